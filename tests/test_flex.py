"""The FlexAttention path of the mask mechanisms (``kernels.flex``), driven on the CPU.

On CUDA, ``local``, ``sparse`` and ``pattern`` run torch's FlexAttention under their mask_mods.
Here the path is let onto the CPU (``flex.DEVICES``), where torch runs flex's forward eagerly, and
each call is compared with the block-sparse engine's answer on the same inputs (the engine is
checked against full attention under the dense mask by each mechanism's own tests). The backward
and the compiled kernels run on CUDA only: ``tests/test_cuda.py``.
"""

import warnings

import pytest
import torch

from subquad.kernels import flex
from subquad.kernels.tuning import tuned
from subquad.mechanisms import pattern as pattern_module
from subquad.mechanisms.local import LocalConfig, local_attention
from subquad.mechanisms.pattern import PatternConfig, pattern_attention, register_pattern
from subquad.mechanisms.sparse import SparseConfig, sparse_attention
from subquad.registry import get_mechanism, make_config

from .conftest import padding, qkv

# (function, config) pairs over the masks' shapes: windows, sinks, strided steps, fixed groups,
# dilation and global tokens.
CASES = {
    "local": (local_attention, LocalConfig(window=9)),
    "local-sinks": (local_attention, LocalConfig(window=5, sinks=3)),
    "local-one": (local_attention, LocalConfig(window=1, sinks=1)),
    "sparse-merged": (sparse_attention, SparseConfig(stride=8)),
    "sparse-local": (sparse_attention, SparseConfig(stride=8, step="local")),
    "sparse-column": (sparse_attention, SparseConfig(stride=8, step="column", sinks=2)),
    "sparse-fixed": (sparse_attention, SparseConfig(pattern="fixed", stride=16, summary=3, groups=2)),
    "sparse-fixed-offset": (
        sparse_attention,
        SparseConfig(pattern="fixed", stride=16, summary=2, groups=3, head_offset=1, sinks=4),
    ),
    "pattern": (pattern_attention, PatternConfig(window=9, dilation=2, global_tokens=3)),
    "pattern-plain": (pattern_attention, PatternConfig(window=4, block=4)),
}


@pytest.fixture
def on_cpu(monkeypatch):
    """Let the flex path run on the CPU; count its calls (a case that falls back counts none)."""
    calls = []
    union = flex.union_attention

    def counted(*args, **kwargs):
        calls.append(args[3])
        return union(*args, **kwargs)

    monkeypatch.setattr(flex, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(flex, "union_attention", counted)
    monkeypatch.setattr(flex, "_MASKS", type(flex._MASKS)())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield calls


def _both(fn, q, k, v, **kwargs):
    """(flex's answer, the engine's answer) for one call."""
    flexed = fn(q, k, v, **kwargs)
    with tuned(flex=0):
        engine = fn(q, k, v, **kwargs)
    return flexed, engine


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("L,S", [(70, 70), (37, 90)])
def test_flex_equals_the_engine(on_cpu, case, is_causal, L, S):
    fn, config = CASES[case]
    q, k, v = qkv(2, 4, L, S, 16, dtype=torch.float32, seed=L + S)
    kpm = padding(2, S, seed=1)
    for mask in (None, kpm):
        flexed, engine = _both(fn, q, k, v, key_padding_mask=mask, is_causal=is_causal, config=config)
        torch.testing.assert_close(flexed, engine, atol=2e-6, rtol=1e-5)
    assert len(on_cpu) == 2


@pytest.mark.parametrize("case", ["local-sinks", "sparse-merged", "sparse-fixed-offset", "pattern"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_grouped_query_heads_equal_the_engine(on_cpu, case, is_causal):
    fn, config = CASES[case]
    q, _, _ = qkv(2, 6, 50, 50, 32, dtype=torch.float32, seed=3)
    _, k, v = qkv(2, 2, 50, 50, 32, dtype=torch.float32, seed=4)
    for mask in (None, padding(2, 50, seed=5)):
        args = dict(is_causal=is_causal, config=config, enable_gqa=True, scale=0.3, key_padding_mask=mask)
        flexed, engine = _both(fn, q, k, v, **args)
        torch.testing.assert_close(flexed, engine, atol=2e-6, rtol=1e-5)
    assert len(on_cpu) == 2


def test_rows_that_see_no_key_are_zero(on_cpu):
    q, k, v = qkv(2, 2, 40, 40, 16, dtype=torch.float32)
    kpm = torch.ones(2, 40, dtype=torch.bool)
    kpm[1] = False  # row 1 has no real key at all
    kpm[0, :20] = False  # row 0's first queries see only padding in their window of 3
    out = local_attention(q, k, v, key_padding_mask=kpm, is_causal=True, config=LocalConfig(window=3))
    assert torch.isfinite(out).all()
    assert out[1].abs().max() == 0 and out[0, :, :20].abs().max() == 0 and out[0, :, 20:].abs().min() > 0
    with tuned(flex=0):
        engine = local_attention(q, k, v, key_padding_mask=kpm, is_causal=True, config=LocalConfig(window=3))
    torch.testing.assert_close(out, engine, atol=2e-6, rtol=1e-5)


def test_a_user_mask_mod_reads_the_batch_row_and_the_layer_head(on_cpu):
    lengths = torch.tensor([10, 30])

    def mask_mod(b, h, q_idx, kv_idx):  # a per-row document boundary, heads offset by one each
        return (kv_idx < lengths[b]) == (q_idx < lengths[b]) & ((q_idx - kv_idx).abs() <= h)

    q, k, v = qkv(2, 3, 45, 45, 16, dtype=torch.float32, seed=5)
    config = PatternConfig(head_offset=2)
    flexed, engine = _both(pattern_attention, q, k, v, config=config, mask_mod=mask_mod, is_causal=True)
    torch.testing.assert_close(flexed, engine, atol=2e-6, rtol=1e-5)
    assert len(on_cpu) == 1 and not flex._MASKS  # a user's function: its mask is not kept


def test_a_user_mask_mod_gets_the_engines_errors(on_cpu):
    q, k, v = qkv(1, 2, 20, 20, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="Python's 'and', 'or', 'not' and 'if' cannot"):
        pattern_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx and kv_idx >= 0)
    with pytest.raises(ValueError, match="must return a bool tensor"):
        pattern_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: q_idx - kv_idx)


def test_block_masks_are_kept_per_shape_and_not_for_padded_calls(on_cpu):
    q, k, v = qkv(1, 2, 64, 64, 16, dtype=torch.float32)
    config = LocalConfig(window=7)
    local_attention(q, k, v, config=config)
    local_attention(q, k, v, config=config)
    assert len(flex._MASKS) == 1
    local_attention(q[:, :, :32], k, v, config=config)  # another length
    local_attention(q, k, v, config=config, is_causal=True)  # another mask
    assert len(flex._MASKS) == 3
    local_attention(q, k, v, config=config, key_padding_mask=padding(1, 64))
    assert len(flex._MASKS) == 3 and len(on_cpu) == 5


def test_a_replaced_pattern_gets_a_new_block_mask(on_cpu, monkeypatch):
    monkeypatch.setattr(pattern_module, "PATTERNS", dict(pattern_module.PATTERNS))  # registrations undone after
    q, k, v = qkv(1, 2, 40, 40, 16, dtype=torch.float32, seed=6)
    register_pattern("subquad-test-flex", lambda c, L, S: lambda b, h, qi, ki: (qi - ki).abs() < 2)
    config = PatternConfig(name="subquad-test-flex")
    first = pattern_attention(q, k, v, config=config)
    register_pattern("subquad-test-flex", lambda c, L, S: lambda b, h, qi, ki: (qi - ki).abs() < 6, replace=True)
    second, engine = _both(pattern_attention, q, k, v, config=config)
    torch.testing.assert_close(second, engine, atol=2e-6, rtol=1e-5)
    assert not torch.allclose(first, second)


@pytest.mark.parametrize(
    "dtype,D,Dv,kernel,reason",
    [
        (torch.float64, 16, 16, "fused", "dtype torch.float64"),
        (torch.float32, 24, 24, "fused", "head dims D=24, Dv=24"),
        (torch.float32, 16, 32, "fused", "head dims D=16, Dv=32"),
        (torch.float32, 16, 16, "eager", None),
        (torch.float32, 16, 16, "native", None),
    ],
)
def test_what_flex_does_not_take_runs_on_the_engine(on_cpu, dtype, D, Dv, kernel, reason):
    q, k, v = qkv(1, 2, 30, 30, D, Dv, dtype=dtype)
    message = flex.unsupported(q, k, v)
    assert message is None if reason is None else message.startswith(reason)
    out = local_attention(q, k, v, config=LocalConfig(window=4, kernel=kernel))
    assert not on_cpu and out.shape == (1, 2, 30, Dv)


def test_the_switch_and_the_device_decide(monkeypatch):
    q, k, v = qkv(1, 2, 30, 30, 16, dtype=torch.float32)
    assert not flex.usable(q, k, v, "fused")  # the CPU: the engine
    monkeypatch.setattr(flex, "DEVICES", ("cuda", "cpu"))
    assert flex.usable(q, k, v, "fused")
    with tuned(flex=0):
        assert not flex.usable(q, k, v, "fused")
    monkeypatch.setattr(flex, "_flex", lambda: None)
    assert flex.unsupported(q, k, v).endswith("has no FlexAttention") and not flex.usable(q, k, v, "fused")


@pytest.mark.parametrize("name", ["local", "sparse", "pattern"])
def test_the_registry_examples_equal_the_engine(on_cpu, name):
    """The contract suite's example configs of the three mechanisms, through the public call."""
    from subquad.call import call

    mech = get_mechanism(name)
    q, k, v = qkv(2, 4, 60, 60, 16, dtype=torch.float32, seed=8)
    for example in mech.examples:
        config = make_config(mech, **example)
        for is_causal in (False, True):
            args = dict(key_padding_mask=padding(2, 60, seed=9), is_causal=is_causal, config=config)
            flexed = call(mech, q, k, v, **args)
            with tuned(flex=0):
                engine = call(mech, q, k, v, **args)
            torch.testing.assert_close(flexed, engine, atol=2e-6, rtol=1e-5)
    assert on_cpu  # some examples reach the flex path (others are exactly full: SDPA)


def test_the_merge_is_the_softmax_over_the_union_with_gradients():
    """Two disjoint key sets' outputs and log-sum-exps join into one softmax; a row that one part
    misses takes the other's alone, a row both miss is zero, and no gradient is NaN."""
    torch.manual_seed(1)
    scores = torch.randn(1, 1, 4, 6, dtype=torch.float64, requires_grad=True)
    values = torch.randn(1, 1, 6, 3, dtype=torch.float64)
    first = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0] * 6], dtype=torch.bool)
    second = torch.tensor([[0, 0, 0, 1, 1, 0], [0] * 6, [0, 0, 0, 1, 1, 1], [0] * 6], dtype=torch.bool)

    def part(mask):
        masked = scores.masked_fill(~mask, float("-inf"))
        lse = masked.logsumexp(-1)
        weights = torch.where(mask, (masked - torch.where(torch.isfinite(lse), lse, 0)[..., None]).exp(), 0)
        return weights @ values, lse

    merged = flex._merge([part(first), part(second)])
    union = first | second
    want = torch.softmax(scores.masked_fill(~union, float("-inf")), -1).nan_to_num() @ values
    torch.testing.assert_close(merged, want.float())
    assert merged[0, 0, 3].abs().max() == 0
    (grad,) = torch.autograd.grad(merged.sum(), scores)
    assert torch.isfinite(grad).all()


def test_regrouping_is_a_permutation_and_its_mask_the_same_pattern():
    x = torch.arange(2 * 3 * 37 * 2, dtype=torch.float32).view(2, 3, 37, 2)
    grouped = flex._regroup(x, 8)
    assert grouped.shape == (2, 3, 40, 2) and torch.equal(flex._ungroup(grouped, 8, 37), x)
    n = 5  # row r·n + a holds position a·8 + r
    assert torch.equal(grouped[0, 0, 3], x[0, 0, 3 * 8]) and torch.equal(grouped[0, 0, 1 * n + 2], x[0, 0, 2 * 8 + 1])
    from subquad.masks import dense_mask
    from subquad.ops.strided_patterns import strided_column_mask

    for L, S in ((37, 37), (20, 37)):
        column = strided_column_mask(8, True, S - L)
        dense = dense_mask(column, 1, 1, L, S)
        regrouped = dense_mask(flex._regrouped(column, 8, L, S), 1, 1, 8 * -(-L // 8), 8 * -(-S // 8))
        rows, cols = (
            flex._regroup(torch.arange(L).view(1, 1, L, 1), 8),
            flex._regroup(torch.arange(S).view(1, 1, S, 1), 8),
        )
        back = torch.zeros_like(dense)
        for i, row in enumerate(rows.flatten().tolist()):  # regrouped (i, j) is position (rows[i], cols[j])
            for j, col in enumerate(cols.flatten().tolist()):
                if regrouped[0, 0, i, j]:
                    back[0, 0, row, col] = True
        assert torch.equal(back, dense)  # a padding row or key let in would mark position 0


def test_the_regrouped_column_step_is_block_sparse(on_cpu):
    """The column step in order meets every 128-block of keys; regrouped by residue, few."""
    from torch.nn.attention.flex_attention import create_block_mask

    from subquad.masks import and_masks, not_mask
    from subquad.ops.strided_patterns import fixed_mask, same_block_mask, strided_column_mask

    N, stride = 4096, 64
    column = strided_column_mask(stride, True, 0)
    in_order = create_block_mask(column, None, None, N, N, device="cpu")
    regrouped = create_block_mask(flex._regrouped(column, stride, N, N), None, None, N, N, device="cpu")
    assert in_order.sparsity() < 51 and regrouped.sparsity() > 96  # percent of blocks skipped
    config = SparseConfig(pattern="fixed", stride=128, summary=8)
    summaries = and_masks(fixed_mask(128, 8, 1, True), not_mask(same_block_mask(128, True, 0)))
    in_order = create_block_mask(summaries, None, None, N, N, device="cpu")
    regrouped = create_block_mask(flex._regrouped(summaries, config.stride, N, N), None, None, N, N, device="cpu")
    assert in_order.sparsity() < 52 and regrouped.sparsity() > 90  # 51.6 and 93.8


def test_strided_sparse_runs_as_two_parts(monkeypatch, on_cpu):
    parts = []
    run = flex._part
    monkeypatch.setattr(flex, "_part", lambda *args: parts.append(args[3]) or run(*args))
    q, k, v = qkv(1, 2, 64, 64, 16, dtype=torch.float32)
    sparse_attention(q, k, v, config=SparseConfig(stride=8), is_causal=True)
    assert [p.stride for p in parts] == [0, 8]
    parts.clear()
    sparse_attention(q, k, v, config=SparseConfig(stride=8, step="column"), is_causal=True)
    assert [p.stride for p in parts] == [8]
    parts.clear()
    sparse_attention(q, k, v, config=SparseConfig(stride=8, step="local"), is_causal=True)
    assert [p.stride for p in parts] == [0]
    parts.clear()
    sparse_attention(q, k, v, config=SparseConfig(pattern="fixed", stride=16, summary=2), is_causal=True)
    assert [p.stride for p in parts] == [0, 16]


def test_kept_masks_are_told_apart_by_the_real_lengths(on_cpu):
    """Regrouped lengths round up to the stride: 57 and 64 keys share a padded size, and so do the
    keys of successive decoding steps; each must still get its own mask."""
    config = SparseConfig(stride=8, step="column")
    for L in (57, 64, 60):
        q, k, v = qkv(1, 2, L, L, 16, dtype=torch.float32, seed=L)
        flexed, engine = _both(sparse_attention, q, k, v, config=config, is_causal=True)
        torch.testing.assert_close(flexed, engine, atol=2e-6, rtol=1e-5)
    config = SparseConfig(stride=8)
    for S in (17, 18, 19, 20, 25):  # one query a step, as a decoder's cache calls it
        q, k, v = qkv(1, 2, 1, S, 16, dtype=torch.float32, seed=S)
        flexed, engine = _both(sparse_attention, q, k, v, config=config, is_causal=True)
        torch.testing.assert_close(flexed, engine, atol=2e-6, rtol=1e-5)
    assert all(key[0][2] > 1 for key in flex._MASKS)  # (part key, stride, L, S): the single-query steps kept none


def test_a_regrouped_row_that_sees_no_key_is_zero(on_cpu):
    q, k, v = qkv(2, 2, 40, 40, 16, dtype=torch.float32, seed=2)
    kpm = torch.ones(2, 40, dtype=torch.bool)
    kpm[1] = False
    for config in (SparseConfig(stride=8), SparseConfig(stride=8, step="column", sinks=2)):
        out, engine = _both(sparse_attention, q, k, v, config=config, key_padding_mask=kpm, is_causal=True)
        assert torch.isfinite(out).all() and out[1].abs().max() == 0
        torch.testing.assert_close(out, engine, atol=2e-6, rtol=1e-5)


def test_a_user_mask_mod_over_one_query_and_one_key(on_cpu):
    document = torch.tensor([0])
    q, k, v = qkv(1, 2, 1, 1, 16, dtype=torch.float32)
    mask_mod = lambda b, h, q_idx, kv_idx: document[q_idx] == document[kv_idx]
    flexed, engine = _both(pattern_attention, q, k, v, mask_mod=mask_mod)
    torch.testing.assert_close(flexed, engine)


@pytest.fixture
def compiled_on_cpu(on_cpu, monkeypatch):
    """The compiled path on the CPU, with torch's eager backend (no C++ compiler needed)."""
    import torch._dynamo

    monkeypatch.setattr(flex, "COMPILED", ("cuda", "cpu"))
    monkeypatch.setattr(flex, "BACKEND", "eager")
    for made in (flex._compiled, flex._compiled_builder):
        made.cache_clear()
    torch._dynamo.reset()
    yield on_cpu
    for made in (flex._compiled, flex._compiled_builder):
        made.cache_clear()
    torch._dynamo.reset()


def test_past_the_recompile_limit_the_engine_runs_and_the_limit_is_put_back(compiled_on_cpu, monkeypatch):
    import torch._dynamo.config

    monkeypatch.setattr(flex, "_RECOMPILES", 2)
    q, k, v = qkv(1, 2, 30, 30, 16, dtype=torch.float32)
    outputs = []
    warned = []
    with torch._dynamo.config.patch(recompile_limit=1):  # the caller's limit, below subquad's 2
        for config in (LocalConfig(window=3), SparseConfig(stride=4, step="local"), PatternConfig(window=5)):
            fn = {"local": local_attention, "sparse": sparse_attention, "pattern": pattern_attention}[config.mechanism]
            for is_causal in (False, True):  # six masks of different code or flags: past a limit of 2
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    flexed, engine = _both(fn, q, k, v, config=config, is_causal=is_causal)
                message = "FlexAttention has compiled 2 masks in this process"
                warned.append(any(message in str(w.message) for w in caught))
                outputs.append((flexed, engine))
        assert torch._dynamo.config.recompile_limit == 1 and not flex._ACTIVE[0]
    assert warned == [False, False, True, True, True, True]  # two compiles under subquad's limit, not the caller's 1
    for flexed, engine in outputs:
        torch.testing.assert_close(flexed, engine, atol=2e-6, rtol=1e-5)


def test_the_raised_limit_is_put_back_after_an_error():
    import torch._dynamo.config

    limit = torch._dynamo.config.recompile_limit
    with pytest.raises(KeyError), flex._recompiles_allowed():
        assert torch._dynamo.config.recompile_limit == max(limit, flex._RECOMPILES)
        with flex._recompiles_allowed():  # a nested call keeps it raised
            pass
        assert torch._dynamo.config.recompile_limit == max(limit, flex._RECOMPILES)
        raise KeyError
    assert torch._dynamo.config.recompile_limit == limit and not flex._ACTIVE[0]


def test_threads_each_get_the_raised_limit_and_put_back_what_they_found():
    """Two overlapping calls in two threads (as nn.DataParallel's replicas run): each runs with the
    raised limit, and each thread's limit afterwards is what it was before, whether torch keeps the
    value per thread or for the process."""
    import threading

    import torch._dynamo.config

    limit = torch._dynamo.config.recompile_limit
    raised = max(limit, flex._RECOMPILES)
    first_in, second_done = threading.Event(), threading.Event()
    seen = {}

    def first():
        with flex._recompiles_allowed():
            seen["first, during"] = torch._dynamo.config.recompile_limit
            first_in.set()
            second_done.wait(10)  # the second call starts and ends inside this one
        seen["first, after"] = torch._dynamo.config.recompile_limit

    def second():
        first_in.wait(10)
        with flex._recompiles_allowed():
            seen["second, during"] = torch._dynamo.config.recompile_limit
        seen["second, after"] = torch._dynamo.config.recompile_limit
        second_done.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen["first, during"] == seen["second, during"] == raised
    assert seen["first, after"] == seen["second, after"] == limit
    assert torch._dynamo.config.recompile_limit == limit and not flex._ACTIVE[0]

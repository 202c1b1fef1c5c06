import dataclasses
import warnings

import pytest
import torch
from torch.autograd import gradcheck

import subquad
from subquad.kernels import native as _native
from subquad.kernels.tuning import TUNING
from subquad.masks import dense_mask
from subquad.mechanisms import sparse
from subquad.mechanisms.full import FullConfig, full_attention
from subquad.mechanisms.pattern import PatternConfig, pattern_attention, register_pattern
from subquad.mechanisms.sparse import (
    SparseConfig,
    fixed_mask,
    sparse_attention,
    sparse_mask_mod,
    strided_column_mask,
    strided_local_mask,
)
from subquad.nn import Attention, CausalLM, HeadGroup

from ..conftest import needs_native, padding, qkv

EAGER = FullConfig(backend="eager")
KERNELS = ["fused", "eager"]

# (pattern, step, groups): both strided steps, merged strided, fixed with nv ∈ {1, 2, 4}.
PATTERN_CASES = [
    ("strided", "local", 1),
    ("strided", "column", 1),
    ("strided", "merged", 1),
    ("fixed", "merged", 1),
    ("fixed", "merged", 2),
    ("fixed", "merged", 4),
]


def oracle(q, k, v, config, is_causal, kpm=None, scale=None):
    """Full attention under the pattern's dense mask (float64, eager)."""
    B, H, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    mask = dense_mask(sparse_mask_mod(config, L, S, is_causal), B, H, L, S)
    return full_attention(q, k, v, key_padding_mask=kpm, attn_mask=mask, scale=scale, config=EAGER)


# --------------------------------------------------------------------------------------------
# The patterns: reference formulas and equality with full attention
# --------------------------------------------------------------------------------------------


def reference(pattern, step, l, c, nv, causal, h, i, j):
    """The index definitions of the authors' code (notes), one pair at a time."""
    past = j <= i
    if pattern == "fixed":
        g = h % nv
        allowed = j // l == i // l or l - (g + 1) * c <= j % l < l - g * c
        return allowed and (past or not causal)
    local = (i - j < l and past) if causal else abs(i - j) < l
    column = (i - j) % l == 0 and (past or not causal)
    return {"local": local, "column": column, "merged": local or column}[step]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("pattern", "step", "groups"), PATTERN_CASES)
def test_patterns_equal_the_reference_formulas_element_by_element(pattern, step, groups, causal):
    l, c, N, H = 8, 2, 43, 5
    config = SparseConfig(pattern=pattern, step=step, stride=l, summary=c, groups=groups)
    mask = dense_mask(sparse_mask_mod(config, N, N, causal), 1, H, N, N)[0]
    expected = torch.tensor(
        [
            [[reference(pattern, step, l, c, groups, causal, h, i, j) for j in range(N)] for i in range(N)]
            for h in range(H)
        ]
    )
    assert torch.equal(mask, expected)


def test_fixed_heads_take_distinct_summary_groups():
    """nv = 4, c = 2, l = 8: head h's summaries are positions 6-7, 4-5, 2-3, 0-1 of each block, and
    head h + nv repeats head h."""
    mask = dense_mask(fixed_mask(8, 2, 4, True), 1, 8, 32, 32)[0]
    for h, first in enumerate([6, 4, 2, 0]):
        assert mask[h, 31, :8].nonzero().flatten().tolist() == [first, first + 1]
        assert torch.equal(mask[h], mask[h + 4])
    assert not torch.equal(mask[0], mask[1])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("pattern", "step", "groups"), PATTERN_CASES)
@pytest.mark.parametrize(("L", "S"), [(45, 45), (64, 64), (19, 45)])
def test_sparse_equals_full_attention_under_its_dense_mask(pattern, step, groups, causal, kernel, L, S):
    """N = 45 is not a multiple of l = 8; L < S places the queries at the last positions."""
    config = SparseConfig(pattern=pattern, step=step, stride=8, summary=2, groups=groups, block=5, kernel=kernel)
    q, k, v = qkv(2, 4, L, S, 6, 5)
    kpm = padding(2, S, seed=L)
    for mask in (None, kpm):
        out = sparse_attention(q, k, v, key_padding_mask=mask, is_causal=causal, config=config)
        assert (out - oracle(q, k, v, config, causal, mask)).abs().max() <= 1e-10


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("pattern", "step", "groups"), [("strided", "merged", 1), ("strided", "column", 1),
                                                         ("fixed", "merged", 2)])  # fmt: skip
@pytest.mark.parametrize("sinks", [1, 3, 60])
def test_sinks_add_the_first_keys_to_every_query_s_pattern(pattern, step, groups, causal, sinks):
    L = S = 45
    config = SparseConfig(pattern=pattern, step=step, stride=8, summary=2, groups=groups, block=5, sinks=sinks)
    mask = dense_mask(sparse_mask_mod(config, L, S, causal), 1, 4, L, S)[0]
    for h, i, j in [(h, i, j) for h in range(4) for i in range(L) for j in range(S)][::7]:
        expected = reference(pattern, step, 8, 2, groups, causal, h, i, j) or (j < sinks and (j <= i or not causal))
        assert bool(mask[h, i, j]) == expected, (h, i, j)
    q, k, v = qkv(2, 4, L, S, 6, 5)
    kpm = padding(2, S, seed=sinks)
    out = sparse_attention(q, k, v, key_padding_mask=kpm, is_causal=causal, config=config)
    assert (out - oracle(q, k, v, config, causal, kpm)).abs().max() <= 1e-10


@pytest.mark.parametrize("causal", [True, False])
def test_scale_and_the_default_options(causal):
    q, k, v = qkv(1, 2, 300, 300, 8)
    for config in (SparseConfig(), SparseConfig(pattern="fixed")):  # l = 128, N not a multiple
        out = sparse_attention(q, k, v, is_causal=causal, scale=0.3, config=config)
        assert (out - oracle(q, k, v, config, causal, scale=0.3)).abs().max() <= 1e-10


@pytest.mark.parametrize("kernel", KERNELS)
def test_head_offset_gives_each_head_group_its_layer_head_index(kernel):
    """Calling heads 1..3 with head_offset=1 equals heads 1..3 of the call on all heads."""
    q, k, v = qkv(1, 4, 40, 40, 4)
    config = SparseConfig(pattern="fixed", stride=8, summary=2, groups=4, kernel=kernel)
    whole = sparse_attention(q, k, v, is_causal=True, config=config)
    split = SparseConfig(pattern="fixed", stride=8, summary=2, groups=4, head_offset=1, kernel=kernel)
    part = sparse_attention(q[:, 1:], k[:, 1:], v[:, 1:], is_causal=True, config=split)
    assert (part - whole[:, 1:]).abs().max() <= 1e-12
    unshifted = sparse_attention(q[:, 1:], k[:, 1:], v[:, 1:], is_causal=True, config=config)
    assert (unshifted - whole[:, 1:]).abs().max() > 1e-3, "without the offset the heads take other groups"


def test_a_layer_split_into_head_groups_equals_one_group():
    """The paper's third combination: heads split among patterns, each group told its first head."""
    torch.manual_seed(0)
    fixed = dict(pattern="fixed", stride=8, summary=2, groups=4)
    one = Attention(32, 4, HeadGroup("sparse", 4, **fixed)).double()
    split = Attention(32, 4, (HeadGroup("sparse", 2, **fixed), HeadGroup("sparse", 2, head_offset=2, **fixed))).double()
    split.load_state_dict(one.state_dict())
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    assert (split(x, is_causal=True) - one(x, is_causal=True)).abs().max() <= 1e-12
    mixed = Attention(
        32, 4, (HeadGroup("sparse", 2, step="local", stride=8), HeadGroup("sparse", 2, step="column", stride=8))
    ).double()
    mixed.load_state_dict(one.state_dict())
    assert torch.isfinite(mixed(x, is_causal=True)).all()


# --------------------------------------------------------------------------------------------
# Causality, block layout, gradients, precision
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("pattern", "step", "groups"), PATTERN_CASES)
@pytest.mark.parametrize(("L", "S"), [(37, 37), (20, 37)])
def test_causality_editing_the_future_leaves_the_past_unchanged(pattern, step, groups, L, S):
    config = SparseConfig(pattern=pattern, step=step, stride=8, summary=2, groups=groups, block=4)
    q, k, v = qkv(1, 4, L, S, 4)
    out = sparse_attention(q, k, v, is_causal=True, config=config)
    for t in (0, 9, L - 3):
        p = t + S - L  # query t sits at key position p
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[:, :, t + 1 :] = torch.randn_like(q2[:, :, t + 1 :])
        k2[:, :, p + 1 :] = 4.0
        v2[:, :, p + 1 :] = -7.0
        edited = sparse_attention(q2, k2, v2, is_causal=True, config=config)
        assert (edited[:, :, : t + 1] - out[:, :, : t + 1]).abs().max() <= 1e-7
        assert (edited[:, :, t + 1 :] - out[:, :, t + 1 :]).abs().max() > 1e-3


@pytest.mark.parametrize(("pattern", "step"), [("strided", "local"), ("strided", "merged"), ("fixed", "merged")])
def test_causal_layouts_compute_no_key_after_the_query_block_and_little_waste(pattern, step):
    """The upper triangle is never computed: every listed key lies at or before the last position of
    its query block (the element mask, or the kernel's causal flag, handles the diagonal block). The
    scores computed are within 1.5× of the pairs the pattern allows."""
    L = S = 2000
    config = SparseConfig(pattern=pattern, step=step, stride=16, summary=4, groups=2, block=8)
    shape = _blocksparse_shape(L, S)
    computed = 0
    for part in sparse._sparse_parts(config, shape, True, torch.device("cpu")):
        for group in part:
            last = group.queries.masked_fill(group.queries == L, -1).amax(-1)  # (n,)
            keys = group.keys
            outside = (keys < 0) | (keys >= S)  # window slots past either end: masked, not computed keys
            assert bool(((keys <= last[None, :, None]) | outside).all())
            # per head; a square block under the kernel's causal flag computes its lower triangle
            width = keys.shape[-1]
            computed += group.queries.numel() * ((width + 1) / 2 if group.facts.causal else width)
    allowed = dense_mask(sparse_mask_mod(config, L, S, True), 1, 2, L, S).sum().item() / 2
    assert computed <= 1.5 * allowed


def _blocksparse_shape(L, S, H=2):
    from subquad._validate import AttentionShape

    return AttentionShape(1, H, L, S, 4, 4, 0.5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("pattern", "step", "groups"), [("strided", "merged", 1), ("fixed", "merged", 2)])
def test_gradcheck(pattern, step, groups, causal, kernel):
    config = SparseConfig(pattern=pattern, step=step, stride=4, summary=1, groups=groups, block=3, kernel=kernel)
    q, k, v = (x.requires_grad_(True) for x in qkv(1, 2, 11, 11, 2))
    kpm = padding(1, 11, seed=2)
    fn = lambda q, k, v: sparse_attention(q, k, v, key_padding_mask=kpm, is_causal=causal, scale=0.8, config=config)
    assert gradcheck(fn, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("pattern", ["strided", "fixed"])
@pytest.mark.parametrize("tile", [1, None])
def test_gradients_equal_full_attentions_under_the_dense_mask(kernel, causal, pattern, tile, monkeypatch):
    """With the default tiles, and with one block per chunk in both passes (a tiny tile budget)."""
    if tile is not None:
        for name in ("tile", "fused_tile", "backward_tile", "view_tile"):
            monkeypatch.setattr(TUNING, f"blocksparse_{name}", tile)
    config = SparseConfig(pattern=pattern, stride=8, summary=2, groups=2, block=4, kernel=kernel)
    inputs = [x.requires_grad_(True) for x in qkv(2, 2, 30, 30, 4)]
    kpm = padding(2, 30, seed=4)
    grad = torch.randn(2, 2, 30, 4, dtype=torch.float64)
    out = sparse_attention(*inputs, key_padding_mask=kpm, is_causal=causal, config=config)
    ours = torch.autograd.grad(out, inputs, grad)
    ref = oracle(*inputs, config, causal, kpm)
    theirs = torch.autograd.grad(ref, inputs, grad)
    assert (out - ref).abs().max() <= 1e-12
    assert all((a - b).abs().max() <= 1e-10 for a, b in zip(ours, theirs))


@pytest.fixture
def accelerator_summary_runs(monkeypatch):
    """The fixed pattern's summary runs as off the CPU (sized by their scores), on the CPU; the
    cached layouts are dropped before and after."""
    spans = sparse._summary_spans
    monkeypatch.setattr(sparse, "_summary_spans", lambda *args: spans(*args[:-1], "meta"))
    sparse._sparse_parts.cache_clear()
    yield monkeypatch
    sparse._sparse_parts.cache_clear()


def test_fixed_summary_runs_off_the_cpu_hold_one_tile_of_scores(monkeypatch):
    config = SparseConfig(pattern="fixed", stride=8, summary=2)
    shape = subquad._validate.AttentionShape(2, 2, 30, 30, 4, 4, 0.5)  # 4 blocks of 8; B·H·l = 32
    monkeypatch.setattr(TUNING, "sparse_summary_scores", 16)  # 16 · 32 (the accelerator scale) / 32 = 16 blocks·keys
    runs = sparse._summary_spans  # blocks · keys of the last block (2 per earlier block) <= 16
    assert runs([0, 1, 2, 3], config, shape, True, "meta") == [(0, 2), (3, 3)]
    assert runs([0, 1, 2, 3], config, shape, False, "meta") == [(0, 1), (2, 3)]  # 8 keys each
    assert runs([0, 1, 2, 3], config, shape, True, "cpu") == [(0, 3)]  # 1024 queries per run


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("budget", [1, 16, 1 << 10])
def test_fixed_with_summary_runs_sized_as_off_the_cpu_equals_full_attention(causal, budget, accelerator_summary_runs):
    """One query block per run, a few, and all of them: outputs and gradients equal the oracle's."""
    accelerator_summary_runs.setattr(TUNING, "sparse_summary_scores", budget)
    config = SparseConfig(pattern="fixed", stride=8, summary=2, groups=2, block=4)
    inputs = [x.requires_grad_(True) for x in qkv(2, 2, 30, 30, 4)]
    kpm = padding(2, 30, seed=4)
    grad = torch.randn(2, 2, 30, 4, dtype=torch.float64)
    out = sparse_attention(*inputs, key_padding_mask=kpm, is_causal=causal, config=config)
    ref = oracle(*inputs, config, causal, kpm)
    assert (out - ref).abs().max() <= 1e-12
    ours, theirs = torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)
    assert all((a - b).abs().max() <= 1e-10 for a, b in zip(ours, theirs))


@pytest.mark.parametrize("kernel", KERNELS)
def test_queries_without_keys_return_zeros_and_finite_gradients(kernel):
    q, k, v = (x.requires_grad_(True) for x in qkv(2, 2, 20, 20, 4))
    kpm = torch.ones(2, 20, dtype=torch.bool)
    kpm[0] = False  # no real key at all
    kpm[1, :10] = False  # causal: queries 0-9 see only padded keys
    config = SparseConfig(stride=4, block=3, kernel=kernel)
    out = sparse_attention(q, k, v, key_padding_mask=kpm, is_causal=True, config=config)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all() and (out[1, :, :10] == 0).all() and (out[1, :, 10:] != 0).all()
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    assert (q.grad[0] == 0).all() and (k.grad[1, :, :10] == 0).all()


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("pattern", ["strided", "fixed"])
def test_low_precision_with_fp32_statistics(pattern, kernel, dtype, tol):
    config = SparseConfig(pattern=pattern, stride=16, summary=4, kernel=kernel)
    q, k, v = qkv(1, 2, 200, 200, 16)
    exact = sparse_attention(q, k, v, is_causal=True, config=config)
    inputs = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
    low = sparse_attention(*inputs, is_causal=True, config=config)
    assert low.dtype == dtype
    assert (low.double() - exact).abs().max() <= tol * exact.abs().max()
    low.float().square().sum().backward()
    assert all(x.grad.dtype == dtype and torch.isfinite(x.grad).all() for x in inputs)


def test_fused_and_eager_kernels_agree_in_float32_with_gradients():
    q, k, v = (x.float().requires_grad_(True) for x in qkv(2, 3, 150, 150, 16))
    kpm = padding(2, 150, seed=7)
    results = []
    for kernel in KERNELS:
        out = sparse_attention(
            q, k, v, key_padding_mask=kpm, is_causal=True, config=SparseConfig(stride=16, kernel=kernel)
        )
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    assert all((a - b).abs().max() <= 1e-4 for a, b in zip(*results))


# --------------------------------------------------------------------------------------------
# The pattern mechanism: any mask_mod
# --------------------------------------------------------------------------------------------


def window_with_globals(b, h, q_idx, kv_idx):
    return ((q_idx - kv_idx).abs() < 4) | (kv_idx < 2) | (q_idx < 2)


def dilated(b, h, q_idx, kv_idx):
    distance = q_idx - kv_idx
    return (distance.abs() < 12) & (distance.remainder(3) == 0)


def per_head_and_batch(b, h, q_idx, kv_idx):
    """Head h looks back h + 1 positions; batch 1 also sees key 0."""
    return ((q_idx - kv_idx).abs() <= h + 1) | ((b == 1) & (kv_idx == 0))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mask_mod", [window_with_globals, dilated, per_head_and_batch])
@pytest.mark.parametrize(("L", "S"), [(41, 41), (23, 41)])
def test_pattern_with_a_user_mask_mod_equals_full_attention_with_gradients(mask_mod, causal, kernel, L, S):
    inputs = [x.requires_grad_(True) for x in qkv(2, 3, L, S, 4)]
    kpm = padding(2, S, seed=1)
    config = PatternConfig(block=8, kernel=kernel)
    out = subquad.attention(
        *inputs,
        subquad.causal_lower_right(L, S) if causal else None,
        mechanism="pattern",
        key_padding_mask=kpm,
        config=config,
        mask_mod=mask_mod,
    )
    mask = dense_mask(mask_mod, 2, 3, L, S)
    ref = full_attention(*inputs, key_padding_mask=kpm, is_causal=causal, attn_mask=mask, config=EAGER)
    assert (out - ref).abs().max() <= 1e-10
    grad = torch.randn_like(out)
    ours, theirs = torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)
    assert all((a - b).abs().max() <= 1e-10 for a, b in zip(ours, theirs))


def test_pattern_gradcheck():
    q, k, v = (x.requires_grad_(True) for x in qkv(1, 2, 11, 11, 2))
    fn = lambda q, k, v: pattern_attention(q, k, v, is_causal=True, config=PatternConfig(block=3), mask_mod=dilated)
    assert gradcheck(fn, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("causal", [True, False])
def test_named_window_pattern_with_dilation_and_global_tokens(causal):
    config = PatternConfig(window=9, dilation=2, global_tokens=3, block=8)
    q, k, v = qkv(2, 2, 50, 50, 4)
    out = pattern_attention(q, k, v, is_causal=causal, config=config)
    i, j = torch.arange(50)[:, None], torch.arange(50)[None, :]
    expected = (((i - j).abs() < 9) & ((i - j) % 2 == 0)) | (i < 3) | (j < 3)
    ref = full_attention(q, k, v, is_causal=causal, attn_mask=expected, config=EAGER)
    assert (out - ref).abs().max() <= 1e-10


def test_pattern_from_the_sparse_mask_mod_equals_sparse():
    """The layout found by evaluating the mask_mod gives what the analytic sparse layout gives."""
    config = SparseConfig(pattern="fixed", stride=8, summary=2, groups=2)
    q, k, v = qkv(1, 4, 60, 60, 4)
    mod = sparse_mask_mod(config, 60, 60, True)
    out = pattern_attention(q, k, v, config=PatternConfig(block=8), mask_mod=mod)
    assert (out - sparse_attention(q, k, v, is_causal=True, config=config)).abs().max() <= 1e-12


def test_a_named_layout_is_built_once_and_follows_a_replaced_registration():
    built = []

    def band(width):
        def factory(config, L, S):
            built.append(width)
            return lambda b, h, i, j: (i - j).abs() <= width

        return factory

    q, k, v = qkv(1, 2, 40, 40, 4)
    i, j = torch.arange(40)[:, None], torch.arange(40)[None, :]
    register_pattern("test-once", band(2), replace=True)
    for _ in range(3):
        out = subquad.attention(q, k, v, mechanism="pattern", name="test-once", block=8)
        assert (out - full_attention(q, k, v, attn_mask=(i - j).abs() <= 2)).abs().max() <= 1e-12
    assert built == [2]  # one layout for three calls
    register_pattern("test-once", band(5), replace=True)
    out = subquad.attention(q, k, v, mechanism="pattern", name="test-once", block=8)
    assert (out - full_attention(q, k, v, attn_mask=(i - j).abs() <= 5)).abs().max() <= 1e-12
    assert built == [2, 5]


def test_registered_pattern_reaches_layers_by_name():
    register_pattern("test-band", lambda config, L, S: lambda b, h, i, j: (i - j).abs() <= config.window, replace=True)
    torch.manual_seed(0)
    layer = Attention(16, 2, HeadGroup("pattern", name="test-band", window=3)).double()
    x = torch.randn(1, 20, 16, dtype=torch.float64)
    out = layer(x)
    full_layer = Attention(16, 2, "full").double()
    full_layer.load_state_dict(layer.state_dict())
    i, j = torch.arange(20)[:, None], torch.arange(20)[None, :]
    qh, kh, vh = (full_layer._split_heads(p(x)) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    ref = full_attention(qh, kh, vh, attn_mask=(i - j).abs() <= 3)
    expected = layer.out_proj(ref.transpose(1, 2).reshape(1, 20, 16))
    assert (out - expected).abs().max() <= 1e-12


# --------------------------------------------------------------------------------------------
# A tiny language model interleaving strided and fixed layers (the paper's first combination)
# --------------------------------------------------------------------------------------------


def test_causal_lm_interleaving_strided_and_fixed_layers_overfits_a_small_batch():
    torch.manual_seed(0)
    strided = HeadGroup("sparse", pattern="strided", stride=4)
    fixed = HeadGroup("sparse", pattern="fixed", stride=4, summary=1, groups=2)
    model = CausalLM(24, 32, 2, 2, attention=[strided, fixed], max_len=40)
    tokens = torch.randint(0, 24, (4, 33), generator=torch.Generator().manual_seed(0))
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = model.loss(tokens).item()
    for _ in range(80):
        loss = model.loss(tokens)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    assert first > 3.0 and loss.item() < 0.2


def test_generate_gives_the_same_tokens_with_and_without_the_kv_cache():
    torch.manual_seed(0)
    attention = [HeadGroup("sparse", stride=4), HeadGroup("sparse", pattern="fixed", stride=4, summary=1, groups=2)]
    model = CausalLM(20, 16, 2, 2, attention=attention, max_len=40).eval()
    prompt = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(3))
    assert torch.equal(model.generate(prompt, 20), model.generate(prompt, 20, use_cache=False))


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pattern": "dense"}, "sparse option pattern must be one of 'strided', 'fixed', got 'dense'"),
        ({"step": "row"}, "sparse option step must be one of 'local', 'column', 'merged', got 'row'"),
        ({"stride": 0}, "sparse option stride must be >= 1, got 0"),
        ({"summary": 0}, "sparse option summary must be >= 1, got 0"),
        ({"groups": 0}, "sparse option groups must be >= 1, got 0"),
        ({"head_offset": -1}, "sparse option head_offset must be >= 0, got -1"),
        ({"block": -1}, "sparse option block must be >= 0, got -1"),
        ({"kernel": "triton"}, "sparse option kernel must be one of 'fused', 'eager', 'native', got 'triton'"),
        (
            {"pattern": "fixed", "stride": 8, "summary": 3, "groups": 3},
            "sparse fixed needs summary·groups <= stride (nv groups of c summary positions fit in a block of l), "
            "got summary=3, groups=3, stride=8; lower summary or groups, or raise stride",
        ),
    ],
)
def test_bad_sparse_options_raise(options, message):
    with pytest.raises(ValueError) as err:
        subquad.attention(*qkv(), mechanism="sparse", **options)
    assert message in str(err.value)


def test_more_queries_than_keys_raises():
    with pytest.raises(ValueError) as err:
        subquad.attention(*qkv(L=9, S=5), mechanism="sparse")
    assert "sparse places query i at key position i + S - L, so it needs L <= S, got L=9 and S=5" in str(err.value)
    assert "use the pattern mechanism with a mask_mod" in str(err.value)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: PatternConfig(name="nope"),
            "pattern option name must be a registered pattern, got 'nope'; registered: window",
        ),
        (lambda: PatternConfig(window=0), "pattern option window must be >= 1, got 0"),
        (lambda: PatternConfig(dilation=0), "pattern option dilation must be >= 1, got 0"),
        (lambda: PatternConfig(global_tokens=-1), "pattern option global_tokens must be >= 0, got -1"),
        (
            lambda: pattern_attention(*qkv(), mask_mod=3),
            "mask_mod must be a function mask_mod(b, h, q_idx, kv_idx) -> bool tensor, got int",
        ),
        (
            lambda: pattern_attention(*qkv(), mask_mod=lambda b, h, i, j: (i - j).float()),
            "mask_mod must return a bool tensor (True = may attend) from broadcastable index tensors, got "
            "torch.float32; combine conditions with & and |, not 'and'/'or'",
        ),
        (
            lambda: pattern_attention(*qkv(), mask_mod=lambda b, h, i, j: (i >= j) and (i - j < 4)),
            "mask_mod is called with index tensors, so Python's 'and', 'or', 'not' and 'if' cannot combine its "
            "conditions; use & | ~ and torch.where, e.g. (q_idx >= kv_idx) & (q_idx - kv_idx < w)",
        ),
        (lambda: register_pattern("", window_with_globals), "a pattern name must be a non-empty string, got ''"),
        (lambda: register_pattern("x", 3), "register_pattern needs a factory (config, L, S) -> mask_mod, got int"),
        (
            lambda: register_pattern("window", lambda c, L, S: window_with_globals),
            "a pattern named 'window' exists; pass replace=True to override it",
        ),
    ],
)
def test_bad_pattern_inputs_raise(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert message in str(err.value)


def test_strided_masks_are_the_two_steps_of_merged():
    local, column = strided_local_mask(8, True), strided_column_mask(8, True)
    merged = sparse_mask_mod(SparseConfig(stride=8), 30, 30, True)
    i, j, z = torch.arange(30)[:, None], torch.arange(30)[None, :], torch.zeros((), dtype=torch.long)
    assert torch.equal(merged(z, z, i, j), local(z, z, i, j) | column(z, z, i, j))
    assert torch.equal(local(z, z, i, j) & column(z, z, i, j), torch.eye(30, dtype=torch.bool))


# --------------------------------------------------------------------------------------------
# The opt-in native kernel (fp32): the same patterns, through subquad.kernels.native
# --------------------------------------------------------------------------------------------


@needs_native
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("pattern", "step", "groups"), PATTERN_CASES)
@pytest.mark.parametrize(("L", "S", "stride"), [(45, 45, 8), (64, 64, 8), (19, 45, 8), (300, 300, 16)])
def test_native_kernel_equals_full_attention_under_the_dense_mask(pattern, step, groups, causal, L, S, stride,
                                                                  native_calls):  # fmt: skip
    """fp32 against the float64 oracle, with and without padding; N = 300 is not a multiple of l = 16
    and its blocks fill the kernel's 32-query blocks; its gradients (the fused backward) too."""
    config = SparseConfig(pattern=pattern, step=step, stride=stride, summary=2, groups=groups, block=5, kernel="native")
    exact = [x.requires_grad_(True) for x in qkv(2, 4, L, S, 16)]
    inputs = [x.detach().float().requires_grad_(True) for x in exact]
    for kpm in (None, padding(2, S, seed=L)):
        out = sparse_attention(*inputs, key_padding_mask=kpm, is_causal=causal, config=config)
        ref = oracle(*exact, config, causal, kpm)
        assert (out.double() - ref).abs().max() <= 2e-6
        grad = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        ours, theirs = torch.autograd.grad(out, inputs, grad.float()), torch.autograd.grad(ref, exact, grad)
        assert all((a.double() - b).abs().max() <= 2e-5 for a, b in zip(ours, theirs))
    assert native_calls


@needs_native
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mask_mod", [window_with_globals, dilated, per_head_and_batch])
def test_native_kernel_runs_user_mask_mods_exactly(mask_mod, causal, native_calls):
    exact = qkv(2, 3, 70, 70, 8)
    kpm = padding(2, 70, seed=3)
    out = subquad.attention(
        *(x.float() for x in exact), mechanism="pattern", key_padding_mask=kpm, is_causal=causal,
        config=PatternConfig(block=16, kernel="native"), mask_mod=mask_mod,
    )  # fmt: skip
    mask = dense_mask(mask_mod, 2, 3, 70, 70)
    ref = full_attention(*exact, key_padding_mask=kpm, is_causal=causal, attn_mask=mask, config=EAGER)
    assert (out.double() - ref).abs().max() <= 2e-6
    assert native_calls


@needs_native
def test_native_kernel_at_the_benchmark_geometry_equals_the_fused_kernel(native_calls):
    """l = 128 with 32-query blocks, causal columns as whole segments, N = 2048: the layout the
    benchmark times, against torch's kernel."""
    q, k, v = (x.float() for x in qkv(1, 2, 2048, 2048, 64))
    for causal in (True, False):
        native = sparse_attention(q, k, v, is_causal=causal, config=SparseConfig(kernel="native"))
        fused = sparse_attention(q, k, v, is_causal=causal, config=SparseConfig(kernel="fused"))
        assert (native - fused).abs().max() <= 2e-6
    # per call, the inner local blocks are written in place and the columns merged in place
    # (the few end blocks, read from a padded copy, are not)
    assert sum(native_calls) >= 4


@needs_native
@pytest.mark.parametrize("causal", [True, False])
def test_native_kernel_with_dv_unlike_d_leaves_long_blocks_to_eager(causal, native_calls):
    """Fixed's summary run here is one block of 304 queries: too long for the native kernel, and
    torch's kernel takes no Dv ≠ D, so it runs eager; the own blocks run native."""
    config = SparseConfig(pattern="fixed", stride=16, summary=2, groups=2, kernel="native")
    exact = qkv(1, 4, 300, 300, 16, 8)
    out = sparse_attention(*(x.float() for x in exact), is_causal=causal, config=config)
    assert (out.double() - oracle(*exact, config, causal)).abs().max() <= 2e-6
    assert native_calls


def test_native_kernel_falls_back_to_fused_and_says_why(monkeypatch):
    """Columns of 38 rows, blocks of 5: whole causal segments where native runs, row blocks here;
    the fallback takes the fused kernel's own layout, so its result is the fused one, bit for bit."""
    monkeypatch.setattr(_native, "_state", {"reason": "a reason for this test"})
    q, k, v = (x.float() for x in qkv(1, 2, 300, 300, 8))
    said = "kernel='native' falls back to the PyTorch kernels: a reason for this test"
    config = SparseConfig(stride=8, block=5, kernel="native")
    with pytest.warns(RuntimeWarning, match=said):
        out = sparse_attention(q, k, v, is_causal=True, config=config)
    fused = sparse_attention(q, k, v, is_causal=True, config=dataclasses.replace(config, kernel="fused"))
    assert torch.equal(out, fused)
    with warnings.catch_warnings():  # once per reason
        warnings.simplefilter("error", RuntimeWarning)
        sparse_attention(q, k, v, is_causal=True, config=config)


@pytest.mark.parametrize(
    ("L", "S", "native", "whole"),
    [(300, 300, True, True), (300, 300, False, False), (290, 300, True, False), (2100, 2100, True, False)],
)
def test_causal_columns_are_whole_segments_only_where_the_native_kernel_runs_them(L, S, native, whole):
    """Whole segments need the native kernel, L = S (square triangular views) and at most 128 rows
    (2100 / 16 gives 132); otherwise row blocks, which see only the rows up to their own."""
    config = SparseConfig(stride=8 if S == 300 else 16, block=5, kernel="native")
    shape = subquad._validate.AttentionShape(1, 2, L, S, 8, 8, 1.0)
    columns = sparse._sparse_parts(config, shape, True, torch.device("cpu"), native)[1]
    rows = -(-S // config.stride)
    assert {g.queries.shape[1] for g in columns} == ({rows} if whole else {5})
    assert all(g.facts.triangular for g in columns) == whole


@needs_native
def test_native_kernel_skips_keys_in_triangular_blocks_that_need_a_mask(monkeypatch):
    """With padding the whole causal columns need their element mask; the causal flag goes with it,
    so the kernel still skips the keys past each query block."""
    seen = []
    run = _native.block_attention
    monkeypatch.setattr(
        _native, "block_attention", lambda *a, **kw: seen.append((a[3] is not None, a[4])) or run(*a, **kw)
    )
    exact = qkv(1, 2, 300, 300, 8)
    kpm = padding(1, 300, seed=2)
    config = SparseConfig(stride=8, kernel="native")
    out = sparse_attention(*(x.float() for x in exact), key_padding_mask=kpm, is_causal=True, config=config)
    assert (True, True) in seen
    assert (out.double() - oracle(*exact, config, True, kpm)).abs().max() <= 2e-6


def test_native_kernel_on_float64_falls_back_and_stays_exact(monkeypatch):
    monkeypatch.setitem(_native._state, "warned", set())  # once per process: earlier tests may have warned
    q, k, v = qkv(1, 2, 40, 40, 8)
    config = SparseConfig(stride=8, kernel="native")
    with pytest.warns(RuntimeWarning, match="it computes in float32, the inputs are torch.float64"):
        out = sparse_attention(q, k, v, is_causal=True, config=config)
    assert (out - oracle(q, k, v, config, True)).abs().max() <= 1e-10


def test_block_0_runs_32_in_the_forward_and_recomputes_the_band_transposed_in_the_backward(monkeypatch):
    # The automatic block: narrower blocks compute fewer keys per query in the forward; the backward
    # recomputes the local step transposed (blocks of local_backward_block keys, whose gradients
    # come whole) and the columns in 64-query blocks; all give the same attention.
    seen = []
    real = sparse._sparse_parts.__wrapped__

    def record(config, shape, causal, device, native=False, transposed_band=None):
        seen.append((config.block, transposed_band))
        return real(config, shape, causal, device, native, transposed_band)

    monkeypatch.setattr(sparse, "_sparse_parts", record)
    q, k, v = (torch.randn(1, 2, 200, 8, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        out = sparse_attention(q, k, v, is_causal=True, config=SparseConfig(stride=16))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    grad_out = sparse_attention(*leaves, is_causal=True, config=SparseConfig(stride=16))
    explicit_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    explicit = sparse_attention(*explicit_leaves, is_causal=True, config=SparseConfig(stride=16, block=5))
    assert seen == [(32, None), (32, None), (64, TUNING.local_backward_block), (5, None)]
    assert torch.equal(grad_out.detach(), out)  # the same blocks in the forward, gradients or not
    torch.testing.assert_close(explicit.detach(), out, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    got, want = torch.autograd.grad(grad_out, leaves, g), torch.autograd.grad(explicit, explicit_leaves, g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(
    "name, options", [("sparse", {"stride": 16}), ("sparse", {"pattern": "fixed", "stride": 16}), ("pattern", {})]
)
def test_masks_kept_with_a_cached_layout_change_no_result(name, options, is_causal):
    """The cached layouts keep the masks their chunks derive (``Group.memo``) for calls without key
    padding: a repeated call returns the same, a padded call between them the same as with no
    layout cached, and a call with another batch size (other chunks) the same as its own rows.
    (Up to rounding: the thread count a call runs on follows the machine's load.)"""
    from subquad.mechanisms import pattern

    def clear():
        sparse._sparse_parts.cache_clear()
        pattern._named_pattern_groups.cache_clear()

    clear()
    q, k, v = qkv(2, 2, 200, 200, 8, seed=4)
    kpm = padding(2, 200, seed=5)
    run = lambda *xs, **kw: subquad.attention(*xs, mechanism=name, is_causal=is_causal, **options, **kw)
    first = run(q, k, v)
    padded = run(q, k, v, key_padding_mask=kpm)
    assert (run(q, k, v) - first).abs().max() <= 1e-12
    assert (run(q[:1], k[:1], v[:1]) - first[:1]).abs().max() <= 1e-12
    clear()
    assert (run(q, k, v, key_padding_mask=kpm) - padded).abs().max() <= 1e-12
    clear()

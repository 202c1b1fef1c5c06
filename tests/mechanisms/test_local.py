import contextlib
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

import subquad
import subquad.nn
from subquad.kernels import band
from subquad.kernels.tuning import TUNING
from subquad.mechanisms.full import full_attention
from subquad.mechanisms.local import LocalConfig, WindowCache, local_attention
from subquad.registry import get_mechanism

from ..conftest import needs_native, padding, qkv, randn


def band_mask(L, S, window, is_causal):
    """The dense (L, S) mask of the window, queries aligned to the last keys."""
    i = torch.arange(L)[:, None] + (S - L)
    j = torch.arange(S)[None, :]
    return ((j <= i) & (j > i - window)) if is_causal else ((j - i).abs() < window)


def dense_local(q, k, v, kpm, is_causal, window):
    return full_attention(q, k, v, key_padding_mask=kpm, attn_mask=band_mask(q.shape[2], k.shape[2], window, is_causal))


@settings(max_examples=50, deadline=None)
@given(
    B=st.integers(1, 2), H=st.integers(1, 3), L=st.integers(1, 150), S=st.integers(1, 150),
    window=st.sampled_from([1, 2, 5, 31, 64, 200]), is_causal=st.booleans(), pad=st.booleans(),
    Dv=st.sampled_from([5, 8]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_local_equals_full_under_the_dense_band_mask(B, H, L, S, window, is_causal, pad, Dv, seed):
    """Dv = 8 runs the CPU flash kernel, Dv = 5 the reference path."""
    q, k, v = qkv(B, H, L, S, 8, Dv, seed=seed)
    kpm = padding(B, S, seed) if pad else None
    out = local_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=LocalConfig(window=window))
    assert (out - dense_local(q, k, v, kpm, is_causal, window)).abs().max() <= 1e-10


def sink_mask(L, S, sinks, is_causal):
    """The first ``sinks`` keys for every query (causal: those up to its position)."""
    i = torch.arange(L)[:, None] + (S - L)
    j = torch.arange(S)[None, :]
    return (j < sinks) & (j <= i) if is_causal else (j < sinks).expand(L, S)


@settings(max_examples=40, deadline=None)
@given(
    L=st.integers(1, 130), S=st.integers(1, 130), window=st.sampled_from([1, 3, 17, 64]),
    sinks=st.sampled_from([1, 2, 4, 40]), is_causal=st.booleans(), pad=st.booleans(), Dv=st.sampled_from([5, 8]),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_sinks_equal_full_under_the_dense_band_and_sink_mask(L, S, window, sinks, is_causal, pad, Dv, seed):
    q, k, v = qkv(2, 2, L, S, 8, Dv, seed=seed)
    kpm = padding(2, S, seed) if pad else None
    config = LocalConfig(window=window, sinks=sinks)
    out = local_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=config)
    mask = band_mask(L, S, window, is_causal) | sink_mask(L, S, sinks, is_causal)
    assert (out - full_attention(q, k, v, key_padding_mask=kpm, attn_mask=mask)).abs().max() <= 1e-10


def test_sinks_change_only_the_queries_whose_window_leaves_them_out():
    q, k, v = qkv(1, 2, 60, 60, 8)
    plain = local_attention(q, k, v, is_causal=True, config=LocalConfig(window=10))
    sunk = local_attention(q, k, v, is_causal=True, config=LocalConfig(window=10, sinks=2))
    assert torch.equal(sunk[:, :, :10], plain[:, :, :10])  # positions < 10 see keys 0 and 1 already
    assert ((sunk[:, :, 11:] - plain[:, :, 11:]).abs().amax(-1) > 0).all()


@pytest.mark.parametrize("is_causal", [False, True])
def test_a_window_covering_the_sequence_is_full_attention(is_causal):
    q, k, v = qkv(2, 2, 90, 90, 8)
    kpm = padding(2, 90, seed=4)
    out = local_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=LocalConfig(window=90))
    assert (out - full_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal)).abs().max() <= 1e-10


def _one_block_per_chunk(monkeypatch):
    from subquad.kernels.tuning import TUNING

    for budget in ("blocksparse_tile", "blocksparse_fused_tile", "blocksparse_backward_tile", "blocksparse_view_tile"):
        monkeypatch.setattr(TUNING, budget, 1)


def test_blocks_one_at_a_time_give_the_same_values_and_gradients(monkeypatch):
    """A tiny budget makes every block its own chunk, in the forward and backward passes."""
    q, k, v = (x.requires_grad_(True) for x in qkv(2, 2, 150, 150, 4, 3))
    kpm = padding(2, 150, seed=2)
    expected = dense_local(q, k, v, kpm, True, 20)
    grads = torch.autograd.grad(expected, (q, k, v), torch.ones_like(expected))
    _one_block_per_chunk(monkeypatch)
    out = local_attention(q, k, v, key_padding_mask=kpm, is_causal=True, config=LocalConfig(window=20))
    assert (out - expected).abs().max() <= 1e-10
    for got, want in zip(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)), grads, strict=True):
        assert (got - want).abs().max() <= 1e-10


@pytest.fixture
def counted_masks(monkeypatch):
    """Counts evaluations of the window's mask_mod, from a fresh cache of band layouts."""
    calls = []
    window_mask = band.window_mask

    def counting(*args):
        mask_mod = window_mask(*args)
        return lambda *idx: calls.append(1) or mask_mod(*idx)

    monkeypatch.setattr(band, "window_mask", counting)
    band._band.cache_clear()
    yield calls
    band._band.cache_clear()


@pytest.mark.parametrize("is_causal", [False, True])
def test_a_second_call_of_a_shape_builds_no_mask_and_padding_uses_none_kept(counted_masks, is_causal):
    """The band layout of a shape is kept with the masks its chunks derive (``Group.memo``): a second
    call evaluates no mask and returns the same; a call with key padding keeps none of its masks
    and still equals the dense band; the kept ones serve the next call without padding."""
    q, k, v = qkv(2, 2, 300, 300, 8, seed=1)
    config = LocalConfig(window=40)
    first = local_attention(q, k, v, is_causal=is_causal, config=config)
    assert counted_masks and (first - dense_local(q, k, v, None, is_causal, 40)).abs().max() <= 1e-10
    built = len(counted_masks)
    assert (local_attention(q, k, v, is_causal=is_causal, config=config) - first).abs().max() <= 1e-12
    assert len(counted_masks) == built
    kpm = padding(2, 300, seed=3)
    padded = local_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=config)
    assert (padded - dense_local(q, k, v, kpm, is_causal, 40)).abs().max() <= 1e-10
    assert (local_attention(q, k, v, is_causal=is_causal, config=config) - first).abs().max() <= 1e-12


def test_masks_over_the_kept_size_are_built_every_call(counted_masks, monkeypatch):
    monkeypatch.setattr(TUNING, "blocksparse_kept_mask", 0)
    q, k, v = qkv(1, 2, 300, 300, 8, seed=1)
    first = local_attention(q, k, v, config=LocalConfig(window=40))
    built = len(counted_masks)
    assert (local_attention(q, k, v, config=LocalConfig(window=40)) - first).abs().max() <= 1e-12
    assert len(counted_masks) == 2 * built


def test_masks_kept_in_inference_mode_serve_a_call_with_gradients(counted_masks, monkeypatch):
    """A layout kept by a first call under ``torch.inference_mode`` serves a later call that records
    a graph, with the dense band's gradients (one block size for both, so that they share it)."""
    monkeypatch.setattr(TUNING, "local_inference_block", TUNING.local_block)
    q, k, v = qkv(1, 2, 200, 200, 8, seed=2)
    config = LocalConfig(window=30)
    with torch.inference_mode():
        local_attention(q, k, v, config=config)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = local_attention(*leaves, config=config)
    expected = dense_local(*leaves, None, False, 30)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    for got, want in zip(grads, torch.autograd.grad(expected.square().sum(), leaves), strict=True):
        assert (got - want).abs().max() <= 1e-10


def test_a_window_with_only_padded_keys_returns_zeros_with_finite_gradients():
    q, k, v = (x.requires_grad_(True) for x in qkv(1, 1, 12, 12, 4))
    kpm = torch.ones(1, 12, dtype=torch.bool)
    kpm[0, 3:8] = False
    out = local_attention(q, k, v, key_padding_mask=kpm, is_causal=True, config=LocalConfig(window=2))
    assert (out[0, 0, 4:8] == 0).all() and (out[0, 0, :3] != 0).all()
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


@pytest.mark.parametrize("is_causal", [False, True])
def test_gradcheck(is_causal):
    q, k, v = (x.requires_grad_(True) for x in qkv(1, 2, 23, 23, 4, 3))
    kpm = padding(1, 23, seed=3)
    fn = functools.partial(local_attention, key_padding_mask=kpm, is_causal=is_causal, config=LocalConfig(window=5))
    assert gradcheck(fn, (q, k, v))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_low_precision(dtype, tol):
    q, k, v = qkv(1, 2, 200, 200, 16)
    ref = local_attention(q, k, v, is_causal=True, config=LocalConfig(window=40))
    out = local_attention(*(x.to(dtype) for x in (q, k, v)), is_causal=True, config=LocalConfig(window=40))
    assert out.dtype == dtype
    assert (out.double() - ref).abs().max() <= tol * ref.abs().max()


def _record_blocks(monkeypatch, transposed: list | None = None) -> list:
    """Record (query block shape, keys per block) of every chunk the block-sparse engine builds and,
    into ``transposed``, whether its group is transposed (blocks of keys against queries)."""
    from subquad.kernels import blocksparse as _blocksparse

    seen = []
    chunk = _blocksparse._Chunk.__init__

    def record(self, *args, **kwargs):
        chunk(self, *args, **kwargs)
        seen.append((tuple(self.queries.shape), self.shape[-1]))
        if transposed is not None:
            transposed.append(self.group.transposed)

    monkeypatch.setattr(_blocksparse._Chunk, "__init__", record)
    return seen


def test_each_block_reads_only_its_window(monkeypatch):
    """A block of queries holds keys for its windows only (block + 2·window − 2 of them), never the
    sequence: memory does not grow with N × window."""
    q, k, v = qkv(1, 1, 2048, 2048, 4, dtype=torch.float32)
    _one_block_per_chunk(monkeypatch)
    seen = _record_blocks(monkeypatch)
    out = local_attention(q, k, v, config=LocalConfig(window=256))
    block = TUNING.local_inference_block
    assert set(seen) == {((1, block), block + 2 * 256 - 2)}
    assert len(seen) == 2048 // block
    assert (out.double() - dense_local(q.double(), k.double(), v.double(), None, False, 256)).abs().max() < 1e-5


@pytest.mark.parametrize(
    "grad, context, Dv, forward_block, backward_block, transposed",
    [
        (False, None, 8, TUNING.local_inference_block, None, None),
        (True, None, 8, TUNING.local_inference_block, TUNING.local_backward_block, True),
        (True, torch.no_grad, 8, TUNING.local_inference_block, None, None),
        (True, torch.inference_mode, 8, TUNING.local_inference_block, None, None),
        (False, None, 5, TUNING.local_block, None, None),  # Dv != D: the reference path, not the flash kernel
        (True, None, 5, TUNING.local_block, TUNING.local_block, False),
    ],
)
def test_the_forward_runs_small_blocks_on_the_flash_kernel_and_the_backward_recomputes_larger_ones(
    monkeypatch, grad, context, Dv, forward_block, backward_block, transposed
):
    """The forward takes the small block wherever the flash kernel runs it, gradients or not (so a
    call with gradients returns what one without returns). The backward recomputes the band in
    blocks of its own: on the flash kernel transposed, ``local_backward_block`` keys against the
    queries that see them; on the reference path ``local_block`` queries. Values and gradients are
    those of the dense band mask."""
    q, k, v = (x.requires_grad_(grad) for x in qkv(2, 3, 300, 300, 8, Dv))
    expected = dense_local(q, k, v, None, False, 40)
    orientation = []
    seen = _record_blocks(monkeypatch, orientation)
    with context() if context else contextlib.nullcontext():
        out = local_attention(q, k, v, config=LocalConfig(window=40))
    assert {shape[1] for shape, _ in seen} == {forward_block} and not any(orientation)
    assert (out - expected).abs().max() <= 1e-10
    if backward_block is None:
        return
    seen.clear()
    orientation.clear()
    g = randn(*out.shape, dtype=out.dtype, seed=4)
    got, want = torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(expected, (q, k, v), g)
    assert {shape[1] for shape, _ in seen} == {backward_block}
    assert set(orientation) == {transposed}
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max() <= 1e-10


def test_a_call_with_gradients_returns_what_one_without_returns():
    """Both forwards run the same blocks: a reentrant checkpoint, whose first forward runs without
    gradients, recomputes exactly the values it returned."""
    q, k, v = qkv(1, 2, 700, 700, 8, dtype=torch.float32, seed=6)
    for is_causal in (False, True):
        with torch.no_grad():
            plain = local_attention(q, k, v, is_causal=is_causal)
        tracked = local_attention(*(x.clone().requires_grad_() for x in (q, k, v)), is_causal=is_causal)
        assert torch.equal(plain, tracked.detach())


@pytest.mark.parametrize(
    "window, is_causal, wide",
    [(129, False, True), (128, False, False), (257, True, True), (256, True, False)],
)
def test_a_band_of_more_than_four_blocks_of_keys_is_recomputed_in_blocks_twice_as_wide(
    monkeypatch, window, is_causal, wide
):
    """Off the flash kernel (``eager``) both passes take ``local_block`` queries, doubled where a
    query sees more than ``4 · local_block`` keys (2·window − 1 non-causal, window causal). On it
    the forward takes ``local_inference_block`` and the backward, transposed, ``local_backward_block``
    keys at any width. Values and gradients stay those of the dense band mask."""
    q, k, v = (x.requires_grad_(True) for x in qkv(1, 2, 700, 700, 8, seed=2))
    expected = dense_local(q, k, v, None, is_causal, window)
    g = randn(*expected.shape, dtype=expected.dtype, seed=4)
    want = torch.autograd.grad(expected, (q, k, v), g)
    straight = TUNING.local_block * (2 if wide else 1)
    orientation = []
    seen = _record_blocks(monkeypatch, orientation)
    for kernel, forward, backward in (
        ("eager", straight, straight),
        ("fused", TUNING.local_inference_block, TUNING.local_backward_block),
    ):
        seen.clear()
        orientation.clear()
        out = local_attention(q, k, v, is_causal=is_causal, config=LocalConfig(window=window, kernel=kernel))
        assert {shape[1] for shape, _ in seen} == {forward}
        assert (out - expected).abs().max() <= 1e-10
        seen.clear()
        orientation.clear()
        got = torch.autograd.grad(out, (q, k, v), g)
        assert {shape[1] for shape, _ in seen} == {backward}
        assert set(orientation) == {kernel == "fused"}
        for a, b in zip(got, want, strict=True):
            assert (a - b).abs().max() <= 1e-10


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("L", "S"), [(40, 64), (64, 40), (150, 150)])
def test_gradients_equal_the_dense_band_mask_on_the_flash_kernel(is_causal, L, S):
    """Queries and values of one width: the CPU flash kernel in both passes, with L != S too (the
    end blocks read zero-padded copies of the keys they reach)."""
    q, k, v = (x.requires_grad_(True) for x in qkv(2, 2, L, S, 8, seed=3))
    kpm = padding(2, S, seed=5)
    config = LocalConfig(window=20)
    out = local_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=config)
    expected = dense_local(q, k, v, kpm, is_causal, 20)
    assert (out - expected).abs().max() <= 1e-10
    g = randn(*out.shape, dtype=out.dtype, seed=9)
    got, want = torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(expected, (q, k, v), g)
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max() <= 1e-10


@needs_native
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("L", "S", "window"), [(40, 64, 20), (64, 40, 20), (300, 300, 40), (500, 500, 256)])
def test_native_kernel_equals_the_dense_band_mask_with_gradients(is_causal, L, S, window, native_calls):
    """fp32 through the opt-in native kernel against the float64 oracle; its gradients (the fused
    backward) too. w = 256 non-causal gives blocks of 544 keys."""
    exact = [x.requires_grad_(True) for x in qkv(2, 2, L, S, 16, seed=3)]
    inputs = [x.detach().float().requires_grad_(True) for x in exact]
    kpm = padding(2, S, seed=5)
    config = LocalConfig(window=window, kernel="native")
    for context in (torch.no_grad, contextlib.nullcontext):  # the backward recomputes in 64-query blocks
        with context():
            out = local_attention(*inputs, key_padding_mask=kpm, is_causal=is_causal, config=config)
        expected = dense_local(*exact, kpm, is_causal, window)
        assert (out.double() - expected).abs().max() <= 2e-6
    g = randn(*out.shape, seed=9)
    got = torch.autograd.grad(out, inputs, g.float())
    want = torch.autograd.grad(expected, exact, g)
    assert all((a.double() - b).abs().max() <= 2e-5 for a, b in zip(got, want, strict=True))
    assert native_calls


@needs_native
@pytest.mark.parametrize("Dv", [16, 5])
def test_native_kernel_without_padding_and_with_dv_unlike_d_takes_the_small_block(monkeypatch, Dv, native_calls):
    """Dv = 5: torch's kernel cannot run, the native one can, so a call without gradients still
    takes 32-query blocks."""
    exact = qkv(2, 2, 300, 300, 16, Dv, seed=4)
    seen = _record_blocks(monkeypatch)
    out = local_attention(*(x.float() for x in exact), is_causal=True, config=LocalConfig(window=40, kernel="native"))
    assert {shape[1] for shape, _ in seen} == {TUNING.local_inference_block}
    assert (out.double() - dense_local(*exact, None, True, 40)).abs().max() <= 2e-6
    assert native_calls


@needs_native
def test_native_window_cache_equals_parallel_token_by_token(native_calls):
    q, k, v = (x.float() for x in qkv(2, 3, 120, 120, 8))
    config = LocalConfig(window=16, kernel="native")
    parallel = local_attention(q, k, v, is_causal=True, config=config)
    cache = WindowCache(get_mechanism("local"), config, None)
    first = cache.step(q[:, :, :30], k[:, :, :30], v[:, :, :30])
    steps = [cache.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]) for t in range(30, 120)]
    assert (torch.cat([first, *steps], dim=2) - parallel).abs().max() <= 1e-6
    assert native_calls


def test_the_kernel_option_reaches_the_engine(monkeypatch):
    q, k, v = qkv(1, 2, 100, 100, 8)
    expected = dense_local(q, k, v, None, True, 16)
    calls = []
    monkeypatch.setattr(band, "block_sparse_attention", functools.partial(_count_kernel, calls))
    for kernel in ("eager", "fused"):
        out = local_attention(q, k, v, is_causal=True, config=LocalConfig(window=16, kernel=kernel))
        assert (out - expected).abs().max() <= 1e-10
    assert calls == ["eager", "fused"]


def _count_kernel(calls, *args):
    from subquad.kernels.blocksparse import block_sparse_attention

    calls.append(args[6])  # (q, k, v, parts, key_padding_mask, scale, kernel, backward_parts)
    return block_sparse_attention(*args)


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


def test_window_cache_equals_parallel_token_by_token():
    q, k, v = qkv(2, 3, 120, 120, 8)
    config = LocalConfig(window=16)
    parallel = local_attention(q, k, v, is_causal=True, config=config)
    cache = WindowCache(get_mechanism("local"), config, None)
    first = cache.step(q[:, :, :30], k[:, :, :30], v[:, :, :30])
    steps = [cache.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]) for t in range(30, 120)]
    assert (torch.cat([first, *steps], dim=2) - parallel).abs().max() <= 1e-12
    assert cache.kept.keys.shape[2] == 16, "the cache holds window keys, whatever the prefix"
    assert sorted(cache.kept.positions[0].tolist()) == list(range(104, 120))


@pytest.mark.parametrize("window, sinks", [(16, 4), (1, 2), (8, 30)])
def test_window_cache_with_sinks_keeps_them_and_equals_parallel(window, sinks):
    q, k, v = qkv(2, 3, 100, 100, 8)
    config = LocalConfig(window=window, sinks=sinks)
    parallel = local_attention(q, k, v, is_causal=True, config=config)
    cache = WindowCache(get_mechanism("local"), config, None)
    first = cache.step(q[:, :, :30], k[:, :, :30], v[:, :, :30])
    steps = [cache.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]) for t in range(30, 100)]
    assert (torch.cat([first, *steps], dim=2) - parallel).abs().max() <= 1e-12
    assert cache.kept.keys.shape[2] == sinks + window
    assert torch.equal(cache.kept.keys[:, :, :sinks], k[:, :, :sinks])  # one-token steps never move the sinks


@pytest.mark.parametrize("sinks", [0, 3])
def test_window_cache_keeps_grouped_keys_unrepeated_and_equals_parallel(sinks):
    """Two key/value heads for six query heads: the cache holds two, after a padded prefill it
    absorbs and through steps of one token and of several, and equals the parallel pass per row."""
    q, k, v = qkv(2, 6, 90, 90, 8)
    k, v = k[:, :2], v[:, :2]
    config = LocalConfig(window=12, sinks=sinks)
    real = torch.ones(2, 40, dtype=torch.bool)
    real[1, :7] = False  # row 1: 7 pads before its first real token
    cache = WindowCache(get_mechanism("local"), config, None)
    cache.absorb(q[:, :, :40], k[:, :, :40], v[:, :, :40], real)
    steps = [cache.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]) for t in range(40, 70)]
    steps.append(cache.step(q[:, :, 70:], k[:, :, 70:], v[:, :, 70:]))
    decoded = torch.cat(steps, dim=2)
    assert cache.kept.keys.shape[1] == cache.kept.values.shape[1] == 2
    for row, first in ((0, 0), (1, 7)):
        rows = slice(row, row + 1)
        alone = local_attention(q[rows, :, first:], k[rows, :, first:], v[rows, :, first:], is_causal=True,
                                config=config, enable_gqa=True)  # fmt: skip
        assert (decoded[rows] - alone[:, :, 40 - first :]).abs().max() <= 1e-12
    with pytest.raises(ValueError, match="the cache holds keys of 2 key/value heads, got 6; start a new cache"):
        cache.step(*qkv(2, 6, 1, 1, 8))
    assert cache.length == 90, "the refused step changed nothing"


def test_window_cache_rejects_bad_steps():
    cache = WindowCache(get_mechanism("local"), LocalConfig(window=4), None)
    cache.step(*qkv(2, 2, 1, 1, 4))
    with pytest.raises(ValueError, match=r"holds keys of \(B, H, D\) = \(2, 2, 4\), got \(3, 2, 1, 4\)"):
        cache.step(*qkv(3, 2, 1, 1, 4))
    with pytest.raises(ValueError, match="as many queries as keys, got 1 and 2"):
        cache.step(*qkv(2, 2, 1, 2, 4))


def test_generate_gives_the_same_tokens_with_and_without_the_cache():
    torch.manual_seed(0)
    model = subquad.nn.CausalLM(37, 32, 2, 4, attention=subquad.nn.HeadGroup("local", window=6), max_len=80).double()
    prompt = torch.randint(0, 37, (2, 9))
    assert torch.equal(model.generate(prompt, 50), model.generate(prompt, 50, use_cache=False))


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_bad_window_raises():
    with pytest.raises(ValueError, match="local option window must be >= 1, got 0"):
        subquad.attention(*qkv(), mechanism="local", window=0)
    with pytest.raises(ValueError, match="local option window must be an int, got 2.5"):
        subquad.attention(*qkv(), mechanism="local", window=2.5)


@pytest.mark.parametrize("causal", [True, False])
def test_torch_s_kernel_reads_grouped_query_keys_in_place_and_answers_as_repeated_heads(monkeypatch, causal):
    """Where torch's CPU flash kernel takes fewer key heads (as recent torch does), the window's keys reach
    it unrepeated (the repeat copied every window G times); the output is the repeated heads' exactly."""
    from subquad.kernels import blocksparse_forward, softmax

    if not softmax.fused_available(torch.device("cpu"), 8, 8) or not softmax.fused_reads_grouped():
        pytest.skip("torch's CPU flash kernel does not take grouped-query keys here")
    q, k, v = (randn(2, h, 64, 8, seed=s) for h, s in ((6, 1), (2, 2), (2, 3)))
    heads = []
    kernel = blocksparse_forward.fused_forward
    monkeypatch.setattr(blocksparse_forward, "fused_forward", lambda *a: heads.append(a[1].shape[1]) or kernel(*a))
    out = local_attention(q, k, v, is_causal=causal, config=LocalConfig(window=8, sinks=2), enable_gqa=True)
    assert 2 * 2 in heads  # the band's calls: B · H_kv key heads, read in place (the sinks' part gathers rows)
    repeated = local_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=causal,
                               config=LocalConfig(window=8, sinks=2))  # fmt: skip
    assert torch.equal(out, repeated)

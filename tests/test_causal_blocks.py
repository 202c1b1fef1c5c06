"""Causal inference in query blocks (``subquad.ops.causal_blocks``): the same outputs as the parallel
forms, for local and linear's windowed form, with sinks, padding and grouped keys; gradients keep
the parallel forms."""

from __future__ import annotations

import pytest
import torch

from subquad import attention
from subquad.mechanisms.linear import LinearConfig, LinearState
from subquad.ops import causal_blocks

CASES = {
    "local": {"window": 7},
    "local-sinks": {"window": 5, "sinks": 3},
    "local-wide": {"window": 40, "sinks": 2},
    "linear-window": {"window": 6, "chunk": 4},
    "linear-window-sinks": {"window": 5, "sinks": 2, "chunk": 3},
    "hedgehog-window-sinks": {"feature_map": "hedgehog", "window": 4, "sinks": 3, "chunk": 4},
}


def inputs(B, H, Hkv, N, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def hedgehog_state(H, D, seed):
    state = LinearState(LinearConfig(feature_map="hedgehog"), H, D).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        state.weight.add_(0.4 * torch.randn(state.weight.shape, generator=g, dtype=torch.float64))
    return state


@pytest.mark.parametrize("padding", [None, "left", "right"])
@pytest.mark.parametrize("case", list(CASES))
def test_query_blocks_equal_the_parallel_form(case, padding, monkeypatch):
    name = case.split("-")[0]
    options = dict(CASES[case])
    if name == "hedgehog":
        name = "linear"
    grouped = name == "local"
    q, k, v = inputs(2, 4, 2 if grouped else 4, 100, 8, seed=len(case))
    state = hedgehog_state(4, 8, 3) if options.get("feature_map") == "hedgehog" else None
    mask = None
    if padding:
        mask = torch.ones(2, 100, dtype=torch.bool)
        mask[1, :9] = padding != "left"
        mask[1, -9:] = padding != "right"
    call = lambda: attention(q, k, v, is_causal=True, key_padding_mask=mask, mechanism=name, state=state,
                             enable_gqa=grouped, **options)  # fmt: skip
    parallel = call()
    monkeypatch.setattr(causal_blocks, "BLOCK", 16)
    used = []
    original = causal_blocks.in_query_blocks

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        used.append(out is not None)
        return out

    monkeypatch.setattr(f"subquad.mechanisms.{name}.in_query_blocks", spy)
    with torch.no_grad():
        blocked = call()
    assert any(used), "the blocks ran"
    torch.testing.assert_close(blocked, parallel.detach(), rtol=1e-10, atol=1e-11)


def test_gradients_keep_the_parallel_form(monkeypatch):
    monkeypatch.setattr(causal_blocks, "BLOCK", 16)
    q, k, v = inputs(1, 2, 2, 80, 8, seed=4)
    q.requires_grad_()
    out = attention(q, k, v, is_causal=True, mechanism="linear", window=5, sinks=2)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    state = hedgehog_state(2, 8, 1)  # learned maps train even when the inputs do not
    attention(q.detach(), k, v, is_causal=True, mechanism="linear", state=state, feature_map="hedgehog",
              window=5).sum().backward()  # fmt: skip
    assert state.weight.grad is not None and state.weight.grad.abs().sum() > 0


def test_short_sequences_and_wide_windows_run_the_parallel_form():
    q, k, v = inputs(1, 2, 2, 50, 8, seed=1)
    assert causal_blocks.in_query_blocks(q, k, v, None, 0, 4, lambda *a: q) is None  # 50 <= 2 blocks
    q, k, v = inputs(1, 2, 2, 3000, 8, seed=1)
    assert causal_blocks.in_query_blocks(q, k, v, None, 0, 3000, lambda *a: q) is None  # the window is all


@pytest.mark.parametrize("sinks", [0, 3])
def test_blocks_without_sinks_read_their_keys_in_place(sinks):
    """A block reads the sinks and its keys ``[a − w + 1, b)``: without sinks those keys are a view of
    the inputs (a concatenation would copy them: 93 MB a call for local at 16k), with sinks a copy
    joining both; the outputs are the parallel form's either way (the tests above)."""
    q, k, v = inputs(1, 2, 2, 40 * causal_blocks.BLOCK // 8, 4, seed=3)  # several blocks of BLOCK queries
    mask = torch.ones(1, k.shape[2], dtype=torch.bool)
    seen = []

    def run(q_, keys, values, block_mask, initial):
        seen.append((keys, values, block_mask))
        return q_.new_zeros(*q_.shape[:3], values.shape[-1])

    causal_blocks.in_query_blocks(q, k, v, mask, sinks, 300, run)
    far = [x for x in seen if x[0].shape[2] < k.shape[2] and x[0].data_ptr() != k.data_ptr()]  # past the start
    assert far  # some blocks' windows leave the sinks
    for keys, values, block_mask in far:
        shares = [a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for a, b in
                  ((keys, k), (values, v), (block_mask, mask))]  # fmt: skip
        assert all(shares) if sinks == 0 else not any(shares)


def test_local_inference_reads_each_window_in_place_and_merges_the_sinks_once(monkeypatch):
    """``local`` with sinks, causal, without gradients: each query block's window alone, its keys a
    view of the inputs (no copy joining the sinks), then the sinks for all queries in one product
    (``leading_keys``), not a sinks part per block; the output is the parallel form's (above), and a
    tuple-returning ``run`` gets its tuple assembled."""
    import subquad.mechanisms.local as local

    monkeypatch.setattr(causal_blocks, "BLOCK", 16)
    q, k, v = inputs(2, 4, 2, 100, 8, seed=5)
    windows, sinks = [], []
    window_softmax, leading_keys = local.window_softmax, local.leading_keys

    def spy_window(q_, keys, values, *args):
        windows.append((q_.shape[2], keys, args[-1]))
        return window_softmax(q_, keys, values, *args)

    def spy_sinks(q_, keys, *args):
        sinks.append((q_.shape[2], keys.shape[2]))
        return leading_keys(q_, keys, *args)

    monkeypatch.setattr(local, "window_softmax", spy_window)
    monkeypatch.setattr(local, "leading_keys", spy_sinks)
    with torch.no_grad():
        out = attention(q, k, v, is_causal=True, mechanism="local", window=5, sinks=3, enable_gqa=True)
    assert sinks == [(100, 3)]  # all 100 queries, the 3 sinks, once
    assert len(windows) == 7 and all(s == 0 for _, _, s in windows)  # 16-query blocks, the window alone
    assert all(keys.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() for _, keys, _ in windows)
    expected = attention(q, k, v, is_causal=True, mechanism="local", window=5, sinks=3, enable_gqa=True, kernel="eager")
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-11)

"""Calls that are exactly full attention at their shape run full attention's kernel.

A window or stride that covers every key, clusters >= L or top-k >= S: the mechanism's maths is
full attention there, so the registry dispatches the call to ``full`` (bit-identical to it), and one
step short of the boundary the mechanism's own kernel runs (its output then differs from full's,
since it leaves a key out).
"""

from __future__ import annotations

import pytest
import torch

import subquad
from subquad._validate import AttentionShape
from subquad.masks import window_covers
from subquad.registry import get_mechanism, make_config

# (mechanism, options, L, S, causal, exactly full)
CASES = [
    ("local", {"window": 12}, 12, 12, True, True),
    ("local", {"window": 11}, 12, 12, True, False),
    ("local", {"window": 12}, 12, 12, False, True),
    ("local", {"window": 11}, 12, 12, False, False),
    ("local", {"window": 12}, 5, 12, True, True),  # cross, bottom-right: the last query is at 11
    ("local", {"window": 8}, 5, 12, False, False),  # the first query (at 7) is 7 from key 0, 4 from key 11
    ("local", {"window": 12, "sinks": 2}, 12, 12, True, True),
    ("local", {"window": 6, "sinks": 2}, 12, 12, True, False),
    ("sparse", {"stride": 12}, 12, 12, True, True),
    ("sparse", {"stride": 11}, 12, 12, True, True),  # merged: the column takes distance 11
    ("sparse", {"stride": 10}, 12, 12, True, False),
    ("sparse", {"stride": 11, "step": "local"}, 12, 12, True, False),
    ("sparse", {"stride": 12, "step": "local"}, 12, 12, False, True),
    ("sparse", {"stride": 12, "step": "column"}, 12, 12, True, False),
    ("sparse", {"stride": 1, "step": "column"}, 12, 12, True, True),
    ("sparse", {"stride": 1, "step": "merged"}, 12, 12, False, True),
    ("sparse", {"pattern": "fixed", "stride": 12, "summary": 2}, 12, 12, True, True),
    ("sparse", {"pattern": "fixed", "stride": 12, "summary": 2}, 12, 12, False, True),
    ("sparse", {"pattern": "fixed", "stride": 6, "summary": 2}, 12, 12, True, False),
    ("pattern", {"window": 12}, 12, 12, False, True),
    ("pattern", {"window": 11, "global_tokens": 1}, 12, 12, False, True),  # position 0 is global
    ("pattern", {"window": 10, "global_tokens": 1}, 12, 12, False, False),
    ("pattern", {"window": 12, "dilation": 2}, 12, 12, True, False),
    ("clustered", {"clusters": 12}, 12, 12, False, True),
    ("clustered", {"clusters": 11}, 12, 12, False, False),
    ("improved-clustered", {"clusters": 2, "topk": 12}, 12, 12, False, True),
    ("improved-clustered", {"clusters": 12, "topk": 2}, 12, 12, False, True),
    ("improved-clustered", {"clusters": 2, "topk": 11}, 12, 12, False, False),
]


def _shape(L, S):
    return AttentionShape(batch=2, heads=3, queries=L, keys=S, head_dim=8, value_dim=8, scale=8**-0.5)


def _call(name, options, L, S, causal, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, L, 8, generator=g, dtype=dtype)
    k, v = (torch.randn(2, 3, S, 8, generator=g, dtype=dtype) for _ in range(2))
    kpm = torch.ones(2, S, dtype=torch.bool)
    kpm[1, :3] = False  # left padding in one row
    extra = {}
    if "query_padding_mask" in get_mechanism(name).tensor_args:
        extra["query_padding_mask"] = torch.ones(2, L, dtype=torch.bool)
    out = subquad.attention(q, k, v, mechanism=name, is_causal=causal, key_padding_mask=kpm, **options, **extra)
    return out, subquad.attention(q, k, v, is_causal=causal, key_padding_mask=kpm)


@pytest.mark.parametrize(("name", "options", "L", "S", "causal", "exact"), CASES)
def test_a_call_that_is_exactly_full_runs_full_and_one_that_is_not_runs_the_mechanism(
    name, options, L, S, causal, exact
):
    mech = get_mechanism(name)
    assert mech.exact_full(make_config(name, **options), _shape(L, S), causal, None, {}) is exact
    out, full = _call(name, options, L, S, causal)
    if exact:
        assert torch.equal(out, full)  # full's own kernel: bit-identical
    else:
        assert not torch.allclose(out, full, atol=1e-6)  # a key is left out somewhere


def test_padded_queries_return_zeros_as_from_the_mechanism_itself():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    real = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
    for name in ("clustered", "improved-clustered"):
        out = subquad.attention(q, k, v, mechanism=name, clusters=6, key_padding_mask=real, query_padding_mask=real)
        full = subquad.attention(q, k, v, key_padding_mask=real)
        assert torch.equal(out[1, :, :2], torch.zeros_like(out[1, :, :2]))
        assert torch.equal(out[:, :, 2:], full[:, :, 2:]) and torch.equal(out[0], full[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dispatch_keeps_the_dtype_and_gradients(dtype):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g).to(dtype).requires_grad_() for _ in range(3))
    out = subquad.attention(q, k, v, mechanism="local", window=16, is_causal=True)
    assert out.dtype == dtype
    out.sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


def test_grouped_query_inputs_reach_full_in_place():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 10, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 10, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out = subquad.attention(q, k, v, mechanism="sparse", stride=16, is_causal=True, enable_gqa=True)
    expected = subquad.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_a_mask_mod_is_never_taken_for_full():
    pattern = get_mechanism("pattern")
    config = make_config("pattern", window=64)
    assert pattern.exact_full(config, _shape(8, 8), False, None, {}) is True
    assert pattern.exact_full(config, _shape(8, 8), False, None, {"mask_mod": lambda b, h, q, k: q >= k}) is False


@pytest.mark.parametrize(
    ("window", "L", "S", "causal", "covers"),
    [(4, 4, 4, True, True), (3, 4, 4, True, False), (4, 9, 4, True, True), (4, 9, 4, False, False),
     (9, 9, 4, False, True), (5, 2, 5, False, True), (4, 2, 5, False, False)],
)  # fmt: skip
def test_window_covers_matches_the_dense_window(window, L, S, causal, covers):
    p = torch.arange(L)[:, None] + S - L
    j = torch.arange(S)[None, :]
    distance = p - j
    inside = (distance >= 0) & (distance < window) if causal else distance.abs() < window
    seen_by_full = distance >= 0 if causal else torch.ones_like(inside)
    assert window_covers(window, L, S, causal) is covers
    assert bool((inside | ~seen_by_full).all()) is covers

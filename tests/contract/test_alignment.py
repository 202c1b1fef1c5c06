"""Causal alignment when L != S, as SDPA reads it: ``is_causal=True`` is top-left (query ``i`` sees
keys ``j <= i``); ``attn_mask=causal_lower_right(L, S)`` asks for the end-aligned form decoding uses."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right as torch_lower_right
from torch.nn.attention.bias import causal_upper_left
from torch.nn.functional import scaled_dot_product_attention as sdpa

import subquad
from subquad.call import call

from .cases import all_cases, make_inputs

CAUSAL = all_cases(causal=True)


def _qkv(L: int, S: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64) for n in (L, S, S)]


@pytest.mark.parametrize(("L", "S"), [(5, 9), (9, 5), (1, 7)])
def test_full_is_causal_with_l_not_s_is_sdpa_top_left(L, S):
    """The silent case: before, subquad aligned these queries to the last keys (a max difference of
    3.0 from SDPA's answer for the same call)."""
    q, k, v = _qkv(L, S)
    expected = sdpa(q, k, v, is_causal=True)
    torch.testing.assert_close(subquad.attention(q, k, v, is_causal=True), expected)
    torch.testing.assert_close(subquad.attention(q, k, v, attn_mask=causal_upper_left(L, S)), expected)


@pytest.mark.parametrize(("L", "S"), [(5, 9), (1, 7), (4, 4)])
def test_causal_lower_right_is_sdpa_lower_right(L, S):
    q, k, v = _qkv(L, S, seed=1)
    expected = sdpa(q, k, v, attn_mask=torch_lower_right(L, S))
    for mask in (torch_lower_right(L, S), subquad.causal_lower_right(L, S)):
        torch.testing.assert_close(subquad.attention(q, k, v, attn_mask=mask), expected)


def test_lower_right_with_more_queries_than_keys_gives_zeros_where_sdpa_gives_nan():
    q, k, v = _qkv(7, 4, seed=2)
    out = subquad.attention(q, k, v, attn_mask=subquad.causal_lower_right(7, 4))
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))  # queries before the first key
    torch.testing.assert_close(out[:, :, 3:], sdpa(q[:, :, 3:], k, v, is_causal=True))


def test_top_left_with_padding_matches_the_dense_mask():
    q, k, v = _qkv(6, 9, seed=3)
    kpm = torch.ones(2, 9, dtype=torch.bool)
    kpm[1, 2] = False
    dense = torch.ones(6, 9, dtype=torch.bool).tril() & kpm[:, None, None, :]
    out = subquad.attention(q, k, v, is_causal=True, key_padding_mask=kpm, mechanism="local", window=3)
    window = (torch.arange(6)[:, None] - torch.arange(9)[None, :]) < 3
    torch.testing.assert_close(out, sdpa(q, k, v, attn_mask=dense & window))


@pytest.mark.parametrize("case", CAUSAL)
def test_top_left_with_fewer_queries_is_causal_attention_over_the_first_l_keys(case):
    """Keys past L - 1 are seen by no query: the answer is the L = S call on the first L keys."""
    x = make_inputs(case, B=2, H=4, L=6, S=10, D=8, Dv=8, dtype=torch.float64, seed=4)
    extras = {n: t[..., :6] if case.mech.positions.get(n) == "key" else t for n, t in x.extras.items()}
    top_left = call(case.mech, x.q, x.k, x.v, is_causal=True, config=case.config, **x.extras)
    square = call(case.mech, x.q, x.k[:, :, :6], x.v[:, :, :6], is_causal=True, config=case.config, **extras)
    torch.testing.assert_close(top_left, square, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("case", CAUSAL)
def test_top_left_with_more_queries_sees_no_later_key(case):
    """Query ``i`` (at position ``i``) depends on no key ``j > i``."""
    L, S = 10, 6
    x = make_inputs(case, B=1, H=4, L=L, S=S, D=8, Dv=8, dtype=torch.float64, seed=5)
    out = call(case.mech, x.q, x.k, x.v, is_causal=True, config=case.config, **x.extras)
    assert out.shape == (1, 4, L, 8) and torch.isfinite(out).all()
    k, v = x.k.clone(), x.v.clone()
    k[:, :, 4:], v[:, :, 4:] = 7.0, -3.0  # keys 4 and 5: reach queries 4 on only
    edited = call(case.mech, x.q, k, v, is_causal=True, config=case.config, **x.extras)
    torch.testing.assert_close(edited[:, :, :4], out[:, :, :4], rtol=1e-9, atol=1e-10)


def test_a_causal_bias_for_other_sizes_or_beside_is_causal_is_refused():
    q, k, v = _qkv(3, 5)
    with pytest.raises(ValueError, match=r"causal bias for L=3, S=6, but q and k have L=3, S=5; build it as "):
        subquad.attention(q, k, v, attn_mask=subquad.causal_lower_right(3, 6))
    with pytest.raises(ValueError, match=r"pass either is_causal=True or a causal attn_mask \(CausalBias\)"):
        subquad.attention(q, k, v, attn_mask=subquad.causal_lower_right(3, 5), is_causal=True)
    with pytest.raises(ValueError, match=r"clustered has no causal form"):
        subquad.attention(q, k, v, attn_mask=subquad.causal_lower_right(3, 5), mechanism="clustered")


def test_a_dense_mask_on_another_mechanism_names_the_causal_spellings():
    q, k, v = _qkv(3, 5)
    with pytest.raises(ValueError, match=r"local takes no dense attn_mask; .*is_causal=True or "
                       r"attn_mask=causal_lower_right\(L, S\)"):  # fmt: skip
        subquad.attention(q, k, v, torch.ones(3, 5, dtype=torch.bool), mechanism="local")

"""One test per contract defect found by probing every mechanism as a new user would, each written
against the public API only, as the report gave it. tests/contract/ checks the same properties in
general; these pin the cases that were seen to fail."""

from __future__ import annotations

import pytest
import torch

import subquad
from subquad.nn import CausalLM


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _extras(name, q, k, v):
    mech = subquad.get_mechanism(name)
    if mech.example_tensors is None:
        return {}
    return mech.example_tensors(q, k, v, subquad.make_config(name), torch.Generator().manual_seed(9))


def test_routing_with_its_defaults_is_prefix_consistent():
    """Its defaults were round(sqrt(S)) clusters and tiles of ceil(S/k): outputs at positions < 150
    moved by up to 3.8 when the sequence went on to 200."""
    q, k, v = (_randn(1, 1, 200, 16, seed=s) for s in range(3))
    whole = subquad.attention(q, k, v, mechanism="routing", is_causal=True)
    prefix = subquad.attention(q[:, :, :150], k[:, :, :150], v[:, :, :150], mechanism="routing", is_causal=True)
    torch.testing.assert_close(whole[:, :, :150], prefix, rtol=1e-5, atol=1e-6)


def test_causal_lm_with_routing_generates_the_same_tokens_with_and_without_its_cache():
    torch.manual_seed(0)
    model = CausalLM(40, 32, 2, 4, attention="routing", max_len=64).eval()
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model.generate(prompt, 40, use_cache=True), model.generate(prompt, 40, use_cache=False))


def test_non_causal_routing_padded_queries_do_not_change_real_outputs():
    q, k, v = (_randn(2, 2, 60, 8, seed=s) for s in range(3))
    real = torch.ones(2, 60, dtype=torch.bool)
    real[0, 45:] = False
    junk = q.clone()
    junk[0, :, 45:] = 5 * _randn(2, 15, 8, seed=7)
    a, b = (
        subquad.attention(x, k, v, mechanism="routing", key_padding_mask=real, query_padding_mask=real)
        for x in (q, junk)
    )
    assert torch.equal(a[0, :, :45], b[0, :, :45]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("name", subquad.mechanism_names())
def test_nan_in_padded_keys_values_and_queries_reaches_no_real_output(name):
    q, k, v = (_randn(2, 4, 40, 8, seed=s) for s in range(3))
    extras = _extras(name, q, k, v)
    real = torch.ones(2, 40, dtype=torch.bool)
    real[0, 30:] = False
    masks = {"key_padding_mask": real}
    if "query_padding_mask" in subquad.get_mechanism(name).tensor_args:
        masks["query_padding_mask"] = real
    clean = subquad.attention(q, k, v, mechanism=name, **masks, **extras)
    for x in (q, k, v):
        x[0, :, 30:] = float("nan")
    dirty = subquad.attention(q, k, v, mechanism=name, **masks, **extras)
    assert torch.isfinite(dirty[0, :, :30]).all()
    assert torch.equal(clean[0, :, :30], dirty[0, :, :30]) and torch.equal(clean[1], dirty[1])


@pytest.mark.parametrize("name", [n for n in subquad.mechanism_names() if subquad.get_mechanism(n).causal])
def test_nan_in_the_future_reaches_no_earlier_output(name):
    q, k, v = (_randn(1, 4, 40, 8, seed=s) for s in range(3))
    extras = _extras(name, q, k, v)
    before = subquad.attention(q, k, v, mechanism=name, is_causal=True, **extras)
    for x in (q, k, v):
        x[:, :, 20:] = float("nan")
    after = subquad.attention(q, k, v, mechanism=name, is_causal=True, **extras)
    assert torch.equal(before[:, :, :20], after[:, :, :20])


@pytest.mark.parametrize("name", ["clustered", "improved-clustered"])
def test_clustered_refuses_a_key_padding_mask_without_a_query_padding_mask(name):
    """With the key mask alone, outputs depended on padded queries (max difference 1.21 and 0.69)."""
    q, k, v = (_randn(1, 2, 30, 8, seed=s) for s in range(3))
    real = torch.ones(1, 30, dtype=torch.bool)
    real[0, 20:] = False
    with pytest.raises(ValueError, match="pass query_padding_mask too"):
        subquad.attention(q, k, v, mechanism=name, key_padding_mask=real)


def test_multires_with_a_tiny_rate_runs_in_bounded_memory():
    """rates=(1e-9,)*4 made torch try to allocate about 100 GB."""
    q, k, v = (_randn(1, 4, 50, 8, seed=s) for s in range(3))
    logits = _randn(1, 4, 50, seed=3)
    out = subquad.attention(q, k, v, mechanism="multires", rates=(1e-9,) * 4, router_logits=logits)
    assert torch.isfinite(out).all()


def test_a_pattern_mask_mod_written_with_and_gets_our_error():
    q, k, v = (_randn(1, 1, 16, 4, seed=s) for s in range(3))
    with pytest.raises(ValueError, match=r"use & \| ~ and torch.where"):
        subquad.attention(q, k, v, mechanism="pattern", mask_mod=lambda b, h, i, j: (i >= j) and (i - j < 4))


def test_generate_from_an_empty_prompt_gets_a_clear_error():
    model = CausalLM(10, 16, 1, 2, max_len=16)
    with pytest.raises(ValueError, match=r"generate continues a prompt of shape \(B, T\) with T >= 1"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 3)


@pytest.mark.parametrize(
    ("name", "dtype", "L", "S", "D"),
    [("routing", torch.float32, 300, 300, 16), ("multires", torch.float64, 16, 152, 4)],
)
def test_causal_outputs_are_bit_identical_when_only_the_future_changes(name, dtype, L, S, D):
    """They moved by 3e-8 to 7e-7 in fp32 (routing) and by rounding in fp64 (multires, 2 of these
    20 inputs): a summation order that followed later tokens."""
    t = S - 4  # the last key position kept
    past = torch.arange(L) + S - L <= t  # the queries at positions <= t
    changed = 0
    for seed in range(20):
        q, k, v = (
            _randn(2, 4, L, D, seed=seed, dtype=dtype),
            *(_randn(2, 4, S, D, seed=seed + s, dtype=dtype) for s in (1, 2)),
        )
        extras = _extras(name, q, k, v)
        before = subquad.attention(q, k, v, mechanism=name, is_causal=True, **extras)
        q[:, :, ~past] = 3 * _randn(2, 4, int((~past).sum()), D, seed=seed + 3, dtype=dtype)
        k[:, :, t + 1 :], v[:, :, t + 1 :] = (
            3 * _randn(2, 4, S - t - 1, D, seed=seed + s, dtype=dtype) for s in (4, 5)
        )
        for x in extras.values():  # router logits run over the queries
            x[..., ~past] = 3 * _randn(*x[..., ~past].shape, seed=seed + 6, dtype=dtype)
        after = subquad.attention(q, k, v, mechanism=name, is_causal=True, **extras)
        changed += not torch.equal(before[:, :, past], after[:, :, past])
    assert changed == 0, f"{changed} of 20 inputs moved"

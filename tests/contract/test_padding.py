"""Padding, for every mechanism: what a padded position holds never reaches a real output.

- Padding invariance: new values, NaN or ±inf in the padded keys and values (and, in
  self-attention, in the padded queries), and in the extra tensors at those positions, leave every
  real output bit-identical, their gradients the same, and send no gradient to a padded key.
- A query that sees no key (every key padded, or causal with L > S) returns zeros and passes back
  zero gradients.
- A mechanism that groups its queries refuses a key padding mask without a query padding mask.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import subquad

from .cases import CONTRACT, DTYPES, FILLS, KEY, SEEDS, Case, all_cases, call, edit, fill_with, grads_at, make_inputs
from .cases import sizes as sizes_of

CASES = all_cases()


def _is_causal(case: Case, data) -> bool:
    return case.mech.causal and data.draw(st.booleans(), label="is_causal")


@st.composite
def masks(draw, B: int, N: int) -> torch.Tensor:
    """A bool (B, N) mask, True = real: random patterns, left or right padding, or all padded."""
    kind = draw(st.sampled_from(["random", "right", "left", "none real"]))
    if kind == "none real":
        return torch.zeros(B, N, dtype=torch.bool)
    if kind == "random":
        bits = draw(st.lists(st.booleans(), min_size=B * N, max_size=B * N))
        return torch.tensor(bits, dtype=torch.bool).view(B, N)
    lengths = torch.tensor(draw(st.lists(st.integers(0, N), min_size=B, max_size=B)))
    real = torch.arange(N) < lengths[:, None]
    return real if kind == "right" else real.flip(1)


@pytest.mark.parametrize("case", CASES)
@CONTRACT
@given(data=st.data(), seed=SEEDS, fill=FILLS, dtype=DTYPES)
def test_padded_content_never_reaches_a_real_output(case, data, seed, fill, dtype):
    size = data.draw(sizes_of(case))
    B, L, S = size["B"], size["L"], size["S"]
    is_causal = _is_causal(case, data)
    self_attention = L == S
    kpm = data.draw(masks(B, S), label="key_padding_mask")
    qpm = kpm if self_attention else data.draw(masks(B, L), label="query_padding_mask")
    # Padded queries are those the call knows of: in self-attention the padded positions, and in
    # cross-attention those of the query padding mask, which only mechanisms that group queries take.
    real_q = qpm if (self_attention or case.takes_query_mask) else torch.ones(B, L, dtype=torch.bool)
    x = make_inputs(case, **size, dtype=dtype, seed=seed)
    y = edit(case, x, ~real_q, ~kpm, fill_with(fill, seed + 1))

    outs, grads = [], []
    for inputs in (x, y):
        leaves = inputs.leaves()
        out = call(case, leaves, is_causal=is_causal, key_padding_mask=kpm, query_padding_mask=qpm)
        if inputs is x:
            assert torch.isfinite(out).all(), "padded queries too return finite values"
        if case.takes_query_mask:  # padded queries return zeros: nothing of theirs can reach them
            padded = out.transpose(1, 2)[~real_q]
            assert torch.equal(padded, torch.zeros_like(padded)), "a padded query returns non-zero output"
        real = out.transpose(1, 2)[real_q]  # (real queries, H, Dv)
        weight = torch.linspace(-1, 1, real.numel(), dtype=torch.float64).view(real.shape)
        if real.requires_grad:  # (not when no query is real, for some mechanisms: then no gradient)
            (real.double() * weight).sum().backward()
        outs.append(real.detach())
        grads.append((grads_at(case, leaves, real_q, kpm), grads_at(case, leaves, ~real_q, ~kpm)))
    assert torch.equal(outs[0], outs[1]), (outs[0] - outs[1]).abs().max()
    for name, grad in grads[0][0].items():
        torch.testing.assert_close(grad, grads[1][0][name], msg=lambda m, name=name: f"gradient of {name}: {m}")
    for name, grad in grads[0][1].items():  # padded keys, values and key-aligned extras
        if name in ("k", "v") or case.mech.positions.get(name) == KEY:
            assert torch.equal(grad, torch.zeros_like(grad)), f"a padded position of {name} receives gradient"


@pytest.mark.parametrize("case", CASES)
@CONTRACT
@given(data=st.data(), seed=SEEDS, dtype=DTYPES)
def test_a_query_that_sees_no_key_returns_zeros_and_zero_gradients(case, data, seed, dtype):
    size = data.draw(sizes_of(case))
    B, L, S = size["B"], size["L"], size["S"]
    is_causal = _is_causal(case, data)
    kpm = torch.ones(B, S, dtype=torch.bool)
    kpm[0] = False  # row 0 has no real key
    x = make_inputs(case, **size, dtype=dtype, seed=seed).leaves()
    out = call(case, x, is_causal=is_causal, key_padding_mask=kpm)
    blind = torch.zeros(B, L, dtype=torch.bool)
    blind[0] = True
    if is_causal:
        blind[:, : max(0, L - S)] = True  # causal queries before every key
    assert torch.equal(out.transpose(1, 2)[blind], torch.zeros_like(out.transpose(1, 2)[blind]))
    out.transpose(1, 2)[blind].double().sum().backward()
    for name, t in {"q": x.q, "k": x.k, "v": x.v, **x.extras}.items():
        if t.grad is not None:
            assert torch.equal(t.grad, torch.zeros_like(t.grad)), f"{name} receives gradient from a blind query"


def test_a_mechanism_that_groups_its_queries_needs_a_query_padding_mask_with_a_key_padding_mask():
    q, k, v = (torch.randn(2, 2, 6, 4) for _ in range(3))
    kpm = torch.ones(2, 6, dtype=torch.bool)
    grouping = [n for n in subquad.mechanism_names() if subquad.get_mechanism(n).groups_queries]
    assert set(grouping) == {"clustered", "improved-clustered", "routing"}
    for name in grouping:
        with pytest.raises(ValueError, match=rf"{name} groups its queries.*pass query_padding_mask too"):
            subquad.attention(q, k, v, mechanism=name, key_padding_mask=kpm)
        subquad.attention(q, k, v, mechanism=name, key_padding_mask=kpm, query_padding_mask=kpm)
        subquad.attention(q, k, v, mechanism=name)  # no padding: nothing to pass

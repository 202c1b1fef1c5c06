"""Strict causality, for every mechanism with a causal form.

- Prefix consistency: the outputs at positions < t equal those of the same call on the first t
  positions. A default derived from the sequence's length (a cluster count, a tile size) breaks
  this while every fixed-length check passes.
- Future edits: whatever the positions after t hold (new values, NaN, ±inf, padding or not), the
  outputs at positions <= t are bit-identical, and so, up to rounding, are the gradients they send to
  inputs at positions <= t.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from .cases import (
    CONTRACT,
    DTYPES,
    FILLS,
    SEEDS,
    all_cases,
    call,
    cut,
    edit,
    fill_with,
    grads_at,
    make_inputs,
    positions_after,
)
from .cases import sizes as sizes_of

CAUSAL = all_cases(causal=True)


@pytest.mark.parametrize("case", CAUSAL)
@CONTRACT
@given(data=st.data(), seed=SEEDS)
def test_prefix_consistency(case, data, seed):
    size = data.draw(sizes_of(case, cross=False))
    N = size["L"]
    t = data.draw(st.integers(1, N), label="t")
    x = make_inputs(case, **size, dtype=torch.float64, seed=seed)
    whole = call(case, x, is_causal=True)
    prefix = call(case, cut(case, x, slice(0, t), slice(0, t)), is_causal=True)
    torch.testing.assert_close(whole[:, :, :t], prefix, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("case", CAUSAL)
@CONTRACT
@given(data=st.data(), seed=SEEDS, fill=FILLS, dtype=DTYPES)
def test_future_edits_leave_the_past_bit_identical(case, data, seed, fill, dtype):
    size = data.draw(sizes_of(case))
    B, L, S = size["B"], size["L"], size["S"]
    t = data.draw(st.integers(0, S - 1), label="t")  # the last key position kept
    x = make_inputs(case, **size, dtype=dtype, seed=seed)
    future_q, future_k = positions_after(t, B, L, S)
    y = edit(case, x, future_q, future_k, fill_with(fill, seed + 1))
    past = ~future_q[0]  # queries at positions <= t
    kpm = None
    if data.draw(st.booleans(), label="padding"):  # and the future's padding flipped
        kpm = torch.rand(B, S, generator=torch.Generator().manual_seed(seed)) > 0.3
    masks = (kpm, None if kpm is None else torch.where(future_k, ~kpm, kpm))

    outs, grads = [], []
    for inputs, mask in zip((x, y), masks, strict=True):
        leaves = inputs.leaves()
        out = call(case, leaves, is_causal=True, key_padding_mask=mask)[:, :, past]
        weight = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape)
        (out.double() * weight).sum().backward()
        outs.append(out.detach())
        grads.append(grads_at(case, leaves, ~future_q, ~future_k))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1]), (outs[0] - outs[1]).abs().max()
    for name, grad in grads[0].items():  # the same up to rounding: backward passes sum in other orders
        torch.testing.assert_close(grad, grads[1][name], msg=lambda m, name=name: f"gradient of {name}: {m}")

"""Properties of whole calls, for every mechanism: batch rows are independent, results are
reproducible, gradients are right, and cached decoding equals the parallel form.

- Batch invariance: whatever the other rows of a batch hold (NaN included), a row's outputs are
  bit-identical; computed alone, they are the same up to rounding.
- Determinism: a repeated call is bit-identical. On 1 thread instead of 2 the results agree to
  rounding only: torch's CPU flash-attention kernel (full's ``sdpa`` backend, the ``fused`` block
  kernels) rounds differently with the thread count for short query blocks (seen for 6 of 60
  fp32 shapes of 1 to 64 queries); subquad's own reductions do not.
- gradcheck in float64 against finite differences, for q, k, v and the extra tensors.
- The decoder (``Mechanism.decoder``), fed the sequence in steps of any size, gives the outputs
  of the parallel causal call.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.autograd import gradcheck

from subquad.kernels.tuning import tuned

from .cases import (
    CONTRACT,
    DTYPES,
    FILLS,
    SEEDS,
    all_cases,
    call,
    call_mechanism,
    cut,
    edit,
    fill_with,
    make_inputs,
    with_batch,
)
from .cases import sizes as sizes_of

CASES = all_cases()


def _is_causal(case, data) -> bool:
    return case.mech.causal and data.draw(st.booleans(), label="is_causal")


@pytest.mark.parametrize("case", CASES)
@CONTRACT
@given(data=st.data(), seed=SEEDS, fill=FILLS, dtype=DTYPES)
def test_a_row_does_not_depend_on_the_other_rows(case, data, seed, fill, dtype):
    size = with_batch(data.draw(sizes_of(case)), data.draw(st.integers(2, 3), label="B"))
    B, L, S = size["B"], size["L"], size["S"]
    is_causal = _is_causal(case, data)
    x = make_inputs(case, **size, dtype=dtype, seed=seed)
    others = torch.arange(B)[:, None] > 0
    y = edit(case, x, others.expand(B, L), others.expand(B, S), fill_with(fill, seed + 1))
    first = call(case, x, is_causal=is_causal)[0]
    assert torch.equal(first, call(case, y, is_causal=is_causal)[0])
    alone = call(case, cut(case, x, slice(None), slice(None), rows=slice(0, 1)), is_causal=is_causal)[0]
    tol = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(first, alone, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES)
@CONTRACT
@given(data=st.data(), seed=SEEDS, dtype=DTYPES)
def test_repeated_calls_are_bit_identical_and_thread_counts_agree(case, data, seed, dtype):
    size = data.draw(sizes_of(case))
    is_causal = _is_causal(case, data)
    x = make_inputs(case, **size, dtype=dtype, seed=seed)
    threads = torch.get_num_threads()
    with tuned(adaptive_threads=0):  # the counts as set, not fewer under load (kernels.threads)
        try:
            torch.set_num_threads(2)
            first, again = call(case, x, is_causal=is_causal), call(case, x, is_causal=is_causal)
            torch.set_num_threads(1)
            single = call(case, x, is_causal=is_causal)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(first, again)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(first, single, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES)
@CONTRACT
@given(data=st.data(), seed=SEEDS)
def test_gradcheck(case, data, seed):
    size = data.draw(sizes_of(case, most=10))
    size.update(B=data.draw(st.integers(1, 2), label="B"), D=3, Dv=2)
    is_causal = _is_causal(case, data)
    pad = data.draw(st.booleans(), label="padding")
    kpm = None
    if pad:
        kpm = torch.rand(size["B"], size["S"], generator=torch.Generator().manual_seed(seed)) > 0.3
    x = make_inputs(case, **size, dtype=torch.float64, seed=seed)
    names = (
        (["q", "k"] if case.mech.uses_qk else []) + ["v"] + [n for n, t in x.extras.items() if t.is_floating_point()]
    )

    def fn(*tensors):
        named = dict(zip(names, tensors, strict=True))
        inputs = type(x)(
            named.get("q", x.q), named.get("k", x.k), named["v"], {n: named.get(n, t) for n, t in x.extras.items()}
        )
        return call(case, inputs, is_causal=is_causal, key_padding_mask=kpm)

    leaves = [getattr(x, n) if n in "qkv" else x.extras[n] for n in names]
    inputs = [t.detach().clone().requires_grad_() for t in leaves]
    # fast_mode: the Jacobian against random directions, not entry by entry (torch's gradcheck docs)
    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4, fast_mode=True)


@pytest.mark.parametrize("case", all_cases(causal=True, decoder=True))
@CONTRACT
@given(data=st.data(), seed=SEEDS)
def test_the_decoder_equals_the_parallel_causal_form(case, data, seed):
    size = data.draw(sizes_of(case, cross=False, most=80))
    N = size["L"]
    x = make_inputs(case, **size, dtype=torch.float64, seed=seed)
    parallel = call(case, x, is_causal=True)
    decoder = case.mech.decoder(case.mech, case.config, None)
    outputs, start = [], 0
    while start < N:
        end = min(N, start + data.draw(st.integers(1, 5), label="step"))
        step = cut(case, x, slice(start, end), slice(start, end))
        outputs.append(decoder.step(step.q, step.k, step.v, **step.extras))
        start = end
    torch.testing.assert_close(torch.cat(outputs, dim=2), parallel, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("case", [p for p in all_cases(causal=True, decoder=True) if p.values[0].mech.decoder.absorbs])
@CONTRACT
@given(data=st.data(), seed=SEEDS)
def test_the_decoder_takes_over_a_padded_prefill_and_decodes_each_row_as_if_alone(case, data, seed):
    """The handover: a left-padded prompt absorbed after the parallel pass, then steps of any size,
    give each row the outputs of the parallel causal form over that row's real tokens alone (its
    sinks are its first real tokens)."""
    N = data.draw(st.integers(2, 60), label="N")
    prompt = data.draw(st.integers(1, N - 1), label="prompt")
    pads = data.draw(st.integers(0, prompt - 1), label="pads")  # row 1's padding, before its first real token
    size = data.draw(sizes_of(case, cross=False, most=N))
    x = make_inputs(case, **{**size, "B": 2, "L": N, "S": N}, dtype=torch.float64, seed=seed)
    real = torch.ones(2, prompt, dtype=torch.bool)
    real[1, :pads] = False
    decoder = case.mech.decoder(case.mech, case.config, None)
    start = cut(case, x, slice(0, prompt), slice(0, prompt))
    decoder.absorb(start.q, start.k, start.v, real, **start.extras)
    outputs, at = [], prompt
    while at < N:
        end = min(N, at + data.draw(st.integers(1, 5), label="step"))
        step = cut(case, x, slice(at, end), slice(at, end))
        outputs.append(decoder.step(step.q, step.k, step.v, **step.extras))
        at = end
    decoded = torch.cat(outputs, dim=2)
    for row, first in ((0, 0), (1, pads)):
        alone = call(case, cut(case, x, slice(first, N), slice(first, N), rows=slice(row, row + 1)), is_causal=True)
        torch.testing.assert_close(decoded[row : row + 1], alone[:, :, prompt - first :], rtol=1e-9, atol=1e-10)
    assert decoder.length == N


@pytest.mark.parametrize("case", CASES)
def test_scale_is_used_where_the_mechanism_says_it_applies_and_refused_elsewhere(case):
    """``Mechanism.takes_scale``: a softmax temperature changes the output; without one, any scale raises."""
    x = make_inputs(case, B=1, H=2, L=256, S=256, D=8, Dv=8, dtype=torch.float64, seed=3)  # several keys a tile
    tensors = dict(x.extras)
    if case.mech.takes_scale(case.config):
        default = call_mechanism(case.mech, x.q, x.k, x.v, config=case.config, **tensors)
        assert torch.equal(
            default, call_mechanism(case.mech, x.q, x.k, x.v, config=case.config, scale=8**-0.5, **tensors)
        )
        hotter = call_mechanism(case.mech, x.q, x.k, x.v, config=case.config, scale=2.0, **tensors)
        assert not torch.allclose(default, hotter)
    else:
        with pytest.raises(ValueError, match=r"scale"):
            call_mechanism(case.mech, x.q, x.k, x.v, config=case.config, scale=8**-0.5, **tensors)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("L", "S"), [(64, 64), (61, 61), (24, 40)])
def test_the_output_is_contiguous_as_sdpas(case, L, S):
    """SDPA's output is a contiguous ``(B, H, L, Dv)`` tensor, so ``out.view(B, -1)`` works on it; so
    does ours, whatever spare rows a kernel computed in (the block engine's empty query slots)."""
    x = make_inputs(case, B=2, H=4, L=L, S=S, D=8, Dv=8, dtype=torch.float32, seed=1)
    padded = torch.ones(2, S, dtype=torch.bool)
    padded[1, S - 3 :] = False
    for is_causal in (False, True) if case.mech.causal else (False,):
        for key_padding_mask in (None, padded):
            out = call(case, x, is_causal=is_causal, key_padding_mask=key_padding_mask)
            assert out.is_contiguous(), (is_causal, key_padding_mask is not None, out.stride())
            assert out.view(2, -1).shape == (2, 4 * L * 8)

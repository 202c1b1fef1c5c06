"""The whole-sequence scans that run off the CPU (``ops.scan.whole_scan``) compute what the CPU's
block-by-block scans compute.

On a GPU the causal products of linear and multires attention and non-causal linear attention run
as whole-sequence ops under autograd. Here they are forced on the CPU and compared in
float64 with the block forms (each checked against full attention under its dense mask by the
mechanism's own tests): outputs and gradients, with padding, cross shapes (L < S and L > S), an
initial state and partial last chunks. ``tests/test_cuda.py`` runs the same calls on a GPU.
"""

import collections

import pytest
import torch

import subquad
from subquad.call import call
from subquad.kernels.tuning import tuned
from subquad.mechanisms import linear as linear_module
from subquad.ops import scan
from subquad.ops.linear_blocks import causal_whole
from subquad.registry import get_mechanism, make_config

from .conftest import padding, qkv, randn

# case -> (mechanism, options): every path that goes through a whole-sequence scan off the CPU
CASES = {
    "linear": ("linear", {"chunk": 5}),
    "linear-relu": ("linear", {"feature_map": "relu", "chunk": 3}),
    "linear-hedgehog": ("linear", {"feature_map": "hedgehog", "chunk": 4}),
    "linear-window": ("linear", {"window": 3, "sinks": 2, "chunk": 2}),
    "multires": ("multires", {"rates": (0.5, 0.25, 0.2, 0.1)}),
}


# (case, is_causal) -> the whole form the call must go through (None: it has no scan)
_WHOLE = {(case, causal): "causal_whole" if causal else "noncausal_whole" for case in CASES for causal in (False, True)}
_WHOLE.update({("linear-window", False): "causal_dot_whole", ("linear-window", True): "causal_dot_whole",
               ("multires", False): None, ("multires", True): "causal_dot_whole"})  # fmt: skip


def _force(monkeypatch) -> collections.Counter:
    """Force the whole-sequence forms on the CPU (where they are otherwise never taken); returns
    the count of calls of each whole form, so a test sees that they ran."""
    calls = collections.Counter()
    for module in (scan, linear_module):
        monkeypatch.setattr(module, "whole_scan", lambda device: True)
    for module, name in ((linear_module, "causal_whole"), (linear_module, "noncausal_whole"),
                         (scan, "causal_dot_whole")):  # fmt: skip
        monkeypatch.setattr(module, name, _counted(getattr(module, name), name, calls))
    return calls


def _counted(fn, name, calls):
    def wrapper(*args):
        calls[name] += 1
        return fn(*args)

    return wrapper


@pytest.fixture
def whole(monkeypatch):
    _force(monkeypatch)


def _run(case, is_causal, L, S, dtype=torch.float64):
    """One call and its gradients (q, k, v and any logits), as float64."""
    mech = get_mechanism(CASES[case][0])
    config = make_config(mech, **CASES[case][1])
    q, k, v = qkv(2, 4, L, S, 8, seed=1)
    tensors = (
        {} if mech.example_tensors is None else mech.example_tensors(q, k, v, config, torch.Generator().manual_seed(5))
    )
    if "query_padding_mask" in mech.tensor_args:
        tensors["query_padding_mask"] = padding(2, L, seed=6)
    tensors = {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
    inputs = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    inputs += [t.requires_grad_() for t in tensors.values() if t.is_floating_point()]
    state = mech.state(config, 4, 8, 7).to(dtype) if mech.state is not None else None
    out = call(mech, *inputs[:3], key_padding_mask=padding(2, S, seed=2), is_causal=is_causal, config=config,
               state=state, **tensors)  # fmt: skip
    grads = torch.autograd.grad(out, inputs, torch.ones_like(out).cos(), allow_unused=True, materialize_grads=True)
    return out.detach().double(), [g.double() for g in grads]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("L", "S"), [(23, 23), (9, 23), (23, 9)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_the_whole_sequence_form_equals_the_block_form(case, L, S, is_causal, monkeypatch):
    blocks = _run(case, is_causal, L, S)
    calls = _force(monkeypatch)
    whole = _run(case, is_causal, L, S)
    expected = _WHOLE[case, is_causal]
    if expected is not None:
        assert calls[expected], f"{case}: the whole form {expected} did not run ({dict(calls)})"
    else:
        assert not calls, calls
    torch.testing.assert_close(whole[0], blocks[0], rtol=1e-10, atol=1e-12)
    for g_whole, g_blocks in zip(whole[1], blocks[1]):
        torch.testing.assert_close(g_whole, g_blocks, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 4, 7, 30])
def test_the_whole_causal_product_equals_the_chunked_function_with_an_initial_state(chunk):
    a, b, c = randn(3, 22, 5, seed=1), randn(3, 22, 5, seed=2), randn(3, 22, 4, seed=3)
    initial = randn(3, 5, 4, seed=4)
    inputs = [x.clone().requires_grad_() for x in (a, b, c, initial)]
    expected = scan.causal_dot(*inputs, chunk=chunk)  # the CPU's Function
    expected_grads = torch.autograd.grad(expected, inputs, torch.ones_like(expected).sin())
    dense = torch.einsum("rid,rjd->rij", a, b).tril() @ c + a @ initial  # the product's definition
    torch.testing.assert_close(expected, dense, rtol=1e-10, atol=1e-12)
    got = scan.causal_dot_whole(*inputs, chunk)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    for g, e in zip(torch.autograd.grad(got, inputs, torch.ones_like(got).sin()), expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_entering_states_start_from_the_first_and_add_the_earlier_chunks():
    updates, first = randn(2, 5, 3, seed=7), randn(2, 3, seed=8)
    states = scan.entering(updates, first, 1)
    torch.testing.assert_close(states[:, 0], first)
    for j in range(1, 5):
        torch.testing.assert_close(states[:, j], first + updates[:, :j].sum(1))
    torch.testing.assert_close(scan.entering(updates, None, 1)[:, 0], torch.zeros(2, 3, dtype=torch.float64))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_with_fp32_states_stay_close_to_float64(is_causal, dtype, whole):
    # bf16 inputs enter the whole form's products as bf16, fp16 ones as fp32; states and normaliser stay fp32
    ref, _ = _run("linear", is_causal, 200, 200)
    out, grads = _run("linear", is_causal, 200, 200, dtype=dtype)
    torch.testing.assert_close(out, ref, rtol=3e-2, atol=3e-2)
    assert all(torch.isfinite(g).all() for g in grads)


def test_the_whole_causal_form_reads_its_initial_state_as_the_block_form_does():
    from subquad.ops.linear_blocks import Causal

    q, k, v = qkv(1, 2, 17, 17, 6, seed=9)
    initial = randn(1, 2, 6, 7, seed=10).abs()  # (D, Dv + 1): S and z of keys before the queries
    expected = Causal.apply(q, k, v, None, initial, "elu", 1e-6, 4)
    torch.testing.assert_close(causal_whole(q, k, v, None, initial, "elu", 1e-6, 4), expected, rtol=1e-10, atol=1e-12)


def test_whole_scans_run_off_the_cpu_while_the_switch_is_on():
    assert not scan.whole_scan(torch.device("cpu"))
    assert scan.whole_scan(torch.device("cuda"))
    assert scan.whole_scan(torch.device("mps"))
    with tuned(whole_scan=0):
        assert not scan.whole_scan(torch.device("cuda"))


@pytest.mark.parametrize(("L", "S"), [(19, 19), (7, 19), (19, 7)])
def test_the_whole_non_causal_form_equals_the_block_function_with_padding(L, S):
    from subquad.ops.linear_blocks import NonCausal, noncausal_whole

    q, k, v = (x.requires_grad_() for x in qkv(2, 3, L, S, 6, Dv=5, seed=11))
    mask = padding(2, S, seed=12)
    expected = NonCausal.apply(q, k, v, mask, "elu", 1e-6)
    got = noncausal_whole(q, k, v, mask, "elu", 1e-6)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    grad = torch.ones_like(got).sin()
    for g, e in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("is_causal", [False, True])
def test_fp16_inputs_multiply_in_fp32_where_fp16_products_would_overflow(is_causal, whole):
    # φ(q)·φ(k) summed over 2,048 keys of large values passes fp16's 65,504; fp32 products do not
    g = torch.Generator().manual_seed(13)
    q, k = (20 * torch.randn(1, 2, 2048, 16, generator=g) for _ in range(2))
    v = 50 * torch.randn(1, 2, 2048, 16, generator=g) + 200
    out = subquad.attention(q.half(), k.half(), v.half(), mechanism="linear", is_causal=is_causal)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    ref = subquad.attention(q.double(), k.double(), v.double(), mechanism="linear", is_causal=is_causal)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def test_bf16_inputs_sum_their_chunk_states_in_fp32(monkeypatch, whole):
    from subquad.ops import linear_blocks

    dtypes = []
    real = linear_blocks.entering
    monkeypatch.setattr(linear_blocks, "entering", lambda u, first, dim: dtypes.append(u.dtype) or real(u, first, dim))
    q, k, v = qkv(1, 2, 40, 40, 8, dtype=torch.bfloat16, seed=14)
    subquad.attention(q, k, v, mechanism="linear", is_causal=True, chunk=8)
    assert dtypes == [torch.float32, torch.float32]  # Σ φ(k) vᵀ and Σ φ(k) across chunks

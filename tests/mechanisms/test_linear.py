import functools
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

import subquad
import subquad.nn
from subquad.kernels.memory import new_buffers
from subquad.kernels.tuning import TUNING
from subquad.mechanisms.linear import LinearConfig, LinearDecoder, linear_attention
from subquad.ops.features import feature_map
from subquad.ops.scan import causal_dot
from subquad.registry import get_mechanism

from ..conftest import padding, qkv, randn


def dense_linear(q, k, v, kpm, is_causal, fm="elu", eps=1e-6, phi=None):
    """φ(Q)φ(K)ᵀ under the contract's mask, normalised by its row sums + ε, times V (φ: the named
    feature map ``fm``, or ``phi``)."""
    phi = phi or (lambda x: feature_map(x, fm))
    L, S = q.shape[2], k.shape[2]
    scores = phi(q) @ phi(k).transpose(-1, -2)
    mask = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        mask = torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L)
    if kpm is not None:
        mask = mask & kpm[:, None, None, :]
    scores = scores * mask
    return (scores @ v) / (scores.sum(-1, keepdim=True) + eps)


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 2), H=st.integers(1, 3), L=st.integers(1, 40), S=st.integers(1, 40),
    D=st.sampled_from([1, 4, 8]), Dv=st.sampled_from([1, 5]), is_causal=st.booleans(), pad=st.booleans(),
    fm=st.sampled_from(["elu", "relu"]), chunk=st.sampled_from([1, 3, 7, 16, 64]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_linear_equals_the_dense_reference(B, H, L, S, D, Dv, is_causal, pad, fm, chunk, seed):
    q, k, v = qkv(B, H, L, S, D, Dv, seed=seed)
    kpm = padding(B, S, seed) if pad else None
    out = linear_attention(
        q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=LinearConfig(feature_map=fm, chunk=chunk)
    )
    assert (out - dense_linear(q, k, v, kpm, is_causal, fm)).abs().max() <= 1e-10


@pytest.mark.parametrize("chunk", [1, 2, 5, 13, 32, 100, 1000])
def test_causal_chunked_equals_unchunked(chunk):
    """Chunk sizes that do and do not divide N (N = 100) give the same result as one chunk."""
    q, k, v = qkv(2, 3, 100, 100, 8, 6)
    kpm = padding(2, 100, seed=1)
    reference = linear_attention(q, k, v, key_padding_mask=kpm, is_causal=True, config=LinearConfig(chunk=100))
    out = linear_attention(q, k, v, key_padding_mask=kpm, is_causal=True, config=LinearConfig(chunk=chunk))
    assert (out - reference).abs().max() <= 1e-12


@pytest.mark.parametrize(("L", "S"), [(97, 97), (90, 97), (97, 90)])
def test_block_boundaries_carry_the_state(monkeypatch, L, S):
    """Many chunks processed one at a time in all three sweeps (forward, ∂q forwards in time, ∂k and
    ∂v backwards in time) give the dense reference's values and gradients."""

    q, k, v = (x.requires_grad_(True) for x in qkv(1, 2, L, S, 4, 3))
    kpm = padding(1, S, seed=2)
    expected = dense_linear(q, k, v, kpm, True)
    grads = torch.autograd.grad(expected, (q, k, v), torch.ones_like(expected))
    monkeypatch.setattr(TUNING, "linear_state_block", 1)  # one chunk per block
    out = linear_attention(q, k, v, key_padding_mask=kpm, is_causal=True, config=LinearConfig(chunk=4))
    assert (out - expected).abs().max() <= 1e-12
    for got, want in zip(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)), grads, strict=True):
        assert (got - want).abs().max() <= 1e-10


def test_zero_features_and_unseen_keys_give_zeros_not_nan():
    """ReLU features of an all-negative query are 0: ε keeps the output at 0. A query that sees no key
    (all keys padded, or causal with L > S) returns zeros with finite gradients."""
    q, k, v = (x.requires_grad_(True) for x in qkv(2, 2, 6, 4, 3))
    with torch.no_grad():
        q[0, 0, 0] = -1.0
    kpm = torch.tensor([[True, True, False, True], [False] * 4])
    out = linear_attention(q, k, v, key_padding_mask=kpm, is_causal=True, config=LinearConfig(feature_map="relu"))
    assert torch.isfinite(out).all()
    assert (out[0, 0, 0] == 0).all() and (out[1] == 0).all() and (out[:, :, :2] == 0).all()
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("fm", ["elu", "relu"])
@pytest.mark.parametrize(("L", "S"), [(11, 11), (7, 11), (11, 7)])
def test_gradcheck(is_causal, fm, L, S):
    q, k, v = (x.requires_grad_(True) for x in qkv(1, 2, L, S, 4, 3))
    kpm = padding(1, S, seed=3)
    config = LinearConfig(feature_map=fm, chunk=4)
    assert gradcheck(
        lambda q, k, v: linear_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=config), (q, k, v)
    )


def test_causal_dot_gradcheck_with_an_initial_state():
    a, b = randn(2, 13, 4, seed=1), randn(2, 13, 4, seed=2)
    c, initial = randn(2, 13, 3, seed=3), randn(2, 4, 3, seed=4)
    inputs = tuple(x.requires_grad_(True) for x in (a, b, c, initial))
    assert gradcheck(lambda a, b, c, s: causal_dot(a, b, c, s, chunk=5), inputs)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("fm", ["elu", "relu"])
def test_low_precision_accumulates_in_fp32(dtype, tol, is_causal, fm):
    q, k, v = (x.to(dtype).requires_grad_() for x in qkv(2, 2, 300, 300, 16))
    config = LinearConfig(feature_map=fm)
    out = linear_attention(q, k, v, is_causal=is_causal, config=config)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = linear_attention(q64, k64, v64, is_causal=is_causal, config=config)
    assert out.dtype == dtype
    assert (out.double() - ref).abs().max() <= tol * ref.abs().max()
    grad = torch.randn_like(ref)
    lows, highs = torch.autograd.grad(out, (q, k, v), grad.to(dtype)), torch.autograd.grad(ref, (q64, k64, v64), grad)
    for low, high in zip(lows, highs):
        assert low.dtype == dtype and (low.double() - high).abs().max() <= 4 * tol * high.abs().max()


# --------------------------------------------------------------------------------------------
# Recurrent decoding
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fm", ["elu", "relu"])
def test_recurrent_equals_parallel_token_by_token_over_200_steps(fm):
    q, k, v = qkv(2, 3, 200, 200, 8, 5)
    config = LinearConfig(feature_map=fm, chunk=16)
    parallel = linear_attention(q, k, v, is_causal=True, config=config)
    decoder = LinearDecoder(get_mechanism("linear"), config, None)
    steps = [decoder.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]) for t in range(200)]
    assert (torch.cat(steps, dim=2) - parallel).abs().max() <= 1e-12
    assert decoder.sums.shape == (2, 3, 8, 6), "the state is O(D·Dv) per head, whatever the prefix"


def test_prefill_then_steps_equals_parallel():
    q, k, v = qkv(1, 2, 50, 50, 4)
    parallel = linear_attention(q, k, v, is_causal=True)
    decoder = LinearDecoder(get_mechanism("linear"), LinearConfig(), None)
    first = decoder.step(q[:, :, :37], k[:, :, :37], v[:, :, :37])
    rest = [decoder.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]) for t in range(37, 50)]
    assert (torch.cat([first, *rest], dim=2) - parallel).abs().max() <= 1e-12


def test_decoder_rejects_a_different_batch():
    decoder = LinearDecoder(get_mechanism("linear"), LinearConfig(), None)
    decoder.step(*qkv(2, 2, 1, 1, 4))
    with pytest.raises(ValueError, match=r"holds state for \(B, H, D, Dv\) = \(2, 2, 4, 4\), got \(3, 2, 4, 4\)"):
        decoder.step(*qkv(3, 2, 1, 1, 4))
    with pytest.raises(ValueError, match="as many queries as keys, got 1 and 2"):
        decoder.step(*qkv(2, 2, 1, 2, 4))


@pytest.mark.parametrize("position", ["learned", "conv"])
def test_generate_gives_the_same_tokens_with_and_without_the_cache(position):
    torch.manual_seed(0)
    model = subquad.nn.CausalLM(37, 32, 2, 4, attention="linear", max_len=80, position=position).double()
    prompt = torch.randint(0, 37, (2, 9))
    cached = model.generate(prompt, 60)
    uncached = model.generate(prompt, 60, use_cache=False)
    assert torch.equal(cached, uncached)
    assert get_mechanism("linear").recurrent


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_scale_is_refused():
    with pytest.raises(ValueError, match="linear attention has no softmax scale; leave scale=None .got 0.5."):
        subquad.attention(*qkv(), mechanism="linear", scale=0.5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"feature_map": "softmax"}, "feature_map must be one of 'elu', 'relu', 'hedgehog', got 'softmax'"),
        ({"eps": 0.0}, "eps must be > 0, got 0.0"),
        ({"chunk": 0}, "chunk must be >= 1, got 0"),
        ({"sinks": 2}, r"sinks=2 joins the first keys to the softmax window, but window is 0; set window=w > 0"),
        ({"sinks": -1, "window": 2}, "sinks must be >= 0, got -1"),
    ],
)
def test_bad_options_raise(options, message):
    with pytest.raises(ValueError, match=message):
        subquad.attention(*qkv(), mechanism="linear", **options)


def test_elu_feature_map_is_elu_plus_one_with_its_gradient():
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64).requires_grad_(True)
    y = feature_map(x, "elu")
    expected = torch.nn.functional.elu(x) + 1
    assert (y - expected).abs().max() <= 1e-15
    (grad,) = torch.autograd.grad(y.sum(), x)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    assert (grad - expected_grad).abs().max() <= 1e-15
    with torch.no_grad():
        assert (feature_map(x, "elu") - expected).abs().max() <= 1e-15


def test_elu_feature_map_in_float32_is_accurate():
    # fp32 and lower take exp through exp2; the error stays that of float32 arithmetic
    x = torch.linspace(-12, 12, 100001)
    expected = torch.nn.functional.elu(x.double()) + 1
    with torch.no_grad():
        y = feature_map(x, "elu")
    assert y.dtype == torch.float32
    assert ((y.double() - expected).abs() / expected).max() <= 1e-6


def test_unknown_feature_map_raises():
    with pytest.raises(ValueError, match="unknown feature map 'tanh'; choose elu or relu"):
        feature_map(torch.zeros(1), "tanh")


def test_non_causal_blocks_forward_and_backward(monkeypatch):
    """One position per block in both passes of the non-causal Function: values and gradients."""

    q, k, v = (x.requires_grad_(True) for x in qkv(1, 2, 9, 7, 3, 2))
    kpm = padding(1, 7, seed=1)
    expected = dense_linear(q, k, v, kpm, False)
    monkeypatch.setattr(TUNING, "linear_block", 1)
    out = linear_attention(q, k, v, key_padding_mask=kpm)
    assert (out - expected).abs().max() <= 1e-12
    for fm in ("elu", "relu"):
        fn = functools.partial(linear_attention, key_padding_mask=kpm, config=LinearConfig(feature_map=fm))
        assert gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("fm", ["elu", "relu"])
@pytest.mark.parametrize(("L", "S"), [(97, 97), (90, 97), (97, 90)])
def test_blocks_of_several_chunks_in_float64_and_float32(monkeypatch, fm, L, S):
    """Blocks of three chunks (the last one partial) with padding, their buffers filled with NaN
    before use: float64 equals the dense reference, and float32 (for elu, φ(q) and φ(k) in one
    pass) stays within its rounding."""
    from subquad.ops import linear_blocks as linear

    def poisoned(shapes, dtype, device, zero):
        buffers = new_buffers(shapes, dtype, device, zero=False)
        for b in buffers:
            b.fill_(0.0 if zero else float("nan"))
        return buffers

    q, k, v = qkv(2, 2, L, S, 4, 3)
    kpm = padding(2, S, seed=3)
    expected = dense_linear(q, k, v, kpm, True, fm)
    monkeypatch.setattr(TUNING, "linear_state_block", 3 * 2 * 2 * 4 * (3 + 1))  # 3 chunks × B·H·D·(Dv + 1)
    monkeypatch.setattr(linear, "new_buffers", poisoned)
    config = LinearConfig(feature_map=fm, chunk=4)
    out = linear_attention(q, k, v, key_padding_mask=kpm, is_causal=True, config=config)
    assert (out - expected).abs().max() <= 1e-12
    low = linear_attention(q.float(), k.float(), v.float(), key_padding_mask=kpm, is_causal=True, config=config)
    assert (low.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("is_causal", [False, True])
def test_gradients_keep_the_strides_of_transposed_inputs(is_causal):
    """The nn layers pass (B, N, H, D) projections transposed to (B, H, N, D); gradients in the same
    layout flow back through the transpose and view without a copy."""
    base = [randn(2, 40, 3, 4, seed=i).requires_grad_() for i in range(3)]
    q, k, v = (x.transpose(1, 2) for x in base)
    strides = []
    for x in (q, k, v):
        x.register_hook(lambda g: strides.append(g.stride()))
    linear_attention(q, k, v, is_causal=is_causal).sum().backward()
    assert strides == [q.stride()] * 3


# --- learned feature maps (hedgehog) ----------------------------------------------------------


def _hedgehog_state(H, D, seed=0, dtype=torch.float64):
    """A LinearState with random (not initial) maps, so tests see W and b at work."""
    from subquad.mechanisms.linear import LinearState

    state = LinearState(LinearConfig(feature_map="hedgehog"), H, D).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        state.weight.copy_(torch.randn(state.weight.shape, generator=g, dtype=dtype))
        state.bias.copy_(torch.randn(state.bias.shape, generator=g, dtype=dtype))
    return state


def dense_hedgehog(q, k, v, kpm, is_causal, state, eps=1e-6):
    """Hedgehog's φ written out per head, then the dense kernel attention under the mask."""

    def phi(x):
        t = torch.einsum("bhnd,hde->bhne", x, state.weight) + state.bias[:, None, :]
        return torch.cat([torch.softmax(t, -1), torch.softmax(-t, -1)], -1)

    return dense_linear(q, k, v, kpm, is_causal, eps=eps, phi=phi)


@pytest.mark.parametrize(("L", "S"), [(23, 23), (9, 23), (23, 9)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_hedgehog_equals_the_dense_reference(L, S, is_causal):
    q, k, v = qkv(2, 3, L, S, 4, 5, seed=3)
    kpm = padding(2, S, seed=2)
    state = _hedgehog_state(3, 4)
    config = LinearConfig(feature_map="hedgehog", chunk=4)
    out = linear_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=config, state=state)
    assert (out - dense_hedgehog(q, k, v, kpm, is_causal, state)).abs().max() <= 1e-10


def test_hedgehog_starts_at_the_identity_map_and_a_missing_state_is_that_map():
    from subquad.mechanisms.linear import LinearState

    config = LinearConfig(feature_map="hedgehog")
    state = LinearState(config, 3, 4).double()
    assert torch.equal(state.weight, torch.eye(4, dtype=torch.float64).expand(3, 4, 4))
    assert torch.equal(state.bias, torch.zeros(3, 4, dtype=torch.float64))
    q, k, v = qkv(1, 3, 10, 10, 4, 4, seed=1)
    with torch.no_grad():  # the same path for both (a missing state's map is frozen: nothing would train it)
        given, missing = (linear_attention(q, k, v, config=config, state=x) for x in (state, None))
        assert torch.equal(given, missing)
    assert not linear_attention(q, k, v, config=config).requires_grad


@pytest.mark.parametrize("is_causal", [False, True])
def test_hedgehog_gradients_reach_the_maps(is_causal):
    """gradcheck through q, k, v and the learned W and b: what distillation trains."""
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 7, 7, 3, 2, seed=4))
    config = LinearConfig(feature_map="hedgehog", chunk=3)

    class Call(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.state = _hedgehog_state(2, 3, seed=5)

        def forward(self, q, k, v):
            return linear_attention(q, k, v, is_causal=is_causal, config=config, state=self.state)

    call = Call()
    weight = call.state.weight.detach().clone().requires_grad_()
    bias = call.state.bias.detach().clone().requires_grad_()
    f = lambda q, k, v, w, b: torch.func.functional_call(call, {"state.weight": w, "state.bias": b}, (q, k, v))
    assert gradcheck(f, (q, k, v, weight, bias))


def test_hedgehog_decoding_equals_the_parallel_pass():
    from subquad.mechanisms.linear import LinearState

    state = _hedgehog_state(2, 4, seed=6)
    config = LinearConfig(feature_map="hedgehog", chunk=3)
    q, k, v = qkv(1, 2, 12, 12, 4, 3, seed=7)
    parallel = linear_attention(q, k, v, is_causal=True, config=config, state=state)
    decoder = LinearDecoder(get_mechanism("linear"), config, state)
    steps = [decoder.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1]) for i in range(12)]
    assert (torch.cat(steps, 2) - parallel).abs().max() <= 1e-10
    assert isinstance(state, LinearState)


def test_hedgehog_refuses_a_state_of_another_kind_or_shape():
    from subquad.mechanisms.linear import LinearState

    config = LinearConfig(feature_map="hedgehog")
    q, k, v = qkv(1, 2, 5, 5, 4, 4)
    with pytest.raises(ValueError, match="built with that config, got one built for another feature map"):
        linear_attention(q, k, v, config=config, state=LinearState(LinearConfig(), 2, 4))
    with pytest.raises(ValueError, match="built with that config, got RoutingState"):
        routing = get_mechanism("routing")
        linear_attention(q, k, v, config=config, state=routing.state(subquad.make_config(routing), 2, 4))
    with pytest.raises(ValueError, match=r"maps are \(heads, head_dim, head_dim\) = \(3, 4, 4\) but this call needs"):
        linear_attention(q, k, v, config=config, state=LinearState(config, 3, 4).double())


# --- a softmax window (LoLCATs-style hybrid) ----------------------------------------------------


def dense_windowed(q, k, v, kpm, is_causal, w, phi, eps=1e-6, sinks=0):
    """Softmax over local's window and the sinks, kernel weights elsewhere, written out with dense masks."""
    L, S = q.shape[2], k.shape[2]
    p = torch.arange(L)[:, None] + (S - L)
    j = torch.arange(S)[None, :]
    visible = j <= p if is_causal else torch.ones(L, S, dtype=torch.bool)
    near = ((j > p - w) | (j < sinks)) & visible if is_causal else ((j - p).abs() < w) | (j < sinks)
    far = visible & ~near
    real = torch.ones(q.shape[0], S, dtype=torch.bool) if kpm is None else kpm
    near, far = near & real[:, None, None, :], far & real[:, None, None, :]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    soft = torch.softmax(scores.masked_fill(~near, float("-inf")), -1).nan_to_num(0.0)
    mass = near.any(-1, keepdim=True).to(q.dtype)
    kernel = (phi(q) @ phi(k).transpose(-1, -2)) * far
    return (mass * (soft @ v) + kernel @ v) / (mass + kernel.sum(-1, keepdim=True) + eps)


@settings(max_examples=40, deadline=None)
@given(
    L=st.integers(1, 30), S=st.integers(1, 30), w=st.integers(1, 12), is_causal=st.booleans(), pad=st.booleans(),
    hedgehog=st.booleans(), chunk=st.sampled_from([1, 3, 8]), sinks=st.sampled_from([0, 0, 1, 3, 40]),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_a_window_equals_the_dense_reference(L, S, w, is_causal, pad, hedgehog, chunk, sinks, seed):
    q, k, v = qkv(2, 3, L, S, 4, 5, seed=seed)
    kpm = padding(2, S, seed) if pad else None
    state = _hedgehog_state(3, 4, seed=seed) if hedgehog else None
    config = LinearConfig(feature_map="hedgehog" if hedgehog else "elu", window=w, chunk=chunk, sinks=sinks)
    phi = (lambda x: learned(x, state)) if hedgehog else (lambda x: feature_map(x, "elu"))
    out = linear_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=config, state=state)
    assert (out - dense_windowed(q, k, v, kpm, is_causal, w, phi, sinks=sinks)).abs().max() <= 1e-10


def learned(x, state):
    from subquad.mechanisms.linear import learned_features

    return learned_features(x, state)


@pytest.mark.parametrize("grad", [True, False])
def test_hedgehog_features_are_both_softmaxes_with_and_without_autograd(grad):
    """Inference builds the two softmaxes in one buffer; they are the written-out map either way,
    and a windowed call with sinks (whose key features it zeroes in place) returns what the
    recorded call returns."""
    state = _hedgehog_state(3, 4, seed=2)
    x = torch.randn(2, 3, 7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    t = torch.einsum("bhnd,hde->bhne", x, state.weight.detach()) + state.bias.detach()[None, :, None]
    with torch.set_grad_enabled(grad):
        got = learned(x, state)
    assert got.requires_grad == grad
    assert (got - torch.cat([torch.softmax(t, -1), torch.softmax(-t, -1)], -1)).abs().max() <= 1e-14
    q, k, v = qkv(2, 3, 9, 9, 4, 5, seed=4)
    config = LinearConfig(feature_map="hedgehog", window=3, sinks=2, chunk=2)
    recorded = linear_attention(q, k, v, is_causal=True, config=config, state=state)
    with torch.no_grad():
        assert (linear_attention(q, k, v, is_causal=True, config=config, state=state) - recorded).abs().max() <= 1e-14


def test_a_window_takes_the_softmax_scale_and_without_one_refuses_it():
    q, k, v = qkv(1, 2, 12, 12, 4, 4, seed=2)
    config = LinearConfig(window=3)
    default = linear_attention(q, k, v, config=config)
    assert torch.equal(
        linear_attention(q, k, v, config=config, scale=0.5), linear_attention(q, k, v, config=config, scale=0.5)
    )
    assert not torch.allclose(linear_attention(q, k, v, config=config, scale=2.0), default)
    assert get_mechanism("linear").takes_scale(config) and not get_mechanism("linear").takes_scale(LinearConfig())


def test_a_window_covering_every_key_is_softmax_attention():
    q, k, v = qkv(2, 2, 15, 15, 4, 3, seed=3)
    kpm = padding(2, 15, seed=3)
    for is_causal in (False, True):
        out = linear_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=LinearConfig(window=15))
        mask = kpm[:, None, None, :] & (torch.ones(15, 15, dtype=torch.bool).tril() if is_causal else True)
        reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(out, reference / (1 + 1e-6), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("hedgehog", [False, True])
def test_windowed_decoding_equals_the_parallel_pass_in_steps_of_any_size(hedgehog):
    state = _hedgehog_state(2, 4, seed=8) if hedgehog else None
    config = LinearConfig(feature_map="hedgehog" if hedgehog else "elu", window=5, chunk=3)
    q, k, v = qkv(1, 2, 23, 23, 4, 3, seed=9)
    parallel = linear_attention(q, k, v, is_causal=True, config=config, state=state)
    decoder = LinearDecoder(get_mechanism("linear"), config, state)
    cuts = [0, 1, 2, 9, 10, 16, 23]
    steps = [decoder.step(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]) for a, b in itertools.pairwise(cuts)]
    assert (torch.cat(steps, 2) - parallel).abs().max() <= 1e-10
    assert decoder.kept.keys.shape[2] == 5  # the last window keys kept (one of them out of view), the rest summed
    assert sorted(decoder.kept.positions[0].tolist()) == [18, 19, 20, 21, 22]


@pytest.mark.parametrize("cuts", [[0, 1, 2, 3, 9, 10, 16, 31], [0, 31], [0, 2, 31]])
def test_sinks_stay_exact_in_decoding_and_equal_the_parallel_pass(cuts):
    state = _hedgehog_state(2, 4, seed=4)
    config = LinearConfig(feature_map="hedgehog", window=5, sinks=3, chunk=3)
    q, k, v = qkv(1, 2, 31, 31, 4, 3, seed=5)
    k[:, :, 0] *= 6  # a strong sink: the windowed kernel alone would differ from it markedly
    parallel = linear_attention(q, k, v, is_causal=True, config=config, state=state)
    phi = lambda x: learned(x, state)
    assert (parallel - dense_windowed(q, k, v, None, True, 5, phi, sinks=3)).abs().max() <= 1e-10
    plain = LinearConfig(feature_map="hedgehog", window=5)
    without = linear_attention(q, k, v, is_causal=True, config=plain, state=state)
    assert (parallel - without)[:, :, 8:].abs().max() > 1e-3  # the sinks matter once out of the window
    decoder = LinearDecoder(get_mechanism("linear"), config, state)
    steps = [decoder.step(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]) for a, b in itertools.pairwise(cuts)]
    assert (torch.cat(steps, 2) - parallel).abs().max() <= 1e-10
    kept = decoder.kept  # the sinks, then the last 5 keys (in slots of any order)
    order = kept.positions[0].argsort()
    assert kept.positions[0, order].tolist() == [0, 1, 2, 26, 27, 28, 29, 30]
    assert torch.equal(kept.keys[:, :, order], k[:, :, [0, 1, 2, 26, 27, 28, 29, 30]])

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck
from torch.utils._python_dispatch import TorchDispatchMode

import subquad
import subquad.nn
from subquad.kernels.tuning import TUNING
from subquad.mechanisms.linear import LinearConfig, linear_attention
from subquad.mechanisms.multires import (
    MultiresConfig,
    MultiresInputs,
    MultiresState,
    multires_attention,
)
from subquad.ops.features import feature_map
from subquad.ops.segments import segment_length, segment_means
from subquad.registry import get_mechanism

from ..conftest import padding, qkv, randn

RATES = (0.5, 0.25, 1 / 3, 1.0)  # ℓ = 2, 4, 3, 1


def averaging_matrix(S, length, kpm, b, causal_at=None):
    """Dense (n, S) matrix of the segment means of batch row b: A[s, j] = [j in segment s, real] / count.
    With ``causal_at`` = p, the segments are those of the prefix [0, p]."""
    n = -(-S // length)
    A = torch.zeros(n, S, dtype=torch.float64)
    for s in range(n):
        members = [j for j in range(s * length, min((s + 1) * length, S)) if kpm is None or bool(kpm[b, j])]
        if causal_at is not None:
            members = [j for j in members if j <= causal_at]
        for j in members:
            A[s, j] = 1 / len(members)
    return A


def dense_multires(q, k, v, kpm, is_causal, logits, config):
    """The paper's equations, query by query: the router (eq. 6) picks argmax P and weights by it;
    head h attends (eq. 7) to the landmarks A k, A v of its resolution; empty segments are no landmark.
    Causal: the landmarks of the prefix [0, p] on the same segment grid."""
    B, H, L, D = q.shape
    S, Dv = k.shape[2], v.shape[3]
    R = len(config.rates)
    probs = torch.softmax(logits, dim=1)
    out = torch.zeros(B, H, L, Dv, dtype=q.dtype)
    for b in range(B):
        for head in range(H):
            r = head // (H // R)
            length = segment_length(config.rates[r], 2**62)  # unclamped: the oracle's own grid
            for i in range(L):
                p = i + S - L
                if int(probs[b, :, i].argmax()) != r or (is_causal and p < 0):
                    continue
                A = averaging_matrix(S, length, kpm, b, p if is_causal else None)
                A = A[A.sum(1) > 0]  # segments with a visible real key
                k_lm, v_lm = A @ k[b, head], A @ v[b, head]
                if config.similarity == "kernel":
                    w = feature_map(k_lm, config.feature_map) @ feature_map(q[b, head, i], config.feature_map)
                    o = (w @ v_lm) / (w.sum() + config.eps)
                elif len(A):
                    o = torch.softmax(k_lm @ q[b, head, i] * D**-0.5, 0) @ v_lm
                else:
                    o = torch.zeros(Dv, dtype=q.dtype)
                out[b, head, i] = probs[b, r, i] * o
    return out


def dense_linear(q, k, v, kpm, is_causal, fm, eps=1e-6):
    L, S = q.shape[2], k.shape[2]
    scores = feature_map(q, fm) @ feature_map(k, fm).transpose(-1, -2)
    mask = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        mask = torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L)
    if kpm is not None:
        mask = mask & kpm[:, None, None, :]
    scores = scores * mask
    return (scores @ v) / (scores.sum(-1, keepdim=True) + eps)


def inputs(B=2, H=8, L=11, S=None, D=4, Dv=3, R=4, seed=0):
    q, k, v = qkv(B, H, L, S, D, Dv, seed=seed)
    return q, k, v, randn(B, R, L, seed=seed + 3)


# --------------------------------------------------------------------------------------------
# Oracles
# --------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 2), subheads=st.integers(1, 2), L=st.integers(1, 14), S=st.integers(1, 14),
    is_causal=st.booleans(), pad=st.booleans(), fm=st.sampled_from(["relu", "elu"]),
    similarity=st.sampled_from(["kernel", "softmax"]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_equals_the_dense_reference_of_the_paper(B, subheads, L, S, is_causal, pad, fm, similarity, seed):
    config = MultiresConfig(rates=RATES, feature_map=fm, similarity=similarity)
    q, k, v, logits = inputs(B, 4 * subheads, L, S, seed=seed)
    kpm = padding(B, S, seed) if pad else None
    if pad and seed % 3 == 0:
        kpm[0] = False  # a row without a real key: zeros
    out = multires_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=config, router_logits=logits)
    assert (out - dense_multires(q, k, v, kpm, is_causal, logits, config)).abs().max() <= 1e-10


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("fm", ["relu", "elu"])
@pytest.mark.parametrize(("L", "S"), [(23, 23), (17, 23), (23, 17)])
def test_one_head_at_rate_one_equals_linear_attention(is_causal, fm, L, S):
    q, k, v = qkv(2, 3, L, S, 5, 4)
    kpm = padding(2, S, seed=4)
    logits = randn(2, 1, L, seed=9)  # one resolution: P = 1 for every query
    config = MultiresConfig(rates=(1.0,), feature_map=fm)
    out = multires_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=config, router_logits=logits)
    expected = linear_attention(
        q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=LinearConfig(feature_map=fm, eps=config.eps)
    )
    assert (out - expected).abs().max() <= 1e-12
    assert (out - dense_linear(q, k, v, kpm, is_causal, fm)).abs().max() <= 1e-10


@pytest.mark.parametrize("chosen", [0, 1, 2, 3])
def test_router_forced_to_one_head_gives_that_heads_attention_alone(chosen):
    """Logits 60 above the rest: P = 1 − 3e^-60; the chosen heads equal kernel attention over their
    resolution's landmarks, built from a dense averaging matrix, and every other head is zero."""
    q, k, v, _ = inputs(2, 8, 19, 19)
    q = q.abs()  # no all-zero ReLU features, so the chosen heads are non-zero everywhere
    kpm = padding(2, 19, seed=1)
    logits = torch.zeros(2, 4, 19, dtype=torch.float64)
    logits[:, chosen] = 60.0
    config = MultiresConfig(rates=RATES)
    out = multires_attention(q, k, v, key_padding_mask=kpm, config=config, router_logits=logits)
    heads = slice(2 * chosen, 2 * chosen + 2)
    length = segment_length(RATES[chosen], 19)
    for b in range(2):
        A = averaging_matrix(19, length, kpm, b)
        real = A.sum(1) > 0
        k_lm, v_lm = A[real] @ k[b, heads], A[real] @ v[b, heads]  # (2, n, D)
        expected = dense_linear(q[b : b + 1, heads], k_lm[None], v_lm[None], None, False, "relu")[0]
        assert (out[b, heads] - expected).abs().max() <= 1e-12
    others = torch.ones(8, dtype=torch.bool)
    others[heads] = False
    assert (out[:, others] == 0).all() and (out[:, heads].abs().amax(-1) > 0).all()


@pytest.mark.parametrize("length", [1, 2, 3, 5, 8])
def test_segment_means_with_padding_equal_a_dense_averaging_matrix(length):
    x = randn(2, 3, 17, 4)
    kpm = padding(2, 17, seed=length)
    kpm[1, :5] = False  # the first segments of row 1 hold no real key
    for mask in (None, kpm):
        means, valid = segment_means(x, mask, length)
        for b in range(2):
            A = averaging_matrix(17, length, mask, b)
            assert (means[b] - A @ x[b]).abs().max() <= 1e-14
            assert torch.equal(valid[b], A.sum(1) > 0)
    assert means.shape == (2, 3, -(-17 // length), 4)


@pytest.mark.parametrize(("rate", "length"), [(1.0, 1), (0.5, 2), (1 / 3, 3), (0.0625, 16), (0.3, 3), (0.7, 1)])
def test_segment_length_gives_at_least_the_papers_landmarks(rate, length):
    assert segment_length(rate, 4097) == length
    assert segment_length(rate, 1) == 1, "never longer than the keys"
    for N in (1, 7, 64, 1000, 4097):
        m = -(-N // length)
        assert m >= -(-round(N * rate, 9) // 1)
        if abs(1 / rate - round(1 / rate)) < 1e-9:  # 1/c whole: exactly m = ⌈N·c⌉
            assert m == -(-N // round(1 / rate))


def test_no_quadratic_and_no_per_position_state_tensor():
    """Every tensor made in the forward and backward passes, causal or not, is far below N×N and
    N×H×D×D elements: the cost is linear."""
    N, H, D = 2048, 4, 32
    q, k, v = (x.float().requires_grad_(True) for x in qkv(1, H, N, N, D, D))
    logits = randn(1, 4, N).float()
    for is_causal in (False, True):
        with _LargestTensor() as largest:
            out = multires_attention(q, k, v, is_causal=is_causal, router_logits=logits)
            out.square().sum().backward()
        assert largest.elements <= 4 * N * H * (D + 1) < min(N * N, N * H * D * D) / 2, largest.elements


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor):
                self.elements = max(self.elements, t.numel())
        return result


# --------------------------------------------------------------------------------------------
# Causality, gradients, precision, padding
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("similarity", ["kernel", "softmax"])
def test_gradcheck(is_causal, similarity):
    q, k, v, logits = inputs(1, 2, 8, 8, D=3, Dv=2, R=2)
    kpm = padding(1, 8, seed=2)
    config = MultiresConfig(rates=(0.5, 1 / 3), similarity=similarity)
    tensors = tuple(x.requires_grad_(True) for x in (q, k, v, logits))
    fn = functools.partial(multires_attention, key_padding_mask=kpm, is_causal=is_causal, config=config)
    assert gradcheck(lambda q, k, v, lg: fn(q, k, v, router_logits=lg), tensors)


def test_router_logits_get_the_gradient_of_the_chosen_probability():
    """∂out/∂logits flows only through P at the argmax: d(P_c · head_c)/d logit_r = head_c P_c (δ_cr − P_r)."""
    q, k, v, logits = inputs(2, 4, 10, 10, R=2)
    q = q.abs()  # no all-zero ReLU features: every query's chosen heads are non-zero
    logits.requires_grad_(True)
    config = MultiresConfig(rates=(0.5, 0.25))
    out = multires_attention(q, k, v, config=config, router_logits=logits)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    probs = torch.softmax(logits.detach(), 1)
    chosen = probs.argmax(1)  # (B, L)
    heads = multires_attention(q, k, v, config=config, router_logits=logits.detach()).sum((1, 3))  # (B, L)
    head_sums = heads / probs.gather(1, chosen[:, None]).squeeze(1)  # the chosen head's output, unweighted
    expected = (
        head_sums[:, None]
        * probs.gather(1, chosen[:, None])
        * (torch.nn.functional.one_hot(chosen, 2).transpose(1, 2) - probs)
    )
    assert (grad - expected).abs().max() <= 1e-12 and grad.abs().min() > 0


@pytest.mark.parametrize("is_causal", [False, True])
def test_outputs_with_and_without_autograd_agree_when_a_resolution_gets_no_query(is_causal, monkeypatch):
    """Without autograd the output is written in place (non-causal: in blocks of queries, here one
    query each); with it, pieces are concatenated. Both equal the dense reference."""

    monkeypatch.setattr(TUNING, "multires_query_block", 1)
    q, k, v, logits = inputs(2, 8, 15, 15)
    logits[:, 2] = -50.0  # resolution 2 is nobody's choice
    kpm = padding(2, 15, seed=4)
    with torch.no_grad():
        plain = multires_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, router_logits=logits)
    assert (plain - dense_multires(q, k, v, kpm, is_causal, logits, MultiresConfig())).abs().max() <= 1e-12
    tracked = multires_attention(
        q, k, v.requires_grad_(True), key_padding_mask=kpm, is_causal=is_causal, router_logits=logits
    )
    assert (plain - tracked.detach()).abs().max() <= 1e-14 and (plain[:, 4:6] == 0).all()
    tracked.sum().backward()
    assert (v.grad[:, 4:6] == 0).all() and (v.grad[:, :4].abs().sum() > 0)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_low_precision_computes_in_fp32(dtype, tol, is_causal):
    q, k, v, logits = inputs(2, 8, 600, 600, D=16, Dv=16)
    low = [x.to(dtype) for x in (q, k, v, logits)]
    out = multires_attention(*low[:3], is_causal=is_causal, router_logits=low[3])
    ref = multires_attention(*(x.double() for x in low[:3]), is_causal=is_causal, router_logits=low[3].double())
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("similarity", ["kernel", "softmax"])
def test_queries_without_a_visible_key_give_zeros_not_nan(similarity):
    q, k, v, logits = (x.requires_grad_(True) for x in inputs(2, 4, 9, 6, R=2))
    kpm = torch.ones(2, 6, dtype=torch.bool)
    kpm[1] = False
    config = MultiresConfig(rates=(0.5, 0.25), similarity=similarity)
    for is_causal in (False, True):
        out = multires_attention(
            q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=config, router_logits=logits
        )
        assert torch.isfinite(out).all() and (out[1] == 0).all()
        if is_causal:
            assert (out[:, :, :3] == 0).all()  # L > S: the first 3 queries come before every key
        out.sum().backward()
        assert all(torch.isfinite(x.grad).all() for x in (q, k, v, logits))


def test_relu_features_of_zero_give_zeros():
    q, k, v, logits = inputs(1, 4, 8, 8, R=2)
    q[0, :, 3] = -1.0  # φ(q) = 0
    out = multires_attention(q, k, v, config=MultiresConfig(rates=(0.5, 0.25)), router_logits=logits)
    assert (out[0, :, 3] == 0).all() and torch.isfinite(out).all()


def test_padded_keys_add_nothing():
    q, k, v, logits = inputs(2, 8, 21, 21)
    kpm = padding(2, 21, seed=8)
    k2 = torch.where(kpm[:, None, :, None], k, k * 50 + 3)
    v2 = torch.where(kpm[:, None, :, None], v, -v * 9)
    for is_causal in (False, True):
        a = multires_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, router_logits=logits)
        b = multires_attention(q, k2, v2, key_padding_mask=kpm, is_causal=is_causal, router_logits=logits)
        assert (a - b).abs().max() <= 1e-12


# --------------------------------------------------------------------------------------------
# Random routing (the Rand ablation)
# --------------------------------------------------------------------------------------------


def _route_of(out, R):
    """The resolution each query went to, read off the non-zero heads ``(B, L)``."""
    B, H, L, _ = out.shape
    nonzero = out.abs().amax(-1).view(B, R, H // R, L).amax(2) > 0  # (B, R, L)
    assert (nonzero.sum(1) == 1).all()
    return nonzero.float().argmax(1)


def test_random_routing_is_reproducible_seeded_and_uniform():
    q, k, v, _ = inputs(2, 8, 2000, 2000, D=2, Dv=2)
    q = q.abs()  # ReLU features never all zero: every query's chosen heads are non-zero
    config = MultiresConfig(routing="random")
    call = functools.partial(multires_attention, q, k, v, config=config)
    torch.manual_seed(123)
    a = call(state=MultiresState(config, 8, 2, seed=5))
    torch.manual_seed(456)  # global RNG state plays no part
    b = call(state=MultiresState(config, 8, 2, seed=5))
    assert torch.equal(a, b)
    c = call(state=MultiresState(config, 8, 2, seed=6))
    route_a, route_c = _route_of(a, 4), _route_of(c, 4)
    assert torch.equal(route_a[0], route_a[1])  # a fixed function of the position, whatever the batch row
    assert (route_a != route_c).float().mean() > 0.6  # another seed, another draw
    counts = torch.bincount(route_a[0], minlength=4)
    assert counts.min() > 430 and counts.max() < 570, counts  # uniform: 500 ± 3σ
    assert torch.equal(_route_of(call(), 4), _route_of(call(state=MultiresState(config, 8, 2, seed=0)), 4))
    weights = a.abs().amax(-1)  # the chosen heads carry weight 1: they equal the head's attention
    learned = multires_attention(
        q, k, v, router_logits=torch.nn.functional.one_hot(route_a, 4).transpose(1, 2).double() * 80
    )
    assert (a - learned).abs().max() <= 1e-12 and (weights > 0).sum() == 2 * 2000 * 2


def test_random_routing_in_decoding_uses_absolute_positions():
    """Causal random routing hashes position i + S − L: a query routed alone with its prefix as
    keys (as a KV cache does) goes where it goes in the full pass."""
    q, k, v, _ = inputs(1, 8, 30, 30)
    config = MultiresConfig(routing="random")
    full = multires_attention(q, k, v, is_causal=True, config=config)
    last = multires_attention(q[:, :, 24:25], k[:, :, :25], v[:, :, :25], is_causal=True, config=config)
    assert (last - full[:, :, 24:25]).abs().max() <= 1e-12


# --------------------------------------------------------------------------------------------
# Layers, models, registry
# --------------------------------------------------------------------------------------------


def test_layer_owns_the_router_and_equals_the_functional_form():
    layer = subquad.nn.Attention(32, 8, "multires", rates=(0.5, 0.25)).double()
    router = layer.inputs["0"]
    assert isinstance(router, MultiresInputs) and router.router.weight.shape == (2, 32) and router.router.bias is None
    x = randn(2, 13, 32)
    kpm = padding(2, 13, seed=3)
    split = lambda t: t.view(2, 13, 8, 4).transpose(1, 2)
    q, k, v = split(layer.q_proj(x)), split(layer.k_proj(x)), split(layer.v_proj(x))
    for is_causal in (False, True):
        heads = multires_attention(
            q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=layer.groups[0].config,
            router_logits=router.router(x).transpose(1, 2), query_padding_mask=kpm,  # self-attention: the same tokens
        )  # fmt: skip
        expected = layer.out_proj(heads.transpose(1, 2).reshape(2, 13, 32))
        assert (layer(x, key_padding_mask=kpm, is_causal=is_causal) - expected).abs().max() <= 1e-12
    random = subquad.nn.Attention(32, 8, "multires", routing="random", seed=4)
    assert random.inputs["0"].router is None and int(random.states["0"].seed) == 4


def test_router_weights_and_every_parameter_get_gradients():
    layer = subquad.nn.Attention(16, 4, "multires", rates=(0.5, 0.25)).double()
    x = randn(2, 12, 16)
    for is_causal in (False, True):
        layer.zero_grad()
        layer(x, is_causal=is_causal).square().sum().backward()
        for name, p in layer.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, (name, is_causal)
        assert (layer.inputs["0"].router.weight.grad.abs() > 0).all()


def test_generate_gives_the_same_tokens_with_and_without_the_kv_cache():
    torch.manual_seed(0)
    model = subquad.nn.CausalLM(31, 32, 2, 4, attention=subquad.nn.HeadGroup("multires", rates=(0.5, 0.25)), max_len=64)
    prompt = torch.randint(0, 31, (2, 5))
    assert torch.equal(model.generate(prompt, 40), model.generate(prompt, 40, use_cache=False))


def test_tiny_encoder_classifier_overfits_a_small_batch():
    torch.manual_seed(0)
    tokens = torch.randint(0, 20, (16, 24))
    labels = torch.randint(0, 4, (16,))
    kpm = torch.ones(16, 24, dtype=torch.bool)
    kpm[::2, 18:] = False
    model = subquad.nn.Encoder(20, 32, 2, 4, 4, attention="multires", max_len=24)
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = float(torch.nn.functional.cross_entropy(model(tokens, kpm), labels).detach())
    for _ in range(120):
        optimiser.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(tokens, kpm), labels)
        loss.backward()
        optimiser.step()
    assert first > 1.2 and float(loss.detach()) < 0.05, (first, float(loss.detach()))
    assert (model(tokens, kpm).argmax(-1) == labels).all()


def test_registry_record_and_bench_inputs():
    mech = get_mechanism("multires")
    assert mech.causal and mech.cross and mech.tensor_args == ("router_logits", "query_padding_mask")
    q, k, v = qkv(1, 8, 12, 12, 4, dtype=torch.float32)
    tensors = mech.example_tensors(q, k, v, MultiresConfig(), torch.Generator().manual_seed(0))
    assert tensors["router_logits"].shape == (1, 4, 12) and tensors["router_logits"].dtype == torch.float32
    assert mech.example_tensors(q, k, v, MultiresConfig(routing="random"), torch.Generator()) == {}
    out = subquad.attention(q, k, v, mechanism="multires", rates=[0.5, 0.5, 0.25, 0.125], **tensors)
    assert out.shape == (1, 8, 12, 4)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"router_logits": None}, r"multires needs router_logits of shape \(B, R, L\) = \(2, 4, 11\)"),
        ({"router_logits": torch.zeros(2, 4, 10)}, r"router_logits must have shape \(B, R, L\) = \(2, 4, 11\), got"),
        ({"router_logits": torch.zeros(2, 2, 11)}, r"router_logits must have shape \(B, R, L\) = \(2, 4, 11\), got"),
        ({"router_logits": torch.zeros(2, 4, 11, dtype=torch.long)}, "router_logits must be a floating tensor"),
        ({"router_logits": torch.zeros(2, 4, 11, device="meta")}, "router_logits is on meta but q is on cpu"),
        ({"scale": 0.5}, r"multires kernel attention has no softmax scale; leave scale=None, or set similarity="),
        ({"routing": "random"}, "multires with routing='random' takes no router_logits; drop them"),
        ({"state": torch.nn.Linear(1, 1)}, "multires needs a MultiresState, got Linear"),
    ],
)
def test_bad_inputs_raise(kwargs, message):
    q, k, v, logits = inputs()
    call = {"router_logits": logits, **kwargs}
    with pytest.raises(ValueError, match=message):
        subquad.attention(q, k, v, mechanism="multires", **call)


def test_heads_must_split_between_the_rates():
    q, k, v, logits = inputs(H=6)
    message = (
        r"multires splits its heads evenly between its 4 resolutions \(rates=.*\), but got 6 heads; use a multiple"
    )
    with pytest.raises(ValueError, match=message):
        subquad.attention(q, k, v, mechanism="multires", router_logits=logits)
    with pytest.raises(ValueError, match="but got 6 heads; use a multiple of 4 heads"):
        subquad.nn.Attention(24, 6, "multires")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rates": (0.5, 0.0)}, "multires option rates must be > 0, got 0.0"),
        ({"rates": (1.5,)}, "multires option rates must be <= 1, got 1.5"),
        ({"rates": ()}, r"multires option rates must name at least one rate, e.g. rates=\(0.5, 0.25\)"),
        ({"rates": 0.5}, "multires option rates must be a tuple, got 0.5"),
        ({"feature_map": "softmax"}, "feature_map must be one of 'relu', 'elu', got 'softmax'"),
        ({"similarity": "dot"}, "similarity must be one of 'kernel', 'softmax', got 'dot'"),
        ({"routing": "topk"}, "routing must be one of 'learned', 'random', got 'topk'"),
        ({"eps": 0.0}, "eps must be > 0, got 0.0"),
    ],
)
def test_bad_options_raise(options, message):
    with pytest.raises(ValueError, match=message):
        MultiresConfig(**options)


def test_any_int_seed_works():
    q, k, v, _ = inputs(1, 4, 6, 6, R=4)
    config = MultiresConfig(routing="random")
    for seed in (-1, 2**40, 2**64 + 3):
        state = MultiresState(config, 4, 4, seed=seed)
        assert 0 <= int(state.seed) < 2**32
        assert torch.isfinite(multires_attention(q, k, v, config=config, state=state)).all()


def test_state_seed_must_be_an_int():
    with pytest.raises(ValueError, match="seed must be an int, got 1.5"):
        MultiresState(MultiresConfig(), 4, 8, seed=1.5)


@pytest.mark.parametrize("is_causal", [False, True])
def test_a_rate_below_one_over_n_is_one_segment_of_every_key_whatever_its_size(is_causal):
    """rates=(1e-9,)*4 once made segments of 10^9 positions (about 100 GB); a segment longer than
    the keys is the same landmark as one of exactly the keys."""
    q, k, v, logits = inputs(2, 4, 50, 50)
    tiny = MultiresConfig(rates=(1e-9,) * 4)
    whole = MultiresConfig(rates=(1 / 50,) * 4)
    a = multires_attention(q, k, v, is_causal=is_causal, config=tiny, router_logits=logits)
    b = multires_attention(q, k, v, is_causal=is_causal, config=whole, router_logits=logits)
    assert torch.equal(a, b)


@pytest.mark.parametrize("feature_map", ["relu", "elu"])
def test_without_gradients_the_query_blocks_use_kept_buffers_and_answer_as_with_autograd(monkeypatch, feature_map):
    """Non-causal kernel multires without autograd computes blocks of queries whose features and
    products go into buffers the thread keeps (fresh ones faulted in on every call at 8k): the same
    memory on the next call, and the outputs of the autograd path."""
    from subquad.kernels.tuning import tuned
    from subquad.ops import landmarks

    taken = []
    keep = landmarks.kept_buffer
    monkeypatch.setattr(landmarks, "kept_buffer", lambda *a: taken.append((a[0], keep(*a).data_ptr())) or keep(*a))
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 40, 8, generator=g, dtype=torch.float64) for _ in range(3))
    kw = dict(mechanism="multires", routing="random", feature_map=feature_map)
    with torch.no_grad(), tuned(multires_query_block=2 * 4 * 17 * 10):  # blocks of 10 queries: 4 of them
        out = subquad.attention(q, k, v, **kw)
        kept, first, taken[:] = out.clone(), list(taken), []
        subquad.attention(q.flip(2), k * 2, v, **kw)
        assert torch.equal(out, kept)  # no result is a view of a buffer the next call rewrites
        taken[:] = []
        assert len(first) == 8 and {name for name, _ in first} == {"multires.features", "multires.y"}
        assert torch.equal(subquad.attention(q, k, v, **kw), out) and taken == first
    graded = subquad.attention(*(x.clone().requires_grad_() for x in (q, k, v)), **kw)
    torch.testing.assert_close(graded.detach(), out, rtol=0, atol=1e-13)

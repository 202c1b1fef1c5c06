import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

import subquad
import subquad.nn
from subquad.kernels.tuning import TUNING
from subquad.mechanisms.agglomerative import (
    AgglomerativeConfig,
    AgglomerativeDecoder,
    AgglomerativeInputs,
    agglomerative_attention,
)
from subquad.registry import get_mechanism

from ..conftest import padding, randn


def inputs(B=2, H=3, L=9, S=None, Dv=5, seed=0):
    """Placeholders for q and k (only their shapes are read), values and class logits."""
    S = L if S is None else S
    q, k = torch.zeros(B, H, L, 1, dtype=torch.float64), torch.zeros(B, H, S, 1, dtype=torch.float64)
    return q, k, randn(B, H, S, Dv, seed=seed), randn(B, H, L, seed=seed + 1), randn(B, H, S, seed=seed + 2)


def averaging_matrix(query_logits, key_logits, kpm, is_causal, clip=1e-3):
    """The paper's formulas as one dense (B, H, L, S) matrix, built element by element:
    W[b, k, i, j] = c^q_ik · c^r_jk [j visible from i] / max(Σ_{visible j'} c^r_j'k, clip)."""
    B, H, L = query_logits.shape
    S = key_logits.shape[2]
    c_q, c_r = torch.softmax(query_logits, dim=1), torch.softmax(key_logits, dim=1)
    W = torch.zeros(B, H, L, S, dtype=c_q.dtype)
    for b in range(B):
        for i in range(L):
            visible = [j for j in range(S) if (not is_causal or j <= i + S - L) and (kpm is None or bool(kpm[b, j]))]
            for h in range(H):
                mass = sum(float(c_r[b, h, j]) for j in visible)
                for j in visible:
                    W[b, h, i, j] = c_q[b, h, i] * c_r[b, h, j] / max(mass, clip)
    return W


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 2), H=st.integers(1, 4), L=st.integers(1, 12), S=st.integers(1, 12),
    is_causal=st.booleans(), pad=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_equals_the_dense_averaging_matrix(B, H, L, S, is_causal, pad, seed):
    q, k, v, ql, kl = inputs(B, H, L, S, seed=seed)
    kpm = padding(B, S, seed) if pad else None
    if pad and seed % 4 == 0:
        kpm[0] = False  # no reference at all: zeros
    out = agglomerative_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, query_logits=ql, key_logits=kl)
    expected = averaging_matrix(ql, kl, kpm, is_causal) @ v
    assert (out - expected).abs().max() <= 1e-8


def test_padded_positions_add_nothing():
    q, k, v, ql, kl = inputs(2, 3, 10, 10)
    kpm = padding(2, 10, seed=5)
    edited_v = torch.where(kpm[:, None, :, None], v, v * 100 + 7)
    edited_kl = torch.where(kpm[:, None, :], kl, kl - 50)
    for is_causal in (False, True):
        a = agglomerative_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, query_logits=ql, key_logits=kl)
        b = agglomerative_attention(
            q, k, edited_v, key_padding_mask=kpm, is_causal=is_causal, query_logits=ql, key_logits=edited_kl
        )
        assert torch.equal(a, b)


def test_the_denominator_is_clipped_not_smoothed():
    """A class with reference mass below the clip divides by the clip; above it, by the mass itself."""
    q, k, v, ql, kl = inputs(1, 2, 1, 1, Dv=1)
    kl = torch.tensor([[[30.0], [0.0]]], dtype=torch.float64)  # class 1 gets mass e^-30 / (1 + e^-30)
    out = agglomerative_attention(q, k, v, query_logits=ql, key_logits=kl)
    c_q, c_r = torch.softmax(ql, 1), torch.softmax(kl, 1)
    assert torch.allclose(out[0, 0, 0, 0], c_q[0, 0, 0] * v[0, 0, 0, 0])  # mass ≈ 1: the plain average
    assert torch.allclose(out[0, 1, 0, 0], c_q[0, 1, 0] * c_r[0, 1, 0] * v[0, 1, 0, 0] / 1e-3)


@pytest.mark.parametrize("is_causal", [False, True])
def test_gradcheck(is_causal):
    q, k, v, ql, kl = inputs(2, 3, 7, 7)
    kpm = padding(2, 7, seed=1)
    tensors = tuple(x.requires_grad_(True) for x in (v, ql, kl))
    assert gradcheck(
        lambda v, ql, kl: agglomerative_attention(
            q, k, v, key_padding_mask=kpm, is_causal=is_causal, query_logits=ql, key_logits=kl
        ),
        tensors,
    )


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_long_prefix_sums_accumulate_in_fp32(dtype, tol):
    """8192 causal positions: fp16/bf16 prefix sums would lose the running average; ours do not."""
    q, k, v, ql, kl = inputs(1, 4, 8192, Dv=8)
    low = agglomerative_attention(
        q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True, query_logits=ql.to(dtype), key_logits=kl.to(dtype)
    )
    ref = agglomerative_attention(
        q, k, v.to(dtype).double(), is_causal=True, query_logits=ql.to(dtype).double(), key_logits=kl.to(dtype).double()
    )
    assert low.dtype == dtype
    assert (low.double() - ref).abs().max() <= tol * ref.abs().max()


# --------------------------------------------------------------------------------------------
# Recurrent decoding, layers, models
# --------------------------------------------------------------------------------------------


def test_recurrent_equals_parallel_token_by_token_over_200_steps():
    q, k, v, ql, kl = inputs(2, 4, 200, Dv=6)
    parallel = agglomerative_attention(q, k, v, is_causal=True, query_logits=ql, key_logits=kl)
    decoder = AgglomerativeDecoder(get_mechanism("agglomerative"), AgglomerativeConfig(), None)
    one = slice(None)
    steps = [
        decoder.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], ql[one, one, t : t + 1],
                     kl[one, one, t : t + 1])
        for t in range(200)
    ]  # fmt: skip
    assert (torch.cat(steps, dim=2) - parallel).abs().max() <= 1e-12
    assert decoder.sums.shape == (2, 4, 1, 6) and decoder.mass.shape == (2, 4, 1, 1)


def test_decoder_rejects_a_different_batch_and_missing_logits():
    decoder = AgglomerativeDecoder(get_mechanism("agglomerative"), AgglomerativeConfig(), None)
    q, k, v, ql, kl = inputs(2, 3, 1, 1)
    decoder.step(q, k, v, ql, kl)
    q3, k3, v3, ql3, kl3 = inputs(3, 3, 1, 1)
    with pytest.raises(ValueError, match=r"holds state for \(B, H, Dv\) = \(2, 3, 5\), got \(3, 3, 5\)"):
        decoder.step(q3, k3, v3, ql3, kl3)
    with pytest.raises(ValueError, match="agglomerative needs query_logits"):
        decoder.step(q, k, v, None, kl)


def test_layer_builds_class_projections_and_no_query_key_projections():
    layer = subquad.nn.Attention(32, 4, "agglomerative")
    assert layer.q_proj is None and layer.k_proj is None
    assert isinstance(layer.inputs["0"], AgglomerativeInputs)
    assert layer.inputs["0"].query_classes is not layer.inputs["0"].key_classes
    shared = subquad.nn.Attention(32, 4, "agglomerative", shared_classes=True)
    assert shared.inputs["0"].query_classes is shared.inputs["0"].key_classes
    x = randn(2, 10, 32).float()
    assert layer(x, is_causal=True).shape == (2, 10, 32)
    mixed = subquad.nn.Attention(32, 4, (subquad.nn.HeadGroup("agglomerative", 2), subquad.nn.HeadGroup("full", 2)))
    assert mixed.q_proj is not None and mixed(x).shape == (2, 10, 32)


def test_layer_gradients_reach_every_parameter():
    layer = subquad.nn.Attention(16, 4, "agglomerative").double()
    layer(randn(2, 12, 16), is_causal=True).square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("position", ["learned", "conv", "both"])
def test_generate_gives_the_same_tokens_with_and_without_the_cache(position):
    torch.manual_seed(0)
    model = subquad.nn.CausalLM(41, 32, 2, 4, attention="agglomerative", max_len=80, position=position).double()
    prompt = torch.randint(0, 41, (2, 7))
    assert torch.equal(model.generate(prompt, 60), model.generate(prompt, 60, use_cache=False))
    assert get_mechanism("agglomerative").recurrent


@pytest.mark.parametrize("position", ["conv", "both"])
def test_model_with_the_convolution_input_is_causal(position):
    torch.manual_seed(0)
    model = subquad.nn.CausalLM(30, 16, 2, 2, attention="agglomerative", max_len=40, position=position).double()
    tokens = torch.randint(0, 30, (2, 40))
    edited = tokens.clone()
    edited[:, 25:] = (edited[:, 25:] + 1) % 30
    assert (model(tokens)[:, :25] - model(edited)[:, :25]).abs().max() == 0
    assert (model(tokens)[:, 25:] - model(edited)[:, 25:]).abs().max() > 0


def test_tiny_causal_lm_with_the_convolution_input_overfits_a_small_batch():
    torch.manual_seed(0)
    tokens = torch.randint(0, 23, (4, 48))
    model = subquad.nn.CausalLM(23, 48, 2, 4, attention="agglomerative", max_len=48, position="conv")
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = float(model.loss(tokens).detach())
    for _ in range(300):
        optimiser.zero_grad()
        loss = model.loss(tokens)
        loss.backward()
        optimiser.step()
    assert first > 2.9 and float(loss.detach()) < 0.3, (first, float(loss.detach()))


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"query_logits": None}, r"agglomerative needs query_logits of shape \(B, H, N\) = \(2, 3, 9\)"),
        ({"key_logits": None}, r"agglomerative needs key_logits of shape \(B, H, N\) = \(2, 3, 9\)"),
        ({"query_logits": torch.zeros(2, 3, 8)}, r"query_logits must have shape \(B, H, N\) = \(2, 3, 9\), got"),
        ({"key_logits": torch.zeros(2, 3, 9, dtype=torch.long)}, "key_logits must be a floating tensor"),
        ({"key_logits": torch.zeros(2, 3, 9, device="meta")}, "key_logits is on meta but v is on cpu"),
        ({"scale": 0.1}, "agglomerative attention has no dot products to scale"),
    ],
)
def test_bad_inputs_raise(kwargs, message):
    q, k, v, ql, kl = inputs()
    call = {"query_logits": ql, "key_logits": kl, **kwargs}
    with pytest.raises(ValueError, match=message):
        subquad.attention(q, k, v, mechanism="agglomerative", **call)


def test_bad_options_raise():
    with pytest.raises(ValueError, match="clip must be > 0, got 0.0"):
        subquad.attention(*inputs()[:3], mechanism="agglomerative", clip=0.0)


def test_cross_attention_classifier_needs_matching_widths():
    layer = subquad.nn.Attention(16, 2, "agglomerative", kdim=8, vdim=8)
    with pytest.raises(ValueError, match="agglomerative classifies references from inputs of width 16, got 8"):
        layer(randn(1, 4, 16).float(), randn(1, 5, 8).float())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"position": "rope"}, "position must be one of learned, conv, both, got 'rope'"),
        ({"conv_width": 0}, "conv_width must be a positive int, got 0"),
    ],
)
def test_bad_position_options_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        subquad.nn.CausalLM(10, 8, 1, 2, **kwargs)


@pytest.mark.parametrize(("L", "S"), [(13, 13), (9, 13), (13, 9)])
def test_block_wise_forward_and_backward_across_many_blocks(L, S, monkeypatch):
    """Blocks of 4 positions (chunks of 4): the carries of the forward pass and of the backward's
    suffix sums cross many block boundaries; values match the dense matrix and gradcheck passes."""

    monkeypatch.setattr(TUNING, "agglomerative_chunk", 4)
    monkeypatch.setattr(TUNING, "agglomerative_block", 1)
    q, k, v, ql, kl = inputs(1, 2, L, S, Dv=2)
    kpm = padding(1, S, seed=2)
    out = agglomerative_attention(q, k, v, key_padding_mask=kpm, is_causal=True, query_logits=ql, key_logits=kl)
    assert (out - averaging_matrix(ql, kl, kpm, True) @ v).abs().max() <= 1e-12
    tensors = tuple(x.requires_grad_(True) for x in (v, ql, kl))
    assert gradcheck(
        lambda v, ql, kl: agglomerative_attention(
            q, k, v, key_padding_mask=kpm, is_causal=True, query_logits=ql, key_logits=kl
        ),
        tensors,
    )

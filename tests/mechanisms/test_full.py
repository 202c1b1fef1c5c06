import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck, gradgradcheck

from subquad.mechanisms.full import FullConfig, attention_weights, full_attention

from ..conftest import padding, qkv

BACKENDS = [FullConfig(backend="sdpa"), FullConfig(backend="eager")]


def reference_mask(L: int, S: int, kpm: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
    """The contract's mask built from scratch: (B|1, 1, L, S), True = may attend."""
    mask = torch.ones(1, 1, L, S, dtype=torch.bool)
    if is_causal:  # query i sits at key position i + S - L
        mask = mask & (torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L))
    if kpm is not None:
        mask = mask & kpm[:, None, None, :]
    return mask


@settings(max_examples=80, deadline=None)
@given(
    B=st.integers(1, 3), H=st.integers(1, 3), L=st.integers(1, 24), S=st.integers(1, 24),
    D=st.sampled_from([1, 4, 16, 64]), Dv=st.sampled_from([1, 8, 32]), is_causal=st.booleans(),
    pad=st.booleans(), scale=st.one_of(st.none(), st.floats(0.01, 2.0)), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_full_matches_torch_sdpa(B, H, L, S, D, Dv, is_causal, pad, scale, seed):
    """fp32 within 1e-6 for the default (fused) path; the eager path in float64 within 1e-10, since in
    fp32 its rounding differs from the fused kernel's by more than 1e-6 at large logits."""
    kpm = padding(B, S, seed, p=0.4) if pad else None
    if pad and seed % 3 == 0:
        kpm[0] = False  # a sequence with no real key at all
    mask = reference_mask(L, S, kpm, is_causal)
    sees_a_key = mask.any(-1, keepdim=True)  # (B|1, 1, L, 1)
    for config, dtype, tol in ((FullConfig(), torch.float32, 1e-6), (FullConfig("eager"), torch.float64, 1e-10)):
        q, k, v = qkv(B, H, L, S, D, Dv, dtype=dtype, seed=seed)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~sees_a_key, scale=scale)
        out = full_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, scale=scale, config=config)
        assert out.shape == (B, H, L, Dv)
        assert torch.isfinite(out).all()
        assert (out.masked_fill(sees_a_key, 0) == 0).all(), "a query that sees no key must return zeros"
        assert (out - expected).masked_fill(~sees_a_key, 0).abs().max() <= tol


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)]
)
@pytest.mark.parametrize("is_causal", [False, True])
def test_backends_agree_in_every_dtype(dtype, tol, is_causal):
    q, k, v = qkv(2, 2, 33, 33, 16)
    kpm = padding(2, 33, seed=3)
    exact = full_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal)
    for config in BACKENDS:
        low = full_attention(
            *(x.to(dtype) for x in (q, k, v)), key_padding_mask=kpm, is_causal=is_causal, config=config
        )
        assert low.dtype == dtype
        assert (low.double() - exact).abs().max() <= tol


@pytest.mark.parametrize("config", BACKENDS)
def test_bool_and_additive_attn_mask_combine_with_padding_and_causal(config):
    q, k, v = qkv(2, 3, 6, 9, 8)
    kpm = padding(2, 9, seed=5)
    bias = torch.randn(3, 6, 9, dtype=torch.float64)
    bias[1, 2] = float("-inf")  # head 1, query 2: every key masked by the bias
    allowed = torch.rand(2, 1, 6, 9) > 0.3
    allowed[0, 0, 4] = False  # batch 0, query 4: every key masked
    mask = reference_mask(6, 9, kpm, True)
    for attn_mask, combined in ((allowed, mask & allowed), (bias, mask)):
        if attn_mask is bias:
            expected_weights = torch.softmax(
                (q @ k.transpose(-1, -2)) * 8**-0.5 + bias.masked_fill(~combined, -torch.inf), -1
            )
        else:
            expected_weights = torch.softmax((q @ k.transpose(-1, -2) * 8**-0.5).masked_fill(~combined, -torch.inf), -1)
        expected = torch.nan_to_num(expected_weights) @ v  # rows with no key: 0
        out = full_attention(q, k, v, key_padding_mask=kpm, is_causal=True, attn_mask=attn_mask, config=config)
        assert torch.allclose(out, expected, atol=1e-12)
    out = full_attention(q, k, v, attn_mask=bias, config=config)
    assert (out[:, 1, 2] == 0).all() and torch.isfinite(out).all()


@pytest.mark.parametrize("config", BACKENDS)
def test_queries_without_keys_give_zero_output_and_finite_zero_gradients(config):
    q, k, v = (x.requires_grad_() for x in qkv(2, 2, 6, 3, 4))
    kpm = torch.tensor([[False, False, False], [True, False, True]])
    out = full_attention(q, k, v, key_padding_mask=kpm, is_causal=True, config=config)  # L > S: rows 0-2 see nothing
    assert (out[0] == 0).all() and (out[1, :, :3] == 0).all() and (out[1, :, 3:] != 0).all()
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    assert (q.grad[0] == 0).all() and (q.grad[1, :, :3] == 0).all()
    assert (k.grad[1, :, 1] == 0).all() and (v.grad[1, :, 1] == 0).all(), "a padded key receives no gradient"


@pytest.mark.parametrize("config", BACKENDS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_gradcheck(config, is_causal):
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 5, 6, 3))
    kpm = torch.tensor([[True, False, True, True, False, True]])
    fn = lambda q, k, v: full_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, scale=0.7, config=config)
    assert gradcheck(fn, (q, k, v))


def test_eager_supports_double_backward():
    q, k, v = (x.requires_grad_() for x in qkv(1, 1, 4, 4, 3))
    bias = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    fn = lambda q, k, v, b: full_attention(q, k, v, is_causal=True, attn_mask=b, config=FullConfig("eager"))
    assert gradgradcheck(fn, (q, k, v, bias))


def test_attention_weights_are_the_dense_matrix_of_full_attention():
    q, k, v = qkv(2, 2, 5, 7, 4)
    kpm = torch.ones(2, 7, dtype=torch.bool)
    kpm[1] = False
    w = attention_weights(q, k, key_padding_mask=kpm, is_causal=True)
    assert w.shape == (2, 2, 5, 7)
    assert torch.allclose(w[0].sum(-1), torch.ones(2, 5, dtype=torch.float64)) and (w[1] == 0).all()
    assert (w[0].triu(3) == 0).all()  # query i sees keys <= i + 2
    assert torch.allclose(w @ v, full_attention(q, k, v, key_padding_mask=kpm, is_causal=True), atol=1e-12)


@pytest.mark.parametrize(
    ("attn_mask", "message"),
    [
        (
            torch.ones(7, 6, dtype=torch.bool),
            "attn_mask of shape (7, 6) does not broadcast to (B, H, L, S) = (2, 3, 7, 7)",
        ),
        (torch.ones(1, 2, 3, 7, 7, dtype=torch.bool), "does not broadcast to (B, H, L, S)"),
        (torch.ones(7, 7, dtype=torch.int64), "attn_mask must be bool (True = may attend) or an additive float mask"),
        (torch.full((7, 7), float("nan")), "additive attn_mask contains NaN or +inf; use -inf for masked positions"),
        (torch.full((7, 7), float("inf")), "additive attn_mask contains NaN or +inf"),
        ([[True] * 7] * 7, "attn_mask must be a tensor broadcastable to (2, 3, 7, 7), got list"),
        (torch.ones(7, 7, dtype=torch.bool, device="meta"), "attn_mask is on meta but q is on cpu"),
    ],
)
def test_bad_attn_mask_raises(attn_mask, message):
    with pytest.raises(ValueError) as err:
        full_attention(*qkv(), attn_mask=attn_mask)
    assert message in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_an_fp32_mask_beyond_half_range_is_not_rounded_to_infinities(dtype, backend):
    """Half inputs with an fp32 mask of -1e5 / -1e9 ("masked", as many models build it) or +7e4:
    SDPA adds it in fp32; cast to fp16 as it stood it would hold ±inf (a row of -1e5 would read as
    seeing no key and come out as zeros). The fused path shifts each row by its largest value first."""
    q, k, v = qkv(2, 3, 5, 7, 8)
    bias = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    bias[1] = -1e5
    bias[1, 2] = -7e4  # row 1 sees key 2 above all: its output is that key's value
    bias[2, :3], bias[3, 4] = -1e9, 7e4
    half = [x.to(dtype) for x in (q, k, v)]
    out = full_attention(*half, attn_mask=bias, config=FullConfig(backend))
    exact = full_attention(q, k, v, attn_mask=bias.double())
    assert torch.isfinite(out).all()
    assert torch.allclose(out[:, :, 1].double(), v[:, :, 2].to(dtype).double().expand_as(out[:, :, 1]))
    assert ((out.double() - exact).norm() / exact.norm()) < 0.02
    sdpa = torch.nn.functional.scaled_dot_product_attention(*half, attn_mask=bias)  # which adds it in fp32
    assert torch.allclose(out.float(), sdpa.float(), atol=2e-2)


def test_eager_adds_a_low_precision_query_mask_in_fp32():
    """A large negative bias (e.g. ALiBi far from the diagonal) must not be rounded to bf16 first."""
    q, k, v = qkv(1, 2, 16, 16, 8)
    bias = -100 - torch.rand(16, 16, dtype=torch.float64)
    exact = full_attention(q, k, v, attn_mask=bias)
    low = full_attention(*(x.bfloat16() for x in (q, k, v)), attn_mask=bias.float(), config=FullConfig("eager"))
    assert ((low.double() - exact).norm() / exact.norm()) < 0.02


def test_bad_backend_raises():
    with pytest.raises(ValueError, match="full option backend must be one of 'sdpa', 'eager', got 'flash'"):
        FullConfig(backend="flash")

import math

import pytest
import torch

from subquad._validate import check_attention_inputs, resolve_scale

from .conftest import qkv


def test_returns_sizes_and_default_scale():
    q, k, v = qkv(B=2, H=3, L=5, S=9, D=16, Dv=4)
    shape = check_attention_inputs(q, k, v)
    assert (shape.batch, shape.heads, shape.queries, shape.keys, shape.head_dim, shape.value_dim) == (2, 3, 5, 9, 16, 4)
    assert shape.scale == pytest.approx(16**-0.5)
    assert check_attention_inputs(q, k, v, scale=0.3).scale == 0.3


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda q, k, v: (q.numpy(), k, v), "q must be a torch.Tensor of shape (B, H, N, D), got ndarray"),
        (lambda q, k, v: (q[0], k, v), "q must be 4-D (B, H, N, D), got shape (3, 7, 8)"),
        (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), "k has an empty dimension: shape (2, 3, 0, 8)"),
        (lambda q, k, v: (q, k.float(), v), "q, k and v must share one dtype, got q=torch.float64, k=torch.float32"),
        (lambda q, k, v: (q.int(), k.int(), v.int()), "unsupported dtype torch.int32; use one of float16, bfloat16"),
        (lambda q, k, v: (q, k.to("meta"), v), "q, k and v must be on one device, got q=cpu, k=meta, v=cpu"),
        (lambda q, k, v: (q, k[:1], v[:1]), "batch sizes differ: q has B=2, k has B=1, v has B=1"),
        (lambda q, k, v: (q, k[:, :1], v[:, :1]), "head counts differ: q has H=3, k has H=1, v has H=1"),
        (lambda q, k, v: (q, k, v[:, :, :5]), "k and v must have the same length, got S=7 for k and S=5 for v"),
        (lambda q, k, v: (q, k[..., :4], v), "q and k must have the same head dim, got D=8 for q and D=4 for k"),
    ],
)
def test_bad_tensors_raise_with_the_values_and_fix(make, message):
    with pytest.raises(ValueError) as err:
        check_attention_inputs(*make(*qkv()))
    assert message in str(err.value)


def test_grouped_query_hint():
    q, k, v = qkv(H=4)
    with pytest.raises(
        ValueError,
        match="head counts differ: q has H=4, k has H=2, v has H=2; for grouped-query attention pass enable_gqa=True",
    ):
        check_attention_inputs(q, k[:, :2], v[:, :2])


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (torch.ones(2, 7), "key_padding_mask must be bool with True marking real tokens, got dtype torch.float32"),
        (torch.ones(2, 6, dtype=torch.bool), "key_padding_mask must have shape (B, S) = (2, 7), got (2, 6)"),
        (torch.ones(1, 2, 7, dtype=torch.bool), "key_padding_mask must have shape (B, S) = (2, 7), got (1, 2, 7)"),
        ([[True] * 7] * 2, "key_padding_mask must be a bool tensor of shape (B, S), got list"),
        (torch.ones(2, 7, dtype=torch.bool, device="meta"), "key_padding_mask is on meta but q, k, v are on cpu"),
    ],
)
def test_bad_padding_mask_raises(mask, message):
    with pytest.raises(ValueError) as err:
        check_attention_inputs(*qkv(), key_padding_mask=mask)
    assert message in str(err.value)


def test_float_padding_mask_mentions_the_inverted_convention():
    with pytest.raises(ValueError, match="nn.MultiheadAttention uses the opposite convention"):
        check_attention_inputs(*qkv(), key_padding_mask=torch.ones(2, 7, dtype=torch.int64))


@pytest.mark.parametrize("flag", [1, "yes", None])
def test_is_causal_must_be_bool(flag):
    with pytest.raises(ValueError, match=f"is_causal must be a bool, got {flag!r}"):
        check_attention_inputs(*qkv(), is_causal=flag)


@pytest.mark.parametrize(
    ("scale", "message"),
    [
        (0.0, "scale must be positive and finite, got 0.0"),
        (-1.0, "scale must be positive and finite, got -1.0"),
        (math.inf, "scale must be positive and finite, got inf"),
        (math.nan, "scale must be positive and finite, got nan"),
        ("0.1", "scale must be a positive number or None, got '0.1'"),
        (True, "scale must be a positive number or None, got True"),
    ],
)
def test_bad_scale_raises(scale, message):
    with pytest.raises(ValueError) as err:
        resolve_scale(scale, 8)
    assert message in str(err.value)

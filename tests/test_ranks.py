"""``subquad.attention`` takes every rank SDPA takes: ``(N, ..., H, L, E)``, ``(H, L, E)``, ``(L, E)``."""

import pytest
import torch
import torch.nn.functional as F

import subquad


def _qkv(*batch, H=4, Hkv=4, L=12, S=12, D=8, Dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, H, L, D, dtype=torch.float64, generator=g)
    k = torch.randn(*batch, Hkv, S, D, dtype=torch.float64, generator=g)
    v = torch.randn(*batch, Hkv, S, Dv, dtype=torch.float64, generator=g)
    return q, k, v


RANKS = {"2-D (L, E)": (), "3-D (H, L, E)": (), "5-D (N, M, H, L, E)": (2, 3), "6-D": (2, 1, 2)}


@pytest.mark.parametrize("rank", list(RANKS))
@pytest.mark.parametrize("causal", [False, True])
def test_full_answers_as_sdpa_at_every_rank_with_its_gradients(rank, causal):
    q, k, v = _qkv(*RANKS[rank])
    if rank.startswith("2-D"):
        q, k, v = q[0], k[0], v[0]
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    out = subquad.attention(q, k, v, is_causal=causal)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert out.shape == ref.shape and (out - ref).abs().max() <= 1e-12
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert all((a - b).abs().max() <= 1e-10 for a, b in zip(grads, expected))


@pytest.mark.parametrize("mechanism", [{"mechanism": "local", "window": 3}, {"mechanism": "linear"}])
def test_a_mechanism_at_rank_5_equals_its_4d_call_on_the_flattened_batch(mechanism):
    q, k, v = _qkv(2, 3)
    out = subquad.attention(q, k, v, is_causal=True, **mechanism)
    flat = subquad.attention(*(x.reshape(6, *x.shape[2:]) for x in (q, k, v)), is_causal=True, **mechanism)
    assert out.shape == (2, 3, 4, 12, 6) and torch.equal(out, flat.view(2, 3, 4, 12, 6))
    three = subquad.attention(q[0, 0], k[0, 0], v[0, 0], is_causal=True, **mechanism)  # (H, L, E): one batch
    assert torch.equal(three, flat[0])


def test_grouped_heads_are_dim_minus_3_as_sdpa_reads_them():
    for batch in ((), (2, 3)):
        q, k, v = _qkv(*batch, H=4, Hkv=2)
        out = subquad.attention(q, k, v, enable_gqa=True, is_causal=True)
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
        assert (out - ref).abs().max() <= 1e-12


@pytest.mark.parametrize("shape", [(12, 12), (4, 12, 12), (3, 1, 12, 12), (2, 3, 4, 12, 12), (1, 1, 1, 12)])
def test_dense_masks_broadcast_as_sdpa_broadcasts_them(shape):
    q, k, v = _qkv(2, 3)
    mask = torch.rand(*shape, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[..., 0] = True  # every query sees a key
    out = subquad.attention(q, k, v, attn_mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (out - ref).abs().max() <= 1e-12
    additive = torch.zeros(shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    assert (subquad.attention(q, k, v, attn_mask=additive) - ref).abs().max() <= 1e-12


def test_the_key_padding_mask_has_the_query_s_batch_dimensions():
    q, k, v = _qkv(2, 3)
    real = torch.ones(2, 3, 12, dtype=torch.bool)
    real[1, 2, 7:] = False
    out = subquad.attention(q, k, v, key_padding_mask=real, mechanism="local", window=4)
    mask = real[:, :, None, None, :]  # as SDPA takes it
    local = torch.ones(12, 12, dtype=torch.bool).tril(3).triu(-3)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask & local)
    assert (out - ref).abs().max() <= 1e-12


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda q, k, v: (q[0], k, v, {}), r"query is \(3, 4, 12, 8\) and key \(2, 3, 4, 12, 8\): give them the"),
        (lambda q, k, v: (q, k[:1], v[:1], {}), r"query is \(2, 3, 4, 12, 8\) and key \(1, 3, 4, 12, 8\)"),
        (lambda q, k, v: (q, k, v, {"key_padding_mask": torch.ones(6, 12, dtype=torch.bool)}),
         r"key_padding_mask must be bool \(2, 3, 12\) for these inputs .* got \(6, 12\)"),
        (lambda q, k, v: (q, k, v, {"attn_mask": torch.ones(1, 2, 3, 4, 12, 12, dtype=torch.bool)}),
         r"attn_mask is \(1, 2, 3, 4, 12, 12\), more dimensions than the query's 5"),
        (lambda q, k, v: (q[0, 0, 0, 0], k, v, {}), r"query must have at least 2 dimensions \(L, E\), as SDPA's"),
    ],
)  # fmt: skip
def test_inputs_whose_ranks_or_batches_disagree_are_refused_by_name(call, message):
    q, k, v, extra = call(*_qkv(2, 3))
    with pytest.raises(ValueError, match=message):
        subquad.attention(q, k, v, **extra)


def test_per_position_tensors_ask_for_4d_inputs():
    q, k, v = _qkv(2, 3)
    logits = torch.zeros(6, 4, 12, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\['key_logits', 'query_logits'\] are given per \(B, H, L\) position"):
        subquad.attention(q, k, v, mechanism="agglomerative", query_logits=logits, key_logits=logits)


def test_a_causal_bias_and_a_mask_mod_pass_at_other_ranks():
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = _qkv(2, 3, L=6, S=10)
    for a, b, c in ((q, k, v), (q[0, 0], k[0, 0], v[0, 0]), (q[0, 0, 0], k[0, 0, 0], v[0, 0, 0])):
        bias = causal_lower_right(6, 10)
        assert (
            subquad.attention(a, b, c, attn_mask=bias) - F.scaled_dot_product_attention(a, b, c, attn_mask=bias)
        ).abs().max() <= 1e-12
    three = q[0, 0], k[0, 0], v[0, 0]
    near = subquad.attention(*three, mechanism="pattern", mask_mod=lambda b, h, i, j: (i - j).abs() < 3)
    assert torch.equal(
        near,
        subquad.attention(
            *(x[None] for x in three), mechanism="pattern", mask_mod=lambda b, h, i, j: (i - j).abs() < 3
        )[0],
    )
    with pytest.raises(ValueError, match=r"\['mask_mod'\] index \(B, H, L, S\): pass query, key and value as 4-D"):
        subquad.attention(q, k, v, mechanism="pattern", mask_mod=lambda b, h, i, j: i >= j)

import pytest
import torch

from subquad.masks import (
    and_masks,
    causal_mask,
    contract_mask,
    dense_mask,
    or_masks,
    padding_mask,
    visible_queries,
)

from .conftest import padding


def test_causal_mask_is_bottom_right_aligned():
    # L == S: the lower triangle; L < S: the queries are the last L positions; L > S: early rows see nothing.
    assert torch.equal(dense_mask(causal_mask(4, 4), 1, 1, 4, 4)[0, 0], torch.ones(4, 4).tril().bool())
    assert torch.equal(dense_mask(causal_mask(2, 5), 1, 1, 2, 5)[0, 0], torch.ones(5, 5).tril().bool()[3:])
    assert torch.equal(dense_mask(causal_mask(5, 2), 1, 1, 5, 2)[0, 0], torch.ones(5, 5).tril(-3).bool()[:, :2])


def test_visible_queries_are_made_on_the_requested_device():
    assert visible_queries(5, 2, None, True, "meta").device.type == "meta"


def test_padding_mask_and_composition():
    kpm = padding(3, 6, seed=1)
    dense = dense_mask(padding_mask(kpm), 3, 2, 4, 6)
    assert torch.equal(dense, kpm[:, None, None, :].expand(3, 2, 4, 6))
    both = dense_mask(and_masks(padding_mask(kpm), causal_mask(6, 6)), 3, 2, 6, 6)
    either = dense_mask(or_masks(padding_mask(kpm), causal_mask(6, 6)), 3, 2, 6, 6)
    tril = torch.ones(6, 6).tril().bool()
    assert torch.equal(both, (kpm[:, None, None, :] & tril).expand(3, 2, 6, 6))
    assert torch.equal(either, (kpm[:, None, None, :] | tril).expand(3, 2, 6, 6))


@pytest.mark.parametrize(("L", "S"), [(5, 5), (3, 7), (7, 3), (1, 4)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("pad", [False, True])
def test_contract_mask_and_visible_queries_match_dense_masks(L, S, is_causal, pad):
    kpm = padding(4, S, seed=L + S, p=0.6) if pad else None
    if pad:
        kpm[1] = False  # a batch with no real key
        kpm[2] = torch.arange(S) >= S - 1  # only the last key is real
    mods = ([padding_mask(kpm)] if pad else []) + ([causal_mask(L, S)] if is_causal else [])
    expected = dense_mask(and_masks(*mods), 4, 1, L, S)[:, 0]  # (B, L, S)
    mask = contract_mask(L, S, kpm, is_causal)
    got = torch.ones(4, L, S, dtype=torch.bool) if mask is None else mask[:, 0].expand(4, L, S)
    assert torch.equal(got, expected)
    visible = visible_queries(L, S, kpm, is_causal)
    got_visible = torch.ones(4, L, dtype=torch.bool) if visible is None else visible.expand(4, L)
    assert torch.equal(got_visible, expected.any(-1))

import pytest
import torch

from subquad.kernels.layouts import Group, MaskFacts, Views


def _allowed(start, stop):
    return torch.ones(1, dtype=torch.bool)


@pytest.mark.parametrize(
    "facts, match",
    [
        ({"uniform": True}, r"MaskFacts\(uniform=True\) needs in_range=True"),
        ({"dense": True}, r"MaskFacts\(dense=True\) needs in_range=True"),
        ({"causal": True, "in_range": True}, r"MaskFacts\(causal=True\) needs triangular=True"),
    ],
)
def test_mask_facts_that_contradict_each_other_are_refused(facts, match):
    with pytest.raises(ValueError, match=match):
        MaskFacts(**facts)


def test_views_are_checked():
    view = lambda x, pad, start, stop: x
    with pytest.raises(ValueError, match="Views pads must be >= 0, got query_pad=-1, key_pad=0"):
        Views(view, query_pad=-1)
    with pytest.raises(ValueError, match=r"Views\(writes=True\) needs a query_view"):
        Views(view, writes=True)


def test_groups_are_checked():
    queries, keys = torch.zeros(3, 4, dtype=torch.long), torch.zeros(1, 3, 4, dtype=torch.long)
    Group(queries, keys, _allowed, MaskFacts(triangular=True))  # square blocks: fine
    with pytest.raises(
        ValueError, match=r"a Group needs queries \(n, bq\) and keys \(Hk, n, W\), got \(3, 4\) and \(1, 2, 4\)"
    ):
        Group(queries, keys[:, :2], _allowed)
    with pytest.raises(ValueError, match="triangular blocks must be square, got bq=4, W=5"):
        Group(queries, torch.zeros(1, 3, 5, dtype=torch.long), _allowed, MaskFacts(triangular=True))


@pytest.mark.parametrize(("L", "offset"), [(1024, 0), (1000, 0), (200, 824)])
def test_a_non_causal_band_reads_its_end_blocks_from_the_first_and_last_keys_without_a_copy(L, offset):
    """Each end block lists the first (last) W keys, which hold every key of its window, and reads
    them through a view (no zero-padded copy); every key of its window is among them."""
    from subquad.kernels.layouts import band_groups
    from subquad.mechanisms.local import window_mask

    w, block = 256, 32
    S = L + offset
    groups = band_groups(L, offset, w - 1, w - 1, block, window_mask(w, False, offset), torch.device("cpu"))
    assert all(g.views is not None and g.views.key_source is None for g in groups)
    x = torch.arange(S, dtype=torch.float32).view(1, 1, S, 1)
    for group in groups:
        listed = group.views.key_view(x, 0, 0, group.queries.shape[0])[0, 0, :, :, 0].long()  # (n, W)
        assert torch.equal(listed, group.keys[0])
        for block_queries, keys in zip(group.queries, listed):
            real = block_queries[block_queries < L] + offset
            reach = torch.arange(max(0, int(real.min()) - w + 1), min(S, int(real.max()) + w))
            assert torch.isin(reach, keys).all()


def test_a_causal_band_lists_no_key_past_its_blocks():
    from subquad.kernels.layouts import band_groups
    from subquad.mechanisms.local import window_mask

    groups = band_groups(1024, 0, 255, 0, 32, window_mask(256, True, 0), torch.device("cpu"))
    for group in groups:
        last = group.queries.amax(-1)
        assert bool(((group.keys[0] <= last[:, None]) | (group.keys[0] < 0)).all())

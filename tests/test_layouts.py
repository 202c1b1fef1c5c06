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

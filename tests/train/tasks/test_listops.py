import statistics

import pytest
import torch

from subquad.train.tasks import listops
from subquad.train.tasks.listops import VOCAB, evaluate, generate, load_splits, pad_batch, tokens


def _reference(toks):
    """A second, recursive-descent evaluator, written apart from the generator and the stack one."""
    position = 0

    def node():
        nonlocal position
        t = toks[position]
        position += 1
        if t.isdigit():
            return int(t)
        args = []
        while toks[position] != "]":
            args.append(node())
        position += 1
        if t == "[MAX":
            return max(args)
        if t == "[MIN":
            return min(args)
        if t == "[MED":
            return int(statistics.median(args))
        assert t == "[SM"
        return sum(args) % 10

    value = node()
    assert position == len(toks)
    return value


def test_labels_equal_two_independent_evaluations_of_the_expression():
    pairs = generate(300, seed=1, min_length=5, max_length=400)
    for toks, label in pairs:
        assert 0 <= label <= 9
        assert label == evaluate(toks) == _reference(toks)
    assert {label for _, label in pairs} == set(range(10))


def test_trees_follow_the_specification():
    pairs = generate(200, seed=2, min_length=20, max_length=300)
    for toks, _ in pairs:
        assert 20 <= len(toks) <= 300
        assert toks[0] in listops.OPERATORS and toks[-1] == "]"  # the root is an operation
        assert toks.count("]") == sum(t in listops.OPERATORS for t in toks)  # the brackets are kept
        depth = deepest = 0
        for t in toks:
            depth += t in listops.OPERATORS
            depth -= t == "]"
            deepest = max(deepest, depth)
        assert deepest <= listops.MAX_DEPTH
    assert len({toks for toks, _ in pairs}) == len(pairs)  # no duplicates


def test_known_expressions():
    assert evaluate("[MAX 2 9 [MIN 4 7 ] 0 ]".split()) == 9
    assert evaluate("[SM 5 6 [MED 1 2 3 4 ] ]".split()) == 3  # 5 + 6 + int(2.5) = 13 -> 3
    for bad, match in (("[MAX 2 9", "does not close"), ("]", "closes nothing"), ("[MIN ]", "no arguments"),
                       ("[MAX 12 ]", "unexpected token '12'")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            evaluate(bad.split())


def test_splits_are_cached_disjoint_and_reproducible(tmp_path, monkeypatch):
    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path))
    splits = load_splits(sizes=(40, 10, 10), min_length=10, max_length=200, seed=5)
    assert [len(splits[s][0]) for s in ("train", "val", "test")] == [40, 10, 10]
    seen = [tuple(t.tolist()) for s in ("train", "val", "test") for t in splits[s][0]]
    assert len(set(seen)) == 60  # deduplicated across the splits
    again = load_splits(sizes=(40, 10, 10), min_length=10, max_length=200, seed=5)  # from the cache
    assert all(torch.equal(a, b) for a, b in zip(again["train"][0], splits["train"][0]))
    assert len(list((tmp_path / "data").iterdir())) == 1
    for ids, label in zip(splits["val"][0], splits["val"][1]):
        assert evaluate([VOCAB[i] for i in ids.tolist()]) == int(label)


def test_padding_and_bad_options(tmp_path, monkeypatch):
    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path))
    ids, real = pad_batch([tokens(["[MAX", "1", "]"]), tokens(["3"])])
    assert ids.tolist() == [[VOCAB.index("[MAX"), 2, VOCAB.index("]")], [4, 0, 0]]
    assert real.tolist() == [[True, True, True], [True, False, False]]
    with pytest.raises(ValueError, match="unknown ListOps preset 'huge'; choose one of lra, small"):
        load_splits(preset="huge")
    with pytest.raises(ValueError, match="need 1 <= min_length <= max_length"):
        load_splits(sizes=(1, 1, 1), min_length=50, max_length=10)

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
    from subquad.kernels.band import window_mask
    from subquad.kernels.layouts import band_groups

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
    from subquad.kernels.band import window_mask
    from subquad.kernels.layouts import band_groups

    groups = band_groups(1024, 0, 255, 0, 32, window_mask(256, True, 0), torch.device("cpu"))
    for group in groups:
        last = group.queries.amax(-1)
        assert bool(((group.keys[0] <= last[:, None]) | (group.keys[0] < 0)).all())


def _pairs(groups, L, S):
    """How many times ``groups`` list each (query, key) pair the mask allows: ``(L, S)`` counts."""
    counts = torch.zeros(L + 1, S, dtype=torch.long)
    for group in groups:
        n = group.queries.shape[0]
        keys = group.keys[0]  # (n, W)
        allowed = group.allowed(0, n).expand(n, group.queries.shape[1], keys.shape[1])
        allowed = allowed & (keys >= 0).unsqueeze(1) & (keys < S).unsqueeze(1)
        rows = group.queries.unsqueeze(-1).expand_as(allowed)
        cols = keys.clamp(0, S - 1).unsqueeze(1).expand_as(allowed)
        counts.index_put_((rows[allowed], cols[allowed]), torch.ones(int(allowed.sum()), dtype=torch.long), True)
    return counts[:L]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(
    ("L", "S", "w", "block"), [(300, 300, 40, 64), (257, 300, 33, 32), (300, 257, 33, 128), (70, 70, 200, 128)]
)
def test_a_transposed_band_lists_each_pair_of_the_band_once(is_causal, L, S, w, block):
    """``band_groups(transposed=True)``: blocks of keys against the queries that see them, each
    (query, key) pair of the window listed exactly once, as the band in query blocks lists it."""
    from subquad.kernels.band import window_mask
    from subquad.kernels.layouts import band_groups

    offset = S - L
    left, right = (w - 1, 0) if is_causal else (w - 1, w - 1)
    mask = window_mask(w, is_causal, offset)
    straight = band_groups(L, offset, left, right, block, mask, torch.device("cpu"))
    flipped = band_groups(L, offset, left, right, block, mask, torch.device("cpu"), transposed=True)
    assert not any(g.transposed for g in straight) and all(g.transposed for g in flipped)
    expected = mask(0, 0, torch.arange(L)[:, None], torch.arange(S)[None, :]).long()
    assert torch.equal(_pairs(straight, L, S), expected)
    assert torch.equal(_pairs(flipped, S, L).T, expected)  # the transposed groups' queries are keys


@pytest.mark.parametrize("kernel", ["fused", "eager"])
@pytest.mark.parametrize(
    ("L", "S", "heads", "is_causal", "sinks"),
    [
        (150, 150, (2, 2), False, 0),
        (130, 150, (4, 2), True, 3),
        (150, 110, (2, 1), False, 2),
        (100, 100, (3, 3), True, 0),
    ],
)
def test_a_transposed_backward_layout_gives_the_gradients_of_the_straight_one(kernel, L, S, heads, is_causal, sinks):
    """The engine's backward over transposed groups (blocks of keys against the queries that see
    them, beside a sinks part in query blocks) equals its backward over the band in query blocks:
    key padding, grouped-query heads, L ≠ S, key blocks with empty slots, both kernels."""
    from subquad.kernels.band import window_layout as _layout
    from subquad.kernels.blocksparse import block_sparse_attention

    from .conftest import padding, qkv, randn

    H, Hkv = heads
    q, _, _ = qkv(2, H, L, S, 8, seed=1)
    _, k, v = qkv(2, Hkv, L, S, 8, seed=2)
    kpm = padding(2, S, seed=3)
    w, offset = 21, S - L
    forward = _layout(L, offset, w, is_causal, sinks, 16, torch.device("cpu"))
    grads = []
    for backward in (_layout(L, offset, w, is_causal, sinks, 32, torch.device("cpu")),
                     _layout(L, offset, w, is_causal, sinks, 32, torch.device("cpu"), transposed=True)):  # fmt: skip
        inputs = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = block_sparse_attention(*inputs, forward, kpm, 8**-0.5, kernel, backward)
        grads.append(torch.autograd.grad(out, inputs, randn(*out.shape, seed=4)))
    assert any(g.transposed for g in _layout(L, offset, w, is_causal, sinks, 32, "cpu", transposed=True)[0])
    for a, b in zip(*grads, strict=True):
        assert (a - b).abs().max() <= 1e-12


def test_transposed_groups_are_refused_as_forward_parts():
    from subquad.kernels.band import window_layout as _layout
    from subquad.kernels.blocksparse import block_sparse_attention

    from .conftest import qkv

    parts = _layout(64, 0, 9, False, 0, 16, torch.device("cpu"), transposed=True)
    with pytest.raises(ValueError, match=r"transposed groups \(Group.transposed\) serve only as backward_parts"):
        block_sparse_attention(*qkv(1, 1, 64, 64, 8), parts, None, 1.0)


@pytest.mark.parametrize("kernel", ["fused", "eager"])
@pytest.mark.parametrize(
    ("L", "S", "heads", "is_causal", "block"),
    [
        (128, 128, (4, 2), True, 16),
        (96, 160, (2, 2), True, 32),
        (128, 96, (3, 1), False, 16),
        (100, 100, (2, 2), True, 16),
    ],
)
def test_the_sinks_part_reads_views_where_its_blocks_are_whole_and_equals_its_gathered_form(
    kernel, L, S, heads, is_causal, block
):
    """The sinks' part reads the queries and the sinks in place and merges in place where its blocks
    hold the queries whole (L a multiple of the block); it is the same part as when every row is
    gathered and scattered: outputs and gradients, key padding, grouped-query heads, L ≠ S."""
    import dataclasses

    from subquad.kernels.band import window_layout

    from .conftest import padding, qkv

    H, Hkv = heads
    q, _, _ = qkv(2, H, L, S, 8, seed=1)
    _, k, v = qkv(2, Hkv, L, S, 8, seed=2)
    kpm = padding(2, S, seed=3)
    parts = window_layout(L, S - L, 9, is_causal, 3, block, torch.device("cpu"))
    assert len(parts) == 2  # the band, then the sinks its windows leave out
    (sinks,) = parts[1]
    assert (sinks.views is not None and sinks.views.writes) == (L % block == 0)
    _same_outputs_and_gradients(q, k, v, kpm, kernel, parts, [parts[0], [dataclasses.replace(sinks, views=None)]])


def _same_outputs_and_gradients(q, k, v, kpm, kernel, *layouts):
    """The engine's outputs and gradients under each layout, equal to 1e-12; those of the first."""
    from subquad.kernels.blocksparse import block_sparse_attention

    from .conftest import randn

    results = []
    for layout in layouts:
        inputs = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = block_sparse_attention(*inputs, layout, kpm, 8**-0.5, kernel)
        results.append((out, *torch.autograd.grad(out, inputs, randn(*out.shape, seed=4))))
    for a, b in zip(*results, strict=True):
        assert (a - b).abs().max() <= 1e-12
    return results[0]


@pytest.mark.parametrize("kernel", ["fused", "eager"])
@pytest.mark.parametrize(
    ("L", "S", "heads", "is_causal", "padded"),
    [(128, 128, (4, 2), True, True), (96, 160, (2, 2), True, False), (100, 100, (3, 1), False, True)],
)
def test_the_sinks_part_in_one_product_equals_it_block_by_block(kernel, L, S, heads, is_causal, padded):
    """The forward computes a sinks part (``Group.leading``) for all its queries at once
    (``blocksparse_forward.leading_keys``): the same outputs and gradients as the part block by
    block through the kernel, with key padding, grouped-query heads and L ≠ S; a query whose sinks
    are all padding, in a row whose window is all padding too, gets zeros."""
    import dataclasses

    from subquad.kernels.band import window_layout

    from .conftest import qkv

    H, Hkv = heads
    q, _, _ = qkv(2, H, L, S, 8, seed=1)
    _, k, v = qkv(2, Hkv, L, S, 8, seed=2)
    kpm = None
    if padded:  # row 1: the sinks and the first 20 keys padding, so its first queries see nothing
        kpm = torch.ones(2, S, dtype=torch.bool)
        kpm[1, :20] = False
    parts = window_layout(L, S - L, 9, is_causal, 3, 16, torch.device("cpu"))
    (sinks,) = parts[1]
    assert sinks.leading is not None
    by_block = [parts[0], [dataclasses.replace(sinks, leading=None)]]
    out, *_ = _same_outputs_and_gradients(q, k, v, kpm, kernel, parts, by_block)
    if padded and is_causal:
        assert out[1, :, : 20 - (S - L)].abs().max() == 0  # queries before any real key

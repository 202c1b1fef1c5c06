import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

import subquad
import subquad.nn
from subquad.kernels.tuning import TUNING, tuned
from subquad.mechanisms.clustered import (
    ClusteredConfig,
    ClusteredState,
    cluster_queries,
    clustered_attention,
)
from subquad.mechanisms.full import attention_weights, full_attention
from subquad.mechanisms.improved_clustered import ImprovedClusteredConfig, improved_clustered_attention
from subquad.ops import clustering

from ..conftest import padding, qkv, randn

MECHANISMS = [("clustered", ClusteredConfig), ("improved-clustered", ImprovedClusteredConfig)]
METRICS = ["euclidean", "hamming"]


def run(name, q, k, v, state=None, **kw):
    return subquad.attention(q, k, v, mechanism=name, state=state, **kw)


def real_rows(out, query_mask):
    """Zero the rows of padded queries, for comparisons that cover the real ones only."""
    return out if query_mask is None else out * query_mask[:, None, :, None]


# --------------------------------------------------------------------------------------------
# Degenerate settings equal full attention
# --------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 2), H=st.integers(1, 3), L=st.integers(1, 20), S=st.integers(1, 20),
    D=st.sampled_from([2, 8]), Dv=st.sampled_from([3, 8]), extra=st.integers(0, 5), pad=st.booleans(),
    metric=st.sampled_from(METRICS), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_one_cluster_per_query_is_full_attention(B, H, L, S, D, Dv, extra, pad, metric, seed):
    """clusters >= L (clamped, no crash): every query is its own centroid, so both mechanisms are exact,
    with key and query padding and with L != S."""
    q, k, v = qkv(B, H, L, S, D, Dv, seed=seed)
    kpm = padding(B, S, seed) if pad else None
    qpm = padding(B, L, seed + 1) if pad else None
    expected = full_attention(q, k, v, key_padding_mask=kpm)
    for name, _ in MECHANISMS:
        out = run(name, q, k, v, clusters=L + extra, kmeans=metric, key_padding_mask=kpm, query_padding_mask=qpm)
        assert (out - real_rows(expected, qpm)).abs().max() <= 1e-6


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize(("L", "S"), [(12, 12), (12, 17)])
def test_one_cluster_per_distinct_real_query_through_kmeans(metric, L, S):
    """With C = the number of real queries < L, the clustering itself (seeding + Lloyd, not the
    C >= L shortcut) must give each real query its own cluster: exact on the real rows."""
    q, k, v = qkv(2, 2, L, S, 8)
    qpm = torch.ones(2, L, dtype=torch.bool)
    qpm[:, ::3] = False  # 8 real queries of 12
    kpm = padding(2, S, seed=4)
    out = run("clustered", q, k, v, clusters=8, kmeans=metric, bits=128, key_padding_mask=kpm, query_padding_mask=qpm)
    expected = full_attention(q, k, v, key_padding_mask=kpm)
    assert (out - real_rows(expected, qpm)).abs().max() <= 1e-6


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 2), H=st.integers(1, 3), L=st.integers(2, 24), S=st.integers(1, 24),
    C=st.integers(1, 6), extra=st.integers(0, 5), pad=st.booleans(), metric=st.sampled_from(METRICS),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_improved_with_topk_at_least_s_is_full_attention(B, H, L, S, C, extra, pad, metric, seed):
    """top-k >= S (clamped): every key is re-scored exactly and m̂ = 1, whatever the clusters."""
    q, k, v = qkv(B, H, L, S, 8, 5, seed=seed)
    kpm = padding(B, S, seed) if pad else None
    qpm = padding(B, L, seed + 1) if pad else None
    out = run("improved-clustered", q, k, v, clusters=C, topk=S + extra, kmeans=metric,
              key_padding_mask=kpm, query_padding_mask=qpm)  # fmt: skip
    expected = full_attention(q, k, v, key_padding_mask=kpm)
    assert (out - real_rows(expected, qpm)).abs().max() <= 1e-6


# --------------------------------------------------------------------------------------------
# The paper's definitions, materialised row by row
# --------------------------------------------------------------------------------------------


def dense_rows(q, k, kpm, qpm, assign, C, topk, scale):
    """A^c (the centroid's row for every query, eq. 3-4) and A^t (eq. 9) as dense (B, H, L, S)."""
    B, H, L, _ = q.shape
    S = k.shape[2]
    one_hot = torch.nn.functional.one_hot(assign, C).to(q.dtype).view(B, H, L, C)
    if qpm is not None:
        one_hot = one_hot * qpm[:, None, :, None]
    centroids = one_hot.transpose(2, 3) @ q / one_hot.sum(2).clamp_min(1).unsqueeze(-1)  # (B, H, C, D)
    centroid_rows = attention_weights(centroids, k, key_padding_mask=kpm, scale=scale)  # (B, H, C, S)
    a_c = torch.gather(centroid_rows, 2, assign.view(B, H, L, 1).expand(B, H, L, S))
    kk = min(topk, S)
    top = torch.zeros_like(a_c, dtype=torch.bool).scatter(-1, a_c.topk(kk, dim=-1).indices, True)
    mass = (a_c * top).sum(-1, keepdim=True)
    logits = (q @ k.transpose(-1, -2)) * scale
    if kpm is not None:
        top = top & kpm[:, None, None, :]
    exact = torch.softmax(logits.masked_fill(~top, float("-inf")), -1).nan_to_num(0.0)
    a_t = torch.where(top, mass * exact, a_c)
    return a_c, a_t


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize(("seed", "L", "C"), [(0, 40, 5), (1, 40, 5), (2, 40, 5), (3, 200, 3)])
@pytest.mark.parametrize("chunk", [None, 1, 500])
def test_outputs_are_the_papers_rows_and_proposition_2_holds(metric, pad, seed, L, C, chunk):
    """Both outputs equal A·V for A^c (eq. 3-6) and A^t (eq. 9-10) built densely from the clustering's
    own assignment; and for every query ‖A^t_i − A_i‖₁ ≤ ‖A^c_i − A_i‖₁ (Proposition 2). L=200, C=3
    gives clusters of several tiles of the re-scoring. Without autograd the tiles go in chunks:
    one chunk (None), a tile per chunk (1) or two (500); with autograd, all at once."""
    B, H, S, D, topk = 2, 2, 33, 6, 7
    q, k, v = qkv(B, H, L, S, D, seed=seed)
    kpm = padding(B, S, seed) if pad else None
    qpm = padding(B, L, seed + 1) if pad else None
    config = ImprovedClusteredConfig(clusters=C, topk=topk, kmeans=metric)
    state = ClusteredState(config, H, D, seed=seed)
    weight = torch.ones(B, L, dtype=q.dtype) if qpm is None else qpm.to(q.dtype)
    assign = cluster_queries(
        q.reshape(B * H, L, D), config, state, weight.repeat_interleave(H, 0), torch.arange(H).repeat(B)
    ).view(B, H, L)
    assert assign.unique().numel() > 1
    scale = D**-0.5
    a_c, a_t = dense_rows(q, k, kpm, qpm, assign, C, topk, scale)
    clustered = run(
        "clustered", q, k, v, state, clusters=C, kmeans=metric, key_padding_mask=kpm, query_padding_mask=qpm
    )
    with tuned(**({} if chunk is None else {"clustered_chunk": chunk})):
        improved = improved_clustered_attention(
            q, k, v, key_padding_mask=kpm, config=config, state=state, query_padding_mask=qpm
        )
    assert (clustered - real_rows(a_c @ v, qpm)).abs().max() <= 1e-10
    assert (improved - real_rows(a_t @ v, qpm)).abs().max() <= 1e-10
    if chunk is None:
        tracked = improved_clustered_attention(
            *(x.clone().requires_grad_() for x in (q, k, v)),
            key_padding_mask=kpm, config=config, state=state, query_padding_mask=qpm,
        )  # fmt: skip
        assert (tracked.detach() - real_rows(a_t @ v, qpm)).abs().max() <= 1e-10
    exact = attention_weights(q, k, key_padding_mask=kpm)
    l1_clustered = (a_c - exact).abs().sum(-1)
    l1_improved = (a_t - exact).abs().sum(-1)
    assert (l1_improved <= l1_clustered + 1e-12).all()
    assert (l1_improved < l1_clustered - 1e-3).any(), "re-scoring should improve some rows strictly"


def test_queries_of_a_cluster_share_one_output_under_clustered():
    q, k, v = qkv(1, 2, 64, 50, 8)
    config = ClusteredConfig(clusters=6)
    out = clustered_attention(q, k, v, config=config)
    assign = cluster_queries(q.reshape(2, 64, 8), config, ClusteredState(config, 2, 8), torch.ones(2, 64),
                             torch.arange(2)).view(1, 2, 64)  # fmt: skip
    for h in range(2):
        for j in assign[0, h].unique():
            rows = out[0, h, assign[0, h] == j]
            assert (rows - rows[0]).abs().max() == 0
        assert out[0, h].unique(dim=0).shape[0] == assign[0, h].unique().numel()


# --------------------------------------------------------------------------------------------
# Grouping
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("C", [1, 5, 100, 300])
@pytest.mark.parametrize("bits", [1, 7, 64])
def test_tagged_hamming_nearest_is_the_lowest_index_nearest_code(C, bits):
    gen = torch.Generator().manual_seed(C * bits)
    codes = torch.randint(0, 2, (3, 200, bits), generator=gen).float() * 2 - 1
    centroids = torch.randint(0, 2, (3, C, bits), generator=gen).float() * 2 - 1
    centroids[:, C // 2] = centroids[:, 0]  # duplicate centroids: ties resolve to the lower index
    distance = (codes.unsqueeze(2) != centroids.unsqueeze(1)).sum(-1)  # (3, 200, C)
    expected = torch.stack([torch.tensor([row.tolist().index(min(row.tolist())) for row in g]) for g in distance])
    assert torch.equal(clustering.Hamming(codes).nearest(centroids), expected)


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_first_argmax_is_the_lowest_index_of_the_maximum(dim, n):
    gen = torch.Generator().manual_seed(n)
    scores = torch.randint(-3, 3, (n, n, n), generator=gen).to(torch.float64)  # many ties
    expected = torch.tensor(
        [[int(torch.nonzero(row == row.max())[0]) for row in plane] for plane in scores.movedim(dim, -1)]
    )
    got = clustering.first_argmax_(scores.clone(), dim)
    assert got.dtype == torch.long and torch.equal(got, expected)
    with_nan = scores.clone()
    with_nan.select(dim, n - 1).fill_(float("nan"))  # NaN in every row along dim: the last index, in range
    assert torch.equal(clustering.first_argmax_(with_nan, dim), torch.full_like(expected, n - 1))


def test_euclidean_nearest_is_the_lowest_index_nearest_centroid():
    gen = torch.Generator().manual_seed(0)
    points = torch.randint(-2, 3, (3, 50, 4), generator=gen).double()
    centroids = torch.randint(-2, 3, (3, 9, 4), generator=gen).double()
    centroids[:, 5] = centroids[:, 1]  # duplicate centroids: ties resolve to the lower index
    distance = torch.cdist(points, centroids)
    expected = torch.stack([torch.tensor([row.tolist().index(min(row.tolist())) for row in g]) for g in distance])
    assert torch.equal(clustering.Euclidean(points).nearest(centroids), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nearest_distance_is_the_least_of_the_distances(dtype):
    """The seeding's distance to the nearest centroid, from one max over the scores, equals the least
    of the distances to each centroid bit for bit (``‖x‖² − 2·s`` rounds monotonically in s)."""
    gen = torch.Generator().manual_seed(0)
    points = (torch.randn(3, 300, 16, generator=gen) * 10).to(dtype)
    centroids = torch.cat([points[:, :5], torch.randn(3, 20, 16, generator=gen).to(dtype)], 1)  # some at 0
    euclidean = clustering.Euclidean(points)
    assert torch.equal(euclidean.nearest_distance(centroids), euclidean.distances(centroids).amin(1))
    codes = torch.where(points > 0, 1.0, -1.0).to(dtype)
    hamming = clustering.Hamming(codes)
    assert torch.equal(hamming.nearest_distance(codes[:, :7]), hamming.distances(codes[:, :7]).amin(1))


@pytest.mark.parametrize("weighted", [False, True])
def test_cluster_counts_count_each_point_with_its_weight(weighted):
    gen = torch.Generator().manual_seed(0)
    assign = torch.randint(0, 6, (3, 40), generator=gen)
    weight = (torch.rand(3, 40, generator=gen) > 0.3).double() if weighted else None
    counts = clustering.cluster_counts(assign, 6, weight, torch.float64)
    expected = torch.zeros(3, 6, dtype=torch.float64)
    for g in range(3):
        for i in range(40):
            expected[g, assign[g, i]] += 1.0 if weight is None else weight[g, i]
    assert counts.dtype == torch.float64 and torch.equal(counts, expected)


def test_the_euclidean_update_is_the_weighted_mean_and_an_empty_cluster_keeps_its_centroid():
    x = torch.tensor([[[0.0, 0.0], [2.0, 2.0], [4.0, 0.0], [9.0, 9.0]]])
    assign = torch.tensor([[0, 0, 0, 1]])
    centroids = torch.tensor([[[1.0, 1.0], [5.0, 5.0], [7.0, 7.0]]])
    metric = clustering.Euclidean(x)
    updated = metric.update(centroids, assign, metric.members(None))
    assert torch.equal(updated, torch.tensor([[[2.0, 2.0 / 3], [9.0, 9.0], [7.0, 7.0]]]))
    padded = metric.update(centroids, assign, metric.members(torch.tensor([[1.0, 1.0, 0.0, 0.0]])))
    assert torch.equal(padded, torch.tensor([[[1.0, 1.0], [5.0, 5.0], [7.0, 7.0]]]))  # 1 (padded): kept


def test_hamming_majority_update_keeps_tied_bits():
    codes = torch.tensor([[[1.0, 1, -1], [1, -1, -1], [-1, -1, 1]]])
    assign = torch.tensor([[0, 0, 1]])
    centroids = torch.tensor([[[-1.0, 1, 1], [1, 1, 1]]])
    updated = clustering.Hamming(codes).update(centroids, assign, codes)
    # cluster 0 votes (1, 0, -2): bit 1 ties and keeps its value 1; cluster 1 takes its one member
    assert torch.equal(updated, torch.tensor([[[1.0, 1, -1], [-1, -1, 1]]]))


def test_hash_offsets_track_the_spread_of_the_queries():
    """Without offsets the planes pass through the origin: queries far from it on one side get one
    code. With offsets the thresholds sit inside the queries' spread and split them."""
    q = randn(1, 500, 8) * 0.1 + 5.0  # a tight cloud far from the origin
    config = ClusteredConfig(bits=16)
    state = ClusteredState(config, 1, 8)
    planes, offsets = state.planes.double(), state.offsets.double()
    without = clustering.sign_codes(q, torch.ones(1, 500), planes, None)
    with_offsets = clustering.sign_codes(q, torch.ones(1, 500), planes, offsets)
    assert without.unique(dim=1).shape[1] <= 2
    assert with_offsets.unique(dim=1).shape[1] > 20
    assert (with_offsets.abs() == 1).all()


@pytest.mark.parametrize("metric", METRICS)
def test_well_separated_groups_are_found(metric):
    """Queries drawn tightly around 6 points, C = 6: each cluster is exactly one group."""
    gen = torch.Generator().manual_seed(1)
    centres = torch.randn(6, 16, generator=gen) * 3
    label = torch.arange(300) % 6
    q = (centres[label] + 0.01 * torch.randn(300, 16, generator=gen)).unsqueeze(0)
    config = ClusteredConfig(clusters=6, kmeans=metric, fit_per_cluster=0)
    assign = cluster_queries(q, config, ClusteredState(config, 1, 16), torch.ones(1, 300), torch.zeros(1).long())
    pairs = set(zip(assign[0].tolist(), label.tolist()))
    assert len(pairs) == 6 and len({a for a, _ in pairs}) == 6


def test_padded_queries_take_no_part_in_the_clustering():
    """Editing the padded queries leaves every real query's output unchanged; padded rows are zero."""
    q, k, v = qkv(2, 2, 60, 40, 8)
    qpm = padding(2, 60, seed=2, p=0.4)
    kpm = padding(2, 40, seed=3)
    edited = torch.where(qpm[:, None, :, None], q, q * 7 + 3)
    for name, _ in MECHANISMS:
        for metric in METRICS:
            kw = dict(clusters=6, kmeans=metric, key_padding_mask=kpm, query_padding_mask=qpm)
            a, b = run(name, q, k, v, **kw), run(name, edited, k, v, **kw)
            assert torch.equal(a, b)
            assert (a[~qpm[:, None, :].expand(2, 2, 60)] == 0).all()


def test_fitting_on_a_sample_then_assigning_everything():
    """fit_per_cluster·C >= L is the same as fitting on all queries; fitting on a small sample still
    assigns every query, and the clusters are nearly as tight (k-means objective within 10%)."""
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 10, 8, generator=gen) * 3).repeat_interleave(40, 1) + torch.randn(2, 400, 8, generator=gen)
    w, heads = torch.ones(2, 400), torch.arange(2)
    state = ClusteredState(ClusteredConfig(), 2, 8)

    def inertia(assign):
        means = clustering.cluster_sums(q, assign, 10) / clustering.cluster_sums(
            torch.ones_like(q[..., :1]), assign, 10
        ).clamp_min(1)
        return (q - torch.gather(means, 1, assign.unsqueeze(-1).expand_as(q))).square().sum()

    all_fit = cluster_queries(q, ClusteredConfig(clusters=10, fit_per_cluster=0), state, w, heads)
    big = cluster_queries(q, ClusteredConfig(clusters=10, fit_per_cluster=40), state, w, heads)
    assert torch.equal(all_fit, big)
    small = cluster_queries(q, ClusteredConfig(clusters=10, fit_per_cluster=8), state, w, heads)
    assert inertia(small) <= 1.1 * inertia(all_fit)


@pytest.mark.parametrize("metric", ["euclidean", "hamming"])
@pytest.mark.parametrize("fit_per_cluster", [0, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clusters_of_all_real_queries_are_those_of_weight_one(metric, fit_per_cluster, dtype):
    """weight=None takes the draws made once per shape; they are the draws of an all-ones weight,
    for every head of every batch row (heads 2, 0 of a 3-head layer, twice)."""
    q = randn(4, 90, 8).to(dtype)
    config = ClusteredConfig(clusters=9, kmeans=metric, fit_per_cluster=fit_per_cluster)
    state = ClusteredState(config, 3, 8, seed=5)
    heads = torch.tensor([2, 0, 2, 0])
    cached = [cluster_queries(q, config, state, None, heads) for _ in range(2)]  # the second from the cache
    assert torch.equal(cached[0], cached[1])
    assert torch.equal(cached[0], cluster_queries(q, config, state, torch.ones(4, 90, dtype=dtype), heads))
    assert cached[0].unique().numel() == 9


def test_seeding_never_draws_a_padded_point():
    """Ten real points and 9 centroids: every centroid is a real point, although the padded points
    lie far from all of them (so their distance, were they drawn, would dominate the D² keys)."""
    x = torch.cat([randn(1, 10, 4), torch.full((1, 30, 4), 100.0)], dim=1)
    weight = torch.cat([torch.ones(1, 10), torch.zeros(1, 30)], dim=1)
    heads = torch.zeros(1, dtype=torch.long)
    draws = clustering.seed_draws(weight, torch.arange(40).view(1, 40), 9, 0, heads)
    init = clustering.seed_centroids(clustering.Euclidean(x), weight, 9, draws)
    assert init.unique().numel() == 9 and int(init.max()) < 10


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("C", [3, 9, 30])  # one round (C <= SEED_ROUNDS), rounds of 3, rounds of 8
@pytest.mark.parametrize("padded", [False, True])
def test_the_seeding_assigns_each_point_to_its_nearest_seed(metric, C, padded):
    """``seed_and_assign`` draws the seeds ``seed_centroids`` draws and assigns every point, padded or
    not, to the first of its nearest seeds, as Lloyd's first step would (``metric.nearest``). Points
    repeated in the data make tied seeds, which resolve to the lower index."""
    x = torch.cat([randn(2, 40, 6), randn(2, 40, 6)[:, :20].repeat(1, 2, 1)], dim=1)  # 40 points twice each
    points = clustering.Euclidean(x) if metric == "euclidean" else clustering.Hamming(torch.where(x > 0, 1.0, -1.0))
    weight = torch.ones(2, 80)
    if padded:
        weight[1, 50:] = 0
    draws = clustering.seed_draws(weight, torch.arange(80).expand(2, 80), C, 7, torch.tensor([0, 1]))
    init, assign = clustering.seed_and_assign(points, None if not padded else weight, C, draws)
    assert torch.equal(init, clustering.seed_centroids(points, None if not padded else weight, C, draws))
    seeds = clustering.gather_rows(points.points, init)
    assert torch.equal(assign, points.nearest(seeds))
    if metric == "hamming":  # integer dots: ties are exact, and the lowest index takes them
        dots = torch.bmm(seeds, points.points.transpose(1, 2))
        first = (dots == dots.amax(1, keepdim=True)).int().argmax(1)
        assert torch.equal(assign, first)


@pytest.mark.parametrize("metric", METRICS)
def test_lloyd_from_the_seedings_assignment_equals_lloyd_from_its_own(metric):
    q = randn(3, 200, 5)
    points = clustering.Euclidean(q) if metric == "euclidean" else clustering.Hamming(torch.where(q > 0, 1.0, -1.0))
    weight = torch.ones(3, 200)
    draws = clustering.seed_draws(weight, torch.arange(200).expand(3, 200), 12, 1, torch.arange(3))
    init, assign = clustering.seed_and_assign(points, None, 12, draws)
    for iterations in (0, 1, 3):
        given_ = clustering.lloyd(points, weight, init, iterations, assign=assign)
        own = clustering.lloyd(points, weight, init, iterations)
        assert torch.equal(given_[0], own[0]) and torch.equal(given_[1], own[1])


def test_lloyd_stops_at_a_fixed_point():
    q = randn(3, 300, 4)
    state = ClusteredState(ClusteredConfig(), 3, 4)
    w, heads = torch.ones(3, 300), torch.arange(3)
    results = [
        cluster_queries(q, ClusteredConfig(clusters=7, iterations=n, fit_per_cluster=0), state, w, heads)
        for n in (200, 1000)
    ]
    assert torch.equal(*results)
    metric = clustering.Euclidean(q)
    centroids = clustering.cluster_sums(q, results[0], 7) / clustering.cluster_sums(
        torch.ones_like(q[..., :1]), results[0], 7
    )
    assert torch.equal(metric.nearest(centroids), results[0])  # the assignment is stable


# --------------------------------------------------------------------------------------------
# Reproducibility and state
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", METRICS)
def test_same_seed_same_result_and_state_round_trips(metric):
    q, k, v = qkv(2, 3, 80, 70, 8)
    config = ImprovedClusteredConfig(clusters=7, topk=5, kmeans=metric)
    a = improved_clustered_attention(q, k, v, config=config, state=ClusteredState(config, 3, 8, seed=5))
    b = improved_clustered_attention(q, k, v, config=config, state=ClusteredState(config, 3, 8, seed=5))
    assert torch.equal(a, b)
    other = improved_clustered_attention(q, k, v, config=config, state=ClusteredState(config, 3, 8, seed=6))
    assert not torch.equal(a, other)
    restored = ClusteredState(config, 3, 8, seed=0)
    restored.load_state_dict(ClusteredState(config, 3, 8, seed=5).state_dict())
    assert torch.equal(improved_clustered_attention(q, k, v, config=config, state=restored), a)
    assert torch.equal(
        improved_clustered_attention(q, k, v, config=config),
        improved_clustered_attention(q, k, v, config=config, state=ClusteredState(config, 3, 8, seed=0)),
    )


def test_a_rows_clusters_do_not_depend_on_the_rest_of_the_batch():
    q, k, v = qkv(3, 2, 90, 90, 8)
    whole = run("clustered", q, k, v, clusters=9)
    for b in range(3):
        alone = run("clustered", q[b : b + 1], k[b : b + 1], v[b : b + 1], clusters=9)
        assert torch.equal(alone, whole[b : b + 1])


def test_no_global_rng_is_used():
    q, k, v = qkv(1, 2, 64, 64, 8)
    torch.manual_seed(1)
    a = run("improved-clustered", q, k, v, clusters=5)
    torch.manual_seed(2)
    b = run("improved-clustered", q, k, v, clusters=5)
    assert torch.equal(a, b)


def test_layer_state_is_seeded_per_layer_and_saved():
    layer = subquad.nn.Attention(32, 4, "improved-clustered", seed=3, clusters=4)
    state = layer.states["0"]
    assert isinstance(state, ClusteredState) and int(state.seed) == 3
    assert {"states.0.planes", "states.0.offsets", "states.0.seed"} <= set(layer.state_dict())


# --------------------------------------------------------------------------------------------
# Layers, dtypes, autograd
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["clustered", "improved-clustered"])
def test_self_attention_layer_leaves_padded_queries_out(name):
    """The layer passes the key padding mask as the query mask in self-attention, so what sits at
    padded positions cannot move the real tokens' outputs."""
    layer = subquad.nn.Attention(16, 2, name, clusters=3).double()
    x = randn(2, 30, 16)
    kpm = padding(2, 30, seed=1)
    edited = torch.where(kpm[..., None], x, randn(2, 30, 16, seed=9) * 5)
    a = layer(x, key_padding_mask=kpm)
    b = layer(edited, key_padding_mask=kpm)
    assert (a - b)[kpm].abs().max() <= 1e-12


@pytest.mark.parametrize("name", ["clustered", "improved-clustered"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_low_precision_matches_fp32_on_the_same_inputs(name, dtype, tol):
    """Half inputs are clustered and attended in fp32, so they match an fp32 call on the same rounded
    inputs to the output's rounding."""
    q, k, v = (x.to(dtype) for x in qkv(2, 2, 100, 90, 16))
    masks = {"key_padding_mask": padding(2, 90, seed=1), "query_padding_mask": torch.ones(2, 100, dtype=torch.bool)}
    options = {"clusters": 8, **({"topk": 6} if name != "clustered" else {})}
    out = run(name, q, k, v, **options, **masks)
    ref = run(name, q.float(), k.float(), v.float(), **options, **masks)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert (out.float() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("name", ["clustered", "improved-clustered"])
def test_gradcheck(name):
    q, k, v = qkv(1, 2, 12, 10, 4)
    kpm = padding(1, 10, seed=2)
    config = ClusteredConfig(clusters=3) if name == "clustered" else ImprovedClusteredConfig(clusters=3, topk=4)
    fn = clustered_attention if name == "clustered" else improved_clustered_attention
    for x in (q, k, v):
        x.requires_grad_(True)
    assert gradcheck(lambda q, k, v: fn(q, k, v, key_padding_mask=kpm, config=config), (q, k, v))


def test_gradients_reach_queries_keys_and_values_and_are_finite():
    q, k, v = (x.float().requires_grad_(True) for x in qkv(2, 2, 50, 40, 8))
    kpm = padding(2, 40, seed=1)
    kpm[1] = False  # a sequence without any real key: zeros, finite gradients
    qpm = torch.ones(2, 50, dtype=torch.bool)
    out = run("improved-clustered", q, k, v, clusters=5, topk=4, key_padding_mask=kpm, query_padding_mask=qpm)
    assert (out[1] == 0).all()
    out.square().sum().backward()
    for x in (q, k, v):
        assert torch.isfinite(x.grad).all() and x.grad[0].abs().sum() > 0


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["clustered", "improved-clustered"])
def test_causal_raises_naming_the_causal_mechanisms(name):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=f"{name} has no causal form; mechanisms with one: full"):
        run(name, q, k, v, is_causal=True)
    fn = clustered_attention if name == "clustered" else improved_clustered_attention
    with pytest.raises(ValueError, match=f"{name} has no causal form; mechanisms with one: full"):
        fn(q, k, v, is_causal=True)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"clusters": 0}, "clusters must be >= 1, got 0"),
        ({"iterations": -1}, "iterations must be >= 0"),
        ({"bits": 0}, "bits must be >= 1"),
        ({"bits": 2000}, "bits must be <= 1024"),
        ({"kmeans": "lsh"}, "kmeans must be one of 'euclidean', 'hamming'"),
        ({"fit_per_cluster": -2}, "fit_per_cluster must be >= 0"),
        ({"topk": 0}, "topk must be >= 1, got 0"),
        ({"hash_offsets": 1}, "hash_offsets must be True or False"),
    ],
)
def test_bad_options_raise(options, message):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=message):
        run("improved-clustered", q, k, v, **options)


def test_topk_is_not_an_option_of_clustered():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['topk'\] for clustered"):
        run("clustered", *qkv(), topk=3)


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (torch.ones(2, 7), "query_padding_mask must be a bool tensor .True = real query., got torch.float32"),
        ([True] * 7, "query_padding_mask must be a bool tensor .True = real query., got list"),
        (torch.ones(2, 6, dtype=torch.bool), r"query_padding_mask must have shape \(B, L\) = \(2, 7\), got \(2, 6\)"),
        (torch.ones(2, 7, dtype=torch.bool, device="meta"), "query_padding_mask is on meta but q is on cpu"),
    ],
)
def test_bad_query_padding_mask_raises(mask, message):
    with pytest.raises(ValueError, match=message):
        run("clustered", *qkv(2, 3, 7), query_padding_mask=mask)


def test_state_of_the_wrong_kind_or_shape_raises():
    q, k, v = qkv(2, 3, 7, D=8)
    with pytest.raises(ValueError, match="clustered needs a ClusteredState, got Linear"):
        run("clustered", q, k, v, state=torch.nn.Linear(2, 2))
    wrong = ClusteredState(ClusteredConfig(), 4, 8)
    with pytest.raises(ValueError, match=r"needs \(3, 8, 32\); build it as ClusteredState\(config, 3, 8, seed\)"):
        run("clustered", q, k, v, state=wrong)
    with pytest.raises(ValueError, match=r"this call needs \(3, 8, 16\)"):
        run("clustered", q, k, v, state=ClusteredState(ClusteredConfig(), 3, 8), bits=16)


# --------------------------------------------------------------------------------------------
# Robustness
# --------------------------------------------------------------------------------------------


def pad_with_noise(x, extra):
    return torch.cat([x, randn(1, 2, extra, x.shape[-1], seed=extra) * 3], dim=2)


@pytest.mark.parametrize("name", ["clustered", "improved-clustered"])
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("real", [20, 40])
def test_a_sequence_gives_the_same_output_whatever_its_padding(name, metric, real):
    """The same real queries and keys, padded to different lengths, give the same real outputs: the
    random draws are keyed by position, and padded queries are out of the clustering. With
    clusters=4 and fit_per_cluster=8, 20 real queries are all fitted and 40 are sampled."""
    q, k, v = qkv(1, 2, real, real, 6, seed=real)
    outputs = []
    for extra in (0, 10, 50):
        pad = functools.partial(pad_with_noise, extra=extra)
        mask = torch.arange(real + extra).unsqueeze(0) < real
        out = run(name, pad(q), pad(k), pad(v), clusters=4, kmeans=metric, key_padding_mask=mask,
                  query_padding_mask=mask)  # fmt: skip
        outputs.append(out[:, :, :real])
    for out in outputs[1:]:
        assert (out - outputs[0]).abs().max() <= 1e-10


@pytest.mark.parametrize("name", ["clustered", "improved-clustered"])
def test_groups_of_rows_give_the_same_values_and_gradients(name, monkeypatch):
    """Rows processed in several groups (written into one output) equal one group, with gradients."""
    q, k, v = qkv(2, 3, 50, 45, 6)
    kpm, qpm = padding(2, 45, seed=1), padding(2, 50, seed=2)

    def forward_backward():
        xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = run(name, *xs, clusters=5, key_padding_mask=kpm, query_padding_mask=qpm)
        out.square().sum().backward()
        return out.detach(), [x.grad for x in xs]

    whole, whole_grads = forward_backward()
    monkeypatch.setattr(TUNING, "clustered_group", 1)  # one (batch, head) row per group
    split, split_grads = forward_backward()
    assert (split - whole).abs().max() <= 1e-12
    for a, b in zip(split_grads, whole_grads):
        assert (a - b).abs().max() <= 1e-12


@pytest.mark.parametrize("seed", [2**33, 2**70, -5])
def test_any_int_seed_works(seed):
    layer = subquad.nn.Attention(16, 2, "clustered", clusters=3, seed=seed)
    assert torch.isfinite(layer(randn(1, 20, 16).float())).all()
    assert torch.equal(
        ClusteredState(ClusteredConfig(), 2, 8, seed).planes, ClusteredState(ClusteredConfig(), 2, 8, seed).planes
    )


def test_a_config_of_the_other_mechanism_raises():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="improved-clustered needs a ImprovedClusteredConfig, got ClusteredConfig"):
        improved_clustered_attention(q, k, v, config=ClusteredConfig())
    with pytest.raises(ValueError, match="clustered needs a ClusteredConfig, got ImprovedClusteredConfig"):
        clustered_attention(q, k, v, config=ImprovedClusteredConfig())
    with pytest.raises(ValueError, match="clustered needs a ClusteredConfig, got ImprovedClusteredConfig"):
        subquad.attention(q, k, v, mechanism="clustered", config=ImprovedClusteredConfig())


@pytest.mark.parametrize("name", ["clustered", "improved-clustered"])
def test_all_padded_queries_or_keys_give_zeros(name):
    q, k, v = qkv(2, 2, 12, 10, 4)
    no_queries = torch.zeros(2, 12, dtype=torch.bool)
    assert (run(name, q, k, v, clusters=3, query_padding_mask=no_queries) == 0).all()
    no_keys, queries = torch.zeros(2, 10, dtype=torch.bool), torch.ones(2, 12, dtype=torch.bool)
    out = run(name, q, k, v, clusters=3, key_padding_mask=no_keys, query_padding_mask=queries)
    assert torch.isfinite(out).all() and (out == 0).all()


@pytest.mark.parametrize("name", ["clustered", "improved-clustered"])
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("junk", [float("inf"), float("nan"), 1e30])
def test_junk_at_padded_queries_does_not_reach_real_rows(name, metric, junk):
    q, k, v = qkv(2, 2, 30, 30, 6, dtype=torch.float32)
    qpm = padding(2, 30, seed=3)
    clean = run(name, q, k, v, clusters=4, kmeans=metric, query_padding_mask=qpm)
    dirty = run(name, torch.where(qpm[:, None, :, None], q, junk), k, v, clusters=4, kmeans=metric,
                query_padding_mask=qpm)  # fmt: skip
    assert torch.equal(clean, dirty)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("padded", [False, True])
def test_every_query_goes_to_its_nearest_final_centroid_when_fitted_on_a_sample(metric, padded, monkeypatch):
    """The sampled queries keep Lloyd's last assignment and only the others are assigned after it:
    together, each query's nearest of the centroids Lloyd returned, sampled or not."""
    from subquad.ops import query_clusters

    fitted = []
    lloyd = query_clusters.lloyd

    def recording(*args, **kwargs):
        result = lloyd(*args, **kwargs)
        fitted.append(result[0])
        return result

    monkeypatch.setattr(query_clusters, "lloyd", recording)
    q = randn(3, 120, 8)
    config = ClusteredConfig(clusters=6, kmeans=metric, fit_per_cluster=4)  # a sample of 24 of 120
    state = ClusteredState(config, 3, 8, seed=2)
    weight = None
    if padded:
        weight = torch.ones(3, 120)
        weight[1, 100:] = 0
    assign = cluster_queries(q, config, state, weight, torch.arange(3))
    if metric == "euclidean":
        every = clustering.Euclidean(q)
    else:
        real = torch.ones(3, 120) if weight is None else weight
        codes = clustering.sign_codes(q, real.to(q.dtype), state.planes.to(q.dtype), state.offsets.to(q.dtype))
        every = clustering.Hamming(codes)
    assert torch.equal(assign, every.nearest(fitted[0]))


def test_rows_are_split_into_as_few_groups_of_equal_size_as_the_budgets_allow(monkeypatch):
    from subquad._validate import AttentionShape
    from subquad.ops.query_clusters import _rows_per_group

    shape = AttentionShape(2, 4, 1024, 1024, 64, 64, 0.125)  # 8 rows
    cpu = torch.device("cpu")
    monkeypatch.setattr(TUNING, "clustered_group", 5 * 100 * 1024)  # 5 rows of (C × S) scores at most
    assert _rows_per_group(shape, 100, None, cpu) == 4  # two groups of 4, not 5 and 3
    monkeypatch.setattr(TUNING, "clustered_group", 1 << 30)
    assert _rows_per_group(shape, 100, None, cpu) == 8
    tiles = 1024 * 64 + (1024 // TUNING.clustered_tile + 100) * 32 * 128  # one row's tiles
    monkeypatch.setattr(TUNING, "clustered_tiles", 3 * tiles)
    assert _rows_per_group(shape, 100, 32, cpu) == 3  # three groups: 3, 3 and 2
    assert _rows_per_group(shape, 100, None, cpu) == 8  # without re-scoring no tiles count


@pytest.mark.parametrize("S", [1000, 1024, 1500, 2047, 512, 4096])
def test_top_keys_are_the_k_largest_entries_of_each_row(S):
    """The two-stage selection (1024 <= S < 2048 for k = 32) takes the same values as torch's top-k,
    ties included (rows of many equal entries), at indices that hold them."""
    from subquad.mechanisms.improved_clustered import top_keys

    gen = torch.Generator().manual_seed(S)
    probs = torch.softmax(torch.randn(3, 5, S, generator=gen) * 3, -1)
    probs[0, 0] = 0.25  # every entry tied
    probs[1, 2, ::7] = probs[1, 2].max()  # many tied at the top
    values, index = top_keys(probs, 32)
    expected = probs.topk(32, dim=-1).values
    assert torch.equal(values.sort(-1).values, expected.sort(-1).values)
    assert torch.equal(probs.gather(-1, index), values)
    assert all(row.unique().numel() == 32 for row in index.view(-1, 32))  # distinct indices in every row


@pytest.mark.parametrize(("name", "Config"), MECHANISMS)
@pytest.mark.parametrize("pad", [False, True])
def test_without_gradients_the_centroid_scores_are_a_kept_buffer_and_the_answer_is_the_same(
    monkeypatch, name, Config, pad
):
    """Without autograd the centroids' scores and their softmax (eq. 4) go into one buffer the
    thread keeps, softmax in place (a fresh (G, C, S) pair faulted in every call); the outputs equal
    those computed with autograd on, bit for bit, and the next call uses the same memory."""
    from subquad.ops import query_clusters

    taken = []
    keep = query_clusters.kept_buffer
    monkeypatch.setattr(query_clusters, "kept_buffer", lambda *a: taken.append(keep(*a).data_ptr()) or keep(*a))
    q, k, v = qkv(2, 3, 48, 48, 8, 6, seed=3)
    kw = {"config": Config(clusters=5)}
    if pad:
        kw["key_padding_mask"] = kw["query_padding_mask"] = padding(2, 48, seed=4)
    with torch.no_grad():
        out = run(name, q, k, v, **kw)
        kept, first, taken[:] = out.clone(), list(taken), []
        run(name, q.flip(2), k * 2, v.flip(2), **kw)
        assert torch.equal(out, kept)  # no result is a view of a buffer the next call rewrites
        taken[:] = []
        assert first and torch.equal(run(name, q, k, v, **kw), out)
        assert taken == first  # the same memory again
    taken[:] = []
    graded = run(name, *(x.clone().requires_grad_() for x in (q, k, v)), **kw)
    assert taken == []  # with autograd: fresh tensors
    assert torch.equal(graded.detach(), out)


def test_kmeans_nearest_scores_go_into_a_kept_buffer_without_autograd(monkeypatch):
    """Euclidean k-means' assignment (``nearest``) writes its (G, C, N) scores into a buffer the thread
    keeps where nothing records gradients (k-means runs so), the same memory each time; with
    autograd on, a fresh tensor; the same assignment either way."""
    taken = []
    keep = clustering.kept_buffer
    monkeypatch.setattr(clustering, "kept_buffer", lambda *a: taken.append(keep(*a).data_ptr()) or keep(*a))
    points, centroids = randn(3, 50, 8, seed=1), randn(3, 7, 8, seed=2)
    metric = clustering.Euclidean(points)
    with torch.no_grad():
        first = metric.nearest(centroids)
        again = metric.nearest(centroids * 0.5)
    assert len(taken) == 2 and taken[0] == taken[1]
    with torch.enable_grad():
        assert torch.equal(metric.nearest(centroids), first) and len(taken) == 2
    nearest = lambda c: ((points[:, :, None] - c[:, None]) ** 2).sum(-1).argmin(-1)
    assert torch.equal(first, nearest(centroids)) and torch.equal(again, nearest(centroids * 0.5))

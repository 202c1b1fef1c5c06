"""Clustered and improved-clustered attention (Vyas, Katharopoulos & Fleuret 2020).

**Clustered** (§3.2, eq. 3–6). The L queries of each (batch, head) are grouped into C clusters;
each cluster's centroid is the mean of its queries, ``Q^c_j = Σ_{i∈j} Q_i / |j|`` (eq. 3). The
centroids attend once, ``A^c = softmax(Q^c Kᵀ · scale)`` (C × S, eq. 4), ``V^c = A^c V`` (eq. 5),
and every query takes its cluster's row, ``V̂_i = V^c_{c(i)}`` (eq. 6). Cost O(L·C·D + C·S·D).

**Improved clustered** (§3.3, eq. 9–10). Per cluster, the top-k keys of ``A^c_j`` are re-scored
exactly for each of its queries and rescaled to the mass ``m̂_j`` the centroid gave them; every
other key keeps the centroid's weight:

    A^t_il = m̂_j · exp(q_i·k_l·s) / Σ_{r∈T_j} exp(q_i·k_r·s)   if l ∈ T_j     (eq. 9)
    A^t_il = A^c_jl                                           otherwise

so ``V̂_i = (V^c_j − Σ_{l∈T_j} A^c_jl v_l) + m̂_j Σ_{l∈T_j} softmax_T(q_i·k·s)_l v_l`` (eq. 10).
Proposition 2: ``‖A^t_i − A_i‖₁ ≤ ‖A^c_j − A_i‖₁`` for every query. Extra cost O(L·k·D).

**Grouping.** The paper (§3.2.2) hashes the queries with B sign-of-random-projection bits and runs
Lloyd's k-means in Hamming space: the assignment step takes the centroid code with the fewest
differing bits, the update step each bit's majority vote (the Hamming-space median; a tied bit keeps
its value). With ``hash_offsets`` each hyperplane is shifted by a random offset relative to the
spread of the queries' projections (``μ_b + σ_b·u_b``), so a bit separates two queries with a
probability that grows with their projected distance and Hamming distance tracks L2 distance;
without, the planes pass through the origin (SimHash: the angle only). That is ``kmeans="hamming"``.

The default, ``kmeans="euclidean"``, runs Lloyd directly on the query vectors (squared L2, mean
update). Measured on clustered inputs it approximates attention several times better at the same
number of clusters (32 bits cannot keep nearby groups of queries apart), and it is as fast here:
a distance is one fused matmul either way, and it needs no hashing pass. Both metrics share:

- Initialisation by D² sampling (k-means++, in a few batched rounds as in k-means||), so
  well-separated groups of queries are not merged by an unlucky uniform draw.
- ``fit_per_cluster``: the centroids are fitted on a seeded random sample of that many real queries
  per cluster, then every query is assigned to its nearest centroid (0 fits on all queries, as the
  paper does). The attention centroids are the means of eq. 3 over *all* members either way.
- Lloyd stops early once an assignment step changes nothing: a fixed point, so the result equals
  that of all ``iterations`` steps.
- Padded queries (``query_padding_mask``) take no part in the fitting or the centroids and return
  zeros.

**Reproducibility.** The hash planes and offsets are buffers of ``ClusteredState``, drawn once from
the layer's seed. The initial centroids and the fitting sample come from a counter-based hash of
(seed, head, position): a row's clusters depend only on its own queries, not on the batch, the
grouping of rows or global RNG state. The same inputs always give the same outputs. Without a
state, seed 0 is used.

**Degenerate settings.** ``clusters >= L`` gives every query its own cluster, which is exact full
attention; ``topk >= S`` makes improved-clustered exact (``m̂ = 1``). Both are clamped, not errors.

**Implementation.** Everything is batched over (batch × head) rows, in groups of rows sized so the
(C × S) centroid scores stay a few MB (large temporaries cost page faults on every call). Hamming
distances are one matmul of ±1 codes; the nearest centroid is found with a max, not an argmax, by
folding ``−j/2^p`` into the dot products (exact integers plus a tag, so ``amax`` identifies the
lowest-indexed nearest centroid). The exact re-scoring of improved-clustered sorts the queries by
cluster and cuts each cluster into tiles of ``_TILE`` queries that share the cluster's k keys: one
batched matmul per step, with no (L × k × D) gather. Half-precision inputs are computed in fp32.

There is no causal form: the paper defines none (a centroid averages queries from the whole
sequence), so ``is_causal=True`` raises and names the mechanisms that have one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from subquad._blocks import BlockOutput, block_elements, tracks_grad
from subquad._validate import AttentionShape, check_attention_inputs, check_query_padding_mask
from subquad.registry import Config, Mechanism, no_causal_form, option

__all__ = [
    "ClusteredConfig",
    "ClusteredState",
    "ImprovedClusteredConfig",
    "cluster_queries",
    "clustered_attention",
    "improved_clustered_attention",
]

_TILE = 32  # queries per tile in the exact top-k re-scoring
_GROUP_ELEMENTS = 1 << 22  # (C × S) score elements per group of (batch × head) rows
_SEED_ROUNDS = 8  # rounds of D² sampling that choose the initial centroids


@dataclass(frozen=True)
class ClusteredConfig(Config):
    mechanism = "clustered"
    clusters: int = option(100, "query clusters C per (batch, head); clamped to the number of queries", ge=1)
    iterations: int = option(10, "Lloyd iterations of k-means (stops early at a fixed point)", ge=0)
    bits: int = option(32, "kmeans=hamming: bits B of the sign-of-random-projection query hash", ge=1, le=1024)
    hash_offsets: bool = option(
        True, "kmeans=hamming: offset each hash plane within the queries' spread, so Hamming tracks L2"
    )
    kmeans: str = option(
        "euclidean",
        "euclidean: Lloyd on the query vectors; hamming: Lloyd on the B-bit hashes (the paper)",
        choices=("euclidean", "hamming"),
    )
    fit_per_cluster: int = option(
        8, "fit the centroids on a seeded sample of this many queries per cluster, then assign all; 0: all", ge=0
    )


@dataclass(frozen=True)
class ImprovedClusteredConfig(ClusteredConfig):
    mechanism = "improved-clustered"
    topk: int = option(32, "keys per cluster re-scored exactly for each query; clamped to S", ge=1)


class ClusteredState(nn.Module):
    """The fixed hash planes and offsets of one layer's clustered heads, and the seed of the
    initial centroids. Built once from ``seed``; saved in ``state_dict``.

    Args:
        config: a ``ClusteredConfig`` (its ``bits``).
        num_heads: H; every head has its own planes.
        head_dim: D, the query width.
        seed: seeds the planes, the offsets and the choice of initial centroids.
    """

    def __init__(self, config: ClusteredConfig, num_heads: int, head_dim: int, seed: int = 0) -> None:
        super().__init__()
        seed = _fold_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer("planes", torch.randn(num_heads, head_dim, config.bits, generator=generator))
        self.register_buffer("offsets", torch.randn(num_heads, config.bits, generator=generator))
        self.register_buffer("seed", torch.tensor(seed, dtype=torch.long))

    def extra_repr(self) -> str:
        heads, dim, bits = self.planes.shape
        return f"heads={heads}, head_dim={dim}, bits={bits}, seed={int(self.seed)}"


def _fold_seed(seed: int) -> int:
    """Any int seed (negative, or past 2^63) as a 32-bit one, so hashes of it cannot overflow int64."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    seed %= 2**64
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


def _resolve_state(state: nn.Module | None, config: ClusteredConfig, shape: AttentionShape) -> ClusteredState:
    if state is None:
        return ClusteredState(config, shape.heads, shape.head_dim, 0)
    if not isinstance(state, ClusteredState):
        raise ValueError(f"{config.mechanism} needs a ClusteredState, got {type(state).__name__}")
    want = (shape.heads, shape.head_dim, config.bits)
    if tuple(state.planes.shape) != want:
        raise ValueError(
            f"{config.mechanism} state has planes of shape (heads, head_dim, bits) = {tuple(state.planes.shape)} "
            f"but this call needs {want}; build it as ClusteredState(config, {shape.heads}, {shape.head_dim}, seed)"
        )
    return state


# ---------------------------------------------------------------------------------------------
# Grouping the queries
# ---------------------------------------------------------------------------------------------


class _Hamming:
    """Lloyd's k-means in Hamming space over ±1 codes ``(G, N, B)``: the nearest centroid has the
    fewest differing bits, and a centroid bit is its members' majority vote (a tie keeps it)."""

    def __init__(self, codes: Tensor) -> None:
        self.points = codes
        G, N, _ = codes.shape
        # Codes, transposed, with a row of ones that multiplies each centroid's tag (see nearest).
        self.points_t = torch.cat([codes, codes.new_ones(G, N, 1)], dim=-1).transpose(1, 2).contiguous()

    def subset(self, index: Tensor) -> _Hamming:
        return _Hamming(_take(self.points, index))

    def distances(self, centroids: Tensor) -> Tensor:
        """``(G, N, r)`` differing bits to ``r`` centroids."""
        B = self.points.shape[-1]
        return (B - torch.bmm(self.points, centroids.transpose(1, 2))) * 0.5

    def nearest(self, centroids: Tensor) -> Tensor:
        # Hamming distance = (B − dot) / 2, so the nearest code has the largest dot. Tagging centroid
        # j with −j/2^p (p bits hold any j < C) makes the max of dot − j/2^p the largest dot at its
        # lowest j, read back from the fraction: exact in fp32 while (B + 1)·2^p < 2^24, and only
        # when matmuls run in full fp32 (TF32 or bf16 matmuls would round the tags).
        G, C, B = centroids.shape
        p = max(1, math.ceil(math.log2(C)))
        if (B + 1) * 2**p >= 2**24 or torch.get_float32_matmul_precision() != "highest":
            return torch.bmm(self.points, centroids.transpose(1, 2)).max(-1).indices
        tag = -torch.arange(C, dtype=centroids.dtype, device=centroids.device) * 2.0**-p
        tagged = torch.cat([centroids, tag.view(1, C, 1).expand(G, C, 1)], dim=-1)  # (G, C, B + 1)
        best = torch.bmm(tagged, self.points_t).amax(1)  # (G, N): max_j dot_j − j/2^p
        return ((torch.ceil(best) - best) * 2.0**p).round_().long()

    def update(self, centroids: Tensor, assign: Tensor, members: Tensor, weight: Tensor) -> Tensor:
        """``members``: the points times their weight (0 for padded points, which do not vote)."""
        votes = _cluster_sums(members, assign, centroids.shape[1])
        return torch.where(votes > 0, 1.0, torch.where(votes < 0, -1.0, centroids))


class _Euclidean:
    """Lloyd's k-means under squared L2 on the vectors ``(G, N, D)``: the mean update. An empty
    cluster keeps its centroid."""

    def __init__(self, x: Tensor) -> None:
        G, N, _ = x.shape
        # Points with a column of ones that multiplies each centroid's −‖c‖²/2: one matmul gives
        # x·c − ‖c‖²/2, whose max over c is the nearest centroid, with no broadcast add.
        self.augmented = torch.cat([x, x.new_ones(G, N, 1)], dim=-1)
        self.points = self.augmented[..., :-1]

    def subset(self, index: Tensor) -> _Euclidean:
        return _Euclidean(_take(self.points, index))

    def _scores(self, centroids: Tensor) -> Tensor:
        """``(G, N, r)`` x·c − ‖c‖²/2."""
        half_norms = -0.5 * centroids.square().sum(-1, keepdim=True)
        return torch.bmm(self.augmented, torch.cat([centroids, half_norms], dim=-1).transpose(1, 2))

    def distances(self, centroids: Tensor) -> Tensor:
        norms = self.points.square().sum(-1, keepdim=True)
        return (norms - 2 * self._scores(centroids)).clamp_min(0)

    def nearest(self, centroids: Tensor) -> Tensor:
        return self._scores(centroids).max(-1).indices  # argmin ‖x − c‖²; the first maximum on ties

    def update(self, centroids: Tensor, assign: Tensor, members: Tensor, weight: Tensor) -> Tensor:
        """``members``: the points times their weight (0 for padded points, which do not count)."""
        C = centroids.shape[1]
        sums = _cluster_sums(members, assign, C)
        counts = _cluster_sums(weight.unsqueeze(-1), assign, C)
        return torch.where(counts > 0, sums / counts.clamp_min(1), centroids)


def _take(x: Tensor, index: Tensor) -> Tensor:
    """Rows ``x[g, index[g]]``: ``(G, N, F)`` by ``(G, n)`` -> ``(G, n, F)``."""
    return torch.gather(x, 1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def _cluster_sums(x: Tensor, assign: Tensor, C: int) -> Tensor:
    """Per-cluster sums ``(G, C, F)`` of ``x`` ``(G, N, F)`` under ``assign`` ``(G, N)``."""
    G, N, F = x.shape
    if x.device.type != "cpu":  # index_add uses atomics there: a one-hot matmul is deterministic
        return torch.bmm(torch.nn.functional.one_hot(assign, C).to(x.dtype).transpose(1, 2), x)
    index = (assign + (torch.arange(G, device=x.device) * C).unsqueeze(-1)).view(-1)
    return x.new_zeros(G * C, F).index_add(0, index, x.reshape(G * N, F)).view(G, C, F)


def _uniform(seed: int, heads: Tensor, positions: Tensor, stream: int) -> Tensor:
    """Uniforms in (0, 1) shaped like ``positions`` ``(G, n)``: a fixed function of (seed, head, stream,
    position in the row).

    A counter-based hash rather than a generator: a query's draws depend on its own position only,
    not on the batch, the padded length, the grouping of rows or the device, so a row's clusters
    depend only on its own real queries.
    """
    mask = 0xFFFFFFFF
    x = positions + (heads.unsqueeze(1) * 0x9E3779B1 + (stream * 0x85EBCA77 + seed * 0xC2B2AE3D) % 2**32)
    x = x & mask
    for multiplier in (0x7FEB352D, 0x4C6A68B3):  # odd constants below 2^31: products stay below 2^63
        x = ((x ^ (x >> 16)) * multiplier) & mask
    x = x ^ (x >> 15)
    return ((x >> 8).to(torch.float32) + 0.5) * 2.0**-24


def _seed_centroids(
    metric: _Hamming | _Euclidean, weight: Tensor, positions: Tensor, C: int, seed: int, heads: Tensor
) -> Tensor:
    """``(G, C)`` indices of C distinct initial centroids, by D² sampling in ``_SEED_ROUNDS`` rounds.

    The first round draws uniformly among real points; each later round draws a batch without
    replacement with probability ∝ (distance to the nearest centroid so far)², by Gumbel-top-k. It is
    k-means++ (Arthur & Vassilvitskii 2007) with several draws per round, as in k-means||: points of
    clusters that hold no centroid yet are the likely draws, so well-separated groups are not merged
    by an unlucky uniform draw, and the rounds stay few and batched.
    """
    per_round = -(-C // min(C, _SEED_ROUNDS))
    chosen = (_uniform(seed, heads, positions, 1) - weight).topk(per_round, dim=1, largest=False).indices  # real 1st
    picks = [chosen]
    nearest = metric.distances(_take(metric.points, chosen)).amin(-1)  # (G, N)
    padded = weight == 0
    while sum(p.shape[1] for p in picks) < C:
        r = min(per_round, C - sum(p.shape[1] for p in picks))
        gumbel = -torch.log(-torch.log(_uniform(seed, heads, positions, 1 + len(picks))))
        keys = (2 * torch.log(nearest) + gumbel).masked_fill_(padded, float("-inf"))
        chosen = keys.topk(r, dim=1).indices
        picks.append(chosen)
        nearest = torch.minimum(nearest, metric.distances(_take(metric.points, chosen)).amin(-1))
    return torch.cat(picks, dim=1)


def _lloyd(metric: _Hamming | _Euclidean, weight: Tensor, init: Tensor, iterations: int) -> tuple[Tensor, Tensor]:
    """Lloyd's iterations from the points at ``init``; stops at a fixed point. Returns the centroids
    and the assignment of ``metric``'s points to them."""
    centroids = _take(metric.points, init)
    assign = metric.nearest(centroids)
    members = metric.points * weight.unsqueeze(-1)
    for _ in range(iterations):
        centroids = metric.update(centroids, assign, members, weight)
        new = metric.nearest(centroids)
        if torch.equal(new, assign):
            break
        assign = new
    return centroids, assign


def _hash(q: Tensor, weight: Tensor, planes: Tensor, offsets: Tensor | None) -> Tensor:
    """±1 codes ``(G, L, B)``: the sign of each query's projection on each plane, minus its threshold.

    With ``offsets`` ``(G, B)`` the threshold of plane b is ``μ_b + σ_b·u_b``: the mean and spread
    of the real queries' projections, shifted by the plane's fixed random offset ``u_b``.
    """
    proj = torch.bmm(q, planes)  # (G, L, B)
    if offsets is not None:
        count = weight.sum(1).clamp_min(1).view(-1, 1, 1)
        w = weight.unsqueeze(-1)
        mean = (proj * w).sum(1, keepdim=True) / count
        std = (((proj - mean) * w).square().sum(1, keepdim=True) / count).sqrt()
        proj = proj - (mean + std * offsets.unsqueeze(1))
    return torch.where(proj > 0, 1.0, -1.0).to(torch.float32)


def cluster_queries(
    q: Tensor,
    config: ClusteredConfig,
    state: ClusteredState,
    weight: Tensor,
    heads: Tensor,
) -> Tensor:
    """Assign each query of each (batch, head) row to one of ``min(C, L)`` clusters.

    Args:
        q: ``(G, L, D)`` queries of G rows (in fp32 or fp64).
        config: the clustering options.
        state: the hash planes and seed.
        weight: ``(G, L)`` 1 for real queries, 0 for padded ones.
        heads: ``(G,)`` the head index of each row (which planes it uses).

    Returns:
        ``(G, L)`` long cluster indices in ``[0, min(C, L))``.
    """
    G, L, _ = q.shape
    C = min(config.clusters, L)
    if C == L:  # one cluster per query: exact
        return torch.arange(L, device=q.device).expand(G, L)
    if config.kmeans == "euclidean":
        metric: _Hamming | _Euclidean = _Euclidean(q)
    else:
        planes = state.planes.to(device=q.device, dtype=q.dtype)[heads]  # (G, D, B)
        offsets = state.offsets.to(device=q.device, dtype=q.dtype)[heads] if config.hash_offsets else None
        metric = _Hamming(_hash(q, weight, planes, offsets))
        weight = weight.to(torch.float32)
    seed = int(state.seed)
    positions = torch.arange(L, device=q.device).expand(G, L)
    fit, fit_weight, fit_positions = metric, weight, positions
    if config.fit_per_cluster and config.fit_per_cluster * C < L:
        # Fit on a seeded random sample of the real queries (all of them when fewer), then assign all.
        sample = (_uniform(seed, heads, positions, 0) - weight).topk(config.fit_per_cluster * C, largest=False)
        fit, fit_weight, fit_positions = (
            metric.subset(sample.indices),
            torch.gather(weight, 1, sample.indices),
            sample.indices,
        )
    init = _seed_centroids(fit, fit_weight, fit_positions, C, seed, heads)
    centroids, assign = _lloyd(fit, fit_weight, init, config.iterations)
    return assign if fit is metric else metric.nearest(centroids)


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


def _masked_softmax(scores: Tensor, real: Tensor | None) -> Tensor:
    """Softmax over the last dim where ``real`` (broadcastable bool) marks keys that may take weight;
    a row without any such key is all zeros."""
    if real is None:
        return torch.softmax(scores, dim=-1)
    scores = scores.masked_fill(~real, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) * real


def _rescore_topk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    assign: Tensor,
    probs: Tensor,
    centroid_out: Tensor,
    key_real: Tensor | None,
    topk: int,
    scale: float,
) -> Tensor:
    """Improved-clustered output (eq. 9–10) for G rows: ``(G, L, Dv)``.

    For query i of cluster j: ``V^c_j + Σ_{l∈T_j} (m̂_j · softmax_T(q_i·k·s)_l − A^c_jl) v_l``, which
    is eq. 10 with the centroid's weights on its top-k keys swapped for the re-scored ones.
    """
    G, L, D = q.shape
    S, Dv = k.shape[1], v.shape[2]
    C = probs.shape[1]
    device = q.device
    top_probs, top_idx = probs.topk(min(topk, S), dim=-1)  # (G, C, k)
    kk = top_idx.shape[-1]
    top_rows = (top_idx + (torch.arange(G, device=device) * S).view(G, 1, 1)).view(G * C, kk)  # into (G·S)
    mass = top_probs.sum(-1).view(G * C, 1, 1)  # m̂_j

    # Sort the queries by cluster and cut each cluster into tiles of at most `tile` queries.
    cluster = (assign + (torch.arange(G, device=device) * C).unsqueeze(-1)).view(-1)  # (G·L,) in [0, G·C)
    order = torch.sort(cluster, stable=True).indices
    counts = torch.bincount(cluster, minlength=G * C)
    tile = _TILE
    starts = torch.cumsum(counts, 0) - counts
    tiles = (counts + tile - 1) // tile
    tile_cluster = torch.repeat_interleave(torch.arange(G * C, device=device), tiles)  # (T,)
    first_tile = torch.cumsum(tiles, 0) - tiles
    rank = torch.arange(tile_cluster.numel(), device=device) - first_tile[tile_cluster]
    pos = (starts[tile_cluster] + rank * tile).unsqueeze(-1) + torch.arange(tile, device=device)  # (T, tile)
    rows = order.index_select(0, pos.clamp_max(G * L - 1).view(-1))  # query per tile slot, into (G·L)
    T = tile_cluster.numel()
    # Where each query's row lands among the tile slots (the inverse of `rows` on the valid slots).
    sorted_cluster = cluster.index_select(0, order)
    sorted_slot = first_tile[sorted_cluster] * tile + torch.arange(G * L, device=device) - starts[sorted_cluster]
    slot = torch.empty_like(sorted_slot).scatter_(0, order, sorted_slot)

    key_rows = top_rows.index_select(0, tile_cluster).view(-1)  # (T·k,)
    q_tile = q.reshape(G * L, D).index_select(0, rows).view(T, tile, D)
    k_tile = k.reshape(G * S, D).index_select(0, key_rows).view(T, kk, D)
    v_tile = v.reshape(G * S, Dv).index_select(0, key_rows).view(T, kk, Dv)
    scores = torch.bmm(q_tile, k_tile.transpose(1, 2)).mul_(scale)  # (T, tile, k)
    top_real = None
    if key_real is not None:
        top_real = key_real.reshape(G * S).index_select(0, key_rows).view(T, 1, kk)
    exact = _masked_softmax(scores, top_real) * mass.index_select(0, tile_cluster)
    swap = exact - top_probs.view(G * C, 1, kk).index_select(0, tile_cluster)
    correction = torch.bmm(swap, v_tile).view(T * tile, Dv).index_select(0, slot)  # (G·L, Dv)
    return (centroid_out.view(G * C, Dv).index_select(0, cluster) + correction).view(G, L, Dv)


def _clustered(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    config: ClusteredConfig,
    state: nn.Module | None,
    query_padding_mask: Tensor | None,
    improved: bool,
) -> Tensor:
    want = ImprovedClusteredConfig if improved else ClusteredConfig
    if type(config) is not want:
        raise ValueError(
            f"{want.mechanism} needs a {want.__name__}, got {type(config).__name__}; "
            "clustered and improved-clustered each take their own config"
        )
    shape = check_attention_inputs(q, k, v, key_padding_mask, is_causal, scale)
    if is_causal:
        raise ValueError(no_causal_form(config.mechanism))
    check_query_padding_mask(query_padding_mask, shape, q.device)
    state = _resolve_state(state, config, shape)
    B, H, L, S, D, Dv = shape.batch, shape.heads, shape.queries, shape.keys, shape.head_dim, shape.value_dim
    C = min(config.clusters, L)
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    rows = B * H
    qf, kf, vf = q.reshape(rows, L, D), k.reshape(rows, S, D), v.reshape(rows, S, Dv)
    key_real = None if key_padding_mask is None else key_padding_mask.repeat_interleave(H, dim=0)  # (BH, S)
    query_real = None if query_padding_mask is None else query_padding_mask.repeat_interleave(H, dim=0)
    heads = torch.arange(H, device=q.device).repeat(B)
    # The largest temporaries per (batch × head) row: scores (C × S), assignment scores (L × C) and,
    # when re-scoring, the tiles of queries and of each cluster's top keys and values.
    per_row = max(C * S, L * C)
    if improved:
        kk = min(config.topk, S)
        per_row = max(per_row, L * D + (L // _TILE + C) * kk * (D + Dv))
    group = max(1, min(rows, block_elements(_GROUP_ELEMENTS, q.device) // per_row))
    result = BlockOutput((rows, L, Dv), 0, q, tracks_grad(q, k, v))
    # split, not slices: one backward node for all groups (each slice's backward fills a full-size zero)
    for r, qg, kg, vg in zip(range(0, rows, group), qf.split(group), kf.split(group), vf.split(group)):
        sl = slice(r, r + group)
        qg, kg, vg = qg.to(work), kg.to(work), vg.to(work)
        G = qg.shape[0]
        weight = qg.new_ones(G, L) if query_real is None else query_real[sl].to(work)
        if query_real is not None:  # whatever sits at padded queries (even inf or NaN) stays out
            qg = torch.where(query_real[sl].unsqueeze(-1), qg, 0.0)
        with torch.no_grad():
            assign = cluster_queries(qg.detach(), config, state, weight, heads[sl])
        sums = _cluster_sums(qg, assign, C)  # padded queries are zero here
        counts = _cluster_sums(weight.unsqueeze(-1), assign, C)
        centroids = sums / counts.clamp_min(1)  # eq. 3, (G, C, D)
        kr = None if key_real is None else key_real[sl].unsqueeze(1)  # (G, 1, S)
        probs = _masked_softmax(torch.bmm(centroids * shape.scale, kg.transpose(1, 2)), kr)  # A^c, eq. 4
        centroid_out = torch.bmm(probs, vg)  # V^c, eq. 5
        if improved:
            out = _rescore_topk(qg, kg, vg, assign, probs, centroid_out, kr, config.topk, shape.scale)
        else:
            index = (assign + (torch.arange(G, device=q.device) * C).unsqueeze(-1)).view(-1)
            out = centroid_out.view(G * C, Dv).index_select(0, index).view(G, L, Dv)  # eq. 6
        if query_real is not None:
            out = out * weight.unsqueeze(-1)
        result.put(out.to(q.dtype))
    return result.result().view(B, H, L, Dv)


def clustered_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    config: ClusteredConfig | None = None,
    state: nn.Module | None = None,
    query_padding_mask: Tensor | None = None,
) -> Tensor:
    """Clustered attention (eq. 3–6): each query gets its cluster centroid's attention output.

    Args:
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, Dv)``.
        key_padding_mask: bool ``(B, S)``, True marks a real key.
        is_causal: must be False; there is no causal form.
        scale: default ``D ** -0.5``.
        config: ``ClusteredConfig``.
        state: ``ClusteredState`` with the hash planes and seed; seed 0 when None.
        query_padding_mask: bool ``(B, L)``, True marks a real query; padded queries are left out
            of the clustering and return zeros. Layers pass the key mask here in self-attention.

    Returns:
        ``(B, H, L, Dv)``.
    """
    config = config or ClusteredConfig()
    return _clustered(q, k, v, key_padding_mask, is_causal, scale, config, state, query_padding_mask, False)


def improved_clustered_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    config: ImprovedClusteredConfig | None = None,
    state: nn.Module | None = None,
    query_padding_mask: Tensor | None = None,
) -> Tensor:
    """Improved clustered attention (eq. 9–10): clustered, plus exact re-scoring of each cluster's
    top-k keys for each of its queries. Arguments as ``clustered_attention``."""
    config = config or ImprovedClusteredConfig()
    return _clustered(q, k, v, key_padding_mask, is_causal, scale, config, state, query_padding_mask, True)


_PAPER = "Vyas, Katharopoulos & Fleuret 2020, Fast Transformers with Clustered Attention"

CLUSTERED = Mechanism(
    name="clustered",
    fn=clustered_attention,
    config=ClusteredConfig,
    summary="queries grouped by k-means (or LSH + Hamming k-means); one softmax per centroid, broadcast back",
    paper=f"{_PAPER}, §3.2 eq. 3-6",
    causal=False,
    tensor_args=("query_padding_mask",),
    groups_queries=True,
    state=ClusteredState,
    examples=(
        {},
        {"clusters": 3},
        {"clusters": 2, "kmeans": "hamming", "bits": 8, "iterations": 3},
        {"clusters": 5, "fit_per_cluster": 0},
    ),
)

IMPROVED_CLUSTERED = Mechanism(
    name="improved-clustered",
    fn=improved_clustered_attention,
    config=ImprovedClusteredConfig,
    summary="clustered, plus exact re-scoring of each cluster's top-k keys for every query",
    paper=f"{_PAPER}, §3.3 eq. 9-10",
    causal=False,
    tensor_args=("query_padding_mask",),
    groups_queries=True,
    state=ClusteredState,
    examples=({}, {"clusters": 3, "topk": 4}, {"clusters": 2, "kmeans": "hamming", "bits": 8, "topk": 2}),
)

MECHANISMS = (CLUSTERED, IMPROVED_CLUSTERED)

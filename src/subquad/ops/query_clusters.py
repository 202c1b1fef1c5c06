"""Clustered attention's shared maths (Vyas et al. 2020): queries grouped by k-means (Euclidean,
or Hamming on LSH codes), one softmax per centroid, its output broadcast back to the cluster's
queries. ``mechanisms/clustered.py`` is this (§3.2); ``mechanisms/improved_clustered.py`` adds its
re-scoring of each cluster's top keys (§3.3) as the ``rescore`` step. The mechanisms' docstrings
give the maths and the choices; the figures are in docs/performance.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from subquad._validate import AttentionShape, check_attention_inputs, check_query_padding_mask, work_dtype
from subquad.kernels.memory import BlockOutput, kept_buffer, tracks_grad
from subquad.kernels.tuning import TUNING, block_elements
from subquad.ops.clustering import (
    Euclidean,
    Hamming,
    cluster_counts,
    cluster_sums,
    flat_clusters,
    lloyd,
    seed_and_assign,
    seed_centroids,
    seed_draws,
    sign_codes,
)
from subquad.ops.hashing import position_uniform
from subquad.registry import Config, no_causal_form, option

__all__ = [
    "ClusteredConfig",
    "ClusteredState",
    "Rescore",
    "cluster_queries",
    "clustered_outputs",
    "exactly_full",
    "masked_softmax",
]

# improved-clustered's step after the centroids: (q, k, v, assign, A^c, V^c, key_real, scale) -> (G, L, Dv)
Rescore = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, float], Tensor]


@dataclass(frozen=True)
class ClusteredConfig(Config):
    mechanism = "clustered"
    clusters: int = option(100, "query clusters C per (batch, head); clamped to the number of queries", ge=1)
    iterations: int = option(
        3, "Lloyd iterations of k-means (stops early at a fixed point; 10 changed MiniLM's outputs by < 1e-3)", ge=0
    )
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


@functools.lru_cache(maxsize=32)
def _default_state(bits: int, heads: int, head_dim: int) -> ClusteredState:
    """The state of a call without one (seed 0), built once per shape: drawing its planes cost
    more than the clustering itself on short sequences. Never modified."""
    return ClusteredState(ClusteredConfig(bits=bits), heads, head_dim, 0)


def _resolve_state(state: nn.Module | None, config: ClusteredConfig, shape: AttentionShape) -> ClusteredState:
    if state is None:
        return _default_state(config.bits, shape.heads, shape.head_dim)
    if not isinstance(state, ClusteredState):
        raise ValueError(f"{config.mechanism} needs a ClusteredState, got {type(state).__name__}")
    want = (shape.heads, shape.head_dim, config.bits)
    if tuple(state.planes.shape) != want:
        raise ValueError(
            f"{config.mechanism} state has planes of shape (heads, head_dim, bits) = {tuple(state.planes.shape)} "
            f"but this call needs {want}; build it as ClusteredState(config, {shape.heads}, {shape.head_dim}, seed)"
        )
    return state


def exactly_full(
    config: ClusteredConfig, shape: AttentionShape, is_causal: bool, state: nn.Module | None, tensors: Mapping
) -> bool:
    """``Mechanism.exact_full`` of both clustered mechanisms: a cluster per query (``clusters >= L``),
    or, re-scoring, every key re-scored (``topk >= S``). A state of the wrong kind or shape raises
    all the same."""
    _resolve_state(state, config, shape)
    topk = getattr(config, "topk", None)
    return config.clusters >= shape.queries or (topk is not None and topk >= shape.keys)


def cluster_queries(
    q: Tensor,
    config: ClusteredConfig,
    state: ClusteredState,
    weight: Tensor | None,
    heads: Tensor,
) -> Tensor:
    """Assign each query of each (batch, head) row to one of ``min(C, L)`` clusters.

    Args:
        q: ``(G, L, D)`` queries of G rows (in fp32 or fp64).
        config: the clustering options.
        state: the hash planes and seed.
        weight: ``(G, L)`` 1 for real queries, 0 for padded ones; None: every query is real.
        heads: ``(G,)`` the head index of each row (which planes it uses).

    Returns:
        ``(G, L)`` long cluster indices in ``[0, min(C, L))``.
    """
    G, L, _ = q.shape
    C = min(config.clusters, L)
    if C == L:  # one cluster per query: exact
        return torch.arange(L, device=q.device).expand(G, L)
    if config.kmeans == "euclidean":
        metric: Hamming | Euclidean = Euclidean(q)
    else:
        planes = state.planes.to(device=q.device, dtype=q.dtype)[heads]  # (G, D, B)
        offsets = state.offsets.to(device=q.device, dtype=q.dtype)[heads] if config.hash_offsets else None
        metric = Hamming(sign_codes(q, q.new_ones(G, L) if weight is None else weight.to(q.dtype), planes, offsets))
    if weight is not None:
        weight = weight.to(metric.points.dtype)
    seed = int(state.seed)
    fit_size = L
    if config.fit_per_cluster and config.fit_per_cluster * C < L:
        fit_size = config.fit_per_cluster * C
    # Fit on a seeded random sample of the real queries (all of them when fewer), then assign all.
    if weight is None:  # the draws depend on the shape alone: made once per shape
        sample, first, factors = _all_real_draws(seed, state.planes.shape[0], L, fit_size, C, q.device)
        if sample is not None:
            sample = sample[heads]
        draws, fit_weight = (first[heads], factors[:, heads]), None
    else:
        sample, draws, fit_weight = _draws(seed, heads, weight, fit_size, C)
    fit = metric if sample is None else metric.subset(sample)
    if config.iterations == 0 and sample is not None:  # Lloyd assigns everyone to the seeds
        init, first = seed_centroids(fit, fit_weight, C, draws), None
    else:
        init, first = seed_and_assign(fit, fit_weight, C, draws)
    return lloyd(fit, fit_weight, init, config.iterations, None if sample is None else metric, first)[1]


def _draws(
    seed: int, heads: Tensor, weight: Tensor, fit_size: int, C: int
) -> tuple[Tensor | None, tuple[Tensor, Tensor], Tensor]:
    """The fitting sample ``(G, n)`` of real queries (None: all queries are fitted), the seeding
    draws and the sample's weights: a fixed function of (seed, head, position, weight)."""
    positions = torch.arange(weight.shape[1], device=weight.device).expand_as(weight)
    sample = None
    if fit_size < weight.shape[1]:
        draw = torch.where(weight > 0, position_uniform(seed, heads, positions, 0), 2.0)  # real queries first
        sample = draw.topk(fit_size, largest=False).indices
        positions, weight = sample, torch.gather(weight, 1, sample)
    return sample, seed_draws(weight, positions, C, seed, heads), weight


@functools.lru_cache(maxsize=64)
def _all_real_draws(
    seed: int, heads: int, L: int, fit_size: int, C: int, device: torch.device
) -> tuple[Tensor | None, Tensor, Tensor]:
    """``_draws`` of every head ``0 … heads − 1`` over L real queries, made once per shape and
    never modified: on short sequences the draws cost more than the clustering."""
    weight = torch.ones(heads, L, device=device)
    sample, (first, factors), _ = _draws(seed, torch.arange(heads, device=device), weight, fit_size, C)
    return sample, first, factors


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


def masked_softmax(scores: Tensor, real: Tensor | None, in_place: bool = False) -> Tensor:
    """Softmax over the last dim where ``real`` (broadcastable bool) marks keys that may take weight;
    a row without any such key is all zeros. ``in_place``: into ``scores`` (without autograd)."""
    if in_place:
        if real is not None:
            scores.masked_fill_(~real, torch.finfo(scores.dtype).min)
        scores = torch.softmax(scores, dim=-1, out=scores)
        return scores if real is None else scores.mul_(real)
    if real is None:
        return torch.softmax(scores, dim=-1)
    scores = scores.masked_fill(~real, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) * real


def clustered_outputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    config: ClusteredConfig,
    state: nn.Module | None,
    query_padding_mask: Tensor | None,
    rescore: Rescore | None = None,
) -> Tensor:
    """Clustered attention of every (batch, head) row, in groups of rows; ``rescore`` replaces
    each query's centroid output (eq. 6) with its own (improved-clustered's eq. 10)."""
    shape = check_attention_inputs(q, k, v, key_padding_mask, is_causal, scale)
    if is_causal:
        raise ValueError(no_causal_form(config.mechanism))
    check_query_padding_mask(query_padding_mask, shape, q.device)
    state = _resolve_state(state, config, shape)
    B, H, L, S, D, Dv = shape.batch, shape.heads, shape.queries, shape.keys, shape.head_dim, shape.value_dim
    C = min(config.clusters, L)
    work = work_dtype(q.dtype)
    rows = B * H
    qf, kf, vf = q.reshape(rows, L, D), k.reshape(rows, S, D), v.reshape(rows, S, Dv)
    key_real = None if key_padding_mask is None else key_padding_mask.repeat_interleave(H, dim=0)  # (BH, S)
    query_real = None if query_padding_mask is None else query_padding_mask.repeat_interleave(H, dim=0)
    heads = torch.arange(H, device=q.device).repeat(B)
    group = _rows_per_group(shape, C, getattr(config, "topk", None), q.device)
    result = BlockOutput((rows, L, Dv), 0, q, tracks_grad(q, k, v))
    # split, not slices: one backward node for all groups (each slice's backward fills a full-size zero)
    for r, qg, kg, vg in zip(range(0, rows, group), qf.split(group), kf.split(group), vf.split(group)):
        sl = slice(r, r + group)
        qg, kg, vg = qg.to(work), kg.to(work), vg.to(work)
        G = qg.shape[0]
        weight = None if query_real is None else query_real[sl].to(work)  # None: every query is real
        if query_real is not None:  # whatever sits at padded queries (even inf or NaN) stays out
            qg = torch.where(query_real[sl].unsqueeze(-1), qg, 0.0)
        with torch.no_grad():
            assign = cluster_queries(qg.detach(), config, state, weight, heads[sl])
        counts = cluster_counts(assign, C, weight, work).unsqueeze(-1)
        centroids = cluster_sums(qg, assign, C) / counts.clamp_min(1)  # eq. 3, (G, C, D); padded queries are 0
        kr = None if key_real is None else key_real[sl].unsqueeze(1)  # (G, 1, S)
        scores = None if result.track else kept_buffer("clustered.scores", G * C * S, work, q.device).view(G, C, S)
        scores = torch.bmm(centroids * shape.scale, kg.transpose(1, 2), out=scores)
        probs = masked_softmax(scores, kr, in_place=not result.track)  # A^c, eq. 4
        centroid_out = torch.bmm(probs, vg)  # V^c, eq. 5
        if rescore is not None:
            out = rescore(qg, kg, vg, assign, probs, centroid_out, kr, shape.scale)
        else:
            out = centroid_out.view(G * C, Dv).index_select(0, flat_clusters(assign, C)).view(G, L, Dv)  # eq. 6
        if weight is not None:
            out = out * weight.unsqueeze(-1)
        result.put(out.to(q.dtype))
    return result.result().view(B, H, L, Dv)


def _rows_per_group(shape: AttentionShape, C: int, topk: int | None, device: torch.device) -> int:
    """(batch × head) rows computed together, in groups of equal size: their scores (C × S) and
    assignment scores (L × C) fit the ``TUNING.clustered_group`` budget and, when re-scoring the
    top-k, their tiles of queries and of each cluster's top keys and values the
    ``TUNING.clustered_tiles`` one. Every group repeats the clustering's hundred-odd small
    operations, so groups are as few as the budgets allow (docs/performance.md)."""
    L, S, D, Dv = shape.queries, shape.keys, shape.head_dim, shape.value_dim
    rows = shape.batch * shape.heads
    most = block_elements(TUNING.clustered_group, device) // max(C * S, L * C)
    if topk is not None:
        kk = min(topk, S)
        tiles = L * D + (L // TUNING.clustered_tile + C) * kk * (D + Dv)
        most = min(most, block_elements(TUNING.clustered_tiles, device) // tiles)
    groups = -(-rows // max(1, min(rows, most)))
    return -(-rows // groups)

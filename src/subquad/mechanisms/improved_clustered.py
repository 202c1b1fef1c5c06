"""Improved clustered attention (Vyas, Katharopoulos & Fleuret 2020, §3.3): clustered attention
(``mechanisms.clustered``, whose grouping it shares) with each cluster's top-k keys re-scored.

Per cluster, the top-k keys of ``A^c_j`` are re-scored
exactly for each of its queries and rescaled to the mass ``m̂_j`` the centroid gave them; every
other key keeps the centroid's weight:

    A^t_il = m̂_j · exp(q_i·k_l·s) / Σ_{r∈T_j} exp(q_i·k_r·s)   if l ∈ T_j     (eq. 9)
    A^t_il = A^c_jl                                           otherwise

so ``V̂_i = (V^c_j − Σ_{l∈T_j} A^c_jl v_l) + m̂_j Σ_{l∈T_j} softmax_T(q_i·k·s)_l v_l`` (eq. 10).
Proposition 2: ``‖A^t_i − A_i‖₁ ≤ ‖A^c_j − A_i‖₁`` for every query. Extra cost O(L·k·D).

**Computation.** The queries are sorted by cluster and each cluster cut into tiles of
``TUNING.clustered_tile`` queries that share the cluster's k keys: one batched matmul per step,
with no (L × k × D) gather. Without autograd the tiles go in chunks of ``TUNING.clustered_chunk``
elements, so that the rows a chunk gathers are still in cache when its products read them.
``topk >= S`` makes it exact (m̂ = 1): clamped, not an error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from subquad.kernels.memory import new_buffers, tracks_grad
from subquad.kernels.tuning import TUNING, block_elements
from subquad.ops.clustering import flat_clusters
from subquad.ops.query_clusters import ClusteredConfig, ClusteredState, clustered_outputs, exactly_full, masked_softmax
from subquad.registry import Mechanism, option

__all__ = ["ImprovedClusteredConfig", "improved_clustered_attention", "rescore_topk", "top_keys"]


@dataclass(frozen=True)
class ImprovedClusteredConfig(ClusteredConfig):
    mechanism = "improved-clustered"
    topk: int = option(32, "keys per cluster re-scored exactly for each query; clamped to S", ge=1)


def top_keys(probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest of each row of ``probs`` ``(G, C, S)`` and their indices, in no particular order:
    ``probs.topk(k, sorted=False)`` (tied values may pick other indices).

    On CPU, where ``a·k <= S < b·k`` (``TUNING.topk_two_stage_from``, ``topk_two_stage_below``), in
    two stages: the k chunks of w keys (``TUNING.topk_chunk``) with the largest maxima, then the k
    largest of their w·k entries. Exact: a chunk left out has its maximum at most the k-th largest
    maximum, and the chunks kept hold k entries at least that large. Why: torch's CPU top-k runs a
    selection over the whole row in that range, which the two stages beat; from b·k on its partial
    sort is as fast (docs/performance.md has the figures).
    """
    G, C, S = probs.shape
    low, high = TUNING.topk_two_stage_from, TUNING.topk_two_stage_below
    if probs.device.type != "cpu" or not low * k <= S < high * k:
        return probs.topk(k, dim=-1, sorted=False)
    width = TUNING.topk_chunk
    n = -(-S // width)
    padded = probs if n * width == S else F.pad(probs, (0, n * width - S), value=float("-inf"))
    maxima = F.max_pool1d(padded.view(G * C, 1, n * width), width).view(G, C, n)  # 3× faster than amax over 4
    chunks = maxima.topk(k, dim=-1, sorted=False).indices  # (G, C, k)
    candidates = (chunks.unsqueeze(-1) * width + torch.arange(width, device=probs.device)).view(G, C, k * width)
    values, picked = padded.gather(-1, candidates).topk(k, dim=-1, sorted=False)
    return values, candidates.gather(-1, picked)


def rescore_topk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    assign: Tensor,
    probs: Tensor,
    centroid_out: Tensor,
    key_real: Tensor | None,
    scale: float,
    topk: int,
) -> Tensor:
    """Improved-clustered output (eq. 9–10) for G rows: ``(G, L, Dv)``.

    For query i of cluster j: ``V^c_j + Σ_{l∈T_j} (m̂_j · softmax_T(q_i·k·s)_l − A^c_jl) v_l``, which
    is eq. 10 with the centroid's weights on its top-k keys swapped for the re-scored ones.
    """
    G, L, D = q.shape
    S, Dv = k.shape[1], v.shape[2]
    C = probs.shape[1]
    device = q.device
    # Tiles of TUNING.clustered_tile queries; clusters of 4 tiles or more on average take tiles
    # twice as long, which repeat each cluster's top keys half as often (docs/performance.md).
    tile = TUNING.clustered_tile * (2 if L >= 4 * TUNING.clustered_tile * C else 1)
    rows, tile_cluster, slot = _tile_layout(assign, C, tile)  # before the top-k: a sort after one runs slower
    T = tile_cluster.numel()
    top_probs, top_idx = top_keys(probs, min(topk, S))  # (G, C, k), in no particular order
    kk = top_idx.shape[-1]
    top_rows = (top_idx + (torch.arange(G, device=device) * S).view(G, 1, 1)).view(G * C, kk)  # into (G·S)
    mass = top_probs.sum(-1).view(G * C, 1, 1)  # m̂_j

    key_rows = top_rows.index_select(0, tile_cluster)  # (T, k), into (G·S)
    neg_top = -top_probs.view(G * C, 1, kk).index_select(0, tile_cluster)  # −A^c on each tile's keys
    tile_mass = mass.index_select(0, tile_cluster)
    tile_base = centroid_out.view(G * C, 1, Dv).index_select(0, tile_cluster)  # V^c_j
    qf, kf, vf = q.reshape(G * L, D), k.reshape(G * S, D), v.reshape(G * S, Dv)
    kr = None if key_real is None else key_real.reshape(G * S)
    if tracks_grad(q, k, v):  # all tiles at once: out= takes no gradient
        out = _tiles(qf, kf, vf, kr, rows, key_rows, neg_top, tile_mass, tile_base, scale)
    else:
        # Chunks of tiles whose gathered queries, keys and values stay in cache for the products that
        # read them, written through reused buffers (docs/performance.md).
        step = max(1, block_elements(TUNING.clustered_chunk, device) // (tile * D + kk * (D + Dv)))
        step = -(-T // -(-T // step))  # equal chunks
        n = min(step, T)
        buffers = new_buffers([(n * tile, D), (n * kk, D), (n * kk, Dv), (T, tile, Dv)], q.dtype, device, zero=False)
        out = buffers[3]
        for part in zip(*(x.split(step) for x in (rows, key_rows, neg_top, tile_mass, tile_base, out))):
            _tiles(qf, kf, vf, kr, *part[:5], scale, buffers=buffers[:3], out=part[5])
    return out.view(T * tile, Dv).index_select(0, slot).view(G, L, Dv)


def _tile_layout(assign: Tensor, C: int, tile: int) -> tuple[Tensor, Tensor, Tensor]:
    """The queries of ``assign`` ``(G, L)`` sorted by cluster, each cluster cut into tiles of at
    most ``tile``. Returns the query of each tile slot ``(T, tile)``, each tile's cluster ``(T,)``
    and each query's slot ``(G·L,)``, into the flattened (G·L) queries and (G·C) clusters. The
    unused slots of a cluster's last tile hold queries of the clusters after it, whose results
    there are never read."""
    G, L = assign.shape
    device = assign.device
    cluster = flat_clusters(assign, C)  # (G·L,) in [0, G·C)
    # the order of a stable sort of `cluster`, row by row: the rows' sorts run in parallel
    order = torch.sort(assign, dim=1, stable=True).indices + (torch.arange(G, device=device) * L).unsqueeze(-1)
    order = order.view(-1)
    counts = torch.bincount(cluster, minlength=G * C)
    starts = torch.cumsum(counts, 0) - counts
    tiles = (counts + tile - 1) // tile
    tile_cluster = torch.repeat_interleave(torch.arange(G * C, device=device), tiles)  # (T,)
    first_tile = torch.cumsum(tiles, 0) - tiles
    rank = torch.arange(tile_cluster.numel(), device=device) - first_tile[tile_cluster]
    pos = (starts[tile_cluster] + rank * tile).unsqueeze(-1) + torch.arange(tile, device=device)  # (T, tile)
    rows = order.index_select(0, pos.clamp_max(G * L - 1).view(-1)).view(-1, tile)
    # Where each query's row lands among the tile slots (the inverse of `rows` on the valid slots).
    sorted_cluster = cluster.index_select(0, order)
    sorted_slot = first_tile[sorted_cluster] * tile + torch.arange(G * L, device=device) - starts[sorted_cluster]
    slot = torch.empty_like(sorted_slot).scatter_(0, order, sorted_slot)
    return rows, tile_cluster, slot


def _tiles(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_real: Tensor | None,
    rows: Tensor,
    key_rows: Tensor,
    neg_top: Tensor,
    mass: Tensor,
    base: Tensor,
    scale: float,
    buffers: list[Tensor] | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Eq. 10 for ``n`` tiles: the queries ``q[rows]`` ``(n, tile)`` against their cluster's top
    keys ``k[key_rows]`` ``(n, k)``: ``base + (mass · softmax_T(q·kᵀ·scale) + neg_top) · v[key_rows]``
    ``(n, tile, Dv)``; gathered into ``buffers`` and written to ``out`` when given (no autograd)."""
    (n, tile), kk = rows.shape, key_rows.shape[1]
    flat_keys = key_rows.reshape(-1)
    q_tile, k_tile, v_tile = buffers or (None, None, None)
    if buffers is not None:
        q_tile, k_tile, v_tile = q_tile[: n * tile], k_tile[: n * kk], v_tile[: n * kk]
    q_tile = torch.index_select(q, 0, rows.reshape(-1), out=q_tile).view(n, tile, -1)
    k_tile = torch.index_select(k, 0, flat_keys, out=k_tile).view(n, kk, -1)
    v_tile = torch.index_select(v, 0, flat_keys, out=v_tile).view(n, kk, -1)
    scores = torch.baddbmm(q_tile.new_empty(()), q_tile, k_tile.transpose(1, 2), beta=0, alpha=scale)
    real = None if key_real is None else key_real.index_select(0, flat_keys).view(n, 1, kk)
    swap = torch.addcmul(neg_top, masked_softmax(scores, real), mass)  # m̂_j · softmax_T − A^c
    return torch.baddbmm(base, swap, v_tile, out=out)


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
    if type(config) is not ImprovedClusteredConfig:
        raise ValueError(
            f"improved-clustered needs a ImprovedClusteredConfig, got {type(config).__name__}; clustered and "
            "improved-clustered each take their own config"
        )
    rescore = functools.partial(rescore_topk, topk=config.topk)
    return clustered_outputs(q, k, v, key_padding_mask, is_causal, scale, config, state, query_padding_mask, rescore)


MECHANISM = Mechanism(
    name="improved-clustered",
    fn=improved_clustered_attention,
    config=ImprovedClusteredConfig,
    summary="clustered, plus exact re-scoring of each cluster's top-k keys for every query",
    paper="Vyas, Katharopoulos & Fleuret 2020, Fast Transformers with Clustered Attention, §3.3 eq. 9-10",
    causal=False,
    tensor_args=("query_padding_mask",),
    groups_queries=True,
    state=ClusteredState,
    exact_full=exactly_full,
    plain_backward=True,
    examples=({}, {"clusters": 3, "topk": 4}, {"clusters": 2, "kmeans": "hamming", "bits": 8, "topk": 2}),
)

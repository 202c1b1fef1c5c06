"""Gathered-tile layouts of content-based routing: which queries see which keys, by cluster.

Both build ``kernels.tiles.Windows`` from per-row cluster assignments of queries and keys
(``(R, L)`` and ``(R, S)``, R = batch × heads), so the exact softmax over each query's window runs
in ``tiles.window_attention``:

- ``balanced_windows`` (non-causal): the real queries and keys of a row sorted by (cluster,
  position) and cut into k tiles each; query tile t sees key tile t.
- ``causal_windows`` (causal): per cluster, its keys in position order cut into tiles of w; a
  query sees the keys of its cluster's tile that holds its position and of the tile before, up to
  its position, plus its own key. Nothing later than a query decides what it sees.

The reasons for both schemes are in ``mechanisms.routing``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from subquad.kernels.tiles import Windows
from subquad.kernels.tuning import TUNING

__all__ = ["balanced_windows", "causal_windows"]


def balanced_windows(
    q_cluster: Tensor,
    k_cluster: Tensor,
    clusters: int,
    key_valid: Tensor | None = None,
    query_valid: Tensor | None = None,
) -> Windows:
    """The non-causal scheme: k balanced tiles of queries and keys sorted by cluster (module docstring).

    Args:
        q_cluster: ``(R, L)`` query clusters; ``k_cluster``: ``(R, S)`` key clusters.
        clusters: k, the number of tiles.
        key_valid: bool ``(R, S)``; padded keys join no tile.
        query_valid: bool ``(R, L)``; padded queries join no tile (a last block that sees nothing).

    Returns:
        ``Windows`` with one block per query tile, whose window is the key tile of the same rank,
        and one more block for the padded queries.
    """
    R, L = q_cluster.shape
    S, dev = k_cluster.shape[1], q_cluster.device
    tile = torch.arange(clusters + 1, device=dev)
    # Query tile t: ranks [⌊tL_r/k⌋, ⌊(t+1)L_r/k⌋) of the real queries sorted by (cluster, position);
    # the padded queries, sorted last, make block k.
    cq = q_cluster if query_valid is None else torch.where(query_valid, q_cluster, clusters)
    real_q = torch.full((R, 1), L, device=dev) if query_valid is None else query_valid.sum(1, keepdim=True)
    q_bound = torch.cat([tile * real_q // clusters, torch.full_like(real_q, L)], dim=1)  # (R, k + 2)
    Tq = max(1, int((q_bound[:, 1:] - q_bound[:, :-1]).max()))
    q_rank = q_bound[:, :-1, None] + torch.arange(Tq, device=dev)  # (R, k + 1, Tq)
    q_order = cq.sort(dim=1, stable=True).indices
    q_sorted = q_order.gather(1, q_rank.clamp(max=L - 1).view(R, -1)).view(q_rank.shape)
    queries = torch.where(q_rank < q_bound[:, 1:, None], q_sorted, -1)  # (R, k + 1, Tq)
    # Key tile t: ranks [a_t, b_t) of the real keys sorted by (cluster, position), padding last.
    ck = k_cluster if key_valid is None else torch.where(key_valid, k_cluster, clusters)
    real = torch.full((R, 1), S, device=dev) if key_valid is None else key_valid.sum(1, keepdim=True)
    a, b = tile[:-1] * real // clusters, tile[1:] * real // clusters  # (R, k)
    b = torch.where(real > 0, torch.maximum(b, a + 1), a)  # every tile of a row with keys gets one
    Tk = max(1, int((b - a).max()))
    k_rank = a[..., None] + torch.arange(Tk, device=dev)  # (R, k, Tk)
    k_order = ck.sort(dim=1, stable=True).indices
    k_sorted = k_order.gather(1, k_rank.clamp(max=S - 1).view(R, -1)).view(k_rank.shape)
    table = torch.where(k_rank < b[..., None], k_sorted, -1)
    start = torch.cat([tile[:-1], tile[:1]]).expand(R, clusters + 1)  # the padded block: any window
    seen = torch.cat([b - a, torch.zeros_like(a[:, :1])], dim=1)  # ... of which it sees nothing
    return Windows(table.view(R, -1), Tk, queries, start, seen[..., None])


def causal_windows(
    q_cluster: Tensor, k_cluster: Tensor, clusters: int, tile: int, key_valid: Tensor | None = None
) -> Windows:
    """The causal scheme: cluster tiles of ``tile`` keys, each query seeing its tile and the
    previous one up to its position, plus its own key (module docstring).

    Args:
        q_cluster: ``(R, L)`` query clusters; ``k_cluster``: ``(R, S)`` key clusters; queries
            are the last L positions.
        clusters: k.
        tile: w, keys per cluster tile.
        key_valid: bool ``(R, S)``; padded keys join no tile.

    Returns:
        ``Windows`` over a table holding each cluster's tiles in turn, w slots each.
    """
    R, L = q_cluster.shape
    S, dev, w = k_cluster.shape[1], q_cluster.device, tile
    ck = k_cluster if key_valid is None else torch.where(key_valid, k_cluster, clusters)  # padding: cluster k
    # Keys in (cluster, position) order; the key of rank r in cluster c goes to table slot base_c·w + r.
    sorted_cluster, order = ck.sort(dim=1, stable=True)
    counts = torch.zeros(R, clusters + 1, dtype=torch.long, device=dev).scatter_add_(1, ck, torch.ones_like(ck))
    starts = counts.cumsum(1) - counts  # each cluster's first sorted index
    tiles = (counts[:, :clusters] + w - 1) // w  # (R, k) key tiles per cluster
    base = tiles.cumsum(1) - tiles  # each cluster's first tile in the table
    total = max(1, int(tiles.sum(1).max()))
    offset = torch.cat([base * w, torch.full_like(base[:, :1], total * w)], dim=1) - starts  # padding: past the table
    slot = offset.gather(1, sorted_cluster).add_(torch.arange(S, device=dev))
    table = torch.full((R, total * w + S), -1, dtype=torch.long, device=dev).scatter_(1, slot, order)[:, : total * w]

    # Queries in (cluster, position) order, which is also the order of (window start, slots seen).
    cq, q_order = q_cluster.sort(dim=1, stable=True)
    # Query i of cluster c: `seen` keys of c at positions <= its own; the latest is in tile
    # t = (seen - 1) // w, and the window starts at tile u = max(t - 1, 0) of the cluster.
    sorted_code = sorted_cluster.mul(S).add_(order)
    seen = torch.searchsorted(sorted_code, cq.mul(S).add_(q_order + (S - L)), right=True)
    seen.sub_(starts.gather(1, cq)).clamp_(min=0)
    u = (seen - 1 - w).clamp_(min=0).div_(w, rounding_mode="floor")
    start = base.gather(1, cq).add_(u)
    seen_slots = seen.sub_(u.mul_(w))  # all of tile t - 1 (if any), then tile t up to the query
    own = torch.zeros(R, L, dtype=torch.bool, device=dev)  # the own key (i + S - L) is real and outside the window
    first = max(0, L - S)
    own_cluster = ck[:, first + S - L :]
    own[:, first:] = (own_cluster != q_cluster[:, first:]) & (own_cluster < clusters)

    # Blocks of TUNING.routing_query_block queries sharing a window start.
    q_rank = torch.arange(L, device=dev) - torch.searchsorted(start, start)  # rank among those of its start
    within = q_rank.remainder_(TUNING.routing_query_block)
    block = (within == 0).cumsum(1).sub_(1)
    slots = block * TUNING.routing_query_block + within
    nb = int(block[:, -1].max()) + 1
    new = lambda fill: torch.full((R, nb * TUNING.routing_query_block), fill, dtype=torch.long, device=dev)  # noqa: E731
    queries = new(-1).scatter_(1, slots, q_order).view(R, nb, TUNING.routing_query_block)
    block_seen = new(0).scatter_(1, slots, seen_slots).view(R, nb, TUNING.routing_query_block)
    block_start = torch.zeros(R, nb, dtype=torch.long, device=dev).scatter_(1, block, start)
    return Windows(table, w, queries, block_start, block_seen, own)

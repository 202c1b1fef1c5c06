"""Routing attention (Roy, Saffar, Vaswani & Grangier 2021): content-based sparse attention.

Queries and keys are routed to the nearest of k centroids shared by both (spherical k-means: the
centroids are unit vectors and a token's cluster is ``argmax_c x̂ · μ_c`` for its normalised
vector x̂, so a query and a key in one cluster have a large dot product, the paper's MIPS
argument). Each token's cluster depends only on its own vector and the centroids. Attention stays
inside clusters, with O(N·w·D) cost for w ≈ S/k keys per query.

**Non-causal: balanced clusters (the paper's).** Per (batch, head) row, the L_r real queries in
(cluster, position) order are cut into k tiles (tile t: ranks ⌊tL_r/k⌋ to ⌊(t+1)L_r/k⌋ − 1), and
so are the S_r real keys (tile t: ranks a_t = ⌊tS_r/k⌋ to b_t − 1, b_t = max(⌊(t+1)S_r/k⌋,
a_t + 1)). Padded keys and padded queries (``query_padding_mask``) come after every real one and
join no tile, so what they hold moves no real token between tiles; padded queries return zeros.
Query tile t attends to exactly key tile t: about S/k keys per query, like the paper's clusters
of the w = n/k tokens nearest each centroid, but every real query is in one tile and every tile
of a row with a real key holds one (the paper's top-w selection leaves 13–20% of queries in no
cluster, with a zero output). The computation is a
permutation of q, k and v and dense attention inside the tiles, through the same
``subquad._tiles.window_attention`` as below; ``window`` plays no part.

**Causal: cluster tiles (ours).** Top-w selection leaks the future under causal masking (a later
token can push an earlier one out of a cluster). Here instead:

1. The keys of a cluster, in position order, are cut into *tiles* of w consecutive members (the
   key of rank r in its cluster is in tile r // w), so a key's tile depends only on the keys of
   its cluster before it.
2. The query at position i (queries are the last L positions), of cluster c, sees the keys of
   cluster c at positions ≤ i in the tile holding the latest such key and in the tile before it:
   all of the earlier tile, and the later one up to i. That is at most 2w keys.
3. It also sees its own position's key, which guarantees each real query a real output even when
   its cluster holds no key before it (in training, queries and keys often occupy different
   regions, so a cluster can hold queries only).

The output at position i is therefore a function of q_i and of the keys and values at positions
≤ i only: the routing, the tile boundaries and the weights all are. The keys sit in a table of
each cluster's tiles in turn (w slots each), so the keys a query sees are a prefix of the two
adjacent tiles starting at its tile's predecessor. Queries sharing that window are computed
together in blocks of ``_QUERY_BLOCK`` through ``subquad._tiles.window_attention`` (flash-style:
saves the log-sum-exp, recomputes scores in the backward), which cuts each block's window to the
keys its queries see and merges the own key through the log-sum-exp.

**Fixed k and w.** The paper argues k ≈ √n, and its official configurations fix the tile size
(w = 256–512). Here both are options with fixed defaults (k = 64, w = 128), never derived from the
sequence's length: a causal output at position i must not depend on how many tokens follow it (a
tile size of S/k would move every tile boundary as tokens are appended), and a state's centroids
keep their shape for the model's life. For long non-causal inputs, set ``clusters`` near √N.

**Centroids** live in ``RoutingState``, owned by the layer: unit vectors drawn from its seed, so a
fresh model routes and generates before any update. In training mode each call, after attending with the
current centroids, moves every centroid by an exponential moving average (``decay``) towards the
mean of the normalised queries and keys routed to it, leaving out padded keys and padded queries
(``query_padding_mask``; layers pass it in self-attention). The commitment loss
β·‖x̂ − sg(μ)‖² of that call is kept on the state; ``routing_loss(model)`` sums it for the training
loop. With no state the function builds the same initial centroids from seed 0, on the inputs'
device, and updates nothing; a state on another device than the inputs is refused.

**Decoding.** A causal output depends only on its query and on the keys up to it, and a query
sees at most its cluster's last two tiles. ``RoutingCache`` therefore keeps, per head and
cluster, a ring of 2w slots holding those two tiles (a new tile clears the slots of the one two
back), so each token costs O(k·D + w·D) and the cache O(k·w·D) per head, whatever the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from subquad._blocks import block_elements
from subquad._tiles import Windows, window_attention
from subquad._validate import AttentionShape, check_attention_inputs, check_query_padding_mask
from subquad.registry import Config, Mechanism, option

__all__ = [
    "RoutingCache",
    "RoutingConfig",
    "RoutingState",
    "balanced_windows",
    "causal_windows",
    "route",
    "routing_attention",
    "routing_loss",
]

_QUERY_BLOCK = 64  # causal queries sharing a window computed together
_ASSIGN_ELEMENTS = 1 << 19  # position × centroid scores held at once while routing


@dataclass(frozen=True)
class RoutingConfig(Config):
    mechanism = "routing"
    clusters: int = option(
        64, "k centroids shared by queries and keys (the paper: about sqrt(N)); non-causal: k tiles of S / k keys",
        ge=1, le=4096,
    )  # fmt: skip
    window: int = option(
        128, "causal: w keys per cluster tile; a query sees its tile and the previous one", ge=1, le=4096
    )
    decay: float = option(0.999, "EMA decay of the centroids (training mode only)", ge=0, le=1)
    commitment: float = option(1e-4, "β of the commitment loss β·‖x̂ − sg(μ)‖²", ge=0)


def _initial_centroids(heads: int, clusters: int, dim: int, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(heads, clusters, dim, generator=generator), dim=-1)


class RoutingState(nn.Module):
    """One layer's routing centroids ``(H, k, D)`` (unit vectors) and its last commitment loss.

    Args:
        config: a ``RoutingConfig``.
        num_heads: H; every head has its own centroids.
        head_dim: D.
        seed: seeds the initial centroids.
    """

    def __init__(self, config: RoutingConfig, num_heads: int, head_dim: int, seed: int = 0) -> None:
        super().__init__()
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.config, self.num_heads, self.head_dim, self.seed = config, num_heads, head_dim, seed % 2**63
        self.register_buffer("centroids", _initial_centroids(num_heads, config.clusters, head_dim, self.seed))
        self.loss: Tensor | None = None

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        saved = state_dict.get(prefix + "centroids")
        if saved is not None and saved.shape != self.centroids.shape:
            raise ValueError(
                f"routing centroids of shape {tuple(saved.shape)} do not fit this layer's "
                f"(heads, clusters, head_dim) = {tuple(self.centroids.shape)}"
            )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @torch.no_grad()
    def update(self, points: list[tuple[Tensor, Tensor, Tensor | None]]) -> None:
        """EMA step towards the mean of the real points routed to each centroid.

        Args:
            points: ``(x̂, cluster, real)`` triples: normalised vectors ``(B, H, N, D)``, their
                clusters ``(B, H, N)`` and a bool ``(B, N)`` mask of real tokens (None: all real).
        """
        H, C, D = self.centroids.shape
        sums = self.centroids.new_zeros(H, C, D)
        counts = self.centroids.new_zeros(H, C)
        for x, cluster, real in points:
            B, _, N, _ = x.shape
            weight = x.new_ones(B, 1, N) if real is None else real[:, None].to(x.dtype)
            weight = weight.expand(B, H, N).transpose(0, 1).reshape(H, B * N)
            index = cluster.transpose(0, 1).reshape(H, B * N)
            sums.scatter_add_(
                1, index[..., None].expand(H, B * N, D), x.transpose(0, 1).reshape(H, B * N, D) * weight[..., None]
            )
            counts.scatter_add_(1, index, weight)
        means = sums / counts.clamp(min=1)[..., None]
        decay = self.config.decay
        moved = torch.where(counts[..., None] > 0, decay * self.centroids + (1 - decay) * means, self.centroids)
        self.centroids.copy_(F.normalize(moved, dim=-1))

    def extra_repr(self) -> str:
        heads, clusters, dim = self.centroids.shape
        return f"heads={heads}, clusters={clusters}, head_dim={dim}, seed={self.seed}"


def route(x: Tensor, centroids: Tensor) -> Tensor:
    """The nearest centroid ``(B, H, N)`` of each vector's direction ``x̂ = x / ‖x‖`` (``x``:
    ``(B, H, N, D)``): ``argmax_c x · μ_c``, the argmax of ``x̂ · μ_c`` (a positive factor ‖x‖
    changes no argmax, so ``x`` need not be normalised); the first of tied maxima."""
    B, H, N, _ = x.shape
    C = centroids.shape[1]
    mu = centroids.transpose(-1, -2)  # (H, D, k)
    # argmax as k − max_c (k − c)·[score_c = max]: vectorised reductions, unlike CPU argmax.
    weight = torch.arange(C, 0, -1, dtype=centroids.dtype, device=x.device)
    step = max(1, min(N, block_elements(_ASSIGN_ELEMENTS, x.device) // (B * H * C)))
    scores = x.new_empty(B, H, step, C, dtype=centroids.dtype)  # reused: no page faults
    cluster = torch.empty(B, H, N, dtype=torch.long, device=x.device)
    for s in range(0, N, step):
        part = torch.matmul(x[:, :, s : s + step].to(centroids.dtype), mu, out=scores if N - s >= step else None)
        top = part.ge_(part.amax(-1, keepdim=True)).mul_(weight).amax(-1)  # NaN rows: 0, kept in range below
        cluster[:, :, s : s + step] = (C - top).clamp_(max=C - 1)
    return cluster


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
    q_cluster: Tensor, k_cluster: Tensor, clusters: int, window: int, key_valid: Tensor | None = None
) -> Windows:
    """The causal scheme: cluster tiles of ``window`` keys, each query seeing its tile and the
    previous one up to its position, plus its own key (module docstring).

    Args:
        q_cluster: ``(R, L)`` query clusters; ``k_cluster``: ``(R, S)`` key clusters; queries
            are the last L positions.
        clusters: k.
        window: w, keys per cluster tile.
        key_valid: bool ``(R, S)``; padded keys join no tile.

    Returns:
        ``Windows`` over a table holding each cluster's tiles in turn, w slots each.
    """
    R, L = q_cluster.shape
    S, dev, w = k_cluster.shape[1], q_cluster.device, window
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

    # Blocks of _QUERY_BLOCK queries sharing a window start.
    q_rank = torch.arange(L, device=dev) - torch.searchsorted(start, start)  # rank among those of its start
    within = q_rank.remainder_(_QUERY_BLOCK)
    block = (within == 0).cumsum(1).sub_(1)
    slots = block * _QUERY_BLOCK + within
    nb = int(block[:, -1].max()) + 1
    new = lambda fill: torch.full((R, nb * _QUERY_BLOCK), fill, dtype=torch.long, device=dev)  # noqa: E731
    queries = new(-1).scatter_(1, slots, q_order).view(R, nb, _QUERY_BLOCK)
    block_seen = new(0).scatter_(1, slots, seen_slots).view(R, nb, _QUERY_BLOCK)
    block_start = torch.zeros(R, nb, dtype=torch.long, device=dev).scatter_(1, block, start)
    return Windows(table, w, queries, block_start, block_seen, own)


def _resolve_state(
    state: nn.Module | None, config: RoutingConfig, shape: AttentionShape, device: torch.device
) -> RoutingState:
    if state is None:
        return RoutingState(config, shape.heads, shape.head_dim, 0).to(device).eval()  # fixed: nothing to update
    if not isinstance(state, RoutingState):
        raise ValueError(f"routing needs a RoutingState, got {type(state).__name__}")
    if state.centroids.device != device:
        raise ValueError(
            f"the routing state's centroids are on {state.centroids.device} but the inputs are on {device}; "
            "move the state (or the layer that owns it) there with .to(device)"
        )
    H, C, D = state.centroids.shape
    if (H, C, D) != (shape.heads, config.clusters, shape.head_dim):
        want = (shape.heads, config.clusters, shape.head_dim)
        raise ValueError(
            f"routing state has centroids of shape (heads, clusters, head_dim) = {(H, C, D)}, "
            f"but this call needs {want}"
        )
    return state


def routing_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    config: RoutingConfig | None = None,
    state: nn.Module | None = None,
    query_padding_mask: Tensor | None = None,
) -> Tensor:
    """Routing attention: softmax inside clusters of queries and keys (module docstring).

    Args:
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, Dv)``.
        key_padding_mask: bool ``(B, S)``, True marks a real key.
        is_causal: strict causality; queries are the last L positions of the keys.
        scale: softmax scale, default ``D ** -0.5``.
        config: ``RoutingConfig``.
        state: the layer's ``RoutingState`` (centroids; updated in training mode).
        query_padding_mask: bool ``(B, L)``, True marks a real query; padded queries join no
            non-causal tile, return zeros there, and do not move the centroids. Needed with
            ``key_padding_mask``.

    Returns:
        ``(B, H, L, Dv)``.
    """
    config = config or RoutingConfig()
    shape = check_attention_inputs(q, k, v, key_padding_mask, is_causal, scale)
    check_query_padding_mask(query_padding_mask, shape, q.device)
    state = _resolve_state(state, config, shape, q.device)
    B, H, L, S, D, Dv = shape.batch, shape.heads, shape.queries, shape.keys, shape.head_dim, shape.value_dim
    R = B * H
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    centroids = state.centroids.to(work)
    C, window = centroids.shape[1], config.window
    key_valid = None if key_padding_mask is None else key_padding_mask[:, None].expand(B, H, S).reshape(R, S)
    query_valid = None if query_padding_mask is None else query_padding_mask[:, None].expand(B, H, L).reshape(R, L)
    with torch.no_grad():
        q_cluster, k_cluster = route(q, centroids), route(k, centroids)
        if is_causal:
            windows = causal_windows(q_cluster.view(R, L), k_cluster.view(R, S), C, window, key_valid)
        else:
            windows = balanced_windows(q_cluster.view(R, L), k_cluster.view(R, S), C, key_valid, query_valid)
    out = window_attention(q.reshape(R, L, D), k.reshape(R, S, D), v.reshape(R, S, Dv), windows, shape.scale)
    out = out.view(B, H, L, Dv)
    if state.training:
        qn, kn = F.normalize(q.to(work), dim=-1), F.normalize(k.to(work), dim=-1)
        state.loss = config.commitment * (
            _commitment(qn, q_cluster, centroids, query_padding_mask)
            + _commitment(kn, k_cluster, centroids, key_padding_mask)
        )
        state.update([(qn.detach(), q_cluster, query_padding_mask), (kn.detach(), k_cluster, key_padding_mask)])
    return out


def _commitment(x: Tensor, cluster: Tensor, centroids: Tensor, real: Tensor | None) -> Tensor:
    """Mean over real tokens of ‖x̂ − sg(μ_cluster)‖²."""
    H = x.shape[1]
    mu = centroids.detach()[torch.arange(H, device=x.device)[None, :, None], cluster]  # (B, H, N, D)
    err = (x - mu).pow(2).sum(-1)  # (B, H, N)
    if real is None:
        return err.mean()
    weight = real[:, None].to(err.dtype).expand_as(err)
    return (err * weight).sum() / weight.sum().clamp(min=1)


def routing_loss(model: nn.Module) -> Tensor:
    """The sum of the commitment losses of the last training-mode forward of every routing layer
    in ``model``: add it to the training loss. Zero when there are none."""
    losses = [m.loss for m in model.modules() if isinstance(m, RoutingState) and m.loss is not None]
    if not losses:
        return torch.zeros(())
    return torch.stack(losses).sum()


class RoutingCache:
    """Decoding cache of causal routing attention: per head and cluster, the keys and values of
    the cluster's last two tiles (module docstring)."""

    recurrent = True
    description = "per cluster, its last two tiles of keys (O(clusters·window) per head)"

    def __init__(self, mechanism: Mechanism, config: RoutingConfig, state: nn.Module | None) -> None:
        self.config = config
        self.state = state
        self.keys: Tensor | None = None  # (B, H, k, 2w, D): two tiles per cluster, as a ring
        self.values: Tensor | None = None
        self.positions: Tensor | None = None  # (B, H, k, 2w), -1 for an empty slot
        self.count: Tensor | None = None  # (B, H, k) keys routed to each cluster so far
        self.length = 0

    def step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attend the ``T`` new queries ``(B, H, T, D)`` causally to the cache and the new keys."""
        shape = check_attention_inputs(q, k, v, None, True, None)
        if shape.queries != shape.keys:
            raise ValueError(f"a decoding step takes as many queries as keys, got {shape.queries} and {shape.keys}")
        if self.keys is not None and (self.keys.shape[:2] + self.keys.shape[-1:]) != (k.shape[:2] + k.shape[-1:]):
            B, H, _, _, D = self.keys.shape
            raise ValueError(
                f"the cache holds keys of (B, H, D) = ({B}, {H}, {D}), got {tuple(k.shape)}; "
                "start a new cache for a new batch"
            )
        state = self.state = _resolve_state(self.state, self.config, shape, q.device)
        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        centroids = state.centroids.to(work)
        outputs = [
            self._one(q[:, :, t], k[:, :, t], v[:, :, t], centroids, shape.scale, work) for t in range(shape.keys)
        ]
        return torch.stack(outputs, dim=2)

    @torch.no_grad()
    def _one(self, q: Tensor, k: Tensor, v: Tensor, centroids: Tensor, scale: float, work: torch.dtype) -> Tensor:
        """One token: ``(B, H, D)`` query, key and value at position ``self.length``."""
        B, H, D = k.shape
        C, w = centroids.shape[1], self.config.window
        if self.keys is None:
            self.keys = k.new_zeros(B, H, C, 2 * w, D)
            self.values = v.new_zeros(B, H, C, 2 * w, v.shape[-1])
            self.positions = torch.full((B, H, C, 2 * w), -1, dtype=torch.long, device=k.device)
            self.count = torch.zeros(B, H, C, dtype=torch.long, device=k.device)
        route_one = lambda x: route(x[:, :, None], centroids)[:, :, 0]  # noqa: E731
        cq, ck = route_one(q), route_one(k)
        b, h = torch.arange(B, device=k.device)[:, None], torch.arange(H, device=k.device)[None, :]
        rank = self.count[b, h, ck]  # (B, H): the new key's rank in its cluster
        half = (rank // w) % 2  # tiles alternate between the ring's two halves
        starting = (rank % w == 0)[..., None] & ((torch.arange(2 * w, device=k.device) // w) == half[..., None])
        self.positions[b, h, ck] = self.positions[b, h, ck].masked_fill(starting, -1)  # a tile two back leaves
        slot = half * w + rank % w
        self.keys[b, h, ck, slot] = k
        self.values[b, h, ck, slot] = v
        self.positions[b, h, ck, slot] = self.length
        self.count[b, h, ck] += 1
        # The query's cluster's two tiles, except its own key, which joins as the last slot.
        seen = self.positions[b, h, cq]  # (B, H, 2w)
        keys = torch.cat([self.keys[b, h, cq], k[:, :, None]], dim=2).to(work)
        values = torch.cat([self.values[b, h, cq], v[:, :, None]], dim=2).to(work)
        visible = torch.cat([(seen >= 0) & (seen != self.length), seen.new_ones(B, H, 1, dtype=torch.bool)], dim=2)
        scores = torch.matmul(keys, q.to(work)[..., None])[..., 0].mul_(scale).masked_fill_(~visible, -torch.inf)
        self.length += 1
        return torch.matmul(torch.softmax(scores, dim=-1)[:, :, None], values)[:, :, 0].to(q.dtype)


MECHANISM = Mechanism(
    name="routing",
    fn=routing_attention,
    config=RoutingConfig,
    summary="content-based sparse attention: online spherical k-means; balanced clusters, causal cluster tiles",
    paper="Roy, Saffar, Vaswani & Grangier 2021, Efficient Content-Based Sparse Attention with Routing Transformers",
    causal=True,
    cross=True,
    tensor_args=("query_padding_mask",),
    groups_queries=True,
    state=RoutingState,
    decoder=RoutingCache,
    examples=({}, {"clusters": 3, "window": 4}, {"clusters": 1, "window": 2}),
)

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
``subquad.kernels.tiles.window_attention`` as below; ``tile`` plays no part.

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
together in blocks of ``TUNING.routing_query_block`` through ``subquad.kernels.tiles.window_attention`` (flash-style:
saves the log-sum-exp, recomputes scores in the backward), which cuts each block's window to the
keys its queries see and merges the own key through the log-sum-exp.

**Fixed k and w.** The paper argues k ≈ √n, and its official configurations fix the tile size
(w = 256–512). Here both are options with fixed defaults (k = 64, w = 128), never derived from the
sequence's length: a causal output at position i must not depend on how many tokens follow it (a
tile size of S/k would move every tile boundary as tokens are appended), and a state's centroids
keep their shape for the model's life. For long non-causal inputs, set ``clusters`` near √N.

**Centroids** live in ``RoutingState`` (``ops.routing_clusters``), owned by the layer: unit vectors
drawn from its seed, so a fresh model routes and generates before any update. In training mode each
call, after attending with the current centroids, moves every centroid by an exponential moving
average (``decay``) towards the mean of the normalised queries and keys routed to it, leaving out
padded keys and padded queries (``query_padding_mask``; layers pass it in self-attention). The
commitment loss β·‖x̂ − sg(μ)‖² of that call goes to ``subquad.hooks.add_auxiliary_loss``: the
training loop collects it with ``subquad.hooks.auxiliary_losses()`` and adds ``sum(losses)`` to its
loss; a training forward with no collector active warns (``UncollectedLossWarning``) that the loss
is dropped, and with ``commitment=0`` there is none to collect. Under gradient checkpointing
(``subquad.hooks.checkpoint_contexts``), the recomputation routes with the centroids the forward
used and neither moves them nor reports the loss again. With no state the function builds the same
initial centroids from seed 0, on the inputs' device, and updates nothing, so a call whose inputs
carry gradients (training) warns that its centroids never move; a state on another device than the
inputs is refused.

**Decoding.** A causal output depends only on its query and on the keys up to it, and a query
sees at most its cluster's last two tiles. ``RoutingCache`` therefore keeps, per head and
cluster, a ring of 2w slots holding those two tiles (a new tile clears the slots of the one two
back), so each token costs O(k·D + w·D) and the cache O(k·w·D) per head, whatever the prefix.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from subquad._validate import AttentionShape, check_attention_inputs, check_query_padding_mask, work_dtype
from subquad.decoding import Decoder
from subquad.hooks import add_auxiliary_loss, is_recomputing, replayed
from subquad.ops.routing_clusters import RoutingState, cluster_attention, resolve_state
from subquad.ops.spherical import commitment_loss, nearest_direction
from subquad.registry import Config, Mechanism, option

__all__ = [
    "RoutingCache",
    "RoutingConfig",
    "RoutingState",
    "routing_attention",
    "routing_loss",
]


@dataclass(frozen=True)
class RoutingConfig(Config):
    mechanism = "routing"
    clusters: int = option(
        64, "k centroids shared by queries and keys (the paper: about sqrt(N)); non-causal: k tiles of S / k keys",
        ge=1, le=4096,
    )  # fmt: skip
    renamed: ClassVar[dict[str, str]] = {"window": "tile"}  # 0.1's spelling: make_config warns
    tile: int = option(
        128, "causal: w keys per cluster tile; a query sees its tile and the previous one", ge=1, le=4096
    )
    decay: float = option(0.999, "EMA decay of the centroids (training mode only)", ge=0, le=1)
    commitment: float = option(1e-4, "β of the commitment loss β·‖x̂ − sg(μ)‖²", ge=0)


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
            non-causal tile, return zeros, and do not move the centroids. Needed with
            ``key_padding_mask``.

    Returns:
        ``(B, H, L, Dv)``.
    """
    config = config or RoutingConfig()
    shape = check_attention_inputs(q, k, v, key_padding_mask, is_causal, scale)
    check_query_padding_mask(query_padding_mask, shape, q.device)
    if state is None and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        warnings.warn(
            "routing without state= routes with fixed centroids (seed 0) that never move, even in training: pass "
            "state=RoutingState(config, heads, head_dim).train() (and collect its commitment loss), or use a "
            "subquad.nn layer, which owns one",
            UserWarning,
            stacklevel=2,
        )
    state = resolve_state(state, config, shape, q.device)
    work = work_dtype(q.dtype)
    centroids = replayed(state.centroids).to(work)  # a checkpoint's recomputation: those of its forward
    out, q_cluster, k_cluster = cluster_attention(
        q, k, v, centroids, config.tile, is_causal, key_padding_mask, query_padding_mask, shape.scale
    )
    if state.training:
        # A checkpoint's recomputation computes the loss too (it must save what the forward saved),
        # but only the forward hands it over and moves the centroids (subquad.hooks).
        qn, kn = F.normalize(q.to(work), dim=-1), F.normalize(k.to(work), dim=-1)
        loss = config.commitment * (
            commitment_loss(qn, q_cluster, centroids, query_padding_mask)
            + commitment_loss(kn, k_cluster, centroids, key_padding_mask)
        )
        if not is_recomputing():
            state.loss = loss  # for the deprecated routing_loss
            if config.commitment:  # β = 0: trained without it, nothing to collect
                add_auxiliary_loss("routing.commitment", loss)
            state.update([(qn.detach(), q_cluster, query_padding_mask), (kn.detach(), k_cluster, key_padding_mask)])
    return out


def routing_loss(model: nn.Module) -> Tensor:
    """The sum of the commitment losses of the last training-mode forward of every routing layer
    in ``model``; zero when there are none.

    Deprecated: collect them with ``subquad.hooks.auxiliary_losses()`` instead, which also sees
    the losses of every forward in its block rather than each layer's last one::

        with subquad.hooks.auxiliary_losses() as losses:
            task_loss = ...  # forward
        loss = task_loss + sum(losses)
    """
    warnings.warn(
        "routing_loss is deprecated: run the forward inside `with subquad.hooks.auxiliary_losses() as losses:` "
        "and add sum(losses) to the loss",
        DeprecationWarning,
        stacklevel=2,
    )
    losses = [m.loss for m in model.modules() if isinstance(m, RoutingState) and m.loss is not None]
    if not losses:
        return torch.zeros(())
    return torch.stack(losses).sum()


class RoutingCache(Decoder):
    """Decoding cache of causal routing attention: per head and cluster, the keys and values of
    the cluster's last two tiles (module docstring)."""

    recurrent = True
    description = "per cluster, its last two tiles of keys (O(clusters·tile) per head)"
    holds = "keys"

    def __init__(self, mechanism: Mechanism, config: RoutingConfig, state: nn.Module | None) -> None:
        super().__init__(mechanism, config, state)
        self.keys: Tensor | None = None  # (B, H, k, 2w, D): two tiles per cluster, as a ring
        self.values: Tensor | None = None
        self.positions: Tensor | None = None  # (B, H, k, 2w), -1 for an empty slot
        self.count: Tensor | None = None  # (B, H, k) keys routed to each cluster so far

    def _step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attend the ``T`` new queries ``(B, H, T, D)`` causally to the cache and the new keys."""
        B, H, T, D = q.shape
        shape = AttentionShape(B, H, T, T, D, v.shape[-1], D**-0.5 if self.scale is None else self.scale)
        state = self.state = resolve_state(self.state, self.config, shape, q.device)
        work = work_dtype(q.dtype)
        centroids = state.centroids.to(work)
        outputs = [
            self._one(q[:, :, t], k[:, :, t], v[:, :, t], self.length + t, centroids, shape.scale, work)
            for t in range(T)
        ]
        return torch.stack(outputs, dim=2)

    @torch.no_grad()
    def _one(
        self, q: Tensor, k: Tensor, v: Tensor, position: int, centroids: Tensor, scale: float, work: torch.dtype
    ) -> Tensor:
        """One token: ``(B, H, D)`` query, key and value at ``position``."""
        B, H, D = k.shape
        C, w = centroids.shape[1], self.config.tile
        if self.keys is None:
            self.keys = k.new_zeros(B, H, C, 2 * w, D)
            self.values = v.new_zeros(B, H, C, 2 * w, v.shape[-1])
            self.positions = torch.full((B, H, C, 2 * w), -1, dtype=torch.long, device=k.device)
            self.count = torch.zeros(B, H, C, dtype=torch.long, device=k.device)
        route_one = lambda x: nearest_direction(x[:, :, None], centroids)[:, :, 0]  # noqa: E731
        cq, ck = route_one(q), route_one(k)
        b, h = torch.arange(B, device=k.device)[:, None], torch.arange(H, device=k.device)[None, :]
        rank = self.count[b, h, ck]  # (B, H): the new key's rank in its cluster
        half = (rank // w) % 2  # tiles alternate between the ring's two halves
        starting = (rank % w == 0)[..., None] & ((torch.arange(2 * w, device=k.device) // w) == half[..., None])
        self.positions[b, h, ck] = self.positions[b, h, ck].masked_fill(starting, -1)  # a tile two back leaves
        slot = half * w + rank % w
        self.keys[b, h, ck, slot] = k
        self.values[b, h, ck, slot] = v
        self.positions[b, h, ck, slot] = position
        self.count[b, h, ck] += 1
        # The query's cluster's two tiles, except its own key, which joins as the last slot.
        seen = self.positions[b, h, cq]  # (B, H, 2w)
        keys = torch.cat([self.keys[b, h, cq], k[:, :, None]], dim=2).to(work)
        values = torch.cat([self.values[b, h, cq], v[:, :, None]], dim=2).to(work)
        visible = torch.cat([(seen >= 0) & (seen != position), seen.new_ones(B, H, 1, dtype=torch.bool)], dim=2)
        scores = torch.matmul(keys, q.to(work)[..., None])[..., 0].mul_(scale).masked_fill_(~visible, -torch.inf)
        return torch.matmul(torch.softmax(scores, dim=-1)[:, :, None], values)[:, :, 0].to(q.dtype)


MECHANISM = Mechanism(
    name="routing",
    calibratable=True,
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
    examples=({}, {"clusters": 3, "tile": 4}, {"clusters": 1, "tile": 2}),
)

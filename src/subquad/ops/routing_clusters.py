"""Routing attention's clusters (Roy, Saffar, Vaswani & Grangier 2021): the layer's centroids, and
the tiles each call routes its queries and keys to.

- ``RoutingState``: the centroids ``(H, k, D)``, unit vectors drawn from the layer's seed, moved
  by an exponential moving average in training mode (``ops.spherical.ema_centroids``).
- ``resolve_state``: the state a call uses (seed 0 when it passes none), checked against the call.
- ``cluster_attention``: each query's and key's nearest centroid, the tiles of keys the queries
  see (``kernels.cluster_tiles``: balanced tiles, or causal cluster tiles), and the softmax inside
  them (``kernels.tiles.window_attention``).

The maths and the choices are in ``mechanisms.routing``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from subquad._validate import AttentionShape
from subquad.kernels.cluster_tiles import balanced_windows, causal_windows
from subquad.kernels.tiles import window_attention
from subquad.ops.spherical import ema_centroids, nearest_direction
from subquad.registry import Config

__all__ = ["RoutingState", "cluster_attention", "resolve_state"]


def _initial_centroids(heads: int, clusters: int, dim: int, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(heads, clusters, dim, generator=generator), dim=-1)


class RoutingState(nn.Module):
    """One layer's routing centroids ``(H, k, D)`` (unit vectors) and, in ``loss``, the commitment
    loss of its last training-mode forward (for the deprecated ``routing_loss``; the loss of each
    forward goes to ``subquad.hooks.auxiliary_losses``).

    Args:
        config: a ``RoutingConfig``.
        num_heads: H; every head has its own centroids.
        head_dim: D.
        seed: seeds the initial centroids.
    """

    def __init__(self, config: Config, num_heads: int, head_dim: int, seed: int = 0) -> None:
        super().__init__()
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.config, self.num_heads, self.head_dim, self.seed = config, num_heads, head_dim, seed % 2**63
        self.register_buffer("centroids", _initial_centroids(num_heads, config.clusters, head_dim, self.seed))
        self.loss: Tensor | None = None

    def __getstate__(self) -> dict[str, Any]:
        """The state without ``loss``, the last forward's graph: a copy (``copy.deepcopy``: a snapshot
        of the model, a decoding cache kept for reuse) or a pickle holds the centroids only."""
        return {**super().__getstate__(), "loss": None}

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
        """EMA step towards the mean of the real points routed to each centroid
        (``ops.spherical.ema_centroids``): ``points`` are ``(x̂, cluster, real)`` triples."""
        self.centroids.copy_(ema_centroids(self.centroids, points, self.config.decay))

    def extra_repr(self) -> str:
        heads, clusters, dim = self.centroids.shape
        return f"heads={heads}, clusters={clusters}, head_dim={dim}, seed={self.seed}"


@functools.lru_cache(maxsize=32)
def _default_state(config: Config, heads: int, head_dim: int, device: torch.device) -> RoutingState:
    """The state of a call without one: seed 0, in eval mode (fixed: nothing updates it), built once
    per shape and device rather than drawn on every call."""
    return RoutingState(config, heads, head_dim, 0).to(device).eval()


def resolve_state(state: nn.Module | None, config: Config, shape: AttentionShape, device: torch.device) -> RoutingState:
    """The state a call uses: ``state``, checked against the call, or without one the fixed default."""
    if state is None:
        return _default_state(config, shape.heads, shape.head_dim, device)
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


def cluster_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    centroids: Tensor,
    tile: int,
    is_causal: bool,
    key_padding_mask: Tensor | None,
    query_padding_mask: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax inside the clusters of ``centroids`` ``(H, k, D)``: the outputs ``(B, H, L, Dv)``, and
    the clusters of the queries and keys, ``(B, H, L)`` (padded queries in cluster 0 when causal) and
    ``(B, H, S)``. The windows of keys are balanced tiles, or (``is_causal``) cluster tiles of
    ``tile`` keys; padded queries return zeros."""
    B, H, L, D = q.shape
    S, Dv = k.shape[2], v.shape[3]
    R, C = B * H, centroids.shape[1]
    key_valid = None if key_padding_mask is None else key_padding_mask[:, None].expand(B, H, S).reshape(R, S)
    query_valid = None if query_padding_mask is None else query_padding_mask[:, None].expand(B, H, L).reshape(R, L)
    with torch.no_grad():
        q_cluster, k_cluster = nearest_direction(q, centroids), nearest_direction(k, centroids)
        if is_causal:
            if query_valid is not None:  # a padded query's blocks may not depend on what it holds
                q_cluster = q_cluster.masked_fill(~query_valid.view(B, H, L), 0)
            windows = causal_windows(q_cluster.view(R, L), k_cluster.view(R, S), C, tile, key_valid)
        else:
            windows = balanced_windows(q_cluster.view(R, L), k_cluster.view(R, S), C, key_valid, query_valid)
    out = window_attention(q.reshape(R, L, D), k.reshape(R, S, D), v.reshape(R, S, Dv), windows, scale)
    out = out.view(B, H, L, Dv)
    if query_padding_mask is not None and is_causal:  # (non-causal: they join no tile, so they are zero)
        # Padded queries return zeros, whatever they hold: an output read off their content would
        # differ wherever that content is replaced (as on CUDA, where padded inputs are zeroed first).
        out = out.masked_fill(~query_padding_mask[:, None, :, None], 0)
    return out, q_cluster, k_cluster

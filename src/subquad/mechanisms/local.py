"""Local (sliding-window) attention, the Routing Transformer's companion heads (Roy et al. 2021).

Query i attends to the keys within ``window`` positions of it: causal, the previous ``window - 1``
keys and its own (``i - window < j <= i``); non-causal, ``window`` on each side
(``|i - j| <= window``). With L ≠ S the queries are the last L positions of the keys (bottom-right
alignment, as in causal attention). Softmax is exact over the window.

**Computation.** Queries go in tiles of ``_TILE`` consecutive positions; a tile's keys are the
contiguous range its queries' windows cover (``_TILE + window - 1`` keys causal,
``_TILE + 2·window`` non-causal) and the exact band is applied inside it. Tiles run a group at a
time through ``subquad._tiles.tile_attention`` (one autograd Function, flash-style: it saves the
output and each query's log-sum-exp and recomputes scores in the backward), so memory is
O(N·D) plus one group's scores, never O(N·window).

**Decoding.** ``WindowCache`` keeps the last ``window - 1`` keys and values: each new token attends
to them and itself, so decoding cost and memory do not grow with the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from subquad._tiles import Band, tile_attention
from subquad._validate import check_attention_inputs
from subquad.registry import Config, Mechanism, option

if TYPE_CHECKING:
    from torch import nn

__all__ = ["LocalConfig", "WindowCache", "local_attention", "window_tiles"]

_TILE = 128  # queries per tile: fewer copies of each key, more of the band's bounding box wasted


@dataclass(frozen=True)
class LocalConfig(Config):
    mechanism = "local"
    window: int = option(256, "w: causal sees the last w keys (itself included); non-causal w on each side", ge=1)


def window_tiles(L: int, S: int, window: int, is_causal: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """Tiles of consecutive queries and the key range their windows cover: ``(T, Tq)`` and
    ``(T, Tk)`` positions, ``-1`` outside the sequence."""
    offset = S - L
    tile = min(_TILE, L)
    starts = torch.arange(0, L, tile, device=device)
    q_index = starts[:, None] + torch.arange(tile, device=device)
    q_index = torch.where(q_index < L, q_index, -1)
    before = window - 1 if is_causal else window
    after = 0 if is_causal else window
    k_index = (starts + offset - before)[:, None] + torch.arange(tile + before + after, device=device)
    k_index = torch.where((k_index >= 0) & (k_index < S), k_index, -1)
    return q_index, k_index


def local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    config: LocalConfig | None = None,
    state: nn.Module | None = None,
) -> Tensor:
    """Sliding-window softmax attention.

    Args:
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, Dv)``.
        key_padding_mask: bool ``(B, S)``, True marks a real key.
        is_causal: query i (at key position i + S - L) sees keys ``i + S - L - window < j <= i + S - L``;
            otherwise ``|j - (i + S - L)| <= window``.
        scale: softmax scale, default ``D ** -0.5``.
        config: ``LocalConfig``.

    Returns:
        ``(B, H, L, Dv)``; zero rows for queries whose window holds no real key.
    """
    config = config or LocalConfig()
    shape = check_attention_inputs(q, k, v, key_padding_mask, is_causal, scale)
    B, H, L, S = shape.batch, shape.heads, shape.queries, shape.keys
    w = config.window
    q_index, k_index = window_tiles(L, S, w, is_causal, q.device)
    R = B * H
    key_valid = None if key_padding_mask is None else key_padding_mask[:, None].expand(B, H, S).reshape(R, S)
    # Every tile's keys start at the same place relative to its first query: one band for all.
    tile, keys = q_index.shape[1], k_index.shape[1]
    before = w - 1 if is_causal else w
    d = torch.arange(keys, device=q.device) - before - torch.arange(tile, device=q.device)[:, None]
    band = Band(relative=(d >= -before) & (d <= (0 if is_causal else w)))
    out = tile_attention(
        q.reshape(R, L, shape.head_dim),
        k.reshape(R, S, shape.head_dim),
        v.reshape(R, S, shape.value_dim),
        q_index.expand(R, *q_index.shape),
        k_index.expand(R, *k_index.shape),
        band,
        shape.scale,
        key_valid,
    )
    return out.view(B, H, L, shape.value_dim)


class WindowCache:
    """Decoding cache of the last ``window - 1`` keys and values: each step attends the new tokens
    to them and to each other, so its cost is independent of the prompt length."""

    recurrent = True
    description = "window cache (the last window - 1 keys and values: O(window) per head)"

    def __init__(self, mechanism: Mechanism, config: LocalConfig, state: nn.Module | None) -> None:
        self.mechanism, self.config = mechanism, config
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.length = 0

    def step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attend the ``T`` new queries ``(B, H, T, D)`` causally to the window and the new keys."""
        check_attention_inputs(q, k, v, None, True, None)
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"a decoding step takes as many queries as keys, got {q.shape[2]} and {k.shape[2]}")
        if self.keys is not None and (self.keys.shape[:2] != k.shape[:2] or self.keys.shape[3] != k.shape[3]):
            raise ValueError(
                f"the cache holds keys of (B, H, D) = ({self.keys.shape[0]}, {self.keys.shape[1]}, "
                f"{self.keys.shape[3]}), got {tuple(k.shape)}; start a new cache for a new batch"
            )
        keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        values = v if self.values is None else torch.cat([self.values, v], dim=2)
        out = local_attention(q, keys, values, is_causal=True, config=self.config)
        drop = max(0, keys.shape[2] - (self.config.window - 1))
        self.keys, self.values = keys[:, :, drop:], values[:, :, drop:]
        self.length += k.shape[2]
        return out


MECHANISM = Mechanism(
    name="local",
    fn=local_attention,
    config=LocalConfig,
    summary="sliding-window softmax attention over w keys (causal) or w each side, in tiles; window cache",
    paper="Roy, Saffar, Vaswani & Grangier 2021 (local heads of the Routing Transformer); Parmar et al. 2018",
    causal=True,
    cross=True,
    decoder=WindowCache,
)

"""Sliding-window attention on the block-sparse engine: the band ``|p − j| < window`` (causal:
``p − window < j <= p``) and the first ``sinks`` keys, for ``local`` and for ``linear``'s exact
window. Query ``i`` sits at key position ``p = i + S − L``. Blocks, layouts and kernels are
``mechanisms/local.py``'s docstring's; the figures behind them are in docs/performance.md.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from subquad._validate import check_grouped_inputs
from subquad.kernels import native as _native
from subquad.kernels.blocksparse import band_blocks, block_sparse_attention
from subquad.kernels.blocksparse_forward import block_sparse_forward
from subquad.kernels.layouts import Group, band_groups, sink_groups, sink_mask
from subquad.kernels.softmax import fused_available
from subquad.masks import MaskMod

__all__ = ["window_attention", "window_layout", "window_mask", "window_softmax"]


def window_mask(window: int, is_causal: bool, offset: int) -> MaskMod:
    """The window as a mask_mod: ``|p - j| < window`` (causal: ``p - window < j <= p``), with
    ``p = q_idx + offset``."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        distance = q_idx + offset - kv_idx
        return ((distance >= 0) & (distance < window)) if is_causal else distance.abs() < window

    return mask_mod


def window_attention(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, is_causal: bool, scale: float | None,
    window: int, sinks: int, kernel: str, enable_gqa: bool = False,
) -> Tensor:  # fmt: skip
    """Softmax attention of each query over its window and the sinks, ``(B, H, L, Dv)``; zero
    rows for queries whose window holds no real key. ``kernel``: fused, eager or native."""
    shape = check_grouped_inputs(q, k, v, key_padding_mask, is_causal, scale, enable_gqa)
    L, S = shape.queries, shape.keys
    w = min(window, L + S)  # a wider window sees no more keys: the same result, bounded work
    offset = S - L
    native = kernel == "native" and _native.supports(q, k, v) is None  # runs Dv != D too
    blocks = band_blocks(q, k, v, kernel, native, w if is_causal else 2 * w - 1)
    layout = functools.partial(window_layout, L, offset, w, is_causal, min(sinks, S), device=q.device)
    parts = layout(min(blocks.forward, L))
    backward = None
    if blocks.transposed is not None:
        backward = layout(min(blocks.transposed, S), transposed=True)
    elif blocks.backward is not None:
        backward = layout(min(blocks.backward, L))
    return block_sparse_attention(q, k, v, parts, key_padding_mask, shape.scale, kernel, backward)


@torch.no_grad()
def window_softmax(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, is_causal: bool, scale: float, window: int,
    sinks: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``window_attention``'s output ``(B, H, L, Dv)`` and log-sum-exp ``(B, H, L, 1)`` (−inf where
    the window holds no real key), in the work dtype and without autograd, for a mechanism that
    joins the window's softmax with parts of its own (``retrieval``'s far blocks). Grouped-query
    keys are read in place; the kernel is the fused one where it runs, else eager."""
    L, S = q.shape[2], k.shape[2]
    w = min(window, L + S)
    fused = fused_available(q.device, q.shape[-1], v.shape[-1])
    kernel = "fused" if fused else "eager"
    blocks = band_blocks(q, k, v, kernel, False, w if is_causal else 2 * w - 1)
    parts = window_layout(L, S - L, w, is_causal, min(sinks, S), min(blocks.forward, L), q.device)
    out, lse = block_sparse_forward(q, k, v, key_padding_mask, parts, scale, kernel, fused)
    return out, lse[..., None]


def window_layout(
    L: int, offset: int, w: int, is_causal: bool, sinks: int, block: int, device: torch.device, transposed: bool = False
) -> list:
    """The window's parts in blocks of ``block`` queries: the band, and the sinks its windows leave
    out. ``transposed``: the band in blocks of ``block`` keys against the queries that see them, for
    the backward (``band_groups``), beside the sinks' part in query blocks."""
    parts = [_band(L, offset, w, is_causal, block, device, transposed)]
    # the part is needed where some query's window leaves out a sink: the last query misses key 0,
    # or (non-causal, L > S) the first query, before the keys, misses the last sink
    if sinks and (offset + L - 1 >= w or (not is_causal and sinks - 1 - offset >= w)):
        window = window_mask(w, is_causal, offset)
        parts.append(sink_groups(L, sinks, min(block, L), 1, sink_mask(sinks, window, is_causal, offset), device))
    return parts


@functools.lru_cache(maxsize=32)
def _band(
    L: int, offset: int, w: int, is_causal: bool, block: int, device: torch.device, transposed: bool
) -> list[Group]:
    """The window's band layout for this shape, built once and kept with the masks its chunks
    derive from it (``Group.memo``): building them took about a tenth of a call at N = 1024
    (docs/performance.md). They enter no autograd graph (the engine's Function recomputes from its
    saved inputs), so those built in inference mode serve calls that record one."""
    left, right = (w - 1, 0) if is_causal else (w - 1, w - 1)
    mask = window_mask(w, is_causal, offset)
    return band_groups(L, offset, left, right, block, mask, device, kept=True, transposed=transposed)

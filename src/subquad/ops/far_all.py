"""``retrieval`` where every query takes every far block it may: the keys a causal query at ``p``
sees are then fixed by position, ``[0, a(p))`` and its window ``(p − w, p]``, with ``a(p)`` the end
of the last whole block before the window (the sinks where there is none). That holds where the
last query's eligible blocks are at most ``blocks`` (sequences up to about sinks + window +
blocks · block keys, as a chat's prompt), and there the mechanism is one masked sdpa call per
block of rows, with no bounds, ranking or gathers (``mechanisms.retrieval``'s parallel pass and
decoding's step, ``ops.far_step``)."""

from __future__ import annotations

import torch
from torch import Tensor

from subquad.kernels.softmax import work_dtype
from subquad.registry import Config

__all__ = ["every_block"]

ROWS = 128  # query rows per sdpa call: each computes its rows' keys up to the last, so a triangle of ROWS² / 2 is spare


def every_block(q: Tensor, k: Tensor, v: Tensor, scale: float | None, config: Config) -> Tensor | None:
    """Causal ``retrieval`` without padding or a kernel part, ``(B, H, L, Dv)``, for queries ``q``
    at positions ``S − L … S − 1`` over keys ``k``, ``v`` ``(B, Hk, S, ·)``, where every query takes
    every eligible block; None where some query has more eligible blocks than ``config.blocks``, and
    off the CPU (where sdpa under a mask with grouped-query keys may fall back to its math kernel,
    which holds every score: not measured)."""
    L, S = q.shape[2], k.shape[2]
    size, w, sinks = min(config.block, max(S, 1)), config.window, config.sinks
    if q.device.type != "cpu":  # measured on CPUs only; elsewhere a masked grouped sdpa may fall back to math
        return None
    if not 0 < L <= S or max(0, S - w) // size - sinks // size > config.blocks:  # the last query's eligible blocks
        return None
    dtype, work = q.dtype, work_dtype(q.dtype)
    q, k, v = (x.to(work) for x in (q, k, v))
    if L == 1:  # decoding's step: keys [0, a) and [lo, S), masked only between (few operations)
        lo = max(0, S - w)
        a, mask = max(sinks, lo // size * size), None
        if a < lo:
            mask = torch.zeros(1, 1, 1, S, dtype=work, device=q.device)
            mask[..., a:lo] = float("-inf")
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.to(dtype)
    outputs = []
    for a in range(0, L, ROWS):
        p = torch.arange(a + S - L, min(a + ROWS, L) + S - L, device=q.device)[:, None]
        n = min(a + ROWS, L) + S - L  # the keys up to the last row's
        keys = torch.arange(n, device=q.device)
        ends = ((p - w + 1).clamp_min(0) // size * size).clamp_min(sinks)  # a(p): blocks wholly before the window
        seen = (keys <= p) & ((keys > p - w) | (keys < ends))
        out = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, a : a + ROWS], k[:, :, :n], v[:, :, :n], attn_mask=seen, scale=scale, enable_gqa=True
        )
        outputs.append(out)
    return torch.cat(outputs, dim=2).to(dtype)

"""Causal self-attention in query blocks, for inference: the memory of a block, not of the sequence.

A causal window of ``w`` with ``s`` sinks lets the query at p read the sinks, the keys
``p - w < j <= p`` and, for ``linear``'s windowed form, the sums of ``φ(k) [v, 1]ᵀ`` over the
keys before the window. So the queries of a block ``[a, b)`` need only the sinks, the keys
``[a - w + 1, b)`` and the sums of the keys between: each block is the same mechanism called on
``cat(sinks, keys[a - w + 1 : b])`` (end-aligned, so every distance in the window is kept and no
sink falls in it twice), with those sums as the far part's initial state. The full-size features,
products and merges the parallel forms hold for the backward then exist for one block at a
time; the output is written block by block. The result is the same sum, in another order.

It runs only where nothing needs gradients (``torch.no_grad``, or no input requiring them), for
self-attention (L = S) longer than two blocks. A block is 1/32 of the sequence (at least 256
queries): what it holds beside the output is then a small share of the output's size. Elsewhere
the parallel forms run as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["BLOCK", "PARTS", "in_query_blocks"]

BLOCK, PARTS = 256, 32  # queries per block: at least BLOCK, and the sequence in at most PARTS blocks


def in_query_blocks(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, sinks: int, window: int | None,
    run: Callable[..., Tensor | tuple[Tensor, ...]], far: Callable[..., Tensor] | None = None,
    needs_grad: tuple = (),
) -> Tensor | tuple[Tensor, ...] | None:  # fmt: skip
    """``run(q, k, v, key_padding_mask, initial)`` over query blocks (module docstring), or None
    where blocks do not apply; where ``run`` returns a tuple of per-query tensors (an output and
    its log-sum-exp), a tuple of them. ``far(k, v, mask)``: the sums ``(B, H, F, Dv + 1)`` of keys that
    left every later window (``linear``); ``initial`` is their running total ``(B·H, F, Dv + 1)``,
    None before any. ``window`` None: a pattern that may reach any earlier key; each block then
    reads the keys from the start. ``needs_grad``: more tensors (a learned state's) whose gradients would be lost."""
    L = q.shape[2]
    block = max(BLOCK, -(-L // PARTS))
    if L != k.shape[2] or L <= 2 * block or (window is not None and window >= L):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *needs_grad)):
        return None
    out, initial, summed = None, None, sinks  # initial: the sums of keys [sinks, summed)
    for a in range(0, L, block):
        b, lo = min(L, a + block), 0 if window is None else max(0, a - window + 1)
        if lo <= sinks:  # the block's windows reach the sinks: the keys from the start
            keys, values = k[:, :, :b], v[:, :, :b]
            mask = None if key_padding_mask is None else key_padding_mask[:, :b]
        else:
            if far is not None and lo > summed:
                part = far(k[:, :, summed:lo], v[:, :, summed:lo],
                           None if key_padding_mask is None else key_padding_mask[:, summed:lo])  # fmt: skip
                part = part.reshape(-1, *part.shape[2:])
                initial, summed = (part if initial is None else initial + part), lo
            keys, values = _sinks_and(k, 2, sinks, lo, b), _sinks_and(v, 2, sinks, lo, b)
            mask = None if key_padding_mask is None else _sinks_and(key_padding_mask, 1, sinks, lo, b)
        o = run(q[:, :, a:b], keys, values, mask, initial)
        parts = o if isinstance(o, tuple) else (o,)  # (output, log-sum-exp, …): each per query row
        if out is None:
            out = tuple(x.new_empty(*q.shape[:3], x.shape[-1]) for x in parts)
        for whole, x in zip(out, parts):
            whole[:, :, a:b] = x
    return out if isinstance(o, tuple) else out[0]


def _sinks_and(x: Tensor, dim: int, sinks: int, lo: int, b: int) -> Tensor:
    """Positions ``[0, sinks)`` then ``[lo, b)`` of ``x`` along ``dim``: a view without sinks (a
    concatenation copies even with an empty part: 93 MB a call for local at 16k)."""
    if not sinks:
        return x.narrow(dim, lo, b - lo)
    return torch.cat([x.narrow(dim, 0, sinks), x.narrow(dim, lo, b - lo)], dim=dim)

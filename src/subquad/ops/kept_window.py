"""What a window with sinks still reaches while decoding: the keys kept per row, with positions.

A causal window of ``w`` with ``s`` sinks lets the query at position p see the keys j <= p with
j < s (the sinks) or p - j < w (the window). The next query, at position n (the row's length so
far), still reaches only the sinks and the last ``w - 1`` keys, so a decoder keeps those, at most
``s + w - 1`` per row, and forgets (or, for ``linear``, sums into its far state) the rest.

Positions count each row's **real** tokens: under padding, a row's sinks are its first real
tokens, and a batch whose rows have different lengths decodes each row as if alone. ``Kept``
holds the kept keys in slots ``(B, H, C, ·)``, each slot's position ``(B, C)`` (-1 for an empty
slot) and each row's length; the attention over the slots is by position, never by slot order.

- ``kept_from_prompt``: the slots after a parallel prefill (the prefill's state, handed over),
  and which keys left the window for good;
- ``reach``: the masks of new queries over the slots and themselves: the window's part, and the
  far part (keys at or beyond ``w`` back, not sinks);
- ``trim``: the slots after the new tokens, and which keys left.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

__all__ = ["PIECE", "Kept", "extend", "kept_from_prompt", "pieces", "reach", "trim"]

PIECE = 256  # new tokens attended at a time: a step's masks are (PIECE, kept + PIECE)


@dataclass
class Kept:
    """Each row's sinks and last ``window - 1`` keys: ``keys`` ``(B, H, C, D)``, ``values``
    ``(B, H, C, Dv)``, ``positions`` ``(B, C)`` (-1: empty) and ``lengths`` ``(B,)``, the real
    tokens each row has had."""

    keys: Tensor
    values: Tensor
    positions: Tensor
    lengths: Tensor

    def select(self, index: Tensor) -> Kept:
        """The rows ``index`` (beam search's reorder, a batch's selection)."""
        return Kept(*(getattr(self, f.name).index_select(0, index.to(self.keys.device)) for f in fields(self)))

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))


def pieces(count: int) -> list[slice]:
    """``count`` new tokens as slices of at most ``PIECE``."""
    return [slice(start, min(count, start + PIECE)) for start in range(0, count, PIECE)]


def kept_from_prompt(k: Tensor, v: Tensor, real: Tensor | None, sinks: int, window: int) -> tuple[Kept, Tensor]:
    """The slots after a prompt ``k``, ``v`` ``(B, H, S, ·)`` whose real tokens are ``real``
    ``(B, S)`` (None: all), and the mask ``(B, S)`` of the real keys that left the window for good."""
    B, _, S, _ = k.shape
    real = torch.ones(B, S, dtype=torch.bool, device=k.device) if real is None else real.to(k.device, torch.bool)
    positions = real.long().cumsum(1) - 1
    lengths = real.sum(1)
    keep = real & ((positions < sinks) | (positions >= (lengths - (window - 1))[:, None]))
    return _gather(k, v, positions, keep, sinks + window - 1, lengths), real & ~keep


def extend(kept: Kept, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The slots followed by ``T`` new tokens ``(B, H, T, ·)``: keys, values, their positions
    ``(B, C + T)``, and the new tokens' positions ``(B, T)``."""
    new = kept.lengths[:, None] + torch.arange(k.shape[2], device=k.device)
    return (
        torch.cat([kept.keys, k], dim=2),
        torch.cat([kept.values, v], dim=2),
        torch.cat([kept.positions, new], dim=1),
        new,
    )


def reach(positions: Tensor, new: Tensor, sinks: int, window: int) -> tuple[Tensor, Tensor]:
    """For queries at ``new`` ``(B, T)`` over keys at ``positions`` ``(B, S)`` (-1: none): the
    window's mask (sinks, or fewer than ``window`` back) and the far mask (the other earlier keys,
    sinks excepted), each ``(B, T, S)``."""
    p, j = new[:, :, None], positions[:, None, :]
    seen = (j >= 0) & (j <= p)
    near = (j < sinks) | (p - j < window)
    return seen & near, seen & ~near


def trim(
    keys: Tensor, values: Tensor, positions: Tensor, lengths: Tensor, sinks: int, window: int
) -> tuple[Kept, Tensor]:
    """The slots for rows of ``lengths`` real tokens, from ``keys``, ``values`` at ``positions``
    ``(B, S)``, and the mask ``(B, S)`` of the keys that left the window for good."""
    real = positions >= 0
    keep = real & ((positions < sinks) | (positions >= (lengths - (window - 1))[:, None]))
    return _gather(keys, values, positions, keep, sinks + window - 1, lengths), real & ~keep


def _gather(k: Tensor, v: Tensor, positions: Tensor, keep: Tensor, capacity: int, lengths: Tensor) -> Kept:
    """``capacity`` slots per row: the kept keys first, in order, then empty ones."""
    B, H, S, D = k.shape
    if S < capacity:  # a short prompt: empty slots to the capacity
        pad = capacity - S
        k = torch.cat([k, k.new_zeros(B, H, pad, D)], dim=2)
        v = torch.cat([v, v.new_zeros(B, H, pad, v.shape[-1])], dim=2)
        positions = torch.cat([positions, positions.new_full((B, pad), -1)], dim=1)
        keep = torch.cat([keep, keep.new_zeros(B, pad)], dim=1)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :capacity]
    index = order[:, None, :, None]
    return Kept(
        k.gather(2, index.expand(B, H, capacity, D)),
        v.gather(2, index.expand(B, H, capacity, v.shape[-1])),
        torch.where(keep.gather(1, order), positions.gather(1, order), -1),
        lengths,
    )

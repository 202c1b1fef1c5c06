"""What a window with sinks still reaches while decoding: the keys kept per row, with positions.

A causal window of ``w`` with ``s`` sinks lets the query at position p see the keys j <= p with
j < s (the sinks) or p - j < w (the window). The next query, at position n (the row's length so
far), still reaches only the sinks and the last ``w - 1`` keys. A decoder keeps those and one key
more, the last ``w``, at most ``s + w`` per row, and forgets (or, for ``linear``, sums into its far
state) the rest. The one more makes a one-token step cheap (``one_step``): the new key takes the
slot of the key it pushes out of the window (or an empty one), and then every kept key is one the
new query sees, so it attends to all slots without a positional mask.

Positions count each row's **real** tokens: under padding, a row's sinks are its first real
tokens, and a batch whose rows have different lengths decodes each row as if alone. ``Kept``
holds the kept keys in slots ``(B, H, C, ·)``, each slot's position ``(B, C)`` (-1 for an empty
slot) and each row's length; the attention over the slots is by position, never by slot order.

- ``kept_from_prompt``: the slots after a parallel prefill (the prefill's state, handed over),
  and which keys left the window for good;
- ``reach``: the masks of new queries over the slots and themselves: the window's part, and the
  far part (keys at or beyond ``w`` back, not sinks);
- ``trim``: the slots after the new tokens, and which keys left;
- ``one_step``: one new token written in place (the common step of generation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PIECE", "Kept", "extend", "kept_from_prompt", "one_step", "pieces", "reach", "trim"]

PIECE = 256  # new tokens attended at a time: a step's masks are (PIECE, kept + PIECE)


@dataclass
class Kept:
    """Each row's sinks and last ``window`` keys: ``keys`` ``(B, H, C, D)``, ``values``
    ``(B, H, C, Dv)``, ``positions`` ``(B, C)`` (-1: empty) and ``lengths`` ``(B,)``, the real
    tokens each row has had."""

    keys: Tensor
    values: Tensor
    positions: Tensor
    lengths: Tensor
    ring: int | None = None  # the slot every row's next key takes, when all slots are full and rows agree

    def select(self, index: Tensor) -> Kept:
        """The rows ``index`` (beam search's reorder, a batch's selection)."""
        index = index.to(self.keys.device)
        return Kept(*(getattr(self, name).index_select(0, index) for name in _TENSORS), ring=self.ring)

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in _TENSORS)


_TENSORS = ("keys", "values", "positions", "lengths")


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
    keep = real & ((positions < sinks) | (positions >= (lengths - window)[:, None]))
    return _gather(k, v, positions, keep, sinks, window, lengths), real & ~keep


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
    keep = real & ((positions < sinks) | (positions >= (lengths - window)[:, None]))
    return _gather(keys, values, positions, keep, sinks, window, lengths), real & ~keep


def one_step(
    kept: Kept, k: Tensor, v: Tensor, sinks: int, leaving: bool = True
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """One new token ``(B, H, 1, ·)`` into ``kept``, in place: it takes an empty slot, else the
    oldest key past the sinks (the one now outside the window). Returns the key and value that
    left ``(B, H, 1, ·)`` (None unless ``leaving``), whether a real key left ``(B,)`` (None: in
    every row), and the mask ``(B, 1, 1, C)`` of the filled slots (None when all are), all in the
    new query's view.

    Once every slot is full and the rows' oldest keys share a slot (``kept.ring``: one row, or
    rows past the window alike), the slots turn as a ring: the step writes there with no search."""
    if kept.ring is not None:
        slot = kept.ring
        old_k = old_v = None
        if leaving:
            old_k, old_v = kept.keys[:, :, slot : slot + 1].clone(), kept.values[:, :, slot : slot + 1].clone()
        kept.keys.narrow(2, slot, 1).copy_(k)
        kept.values.narrow(2, slot, 1).copy_(v)
        kept.positions[:, slot] = kept.lengths
        kept.lengths = kept.lengths + 1
        kept.ring = slot + 1 if slot + 1 < kept.positions.shape[1] else sinks
        return old_k, old_v, None, None
    B, H, _, D = kept.keys.shape
    positions = kept.positions
    slot = _oldest(positions, sinks)  # empty (-1) first
    index = slot[:, None, None, None]
    old_k = old_v = None
    if leaving:
        old_k = kept.keys.gather(2, index.expand(B, H, 1, D))
        old_v = kept.values.gather(2, index.expand(B, H, 1, kept.values.shape[-1]))
    left = positions.gather(1, slot[:, None])[:, 0] >= sinks
    kept.keys.scatter_(2, index.expand(B, H, 1, D), k)
    kept.values.scatter_(2, index.expand(B, H, 1, kept.values.shape[-1]), v)
    positions.scatter_(1, slot[:, None], kept.lengths[:, None])
    kept.lengths = kept.lengths + 1
    filled = positions >= 0
    if not bool(filled.all()):
        return old_k, old_v, left, filled[:, None, None, :]
    kept.ring = _ring(positions, sinks)
    return old_k, old_v, left, None


def _oldest(positions: Tensor, sinks: int) -> Tensor:
    """Each row's slot ``(B,)`` of the smallest position past the sinks (an empty slot's -1 first)."""
    never = torch.iinfo(positions.dtype).max
    return torch.where((positions >= sinks) | (positions < 0), positions, never).argmin(1)


def _ring(positions: Tensor, sinks: int) -> int | None:
    """The slot every row's next key takes, for full slots ``positions`` ``(B, C)``, when the rows agree."""
    if positions.shape[1] <= sinks:
        return None
    slot = _oldest(positions, sinks)
    return int(slot[0]) if bool((slot == slot[0]).all()) else None


def _gather(k: Tensor, v: Tensor, positions: Tensor, keep: Tensor, sinks: int, window: int, lengths: Tensor) -> Kept:
    """``sinks + window`` slots per row: the kept keys first, by position, then empty ones."""
    B, H, S, D = k.shape
    capacity = sinks + window
    if S < capacity:  # a short prompt: empty slots to the capacity
        pad = capacity - S
        k = torch.cat([k, k.new_zeros(B, H, pad, D)], dim=2)
        v = torch.cat([v, v.new_zeros(B, H, pad, v.shape[-1])], dim=2)
        positions = torch.cat([positions, positions.new_full((B, pad), -1)], dim=1)
        keep = torch.cat([keep, keep.new_zeros(B, pad)], dim=1)
    never = torch.iinfo(positions.dtype).max
    order = torch.argsort(torch.where(keep, positions, never), dim=1, stable=True)[:, :capacity]  # by position
    index = order[:, None, :, None]
    kept = torch.where(keep.gather(1, order), positions.gather(1, order), -1)
    full = capacity > 0 and bool((kept >= 0).all())
    return Kept(
        k.gather(2, index.expand(B, H, capacity, D)),
        v.gather(2, index.expand(B, H, capacity, v.shape[-1])),
        kept,
        lengths,
        ring=_ring(kept, sinks) if full else None,
    )

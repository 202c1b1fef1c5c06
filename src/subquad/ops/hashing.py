"""Counter-based hashing: random numbers that are a fixed function of (seed, position, ...).

A mechanism that needs random draws per position (initial centroids, a fitting sample, a random
resolution) takes them from a hash of the position rather than from a generator, so a position's
draw depends only on itself: not on the batch, the padded length, the grouping of rows or the
device. ``mix32`` is the integer finaliser (two multiply–xorshift rounds).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["mix32", "position_uniform", "position_uniforms", "seeded_uniform"]

_MASK = 0xFFFFFFFF


def mix32(x: Tensor) -> Tensor:
    """A bijective mix of 32-bit counters ``x`` (int64, values in ``[0, 2^32)``)."""
    for multiplier in (0x7FEB352D, 0x4C6A68B3):  # odd constants below 2^31: products stay below 2^63
        x = ((x ^ (x >> 16)) * multiplier) & _MASK
    return x ^ (x >> 15)


def position_uniform(seed: int, heads: Tensor, positions: Tensor, stream: int) -> Tensor:
    """Uniforms in (0, 1), fp32, shaped like ``positions`` ``(G, n)``: a fixed function of (seed,
    head ``heads (G,)``, stream, position in the row)."""
    return position_uniforms(seed, heads, positions, [stream])[0]


def position_uniforms(seed: int, heads: Tensor, positions: Tensor, streams: Sequence[int]) -> Tensor:
    """``position_uniform`` of several streams at once: ``(R, G, n)`` for R streams, in one pass
    (the same numbers, for a fraction of the small operations)."""
    # each stream's offset in Python's exact integers: seed · constant overflows int64
    offsets = [(stream * 0x85EBCA77 + seed * 0xC2B2AE3D) % 2**32 for stream in streams]
    base = positions + heads.unsqueeze(1) * 0x9E3779B1
    if len(offsets) == 1:
        x = (base + offsets[0]).unsqueeze(0)
    else:
        x = base + torch.tensor(offsets, dtype=base.dtype, device=base.device).view(-1, 1, 1)
    # 23 bits: (k + 0.5)·2^-23 is exact in fp32 and lies in [2^-24, 1 − 2^-24], never 0 or 1
    return ((mix32(x & _MASK) >> 9).to(torch.float32) + 0.5) * 2.0**-23


def seeded_uniform(seed: int, positions: Tensor) -> Tensor:
    """Uniforms in [0, 1), fp64, shaped like ``positions``: a fixed function of (seed, position)."""
    x = (positions * 0x9E3779B1 + (seed * 0x85EBCA77 + 0x632BE5AB) % 2**32) & _MASK
    return (mix32(x) >> 8).to(torch.float64) * 2.0**-24

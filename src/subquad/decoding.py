"""Decoding caches for autoregressive generation.

A mechanism names its decoder in its registry record (``Mechanism.decoder``); layers build one
per head group with ``decoder(mechanism, config, state)`` and call ``step(q, k, v, **tensors)`` with
the new tokens. A mechanism without a decoder cannot decode from a cache: generate without one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from subquad.registry import Config, Mechanism

__all__ = ["KVCache"]


class KVCache:
    """Decoding cache that keeps every key and value seen so far.

    Exact for a mechanism whose causal output at a position depends only on that position's query
    and the keys and values up to it (full attention, for one): causal attention aligns the new
    queries to the last keys. It is wrong for a mechanism whose output also depends on past
    queries, or on extra tensors of past positions (those are passed for the new tokens only);
    such a mechanism needs its own decoder. Each new token costs attention over the whole prefix.
    """

    recurrent = False  # state grows with the prefix
    description = "KV cache (each new token attends to the whole prefix)"

    def __init__(self, mechanism: Mechanism, config: Config, state: torch.nn.Module | None) -> None:
        if not (mechanism.causal and mechanism.cross):
            raise ValueError(f"{mechanism.name} needs a causal form that takes L != S to decode from a KV cache")
        self.mechanism, self.config, self.state = mechanism, config, state
        self.keys: Tensor | None = None  # (B, H, capacity, D)
        self.values: Tensor | None = None  # (B, H, capacity, Dv)
        self.length = 0

    def step(self, q: Tensor, k: Tensor, v: Tensor, **tensors: Tensor) -> Tensor:
        """Append ``k``, ``v`` ``(B, H, T, D)`` and attend the ``T`` new queries causally."""
        self._check_matches(k, self.keys, "k")
        self._check_matches(v, self.values, "v")
        self.keys = _append(self.keys, self.length, k)
        self.values = _append(self.values, self.length, v)
        self.length += k.shape[2]
        keys, values = self.keys[:, :, : self.length], self.values[:, :, : self.length]
        return self.mechanism(q, keys, values, is_causal=True, config=self.config, state=self.state, **tensors)

    @staticmethod
    def _check_matches(x: Tensor, buffer: Tensor | None, name: str) -> None:
        """New entries must match what the cache holds, checked before anything is written."""
        if buffer is None:
            return
        B, H, _, D = buffer.shape
        if x.dim() != 4 or (x.shape[0], x.shape[1], x.shape[3]) != (B, H, D) or x.dtype != buffer.dtype:
            raise ValueError(
                f"the cache holds {name} of (B, H, D) = ({B}, {H}, {D}) {buffer.dtype}, got shape "
                f"{tuple(x.shape)} {x.dtype}; start a new cache for a new batch"
            )
        if x.device != buffer.device:
            raise ValueError(f"the cache is on {buffer.device} but {name} is on {x.device}")


def _append(buffer: Tensor | None, length: int, x: Tensor) -> Tensor:
    """Write ``x`` after ``length`` entries on dim 2, doubling the capacity when it is full."""
    needed = length + x.shape[2]
    if buffer is None or needed > buffer.shape[2]:
        capacity = max(needed, 2 * (0 if buffer is None else buffer.shape[2]), 16)
        grown = x.new_empty(*x.shape[:2], capacity, x.shape[3])
        if buffer is not None:
            grown[:, :, :length] = buffer[:, :, :length]
        buffer = grown
    buffer[:, :, length:needed] = x
    return buffer

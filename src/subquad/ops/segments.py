"""Segment means: the landmarks of multi-resolution attention (AdaMRA, Zhang et al. 2021, §3.2).

A sequence is cut into consecutive segments of ℓ positions from position 0; a segment's landmark is
the mean of its real positions. The causal form (``running_means``) takes, at each position, the
mean of its own segment's real positions up to it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["running_means", "segment_length", "segment_means"]


def segment_length(rate: float, keys: int | None = None) -> int:
    """ℓ = ⌊1/c⌋ positions per segment: the longest segment that gives at least m = ⌈N·c⌉ landmarks
    at every N (exactly m when 1/c is a whole number, as for all the paper's rates). At most the
    ``keys`` S: one segment of all the keys is the same landmark as any longer one (segments start
    at position 0, causal ones too), and the work stays O(S) for any rate."""
    length = max(1, math.floor(1 / rate + 1e-9))
    return length if keys is None else max(1, min(length, keys))


def segment_means(x: Tensor, key_padding_mask: Tensor | None, length: int) -> tuple[Tensor, Tensor]:
    """Means of consecutive segments of ``length`` positions over the real positions only.

    Args:
        x: ``(B, H, N, F)``.
        key_padding_mask: bool ``(B, N)``, True marks a real position, or None.
        length: ℓ, positions per segment; the last segment may be short.

    Returns:
        The means ``(B, H, n, F)`` with n = ⌈N/ℓ⌉ (zero for an empty segment), and ``valid`` bool
        ``(B, n)``: whether a segment holds a real position.
    """
    B, H, N, Fx = x.shape
    n = -(-N // length)
    pad = n * length - N
    if pad:
        x = F.pad(x, (0, 0, 0, pad))  # zeros add nothing
    if key_padding_mask is None:
        sums = x.view(B, H, n, length, Fx).sum(3)
        counts = (N - torch.arange(n, device=x.device) * length).clamp(max=length).expand(B, n)
    else:
        weight = F.pad(key_padding_mask, (0, pad)).view(B, 1, n, length, 1)
        sums = (x.view(B, H, n, length, Fx) * weight.to(x.dtype)).sum(3)
        counts = weight.view(B, n, length).sum(-1)
    means = sums / counts.clamp(min=1).to(x.dtype)[:, None, :, None]
    return means, counts > 0


def running_means(x: Tensor, key_padding_mask: Tensor | None, length: int) -> tuple[Tensor, Tensor]:
    """Causal form: at each position p the mean of the real positions of its segment up to p,
    ``(B, H, N, F)``, and whether there is one, ``(B, N)``."""
    B, H, N, Fx = x.shape
    n = -(-N // length)
    pad = n * length - N
    weight = F.pad(x.new_ones(B, N) if key_padding_mask is None else key_padding_mask.to(x.dtype), (0, pad))
    weight = weight.view(B, 1, n, length, 1)
    sums = torch.cumsum(F.pad(x, (0, 0, 0, pad)).view(B, H, n, length, Fx) * weight, dim=3)
    counts = torch.cumsum(weight, dim=3)
    means = (sums / counts.clamp(min=1)).view(B, H, n * length, Fx)[:, :, :N]
    return means, (counts.view(B, n * length)[:, :N] > 0)

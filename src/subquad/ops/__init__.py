"""Shared differentiable maths used by several mechanisms."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["softmax"]


def softmax(x: Tensor, dim: int) -> Tensor:
    """``torch.softmax(x, dim)`` whose result does not depend on the thread count.

    torch's CPU softmax over a dimension other than the last splits each row's reduction between
    threads, so 1 and 2 threads round differently; over the last dimension each row is one
    thread's. So the softmax runs over a view with ``dim`` moved last.
    """
    return torch.softmax(x.movedim(dim, -1), dim=-1).movedim(-1, dim)

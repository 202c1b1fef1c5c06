"""Shared test helpers."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor


def randn(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> Tensor:
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def qkv(B=2, H=3, L=7, S=None, D=8, Dv=None, dtype=torch.float64, seed=0) -> tuple[Tensor, Tensor, Tensor]:
    S = L if S is None else S
    Dv = D if Dv is None else Dv
    return (
        randn(B, H, L, D, dtype=dtype, seed=seed),
        randn(B, H, S, D, dtype=dtype, seed=seed + 1),
        randn(B, H, S, Dv, dtype=dtype, seed=seed + 2),
    )


def padding(B: int, S: int, seed: int = 0, p: float = 0.3) -> Tensor:
    """A random key padding mask (True = real) where every row keeps at least one real key."""
    mask = torch.rand(B, S, generator=torch.Generator().manual_seed(seed)) > p
    mask[:, 0] = True
    return mask


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)

"""Benchmark inputs: iid Gaussians, and queries and keys with real cluster structure.

On iid Gaussian queries and keys, attention is close to uniform and shows no structure for a
clustering or routing mechanism to find, so approximation errors there are pessimistic. Real
activations cluster. ``clustered`` draws queries and keys around a few shared centres per head, so
that each query attends mostly to the keys of its own centre:

    centre_c ~ N(0, I_D),   q_i = centre_{z_i} + spread · ε_i,   k_j = centre_{y_j} + spread · ε'_j

with z, y uniform over ``centres`` and spread 0.5. At D = 64 and scale D^-1/2 a query's logits for
keys of its own centre are about 8 above the others, with a spread of about 1 among them.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["INPUT_KINDS", "make_qkv"]

INPUT_KINDS = ("iid", "clustered")


def make_qkv(
    kind: str,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    *,
    centres: int = 16,
    spread: float = 0.5,
    kv_heads: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Queries, keys and values of ``shape`` ``(B, H, N, D)``, drawn reproducibly from ``seed``;
    with ``kv_heads``, keys and values ``(B, kv_heads, N, D)``, each serving ``H / kv_heads``
    consecutive query heads (clustered: around its own centres)."""
    if kind not in INPUT_KINDS:
        raise ValueError(f"unknown input kind {kind!r}; choose one of {', '.join(INPUT_KINDS)}")
    generator = torch.Generator().manual_seed(seed)
    B, H, N, D = shape
    Hk = kv_heads or H
    if H % Hk:
        raise ValueError(f"kv_heads must divide the {H} heads, got {kv_heads}: each serves H / kv_heads query heads")
    if kind == "iid":
        q, k, v = (torch.randn(s, generator=generator, dtype=dtype) for s in (shape, (B, Hk, N, D), (B, Hk, N, D)))
        return q.to(device), k.to(device), v.to(device)
    centre = torch.randn(B, Hk, centres, D, generator=generator)  # (B, Hk, C, D)
    q = _around(centre.repeat_interleave(H // Hk, dim=1), N, spread, generator)
    k = _around(centre, N, spread, generator)
    v = torch.randn(B, Hk, N, D, generator=generator)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))  # type: ignore[return-value]


def _around(centre: Tensor, n: int, spread: float, generator: torch.Generator) -> Tensor:
    """``n`` points per (batch, head), each at a uniformly chosen centre plus Gaussian noise."""
    B, H, C, D = centre.shape
    which = torch.randint(C, (B, H, n), generator=generator)  # (B, H, N)
    points = torch.gather(centre, 2, which.unsqueeze(-1).expand(B, H, n, D))  # (B, H, N, D)
    return points + spread * torch.randn(B, H, n, D, generator=generator)

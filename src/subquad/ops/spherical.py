"""Routing attention's online spherical k-means (Roy et al. 2021): each vector's nearest centroid
direction, the exponential-moving-average update of the centroids, the commitment loss, and the
offline k-means that calibrates centroids on a model's own queries and keys. Batched over heads:
centroids are ``(H, C, D)``, points ``(B, H, N, D)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from subquad.kernels.tuning import TUNING, block_elements
from subquad.ops.clustering import first_argmax_

__all__ = ["commitment_loss", "ema_centroids", "nearest_direction", "spherical_kmeans"]


def nearest_direction(x: Tensor, centroids: Tensor) -> Tensor:
    """The nearest centroid ``(B, H, N)`` of each vector's direction ``x̂ = x / ‖x‖`` (``x``:
    ``(B, H, N, D)``): ``argmax_c x · μ_c``, the argmax of ``x̂ · μ_c`` (a positive factor ‖x‖
    changes no argmax, so ``x`` need not be normalised); the first of tied maxima."""
    B, H, N, _ = x.shape
    C = centroids.shape[1]
    mu = centroids.transpose(-1, -2)  # (H, D, k)
    step = max(1, min(N, block_elements(TUNING.routing_assign, x.device) // (B * H * C)))
    scores = x.new_empty(B, H, step, C, dtype=centroids.dtype)  # reused: no page faults
    cluster = torch.empty(B, H, N, dtype=torch.long, device=x.device)
    for s in range(0, N, step):
        part = torch.matmul(x[:, :, s : s + step].to(centroids.dtype), mu, out=scores if N - s >= step else None)
        cluster[:, :, s : s + step] = first_argmax_(part, -1)  # NaN rows: C − 1, in range
    return cluster


def ema_centroids(centroids: Tensor, points: list[tuple[Tensor, Tensor, Tensor | None]], decay: float) -> Tensor:
    """Online spherical k-means (Roy et al. 2021, eq. 8): each centroid ``(H, C, D)`` moves by an
    exponential moving average towards the mean of the real points routed to it, then back onto the
    unit sphere; a centroid that got no point keeps its place.

    Args:
        centroids: ``(H, C, D)`` unit vectors.
        points: ``(x̂, cluster, real)`` triples: normalised vectors ``(B, H, N, D)``, their
            clusters ``(B, H, N)`` and a bool ``(B, N)`` mask of real tokens (None: all real).
        decay: the EMA's weight on the old centroid.

    Returns:
        The new centroids ``(H, C, D)``.
    """
    H, C, D = centroids.shape
    work = torch.promote_types(centroids.dtype, torch.float32)  # half centroids: sums and counts in fp32
    sums, counts = centroids.new_zeros(H, C, D, dtype=work), centroids.new_zeros(H, C, dtype=work)
    for x, cluster, real in points:
        B, _, N, _ = x.shape
        weight = x.new_ones(B, 1, N, dtype=work) if real is None else real[:, None].to(work)
        weight = weight.expand(B, H, N).transpose(0, 1).reshape(H, B * N)
        index = cluster.transpose(0, 1).reshape(H, B * N)
        rows = x.transpose(0, 1).reshape(H, B * N, D).to(work) * weight[..., None]
        sums.scatter_add_(1, index[..., None].expand(H, B * N, D), rows)
        counts.scatter_add_(1, index, weight)
    means, old = sums / counts.clamp(min=1)[..., None], centroids.to(work)
    moved = torch.where(counts[..., None] > 0, decay * old + (1 - decay) * means, old)
    return F.normalize(moved, dim=-1).to(centroids.dtype)


def commitment_loss(x: Tensor, cluster: Tensor, centroids: Tensor, real: Tensor | None) -> Tensor:
    """Mean over real tokens of ‖x̂ − sg(μ_cluster)‖², the commitment loss of routing (``x``: normalised
    ``(B, H, N, D)``, ``cluster`` ``(B, H, N)``, ``real`` bool ``(B, N)`` or None)."""
    H = x.shape[1]
    mu = centroids.detach()[torch.arange(H, device=x.device)[None, :, None], cluster]  # (B, H, N, D)
    err = (x - mu).pow(2).sum(-1)  # (B, H, N)
    if real is None:
        return err.mean()
    weight = real[:, None].to(err.dtype).expand_as(err)
    return (err * weight).sum() / weight.sum().clamp(min=1)


def spherical_kmeans(points: Tensor, clusters: int, iterations: int, seed: int) -> Tensor:
    """Unit centroids ``(H, C, D)`` of unit ``points`` ``(H, n, D)``, by Lloyd's iterations with the
    dot product from C distinct seeded points: routing's own assignment (``nearest_direction``) and
    update (``ema_centroids`` with no memory of the old centroid); a cluster left empty keeps its
    centroid."""
    H, n, D = points.shape
    if n < clusters:
        raise ValueError(f"calibration saw {n} tokens per head, fewer than clusters={clusters}; pass more batches")
    generator = torch.Generator().manual_seed(seed)
    start = torch.stack([torch.randperm(n, generator=generator)[:clusters] for _ in range(H)]).to(points.device)
    centroids = torch.gather(points, 1, start[..., None].expand(-1, -1, D))
    x = points.unsqueeze(0)  # (1, H, n, D)
    for _ in range(iterations):
        centroids = ema_centroids(centroids, [(x, nearest_direction(x, centroids), None)], decay=0.0)
    return centroids

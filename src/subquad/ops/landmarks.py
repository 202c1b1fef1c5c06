"""Attention over landmarks (AdaMRA, Zhang et al. 2021, eq. 7): each query against the segment
means of the keys and values (``ops.segments``), never against the keys themselves.

- ``landmark_kernel``: kernel attention ``φ(q)ᵀ Σ φ(k̃) ṽᵀ / φ(q)ᵀ Σ φ(k̃)`` for groups of heads at
  several resolutions at once, weighted by a per-query gate (zero where a query chose another).
- ``causal_landmark_kernel``: the same over the completed segments before each query plus the
  running mean of its own segment up to it, through the causal product (``ops.scan``).
- ``landmark_softmax``: the softmax ablation over the same landmarks.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from subquad.kernels.memory import BlockOutput, Scratch, kept_buffer, tracks_grad
from subquad.kernels.tuning import TUNING, block_elements
from subquad.ops.features import feature_map, features_into
from subquad.ops.scan import causal_dot
from subquad.ops.segments import running_means, segment_length, segment_means

__all__ = ["causal_landmark_kernel", "gather_positions", "landmark_kernel", "landmark_softmax", "scatter_positions"]


def gather_positions(x: Tensor, index: Tensor) -> Tensor:
    """``x[b, h, index[b, j]]``: rows of ``x`` ``(B, H, N, F)`` for ``index`` ``(B, n)``."""
    B, H, _, Fx = x.shape
    return x.gather(2, index[:, None, :, None].expand(B, H, index.shape[1], Fx))


def scatter_positions(x: Tensor, index: Tensor, size: int) -> Tensor:
    """Rows of ``x`` ``(B, H, n, F)`` placed at ``index`` ``(B, n)`` of a zero ``(B, H, size, F)``."""
    B, H, n, Fx = x.shape
    return x.new_zeros(B, H, size, Fx).scatter(2, index[:, None, :, None].expand(B, H, n, Fx), x)


def landmark_kernel(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, rates: tuple[float, ...], subheads: int, gate: Tensor,
    feature: str, eps: float,
) -> Tensor:  # fmt: skip
    """Eq. 7 for every head at once: each head group's Σ φ(k̃) [ṽ, 1]ᵀ over its own landmarks, then
    one product of all queries with them, weighted by ``gate`` ``(B, H, L)`` (zero where a query chose
    another resolution)."""
    Dv = v.shape[3]
    sums = []
    for h, rate in enumerate(rates):
        heads = slice(h * subheads, (h + 1) * subheads)
        length = segment_length(rate, k.shape[2])
        k_means, valid = segment_means(k[:, heads], mask, length)  # (B, S', n, D), (B, n)
        v_means, _ = segment_means(v[:, heads], mask, length)
        fk = feature_map(k_means, feature) * valid[:, None, :, None].to(q.dtype)
        v1 = torch.cat([v_means, v_means.new_ones(*v_means.shape[:3], 1)], dim=-1)  # the normaliser column
        sums.append(torch.matmul(fk.transpose(-1, -2), v1))  # (B, S', D, Dv + 1)
    sums = torch.cat(sums, dim=1)  # (B, H, D, Dv + 1)
    if tracks_grad(q, k, v, gate):
        y = torch.matmul(feature_map(q, feature), sums)  # (B, H, L, Dv + 1)
        return y[..., :Dv] * (gate.unsqueeze(-1) / (y[..., Dv:] + eps))
    # Without autograd, blocks of queries are written into the output: no full-size temporaries;
    # a block's features and products go into buffers the thread keeps (fresh ones faulted in).
    B, H, L, D = q.shape
    out = q.new_empty(B, H, L, Dv)
    block = max(1, block_elements(TUNING.multires_query_block, q.device) // (B * H * (D + Dv + 1)))
    scratch = Scratch(q.dtype, q.device)
    for start in range(0, L, block):
        rows = q[:, :, start : start + block]
        phi = features_into(rows, feature, _kept("multires.features", rows, D), scratch)
        y = torch.matmul(phi, sums, out=_kept("multires.y", rows, Dv + 1))
        weight = gate[:, :, start : start + block, None] / (y[..., Dv:] + eps)
        torch.mul(y[..., :Dv], weight, out=out[:, :, start : start + block])
    return out


def _kept(name: str, rows: Tensor, width: int) -> Tensor:
    """A buffer ``(B, H, n, width)`` for ``rows`` ``(B, H, n, ·)`` that the thread keeps (``kept_buffer``)."""
    return kept_buffer(name, rows[..., :1].numel() * width, rows.dtype, rows.device).view(*rows.shape[:3], width)


def causal_landmark_kernel(
    q: Tensor,
    position: Tensor,
    real: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    length: int,
    feature: str,
    eps: float,
) -> Tensor:
    """Causal eq. 7 for the queries ``(B, H, w, D)`` at key positions ``position`` ``(B, w)``, in
    increasing order where ``real``: the completed segments before each, and its own segment's
    running mean. Rows that are not ``real`` return zeros.

    The completed landmarks come from ``causal_dot`` over a merged sequence holding the queries and
    the landmarks in order of position, each landmark after the queries of its segment (queries have
    b = c = 0, landmarks a = 0), so each query sums exactly the landmarks of earlier segments. Its
    own segment enters as φ(q)·φ(k̄_p) [v̄_p, 1].
    """
    B, H, w, D = q.shape
    Dv = v.shape[3]
    k_means, valid = segment_means(k, mask, length)  # (B, H, n, D), (B, n)
    v_means, _ = segment_means(v, mask, length)
    n = k_means.shape[2]
    position = position.clamp(min=0)  # rows before every key are not real
    segment = torch.where(real, torch.div(position, length, rounding_mode="floor"), n)  # others go last
    # Query j goes after the landmarks of the segments before its own; landmark s after the queries
    # of segments <= s.
    query_slot = torch.arange(w, device=q.device) + segment  # (B, w)
    per_segment = torch.zeros(B, n + 1, dtype=torch.long, device=q.device).scatter_add_(1, segment, real.long())
    landmark_slot = torch.arange(n, device=q.device) + torch.cumsum(per_segment[:, :n], dim=1)  # (B, n)
    # Whole chunks: w counts the queries routed here, later ones included, and a shorter last chunk
    # would sum the earlier slots in another order, so the past would move with the future.
    slots = -(-(w + n) // TUNING.multires_causal_chunk) * TUNING.multires_causal_chunk

    fq = feature_map(q, feature) * real[:, None, :, None].to(q.dtype)
    fk = feature_map(k_means, feature) * valid[:, None, :, None].to(q.dtype)
    v1 = torch.cat([v_means, v_means.new_ones(B, H, n, 1)], dim=-1)  # the normaliser as a value column
    a, b, c = (
        scatter_positions(fq, query_slot, slots),
        scatter_positions(fk, landmark_slot, slots),
        scatter_positions(v1, landmark_slot, slots),
    )
    rows = B * H
    a, b, c = a.view(rows, slots, D), b.view(rows, slots, D), c.view(rows, slots, Dv + 1)
    y = causal_dot(a, b, c, None, TUNING.multires_causal_chunk)
    y = gather_positions(y.view(B, H, slots, Dv + 1), query_slot)  # (B, H, w, Dv + 1)

    k_run, seen = running_means(k, mask, length)  # the own segment up to p: (B, H, S, D), (B, S)
    v_run, _ = running_means(v, mask, length)
    own = (fq * feature_map(gather_positions(k_run, position), feature)).sum(-1, keepdim=True)
    own = own * seen.gather(1, position)[:, None, :, None].to(q.dtype)
    v_own = gather_positions(v_run, position)
    y = y + own * torch.cat([v_own, v_own.new_ones(B, H, w, 1)], dim=-1)
    return y[..., :Dv] / (y[..., Dv:] + eps)  # zero where not real: φ(q) = 0 there


def landmark_softmax(
    q: Tensor,
    position: Tensor,
    real: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    length: int,
    is_causal: bool,
    scale: float,
) -> Tensor:
    """The Softmax ablation: softmax(q·k̃ᵀ·scale) ṽ over the same landmarks as the kernel form, in
    blocks of queries; causal: the completed segments before p and the running mean at p. Rows that
    are not ``real``, or see no landmark, return zeros."""
    B, H, w, _ = q.shape
    Dv = v.shape[3]
    k_means, valid = segment_means(k, mask, length)  # (B, H, n, D), (B, n)
    v_means, _ = segment_means(v, mask, length)
    n = k_means.shape[2]
    if is_causal:
        k_run, seen = running_means(k, mask, length)
        v_run, _ = running_means(v, mask, length)
    out = BlockOutput((B, H, w, Dv), 2, q, track=tracks_grad(q, k, v))
    block = max(1, block_elements(TUNING.multires_softmax_block, q.device) // (B * H * (n + 1)))
    for start in range(0, w, block):
        qb, pb, rb = q[:, :, start : start + block], position[:, start : start + block], real[:, start : start + block]
        scores = torch.matmul(qb, k_means.transpose(-1, -2)) * scale  # (B, H, b, n)
        visible = (valid[:, None, :] & rb[:, :, None]).unsqueeze(1)  # (B, 1, b, n)
        if is_causal:
            pb = pb.clamp(min=0)  # rows before every key are not real
            completed = torch.arange(n, device=q.device) < torch.div(pb, length, rounding_mode="floor").unsqueeze(-1)
            own_k, own_v = gather_positions(k_run, pb), gather_positions(v_run, pb)
            scores = torch.cat([scores, (qb * own_k).sum(-1, keepdim=True) * scale], dim=-1)
            own_seen = (seen.gather(1, pb) & rb).unsqueeze(-1)  # (B, b, 1)
            visible = torch.cat([visible & completed.unsqueeze(1), own_seen.unsqueeze(1)], dim=-1)
        scores = scores.masked_fill(~visible, -math.inf)
        top = scores.amax(-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)  # finite when none is seen
        weights = torch.exp(scores - top)
        result = torch.matmul(weights[..., :n], v_means)
        if is_causal:
            result = result + weights[..., n:] * own_v
        out.put(result / weights.sum(-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).tiny))
    return out.result()

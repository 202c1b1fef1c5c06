"""``retrieval``'s sinks-and-window part under autograd (``ops.far_blocks.retrieval_chunk``): the
queries in blocks of a few dozen, each block scored against its own key range and the sinks
outside it, its softmax part returned as ``(top, sum, out)`` (``far_blocks._part``'s three).

Under autograd a slice or gather of k per block made each block's gradient a zero tensor of k's
size (the engine's SliceBackward and IndexBackward), summed block by block: O(S² / block) memory
traffic per call. ``window_part`` is an autograd function instead: its forward keeps nothing but
the blocks' largest scores, its backward recomputes each block's weights and adds the block's key
and value gradients into one buffer in place (as flash attention's backward does). ``top`` is a
shift, held constant: the merged softmax does not depend on it, so its gradient is zero and none
is passed (``far_blocks._far`` detaches its own likewise).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from subquad.kernels.softmax import work_dtype

__all__ = ["seen_keys", "window_part"]


def seen_keys(keys: Tensor, p: Tensor, real: Tensor, is_causal: bool, w: int, s: int, window: bool) -> Tensor:
    """``(B, 1, c, n)``: which of the positions ``keys`` the queries at ``p`` see as window or sinks."""
    j, at = keys[None, :], p[:, None]
    near = (at - j < w) & (j - at < w) if window else torch.zeros_like(j - at, dtype=torch.bool)
    seen = near | (j < s)
    if is_causal:
        seen = seen & (j <= at)
    return (seen[None] & real[:, None, keys])[:, None]


def _blocks(c: int, S: int, first: int, real: Tensor, is_causal: bool, w: int, s: int, block: int) -> list[tuple]:
    """Each block of queries ``[a, b)`` (at key positions ``first + a …``): its sinks outside its key
    range, the range ``[lo, hi)`` and which of those keys each query sees ``(B, 1, b − a, K)``."""
    out = []
    for a in range(0, c, block):
        at, n = first + a, min(block, c - a)
        p = torch.arange(at, at + n, device=real.device)
        lo = min(S, max(0, at - w + 1))
        hi = max(lo, min(S, at + n if is_causal else at + n - 1 + w))  # queries may lie before the keys
        keys = torch.arange(lo, hi, device=real.device)
        sink = torch.cat([torch.arange(min(s, lo), device=real.device),
                          torch.arange(hi, min(S, max(s, hi)), device=real.device)])  # fmt: skip
        if len(sink) + hi - lo:  # else none of its queries sees a key: top −inf, sum and output 0
            seen = [seen_keys(x, p, real, is_causal, w, s, near) for near, x in ((False, sink), (True, keys))]
            out.append((a, a + n, sink, lo, hi, torch.cat(seen, -1)))
    return out


def _weights(q: Tensor, k: Tensor, v: Tensor, span: tuple, scale: float) -> tuple[Tensor, ...]:
    """One block's rows ``(B, Hk, per · n, D)`` (q scaled; the query heads of a key/value head
    stacked), keys and values ``(B, Hk, K, ·)``, and exp(score − top) ``(B, Hk, per · n, K)`` with its
    top ``(B, Hk, per · n, 1)`` (−inf where the query sees none of these keys)."""
    (a, b, sink, lo, hi, seen), (B, H, _, D), Hk = span, q.shape, k.shape[1]
    rows = (q[:, :, a:b] * scale).reshape(B, Hk, -1, D)  # heads h·per … of key/value head h, in order
    keys, values = (torch.cat([x.index_select(2, sink), x[:, :, lo:hi]], dim=2) for x in (k, v))
    scores = rows @ keys.transpose(-1, -2)
    scores.view(B, Hk, H // Hk, b - a, -1).masked_fill_(~seen[:, :, None], float("-inf"))
    top = scores.amax(-1, keepdim=True)
    return rows, keys, values, scores.sub_(torch.where(torch.isfinite(top), top, 0.0)).exp_(), top


class _Window(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, spans: list, scale: float) -> tuple[Tensor, ...]:
        work = work_dtype(q.dtype)
        qw, kw, vw = (x.to(work) for x in (q, k, v))
        B, H, c, _ = q.shape
        top = q.new_full((B, H, c, 1), float("-inf"), dtype=work)
        total, out = torch.zeros_like(top), q.new_zeros((B, H, c, v.shape[-1]), dtype=work)
        for span in spans:
            a, b = span[:2]
            _, _, values, weights, high = _weights(qw, kw, vw, span, scale)
            top[:, :, a:b] = high.view(B, H, b - a, 1)
            total[:, :, a:b] = weights.sum(-1, keepdim=True).view(B, H, b - a, 1)
            out[:, :, a:b] = (weights @ values).view(B, H, b - a, -1)
        ctx.save_for_backward(q, k, v)
        ctx.spans, ctx.scale = spans, scale
        ctx.mark_non_differentiable(top)
        return top, total, out

    @staticmethod
    def backward(ctx: Any, _: Tensor, d_total: Tensor | None, d_out: Tensor | None) -> tuple:
        q, k, v = ctx.saved_tensors
        work = work_dtype(q.dtype)
        qw, kw, vw = (x.to(work) for x in (q, k, v))
        dq, dk, dv = (torch.zeros_like(x) for x in (qw, kw, vw))
        (B, Hk), scale = k.shape[:2], ctx.scale
        for span in ctx.spans:
            a, b, sink, lo, hi = span[:5]
            rows, keys, values, weights, _ = _weights(qw, kw, vw, span, scale)
            d_weights = torch.zeros_like(weights)
            if d_out is not None:
                grads = d_out[:, :, a:b].to(work).reshape(B, Hk, -1, d_out.shape[-1])
                d_weights = grads @ values.transpose(-1, -2)
                dv_block = weights.transpose(-1, -2) @ grads
                dv[:, :, lo:hi] += dv_block[:, :, len(sink) :]
                dv.index_add_(2, sink, dv_block[:, :, : len(sink)])
            if d_total is not None:
                d_weights += d_total[:, :, a:b].to(work).reshape(B, Hk, -1, 1)
            d_scores = d_weights.mul_(weights)  # masked keys: weight 0, gradient 0
            dq[:, :, a:b] = (d_scores @ keys).mul_(scale).view(B, -1, b - a, q.shape[-1])
            dk_block = d_scores.transpose(-1, -2) @ rows
            dk[:, :, lo:hi] += dk_block[:, :, len(sink) :]
            dk.index_add_(2, sink, dk_block[:, :, : len(sink)])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def window_part(
    q: Tensor, k: Tensor, v: Tensor, real: Tensor, first: int, is_causal: bool, scale: float, w: int, s: int,
    block: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The sinks-and-window softmax part ``(top, sum, out)`` ``(B, H, c, ·)`` of queries ``q`` at key
    positions ``first …`` over keys ``k`` and values ``v`` of the key/value heads (``real``: the
    keys' padding mask, ``(B, S)``), in blocks of ``block`` queries; ``top`` carries no gradient."""
    spans = _blocks(q.shape[2], k.shape[2], first, real, is_causal, w, s, block)
    return _Window.apply(q, k, v, spans, scale)

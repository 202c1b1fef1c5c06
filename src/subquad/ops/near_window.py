"""``retrieval``'s sinks-and-window part under autograd (``ops.far_blocks.attend_rows``): its
output and log-sum-exp over each query's window and sinks, both with gradients, for the far part
to join in one softmax.

``window_part``'s forward is the block engine's (``kernels.band.window_softmax``, as without
autograd: the same numbers either way), and it keeps only its inputs and results. Its backward
takes the queries in blocks of a few dozen, each against its own key range and the sinks outside
it, recomputes their weights ``P = exp(s − lse)`` and adds each block's key and value gradients into
one buffer in place (flash attention's backward, with the log-sum-exp's own gradient:
``∂lse/∂s = P``, so ``dS = P ⊙ (dO·vᵀ − (rowsum(dO ⊙ O) − d_lse))``). A slice or gather of k per
block under autograd made each block's gradient a zero tensor of k's size, summed by the engine:
O(S² / block) memory traffic per call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from subquad.kernels.band import window_softmax

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


def _scores(q: Tensor, k: Tensor, span: tuple, scale: float) -> tuple[Tensor, ...]:
    """One block's rows ``(B, Hk, per · n, D)`` (q scaled; the query heads of a key/value head
    stacked), its keys ``(B, Hk, K, D)`` (the sinks outside its range, then the range) and their
    scores ``(B, Hk, per · n, K)``, −inf where unseen."""
    (a, b, sink, lo, hi, seen), (B, H, _, D), Hk = span, q.shape, k.shape[1]
    rows = (q[:, :, a:b] * scale).reshape(B, Hk, -1, D)  # heads h·per … of key/value head h, in order
    keys = torch.cat([k.index_select(2, sink), k[:, :, lo:hi]], dim=2)
    scores = rows @ keys.transpose(-1, -2)
    scores.view(B, Hk, H // Hk, b - a, -1).masked_fill_(~seen[:, :, None], float("-inf"))
    return rows, keys, scores


class _Window(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, real: Tensor, is_causal: bool,
        scale: float, sizes: tuple[int, int, int],
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        out, lse = window_softmax(q, k, v, key_padding_mask, is_causal, scale, *sizes[:2])
        ctx.save_for_backward(q, k, v, real, out, lse)
        ctx.args = (is_causal, scale, sizes)
        return out, lse

    @staticmethod
    def backward(ctx: Any, d_out: Tensor | None, d_lse: Tensor | None) -> tuple:
        q, k, v, real, out, lse = ctx.saved_tensors
        (is_causal, scale, (w, s, block)), work = ctx.args, out.dtype
        (B, H, L, _), (Hk, S) = q.shape, k.shape[1:3]
        qw, kw, vw = (x.to(work) for x in (q, k, v))
        dq, dk, dv = (torch.zeros_like(x) for x in (qw, kw, vw))
        d_out = torch.zeros_like(out) if d_out is None else d_out.to(work)
        delta = (d_out * out).sum(-1, keepdim=True)  # rowsum(dO ⊙ O) − d_lse
        delta = delta if d_lse is None else delta - torch.where(torch.isfinite(lse), d_lse.to(work), 0.0)
        shift = torch.where(torch.isfinite(lse), lse, 0.0)  # a row that sees no key: weights exp(−inf) = 0
        for span in _blocks(L, S, S - L, real, is_causal, w, s, block):
            a, b, sink, lo, hi = span[:5]
            rows, keys, scores = _scores(qw, kw, span, scale)
            values = torch.cat([vw.index_select(2, sink), vw[:, :, lo:hi]], dim=2)
            shifts, grads, deltas = (x[:, :, a:b].reshape(B, Hk, -1, x.shape[-1]) for x in (shift, d_out, delta))
            weights = scores.sub_(shifts).exp_()
            d_scores = (grads @ values.transpose(-1, -2)).sub_(deltas).mul_(weights)
            dq[:, :, a:b] = (d_scores @ keys).mul_(scale).view(B, H, b - a, -1)
            for grad, block_grad in ((dk, d_scores.transpose(-1, -2) @ rows), (dv, weights.transpose(-1, -2) @ grads)):
                grad[:, :, lo:hi] += block_grad[:, :, len(sink) :]
                grad.index_add_(2, sink, block_grad[:, :, : len(sink)])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def window_part(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, real: Tensor, is_causal: bool, scale: float,
    w: int, s: int, block: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The sinks-and-window softmax of queries ``q`` ``(B, H, L, D)`` at key positions ``S − L …`` over
    keys ``k`` and values ``v`` of the key/value heads (``real``: the keys' padding mask ``(B, S)``,
    True where ``key_padding_mask`` is None): its output ``(B, H, L, Dv)`` and log-sum-exp
    ``(B, H, L, 1)`` (−inf where a query sees no key), in the work dtype, both with gradients (the backward
    in blocks of ``block`` queries)."""
    return _Window.apply(q, k, v, key_padding_mask, real, is_causal, scale, (w, s, block))

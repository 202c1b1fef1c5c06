"""Exact softmax attention over tiles: groups of queries that share a set of keys.

Local and routing attention both reduce to this. A tile lists up to ``Tq`` query positions and up
to ``Tk`` key positions (``-1`` marks an empty slot); each query sits in at most one tile and
attends to the tile's keys that a positional rule allows, plus, optionally, its own position's key.
The rule is a band on ``d = key position - (query position + offset)``: ``lo <= d <= hi``, where
``offset = S - L`` aligns the last query with the last key (bottom-right, as causal attention
does). Padded keys never receive weight; a query with no visible key returns zeros.

``tile_attention`` is one autograd Function that computes tiles a group at a time, so memory
holds one group's gathered keys and scores, never one per tile at once. Like flash attention it
saves only its inputs, the output and each query's log-sum-exp; the backward recomputes the
scores group by group. Scores, softmax statistics and sums are fp32 for fp16/bf16 inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Band", "tile_attention"]

_GROUP_ELEMENTS = 1 << 22  # score entries computed at once (about 16 MB in fp32)


@dataclass(frozen=True, eq=False)
class Band:
    """Which tile keys a query sees: ``lo <= key - (query + offset) <= hi`` (None: unbounded);
    with ``own_key`` the query's own position is left out of the tile keys and added as an extra
    key it always sees (when that key is real). ``relative``, a bool ``(Tq, Tk)`` matrix, replaces
    ``lo``/``hi`` when every tile has the same layout relative to its queries (local windows): slot
    ``(a, b)`` is visible when ``relative[a, b]``."""

    lo: int | None = None
    hi: int | None = None
    own_key: bool = False
    relative: Tensor | None = None


def tile_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_index: Tensor,
    k_index: Tensor,
    band: Band,
    scale: float,
    key_valid: Tensor | None = None,
) -> Tensor:
    """Softmax attention of each tile's queries to its keys.

    Args:
        q, k, v: ``(R, L, D)``, ``(R, S, D)``, ``(R, S, Dv)`` (rows are batch × heads).
        q_index: ``(R, T, Tq)`` query positions per tile, ``-1`` for an empty slot; a position
            appears at most once per row.
        k_index: ``(R, T, Tk)`` key positions per tile, ``-1`` for an empty slot.
        band: the positional rule.
        scale: the softmax scale.
        key_valid: bool ``(R, S)``, False for padded keys.

    Returns:
        ``(R, L, Dv)``; zeros for queries in no tile or with no visible key.
    """
    return _TileAttention.apply(q, k, v, q_index, k_index, key_valid, band, scale)


def _take(x: Tensor, index: Tensor) -> Tensor:
    """Rows ``x[r, index[r, ...]]`` of ``x`` ``(R, N, D)`` for ``index`` ``(R, ...)``, as ``(R, ..., D)``."""
    R, N, D = x.shape
    flat = (index + torch.arange(R, device=index.device).view(R, *([1] * (index.dim() - 1))) * N).flatten()
    return x.reshape(R * N, D).index_select(0, flat).view(*index.shape, D)


class _Gathered:
    """One group of tiles: gathered rows, positions and the visibility mask."""

    def __init__(self, q, k, v, q_index, k_index, key_valid, band: Band, work: torch.dtype) -> None:
        R, L, S = q.shape[0], q.shape[1], k.shape[1]
        offset = S - L
        self.q_ok = q_index >= 0
        self.qi = q_index.clamp(min=0)
        self.ki = ki = k_index.clamp(min=0)
        self.q = _take(q, self.qi).to(work)  # (R, g, Tq, D)
        self.k = _take(k, ki).to(work)  # (R, g, Tk, D)
        self.v = _take(v, ki).to(work)
        k_ok = k_index >= 0
        if key_valid is not None:
            k_ok = k_ok & torch.gather(key_valid, 1, ki.view(R, -1)).view(ki.shape)
        # Hidden slots as broadcastable masks: padded or empty keys (R, g, 1, Tk), and the band;
        # a relative band enters the score product as an additive 0 / -inf bias.
        self.hidden = [] if bool(k_ok.all()) else [~k_ok.unsqueeze(-2)]
        self.bias = None
        if band.relative is not None:
            self.bias = torch.zeros(band.relative.shape, dtype=work, device=q.device)
            self.bias.masked_fill_(~band.relative, -torch.inf)
        elif band.lo is not None or band.hi is not None or band.own_key:
            # The band depends on positions only: compute it once when every row has the same tiles.
            shared = q_index.stride(0) == 0 and k_index.stride(0) == 0
            qi_, ki_ = (self.qi[:1], ki[:1]) if shared else (self.qi, ki)
            key_pos, query_pos = ki_.unsqueeze(-2), (qi_ + offset).unsqueeze(-1)
            hidden = None
            for far in (
                None if band.lo is None else key_pos < query_pos + band.lo,
                None if band.hi is None else key_pos > query_pos + band.hi,
                key_pos == query_pos if band.own_key else None,
            ):
                if far is not None:
                    hidden = far if hidden is None else hidden.logical_or_(far)
            self.hidden.append(hidden)
        self.own = None
        if band.own_key:
            own = (self.qi + offset).clamp(0, S - 1)
            own_ok = self.q_ok & (self.qi + offset >= 0)
            if key_valid is not None:
                own_ok = own_ok & torch.gather(key_valid, 1, own.view(R, -1)).view(own.shape)
            self.own, self.own_ok = own, own_ok
            self.k_own = _take(k, own).to(work)  # (R, g, Tq, D)
            self.v_own = _take(v, own).to(work)

    def scores(self, scale: float) -> tuple[Tensor, Tensor | None]:
        """Masked scores ``(R, g, Tq, Tk)`` and the own-key scores ``(R, g, Tq)`` (-inf where hidden)."""
        if self.bias is None:
            s = torch.matmul(self.q, self.k.transpose(-1, -2)).mul_(scale)
        else:  # bias + scale · q kᵀ in one product
            q, k = self.q.flatten(0, 1), self.k.flatten(0, 1)
            s = torch.baddbmm(self.bias, q, k.transpose(-1, -2), alpha=scale).view(*self.q.shape[:-1], -1)
        for hidden in self.hidden:
            s.masked_fill_(hidden, -torch.inf)
        s_own = None
        if self.own is not None:
            s_own = (self.q * self.k_own).sum(-1).mul_(scale).masked_fill_(~self.own_ok, -torch.inf)
        return s, s_own


def _groups(T: int, per_tile: int, R: int) -> range:
    return range(0, T, max(1, _GROUP_ELEMENTS // max(1, R * per_tile)))


class _TileAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_index, k_index, key_valid, band: Band, scale: float) -> Tensor:  # type: ignore[override]
        R, L, _ = q.shape
        T, Tq = q_index.shape[1:]
        Tk = k_index.shape[2]
        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        out = q.new_zeros(R, L, v.shape[-1])
        lse = q.new_full((R, L), -torch.inf, dtype=work)
        step = _groups(T, Tq * Tk, R).step
        rows = torch.arange(R, device=q.device).view(R, 1, 1)
        for start in range(0, T, step):
            tiles = slice(start, start + step)
            g = _Gathered(q, k, v, q_index[:, tiles], k_index[:, tiles], key_valid, band, work)
            s, s_own = g.scores(scale)
            m = s.amax(-1) if s_own is None else torch.maximum(s.amax(-1), s_own)
            m = torch.where(torch.isfinite(m), m, 0.0)
            p = s.sub_(m.unsqueeze(-1)).exp_()
            o = torch.matmul(p, g.v)
            total = p.sum(-1)
            if s_own is not None:
                p_own = torch.exp(s_own - m)
                o += p_own.unsqueeze(-1) * g.v_own
                total += p_own
            o = o / torch.where(total > 0, total, 1.0).unsqueeze(-1)
            ok = g.q_ok
            out[rows.expand_as(g.qi)[ok], g.qi[ok]] = o[ok].to(out.dtype)
            lse[rows.expand_as(g.qi)[ok], g.qi[ok]] = (m + total.log())[ok]
        ctx.save_for_backward(q, k, v, q_index, k_index, key_valid, out, lse)
        ctx.band, ctx.scale, ctx.step, ctx.work = band, scale, step, work
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        q, k, v, q_index, k_index, key_valid, out, lse = ctx.saved_tensors
        band, scale, step, work = ctx.band, ctx.scale, ctx.step, ctx.work
        R, L, D = q.shape
        S, Dv = k.shape[1], v.shape[2]
        T = q_index.shape[1]
        grad_q = torch.zeros(R, L, D, dtype=work, device=q.device)
        grad_k = torch.zeros(R * S, D, dtype=work, device=q.device)
        grad_v = torch.zeros(R * S, Dv, dtype=work, device=q.device)
        rows = torch.arange(R, device=q.device).view(R, 1, 1)
        lse_safe = torch.where(torch.isfinite(lse), lse, 0.0)
        for start in range(0, T, step):
            tiles = slice(start, start + step)
            g = _Gathered(q, k, v, q_index[:, tiles], k_index[:, tiles], key_valid, band, work)
            s, s_own = g.scores(scale)
            row_lse = torch.gather(lse_safe, 1, g.qi.view(R, -1)).view(g.qi.shape)  # (R, g, Tq)
            p = s.sub_(row_lse.unsqueeze(-1)).exp_()  # zero where hidden
            go = _take(grad, g.qi).to(work) * g.q_ok.unsqueeze(-1)
            delta = (go * _take(out, g.qi).to(work)).sum(-1, keepdim=True)  # (R, g, Tq, 1)
            flat_k = (rows * S + g.ki).flatten()
            grad_v.index_add_(0, flat_k, torch.matmul(p.transpose(-1, -2), go).flatten(0, 2))
            ds = p.mul_(torch.matmul(go, g.v.transpose(-1, -2)).sub_(delta)).mul_(scale)
            gq = torch.matmul(ds, g.k)
            grad_k.index_add_(0, flat_k, torch.matmul(ds.transpose(-1, -2), g.q).flatten(0, 2))
            if s_own is not None:
                p_own = torch.exp(s_own - row_lse).unsqueeze(-1)  # (R, g, Tq, 1)
                flat_own = (rows * S + g.own).flatten()
                grad_v.index_add_(0, flat_own, (p_own * go).flatten(0, 2))
                ds_own = p_own * ((go * g.v_own).sum(-1, keepdim=True) - delta) * scale
                gq += ds_own * g.k_own
                grad_k.index_add_(0, flat_own, (ds_own * g.q).flatten(0, 2))
            ok = g.q_ok
            grad_q[rows.expand_as(g.qi)[ok], g.qi[ok]] = gq[ok]
        return (
            grad_q.to(q.dtype),
            grad_k.view(R, S, D).to(k.dtype),
            grad_v.view(R, S, Dv).to(v.dtype),
            None,
            None,
            None,
            None,
            None,
        )

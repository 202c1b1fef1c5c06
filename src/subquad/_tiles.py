"""Exact softmax attention over tiles: groups of queries that share a set of keys.

Routing attention reduces to this: its tiles are gathered by cluster, per (batch, head) row. (A
regular band such as a sliding window is cheaper through ``mechanisms._blocksparse``.) A tile
lists up to ``Tq`` query positions and up to ``Tk`` key positions (``-1`` marks an empty slot);
each query sits in at most one tile and attends to the tile's keys that a positional rule allows.
The rule is a band on ``d = key position - (query position + offset)``: ``lo <= d <= hi``, where
``offset = S - L`` aligns the last query with the last key (bottom-right, as causal attention
does). Optionally the last ``Tq`` key slots of a tile hold its queries' own positions, each seen
only by its own query (routing uses this so that every query sees at least its own key). Padded
keys never receive weight; a query with no visible key returns zeros.

``tile_attention`` is one autograd Function that computes tiles a group at a time, so memory
holds one group's gathered keys and scores, never one per tile at once. The forward runs each
group through torch's CPU flash-attention kernel where it exists (the hidden slots as an additive
mask), else an eager softmax; it saves only its inputs and the output, and the backward recomputes
each group's softmax. Scores and softmax are fp32 for fp16/bf16 inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Band", "tile_attention"]

_GROUP_ELEMENTS = 1 << 22  # score entries computed at once (about 16 MB in fp32)


@dataclass(frozen=True)
class Band:
    """Which tile keys a query sees: ``lo <= key - (query + offset) <= hi`` (None: unbounded).

    With ``own_slots`` the last ``Tq`` key slots of each tile are the tile's queries' own
    positions: a query sees only its own there, and the other slots hide its position so that it
    counts once.
    """

    lo: int | None = None
    hi: int | None = None
    own_slots: bool = False


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
    """One group of tiles: gathered rows and the hidden slots."""

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
        # Hidden slots, as one mask broadcastable to (R, g, Tq, Tk): empty or padded keys, and the band.
        self.hidden = [] if bool(k_ok.all()) else [~k_ok.unsqueeze(-2)]
        if band.lo is not None or band.hi is not None or band.own_slots:
            Tq = self.q.shape[2]
            key_pos, query_pos = ki.unsqueeze(-2), (self.qi + offset).unsqueeze(-1)  # (R, g, 1, Tk), (R, g, Tq, 1)
            if band.own_slots:  # tile slots hide the query's own position; own slot b serves query b
                key_pos = key_pos[..., :-Tq]
            lo, hi = band.lo, band.hi
            if band.own_slots and hi == 0:
                hi = -1  # d <= 0 and d != 0 in one comparison
            parts = []
            if lo is not None:
                parts.append(key_pos < query_pos + lo)
            if hi is not None:
                parts.append(key_pos > query_pos + hi)
            if band.own_slots and band.hi != 0:
                parts.append(key_pos == query_pos)
            hidden = (
                parts[0] if parts else torch.zeros_like(key_pos.expand(*query_pos.shape[:-1], -1), dtype=torch.bool)
            )
            for part in parts[1:]:
                hidden = hidden | part
            if band.own_slots:
                own = ~torch.eye(Tq, dtype=torch.bool, device=q.device)
                hidden = torch.cat([hidden, own.expand(*hidden.shape[:-1], Tq)], dim=-1)
            if self.hidden:  # one pass over the scores: fold the empty and padded slots in
                hidden = hidden | self.hidden.pop()
            self.hidden.append(hidden)

    def fused_output(self, scale: float) -> Tensor:
        """The attention output ``(R, g, Tq, Dv)`` through torch's CPU flash-attention kernel, with the
        hidden slots as an additive mask (zero rows where none is visible, as the kernel returns)."""
        R, g, Tq, D = self.q.shape
        Tk = self.k.shape[2]
        mask = torch.zeros(R, g, Tq, Tk, dtype=self.q.dtype, device=self.q.device)
        for hidden in self.hidden:
            mask.masked_fill_(hidden, -torch.inf)
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            self.q.view(R * g, 1, Tq, D), self.k.view(R * g, 1, Tk, D), self.v.view(R * g, 1, Tk, -1),
            attn_mask=mask.view(R * g, 1, Tq, Tk), scale=scale,
        )  # fmt: skip
        return out.view(R, g, Tq, -1)

    def probabilities(self, scale: float) -> Tensor:
        """Softmax weights ``(R, g, Tq, Tk)`` over the visible slots; zero rows where none is."""
        s = torch.matmul(self.q, self.k.transpose(-1, -2)).mul_(scale)
        for hidden in self.hidden:
            s.masked_fill_(hidden, -torch.inf)
        blind = s.amax(-1, keepdim=True) == -torch.inf  # rows that see no key: softmax gives NaN
        p = torch.softmax(s, dim=-1)
        return p.masked_fill_(blind, 0.0) if bool(blind.any()) else p


def _fused_available(q: Tensor, v: Tensor) -> bool:
    """Whether torch's CPU flash-attention kernel can run the forward (it needs Dv = D)."""
    return (
        q.device.type == "cpu"
        and q.shape[-1] == v.shape[-1]
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    )


def _groups(T: int, per_tile: int, R: int) -> int:
    return max(1, _GROUP_ELEMENTS // max(1, R * per_tile))


class _TileAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_index, k_index, key_valid, band: Band, scale: float) -> Tensor:  # type: ignore[override]
        R, L, _ = q.shape
        T, Tq = q_index.shape[1:]
        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        out = q.new_zeros(R, L, v.shape[-1])
        step = _groups(T, Tq * k_index.shape[2], R)
        rows = torch.arange(R, device=q.device).view(R, 1, 1)
        fused = _fused_available(q, v)
        for start in range(0, T, step):
            tiles = slice(start, start + step)
            g = _Gathered(q, k, v, q_index[:, tiles], k_index[:, tiles], key_valid, band, work)
            o = g.fused_output(scale) if fused else torch.matmul(g.probabilities(scale), g.v)
            ok = g.q_ok
            out[rows.expand_as(g.qi)[ok], g.qi[ok]] = o[ok].to(out.dtype)
        ctx.save_for_backward(q, k, v, q_index, k_index, key_valid, out)
        ctx.band, ctx.scale, ctx.step, ctx.work = band, scale, step, work
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        q, k, v, q_index, k_index, key_valid, out = ctx.saved_tensors
        band, scale, step, work = ctx.band, ctx.scale, ctx.step, ctx.work
        R, L, D = q.shape
        S, Dv = k.shape[1], v.shape[2]
        T = q_index.shape[1]
        grad_q = torch.zeros(R, L, D, dtype=work, device=q.device)
        grad_k = torch.zeros(R * S, D, dtype=work, device=q.device)
        grad_v = torch.zeros(R * S, Dv, dtype=work, device=q.device)
        rows = torch.arange(R, device=q.device).view(R, 1, 1)
        for start in range(0, T, step):
            tiles = slice(start, start + step)
            g = _Gathered(q, k, v, q_index[:, tiles], k_index[:, tiles], key_valid, band, work)
            p = g.probabilities(scale)
            go = _take(grad, g.qi).to(work) * g.q_ok.unsqueeze(-1)
            delta = (go * _take(out, g.qi).to(work)).sum(-1, keepdim=True)  # (R, g, Tq, 1)
            flat_k = (rows * S + g.ki).flatten()
            grad_v.index_add_(0, flat_k, torch.matmul(p.transpose(-1, -2), go).flatten(0, 2))
            ds = p.mul_(torch.matmul(go, g.v.transpose(-1, -2)).sub_(delta)).mul_(scale)
            grad_k.index_add_(0, flat_k, torch.matmul(ds.transpose(-1, -2), g.q).flatten(0, 2))
            ok = g.q_ok
            grad_q[rows.expand_as(g.qi)[ok], g.qi[ok]] = torch.matmul(ds, g.k)[ok]
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

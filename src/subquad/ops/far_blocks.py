"""The computation behind ``retrieval`` (``mechanisms.retrieval``): each block's bounds, and the
output of a chunk of queries over their sinks, window and own far blocks in one softmax.

``block_bounds``: the elementwise min and max of each block's counted keys (real, not sinks), from
which Quest's bound ranks the blocks. ``retrieval_chunk``: a chunk of queries' sinks and windows'
key range scored together, each query's far blocks gathered whole and scored on their own (so one
query's arithmetic never depends on what the others chose), the parts merged in one softmax.
``one_query``: decoding's step for one new query per row, the same choice and softmax in one call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from subquad.kernels.softmax import work_dtype
from subquad.registry import Config

__all__ = ["block_bounds", "one_query", "retrieval_chunk"]


def block_bounds(kb: Tensor, counted: Tensor) -> tuple[Tensor, Tensor]:
    """Each block's elementwise min and max ``(B, H, n, D)`` over its counted keys (zero for a
    block without one, which is never eligible)."""
    held = counted[:, None, :, :, None]
    low = kb.masked_fill(~held, float("inf")).amin(3)
    high = kb.masked_fill(~held, float("-inf")).amax(3)
    empty = ~held.any(3)
    return low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)


def retrieval_chunk(
    q: Tensor, k: Tensor, v: Tensor, real: Tensor, counted: Tensor, low: Tensor, high: Tensor, first: int,
    is_causal: bool, scale: float, config: Config,
) -> Tensor:  # fmt: skip
    """The output ``(B, H, c, Dv)`` of c queries at key positions ``first …``: their sinks, their
    windows' key range and the union of the far blocks they chose, each query masked to its own.
    ``k``, ``v``: the key/value heads; only the sinks and the window's range are repeated to the
    query heads."""
    c, S, w, s = q.shape[2], k.shape[2], config.window, config.sinks
    p = torch.arange(first, first + c, device=q.device)
    lo = min(S, max(0, first - w + 1))
    hi = max(lo, min(S, first + c if is_causal else first + c - 1 + w))  # queries may lie before the keys
    near = torch.arange(lo, hi, device=q.device)
    sink = torch.cat([torch.arange(min(s, lo), device=q.device), torch.arange(hi, min(S, max(s, hi)), device=q.device)])
    chosen = _chosen(q, low, high, counted, p, is_causal, config)  # each query's far blocks
    per = q.shape[1] // k.shape[1]
    keys, values = (torch.cat([x.index_select(2, sink), x[:, :, lo:hi]], dim=2).repeat_interleave(per, dim=1)
                    for x in (k, v))  # fmt: skip
    seen = torch.cat([_seen(sink, p, real, is_causal, w, s, False), _seen(near, p, real, is_causal, w, s, True)], -1)
    return _merge(_part(q, keys, values, seen, scale), _far(q, k, v, counted, *chosen, scale)).to(q.dtype)


def _part(q: Tensor, k: Tensor, v: Tensor, seen: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """One part of a softmax: the largest seen score (-inf: none), the sum of exp(score − it) and
    the values weighted by those exponentials (no log: a part without keys keeps finite gradients)."""
    work = work_dtype(q.dtype)
    if not k.shape[-2]:  # no key in reach (queries before every key)
        top = q.new_full((*q.shape[:-1], 1), float("-inf"), dtype=work)
        return top, torch.zeros_like(top), q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=work)
    scores = torch.matmul(q.to(work) * scale, k.to(work).transpose(-1, -2)).masked_fill(~seen, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - torch.where(torch.isfinite(top), top, 0.0))
    return top, weights.sum(-1, keepdim=True), weights @ v.to(work)


def _merge(*parts: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """One softmax over the union of disjoint parts (``_part``), rescaled to their common maximum."""
    top = torch.stack([t for t, _, _ in parts]).amax(0)
    top = torch.where(torch.isfinite(top), top, 0.0)
    total = sum(s * torch.exp(t - top) for t, s, _ in parts)
    out = sum(o * torch.exp(t - top) for t, _, o in parts)
    return out / torch.where(total > 0, total, 1.0)


def _far(q: Tensor, k: Tensor, v: Tensor, counted: Tensor, index: Tensor, ok: Tensor, scale: float):
    """The far part (``_part``) of each query: its own blocks ``index`` ``(B, H / shared, c,
    blocks)``, read whole from the key/value heads ``k``, ``v``, so that what one query computes
    never depends on what the others chose. The heads of a group read one gathered copy where
    they share a key/value head."""
    B, H, c, D = q.shape
    groups, per, size = index.shape[1], H // k.shape[1], counted.shape[-1]
    shared = H // groups
    if per % shared:  # a group spans key/value heads: each head gathers its own
        index, ok, shared = index.repeat_interleave(shared, dim=1), ok.repeat_interleave(shared, dim=1), 1
    units = H // shared
    rows = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    source = (torch.arange(units, device=q.device) * shared // per).view(1, units, 1, 1)
    at = (index[..., None] * size + torch.arange(size, device=q.device)).flatten(-2)  # (B, U, c, F) positions
    seen = ok.repeat_interleave(size, dim=-1) & counted.flatten(1)[rows, at]
    keys, values = (x[rows, source, at.clamp_max(x.shape[2] - 1)] for x in (k, v))  # (B, U, c, F, ·)
    grouped = q.view(B, units, shared, c, D).transpose(2, 3)  # (B, U, c, shared, D)
    parts = _part(grouped, keys, values, seen.unsqueeze(-2), scale)
    return tuple(x.transpose(2, 3).reshape(B, H, c, -1) for x in parts)


def _seen(keys: Tensor, p: Tensor, real: Tensor, is_causal: bool, w: int, s: int, window: bool) -> Tensor:
    """``(B, 1, c, n)``: which of the positions ``keys`` the queries at ``p`` see as window or sinks."""
    j, at = keys[None, :], p[:, None]
    near = (at - j < w) & (j - at < w) if window else torch.zeros_like(j - at, dtype=torch.bool)
    seen = near | (j < s)
    if is_causal:
        seen = seen & (j <= at)
    return (seen[None] & real[:, None, keys])[:, None]


def _chosen(
    q: Tensor, low: Tensor, high: Tensor, counted: Tensor, p: Tensor, is_causal: bool, config: Config
) -> tuple[Tensor, Tensor]:
    """``(B, H, c, blocks)``: each query's far blocks, the eligible ones of highest bound, and
    whether each is one (fewer are eligible than ``blocks``)."""
    n, size, w = low.shape[2], counted.shape[-1], config.window
    start = torch.arange(n, device=q.device) * size
    outside = (start + size - 1)[None] <= p[:, None] - w  # (c, n): the whole block older than the window
    if not is_causal:
        outside = outside | (start[None] >= p[:, None] + w)
    eligible = outside[None, None] & counted.any(-1)[:, None, None]
    q = q.detach()
    bound = q.clamp_min(0) @ high.transpose(-1, -2) - (-q).clamp_min(0) @ low.transpose(-1, -2)
    if config.shared > 1:  # a group ranks blocks by its heads' bounds summed
        bound = bound.view(bound.shape[0], -1, config.shared, *bound.shape[2:]).sum(2)
    top, index = bound.masked_fill(~eligible, float("-inf")).topk(min(config.blocks, n), dim=-1, sorted=False)
    return index, torch.isfinite(top)


def one_query(
    q: Tensor, k: Tensor, v: Tensor, low: Tensor, high: Tensor, scale: float | None, config: Config
) -> Tensor:
    """Decoding's step: the output ``(B, H, 1, Dv)`` of each row's last query (at p = S − 1) over its
    keys ``k``, ``v`` ``(B, Hk, S, ·)`` (no padding), given the bounds ``low``, ``high`` ``(B, Hk,
    S // block, D)`` of its whole blocks: ``retrieval_chunk``'s choice of blocks (the eligible ones
    of highest bound) and its softmax over the sinks, the window and those blocks, as one sdpa call
    on a few dozen operations where the general chunk takes about eighty."""
    B, H = q.shape[:2]
    Hk, S = k.shape[1], k.shape[2]
    per, size, w, s, work = H // Hk, config.block, config.window, config.sinks, work_dtype(q.dtype)
    lo = max(0, S - w)  # the window: keys lo … S − 1; the sinks before it
    keys, values = ([torch.cat([x[:, :, : min(s, lo)], x[:, :, lo:]], dim=2).repeat_interleave(per, dim=1)]
                    for x in (k, v))  # fmt: skip
    mask = None
    e, first = max(0, S - w) // size, s // size  # blocks [first, e): wholly before the window, not sinks only
    if e > first:
        high, low = (x[:, :, first:e].repeat_interleave(per, dim=1) for x in (high, low))
        bound = q.clamp_min(0) @ high.transpose(-1, -2) - (-q).clamp_min(0) @ low.transpose(-1, -2)  # (B, H, 1, n)
        shared = config.shared if per % config.shared == 0 else 1  # a group within one key/value head, or heads alone
        if config.shared > 1:
            bound = bound.view(B, H // config.shared, config.shared, -1).sum(2)
            bound = bound.repeat_interleave(config.shared // shared, dim=1)
        index = bound.view(B, H // shared, -1).topk(min(config.blocks, e - first), dim=-1, sorted=False).indices
        index = index + first  # (B, U, chosen)
        units = H // shared
        rows = torch.arange(B, device=q.device).view(B, 1, 1)
        source = (torch.arange(units, device=q.device) * shared // per).view(1, units, 1)
        for parts, x in ((keys, k), (values, v)):
            blocks = x[:, :, : e * size].view(B, Hk, e, size, x.shape[-1])[
                rows, source, index
            ]  # (B, U, chosen, size, ·)
            parts.append(blocks.flatten(2, 3).repeat_interleave(shared, dim=1))
        if s % size:  # the first block holds sinks, which the window part has counted
            at = (index[..., None] * size + torch.arange(size, device=q.device)).flatten(2) >= s
            near = torch.ones(B, H, keys[0].shape[2], dtype=torch.bool, device=q.device)
            mask = torch.cat([near, at.repeat_interleave(shared, dim=1)], dim=2)[:, :, None]
    keys, values = (torch.cat(parts, dim=2).to(work) for parts in (keys, values))
    out = torch.nn.functional.scaled_dot_product_attention(q.to(work), keys, values, attn_mask=mask, scale=scale)
    return out.to(q.dtype)

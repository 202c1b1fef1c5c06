"""Decoding's step for ``retrieval`` (``mechanisms.retrieval``'s ``RetrievalCache``): one new query
per row over its cached keys, the same choice of far blocks and the same softmax as the parallel
pass (``ops.far_blocks``), on a few dozen operations. Where the cache is short, every key is read
in place under the mask of those the query sees (one sdpa call); else each unit's sinks, window and
chosen blocks are gathered in one call a tensor.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from subquad.kernels.memory import kept_buffer
from subquad.kernels.softmax import work_dtype
from subquad.kernels.tuning import TUNING
from subquad.ops.far_all import every_block
from subquad.ops.far_blocks import lola, quest_bound
from subquad.ops.windowed_linear import phi
from subquad.registry import Config

if TYPE_CHECKING:
    from torch import nn

__all__ = ["one_query"]


def one_query(
    q: Tensor, k: Tensor, v: Tensor, bounds: Tensor, scale: float | None, config: Config,
    kernel: tuple[nn.Module | None, Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """Decoding's step: the output ``(B, H, 1, Dv)`` of each row's last query (at p = S − 1) over its
    keys ``k``, ``v`` ``(B, Hk, S, ·)`` (no padding), given the bounds ``[high, low]`` ``(B, Hk,
    S // block, 2D)`` of its whole blocks: ``retrieval_chunk``'s choice of blocks (the eligible ones
    of highest bound) and its softmax over the sinks, the window and those blocks. Each unit's keys
    (the sinks, the window, then its chosen blocks) are gathered in one call a tensor for all rows
    and units (``_gathered``) and read by the unit's query heads together in one softmax: a
    handful of operations a step, whose fixed cost is what a step costs at these sizes.
    ``kernel`` (a feature map): hedgehog's state or None, and the sums ``Σ φ(k) [v, 1]ᵀ``
    ``(B, H, F, Dv + 1)`` over the keys beyond the window, less sinks; the chosen blocks' share is
    taken out (``lola``)."""
    B, H, _, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    per, size, w, s, work = H // Hk, config.block, config.window, config.sinks, work_dtype(q.dtype)
    lo = max(0, S - w)  # the window: keys lo … S − 1; the sinks before it
    if kernel is None:  # where every eligible block is taken, or none is eligible: one masked sdpa call
        taken = every_block(q, k, v, scale, config)
        if taken is not None:
            return taken.to(q.dtype)
    picked = _step_blocks(q, bounds, config, lo // size)
    m = S - lo + min(s, lo)  # the sinks' and the window's keys
    if picked is not None and kernel is None and _in_place(Hk, S, picked[0].shape[1] * (m + picked[0].shape[2] * size)):
        return _one_query_dense(q, k, v, *picked, scale, (w, s, size)).to(q.dtype)
    index, shared = picked if picked is not None else (None, per)  # no far block: a unit per key/value head
    units = H // shared
    tokens = torch.arange(lo - min(s, lo), S, device=q.device)  # the sinks, then the window: m keys
    if min(s, lo):
        tokens[: min(s, lo)] = torch.arange(min(s, lo), device=q.device)
    tokens = tokens.expand(B, units, m)
    if index is not None:  # then each unit's chosen blocks
        tokens = torch.cat([tokens, (index[..., None] * size + _offsets(size, q.device)).view(B, units, -1)], -1)
    named = ((k, "retrieval.keys"), (v, "retrieval.values"))  # the thread's kept buffers they are gathered into
    keys, values = (_gathered(x, tokens, per // shared, name).to(work) for x, name in named)  # (B, U, M, ·)
    mine = q.to(work).view(B, units, shared, D) * (D**-0.5 if scale is None else scale)
    scores = torch.matmul(mine, keys.transpose(-1, -2))  # (B, U, shared, M): one softmax over both parts
    chosen, sinks = None, None
    if index is not None and s % size:  # block s // size holds sinks, which the window part has counted
        first, taken = s // size, index == s // size  # (B, U, chosen): hidden where chosen
        part = scores[..., m:].view(B, units, shared, -1, size)[..., : s - first * size]
        part.masked_fill_(taken[:, :, None, :, None], float("-inf"))
        if kernel is not None:
            sinks = (taken[..., None] & (torch.arange(size, device=q.device) < s - first * size)).flatten(2)
    if index is not None and kernel is not None:  # the chosen keys and values by query head, and which count
        far = (keys[:, :, m:], values[:, :, m:], None if sinks is None else ~sinks)
        chosen = tuple(None if x is None else x.repeat_interleave(shared, dim=1) for x in far)
    out = torch.matmul(torch.softmax(scores, dim=-1), values).view(B, H, 1, -1)
    if kernel is not None:
        out = _one_query_kernel(q, out, chosen, config.feature_map, *kernel, max(0, S - w - s))
    return out.to(q.dtype)


def _gathered(x: Tensor, tokens: Tensor, g: int, name: str) -> Tensor:
    """Each unit's keys ``tokens`` ``(B, U, M)`` (positions) of ``x`` ``(B, Hk, S, F)``, ``(B, U, M, F)``
    (g: units per key/value head): the sinks, the window and the chosen blocks of all rows and
    units in one ``index_select`` over the storage of ``x`` read as rows of ``F`` (copied contiguous
    first where its tokens are not such rows), straight into ``kernels.memory.kept_buffer(name, …)``
    (on the CPU the thread's kept buffer, elsewhere or past ``TUNING.kept_buffer`` a fresh tensor):
    a fresh output of a few megabytes faults its pages in again at the steps where the heap has
    given them back (SmolLM2 at 8,192 tokens: 230 minor faults a token, 18 with the kept buffers)."""
    (B, units, M), F = tokens.shape, x.shape[-1]
    if not (x.stride(3) == 1 and x.stride(2) == F and all(n % F == 0 for n in (*x.stride()[:2], x.storage_offset()))):
        x = x.clone(memory_format=torch.contiguous_format)  # its own storage, from row 0
    rows = x.as_strided((x.untyped_storage().nbytes() // x.element_size() // F, F), (F, 1), 0)
    first = _first_rows(B, units, g, x.stride(0) // F, x.stride(1) // F, x.storage_offset() // F, x.device)
    out = kept_buffer(name, B * units * M * F, x.dtype, x.device).view(-1, F)
    torch.index_select(rows, 0, (tokens + first).view(-1), out=out)
    return out.view(B, units, M, F)


@functools.lru_cache(maxsize=64)
def _first_rows(B: int, units: int, g: int, row_stride: int, head_stride: int, offset: int, device) -> Tensor:
    """``_gathered``'s storage row of each row's units' key 0 ``(B, U, 1)`` (unit u reads key/value
    head u // g), in rows of the storage."""
    rows = torch.arange(B, device=device)[:, None] * row_stride
    return (rows + torch.arange(units, device=device)[None] // g * head_stride + offset)[..., None]


@functools.lru_cache(maxsize=16)
def _offsets(size: int, device) -> Tensor:
    """``0 … size − 1``: the positions within a block."""
    return torch.arange(size, device=device)


def _step_blocks(q: Tensor, bounds: Tensor, config: Config, e: int) -> tuple[Tensor, int] | None:
    """``one_query``'s choice: the blocks ``(B, U, chosen)`` of highest bound among ``[first, e)``
    (wholly before the window, not sinks only) for each unit of ``shared`` query heads (a group
    within one key/value head; else each head alone), or None where no block is eligible."""
    (B, H, _, D), Hk = q.shape, bounds.shape[1]
    per, first = H // Hk, config.sinks // config.block
    if e <= first:
        return None
    bound = quest_bound(q.view(B, Hk, per, D), bounds[:, :, first:e]).view(B, H, 1, -1)
    shared = config.shared if per % config.shared == 0 else 1
    if config.shared > 1:
        bound = bound.view(B, H // config.shared, config.shared, -1).sum(2)
        bound = bound.repeat_interleave(config.shared // shared, dim=1)
    index = bound.view(B, H // shared, -1).topk(min(config.blocks, e - first), dim=-1, sorted=False).indices
    return index + first, shared


def _in_place(Hk: int, S: int, gathered: int) -> bool:
    """Whether a step reads all its ``S`` keys per key/value head in place rather than gathering
    each unit's sinks, window and chosen blocks (``gathered``: their keys for all units of a row):
    for a short cache (``TUNING.retrieval_step_in_place``: a gather's fixed cost), or where the keys
    of all key/value heads number at most ``TUNING.retrieval_step_dense`` times those gathered
    (SmolLM2's steps in docs/performance.md)."""
    return S <= TUNING.retrieval_step_in_place or Hk * S <= TUNING.retrieval_step_dense * gathered


def _one_query_dense(
    q: Tensor, k: Tensor, v: Tensor, index: Tensor, shared: int, scale: float | None, sizes: tuple[int, int, int]
) -> Tensor:
    """``one_query``'s softmax as one sdpa call over all of each row's keys under the mask of those
    it sees (the sinks, the window, each unit's chosen blocks ``index`` ``(B, U, chosen)``): where the
    keys are few, reading them all in place costs less than gathering the chosen blocks."""
    B, S = q.shape[0], k.shape[2]
    w, s, size = sizes
    work = work_dtype(q.dtype)
    whole, units = S // size, index.shape[1]
    # sdpa's additive form, chosen blocks first (one scatter of block indices, then one copy to keys)
    blocks = torch.full((B, units, whole), float("-inf"), dtype=work, device=q.device).scatter_(2, index, 0.0)
    seen = torch.empty(B, units, S, dtype=work, device=q.device)
    seen[:, :, : whole * size].view(B, units, whole, size).copy_(blocks[..., None].expand(-1, -1, -1, size))
    seen[:, :, whole * size :] = float("-inf")
    seen[:, :, : min(s, S)] = 0
    seen[:, :, max(0, S - w) :] = 0
    mask = (seen if shared == 1 else seen.repeat_interleave(shared, dim=1))[:, :, None]
    k, v = (x.to(work) for x in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(
        q.to(work), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )


def _one_query_kernel(
    q: Tensor, out: Tensor, chosen: tuple[Tensor, Tensor, Tensor | None] | None, name: str, learned, sums: Tensor,
    far: int,
) -> Tensor:  # fmt: skip
    """``one_query``'s output with the kernel part: the sums over the ``far`` keys beyond the window,
    less the chosen blocks' keys ``chosen`` (keys, values ``(B, H, n, ·)``, and which count: not sinks)."""
    fq = phi(q, name, learned)  # (B, H, 1, F)
    beyond = torch.matmul(fq, sums)
    taken, total, held = torch.zeros_like(out), torch.zeros_like(out[..., :1]), 0
    if chosen is not None:
        fk = phi(chosen[0], name, learned)
        held = chosen[0].shape[2]
        if chosen[2] is not None:
            fk = fk * chosen[2][..., None].to(fk.dtype)
            held = chosen[2].sum(-1)[..., None, None]
        weights = torch.matmul(fq, fk.transpose(-1, -2))
        taken, total = torch.matmul(weights, chosen[1].to(weights.dtype)), weights.sum(-1, keepdim=True)
    left = torch.as_tensor(far, device=q.device) > torch.as_tensor(held, device=q.device)
    return lola(out, torch.ones_like(total), beyond, taken, total, left.expand_as(total))

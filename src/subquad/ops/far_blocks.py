"""The computation behind ``retrieval`` (``mechanisms.retrieval``): each block's bounds, and the
output of a chunk of queries over their sinks, window and own far blocks in one softmax.

``block_bounds``: the elementwise min and max of each block's counted keys (real, not sinks), from
which Quest's bound ranks the blocks. ``attend_rows``: the queries in chunks, each either
``retrieval_chunk`` (its sinks and windows, from ``window_softmax`` or ``near_window.window_part``,
and far blocks, ``_far``: the queries that chose a block scored together against it, each row
reading only its own query and block, merged in one softmax) or, where its keys are few
(``dense_rows``), ``_dense`` (every key up to its last query read in place under the mask of those
each query sees, one sdpa call). ``quest_bound``: the bound, shared with decoding's step
(``ops.far_step``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from subquad.kernels.band import window_softmax
from subquad.kernels.memory import kept_buffer
from subquad.kernels.softmax import work_dtype
from subquad.kernels.tuning import TUNING
from subquad.ops.far_segments import SegmentBuffers, per_query, segment_blocks, segments, whole_blocks
from subquad.ops.near_window import seen_keys, window_part
from subquad.ops.windowed_linear import beyond_window, phi, with_ones
from subquad.registry import Config

if TYPE_CHECKING:
    from torch import nn

__all__ = ["attend_rows", "block_bounds", "dense_rows", "kernel_inputs", "lola", "quest_bound", "retrieval_chunk"]

_CHUNK = 64  # positions per chunk of the kernel part's causal product (linear's default)
_SORTED_ROWS = 256  # rows from which ``largest`` picks its method by the row's length (fewer: topk)


def block_bounds(kb: Tensor, counted: Tensor) -> tuple[Tensor, Tensor]:
    """Each block's elementwise min and max ``(B, H, n, D)`` over its counted keys (zero for a
    block without one, which is never eligible): on the CPU over all its keys where all count, and
    recomputed over the counted ones in the few blocks that hold a sink or padding (without padding:
    those of the sinks); elsewhere, or with padding in many blocks, masked (no wait on the device)."""
    mixed = ~counted.all(-1)  # (B, n)
    if not kb.is_cpu or int(mixed.sum()) * 4 > mixed.numel():  # mask every block's keys
        held = counted[:, None, :, :, None]
        low, high = kb.masked_fill(~held, float("inf")).amin(3), kb.masked_fill(~held, float("-inf")).amax(3)
        empty = ~held.any(3)
        return low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)
    low, high = kb.amin(3), kb.amax(3)
    if bool(mixed.any()):
        b, n = mixed.nonzero(as_tuple=True)
        some = block_bounds(kb[b, :, n].unsqueeze(2), counted[b, n].unsqueeze(1))  # (P, H, 1, D) each
        low[b, :, n], high[b, :, n] = (x.squeeze(2) for x in some)
    return low, high


def attend_rows(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, real: Tensor, counted: Tensor, low: Tensor,
    high: Tensor, is_causal: bool, scale: float, config: Config, kernel: tuple | None, grad: bool, step: int,
) -> Tensor:  # fmt: skip
    """``retrieval``'s output ``(B, H, L, Dv)`` for queries at positions ``S − L …``: the leading
    ``dense_rows`` by ``_dense`` (causal, unpadded, L = S: the first ``window`` of them by one causal
    sdpa call), the others by ``retrieval_chunk`` in chunks of ``step`` rows, both checkpointed under
    autograd (``grad``). The sinks and windows of all rows past the lead come at once from the block
    engine (with autograd through ``near_window.window_part``), outside the checkpoints, as does each
    chunk's choice of blocks. Rows are split once (one gradient node, where a slice per chunk made
    each chunk's gradient a zero tensor of the whole). ``kernel``: ``kernel_inputs``, or None."""
    L, S = q.shape[2], k.shape[2]
    lead = 0  # rows read in place: on CPUs, where measured (``ops.far_all.every_block`` says why)
    if kernel is None and q.device.type == "cpu":
        lead = dense_rows(L, S, is_causal, config, counted.shape[-1], low.shape[2])
    near, w, s = None, config.window, config.sinks  # the sinks and windows of all rows past the lead at once
    if lead < L and S and grad:  # outside the checkpoints: it keeps only its inputs and results
        block = max(1, TUNING.retrieval_window_block)
        near = window_part(q[:, :, lead:], k, v, key_padding_mask, real, is_causal, scale, w, s, block)
    elif lead < L and S:
        near = window_softmax(q[:, :, lead:], k, v, key_padding_mask, is_causal, scale, w, s)
    k, v = (x.to(work_dtype(q.dtype)) for x in (k, v))  # half inputs: once per call, not per chunk
    outputs, run = [], lambda f, *args: checkpoint(f, *args, use_reentrant=False) if grad else f(*args)
    start = min(lead, config.window) if is_causal and key_padding_mask is None and L == S else 0
    if start:  # rows whose window holds every key up to them: plain causal attention (no mask, no ranking)
        rows, keys, values = (x[:, :, :start] for x in (q.to(k.dtype), k, v))
        out = torch.nn.functional.scaled_dot_product_attention(rows, keys, values, is_causal=True, scale=scale,
                                                               enable_gqa=True)  # fmt: skip
        outputs.append(out.to(q.dtype))
    widest = max(1, (lead + S - L) if is_causal else S)  # keys the last in-place row reads
    dense_step = max(1, TUNING.retrieval_gather // (3 * q.shape[0] * q.shape[1] * widest))  # its mask, thrice
    for a, rows in zip(range(start, lead, dense_step), q[:, :, start:lead].split(dense_step, dim=2)):
        outputs.append(run(_dense, rows, k, v, real, counted, low, high, a + S - L, is_causal, scale, config))
    if lead >= L:
        return torch.cat(outputs, dim=2)
    # the far part's segments gather from k and v as rows of whole blocks (one copy a call at most):
    # without autograd into kept buffers (far_segments); with it on the CPU by index_select (its
    # gradient one index_add); elsewhere by indexing (index_put's accumulation is deterministic)
    scratch = SegmentBuffers(whole_blocks(k, v, counted), kept=not grad) if not grad or k.is_cpu else None
    parts = [x[:, :, lead:].split(step, dim=2) for x in (q, *(kernel or ())[1:])]
    nears = [x.split(step, dim=2) for x in near] if near is not None else None
    for i, a in enumerate(range(lead, L, step)):
        chosen = _chosen(parts[0][i], low, high, counted, a + S - L, is_causal, config)  # no gradient to recompute
        args = (parts[0][i], k, v, counted, chosen, scale, max(1, TUNING.retrieval_rows))
        args += (None if kernel is None else (kernel[0], *(x[i] for x in parts[1:])),  # the keys' features whole
                 None if nears is None else tuple(x[i] for x in nears))  # fmt: skip
        outputs.append(run(retrieval_chunk, *args, scratch))
    return torch.cat(outputs, dim=2)


def dense_rows(L: int, S: int, is_causal: bool, config: Config, size: int, blocks: int) -> int:
    """How many of the queries (at positions ``S − L …``) read every key up to theirs in place
    (``_dense``): those whose keys number at most what their window and sinks hold plus
    ``TUNING.retrieval_dense`` times what their chosen blocks (of ``blocks``) hold (a key read in
    place costs about half one gathered into a segment); non-causal, every query reads all ``S``."""
    near = config.window * (1 if is_causal else 2) + config.sinks
    most = near + TUNING.retrieval_dense * min(config.blocks, blocks) * size  # keys a query may read in place
    if not is_causal:
        return L if S <= most else 0
    return max(0, min(L, most - (S - L)))  # query i reads i + S − L + 1 keys


def _dense(
    q: Tensor, k: Tensor, v: Tensor, real: Tensor, counted: Tensor, low: Tensor, high: Tensor, first: int,
    is_causal: bool, scale: float, config: Config,
) -> Tensor:  # fmt: skip
    """``retrieval_chunk``'s output without a kernel part where its queries' keys are few: each
    query's far blocks chosen as there (``_chosen``), then every key up to the chunk's last query
    read in place under sdpa's additive mask of the sinks, window and chosen blocks' counted keys
    it sees, built as the chosen blocks' counted keys, then the sinks' columns and the window's band
    set in place; a query that sees no key gets zeros (and a stand-in key, so nothing is NaN)."""
    H, c = q.shape[1], q.shape[2]
    if is_causal and first + c <= 0:  # queries before every key (L > S): they see none
        return q.new_zeros(*q.shape[:3], v.shape[-1])
    p = torch.arange(first, first + c, device=q.device)
    index, ok = _chosen(q, low, high, counted, first, is_causal, config)  # (B, U, c, chosen)
    n, work, inf = (first + c if is_causal else k.shape[2]), k.dtype, float("-inf")
    blocks = -(-n // counted.shape[-1])  # those holding the n keys: every chosen one (ok) lies among them
    zero = torch.zeros((), dtype=work, device=q.device)
    chosen = torch.full((*index.shape[:3], blocks), inf, dtype=work, device=q.device)  # those not ok: -inf anyway
    chosen.scatter_reduce_(-1, index.clamp(max=blocks - 1), torch.where(ok, zero, inf), "amax")
    held = torch.where(counted[:, :blocks], zero, inf)  # (B, blocks, size)
    bias = chosen.new_empty((*chosen.shape, held.shape[-1]))  # (B, U, c, blocks, size)
    if not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))):  # sdpa saves no mask: kept
        bias = kept_buffer("retrieval.dense", bias.numel(), work, q.device).view(bias.shape)
    bias = torch.add(chosen[..., None], held[:, None, None], out=bias).flatten(-2)[..., :n]  # the far blocks' keys
    w, s, lo = config.window, min(config.sinks, n), max(0, first - config.window + 1)  # then the sinks' columns
    spans = ((0, s), (lo, max(lo, min(n, first + c + (0 if is_causal else w - 1)))))  # and the window's band
    near = [seen_keys(torch.arange(*ab, device=q.device), p, real, is_causal, w, s, True) for ab in spans]
    for (a, b), seen in zip(spans, near):
        bias[..., a:b].masked_fill_(seen, 0.0)  # in place (queries may lie before the keys: an empty band)
    sees = near[0].any(-1) | near[1].any(-1) | ok.any(-1)  # or an eligible block holds a counted key
    bias[..., 0].masked_fill_(~sees, 0.0)  # (B, U, c): a row that sees nothing reads key 0, then is zeroed
    if bias.shape[1] != H:
        bias, sees = (x.repeat_interleave(H // x.shape[1], dim=1) for x in (bias, sees))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.to(work), k[:, :, :n], v[:, :, :n], attn_mask=bias, scale=scale, enable_gqa=True
    )
    return out.masked_fill(~sees[..., None], 0.0).to(q.dtype)


def retrieval_chunk(
    q: Tensor, k: Tensor, v: Tensor, counted: Tensor, chosen: tuple[Tensor, Tensor], scale: float, rows: int,
    kernel: tuple[Tensor, Tensor, Tensor, Tensor] | None = None, near: tuple[Tensor, Tensor] | None = None,
    scratch: SegmentBuffers | None = None,
) -> Tensor:  # fmt: skip
    """The output ``(B, H, c, Dv)`` of c queries: their sinks and windows and the far blocks each
    chose (``chosen``: ``_chosen``'s), by ``_far``, merged in one softmax. ``k``, ``v``: the
    key/value heads. ``rows``: ``TUNING.retrieval_rows`` as the forward read it (a checkpoint's
    recomputation must repeat the forward's work).

    ``kernel`` (a feature map): ``kernel_inputs``' for these queries (the keys' features whole): the
    chosen blocks' share of the kernel sums is taken out and the rest joins the softmax part under
    one normaliser (``lola``). ``near``: these queries' sinks-and-window softmax, output and
    log-sum-exp (``kernels.band.window_softmax``, or with gradients ``near_window.window_part``),
    computed for every query at once; None where there is no key. ``scratch``: ``_far``'s."""
    if near is None:  # no key: top −inf, sum 0, output 0
        top = q.new_full((*q.shape[:3], 1), float("-inf"), dtype=work_dtype(q.dtype))
        near = (top, torch.zeros_like(top), q.new_zeros((*q.shape[:3], v.shape[-1]), dtype=top.dtype))
    else:  # a normalised part: its log-sum-exp as the shift, a sum of 1 (0 where it sees no key)
        near = (near[1], torch.isfinite(near[1]).to(near[0].dtype), near[0])
    features = None if kernel is None else (kernel[1], kernel[0])
    far = _far(q, k, v, counted, *chosen, scale, rows, features, scratch)
    if kernel is None:
        return _merge(near, far).to(q.dtype)
    held = counted.sum(-1).gather(1, chosen[0].flatten(1)).view(chosen[0].shape) * chosen[1]  # each block's keys
    held = held.sum(-1, keepdim=True).repeat_interleave(q.shape[1] // chosen[0].shape[1], dim=1)
    return lola(*_merge(near, far[:3], mass=True), kernel[2], *far[3:], kernel[3] > held).to(q.dtype)


def lola(out: Tensor, mass: Tensor, beyond: Tensor, taken: Tensor, taken_total: Tensor, left: Tensor) -> Tensor:
    """Softmax output ``out`` of a query's exact keys (``mass``: 1 where they hold a real key, else 0)
    with kernel attention over its far keys no block brought, under one normaliser (``linear``'s
    window formula, LoLCATs): ``beyond`` ``(…, Dv + 1)`` the kernel sums ``Σ φ(q)·φ(k) [v, 1]`` over
    every key beyond the window, ``taken`` and ``taken_total`` those over the chosen blocks' keys,
    which the softmax part already holds: ``(m·o + N − N_T) / (m + Z − Z_T)``, zero for a query
    that sees no key. ``left`` ``(…, 1)``: whether any far key is left (counted, not inferred from the
    differences, whose rounding would otherwise remain where nothing is): where none is, the output
    is the softmax's exactly. Elsewhere the differences carry fp32 rounding of order ε·Z."""
    Dv = out.shape[-1]
    rest = torch.where(left, (beyond[..., Dv:] - taken_total).clamp_min(0), 0.0)  # Z − Z_T ≥ 0
    total = mass + rest
    return (mass * out + torch.where(left, beyond[..., :Dv] - taken, 0.0)) / torch.where(total > 0, total, 1.0)


def kernel_inputs(
    q: Tensor, k: Tensor, v: Tensor, real: Tensor, is_causal: bool, config: Config, learned: nn.Module | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The kernel part's inputs: the keys' features ``(B, H, S, F)`` (zero for sinks and padding:
    those are never in it), the queries' ``(B, H, L, F)``, each query's kernel sums over every key
    beyond its window ``(B, H, L, Dv + 1)`` and how many keys those are ``(B, 1, L, 1)``; grouped keys
    and values repeated to the query heads (a learned map is per query head)."""
    (L, S), w, per = (q.shape[2], k.shape[2]), config.window, q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(per, dim=1) for x in (k, v))
    fq, fk = phi(q, config.feature_map, learned), phi(k, config.feature_map, learned)
    keep = real.clone()
    keep[:, : config.sinks] = False
    fk = fk * keep[:, None, :, None].to(fk.dtype)
    beyond = beyond_window(fq, fk, with_ones(v, fk.dtype), w, is_causal, _CHUNK)
    before = torch.nn.functional.pad(keep.cumsum(1), (1, 0))  # (B, S + 1): kept keys before each position
    p = torch.arange(L, device=q.device) + S - L
    count = before[:, (p - w + 1).clamp(0, S)]  # keys j <= p - w
    if not is_causal:  # and j >= p + w
        count = count + before[:, S:] - before[:, (p + w).clamp(0, S)]
    return fk, fq, beyond, count[:, None, :, None]


def _merge(*parts: tuple[Tensor, Tensor, Tensor], mass: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """One softmax over the union of disjoint parts (each its largest score, the sum of exp(score −
    it) and the values so weighted), rescaled to their common maximum;
    with ``mass``, also whether it holds a real key (1 or 0)."""
    top = torch.stack([t for t, _, _ in parts]).amax(0)
    top = torch.where(torch.isfinite(top), top, 0.0)
    scales = [torch.exp(t - top) for t, _, _ in parts]  # (…, 1) each
    total = sum(s * e for (_, s, _), e in zip(parts, scales))
    if torch.is_grad_enabled() and any(o.requires_grad for _, _, o in parts):
        out = sum(o * e for (_, _, o), e in zip(parts, scales)) / torch.where(total > 0, total, 1.0)
    else:  # the same operations (the same numbers as with gradients), summed and divided in place
        out = parts[0][2] * scales[0]
        for (_, _, o), e in zip(parts[1:], scales[1:]):
            out.add_(o * e)
        out.div_(torch.where(total > 0, total, 1.0))
    return (out, (total > 0).to(out.dtype)) if mass else out


def _far(
    q: Tensor, k: Tensor, v: Tensor, counted: Tensor, index: Tensor, ok: Tensor, scale: float, rows: int,
    features: tuple[Tensor, Tensor] | None = None, scratch: SegmentBuffers | None = None,
):  # fmt: skip
    """The far part (a softmax part, as ``_merge`` takes) of each query over its own blocks
    ``index`` ``(B, H / shared, c, blocks)`` (``ok``: the block was eligible). The queries that
    chose a block are gathered into segments of ``rows`` (``far_segments``), each segment scored
    against its block in one batched product, and each query's partials summed under its largest
    far score: a row reads only its own query and block, and its query sums its partials in block
    order. The heads of a group share their rows' block where they share a key/value head. With ``features``
    (the queries' and the keys' of a kernel part), also the kernel sums over the chosen blocks'
    keys (``_taken``). ``scratch``: the call's (``far_segments.SegmentBuffers``), where nothing needs
    gradients: the segments then gather from whole blocks into buffers kept from chunk to chunk."""
    B, H, c, D = q.shape
    scratch = scratch or SegmentBuffers()
    groups, per, n = index.shape[1], H // k.shape[1], counted.shape[1]
    shared = H // groups
    if per % shared:  # a group spans key/value heads: each head chooses on its own
        index, ok, shared = index.repeat_interleave(shared, dim=1), ok.repeat_interleave(shared, dim=1), 1
    units, work, Hk = H // shared, work_dtype(q.dtype), k.shape[1]
    asks = B * units * c  # the (row, unit, query) rows
    # a segment's block is its key/value head's, so the units sharing one fill its segments together;
    # with features (a map per query head), its unit's
    streams, owners = torch.arange(B * units, device=q.device).view(B, units, 1, 1), units
    if features is None:
        streams, owners = streams // units * Hk + streams % units * shared // per, Hk
    count = B * owners * n
    asker, owner, slot = segments(torch.where(ok, streams * n + index, count), count, rows)
    if not owner.numel():  # no query in the chunk has a far block
        top = q.new_full((B, H, c, 1), float("-inf"), dtype=work)
        none = (top, torch.zeros_like(top), q.new_zeros((B, H, c, v.shape[-1]), dtype=work))
        return none if features is None else (*none, none[2], none[1])
    mine = q.to(work).view(B, units, shared, c, D).transpose(2, 3).reshape(asks, shared * D)  # gradients sum in work
    mine = torch.cat([mine, mine.new_zeros(1, shared * D)])  # an empty slot's row: zeros, whatever q holds
    queries = torch.index_select(mine, 0, asker, out=scratch("queries", (len(asker), shared * D), mine))
    queries = queries.view(owner.numel(), -1, D)
    keys, values, bias = segment_blocks(
        k, v, counted, owner, owners, shared if features is not None else 1, work, scratch
    )  # fmt: skip
    scores = scratch("scores", (*queries.shape[:2], keys.shape[1]), queries)  # (T, rows · shared, block)
    scores = torch.baddbmm(bias, queries, keys.transpose(1, 2), alpha=scale, out=scores)
    top = torch.full((asks + 1, shared), float("-inf"), dtype=work, device=q.device)
    top.scatter_reduce_(0, asker[:, None].expand(-1, shared), scores.detach().amax(-1).view(-1, shared), "amax")
    safe = torch.where(torch.isfinite(top), top, 0.0)  # the largest far score of each query (a constant shift)
    weights = scores.sub_(safe.index_select(0, asker).view(scores.shape[0], -1, 1)).exp_()
    total = per_query(weights.sum(-1).view(-1, shared, 1), asker, slot, asks)
    out = torch.bmm(weights, values, out=scratch("out", (*weights.shape[:2], values.shape[-1]), weights))
    out = per_query(out.view(asker.numel(), shared, -1), asker, slot, asks)
    parts = (top[:asks, :, None], total, out)
    if features is not None:
        parts += _taken(*features, values, owner, asker, slot, (units, shared), counted.shape[1:])
    return tuple(x.view(B, units, c, shared, -1).transpose(2, 3).reshape(B, H, c, -1) for x in parts)


def _taken(
    fq: Tensor, fk: Tensor, values: Tensor, owner: Tensor, asker: Tensor, slot: Tensor, heads: tuple[int, int],
    blocks: tuple[int, int],
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Each query's kernel sums over its chosen blocks' keys, ``Σ φ(q)·φ(k) v`` ``(asks, shared, Dv)``
    and ``Σ φ(q)·φ(k)`` ``(asks, shared, 1)``, in ``_far``'s segments (``values``: each segment's
    block's, ``(T, block, Dv)``): the features ``fq`` ``(B, H, c, F)`` of the slots' queries against
    their segment's block of ``fk`` ``(B, H, S, F)``, each head its own (a learned map is per head)."""
    B, H, c, F = fq.shape
    (units, shared), (n, size) = heads, blocks
    asks, S = B * units * c, fk.shape[2]
    mine = fq.view(B, units, shared, c, F).transpose(2, 3).reshape(asks, shared, F)
    mine = torch.cat([mine, mine.new_zeros(1, shared, F)])  # an empty slot: zero features
    queries = mine.index_select(0, asker).view(owner.numel(), -1, shared, F).transpose(1, 2)  # (T, shared, rows, F)
    b, block = owner // (units * n), owner % n
    if n * size > S and bool((block == n - 1).any()):  # the last block, partly filled, chosen (not causal)
        fk = torch.nn.functional.pad(fk, (0, 0, 0, n * size - S))
    elif n * size > S:
        fk = fk[:, :, : (n - 1) * size]
    head = (owner // n % units * shared)[:, None] + torch.arange(shared, device=fk.device)  # (T, shared)
    keys = fk.reshape(B, H, -1, size, F)[b[:, None], head, block[:, None]]  # (T, shared, block, F)
    weights = torch.matmul(queries, keys.transpose(-1, -2))  # (T, shared, rows, block): sinks, padding 0
    taken = torch.matmul(weights, values[:, None]).transpose(1, 2).reshape(-1, shared, values.shape[-1])
    total = weights.sum(-1).transpose(1, 2).reshape(-1, shared, 1)
    return per_query(taken, asker, slot, asks), per_query(total, asker, slot, asks)


def _chosen(
    q: Tensor, low: Tensor, high: Tensor, counted: Tensor, first: int, is_causal: bool, config: Config
) -> tuple[Tensor, Tensor]:
    """``(B, H, c, blocks)``: each query's (at positions ``first …``) far blocks, the eligible ones of
    highest bound, and whether each is one (fewer are eligible than ``blocks``)."""
    n, size, w, c = low.shape[2], counted.shape[-1], config.window, q.shape[2]
    p = torch.arange(first, first + c, device=q.device)
    if is_causal:  # the blocks some query of the chunk may take, and as many as it chooses: no bound past them
        n = max(min(n, max(first + c - w, 0) // size), min(config.blocks, n))
        low, high, counted = low[:, :, :n], high[:, :, :n], counted[:, :n]
    start = torch.arange(n, device=q.device) * size
    outside = (start + size - 1)[None] <= p[:, None] - w  # (c, n): the whole block older than the window
    if not is_causal:
        outside = outside | (start[None] >= p[:, None] + w)
    eligible = outside[None, None] & counted.any(-1)[:, None, None]
    bound = quest_bound(q.detach(), torch.cat([high, low], -1))
    if config.shared > 1:  # a group ranks blocks by its heads' bounds summed
        bound = bound.view(bound.shape[0], -1, config.shared, *bound.shape[2:]).sum(2)
    top, index = largest(bound.masked_fill_(~eligible, float("-inf")), min(config.blocks, n))  # bound: this call's
    return index, torch.isfinite(top)


def largest(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest of ``scores`` along the last dim and their indices, in no set order
    (``torch.topk(sorted=False)``'s). On the CPU, in many rows (``_SORTED_ROWS``): torch's top-k
    runs a partial sort from ``64·k`` entries a row on, and below that a selection over the whole
    row, about three times slower an entry (docs/performance.md), so a row of ``3/8 · 64·k`` entries
    or more, with ``k`` ≥ 2, is padded to ``64·k`` with −inf first (an index picked in the padding,
    where fewer than ``k`` are finite, is clamped to the row's last); a few (``k`` ≤ 4) of at most
    128 otherwise by ``k`` rounds of max, each setting its pick to −inf in ``scores`` (overwritten;
    of equal values the lower index first, as ``torch.max``), where ``topk`` took twice the time
    or more; else ``topk``. Where fewer than ``k`` are finite, the −inf ones taken may repeat an
    index."""
    n = scores.shape[-1]
    many = scores.is_cpu and scores.numel() // max(1, n) >= _SORTED_ROWS
    if many and k >= 2 and 3 * 64 * k <= 8 * n < 8 * 64 * k:
        padded = torch.nn.functional.pad(scores, (0, 64 * k - n), value=float("-inf"))
        values, indices = padded.topk(k, dim=-1, sorted=False)
        return values, indices.clamp_(max=n - 1)
    if not (many and k <= 4 and n <= 128):
        return scores.topk(k, dim=-1, sorted=False)
    values, indices = [], []
    for _ in range(k):
        value, index = scores.max(-1, keepdim=True)
        values.append(value)
        indices.append(index)
        scores.scatter_(-1, index, float("-inf"))
    return torch.cat(values, -1), torch.cat(indices, -1)


def quest_bound(q: Tensor, bounds: Tensor) -> Tensor:
    """Quest's bound ``Σ_d max(q_d·min_d, q_d·max_d)`` of queries ``(…, c, D)`` on blocks of bounds
    ``[max, min]`` ``(…, n, 2D)``, ``(…, c, n)``: relu(q)·max − relu(−q)·min, that is
    ``q·min + relu(q)·(max − min)``, two products over the queries with one temporary of their size
    (the parallel pass and decoding's step, whose cache holds the bounds so)."""
    work, D = work_dtype(q.dtype), q.shape[-1]  # in fp32 for half inputs: else near ties flip with the call's shape
    q, high, low = q.to(work), bounds[..., :D].to(work), bounds[..., D:].to(work)
    return torch.matmul(q, low.transpose(-1, -2)).add_(torch.matmul(q.clamp_min(0), (high - low).transpose(-1, -2)))

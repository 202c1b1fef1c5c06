"""The Sparse Transformer patterns (Child, Gray, Radford & Sutskever 2019, §4.2) as mask_mods, and
their block layouts: the disjoint parts whose union is a pattern, for ``kernels.blocksparse``.
Query ``i`` sits at position ``p = i + S − L``, ``l`` is the stride (fixed: the block length), and
a ``config`` is a ``SparseConfig``. The patterns and the reasons for computing them block-sparse
are in ``mechanisms.sparse``; the parts:

- Local step: blocks of ``block`` consecutive queries, each against the window of keys
  ``[p₀ − l + 1, p₀ + block − 1]`` (plus ``l − 1`` on the right when bidirectional): overlapping
  views of k and v (``unfold``), no copy. One element mask serves every inner block, since the step
  depends on ``p − j`` only. Merged, it leaves ``j = p`` to the column part. With ``block=0``
  the backward recomputes it transposed (``kernels.blocksparse.band_blocks``): blocks of keys
  against the queries that see them, whose key gradients come whole from one kernel call.
- Column step, made block-local by **transposition**: positions are regrouped by ``t mod l``, so
  column c is the run ``c, c + l, c + 2l, …`` and the step becomes ``l`` independent dense (causal)
  attentions of length ⌈S/l⌉. The transposition is a strided view (stride l rows), not a copy.
  Under the fused kernel, bidirectional columns run whole segments as single query blocks (fewer,
  larger calls than row blocks; docs/performance.md has the figures).
  Causal columns run as row blocks that see only the rows up to their own (faster than whole
  segments under the fused kernel's own causal flag, which at this length computes every diagonal
  tile in full). Where the native kernel runs (``kernel="native"``), causal
  columns run whole segments too when L = S and a column holds at most 128 rows: it skips the keys
  past each of its 32-query blocks itself.
- Fixed: its own block as ``l``-long segments (the same segment code, untransposed; whole segments
  under the fused kernel, causal with its causal flag, whose backward is faster than row blocks'), plus the summary
  keys of the other blocks, gathered once per call per head (nv distinct groups, ``blocks·c`` keys).
  Query block r sees those of blocks ``< r`` (causal) or ``≠ r``; runs of query blocks
  (``TUNING.sparse_summary_queries`` queries on the CPU; elsewhere as many as one tile of scores holds) share
  one kernel call on the summary prefix their last block can see, with that block-level mask (the
  same for every head).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from subquad._validate import AttentionShape
from subquad.kernels.blocksparse import native_runs
from subquad.kernels.layouts import (
    Group,
    MaskFacts,
    Views,
    band_groups,
    query_slots,
    segment_groups,
    sink_groups,
    sink_mask,
)
from subquad.kernels.softmax import fused_available
from subquad.kernels.tuning import TUNING, block_elements
from subquad.masks import MaskMod, and_masks, not_mask, or_masks
from subquad.registry import Config

__all__ = [
    "fixed_mask",
    "pattern_mask",
    "pattern_parts",
    "same_block_mask",
    "strided_column_mask",
    "strided_local_mask",
    "summary_groups",
    "summary_spans",
]

Spans = Callable[..., list[tuple[int, int]]]  # as summary_spans: (nonempty, config, shape, causal, device) -> runs


# ---------------------------------------------------------------------------------------------
# The Sparse Transformer patterns as mask_mods (Child et al. 2019, §4.2; the authors' code)
# ---------------------------------------------------------------------------------------------


def strided_local_mask(stride: int, causal: bool, offset: int = 0) -> MaskMod:
    """Local step: ``0 ≤ p − j < l`` (causal) or ``|p − j| < l``, with ``p = q_idx + offset``."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        distance = q_idx + offset - kv_idx
        return ((distance >= 0) & (distance < stride)) if causal else distance.abs() < stride

    return mask_mod


def strided_column_mask(stride: int, causal: bool, offset: int = 0) -> MaskMod:
    """Column step: ``(p − j) mod l = 0``, and ``j ≤ p`` when causal."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        distance = q_idx + offset - kv_idx
        same = distance.remainder(stride) == 0
        return same & (distance >= 0) if causal else same

    return mask_mod


def fixed_mask(stride: int, summary: int, groups: int, causal: bool, offset: int = 0, head_offset: int = 0) -> MaskMod:
    """Fixed: own block, or one of head h's c summary positions at the end of every block."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        position = q_idx + offset
        same_block = torch.div(position, stride, rounding_mode="floor") == torch.div(
            kv_idx, stride, rounding_mode="floor"
        )
        group = (h + head_offset).remainder(groups)
        within = kv_idx.remainder(stride)
        is_summary = (within >= stride - (group + 1) * summary) & (within < stride - group * summary)
        allowed = same_block | is_summary
        return allowed & (kv_idx <= position) if causal else allowed

    return mask_mod


def pattern_mask(config: Config, num_queries: int, num_keys: int, is_causal: bool) -> MaskMod:
    """The pattern of ``config`` for L queries and S keys, without its sinks."""
    offset = num_keys - num_queries
    if config.pattern == "fixed":
        return fixed_mask(config.stride, config.summary, config.groups, is_causal, offset, config.head_offset)
    local = strided_local_mask(config.stride, is_causal, offset)
    column = strided_column_mask(config.stride, is_causal, offset)
    return {"local": local, "column": column, "merged": or_masks(local, column)}[config.step]


def same_block_mask(stride: int, causal: bool, offset: int) -> MaskMod:
    """The fixed pattern's own-block part: ``⌊p / l⌋ = ⌊j / l⌋`` (and ``j ≤ p`` when causal)."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        position = q_idx + offset
        same = torch.div(position, stride, rounding_mode="floor") == torch.div(kv_idx, stride, rounding_mode="floor")
        return same & (kv_idx <= position) if causal else same

    return mask_mod


# ---------------------------------------------------------------------------------------------
# Block layouts of the Sparse Transformer patterns
# ---------------------------------------------------------------------------------------------


def summary_groups(config: Config, shape: AttentionShape, causal: bool, device, spans: Spans) -> list[Group]:
    """Fixed pattern, other blocks' summaries: per head, the c positions of its group in every block,
    gathered once into a short sequence (``blocks·c`` per head); query block r (positions
    ``[r·l, (r+1)·l)``) sees those of blocks < r (causal) or ≠ r."""
    l, c, H, L, S = config.stride, config.summary, shape.heads, shape.queries, shape.keys
    offset, blocks = S - L, -(-S // l)
    group_of_head = (torch.arange(H, device=device) + config.head_offset).remainder(config.groups)
    within = l - (group_of_head[:, None] + 1) * c + torch.arange(c, device=device)  # (H, c)
    summary = (torch.arange(blocks, device=device)[None, :, None] * l + within[:, None, :]).reshape(H, -1)
    in_range = bool((summary < S).all())  # a short last block may lack some heads' summaries
    slots = query_slots(torch.arange(blocks * l, device=device).view(blocks, l), offset, L)
    summary_block = torch.arange(blocks * c, device=device) // c

    def key_source(x: Tensor, pad: int) -> Tensor:
        B, Hkv, N, F_ = x.shape  # Hkv = H / G with grouped-query inputs: head h reads key head h // G
        heads = torch.arange(H, device=device)[:, None] // (H // Hkv)
        rows = (heads * N + pad + summary.clamp(max=S - 1)).flatten()
        return x.reshape(B, Hkv * N, F_).index_select(1, rows).view(B, H, -1, F_)  # (B, H, blocks·c, F)

    groups = []
    for first, last in spans(torch.nonzero((slots < L).any(1)).flatten().tolist(), config, shape, causal, device):
        width = last * c if causal else blocks * c
        if width == 0:
            continue
        keys = summary[:, None, :width]  # (H, 1, W)
        rows = torch.arange(first * l, (last + 1) * l, device=device)[:, None] // l  # (span·l, 1): query blocks

        def allowed(start: int, stop: int, keys=keys, rows=rows) -> Tensor:
            kb = summary_block[: keys.shape[-1]]
            visible = (kb < rows) if causal else (kb != rows)  # (span·l, W): the same for every head
            return visible if in_range else visible & (keys < S).unsqueeze(-2)

        def key_view(x: Tensor, pad: int, start: int, stop: int, width=width) -> Tensor:
            return x[:, :, None, :width]  # (B, H, 1, W, F)

        views = Views(key_view, key_source=key_source)
        if offset == 0:
            views = Views(
                key_view,
                lambda q, start, stop, first=first, n=last + 1 - first: q.narrow(2, first * l, n * l).unsqueeze(2),
                query_pad=max(0, (last + 1) * l - L),
                key_source=key_source,
                writes=True,
            )
        queries = slots[first : last + 1].reshape(1, -1)
        groups.append(Group(queries, keys, allowed, MaskFacts(in_range=in_range), views))
    return groups


def summary_spans(nonempty: list[int], config: Config, shape: AttentionShape, causal: bool, device):
    """Runs ``(first, last)`` of the query blocks ``nonempty`` that share one call on the summaries:
    few, large calls, as long query runs keep the matrix products large and each call has a fixed
    cost. On the CPU a run holds ``TUNING.sparse_summary_queries`` queries. Elsewhere, where a call is dozens of
    kernel launches, a run grows while its scores (the summary prefix its last block sees, for all
    its queries) fit in one tile of ``TUNING.sparse_summary_scores`` elements, scaled by ``block_elements``."""
    l, c = config.stride, config.summary
    if torch.device(device).type == "cpu":
        span = max(1, TUNING.sparse_summary_queries // l)
        return [(run[0], run[-1]) for run in (nonempty[i : i + span] for i in range(0, len(nonempty), span))]
    budget = block_elements(TUNING.sparse_summary_scores, torch.device(device)) // (shape.batch * shape.heads * l)
    widest = -(-shape.keys // l) * c
    runs: list[tuple[int, int]] = []
    for r in nonempty:
        if runs and (r + 1 - runs[-1][0]) * (r * c if causal else widest) <= budget:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    return runs


def pattern_parts(
    config: Config,
    shape: AttentionShape,
    causal: bool,
    device,
    native: bool,
    transposed_band: int | None,
    spans: Spans,
) -> list[list[Group]]:
    """The disjoint parts whose union is the pattern (see the module docstring). ``native``: the
    native kernel will run (``kernel="native"`` on inputs it takes). ``transposed_band``: the local
    step as the band transposed, blocks of that many keys against the queries that see them (a
    backward layout: ``band_blocks``); the other parts stay in blocks of ``config.block`` queries.
    ``spans``: the runs of the fixed pattern's query blocks that share one call on the summaries
    (``summary_spans``)."""
    l, L, S, block = config.stride, shape.queries, shape.keys, config.block
    offset = S - L
    # Whole segments as one query block each, where the fused kernel (which never holds a block's
    # scores at once) runs: fewer, larger calls. Causal columns keep their row blocks, which see
    # only the rows up to their own, unless the native kernel runs them.
    whole = config.kernel != "eager" and fused_available(torch.device(device))
    parts = []
    if config.sinks:  # the first keys the pattern leaves out, as a disjoint part
        heads = shape.heads if config.pattern == "fixed" and config.groups > 1 else 1
        sinks = sink_mask(min(config.sinks, S), pattern_mask(config, L, S, causal), causal, offset)
        parts.append(sink_groups(L, min(config.sinks, S), min(block, L), heads, sinks, device))
    if config.pattern == "fixed":
        blocks = -(-S // l)
        own = torch.arange(blocks * l, device=device).view(blocks, l)
        same_block = same_block_mask(l, causal, offset)
        return [
            segment_groups(own, L, offset, block, causal, same_block, (l, 1), whole),
            summary_groups(config, shape, causal, device, spans),
            *parts,
        ]
    local = strided_local_mask(l, causal, offset)
    column = strided_column_mask(l, causal, offset)
    if config.step in ("local", "merged"):
        right = 0 if causal else l - 1
        if config.step == "merged":  # j = p belongs to the column part
            local = and_masks(local, not_mask(column))
        if transposed_band is None:
            parts.append(band_groups(L, offset, l - 1, right, block, local, device, kept=True))
        else:
            keys = min(transposed_band, S)
            parts.append(band_groups(L, offset, l - 1, right, keys, local, device, kept=True, transposed=True))
    if config.step in ("column", "merged"):
        rows = -(-S // l)
        columns = torch.arange(l, device=device)[:, None] + l * torch.arange(rows, device=device)  # (l, rows)
        # the native kernel skips the keys past each of its query blocks: whole causal segments too
        # (with L = S: only then are the segments views it reads as square triangular blocks)
        whole_columns = whole and (not causal or (native and offset == 0 and native_runs(rows, rows)))
        parts.append(segment_groups(columns, L, offset, block, causal, column, (1, l), whole_columns))
    return parts

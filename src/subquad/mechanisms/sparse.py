"""Sparse Transformer attention (Child, Gray, Radford & Sutskever 2019): strided and fixed patterns.

**Patterns** are ``mask_mod(b, h, q_idx, kv_idx) -> bool`` functions (``subquad.masks``), defined
once here; ``dense_mask`` turns them into the dense masks tests compare with, and the block layouts
below evaluate them for the exact element mask inside every computed block. Query ``i`` sits at
position ``p = i + S − L`` (the queries are the last L positions, as in every mechanism's ``fn``). With
stride (block length) ``l``, as in the authors' released code (§4.2, Fig. 3):

- strided, local step: ``0 ≤ p − j < l``; column step: ``j ≤ p`` and ``(p − j) mod l = 0``;
  ``merged``: their union in one head (§4.2, "merged head").
- fixed: ``j ≤ p`` and (``⌊j/l⌋ = ⌊p/l⌋`` or ``j mod l`` is a summary position of head h:
  ``l − (g+1)·c ≤ j mod l < l − g·c`` with ``g = h mod nv``).
- Bidirectional forms drop ``j ≤ p``; the local step becomes ``|p − j| < l`` (dropping ``j ≤ p``
  from ``p − j < l`` alone would admit every later key).

**Head index.** ``h`` is the head's index in its layer: a ``HeadGroup`` whose heads start at layer
head 4 passes ``head_offset=4``, so head h of the call uses summary group ``(4 + h) mod nv``.

**Block-sparse computation** (``kernels.blocksparse``): each pattern is a union of disjoint parts, each
computed block by block and merged by log-sum-exp. No (N × N) tensor exists and the blocks outside
a part are never touched, so the causal upper triangle is never computed. Layouts are built from the
patterns' geometry (cached per shape); their element masks are the mask_mods above, and tests check
that the union of the parts is exactly the pattern's dense mask.

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

``pattern`` (``mechanisms.pattern``) computes any mask_mod on the same engine.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from subquad._validate import AttentionShape, check_grouped_inputs
from subquad.decoding import KVCache
from subquad.kernels import native as _native
from subquad.kernels.blocksparse import band_blocks, block_sparse_attention, native_runs
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
from subquad.masks import MaskMod, and_masks, or_masks, window_covers
from subquad.mechanisms._options import head_offset_option, kernel_option
from subquad.registry import Config, Mechanism, option

__all__ = [
    "SparseConfig",
    "fixed_mask",
    "sparse_attention",
    "sparse_mask_mod",
    "strided_column_mask",
    "strided_local_mask",
]


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SparseConfig(Config):
    mechanism = "sparse"
    pattern: str = option(
        "strided", "strided (images, audio) or fixed (text): Child et al. §4.2", choices=("strided", "fixed")
    )
    step: str = option(
        "merged",
        "strided: local (p − j < l), column ((p − j) mod l = 0), or merged (both in one head)",
        choices=("local", "column", "merged"),
    )
    stride: int = option(128, "l: the stride of strided, the block length of fixed", ge=1, le=1 << 20)
    summary: int = option(8, "fixed: c, summary positions at the end of each block", ge=1)
    groups: int = option(1, "fixed: nv distinct summary groups; layer head h uses group h mod nv", ge=1)
    sinks: int = option(0, "the first s keys are visible to every query as well (StreamingLLM's attention sinks)", ge=0)
    head_offset: int = head_offset_option()
    block: int = option(
        0,
        "queries per block of compute (speed only); 0: as local, 32 in the forward on the fused or native "
        "kernel (else 64); the backward recomputes the local step transposed there (blocks of 128 keys), the rest "
        "in 64, 128 where a query sees more than 256 keys",
        ge=0,
        le=4096,
    )
    kernel: str = kernel_option()

    def check(self) -> None:
        if self.pattern == "fixed" and self.summary * self.groups > self.stride:
            raise ValueError(
                f"sparse fixed needs summary·groups <= stride (nv groups of c summary positions fit in a block "
                f"of l), got summary={self.summary}, groups={self.groups}, stride={self.stride}; lower summary "
                "or groups, or raise stride"
            )


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


def sparse_mask_mod(config: SparseConfig, num_queries: int, num_keys: int, is_causal: bool) -> MaskMod:
    """The whole pattern of ``config`` for L queries and S keys, sinks included: the dense oracle of
    ``sparse``."""
    pattern = _pattern_mask(config, num_queries, num_keys, is_causal)
    if not config.sinks:
        return pattern
    return or_masks(pattern, sink_mask(config.sinks, pattern, is_causal, num_keys - num_queries))


def _pattern_mask(config: SparseConfig, num_queries: int, num_keys: int, is_causal: bool) -> MaskMod:
    offset = num_keys - num_queries
    if config.pattern == "fixed":
        return fixed_mask(config.stride, config.summary, config.groups, is_causal, offset, config.head_offset)
    local = strided_local_mask(config.stride, is_causal, offset)
    column = strided_column_mask(config.stride, is_causal, offset)
    return {"local": local, "column": column, "merged": or_masks(local, column)}[config.step]


# ---------------------------------------------------------------------------------------------
# Block layouts of the Sparse Transformer patterns
# ---------------------------------------------------------------------------------------------


def _summary_groups(config: SparseConfig, shape: AttentionShape, causal: bool, device) -> list[Group]:
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
    for first, last in _summary_spans(
        torch.nonzero((slots < L).any(1)).flatten().tolist(), config, shape, causal, device
    ):
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


def _summary_spans(nonempty: list[int], config: SparseConfig, shape: AttentionShape, causal: bool, device):
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


@functools.lru_cache(maxsize=16)
def _sparse_parts(
    config: SparseConfig,
    shape: AttentionShape,
    causal: bool,
    device,
    native: bool = False,
    transposed_band: int | None = None,
) -> list[list[Group]]:
    """The disjoint parts whose union is the pattern (see the module docstring). Cached: a layer
    calls with the same sizes again and again, and the layout depends on nothing else. ``native``:
    the native kernel will run (``kernel="native"`` on inputs it takes). ``transposed_band``: the
    local step as the band transposed, blocks of that many keys against the queries that see them
    (a backward layout: ``band_blocks``); the other parts stay in blocks of ``config.block`` queries."""
    l, L, S, block = config.stride, shape.queries, shape.keys, config.block
    offset = S - L
    # Whole segments as one query block each, where the fused kernel (which never holds a block's
    # scores at once) runs: fewer, larger calls. Causal columns keep their row blocks, which see
    # only the rows up to their own, unless the native kernel runs them.
    whole = config.kernel != "eager" and fused_available(torch.device(device))
    parts = []
    if config.sinks:  # the first keys the pattern leaves out, as a disjoint part
        heads = shape.heads if config.pattern == "fixed" and config.groups > 1 else 1
        sinks = sink_mask(min(config.sinks, S), _pattern_mask(config, L, S, causal), causal, offset)
        parts.append(sink_groups(L, min(config.sinks, S), min(block, L), heads, sinks, device))
    if config.pattern == "fixed":
        blocks = -(-S // l)
        own = torch.arange(blocks * l, device=device).view(blocks, l)
        same_block = _same_block_mask(l, causal, offset)
        return [
            segment_groups(own, L, offset, block, causal, same_block, (l, 1), whole),
            _summary_groups(config, shape, causal, device),
            *parts,
        ]
    local = strided_local_mask(l, causal, offset)
    column = strided_column_mask(l, causal, offset)
    if config.step in ("local", "merged"):
        right = 0 if causal else l - 1
        if config.step == "merged":  # j = p belongs to the column part
            local = and_masks(local, _not(column))
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


def _same_block_mask(stride: int, causal: bool, offset: int) -> MaskMod:
    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        position = q_idx + offset
        same = torch.div(position, stride, rounding_mode="floor") == torch.div(kv_idx, stride, rounding_mode="floor")
        return same & (kv_idx <= position) if causal else same

    return mask_mod


def _not(mask_mod: MaskMod) -> MaskMod:
    return lambda b, h, q_idx, kv_idx: ~mask_mod(b, h, q_idx, kv_idx)


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    config: SparseConfig | None = None,
    state: None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Sparse Transformer attention: strided (local, column or merged) or fixed, block-sparse.

    Args:
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, Dv)``; L ≤ S, query i at position
            ``i + S − L``.
        key_padding_mask: bool ``(B, S)``, True marks a real key.
        is_causal: the causal form of the pattern (``j ≤ p``).
        scale: softmax scale, default ``D ** -0.5``.
        config: ``SparseConfig``.
        enable_gqa: k and v may have a divisor of q's heads (grouped-query), read in place.

    Returns:
        ``(B, H, L, Dv)``; zero rows for queries that see no key.
    """
    config = config or SparseConfig()
    shape = check_grouped_inputs(q, k, v, key_padding_mask, is_causal, scale, enable_gqa)
    if shape.queries > shape.keys:
        raise ValueError(
            f"sparse places query i at key position i + S - L, so it needs L <= S, got L={shape.queries} and "
            f"S={shape.keys}; pass the whole sequence as keys, or use the pattern mechanism with a mask_mod"
        )
    native = config.kernel == "native" and _native.supports(q, k, v) is None
    layout_shape = dataclasses.replace(shape, scale=1.0)
    backward = None
    if config.block:
        parts = _sparse_parts(config, layout_shape, is_causal, q.device, native)
    else:
        band = config.stride if is_causal else 2 * config.stride - 1  # keys per query of the local step
        blocks = band_blocks(q, k, v, config.kernel, native, band)
        parts = _sparse_parts(
            dataclasses.replace(config, block=blocks.forward), layout_shape, is_causal, q.device, native
        )
        if blocks.backward is not None or blocks.transposed is not None:
            config_backward = dataclasses.replace(config, block=blocks.backward or blocks.forward)
            backward = _sparse_parts(config_backward, layout_shape, is_causal, q.device, native, blocks.transposed)
    return block_sparse_attention(q, k, v, parts, key_padding_mask, shape.scale, config.kernel, backward)


def _exactly_full(config: SparseConfig, shape: AttentionShape, is_causal: bool, state: None, tensors: dict) -> bool:
    """Whether the pattern leaves out no key full attention would see: fixed, one block holds every
    key and query position; strided, a stride of 1 makes the column step every key, the local step
    covers distances below l, and merged adds the column at distance l."""
    L, S = shape.queries, shape.keys
    if L > S:  # no form of its own: sparse_attention says so
        return False
    if config.pattern == "fixed":
        return S <= config.stride
    if config.stride == 1 and config.step != "local":
        return True
    reach = {"local": config.stride, "merged": config.stride + 1, "column": 1}[config.step]
    return window_covers(reach, L, S, is_causal)


MECHANISM = Mechanism(
    name="sparse",
    sinks="sinks",
    fn=sparse_attention,
    config=SparseConfig,
    summary="Sparse Transformer strided (local/column/merged) and fixed patterns, block-sparse",
    paper="Child et al. 2019, Generating Long Sequences with Sparse Transformers, §4.2",
    decoder=KVCache,  # exact: the causal pattern of position p reads only keys <= p
    gqa=True,
    longer_queries=False,
    exact_full=_exactly_full,
    examples=(
        {},
        {"stride": 4, "block": 4},
        {"stride": 5, "step": "column", "block": 3, "kernel": "eager"},
        {"pattern": "fixed", "stride": 6, "summary": 2, "groups": 2, "block": 4},
        {"stride": 4, "block": 4, "kernel": "native"},
        {"stride": 5, "block": 4, "sinks": 3},
        {"pattern": "fixed", "stride": 6, "summary": 2, "groups": 2, "block": 4, "sinks": 4},
    ),
)

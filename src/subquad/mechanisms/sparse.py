"""Sparse Transformer attention (Child, Gray, Radford & Sutskever 2019) and general mask patterns.

**Patterns** are ``mask_mod(b, h, q_idx, kv_idx) -> bool`` functions (``subquad.masks``), defined
once here; ``dense_mask`` turns them into the dense masks tests compare with, and the block layouts
below evaluate them for the exact element mask inside every computed block. Query ``i`` sits at
position ``p = i + S − L`` (the queries are the last L positions, as everywhere in subquad). With
stride (block length) ``l``, as in the authors' released code (§4.2, Fig. 3):

- strided, local step: ``0 ≤ p − j < l``; column step: ``j ≤ p`` and ``(p − j) mod l = 0``;
  ``merged``: their union in one head (§4.2, "merged head").
- fixed: ``j ≤ p`` and (``⌊j/l⌋ = ⌊p/l⌋`` or ``j mod l`` is a summary position of head h:
  ``l − (g+1)·c ≤ j mod l < l − g·c`` with ``g = h mod nv``).
- Bidirectional forms drop ``j ≤ p``; the local step becomes ``|p − j| < l`` (dropping ``j ≤ p``
  from ``p − j < l`` alone would admit every later key).

**Head index.** ``h`` is the head's index in its layer: a ``HeadGroup`` whose heads start at layer
head 4 passes ``head_offset=4``, so head h of the call uses summary group ``(4 + h) mod nv``.

**Block-sparse computation** (``_blocksparse``): each pattern is a union of disjoint parts, each
computed block by block and merged by log-sum-exp. No (N × N) tensor exists and the blocks outside
a part are never touched, so the causal upper triangle is never computed. Layouts are built from the
patterns' geometry (cached per shape); their element masks are the mask_mods above, and tests check
that the union of the parts is exactly the pattern's dense mask.

- Local step: blocks of ``block`` consecutive queries, each against the window of keys
  ``[p₀ − l + 1, p₀ + block − 1]`` (plus ``l − 1`` on the right when bidirectional): overlapping
  views of k and v (``unfold``), no copy. One element mask serves every inner block, since the step
  depends on ``p − j`` only. Merged, it leaves ``j = p`` to the column part.
- Column step, made block-local by **transposition**: positions are regrouped by ``t mod l``, so
  column c is the run ``c, c + l, c + 2l, …`` and the step becomes ``l`` independent dense (causal)
  attentions of length ⌈S/l⌉. The transposition is a strided view (stride l rows), not a copy.
  Under the fused kernel, bidirectional columns run whole segments as single query blocks (fewer,
  larger calls than row blocks: about 5% faster forward, 10% forward+backward at N = 16384).
  Causal columns run as row blocks that see only the rows up to their own (a quarter faster
  forward than whole segments under the fused kernel's own causal flag, which at this length
  computes every diagonal tile in full). Where the native kernel runs (``kernel="native"``), causal
  columns run whole segments too when L = S and a column holds at most 128 rows: it skips the keys
  past each of its 32-query blocks itself.
- Fixed: its own block as ``l``-long segments (the same segment code, untransposed; whole segments
  under the fused kernel, causal with its causal flag, whose backward is faster than row blocks'), plus the summary
  keys of the other blocks, gathered once per call per head (nv distinct groups, ``blocks·c`` keys).
  Query block r sees those of blocks ``< r`` (causal) or ``≠ r``; runs of query blocks
  (``_SUMMARY_QUERIES`` queries on the CPU; elsewhere as many as one tile of scores holds) share
  one kernel call on the summary prefix their last block can see, with that block-level mask (the
  same for every head).

**``pattern``: any mask_mod, block-sparse, with autograd on CPU.** A config holds simple values only,
so a pattern reaches the mechanism in one of two ways:

- by name (``PatternConfig.name``): built-ins ``window`` (sliding window, optionally dilated, plus
  global tokens), and any factory added with ``register_pattern``. Names work everywhere a config
  does: ``HeadGroup("pattern", name="window", window=64)``, the bench, ``subquad list``.
- as a callable for one call: ``subquad.attention(q, k, v, "pattern", mask_mod=fn)`` (or
  ``pattern_attention(..., mask_mod=fn)``). A user mask_mod sees raw indices ``q_idx ∈ [0, L)``,
  ``kv_idx ∈ [0, S)`` and the layer head ``head_offset + h``, like ``dense_mask``; ``is_causal`` adds
  the causal mask.

Its layout is found by evaluating the mask on every (query block, key block) tile, a chunk of query
blocks at a time (O(L·S) cheap boolean work, O(block·S) memory); each query block then attends to its
non-empty key blocks only, with query blocks bucketed by how many they have.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import Tensor

from subquad import _native
from subquad._blocks import block_elements
from subquad._validate import AttentionShape, check_attention_inputs
from subquad.decoding import KVCache
from subquad.masks import MaskMod, and_masks, causal_mask, or_masks
from subquad.mechanisms._blocksparse import (
    Group,
    band_groups,
    block_sparse_attention,
    fused_kernel_available,
    kernel_option,
    native_runs,
)
from subquad.registry import Config, Mechanism, option

__all__ = [
    "PATTERNS",
    "PatternConfig",
    "SparseConfig",
    "fixed_mask",
    "pattern_attention",
    "pattern_mask_mod",
    "register_pattern",
    "sparse_attention",
    "sparse_mask_mod",
    "strided_column_mask",
    "strided_local_mask",
]

_LAYOUT_ELEMENTS = 1 << 22  # mask values evaluated at once while finding a pattern's layout
_SUMMARY_QUERIES = 1024  # queries per kernel call against the fixed pattern's gathered summaries
_SUMMARY_SCORES = 1 << 19  # off the CPU: scores per call against them, times block_elements' scale


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


def _head_offset_option():
    """The ``head_offset`` option that sparse and pattern share."""
    return option(0, "layer index of this call's first head (a HeadGroup's first head)", ge=0)


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
    head_offset: int = _head_offset_option()
    block: int = option(32, "queries per block of compute (speed only)", ge=1, le=4096)
    kernel: str = kernel_option()

    def check(self) -> None:
        if self.pattern == "fixed" and self.summary * self.groups > self.stride:
            raise ValueError(
                f"sparse fixed needs summary·groups <= stride (nv groups of c summary positions fit in a block "
                f"of l), got summary={self.summary}, groups={self.groups}, stride={self.stride}; lower summary "
                "or groups, or raise stride"
            )


@dataclasses.dataclass(frozen=True)
class PatternConfig(Config):
    mechanism = "pattern"
    name: str = option("window", "a registered pattern (PATTERNS); a mask_mod argument replaces it")
    window: int = option(128, "window: keys with |p − j| < window (positions, counted before dilation)", ge=1)
    dilation: int = option(1, "window: keep only keys with (p − j) mod dilation = 0", ge=1)
    global_tokens: int = option(0, "window: the first g positions see, and are seen by, every position", ge=0)
    head_offset: int = _head_offset_option()
    block: int = option(64, "query and key block length of the layout (speed only)", ge=1, le=4096)
    kernel: str = kernel_option()

    def check(self) -> None:
        if self.name not in PATTERNS:
            raise ValueError(
                f"pattern option name must be a registered pattern, got {self.name!r}; registered: "
                f"{', '.join(PATTERNS)} (add one with register_pattern)"
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
    """The whole pattern of ``config`` for L queries and S keys: the dense oracle of ``sparse``."""
    offset = num_keys - num_queries
    if config.pattern == "fixed":
        return fixed_mask(config.stride, config.summary, config.groups, is_causal, offset, config.head_offset)
    local = strided_local_mask(config.stride, is_causal, offset)
    column = strided_column_mask(config.stride, is_causal, offset)
    return {"local": local, "column": column, "merged": or_masks(local, column)}[config.step]


# ---------------------------------------------------------------------------------------------
# Block layouts of the Sparse Transformer patterns
# ---------------------------------------------------------------------------------------------


def _query_slots(positions: Tensor, offset: int, L: int) -> Tensor:
    """Query index of each key position (``L`` where no query sits there)."""
    index = positions - offset
    return index.masked_fill((index < 0) | (index >= L), L)


def _strided_view(x: Tensor, first: int, blocks: int, block_step: int, rows: int, row_step: int) -> Tensor:
    """``(B, H, blocks, rows, F)`` view of ``x`` ``(B, H, N, F)``: row r of block s is position
    ``first + s·block_step + r·row_step``."""
    B, H, _, F_ = x.shape
    sb, sh, sn, sf = x.stride()
    return x.as_strided(
        (B, H, blocks, rows, F_), (sb, sh, block_step * sn, row_step * sn, sf), x.storage_offset() + first * sn
    )


def _segment_groups(
    positions: Tensor,
    L: int,
    offset: int,
    block: int,
    causal: bool,
    mask_mod: MaskMod,
    steps: tuple[int, int],
    whole: bool = False,
) -> list[Group]:
    """Dense attention inside each segment (a row of ``positions`` ``(segments, R)``, in order).

    Row blocks of ``block`` queries see the whole segment, or, when causal, its rows up to their
    own last one. Blocks with no query are dropped. ``positions[s, r] = s·a + r·b`` with
    ``steps = (a, b)``, so when every segment has queries (and L = S) the blocks are strided views
    and share one element mask (it depends on the rows only). ``whole``: one block per segment;
    causal, its mask is exactly ``j <= p`` there (the fused kernel's own causal flag).
    """
    segments, R = positions.shape
    a, b = steps
    block = R if whole else block
    slots = _query_slots(positions, offset, L)
    zero = torch.zeros((), dtype=torch.long, device=positions.device)
    groups = []
    for first in range(0, R, block):
        last = min(R, first + block)
        queries = torch.nn.functional.pad(slots[:, first:last], (0, block - (last - first)), value=L)
        keep = (queries < L).any(1)
        if not bool(keep.any()):
            continue
        width = last if causal else R
        keys = positions[keep, :width]  # (n, W)
        views: dict = {}
        if offset == 0 and bool(keep.all()):

            def query_view(q_ext: Tensor, start: int, stop: int, first=first) -> Tensor:
                return _strided_view(q_ext, start * a + first * b, stop - start, a, block, b)

            def key_view(x: Tensor, pad: int, start: int, stop: int, width=width) -> Tensor:
                return _strided_view(x, pad + start * a, stop - start, a, width, b)

            in_range = bool((keys < L).all())
            views = {
                "query_view": query_view,
                "key_view": key_view,
                "query_pad": max(0, (segments - 1) * a + (first + block - 1) * b + 1 - L),  # rows the views read
                "key_pad": max(0, (segments - 1) * a + (width - 1) * b + 1 - L),
                "uniform": in_range,
                "causal": whole and causal and in_range,
                "triangular": whole and causal,  # row j is allowed only for queries of rows >= j
                "dense": not causal,  # a whole segment: all of it is visible
                "in_range": in_range,
                "view_writes": b * R >= a * segments,  # padded rows lie past the last position, not on a query
            }
        queries = queries[keep]

        def allowed(start: int, stop: int, queries=queries, keys=keys) -> Tensor:
            return mask_mod(zero, zero, queries[start:stop, :, None], keys[start:stop, None, :])

        groups.append(Group(queries, keys.unsqueeze(0), allowed, **views))
    return groups


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
    slots = _query_slots(torch.arange(blocks * l, device=device).view(blocks, l), offset, L)
    summary_block = torch.arange(blocks * c, device=device) // c

    def key_source(x: Tensor, pad: int) -> Tensor:
        B, _, N, F_ = x.shape
        rows = (torch.arange(H, device=device)[:, None] * N + pad + summary.clamp(max=S - 1)).flatten()
        return x.reshape(B, H * N, F_).index_select(1, rows).view(B, H, -1, F_)  # (B, H, blocks·c, F)

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

        views: dict = {"key_view": key_view, "key_source": key_source}
        if offset == 0:
            views["query_view"] = lambda q, start, stop, first=first, n=last + 1 - first: q.narrow(
                2, first * l, n * l
            ).unsqueeze(2)
            views["view_writes"] = True
            views["query_pad"] = max(0, (last + 1) * l - L)
        groups.append(Group(slots[first : last + 1].reshape(1, -1), keys, allowed, in_range=in_range, **views))
    return groups


def _summary_spans(nonempty: list[int], config: SparseConfig, shape: AttentionShape, causal: bool, device):
    """Runs ``(first, last)`` of the query blocks ``nonempty`` that share one call on the summaries:
    few, large calls, as long query runs keep the matrix products large and each call has a fixed
    cost. On the CPU a run holds ``_SUMMARY_QUERIES`` queries. Elsewhere, where a call is dozens of
    kernel launches, a run grows while its scores (the summary prefix its last block sees, for all
    its queries) fit in one tile of ``_SUMMARY_SCORES`` elements, scaled by ``block_elements``."""
    l, c = config.stride, config.summary
    if torch.device(device).type == "cpu":
        span = max(1, _SUMMARY_QUERIES // l)
        return [(run[0], run[-1]) for run in (nonempty[i : i + span] for i in range(0, len(nonempty), span))]
    budget = block_elements(_SUMMARY_SCORES, torch.device(device)) // (shape.batch * shape.heads * l)
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
    config: SparseConfig, shape: AttentionShape, causal: bool, device, native: bool = False
) -> list[list[Group]]:
    """The disjoint parts whose union is the pattern (see the module docstring). Cached: a layer
    calls with the same sizes again and again, and the layout depends on nothing else. ``native``:
    the native kernel will run (``kernel="native"`` on inputs it takes)."""
    l, L, S, block = config.stride, shape.queries, shape.keys, config.block
    offset = S - L
    # Whole segments as one query block each, where the fused kernel (which never holds a block's
    # scores at once) runs: fewer, larger calls. Causal columns keep their row blocks, which see
    # only the rows up to their own, unless the native kernel runs them.
    whole = config.kernel != "eager" and fused_kernel_available(device)
    if config.pattern == "fixed":
        blocks = -(-S // l)
        own = torch.arange(blocks * l, device=device).view(blocks, l)
        same_block = _same_block_mask(l, causal, offset)
        return [
            _segment_groups(own, L, offset, block, causal, same_block, (l, 1), whole),
            _summary_groups(config, shape, causal, device),
        ]
    parts = []
    local = strided_local_mask(l, causal, offset)
    column = strided_column_mask(l, causal, offset)
    if config.step in ("local", "merged"):
        right = 0 if causal else l - 1
        if config.step == "merged":  # j = p belongs to the column part
            local = and_masks(local, _not(column))
        parts.append(band_groups(L, offset, l - 1, right, block, local, device))
    if config.step in ("column", "merged"):
        rows = -(-S // l)
        columns = torch.arange(l, device=device)[:, None] + l * torch.arange(rows, device=device)  # (l, rows)
        # the native kernel skips the keys past each of its query blocks: whole causal segments too
        # (with L = S: only then are the segments views it reads as square triangular blocks)
        whole_columns = whole and (not causal or (native and offset == 0 and native_runs(rows, rows)))
        parts.append(_segment_groups(columns, L, offset, block, causal, column, (1, l), whole_columns))
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
) -> Tensor:
    """Sparse Transformer attention: strided (local, column or merged) or fixed, block-sparse.

    Args:
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, Dv)``; L ≤ S, query i at position
            ``i + S − L``.
        key_padding_mask: bool ``(B, S)``, True marks a real key.
        is_causal: the causal form of the pattern (``j ≤ p``).
        scale: softmax scale, default ``D ** -0.5``.
        config: ``SparseConfig``.

    Returns:
        ``(B, H, L, Dv)``; zero rows for queries that see no key.
    """
    config = config or SparseConfig()
    shape = check_attention_inputs(q, k, v, key_padding_mask, is_causal, scale)
    if shape.queries > shape.keys:
        raise ValueError(
            f"sparse places query i at key position i + S - L, so it needs L <= S, got L={shape.queries} and "
            f"S={shape.keys}; pass the whole sequence as keys, or use the pattern mechanism with a mask_mod"
        )
    native = config.kernel == "native" and _native.supports(q, k, v) is None
    parts = _sparse_parts(config, dataclasses.replace(shape, scale=1.0), is_causal, q.device, native)
    return block_sparse_attention(q, k, v, parts, key_padding_mask, shape.scale, config.kernel)


# ---------------------------------------------------------------------------------------------
# General patterns
# ---------------------------------------------------------------------------------------------

PatternFactory = Callable[[PatternConfig, int, int], MaskMod]


def _window_pattern(config: PatternConfig, num_queries: int, num_keys: int) -> MaskMod:
    """Sliding window ``|p − j| < window`` keeping ``(p − j) mod dilation = 0``, plus global tokens
    (the first ``global_tokens`` positions see and are seen by all), as in Longformer."""
    offset, window, dilation, g = num_keys - num_queries, config.window, config.dilation, config.global_tokens

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        distance = q_idx + offset - kv_idx
        allowed = (distance.abs() < window) & (distance.remainder(dilation) == 0)
        return allowed | (q_idx + offset < g) | (kv_idx < g) if g else allowed

    return mask_mod


PATTERNS: dict[str, PatternFactory] = {"window": _window_pattern}


def register_pattern(name: str, factory: PatternFactory, *, replace: bool = False) -> None:
    """Make ``factory(config, L, S) -> mask_mod`` available as ``PatternConfig(name=...)``.

    The mask_mod takes raw indices ``q_idx ∈ [0, L)``, ``kv_idx ∈ [0, S)`` and the layer head index.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a pattern name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise ValueError(f"register_pattern needs a factory (config, L, S) -> mask_mod, got {type(factory).__name__}")
    if name in PATTERNS and not replace:
        raise ValueError(f"a pattern named {name!r} exists; pass replace=True to override it")
    PATTERNS[name] = factory


def pattern_mask_mod(
    config: PatternConfig, num_queries: int, num_keys: int, is_causal: bool, mask_mod: MaskMod | None = None
) -> MaskMod:
    """The mask ``pattern`` computes: ``mask_mod`` (or the named pattern), and causal when asked."""
    if mask_mod is None:
        mask_mod = PATTERNS[config.name](config, num_queries, num_keys)
    return and_masks(mask_mod, causal_mask(num_queries, num_keys)) if is_causal else mask_mod


def _evaluate(mask_mod: MaskMod, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    try:
        out = mask_mod(b, h, q_idx, kv_idx)
    except RuntimeError as error:
        if "Boolean value of Tensor" not in str(error):
            raise
        raise ValueError(
            "mask_mod is called with index tensors, so Python's 'and', 'or', 'not' and 'if' cannot "
            "combine its conditions; use & | ~ and torch.where, e.g. (q_idx >= kv_idx) & (q_idx - kv_idx < w)"
        ) from error
    if not isinstance(out, Tensor) or out.dtype != torch.bool:
        got = out.dtype if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(
            f"mask_mod must return a bool tensor (True = may attend) from broadcastable index tensors, got {got}; "
            "combine conditions with & and |, not 'and'/'or'"
        )
    return out


def _occupancy(mask_mod: MaskMod, shape: AttentionShape, block: int, head_offset: int, device) -> Tensor:
    """Which (query block, key block) tiles hold an allowed pair, per head: bool ``(H|1, nq, nk)``."""
    B, H, L, S = shape.batch, shape.heads, shape.queries, shape.keys
    nq, nk = -(-L // block), -(-S // block)
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = (torch.arange(H, device=device) + head_offset).view(1, H, 1, 1)
    kv_idx = torch.arange(S, device=device).view(1, 1, 1, S)
    per_chunk = max(1, block_elements(_LAYOUT_ELEMENTS, torch.device(device)) // (B * H * block * S))
    tiles = []
    for first in range(0, nq, per_chunk):
        rows = torch.arange(first * block, min(L, (first + per_chunk) * block), device=device)
        m = _evaluate(mask_mod, b, h, rows.view(1, 1, -1, 1), kv_idx)
        m = m.expand(*m.shape[:2], len(rows), S)  # (B|1, H|1, rows, S)
        m = torch.nn.functional.pad(m, (0, nk * block - S, 0, -len(rows) % block))
        tiles.append(m.view(*m.shape[:2], -1, block, nk, block).any(-1).any(-2).any(0))  # (H|1, n, nk)
    return torch.cat(tiles, dim=1)


def _pattern_groups(mask_mod: MaskMod, shape: AttentionShape, block: int, head_offset: int, device) -> list[Group]:
    """Each query block against its non-empty key blocks, blocks bucketed by how many they have."""
    H, L, S = shape.heads, shape.queries, shape.keys
    occupied = _occupancy(mask_mod, shape, block, head_offset, device)  # (Hm, nq, nk)
    counts = occupied.sum(-1)  # (Hm, nq)
    order = torch.argsort((~occupied).to(torch.uint8), dim=-1, stable=True)  # occupied key blocks first
    most = counts.amax(0)  # (nq,)
    quantum = max(1, -(-int(most.max()) // 8))
    widths = (-(-most // quantum) * quantum).clamp(max=occupied.shape[-1])  # no wider than the key blocks
    h = (torch.arange(H, device=device) + head_offset).view(1, H, 1, 1, 1)
    b = torch.arange(shape.batch, device=device).view(-1, 1, 1, 1, 1)
    groups = []
    for width in widths.unique().tolist():
        if width == 0:
            continue  # these query blocks see no key: their rows stay zero
        rows = torch.nonzero(widths == width).flatten()
        key_blocks = order[:, rows, :width]  # (Hm, n, w)
        key_blocks = key_blocks.masked_fill(torch.arange(width, device=device) >= counts[:, rows, None], -1)
        keys = (key_blocks[..., None] * block + torch.arange(block, device=device)).flatten(-2)  # (Hm, n, W)
        keys = keys.masked_fill(key_blocks.repeat_interleave(block, dim=-1) < 0, -1)
        queries = rows[:, None] * block + torch.arange(block, device=device)
        queries = queries.masked_fill(queries >= L, L)

        def allowed(start: int, stop: int, queries=queries, keys=keys) -> Tensor:
            q_idx = queries[start:stop].clamp(max=L - 1)[None, None, :, :, None]  # (1, 1, n, bq, 1)
            kv_idx = keys[:, start:stop].clamp(0, S - 1)[None, :, :, None, :]  # (1, Hm, n, 1, W)
            return _evaluate(mask_mod, b, h, q_idx, kv_idx)

        groups.append(Group(queries, keys, allowed))
    return groups


@functools.lru_cache(maxsize=16)
def _named_pattern_groups(
    config: PatternConfig, factory: PatternFactory, shape: AttentionShape, is_causal: bool, device
) -> list[Group]:
    """The layout of a registered pattern (``factory``: a replaced registration is a new key)."""
    mod = pattern_mask_mod(config, shape.queries, shape.keys, is_causal)
    return _pattern_groups(mod, shape, config.block, config.head_offset, device)


def pattern_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    config: PatternConfig | None = None,
    state: None = None,
    mask_mod: MaskMod | None = None,
) -> Tensor:
    """Softmax attention under any ``mask_mod``, computed on its non-empty blocks only.

    Args:
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, Dv)``.
        key_padding_mask: bool ``(B, S)``, True marks a real key.
        is_causal: also apply the causal mask (key ``j <= i + S - L``).
        scale: softmax scale, default ``D ** -0.5``.
        config: ``PatternConfig``: the named pattern and the block length.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` on broadcastable index tensors; replaces
            the named pattern. ``h`` is the layer head ``head_offset + h``.

    Returns:
        ``(B, H, L, Dv)``; zero rows for queries that see no key.
    """
    config = config or PatternConfig()
    shape = check_attention_inputs(q, k, v, key_padding_mask, is_causal, scale)
    if mask_mod is not None and not callable(mask_mod):
        raise ValueError(
            f"mask_mod must be a function mask_mod(b, h, q_idx, kv_idx) -> bool tensor, got {type(mask_mod).__name__}"
        )
    if mask_mod is None:  # a named pattern's layout depends only on these: computed once
        groups = _named_pattern_groups(config, PATTERNS[config.name], shape, is_causal, q.device)
    else:  # a user's function may close over anything: its layout is evaluated on every call
        mod = pattern_mask_mod(config, shape.queries, shape.keys, is_causal, mask_mod)
        groups = _pattern_groups(mod, shape, config.block, config.head_offset, q.device)
    return block_sparse_attention(q, k, v, [groups], key_padding_mask, shape.scale, config.kernel)


MECHANISMS = (
    Mechanism(
        name="sparse",
        fn=sparse_attention,
        config=SparseConfig,
        summary="Sparse Transformer strided (local/column/merged) and fixed patterns, block-sparse",
        paper="Child et al. 2019, Generating Long Sequences with Sparse Transformers, §4.2",
        decoder=KVCache,  # exact: the causal pattern of position p reads only keys <= p
        longer_queries=False,
        examples=(
            {},
            {"stride": 4, "block": 4},
            {"stride": 5, "step": "column", "block": 3, "kernel": "eager"},
            {"pattern": "fixed", "stride": 6, "summary": 2, "groups": 2, "block": 4},
            {"stride": 4, "block": 4, "kernel": "native"},
        ),
    ),
    Mechanism(
        name="pattern",
        fn=pattern_attention,
        config=PatternConfig,
        summary="any mask_mod (named, or passed as mask_mod=), block-sparse with autograd",
        paper="mask_mod(b, h, q_idx, kv_idx) patterns, as in FlexAttention",
        tensor_args=("mask_mod",),
        examples=({}, {"window": 4, "block": 4}, {"window": 3, "dilation": 2, "global_tokens": 1, "block": 5}),
    ),
)

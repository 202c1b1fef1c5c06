"""Sparse Transformer attention (Child, Gray, Radford & Sutskever 2019): strided and fixed patterns.

**Patterns** are ``mask_mod(b, h, q_idx, kv_idx) -> bool`` functions (``subquad.masks``), defined
once (``ops.strided_patterns``, and importable from here); ``dense_mask`` turns them into the dense
masks tests compare with, and the block layouts evaluate them for the exact element mask inside
every computed block. Query ``i`` sits at position ``p = i + S − L`` (the queries are the last L
positions, as in every mechanism's ``fn``). With stride (block length) ``l``, as in the authors'
released code (§4.2, Fig. 3):

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
that the union of the parts is exactly the pattern's dense mask. ``ops.strided_patterns`` builds
them and says how each part is computed: the local step in overlapping windows of the keys, the
column step as ``l`` dense attentions over positions regrouped by ``t mod l`` (a strided view),
fixed as its own blocks plus the other blocks' summary keys, gathered once per call per head.

``pattern`` (``mechanisms.pattern``) computes any mask_mod on the same engine.
"""

from __future__ import annotations

import dataclasses
import functools

from torch import Tensor

from subquad._validate import AttentionShape, check_grouped_inputs
from subquad.decoding import KVCache
from subquad.kernels import flex
from subquad.kernels import native as _native
from subquad.kernels.blocksparse import band_blocks, block_sparse_attention
from subquad.kernels.layouts import Group, sink_mask
from subquad.masks import MaskMod, and_masks, not_mask, or_masks, window_covers
from subquad.mechanisms._options import head_offset_option, kernel_option
from subquad.ops.strided_patterns import (
    fixed_mask,
    pattern_mask,
    pattern_parts,
    same_block_mask,
    strided_column_mask,
    strided_local_mask,
    summary_spans,
)
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


def sparse_mask_mod(config: SparseConfig, num_queries: int, num_keys: int, is_causal: bool) -> MaskMod:
    """The whole pattern of ``config`` for L queries and S keys, sinks included: the dense oracle of
    ``sparse``."""
    pattern = pattern_mask(config, num_queries, num_keys, is_causal)
    if not config.sinks:
        return pattern
    return or_masks(pattern, sink_mask(config.sinks, pattern, is_causal, num_keys - num_queries))


# The fixed pattern's summary runs, looked up here each time ``_sparse_parts`` builds a layout: tests
# replace it to size the runs as off the CPU.
_summary_spans = summary_spans


@functools.lru_cache(maxsize=16)
def _sparse_parts(
    config: SparseConfig,
    shape: AttentionShape,
    causal: bool,
    device,
    native: bool = False,
    transposed_band: int | None = None,
) -> list[list[Group]]:
    """The disjoint parts whose union is the pattern (``ops.strided_patterns.pattern_parts``).
    Cached: a layer calls with the same sizes again and again, and the layout depends on nothing
    else."""
    return pattern_parts(config, shape, causal, device, native, transposed_band, _summary_spans)


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
    if flex.usable(q, k, v, config.kernel):  # CUDA: FlexAttention under the same mask
        parts = _flex_parts(config, shape.queries, shape.keys, is_causal)
        heads_vary = config.pattern == "fixed" and config.groups > 1
        out = flex.union_attention(q, k, v, parts, key_padding_mask, shape.scale, enable_gqa, heads_vary)
        if out is not None:
            return out
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


def _flex_parts(config: SparseConfig, num_queries: int, num_keys: int, is_causal: bool) -> list[flex.Part]:
    """The pattern as FlexAttention's parts. The column step, and fixed's summary positions, meet
    every block of keys in order, so they run on positions regrouped by residue mod l
    (``flex.Part.stride``), where the column step is block-diagonal and the summaries c·n
    consecutive keys: the transposition that makes strided attention block-sparse (Child et al.
    §5.5). The local step, fixed's own block and the sinks keep the order; one softmax over the
    disjoint parts."""
    key = (dataclasses.replace(config, block=0), is_causal)  # block sizes the engine only
    if config.pattern == "strided" and config.step == "local":
        return [flex.Part(sparse_mask_mod(config, num_queries, num_keys, is_causal), key)]
    offset = num_keys - num_queries
    if config.pattern == "fixed":  # own block in order; the summaries, c residues mod l, regrouped
        near = [same_block_mask(config.stride, is_causal, offset)]
        far = and_masks(pattern_mask(config, num_queries, num_keys, is_causal), not_mask(near[0]))
    else:
        column = strided_column_mask(config.stride, is_causal, offset)
        near = [strided_local_mask(config.stride, is_causal, offset)] if config.step == "merged" else []
        far = and_masks(column, not_mask(near[0])) if near else column  # the column keys the local step leaves
    if config.sinks:
        near.append(sink_mask(config.sinks, pattern_mask(config, num_queries, num_keys, is_causal), is_causal, offset))
    parts = [flex.Part(or_masks(*near), (*key, "near"))] if near else []
    return [*parts, flex.Part(far, (*key, "far"), config.stride)]


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

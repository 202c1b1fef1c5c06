"""A mechanism added from outside subquad, as a third-party package would: block-local attention.

Query i (at key position p = i + S − L) sees the keys of its own block of ``size`` positions;
causal, those up to p. It is built from subquad's pieces only: the segment layout and the
block-sparse engine run it, ``KVCache`` decodes it, and registering it (the entry point in
``subquad_toy_plugin-0.1.dist-info``) gives it ``subquad list``, the bench, the contract suite and
the GPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from subquad._validate import check_attention_inputs
from subquad.decoding import KVCache
from subquad.kernels.blocksparse import block_sparse_attention
from subquad.kernels.layouts import segment_groups
from subquad.registry import Config, Mechanism, option


@dataclass(frozen=True)
class BlocksConfig(Config):
    mechanism = "toy-blocks"
    size: int = option(16, "positions per block; a query sees its own block (causal: up to itself)", ge=1, le=4096)


def blocks_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    config: BlocksConfig | None = None,
    state: None = None,
) -> Tensor:
    config = config or BlocksConfig()
    shape = check_attention_inputs(q, k, v, key_padding_mask, is_causal, scale)
    if shape.queries > shape.keys:
        raise ValueError(f"toy-blocks needs L <= S, got L={shape.queries} and S={shape.keys}")
    L, S, n = shape.queries, shape.keys, config.size
    offset = S - L
    positions = torch.arange(-(-S // n) * n, device=q.device).view(-1, n)  # (blocks, n)

    def same_block(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        p = q_idx + offset
        same = torch.div(p, n, rounding_mode="floor") == torch.div(kv_idx, n, rounding_mode="floor")
        return same & (kv_idx <= p) & (kv_idx < S) if is_causal else same & (kv_idx < S)

    groups = segment_groups(positions, L, offset, min(n, 32), is_causal, same_block, (n, 1))
    return block_sparse_attention(q, k, v, [groups], key_padding_mask, shape.scale)


MECHANISM = Mechanism(
    name="toy-blocks",
    fn=blocks_attention,
    config=BlocksConfig,
    summary="block-local attention (a plugin example)",
    paper="none: a test of the plugin entry point",
    longer_queries=False,
    decoder=KVCache,
    examples=({}, {"size": 3}, {"size": 5}),
)

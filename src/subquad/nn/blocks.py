"""Transformer blocks built on ``Attention``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as recompute

from subquad.hooks import checkpoint_contexts
from subquad.nn.attention import Attention, AttentionSpec

__all__ = ["MLP", "TransformerBlock"]


class MLP(nn.Module):
    """Position-wise feed-forward: Linear, GELU, Linear."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, hidden, bias=bias)
        self.proj = nn.Linear(hidden, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(nn.functional.gelu(self.fc(x))))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: ``x + Attn(LN(x))`` then ``x + MLP(LN(x))``.

    Args:
        dim: model width.
        num_heads: attention heads.
        attention: a mechanism name (with ``options``), a ``HeadGroup`` or a split into groups.
        mlp_ratio: MLP hidden width as a multiple of ``dim``.
        dropout: on the attention and MLP outputs, before each residual sum.
        seed: seeds the attention's state modules.
        checkpoint: recompute the block's activations in the backward pass instead of keeping them
            (Child et al. 2019, "saving memory by recomputing attention weights"): only the block's
            input is saved during training. The recomputation runs under
            ``subquad.hooks.checkpoint_contexts``: mechanisms see the state their forward saw
            (``replayed``: routing's centroids, which its forward moves) and neither move it nor
            report auxiliary losses a second time (``is_recomputing``), so the recomputation
            repeats the original forward exactly and the state moves once.
        **options: the mechanism's options when ``attention`` is a name.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        attention: AttentionSpec = "full",
        *,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        bias: bool = True,
        seed: int = 0,
        checkpoint: bool = False,
        **options: Any,
    ) -> None:
        super().__init__()
        if not isinstance(checkpoint, bool):
            raise ValueError(f"checkpoint must be True or False, got {checkpoint!r}")
        self.checkpoint = checkpoint
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, attention, bias=bias, seed=seed, **options)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, int(mlp_ratio * dim), dropout, bias)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        cache: list[Any] | None = None,
    ) -> Tensor:
        if self.checkpoint and cache is None and torch.is_grad_enabled():
            return recompute(
                self._forward, x, key_padding_mask, is_causal, None, use_reentrant=False, context_fn=checkpoint_contexts
            )
        return self._forward(x, key_padding_mask, is_causal, cache)

    def _forward(self, x: Tensor, key_padding_mask: Tensor | None, is_causal: bool, cache: list[Any] | None) -> Tensor:
        h = self.norm1(x)
        h = self.attn(h, key_padding_mask=key_padding_mask, is_causal=is_causal, cache=cache)
        x = x + self.dropout(h)
        return x + self.mlp(self.norm2(x))

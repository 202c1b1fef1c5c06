"""Layers and models built from any registered mechanism."""

from subquad.nn.attention import AttentionSpec, HeadGroup, MultiheadAttention
from subquad.nn.blocks import MLP, TransformerBlock
from subquad.nn.models import CausalLM, DecodeCache, Encoder

__all__ = [
    "MLP",
    "AttentionSpec",
    "CausalLM",
    "DecodeCache",
    "Encoder",
    "HeadGroup",
    "MultiheadAttention",
    "TransformerBlock",
]

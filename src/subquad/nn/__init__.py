"""Layers and models built from any registered mechanism."""

from subquad.nn.attention import Attention, AttentionSpec, HeadGroup
from subquad.nn.blocks import MLP, TransformerBlock
from subquad.nn.models import CausalLM, DecodeCache, Encoder
from subquad.nn.multihead import MultiheadAttention

__all__ = [
    "MLP",
    "Attention",
    "AttentionSpec",
    "CausalLM",
    "DecodeCache",
    "Encoder",
    "HeadGroup",
    "MultiheadAttention",
    "TransformerBlock",
]

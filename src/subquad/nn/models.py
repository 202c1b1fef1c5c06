"""Whole models: an ``Encoder`` classifier and a ``CausalLM`` with cached generation.

Both take ``attention``: one layer spec for every layer (a mechanism name, a ``HeadGroup``, or a
tuple of ``HeadGroup`` splitting the heads), or a list with one spec per layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from subquad.nn.attention import AttentionSpec
from subquad.nn.blocks import TransformerBlock
from subquad.registry import no_causal_form

__all__ = ["CausalLM", "DecodeCache", "Encoder"]


def layer_specs(attention: AttentionSpec | list[AttentionSpec], depth: int) -> list[AttentionSpec]:
    """One attention spec per layer: a list gives them per layer, anything else applies to all."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be a positive int, got {depth!r}")
    if not isinstance(attention, list):
        return [attention] * depth
    if len(attention) != depth:
        raise ValueError(
            f"a list of attention specs gives one per layer: got {len(attention)} for depth={depth}. "
            "To split the heads of every layer, pass a tuple of HeadGroup instead"
        )
    return attention


POSITIONS = ("learned", "conv", "both")


class TokenEmbedding(nn.Module):
    """Token embeddings plus order information, with input checks.

    ``position`` chooses how order enters: ``learned`` absolute position embeddings; ``conv`` a causal
    convolution over the token embeddings (``conv_width`` positions: each output sees its token and
    the ``conv_width - 1`` before it) in their place, the input option of Spellings (2019, Table 1)
    that lets agglomerative attention match full attention on characters; ``both`` adds the two.
    Decoding keeps the last ``conv_width - 1`` embeddings in the ``DecodeCache``.
    """

    def __init__(self, vocab_size: int, dim: int, max_len: int, position: str = "learned", conv_width: int = 8) -> None:
        super().__init__()
        if position not in POSITIONS:
            raise ValueError(f"position must be one of {', '.join(POSITIONS)}, got {position!r}")
        if isinstance(conv_width, bool) or not isinstance(conv_width, int) or conv_width < 1:
            raise ValueError(f"conv_width must be a positive int, got {conv_width!r}")
        self.vocab_size, self.max_len, self.position = vocab_size, max_len, position
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(max_len, dim) if position != "conv" else None
        self.conv = nn.Conv1d(dim, dim, conv_width) if position != "learned" else None

    def forward(self, tokens: Tensor, offset: int = 0, cache: DecodeCache | None = None) -> Tensor:
        if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.dtype != torch.long:
            got = f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must be a (B, N) long tensor, got {got}")
        end = offset + tokens.shape[1]
        if end > self.max_len:
            raise ValueError(f"sequence reaches position {end} but max_len={self.max_len}; build with a larger max_len")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.vocab_size}), got range [{int(tokens.min())}, {int(tokens.max())}]"
            )
        x = self.tokens(tokens)  # (B, N, E)
        out = x if self.positions is None else x + self.positions(torch.arange(offset, end, device=tokens.device))
        if self.conv is not None:
            out = out + self._causal_conv(x, cache) if self.positions is not None else self._causal_conv(x, cache)
        return out

    def _causal_conv(self, x: Tensor, cache: DecodeCache | None) -> Tensor:
        """Conv1d over positions, left-padded with zeros (or the cached last embeddings)."""
        width = self.conv.kernel_size[0]
        history = None if cache is None else cache.conv_history
        if history is None:
            history = x.new_zeros(x.shape[0], width - 1, x.shape[2])
        extended = torch.cat([history, x], dim=1)  # (B, width - 1 + N, E)
        if cache is not None:
            cache.conv_history = extended[:, extended.shape[1] - (width - 1) :]
        return self.conv(extended.transpose(1, 2)).transpose(1, 2)  # (B, N, E)


class _Backbone(nn.Module):
    """Embeddings, a stack of pre-LN blocks and a final LayerNorm."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        depth: int,
        num_heads: int,
        attention: AttentionSpec | list[AttentionSpec],
        max_len: int,
        mlp_ratio: float,
        dropout: float,
        seed: int,
        position: str = "learned",
        conv_width: int = 8,
        checkpoint: bool = False,
    ) -> None:
        super().__init__()
        self.embed = TokenEmbedding(vocab_size, dim, max_len, position, conv_width)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                dim, num_heads, spec, mlp_ratio=mlp_ratio, dropout=dropout, seed=seed + 1000 * i, checkpoint=checkpoint
            )
            for i, spec in enumerate(layer_specs(attention, depth))
        )
        self.norm = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)
        self.apply(_init_weights)

    def features(
        self,
        tokens: Tensor,
        key_padding_mask: Tensor | None,
        is_causal: bool,
        cache: DecodeCache | None = None,
    ) -> Tensor:
        x = self.dropout(self.embed(tokens, offset=0 if cache is None else cache.length, cache=cache))  # (B, N, E)
        for i, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache.layers[i]
            x = block(x, key_padding_mask=key_padding_mask, is_causal=is_causal, cache=layer_cache)
        if cache is not None:
            cache.length += tokens.shape[1]
        return self.norm(x)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class Encoder(nn.Module):
    """Bidirectional Transformer encoder with a classification head (mean pooling over real tokens).

    Args:
        vocab_size, dim, depth, num_heads: the usual sizes.
        num_classes: outputs of the classifier.
        attention: one layer spec for all layers, or a list with one per layer.
        max_len: longest sequence (learned position embeddings).
        mlp_ratio, dropout: block settings.
        seed: seeds the mechanisms' state modules.
        position, conv_width: how order enters (``TokenEmbedding``): learned positions, a causal
            convolution of ``conv_width`` tokens, or both.
        checkpoint: recompute each block's activations in the backward pass (less memory, more time).

    Shape:
        tokens ``(B, N)`` long; key_padding_mask bool ``(B, N)``, True = real; output ``(B, num_classes)``.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        depth: int,
        num_heads: int,
        num_classes: int,
        *,
        attention: AttentionSpec | list[AttentionSpec] = "full",
        max_len: int = 1024,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        seed: int = 0,
        position: str = "learned",
        conv_width: int = 8,
        checkpoint: bool = False,
    ) -> None:
        super().__init__()
        self.backbone = _Backbone(
            vocab_size, dim, depth, num_heads, attention, max_len, mlp_ratio, dropout, seed, position, conv_width,
            checkpoint,
        )  # fmt: skip
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        x = self.backbone.features(tokens, key_padding_mask, is_causal=False)  # (B, N, E)
        if key_padding_mask is None:
            pooled = x.mean(dim=1)
        else:
            weights = key_padding_mask.to(x.dtype).unsqueeze(-1)  # (B, N, 1)
            pooled = (x * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)
        return self.head(pooled)  # (B, num_classes)


class DecodeCache:
    """Per-layer decoding caches of a ``CausalLM`` and the number of tokens they hold."""

    def __init__(self, layers: list[list[Any]]) -> None:
        self.layers = layers
        self.length = 0
        self.conv_history: Tensor | None = None  # the last embeddings, for a convolutional input


class CausalLM(nn.Module):
    """Decoder-only language model: embeddings, causal pre-LN blocks, tied output head.

    Args:
        vocab_size, dim, depth, num_heads: the usual sizes.
        attention: one layer spec for all layers, or a list with one per layer.
        max_len: longest sequence, prompt plus generated tokens.
        mlp_ratio, dropout: block settings.
        seed: seeds the mechanisms' state modules.
        position, conv_width: how order enters (``TokenEmbedding``): learned positions, a causal
            convolution of ``conv_width`` tokens (Spellings 2019), or both.
        checkpoint: recompute each block's activations in the backward pass (less memory, more time).

    Shape:
        tokens ``(B, N)`` long; output logits ``(B, N, vocab_size)``.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        depth: int,
        num_heads: int,
        *,
        attention: AttentionSpec | list[AttentionSpec] = "full",
        max_len: int = 1024,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        seed: int = 0,
        position: str = "learned",
        conv_width: int = 8,
        checkpoint: bool = False,
    ) -> None:
        super().__init__()
        self.backbone = _Backbone(
            vocab_size, dim, depth, num_heads, attention, max_len, mlp_ratio, dropout, seed, position, conv_width,
            checkpoint,
        )  # fmt: skip
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.backbone.embed.tokens.weight  # tied
        for block in self.backbone.blocks:  # a causal model: refused when built, not at its first forward
            for group in block.attn.groups:
                if not group.mechanism.causal:
                    raise ValueError(no_causal_form(group.mechanism.name))

    def forward(
        self, tokens: Tensor, *, key_padding_mask: Tensor | None = None, cache: DecodeCache | None = None
    ) -> Tensor:
        """Next-token logits ``(B, N, V)``; with ``cache``, ``tokens`` continue the cached sequence (a
        refused step leaves the cache as it was)."""
        history = None if cache is None else cache.conv_history
        if history is not None and history.shape[0] != tokens.shape[0]:
            raise ValueError(f"this cache holds a batch of {history.shape[0]}, got {tokens.shape[0]} rows; start a new "
                             "cache (new_cache) for a new batch")  # fmt: skip
        try:
            return self.head(self.backbone.features(tokens, key_padding_mask, is_causal=True, cache=cache))
        except Exception:
            if cache is not None:  # the input convolution's history is written before the layers check the step
                cache.conv_history = history
            raise

    def loss(self, tokens: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """Mean next-token cross-entropy over positions whose target is a real token."""
        logits = self(tokens[:, :-1], key_padding_mask=None if key_padding_mask is None else key_padding_mask[:, :-1])
        targets = tokens[:, 1:]
        if key_padding_mask is not None:
            targets = targets.masked_fill(~key_padding_mask[:, 1:], -100)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def new_cache(self) -> DecodeCache:
        """An empty decoding cache for ``forward(..., cache=...)`` and ``generate``."""
        return DecodeCache([block.attn.new_cache() for block in self.backbone.blocks])

    @torch.no_grad()
    def generate(
        self,
        tokens: Tensor,
        max_new_tokens: int,
        *,
        use_cache: bool = True,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Continue ``tokens`` ``(B, T)`` by ``max_new_tokens``; returns ``(B, T + max_new_tokens)``.

        ``temperature=0`` is greedy. Sampling draws from ``generator`` (seed it to reproduce), on
        the generator's device: a CPU generator gives the same tokens on every device.
        With ``use_cache`` each new token runs the layers on that token alone.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        if not temperature >= 0 or temperature == float("inf"):  # NaN fails the first test
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator (seeded to reproduce) or None, got {generator!r}")
        if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.shape[1] == 0:
            got = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(
                f"generate continues a prompt of shape (B, T) with T >= 1, got {got}: the next token is "
                "predicted from the last one; start from a token of your own, e.g. torch.zeros(B, 1, dtype=torch.long)"
            )
        total = tokens.shape[-1] + max_new_tokens
        if total > self.backbone.embed.max_len:
            raise ValueError(f"prompt plus max_new_tokens is {total} tokens but max_len={self.backbone.embed.max_len}")
        cache = self.new_cache() if use_cache else None
        out, step_input = tokens, tokens
        for _ in range(max_new_tokens):
            logits = self(step_input if use_cache else out, cache=cache)[:, -1]  # (B, V)
            next_token = _pick(logits, temperature, top_k, generator)  # (B, 1)
            out = torch.cat([out, next_token], dim=1)
            step_input = next_token
        return out


def _pick(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        threshold = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if generator is not None and generator.device.type != probs.device.type:
        # Draw on the generator's device: one seed gives the same tokens wherever the model runs.
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator)

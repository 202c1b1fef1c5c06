"""The attention layer over any registered mechanism, or several at once (``Attention``).

A layer's heads form one or more ``HeadGroup``s, each running one mechanism with one config: the
Routing Transformer's mix of local and routing heads is ``(HeadGroup("local", 4, ...),
HeadGroup("routing", 4, ...))``. The layer owns everything a mechanism declares in its registry
record: the projections, the persistent state module (``Mechanism.state``), the producer of extra
tensors (``Mechanism.inputs``) and, for decoding, the caches (``Mechanism.decoder``).
A new mechanism therefore plugs in here without a change to this file. In self-attention the key
padding mask also marks the padded queries, so it is passed as ``query_padding_mask`` to mechanisms
that take one.

``Attention`` keeps subquad's conventions (batch first, ``key_padding_mask`` True = real token,
the output alone). ``subquad.nn.MultiheadAttention`` is torch's class with these heads inside, and
torch's conventions.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from subquad.call import call
from subquad.config import joined_options, parse_spec
from subquad.registry import Config, Mechanism, get_mechanism, make_config

__all__ = ["Attention", "AttentionSpec", "HeadGroup", "HeadGroups"]


class HeadGroup:
    """A group of heads that run one mechanism with one config.

    Args:
        mechanism: a registered mechanism name.
        heads: how many of the layer's heads; ``None`` takes the heads no other group claims.
        **options: the mechanism's config options, checked now against its dataclass.
    """

    def __init__(self, mechanism: str, heads: int | None = None, **options: Any) -> None:
        if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
            raise ValueError(f"HeadGroup heads must be a positive int or None, got {heads!r}")
        self.mechanism: Mechanism = get_mechanism(mechanism)
        self.heads = heads
        self.config: Config = make_config(self.mechanism, **options)

    def with_heads(self, heads: int) -> HeadGroup:
        """A copy of this group with ``heads`` heads."""
        group = copy.copy(self)
        group.heads = heads
        return group

    def __repr__(self) -> str:
        return f"HeadGroup({self.mechanism.name!r}, heads={self.heads}, config={self.config})"


# One layer's attention: a mechanism name, one group, or a split of the heads into groups.
AttentionSpec = str | HeadGroup | Sequence[HeadGroup]


def spec_head_groups(text: str, **options: Any) -> list[HeadGroup]:
    """The head groups of a spec string (``subquad.config.parse_spec``): ``"local:window=64"`` or a
    mix such as ``"local:window=128*2+routing*2"``. ``options`` join a single group's own."""
    groups = parse_spec(text)
    if options and len(groups) > 1:
        raise ValueError(f"options {sorted(options)} apply to a single mechanism; put them in the spec {text!r}")
    made = []
    for g in groups:
        made.append(HeadGroup(g.name, g.heads, **joined_options(g, options, text)))
    return made


def resolve_head_groups(spec: AttentionSpec, num_heads: int, options: dict[str, Any]) -> list[HeadGroup]:
    """Turn a layer spec (a spec string, a ``HeadGroup`` or a sequence of them) into head groups
    whose head counts are set and sum to ``num_heads``."""
    if isinstance(spec, str):
        spec, options = spec_head_groups(spec, **options), {}
    if options:
        raise ValueError(f"options {sorted(options)} apply to a mechanism name only; put them in the HeadGroup instead")
    groups = [spec] if isinstance(spec, HeadGroup) else list(spec)
    if not groups or not all(isinstance(g, HeadGroup) for g in groups):
        raise ValueError(f"attention must be a mechanism name, a HeadGroup or a sequence of them, got {spec!r}")
    open_groups = [g for g in groups if g.heads is None]
    claimed = sum(g.heads for g in groups if g.heads is not None)
    if len(open_groups) > 1:
        raise ValueError("at most one HeadGroup may leave heads=None (it takes the remaining heads)")
    if open_groups and claimed >= num_heads:
        raise ValueError(f"head groups claim {claimed} of {num_heads} heads, leaving none for heads=None")
    if not open_groups and claimed != num_heads:
        counts = [g.heads for g in groups]
        raise ValueError(f"head groups {counts} cover {claimed} heads but the layer has num_heads={num_heads}")
    return [g if g.heads is not None else g.with_heads(num_heads - claimed) for g in groups]


class HeadGroups:
    """What a layer owns for its head groups (mixin): the groups, their state modules
    (``Mechanism.state``) and their producers of extra tensors (``Mechanism.inputs``), and the
    call of each group's mechanism on its heads."""

    groups: list[HeadGroup]
    states: nn.ModuleDict
    inputs: nn.ModuleDict

    def _init_groups(self, spec: AttentionSpec, num_heads: int, embed_dim: int, seed: int, options: dict) -> None:
        self.groups = resolve_head_groups(spec, num_heads, options)
        self.states, self.inputs = nn.ModuleDict(), nn.ModuleDict()
        for i, g in enumerate(self.groups):
            if g.mechanism.state is not None:
                self.states[str(i)] = g.mechanism.state(g.config, g.heads, embed_dim // num_heads, seed + i)
            if g.mechanism.inputs is not None:
                self.inputs[str(i)] = g.mechanism.inputs(g.config, embed_dim, g.heads)

    def new_cache(self) -> list[Any]:
        """A fresh decoding cache: one decoder per head group."""
        caches = []
        for i, g in enumerate(self.groups):
            if g.mechanism.decoder is None:
                raise ValueError(
                    f"{g.mechanism.name} has no decoder for cached generation; generate with use_cache=False"
                )
            state = self.states[str(i)] if str(i) in self.states else None
            caches.append(g.mechanism.decoder(g.mechanism, g.config, state))
        return caches

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, query: Tensor, key: Tensor, key_padding_mask: Tensor | None,
        query_padding_mask: Tensor | None, causal: Any, cache: list[Any] | None = None, dropout_p: float = 0.0,
    ) -> Tensor:  # fmt: skip
        """Each group's mechanism on its heads of ``q, k, v`` ``(B, H, ·, Dh)``; ``query``, ``key``
        are the layer's inputs ``(B, ·, E)`` (for ``inputs``); ``causal``: False, True (SDPA's
        form) or a ``CausalBias``. Returns ``(B, H, L, Dv)``."""
        outputs, start = [], 0
        causal_args = {"is_causal": causal} if isinstance(causal, bool) else {"attn_mask": causal}
        if dropout_p:
            causal_args["dropout_p"] = dropout_p
        for i, g in enumerate(self.groups):
            heads = slice(start, start + g.heads)
            start += g.heads
            tensors = self.inputs[str(i)](query, key) if str(i) in self.inputs else {}
            if "query_padding_mask" in g.mechanism.tensor_args:
                if query_padding_mask is not None:
                    tensors["query_padding_mask"] = query_padding_mask
                elif key is query and key_padding_mask is not None:
                    tensors["query_padding_mask"] = key_padding_mask  # self-attention: the same tokens
            if cache is not None:
                outputs.append(cache[i].step(q[:, heads], k[:, heads], v[:, heads], **tensors))
                continue
            state = self.states[str(i)] if str(i) in self.states else None
            out = call(
                g.mechanism, q[:, heads], k[:, heads], v[:, heads], key_padding_mask=key_padding_mask,
                config=g.config, state=state, **causal_args, **tensors,
            )  # fmt: skip
            outputs.append(out)
        return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]  # (B, H, L, Dh)

    def _groups_repr(self) -> str:
        return ", ".join(f"{g.mechanism.name}×{g.heads}" for g in self.groups)


class Attention(HeadGroups, nn.Module):
    """Batch-first multi-head attention whose heads run registered mechanisms, with subquad's
    conventions: ``key_padding_mask`` True = a real token, and the output alone is returned. (For
    torch's conventions, use ``subquad.nn.MultiheadAttention``.)

    Args:
        embed_dim: model width E.
        num_heads: H; E must divide by H.
        mechanism: a mechanism name (with ``options``), a ``HeadGroup``, or a sequence of
            ``HeadGroup`` that splits the heads between mechanisms.
        kdim, vdim: widths of the key and value inputs for cross-attention (default E).
        bias: whether the projections have biases.
        seed: seeds the mechanisms' state modules (hash planes, initial centroids).
        **options: the mechanism's config options when ``mechanism`` is a name.

    Shape:
        query ``(B, L, E)``; key ``(B, S, kdim)``; value ``(B, S, vdim)``; output ``(B, L, E)``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        mechanism: AttentionSpec = "full",
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        seed: int = 0,
        **options: Any,
    ) -> None:
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self._init_groups(mechanism, num_heads, embed_dim, seed, options)
        # Mechanisms that read only the shapes of q and k (agglomerative) get no projections for them.
        uses_qk = any(g.mechanism.uses_qk for g in self.groups)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias) if uses_qk else None
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias) if uses_qk else None
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        query_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        cache: list[Any] | None = None,
    ) -> Tensor:
        """Attend ``query`` to ``key``/``value`` (to itself when they are None).

        ``key_padding_mask`` is bool ``(B, S)``, True = a real token. Mechanisms that group their
        queries (clustered, routing) also need to know the padded queries: in self-attention they
        are the padded keys; in cross-attention pass ``query_padding_mask`` ``(B, L)``.
        ``is_causal`` with L != S aligns as SDPA does (query ``i`` sees keys ``j <= i``).
        With ``cache`` (from ``new_cache``), ``query`` holds the next tokens of a causal
        self-attention sequence; their keys and values are appended to the cache.
        """
        key = query if key is None else key
        value = key if value is None else value
        if not isinstance(is_causal, bool):  # anything else would be read as a causal bias, or dropped
            raise ValueError(f"is_causal must be True or False, got {is_causal!r}")
        self._check_inputs(query, key, value)
        if cache is not None and (key is not query or key_padding_mask is not None or not is_causal):
            raise ValueError("a decoding cache needs causal self-attention without key_padding_mask")
        v = self._split_heads(self.v_proj(value))  # (B, H, S, Dh)
        if self.q_proj is not None:
            q = self._split_heads(self.q_proj(query))  # (B, H, L, Dh)
            k = self._split_heads(self.k_proj(key))  # (B, H, S, Dh)
        else:  # shapes only: zero-stride views of one element
            q = v.new_zeros(()).expand(v.shape[0], self.num_heads, query.shape[1], self.head_dim)
            k = v.new_zeros(()).expand(v.shape)
        out = self._attend(q, k, v, query, key, key_padding_mask, query_padding_mask, is_causal, cache)
        B, _, L, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, L, self.embed_dim))  # (B, L, E)

    def _split_heads(self, x: Tensor) -> Tensor:
        B, N, _ = x.shape
        return x.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, N, Dh)

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        for name, x, width in (
            ("query", query, self.embed_dim),
            ("key", key, self.kdim),
            ("value", value, self.vdim),
        ):
            if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != width:
                got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"{name} must be (B, N, {width}) (batch first), got {got}")
        if not (query.shape[0] == key.shape[0] == value.shape[0]):
            raise ValueError(f"batch sizes differ: query {query.shape[0]}, key {key.shape[0]}, value {value.shape[0]}")
        if key.shape[1] != value.shape[1]:
            raise ValueError(f"key and value lengths differ: {key.shape[1]} and {value.shape[1]}")

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, heads=[{self._groups_repr()}]"

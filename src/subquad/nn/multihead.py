"""``torch.nn.MultiheadAttention`` with its heads running registered mechanisms: a drop-in.

It *is* torch's class (a subclass): the same constructor, the same parameters (``in_proj_weight``
or ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``, ``in_proj_bias``, ``out_proj``), so torch's
layer's state dict loads into it as is (a mechanism's own state, ``states.*`` and ``inputs.*``
where it has one, such as routing's centroids, then keeps the values it has; torch's layer has no
place for those the other way: drop them, or load with ``strict=False``), and torch's conventions: sequence first unless
``batch_first=True``, ``key_padding_mask`` True = *padding* (or an additive float mask),
``attn_mask`` True = *not allowed* (or additive), and ``(output, weights)`` returned.

With ``mechanism="full"`` and its default options the forward *is* torch's own, weights included.
Any other mechanism differs where it must, and says so:

- ``weights`` is None: a sub-quadratic mechanism never forms the (L, S) weight matrix.
- ``attn_mask`` may only be a causal mask (top-left, which is what ``is_causal=True`` means, or
  lower-right); any other mask raises, naming ``full`` and ``pattern`` as the mechanisms that take
  one. ``is_causal=True`` alone is accepted too (torch requires the mask as a hint).
- ``add_bias_kv`` and ``add_zero_attn`` raise: they append a key to every sequence, which a
  mechanism with positions (windows, strides, causal scans) has no place for.
- In inference torch's ``TransformerEncoderLayer`` runs its own fused kernel on ``self_attn``'s
  projections instead of calling it; a no-op forward pre-hook keeps it on the path that calls this
  forward (torch >= 2.5 checks for hooks there; before, use the layer in training mode or with
  gradients, or ``torch.backends.mha.set_fastpath_enabled(False)``), and the nested batch
  ``TransformerEncoder`` then passes is taken (``_nested``).
- Mechanisms that group their queries (clustered, routing) need the padded queries: in
  self-attention they are the padded keys; in cross-attention pass ``query_padding_mask``
  (True = padding, as ``key_padding_mask`` here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from subquad.call import causal_lower_right
from subquad.nn.attention import AttentionSpec, HeadGroup, HeadGroups
from subquad.registry import make_config

__all__ = ["MultiheadAttention"]


class MultiheadAttention(HeadGroups, nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` whose heads run ``mechanism`` (module docstring).

    Args:
        embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first,
            device, dtype: as torch's.
        mechanism: a mechanism name (with ``options``), a ``HeadGroup``, or a sequence of them.
        seed: seeds the mechanisms' state modules.
        **options: the mechanism's config options when ``mechanism`` is a name.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: Any = None,
        dtype: Any = None,
        *,
        mechanism: AttentionSpec = "full",
        seed: int = 0,
        **options: Any,
    ) -> None:
        if isinstance(dropout, (str, HeadGroup, Sequence)):
            raise ValueError(
                f"subquad.nn.MultiheadAttention takes torch's arguments (the third is dropout), got {dropout!r}: pass "
                "mechanism=... by keyword. Its conventions are torch's: sequence first unless batch_first=True, "
                "key_padding_mask True = padding, (output, weights) returned. The batch-first layer with "
                "key_padding_mask True = real token is subquad.nn.Attention"
            )
        super().__init__(
            embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype
        )
        self._init_groups(mechanism, num_heads, embed_dim, seed, options)
        self.states.to(device=device, dtype=dtype)
        self.inputs.to(device=device, dtype=dtype)
        only = self.groups[0] if len(self.groups) == 1 else None
        self._torch_forward = only is not None and only.mechanism.name == "full" and only.config == make_config("full")
        if not self._torch_forward:
            self.register_forward_pre_hook(_own_forward)
            if add_bias_kv or add_zero_attn:
                raise ValueError(
                    f"add_bias_kv and add_zero_attn append a key to every sequence, which {self._groups_repr()} has "
                    "no place for; leave them False, or use mechanism='full'"
                )
            if dropout and not all(g.mechanism.dropout for g in self.groups):
                raise ValueError(
                    f"{self._groups_repr()} has no attention dropout (dropout={dropout}); pass dropout=0.0, or "
                    "use mechanism='full'"
                )

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        query_padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """torch's forward; ``weights`` is None unless the mechanism is torch's own (module docstring)."""
        if key is None or value is None:
            raise ValueError(
                "MultiheadAttention takes query, key and value as torch's does (self-attention: mha(x, x, x)); "
                "the layer that took mha(x), batch first with True = real token, is subquad.nn.Attention"
            )
        if self._torch_forward:
            if query_padding_mask is not None:
                raise ValueError("query_padding_mask is for mechanisms that group their queries; full takes none")
            return super().forward(
                query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        if query.is_nested:
            return _nested(self, query, key, value, key_padding_mask, attn_mask, is_causal, query_padding_mask)
        same = key is query
        batched = query.dim() == 3
        query, key, value = (self._batch_first(x, name, batched) for name, x in zip(("query", "key", "value"),
                                                                                   (query, key, value)))  # fmt: skip
        key = query if same else key
        B, L, S = query.shape[0], query.shape[1], key.shape[1]
        real = _real("key_padding_mask", key_padding_mask, batched)
        real_queries = _real("query_padding_mask", query_padding_mask, batched)
        causal = _causal(self._groups_repr(), attn_mask, is_causal, L, S)
        q, k, v = (
            x.view(B, -1, self.num_heads, self.head_dim).transpose(1, 2) for x in _project(self, query, key, value)
        )
        out = self._attend(q, k, v, query, key, real, real_queries, causal,
                           dropout_p=self.dropout if self.training else 0.0)  # fmt: skip
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, self.embed_dim))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return (out if batched else out.squeeze(1 if not self.batch_first else 0)), None

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        """torch's layer's state dict loads: the mechanism's state keeps its values (``_keep_own_state``)."""
        _keep_own_state(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _batch_first(self, x: Tensor, name: str, batched: bool) -> Tensor:
        """``x`` as ``(B, N, ·)``; checks its rank against the query's."""
        if not isinstance(x, Tensor) or x.dim() != (3 if batched else 2):
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            layout = ("(N, B, E)" if not self.batch_first else "(B, N, E)") if batched else "(N, E)"
            raise ValueError(f"{name} must be {layout} like the query, got {got}")
        if not batched:
            return x.unsqueeze(0)
        return x if self.batch_first else x.transpose(0, 1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}heads=[{self._groups_repr()}]"


def _keep_own_state(layer: nn.Module, state_dict: dict, prefix: str) -> None:
    """Where ``state_dict`` holds none of ``layer``'s mechanism state (``states.*``, ``inputs.*``: a
    state dict of torch's layer), fill it in with the present values, as ``BatchNorm`` fills in a
    missing ``num_batches_tracked``; a state dict holding some of it loads as it is (what it lacks
    is missing)."""
    own = {f"{prefix}{name}": x for name, x in layer.state_dict().items() if name.startswith(("states.", "inputs."))}
    if own and not any(name in state_dict for name in own):
        state_dict.update(own)


def _own_forward(module: nn.Module, args: Any) -> None:
    """A forward pre-hook that does nothing, on layers whose forward is not torch's: torch's
    ``TransformerEncoderLayer`` in inference runs its fused kernel on ``self_attn``'s projections
    (full attention) without calling ``self_attn``, unless a hook is attached to one of its modules."""


def _nested(
    layer: MultiheadAttention, x: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None,
    attn_mask: Tensor | None, is_causal: bool, query_padding_mask: Tensor | None,
) -> tuple[Tensor, None]:  # fmt: skip
    """Self-attention over a nested batch (torch's ``TransformerEncoder`` passes one in inference
    where a ``src_key_padding_mask`` is given): padded, each sequence's padding as
    ``key_padding_mask``, and returned nested as it came."""
    if key is not x or value is not x or not layer.batch_first or key_padding_mask is not None:
        raise ValueError(
            "a nested query is taken in self-attention only (mha(x, x, x)), with batch_first=True and no "
            "key_padding_mask (its lengths are the padding), as torch's TransformerEncoder passes it; pass a "
            "padded batch and key_padding_mask otherwise"
        )
    lengths = [t.shape[0] for t in x.unbind()]
    padded = torch.nested.to_padded_tensor(x, 0.0)
    padding = (
        torch.arange(padded.shape[1], device=padded.device) >= torch.tensor(lengths, device=padded.device)[:, None]
    )
    out, _ = layer(padded, padded, padded, padding, False, attn_mask, is_causal=is_causal,
                   query_padding_mask=query_padding_mask)  # fmt: skip
    return torch.nested.as_nested_tensor([o[:n] for o, n in zip(out, lengths)], layout=x.layout), None


def _project(layer: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """torch's input projections, from ``layer``'s own parameters."""
    E = layer.embed_dim
    if layer._qkv_same_embed_dim:
        weights = layer.in_proj_weight.split(E)
    else:
        weights = (layer.q_proj_weight, layer.k_proj_weight, layer.v_proj_weight)
    biases = layer.in_proj_bias.split(E) if layer.in_proj_bias is not None else (None, None, None)
    for name, x, w in zip(("query", "key", "value"), (query, key, value), weights):
        if x.shape[-1] != w.shape[1]:
            raise ValueError(f"{name} has {x.shape[-1]} features, but this layer takes {w.shape[1]}")
    if query.shape[0] != key.shape[0] or key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"query, key and value disagree on batch or length: {tuple(query.shape)}, {tuple(key.shape)}, "
            f"{tuple(value.shape)} (batch first)"
        )
    return tuple(F.linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))  # type: ignore[return-value]


def _causal(who: str, attn_mask: Tensor | None, is_causal: bool, L: int, S: int) -> Any:
    """False, True (top-left) or a lower-right ``CausalBias``, from torch's ``attn_mask``
    (True / -inf = not allowed), which governs when given, as in torch."""
    if attn_mask is None:
        return bool(is_causal)
    if not isinstance(attn_mask, Tensor) or attn_mask.shape != (L, S):
        got = tuple(attn_mask.shape) if isinstance(attn_mask, Tensor) else type(attn_mask).__name__
        raise ValueError(f"{who} takes an attn_mask of shape (L, S) = ({L}, {S}) only, got {got}")
    allowed = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask == 0
    if attn_mask.dtype != torch.bool and not bool((allowed | (attn_mask == float("-inf"))).all()):
        raise ValueError("a float attn_mask here may hold only 0 (allowed) and -inf (not allowed)")
    ones = torch.ones(L, S, dtype=torch.bool, device=attn_mask.device)
    if bool(allowed.all()):
        return False
    if torch.equal(allowed, ones.tril()):
        return True
    if torch.equal(allowed, ones.tril(S - L)):
        return causal_lower_right(L, S)
    raise ValueError(
        f"{who} takes no attn_mask but a causal one (top-left, as is_causal=True, or lower-right); "
        "use mechanism='full' with its default options (torch's own forward: any mask) or 'pattern' (a mask_mod)"
    )


def _real(name: str, mask: Tensor | None, batched: bool) -> Tensor | None:
    """torch's padding mask (True or -inf = padding) as subquad's: bool, True = real."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dim() != (2 if batched else 1):
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"{name} must be {'(B, S)' if batched else '(S,)'}, True = padding, got {got}")
    if mask.dtype == torch.bool:
        real = ~mask
    elif not mask.is_floating_point():
        raise ValueError(f"{name} must be bool (True = padding) or float (-inf = padding), got {mask.dtype}")
    else:
        real = mask == 0
        if not bool((real | (mask == float("-inf"))).all()):
            raise ValueError(f"a float {name} here may hold only 0 (a token) and -inf (padding)")
    return real if batched else real.unsqueeze(0)

"""Full softmax attention: the reference, the test oracle and the baseline of every benchmark ratio.

    Attention(Q, K, V) = softmax(Q Kᵀ · scale + mask) V        (Vaswani et al. 2017, eq. 1)

Two backends compute it. ``sdpa`` (the default) calls torch's fused
``scaled_dot_product_attention``, which never materialises the (L, S) score matrix when no dense
mask is needed. ``eager`` is the plain matmul-softmax-matmul, with the softmax in at least fp32:
the readable reference, the path ``attention_weights`` takes, and the one to choose for double
backward, which torch's fused CPU kernel does not have (a need no call can detect in advance).
Tests prove the two agree.

Queries that see no key (every key padded, or causal with L > S) return zeros: their mask row is
lifted before the softmax, so no NaN enters the forward or the backward, and the row is zeroed
after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from subquad._validate import AttentionShape, check_attention_inputs, check_grouped_inputs
from subquad.decoding import KVCache
from subquad.masks import contract_mask, visible_queries
from subquad.registry import Config, Mechanism, option

__all__ = ["FullConfig", "attention_weights", "full_attention"]

# torch's SDPA reads grouped-query keys and values in place from torch 2.5 on (``enable_gqa``).
_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


@dataclass(frozen=True)
class FullConfig(Config):
    mechanism = "full"
    backend: str = option(
        "sdpa",
        "sdpa: torch's fused kernel; eager: matmul-softmax-matmul in fp32+ (reference; double backward)",
        choices=("sdpa", "eager"),
    )


def full_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    attn_mask: Tensor | None = None,
    config: FullConfig | None = None,
    state: None = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
) -> Tensor:
    """Exact softmax attention under the contract's masks and an optional dense ``attn_mask``.

    Args:
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, Dv)``.
        key_padding_mask: bool ``(B, S)``, True marks a real token.
        is_causal: query ``i`` sees keys ``j <= i + S - L``.
        scale: default ``D ** -0.5``.
        attn_mask: broadcastable to ``(B, H, L, S)``; bool (True = may attend) or additive float.
        config: ``FullConfig``.
        enable_gqa: k and v may have ``H / G`` heads (grouped-query attention); each serves G
            consecutive query heads, read in place.
        dropout_p: attention dropout on the weights (as torch's SDPA; use it in training only).

    Returns:
        ``(B, H, L, Dv)``; zero rows for queries that see no key.
    """
    config = config or FullConfig()
    shape = check_grouped_inputs(q, k, v, key_padding_mask, is_causal, scale, enable_gqa)
    groups = q.shape[1] // k.shape[1]
    if attn_mask is not None:
        attn_mask = _check_attn_mask(attn_mask, shape, q)
    if attn_mask is None and key_padding_mask is None and (not is_causal or shape.queries == shape.keys):
        mask, visible = None, None  # the fused kernel's own causal flag applies (L == S)
    else:
        mask, visible = _merged_mask(shape, key_padding_mask, is_causal, attn_mask, q)
        is_causal = False
    if config.backend == "eager":
        if is_causal:
            mask, _ = _merged_mask(shape, None, True, None, q)
        out = _eager(q, k, v, mask, shape.scale, groups, dropout_p)
    else:
        if mask is not None and mask.is_floating_point():
            mask = _in_dtype(mask, q.dtype)  # the fused kernel takes an additive mask in q's dtype
        if groups > 1 and not _SDPA_GQA:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        gqa = {"enable_gqa": True} if groups > 1 and _SDPA_GQA else {}
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=shape.scale, **gqa
        )
    return out if visible is None else out.masked_fill(~visible, 0.0)


def attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    attn_mask: Tensor | None = None,
) -> Tensor:
    """The dense attention matrix ``(B, H, L, S)`` of ``full_attention``, in fp32 or wider.

    Rows of queries that see no key are zero. O(L·S) memory: for tests and analysis.
    """
    shape = check_attention_inputs(q, k, k, key_padding_mask, is_causal, scale)
    if attn_mask is not None:
        attn_mask = _check_attn_mask(attn_mask, shape, q)
    mask, visible = _merged_mask(shape, key_padding_mask, is_causal, attn_mask, q)
    weights = _softmax_weights(q, k, mask, shape.scale)
    return weights if visible is None else weights.masked_fill(~visible, 0.0)


def _softmax_weights(q: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    compute = torch.promote_types(q.dtype, torch.float32)  # softmax statistics in >= fp32
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * scale  # (B, H, L, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, dim=-1)


def _eager(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, groups: int = 1, dropout_p: float = 0.0
) -> Tensor:
    """Matmul, softmax, matmul. With ``groups`` G > 1 the query heads are viewed as ``(Hkv, G)``
    against keys and values of ``Hkv`` heads broadcast over G: nothing is copied."""
    if groups > 1:
        H = q.shape[1]
        q, k, v = q.unflatten(1, (H // groups, groups)), k.unsqueeze(2), v.unsqueeze(2)
        if mask is not None:
            mask = mask.unflatten(1, (H // groups, groups)) if mask.shape[1] == H else mask.unsqueeze(2)
    weights = _softmax_weights(q, k, mask, scale)  # (B, H, L, S), or (B, Hkv, G, L, S)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    out = torch.matmul(weights, v.to(weights.dtype)).to(q.dtype)  # (B, H, L, Dv), or (B, Hkv, G, L, Dv)
    return out.flatten(1, 2) if groups > 1 else out


def _in_dtype(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """An additive ``mask`` in ``dtype``. Where it holds finite values beyond ``dtype``'s range (-1e5
    or -1e9 for "masked" beside fp16 inputs, as SDPA adds an fp32 mask in fp32), each row is first
    shifted by its largest value (softmax ignores a constant per row): its best key at 0, so no row's
    keys all round to -inf (read as seeing none) or any to +inf; keys beyond range below it keep a
    weight of exp(-65504) = 0 either way. Exact by softmax's invariance; where SDPA's fp32 sum itself
    rounds (a row of -1e9 everywhere loses its scores: uniform weights), this is the exact softmax."""
    if mask.dtype == dtype:
        return mask
    finite = torch.where(torch.isneginf(mask), 0.0, mask)
    info = torch.finfo(dtype)
    if bool(finite.amin() < info.min) or bool(finite.amax() > info.max):
        mask = mask - mask.amax(dim=-1, keepdim=True)  # every row holds a finite value (``_merged_mask``)
    return mask.to(dtype)


def _merged_mask(
    shape: AttentionShape,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    attn_mask: Tensor | None,
    q: Tensor,
) -> tuple[Tensor | None, Tensor | None]:
    """One mask for the kernels, and which queries see any key.

    Returns ``(mask, visible)``: ``mask`` is bool or additive, broadcastable to ``(B, H, L, S)``,
    with the rows of queries that see no key lifted so the softmax stays finite; ``visible`` is
    bool broadcastable to ``(B, H, L, 1)``, or None when every query sees a key.
    """
    L, S = shape.queries, shape.keys
    allowed = contract_mask(L, S, key_padding_mask, is_causal, q.device)
    additive = None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        allowed = attn_mask if allowed is None else allowed & attn_mask
    elif attn_mask is not None:
        additive = attn_mask
    if attn_mask is None:
        visible = visible_queries(L, S, key_padding_mask, is_causal, q.device)
        visible = None if visible is None else visible[:, None, :, None]  # (B|1, 1, L, 1)
    else:
        reachable = allowed
        if additive is not None:
            finite = ~torch.isneginf(additive)
            reachable = finite if reachable is None else reachable & finite
        visible = reachable.any(dim=-1, keepdim=True)  # (B|1, H|1, L, 1)
    if visible is not None and bool(visible.all()):
        visible = None
    if visible is not None:
        allowed = None if allowed is None else allowed | ~visible
        additive = None if additive is None else additive.masked_fill(~visible, 0.0)
    if additive is None:
        return allowed, visible
    if allowed is not None:
        additive = additive.masked_fill(~allowed, float("-inf"))
    return additive, visible


def _check_attn_mask(attn_mask: object, shape: AttentionShape, q: Tensor) -> Tensor:
    full = (shape.batch, shape.heads, shape.queries, shape.keys)
    if not isinstance(attn_mask, Tensor):
        raise ValueError(f"attn_mask must be a tensor broadcastable to {full}, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise ValueError(f"attn_mask must be bool (True = may attend) or an additive float mask, got {attn_mask.dtype}")
    if attn_mask.dim() > 4 or any(
        m not in (1, n) for m, n in zip(reversed(attn_mask.shape), reversed(full), strict=False)
    ):
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, L, S) = {full}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but q is on {q.device}; move it with .to()")
    if attn_mask.is_floating_point():
        if bool(torch.isnan(attn_mask).any() | torch.isposinf(attn_mask).any()):
            raise ValueError("additive attn_mask contains NaN or +inf; use -inf for masked positions")
        attn_mask = attn_mask.to(torch.promote_types(q.dtype, torch.float32))  # eager adds it in fp32+
    while attn_mask.dim() < 4:
        attn_mask = attn_mask.unsqueeze(0)
    return attn_mask


MECHANISM = Mechanism(
    name="full",
    fn=full_attention,
    config=FullConfig,
    summary="exact softmax attention; the oracle and the baseline of every ratio",
    paper="Vaswani et al. 2017, eq. 1",
    tensor_args=("attn_mask",),
    decoder=KVCache,
    gqa=True,
    dropout=True,
    examples=({}, {"backend": "eager"}),
)

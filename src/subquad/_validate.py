"""Shared input checks for every attention mechanism.

Each check raises ``ValueError`` with the offending shapes, dtypes or values and the fix, so a
bad call never reaches a kernel where it would crash deep inside torch or, worse, broadcast into
a silent wrong answer.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "DTYPE_NAMES",
    "SUPPORTED_DTYPES",
    "AttentionShape",
    "check_attention_inputs",
    "check_dtype",
    "check_gqa",
    "check_grouped_inputs",
    "check_logits",
    "check_query_padding_mask",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DTYPE_NAMES = tuple(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)


@dataclass(frozen=True)
class AttentionShape:
    """Sizes of one attention call: queries ``(B, H, L, D)``, keys ``(B, H, S, D)``, values
    ``(B, H, S, Dv)``, and the resolved softmax scale."""

    batch: int
    heads: int
    queries: int
    keys: int
    head_dim: int
    value_dim: int
    scale: float


def _check_tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape (B, H, N, D), got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(
            f"{name} must be 4-D (B, H, N, D), got shape {tuple(x.shape)}. "
            "For a (B, N, E) input, split the heads first: x.view(B, N, H, E // H).transpose(1, 2)."
        )
    if 0 in x.shape:
        raise ValueError(f"{name} has an empty dimension: shape {tuple(x.shape)}; every size must be >= 1")
    return x


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and softmax statistics are kept in: fp32 for half inputs (fp16 and bf16 drift
    in long sums and normalisers), else the input's own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def check_dtype(dtype: torch.dtype, supported: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> None:
    """Raise unless ``dtype`` is one of ``supported``."""
    if dtype not in supported:
        names = ", ".join(str(d).replace("torch.", "") for d in supported)
        raise ValueError(f"unsupported dtype {dtype}; use one of {names} (e.g. q.float())")


def check_attention_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> AttentionShape:
    """Check the core contract shared by all mechanisms and return the call's sizes.

    Args:
        q: queries ``(B, H, L, D)``.
        k: keys ``(B, H, S, D)``.
        v: values ``(B, H, S, Dv)``.
        key_padding_mask: optional bool ``(B, S)``, True marks a real token.
        is_causal: must be a bool.
        scale: optional positive finite number; defaults to ``D ** -0.5``.

    Returns:
        The sizes of the call and the resolved scale.
    """
    return _checked(q, k, v, key_padding_mask, is_causal, scale, False)


def _checked(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, is_causal: bool, scale: float | None,
    grouped: bool,
) -> AttentionShape:  # fmt: skip
    """``check_attention_inputs``; with ``grouped``, k and v hold a divisor of q's heads (``check_gqa``
    passed), and the sizes are those of the H heads they serve."""
    q, k, v = _check_tensor("q", q), _check_tensor("k", k), _check_tensor("v", v)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}; "
            "cast them first, e.g. k = k.to(q.dtype)"
        )
    check_dtype(q.dtype)
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got q={q.device}, k={k.device}, v={v.device}; "
            "move them first, e.g. k = k.to(q.device)"
        )
    (B, H, L, D), (Bk, Hk, S, Dk), (Bv, Hv, Sv, Dv) = q.shape, k.shape, v.shape
    if not (B == Bk == Bv):
        raise ValueError(f"batch sizes differ: q has B={B}, k has B={Bk}, v has B={Bv}")
    if not grouped and not (H == Hk == Hv):
        raise ValueError(
            f"head counts differ: q has H={H}, k has H={Hk}, v has H={Hv}; for grouped-query attention "
            "pass enable_gqa=True (H must be a multiple of the key/value heads)"
        )
    if S != Sv:
        raise ValueError(f"k and v must have the same length, got S={S} for k and S={Sv} for v")
    if D != Dk:
        raise ValueError(f"q and k must have the same head dim, got D={D} for q and D={Dk} for k")
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
    if key_padding_mask is not None:
        _check_padding_mask(key_padding_mask, B, S, q.device)
    return AttentionShape(B, H, L, S, D, Dv, resolve_scale(scale, D))


def check_grouped_inputs(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, is_causal: bool, scale: float | None,
    enable_gqa: bool,
) -> AttentionShape:  # fmt: skip
    """``check_attention_inputs`` for a mechanism that reads grouped-query keys and values in place:
    with ``enable_gqa``, k and v may have a divisor of q's heads; they are checked as the H heads
    they serve (nothing is copied, no view made)."""
    return _checked(q, k, v, key_padding_mask, is_causal, scale, enable_gqa and check_gqa(q, k, v) > 1)


def check_gqa(q: Tensor, k: Tensor, v: Tensor) -> int:
    """Check grouped-query inputs: ``k`` and ``v`` share a head count that divides q's. Returns
    the group size G = H / H_kv (query heads per key/value head)."""
    q, k, v = _check_tensor("q", q), _check_tensor("k", k), _check_tensor("v", v)
    H, Hk, Hv = q.shape[1], k.shape[1], v.shape[1]
    if Hk != Hv or Hk < 1 or H % Hk != 0:
        raise ValueError(
            f"grouped-query attention needs k and v with one head count that divides q's, got q H={H}, "
            f"k H={Hk}, v H={Hv}"
        )
    return H // Hk


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale: ``head_dim ** -0.5`` unless a positive finite ``scale`` is given."""
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):  # numpy's scalars too, as torch takes them
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be positive and finite, got {scale}; leave it None for 1/sqrt(D)")
    return float(scale)


def _check_padding_mask(mask: object, B: int, S: int, device: torch.device) -> None:
    if not isinstance(mask, Tensor):
        raise ValueError(f"key_padding_mask must be a bool tensor of shape (B, S), got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(
            f"key_padding_mask must be bool with True marking real tokens, got dtype {mask.dtype}; "
            "convert with mask.bool() (note: nn.MultiheadAttention uses the opposite convention, "
            "True = padding; pass ~mask for those)"
        )
    if tuple(mask.shape) != (B, S):
        raise ValueError(f"key_padding_mask must have shape (B, S) = ({B}, {S}), got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"key_padding_mask is on {mask.device} but q, k, v are on {device}; move it with .to()")


def check_query_padding_mask(mask: Tensor | None, shape: AttentionShape, device: torch.device) -> None:
    """Raise unless ``mask`` is None or a bool ``(B, L)`` tensor on ``device`` (True = real query)."""
    if mask is None:
        return
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"query_padding_mask must be a bool tensor (True = real query), got {got}")
    if tuple(mask.shape) != (shape.batch, shape.queries):
        raise ValueError(
            f"query_padding_mask must have shape (B, L) = ({shape.batch}, {shape.queries}), got {tuple(mask.shape)}"
        )
    if mask.device != device:
        raise ValueError(f"query_padding_mask is on {mask.device} but q is on {device}; move it with .to()")


def check_logits(
    logits: object, name: str, dims: str, want: tuple[int, ...], device: torch.device, other: str, missing: str
) -> Tensor:
    """A floating tensor of extra logits (``name``, of shape ``dims = want``) on the device of the
    input ``other``; ``missing`` is the message when none was passed."""
    if logits is None:
        raise ValueError(missing)
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        got = logits.dtype if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"{name} must be a floating tensor of shape {dims} = {want}, got {got}")
    if tuple(logits.shape) != want:
        raise ValueError(f"{name} must have shape {dims} = {want}, got {tuple(logits.shape)}")
    if logits.device != device:
        raise ValueError(f"{name} is on {logits.device} but {other} is on {device}; move it with .to()")
    return logits

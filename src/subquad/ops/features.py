"""Feature maps of kernel attention: φ with φ(q)·φ(k) ≥ 0 standing in for exp(q·k).

``elu``: elu(x) + 1 (Katharopoulos et al. 2020); ``relu``: max(x, 0) (AdaMRA). ``features_into``
writes φ without autograd into a given buffer, reading x once: elu(x) + 1 = exp(min(x, 0)) +
max(x, 0), with exp taken as exp2 of x·log2 e (torch's exp2 is the faster of the two on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from subquad.kernels.memory import Scratch

__all__ = ["LOG2E", "elu_from_scaled", "feature_grad", "feature_map", "features_into"]

LOG2E = 1.4426950408889634


def feature_map(x: Tensor, name: str) -> Tensor:
    """φ(x): ``elu`` gives elu(x) + 1 > 0; ``relu`` gives max(x, 0)."""
    if name == "elu":  # elu(x) + 1 = exp(min(x, 0)) + max(x, 0): cheaper on CPU than F.elu
        if torch.is_grad_enabled() and x.requires_grad:
            return torch.exp(x.clamp(max=0)) + F.relu(x)
        return features_into(x, name, torch.empty_like(x, memory_format=torch.contiguous_format))
    if name == "relu":
        return F.relu(x)
    raise ValueError(f"unknown feature map {name!r}; choose elu or relu")


def feature_grad(x: Tensor, name: str) -> Tensor:
    """φ'(x): elu+1 has derivative 1 above 0 and exp(x) below; ReLU has 1 above 0 and 0 below."""
    if name == "elu":
        return torch.where(x > 0, 1.0, torch.exp(x.clamp(max=0)))
    return (x > 0).to(x.dtype)


def features_into(x: Tensor, name: str, out: Tensor, scratch: Scratch | None = None) -> Tensor:
    """φ(x), without autograd, for ``x`` ``(..., n, D)`` written into the first n rows of ``out``
    ``(..., ≥ n, D)``, which is returned whole; its temporary goes into ``scratch`` if given."""
    y = out if out.shape == x.shape else out[..., : x.shape[-2], :]
    if name == "relu" and x.dtype == y.dtype:
        torch.clamp(x, min=0, out=y)
    elif name == "relu":  # bf16/fp16 inputs into fp32 features: clamp's out= takes no other dtype
        y.copy_(x).clamp_(min=0)
    elif out.dtype == torch.float64:
        torch.clamp(x, max=0, out=y).exp_().add_(F.relu(x))
    else:
        elu_from_scaled(torch.mul(x, LOG2E, out=None if scratch is None else scratch("features", x.shape)), y)
    return out


def elu_from_scaled(t: Tensor, y: Tensor) -> None:
    """elu(x) + 1 into ``y``, from ``t = x·log2 e`` (consumed), for fp32 and lower: exp(u) = 2^(u·log2 e),
    as torch's exp2 is faster than exp on CPU (docs/performance.md), and max(x, 0) = max(t, 0) / log2 e. The
    product is the one pass that reads x."""
    torch.clamp(t, max=0, out=y).exp2_().add_(t.clamp_(min=0), alpha=1 / LOG2E)

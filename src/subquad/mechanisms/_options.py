"""Options that several mechanisms share, declared once."""

from __future__ import annotations

from typing import Any

from subquad.registry import option

__all__ = ["head_offset_option", "kernel_option"]


def head_offset_option() -> Any:
    """The ``head_offset`` option of the block-sparse patterns (a fresh field for each config)."""
    return option(0, "layer index of this call's first head (a HeadGroup's first head)", ge=0)


def kernel_option() -> Any:
    """The ``kernel`` option of the mechanisms computed here (a fresh field for each config)."""
    return option(
        "fused",
        "fused: torch's CPU flash kernel per chunk of blocks, FlexAttention (compiled) on CUDA (else eager); "
        "eager: matmul-softmax-matmul "
        "(reference); native: opt-in C kernel for the forward, compiled on first use (fp32, AVX2 CPUs; "
        "else the PyTorch kernels)",
        choices=("fused", "eager", "native"),
    )

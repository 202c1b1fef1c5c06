"""Softmax attention of a batch of blocks, and the log-sum-exp algebra that joins blocks.

Every block engine (``blocksparse``: bands and segments; ``tiles``: gathered windows) reduces its
pattern to chunks of blocks, each a batch of small dense attentions ``q (.., r, D)`` against
``k (.., W, D)`` with an element mask, and runs them here:

- ``eager_forward``: matmul, softmax in fp32 or wider, matmul; the reference, and the path off
  the CPU.
- ``fused_forward``: torch's CPU flash-attention kernel, which also returns the log-sum-exp and
  accumulates half inputs in fp32 (it needs Dv = D).
- ``eager_backward`` / ``fused_backward``: the gradients of a block from the *merged* output and
  log-sum-exp of the whole row (as FlashAttention recomputes them): ``P = exp(S − lse)`` and
  ``dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O))``, so that blocks computed apart get the gradients of one
  softmax over all of them.

A row that sees no key has ``lse = −inf`` and a zero output; in the backward its ``lse`` is
``+inf``, so its probabilities are zero.

``merge_into`` joins a block's softmax with the one over earlier, disjoint keys of the same rows:
``out = (e^lse out + e^lse_b out_b) / e^total`` with ``total = log(e^lse + e^lse_b)``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from subquad._validate import work_dtype

__all__ = [
    "additive_mask",
    "eager_backward",
    "eager_forward",
    "fused_available",
    "fused_backward",
    "fused_forward",
    "merge_into",
    "work_dtype",
]


def fused_available(device: torch.device, head_dim: int | None = None, value_dim: int | None = None) -> bool:
    """Whether torch's CPU flash-attention kernel runs here (and, given both dims, for Dv = D only)."""
    return (
        device.type == "cpu"
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
        and (head_dim is None or head_dim == value_dim)
    )


@functools.cache
def fused_reads_grouped() -> bool:
    """Whether torch's CPU flash kernel reads keys with fewer heads than the queries as grouped-query
    attention (query head h reads key head h // G), as recent torch does; probed once on a tiny call
    whose answer is compared with the repeated heads'. An older kernel that takes the call but reads
    a key head per query head reads the probe's spare heads (a view into a larger buffer): it
    answers otherwise, and the heads are repeated as before."""
    g = torch.Generator().manual_seed(0)
    q, spare = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 4, 5, 8, generator=g)
    k = spare[:, :2]  # 2 key heads for 4 query heads, heads 2 and 3 of the buffer unused
    run = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    try:
        grouped = run(q, k, k, is_causal=False, attn_mask=None, scale=1.0)[0]
    except (RuntimeError, ValueError):
        return False
    repeated = k.repeat_interleave(2, dim=1)
    return bool(torch.allclose(grouped, run(q, repeated, repeated, is_causal=False, attn_mask=None, scale=1.0)[0]))


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True = visible) as the fused kernel's additive one: 0 or −inf."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def eager_forward(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """Softmax attention of blocks ``q (.., r, D)``, ``k (.., W, D)``, ``v (.., W, Dv)`` where
    ``allowed`` (bool, broadcastable to ``(.., r, W)``; None: all) is True.

    Returns the output ``(.., r, Dv)`` and log-sum-exp ``(.., r)`` in the work dtype.
    """
    work = work_dtype(q.dtype)
    s = torch.matmul(q.to(work) * scale, k.to(work).transpose(-1, -2))
    if allowed is not None:
        s.masked_fill_(~allowed, float("-inf"))
    top = s.amax(-1, keepdim=True)
    top = top.masked_fill_(top == float("-inf"), 0.0)
    p = s.sub_(top).exp_()
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v.to(work)).div_(total.clamp_min(torch.finfo(work).tiny))
    return out, (top + total.log()).squeeze(-1)


def fused_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """The same through torch's CPU flash kernel, for ``(n, b, r, D)`` batches; ``mask`` additive
    (``additive_mask``) and broadcastable to ``(n, b, r, W)``, ``causal``: the kernel's own flag.

    Returns the output ``(n, b, r, Dv)`` in q's dtype and the log-sum-exp ``(n, b, r)`` in fp32 or
    wider. With a mask the kernel reports ``lse = 0`` for a row that sees no key: callers that
    can have such rows set it to −inf (``allowed.any(-1)``).
    """
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, is_causal=causal, attn_mask=mask, scale=scale
    )


def eager_backward(
    q: Tensor, k: Tensor, v: Tensor, grad: Tensor, lse: Tensor, delta: Tensor, allowed: Tensor | None, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of blocks as in ``eager_forward``, from the merged log-sum-exp ``lse (.., r)``
    (``+inf`` for rows without keys) and ``delta = rowsum(dO ∘ O)`` ``(.., r)``; all in the work
    dtype. Returns ``(dq, dk, dv)`` shaped like q, k and v."""
    s = torch.matmul(q * scale, k.transpose(-1, -2))
    if allowed is not None:
        s.masked_fill_(~allowed, float("-inf"))
    p = s.sub_(lse.unsqueeze(-1)).exp_()
    dv = torch.matmul(p.transpose(-1, -2), grad)
    ds = torch.matmul(grad, v.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(p)
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


def fused_backward(
    q: Tensor, k: Tensor, v: Tensor, grad: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None, causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``eager_backward`` through torch's CPU flash kernel, for ``(n, b, r, ·)`` batches, given the
    merged output and log-sum-exp ``(n, b, r)``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
    )


def merge_into(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Join, in place in ``out`` and ``lse``, the softmax over a block's keys with the one over
    earlier disjoint keys of the same rows (module docstring); ``lse`` and ``block_lse`` end in a
    size-1 dim. ``block_out`` is overwritten."""
    total = torch.logaddexp(lse, block_lse)
    safe = total.masked_fill(total == float("-inf"), 0.0)  # rows that see no key in either
    out.mul_((lse - safe).exp_()).add_(block_out.mul_((block_lse - safe).exp_()))
    lse.copy_(total)

"""Causal scans: prefix sums and the causal product ``y_i = Σ_{j≤i} (a_i·b_j) c_j``, chunked.

Kernel attention's causal form (linear, multires) is the causal product with a = φ(q), b = φ(k),
c = [v, 1]; agglomerative attention's is a running sum of class-weighted values. Both are computed
in chunks: inside a chunk by a masked (chunk × chunk) product, across chunks through a running
state, so the work is linear in N and vectorises (a ``cumsum`` along a middle dim does not, on CPU).

On the CPU the chunks of the causal product run in blocks sized for its caches, with a backward of
their own that saves only the inputs. Off the CPU (``whole_scan``) a block is a handful of kernel
launches, so the product runs as whole-sequence ops under autograd instead: every chunk's masked
product at once, the states entering the chunks by one cumulative sum over the chunks
(flash-linear-attention's chunked form, written in PyTorch). It saves the chunked inputs and
products and the entering states, O(N·(D + chunk) + (N / chunk)·D·Dc) per row, never O(N²). The
prefix sums keep their chunked form on every device (``prefix_sums``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from subquad.kernels.memory import Scratch
from subquad.kernels.threads import adapted_backward
from subquad.kernels.tuning import TUNING, block_elements

__all__ = [
    "add_matmul_",
    "causal_dot",
    "causal_dot_forward",
    "causal_dot_whole",
    "chunk_states",
    "chunked",
    "entering",
    "prefix_sums",
    "whole_scan",
]


def whole_scan(device: torch.device) -> bool:
    """Whether causal scans on ``device`` run as whole-sequence ops (off the CPU, ``TUNING.whole_scan``)."""
    return device.type != "cpu" and TUNING.whole_scan == 1


def entering(updates: Tensor, first: Tensor | None, dim: int) -> Tensor:
    """The state entering each chunk along ``dim`` of ``updates``: ``first`` (zero if None; its shape
    without ``dim``) plus the updates of the chunks before it. Differentiable."""
    earlier = updates.narrow(dim, 0, updates.shape[dim] - 1).cumsum(dim)
    states = torch.cat([torch.zeros_like(updates.narrow(dim, 0, 1)), earlier], dim)
    return states if first is None else states + first.unsqueeze(dim)


def causal_dot_whole(a: Tensor, b: Tensor, c: Tensor, initial: Tensor | None, chunk: int) -> Tensor:
    """``causal_dot`` as whole-sequence ops under autograd (``whole_scan``): each chunk's masked
    product at once, plus each chunk's entering state from one cumulative sum."""
    N = a.shape[1]
    chunk = max(1, min(chunk, N))
    ac, bc, cc = (chunked(x.unsqueeze(0), chunk)[0] for x in (a, b, c))  # (R, m, chunk, ·)
    y = torch.matmul(torch.matmul(ac, bc.transpose(-1, -2)).tril(), cc)
    y = y + torch.matmul(ac, entering(torch.matmul(bc.transpose(-1, -2), cc), initial, 1))
    return y.flatten(1, 2)[:, :N]


def causal_dot_forward(a: Tensor, b: Tensor, c: Tensor, initial: Tensor | None, chunk: int) -> Tensor:
    """``y_i = Σ_{j≤i} (a_i·b_j) c_j + a_iᵀ initial`` for rows ``(R, N, ·)``, without autograd."""
    R, N, Da = a.shape
    Dc = c.shape[-1]
    chunk = max(1, min(chunk, N))
    chunks = -(-N // chunk)
    pad = chunks * chunk - N
    if pad:  # zero rows add nothing to the state; their outputs are cut off below
        a, b, c = (F.pad(x, (0, 0, 0, pad)) for x in (a, b, c))
    a, b, c = (x.view(R, chunks, chunk, x.shape[-1]) for x in (a, b, c))
    state = a.new_zeros(R, 1, Da, Dc) if initial is None else initial.unsqueeze(1)
    per_block = max(1, block_elements(TUNING.linear_state_block, a.device) // (R * Da * Dc))
    out = a.new_empty(R, chunks, chunk, Dc)
    for start in range(0, chunks, per_block):
        block = slice(start, start + per_block)
        ab, bb, cb = a[:, block], b[:, block], c[:, block]
        scores = torch.matmul(ab, bb.transpose(-1, -2)).tril_()  # (R, n, chunk, chunk)
        updates = torch.matmul(bb.transpose(-1, -2), cb)  # (R, n, Da, Dc): each chunk's Σ b cᵀ
        before = F.pad(torch.cumsum(updates[:, :-1], dim=1), (0, 0, 0, 0, 1, 0)) + state  # entering each chunk
        out[:, block] = torch.matmul(scores, cb) + torch.matmul(ab, before)
        state = before[:, -1:] + updates[:, -1:]
    return out.view(R, chunks * chunk, Dc)[:, :N]


class _CausalDot(torch.autograd.Function):
    """The chunked causal product with a backward pass that is the same product, run forwards
    (for a) and backwards in time (for b and c), so only the inputs are saved."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, c: Tensor, initial: Tensor | None, chunk: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b, c, initial)
        ctx.chunk = chunk
        return causal_dot_forward(a, b, c, initial, chunk)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @adapted_backward
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        a, b, c, initial = ctx.saved_tensors
        chunk = ctx.chunk
        grad_a = grad_b = grad_c = grad_initial = None
        if ctx.needs_input_grad[0]:
            # ∂/∂a_i = Σ_{j≤i} (g_i·c_j) b_j + initial g_i
            grad_a = causal_dot_forward(grad, c, b, None if initial is None else initial.transpose(1, 2), chunk)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            flip = lambda x: x.flip(1)  # noqa: E731 - reversed time: Σ_{i≥j} becomes a causal sum
            if ctx.needs_input_grad[1]:  # ∂/∂b_j = Σ_{i≥j} (g_i·c_j) a_i
                grad_b = flip(causal_dot_forward(flip(c), flip(grad), flip(a), None, chunk))
            if ctx.needs_input_grad[2]:  # ∂/∂c_j = Σ_{i≥j} (a_i·b_j) g_i
                grad_c = flip(causal_dot_forward(flip(b), flip(a), flip(grad), None, chunk))
        if initial is not None and ctx.needs_input_grad[3]:
            grad_initial = torch.matmul(a.transpose(1, 2), grad)  # Σ_i a_i g_iᵀ
        return grad_a, grad_b, grad_c, grad_initial, None


def causal_dot(a: Tensor, b: Tensor, c: Tensor, initial: Tensor | None = None, chunk: int = 64) -> Tensor:
    """``y_i = Σ_{j≤i} (a_i·b_j) c_j + a_iᵀ initial`` over rows ``(R, N, ·)``; differentiable.

    Args:
        a, b: ``(R, N, Da)``.
        c: ``(R, N, Dc)``.
        initial: ``(R, Da, Dc)`` state before the first position, or None.
        chunk: positions per chunk.

    Returns:
        ``(R, N, Dc)``.
    """
    if whole_scan(a.device):
        return causal_dot_whole(a, b, c, initial, chunk)
    return _CausalDot.apply(a, b, c, initial, chunk)


def chunk_states(updates: Tensor, state: Tensor, reverse: bool = False) -> tuple[Tensor, Tensor]:
    """From per-chunk ``updates`` ``(B, H, m, ·, ·)`` (consumed), the state entering each chunk,
    ``state`` plus the chunks before it in time order (after it when ``reverse``), and the state
    after the last chunk."""
    if reverse:
        before, after = chunk_states(updates.flip(2), state)
        return before.flip(2), after
    before = torch.empty_like(updates)
    before[:, :, 0] = state
    if updates.shape[2] > 1:
        updates[:, :, 0] += state
        torch.cumsum(updates[:, :, :-1], dim=2, out=before[:, :, 1:])
    return before, before[:, :, -1] + updates[:, :, -1]


def add_matmul_(y: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``y += a @ b`` in place over any leading dims (one fused BLAS call per matrix)."""
    y.view(-1, *y.shape[-2:]).baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return y


def chunked(x: Tensor, chunk: int) -> Tensor:
    """``(B, H, n, ·)`` as ``(B, H, n / chunk, chunk, ·)``, zero-padded to whole chunks."""
    pad = -x.shape[2] % chunk
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.view(*x.shape[:2], -1, chunk, x.shape[-1])


def prefix_sums(x: Tensor, carry: Tensor | None, scratch: Scratch | None = None, name: str = "") -> Tensor:
    """Inclusive prefix sums of ``x`` ``(B, H, n, F)`` along n, plus ``carry`` ``(B, H, 1, F)``: a
    lower-triangular matmul within chunks of ``TUNING.agglomerative_chunk`` and a cumulative sum
    of the chunk totals (much faster on CPU than ``cumsum`` along a middle dim); written into
    ``scratch(name)`` if given. Off the CPU too: a ``cumsum`` along a middle dim is CUDA's slow
    scan as well (one thread per column, 77 of 85 ms of agglomerative's causal call at 64k on an
    H200, against 10 ms for the whole call in this form)."""
    B, H, n, F = x.shape
    chunk = min(TUNING.agglomerative_chunk, n)
    pad = -n % chunk
    xc = (torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x).reshape(B, H, -1, chunk, F)
    tril = torch.ones(chunk, chunk, dtype=x.dtype, device=x.device).tril()
    out = None if scratch is None else scratch(name, xc.shape)
    within = torch.matmul(tril, xc, out=out)  # (B, H, chunks, chunk, F); matmul saves its inputs, not this
    if within.shape[2] > 1:
        within[:, :, 1:] += torch.cumsum(within[:, :, :-1, -1:], dim=2)  # totals of the earlier chunks
    if carry is not None:
        within += carry.unsqueeze(2)
    return within.view(B, H, -1, F)[:, :, :n]

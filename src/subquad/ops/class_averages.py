"""Running class averages, block by block: masked agglomerative attention (Spellings 2019).

``CausalAgglomerative``: out_i = c^q_i · Σ_{j≤p} c^r_j v_j / max(Σ_{j≤p} c^r_j, clip) with
p = i + offset, as one autograd Function. Prefix sums run block by block (a lower-triangular
matmul per chunk, carried across blocks), and the backward recomputes them and accumulates suffix
sums of the gradients, so only c^q, c^r and the values are saved. The maths and the choices are in
``mechanisms.agglomerative``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from subquad.kernels.memory import Scratch, new_output
from subquad.kernels.threads import adapted_backward
from subquad.kernels.tuning import TUNING, block_elements
from subquad.ops.scan import prefix_sums

__all__ = ["CausalAgglomerative"]


def _causal(c_q: Tensor, c_r: Tensor, values: Tensor, offset: int, clip: float) -> Tensor:
    """Masked agglomerative attention, block by block over the reference positions: running class
    sums and masses carry across blocks, and each block's queries are written into one output.
    Query i sits at reference position i + offset."""
    B, H, L, _ = c_q.shape
    S, Dv = values.shape[2], values.shape[3]
    out = new_output((B, H, L, Dv), values.dtype, values.device)
    if offset < 0:
        out[:, :, : min(-offset, L)] = 0  # queries before the first reference see none
    block = _block_size(B, H, Dv, c_q.device)
    starts = range(0, S, block)
    # The query rows each reference block serves: positions max(start, offset) .. min(stop, offset + L).
    spans = [(max(s, offset), min(s + block, S, offset + L)) for s in starts]
    sums = mass = None
    scratch = Scratch(values.dtype, values.device)
    for start, (lo, hi), c_r_block, v_block in zip(starts, spans, c_r.split(block, dim=2), values.split(block, dim=2)):
        weighted = torch.mul(c_r_block, v_block, out=scratch("weighted", v_block.shape))
        sums = prefix_sums(weighted, sums, scratch, "sums")
        mass = prefix_sums(c_r_block, mass)
        if lo < hi:
            scale = c_q[:, :, lo - offset : hi - offset] / mass[:, :, lo - start : hi - start].clamp_min(clip)
            torch.mul(sums[:, :, lo - start : hi - start], scale, out=out[:, :, lo - offset : hi - offset])
        sums, mass = sums[:, :, -1:].clone(), mass[:, :, -1:]  # the next block overwrites the buffer
    return out


def _block_size(B: int, H: int, Dv: int, device: torch.device) -> int:
    chunk = TUNING.agglomerative_chunk
    return max(chunk, (block_elements(TUNING.agglomerative_block, device) // (B * H * (Dv + 1))) // chunk * chunk)


class CausalAgglomerative(torch.autograd.Function):
    """Masked agglomerative attention whose backward also runs block by block: it recomputes the
    running class sums S and masses M forwards, then accumulates the gradients' suffix sums
    backwards, so only c^q, c^r and the values are saved (no full-size prefix tensor).

    With out_i = c^q_i S_p / M̃_p (p = i + offset, M̃ = max(M, clip)) and a_i = g_i·S_p:
    ∂c^q_i = a_i / M̃_p, ∂S_p = g_i c^q_i / M̃_p, ∂M_p = −a_i c^q_i / M̃_p² where M_p > clip; then
    ∂v_j = c^r_j Σ_{p≥j} ∂S_p and ∂c^r_j = v_j·Σ_{p≥j} ∂S_p + Σ_{p≥j} ∂M_p.
    """

    @staticmethod
    def forward(ctx, c_q: Tensor, c_r: Tensor, values: Tensor, offset: int, clip: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(c_q, c_r, values)
        ctx.offset, ctx.clip = offset, clip
        return _causal(c_q, c_r, values, offset, clip)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @adapted_backward
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        c_q, c_r, values = ctx.saved_tensors
        offset, clip = ctx.offset, ctx.clip
        B, H, L, _ = c_q.shape
        S, Dv = values.shape[2], values.shape[3]
        block = _block_size(B, H, Dv, c_q.device)
        grad = grad.to(values.dtype)
        grad_q = torch.zeros_like(c_q)
        grad_sums = torch.zeros_like(values)  # ∂S per position; becomes ∂v in the second pass
        grad_mass = torch.zeros_like(c_r)
        sums = mass = None
        for start in range(0, S, block):  # forwards: the running S, M and their gradients
            stop = min(start + block, S)
            sums = prefix_sums(c_r[:, :, start:stop] * values[:, :, start:stop], sums)
            mass = prefix_sums(c_r[:, :, start:stop], mass)
            lo, hi = max(start, offset), min(stop, offset + L)
            if lo < hi:
                rows, queries = slice(lo - start, hi - start), slice(lo - offset, hi - offset)
                m = mass[:, :, rows]
                kept = m.clamp_min(clip)
                g, cq = grad[:, :, queries], c_q[:, :, queries]
                a = (g * sums[:, :, rows]).sum(-1, keepdim=True)
                grad_q[:, :, queries] = a / kept
                grad_sums[:, :, lo:hi] = g * (cq / kept)
                grad_mass[:, :, lo:hi] = -(a * cq / kept.square()) * (m > clip)
            sums, mass = sums[:, :, -1:], mass[:, :, -1:]
        grad_r = torch.empty_like(c_r)
        later_sums = later_mass = None
        for start in reversed(range(0, S, block)):  # backwards: suffix sums of ∂S and ∂M
            stop = min(start + block, S)
            suffix = prefix_sums(grad_sums[:, :, start:stop].flip(2), later_sums).flip(2)
            suffix_mass = prefix_sums(grad_mass[:, :, start:stop].flip(2), later_mass).flip(2)
            grad_r[:, :, start:stop] = (values[:, :, start:stop] * suffix).sum(-1, keepdim=True) + suffix_mass
            grad_sums[:, :, start:stop] = c_r[:, :, start:stop] * suffix
            later_sums, later_mass = suffix[:, :, :1], suffix_mass[:, :, :1]
        return grad_q, grad_r, grad_sums, None, None

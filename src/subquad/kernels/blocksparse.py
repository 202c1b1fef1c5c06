"""Block-sparse softmax attention: only the listed blocks of the (L, S) score matrix are computed.

**Layout.** A pattern is computed as one or more *parts*, each a list of *groups*. A group is a
batch of query blocks that all see the same number ``W`` of keys:

- ``queries`` ``(n, bq)``: the query indices of each block (``L`` marks an empty slot). A part
  covers each query at most once, in any order: the strided pattern lists them transposed.
- ``keys`` ``(Hk, n, W)``: the key indices each block attends to, per head (``Hk = H``) or shared
  (``Hk = 1``); out-of-range indices are allowed and are masked.
- ``allowed(start, stop)``: the exact element mask of blocks ``start:stop``, broadcastable to
  ``(B, H, n, bq, W)``. It is evaluated from the pattern's ``mask_mod`` on the blocks' positions, so
  causality inside a diagonal block is exact, not block-level.

The engine is one autograd Function (``_BlockSparse``) over three modules: ``blocksparse_chunks``
reads the blocks a chunk at a time (memory O(chunk) above the inputs and outputs: no (L, S) tensor),
``blocksparse_forward`` runs each chunk's blocks through one kernel call (``fused``, ``eager`` or
``native``) and merges the parts' softmaxes by their log-sum-exps, and ``blocksparse_backward``
recomputes each chunk's probabilities from the merged log-sum-exp, in a layout of its own
(``backward_parts``, ``band_blocks``), its groups straight or transposed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from subquad.kernels import native as _native
from subquad.kernels.blocksparse_backward import block_sparse_backward
from subquad.kernels.blocksparse_chunks import Chunk, Part
from subquad.kernels.blocksparse_forward import block_sparse_forward, native_runs
from subquad.kernels.memory import tracks_grad
from subquad.kernels.softmax import fused_available
from subquad.kernels.threads import adapted_backward
from subquad.kernels.tuning import TUNING

__all__ = [
    "BandBlocks",
    "band_blocks",
    "block_sparse_attention",
    "native_runs",
]


_Chunk = Chunk  # its name before the chunks had a module of their own: tests record the chunks through it


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    parts: Sequence[Part],
    key_padding_mask: Tensor | None,
    scale: float,
    kernel: str = "fused",
    backward_parts: Sequence[Part] | None = None,
) -> Tensor:
    """Softmax attention over the union of ``parts`` (disjoint key sets per query); differentiable.

    Args:
        q, k, v: ``(B, H, L, D)``, ``(B, H_kv, S, D)``, ``(B, H_kv, S, Dv)``; H_kv = H, or a divisor
            of it (grouped-query: key head h // G serves query head h), read in place.
        parts: each a sequence of ``Group``.
        key_padding_mask: bool ``(B, S)``, True marks a real key, or None.
        scale: the softmax scale.
        kernel: ``fused`` runs each chunk through torch's CPU flash-attention kernel, which also
            returns the log-sum-exp (``eager`` where it is unavailable, or when Dv ≠ D); ``eager`` is
            matmul, softmax in fp32+, matmul: the reference; ``native``: subquad's C kernel for the
            forward, opt-in (what ``fused`` runs where it cannot, with a warning).
        backward_parts: the same pattern in the layout the backward pass recomputes it in (default:
            ``parts``), such as larger blocks; it must cover exactly the (query, key) pairs of ``parts``.

    Returns:
        ``(B, H, L, Dv)`` in q's dtype; zero rows for queries that see no key.
    """
    fused = kernel != "eager" and fused_available(q.device, q.shape[-1], v.shape[-1])
    forward = "fused" if fused else "eager"
    if kernel == "native":
        why = _native.supports(q, k, v)
        if why is None:
            forward = "native"
        else:
            _native.warn_unavailable(why)
    if any(group.transposed for part in parts for group in part):
        raise ValueError("transposed groups (Group.transposed) serve only as backward_parts, not as parts")
    backward = tuple(parts if backward_parts is None else backward_parts)
    return _BlockSparse.apply(q, k, v, key_padding_mask, tuple(parts), scale, forward, fused, backward)


class BandBlocks(NamedTuple):
    """The blocks of a band (``band_blocks``)."""

    forward: int  # queries per block of the forward
    backward: int | None  # queries per block of a backward in query blocks; None: the forward's, or no backward
    transposed: int | None  # keys per block of the band's backward transposed; None: not transposed


def band_blocks(q: Tensor, k: Tensor, v: Tensor, kernel: str, native: bool, keys: int) -> BandBlocks:
    """The blocks of a band (local, strided sparse) whose queries see ``keys`` keys each: queries
    per block in the forward pass and in the backward pass, which recomputes the band in a layout
    of its own (``block_sparse_attention``'s ``backward_parts``), and, where that layout is the band
    transposed (``band_groups(transposed=True)``: blocks of keys against the queries that see
    them), keys per block. ``native``: the native kernel takes these inputs.

    The forward takes ``TUNING.local_inference_block`` where the fused or native kernel runs it:
    fewer keys computed outside the band. Under torch's flash backward (the fused and native
    kernels') the band's backward is transposed, in blocks of ``TUNING.local_backward_block`` keys:
    each block of keys gets its whole gradient from one call, where query blocks' overlapping key
    windows each give a part that is zero-filled and summed, and the kernel runs faster with the
    long side on its queries (docs/performance.md). Parts of a pattern in query blocks take
    ``TUNING.local_block`` queries in the backward, twice that where ``keys > 4 · TUNING.local_block``;
    off those kernels (``eager``) the forward does too, and nothing is transposed. ``backward`` and
    ``transposed`` are None where no input takes a gradient; ``backward`` is also where it would be
    the forward's block."""
    fused = kernel != "eager" and fused_available(q.device, q.shape[-1], v.shape[-1])
    straight = TUNING.local_block * (2 if keys > 4 * TUNING.local_block else 1)
    forward = TUNING.local_inference_block if fused or native else straight
    grad = tracks_grad(q, k, v)
    return BandBlocks(
        forward,
        straight if grad and straight != forward else None,
        TUNING.local_backward_block if grad and (fused or native) else None,
    )


class _BlockSparse(torch.autograd.Function):
    """Block-sparse attention whose backward recomputes every chunk (``kernels.blocksparse_backward``)."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, parts, scale, kernel, fused, backward_parts):  # type: ignore[override]
        out, lse = block_sparse_forward(q, k, v, key_padding_mask, parts, scale, kernel, fused)
        ctx.save_for_backward(q, k, v, key_padding_mask, out, lse)
        ctx.parts, ctx.scale, ctx.fused = backward_parts, scale, fused
        return out.to(q.dtype).contiguous()  # as SDPA's: a copy only where out has spare rows

    @staticmethod
    @torch.autograd.function.once_differentiable
    @adapted_backward
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, key_padding_mask, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = block_sparse_backward(
            q, k, v, key_padding_mask, grad, out, lse, ctx.parts, ctx.scale, ctx.fused
        )
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None, None, None

"""The backward pass of block-sparse attention (``kernels.blocksparse``): every chunk recomputed.

**Backward.** The autograd Function saves only q, k, v, the output and ``lse``. The backward recomputes
each chunk's probabilities ``P = exp(S − lse)`` from the merged ``lse`` (as FlashAttention does), so
every part's gradients are those of the merged softmax: ``dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O))``.
Key and value gradients are scattered back with ``index_add_``. Memory stays linear in N. As each
pair's gradient needs only the merged ``lse`` and output, the backward may recompute the pattern
in a layout of its own (``backward_parts``): a band's forward runs fastest in small blocks of
queries, its backward transposed (``band_blocks``). A transposed group (``Group.transposed``)
lists blocks of keys against the queries that see them: the kernel then takes the queries, the
output gradient, the output and ``lse`` through the group's key views and the keys and values as
its blocks, each block's key and value gradients come whole, and the queries' gradients are
summed over the blocks. The groups of a backward layout may mix both orientations.

**Dtype.** Half-precision inputs run their backward in the work dtype (fp32): torch's CPU flash
backward is slower in bf16 than in fp32 on short blocks (AMD EPYC with avx512_bf16, torch 2.13:
1.31× on 64 × 128 blocks, 2.18× on 32 × 32, though 0.73× on one 2,048-token call), so the blocks
are upcast once per call and each chunk runs the fp32 kernel (local, sparse and pattern forward +
backward in bf16: 1.08–1.66× their fp32 time before, 0.99–1.22× after).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from subquad.kernels.blocksparse_chunks import Chunk, Part, as_batch, chunks, from_batch, fused_mask, padded, pads
from subquad.kernels.memory import new_output
from subquad.kernels.softmax import eager_backward, fused_backward, work_dtype
from subquad.kernels.tuning import TUNING, block_elements

__all__ = ["block_sparse_backward"]


def block_sparse_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    grad: Tensor,
    out: Tensor,
    lse: Tensor,
    parts: Sequence[Part],
    scale: float,
    fused: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of q, k and v, in the work dtype, given the output gradient ``grad`` and the
    forward's merged output and log-sum-exp (``block_sparse_forward``); ``parts``: the backward
    layout, whose groups may be straight or transposed. ``fused``: torch's flash backward, else eager."""
    groups = [group for part in parts for group in part]
    grads = _Gradients(q, k, v, pads([[g for g in groups if not g.transposed]])[1])
    # Each (query, key) pair lies in one group, and its gradient needs only the merged lse and
    # output: the groups are computed apart, in either orientation, into the same sums.
    # The empty slot L gets lse = +inf, so its probabilities are 0; queries that see no key too.
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    for transposed, backward in ((False, _straight_backward), (True, _transposed_backward)):
        some = [group for group in groups if group.transposed == transposed]
        if some:
            backward(grads, q, k, v, key_padding_mask, grad, out, lse, some, scale, fused)
    return grads.result()


class _Gradients:
    """The gradients of q, k and v as they are summed over the chunks: matrices with one row per
    (batch, head, position), as index_add_ along dim 0 of a matrix is the fast scatter on CPU
    (several times faster than along an inner dim). Row L of each (batch, head) of the queries takes
    the empty slots; the keys have ``pad`` rows at both ends of each (batch, head), which the
    straight chunks' key views may read past the sequence. Grouped-query key heads sum over their
    group of query heads."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, pad: int) -> None:
        B, H, L, D = q.shape
        Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
        work = work_dtype(q.dtype)
        self.shape, self.pad = (B, H, L, Hkv, S, D, Dv), pad
        self.q = new_output((B * H * (L + 1), D), work, q.device).zero_()
        self.k = new_output((B * Hkv * (S + 2 * pad), D), work, q.device).zero_()
        self.v = new_output((B * Hkv * (S + 2 * pad), Dv), work, q.device).zero_()

    def query_rows(self, positions: Tensor) -> Tensor:
        """The rows of query ``positions`` ``(B | 1, H | 1, …)`` (L: the empty slot), per (batch, head)."""
        B, H, L = self.shape[:3]
        heads = torch.arange(B * H, device=positions.device).view(B, H, *(1,) * (positions.dim() - 2))
        return heads * (L + 1) + positions

    def key_rows(self, positions: Tensor) -> Tensor:
        """The rows of key ``positions`` ``(B | 1, H | 1, …)`` of query heads (in ``[−pad, S + pad)``)."""
        B, H, _, Hkv, S = self.shape[:5]
        heads = torch.arange(B * H, device=positions.device).view(B, H, *(1,) * (positions.dim() - 2)) // (H // Hkv)
        return heads * (S + 2 * self.pad) + self.pad + positions

    def result(self) -> tuple[Tensor, Tensor, Tensor]:
        B, H, L, Hkv, S, D, Dv = self.shape
        pad = self.pad
        return (
            self.q.view(B, H, L + 1, D)[:, :, :L],
            self.k.view(B, Hkv, S + 2 * pad, D)[:, :, pad : pad + S],
            self.v.view(B, Hkv, S + 2 * pad, Dv)[:, :, pad : pad + S],
        )


def _straight_backward(grads: _Gradients, q, k, v, key_padding_mask, grad, out, lse, groups, scale, fused) -> None:
    """Add to ``grads`` the gradients of the pairs of ``groups`` (query blocks against their keys);
    ``lse`` is +inf for rows without keys."""
    B, H, L = q.shape[:3]
    S = k.shape[2]
    work = out.dtype
    lse = F.pad(lse, (0, 1), value=float("inf"))  # the empty slot L
    dtype = work  # torch's flash backward runs short blocks faster in fp32 than in bf16 (module docstring)
    query_pad, pad = pads([groups])
    q_ext = padded(q.to(dtype), 0, query_pad)
    g_ext, out_ext = grad.to(dtype), out.to(dtype)
    kf, vf = (padded(x.to(dtype), pad, pad) for x in (k, v))  # (B, H, S + 2 pad, ·)
    delta = None if fused else (g_ext * out_ext).sum(-1)  # (B, H, L): rowsum(dO ∘ O)
    sources: dict = {}
    tile = TUNING.blocksparse_backward_tile if fused else block_elements(TUNING.blocksparse_tile, q.device)
    for group in groups:
        for c in chunks(group, B, H, L, S, pad, key_padding_mask, tile, False, H // k.shape[1]):
            rows = c.queries
            qc, gc = c.take(q_ext), c.take(g_ext, view=False)
            kc, vc = c.gather(kf, sources, "blocksparse.keys"), c.gather(vf, sources, "blocksparse.values")
            if fused:
                dq, dk, dv = _chunk_backward_fused(
                    qc, kc, vc, gc, c.take(out_ext, view=False), lse[:, :, rows], c, scale
                )
            else:
                dq, dk, dv = eager_backward(qc, kc, vc, gc, lse[:, :, rows], delta[:, :, c.reads], c.allowed, scale)
            _add_rows(grads.q, grads.query_rows(rows.expand(B, H, *rows.shape)), dq)
            keys = grads.key_rows(c.keys.clamp(0, S - 1).expand(B, *c.shape))  # (B, H, n, W)
            _add_rows(grads.k, keys, dk)
            _add_rows(grads.v, keys, dv)


def _transposed_backward(grads: _Gradients, q, k, v, key_padding_mask, grad, out, lse, groups, scale, fused) -> None:
    """``_straight_backward`` for transposed groups (``Group.transposed``): each chunk is blocks of
    keys against the windows of queries that see them, so the kernel's queries are q, dO, O and lse
    read through the groups' key views, its keys and values the blocks. A block's key and value
    gradients are whole (no overlapping windows to sum), and its queries' gradients are summed
    over the blocks. Empty key slots (``S``) and padded keys are masked: their gradients are zero,
    added to key 0, as those of a window's queries outside the sequence are to its ends."""
    B, H, L = q.shape[:3]
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    work = out.dtype
    dtype = work  # as in _straight_backward
    key_pad, pad = pads([groups])  # rows past the end of the keys; rows past both ends of the queries
    qf, gf, of = (padded(x.to(dtype), pad, pad) for x in (q, grad, out))  # (B, H, L + 2 pad, ·)
    lf = F.pad(lse, (pad, pad), value=float("inf")).unsqueeze(-1)  # padded queries take no weight
    df = None if fused else (gf * of).sum(-1, keepdim=True)  # rowsum(dO ∘ O)
    # keys and values per query head (a copy where grouped-query inputs share them)
    kx, vx = (x if G == 1 else x.repeat_interleave(G, dim=1) for x in (k.to(dtype), v.to(dtype)))
    kx, vx = padded(kx, 0, key_pad), padded(vx, 0, key_pad)
    sources: dict = {}
    tile = TUNING.blocksparse_backward_tile if fused else block_elements(TUNING.blocksparse_tile, q.device)
    for group in groups:
        # the chunks of the transposed pattern: its S "queries" are keys, its L "keys" queries
        for c in chunks(group, B, H, S, L, pad, None, tile, False):
            kc, vc = c.take(kx), c.take(vx)  # (B, H, n, bq, ·)
            qc, gc, oc, lc = (
                c.gather(x, sources, f"blocksparse.transposed.{name}")
                for x, name in ((qf, "q"), (gf, "grad"), (of, "out"), (lf, "lse"))
            )
            allowed = _transposed_allowed(c, key_padding_mask, S)  # (.., n, W, bq): (query, key)
            if fused:
                mask = None
                if allowed is not None:
                    build = lambda allowed=allowed: fused_mask(allowed, B, H, dtype)  # noqa: E731
                    mask = build() if key_padding_mask is not None else c.kept(("transposed", B, H, dtype), build)
                dq, dk, dv = fused_backward(
                    as_batch(qc), as_batch(kc), as_batch(vc), as_batch(gc), as_batch(oc),
                    as_batch(lc).squeeze(-1), mask, False, scale,
                )  # fmt: skip
                dq, dk, dv = from_batch(dq, B, H), from_batch(dk, B, H), from_batch(dv, B, H)
            else:
                dc = c.gather(df, sources, "blocksparse.transposed.delta")
                dq, dk, dv = eager_backward(qc, kc, vc, gc, lc.squeeze(-1), dc.squeeze(-1), allowed, scale)
            _add_rows(grads.q, grads.query_rows(c.keys.clamp(0, L - 1).expand(B, *c.shape)), dq)
            keys = grads.key_rows(c.reads.expand(B, H, *c.reads.shape))  # (B, H, n, bq)
            _add_rows(grads.k, keys, dk)
            _add_rows(grads.v, keys, dv)


def _transposed_allowed(c: Chunk, key_padding_mask: Tensor | None, S: int) -> Tensor | None:
    """A transposed chunk's element mask as (query, key) ``(B | 1, 1, n | 1, W, bq)``: its layout
    mask (key, query), the empty key slots and the padded keys left out; None where all is visible."""
    allowed = None if c.open else c.allowed  # (.., n | 1, bq, W)
    empty = c.kept(("empty",), lambda: (c.queries == S).unsqueeze(-1))  # (n, bq, 1)
    if bool(empty.any()):
        allowed = ~empty if allowed is None else allowed & ~empty
    if key_padding_mask is not None:
        real = key_padding_mask[:, c.reads].unsqueeze(1).unsqueeze(-1)  # (B, 1, n, bq, 1)
        allowed = real if allowed is None else allowed & real
    return None if allowed is None else allowed.transpose(-1, -2)


def _add_rows(target: Tensor, index: Tensor, rows: Tensor) -> None:
    """``target[index[b, h, n, r]] += rows[b, h, n, r]`` for a matrix ``target`` and ``rows``
    ``(B, H, n, r, F)``, read in the order they lie in memory: the fused kernel's gradients are
    views of ``(n, r, B·H, F)`` buffers, which would cost a transposing copy to read in logical order."""
    order = sorted(range(4), key=lambda d: -rows.stride(d))
    if not rows.is_contiguous() and rows.permute(*order, 4).is_contiguous():
        rows, index = rows.permute(*order, 4), index.permute(*order)
    target.index_add_(0, index.reshape(-1), rows.reshape(-1, rows.shape[-1]).to(target.dtype))


def _chunk_backward_fused(qc, kc, vc, gc, oc, lse, c: Chunk, scale: float):
    """The same through the fused kernel's backward, given the merged output and log-sum-exp."""
    B, H = qc.shape[:2]
    mask = None if c.causal or c.open else c.additive(B, H, qc.dtype)
    dq, dk, dv = fused_backward(
        as_batch(qc), as_batch(kc), as_batch(vc), as_batch(gc), as_batch(oc),
        as_batch(lse.unsqueeze(-1)).squeeze(-1), mask, c.causal, scale,
    )  # fmt: skip
    return from_batch(dq, B, H), from_batch(dk, B, H), from_batch(dv, B, H)

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

Blocks are read a chunk at a time, by gathering the listed rows or, for regular layouts, through
views (``query_view``, ``key_view``: windows, strides) that copy nothing. Memory is O(chunk) above
the inputs and outputs: no (L, S) tensor exists, and blocks a part does not list are never touched
(in particular the upper triangle of a causal pattern).

**Kernel.** Each chunk's blocks form the batch of one call of torch's CPU flash-attention kernel
(``fused``), which returns the log-sum-exp beside the output and accumulates in fp32 for half
inputs; or of the reference matmul-softmax-matmul (``eager``), with the softmax in fp32 or wider;
or, opted into, of subquad's native kernel (``native``, ``subquad.kernels.native``: C compiled on first use,
fp32 on AVX2 CPUs), whose cost per short block is lower. Where it cannot run, ``native`` falls back
to what ``fused`` runs and warns once; groups of long blocks (``native_runs``) keep that too. The
backward of ``native`` is the ``fused`` one.

**Softmax.** Each part gives, per query, its normalised output ``o_p`` and log-sum-exp ``lse_p``.
Parts hold disjoint key sets, so the pattern's softmax is their log-sum-exp merge, done chunk by
chunk in place: ``out = Σ_p exp(lse_p − lse) o_p`` with ``lse = log Σ_p exp(lse_p)``. A query with
no visible key has ``lse = −inf`` and returns zeros.

**Backward.** ``_BlockSparse`` saves only q, k, v, the output and ``lse``. The backward recomputes
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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from subquad.kernels import native as _native
from subquad.kernels.layouts import Group
from subquad.kernels.memory import kept_buffer, new_output, tracks_grad
from subquad.kernels.softmax import (
    additive_mask,
    eager_backward,
    eager_forward,
    fused_available,
    fused_backward,
    fused_forward,
    merge_into,
    work_dtype,
)
from subquad.kernels.threads import adapted_backward
from subquad.kernels.tuning import TUNING, block_elements

__all__ = [
    "BandBlocks",
    "band_blocks",
    "block_sparse_attention",
    "native_runs",
]


Part = Sequence[Group]


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


class _Chunk:
    """One chunk of a group: the gathered indices and the element mask, shared by both passes."""

    def __init__(
        self, group: Group, start: int, stop: int, H: int, L: int, S: int, pad: int, key_padding_mask: Tensor | None,
        groups: int = 1,
    ) -> None:  # fmt: skip
        self.group, self.start, self.stop, self.pad, self.groups = group, start, stop, pad, groups
        self.query_view = None if group.views is None else group.views.query_view
        self.writes = group.views is not None and group.views.writes  # outputs go through query_view
        self.queries = group.queries[start:stop]  # (n, bq)
        # Rows read for the empty slot L: any real row will do, as its probabilities are zero in the
        # backward pass and its forward output is written to the discarded row L.
        self.reads = self.queries.masked_fill(self.queries == L, 0)
        keys = group.keys[:, start:stop]  # (Hk, n, W)
        self.keys, self.H, self.S = keys, H, S
        self.shape = (H, *keys.shape[1:])  # (H, n, W)
        # Without key padding, the masks below depend on the layout alone: a group kept across calls
        # keeps them too (Group.memo), and a later call of the same shape builds none.
        self.memo = group.memo if key_padding_mask is None else None

        def layout_mask() -> Tensor:
            if group.facts.uniform:
                return group.allowed(start, start + 1)  # (.., 1, bq, W): broadcast over the blocks
            if group.facts.in_range:
                return group.allowed(start, stop)
            return group.allowed(start, stop) & (keys >= 0).unsqueeze(-2) & (keys < S).unsqueeze(-2)

        allowed = self.kept(("allowed",), layout_mask)
        self.causal = group.facts.causal and key_padding_mask is None
        # Nothing masked: the fused kernel runs without a mask.
        self.open = group.facts.dense and group.facts.in_range and key_padding_mask is None
        if key_padding_mask is not None:
            real = key_padding_mask[:, keys.clamp(0, S - 1)]  # (B, Hk, n, W)
            allowed = allowed & real.unsqueeze(-2)  # (B, Hk, n, 1, W)
        self.allowed = allowed

    def kept(self, key: tuple, build: Callable[[], Tensor]) -> Tensor:
        """``build()``, from the group's memo where it has one; masks over ``TUNING.blocksparse_kept_mask``
        elements are built each time (a long sequence's layout would hold them all), and a memo of
        many chunkings starts again at ``TUNING.blocksparse_kept_masks``."""
        if self.memo is None:
            return build()
        key = (self.start, self.stop, *key)
        value = self.memo.get(key)
        if value is None:
            value = build()
            if value.numel() <= TUNING.blocksparse_kept_mask:
                if len(self.memo) >= TUNING.blocksparse_kept_masks:
                    self.memo.clear()
                self.memo[key] = value
        return value

    def additive(self, B: int, H: int, dtype: torch.dtype) -> Tensor:
        """The element mask as the fused kernel's additive one (``_additive``)."""
        return self.kept(("additive", B, H, dtype), lambda: _additive(self.allowed, B, H, dtype))

    def keyless(self) -> Tensor:
        """Rows that see no key ``(.., n, bq)``, where the fused kernel reports lse = 0."""
        return self.kept(("keyless",), lambda: ~self.allowed.any(-1))

    @functools.cached_property
    def flat(self) -> Tensor:
        """The key rows of the chunk in the ``(B, H_kv·(S + 2 pad), ·)`` keys, flattened (query head h
        reads key head h // G): built only when gathered or scattered, as view groups read without
        them."""
        heads = torch.arange(self.H, device=self.keys.device).view(self.H, 1, 1) // self.groups
        heads = heads * (self.S + 2 * self.pad)
        return (heads + self.pad + self.keys.clamp(0, self.S - 1)).reshape(-1)

    def gather(self, x: Tensor, sources: dict, name: str) -> Tensor:
        """This chunk's keys (or values) from ``x`` ``(B, H_kv, S + 2 pad, F)``: ``(B, H, n, W, F)``.
        ``sources`` keeps each ``key_source`` sequence for the whole pass (built once). With
        grouped-query inputs each key head is repeated for its G query heads here, a chunk at a time.
        A gathered copy (not a view) is written into the thread's kept buffer ``name``
        (``memory.kept_buffer``): it lives until the next chunk's gather."""
        views = self.group.views
        if views is not None:
            if views.key_source is not None:
                key = (id(views.key_source), id(x))
                if key not in sources:
                    sources[key] = views.key_source(x, self.pad)
                x = sources[key]
            y = views.key_view(x, self.pad, self.start, self.stop)
            if y.shape[1] == self.H:
                return y
            B, Hkv = y.shape[:2]
            return y.unsqueeze(2).expand(B, Hkv, self.H // Hkv, *y.shape[2:]).flatten(1, 2)
        B, F_ = x.shape[0], x.shape[-1]
        rows = x.reshape(-1, F_)  # index_select along dim 0 of a matrix: the fast gather on CPU
        flat = self.flat
        if B > 1:
            flat = (torch.arange(B, device=x.device)[:, None] * (rows.shape[0] // B) + flat).flatten()
        out = kept_buffer(name, flat.numel() * F_, x.dtype, x.device).view(-1, F_)
        return torch.index_select(rows, 0, flat, out=out).view(B, *self.shape, F_)

    def take(self, x: Tensor, view: bool = True) -> Tensor:
        """This chunk's rows of queries (``view``) or of per-query tensors ``x`` ``(B, H, L(+pad), F)``:
        ``(B, H, n, bq, F)``."""
        if view and self.query_view is not None:
            return self.query_view(x, self.start, self.stop)
        return x[:, :, self.reads]

    def merge(self, out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
        """Merge this chunk's softmax over its keys into the one over earlier parts' (disjoint) keys:
        ``out = (e^lse out + e^block_lse block_out) / e^total``, ``total = log(e^lse + e^block_lse)``."""
        if self.writes:
            out_rows, lse_rows = self.take(out), self.take(lse)  # views: updated in place
        else:
            out_rows, lse_rows = out[:, :, self.queries], lse[:, :, self.queries]
        merge_into(out_rows, lse_rows, block_out, block_lse)
        if not self.writes:
            out[:, :, self.queries], lse[:, :, self.queries] = out_rows, lse_rows

    def write(self, out: Tensor, block_out: Tensor) -> None:
        """Put ``block_out`` ``(B, H, n, bq, F)`` into the rows of ``out`` ``(B, H, L + pad, F)``."""
        if self.writes:
            self.take(out).copy_(block_out)
        else:
            out[:, :, self.queries] = block_out.to(out.dtype)


def _pads(parts: Sequence[Part]) -> tuple[int, int]:
    """Rows to pad the queries with at the end and the keys at both ends: what the views read past
    the ends. Usually none: padding copies the inputs."""
    groups = [g for part in parts for g in part]
    return max([0] + [g.query_pad for g in groups]), max([0] + [g.key_pad for g in groups])


def _padded(x: Tensor, front: int, back: int) -> Tensor:
    return F.pad(x, (0, 0, front, back)) if front or back else x


def _chunks(
    group: Group, B: int, H: int, L: int, S: int, pad: int, key_padding_mask: Tensor | None, tile: int, views: bool,
    groups: int = 1,
):  # fmt: skip
    """The group's chunks of at most ``tile`` scores; with ``views``, a group read through views
    with one block's mask, whose chunks hold nothing but their output, of ``TUNING.blocksparse_view_tile``."""
    n, bq = group.queries.shape
    W = group.keys.shape[-1]
    if views and group.facts.uniform and group.views is not None and key_padding_mask is None:
        tile = TUNING.blocksparse_view_tile
    per_chunk = max(1, tile // max(1, B * H * bq * W))
    for start in range(0, n, per_chunk):
        yield _Chunk(group, start, min(start + per_chunk, n), H, L, S, pad, key_padding_mask, groups)


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


def native_runs(queries: int, keys: int) -> bool:
    """Whether ``kernel="native"`` runs blocks of this many queries and keys (else what ``fused``
    runs: torch's kernel, or eager when Dv ≠ D or off the CPU)."""
    return queries <= TUNING.native_queries and keys <= TUNING.native_keys


def _as_batch(x: Tensor) -> Tensor:
    """``(B, H, n, r, F)`` -> ``(n, B·H, r, F)``: one chunk's blocks as the batch of a fused call."""
    B, H, n = x.shape[:3]
    return x.permute(2, 0, 1, 3, 4).reshape(n, B * H, *x.shape[3:])


def _from_batch(x: Tensor, B: int, H: int) -> Tensor:
    """Inverse of ``_as_batch``."""
    n = x.shape[0]
    return x.reshape(n, B, H, *x.shape[2:]).movedim(0, 2)


def _additive(allowed: Tensor, B: int, H: int, dtype: torch.dtype) -> Tensor:
    """The element mask as the fused kernel's additive mask ``(n | 1, B·H | 1, bq, W)``."""
    while allowed.dim() < 5:
        allowed = allowed.unsqueeze(0)
    if allowed.shape[0] == 1 and allowed.shape[1] == 1:
        allowed = allowed[0, 0].unsqueeze(1)  # (n | 1, 1, bq, W)
    else:
        allowed = allowed.expand(B, H, *allowed.shape[2:]).movedim(2, 0).flatten(1, 2)  # (n | 1, B·H, bq, W)
    return additive_mask(allowed, dtype)


def _chunk_forward(q_ext, kf, vf, sources, c: _Chunk, scale: float, kernel: str) -> tuple[Tensor, Tensor]:
    """One chunk's normalised output ``(B, H, n, bq, Dv)`` and log-sum-exp ``(B, H, n, bq)``."""
    B, H = q_ext.shape[:2]
    qc, kc, vc = c.take(q_ext), c.gather(kf, sources, "blocksparse.keys"), c.gather(vf, sources, "blocksparse.values")
    if kernel == "native":  # lse = −inf already for a row with no key
        o, lse = _native.block_attention(_as_batch(qc), _as_batch(kc), _as_batch(vc), *_native_masks(c, B, H), scale)
        return _from_batch(o, B, H), _from_batch(lse.squeeze(-1), B, H)
    if kernel == "fused":
        mask = None if c.causal or c.open else c.additive(B, H, qc.dtype)
        o, lse = fused_forward(_as_batch(qc), _as_batch(kc), _as_batch(vc), mask, c.causal, scale)
        lse = _from_batch(lse, B, H)
        if mask is not None:  # the kernel reports lse = 0 for a row with no key
            lse = lse.masked_fill(c.keyless(), float("-inf"))
        return _from_batch(o, B, H), lse
    return eager_forward(qc, kc, vc, c.allowed, scale)


def _native_masks(c: _Chunk, B: int, H: int) -> tuple[Tensor | None, bool]:
    """The native kernel's additive mask and causal flag for a chunk. Its causal flag only skips
    keys, so it also serves triangular blocks that need their element mask (padding, the keys past
    the sequence's end): they skip the keys past each query block, as exact causal ones do."""
    mask = None if c.causal or c.open else c.additive(B, H, torch.float32)
    return mask, c.causal or c.group.facts.triangular


def _batch_view(x: Tensor) -> Tensor | None:
    """``_as_batch`` as a view of ``x``, or None where it would be a copy."""
    try:
        return x.permute(2, 0, 1, 3, 4).view(x.shape[2], -1, *x.shape[3:])
    except RuntimeError:
        return None


def _native_in_place(q_ext, kf, vf, sources, c: _Chunk, scale: float, out: Tensor, lse: Tensor, merge: bool) -> bool:
    """Run a chunk through the native kernel straight into (or merged into) its rows of ``out`` and
    ``lse``, where the group reads its queries through views that can be written: no block output
    is allocated and no second pass merges it. False where that cannot be done."""
    if not c.writes:
        return False
    rows, rows_lse = _batch_view(c.take(out)), _batch_view(c.take(lse))
    if rows is None or rows_lse is None:
        return False
    B, H = q_ext.shape[:2]
    qc, kc, vc = c.take(q_ext), c.gather(kf, sources, "blocksparse.keys"), c.gather(vf, sources, "blocksparse.values")
    mask, causal = _native_masks(c, B, H)
    _native.block_attention(_as_batch(qc), _as_batch(kc), _as_batch(vc), mask, causal, scale, (rows, rows_lse), merge)
    return True


def _forward(q, k, v, key_padding_mask, parts, scale, kernel, fused):
    """Outputs and log-sum-exps of every part, merged; in the work dtype."""
    B, H, L, _ = q.shape
    S, Dv = k.shape[2], v.shape[3]
    work = work_dtype(q.dtype)
    query_pad, pad = _pads(parts)
    q_ext = _padded(q, 0, query_pad)  # (B, H, L + query_pad, D)
    kf, vf = _padded(k, pad, pad), _padded(v, pad, pad)  # (B, H, S + 2 pad, ·)
    rows = L + max(1, query_pad)  # row L receives the empty slots
    out = lse = None
    sources: dict = {}
    for part in parts:
        if out is None:  # the first part writes, the others merge into what is there
            covered = torch.zeros(rows, dtype=torch.bool, device=q.device)
            for group in part:
                covered[group.queries.flatten()] = True
            # Rows the first part leaves out start as "no key seen": zero output, lse = −inf.
            out = new_output((B, H, rows, Dv), work, q.device)
            if not bool(covered[:L].all()):
                out.zero_()
            lse = q.new_full((B, H, rows, 1), float("-inf"), dtype=work)
            merge = False
        for group in part:
            # the native kernel's gain is on short blocks; torch's tiles are faster on long ones
            group_kernel = kernel
            if kernel == "native" and not native_runs(group.queries.shape[1], group.keys.shape[-1]):
                group_kernel = "fused" if fused else "eager"
            views = group_kernel != "eager"
            tile = TUNING.blocksparse_fused_tile if views else block_elements(TUNING.blocksparse_tile, q.device)
            for c in _chunks(group, B, H, L, S, pad, key_padding_mask, tile, views, H // k.shape[1]):
                if group_kernel == "native" and _native_in_place(q_ext, kf, vf, sources, c, scale, out, lse, merge):
                    continue
                o, chunk_lse = _chunk_forward(q_ext, kf, vf, sources, c, scale, group_kernel)
                if merge:
                    c.merge(out, lse, o.to(work), chunk_lse.to(work).unsqueeze(-1))
                else:
                    c.write(out, o)
                    c.write(lse, chunk_lse.unsqueeze(-1))
        merge = True
    return out[:, :, :L], lse[:, :, :L, 0]


class _BlockSparse(torch.autograd.Function):
    """Block-sparse attention whose backward recomputes every chunk (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, parts, scale, kernel, fused, backward_parts):  # type: ignore[override]
        out, lse = _forward(q, k, v, key_padding_mask, parts, scale, kernel, fused)
        ctx.save_for_backward(q, k, v, key_padding_mask, out, lse)
        ctx.parts, ctx.scale, ctx.fused = backward_parts, scale, fused
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @adapted_backward
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, key_padding_mask, out, lse = ctx.saved_tensors
        groups = [group for part in ctx.parts for group in part]
        grads = _Gradients(q, k, v, _pads([[g for g in groups if not g.transposed]])[1])
        # Each (query, key) pair lies in one group, and its gradient needs only the merged lse and
        # output: the groups are computed apart, in either orientation, into the same sums.
        # The empty slot L gets lse = +inf, so its probabilities are 0; queries that see no key too.
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))
        for transposed, backward in ((False, _straight_backward), (True, _transposed_backward)):
            some = [group for group in groups if group.transposed == transposed]
            if some:
                backward(grads, q, k, v, key_padding_mask, grad, out, lse, some, ctx.scale, ctx.fused)
        grad_q, grad_k, grad_v = grads.result()
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None, None, None


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
    dtype = q.dtype if fused else work
    query_pad, pad = _pads([groups])
    q_ext = _padded(q.to(dtype), 0, query_pad)
    g_ext, out_ext = grad.to(dtype), out.to(dtype)
    kf, vf = (_padded(x.to(dtype), pad, pad) for x in (k, v))  # (B, H, S + 2 pad, ·)
    delta = None if fused else (g_ext * out_ext).sum(-1)  # (B, H, L): rowsum(dO ∘ O)
    sources: dict = {}
    tile = TUNING.blocksparse_backward_tile if fused else block_elements(TUNING.blocksparse_tile, q.device)
    for group in groups:
        for c in _chunks(group, B, H, L, S, pad, key_padding_mask, tile, False, H // k.shape[1]):
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
    dtype = q.dtype if fused else work
    key_pad, pad = _pads([groups])  # rows past the end of the keys; rows past both ends of the queries
    qf, gf, of = (_padded(x.to(dtype), pad, pad) for x in (q, grad, out))  # (B, H, L + 2 pad, ·)
    lf = F.pad(lse, (pad, pad), value=float("inf")).unsqueeze(-1)  # padded queries take no weight
    df = None if fused else (gf * of).sum(-1, keepdim=True)  # rowsum(dO ∘ O)
    # keys and values per query head (a copy where grouped-query inputs share them)
    kx, vx = (x if G == 1 else x.repeat_interleave(G, dim=1) for x in (k.to(dtype), v.to(dtype)))
    kx, vx = _padded(kx, 0, key_pad), _padded(vx, 0, key_pad)
    sources: dict = {}
    tile = TUNING.blocksparse_backward_tile if fused else block_elements(TUNING.blocksparse_tile, q.device)
    for group in groups:
        # the chunks of the transposed pattern: its S "queries" are keys, its L "keys" queries
        for c in _chunks(group, B, H, S, L, pad, None, tile, False):
            kc, vc = c.take(kx), c.take(vx)  # (B, H, n, bq, ·)
            qc, gc, oc, lc = (
                c.gather(x, sources, f"blocksparse.transposed.{name}")
                for x, name in ((qf, "q"), (gf, "grad"), (of, "out"), (lf, "lse"))
            )
            allowed = _transposed_allowed(c, key_padding_mask, S)  # (.., n, W, bq): (query, key)
            if fused:
                mask = None
                if allowed is not None:
                    build = lambda allowed=allowed: _additive(allowed, B, H, dtype)  # noqa: E731
                    mask = build() if key_padding_mask is not None else c.kept(("transposed", B, H, dtype), build)
                dq, dk, dv = fused_backward(
                    _as_batch(qc), _as_batch(kc), _as_batch(vc), _as_batch(gc), _as_batch(oc),
                    _as_batch(lc).squeeze(-1), mask, False, scale,
                )  # fmt: skip
                dq, dk, dv = _from_batch(dq, B, H), _from_batch(dk, B, H), _from_batch(dv, B, H)
            else:
                dc = c.gather(df, sources, "blocksparse.transposed.delta")
                dq, dk, dv = eager_backward(qc, kc, vc, gc, lc.squeeze(-1), dc.squeeze(-1), allowed, scale)
            _add_rows(grads.q, grads.query_rows(c.keys.clamp(0, L - 1).expand(B, *c.shape)), dq)
            keys = grads.key_rows(c.reads.expand(B, H, *c.reads.shape))  # (B, H, n, bq)
            _add_rows(grads.k, keys, dk)
            _add_rows(grads.v, keys, dv)


def _transposed_allowed(c: _Chunk, key_padding_mask: Tensor | None, S: int) -> Tensor | None:
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


def _chunk_backward_fused(qc, kc, vc, gc, oc, lse, c: _Chunk, scale: float):
    """The same through the fused kernel's backward, given the merged output and log-sum-exp."""
    B, H = qc.shape[:2]
    mask = None if c.causal or c.open else c.additive(B, H, qc.dtype)
    dq, dk, dv = fused_backward(
        _as_batch(qc), _as_batch(kc), _as_batch(vc), _as_batch(gc), _as_batch(oc),
        _as_batch(lse.unsqueeze(-1)).squeeze(-1), mask, c.causal, scale,
    )  # fmt: skip
    return _from_batch(dq, B, H), _from_batch(dk, B, H), _from_batch(dv, B, H)

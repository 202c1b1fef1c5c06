"""The forward pass of block-sparse attention (``kernels.blocksparse``): every part's chunks, merged.

**Kernel.** Each chunk's blocks form the batch of one call of torch's CPU flash-attention kernel
(``fused``), which returns the log-sum-exp beside the output and accumulates in fp32 for half
inputs; or of the reference matmul-softmax-matmul (``eager``), with the softmax in fp32 or wider;
or, opted into, of subquad's native kernel (``native``, ``subquad.kernels.native``: C compiled on first use,
fp32 on AVX2 CPUs), whose cost per short block is lower. Where it cannot run, ``native`` falls back
to what ``fused`` runs and warns once; groups of long blocks (``native_runs``) keep that too. The
backward of ``native`` is the ``fused`` one.

**The sinks.** A group whose blocks all read the sequence's first few keys (``Group.leading``:
StreamingLLM's sinks beside a window or a pattern) is computed for runs of queries at once, one
product, softmax and product over all its queries' rows, instead of block by block through a
kernel's call: per block it is a call for a handful of keys (SmolLM2's local window at 8,192
tokens: 256 calls of 4 keys, a third of the call's time). Its backward is still the blocks'.

**Softmax.** Each part gives, per query, its normalised output ``o_p`` and log-sum-exp ``lse_p``.
Parts hold disjoint key sets, so the pattern's softmax is their log-sum-exp merge, done chunk by
chunk in place: ``out = Σ_p exp(lse_p − lse) o_p`` with ``lse = log Σ_p exp(lse_p)``. A query with
no visible key has ``lse = −inf`` and returns zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from subquad.kernels import native as _native
from subquad.kernels.blocksparse_chunks import Chunk, Part, as_batch, chunks, from_batch, padded, pads
from subquad.kernels.memory import new_output
from subquad.kernels.softmax import eager_forward, fused_forward, fused_reads_grouped, merge_into, work_dtype
from subquad.kernels.tuning import TUNING, block_elements

__all__ = ["block_sparse_forward", "leading_keys", "native_runs"]


def native_runs(queries: int, keys: int) -> bool:
    """Whether ``kernel="native"`` runs blocks of this many queries and keys (else what ``fused``
    runs: torch's kernel, or eager when Dv ≠ D or off the CPU)."""
    return queries <= TUNING.native_queries and keys <= TUNING.native_keys


def _chunk_forward(q_ext, kf, vf, sources, c: Chunk, scale: float, kernel: str) -> tuple[Tensor, Tensor]:
    """One chunk's normalised output ``(B, H, n, bq, Dv)`` and log-sum-exp ``(B, H, n, bq)``."""
    B, H = q_ext.shape[:2]
    grouped = kernel == "fused" and fused_reads_grouped()  # torch's kernel reads a key/value head per G query heads
    kc, vc = (c.gather(x, sources, f"blocksparse.{name}", grouped) for x, name in ((kf, "keys"), (vf, "values")))
    qc = c.take(q_ext)
    if kernel == "native":  # lse = −inf already for a row with no key
        o, lse = _native.block_attention(as_batch(qc), as_batch(kc), as_batch(vc), *_native_masks(c, B, H), scale)
        return from_batch(o, B, H), from_batch(lse.squeeze(-1), B, H)
    if kernel == "fused":
        mask = None if c.causal or c.open else c.additive(B, H, qc.dtype)
        o, lse = fused_forward(as_batch(qc), as_batch(kc), as_batch(vc), mask, c.causal, scale)
        lse = from_batch(lse, B, H)
        if mask is not None:  # the kernel reports lse = 0 for a row with no key
            lse = lse.masked_fill(c.keyless(), float("-inf"))
        return from_batch(o, B, H), lse
    return eager_forward(qc, kc, vc, c.allowed, scale)


def _native_masks(c: Chunk, B: int, H: int) -> tuple[Tensor | None, bool]:
    """The native kernel's additive mask and causal flag for a chunk. Its causal flag only skips
    keys, so it also serves triangular blocks that need their element mask (padding, the keys past
    the sequence's end): they skip the keys past each query block, as exact causal ones do."""
    mask = None if c.causal or c.open else c.additive(B, H, torch.float32)
    return mask, c.causal or c.group.facts.triangular


def _batch_view(x: Tensor) -> Tensor | None:
    """``as_batch`` as a view of ``x``, or None where it would be a copy."""
    try:
        return x.permute(2, 0, 1, 3, 4).view(x.shape[2], -1, *x.shape[3:])
    except RuntimeError:
        return None


def _native_in_place(q_ext, kf, vf, sources, c: Chunk, scale: float, out: Tensor, lse: Tensor, merge: bool) -> bool:
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
    _native.block_attention(as_batch(qc), as_batch(kc), as_batch(vc), mask, causal, scale, (rows, rows_lse), merge)
    return True


def block_sparse_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    parts: Sequence[Part],
    scale: float,
    kernel: str,
    fused: bool,
) -> tuple[Tensor, Tensor]:
    """Outputs and log-sum-exps of every part, merged; in the work dtype."""
    B, H, L, _ = q.shape
    S, Dv = k.shape[2], v.shape[3]
    work = work_dtype(q.dtype)
    query_pad, pad = pads(parts)
    q_ext = padded(q, 0, query_pad)  # (B, H, L + query_pad, D)
    kf, vf = padded(k, pad, pad), padded(v, pad, pad)  # (B, H, S + 2 pad, ·)
    # Rows past L receive the empty slots (row L) and what views write past the queries; with none
    # (a layout of whole blocks, known on the CPU), the output is allocated as SDPA's: contiguous.
    rows = L + max(query_pad, 1 if q.device.type != "cpu" or _empty_slots(parts, L) else 0)
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
            if group.leading is not None and not group.transposed:  # the sinks: all queries at once
                W = group.keys.shape[-1]
                keys, values = kf.narrow(2, pad, W), vf.narrow(2, pad, W)
                leading_keys(q, keys, values, group.leading, key_padding_mask, scale, out, lse, merge)
                continue
            # the native kernel's gain is on short blocks; torch's tiles are faster on long ones
            group_kernel = kernel
            if kernel == "native" and not native_runs(group.queries.shape[1], group.keys.shape[-1]):
                group_kernel = "fused" if fused else "eager"
            views = group_kernel != "eager"
            tile = TUNING.blocksparse_fused_tile if views else block_elements(TUNING.blocksparse_tile, q.device)
            for c in chunks(group, B, H, L, S, pad, key_padding_mask, tile, views, H // k.shape[1]):
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


def leading_keys(
    q: Tensor, k: Tensor, v: Tensor, seen: Callable[[int, int], Tensor], key_padding_mask: Tensor | None,
    scale: float, out: Tensor, lse: Tensor, merge: bool = True,
) -> None:  # fmt: skip
    """The softmax of queries ``q`` ``(B, H, L, D)`` over a few keys ``k``, ``v`` ``(B, Hk, W, ·)``
    (the sequence's first: the sinks), written or merged (``merge``) into ``out`` ``(B, H, ≥ L, Dv)``
    and ``lse`` ``(B, H, ≥ L, 1)`` (work dtype) for runs of queries at once: one product, softmax
    and product over all their rows (module docstring). ``seen(a, b)``: bool, broadcastable to
    ``(H, b − a, W)``, which keys queries ``a … b − 1`` see (on the CPU applied only where it hides
    some), and real keys only (``key_padding_mask`` ``(B, ≥ W)``); a row that sees none gets zero
    and lse = −inf. Grouped-query keys are read by their query heads in place."""
    B, H, L, D = q.shape
    Hk, W, Dv, work = k.shape[1], k.shape[2], v.shape[-1], out.dtype
    G, inf = H // Hk, float("-inf")
    keys, values = k.to(work) * scale, v.to(work)
    real = None if key_padding_mask is None else key_padding_mask[:, None, None, :W]
    step = max(1, min(TUNING.blocksparse_rows, TUNING.blocksparse_fused_tile // max(1, W)) // (B * H))
    for a in range(0, L, step):
        b = min(L, a + step)
        rows = q[:, :, a:b].to(work).reshape(B, Hk, G * (b - a), D)
        scores = torch.matmul(rows, keys.transpose(-1, -2)).view(B, H, b - a, W)
        hidden = ~(seen(a, b) if real is None else seen(a, b) & real)
        if not (q.is_cpu and not bool(hidden.any())):
            scores.masked_fill_(hidden, inf)
        top = scores.amax(-1, keepdim=True)  # (B, H, b − a, 1): −inf where no key is seen
        top.masked_fill_(top == inf, 0.0)
        weights = scores.sub_(top).exp_()  # rows seeing none: all zero
        total = weights.sum(-1, keepdim=True)
        part = torch.matmul(weights.view(B, Hk, G * (b - a), W), values).view(B, H, b - a, Dv).div_(total)
        top.add_(total.log_())  # the part's log-sum-exp: −inf where it sees no key (its output 0 / 0 …
        part.masked_fill_(top == inf, 0.0)  # … made 0)
        if merge:
            merge_into(out[:, :, a:b], lse[:, :, a:b], part, top)
        else:
            out[:, :, a:b], lse[:, :, a:b] = part, top


def _empty_slots(parts: Sequence[Part], L: int) -> bool:
    """Whether some block of ``parts`` has an empty query slot (marked ``L``)."""
    return any(bool((group.queries >= L).any()) for part in parts for group in part)

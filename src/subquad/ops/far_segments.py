"""``retrieval``'s far part in segments (``ops.far_blocks._far``): the queries that chose a far block
are gathered into segments of a few rows, each segment scored against its block in one batched
product, and each query's partials summed back.

``segments`` lays the (query, block) pairs out in segments, ``segment_blocks`` gathers each
segment's block of keys and values, ``per_query`` sums each query's rows. ``SegmentBuffers`` holds a
chunk's large temporaries: without autograd on the CPU, buffers the thread keeps from chunk to
chunk and call to call (``kernels.memory.kept_buffer``). A chunk's fresh temporaries (about ten
megabytes each at 8,192 tokens) made glibc shrink its heap and fault it back in, about one call in
two: 0.4 million page faults and half the call's time (docs/performance.md).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from subquad.kernels.memory import kept_buffer, new_buffers
from subquad.kernels.tuning import TUNING

__all__ = ["SegmentBuffers", "per_query", "segment_blocks", "segments", "whole_blocks"]


class SegmentBuffers:
    """A call's far part: k and v as ``rows`` of whole blocks (``whole_blocks``), and, without
    autograd (``kept``), the large temporaries of its chunks in buffers: those of up to
    ``TUNING.kept_buffer`` elements the thread keeps from call to call
    (``kernels.memory.kept_buffer``), larger ones this call keeps from chunk to chunk (in huge pages:
    ``kernels.memory.new_buffers``). Not ``kept`` (autograd keeps its tensors), or ``rows`` None:
    fresh tensors. A result returned or saved is never a buffer."""

    def __init__(self, rows: tuple[Tensor, Tensor] | None = None, kept: bool = True) -> None:
        self.rows, self.kept = rows, rows is not None and kept
        self._own: dict[str, Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor | None:
        """A buffer of ``shape`` for ``name`` (``out=`` of the op that fills it), or None: fresh."""
        if not self.kept:
            return None
        numel = math.prod(shape)
        if numel <= TUNING.kept_buffer or like.device.type != "cpu":
            return kept_buffer(f"retrieval.segments.{name}", numel, like.dtype, like.device).view(shape)
        own = self._own.get(name)
        if own is None or own.numel() < numel or own.dtype != like.dtype:  # the later chunks' needs vary a little
            own = self._own[name] = new_buffers([(numel + numel // 4,)], like.dtype, like.device, zero=False)[0]
        return own[:numel].view(shape)


def whole_blocks(k: Tensor, v: Tensor, counted: Tensor) -> tuple[Tensor, Tensor]:
    """``k`` and ``v`` ``(B, Hk, S, ·)`` as rows of whole blocks ``(B·Hk·blocks, size·F)`` (``counted``:
    ``(B, blocks, size)``), zero-padded to ``blocks · size`` positions: views where they are
    contiguous and fill their blocks, else one copy per call (the segments of every chunk gather
    from them)."""
    blocks, size = counted.shape[1:]
    rows = []
    for x in (k, v):
        if blocks * size != x.shape[2]:
            x = torch.nn.functional.pad(x, (0, 0, 0, blocks * size - x.shape[2]))
        rows.append(x.contiguous().view(-1, size * x.shape[-1]))
    return rows[0], rows[1]


def segment_blocks(
    k: Tensor, v: Tensor, counted: Tensor, owner: Tensor, units: int, shared: int, work: torch.dtype,
    scratch: SegmentBuffers,
):  # fmt: skip
    """The keys and values ``(T, block, ·)`` of each segment's block (``owner``: of the blocks of all
    rows and units), read from the key/value heads, and the additive mask ``(T, 1, block)`` of
    its keys that count (sinks and padding: −inf). With ``scratch.rows`` (``whole_blocks``' k and v),
    gathered from them by ``index_select`` (into ``scratch``'s buffers where it keeps them; under
    autograd its gradient is one ``index_add``, where advanced indexing's ``index_put`` with
    accumulation took 7× as long on the CPU); else from ``k`` and ``v`` by indexing."""
    Hk, S = k.shape[1:3]
    n, size = counted.shape[1:]
    b, block = owner // (units * n), owner % n
    head = owner // n % units * shared // (units * shared // Hk)  # the key/value head of the segment's unit
    if scratch.rows is not None:
        flat = (b * Hk + head) * n + block
        keys, values = (
            torch.index_select(x, 0, flat, out=scratch(name, (len(flat), x.shape[1]), x)).view(len(flat), size, -1)
            for name, x in zip(("keys", "values"), scratch.rows)
        )
    else:
        if n * size > S and bool((block == n - 1).any()):  # the last block, partly filled, chosen (not causal)
            k, v = (torch.nn.functional.pad(x, (0, 0, 0, n * size - S)) for x in (k, v))
        elif n * size > S:  # the whole blocks, a view
            k, v = (x[:, :, : (n - 1) * size] for x in (k, v))
        keys, values = (x.to(work).view(*x.shape[:2], -1, size, x.shape[-1])[b, head, block] for x in (k, v))
    bias = torch.zeros(owner.shape[0], 1, size, dtype=work, device=k.device)
    return keys, values, bias.masked_fill_(~counted[b, block][:, None], float("-inf"))


def segments(ids: Tensor, count: int, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """Segments of ``rows`` slots for the pairs ``ids`` ``(..., blocks)`` (each query's chosen
    blocks, numbered below ``count``; ``count``: none), a block's pairs in their order and its
    segments consecutive. Returns each slot's query (the index of ``ids[..., 0]``'s entry; their
    number for an empty slot), each segment's block, and each pair's slot (past the last: none)."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    ranked = flat[order]
    counts = torch.bincount(flat, minlength=count + 1)[:count]
    spans = (counts + rows - 1).div(rows, rounding_mode="floor")
    ends = spans.cumsum(0)
    total = int(ends[-1])
    at = ranked.clamp_max(count - 1)
    place = (ends - spans)[at] * rows + torch.arange(flat.numel(), device=ids.device) - (counts.cumsum(0) - counts)[at]
    slot = torch.empty_like(flat)
    slot[order] = torch.where(ranked < count, place, total * rows)
    asker = torch.full((total * rows + 1,), flat.numel() // ids.shape[-1], dtype=torch.long, device=ids.device)
    asker[slot] = torch.arange(flat.numel(), device=ids.device) // ids.shape[-1]
    owner = torch.repeat_interleave(torch.arange(count, device=ids.device), spans, output_size=total)
    return asker[:-1], owner, slot


def per_query(x: Tensor, asker: Tensor, slot: Tensor, asks: int, ordered: bool | None = None) -> Tensor:
    """Each query's sum ``(asks, ·)`` of its slots' rows of ``x``, added in slot order: on the CPU by
    ``index_add`` (which adds in index order there), elsewhere, where it adds with atomics in any
    order, as a sum over each query's own slots (``slot``: each pair's, past the last: none).
    ``ordered``: whether ``index_add`` adds in order (default: on the CPU)."""
    if (x.device.type == "cpu" and ordered is None) or ordered:
        return x.new_zeros(asks + 1, *x.shape[1:]).index_add_(0, asker, x)[:asks]
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return padded[slot].view(asks, -1, *x.shape[1:]).sum(1)

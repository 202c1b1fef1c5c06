"""Working block by block: assembling an output, and reusing buffers.

``BlockOutput``: without autograd, blocks are written into one tensor (a single block is returned
as it is): no second full-size copy. With autograd they are concatenated instead: each slice write
into a shared buffer would make its backward node copy the gradient of the whole buffer, which is
quadratic in the number of blocks.

``Scratch``: named buffers that a loop over blocks writes its temporaries into (``out=``), so
each is allocated once per call rather than once per block.

``new_output``: ``torch.empty`` for a large output, in huge pages on Linux CPUs; ``new_buffers``:
several working buffers carved from one of them.

``workspace``: working buffers lent for the length of a ``with`` block and kept, per thread, for the
next call, so a short sequence's temporaries cost no fresh pages at all.

"""

from __future__ import annotations

import contextlib
import ctypes
import math
import sys
import threading
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = [
    "BlockOutput",
    "Scratch",
    "new_buffers",
    "new_output",
    "new_output_like",
    "tracks_grad",
    "workspace",
]

_HUGE_PAGE = 1 << 21  # x86-64 and arm64 with 4 KiB base pages
_MADV_HUGEPAGE = 14  # <asm-generic/mman-common.h>


def _load_madvise():
    """libc's ``madvise`` on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _load_madvise()


def new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.empty(shape)``; on Linux, a CPU tensor's whole 2 MiB pages are advised into huge pages.

    A fresh output of tens of megabytes comes from the kernel page by page, and at 4 KiB a page its
    first write costs more in page faults than the pass that writes it; in huge pages it costs
    about a third as much (docs/performance.md). Huge pages come where the kernel's transparent_hugepage setting
    is ``madvise`` (as on many distributions; ``always`` gives them anyway, ``never`` ignores the
    advice). The advice is given for pages of this tensor only, though it stays with those
    addresses after the tensor is freed; where ``defrag`` makes the kernel compact memory for such
    a fault, a fragmented machine can make the first write slower instead.
    """
    return _advised(torch.empty(shape, dtype=dtype, device=device))


def new_output_like(x: Tensor) -> Tensor:
    """``torch.empty_like(x)`` (same strides for a dense ``x``), advised as in ``new_output``."""
    return _advised(torch.empty_like(x))


def _advised(out: Tensor) -> Tensor:
    """``out``, a fresh dense tensor, with its whole huge pages advised (Linux CPUs only)."""
    if _madvise is None or out.device.type != "cpu" or type(out) is not Tensor:  # not a subclass or a fake
        return out
    try:
        begin = out.data_ptr()
    except RuntimeError:  # no storage to advise (e.g. while tracing)
        return out
    first = -(-begin // _HUGE_PAGE) * _HUGE_PAGE
    last = (begin + out.numel() * out.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if last > first:
        _madvise(first, last - first, _MADV_HUGEPAGE)
    return out


def new_buffers(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device, zero: bool) -> list[Tensor]:
    """Contiguous tensors of ``shapes``, carved from one ``new_output`` (each starting on a 64-byte
    line, the first on a 2 MiB boundary when they fill a huge page), zero-filled if ``zero``.

    A loop's working buffers of a few hundred kilobytes each, allocated one by one, land on
    whatever 4 KiB pages the allocator has; on a physically indexed cache, how their lines
    collide then changes from one process to the next, and so does the speed of the loop that
    uses them (docs/performance.md). Carved from huge pages from a 2 MiB boundary on, their
    layout in those caches is the same every time.
    """
    starts = _line_starts(shapes, dtype)
    slab = _new_slab(starts[-1], dtype, device)
    if zero:
        slab.zero_()
    return _carve(slab, shapes, starts)


def _line_starts(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[int]:
    """Element offsets of ``shapes`` laid out one after another, each on a 64-byte line; the last
    entry is the total."""
    line = max(1, 64 // dtype.itemsize)
    starts = [0]
    for shape in shapes:
        starts.append(starts[-1] + -(-math.prod(shape) // line) * line)
    return starts


def _new_slab(total: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``total`` elements of a ``new_output``, from a 2 MiB boundary when they fill a huge page."""
    align = _HUGE_PAGE // dtype.itemsize if total * dtype.itemsize >= _HUGE_PAGE and device.type == "cpu" else 0
    slab = new_output((total + align,), dtype, device)
    offset = 0
    if align:  # the untouched pages before the boundary cost address space only
        offset = (-slab.data_ptr() % _HUGE_PAGE) // dtype.itemsize
    return slab[offset : offset + total]


def _carve(slab: Tensor, shapes: list[tuple[int, ...]], starts: list[int]) -> list[Tensor]:
    return [slab[start : start + math.prod(shape)].view(shape) for start, shape in zip(starts, shapes)]


WORKSPACE_BYTES = 32 << 20  # the largest workspace a thread keeps between calls, per dtype
_pool = threading.local()  # .slabs: {dtype: slab} of this thread


@contextlib.contextmanager
def workspace(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> Iterator[list[Tensor]]:
    """Working buffers of ``shapes`` (contents undefined) for the length of the ``with`` block, laid
    out as ``new_buffers`` lays them out.

    On the CPU they come from a slab this thread keeps from one call to the next (up to
    ``WORKSPACE_BYTES``): a fresh slab of a few megabytes costs more in page faults than a short
    sequence's whole pass over it. The slab is lent, not shared: a nested ``workspace`` gets a slab
    of its own, and another thread has its own. Nothing the block returns may be a view of the
    buffers, and they take no gradient. Elsewhere (CUDA has its caching allocator) they are fresh.
    """
    starts = _line_starts(shapes, dtype)
    total = starts[-1]
    if device.type != "cpu" or total * dtype.itemsize > WORKSPACE_BYTES:
        yield _carve(_new_slab(total, dtype, device), shapes, starts)
        return
    slabs = getattr(_pool, "slabs", None)
    if slabs is None:
        slabs = _pool.slabs = {}
    slab = slabs.pop(dtype, None)  # lent: a nested call finds none and makes its own
    if slab is None or slab.numel() < total:
        # grown in steps of a quarter, so slowly growing calls do not reallocate every time
        slab = _new_slab(min(max(total, total * 5 // 4), WORKSPACE_BYTES // dtype.itemsize), dtype, device)
    try:
        yield _carve(slab, shapes, starts)
    finally:
        kept = slabs.get(dtype)
        if kept is None or kept.numel() < slab.numel():
            slabs[dtype] = slab


def tracks_grad(*tensors: Tensor) -> bool:
    """Whether autograd records operations on any of ``tensors`` here."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class BlockOutput:
    """Collects consecutive blocks along ``dim`` of a tensor of ``shape``.

    Args:
        shape: the whole output's shape.
        dim: the dimension the blocks follow each other along.
        like: a tensor whose dtype and device the output takes.
        track: whether the blocks carry gradients (concatenate them) or not (write in place).
    """

    def __init__(self, shape: tuple[int, ...], dim: int, like: Tensor, track: bool) -> None:
        self.shape, self.dim, self.like, self.track = shape, dim, like, track
        self.pieces: list[Tensor] = []
        self.buffer: Tensor | None = None
        self.filled = 0

    def put(self, block: Tensor) -> None:
        """Append the next block (its size along ``dim`` is taken from it)."""
        if not self.track and self.pieces:  # a second block: from now on, write into one buffer
            self.buffer = self.like.new_empty(self.shape, dtype=block.dtype)
            self.buffer.narrow(self.dim, 0, self.filled).copy_(self.pieces.pop())
        if self.buffer is not None:
            self.buffer.narrow(self.dim, self.filled, block.shape[self.dim]).copy_(block)
        else:
            self.pieces.append(block)
        self.filled += block.shape[self.dim]

    def result(self) -> Tensor:
        if self.buffer is not None:
            return self.buffer
        return self.pieces[0] if len(self.pieces) == 1 else torch.cat(self.pieces, dim=self.dim)


class Scratch:
    """Buffers reused across the blocks of one call, by name: on CPU a freshly allocated tensor of
    a megabyte costs more in page faults on its first write than a pass of work over it."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.buffers: dict[str, Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """A contiguous tensor of ``shape`` (contents undefined)."""
        size = math.prod(shape)
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < size:
            buffer = self.buffers[name] = torch.empty(size, dtype=self.dtype, device=self.device)
        return buffer[:size].view(shape)

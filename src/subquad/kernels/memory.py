"""Working block by block: assembling an output, and reusing buffers.

``BlockOutput``: without autograd, blocks are written into one tensor (a single block is returned
as it is): no second full-size copy. With autograd they are concatenated instead: each slice write
into a shared buffer would make its backward node copy the gradient of the whole buffer, which is
quadratic in the number of blocks.

``Scratch``: named buffers that a loop over blocks writes its temporaries into (``out=``), so
each is allocated once per call rather than once per block.

``new_output``: ``torch.empty`` for a large output, in huge pages on Linux CPUs; ``new_buffers``:
several working buffers carved from one such tensor.

``kept_buffer``: a named working buffer on the CPU that the calling thread keeps from call to call.

"""

from __future__ import annotations

import ctypes
import math
import sys
import threading

import torch
from torch import Tensor

from subquad.kernels.tuning import TUNING

__all__ = [
    "BlockOutput",
    "Scratch",
    "kept_buffer",
    "new_buffers",
    "new_output",
    "new_output_like",
    "tracks_grad",
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
    """``torch.empty(shape)``; on Linux, a CPU tensor of at least ``TUNING.huge_page_mib`` MiB has its
    whole 2 MiB pages advised into huge pages.

    A fresh output of tens of megabytes comes from the kernel page by page, and at 4 KiB a page its
    first write costs more in page faults than the pass that writes it; in huge pages it costs
    about a third as much (docs/performance.md). Huge pages come where the kernel's transparent_hugepage setting
    is ``madvise`` (as on many distributions; ``always`` gives them anyway, ``never`` ignores the
    advice). The advice is given for pages of this tensor only, though it stays with those
    addresses after the tensor is freed; where ``defrag`` makes the kernel compact memory for such
    a fault, a fragmented machine can make the first write slower instead, and a virtual machine may
    fault a huge page in slower than its 512 small ones at some times and faster at others: raising
    ``TUNING.huge_page_mib`` past every output turns the advice off. ``subquad tune`` does not time
    it: on the VM where it was tried, its measurement flipped between runs (docs/performance.md).
    """
    return _advised(torch.empty(shape, dtype=dtype, device=device), TUNING.huge_page_mib << 20)


def new_output_like(x: Tensor) -> Tensor:
    """``torch.empty_like(x)`` (same strides for a dense ``x``), advised as in ``new_output``."""
    return _advised(torch.empty_like(x), TUNING.huge_page_mib << 20)


def _advised(out: Tensor, least: int = 0) -> Tensor:
    """``out``, a fresh dense tensor, with its whole huge pages advised (Linux CPUs only) where it
    holds at least ``least`` bytes."""
    if _madvise is None or out.device.type != "cpu" or type(out) is not Tensor:  # not a subclass or a fake
        return out
    if out.numel() * out.element_size() < least:
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
    """Contiguous tensors of ``shapes``, carved from one tensor advised into huge pages as
    ``new_output``'s are, whatever ``TUNING.huge_page_mib`` says (each starting on a 64-byte line,
    the first on a 2 MiB boundary when they fill a huge page), zero-filled if ``zero``.

    A loop's working buffers of a few hundred kilobytes each, allocated one by one, land on
    whatever 4 KiB pages the allocator has; on a physically indexed cache, how their lines
    collide then changes from one process to the next, and so does the speed of the loop that
    uses them (docs/performance.md). Carved from huge pages from a 2 MiB boundary on, their
    layout in those caches is the same every time.
    """
    line = max(1, 64 // dtype.itemsize)
    sizes = [math.prod(shape) for shape in shapes]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // line) * line)
    total = starts[-1]
    align = _HUGE_PAGE // dtype.itemsize if total * dtype.itemsize >= _HUGE_PAGE and device.type == "cpu" else 0
    slab = _advised(torch.empty(total + align, dtype=dtype, device=device))
    offset = 0
    if align:  # the untouched pages before the boundary cost address space only
        offset = (-slab.data_ptr() % _HUGE_PAGE) // dtype.itemsize
    slab = slab[offset : offset + total]
    if zero:
        slab.zero_()
    return [slab[start : start + size].view(shape) for start, size, shape in zip(starts, sizes, shapes)]


_kept = threading.local()


def kept_buffer(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A contiguous 1-D tensor of ``numel`` elements (contents undefined) for the temporaries that
    ``name`` stands for.

    On the CPU, up to ``TUNING.kept_buffer`` elements, it is a view of a buffer that the calling
    thread keeps for its next request of that name and dtype (grown when a request needs more),
    carved from huge pages as ``new_buffers`` (a kept buffer in 4 KiB pages ran slower than fresh
    ones in some processes, by where its pages fell in the caches); larger requests, and other
    devices (whose caching allocators keep memory already), and requests under fake tensors or
    compilation (nothing is kept from them) get a fresh tensor. A call's
    temporaries of a few megabytes, freed at its end, can make glibc's heap shrink and grow again
    with every call, each time faulting their pages back in: block-sparse gathers took 2500 page
    faults a call in some processes and none in others (docs/performance.md).

    The caller owns the buffer until it returns: nothing it returns or saves may be a view of it,
    and it must not be asked for again (by that name) meanwhile, as a later request on the same
    thread gets the same memory.
    """
    if device.type != "cpu" or numel > TUNING.kept_buffer or _tracing():
        return torch.empty(numel, dtype=dtype, device=device)
    store = _kept.__dict__.setdefault("buffers", {})
    buffer = store.get((name, dtype))
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: out= may write it outside inference mode
            buffer = store[(name, dtype)] = new_buffers([(numel,)], dtype, device, zero=False)[0]
    return buffer[:numel]


def _tracing() -> bool:
    """Whether tensors made now are fakes or traced (under fake tensors, or compiled): keeping one
    would hand a later, real call a tensor it cannot write into. (The active fake mode read
    directly: ``torch._guards.detect_fake_mode`` costs 3.5 µs a call, this 0.3.)"""
    fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    return fake is not None or torch.compiler.is_compiling()


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

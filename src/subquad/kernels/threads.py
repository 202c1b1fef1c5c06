"""Intra-op threads under contention: fewer threads while other processes keep this process's cores busy.

torch runs each operation's parallel region on all of its intra-op threads, and a region ends at a
barrier where they wait for the slowest. When another process keeps one of the cores busy, the
thread that shares that core runs a time slice at a time, and every barrier waits for its next
slice; the waiting threads spin meanwhile, taking CPU from the thread with work left. One long
region (full attention's) loses about half a core. The mechanisms run many short regions, and lost
up to 3.6× their quiet speed relative to full attention (docs/performance.md).

It is opt-in (``TUNING.adaptive_threads = 1``, ``tuned(adaptive_threads=1)``, ``subquad bench
--adaptive-threads yes``): a library call must not change its caller's thread count, and on a quiet
machine it changes nothing measurable. Switched on, ``adapted`` runs a call with as many threads as
there are cores left free. The load comes from
``/proc/stat``: the busy time of the cores this process may run on, less this process's own CPU
time (``getrusage``), averaged since the previous reading, which is taken when at least ``PERIOD``
seconds have passed (so a call costs a clock read). With a core's worth or more taken by others, a
2-thread process runs its calls on one thread, which then never waits at a barrier. A quiet
machine changes nothing.

Where it does nothing:

- by default (``TUNING.adaptive_threads = 0``), off the CPU, or where there is no ``/proc/stat``
  (not Linux): calls run on ``torch.get_num_threads()`` threads, as set;
- in a process running other Python threads: ``torch.set_num_threads`` also sets the count a
  thread takes when it first uses torch, so a thread starting while a call ran on fewer threads
  would keep that count.

The count is lowered for the calling thread for the length of the call, or of its backward: an
autograd Function's backward runs under ``adapted`` (``adapted_backward``), and where a mechanism's
backward is autograd's own operations, hooks bracket it (``backward_adapted``). It is restored even
when the call raises (a backward that raised: at the next call). Outputs and gradients of every mechanism are
bitwise the same on one thread as on two at the shapes tested (``tests/test_threads.py``); a
reduction over tens of millions of elements can round differently with the thread count, so on
very long inputs the last bits may follow the load.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from subquad.kernels.tuning import TUNING

try:
    import resource
except ImportError:  # not POSIX
    resource = None  # type: ignore[assignment]

__all__ = [
    "PERIOD",
    "Sample",
    "adapted",
    "adapted_backward",
    "backward_adapted",
    "free_cores",
    "read_sample",
    "threads_for",
]

PERIOD = 0.1  # seconds between two reads of the machine's load

# /proc/stat columns after the cpu name: user nice system idle iowait irq softirq steal (guest is in user)
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)  # steal: a hypervisor ran something else on this core
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Sample:
    """One reading: ``wall`` (monotonic s), ``busy`` (s of non-idle time of the process's cores, all
    processes), ``own`` (s of CPU this process used), ``cores`` (how many cores it may run on)."""

    wall: float
    busy: float
    own: float
    cores: int


def read_sample(clock: Callable[[], float] = time.monotonic) -> Sample | None:
    """The machine's counters now (``wall`` from ``clock``), or None where they cannot be read (not
    Linux, no ``/proc``)."""
    if resource is None or not hasattr(os, "sched_getaffinity"):
        return None
    try:
        cores = os.sched_getaffinity(0)
        with open("/proc/stat", "rb") as stat:
            lines = stat.read().split(b"\n")
        usage = resource.getrusage(resource.RUSAGE_SELF)
        ticks = 0
        for line in lines:
            if line.startswith(b"cpu") and line[3:4].isdigit():
                name, *columns = line.split()
                if int(name[3:]) in cores:
                    ticks += sum(int(columns[c]) for c in _BUSY_COLUMNS if c < len(columns))
    except (OSError, ValueError):
        return None
    return Sample(clock(), ticks / _TICKS_PER_SECOND, usage.ru_utime + usage.ru_stime, len(cores))


def free_cores(before: Sample, after: Sample) -> float:
    """Cores' worth of time the rest of the machine left free between two samples."""
    wall = after.wall - before.wall
    others = max(0.0, (after.busy - before.busy) - (after.own - before.own)) / wall
    return after.cores - others


def threads_for(requested: int, cores: int, free: float) -> int:
    """Threads to run on, given the ``requested`` count and the ``free`` of the process's ``cores``:
    ``requested`` unless other processes took half a core or more, else the free cores, rounded, at
    least 1 (and never more than requested)."""
    if cores - free < 0.5:
        return requested
    return max(1, min(requested, round(free)))


class _Load:
    """The last sample and the free cores it gave, shared by the threads of the process."""

    def __init__(
        self, read: Callable[[], Sample | None] | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.read = read or (lambda: read_sample(clock))
        self.clock = clock
        self.lock = threading.Lock()
        self.last: Sample | None = None
        self.free: tuple[int, float] | None = None  # (cores, free cores), once two samples are PERIOD apart
        self.disabled = False

    def free_now(self) -> tuple[int, float] | None:
        """The process's cores and the free ones as of the last reading, reading again once
        ``PERIOD`` has passed; None until two readings are that far apart, or where none can be made."""
        if self.disabled:
            return None
        last = self.last
        if last is not None and self.clock() - last.wall < PERIOD:
            return self.free
        with self.lock:
            if self.last is not None and self.clock() - self.last.wall < PERIOD:  # another thread read
                return self.free
            sample = self.read()
            if sample is None:
                self.disabled = True
                return None
            if self.last is not None:
                self.free = (sample.cores, free_cores(self.last, sample))
            self.last = sample
            return self.free


_LOAD = _Load()
_LOWERED = False  # inside an ``adapted`` block that lowered the thread count (one Python thread: ``_alone``)


def _alone() -> bool:
    """Whether no other Python thread runs in this process (module docstring: where it does nothing)."""
    return threading.active_count() == 1


def _forget_after_fork() -> None:
    """A forked child starts its own readings: the parent's hold the parent's CPU time."""
    global _LOAD, _LOWERED
    _LOAD, _LOWERED = _Load(), False
    _OPEN.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


@contextlib.contextmanager
def adapted(device: torch.device) -> Iterator[None]:
    """Run the block on fewer intra-op threads while other processes keep cores busy (module
    docstring); on a quiet machine, off the CPU, or with ``TUNING.adaptive_threads = 0``, as it is."""
    _close_left_open()
    requested, threads = _counts(device)
    if threads == requested:
        yield
        return
    global _LOWERED
    torch.set_num_threads(threads)
    outer, _LOWERED = _LOWERED, True
    try:
        yield
    finally:
        _LOWERED = outer
        torch.set_num_threads(requested)


def _counts(device: torch.device) -> tuple[int, int]:
    """The thread count set now, and the one ``adapted`` runs a call on ``device`` on (the same
    where it does nothing: off the CPU, one thread, switched off, other Python threads, no load)."""
    requested = torch.get_num_threads()
    if device.type != "cpu" or requested == 1 or not TUNING.adaptive_threads or not _alone():
        return requested, requested
    load = _LOAD.free_now()
    return requested, requested if load is None else threads_for(requested, *load)


def adapted_backward(backward: Callable) -> Callable:
    """An autograd Function's ``backward(ctx, *grads)`` run under ``adapted``: the backward pass runs
    after the call that made the graph has returned."""

    @functools.wraps(backward)
    def run(ctx, *grads):
        device = next((g.device for g in grads if isinstance(g, torch.Tensor)), torch.device("cpu"))
        with adapted(device):
            return backward(ctx, *grads)

    return run


def backward_adapted(call: Callable[..., torch.Tensor], inputs: list[torch.Tensor]) -> torch.Tensor:
    """``call(*inputs)``, whose backward (torch's own operations, run by autograd) runs on the cores
    other processes leave free, as ``adapted`` would run it. Hooks bracket it: one on the output's
    gradient, which autograd computes before any of the call's backward, lowers the thread count;
    one on the gradient of each input that takes one (an identity view of it), computed after all
    of the call's backward for it, restores the count once they all have run, and a callback at the
    end of the backward pass restores it where some never run (a gradient taken for some inputs
    only). Autograd's semantics are unchanged (double backward, ``retain_graph``). Without a
    gradient to take, or where ``adapted`` would change nothing at the time of the call (a quiet
    machine, off the CPU), the call as it is, without hooks."""
    if not torch.is_grad_enabled() or not any(x.requires_grad for x in inputs) or not _lowers(inputs[0].device):
        return call(*inputs)
    bracket = _Bracket(inputs[0].device)
    views = [x.view_as(x) if x.requires_grad else x for x in inputs]
    for view in views:
        if view.requires_grad:
            view.register_hook(bracket.input_done)
            bracket.inputs += 1
    out = call(*views)
    if out.requires_grad:
        out.register_hook(bracket.start)
    return out


def _lowers(device: torch.device) -> bool:
    """Whether ``adapted`` would run a call on ``device`` on fewer threads now (or already does)."""
    if _LOWERED:
        return True
    requested, threads = _counts(device)
    return threads < requested


_OPEN: set[_Bracket] = set()  # brackets whose backward lowered the count and has not restored it yet


def _close_left_open() -> None:
    """Restore the count a bracket lowered whose backward pass never ended (it raised): seen at the
    next call made outside any backward pass."""
    if _OPEN and torch._C._current_graph_task_id() == -1:
        for bracket in list(_OPEN):
            bracket.finish()


class _Bracket:
    """The hooks of one ``backward_adapted`` call (see there)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device  # the call's: a hook may be given no gradient (an undefined one) to read it from
        self.inputs = 0  # inputs whose gradient ends the bracket
        self.pending = 0
        self.restore_to: int | None = None  # the thread count to restore, while lowered

    def start(self, grad: torch.Tensor | None) -> None:
        if self.restore_to is not None:
            return
        requested, threads = _counts(self.device)
        if threads == requested:
            return
        torch.set_num_threads(threads)
        self.restore_to, self.pending = requested, self.inputs
        _OPEN.add(self)
        torch.autograd.Variable._execution_engine.queue_callback(self.finish)  # the end of this backward

    def input_done(self, grad: torch.Tensor | None) -> None:
        if self.restore_to is not None:
            self.pending -= 1
            if self.pending <= 0:
                self.finish()

    def finish(self) -> None:
        if self.restore_to is not None:
            torch.set_num_threads(self.restore_to)
            self.restore_to = None
        _OPEN.discard(self)

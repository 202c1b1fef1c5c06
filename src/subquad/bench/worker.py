"""Measure benchmark cells in a worker process: ``python -m subquad.bench.worker < cells.json``
(a JSON list of cells, or one cell), one JSON line of results per cell on stdout as each finishes.

Peak memory on CPU: before each cell the freed memory of the cells before it goes back to the
system (``gc`` and glibc's ``malloc_trim``), and after a tiny warm-up that starts the thread pools,
the inputs are made, the kernel's resident-memory high-water mark is reset, and the first
full-size call's peak above that baseline is the cell's memory. That call starts the
warm-up for timing, which repeats the call until ``warmup_seconds`` have passed: the first calls
of a process can run slower than the rest while memory settles (on virtual machines whose host
backs memory on first use, fresh huge pages cost most of a second of calls before they are reused).
Then the call repeats until ``repeats`` timings or ``max_seconds``, and the median is reported.
A ``paired`` cell also times full attention (default config, same causality and pass) on the same
inputs, one call after each of its own, in the warm-up too: its ``paired_ratio`` is the median of
the per-round ratios, so a slow spell of the machine (another process, a host's neighbour) slows
both sides of a ratio alike instead of one cell. Where the mechanism's call is shorter than half of
full attention's (as the warm-up timed them), a round times it several times, up to
``_ROUND_CALLS``, as many as fit in one of full's, and takes their median: a slow spell short
enough to hit one call of a few milliseconds no longer is the round's mechanism time, and where
full's calls are long enough that the cell has only a few rounds, the short calls still fill the
time those rounds take. ``times_s`` holds one time per round. It times at least ``_PAIRED_ROUNDS``
rounds, and ``max_seconds`` counts all the calls. Where the baseline cell, run earlier in the same process, took
longer than ``max_seconds`` a call, the cell is not paired: each call is then long enough that a
slow spell weighs little, and pairing would double the cell's time.
On CPU with two threads or more, a cell also probes how much faster two threads run short
operations than one (``short_op_speedup``), before its warm-up and after its last round: where
the host of a 2-core virtual machine ran the process's cores apart, every short parallel region
waited on the other core, the probe read 0.94–1.05 instead of 1.30–1.38, and mechanisms made of
many operations read about a fifth higher against full attention (README, ``subquad bench``).
Forward cells also report the relative error against full attention, computed in float64 on
evenly spaced query rows (exact for those rows, and cheap at any length), on iid and on clustered
inputs, and the fraction of queries whose output is all zero (``bench.checks``).
A cell with ``inputs`` (a file of queries, keys and values, ``bench.inputs``) runs on the file's
sets instead, each timed call one call per set in turn (a model's layers, one after another), and
reports its error over all of them (``error_inputs``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from subquad.bench.checks import output_checks, reference_rows, relative_error, set_checks
from subquad.bench.inputs import make_qkv, read_inputs
from subquad.call import call as call_mechanism
from subquad.kernels.tuning import TUNING
from subquad.registry import Config, Mechanism, get_mechanism, make_config

__all__ = ["measure_cell", "reference_rows", "short_op_speedup"]

_STATUS = "/proc/self/status"
# The baseline cell's time per shape, as measured earlier in this process (it runs first in its group).
_BASELINE_SECONDS: dict[tuple, float] = {}


def measure_cell(cell: dict[str, Any]) -> dict[str, Any]:
    """Time, peak memory and error of one (mechanism, options, length, causal, pass) cell."""
    if cell.get("threads"):
        torch.set_num_threads(int(cell["threads"]))
    TUNING.adaptive_threads = int(cell.get("adaptive_threads", False))  # this worker process's own setting
    device = torch.device(cell["device"])
    dtype = getattr(torch, cell["dtype"])
    mech = get_mechanism(cell["mechanism"])
    config = make_config(mech, **cell["options"])
    B, H, N, D = cell["batch"], cell["heads"], cell["length"], cell["head_dim"]
    Hk = cell.get("kv_heads") or H  # grouped-query: keys and values of Hk heads, read with enable_gqa
    # Inference mode: a state that learns (routing centroids) must not move between timed calls.
    state = mech.state(config, H, D, cell["seed"]).to(device).eval() if mech.state is not None else None
    call = _make_call(mech, config, state, cell["causal"], cell["backward"], cell["seed"], Hk != H)
    shape = (cell["device"], cell["dtype"], B, H, Hk, N, D, cell["causal"], cell["backward"], torch.get_num_threads())
    baseline = None  # full attention, timed call for call alongside: the cell's own ratio
    if cell.get("paired") and _BASELINE_SECONDS.get(shape, 0.0) <= cell["max_seconds"]:
        baseline = _make_call(
            get_mechanism("full"), make_config("full"), None, cell["causal"], cell["backward"], cell["seed"], Hk != H
        )

    if device.type == "cpu":  # start thread pools (on CUDA, a short call would compile a kernel for its length)
        call(*make_qkv("iid", (B, H, min(N, 64), D), dtype, device, cell["seed"], kv_heads=Hk))
    probe_before = short_op_speedup() if device.type == "cpu" else None
    if cell.get("inputs"):  # the file's sets (S, B, H, N, D), one call after another: one timed call
        q, k, v = read_inputs(cell["inputs"], dtype, device)
        single, call, baseline = call, _over_sets(call), baseline and _over_sets(baseline)
    else:
        q, k, v = make_qkv("iid", (B, H, N, D), dtype, device, cell["seed"], kv_heads=Hk)
    out, result, timing = _timed_calls(call, baseline, q, k, v, device, cell)
    result.update(time_s=statistics.median(timing.times), times_s=timing.times, threads=torch.get_num_threads())
    if device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(device)
    if probe_before is not None:
        result["short_op_speedup"] = [probe_before, short_op_speedup()]
    if timing.paired:
        result["calls_per_round"] = timing.calls
    if mech.name == "full" and config == make_config("full"):  # the baseline cell: what pairing would cost
        _BASELINE_SECONDS[shape] = result["time_s"]
    if timing.paired:
        result.update(
            baseline_time_s=statistics.median(timing.base_times),
            baseline_times_s=timing.base_times,
            paired_ratio=statistics.median(t / b for t, b in zip(timing.times, timing.base_times)),
        )
    if not cell["backward"] and cell.get("inputs"):
        del out
        result.update(set_checks(single, q, k, v, cell))
    elif not cell["backward"]:
        result.update(output_checks(out), error_iid=relative_error(out, q, k, v, cell))
        del out, q, k, v
        structure = {"centres": cell.get("centres", 16), "spread": cell.get("spread", 0.5)}
        q, k, v = make_qkv("clustered", (B, H, N, D), dtype, device, cell["seed"] + 1, kv_heads=Hk, **structure)
        result["error_clustered"] = relative_error(call(q, k, v), q, k, v, cell)
    return result


def _over_sets(call: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """One call of ``call`` on each set of ``(S, B, H, N, D)`` inputs in turn (a model's layers, one
    after another); the last set's output."""

    def each(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        for i in range(q.shape[0] - 1):
            call(q[i], k[i], v[i])  # its output freed at once, as a layer's is once the next runs
        return call(q[-1], k[-1], v[-1])

    return each


class _Timing(NamedTuple):
    """The timed rounds of a cell (``_timed_calls``)."""

    times: list[float]  # the mechanism's time in each round: the median of its calls there
    base_times: list[float]  # full attention's time in each round of a paired cell; else empty
    calls: int  # the mechanism's calls in each round
    paired: bool  # full attention was timed alongside (it ran)


def _timed_calls(
    call: Callable[[Tensor, Tensor, Tensor], Tensor],
    baseline: Callable[[Tensor, Tensor, Tensor], Tensor] | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    device: torch.device,
    cell: dict[str, Any],
) -> tuple[Tensor, dict[str, Any], _Timing]:
    """The cell's calls on its inputs: the first full-size one, whose peak above the memory in use
    before it is the cell's memory, the warm-up, and the timed rounds, with ``baseline`` (full
    attention) one call after each round's calls where the cell is paired. The last call's output,
    the result so far (memory, and why a paired cell could not be paired), and the rounds' times."""
    _release_freed_memory(device)
    peak_memory = _memory_probe(device)
    warmup_start = time.perf_counter()
    out = call(q, k, v)  # the first full-size call: memory, and the start of the warm-up for timing
    if device.type == "cuda":
        torch.cuda.synchronize()
    result: dict[str, Any] = {"peak_bytes": peak_memory(), "memory_method": _memory_method(device)}
    if baseline is not None:
        try:  # full attention may not run where the mechanism does (memory): then the cell is not paired
            _timed(baseline, q, k, v, device)
        except Exception as exc:
            baseline, result["paired_error"] = None, f"{type(exc).__name__}: {exc}"[:200]
    own, base = 0.0, 0.0  # the latest warm-up times of a call of each (a paired cell times one at least)
    # On a GPU, one untimed call after the first at least: the first may have compiled a kernel (FlexAttention).
    again = device.type != "cpu" or baseline is not None
    while time.perf_counter() - warmup_start < cell["warmup_seconds"] or (again and not own):
        out, own = _timed(call, q, k, v, device)
        if baseline is not None:
            base = _timed(baseline, q, k, v, device)[1]
    calls = 1 if baseline is None else max(1, min(_ROUND_CALLS, int(base / max(own, 1e-9))))
    times: list[float] = []  # the mechanism's time in each round: the median of its calls there
    base_times: list[float] = []
    spent = 0.0
    rounds = _PAIRED_ROUNDS if baseline is not None else 1
    while len(times) < rounds or (len(times) < cell["repeats"] and spent < cell["max_seconds"]):
        own_times = []
        for _ in range(calls):
            out, seconds = _timed(call, q, k, v, device)
            own_times.append(seconds)
        times.append(statistics.median(own_times))
        spent += sum(own_times)
        if baseline is not None:
            base_times.append(_timed(baseline, q, k, v, device)[1])
            spent += base_times[-1]
    return out, result, _Timing(times, base_times, calls, baseline is not None)


_PAIRED_ROUNDS = 2  # the fewest timed rounds of a paired cell, whatever max_seconds says
_ROUND_CALLS = 8  # the most calls of the mechanism in one round of a paired cell
_PROBE_ELEMENTS = 1 << 16  # fp32: 256 KB, a copy of a few µs within one core's L2 cache
_PROBE_COPIES = 64
_PROBE_REPEATS = 5
_probe_buffers: list[Tensor] = []  # made once per process, before any cell's memory is measured


def short_op_speedup() -> float | None:
    """How many times faster two intra-op threads run short operations than one, now: 64 copies of
    256 KB, each a parallel region of a few µs, timed on one thread and on two in turn, 5 times
    each; the ratio of the medians. On the 2-core virtual machine of docs/performance.md, 1.30–1.38
    while its cores sit close together and 0.94–1.05 while the host runs them apart (then every
    short region waits on the other core). None where the process runs on one thread. The thread
    count is restored, also if a copy raises."""
    threads = torch.get_num_threads()
    if threads < 2:
        return None
    if not _probe_buffers:
        _probe_buffers.extend(torch.zeros(_PROBE_ELEMENTS) for _ in range(2))
    source, target = _probe_buffers

    def copies(count: int) -> float:
        torch.set_num_threads(count)
        target.copy_(source)  # the first region after a change of count starts the threads
        start = time.perf_counter()
        for _ in range(_PROBE_COPIES):
            target.copy_(source)
        return time.perf_counter() - start

    one: list[float] = []
    two: list[float] = []
    try:
        for _ in range(_PROBE_REPEATS):
            one.append(copies(1))
            two.append(copies(2))
    finally:
        torch.set_num_threads(threads)
    return statistics.median(one) / statistics.median(two)


def _timed(call: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor, v: Tensor, device: torch.device):
    """``call(q, k, v)`` and its wall time in seconds (the device's work included)."""
    start = time.perf_counter()
    out = call(q, k, v)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _make_call(
    mech: Mechanism,
    config: Config,
    state: torch.nn.Module | None,
    causal: bool,
    backward: bool,
    seed: int,
    grouped: bool = False,
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """One attention call (plus backward for fwd+bwd cells), fed extra tensors the mechanism needs.
    Those tensors (agglomerative's class logits, multires's router logits) are made once per input
    shape, outside the timed calls, as a model's layer computes them before its attention: drawn in
    each call they were 13–18% of agglomerative's time. The backward takes a gradient of ones made
    once per output shape, outside the timed calls too, as the gradient a model's layer receives
    comes from above it: filling it each call under load (on threads that wait for a busy core) cost
    more than agglomerative's whole backward at N = 1024."""
    grads: dict[tuple, Tensor] = {}
    extras: dict[tuple, dict[str, Tensor]] = {}

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        tensors = {}
        if mech.example_tensors is not None:
            key = (q.shape, k.shape, v.shape, q.dtype, q.device)
            if key not in extras:
                extras[key] = mech.example_tensors(q, k, v, config, torch.Generator().manual_seed(seed))
            tensors = extras[key]
        if not backward:
            with torch.no_grad():
                return call_mechanism(
                    mech, q, k, v, is_causal=causal, config=config, state=state, enable_gqa=grouped, **tensors
                )
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out = call_mechanism(mech, q, k, v, is_causal=causal, config=config, state=state, enable_gqa=grouped, **tensors)
        key = (out.shape, out.dtype, out.device)
        if key not in grads:
            grads[key] = torch.ones_like(out)
        out.backward(grads[key])
        # Detached: the graph's leaves (and their gradients) would otherwise stay alive through
        # `out` while the next call runs, doubling the measured footprint of long cells.
        return out.detach()

    return call


def _release_freed_memory(device: torch.device) -> None:
    """Give what earlier cells freed back to the system, so that a cell's peak above the current
    resident size counts the memory it needs (not less, by reusing pages an earlier cell left
    resident)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _load_libc()


def _memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return "cuda-max-allocated"
    return "rss-high-water" if reset_high_water() else "ru_maxrss"


def _memory_probe(device: torch.device) -> Callable[[], int]:
    """Start measuring; the returned function gives the peak bytes above the current usage."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        return lambda: torch.cuda.max_memory_allocated(device) - base
    if reset_high_water():  # VmHWM is now the current resident size
        base = status_kib("VmRSS")
        return lambda: max(0, status_kib("VmHWM") - base) * 1024
    # No /proc (e.g. macOS): the growth of the lifetime peak is a lower bound.
    scale = 1 if sys.platform == "darwin" else 1024
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return lambda: max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * scale


def reset_high_water() -> bool:
    """Reset the process's peak resident size (VmHWM) to its current one; False where the system
    cannot (no ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return status_kib("VmHWM") > 0
    except OSError:
        return False


def status_kib(key: str) -> int:
    """A size line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in KiB; 0 where it has none."""
    with open(_STATUS) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def main() -> None:
    cells = json.loads(sys.stdin.read())
    for cell in cells if isinstance(cells, list) else [cells]:
        try:
            result = measure_cell(cell)
        except Exception as exc:  # reported in the cell, so one failure does not end the run
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=3)}
        print(json.dumps(result), flush=True)  # a NaN error stays NaN: the table shows it, results.json null


if __name__ == "__main__":
    main()

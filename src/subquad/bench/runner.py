"""The benchmark grid: mechanism variants × lengths × {non-causal, causal} × {forward, forward+backward}.

The cells of one length run in one worker process (``subquad.bench.worker``), one after another so
that cells do not compete for cores; a worker that dies or overruns ``timeout`` costs the cell it
was running, and a fresh worker takes the rest. Full attention with its default config always
runs: it is the baseline of every ratio, measured in the same run as what it is compared with, and
in each other cell it is timed again, call for call with the mechanism (the worker's ``paired``
cells), so a ratio does not depend on how busy the machine was between two cells.

Three grids: ``GRIDS["default"]`` (N = 256 … 4096, short warm-ups: a few minutes on 2 CPU cores),
``GRIDS["full"]`` (N = 256 … 16384, the longer warm-ups of a fresh process per length) and
``GRIDS["gpu"]`` (bf16 on a CUDA device, B = 1, H = 16, D = 64, N = 4k … 128k).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from subquad._validate import DTYPE_NAMES
from subquad.bench.inputs import input_shape
from subquad.flags import setting
from subquad.registry import get_mechanism, make_config

__all__ = ["BASELINE", "GRIDS", "BenchSettings", "Variant", "run_bench"]


Cell = tuple["Variant", int, bool, bool]  # (variant, length, causal, backward)


@dataclass(frozen=True)
class Variant:
    """A mechanism with a set of options, e.g. ``Variant("full", (("backend", "eager"),))``."""

    mechanism: str
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        make_config(self.mechanism, **dict(self.options))  # unknown or bad options raise now

    @property
    def label(self) -> str:
        if not self.options:
            return self.mechanism
        return f"{self.mechanism}({', '.join(f'{k}={_show(v)}' for k, v in self.options)})"


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


BASELINE = Variant("full")


_BOTH = {"both": (False, True), "yes": (True,), "no": (False,)}

# The settings each grid gives unless they are set: the default grid finishes in a few minutes on
# 2 CPU cores; the full one reaches 16k, where full attention's calls take seconds each.
GRIDS: dict[str, dict[str, Any]] = {
    "default": {"lengths": (256, 512, 1024, 2048, 4096), "repeats": 30, "warmup_seconds": 0.5, "max_seconds": 0.6},
    "full": {"lengths": (256, 512, 1024, 2048, 4096, 8192, 16384), "repeats": 20, "warmup_seconds": 2.0,
             "max_seconds": 2.0},
    # Long-context training's shape on one GPU, SDPA's flash kernel as the baseline; the first call
    # of a cell compiles FlexAttention's kernels (local, sparse, pattern), outside the timed calls.
    "gpu": {"lengths": (4096, 16384, 65536, 131072), "batch": 1, "heads": 16, "head_dim": 64, "dtype": "bfloat16",
            "device": "cuda", "repeats": 10, "warmup_seconds": 0.5, "max_seconds": 1.0, "timeout": 300.0},
}  # fmt: skip
_DEFAULT = GRIDS["default"]


@dataclass
class BenchSettings:
    """Everything one benchmark run measures; the command line's flags and defaults come from here."""

    variants: Sequence[Variant] = setting(
        (), "what runs besides the baseline: --mechanisms and the --NAME.OPTION flags"
    )
    lengths: Sequence[int] = setting(_DEFAULT["lengths"], "sequence lengths", metavar="N")
    batch: int = setting(1, "batch size B")
    heads: int = setting(8, "heads H")
    kv_heads: int | None = setting(
        None, "key/value heads (grouped-query attention, enable_gqa): a divisor of H", shown_default="H"
    )
    head_dim: int = setting(64, "head dim D")
    dtype: str = setting("float32", "", choices=DTYPE_NAMES)
    device: str = setting("cpu", "cpu or cuda")
    threads: int | None = setting(None, "CPU threads", shown_default="torch's default")
    causal: Sequence[bool] = setting((False, True), "causal cells, non-causal cells, or both", choices=_BOTH)
    backward: Sequence[bool] = setting((False, True), "forward+backward cells, forward cells, or both", choices=_BOTH)
    repeats: int = setting(_DEFAULT["repeats"], "most timed calls per cell, after the warm-up")
    warmup_seconds: float = setting(
        _DEFAULT["warmup_seconds"], "untimed calls per cell until this long has passed, the first call included"
    )
    max_seconds: float = setting(
        _DEFAULT["max_seconds"],
        "stop repeating once a cell's timed calls (and their paired full-attention calls) took this long",
    )
    error_rows: int = setting(512, "query rows compared with float64 full attention")
    centres: int = setting(16, "centres per head of the clustered inputs of the error column")
    spread: float = setting(0.5, "spread of the clustered inputs around their centres")
    baseline_max_length: int | None = setting(
        None, "run the full-attention baseline only up to this N; longer cells get no ratio", shown_default="all"
    )
    busy: int = setting(0, "competing processes that each keep one core busy during the run (behaviour under load)")
    adaptive_threads: bool = setting(
        False,
        "calls on fewer threads while other processes keep cores busy (opt-in: kernels.threads)",
    )
    timeout: float = setting(1800.0, "seconds per cell")
    seed: int = setting(0, "input and state seed")
    inputs: str | None = setting(
        None,
        "time every cell on the queries, keys and values of a safetensors file, in place of drawn ones: tensors "
        "q (B, H, N, D), k (B, Hk, N, D) and v (B, Hk, N, Dv), or each (S, B, ...) for S sets run one after "
        "another in each timed call; the cells' N, B, H, key/value heads and D are the file's, and "
        "--lengths, --batch, --heads, --kv-heads and --head-dim are refused with it",
        metavar="FILE",
        shown_default="drawn",
    )

    def __post_init__(self) -> None:
        if self.inputs is not None:  # the shape is the file's
            self.inputs = os.fspath(self.inputs)  # a Path too; the workers read it from JSON
            shape = input_shape(self.inputs)
            self.lengths, self.batch, self.heads = (shape.length,), shape.batch, shape.heads
            self.head_dim, self.kv_heads = shape.head_dim, shape.kv_heads if shape.kv_heads != shape.heads else None
        for name in ("batch", "heads", "head_dim", "repeats", "error_rows", "centres"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_heads is not None and not (1 <= self.kv_heads <= self.heads and self.heads % self.kv_heads == 0):
            raise ValueError(
                f"kv_heads must divide heads ({self.heads}), got {self.kv_heads}: each key/value head serves "
                "heads / kv_heads query heads"
            )
        if self.busy < 0:
            raise ValueError(f"busy must be >= 0, got {self.busy}")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"lengths must be positive, got {list(self.lengths)}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.baseline_max_length is not None and self.baseline_max_length < 1:
            raise ValueError(f"baseline_max_length must be >= 1 or None, got {self.baseline_max_length}")
        if not self.spread >= 0:
            raise ValueError(f"spread must be >= 0, got {self.spread}")
        for name in ("max_seconds", "timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not 0 <= self.warmup_seconds < math.inf:
            raise ValueError(f"warmup_seconds must be finite and >= 0 seconds, got {self.warmup_seconds}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not self.causal or not self.backward:
            raise ValueError("select at least one of causal/non-causal and one of forward/forward+backward")

    def all_variants(self) -> list[Variant]:
        """The baseline first, then the requested variants, each distinct config once."""
        seen, variants = set(), []
        for variant in [BASELINE, *self.variants]:
            key = (variant.mechanism, make_config(variant.mechanism, **dict(variant.options)))
            if key not in seen:
                seen.add(key)
                variants.append(variant)
        return variants

    def cells(self) -> list[tuple[Variant, int, bool, bool]]:
        """(variant, length, causal, backward) in run order: short lengths first."""
        grid = []
        for length in sorted(self.lengths):
            for backward in sorted(self.backward):
                for causal in sorted(self.causal):
                    for variant in self.all_variants():
                        if causal and not get_mechanism(variant.mechanism).causal:
                            continue
                        if variant == BASELINE and length > (self.baseline_max_length or length):
                            continue  # full attention where it cannot run: no baseline, no ratio
                        grid.append((variant, length, causal, backward))
        return grid


def run_bench(
    settings: BenchSettings,
    progress: Callable[[int, int, str], None] | None = None,
    on_row: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every cell and return one row per cell, with ``ratio`` = time ÷ full attention's time.

    ``on_row(rows)`` is called after each cell with the rows so far (ratios included: the baseline
    runs first in each group), so a caller can save partial results."""
    cells = settings.cells()
    with _busy_processes(settings.busy):
        return _run_grid(settings, cells, progress, on_row)


def _run_grid(
    settings: BenchSettings,
    cells: list[Cell],
    progress: Callable[[int, int, str], None] | None,
    on_row: Callable[[list[dict[str, Any]]], None] | None,
) -> list[dict[str, Any]]:
    results = _run_cells(settings, cells)
    rows = []
    for i, (variant, length, causal, backward) in enumerate(cells):
        label = f"{variant.label} N={length} {'causal' if causal else 'non-causal'} {_pass(backward)}"
        if progress is not None:
            progress(i, len(cells), label)
        row = {
            "mechanism": variant.label,
            "name": variant.mechanism,
            "options": dict(variant.options),
            "length": length,
            "causal": causal,
            "pass": _pass(backward),
        }
        row.update(next(results))
        rows.append(row)
        _add_ratios(rows)
        if on_row is not None:
            on_row(rows)
    if progress is not None:
        progress(len(cells), len(cells), "done")
    return rows


@contextlib.contextmanager
def _busy_processes(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` processes that spin on one core each while the block runs (a data loader or a
    second job, as far as the measured cells can tell)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def _pass(backward: bool) -> str:
    return "forward+backward" if backward else "forward"


_WORKER = [sys.executable, "-m", "subquad.bench.worker"]


def _run_cells(settings: BenchSettings, cells: list[Cell]) -> Iterator[dict[str, Any]]:
    """Each cell's result, in order: the cells of one length share a worker process."""
    start = 0
    while start < len(cells):
        stop = start
        while stop < len(cells) and cells[stop][1] == cells[start][1]:
            stop += 1
        yield from _run_in_workers(settings, cells[start:stop])
        start = stop


def _run_cell(settings: BenchSettings, variant: Variant, length: int, causal: bool, backward: bool) -> dict[str, Any]:
    """One cell in a worker of its own."""
    return next(_run_in_workers(settings, [(variant, length, causal, backward)]))


def _run_in_workers(settings: BenchSettings, cells: list[Cell]) -> Iterator[dict[str, Any]]:
    """Run ``cells`` in one worker, reading each result as it comes; a worker that exits or
    overruns ``settings.timeout`` on a cell gets an error for that cell, and a new worker the rest.
    Cells are paired with full attention's calls (the worker's ``paired``) unless their baseline
    cell failed, or a cell of their (length, causality, pass) ended its worker: there full
    attention may not run, and each cell would fail with it."""
    common = {
        k: v for k, v in asdict(settings).items()
        if k not in ("variants", "lengths", "causal", "backward", "baseline_max_length")
    }  # fmt: skip
    unpaired: set[tuple[int, bool, bool]] = set()  # where the baseline cell failed: full attention cannot run
    while cells:
        worker, lines, errors, stderr = _start_worker(settings, cells, common, unpaired)
        done = 0
        try:
            for variant, n, c, b in cells:
                try:
                    line = lines.get(timeout=settings.timeout)
                except queue.Empty:
                    worker.kill()
                    unpaired.add((n, c, b))  # the rest of its group runs without full attention's calls
                    yield {"error": f"timed out after {settings.timeout:g} s"}
                    done += 1
                    break
                if line is None:  # the worker exited before this cell's result
                    code = worker.wait()
                    stderr.join(timeout=5)  # its last words may still be in the pipe when stdout ends
                    killed = " (killed: out of memory?)" if code < 0 else ""
                    tail = "".join(errors).strip().splitlines()[-1:] or [""]
                    unpaired.add((n, c, b))
                    yield {"error": f"worker exited with code {code}{killed} {tail[0]}".strip()}
                    done += 1
                    break
                result = json.loads(line)
                if variant == BASELINE and "error" in result:
                    unpaired.add((n, c, b))
                yield result
                done += 1
        finally:
            try:
                worker.wait(timeout=10 if done == len(cells) else 0)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        cells = cells[done:]


def _start_worker(
    settings: BenchSettings, cells: list[Cell], common: dict[str, Any], unpaired: set[tuple[int, bool, bool]]
) -> tuple[subprocess.Popen, queue.Queue, list[str], threading.Thread]:
    """A worker process given ``cells``: the process, the queue of its result lines, its stderr lines
    and the thread reading them."""
    payload = [
        {"mechanism": v.mechanism, "options": dict(v.options), "length": n, "causal": c, "backward": b,
         "paired": v != BASELINE and n <= (settings.baseline_max_length or n) and (n, c, b) not in unpaired,
         **common}
        for v, n, c, b in cells
    ]  # fmt: skip
    worker = subprocess.Popen(
        _WORKER,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()
    errors: list[str] = []
    _drain(worker.stdout, lines, results=True)
    stderr = _drain(worker.stderr, errors)
    try:
        worker.stdin.write(json.dumps(payload))
        worker.stdin.close()
    except BrokenPipeError:
        pass  # the worker died at once: its exit code tells why, in the caller
    return worker, lines, errors, stderr


def _drain(stream: Any, sink: queue.Queue | list, results: bool = False) -> threading.Thread:
    """Read ``stream`` on a daemon thread (a full pipe would block the worker) into ``sink``: with
    ``results``, the JSON lines, then None at the end of the stream. Returns the thread."""

    def read() -> None:
        for line in stream:
            if results and line.startswith("{"):
                sink.put(line)
            elif not results:
                sink.append(line)
        if results:
            sink.put(None)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's ``ratio``: its paired ratio (full attention timed call for call in the same cell),
    else its time over the baseline cell's; None without either."""
    baseline = {(r["length"], r["causal"], r["pass"]): r for r in rows if r["mechanism"] == BASELINE.label}
    for r in rows:
        base_row = baseline.get((r["length"], r["causal"], r["pass"]), {})
        base = base_row.get("time_s")
        if r.get("paired_ratio") is not None:
            r["ratio"] = r["paired_ratio"]
        else:
            r["ratio"] = r["time_s"] / base if r.get("time_s") and base else None
            if r["ratio"] is not None and r is not base_row and "short_op_speedup" in base_row:
                r["baseline_short_op_speedup"] = base_row["short_op_speedup"]  # its ratio's other side

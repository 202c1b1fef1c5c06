"""``subquad bench``: its flags (one per `BenchSettings` field, and one per mechanism option) and its run.

Each mechanism's option flags (``--<mechanism>.<option> V [V ...]``) are generated from its config
dataclass; several values sweep the option, and the sweeps of one mechanism combine as a product.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import platform
import sys
import time
import typing
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from subquad.files import out_folder
from subquad.flags import Command, add_flags, flag_values, option_parser
from subquad.registry import get_mechanism, make_config, mechanism_names
from subquad.version import __version__

__all__ = ["BENCH", "Progress", "machine", "settings_from"]


def arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per `BenchSettings` field, then ``--grid``, ``--out``, ``--plots`` and each mechanism's options."""
    from subquad.bench.runner import GRIDS, BenchSettings

    names = mechanism_names()
    parser.add_argument(
        "--mechanisms", nargs="+", default=names, metavar="SPEC",
        help=f"mechanisms to run, each NAME or NAME:option=value,... (default: all: {' '.join(names)}); "
        "full always runs as baseline",
    )  # fmt: skip
    defaults = {f.name: f.default for f in fields(BenchSettings)}
    unset = {
        name: "from --grid, "
        + "; ".join(f"{grid}: {_shown(values.get(name, defaults[name]))}" for grid, values in GRIDS.items())
        for name in dict.fromkeys(name for values in GRIDS.values() for name in values)
    }
    add_flags(parser, BenchSettings, skip=("variants",), unset=unset)
    parser.add_argument(
        "--grid", choices=list(GRIDS), default="default",
        help="default: N = 256 … 4096 with short warm-ups, about 4 minutes on 2 CPU cores; full: N up to 16384 "
        "with 2 s warm-ups, half an hour or more; gpu: bf16 on CUDA, B = 1, H = 16, D = 64, N = 4k … 128k "
        "(default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("subquad-bench"),
                        help="folder for results.csv, results.json and the plots (default: %(default)s)")  # fmt: skip
    parser.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                        help="write the PNG plots (default: on)")  # fmt: skip
    for name in names:
        _option_flags(parser, name)


def _option_flags(parser: argparse.ArgumentParser, name: str) -> None:
    """``--NAME.OPTION V [V ...]`` for each option of one mechanism."""
    mech = get_mechanism(name)
    group = parser.add_argument_group(f"{name} options (several values sweep)")
    hints = typing.get_type_hints(mech.config)
    for f in fields(mech.config):
        parse, metavar = option_parser(hints[f.name])
        # argparse compares a whole parsed value with the choices, so only scalar options get them;
        # the config dataclass checks every value anyway.
        choices = None if typing.get_origin(hints[f.name]) is tuple else f.metadata.get("choices")
        group.add_argument(
            f"--{name}.{f.name}", dest=f"opt:{name}:{f.name}", nargs="+", type=parse, metavar=metavar,
            choices=choices, help=f"{f.metadata.get('help', '')} (default: {f.default!r})",
        )  # fmt: skip


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


_SHAPE = ("lengths", "batch", "heads", "kv_heads", "head_dim")  # what an inputs file's tensors give


def settings_from(args: argparse.Namespace) -> Any:
    """The `BenchSettings` that ``subquad bench``'s parsed arguments ask for."""
    from subquad.bench.runner import GRIDS, BenchSettings

    values = flag_values(args, BenchSettings, skip=("variants",))
    shape = [f"--{name.replace('_', '-')}" for name in _SHAPE if values.get(name) is not None]
    if values.get("inputs") is not None and shape:
        raise ValueError(f"--inputs gives the cells' N, B, H, key/value heads and D; drop {' '.join(shape)}")
    values.update({k: v for k, v in GRIDS[args.grid].items() if values.get(k) is None})
    values = {k: v for k, v in values.items() if v is not None}  # set by neither: the field's default
    return BenchSettings(variants=_variants(args), **values)


def _variants(args: argparse.Namespace) -> list[Any]:
    from subquad.bench.runner import Variant

    sweeps: dict[str, dict[str, list[Any]]] = {}
    for key, values in vars(args).items():
        if key.startswith("opt:") and values is not None:
            _, mech, option = key.split(":")
            sweeps.setdefault(mech, {})[option] = values
    specs = [_bench_spec(text) for text in args.mechanisms]
    unselected = sorted(set(sweeps) - {name for name, _ in specs})
    if unselected:
        raise ValueError(f"options given for {unselected}, which --mechanisms does not select")
    variants = []
    for name, fixed in specs:
        options = {k: [v] for k, v in fixed.items()} | sweeps.get(name, {})  # a --NAME.OPTION sweep wins
        for combo in itertools.product(*options.values()):
            variants.append(Variant(name, tuple(zip(options, combo))))
    return variants


def _bench_spec(text: str) -> tuple[str, dict[str, Any]]:
    """One ``--mechanisms`` entry: a spec of one mechanism (a bench cell runs one on every head)."""
    from subquad.config import one_mechanism

    name, options = one_mechanism(
        text, {}, "; a bench cell times one mechanism on all heads: give each as its own spec"
    )
    make_config(name, **options)  # an unknown name or option raises now
    return name, options


def run(args: argparse.Namespace) -> int:
    import torch

    from subquad.bench import report
    from subquad.bench.runner import run_bench

    settings = settings_from(args)
    _check_device(settings.device, args.grid)
    out_folder(args.out)  # before the run, so a bad folder fails at once
    threads = settings.threads or torch.get_num_threads()
    kv = "" if settings.kv_heads is None else f" Hkv={settings.kv_heads}"
    title = f"B={settings.batch} H={settings.heads}{kv} D={settings.head_dim} {settings.dtype} {settings.device}"
    title += f", {threads} threads"
    if settings.inputs:
        from subquad.bench.inputs import input_shape

        sets = input_shape(settings.inputs).sets
        title += f", on {settings.inputs}" + (f" ({sets} sets, one after another in each call)" if sets > 1 else "")
    cells = settings.cells()
    without = sorted({v.label for v in settings.all_variants() if not get_mechanism(v.mechanism).causal})
    if without and True in settings.causal:  # said, not dropped silently
        print(f"no causal cells for {', '.join(without)} (no causal form)", file=sys.stderr)
    tuning = _profile_named(settings, threads)
    print(f"subquad {__version__} bench: {len(cells)} cells, {title}, torch {torch.__version__}", file=sys.stderr)
    print(f"tuning profile: {tuning}", file=sys.stderr)
    meta = {
        "subquad": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "machine": machine(), "threads": threads, "tuning_profile": tuning, "grid": args.grid,
        "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k != "variants"},
        "mechanisms": [v.label for v in settings.all_variants()],
    }  # fmt: skip
    started = time.time()
    done: list[dict] = []

    def save(rows: list[dict]) -> None:
        """results.csv and results.json as they stand: after each cell, so a stopped run keeps its rows."""
        done[:] = rows
        elapsed = round(time.time() - started, 1)
        meta["device"] = next((r["device_name"] for r in rows if r.get("device_name")), settings.device)
        report.write_csv(rows, args.out / "results.csv")
        report.write_json(rows, {**meta, "elapsed_s": elapsed, "cells_done": len(rows), "cells": len(cells)},
                          args.out / "results.json")  # fmt: skip

    try:
        with Progress() as progress:
            rows = run_bench(settings, progress, on_row=save)
    except KeyboardInterrupt:
        print(report.format_table(done) if done else "no cell finished")
        if note := report.short_op_note(done):
            print(note)
        print(f"\ninterrupted after {len(done)} of {len(cells)} cells; their rows are in {args.out}", file=sys.stderr)
        return 130
    save(rows)  # also when there was no cell to run
    return _report(rows, settings, args, title, time.time() - started)


def _profile_named(settings: Any, threads: int) -> str:
    """The tuning profile the cells run with (each worker applies it, as any call does): its path and
    values, or that there is none. Off the CPU the profile's values are not measured for the device."""
    from subquad.kernels import profile

    return profile.apply_for_threads(threads).describe()


def _report(rows: list[dict], settings: Any, args: argparse.Namespace, title: str, elapsed: float) -> int:
    """The table, the crossovers and the plots of a finished run; 1 if a cell failed."""
    from subquad.bench import report

    print(report.format_table(rows))
    print("\ntime = median per call; × full = median of time ÷ full attention's, timed call for call in the cell;")
    print("peak MB = above the inputs;", end=" ")
    on = f"the queries, keys and values of {settings.inputs}" if settings.inputs else "iid and clustered q, k"
    print(f"err = ‖out − full‖ / ‖full‖ on {on} (float64 reference on sampled rows).")
    if note := report.short_op_note(rows):
        print(note)
    if len(settings.lengths) > 1:
        print("\n" + report.format_crossovers(rows))
        print("crossover N = the smallest N from which the mechanism beats full at every longer N measured.")
    written = [args.out / "results.csv", args.out / "results.json"]
    if args.plots:
        try:
            written += report.plot_results(rows, args.out, title)
        except ImportError:
            print("matplotlib is not installed: no plots (pip install 'subquad[bench]')", file=sys.stderr)
    print(f"\nwrote {', '.join(map(str, written))} in {elapsed:.0f} s")
    failed = [r for r in rows if r.get("error")]
    if failed:
        print(f"{len(failed)} of {len(rows)} cells failed; see the table", file=sys.stderr)
    return 1 if failed else 0


def _check_device(device: str, grid: str) -> None:
    """Refuse, with the fix, a device the workers could not run on (this process starts no CUDA
    context: the workers do, and report the device's name)."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device torch knows; give cpu, cuda or cuda:N") from None
    if parsed.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        where = "the gpu grid needs one; on a CPU, give --grid default or full" if grid == "gpu" else "or --device cpu"
        raise ValueError(
            f"--device {device}: torch {torch.__version__} sees no CUDA device here; run on a machine with a GPU and "
            f"a CUDA build of torch ({where})"
        )
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")


def machine() -> str:
    """The CPU's model name, for the results beside every timing."""
    from subquad.kernels.profile import cpu_model

    return cpu_model()


class Progress:
    """A progress bar on a terminal (with rich installed), else one line per cell on stderr."""

    def __enter__(self) -> Callable[[int, int, str], None]:
        self._bar = None
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            Progress = None
        if Progress is None or not sys.stderr.isatty():  # a log file gets one line per cell
            return lambda i, n, label: print(f"[{i}/{n}] {label}", file=sys.stderr, flush=True)
        self._bar = Progress(
            TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            transient=False,
        )  # fmt: skip
        self._bar.__enter__()
        task = None

        def update(i: int, n: int, label: str) -> None:
            nonlocal task
            if task is None:
                task = self._bar.add_task(label, total=n)
            self._bar.update(task, completed=i, description=label)

        return update

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)


BENCH = Command(
    "bench",
    "time, memory and error of mechanisms against full attention",
    arguments,
    run,
    "Benchmark mechanisms against full attention over sequence lengths. The cells of each length run in a worker "
    "process of their own; time is the median of repeats after a warm-up; memory is the peak above the inputs; "
    "error is relative to full attention on iid and clustered inputs, or on the queries, keys and values of a "
    "file (--inputs).",
)

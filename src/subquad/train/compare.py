"""``subquad compare``: several attention specs trained on one task at an equal budget, one after another.

Each variant is ``NAME`` or ``NAME:option=value,option=value`` (a mechanism and its options), or a
TOML file (``subquad train --config``: head splits, per-layer specs). Every variant runs as its own
``subquad train`` process with the same training flags, into ``OUT/<variant>/``, so its peak memory
is its own. ``OUT/compare.json`` and ``compare.csv`` are rewritten after each variant; running the
same command again skips the variants that finished and resumes the one that was interrupted.
The comparison table (final and best evaluation, steps, training minutes, s/step, tokens/s, peak
memory) is printed and the validation curves of all variants drawn on ``compare.png``.

The budget is equal steps (the training flags' ``--steps``), or equal wall-clock (``minutes``): each
variant first trains a few steps in a throw-away probe run, and its step count is set to the budget
divided by its median seconds per step (evaluations and checkpoints not counted). The chosen counts
are saved in ``OUT/budget.json`` before training, so a resumed comparison keeps them; each run is
then an ordinary, deterministic run of that many steps, with its whole warm-up and cosine schedule.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from subquad.config import parse_spec
from subquad.files import FileError, out_folder, read_json
from subquad.train.config import _changed, load_config_file
from subquad.train.loop import read_metrics

__all__ = ["compare", "format_table", "variant_arguments"]

PROBE_STEPS = 12  # a budget's probe run: its steps after the third are timed
_AGAIN = "remove it to tabulate the variants again (their runs are kept)"


def variant_arguments(variant: str) -> list[str]:
    """The ``subquad train`` flags of a variant."""
    if variant.endswith(".toml"):
        if not Path(variant).is_file():
            raise FileNotFoundError(f"no config file at {variant}")
        return ["--config", variant]
    try:
        parse_spec(variant)
    except ValueError as error:
        raise ValueError(f"a variant is an attention spec or a .toml file; {error}") from None
    return ["--attention", variant]


def _label(variant: str) -> str:
    """How tables and plots name a variant: a config file by its file name."""
    return Path(variant).name if variant.endswith(".toml") else variant


def _slug(variant: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", Path(variant).stem if variant.endswith(".toml") else variant)


def _records(folder: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A variant's run: its metrics' records and its config, each file checked."""
    return read_metrics(folder / "metrics.jsonl"), load_config_file(folder / "config.json")


def _row(variant: str, folder: Path, peak_mb: float | None) -> dict[str, Any]:
    records, config = _records(folder)
    metric = next((k for r in records for k in r if k.startswith("val_")), None)
    if metric is None:
        raise FileError(folder / "metrics.jsonl", "holds no evaluation", f"remove {folder} to train the variant again")
    values = [r[metric] for r in records if metric in r]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    tokens = statistics.median(rates)
    window = config["batch"] * config["seq_len"]
    lower = metric.endswith("bpb")
    return {
        "variant": variant, "metric": metric, "final": values[-1], "best": min(values) if lower else max(values),
        "steps": len(rates), "train_minutes": sum(window / r for r in rates) / 60, "s_per_step": window / tokens,
        "tokens_per_s": tokens, "peak_mb": peak_mb,
    }  # fmt: skip


def _train(variant: str, flags: list[str], folder: Path, resume: bool) -> float | None:
    """Run (or resume) one variant in its own process; returns its peak resident memory in MB."""
    command = [sys.executable, "-m", "subquad", "train", *flags, *variant_arguments(variant), "--out", str(folder)]
    if resume:
        command.append("--resume")
    process = subprocess.Popen(command)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        where = f"; its run is in {folder}" if (folder / "config.json").exists() else ""
        raise ValueError(f"variant {variant!r} failed (exit {process.returncode}, its error above){where}")
    return usage.ru_maxrss / 1024  # KiB on Linux


def _probe(variant: str, base: list[str], folder: Path) -> float:
    """The median seconds per training step of ``variant``, from a short throw-away run in ``folder``."""
    shutil.rmtree(folder, ignore_errors=True)
    every = str(PROBE_STEPS)
    flags = [*base, "--steps", every, "--eval-every", every, "--eval-windows", "1", "--checkpoint-every", every]
    _train(variant, flags, folder, resume=False)
    records, config = _records(folder)
    seconds = [config["batch"] * config["seq_len"] / r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    shutil.rmtree(folder)
    return statistics.median(seconds[3:])


def _budget_steps(variant: str, base: list[str], out: Path, minutes: float) -> int:
    """The steps that fill ``minutes`` of training for ``variant``: probed once, then read from ``budget.json``."""
    path = out / "budget.json"
    budget = read_json(path, "budget", "remove it to probe the variants' speed again") if path.exists() else {}
    entry = budget.get(variant)
    if entry is not None and not (isinstance(entry, dict) and isinstance(entry.get("steps"), int)):
        raise FileError(path, f"holds no step count for {variant!r}", "remove it to probe the variants' speed again")
    if entry is None or entry["minutes"] != minutes:
        s_per_step = _probe(variant, base, out / f".probe-{_slug(variant)}")
        entry = {"minutes": minutes, "probe_s_per_step": s_per_step, "steps": max(1, round(minutes * 60 / s_per_step))}
        budget[variant] = entry
        tmp = path.with_name(f".budget.json.tmp{os.getpid()}")
        tmp.write_text(json.dumps(budget, indent=2))
        tmp.replace(path)
        print(f"{variant}: {s_per_step:.3f} s/step in the probe, so {entry['steps']} steps fill {minutes:g} min",
              file=sys.stderr, flush=True)  # fmt: skip
    return entry["steps"]


def compare(
    variants: list[str], base: list[str], out: str | Path, minutes: float | None = None,
    configs: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Train each variant with the flags ``base``; returns (and writes) one row per variant.

    ``minutes``: an equal wall-clock budget instead of ``base``'s equal steps (see the module).
    ``configs``: each variant's ``TrainConfig`` as its run builds it: a run already in ``out`` with
    other settings is refused before any training, not reported (or resumed) as this comparison's.
    """
    out = Path(out)
    if minutes is not None and not 0 < minutes < math.inf:
        raise ValueError(f"--minutes must be a number > 0, got {minutes}")
    if minutes is not None and "--steps" in base:
        raise ValueError("--minutes sets each variant's steps from its speed; drop --steps from the training flags")
    out_folder(out)
    saved = out / "compare.json"
    rows = read_json(saved, "comparison", _AGAIN, kind=list) if saved.exists() else []
    if not all(isinstance(r, dict) and isinstance(r.get("variant"), str) for r in rows):
        raise FileError(saved, "holds rows that are not compare's own", _AGAIN)
    previous = {r["variant"]: r for r in rows}
    rows = []
    _check_folders(variants, out, configs or {}, minutes)
    for variant in variants:
        folder = out / _slug(variant)
        if (folder / "summary.json").exists() and variant in previous:
            peak = previous[variant]["peak_mb"]
        else:
            resume = (folder / "config.json").exists()
            steps = ["--steps", str(_budget_steps(variant, base, out, minutes))] if minutes is not None else []
            peak = _train(variant, [*base, *steps], folder, resume)
        rows.append(_row(variant, folder, peak))
        _write(rows, out)
    _plot(rows, out)
    return rows


def _check_folders(variants: list[str], out: Path, configs: dict[str, Any], minutes: float | None) -> None:
    """Before any training: each variant a spec or a file, each its own folder, and a run already in
    its folder one of these settings (its steps too, unless ``minutes`` sets them)."""
    folders: dict[str, str] = {}
    for variant in variants:
        variant_arguments(variant)  # a bad spec fails before any training
        other = folders.setdefault(_slug(variant), variant)
        if other != variant:
            raise ValueError(f"variants {other!r} and {variant!r} would share the run folder {out / _slug(variant)}; "
                             "rename one (a .toml file's name names its folder)")  # fmt: skip
        saved = out / _slug(variant) / "config.json"
        if variant in configs and saved.exists():
            free = {"out", "device"} | ({"steps"} if minutes is not None else set())
            changed = _changed(load_config_file(saved), configs[variant], free)
            if changed:
                raise FileError(saved, f"is a run of {variant!r} with other settings (run, now): {changed}",
                                f"compare into another --out, or remove {saved.parent} to train it again")  # fmt: skip


def _write(rows: list[dict[str, Any]], out: Path) -> None:
    tmp = out / f".compare.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(rows, indent=2))
    tmp.replace(out / "compare.json")
    with (out / "compare.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The comparison as a markdown table."""
    lines = ["| variant | final | best | steps | train min | s/step | tokens/s | peak MB |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        peak = f"{r['peak_mb']:.0f}" if r["peak_mb"] is not None else "-"
        cells = [_label(r["variant"]), f"{r['final']:.4f}", f"{r['best']:.4f}", str(r["steps"]),
                 f"{r['train_minutes']:.2f}", f"{r['s_per_step']:.3f}", f"{r['tokens_per_s']:,.0f}", peak]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return f"{rows[0]['metric']}:\n" + "\n".join(lines) if rows else "no variant"


def _plot(rows: list[dict[str, Any]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    clock = (out / "budget.json").exists()  # an equal wall-clock budget: curves against training time
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    for r in rows:
        records, config = _records(out / _slug(r["variant"]))
        window = config["batch"] * config["seq_len"]
        elapsed, points = 0.0, []
        for x in records:
            elapsed += window / x["tokens_per_s"] / 60 if "tokens_per_s" in x else 0.0
            if r["metric"] in x:
                points.append((elapsed if clock else x["step"], x[r["metric"]]))
        ax.plot(*zip(*points), "o-", ms=3, label=_label(r["variant"]))
    xlabel = "training minutes (evaluations not counted)" if clock else "step"
    ax.set(xlabel=xlabel, ylabel=rows[0]["metric"] if rows else "", title="subquad compare")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=100)
    plt.close(fig)

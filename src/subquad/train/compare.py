"""``subquad compare``: several attention specs trained on one task at an equal budget, one after another.

Each variant is ``NAME`` or ``NAME:option=value,option=value`` (a mechanism and its options), or a
TOML file (``subquad train --config``: head splits, per-layer specs). Every variant runs as its own
``subquad train`` process with the same training flags, into ``OUT/<variant>/``, so its peak memory
is its own. ``OUT/compare.json`` and ``compare.csv`` are rewritten after each variant; running the
same command again skips the variants that finished and resumes the one that was interrupted.
The comparison table (final and best evaluation, s/step, tokens/s, peak memory) is printed and the
validation curves of all variants drawn on ``compare.png``.
"""

from __future__ import annotations

import csv
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["compare", "variant_arguments"]


def variant_arguments(variant: str) -> list[str]:
    """The ``subquad train`` flags of a variant."""
    if variant.endswith(".toml"):
        if not Path(variant).is_file():
            raise FileNotFoundError(f"no config file at {variant}")
        return ["--config", variant]
    name, _, options = variant.partition(":")
    if not name:
        raise ValueError(f"a variant is NAME, NAME:option=value,... or a .toml file, got {variant!r}")
    flags = ["--attention", name]
    if options:
        flags += ["--options", *options.split(",")]
    return flags


def _slug(variant: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", Path(variant).stem if variant.endswith(".toml") else variant)


def _row(variant: str, folder: Path, peak_mb: float | None) -> dict[str, Any]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line]
    metric = next(k for r in records for k in r if k.startswith("val_"))
    values = [r[metric] for r in records if metric in r]
    config = json.loads((folder / "config.json").read_text())
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    tokens = statistics.median(rates)
    lower = metric.endswith("bpb")
    return {
        "variant": variant, "metric": metric, "final": values[-1], "best": min(values) if lower else max(values),
        "s_per_step": config["batch"] * config["seq_len"] / tokens, "tokens_per_s": tokens, "peak_mb": peak_mb,
    }  # fmt: skip


def _train(variant: str, base: list[str], folder: Path) -> float | None:
    """Run (or resume) one variant in its own process; returns its peak resident memory in MB."""
    command = [sys.executable, "-m", "subquad", "train", *base, *variant_arguments(variant), "--out", str(folder)]
    if (folder / "config.json").exists():
        command.append("--resume")
    process = subprocess.Popen(command)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"variant {variant!r} failed (exit {process.returncode}); its run is in {folder}")
    return usage.ru_maxrss / 1024  # KiB on Linux


def compare(variants: list[str], base: list[str], out: str | Path) -> list[dict[str, Any]]:
    """Train each variant with the flags ``base``; returns (and writes) one row per variant."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "compare.json"
    previous = {r["variant"]: r for r in json.loads(saved.read_text())} if saved.exists() else {}
    rows = []
    for variant in variants:
        variant_arguments(variant)  # a bad spec fails before any training
    for variant in variants:
        folder = out / _slug(variant)
        done = (folder / "summary.json").exists() and variant in previous
        peak = previous[variant]["peak_mb"] if done else _train(variant, base, folder)
        rows.append(_row(variant, folder, peak))
        _write(rows, out)
    _plot(rows, out)
    return rows


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
    lines = ["| variant | final | best | s/step | tokens/s | peak MB |", "|---|---|---|---|---|---|"]
    for r in rows:
        peak = f"{r['peak_mb']:.0f}" if r["peak_mb"] is not None else "-"
        lines.append(f"| {r['variant']} | {r['final']:.4f} | {r['best']:.4f} | {r['s_per_step']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {peak} |")  # fmt: skip
    return f"{rows[0]['metric']}:\n" + "\n".join(lines) if rows else "no variant"


def _plot(rows: list[dict[str, Any]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        records = [json.loads(line) for line in (out / _slug(r["variant"]) / "metrics.jsonl").read_text().splitlines()]
        points = [(x["step"], x[r["metric"]]) for x in records if r["metric"] in x]
        ax.plot(*zip(*points), "o-", ms=3, label=r["variant"])
    ax.set(xlabel="step", ylabel=rows[0]["metric"] if rows else "", title="subquad compare")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=100)
    plt.close(fig)

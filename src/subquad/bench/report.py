"""Benchmark output: a table, CSV and JSON files, and PNG plots against sequence length."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from subquad.bench.runner import BASELINE

__all__ = [
    "TABLE_HEADERS",
    "crossovers",
    "format_crossovers",
    "format_table",
    "marked_crossovers",
    "plot_results",
    "short_op_note",
    "slow_short_ops",
    "table_rows",
    "write_csv",
    "write_json",
]

TABLE_HEADERS = ("mechanism", "causal", "pass", "N", "time ms", "× full", "peak MB", "err iid", "err clust", "reps")
_CSV_FIELDS = (
    "mechanism", "name", "options", "length", "causal", "pass", "time_s", "ratio", "baseline_time_s", "peak_bytes",
    "error_iid", "error_clustered", "error_inputs", "zero_rows", "nonfinite", "repeats", "threads", "short_op_speedup",
    "memory_method", "error",
)  # fmt: skip
# A cell whose probe read less than this ran while two threads gained little on short operations.
SHORT_OP_SPEEDUP = 1.1
_PANELS = [("forward", False), ("forward", True), ("forward+backward", False), ("forward+backward", True)]


def _number(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)  # NaN prints as "nan"


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The table's cells as strings, grouped by pass, then causality, then length."""
    order = {label: i for i, label in enumerate(dict.fromkeys(r["mechanism"] for r in rows))}
    ordered = sorted(rows, key=lambda r: (r["pass"], r["causal"], r["length"], order[r["mechanism"]]))
    cells = []
    for r in ordered:
        if r.get("error"):
            cells.append([r["mechanism"], _causal(r), r["pass"], str(r["length"]), "failed: " + r["error"][:60]])
            continue
        peak = None if r.get("peak_bytes") is None else r["peak_bytes"] / 2**20
        cells.append([
            r["mechanism"], _causal(r), r["pass"], str(r["length"]),
            _milliseconds(r["time_s"]), _number(r.get("ratio"), ".3f") + ("*" if slow_short_ops(r) else ""),
            _number(peak, ".1f"),
            *_errors(r),
            str(len(r.get("times_s", []))),
        ])  # fmt: skip
    return cells


def _errors(row: dict[str, Any]) -> list[str]:
    """The two error columns: iid and clustered; on the inputs of a file (``--inputs``) that error, then -."""
    if "error_inputs" in row:
        return [_number(row["error_inputs"], ".1e"), "-"]
    return [_number(row.get("error_iid"), ".1e"), _number(row.get("error_clustered"), ".1e")]


def slow_short_ops(row: dict[str, Any]) -> bool:
    """Whether a probe behind the cell's ratio (``worker.short_op_speedup``, before and after its
    timing; for a cell not paired, also full attention's row, the other side of its ratio) found two
    threads less than ``SHORT_OP_SPEEDUP`` times faster than one on short operations. Full
    attention's own row (ratio 1 by definition) is never marked."""
    if row["mechanism"] == BASELINE.label:
        return False
    probes = [*(row.get("short_op_speedup") or ()), *(row.get("baseline_short_op_speedup") or ())]
    return any(p is not None and p < SHORT_OP_SPEEDUP for p in probes)


def short_op_note(rows: list[dict[str, Any]]) -> str | None:
    """The table's footnote for the cells ``slow_short_ops`` marks with ``*``; None where none is."""
    marked = sum(slow_short_ops(r) for r in rows)
    if not marked:
        return None
    return (
        f"* {marked} of {len(rows)} cells ran while two threads were less than {SHORT_OP_SPEEDUP}× as fast as one "
        "on short operations (`short_op_speedup` in results.csv). On a 2-core virtual machine that meant each short "
        "parallel region waited on the other core (kept busy by another process, as with --busy, or run apart by "
        "the host), and mechanisms made of many operations read higher against full attention (README)."
    )


def _milliseconds(seconds: float) -> str:
    ms = 1e3 * seconds
    return f"{ms:,.0f}" if ms >= 1000 else f"{ms:.1f}" if ms >= 10 else f"{ms:.3f}"


def _causal(row: dict[str, Any]) -> str:
    return "causal" if row["causal"] else "non-causal"


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of the results."""
    headers = list(TABLE_HEADERS)
    if any("error_inputs" in r for r in rows):  # --inputs: one error, on the file's inputs
        headers[headers.index("err iid") : headers.index("err clust") + 1] = ["err (file)", "-"]
    cells = [headers, *table_rows(rows)]
    widths = [max(len(c[i]) for c in cells if i < len(c)) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def crossovers(rows: list[dict[str, Any]]) -> dict[tuple[str, bool, str], tuple[str, int | None]]:
    """Each (mechanism, causal, pass)'s crossover against full attention: the smallest measured N
    from which its ratio stays below 1 at every longer N measured (one noisy win below a loss does
    not count). Values: ``("at", N)``; ``("below", N)`` where it already wins at the shortest N
    measured; ``("above", N)`` where it does not win at the longest N measured (or has no ratio)."""
    out = {}
    for key, (series, first) in _crossover_series(rows).items():
        if first == len(series):
            out[key] = ("above", series[-1]["length"])
        else:
            out[key] = ("below" if first == 0 else "at", series[first]["length"])
    return out


def marked_crossovers(rows: list[dict[str, Any]]) -> set[tuple[str, bool, str]]:
    """The crossovers set by a cell that ``slow_short_ops`` marks: the loss at the longest N the
    mechanism did not beat full attention at was measured while a probe read slow, so the crossover
    may be later than the host's quiet state gives."""
    return {
        key for key, (series, first) in _crossover_series(rows).items() if first and slow_short_ops(series[first - 1])
    }


def _crossover_series(rows: list[dict[str, Any]]) -> dict[tuple[str, bool, str], tuple[list[dict[str, Any]], int]]:
    """Each (mechanism, causal, pass)'s rows by length, and the index of the first of the wins
    (ratio below 1) that last to its longest N (the number of rows where the last is no win)."""
    out = {}
    for r in rows:
        key = (r["mechanism"], r["causal"], r["pass"])
        if r["mechanism"] == BASELINE.label or key in out:
            continue
        series = sorted((x for x in rows if (x["mechanism"], x["causal"], x["pass"]) == key), key=lambda x: x["length"])
        first = len(series)
        while first > 0 and series[first - 1].get("ratio") is not None and series[first - 1]["ratio"] < 1:
            first -= 1
        out[key] = (series, first)
    return out


def _crossover_text(value: tuple[str, int | None] | None) -> str:
    if value is None:
        return "-"
    kind, n = value
    return {"at": str(n), "below": f"<= {n}", "above": f"> {n}"}[kind]


def format_crossovers(rows: list[dict[str, Any]]) -> str:
    """A table of each mechanism's crossover N, forward and forward+backward, non-causal and causal;
    ``*`` marks one set by a marked cell (``marked_crossovers``), with a footnote."""
    found, marked = crossovers(rows), marked_crossovers(rows)
    columns = [(c, p) for c in (False, True) for p in ("forward", "forward+backward")]
    columns = [col for col in columns if any(k[1:] == col for k in found)]
    headers = ["crossover N", *(f"{'causal' if c else 'non-causal'} {p}" for c, p in columns)]
    labels = list(dict.fromkeys(k[0] for k in found))
    cells = [headers] + [
        [m, *(_crossover_text(found.get((m, c, p))) + ("*" if (m, c, p) in marked else "") for c, p in columns)]
        for m in labels
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if marked:
        lines.append(
            f"* {len(marked)} {'crossover is' if len(marked) == 1 else 'crossovers are'} set by a loss in a cell "
            "marked * above (the longest N not beaten): with the host quiet it may come sooner."
        )
    return "\n".join(line.rstrip() for line in lines)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            probes = " ".join(format(p, ".3f") for p in r.get("short_op_speedup") or () if p is not None)
            repeats = len(r.get("times_s", []))
            writer.writerow({**r, "options": json.dumps(r["options"]), "repeats": repeats, "short_op_speedup": probes})


def write_json(rows: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    """Standard JSON: NaN and inf become null (the row's ``nonfinite`` flag keeps the fact)."""
    clean = [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()} for r in rows]
    path.write_text(json.dumps({"meta": meta, "results": clean}, indent=2, default=str))


def plot_results(rows: list[dict[str, Any]], out_dir: Path, title: str) -> list[Path]:
    """Write time.png, ratio.png, memory.png, error.png and crossover.png; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.get("error")]
    if not ok:  # every cell failed: nothing to plot
        return []
    labels = list(dict.fromkeys(r["mechanism"] for r in rows))
    colours = {label: plt.get_cmap("tab10")(i % 10) for i, label in enumerate(labels)}
    written = []
    for name, key, scale, ylabel in (
        ("time", "time_s", 1e3, "time per call (ms, median)"),
        ("ratio", "ratio", 1.0, "time ÷ full attention"),
        ("memory", "peak_bytes", 2.0**-20, "peak memory above inputs (MB)"),
    ):
        fig = _panels(plt, ok, key, scale, ylabel, colours, guides=name == "time")
        suptitle = f"{name}: {title}"
        if name != "memory" and any(slow_short_ops(r) for r in ok):
            suptitle += f"\nopen markers: two threads less than {SHORT_OP_SPEEDUP}× as fast as one on short operations"
            _open_slow_cells(fig, ok, key, scale, colours)
        fig.suptitle(suptitle)
        written.append(_save(fig, plt, out_dir / f"{name}.png"))
    fig = _error_panels(plt, ok, colours)
    fig.suptitle(f"relative error against full attention: {title}")
    written.append(_save(fig, plt, out_dir / "error.png"))
    fig = _crossover_plot(plt, rows)
    if fig is not None:
        fig.suptitle(f"crossover N (beats full from there on): {title}")
        written.append(_save(fig, plt, out_dir / "crossover.png"))
    return written


def _crossover_plot(plt: Any, rows: list[dict[str, Any]]):
    """One row per mechanism: its crossover N in each (causality, pass); an open marker past the
    longest N for none, at the shortest N for a win already there; a ``*`` beside one set by a
    marked cell (``marked_crossovers``)."""
    found, marked = crossovers(rows), marked_crossovers(rows)
    lengths = sorted({r["length"] for r in rows})
    if not found or len(lengths) < 2:
        return None
    labels = list(dict.fromkeys(k[0] for k in found))
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(labels) + 1.6))
    styles = {(False, "forward"): ("o", -0.24), (False, "forward+backward"): ("s", -0.08),
              (True, "forward"): ("^", 0.08), (True, "forward+backward"): ("D", 0.24)}  # fmt: skip
    beyond = lengths[-1] * 1.6
    for (causal, pass_), (marker, shift) in styles.items():
        xs, ys, open_ = [], [], []
        for i, label in enumerate(labels):
            value = found.get((label, causal, pass_))
            if value is not None:
                xs.append(beyond if value[0] == "above" else value[1])
                ys.append(i + shift)
                open_.append(value[0] != "at")
                if (label, causal, pass_) in marked:
                    ax.annotate("*", (xs[-1], ys[-1]), xytext=(5, -3), textcoords="offset points", fontsize=9)
        if xs:
            name = f"{'causal' if causal else 'non-causal'} {pass_}"
            colour = "C3" if causal else "C0"
            faces = ["none" if o else colour for o in open_]
            ax.scatter(xs, ys, marker=marker, label=name, facecolors=faces, edgecolors=colour)
    ax.set_xscale("log")
    ax.set_xticks([*lengths, beyond], [*map(str, lengths), f"> {lengths[-1]}"])
    ax.minorticks_off()  # the log axis' own labels (2×10³) would print over the lengths
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(
        "smallest N from which it beats full attention\n"
        "(open: at or beyond the grid's ends; *: set by a cell marked * in the table)"
    )
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return fig


def _present_panels(rows: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """The (pass, causal) panels that ``rows`` have cells for, in ``_PANELS``' order."""
    return [(p, c) for p, c in _PANELS if any(r["pass"] == p and r["causal"] == c for r in rows)]


def _panels(plt: Any, rows: list[dict[str, Any]], key: str, scale: float, ylabel: str, colours: dict, guides: bool):
    panels = _present_panels(rows)
    cols = 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.2 * cols, 4.4 * nrows), squeeze=False)
    for ax, (pass_, causal) in zip(axes.flat, panels):
        cell_rows = [r for r in rows if r["pass"] == pass_ and r["causal"] == causal and r.get(key) is not None]
        for label in colours:
            pts = sorted((r["length"], max(r[key] * scale, 1e-3)) for r in cell_rows if r["mechanism"] == label)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=colours[label], label=label)
        if guides:
            _add_guides(ax, cell_rows, key, scale)
        _style(ax, sorted({r["length"] for r in rows}), ylabel, f"{pass_}, {'causal' if causal else 'non-causal'}")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    _figure_legend(fig, list(axes.flat)[: len(panels)])
    return fig


def _open_slow_cells(fig: Any, rows: list[dict[str, Any]], key: str, scale: float, colours: dict) -> None:
    """Draw the points of ``slow_short_ops`` cells over ``_panels``' figure as open markers (the
    table's ``*``)."""
    for ax, (pass_, causal) in zip(fig.axes, _present_panels(rows)):
        for label, colour in colours.items():
            pts = [
                (r["length"], max(r[key] * scale, 1e-3))
                for r in rows
                if (r["mechanism"], r["pass"], r["causal"]) == (label, pass_, causal)
                and r.get(key) is not None
                and slow_short_ops(r)
            ]
            if pts:
                ax.scatter(*zip(*pts), marker="o", facecolors="white", edgecolors=colour, zorder=3)


def _style(ax: Any, lengths: list[int], ylabel: str, title: str) -> None:
    """Log-log axes with the measured lengths as x ticks and plain numbers on y."""
    from matplotlib.ticker import FuncFormatter, NullLocator

    ax.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel=ylabel)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.xaxis.set_minor_locator(NullLocator())
    plain = FuncFormatter(lambda y, _: f"{y:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)


def _figure_legend(fig: Any, axes: Any) -> None:
    """One legend for all panels, right of them, where it covers no line (a legend inside each
    panel hid the short lengths' points). ``_save`` leaves it the room."""
    entries: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        fig.legend(entries.values(), entries.keys(), loc="center right", fontsize=8, frameon=False)


def _add_guides(ax: Any, rows: list[dict[str, Any]], key: str, scale: float) -> None:
    """Dotted O(N) and O(N²) lines through full attention's shortest-length point."""
    base = sorted((r["length"], r[key] * scale) for r in rows if r["mechanism"] == BASELINE.label)
    if len(base) < 2:
        return
    (n0, t0), n1 = base[0], base[-1][0]
    for power, text in ((1, "O(N)"), (2, "O(N²)")):
        ax.plot([n0, n1], [t0, t0 * (n1 / n0) ** power], ls=":", color="grey", lw=1)
        ax.annotate(text, (n1, t0 * (n1 / n0) ** power), fontsize=8, color="grey", ha="right", va="bottom")


def _error_panels(plt: Any, rows: list[dict[str, Any]], colours: dict):
    forward = [r for r in rows if r["pass"] == "forward"]
    panels = [("error_iid", "iid Gaussian"), ("error_clustered", "clustered")]
    if any("error_inputs" in r for r in forward):  # --inputs: the file's queries and keys only
        panels = [("error_inputs", "the inputs file's")]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4), squeeze=False)
    for ax, (key, kind) in zip(axes.flat, panels):
        for label in colours:
            for causal, style in ((False, "-"), (True, "--")):
                pts = sorted(
                    (r["length"], max(r[key], 1e-9))
                    for r in forward
                    if r["mechanism"] == label and r["causal"] == causal and r.get(key) is not None
                )
                if pts:
                    name = f"{label} ({'causal' if causal else 'non-causal'})"
                    ax.plot(*zip(*pts), marker="o", ls=style, color=colours[label], label=name)
        _style(ax, sorted({r["length"] for r in rows}), "‖out − full‖ / ‖full‖", f"{kind} q, k")
    _figure_legend(fig, list(axes.flat))
    return fig


def _save(fig: Any, plt: Any, path: Path) -> Path:
    if fig.legends:  # a figure legend on the right: widen the figure by its width, keep the panels
        width = fig.legends[0].get_window_extent(fig.canvas.get_renderer()).width / fig.dpi + 0.2
        fig.set_figwidth(fig.get_figwidth() + width)
        right = 1 - width / fig.get_figwidth()
    else:
        right = 1.0
    fig.tight_layout(rect=(0, 0, right, 0.96))  # leave room for the suptitle (and the legend)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

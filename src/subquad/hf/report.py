"""``subquad approx``'s rows as tables and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["format_decode_table", "format_table", "plot"]

_COLUMNS = {
    "cosine": ("cosine", "{:.4f}"), "cosine_p5": ("cosine p5", "{:.4f}"), "spearman": ("Spearman", "{:.4f}"),
    "probe_accuracy": ("probe acc", "{:.3f}"), "perplexity": ("perplexity", "{:.2f}"),
    "top1_agreement": ("top-1 agree", "{:.3f}"), "time_ms": ("attn ms", "{:.1f}"), "ratio": ("attn ÷", "{:.2f}"),
    "peak_mb": ("peak MB", "{:.0f}"), "model_ms": ("model ms", "{:.0f}"), "model_ratio": ("model ÷", "{:.2f}"),
}  # fmt: skip


def format_table(rows: list[dict[str, Any]], header: bool = True) -> str:
    """The rows as a markdown table."""
    keys = [k for k in _COLUMNS if any(k in r for r in rows)]
    lines = []
    if header:
        lines = ["| spec | " + " | ".join(_COLUMNS[k][0] for k in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for r in rows:
        cells = [_COLUMNS[k][1].format(r[k]) if isinstance(r.get(k), (int, float)) else "-" for k in keys]
        lines.append(f"| {r['spec']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_decode_table(rows: list[dict[str, Any]]) -> str:
    """Each row's generation measurements, one line per prompt length, as a markdown table."""
    lines = ["| spec | prompt | prefill s | ms / token | cache MB | peak RSS MB |", "|---|---|---|---|---|---|"]
    for r in rows:
        for n, m in sorted(r.get("decode", {}).items(), key=lambda item: int(item[0])):
            lines.append(f"| {r['spec']} | {n} | {m['prefill_s']:.2f} | {m['ms_per_token']:.1f} | "
                         f"{m['cache_mb']:.1f} | {m['peak_rss_mb']:.0f} |")  # fmt: skip
    return "\n".join(lines)


def format_recall_table(rows: list[dict[str, Any]]) -> str:
    """Each row's passkey probe, one line per prompt length: found of all, and by depth."""
    depths = sorted({d for r in rows for m in r.get("passkey", {}).values() for d in m["by_depth"]}, key=float)
    lines = ["| spec | prompt | found | " + " | ".join(f"depth {d}" for d in depths) + " |",
             "|---" * (3 + len(depths)) + "|"]  # fmt: skip
    for r in rows:
        for n, m in sorted(r.get("passkey", {}).items(), key=lambda item: int(item[0])):
            per = [str(m["by_depth"].get(d, "-")) for d in depths]
            kind = m.get("probe", {}).get("kind", "passkey")
            lines.append(f"| {r['spec']} | {kind} {n} | {m['found']}/{m['cases']} | " + " | ".join(per) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, decoder: bool) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    key = "perplexity" if decoder else "cosine"
    points = [(r.get("ratio"), r[key], r["spec"]) for r in rows if r.get("ratio") is not None and key in r]
    if not points:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for x, y, label in points:
        ax.scatter(x, y)
        ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="attention time ÷ original (lower is faster)", ylabel=key, title="subquad approx")
    if decoder:
        ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

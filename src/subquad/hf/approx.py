"""``subquad approx``: how closely each mechanism, swapped into a pretrained Hugging Face model,
reproduces the model's own outputs on real text.

The text is cut into windows of exactly ``tokens`` tokens (passages packed one after another, within
a label where the data has labels). The original model runs once; then each mechanism in turn
(``subquad.hf.use``; routing's centroids calibrated first on the model's own queries and keys).

- Encoders: mean-pooled embeddings; their cosine to the original's (mean and 5th percentile),
  Spearman's correlation of all pairwise similarities, and, where the data has labels, the accuracy
  of a logistic-regression probe trained on one half of the windows and tested on the other (for
  the original and for the swapped embeddings).
- Decoders: perplexity of the windows' next tokens, and top-1 next-token agreement with the original.
- Both: time and peak memory of the attention alone at the model's longest context, against the
  original's (``subquad bench``'s measurement, at the model's heads and head size), and the whole
  model's forward time on one window of that length (batch 1), against the original model's.

Converted models (folders ``subquad distill`` or ``subquad.hf.save`` wrote, from the same original
model) are measured the same way, each under the row ``converted:FOLDER``; their attention speed is
that of their mechanism and options.

``approx.json`` is rewritten after each mechanism (a rerun skips those done), the table printed, and
``approx.png`` plots quality against speed.

Data: a ``.jsonl`` file of ``{"text": ..., "label": ...}`` lines (label optional), a text file of
passages separated by blank lines, or a folder of ``.txt`` files (labelled by their subfolder).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from subquad.files import FileError, read_json
from subquad.hf.data import Windows, load_model, read_passages, token_windows

__all__ = ["approx", "format_table", "parse_spec"]


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """A spec (``subquad.config.parse_spec``) as the one mechanism and options each layer runs."""
    from subquad.hf.interface import layer_spec

    return layer_spec(spec)


@torch.no_grad()
def _outputs(model: nn.Module, windows: Windows, batch: int, decoder: bool) -> dict[str, Tensor]:
    """Encoders: unit mean-pooled embeddings ``(n, E)``. Decoders: next-token log-losses ``(n, T-1)``
    and predictions ``(n, T-1)``."""
    parts: dict[str, list[Tensor]] = {}
    for start in range(0, len(windows.ids), batch):
        ids = windows.ids[start : start + batch]
        if decoder:
            logits = model(input_ids=ids).logits[:, :-1].float()
            loss = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            parts.setdefault("loss", []).append(loss)
            parts.setdefault("top1", []).append(logits.argmax(-1))
        else:
            hidden = model(input_ids=ids).last_hidden_state.float().mean(1)
            parts.setdefault("embedding", []).append(nn.functional.normalize(hidden, dim=-1))
    return {k: torch.cat(v).cpu() for k, v in parts.items()}


def _dtype(name: str) -> torch.dtype:
    """``--dtype``'s name as a torch dtype; a ValueError names the choices."""
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in choices:
        raise ValueError(f"--dtype must be one of {', '.join(choices)}, got {name!r}")
    return choices[name]


def _ranks(x: Tensor) -> Tensor:
    return torch.empty_like(x).scatter_(0, x.argsort(), torch.arange(len(x), dtype=x.dtype))


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman's rank correlation of two 1-D tensors."""
    ra, rb = _ranks(a.double()), _ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def probe_accuracy(embeddings: Tensor, labels: list[str], seed: int = 0) -> float:
    """Test accuracy of a multinomial logistic regression (L2, LBFGS) trained on a seeded half."""
    names = sorted(set(labels))
    y = torch.tensor([names.index(label) for label in labels])
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    train, test = order[: len(y) // 2], order[len(y) // 2 :]
    x = embeddings.double()
    mean, std = x[train].mean(0), x[train].std(0).clamp_min(1e-6)
    x = (x - mean) / std
    weight = torch.zeros(x.shape[1], len(names), dtype=x.dtype, requires_grad=True)
    bias = torch.zeros(len(names), dtype=x.dtype, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(x[train] @ weight + bias, y[train]) + 1e-3 * weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return float(((x[test] @ weight + bias).argmax(-1) == y[test]).double().mean())


def _quality(original: dict[str, Tensor], swapped: dict[str, Tensor], labels: list[str] | None) -> dict[str, Any]:
    if "loss" in original:
        return {
            "perplexity": math.exp(float(swapped["loss"].mean())),
            "top1_agreement": float((swapped["top1"] == original["top1"]).double().mean()),
        }
    a, b = original["embedding"], swapped["embedding"]
    cosine = (a * b).sum(-1)
    upper = torch.triu_indices(len(a), len(a), 1)
    pairs = lambda e: (e @ e.T)[upper[0], upper[1]]  # noqa: E731
    row = {"cosine": float(cosine.mean()), "cosine_p5": float(cosine.quantile(0.05)),
           "spearman": spearman(pairs(a), pairs(b))}  # fmt: skip
    if labels is not None:
        row["probe_accuracy"] = probe_accuracy(b, labels)
    return row


def _speed(
    model: nn.Module, specs: list[str], context: int, causal: bool, device: torch.device, dtype: str
) -> dict[str, dict[str, Any]]:
    """Time and peak memory of each mechanism's attention at ``context``, with the model's heads."""
    from subquad.bench.runner import BenchSettings, Variant, run_bench

    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    variants = [Variant(name, tuple(sorted(options.items()))) for name, options in map(parse_spec, specs)]
    settings = BenchSettings(variants=variants, lengths=(context,), heads=heads, head_dim=head_dim, causal=(causal,),
                             backward=(False,), repeats=5, warmup_seconds=1.0, max_seconds=3.0, device=device.type,
                             dtype=dtype)  # fmt: skip
    rows = {r["mechanism"]: r for r in run_bench(settings)}
    labels = {"original": "full", **{spec: variant.label for spec, variant in zip(specs, variants)}}
    out = {}
    for spec, label in labels.items():
        row = rows.get(label, {})
        peak = row["peak_bytes"] / 2**20 if row.get("peak_bytes") else None
        ratio = 1.0 if spec == "original" else row.get("ratio")
        out[spec] = {"time_ms": row.get("time_s", math.nan) * 1e3, "ratio": ratio, "peak_mb": peak}
    return out


@torch.no_grad()
def _model_speed(
    model: nn.Module, tokenizer: Any, texts: list[str], specs: list[str], context: int, calib: Windows,
    batch: int, seed: int, budget: float = 20.0, converted: dict[str, str] | None = None,
) -> dict[str, dict[str, float]]:  # fmt: skip
    """The whole model's forward time on one window of ``context`` tokens of the text (batch 1), the
    original and each spec swapped in: the median of up to 3 timed calls after one untimed call
    (fewer where the calls take over ``budget`` seconds). The body runs without a language-model
    head, whose logits do not change with the attention."""
    from subquad import hf

    reference = next(model.parameters())
    ids = token_windows(tokenizer, texts, None, context, 1, seed).ids.to(reference.device)

    def timed(model: nn.Module) -> float:
        body = getattr(model, "base_model", model)
        body(input_ids=ids)  # untimed: the first call of a shape
        times: list[float] = []
        while len(times) < 3 and sum(times) < budget:
            start = time.perf_counter()
            body(input_ids=ids)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    seconds = {"original": timed(model)}
    for label, folder in (converted or {}).items():
        seconds[label] = timed(hf.from_pretrained(folder).to(reference.device, reference.dtype))
    for spec in specs:
        name, options = parse_spec(spec)
        hf.use(model, name, **options)
        if hf.calibratable(name):  # routing's speed depends on how its centroids split the tokens
            hf.calibrate(model, [{"input_ids": calib.ids[i : i + batch]} for i in range(0, len(calib.ids), batch)])
        seconds[spec] = timed(model)
        hf.restore(model)
    return {spec: {"model_ms": t * 1e3, "model_ratio": t / seconds["original"]} for spec, t in seconds.items()}


def approx(model_path: str | Path, data: str | Path, specs: list[str], out: str | Path, *, tokens: int = 256,
           samples: int = 300, batch: int = 8, context: int | None = None, calibration: int = 16,
           speed: bool = True, seed: int = 0, converted: list[str | Path] = (), device: str = "auto",
           dtype: str = "float32") -> list[dict[str, Any]]:  # fmt: skip
    """Measure each mechanism spec, and each converted model folder, against the original model;
    returns (and writes) the rows. ``device``: auto, cpu, cuda or cuda:N; ``dtype``: the model's
    (float32, bfloat16, float16); quality is compared in float32 either way."""
    from subquad import hf
    from subquad.train.loop import resolve_device

    where, kind = resolve_device(device), _dtype(dtype)

    for spec in specs:
        name, options = parse_spec(spec)
        hf.LayerAttention.build(name, **options)  # a bad spec fails before the model loads
    folders = {f"converted:{folder}": converted_spec(folder) for folder in converted}
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a folder (it is created if missing)")
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer, decoder = load_model(model_path)
    model = model.to(where, kind)
    texts, labels = read_passages(data)
    windows = token_windows(tokenizer, texts, labels, tokens, samples + calibration, seed)
    calib = Windows(windows.ids[samples:].to(where), None)
    windows = Windows(windows.ids[:samples].to(where), windows.labels[:samples] if windows.labels else None)
    if len(windows.ids) < 2:
        raise ValueError(f"the text gives {len(windows.ids)} window(s) of {tokens} tokens; pass more text")
    settings = {"model": str(model_path), "data": str(data), "tokens": tokens, "samples": len(windows.ids),
                "decoder": decoder, "seed": seed, "device": where.type, "dtype": dtype}  # fmt: skip
    saved = out / "approx.json"
    previous = read_json(saved, "approx results", _RESULTS_FIX) if saved.exists() else {}
    kept = previous.get("rows", []) if previous.get("settings") == settings else []
    if not isinstance(kept, list) or not all(isinstance(r, dict) and isinstance(r.get("spec"), str) for r in kept):
        raise FileError(saved, "holds rows that are not approx's own", _RESULTS_FIX)
    done = {r["spec"]: r for r in kept}
    original = _outputs(model, windows, batch, decoder)
    rows = [done.get("original") or {"spec": "original", **_quality(original, original, windows.labels)}]
    for spec in specs:
        if spec in done:
            rows.append(done[spec])
            continue
        name, options = parse_spec(spec)
        hf.use(model, name, **options)
        if hf.calibratable(name):
            hf.calibrate(model, [{"input_ids": calib.ids[i : i + batch]} for i in range(0, len(calib.ids), batch)])
        rows.append({"spec": spec, **_quality(original, _outputs(model, windows, batch, decoder), windows.labels)})
        hf.restore(model)
        _write(saved, settings, rows)
        print(format_table(rows[-1:], header=False), flush=True)
    for label in folders:
        if label in done:
            rows.append(done[label])
            continue
        swapped = _outputs(hf.from_pretrained(label.partition(":")[2]).to(where, kind), windows, batch, decoder)
        rows.append({"spec": label, **_quality(original, swapped, windows.labels)})
        _write(saved, settings, rows)
        print(format_table(rows[-1:], header=False), flush=True)
    if speed and not all("time_ms" in r and "model_ms" in r for r in rows):
        longest = context or int(getattr(model.config, "max_position_embeddings", tokens))
        timing = _speed(model, list(dict.fromkeys([*specs, *folders.values()])), longest, decoder, where, dtype)
        timing.update({label: timing[spec] for label, spec in folders.items()})
        converted_folders = {label: label.partition(":")[2] for label in folders}
        whole = _model_speed(model, tokenizer, texts, specs, longest, calib, batch, seed, converted=converted_folders)
        for r in rows:
            r.update(timing.get(r["spec"], {}), **whole.get(r["spec"], {}), context=longest)
    _write(saved, settings, rows)
    _plot(rows, out / "approx.png", decoder)
    return rows


_RESULTS_FIX = "remove it (or pass another --out) to measure every mechanism again"


def converted_spec(folder: str | Path) -> str:
    """The mechanism spec (``NAME:option=value,...``) of a converted model folder's first layer."""
    from subquad.hf import saved_layers

    layers = saved_layers(folder)
    mechanism, options = layers[min(layers)]
    text = ",".join(f"{k}={'|'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in options.items())
    return f"{mechanism}:{text}" if text else mechanism


def _write(path: Path, settings: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    tmp.replace(path)


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


def _plot(rows: list[dict[str, Any]], path: Path, decoder: bool) -> None:
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

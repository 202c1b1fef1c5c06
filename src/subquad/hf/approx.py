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
  original's (``subquad bench``'s measurement, on the original's own queries, keys and values of
  ``speed_layers`` layers of one window, ``hf.record``; 0: on drawn ones at the model's heads and
  head size), and the whole model's forward time on that window (batch 1), against the original
  model's.

Converted models (folders ``subquad distill`` or ``subquad.hf.save`` wrote, from the same original
model) are measured the same way, each under the row ``converted:FOLDER``; their attention speed is
that of their mechanism and options.

``approx.json`` is rewritten after each mechanism (a rerun skips those done and keeps the rows of
specs it is not given; one with other settings is refused), the table printed, and ``approx.png``
plots quality against speed.

Data: a ``.jsonl`` file of ``{"text": ..., "label": ...}`` lines (label optional), a text file of
passages separated by blank lines, or a folder of ``.txt`` files (labelled by their subfolder).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from subquad.files import out_folder
from subquad.flags import DTYPES, check_choices, setting
from subquad.hf.data import Windows, check_window, load_model, read_passages, token_windows
from subquad.hf.measures import probe_accuracy, spearman
from subquad.hf.plans import LayerPlan, expand_plans, plan_cell, saved_plan
from subquad.hf.recall import passkey
from subquad.hf.report import format_decode_table, format_recall_table, format_table, plot
from subquad.hf.rows import kept_rows, previous_results, settings_path, write_rows
from subquad.hf.speed import attention_speed, decode_speed, decode_windows, each, model_speed, own_inputs

__all__ = ["ApproxConfig", "approx", "format_table", "parse_spec", "run_approx"]


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """A spec (``subquad.config.parse_spec``) as the one mechanism and options each layer runs."""
    from subquad.hf.interface import layer_spec

    return layer_spec(spec)


@torch.no_grad()
def _outputs(model: nn.Module, windows: Windows, batch: int, decoder: bool, show: Any) -> dict[str, Tensor]:
    """Encoders: unit mean-pooled embeddings ``(n, E)``. Decoders: next-token log-losses ``(n, T-1)``
    and predictions ``(n, T-1)``. ``show(done, total)``: the windows' progress."""
    parts: dict[str, list[Tensor]] = {}
    for start in range(0, len(windows.ids), batch):
        show(start, len(windows.ids))
        ids = windows.ids[start : start + batch]
        if decoder:
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()  # scoring: no cache
            loss = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            parts.setdefault("loss", []).append(loss)
            parts.setdefault("top1", []).append(logits.argmax(-1))
        else:
            hidden = model(input_ids=ids).last_hidden_state.float().mean(1)
            parts.setdefault("embedding", []).append(nn.functional.normalize(hidden, dim=-1))
    show(len(windows.ids), len(windows.ids))
    return {k: torch.cat(v).cpu() for k, v in parts.items()}


def _dtype(name: str) -> torch.dtype:
    """``--dtype``'s name as a torch dtype; a ValueError names the choices."""
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in choices:
        raise ValueError(f"--dtype must be one of {', '.join(choices)}, got {name!r}")
    return choices[name]


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


@dataclass(frozen=True)
class ApproxConfig:
    """One ``subquad approx`` run; the command's flags come from here (``subquad approx --help``)."""

    model: str = setting(help="a local Hugging Face model folder or .gguf file")
    data: str = setting(help="a .jsonl file (text, label), a text file or a folder of .txt")
    out: str = setting(help="folder for approx.json and approx.png")
    mechanisms: tuple[str, ...] = setting(
        (),
        "NAME or NAME:option=value,... (tuple values as a|b), or a .toml layer plan (subquad.hf.plans)",
        metavar="SPEC",
    )
    converted: tuple[str, ...] = setting(
        (), "model folders subquad distill wrote (OUT/model) from the same model", metavar="FOLDER"
    )
    tokens: int = setting(256, "tokens per window", flag="--window-tokens", old="--tokens")
    samples: int = setting(300, "windows measured", flag="--windows", old="--samples")
    batch: int = setting(8, "windows per forward", flag="--windows-per-forward", old="--batch")
    context: int | None = setting(None, "length of the speed measurement", shown_default="the model's longest context")
    calibration: int = setting(16, "windows routing's k-means reads (after the measured ones)")
    speed: bool = setting(True, "measure the attention's and the model's speed")
    speed_layers: int = setting(
        3, "layers (spread over the depth) whose own queries, keys and values time the attention, one after "
        "another; 0: the bench's drawn inputs",
    )  # fmt: skip
    decode: tuple[int, ...] = setting(
        (), "decoders: prompt lengths at which to measure generation (prefill s, ms per new token, cache MB, peak "
        "RSS)", metavar="N", flag="--decode-lengths",
    )  # fmt: skip
    new_tokens: int = setting(16, "new tokens generated at each --decode-lengths prompt")
    passkey: tuple[int, ...] = setting(
        (), "decoders: prompt lengths of the passkey probe (subquad.hf.recall)", metavar="N", flag="--passkey-lengths"
    )
    passkey_depths: tuple[float, ...] = setting(
        (0.1, 0.3, 0.5, 0.7, 0.9), "where the key sits in the filler (0-1)", metavar="D"
    )
    passkey_samples: int = setting(4, "passkey cases at each length and depth, each with its own seeded key")
    probe: str = setting("passkey", "passkey (a key in filler) or needle (a number told in the run's own text, "
                         "RULER's niah_single_2)", choices=("passkey", "needle"), flag="--recall-probe")  # fmt: skip
    seed: int = setting(0, "window order, probe split and passkey keys")
    device: str = setting("auto", "auto, cpu, cuda or cuda:N; auto: cuda where this torch sees one")
    dtype: str = setting("float32", "the model's dtype; quality is compared in float32", choices=DTYPES)

    def __post_init__(self) -> None:
        check_choices(self)
        flags = {"tokens": "--window-tokens", "samples": "--windows", "batch": "--windows-per-forward"}
        for name, flag in flags.items():
            if getattr(self, name) < 1:
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if self.samples < 2:  # before any model loads: the run needs two windows whatever the text
            raise ValueError(
                f"--windows must be >= 2 (an encoder's measures compare windows; every run takes two), "
                f"got {self.samples}"
            )
        if self.calibration < 0:
            raise ValueError(f"--calibration must be >= 0, got {self.calibration}")
        if self.speed_layers < 0:
            raise ValueError(f"--speed-layers must be >= 0, got {self.speed_layers}")
        if self.context is not None and self.context < 1:
            raise ValueError(f"--context must be >= 1, got {self.context}")
        if any(n < 1 for n in self.decode) or self.new_tokens < 1:
            raise ValueError(f"--decode-lengths and --new-tokens must be >= 1, got {self.decode} and {self.new_tokens}")
        if self.passkey_samples < 1 or not self.passkey_depths or not all(0 <= d <= 1 for d in self.passkey_depths):
            raise ValueError(
                f"--passkey-samples must be >= 1 and --passkey-depths fractions from 0 to 1, got "
                f"{self.passkey_samples} and {self.passkey_depths}"
            )


def approx(model_path: str | Path, data: str | Path, specs: list[str], out: str | Path, *, tokens: int = 256,
           samples: int = 300, batch: int = 8, context: int | None = None, calibration: int = 16,
           speed: bool = True, speed_layers: int = 3, seed: int = 0, converted: list[str | Path] = (),
           device: str = "auto", dtype: str = "float32", decode: tuple[int, ...] = (), new_tokens: int = 16,
           passkey: tuple[int, ...] = (), passkey_depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9),
           passkey_samples: int = 4, probe: str = "passkey") -> list[dict[str, Any]]:  # fmt: skip
    """Measure each mechanism spec, and each converted model folder, against the original model;
    returns (and writes) the rows. ``device``: auto, cpu, cuda or cuda:N; ``dtype``: the model's
    (float32, bfloat16, float16); quality is compared in float32 either way (`ApproxConfig`)."""
    config = ApproxConfig(str(model_path), str(data), str(out), tuple(map(os.fspath, specs)),
                          tuple(map(str, converted)), tokens, samples, batch, context, calibration, speed,
                          speed_layers, tuple(decode), new_tokens, tuple(passkey),
                          tuple(passkey_depths), passkey_samples, probe, seed, device, dtype)  # fmt: skip
    return run_approx(config)


def run_approx(config: ApproxConfig) -> list[dict[str, Any]]:
    """`approx` of one `ApproxConfig`."""
    from subquad import hf
    from subquad.train.loop import resolve_device

    for spec in config.mechanisms:
        hf.check_spec(spec)  # a bad spec fails before the model loads
    folders = {f"converted:{folder}": saved_plan(folder) for folder in config.converted}  # its saved layers
    out = out_folder(config.out)
    saved = out / "approx.json"
    previous = previous_results(saved)
    early = {"model": config.model, "data": config.data, "tokens": config.tokens, "seed": config.seed,
             "device": resolve_device(config.device).type, "dtype": config.dtype}  # fmt: skip
    kept_rows(saved, previous, early)  # other settings: refused before the model loads
    run = _Run.load(config)
    run.saved, run.kept = saved, kept_rows(saved, previous, run.settings)  # the rows of other specs stay in the file
    rows = run.quality({r["spec"]: r for r in run.kept}, folders)
    timed = ("time_ms", "model_ms")
    if config.speed and not all(set(timed) <= set(r) and r.get("speed_layers") == config.speed_layers for r in rows):
        _add_speed(run, rows, folders)
        run.write(rows)  # kept before the longer steps that follow
    lengths = [str(n) for n in config.decode] if run.decoder else []
    if lengths and not all(set(lengths) <= set(r.get("decode", {})) for r in rows):
        run.add_decoding(rows, folders)
        print(format_decode_table(rows), flush=True)
    if run.decoder and config.passkey:
        run.add_recall(rows, folders)
        print(format_recall_table(rows), flush=True)
    run.write(rows)
    plot(rows, out / "approx.png", run.decoder)
    return rows


class _Run:
    """The loaded model and windows of one approx run, and its measurements."""

    @classmethod
    def load(cls, config: ApproxConfig) -> _Run:
        from subquad.train.loop import resolve_device

        run = cls()
        run.config, run.where, run.kind = config, resolve_device(config.device), _dtype(config.dtype)
        model, run.tokenizer, run.decoder = load_model(config.model)
        run.model = model.to(run.where, run.kind)
        run.texts, labels = read_passages(config.data)
        check_window(model, config.tokens)
        n = config.samples
        windows = token_windows(run.tokenizer, run.texts, labels, config.tokens, n + config.calibration, config.seed)
        run.calib = Windows(windows.ids[n:].to(run.where), None)
        run.windows = Windows(windows.ids[:n].to(run.where), windows.labels[:n] if windows.labels else None)
        if len(run.windows.ids) < 2:
            raise ValueError(
                f"the text gives {len(run.windows.ids)} window(s) of {config.tokens} tokens; pass more text"
            )
        run.plans = expand_plans(config.mechanisms)[1]  # each plan file read once: what is measured is recorded
        run.settings = {"model": settings_path(config.model), "data": settings_path(config.data),
                        "tokens": config.tokens, "samples": len(run.windows.ids), "decoder": run.decoder,
                        "seed": config.seed, "device": run.where.type, "dtype": config.dtype}  # fmt: skip
        return run

    def write(self, rows: list[dict[str, Any]]) -> None:
        """``approx.json``: this run's rows so far, then every row an earlier run measured that they
        do not replace (other specs', and this run's not reached yet)."""
        write_rows(self.saved, self.settings, rows, self.kept)

    def calibrate(self, spec: str) -> None:
        """Calibrate the swapped-in ``spec`` on the calibration windows, where it has centroids."""
        from subquad import hf

        if hf.calibratable(self.plans.get(spec, spec)):  # routing's centroids, from the model's own queries and keys
            ids, batch = self.calib.ids, self.config.batch
            hf.calibrate(self.model, [{"input_ids": ids[i : i + batch]} for i in range(0, len(ids), batch)])

    def quality(self, done: dict[str, dict], folders: dict[str, LayerPlan]) -> list[dict[str, Any]]:
        """The original's row, then each spec's and each converted folder's: done ones as they were,
        the others measured, the file rewritten after each."""
        from subquad import hf

        windows, batch, decoder = self.windows, self.config.batch, self.decoder
        outputs = lambda model, label: _outputs(model, windows, batch, decoder, _progress("windows", {"spec": label}))  # noqa: E731
        original = outputs(self.model, "original")
        rows = [done.get("original") or {"spec": "original", **_quality(original, original, self.windows.labels)}]
        plans = {s: {"plan": p.record()} for s, p in self.plans.items()}  # kept in its row
        for label in [*self.config.mechanisms, *folders]:
            if label in done and done[label].get("plan") == plans.get(label, {}).get("plan"):  # an edited plan: again
                rows.append(done[label])
                continue
            swapped = self.converted(label.partition(":")[2]) if label in folders else _Swapped(self, label)()
            quality = _quality(original, outputs(swapped, label), self.windows.labels)
            rows.append({"spec": label, **plans.get(label, {}), **quality})
            if label not in folders:
                hf.restore(self.model)
            self.write(rows)
            print(format_table(rows[-1:], header=False), flush=True)
        return rows

    def setups(self, folders: dict[str, LayerPlan]) -> dict[str, Any]:
        """Each label's model: the original, each converted folder's, each spec swapped in (and
        restored after)."""
        setups: dict[str, Any] = {"original": lambda: self.model}
        for label in folders:
            setups[label] = functools.partial(self.converted, label.partition(":")[2])
        for spec in self.config.mechanisms:
            setups[spec] = _Swapped(self, spec)
        return setups

    def converted(self, folder: str) -> nn.Module:
        from subquad.hf.io import from_pretrained  # transformers: imported at the call

        model = from_pretrained(folder)  # measured against this model: converted from it
        if type(model) is not type(self.model):
            raise ValueError(f"--converted {folder} is a {type(model).__name__}, not this {type(self.model).__name__}")
        return model.to(self.where, self.kind)

    def add_decoding(self, rows: list[dict[str, Any]], folders: dict[str, LayerPlan]) -> None:
        """Each row's generation at each ``--decode-lengths`` prompt (``hf.speed.decode_speed``);
        the file is rewritten after each row."""
        config = self.config
        ids = decode_windows(self.tokenizer, self.texts, max(config.decode), config.seed).to(self.where)
        setups = self.setups(folders)
        for r in rows:
            measure = functools.partial(decode_speed, ids=ids, lengths=list(config.decode),
                                        new_tokens=config.new_tokens, progress=_progress("decoding", r))  # fmt: skip
            r["decode"] = each(setups[r["spec"]], measure)
            self.write(rows)

    def add_recall(self, rows: list[dict[str, Any]], folders: dict[str, LayerPlan]) -> None:
        """Each row's passkey probe (``hf.recall``) at each ``--passkey-lengths``, where it has not
        run with these depths, samples and seed; the file is rewritten after each row."""
        config = self.config
        depths, samples = list(config.passkey_depths), config.passkey_samples
        probe = {"depths": depths, "samples": samples, "seed": config.seed, "kind": config.probe}
        setups = self.setups(folders)
        for r in rows:
            done = {n: m for n, m in r.get("passkey", {}).items() if m.get("probe") == probe}
            todo = [n for n in config.passkey if str(n) not in done]
            if todo:
                measure = functools.partial(passkey, tokenizer=self.tokenizer, lengths=todo, depths=depths,
                                            samples=samples, seed=config.seed, progress=_progress(config.probe, r),
                                            haystack=self.texts if config.probe == "needle" else None)  # fmt: skip
                done.update({n: {**m, "probe": probe} for n, m in each(setups[r["spec"]], measure).items()})
            r["passkey"] = done
            self.write(rows)


def _add_speed(run: _Run, rows: list[dict[str, Any]], folders: dict[str, LayerPlan]) -> None:
    """Each row's attention time and memory (on the original's own queries, keys and values of
    ``--speed-layers`` layers, on the window the whole model is timed on), and the whole model's
    forward time, at the longest context."""
    config, plans = run.config, {**run.plans, **folders}  # a converted folder: its saved layers
    labels = [*config.mechanisms, *folders]
    specs = [s for label in labels for s in (plans[label].specs() if label in plans else [label])]
    longest = config.context or int(getattr(run.model.config, "max_position_embeddings", config.tokens))
    ids = decode_windows(run.tokenizer, run.texts, longest, config.seed).to(run.where)
    inputs = own_inputs(run.model, ids, config.speed_layers)
    layers = list(inputs.layers) if inputs else []
    on = f"the original's own q, k, v of layers {layers}" if layers else "drawn inputs"
    print(f"  speed at {longest} tokens, attention on {on}", flush=True)
    timing = attention_speed(run.model, list(dict.fromkeys(specs)), longest, run.decoder, run.where, config.dtype,
                             inputs, lambda label: print(f"  attention {label}", flush=True))  # fmt: skip
    del inputs
    timing.update({label: plan_cell(run.model, plan, timing) for label, plan in plans.items()})
    whole = model_speed(run.setups(folders), ids, progress=lambda label: print(f"  model {label}", flush=True))
    used = {"speed_layers": config.speed_layers, "attention_layers": layers}
    for r in rows:
        r.update(timing.get(r["spec"], {}), **whole.get(r["spec"], {}), **used, context=longest)


def _progress(probe: str, row: dict[str, Any]) -> Any:
    def show(done: int, total: int) -> None:
        print(f"\r  {probe} {row['spec']}: {done}/{total}", end="\n" if done == total else "", flush=True)

    return show


class _Swapped:
    """The run's model with ``spec`` swapped in (calibrated where it has centroids); ``done``
    restores it."""

    def __init__(self, run: _Run, spec: str) -> None:
        self.run, self.spec = run, spec

    def __call__(self) -> nn.Module:
        from subquad import hf

        hf.use(self.run.model, self.run.plans.get(self.spec, self.spec))
        self.run.calibrate(self.spec)
        return self.run.model

    def done(self) -> None:
        from subquad import hf

        hf.restore(self.run.model)

"""Which heads of a pretrained model fetch what it read long before, and a layer plan that gives
those heads a far reach and every other head a window.

A window with sinks keeps a decoder's perplexity within a few percent and loses every fact told
beyond it; far reach in every head costs most of what full attention costs. Only a few heads do
the fetching: Wu et al. (2024, "Retrieval Head Mechanistically Explains Long-Context Factuality")
find that under 5% of heads copy a needle into the answer, and DuoAttention (Xiao et al. 2024)
keeps full attention in such heads and a window with sinks in the rest. Here the far reach is
itself sub-quadratic (``retrieval``: the window, the sinks and each query's top far blocks), so
every layer stays sub-quadratic.

**The score** (``retrieval_scores``). Needle prompts made of the caller's text (``recall``'s needle
probe: whole passages, a sentence that gives a seven-digit number for a word at a seeded depth,
then the question asking for it), ``samples`` cases at each of ``depths``, each case seeded as the
probe seeds it. Each case is one pass of the model with exact attention (``recording.observe``);
a query head's score is the attention weight that the prompt's last position, where the model
answers, gives the needle sentence's tokens: the softmax over every key that position sees under
the model's own mask (no logit soft-capping), averaged over the cases. Calibrate on text apart
from the text the converted model is measured on.

**The plan** (``HeadScores.plan``). In each layer, the ``per_layer`` key/value heads whose query
heads' scores sum highest (the lower index first among equal sums), or the ``total`` such heads of
highest sums wherever they lie (DuoAttention's global choice: a layer may get none or all), take
``far`` on their query heads, and the other heads ``near``: a head mix (``mixes``), key/value heads never split. Layers
with the same mix share a table of the TOML layer plan (``plans``) that ``subquad.hf.use``,
``convert``, ``subquad approx --mechanisms`` and ``subquad distill --mechanism`` read.

**Far specs by depth.** ``far`` may be several specs: the layers are cut into as many bands of
consecutive layers (as equal as they divide), the first band, the earliest layers, taking the
first spec. Early layers spread the answer's attention over the whole context and late ones
narrow it to a few blocks (docs/performance.md), so far blocks taken from the late layers and
given to the early ones (``blocks=4`` / ``3`` / ``2`` by thirds against ``3`` everywhere, the same
far keys in all) find more passkeys at the same cost.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from subquad.config import one_mechanism
from subquad.files import FileError, check_fields, out_folder, read_json, write_atomic
from subquad.flags import setting
from subquad.hf.recall import seeded_needle
from subquad.hf.recording import observe
from subquad.hf.support import attention_modules, layer_index
from subquad.registry import make_config

__all__ = ["DEPTHS", "FAR", "NEAR", "HeadScores", "HeadsConfig", "format_scores", "retrieval_scores", "run_heads"]

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
FAR = "retrieval:window=256,sinks=4,blocks=4,block=128"  # the far reach of the heads that fetch
NEAR = "local:window=256,sinks=4"  # the others


@dataclass(frozen=True)
class HeadScores:
    """Each query head's score ``(layers, H)`` (``retrieval_scores``), the model's key/value heads,
    and the calibration: prompt length and cases."""

    layers: tuple[int, ...]
    scores: Tensor
    kv_heads: int
    length: int
    cases: int

    def groups(self) -> Tensor:
        """``(layers, kv_heads)``: the scores of each key/value head's query heads summed."""
        return self.scores.view(len(self.layers), self.kv_heads, -1).sum(-1)

    def chosen(self, per_layer: int | None = None, total: int | None = None) -> list[list[int]]:
        """Each layer's chosen key/value heads, in index order: its ``per_layer`` of highest summed
        score (default 1), or with ``total`` those among the ``total`` of highest summed score across
        all layers (equal sums: the earlier layer, then the lower index, first)."""
        groups = self.groups()
        if total is not None:
            if per_layer is not None:
                raise ValueError(f"per_layer={per_layer} and total={total}: give one (per layer, or across layers)")
            if not 0 <= total <= groups.numel():
                raise ValueError(
                    f"total={total}: give 0 to {groups.numel()} key/value heads in all (the model has "
                    f"{self.kv_heads} in each of {len(self.layers)} layers)"
                )
            picked: list[list[int]] = [[] for _ in self.layers]
            for flat in torch.argsort(-groups.flatten(), stable=True)[:total].tolist():
                picked[flat // self.kv_heads].append(flat % self.kv_heads)
            return [sorted(row) for row in picked]
        per_layer = 1 if per_layer is None else per_layer
        if not 0 <= per_layer <= self.kv_heads:
            raise ValueError(
                f"per_layer={per_layer}: give 0 to {self.kv_heads} key/value heads per layer (the model has "
                f"{self.kv_heads})"
            )
        order = torch.argsort(-groups, dim=1, stable=True)[:, :per_layer]
        return [sorted(row) for row in order.tolist()]

    def plan(
        self, far: str | Sequence[str] = FAR, near: str = NEAR, per_layer: int | None = None, total: int | None = None
    ) -> str:
        """The TOML layer plan (module docstring): ``far`` on the chosen key/value heads' query heads
        (``chosen``), ``near`` on the others; several ``far`` specs, one to each band of
        consecutive layers, the first to the earliest."""
        fars = (far,) if isinstance(far, str) else tuple(far)
        check_specs(fars, near)
        if len(fars) > len(self.layers):
            raise ValueError(
                f"{len(fars)} far specs for {len(self.layers)} layers: give at most one a layer (each takes a band "
                "of consecutive layers)"
            )
        per = self.scores.shape[1] // self.kv_heads
        tables: dict[str, list[int]] = {}
        for i, (layer, picked) in enumerate(zip(self.layers, self.chosen(per_layer, total))):
            runs: list[list[Any]] = []  # [spec, query heads] of consecutive key/value heads alike
            for head in range(self.kv_heads):
                spec = fars[i * len(fars) // len(self.layers)] if head in picked else near
                if runs and runs[-1][0] == spec:
                    runs[-1][1] += per
                else:
                    runs.append([spec, per])
            text = runs[0][0] if len(runs) == 1 else "+".join(f"{spec}*{count}" for spec, count in runs)
            tables.setdefault(text, []).append(layer)
        which = (f"the {total} key/value head(s) across all layers" if total is not None
                 else f"per layer, the {1 if per_layer is None else per_layer} key/value head(s)")  # fmt: skip
        bands = (
            "" if len(fars) == 1 else f" of their band ({len(fars)} bands of consecutive layers, the earliest first)"
        )
        lines = [f"# subquad heads: {which} that fetch most take the far spec{bands} "
                 f"({self.cases} needle cases of {self.length} tokens)"]  # fmt: skip
        for text, layers in tables.items():
            lines += ["", "[[layers]]", f"layers = {layers}", f"attention = {json.dumps(text)}"]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "scores": self.scores.tolist(), "kv_heads": self.kv_heads,
                "length": self.length, "cases": self.cases}  # fmt: skip

    def save(self, path: str | os.PathLike) -> None:
        write_atomic(path, json.dumps(self.to_dict(), indent=1))


def check_specs(far: str | Sequence[str], near: str) -> None:
    """Refuse a ``far`` (one spec or several) or ``near`` that is not one mechanism's spec with
    options it takes."""
    fars = (far,) if isinstance(far, str) else tuple(far)
    if not fars:
        raise ValueError("no far spec: give one, or one for each band of consecutive layers")
    for name, spec in [*(("far", f) for f in fars), ("near", near)]:
        mix = f" (the {name} spec); give one mechanism's spec: the plan mixes them"
        mechanism, options = one_mechanism(spec, {}, mix)
        make_config(mechanism, **options)


@torch.no_grad()
def retrieval_scores(
    model: nn.Module, tokenizer: Any, texts: list[str], length: int = 4096, depths: Sequence[float] = DEPTHS,
    samples: int = 1, seed: int = 0, progress: Callable[[int, int], None] | None = None,
) -> HeadScores:  # fmt: skip
    """Each query head's score on ``samples`` needle cases at each of ``depths`` made of ``texts``
    at ``length`` tokens (module docstring). ``progress(done, total)`` after each case."""
    if samples < 1 or not depths or not all(0 <= d <= 1 for d in depths):
        raise ValueError(f"give samples >= 1 and depths from 0 to 1; got {samples} and {tuple(depths)}")
    layers = sorted({layer_index(m) for m in attention_modules(model)})
    device, total, kv, done = next(model.parameters()).device, None, 0, 0
    for depth in depths:
        for sample in range(samples):
            case = seeded_needle(tokenizer, texts, seed, length, depth, sample)
            take = functools.partial(_answer_weight, start=case.needle_at, end=case.needle_at + case.needle_tokens)
            kept = observe(model, case.ids.to(device), layers, take)
            scores = torch.stack([kept[i][0] for i in layers])
            total, kv, done = scores if total is None else total + scores, kept[layers[0]][1], done + 1
            if progress is not None:
                progress(done, len(depths) * samples)
    return HeadScores(tuple(layers), total / done, kv, length, done)


def _answer_weight(
    query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, start: int, end: int
) -> list[Any]:  # fmt: skip
    """``observe``'s take: each query head's attention weight ``(H,)`` from the last query to the
    keys ``start … end − 1`` (batch row 0), and the key/value head count."""
    H, Hk, D = query.shape[1], key.shape[1], query.shape[-1]
    q = query[0, :, -1:].float()  # (H, 1, D), carrying the model's scale
    k = key[0].float().repeat_interleave(H // Hk, dim=0)
    scores = torch.matmul(q, k.transpose(-1, -2)) * D**-0.5  # (H, 1, S)
    if attention_mask is not None:  # sdpa's: boolean (True: seen) or additive, (B, 1 or H, L, S)
        row = attention_mask[0, :, -1:, -k.shape[1] :]
        scores = scores.masked_fill(~row, float("-inf")) if row.dtype == torch.bool else scores + row.float()
    weights = torch.softmax(scores, dim=-1)[:, 0]
    return [weights[:, start:end].sum(-1).cpu(), Hk]


@dataclass(frozen=True)
class HeadsConfig:
    """One ``subquad heads`` run; its flags come from here (``subquad heads --help``)."""

    model: str = setting(help="a local Hugging Face decoder folder or .gguf file")
    data: str = setting(help="text for the needle cases (.jsonl, a text file or a folder of .txt), apart from the "
                        "text the converted model is measured on")  # fmt: skip
    out: str = setting(help="folder for heads.json (the scores; a rerun of the same cases reads them) and plan.toml "
                       "(the layer plan)")  # fmt: skip
    length: int = setting(4096, "tokens per needle case")
    depths: tuple[float, ...] = setting(DEPTHS, "where the needle sits in the text (0-1)", metavar="D")
    samples: int = setting(1, "needle cases at each depth")
    seed: int = setting(0, "the cases' passage order, words and numbers")
    far: tuple[str, ...] = setting(
        (FAR,), "the spec of the heads that fetch; several: the layers cut into as many bands of consecutive layers, "
        "the first spec the earliest band's", metavar="SPEC",
    )  # fmt: skip
    near: str = setting(NEAR, "the spec of the other heads")
    per_layer: int | None = setting(
        None, "key/value heads per layer that take --far (not with --total)", shown_default="1, without --total"
    )
    total: int | None = setting(
        None, "key/value heads in all that take --far, those of highest score in any layer (DuoAttention's "
        "choice; a layer may get none or all), in place of --per-layer", shown_default="unset"
    )  # fmt: skip

    def __post_init__(self) -> None:
        if isinstance(self.far, str):  # one spec, as the Python API may give it
            object.__setattr__(self, "far", (self.far,))
        counts = [x for x in (self.per_layer, self.total) if x is not None]
        if self.length < 1 or self.samples < 1 or any(x < 0 for x in counts):
            raise ValueError(
                f"--length and --samples must be >= 1 and --per-layer and --total >= 0, got {self.length}, "
                f"{self.samples}, {self.per_layer} and {self.total}"
            )
        if len(counts) == 2:
            raise ValueError(f"--per-layer {self.per_layer} and --total {self.total}: give one of them")
        if not self.depths or not all(0 <= d <= 1 for d in self.depths):
            raise ValueError(f"--depths are fractions from 0 to 1, got {self.depths}")
        check_specs(self.far, self.near)


def run_heads(config: HeadsConfig) -> tuple[HeadScores, str]:
    """Score the model's heads on ``config.data``, write ``heads.json`` and ``plan.toml`` in
    ``config.out``; return the scores and the plan. Where ``heads.json`` holds scores of the same
    cases (model, data, length, depths, samples, seed), they are read instead of measured again:
    another ``--far``, ``--near``, ``--per-layer`` or ``--total`` only writes a new plan."""
    from subquad.hf.data import check_window, load_model, read_passages

    out = out_folder(config.out)  # the specs were checked with the settings (HeadsConfig)
    settings = {"model": os.path.abspath(config.model), "data": os.path.abspath(config.data), "length": config.length,
                "depths": list(config.depths), "samples": config.samples, "seed": config.seed}  # fmt: skip
    scores = _saved(out / "heads.json", settings)
    if scores is None:
        texts, _ = read_passages(config.data)
        model, tokenizer, decoder = load_model(config.model)
        if not decoder:
            raise ValueError(f"{config.model} is an encoder: the needle cases ask a decoder to answer; give a decoder")
        check_window(model, config.length, "--length")
        show = lambda done, total: print(f"\r  needle cases: {done}/{total}", end="\n" if done == total else "",  # noqa: E731
                                         flush=True)  # fmt: skip
        scores = retrieval_scores(model, tokenizer, texts, config.length, config.depths, config.samples, config.seed,
                                  show)  # fmt: skip
        write_atomic(out / "heads.json", json.dumps({"settings": settings, **scores.to_dict()}, indent=1))
    else:
        print(f"  scores of the same cases from {out / 'heads.json'}")
    plan = scores.plan(config.far, config.near, config.per_layer, config.total)
    write_atomic(out / "plan.toml", plan)
    return scores, plan


_SAVED_FIX = "remove it (or pass another --out) to score the heads again"


def _saved(path: Path, settings: dict[str, Any]) -> HeadScores | None:
    """The scores ``path`` holds for these ``settings`` (None: no file, or other settings), each
    field checked: the file is data from wherever the folder came from."""
    if not path.exists():
        return None
    data = read_json(path, "head scores", _SAVED_FIX)
    check_fields(data, path, {"settings": dict, "layers": list, "scores": list, "kv_heads": int, "length": int,
                              "cases": int}, required=("settings", "layers", "scores", "kv_heads", "length", "cases"),
                 fix=_SAVED_FIX)  # fmt: skip
    if data["settings"] != settings:
        return None
    layers, rows, kv = data["layers"], data["scores"], data["kv_heads"]
    width = len(rows[0]) if rows and isinstance(rows[0], list) else 0
    numbers = all(isinstance(r, list) and len(r) == width and all(type(x) in (int, float) for x in r) for r in rows)
    if not (numbers and all(type(i) is int for i in layers) and len(rows) == len(layers) and kv > 0
            and width and width % kv == 0):  # fmt: skip
        raise FileError(path, "does not hold one row of numbers per layer, as many per row, a multiple of "
                        "kv_heads", _SAVED_FIX)  # fmt: skip
    return HeadScores(tuple(layers), torch.tensor(rows, dtype=torch.float32), kv, data["length"], data["cases"])


def format_scores(scores: HeadScores, per_layer: int | None = None, total: int | None = None) -> str:
    """A table of each layer's key/value heads' summed scores, the chosen (``HeadScores.chosen``)
    marked ``*``."""
    picked = scores.chosen(per_layer, total)
    head = "layer  " + "  ".join(f"{f'kv{h}':>6} " for h in range(scores.kv_heads))
    rows = [head, "-" * len(head)]
    for layer, sums, chosen in zip(scores.layers, scores.groups().tolist(), picked):
        cells = "  ".join(f"{s:6.3f}{'*' if h in chosen else ' '}" for h, s in enumerate(sums))
        rows.append(f"{layer:5d}  {cells}")
    return "\n".join(rows)

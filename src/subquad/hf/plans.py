"""Layer plans: one attention spec per layer of a pretrained model, from a TOML file.

Where a spec string names one attention for every chosen layer, a plan names one per layer, for
``subquad.hf.use``, ``convert``, ``subquad approx --mechanisms`` and ``subquad distill --mechanism``
(a path ending in ``.toml`` in place of a spec)::

    # hybrid.toml: a window with sinks in every layer, three layers left as the model has them
    [[layers]]
    attention = "local:window=256,sinks=4"
    [[layers]]
    layers = [9, 19, 29]
    attention = "original"

Each ``[[layers]]`` table has an ``attention``: a spec (``subquad.config.parse_spec``: options,
head mixes) or ``"original"`` (exact attention: the model's own, run by subquad once another layer
is swapped), and ``layers``: the ``layer_idx`` of its layers. At most one table leaves ``layers``
out: it takes every layer the others do not name. A layer no table takes is ``original`` too; no
layer may be named twice. Every table is built and checked against the model before any layer
changes, so a refused plan leaves the model as it was.

A plan is data: read as TOML, every field and spec checked before a model is touched.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from subquad.files import FileError, check_fields, read_toml
from subquad.hf.support import attention_modules, layer_index

__all__ = [
    "ORIGINAL",
    "LayerPlan",
    "clear_layers",
    "expand_plans",
    "is_plan",
    "plan_cell",
    "plan_layers",
    "read_plan",
    "resolved",
    "saved_plan",
    "use_plan",
]

ORIGINAL = "original"  # a plan's name for the model's own attention
_FIX = 'each [[layers]] table holds attention = SPEC (or "original") and layers = [i, ...] (one table may omit it)'


@dataclass(frozen=True)
class LayerPlan:
    """A read plan: ``groups`` of (spec, layers), ``layers`` None for the table that takes the rest."""

    path: str
    groups: tuple[tuple[str, tuple[int, ...] | None], ...]

    def specs(self) -> list[str]:
        """Its specs, once each, without ``original``."""
        return list(dict.fromkeys(spec for spec, _ in self.groups if spec != ORIGINAL))

    def record(self) -> list[dict[str, Any]]:
        """The plan as data (what a result file keeps, to tell an edited plan from the one measured)."""
        return [{"attention": spec, "layers": None if layers is None else list(layers)} for spec, layers in self.groups]


def is_plan(spec: object) -> bool:
    """Whether ``spec`` names a plan file (a path ending in ``.toml``) rather than a spec string."""
    return isinstance(spec, (str, os.PathLike)) and os.fspath(spec).endswith(".toml")


def read_plan(path: str | os.PathLike, *, converted: bool = False) -> LayerPlan:
    """The plan in ``path``, each table and spec checked (``hf.check_spec``)."""
    from subquad.hf.interface import check_spec

    data = read_toml(path, "layer plan", _FIX)
    check_fields(data, path, {"layers": list}, required=("layers",), fix=_FIX)
    if not data["layers"]:
        raise FileError(path, "has no [[layers]] table", _FIX)
    groups, named, rest = [], set(), 0
    for i, table in enumerate(data["layers"]):
        where = f"[[layers]] table {i + 1}"
        if not isinstance(table, dict):
            raise FileError(path, f"{where} is not a table", _FIX)
        check_fields(table, path, {"attention": str, "layers": list}, required=("attention",), where=where, fix=_FIX)
        layers = table.get("layers")
        if layers is None:
            rest += 1
        elif not layers or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in layers):
            raise FileError(path, f"{where} has layers {layers!r}: give layer indices >= 0, or leave it out", _FIX)
        twice = sorted(named & set(layers or ()) | {n for n, count in Counter(layers or ()).items() if count > 1})
        if twice:
            raise FileError(path, f"{where} names layer(s) {twice} that another table (or it) names already", _FIX)
        named |= set(layers or ())
        if is_plan(table["attention"]):
            raise FileError(path, f"{where} names the plan {table['attention']!r}: a table's attention is a spec", _FIX)
        if table["attention"] != ORIGINAL:
            try:
                check_spec(table["attention"], converted=converted)
            except ValueError as error:
                raise FileError(path, f"{where}: {error}", _FIX) from error
        groups.append((table["attention"], None if layers is None else tuple(layers)))
    if rest > 1:
        raise FileError(path, f"has {rest} tables without layers; at most one takes the layers the others leave", _FIX)
    return LayerPlan(os.fspath(path), tuple(groups))


def plan_layers(model: nn.Module, plan: LayerPlan) -> list[tuple[str, list[int]]]:
    """Each group's spec and the model's layers it takes (the table without ``layers``: the rest;
    then ``original`` for the layers no table takes)."""
    indices = sorted({layer_index(m) for m in attention_modules(model)})
    named = {n for _, layers in plan.groups if layers is not None for n in layers}
    unknown = sorted(named - set(indices))
    if unknown:
        raise ValueError(
            f"{plan.path}: {type(model).__name__} has no layer {unknown}; its layers are {indices[0]}..{indices[-1]}"
        )
    out = [
        (spec, [n for n in indices if n not in named] if layers is None else list(layers))
        for spec, layers in plan.groups
    ]
    taken = {n for _, layers in out for n in layers}
    rest = [n for n in indices if n not in taken]
    return [(spec, layers) for spec, layers in out if layers] + ([(ORIGINAL, rest)] if rest else [])


def resolved(model: nn.Module, plan: LayerPlan, build: Callable[[str], Any]) -> list[tuple[Any, list[int]]]:
    """Each group's attention as ``build(spec)`` makes it (None for ``original``) and its layers,
    every one built and its head mix checked against the model's heads before anything is applied:
    a refusal leaves the model as it was, and names the file and the table."""
    from subquad.hf.mixes import LayerMix, check_heads

    out, modules = [], attention_modules(model)
    for spec, chosen in plan_layers(model, plan):
        made = None
        if spec != ORIGINAL:
            try:
                made = build(spec)
                for module in modules if isinstance(made, LayerMix) else ():
                    if layer_index(module) in chosen:
                        check_heads(model, module, made)
            except ValueError as error:
                raise ValueError(f"{plan.path}, the table of {spec!r} (layers {chosen}): {error}") from error
        out.append((made, chosen))
    return out


def clear_layers(model: nn.Module, layers: list[int]) -> None:
    """What ``use`` or ``convert`` set on ``layers`` goes: they run exact attention again."""
    from subquad.hf.interface import _clear

    for module in attention_modules(model):
        if layer_index(module) in layers:
            _clear(module, "subquad_attention", "subquad_state", "subquad_inputs", "subquad_shares")


def use_plan(model: nn.Module, plan: LayerPlan, layers: Iterable[int] | None = None, **options: Any) -> nn.Module:
    """``hf.use`` of each group of ``plan`` on its layers; ``original`` layers (named so, or taken by
    no table) get back what ``use`` had not set: exact attention."""
    from subquad.hf.interface import _apply, model_attention

    if layers is not None or options:
        raise ValueError(f"{plan.path} names each layer's attention and options; pass no layers= or options with it")
    for made, chosen in resolved(model, plan, lambda spec: model_attention(model, spec)):
        if made is None:
            clear_layers(model, chosen)
        else:
            _apply(model, made, chosen)
    return model


def plan_cell(model: nn.Module, plan: LayerPlan, cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A plan's attention time as ``hf.speed.attention_speed`` gives a spec's: the mean over the
    plan's layers of their specs' cells (each layer its group's spec, ``original`` the exact
    attention's cell; a cell is one call over the recorded layers, or over drawn inputs), the ratio
    to exact attention likewise, and the largest peak."""
    per_layer = [cells[spec] for spec, layers in plan_layers(model, plan) for _ in layers]
    mean = lambda key: sum(c.get(key, float("nan")) for c in per_layer) / len(per_layer)  # noqa: E731
    peaks = [c.get("peak_mb") for c in per_layer]
    return {"time_ms": mean("time_ms"), "ratio": mean("ratio"), "peak_mb": None if None in peaks else max(peaks)}


def expand_plans(specs: Iterable[str]) -> tuple[list[str], dict[str, LayerPlan]]:
    """``specs`` with each plan file replaced by its own specs, and the plans read, by path."""
    specs = list(specs)
    plans = {spec: read_plan(spec) for spec in specs if is_plan(spec)}
    return [x for spec in specs for x in (plans[spec].specs() if spec in plans else [spec])], plans


def saved_plan(folder: str | os.PathLike) -> LayerPlan:
    """A converted model folder's layers (``hf.save``) as a plan: each saved spec on its layers (the
    rest ``original``), so that ``approx`` times a folder as the layers it holds."""
    from subquad.hf.io import saved_layers, spec_text  # transformers: imported at the call

    groups: dict[str, list[int]] = {}
    for index, (mechanism, options) in sorted(saved_layers(folder).items()):
        groups.setdefault(spec_text(mechanism, options), []).append(index)
    return LayerPlan(os.fspath(folder), tuple((spec, tuple(layers)) for spec, layers in groups.items()))

"""A training run's settings (`TrainConfig`, ``subquad train``'s flags and config files) and the
checks that a run folder, a config file and a checkpoint belong together."""

from __future__ import annotations

import json
import math
import typing
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from subquad.files import FileError, check_fields, out_folder, read_json, read_toml, write_atomic
from subquad.flags import check_choices, flag_name, named, setting
from subquad.nn import HeadGroup
from subquad.nn.attention import resolve_head_groups, spec_head_groups
from subquad.registry import no_causal_form, parse_value
from subquad.version import __version__

__all__ = ["TrainConfig", "check_run", "check_trained_with", "jsonable", "load_config_file", "train_config",
           "write_config"]  # fmt: skip


@dataclass(frozen=True)
class TrainConfig:
    """One training run; ``subquad train``'s flags and defaults come from here."""

    task: str = setting(
        "text",
        "text: byte-level LM; listops: LRA ListOps; pixels: images as pixel sequences",
        choices=("text", "listops", "pixels"),
    )
    data: str = setting("", "text: the file to train on (plain, .gz, .dz); pixels: the IDX folder", metavar="PATH")
    listops_preset: str = setting(
        "small", "listops sizes: small (2k/200/200) or lra (96k/2k/2k)", choices=("small", "lra")
    )
    out: str = setting("subquad-run", "the run folder: config, metrics, checkpoints, summary", metavar="DIR")
    attention: str = setting(
        "full", "every layer's attention: NAME, NAME:option=value,... or a head mix such as "
        "local:window=64*2+routing*2 (subquad list)", metavar="SPEC",
    )  # fmt: skip
    options: tuple[str, ...] = setting(
        (), "deprecated: the options go in --attention (local:window=64)", metavar="NAME=VALUE"
    )
    layers: tuple = setting(
        (), "config files only: [[layers]] tables of head groups, one for every layer or one per layer"
    )
    seq_len: int = setting(256, "bytes per training window")
    dim: int = setting(128, "model width")
    depth: int = setting(4, "layers")
    heads: int = setting(4, "attention heads per layer")
    dropout: float = setting(0.0, "dropout in the blocks")
    steps: int = setting(1000, "optimizer steps")
    batch: int = setting(
        16, "examples per step, the global batch (text: windows)", flag="--examples-per-step", old="--batch"
    )
    accumulate: int = setting(1, "micro-batches per step (the batch is split between them)")
    lr: float = setting(3e-4, "peak learning rate")
    warmup: int = setting(100, "linear warm-up steps, then cosine decay to min_lr")
    min_lr: float = setting(3e-5, "learning rate at the end of the cosine")
    weight_decay: float = setting(0.01, "AdamW weight decay")
    clip: float = setting(1.0, "gradient norm clipping (0: none)")
    eval_every: int = setting(100, "steps between evaluations")
    eval_windows: int = setting(64, "validation windows (classification: batches) per evaluation")
    checkpoint_every: int = setting(100, "steps between checkpoints")
    keep: int = setting(3, "checkpoints kept")
    seed: int = setting(0, "seeds the split, the batches, the weights and dropout")
    position: str = setting(
        "auto",
        "how order enters: learned positions, a causal convolution (Spellings 2019) or both; "
        "auto: the convolution where a layer is agglomerative, else learned",
        choices=("auto", "learned", "conv", "both"),
    )
    device: str = setting("auto", "cpu, cuda or cuda:N; auto: cuda where available (torchrun: cuda:LOCAL_RANK)")
    bf16: bool = setting(False, "bf16 autocast")
    grad_checkpoint: bool = setting(False, "recompute block activations in the backward pass")

    def __post_init__(self) -> None:
        check_choices(self)
        positive = ("seq_len", "dim", "depth", "heads", "steps", "batch", "accumulate", "eval_every",
                    "eval_windows", "checkpoint_every", "keep")  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{named(self, name)} must be >= 1, got {getattr(self, name)}")
        if self.batch % self.accumulate:
            raise ValueError(
                f"{named(self, 'batch')} {self.batch} must split into accumulate={self.accumulate} equal micro-batches"
            )
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} must divide between heads={self.heads}")
        if not self.data and self.task != "listops":
            raise ValueError(
                f"pass --data PATH: the {'text file' if self.task == 'text' else 'IDX folder'} to train on"
            )
        for name in ("dropout", "lr", "min_lr", "weight_decay", "clip"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{named(self, name)} must be a finite number, got {getattr(self, name)}")
        if not 0 <= self.dropout < 1 or self.lr <= 0 or self.min_lr < 0 or self.warmup < 0 or self.clip < 0:
            raise ValueError("need 0 <= dropout < 1, lr > 0, min_lr >= 0, warmup >= 0 and clip >= 0")
        if self.min_lr > self.lr:  # the cosine would climb from lr to min_lr
            raise ValueError(
                f"{named(self, 'min_lr')} = {self.min_lr} is above {named(self, 'lr')} = {self.lr}: the learning rate "
                f"decays from lr to min_lr; give {named(self, 'min_lr')} {self.lr} or less"
            )
        object.__setattr__(self, "layers", _frozen(self.layers))
        if self.layers and len(self.layers) not in (1, self.depth):
            raise ValueError(
                f"give one [[layers]] table for every layer or one per layer ({self.depth}), got {len(self.layers)}"
            )
        for spec in self.attention_specs():  # an unknown mechanism, option or head split raises now
            for group in resolve_head_groups(spec, self.heads, {}):
                if self.task == "text" and not group.mechanism.causal:  # a causal language model
                    raise ValueError(no_causal_form(group.mechanism.name))

    def input_position(self) -> str:
        """``position`` with ``auto`` resolved: the convolution input where any layer is agglomerative."""
        if self.position != "auto":
            return self.position
        groups = [g for spec in self.attention_specs() for g in spec]
        return "conv" if any(g.mechanism.conv_input for g in groups) else "learned"

    def attention_specs(self) -> list:
        """The attention spec of each layer: ``layers``' head groups, else ``attention`` with its options."""
        if not self.layers:
            return [tuple(spec_head_groups(self.attention, **self.attention_options()))] * self.depth
        specs = [tuple(HeadGroup(**dict(group)) for group in layer) for layer in self.layers]
        return specs * self.depth if len(specs) == 1 else specs

    def attention_options(self) -> dict[str, Any]:
        """``options`` (deprecated) parsed: numbers and true/false as such, the rest as strings."""
        if self.options:
            warnings.warn(
                f"--options is deprecated (until the next release): write the options into --attention, e.g. "
                f"--attention {self.attention}:{','.join(self.options)}",
                DeprecationWarning,
                stacklevel=2,
            )
        parsed = {}
        for item in self.options:
            name, sep, text = item.partition("=")
            if not sep or not name:
                raise ValueError(f"an attention option is name=value, got {item!r}")
            parsed[name] = parse_value(text)
        return parsed


def _frozen(layers: Any) -> tuple:
    """``[[layers]]`` from a config file (lists of tables with a ``groups`` list) as nested tuples."""
    if layers in ((), [], None):
        return ()
    out = []
    for layer in layers:
        groups = layer.get("groups") if isinstance(layer, dict) else layer
        if not isinstance(groups, (list, tuple)) or not groups:
            raise ValueError(
                f"each [[layers]] table needs groups = [{{mechanism = ..., heads = ...}}, ...], got {layer!r}"
            )
        frozen = []
        for group in groups:
            group = dict(group)
            if "mechanism" not in group:
                raise ValueError(f"a head group needs a mechanism, got {group!r}")
            frozen.append(tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in group.items())))
        out.append(tuple(frozen))
    return tuple(out)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """A run's settings from a TOML file, or the ``config.json`` a run wrote (to reproduce it);
    FileError, naming the file, for one that does not parse, has unknown settings or values of
    the wrong type."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no config file at {path}")
    fix = "subquad train --help lists the settings and what each takes"
    if path.suffix == ".json":
        values = read_json(path, "run config", fix)
        written = values.pop("subquad", None)  # the version that wrote a run's config.json
    else:
        values, written = read_toml(path, "run config", fix), None
    values = {k.replace("-", "_"): v for k, v in values.items()}
    flags = {flag_name(f)[2:].replace("-", "_"): f.name for f in fields(TrainConfig) if f.metadata.get("flag")}
    values = {flags.get(k, k): v for k, v in values.items()}  # a key may be the flag's name: examples_per_step
    if written is not None and written != __version__:
        fix = f"it was written by subquad {written} (this is {__version__}); {fix}"
    hints = typing.get_type_hints(TrainConfig)
    types = {f.name: list if typing.get_origin(hints[f.name]) is tuple or hints[f.name] is tuple else hints[f.name]
             for f in fields(TrainConfig)}  # fmt: skip
    check_fields(values, path, types, noun="setting", fix=fix)
    if not all(isinstance(item, str) for item in values.get("options", [])):
        raise FileError(path, f"options must be strings name=value, got {values['options']!r}", fix)
    return values


def train_config(values: dict[str, Any], source: str | Path | None = None) -> TrainConfig:
    """``TrainConfig(**values)``; where the values came from a file (``source``), an invalid one is a
    FileError naming it."""
    try:
        return TrainConfig(**values)
    except FileError:
        raise
    except (ValueError, TypeError) as error:
        if source is None:
            raise
        raise FileError(source, f"does not make a valid run config with the flags given ({error})",
                        "subquad train --help lists the settings and what each takes") from error  # fmt: skip


def check_run(config: TrainConfig, resume: bool) -> None:
    """Check the run folder against ``config`` (rank 0): a run there is resumed only when asked,
    and with its own config."""
    saved = Path(config.out) / "config.json"
    if resume and not saved.exists() and not Path(config.out).is_file():
        raise ValueError(
            f"--resume: {config.out} holds no run to continue (no config.json there); a run moved elsewhere is "
            "continued with --out set to its folder; a new run starts without --resume"
        )
    out_folder(config.out)
    if saved.exists():
        if not resume:
            raise ValueError(f"{config.out} already holds a run; pass --resume to continue it, or choose another --out")
        changed = _changed(load_config_file(saved), config, _FREE)
        if changed:
            raise FileError(saved, f"--resume needs the run's config; these differ (run, now): {changed}",
                            f"pass the run's settings, or resume with --config {saved} --resume")  # fmt: skip


def check_trained_with(config: TrainConfig, meta: dict[str, Any], where: Path, resume: bool = False) -> None:
    """Refuse a checkpoint trained with another config than ``config`` (a run folder of mixed
    origins, or an edited config.json), naming ``where``. Free to differ: the steps, the folder and
    the device, and, for evaluating, the data file's path. Checkpoints written before the config
    was recorded (or by an upgrade) are not checked."""
    trained = meta.get("config")
    if not isinstance(trained, dict):
        return
    changed = _changed(trained, config, _FREE if resume else {*_FREE, "data"})
    if changed:
        raise FileError(
            where, f"the checkpoint was trained with another config; these differ (trained, now): {changed}",
            "a run's config.json and its checkpoints must come from one run: restore config.json, or pass the run "
            "folder the checkpoint came from",
        )  # fmt: skip


_FREE = {"steps", "out", "device"}  # a run may be extended, moved, or resumed on another device


def _changed(before: dict[str, Any], config: TrainConfig, free: set[str]) -> dict[str, tuple[Any, Any]]:
    """The settings of ``config`` that differ from ``before`` (a run's recorded config), but ``free``."""
    now = jsonable(config)
    return {k: (before.get(k), v) for k, v in now.items() if k not in free and before.get(k) != v}


def write_config(config: TrainConfig) -> None:
    """``config.json``, written once the run starts or its checkpoint has loaded (rank 0)."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "config.json", json.dumps({"subquad": __version__, **jsonable(config)}, indent=2))


def jsonable(config: TrainConfig) -> dict[str, Any]:
    values = asdict(config)
    values["layers"] = [{"groups": [dict(group) for group in layer]} for layer in config.layers]
    return json.loads(json.dumps(values))  # tuples as lists, as the file holds them

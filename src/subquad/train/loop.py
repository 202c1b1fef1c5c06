"""``subquad train``: the papers' models trained on a task (``train.tasks``), with checkpoints and exact resume.

AdamW with linear warm-up and cosine decay, gradient clipping and accumulation; auxiliary losses
(routing's commitment) collected through ``subquad.hooks`` and added; bf16 autocast as an option;
evaluation in bits per byte every ``eval_every`` steps. The run folder holds ``config.json``,
``metrics.jsonl`` (a line per step and per evaluation, flushed as written), ``checkpoints/`` and, at
the end, ``summary.json`` and ``curve.png``. Batches are a function of (seed, step), and a checkpoint holds every
RNG, so ``resume=True`` after a kill at any moment ends with the weights of the run that was
never killed, bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
import typing
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from subquad import hooks
from subquad.bench.runner import setting
from subquad.files import FileError, check_fields, read_json, read_jsonl, read_toml, write_atomic
from subquad.nn import HeadGroup
from subquad.nn.attention import resolve_head_groups, spec_head_groups
from subquad.registry import parse_value
from subquad.train import checkpoint
from subquad.train.tasks import make_task
from subquad.version import __version__

__all__ = [
    "TrainConfig", "check_trained_with", "load_config_file", "plot_curve", "read_metrics", "resolve_device", "train",
    "train_config", "trimmed_log",
]  # fmt: skip

_YES_NO = {"yes": True, "no": False}


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
    batch: int = setting(16, "windows per step (the global batch)")
    accumulate: int = setting(1, "micro-batches per step (the batch is split between them)")
    lr: float = setting(3e-4, "peak learning rate")
    warmup: int = setting(100, "linear warm-up steps, then cosine decay to min_lr")
    min_lr: float = setting(3e-5, "learning rate at the end of the cosine")
    weight_decay: float = setting(0.01, "AdamW weight decay")
    clip: float = setting(1.0, "gradient norm clipping (0: none)")
    eval_every: int = setting(100, "steps between evaluations")
    eval_windows: int = setting(64, "validation windows per evaluation")
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
    bf16: bool = setting(False, "bf16 autocast", choices=_YES_NO)
    grad_checkpoint: bool = setting(False, "recompute block activations in the backward pass", choices=_YES_NO)

    def __post_init__(self) -> None:
        positive = ("seq_len", "dim", "depth", "heads", "steps", "batch", "accumulate", "eval_every",
                    "eval_windows", "checkpoint_every", "keep")  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch % self.accumulate:
            raise ValueError(f"batch {self.batch} must split into accumulate={self.accumulate} equal micro-batches")
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} must divide between heads={self.heads}")
        if not self.data and self.task != "listops":
            raise ValueError(
                f"pass --data PATH: the {'text file' if self.task == 'text' else 'IDX folder'} to train on"
            )
        if not 0 <= self.dropout < 1 or self.lr <= 0 or self.min_lr < 0 or self.warmup < 0 or self.clip < 0:
            raise ValueError("need 0 <= dropout < 1, lr > 0, min_lr >= 0, warmup >= 0 and clip >= 0")
        object.__setattr__(self, "layers", _frozen(self.layers))
        if self.layers and len(self.layers) not in (1, self.depth):
            raise ValueError(
                f"give one [[layers]] table for every layer or one per layer ({self.depth}), got {len(self.layers)}"
            )
        for spec in self.attention_specs():  # an unknown mechanism, option or head split raises now
            resolve_head_groups(spec, self.heads, {})

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


def _schedule(config: TrainConfig):
    def factor(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        progress = (step - config.warmup) / max(1, config.steps - config.warmup)
        floor = config.min_lr / config.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _evaluate(model: nn.Module, task: Any) -> float:
    model.eval()
    with torch.no_grad():
        value = task.evaluate(model)
    model.train()
    return value


def _check_run(config: TrainConfig, resume: bool) -> None:
    """Check the run folder against ``config`` (rank 0): a run there is resumed only when asked,
    and with its own config."""
    saved = Path(config.out) / "config.json"
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
    now = _jsonable(config)
    return {k: (before.get(k), v) for k, v in now.items() if k not in free and before.get(k) != v}


def _write_config(config: TrainConfig) -> None:
    """``config.json``, written once the run starts or its checkpoint has loaded (rank 0)."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "config.json", json.dumps({"subquad": __version__, **_jsonable(config)}, indent=2))


def _jsonable(config: TrainConfig) -> dict[str, Any]:
    values = asdict(config)
    values["layers"] = [{"groups": [dict(group) for group in layer]} for layer in config.layers]
    return json.loads(json.dumps(values))  # tuples as lists, as the file holds them


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl`` (``train`` or ``distill``): each a step and numbers.
    A last line cut off by a kill is dropped; any other broken line is a FileError naming it."""
    fix = "a run's own log holds a JSON object of a step and numbers per line; remove the lines that are not"
    records = read_jsonl(path, "metrics log", fix, partial_last=True)
    for number, record in records:
        if not isinstance(record.get("step"), int) or isinstance(record["step"], bool):
            raise FileError(path, f"line {number} has no integer step", fix)
        wrong = [k for k, v in record.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
        if wrong:
            verb = "is" if len(wrong) == 1 else "are"
            raise FileError(path, f"line {number}: {', '.join(wrong)} {verb} not a number", fix)
    return [record for _, record in records]


def trimmed_log(path: Path, step: int) -> list[dict[str, Any]]:
    """The records of a resumed run's log up to ``step``, the file rewritten to hold only those: what a
    run logged after its last checkpoint is done again (``read_metrics``)."""
    if not path.exists():
        return []
    kept = [record for record in read_metrics(path) if record["step"] <= step]
    write_atomic(path, "".join(json.dumps(record) + "\n" for record in kept))
    return kept


class _Log:
    """``metrics.jsonl``: on resume, lines past the checkpoint's step are dropped (they are redone)."""

    def __init__(self, path: Path, step: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.kept = trimmed_log(path, step)  # what the run logged before its checkpoint
        self.file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def train(config: TrainConfig, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train (or resume) the run of ``config``; returns the summary it writes.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) it joins the process group (gloo on CPU, NCCL on GPU),
    each process computes its slice of every global batch under DDP, and only rank 0 writes.
    """
    checkpoint.require()  # before any work: a run that cannot save must not start
    device = _device(config.device)
    rank, world = _distributed(device)
    if config.batch % (world * config.accumulate):
        raise ValueError(
            f"batch {config.batch} must split into {world} processes × accumulate={config.accumulate} equal parts"
        )
    task = make_task(config)  # bad data fails before the run exists
    task.device = device
    out = Path(config.out)
    if rank == 0:
        _check_run(config, resume)
    _barrier(world)
    last = checkpoint.latest(out / "checkpoints") if resume else None  # every rank, after rank 0 checked
    if last is not None:  # a damaged or foreign checkpoint is refused before the model is built
        check_trained_with(config, checkpoint.verify(last), last / "state.json", resume=True)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    model = task.model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config))
    step = 0
    if last is not None:
        with checkpoint.fitting(last):  # nothing is written before the checkpoint has loaded
            state = checkpoint.load(last, model)
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            checkpoint.set_rng_state(state["rng"])
            step = state["step"]
    log = _Log(out / "metrics.jsonl", step) if rank == 0 else None  # a broken log refused before any write
    if rank == 0:
        _write_config(config)
    runner = _Losses(model, task, world, device)
    sign = 1 if task.lower_is_better else -1
    before = [r[task.metric] * sign for r in (log.kept if log else []) if task.metric in r]
    best, started = min(before, default=math.inf) * sign, time.perf_counter()
    with Progress(config, step, progress and rank == 0) as bar:
        while step < config.steps:
            loss, seconds = _step(runner, optimizer, scheduler, task, config, step, rank, world)
            step += 1
            record = [{"step": step, **task.train_metric(loss), "lr": scheduler.get_last_lr()[0],
                       "tokens_per_s": config.batch * config.seq_len / seconds}]  # fmt: skip
            if step % config.eval_every == 0 or step == config.steps:
                val = _evaluate(model, task)  # every rank: the same numbers
                best = min(best * sign, val * sign) * sign
                record.append({"step": step, task.metric: val})
            if rank == 0:
                for r in record:
                    log.write(r)
                if step % config.checkpoint_every == 0 or step == config.steps:
                    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
                    state["rng"] = checkpoint.rng_state()
                    meta = {"config": _jsonable(config)}  # what evaluate checks config.json against
                    checkpoint.save(out / "checkpoints", step, model, state, config.keep, meta)
            bar.update(step, record[0], best)
    summary = {"steps": step, "seconds": time.perf_counter() - started, f"best_{task.metric}": best, "processes": world}
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        plot_curve(
            out / "metrics.jsonl", out / "curve.png", title=f"{config.task}: {config.attention}, N = {config.seq_len}"
        )
    _barrier(world)
    return summary


def _distributed(device: torch.device) -> tuple[int, int]:
    """This process's rank and the world size; joins the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world


def _device(name: str) -> torch.device:
    """The device of ``--device``, made current; under torchrun on GPUs each process takes ``cuda:LOCAL_RANK``."""
    device = resolve_device(name, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device ``name`` stands for: ``auto`` is cuda where this torch sees a CUDA device, else
    cpu; a bare ``cuda`` is ``cuda:local_rank`` (torchrun's ``LOCAL_RANK``). Raises ValueError,
    naming the value and the fix, for a device that is not cpu or cuda, or a CUDA device this
    machine lacks (which CUDA would report as an invalid ordinal)."""
    given = name
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}") from error
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch sees no CUDA device; pass --device cpu")
    count = torch.cuda.device_count()
    if device.index is None:
        if local_rank >= count:
            raise ValueError(
                f"--device {given}: the process of LOCAL_RANK {local_rank} takes cuda:{local_rank}, but this machine "
                f"has {count} CUDA device(s); start at most {count} process(es) per node (torchrun "
                f"--nproc_per_node {count}), or pass --device cpu"
            )
        device = torch.device("cuda", local_rank)
    elif device.index >= count:
        raise ValueError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


class _LossForward(nn.Module):
    """The task's loss as a forward, so DistributedDataParallel can synchronise its gradients."""

    def __init__(self, model: nn.Module, task: Any) -> None:
        super().__init__()
        self.model, self.task = model, task

    def forward(self, batch: Any) -> Tensor:
        return self.task.loss(self.model, batch)


class _Losses:
    """Runs the loss of a batch, under DistributedDataParallel when there are several processes."""

    def __init__(self, model: nn.Module, task: Any, world: int, device: torch.device) -> None:
        self.model, self.forward, self.device = model, _LossForward(model, task), device
        self.parallel = DistributedDataParallel(self.forward) if world > 1 else None

    def run(self, batch: Any, sync: bool) -> Tensor:
        """The loss of ``batch``; ``sync``: this backward all-reduces the gradients."""
        if self.parallel is None:
            return self.forward(batch)
        if sync:
            return self.parallel(batch)
        with self.parallel.no_sync():
            return self.parallel(batch)


class Progress:
    """Progress on stderr: a rich bar (loss, best evaluation, tokens/s, ETA) on a terminal, else
    about a hundred plain lines per run, which logs keep readably."""

    def __init__(self, config: TrainConfig, first: int, enabled: bool) -> None:
        self.config, self.first, self.started = config, first, time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            except ImportError:  # the train extra installs rich; plain lines without it
                pass
            else:
                columns = (BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[text]}"), TimeRemainingColumn())
                self.bar = Progress(*columns)
                self.task = self.bar.add_task("train", total=config.steps, completed=first, text="")
                self.bar.start()
        self.enabled = enabled

    def update(self, step: int, record: dict, best: float) -> None:
        if not self.enabled:
            return
        c = self.config
        elapsed = time.perf_counter() - self.started
        rate = (step - self.first) / elapsed if elapsed > 0 else 0.0
        train = "  ".join(f"{k} {v:.3f}" for k, v in record.items() if k.startswith("loss"))
        val = f"  best val {best:.3f}" if math.isfinite(best) else ""
        text = f"{train}{val}  {rate * c.batch * c.seq_len:,.0f} tok/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, text=text)
        elif step % max(1, c.steps // 100) == 0 or step == c.steps:
            eta = (c.steps - step) / rate if rate else 0.0
            print(f"step {step}/{c.steps}  {text}  ETA {eta:,.0f} s", file=sys.stderr, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def plot_curve(metrics: Path, png: Path, title: str = "") -> Path | None:
    """Training and validation bits per byte against the step, from ``metrics.jsonl``; None without
    matplotlib (``pip install 'subquad[train]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_metrics(metrics)
    train_key = next((k for r in records for k in r if k.startswith("loss")), "loss")
    val_key = next((k for r in records for k in r if k.startswith("val_")), "val")
    train_points = [(r["step"], r[train_key]) for r in records if train_key in r]
    val_points = [(r["step"], r[val_key]) for r in records if val_key in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train_points:
        ax.plot(*zip(*train_points), lw=0.8, alpha=0.7, label="train")
    if val_points:
        ax.plot(*zip(*val_points), "o-", label="validation")
    ax.set(xlabel="step", ylabel=f"{train_key} / {val_key}", title=title)
    if train_points or val_points:
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def _step(
    runner: _Losses, optimizer, scheduler, task: Any, config: TrainConfig, step: int, rank: int, world: int
) -> tuple[float, float]:
    """One optimizer step on this rank's slice of the global batch of ``step``; returns the mean
    loss of the whole batch (nats) and the seconds it took."""
    t = time.perf_counter()
    micros = task.split(task.batch(step, rank, world), config.accumulate)
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=runner.device)
    for i, micro in enumerate(micros):
        autocast = torch.autocast(runner.device.type, torch.bfloat16, enabled=config.bf16)
        with hooks.auxiliary_losses() as aux, autocast:
            loss = runner.run(micro, sync=i == len(micros) - 1)  # gradients meet once, on the last
            objective = loss + sum(aux) if aux else loss
        (objective / config.accumulate).backward()
        total += loss.detach().float() / config.accumulate
    if config.clip:
        nn.utils.clip_grad_norm_(runner.model.parameters(), config.clip)
    optimizer.step()
    scheduler.step()
    if world > 1:
        dist.all_reduce(total)
        total /= world
    return float(total), time.perf_counter() - t

"""``subquad distill``: attention transfer into a converted pretrained model.

A model converted by ``subquad.hf.convert`` has new parameters (feature maps, class projections,
a router) that start untrained. Attention transfer (as in Hedgehog and LoLCATs) trains them so that
each converted layer's attention output matches the original layer's on real text:

- **Teacher alongside.** Each converted attention module gets a frozen copy of itself computing
  exact attention (``AttentionTransfer``). In every forward the copy runs on the same inputs,
  the layer's loss is the mean squared error between the two outputs, divided by the mean square
  of the original's (so layers of different scales weigh alike), and the original's output goes on
  to the next layer. Every layer learns from the inputs it sees in the original model, all layers
  in one forward pass, and no labels are needed.
- **Two stages.** ``steps`` steps train only what conversion added (``subquad.hf.converted_parameters``);
  then ``finetune_steps`` steps train the whole attention block too (its query, key, value and
  output projections; no adapters), at ``finetune_lr``. The loss stays the layer-wise one.
- **Held-out error.** The last ``heldout`` windows of the data never train; their mean relative
  error is measured before the first step, every ``eval_every`` steps and at the end.
- **Checkpoints** (``train.checkpoint``: written atomically, the newest ``keep`` kept) hold the
  converted attention modules, the optimizer, every RNG and the step; batches are a function of
  (seed, step), so a resumed run (``resume=True``) continues exactly where it stopped.
- **Output.** ``OUT/model`` is a folder ``subquad.hf.from_pretrained`` loads with subquad
  attention (and transformers as the original architecture); ``OUT/metrics.jsonl`` the losses and
  held-out errors; ``OUT/distill.json`` the summary.

Windows are ``subquad approx``'s: passages packed into windows of exactly ``tokens`` tokens.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from subquad.files import out_folder
from subquad.flags import DTYPES, named, setting
from subquad.hf.data import check_window, load_model, read_passages, token_windows
from subquad.hf.plans import is_plan, read_plan
from subquad.hf.support import layer_index

__all__ = ["AttentionTransfer", "DistillConfig", "distill"]


@dataclass(frozen=True)
class DistillConfig:
    """One distillation run; ``subquad distill``'s flags come from here (``subquad distill --help``)."""

    model: str = setting(help="a local Hugging Face model folder or .gguf file")
    data: str = setting(help="a .jsonl file (text), a text file or a folder of .txt")
    mechanism: str = setting(
        help="NAME or NAME:option=value,... (tuple values as a|b), or a .toml layer plan (subquad.hf.plans)",
        metavar="SPEC",
    )
    out: str = setting(help="folder for the run")
    layers: tuple[int, ...] | None = setting(None, "layers to convert", shown_default="all")
    tokens: int = setting(512, "tokens per window", flag="--window-tokens", old="--tokens")
    batch: int = setting(4, "windows per step", flag="--windows-per-step", old="--batch")
    steps: int = setting(200, "steps training only what conversion added")
    finetune_steps: int = setting(0, "then steps training the whole attention blocks too")
    lr: float = setting(1e-2, "peak learning rate of the first stage")
    finetune_lr: float = setting(1e-4, "peak learning rate of the second stage")
    warmup: int = setting(10, "warm-up steps of each stage")
    heldout: int = setting(16, "windows kept out of training, for the held-out error")
    eval_every: int = setting(50, "steps between held-out errors")
    checkpoint_every: int = setting(50, "steps between checkpoints")
    calibration: int = setting(16, "windows routing's k-means reads")
    seed: int = setting(0, "window order and the new weights' initialisation")
    keep: int = setting(2, "checkpoints kept")
    device: str = setting("auto", "auto, cpu, cuda or cuda:N; auto: cuda where this torch sees one")
    dtype: str = setting("float32", "the model's dtype", choices=DTYPES)

    def __post_init__(self) -> None:
        for name in ("model", "data", "mechanism", "out"):  # pathlib paths as text: the checkpoints record them
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        for name in ("tokens", "batch", "heldout", "eval_every", "checkpoint_every", "keep"):
            if getattr(self, name) < 1:
                raise ValueError(f"distill {named(self, name)} must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "finetune_steps", "warmup", "calibration"):
            if getattr(self, name) < 0:
                raise ValueError(f"distill {name} must be >= 0, got {getattr(self, name)}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.steps + self.finetune_steps < 1:
            raise ValueError("distill needs steps or finetune_steps > 0")
        for name in ("lr", "finetune_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"distill {name} must be > 0, got {getattr(self, name)}")

    @property
    def total(self) -> int:
        return self.steps + self.finetune_steps


_CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")  # across transformers' models

# Fields a resumed run may change: where its folder is, how long it goes on, how often it reports and saves.
_RESUMABLE = {"out", "finetune_steps", "eval_every", "checkpoint_every", "keep", "device"}  # may change on resume
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class AttentionTransfer:
    """Layer-wise attention transfer on the converted attention modules of ``model``.

    Builds a frozen exact-attention copy of each converted module (do it before any of the
    module's own weights train) and hooks the module: in a forward, the copy runs on the same
    inputs, ``losses`` gets the layer's relative squared error, and the copy's output replaces the
    module's for the layers after it. ``close()`` (or leaving the ``with`` block) removes the hooks.

        with AttentionTransfer(model) as transfer:
            model(input_ids=ids)
            loss = transfer.loss()  # mean over layers; clears the list
    """

    def __init__(self, model: nn.Module) -> None:
        from subquad import hf
        from subquad.hf.interface import _clear

        self.modules = [m for m in hf.attention_modules(model) if getattr(m, "subquad_attention", None) is not None]
        if not self.modules:
            raise ValueError("no layer of this model runs subquad attention; subquad.hf.convert it first")
        full = hf.LayerAttention.build("full")
        self.teachers: dict[nn.Module, nn.Module] = {}
        for module in self.modules:
            teacher = copy.deepcopy(module)
            _clear(teacher, "subquad_state", "subquad_inputs", "subquad_shares")
            teacher.subquad_attention = full
            self.teachers[module] = teacher.requires_grad_(False)
        self.losses: list[Tensor] = []
        self._handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in self.modules]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        for name in _CACHE_NAMES:  # the student filled the cache; the teacher must not add to it
            cache = bound.arguments.get(name)
            if cache is not None:
                hidden = bound.arguments.get("hidden_states", args[0] if args else None)
                if hasattr(cache, "get_seq_length") and cache.get_seq_length(layer_index(module)) > hidden.shape[-2]:
                    raise ValueError(
                        "attention transfer compares whole sequences, not cached decoding steps: call the model "
                        "with use_cache=False"
                    )
                bound.arguments[name] = None
        with torch.no_grad():
            target = self.teachers[module](*bound.args, **bound.kwargs)
        student, teacher = output[0].float(), target[0].float()
        power = teacher.square().mean().clamp_min(torch.finfo(teacher.dtype).tiny)
        self.losses.append((student - teacher).square().mean() / power)
        return (target[0], *output[1:])

    def loss(self) -> Tensor:
        """The mean of the layers' losses since the last call."""
        if not self.losses:
            raise ValueError("no converted layer ran since the last loss(); run the model first")
        loss = torch.stack(self.losses).mean()
        self.losses = []
        return loss

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> AttentionTransfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _batch_indices(step: int, batch: int, count: int, seed: int) -> Tensor:
    """The training windows of ``step``: positions ``step·batch ...`` of an endless sequence of
    epochs, each a seeded permutation of the ``count`` windows."""
    out = []
    for position in range(step * batch, (step + 1) * batch):
        epoch, index = divmod(position, count)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        out.append(int(torch.randperm(count, generator=generator)[index]))
    return torch.tensor(out)


def _rate(config: DistillConfig, step: int) -> float:
    """Learning rate of ``step``: per stage, a linear warm-up then a cosine decay to a tenth."""
    first, length, peak = (0, config.steps, config.lr) if step < config.steps else (
        config.steps, config.finetune_steps, config.finetune_lr)  # fmt: skip
    local = step - first
    if local < config.warmup:
        return peak * (local + 1) / (config.warmup + 1)
    progress = (local - config.warmup) / max(1, length - config.warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _trainable(model: nn.Module, modules: list[nn.Module], stage: int) -> list[nn.Parameter]:
    from subquad import hf

    added = hf.converted_parameters(model)
    if stage == 0:
        return added
    seen = {id(p) for p in added}
    own = [p for m in modules for p in m.parameters() if id(p) not in seen]
    for p in own:
        p.requires_grad_(True)
    return added + own


def distill(config: DistillConfig, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Convert ``config.model`` to ``config.mechanism`` and distil it on ``config.data``; returns
    the summary (also in ``OUT/distill.json``). See the module docstring."""
    from subquad import hf
    from subquad.train import checkpoint

    checkpoint.require()  # before any work: a run that cannot save must not start
    hf.check_spec(config.mechanism, converted=True)  # a bad spec fails before the model loads
    if is_plan(config.mechanism) and config.layers is not None:
        raise ValueError(f"{config.mechanism} names each layer's attention; pass no --layers with it")
    out = out_folder(config.out)
    found = checkpoint.latest(out / "checkpoints") if (out / "checkpoints").is_dir() else None
    if found is not None and not resume:
        raise ValueError(f"{out} already holds a distillation run; pass --resume to continue it, or another --out")
    if found is not None:
        meta = checkpoint.verify(found)  # a damaged checkpoint is refused before the model loads
    out.mkdir(parents=True, exist_ok=True)
    job = _Job(config)
    run = _resume(job, found, meta if found is not None else {})
    _train(job, run, progress)
    job.transfer.close()
    hf.save(job.model, out / "model", job.tokenizer)
    summary = {
        "settings": dataclasses.asdict(config),
        "layers": [layer_index(m) for m in job.modules],
        "trained_parameters": sum(p.numel() for g in run.optimizer.param_groups for p in g["params"]),
        "heldout_error_before": run.history[0]["heldout_error"],
        "heldout_error_after": run.history[-1]["heldout_error"],
        "history": run.history,
        "seconds": run.seconds,
        "threads": torch.get_num_threads(),
    }
    (out / "distill.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


class _Job:
    """The converted model of a distillation with its teachers, and its training and held-out windows."""

    def __init__(self, config: DistillConfig) -> None:
        from subquad import hf
        from subquad.train.loop import resolve_device

        self.config, where = config, resolve_device(config.device)
        model, self.tokenizer, decoder = load_model(config.model)
        self.model = model.to(where, _DTYPES[config.dtype])
        texts, _ = read_passages(config.data)
        check_window(model, config.tokens)
        windows = token_windows(self.tokenizer, texts, None, config.tokens, 10**9, config.seed).ids.to(where)
        self.train_count = len(windows) - config.heldout
        if self.train_count < config.batch:
            raise ValueError(
                f"{config.data} gives {len(windows)} windows of {config.tokens} tokens: fewer than heldout "
                f"({config.heldout}) + windows per step ({config.batch}); pass more text, fewer --window-tokens or a "
                "smaller --heldout"
            )
        self.train, self.heldout = windows[: self.train_count], windows[self.train_count :]
        calibration = [{"input_ids": b} for b in self.batches(self.train[: max(config.calibration, 1)])]
        name = config.mechanism
        self.plan = read_plan(name, converted=True) if is_plan(name) else None  # one spec per layer
        hf.convert(self.model, name, layers=config.layers, seed=config.seed,
                   calibration=calibration if hf.calibratable(name) else None)  # fmt: skip
        self.modules = [m for m in hf.attention_modules(model) if getattr(m, "subquad_attention", None) is not None]
        if config.steps and not hf.converted_parameters(model):
            raise ValueError(
                f"{name!r} adds no parameters that gradients train (routing's centroids are fitted by k-means); "
                "pass --steps 0 and --finetune-steps N to train the attention blocks themselves"
            )
        self.transfer = AttentionTransfer(model)  # the teachers copy the original attention weights
        self.body = getattr(model, "base_model", model)  # no language-model head: its logits play no part
        self.extra = {"use_cache": False} if decoder else {}
        self.container = nn.ModuleDict({str(layer_index(m)): m for m in self.modules})

    def batches(self, ids: Tensor) -> list[Tensor]:
        return [ids[i : i + self.config.batch] for i in range(0, len(ids), self.config.batch)]

    def forward(self, ids: Tensor) -> Tensor:
        """The layers' mean attention-transfer loss on the windows ``ids``."""
        self.body(input_ids=ids, **self.extra)
        return self.transfer.loss()

    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean loss of the held-out windows."""
        return float(torch.stack([self.forward(b) for b in self.batches(self.heldout)]).mean())


def _resume(job: _Job, found: Path | None, meta: dict[str, Any]) -> SimpleNamespace:
    """The run's step, seconds, held-out history, stage and optimizer: from the checkpoint ``found``
    (refused when its settings differ: those in its ``meta`` before its tensors are loaded into a
    model they may not fit), else new, with the held-out error before training."""
    from subquad.train import checkpoint
    from subquad.train.loop import trimmed_log

    config = job.config
    run = SimpleNamespace(step=0, seconds=0.0, history=[], metrics=Path(config.out) / "metrics.jsonl")
    run.settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in _RESUMABLE}
    if job.plan is not None:  # an edited plan file is another run
        run.settings["plan"] = job.plan.record()
    state: dict[str, Any] = {}
    if "settings" in meta:
        _same_settings(meta["settings"], run.settings)
    if found is not None:
        with checkpoint.fitting(found):
            state = checkpoint.load(found, job.container)
        _same_settings(state["settings"], run.settings)
        with checkpoint.fitting(found):
            checkpoint.set_rng_state(state["rng"])
            run.step, run.seconds, run.history = state["step"], float(state["seconds"]), list(state["history"])
    run.stage = int(config.finetune_steps > 0 and run.step >= config.steps)  # a finished first stage stays there
    run.optimizer = _optimizer(job, run.stage, run.step)
    if state.get("stage") == run.stage and "optimizer" in state:
        with checkpoint.fitting(found):
            run.optimizer.load_state_dict(state["optimizer"])
    if run.step:  # drop what a killed run logged after its last checkpoint
        trimmed_log(run.metrics, run.step)
    else:
        run.metrics.write_text("")
        run.history = [{"step": 0, "heldout_error": job.evaluate()}]
        _log(run.metrics, run.history[-1])
    return run


def _optimizer(job: _Job, stage: int, step: int) -> torch.optim.Optimizer:
    return torch.optim.AdamW(_trainable(job.model, job.modules, stage), lr=_rate(job.config, step), weight_decay=0.0)


def _train(job: _Job, run: SimpleNamespace, progress: bool) -> None:
    """Train from ``run.step`` to the end, logging every step and checkpointing as configured."""
    from subquad.train.loop import Progress

    config = job.config
    job.model.eval()  # no dropout: the student matches the teacher's deterministic outputs
    counts = SimpleNamespace(steps=config.total, batch=config.batch, seq_len=config.tokens)
    with Progress(counts, run.step, progress) as bar:
        while run.step < config.total:
            if run.stage == 0 and run.step >= config.steps:  # the whole attention block joins
                run.stage, run.optimizer = 1, _optimizer(job, 1, run.step)
            started = time.perf_counter()
            for group in run.optimizer.param_groups:
                group["lr"] = _rate(config, run.step)
            loss = job.forward(job.train[_batch_indices(run.step, config.batch, job.train_count, config.seed)])
            run.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_([p for g in run.optimizer.param_groups for p in g["params"]], 1.0)
            run.optimizer.step()
            run.seconds += time.perf_counter() - started
            run.step += 1
            record: dict[str, Any] = {"step": run.step, "loss": float(loss.detach()), "lr": _rate(config, run.step - 1)}
            if run.step % config.eval_every == 0 or run.step == config.total:
                record["heldout_error"] = job.evaluate()
                run.history.append({"step": run.step, "heldout_error": record["heldout_error"]})
            _log(run.metrics, record)
            bar.update(run.step, record, min(h["heldout_error"] for h in run.history))
            if run.step % config.checkpoint_every == 0 or run.step == config.total:
                _save(job, run)


def _same_settings(saved: dict[str, Any], settings: dict[str, Any]) -> None:
    """Refuse a resume whose settings differ from the checkpoint's (as JSON: tuples and lists alike)."""
    plain = lambda x: json.loads(json.dumps(x))  # noqa: E731
    saved = plain({"dtype": "float32", **{k: v for k, v in saved.items() if k not in _RESUMABLE}})
    settings = plain(settings)
    if saved != settings:
        changed = sorted(k for k in saved.keys() | settings.keys() if saved.get(k) != settings.get(k))
        raise ValueError(f"--resume with other settings than the run's ({', '.join(changed)}); use the same ones")


def _save(job: _Job, run: SimpleNamespace) -> None:
    """A checkpoint of the converted modules, the optimizer, every RNG and the run's progress."""
    from subquad.train import checkpoint

    extra = {"settings": run.settings, "rng": checkpoint.rng_state(), "seconds": run.seconds, "history": run.history,
             "stage": run.stage, "optimizer": run.optimizer.state_dict()}  # fmt: skip
    config = job.config
    checkpoint.save(
        Path(config.out) / "checkpoints", run.step, job.container, extra, config.keep, meta={"settings": run.settings}
    )  # read before a resume loads the tensors


def _log(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")

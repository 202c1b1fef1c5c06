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
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from subquad.hf.approx import parse_spec
from subquad.hf.data import load_model, read_passages, token_windows

__all__ = ["AttentionTransfer", "DistillConfig", "distill"]


@dataclass(frozen=True)
class DistillConfig:
    """One distillation run (``subquad distill --help`` gives each field)."""

    model: str
    data: str
    mechanism: str
    out: str
    layers: tuple[int, ...] | None = None
    tokens: int = 512
    batch: int = 4
    steps: int = 200
    finetune_steps: int = 0
    lr: float = 1e-2
    finetune_lr: float = 1e-4
    warmup: int = 10
    heldout: int = 16
    eval_every: int = 50
    checkpoint_every: int = 50
    calibration: int = 16
    seed: int = 0
    keep: int = 2
    device: str = "auto"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("tokens", "batch", "heldout", "eval_every", "checkpoint_every", "keep"):
            if getattr(self, name) < 1:
                raise ValueError(f"distill {name} must be >= 1, got {getattr(self, name)}")
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
            _clear(teacher, "subquad_state", "subquad_inputs")
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
                if hasattr(cache, "get_seq_length") and cache.get_seq_length(module.layer_idx) > hidden.shape[-2]:
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
    from subquad.train.loop import Progress, resolve_device, trimmed_log

    checkpoint.require()  # before any work: a run that cannot save must not start

    name, options = parse_spec(config.mechanism)
    hf.LayerAttention.build(name, converted=True, **options)  # a bad spec fails before the model loads
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a folder (it is created if missing)")
    folder = out / "checkpoints"
    found = checkpoint.latest(folder) if folder.is_dir() else None
    if found is not None and not resume:
        raise ValueError(f"{out} already holds a distillation run; pass --resume to continue it, or another --out")
    if found is not None:
        checkpoint.verify(found)  # a damaged checkpoint is refused before the model loads
    out.mkdir(parents=True, exist_ok=True)

    where = resolve_device(config.device)
    model, tokenizer, decoder = load_model(config.model)
    model = model.to(where, _DTYPES[config.dtype])
    texts, _ = read_passages(config.data)
    windows = token_windows(tokenizer, texts, None, config.tokens, 10**9, config.seed).ids.to(where)
    train_count = len(windows) - config.heldout
    if train_count < config.batch:
        raise ValueError(
            f"{config.data} gives {len(windows)} windows of {config.tokens} tokens: fewer than heldout "
            f"({config.heldout}) + batch ({config.batch}); pass more text, fewer --tokens or a smaller --heldout"
        )
    train, heldout = windows[:train_count], windows[train_count:]
    batches = lambda ids: [ids[i : i + config.batch] for i in range(0, len(ids), config.batch)]  # noqa: E731
    calibration = [{"input_ids": b} for b in batches(train[: max(config.calibration, 1)])]
    hf.convert(model, name, layers=config.layers, calibration=calibration if hf.calibratable(name) else None,
               seed=config.seed, **options)  # fmt: skip
    modules = [m for m in hf.attention_modules(model) if getattr(m, "subquad_attention", None) is not None]
    if config.steps and not hf.converted_parameters(model):
        raise ValueError(
            f"{name} adds no parameters that gradients train (routing's centroids are fitted by k-means); "
            "pass --steps 0 and --finetune-steps N to train the attention blocks themselves"
        )
    transfer = AttentionTransfer(model)  # the teachers copy the original attention weights
    body = getattr(model, "base_model", model)  # no language-model head: its logits play no part
    extra = {"use_cache": False} if decoder else {}
    container = nn.ModuleDict({str(m.layer_idx): m for m in modules})

    def forward(ids: Tensor) -> Tensor:
        body(input_ids=ids, **extra)
        return transfer.loss()

    @torch.no_grad()
    def evaluate() -> float:
        return float(torch.stack([forward(b) for b in batches(heldout)]).mean())

    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in _RESUMABLE}
    step, seconds, history = 0, 0.0, []
    state: dict[str, Any] = {}
    if found is not None:
        with checkpoint.fitting(found):
            state = checkpoint.load(found, container)
            saved = {"dtype": "float32", **{k: v for k, v in state["settings"].items() if k not in _RESUMABLE}}
        if saved != settings:
            changed = sorted(k for k in saved.keys() | settings.keys() if saved.get(k) != settings.get(k))
            raise ValueError(f"--resume with other settings than the run's ({', '.join(changed)}); use the same ones")
        with checkpoint.fitting(found):
            checkpoint.set_rng_state(state["rng"])
            step, seconds, history = state["step"], float(state["seconds"]), list(state["history"])
    stage = int(config.finetune_steps > 0 and step >= config.steps)  # a finished first-stage-only run stays there
    optimizer = torch.optim.AdamW(_trainable(model, modules, stage), lr=_rate(config, step), weight_decay=0.0)
    if state.get("stage") == stage and "optimizer" in state:
        with checkpoint.fitting(found):
            optimizer.load_state_dict(state["optimizer"])
    metrics = out / "metrics.jsonl"
    if step:  # drop what a killed run logged after its last checkpoint
        trimmed_log(metrics, step)
    if step == 0:
        metrics.write_text("")
        history = [{"step": 0, "heldout_error": evaluate()}]
        _log(metrics, history[-1])
    model.eval()  # no dropout: the student matches the teacher's deterministic outputs

    def save_checkpoint() -> None:
        extra_state = {"settings": settings, "rng": checkpoint.rng_state(), "seconds": seconds, "history": history,
                       "stage": stage, "optimizer": optimizer.state_dict()}  # fmt: skip
        checkpoint.save(folder, step, container, extra_state, config.keep)

    counts = SimpleNamespace(steps=config.total, batch=config.batch, seq_len=config.tokens)
    with Progress(counts, step, progress) as bar:
        while step < config.total:
            if stage == 0 and step >= config.steps:  # the whole attention block joins
                stage = 1
                optimizer = torch.optim.AdamW(_trainable(model, modules, 1), lr=_rate(config, step), weight_decay=0.0)
            started = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = _rate(config, step)
            loss = forward(train[_batch_indices(step, config.batch, train_count, config.seed)])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
            optimizer.step()
            seconds += time.perf_counter() - started
            step += 1
            record: dict[str, Any] = {"step": step, "loss": float(loss.detach()), "lr": _rate(config, step - 1)}
            if step % config.eval_every == 0 or step == config.total:
                record["heldout_error"] = evaluate()
                history.append({"step": step, "heldout_error": record["heldout_error"]})
            _log(metrics, record)
            bar.update(step, record, min(h["heldout_error"] for h in history))
            if step % config.checkpoint_every == 0 or step == config.total:
                save_checkpoint()
    transfer.close()
    hf.save(model, out / "model", tokenizer)
    summary = {
        "settings": dataclasses.asdict(config),
        "layers": [int(m.layer_idx) for m in modules],
        "trained_parameters": sum(p.numel() for g in optimizer.param_groups for p in g["params"]),
        "heldout_error_before": history[0]["heldout_error"],
        "heldout_error_after": history[-1]["heldout_error"],
        "history": history,
        "seconds": seconds,
        "threads": torch.get_num_threads(),
    }
    (out / "distill.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _log(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")

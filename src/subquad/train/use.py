"""Using a trained run: ``subquad evaluate`` and ``subquad generate`` load its checkpoint.

A run folder (``subquad train --out``) holds the config the model was built from; the model is
rebuilt from it and the newest checkpoint's weights (or a named one's) loaded into it, checked
against the checkpoint's record (its hashes and the config it was trained with); the rest of its
state is never read. On ``device`` (``auto``,
as training's default: cuda where this torch sees a CUDA device). A run evaluated on the device it
trained on gives the value its own evaluation logged.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from subquad.files import FileError
from subquad.train import checkpoint
from subquad.train.config import TrainConfig, check_trained_with, load_config_file, train_config
from subquad.train.loop import resolve_device
from subquad.train.tasks import TextTask, make_task

__all__ = ["evaluate_run", "generate_text", "load_run"]

_FIX = "the run's config.json and its checkpoints must come from one subquad train run, unedited"


def load_run(run: str | Path, step: int | None = None, device: str = "auto") -> tuple[TrainConfig, Any, nn.Module]:
    """The config, task and model of a run, with the weights of its newest checkpoint (or of
    ``step``), on ``device`` (auto, cpu, cuda or cuda:N)."""
    place = resolve_device(device)  # a bad device fails before any loading
    run = Path(run)
    if not (run / "config.json").is_file():
        raise FileNotFoundError(f"{run} holds no run (no config.json); pass the --out folder of subquad train")
    source = run / "config.json"
    config = train_config(load_config_file(source), source)
    folder = run / "checkpoints"
    path = checkpoint.latest(folder) if step is None else folder / f"step-{step:09d}"
    if path is None or not (path / "model.safetensors").is_file():
        have = sorted(p.name for p in folder.glob("step-*")) if folder.is_dir() else []
        raise FileNotFoundError(f"{run} has no checkpoint {'' if step is None else step}; it has: {have or 'none'}")
    try:
        task = make_task(config)
    except (FileNotFoundError, FileError) as error:
        raise FileError(source, f"names data that cannot be read ({error})",
                        "put the data back, or set config.json's data to where it is now") from error  # fmt: skip
    task.device = place
    model = task.model()
    meta = checkpoint.load_weights(path, model, fix=_FIX)
    check_trained_with(config, meta, source)
    return config, task, model.to(place).eval()


def evaluate_run(
    run: str | Path, split: str = "test", windows: int | None = None, step: int | None = None, device: str = "auto"
) -> dict:
    """The task's metric on ``split`` (all of it unless ``windows`` limits it: text windows, or
    classification batches, as ``eval_windows`` counts them), on ``device``."""
    if windows is not None and (isinstance(windows, bool) or not isinstance(windows, int) or windows < 1):
        raise ValueError(f"--batches must be a count >= 1 (or left out for all), got {windows}")
    config, task, model = load_run(run, step, device)
    with torch.no_grad():
        value = task.evaluate(model, split, windows)
    name = task.metric.replace("val_", f"{split}_")
    return {"run": str(run), "task": config.task, name: value}


def generate_text(
    run: str | Path,
    prompt: str,
    tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    device: str = "auto",
) -> str:
    """Continue ``prompt`` byte by byte with a text run's model (cached decoding where the
    mechanism has it), on ``device``. Sampling draws from a CPU generator seeded with ``seed``."""
    config, task, model = load_run(run, device=device)
    if not isinstance(task, TextTask):
        raise ValueError(f"generate needs a text run; {run} trained the {config.task} task")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k is not None and (top_k < 1 or not temperature):
        raise ValueError(f"--top-k {top_k} samples among the k likeliest bytes: it needs k >= 1 and --temperature > 0 "
                         "(at 0 generation is greedy)")  # fmt: skip
    data = prompt.encode()
    if not data or len(data) + tokens > config.seq_len:
        raise ValueError(
            f"the prompt ({len(data)} bytes) must be non-empty and, with --new-bytes, fit seq_len={config.seq_len}"
        )
    use_cache = all(g.mechanism.decoder is not None for block in model.backbone.blocks for g in block.attn.groups)
    out = model.generate(
        torch.tensor([list(data)], device=task.device), tokens, use_cache=use_cache, temperature=temperature,
        top_k=top_k, generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")

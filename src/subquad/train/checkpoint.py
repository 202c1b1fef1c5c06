"""Checkpoints that lose nothing: weights in safetensors, the rest of the run's state beside them.

A checkpoint is a folder ``step-000120/`` holding ``model.safetensors`` (the weights, shared
tensors such as a tied head stored once) and ``state.pt`` (optimizer, scheduler, every RNG, the
step; the data position is the step, as batches are a function of (seed, step)). It is written
into a temporary folder and renamed into place, so a run killed at any moment leaves either the
whole checkpoint or none; the oldest are removed beyond ``keep``.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["latest", "load", "require", "rng_state", "save", "set_rng_state"]

_PREFIX = "step-"


def rng_state() -> dict[str, Any]:
    """Every generator a training step can draw from."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def require() -> Any:
    """``safetensors.torch``, which writes and reads the weights; an ImportError saying how to install
    it where it is missing (the ``train`` extra has it; ``subquad bench`` and ``list`` need none of it).
    Runs call it before any work, so a missing package cannot cost the work done before a checkpoint."""
    try:
        import safetensors.torch
    except ImportError as error:
        raise ImportError(
            "checkpoints need safetensors, which is not installed: pip install 'subquad[train]'"
        ) from error
    return safetensors.torch


def save(folder: Path, step: int, model: nn.Module, state: dict[str, Any], keep: int) -> Path:
    """Write the checkpoint of ``step`` atomically and keep the newest ``keep``."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{_PREFIX}{step:09d}"
    tmp = folder / f".tmp-{step:09d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    require().save_model(model, str(tmp / "model.safetensors"))
    torch.save({**state, "step": step}, tmp / "state.pt")
    for f in tmp.iterdir():  # on disk before the rename makes the checkpoint visible
        with f.open("rb") as handle:
            os.fsync(handle.fileno())
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in sorted(folder.glob(f"{_PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(folder: Path) -> Path | None:
    """The newest complete checkpoint in ``folder``, or None."""
    found = sorted(p for p in folder.glob(f"{_PREFIX}*") if (p / "state.pt").is_file())
    return found[-1] if found else None


def load(path: Path, model: nn.Module) -> dict[str, Any]:
    """Load the weights into ``model``; returns the rest of the state."""
    missing, unexpected = require().load_model(model, str(path / "model.safetensors"), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"the checkpoint {path} does not fit this model: missing {sorted(missing)}, unexpected "
            f"{sorted(unexpected)}; resume with the config the run was started with"
        )
    return torch.load(path / "state.pt", weights_only=False)

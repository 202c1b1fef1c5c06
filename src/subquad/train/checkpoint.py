"""Checkpoints that lose nothing and carry no code: tensors in safetensors, the rest in JSON.

A checkpoint is a folder ``step-000000120/`` holding

- ``model.safetensors``: the weights (shared tensors such as a tied head stored once);
- ``state.safetensors``: every tensor of the rest of the run's state (optimizer moments, RNG states);
- ``state.json``: that state's structure and plain values (the step, the scheduler, Python's RNG,
  settings), each tensor named where it goes, with the SHA-256 of both safetensors files and a
  checksum of its own content.

Reading a checkpoint runs nothing from it: JSON and safetensors are data. A byte of any of the
three files changed after it was written (a damaged copy, a truncated download) is refused with a
`FileError` naming the file, so a damaged run never resumes silently.

A checkpoint is written into a temporary folder, put on disk and renamed into place, so a run
killed at any moment leaves either the whole checkpoint or none; the oldest are removed beyond
``keep``. Checkpoints of the earlier pickle format (``state.pt``) are never read by a resume:
``upgrade`` converts them when the user asks (``subquad upgrade-run``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from subquad.files import FileError, check_fields, json_checksum, load_safetensors, read_json, sha256, write_atomic
from subquad.version import __version__

__all__ = [
    "fitting", "latest", "load", "load_weights", "require", "rng_state", "save", "set_rng_state", "upgrade", "verify",
]  # fmt: skip

_PREFIX = "step-"
FORMAT = 2
WEIGHTS, TENSORS, STATE = "model.safetensors", "state.safetensors", "state.json"
LEGACY = "state.pt"  # the pickle format of the checkpoints before format 2
_DAMAGED = "copy the checkpoint again from where it was written, or remove it to resume from the one before it"


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


def save(
    folder: Path, step: int, model: nn.Module, state: dict[str, Any], keep: int, meta: dict[str, Any] | None = None
) -> Path:
    """Write the checkpoint of ``step`` atomically and keep the newest ``keep``. ``meta``: plain
    values ``verify`` returns, such as the config the run was trained with."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{_PREFIX}{step:09d}"
    tmp = folder / f".tmp-{step:09d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    _write_state(tmp, {**state, "step": step}, model, meta)
    for f in tmp.iterdir():  # on disk before the rename makes the checkpoint visible
        with f.open("rb") as handle:
            os.fsync(handle.fileno())
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in sorted(folder.glob(f"{_PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_state(path: Path, state: dict[str, Any], model: nn.Module | None = None, meta: dict | None = None) -> None:
    """``state.safetensors`` and, last, ``state.json`` in ``path``; the weights first when ``model``
    is given (else ``path`` already holds them)."""
    if model is not None:
        require().save_model(model, str(path / WEIGHTS))
    tensors: dict[str, Tensor] = {}
    tree = _encode(state, tensors)
    require().save_file(tensors, str(path / TENSORS))
    record = {"format": FORMAT, "subquad": __version__, "sha256": {n: sha256(path / n) for n in (WEIGHTS, TENSORS)},
              "state": tree, "meta": meta or {}}  # fmt: skip
    write_atomic(path / STATE, json.dumps({**record, "checksum": json_checksum(record)}) + "\n")


def latest(folder: Path) -> Path | None:
    """The newest checkpoint in ``folder`` (a ``step-*`` folder is complete once it exists), or None."""
    found = sorted(p for p in folder.glob(f"{_PREFIX}*") if (p / WEIGHTS).is_file())
    return found[-1] if found else None


def load_weights(path: Path, model: nn.Module, fix: str = "") -> dict[str, Any]:
    """Load the checkpoint's weights into ``model``: all that evaluating or generating needs; returns
    its ``meta``. The weights are checked against the checkpoint's record where it has one (a
    checkpoint of the pickle format has none, and no meta; its ``state.pt`` is never read)."""
    record = {"meta": {}}
    if (path / STATE).is_file() or not (path / LEGACY).is_file():
        record = _record(path)
        _verify(path, record, WEIGHTS)
    _load_model(path, model, fix or _FIT)
    return record["meta"]


def verify(path: Path) -> dict[str, Any]:
    """Check a checkpoint whole (its record, and both tensor files against it) without loading it,
    so a resume refuses a damaged one before any costly work; returns its meta."""
    return _checked(path)["meta"]


def _checked(path: Path) -> dict[str, Any]:
    record = _record(path)
    for name in (WEIGHTS, TENSORS):
        _verify(path, record, name)
    return record


def load(path: Path, model: nn.Module) -> dict[str, Any]:
    """Load the weights into ``model``; returns the rest of the state, each file checked first."""
    record = _checked(path)
    _load_model(path, model, _FIT)
    tensors = load_safetensors(path / TENSORS, fix=_DAMAGED)
    used: set[str] = set()
    state = _decode(record["state"], tensors, path / STATE, used)
    if used != set(tensors) or not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise FileError(path / STATE, f"does not describe {TENSORS}'s tensors and a step", _DAMAGED)
    return state


@contextlib.contextmanager
def fitting(path: Path) -> Iterator[None]:
    """Errors while a checkpoint's state is put into a run (an optimizer of other parameters, a
    state of another kind) name the checkpoint instead of ending in a traceback."""
    try:
        yield
    except FileError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError, IndexError) as error:
        raise FileError(
            path, f"does not fit this run ({type(error).__name__}: {error})",
            "resume with the settings the run was started with, or remove this checkpoint to resume from the one "
            "before it",
        ) from error  # fmt: skip


def _load_model(path: Path, model: nn.Module, fix: str) -> None:
    from safetensors import SafetensorError

    try:
        missing, unexpected = require().load_model(model, str(path / WEIGHTS), strict=False)
    except (SafetensorError, OSError) as error:
        raise FileError(path / WEIGHTS, f"is not a readable safetensors file ({error})", _DAMAGED) from error
    except RuntimeError as error:  # shapes that differ
        raise FileError(path / WEIGHTS, f"does not fit this model: {error}", fix) from error
    if missing or unexpected:
        raise FileError(
            path / WEIGHTS, f"does not fit this model: missing {sorted(missing)}, unexpected {sorted(unexpected)}", fix
        )


_FIT = "use the config the run was started with"


def _record(path: Path) -> dict[str, Any]:
    """``state.json``, checked: its fields, format and checksum."""
    if not (path / STATE).is_file():
        if (path / LEGACY).is_file():
            raise FileError(
                path / LEGACY,
                "holds the run's state in the earlier pickle format, which subquad never reads by itself: a pickle "
                "from elsewhere can run code",
                f"if you trust where this run comes from, convert it with `subquad upgrade-run {path.parent.parent}` "
                "(torch's weights-only reader, which builds tensors and plain data only), then resume it",
            )  # fmt: skip
        raise FileError(path, f"holds no {STATE}: it is not a whole checkpoint", _DAMAGED)
    record = read_json(path / STATE, "checkpoint record", _DAMAGED)
    types = {"format": int, "subquad": str, "sha256": dict, "state": dict, "meta": dict, "checksum": str}
    check_fields(record, path / STATE, types, required=list(types), fix=_DAMAGED)
    if record["format"] != FORMAT:
        raise FileError(
            path / STATE, f"is checkpoint format {record['format']} (subquad {record['subquad']}); subquad "
            f"{__version__} reads format {FORMAT}", f"resume it with subquad {record['subquad']}",
        )  # fmt: skip
    if record["checksum"] != json_checksum({k: v for k, v in record.items() if k != "checksum"}):
        raise FileError(path / STATE, "was changed after it was written (its checksum does not match it)", _DAMAGED)
    return record


def _verify(path: Path, record: dict[str, Any], name: str) -> None:
    if not (path / name).is_file():
        raise FileError(path, f"has no {name}: it is not a whole checkpoint", _DAMAGED)
    if sha256(path / name) != record["sha256"].get(name):
        raise FileError(path / name, f"was changed or damaged after it was written (its SHA-256 is not {STATE}'s)",
                        _DAMAGED)  # fmt: skip


def _encode(value: Any, tensors: dict[str, Tensor]) -> Any:
    """``value`` as JSON, its tensors moved into ``tensors`` and named where they were (``{"$tensor":
    name}``); tuples and dicts with other keys than strings tagged (``$tuple``, ``$dict``) so they
    come back as they were."""
    if isinstance(value, Tensor):
        name = str(len(tensors))
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()
        return {"$tensor": name}
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, tensors) for k, v in value.items()}
        return {"$dict": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"a checkpoint holds tensors, numbers, strings, None, lists, tuples and dicts; got a {type(value).__name__}"
    )


def _decode(value: Any, tensors: dict[str, Tensor], where: Path, used: set[str]) -> Any:
    """The inverse of `_encode`; a malformed entry raises FileError naming ``where``."""
    if isinstance(value, list):
        return [_decode(v, tensors, where, used) for v in value]
    if not isinstance(value, dict):
        return value
    tags = [k for k in value if k.startswith("$")]
    if not tags:
        return {k: _decode(v, tensors, where, used) for k, v in value.items()}
    tag, inner = (tags[0], value[tags[0]]) if len(value) == 1 else (None, None)
    if tag == "$tensor" and isinstance(inner, str) and inner in tensors:
        used.add(inner)
        return tensors[inner]
    if tag == "$tuple" and isinstance(inner, list):
        return tuple(_decode(v, tensors, where, used) for v in inner)
    if tag == "$dict" and isinstance(inner, list) and all(isinstance(p, list) and len(p) == 2 for p in inner):
        pairs = [(_decode(k, tensors, where, used), _decode(v, tensors, where, used)) for k, v in inner]
        with contextlib.suppress(TypeError):  # a key that cannot be one (a list)
            return dict(pairs)
    raise FileError(where, f"holds a malformed entry {json.dumps(value)[:80]}", _DAMAGED)


def upgrade(run: str | Path) -> list[Path]:
    """Convert the checkpoints of ``run`` (a ``subquad train`` or ``distill`` folder) written in the
    earlier pickle format (``state.pt``) to this one; returns the checkpoints converted.

    ``state.pt`` is read by torch's weights-only reader (``torch.load(weights_only=True)``, torch >=
    2.6, whose reader has no known way to run code), which builds tensors and plain data only and
    refuses anything else with the file named. Each checkpoint gains ``state.json`` last (written
    through a rename) and loses ``state.pt`` after, so an upgrade stopped at any moment can be run again.
    """
    folder = Path(run) / "checkpoints"
    if not folder.is_dir():
        raise FileNotFoundError(f"{run} has no checkpoints folder; pass the --out folder of subquad train or distill")
    legacy = sorted(p for p in folder.glob(f"{_PREFIX}*") if (p / LEGACY).is_file())
    if legacy and _torch_version() < (2, 6):
        raise ValueError(
            f"upgrading reads state.pt with torch's weights-only reader, which is safe for files from elsewhere "
            f"from torch 2.6 on; this is torch {torch.__version__}: pip install -U 'torch>=2.6'"
        )
    for path in legacy:
        if not (path / STATE).is_file():
            state = _read_legacy(path / LEGACY)
            try:
                _write_state(path, state)
            except TypeError as error:
                raise FileError(path / LEGACY, f"holds what a checkpoint does not ({error})", _DAMAGED) from error
            _verify(path, _record(path), WEIGHTS)
        (path / LEGACY).unlink()
    return legacy


def _read_legacy(path: Path) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # any refusal or damage of a file from elsewhere: named, never a traceback
        reason = str(error).strip().splitlines()
        reason = next((line for line in reason if "WeightsUnpickler error" in line), reason[0] if reason else "")
        raise FileError(
            path, f"is not plain data: torch's weights-only reader refused it ({reason.strip()[:200]}); nothing in it "
            "ran",
            "a checkpoint subquad wrote holds tensors and plain data only, so this one was changed or is not one",
        ) from error  # fmt: skip
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise FileError(path, "is not a subquad checkpoint's state (a dict with a step)", _DAMAGED)
    return state


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)

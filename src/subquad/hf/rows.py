"""``approx.json``: the settings and rows ``subquad approx`` writes, and the checks a rerun into the
same folder makes of them. The file is data from wherever the folder came from: its settings must
be this run's (each that differs named, before the model loads) and its rows approx's own. The rows
of specs a rerun is not given stay in the file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from subquad.files import FileError, read_json, write_atomic

__all__ = ["kept_rows", "previous_results", "settings_path", "write_rows"]

RESULTS_FIX = "remove it (or pass another --out) to measure every mechanism again"


_FLAGS = {"model": "MODEL", "data": "--data", "tokens": "--window-tokens", "samples": "--windows", "seed": "--seed",
          "device": "--device", "dtype": "--dtype", "decoder": "the model's kind (decoder)"}  # fmt: skip


def kept_rows(saved: Path, previous: dict[str, Any], settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of an earlier run into the same folder, whose settings must be ``settings`` (those
    named there; the model's and the data's paths compared as absolute paths). Rows measured on
    other windows or another model are refused by name, not overwritten."""
    if not previous:
        return []
    was = previous.get("settings")
    if not isinstance(was, dict):
        raise FileError(saved, "holds no settings object: it is not approx's own", RESULTS_FIX)
    same = lambda key, a, b: a == b or (key in ("model", "data") and settings_path(a) == settings_path(b))  # noqa: E731
    changed = [f"{_FLAGS.get(key, key)} {was.get(key)!r} → {value!r}" for key, value in settings.items()
               if not same(key, was.get(key), value)]  # fmt: skip
    if changed:
        raise FileError(saved, f"holds results measured with other settings ({', '.join(changed)})",
                        "pass another --out to keep them, rerun with the earlier values, or remove it to measure "
                        "again with these")  # fmt: skip
    kept = previous.get("rows", [])
    if not isinstance(kept, list) or not all(isinstance(r, dict) and isinstance(r.get("spec"), str) for r in kept):
        raise FileError(saved, "holds rows that are not approx's own", RESULTS_FIX)
    return kept


def settings_path(value: Any) -> Any:
    """A model's or data's path as settings keep it: absolute where it names a file or folder."""
    return os.path.abspath(value) if isinstance(value, str) and os.path.exists(value) else value


def previous_results(path: Path) -> dict[str, Any]:
    """What an earlier run wrote to ``path`` (``{}``: nothing)."""
    return read_json(path, "approx results", RESULTS_FIX) if path.exists() else {}


def write_rows(path: Path, settings: dict[str, Any], rows: list[dict[str, Any]], kept: list[dict[str, Any]]) -> None:
    """``path``: ``rows``, then every row of ``kept`` (an earlier run's) that they do not replace
    (other specs', and this run's not reached yet)."""
    given = {r["spec"] for r in rows}
    rows = [*rows, *(r for r in kept if r["spec"] not in given)]
    write_atomic(path, json.dumps({"settings": settings, "rows": rows}, indent=2))

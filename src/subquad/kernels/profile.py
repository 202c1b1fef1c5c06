"""Tuning profiles: the ``TUNING`` values ``subquad tune`` measured on one machine, used automatically.

The defaults of ``kernels.tuning`` were chosen on one cache hierarchy; the best block sizes differ
between CPUs and thread counts. ``subquad tune`` (``bench.autotune``) times the knobs that matter
on the machine at hand and writes a **profile**: a JSON file in the user's cache folder,
``tuning/<key>.json`` under ``$SUBQUAD_CACHE``, else ``$XDG_CACHE_HOME/subquad``, else
``~/.cache/subquad``. The key names the CPU model, the thread count and the torch version, the
three things a measurement depends on; a profile for another key is never used.

**Used automatically.** Every CPU call (``subquad.call``) looks up the profile for the thread count
set at that moment (a dictionary look-up once the key is known) and applies its values to
``TUNING``. A value the caller set (``tuned(...)``, ``TUNING.x = ...``) is left as the caller set
it: the profile replaces only values still at what the profile layer last put there. Without a
profile, or with ``SUBQUAD_TUNING_PROFILE=off``, the defaults are used, unchanged.
``SUBQUAD_TUNING_PROFILE=PATH`` uses that file whatever its key.

**Untrusted.** A profile is data: JSON, each value checked as ``Tuning`` checks its own (an int ≥ 1
for a known knob; switches are never taken from a profile). A file that does not parse, or holds a
bad value, is not used: one warning names the file and the fix, and the defaults stay.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from subquad.kernels.tuning import TUNING, Tuning

__all__ = ["FORMAT", "Profile", "active", "apply_for_threads", "cache_folder", "cpu_model", "profile_key",
           "profile_path", "read_profile", "write_profile"]  # fmt: skip

FORMAT = 1
ENV = "SUBQUAD_TUNING_PROFILE"
_KNOBS = {f.name for f in fields(Tuning) if not f.metadata.get("switch")}


@dataclass(frozen=True)
class Profile:
    """A profile's values and where they came from (``path`` None: the defaults)."""

    values: dict[str, int] = field(default_factory=dict)
    path: Path | None = None

    def describe(self) -> str:
        if self.path is None:
            return "none (the defaults)"
        changed = ", ".join(f"{k}={v}" for k, v in sorted(self.values.items())) or "no knob changed"
        return f"{self.path} ({changed})"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_folder() -> Path:
    """``$SUBQUAD_CACHE``, else ``$XDG_CACHE_HOME/subquad``, else ``~/.cache/subquad``."""
    if os.environ.get("SUBQUAD_CACHE"):
        return Path(os.environ["SUBQUAD_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "subquad"


def profile_key(threads: int | None = None, cpu: str | None = None, torch_version: str | None = None) -> str:
    """The file name's key: CPU model, thread count and torch version, as a safe slug."""
    cpu = cpu_model() if cpu is None else cpu
    threads = torch.get_num_threads() if threads is None else threads
    version = torch.__version__ if torch_version is None else torch_version
    slug = lambda text: re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-") or "unknown"  # noqa: E731
    return f"{slug(cpu)}_{threads}t_torch-{slug(version)}"


def profile_path(threads: int | None = None) -> Path:
    """Where the profile for this machine at ``threads`` (default: the count set now) lives."""
    return cache_folder() / "tuning" / f"{profile_key(threads)}.json"


def read_profile(path: Path) -> dict[str, int]:
    """A profile file's values, checked: ValueError naming the file, the value and the fix."""
    fix = f"run `subquad tune` again or delete {path}"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"tuning profile {path} cannot be read ({error}); {fix}") from error
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("values"), dict):
        raise ValueError(f"tuning profile {path} is not a format-{FORMAT} profile (a JSON object with 'values'); {fix}")
    values = data["values"]
    unknown = sorted(set(values) - _KNOBS)
    if unknown:
        raise ValueError(f"tuning profile {path} names {unknown}, which are not tuning knobs of this version; {fix}")
    try:
        Tuning(**values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"tuning profile {path}: {error}; {fix}") from error
    return dict(values)


def write_profile(path: Path, values: dict[str, int], record: dict[str, Any]) -> None:
    """Write a profile (checked first), atomically: a stopped write never leaves half a file."""
    unknown = sorted(set(values) - _KNOBS)
    if unknown:
        raise ValueError(f"{unknown} are not tuning knobs a profile may set")
    Tuning(**values)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps({"format": FORMAT, **record, "values": values}, indent=1, sort_keys=True) + "\n")
    os.replace(partial, path)


class _Layer:
    """What the profile layer has applied: per thread count, the profile; and the values it set."""

    def __init__(self) -> None:
        self.threads: int | None = None
        self.setting: str | None = None
        self.profile = Profile()
        self.applied: dict[str, int] = {}
        self.loaded: dict[tuple[str, int], Profile] = {}

    def load(self, setting: str, threads: int) -> Profile:
        if (setting, threads) not in self.loaded:
            self.loaded[setting, threads] = _find(setting, threads)
        return self.loaded[setting, threads]

    def switch(self, profile: Profile) -> None:
        """Apply ``profile``: each knob at the value the layer last set (or its default, where the
        layer set none) takes the profile's value, or goes back to its default."""
        defaults = {f.name: f.default for f in fields(Tuning)}
        for name in set(self.applied) | set(profile.values):
            expected = self.applied.get(name, defaults[name])
            if getattr(TUNING, name) != expected:
                continue  # the caller's own value
            setattr(TUNING, name, profile.values.get(name, defaults[name]))
        self.applied = dict(profile.values)
        self.profile = profile


_LAYER = _Layer()


def _find(setting: str, threads: int) -> Profile:
    if setting == "off":
        return Profile()
    path = Path(setting) if setting else profile_path(threads)
    if not setting and not path.is_file():
        return Profile()
    try:
        return Profile(read_profile(path), path)
    except ValueError as error:
        warnings.warn(f"{error}; using the default tuning", RuntimeWarning, stacklevel=4)
        return Profile()


def apply_for_threads(threads: int | None = None) -> Profile:
    """Apply the profile for ``threads`` (default: the count set now) where it is not applied yet;
    the profile in use. Called by every CPU call: cheap once the key is known."""
    threads = torch.get_num_threads() if threads is None else threads
    setting = os.environ.get(ENV, "")
    if threads != _LAYER.threads or setting != _LAYER.setting:
        _LAYER.switch(_LAYER.load(setting, threads))
        _LAYER.threads, _LAYER.setting = threads, setting
    return _LAYER.profile


def active() -> Profile:
    """The profile in use for the thread count set now (applying it where it is not yet)."""
    return apply_for_threads()


def forget() -> None:
    """Drop what was read, so the next call reads the cache folder again (after ``subquad tune``
    writes a profile, or a test changes the folder); values the layer set go back to defaults."""
    _LAYER.switch(Profile())
    _LAYER.threads = _LAYER.setting = None
    _LAYER.loaded.clear()

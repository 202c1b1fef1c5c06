"""Files a user hands in: read as data, never as code, and every broken one named.

Everything subquad reads from a path it did not just write goes through here: JSON, JSON lines,
TOML, text, safetensors and GGUF headers. Nothing is unpickled. A file that cannot be read, is
empty, truncated, not of the kind expected, or holds values of the wrong kind raises `FileError`,
whose message names the file, says what is wrong and what to do about it; the command line prints
it and exits with status 2.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

__all__ = [
    "FileError",
    "check_fields",
    "check_gguf",
    "json_checksum",
    "load_safetensors",
    "out_folder",
    "read_bytes",
    "read_json",
    "read_jsonl",
    "read_text",
    "read_toml",
    "sha256",
    "write_atomic",
]

_SNIFF = 1 << 16  # bytes looked at to tell text from binary, as git and grep do


class FileError(ValueError):
    """A file (or folder) handed in is unreadable, broken, or does not fit what reads it.

    ``str(error)`` is ``"PATH: what is wrong; what to do"``; ``path`` is the file.
    """

    def __init__(self, path: str | os.PathLike, problem: str, fix: str = "") -> None:
        self.path, self.problem, self.fix = Path(path), problem, fix
        super().__init__(f"{path}: {problem}" + (f"; {fix}" if fix else ""))


def read_bytes(path: str | os.PathLike, what: str = "file") -> bytes:
    """The bytes of ``path``; FileNotFoundError naming ``what`` if it is missing, FileError if it
    cannot be read (a folder, no permission)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no {what} at {path}")
    try:
        return path.read_bytes()
    except OSError as error:
        raise FileError(path, f"cannot be read as a {what} ({error.strerror or error})") from error


def read_text(path: str | os.PathLike, what: str = "text file", fix: str = "", *, errors: str = "strict") -> str:
    """The text of ``path``. Refused with FileError: an empty file, a binary one (a NUL byte in its
    first 64 KiB), and, with ``errors="strict"``, one that is not UTF-8."""
    data = read_bytes(path, what)
    if not data.strip():
        raise FileError(path, f"is empty; a {what} needs content", fix)
    if b"\0" in data[:_SNIFF]:
        raise FileError(path, f"is binary (it holds NUL bytes), not a {what}", fix)
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise FileError(path, f"is not UTF-8 text (byte {error.start}, line {line}): not a {what}", fix) from error


def read_json(path: str | os.PathLike, what: str = "JSON file", fix: str = "", *, kind: type = dict) -> Any:
    """The JSON value of ``path``, which must be a ``kind`` (an object by default)."""
    text = read_text(path, what, fix)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise FileError(
            path, f"is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno})", fix
        ) from error
    if not isinstance(value, kind):
        raise FileError(path, f"holds {_a(_json_type(value))} where a {what} holds {_a(_json_type(kind()))}", fix)
    return value


def read_jsonl(
    path: str | os.PathLike, what: str = "JSON-lines file", fix: str = "", *, partial_last: bool = False
) -> list[tuple[int, dict[str, Any]]]:
    """The objects of a JSON-lines file as (line number, object), blank lines skipped.

    ``partial_last``: a last line that does not parse and has no newline after it is dropped, not
    refused; it is what a process killed while appending leaves (a log being resumed).
    """
    data = read_bytes(path, what)
    if b"\0" in data[:_SNIFF]:
        raise FileError(path, f"is binary (it holds NUL bytes), not a {what}", fix)
    lines = data.split(b"\n")
    records = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            if partial_last and number == len(lines):  # no newline after it: cut off mid-write
                break
            reason = error.msg if isinstance(error, json.JSONDecodeError) else "not UTF-8"
            raise FileError(path, f"line {number} is not valid JSON ({reason})", fix) from error
        if not isinstance(record, dict):
            raise FileError(path, f"line {number} is {_a(_json_type(record))}, not an object", fix)
        records.append((number, record))
    return records


def read_toml(path: str | os.PathLike, what: str = "TOML file", fix: str = "") -> dict[str, Any]:
    """The tables of a TOML file."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    text = read_text(path, what, fix)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise FileError(path, f"is not valid TOML ({error})", fix) from error


def check_fields(
    values: Mapping[str, Any],
    path: str | os.PathLike,
    types: Mapping[str, type | tuple[type, ...]],
    required: Iterable[str] = (),
    where: str = "",
    fix: str = "",
    noun: str = "field",
) -> None:
    """Refuse, naming ``path`` (and ``where`` in it), an object that lacks a ``required`` field, has
    one ``types`` does not list, or one of another type (an int passes for a float, a bool for
    neither)."""
    at = f"{where} " if where else ""
    missing = sorted(set(required) - set(values))
    if missing:
        raise FileError(path, f"{at}lacks {', '.join(map(repr, missing))}", fix)
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise FileError(path, f"{at}has unknown {noun}(s) {unknown}; known: {', '.join(sorted(types))}", fix)
    for name, value in values.items():
        wanted = types[name] if isinstance(types[name], tuple) else (types[name],)
        if not _is_a(value, wanted):
            names = _a(" or ".join(_json_type(t()) if t is not type(None) else "null" for t in wanted))
            raise FileError(path, f"{at}{noun} {name!r} is {_a(_json_type(value))} ({value!r:.40}), not {names}", fix)


def _is_a(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", tuple: "array", str: "string", bool: "boolean", int: "integer",
             float: "number", type(None): "null"}  # fmt: skip
    return names.get(type(value), type(value).__name__)


def load_safetensors(path: str | os.PathLike, what: str = "safetensors file", fix: str = "") -> dict[str, Tensor]:
    """Every tensor of a safetensors file, on the CPU; FileError for a file that is missing its
    header, truncated or otherwise not a safetensors file."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    data = read_bytes(path, what)
    try:
        return load(data)
    except (SafetensorError, ValueError, RuntimeError, TypeError, OverflowError, KeyError) as error:  # KeyError: F4…
        raise FileError(
            path, f"is not a readable safetensors file ({error}); it may be truncated or damaged",
            fix or "copy it again from where it was written",
        ) from error  # fmt: skip


def check_gguf(path: str | os.PathLike) -> None:
    """Refuse a file that does not start as a GGUF file does: the magic ``GGUF`` and a version."""
    head = read_bytes(path, "GGUF file")[:8]
    if head[:4] != b"GGUF":
        raise FileError(
            path, f"is not a GGUF file (it starts with {head[:4]!r}, not b'GGUF')",
            "pass a .gguf model file, or a Hugging Face model folder",
        )  # fmt: skip
    version = int.from_bytes(head[4:8], "little") if len(head) == 8 else None
    if version not in (1, 2, 3):
        raise FileError(path, f"is a GGUF file of unknown version {version}", "pass a GGUF file of version 1 to 3")


def sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def json_checksum(record: Mapping[str, Any]) -> str:
    """The SHA-256 of a JSON object's canonical text (keys sorted, no spaces): the same before it
    is written and after it is read back, whatever the file's layout."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def out_folder(path: str | os.PathLike, flag: str = "--out") -> Path:
    """``path``, an output folder, created if missing; a ValueError naming it where it is a file or
    cannot be made (before any work, so none is lost)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file; pass a folder (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{flag} {path} cannot be made ({error.strerror}); pass a folder you can write") from error
    return path


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename, on disk before the rename:
    a process killed at any moment leaves the old file or the new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)

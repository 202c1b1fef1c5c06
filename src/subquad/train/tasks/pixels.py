"""Sequential image classification: one pixel a token, read from MNIST-style IDX files.

A folder holds the four standard files, plain or gzipped: ``train-images-idx3-ubyte``,
``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``. Debian's
``dataset-fashion-mnist`` installs Fashion-MNIST as such a folder (``dpkg -L dataset-fashion-mnist``
shows where). An image of 28 × 28 becomes a sequence of 784 tokens, its grey levels 0–255.

IDX: a big-endian header, two zero bytes, a type byte (``0x08``: unsigned bytes), the number of
dimensions, then each dimension as a 32-bit integer, then the data.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import torch
from torch import Tensor

from subquad.files import FileError, read_bytes

__all__ = ["FILES", "load_idx", "load_split"]

FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
HINT = (
    "for Fashion-MNIST, `apt install dataset-fashion-mnist` and pass the folder holding its IDX files "
    "(`dpkg -L dataset-fashion-mnist`)"
)


def _find(folder: Path, name: str) -> Path:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{folder} has no {name} (nor {name}.gz); {HINT}")


def load_idx(path: str | Path) -> Tensor:
    """An IDX file of unsigned bytes as a uint8 tensor of its dimensions."""
    path = Path(path)
    raw = read_bytes(path, "IDX file")
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as error:
            raise FileError(path, f"looks like gzip but cannot be decompressed ({error})", "is it complete?") from error
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise FileError(path, "is not an IDX file (it must start with two zero bytes)", HINT)
    if raw[2] != 0x08:
        raise FileError(path, f"holds IDX type {raw[2]:#04x}; only unsigned bytes (0x08) are images or labels", HINT)
    start = 4 + 4 * raw[3]
    if len(raw) < start:
        raise FileError(path, f"ends inside its header ({len(raw)} bytes)", "is it complete?")
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(raw[3])]
    count = 1
    for d in dims:
        count *= d
    if len(raw) - start != count:
        raise FileError(path, f"declares dimensions {dims} ({count} bytes) but holds {len(raw) - start}",
                        "is it complete?")  # fmt: skip
    if count == 0:
        return torch.zeros(dims, dtype=torch.uint8)
    return torch.frombuffer(bytearray(raw[start:]), dtype=torch.uint8).view(*dims)


def load_split(folder: str | Path, split: str) -> tuple[Tensor, Tensor]:
    """``(images (n, H·W) uint8, labels (n,) long)`` of the ``train`` or ``test`` split."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no data folder at {folder}; {HINT}")
    if split not in FILES:
        raise ValueError(f"split must be one of {', '.join(FILES)}, got {split!r}")
    images, labels = (load_idx(_find(folder, name)) for name in FILES[split])
    if images.dim() != 3 or labels.dim() != 1 or images.shape[0] != labels.shape[0]:
        raise FileError(
            folder, f"its images {tuple(images.shape)} and labels {tuple(labels.shape)} do not pair up",
            "need images (n, rows, cols) and labels (n,)",
        )  # fmt: skip
    return images.flatten(1), labels.long()

"""Byte-level language modelling on any file: the data of the ``text`` task.

The file is memory-mapped, never read whole, so a corpus of several GB trains in a few MB of
memory. A gzip file (``.gz``, or dictzip ``.dz`` such as Debian's ``dict-gcide``) is decompressed
once into the cache (``$SUBQUAD_CACHE``, default ``~/.cache/subquad``), then mapped.

**Splits.** The file is cut into blocks of ``block`` bytes (a hundredth of it by default); a
seeded permutation gives each block to train, validation or test in the given fractions, so every
split samples the whole file (a dictionary sorted A to Z would otherwise validate on Z alone).
Adjacent blocks of one split join into runs; a window never crosses from one run into another.

**Batches** are a pure function of (seed, step): training windows are drawn at random offsets by a
generator seeded with both, so a resumed run draws the batches the first run would have, and the
data position is just the step. The whole global batch is drawn the same way on every process; each
rank takes its slice. Evaluation reads fixed, non-overlapping windows.

Metric: bits per byte, the cross-entropy in nats divided by ln 2.
"""

from __future__ import annotations

import gzip
import hashlib
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from subquad.files import FileError

__all__ = ["GCIDE_HINT", "ByteCorpus", "bits_per_byte", "cache_dir"]

SPLITS = ("train", "val", "test")
GCIDE_HINT = (
    "any text file works; for a real corpus that installs offline, `apt install dict-gcide` and pass "
    "the dictionary it installs: --data \"$(dpkg -L dict-gcide | grep 'gcide.dict.dz$')\""
)


def cache_dir() -> Path:
    """Where decompressed and generated data go: ``$SUBQUAD_CACHE``, else ``$XDG_CACHE_HOME/subquad``,
    else ``~/.cache/subquad``."""
    if os.environ.get("SUBQUAD_CACHE"):
        return Path(os.environ["SUBQUAD_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "subquad"


def bits_per_byte(nats: float) -> float:
    """A mean cross-entropy in nats as bits."""
    return nats / math.log(2)


def _is_gzip(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(2) == b"\x1f\x8b"
    except OSError as error:
        raise FileError(path, f"cannot be read ({error.strerror or error})") from error


def _decompressed(path: Path) -> Path:
    """The gzip file ``path`` decompressed into the cache once (keyed by its path, size and mtime),
    written to a temporary file and renamed, so an interrupted run leaves no partial file."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "data" / f"{path.stem}-{key}.bin"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    try:
        with gzip.open(path, "rb") as src, tmp.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (OSError, EOFError) as error:
        tmp.unlink(missing_ok=True)
        raise FileError(path, f"looks like gzip but cannot be decompressed ({error})", "is it complete?") from error
    tmp.replace(out)
    return out


@dataclass(frozen=True)
class _Run:
    start: int
    stop: int


class ByteCorpus:
    """A file of bytes, memory-mapped, cut into seeded train/val/test splits (module docstring).

    Args:
        path: the file; gzip input is decompressed into the cache once.
        seq_len: bytes a model sees per window (a window holds ``seq_len + 1``: inputs and targets).
        fractions: of the blocks given to train, val and test.
        block: bytes per block of the split, at least ``seq_len + 1``; by default a hundredth of
            the file (at most 1 MiB, at least one window), so every split gets several blocks.
        seed: seeds the split and the training windows.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        seq_len: int,
        fractions: tuple[float, float, float] = (0.9, 0.05, 0.05),
        block: int | None = None,
        seed: int = 0,
    ) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no text file at {path}; {GCIDE_HINT}")
        if block is None:
            block = max(seq_len + 1, min(1 << 20, path.stat().st_size // 100))
        if seq_len < 1 or block < seq_len + 1:
            raise ValueError(f"need 1 <= seq_len < block, got seq_len={seq_len}, block={block}")
        if len(fractions) != 3 or min(fractions) < 0 or not math.isclose(sum(fractions), 1.0):
            raise ValueError(f"fractions must be three numbers >= 0 summing to 1 (train, val, test), got {fractions}")
        mapped = _decompressed(path) if _is_gzip(path) else path
        size = mapped.stat().st_size
        with mapped.open("rb") as f:
            head = f.read(1 << 16)
        if not head.strip():
            raise FileError(path, "is empty (or blank): there is no text to learn", GCIDE_HINT)
        if b"\0" in head:
            raise FileError(path, "is binary (it holds NUL bytes), not text", f"pass a text file; {GCIDE_HINT}")
        self.path, self.seq_len, self.seed = path, seq_len, seed
        self.data = torch.from_file(str(mapped), shared=False, size=size, dtype=torch.uint8)
        self.runs = self._split(size, fractions, block, seed)
        for name in SPLITS:
            if fractions[SPLITS.index(name)] > 0 and not self.runs[name]:
                raise FileError(
                    path, f"({size} bytes) holds no {seq_len + 1}-byte window for the {name} split (blocks of "
                    f"{block} bytes, fractions {fractions})",
                    "use a longer file, a shorter --seq-len or smaller blocks",
                )  # fmt: skip

    def _split(self, size: int, fractions: tuple[float, ...], block: int, seed: int) -> dict[str, list[_Run]]:
        blocks = -(-size // block)
        order = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        counts = [round(f * blocks) for f in fractions[1:]]
        owner = {}
        for rank, b in enumerate(order):
            owner[b] = "val" if rank < counts[0] else "test" if rank < counts[0] + counts[1] else "train"
        runs: dict[str, list[_Run]] = {name: [] for name in SPLITS}
        b = 0
        while b < blocks:  # adjacent blocks of one split form a run
            end = b
            while end + 1 < blocks and owner[end + 1] == owner[b]:
                end += 1
            run = _Run(b * block, min((end + 1) * block, size))
            if run.stop - run.start >= self.seq_len + 1:
                runs[owner[b]].append(run)
            b = end + 1
        return runs

    def bytes_in(self, split: str) -> int:
        """How many bytes a split holds."""
        return sum(r.stop - r.start for r in self.runs[split])

    def train_batch(self, step: int, batch: int, rank: int = 0, world: int = 1) -> Tensor:
        """This rank's slice ``(batch / world, seq_len + 1)`` of the global training batch of ``step``:
        a function of (seed, step) only."""
        if batch % world:
            raise ValueError(f"the global batch {batch} must divide between {world} processes")
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) % 2**63)
        runs = self.runs["train"]
        room = torch.tensor([r.stop - r.start - self.seq_len for r in runs], dtype=torch.float64)
        which = torch.multinomial(room, batch, replacement=True, generator=g)  # runs weighted by their windows
        offsets = (torch.rand(batch, generator=g, dtype=torch.float64) * room[which]).long()
        starts = torch.tensor([runs[i].start for i in which.tolist()]) + offsets
        mine = starts[rank * (batch // world) : (rank + 1) * (batch // world)]
        return self._windows(mine)

    def eval_batches(self, split: str, batch: int, max_windows: int | None = None):
        """Fixed non-overlapping windows of ``split``, ``batch`` at a time (the last may be short)."""
        starts = [s for r in self.runs[split] for s in range(r.start, r.stop - self.seq_len, self.seq_len)]
        starts = starts[:max_windows] if max_windows is not None else starts
        for i in range(0, len(starts), batch):
            yield self._windows(torch.tensor(starts[i : i + batch]))

    def _windows(self, starts: Tensor) -> Tensor:
        index = starts[:, None] + torch.arange(self.seq_len + 1)
        return self.data[index].long()

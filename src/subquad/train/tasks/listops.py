"""ListOps (Nangia & Bowman 2018), as in Long Range Arena: nested lists of operations on digits.

A sequence such as ``[MAX 2 9 [MIN 4 7 ] 0 ]`` evaluates to one digit, the label (10 classes).
Generated from its specification, as LRA did:

- operators MAX, MIN, MED (the integer part of the median) and SM (sum mod 10), on digits 0–9;
- a tree of depth at most 10 whose nodes have 2 to 10 arguments; below the maximum depth each
  argument is itself an operation with probability 0.25, else a digit; the root is an operation;
- trees kept when their length in tokens lies in ``[min_length, max_length]`` (LRA: 500 to 2000,
  about 8% of trees, mean length about 1,060), deduplicated across all splits;
- sizes 96k / 2k / 2k by default; ``preset="small"`` is 2k / 200 / 200 for quick runs.

The closing brackets are kept: a known bug of one public LRA pipeline dropped them, which makes
some expressions ambiguous. Tokens: 0 is padding, then the ten digits, the four operators (an
opening bracket with its operator, as in LRA's ``[MAX``) and ``]``. A split is generated once per
(seed, sizes, lengths), saved to the cache (``subquad.train.tasks.text.cache_dir()``) with an atomic
rename, as safetensors, and loaded from there afterwards (a damaged cache file is generated again).
"""

from __future__ import annotations

import hashlib
import os
import random
import statistics
import warnings
from pathlib import Path

import torch
from torch import Tensor

from subquad.train.tasks.text import cache_dir

__all__ = ["OPERATORS", "PRESETS", "VOCAB", "evaluate", "generate", "load_splits", "pad_batch", "tokens"]

OPERATORS = ("[MAX", "[MIN", "[MED", "[SM")
VOCAB = ("<pad>", *(str(d) for d in range(10)), *OPERATORS, "]")
_ID = {t: i for i, t in enumerate(VOCAB)}
PRESETS = {"lra": (96_000, 2_000, 2_000), "small": (2_000, 200, 200)}
MAX_DEPTH, MAX_ARGS, OPERATION = 10, 10, 0.25


def _tree(rng: random.Random, depth: int) -> list | int:
    """An operation node ``[op, child, ...]``, or a digit."""
    if depth > 0 and (depth >= MAX_DEPTH or rng.random() >= OPERATION):
        return rng.randrange(10)
    return [rng.choice(OPERATORS), *(_tree(rng, depth + 1) for _ in range(rng.randint(2, MAX_ARGS)))]


def _value(node: list | int) -> int:
    if isinstance(node, int):
        return node
    op, args = node[0], [_value(a) for a in node[1:]]
    if op == "[MAX":
        return max(args)
    if op == "[MIN":
        return min(args)
    if op == "[MED":
        return int(statistics.median(args))
    return sum(args) % 10


def _flat(node: list | int, out: list[str]) -> list[str]:
    if isinstance(node, int):
        out.append(str(node))
    else:
        out.append(node[0])
        for a in node[1:]:
            _flat(a, out)
        out.append("]")
    return out


def generate(count: int, seed: int, min_length: int = 500, max_length: int = 2000, seen: set | None = None):
    """``count`` distinct (token strings, label) pairs with lengths in ``[min_length, max_length]``,
    none in ``seen`` (which collects them)."""
    rng, seen = random.Random(seed), set() if seen is None else seen
    out: list[tuple[tuple[str, ...], int]] = []
    while len(out) < count:
        node = _tree(rng, 0)
        toks = tuple(_flat(node, []))
        if min_length <= len(toks) <= max_length and toks not in seen:
            seen.add(toks)
            out.append((toks, _value(node)))
    return out


def evaluate(toks: list[str] | tuple[str, ...]) -> int:
    """The value of a token sequence, read left to right with a stack (independent of the
    generator's trees); raises ValueError on a malformed sequence."""
    stack: list[list] = []
    result = None
    for t in toks:
        if t in OPERATORS:
            stack.append([t])
        elif t == "]":
            if not stack:
                raise ValueError("']' closes nothing")
            op, *args = stack.pop()
            if not args:
                raise ValueError(f"{op} has no arguments")
            value = _value([op, *args])
            if stack:
                stack[-1].append(value)
            else:
                result = value
        elif t.isdigit() and len(t) == 1 and stack:
            stack[-1].append(int(t))
        else:
            raise ValueError(f"unexpected token {t!r}")
    if stack or result is None:
        raise ValueError("the sequence does not close its outermost operation")
    return result


def tokens(toks: tuple[str, ...] | list[str]) -> Tensor:
    """Token strings as ids ``(len,)``."""
    return torch.tensor([_ID[t] for t in toks], dtype=torch.long)


def load_splits(
    preset: str = "lra", seed: int = 0, min_length: int = 500, max_length: int = 2000,
    sizes: tuple[int, int, int] | None = None,
) -> dict[str, tuple[list[Tensor], Tensor]]:  # fmt: skip
    """train / val / test as (list of token tensors, labels ``(n,)``), generated once and cached."""
    if sizes is None:
        if preset not in PRESETS:
            raise ValueError(f"unknown ListOps preset {preset!r}; choose one of {', '.join(PRESETS)}")
        sizes = PRESETS[preset]
    if not 1 <= min_length <= max_length or min(sizes) < 0:
        raise ValueError(f"need 1 <= min_length <= max_length and sizes >= 0, got {min_length}, {max_length}, {sizes}")
    key = hashlib.sha256(f"listops:{seed}:{sizes}:{min_length}:{max_length}".encode()).hexdigest()[:16]
    path = cache_dir() / "data" / f"listops-{key}.safetensors"
    cached = _read_cache(path)
    if cached is not None:
        return cached
    seen: set = set()
    splits = {}
    for i, (name, n) in enumerate(zip(("train", "val", "test"), sizes)):
        pairs = generate(n, seed * 3 + i, min_length, max_length, seen)
        splits[name] = ([tokens(t) for t, _ in pairs], torch.tensor([label for _, label in pairs], dtype=torch.long))
    _write_cache(path, splits)
    return splits


_SPLITS = ("train", "val", "test")


def _write_cache(path: Path, splits: dict[str, tuple[list[Tensor], Tensor]]) -> None:
    """The splits as safetensors (each split's sequences end to end, their lengths and labels), written
    through an atomic rename; nothing is cached where safetensors is not installed."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        return
    tensors = {}
    for name, (sequences, labels) in splits.items():
        tensors[f"{name}.tokens"] = torch.cat([*sequences, torch.zeros(0, dtype=torch.long)]).to(torch.uint8)
        tensors[f"{name}.lengths"] = torch.tensor([len(s) for s in sequences], dtype=torch.long)
        tensors[f"{name}.labels"] = labels
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file(tensors, str(tmp))
    tmp.replace(path)


def _read_cache(path: Path) -> dict[str, tuple[list[Tensor], Tensor]] | None:
    """The cached splits, or None where there is no cache, or it is damaged (then it is generated again)."""
    if not path.is_file():
        return None
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        splits = {}
        for name in _SPLITS:
            flat, lengths, labels = (tensors[f"{name}.{part}"] for part in ("tokens", "lengths", "labels"))
            fits = int(lengths.sum()) == flat.numel() and len(lengths) == len(labels)
            if not fits or (flat.numel() and int(flat.max()) >= len(VOCAB)):
                raise ValueError("the parts do not fit together")
            splits[name] = (list(flat.long().split(lengths.tolist())), labels.long())
        return splits
    except Exception as error:  # a cache: anything wrong with it means generating the data again
        warnings.warn(f"the ListOps cache {path} is damaged ({error}); generating it again", RuntimeWarning,
                      stacklevel=3)  # fmt: skip
        return None


def pad_batch(sequences: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Token tensors padded to the longest: ``(B, N)`` ids and the bool mask of real tokens."""
    n = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), n, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = s
    return ids, ids != 0

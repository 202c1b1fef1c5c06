"""Benchmark inputs: iid Gaussians, and queries and keys with real cluster structure.

On iid Gaussian queries and keys, attention is close to uniform and shows no structure for a
clustering or routing mechanism to find, so approximation errors there are pessimistic. Real
activations cluster. ``clustered`` draws queries and keys around a few shared centres per head, so
that each query attends mostly to the keys of its own centre:

    centre_c ~ N(0, I_D),   q_i = centre_{z_i} + spread · ε_i,   k_j = centre_{y_j} + spread · ε'_j

with z, y uniform over ``centres`` and spread 0.5. At D = 64 and scale D^-1/2 a query's logits for
keys of its own centre are about 8 above the others, with a spread of about 1 among them.

A model's own queries, keys and values (``subquad approx`` captures them from its layers; a user may
save any) come from a safetensors file (``--inputs``): floating-point tensors ``q`` ``(B, H, N, D)``,
``k`` ``(B, Hk, N, D)`` and ``v`` ``(B, Hk, N, Dv)``, Hk dividing H (grouped-query), or each with a
leading dimension of sets (layers) ``(S, B, H, N, D)``, which a timed call runs one after another.
The file is read as data only.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor

from subquad.files import FileError, load_safetensors

__all__ = ["INPUT_KINDS", "InputShape", "input_shape", "make_qkv", "read_inputs", "save_inputs"]

INPUT_KINDS = ("iid", "clustered")


def make_qkv(
    kind: str,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    *,
    centres: int = 16,
    spread: float = 0.5,
    kv_heads: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Queries, keys and values of ``shape`` ``(B, H, N, D)``, drawn reproducibly from ``seed``;
    with ``kv_heads``, keys and values ``(B, kv_heads, N, D)``, each serving ``H / kv_heads``
    consecutive query heads (clustered: around its own centres)."""
    if kind not in INPUT_KINDS:
        raise ValueError(f"unknown input kind {kind!r}; choose one of {', '.join(INPUT_KINDS)}")
    generator = torch.Generator().manual_seed(seed)
    B, H, N, D = shape
    Hk = kv_heads or H
    if H % Hk:
        raise ValueError(f"kv_heads must divide the {H} heads, got {kv_heads}: each serves H / kv_heads query heads")
    if kind == "iid":
        q, k, v = (torch.randn(s, generator=generator, dtype=dtype) for s in (shape, (B, Hk, N, D), (B, Hk, N, D)))
        return q.to(device), k.to(device), v.to(device)
    centre = torch.randn(B, Hk, centres, D, generator=generator)  # (B, Hk, C, D)
    q = _around(centre.repeat_interleave(H // Hk, dim=1), N, spread, generator)
    k = _around(centre, N, spread, generator)
    v = torch.randn(B, Hk, N, D, generator=generator)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))  # type: ignore[return-value]


def _around(centre: Tensor, n: int, spread: float, generator: torch.Generator) -> Tensor:
    """``n`` points per (batch, head), each at a uniformly chosen centre plus Gaussian noise."""
    B, H, C, D = centre.shape
    which = torch.randint(C, (B, H, n), generator=generator)  # (B, H, N)
    points = torch.gather(centre, 2, which.unsqueeze(-1).expand(B, H, n, D))  # (B, H, N, D)
    return points + spread * torch.randn(B, H, n, D, generator=generator)


class InputShape(NamedTuple):
    """The shape of an inputs file's sets: each ``(batch, heads, length, head_dim)`` queries,
    ``(batch, kv_heads, length, head_dim)`` keys and ``(batch, kv_heads, length, value_dim)`` values."""

    sets: int
    batch: int
    heads: int
    kv_heads: int
    length: int
    head_dim: int
    value_dim: int


_FIX = (
    "save floating-point tensors q (B, H, N, D), k (B, Hk, N, D) and v (B, Hk, N, Dv), or each (S, B, ...) for S "
    "sets (subquad.bench.inputs.save_inputs)"
)
# The element types torch reads from safetensors that can hold attention's inputs.
_FLOATS = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def input_shape(path: str | os.PathLike) -> InputShape:
    """The shape of the queries, keys and values in ``path`` (read from its header only); FileError
    naming what does not fit."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as error:
        raise ImportError("reading --inputs needs safetensors: pip install 'subquad[bench]'") from error
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no inputs file at {path}")
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            names = set(f.keys())
            slices = {n: f.get_slice(n) for n in ("q", "k", "v") if n in names}
            shapes = {n: tuple(x.get_shape()) for n, x in slices.items()}
            types = {n: x.get_dtype() for n, x in slices.items()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise FileError(path, f"is not a readable safetensors file ({error})", _FIX) from error
    shape = _check_shapes(path, shapes)
    for name, kind in types.items():
        if kind not in _FLOATS:
            raise FileError(path, f"holds {name} as {kind}, not a floating-point type ({', '.join(_FLOATS)})", _FIX)
    return shape


def _check_shapes(path: str | os.PathLike, shapes: dict[str, tuple[int, ...]]) -> InputShape:
    missing = [n for n in ("q", "k", "v") if n not in shapes]
    if missing:
        raise FileError(path, f"holds no tensor {', '.join(missing)}", _FIX)
    q, k, v = shapes["q"], shapes["k"], shapes["v"]
    if len(q) not in (4, 5) or len(k) != len(q) or len(v) != len(q):
        raise FileError(path, f"holds q, k, v of shapes {list(q)}, {list(k)}, {list(v)}: all 4-D, or all 5-D", _FIX)
    if len(q) == 4:
        q, k, v = (1, *q), (1, *k), (1, *v)
    if min(q + k + v) < 1:
        raise FileError(path, f"holds q {list(q)}, k {list(k)}, v {list(v)}: a dimension of size 0", _FIX)
    if k[:4] != v[:4] or (q[0], q[1], q[3], q[4]) != (k[0], k[1], k[3], k[4]) or q[2] % k[2]:
        raise FileError(
            path, f"holds q {list(q)}, k {list(k)}, v {list(v)}: k and v must have the same heads, share q's sets, "
            "batch and length, k q's head dim, and their number of heads must divide q's", _FIX,
        )  # fmt: skip
    return InputShape(q[0], q[1], q[2], k[2], q[3], q[4], v[4])


def read_inputs(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor, Tensor]:
    """The queries, keys and values of ``path``, each ``(S, B, heads, N, D)``, as ``dtype`` on ``device``."""
    tensors = load_safetensors(path, "inputs file", _FIX)
    shape = _check_shapes(path, {n: tuple(t.shape) for n, t in tensors.items()})
    out = []
    for name in ("q", "k", "v"):
        x = tensors[name]
        if not x.is_floating_point():
            raise FileError(path, f"holds {name} as {x.dtype}, not a floating-point tensor", _FIX)
        out.append(x.reshape(shape.sets, *x.shape[-4:]).to(device=device, dtype=dtype).contiguous())
    return out[0], out[1], out[2]


def save_inputs(path: str | os.PathLike, q: Tensor, k: Tensor, v: Tensor) -> None:
    """Write queries, keys and values for ``--inputs``: ``(B, H, N, D)`` and ``(B, Hk, N, D)``, or
    with a leading dimension of sets."""
    from safetensors.torch import save_file

    tensors = {n: x.detach().contiguous().cpu() for n, x in zip("qkv", (q, k, v))}
    _check_shapes(path, {n: tuple(x.shape) for n, x in tensors.items()})
    save_file(tensors, os.fspath(path))

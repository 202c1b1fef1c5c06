"""FlexAttention for the mask mechanisms on CUDA: ``local`` (with sinks), ``sparse`` and ``pattern``.

Each of those mechanisms is a ``mask_mod`` (``subquad.masks``). On a CUDA device their ``fused``
kernel is torch's ``flex_attention``, compiled, forward and backward, under a ``BlockMask`` built
from that mask_mod: only the 128 × 128 tiles the mask touches are computed, and the mask is
evaluated element by element only on tiles it cuts. Off CUDA nothing changes: the block-sparse
engine (``kernels.blocksparse``) runs, as it does on CUDA for ``kernel="eager"``/``"native"``,
with ``TUNING.flex = 0``, and for inputs flex does not take (``unsupported``).

Choices, and why:

- **Block masks are built once per shape** and kept (``_MASKS``, the last ``_KEPT`` of them): a
  layer calls with the same sizes again and again, and building one evaluates the mask at every
  (query, key) pair (compiled on CUDA, so no L × S tensor is made). A key padding mask is data, so
  a padded call builds its own mask with the padding as one more term (``masks.padding_mask``),
  per batch row, and keeps none; nor is one kept for a single query (a decoding step: each has
  another length).
- **Recompiles.** ``torch.compile`` specialises on the first length (and window, stride…) it
  sees and compiles a dynamic kernel at the second (its automatic dynamic shapes), so a model run
  at many lengths compiles twice per mask, not once per length. Each mask of different code, and
  each grad mode, is a compile of its own, and past torch's limit of 8 per function (a model with
  local and sparse layers, causal and not, trained and evaluated, reaches it) torch would run flex
  uncompiled, materialising every score. So subquad compiles functions of its own (their compiles
  are not a caller's ``torch.compile(flex_attention)``'s), allows them ``_RECOMPILES`` while its
  calls run (``_recompiles_allowed``: the limit is put back after each, nothing global kept), and
  compiles them ``fullgraph``: past that limit torch raises instead of running uncompiled, and the
  call runs on the block engine, with one warning.
- **What flex does not take runs on the engine:** float64 (the engine's reference dtype), head
  dims other than 16, 32, 64, 128 or 256 or differing between keys and values, and a torch
  without FlexAttention.
- Rows whose mask leaves no key come back as zeros, as the contract asks; FlexAttention returns
  exactly that.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from subquad.kernels.tuning import TUNING
from subquad.masks import MaskMod, and_masks, padding_mask

__all__ = ["Part", "masked_attention", "union_attention", "unsupported", "usable"]

DEVICES = ("cuda",)  # where the fused kernel is flex; tests add "cpu" to run its forward eagerly
COMPILED = ("cuda",)  # where flex and the mask builder run compiled; tests add "cpu" (backend "eager")
BACKEND = "inductor"
_LOCK = threading.Lock()  # the kept masks and the raised recompile limit, between threads
_THREAD = threading.local()  # this thread's calls running (depth) and the limit it found (saved)
_ACTIVE: list[Any] = [0, None]  # calls running in all threads, and the limit before the first of them
_KEPT = 32  # block masks kept: a model's distinct (mask, length) pairs, each O((L/128)·(S/128)) ints
_MASKS: OrderedDict[tuple, Any] = OrderedDict()
_RECOMPILES = 64  # compiled masks × grad modes × (static, dynamic) one process may hold
_HEAD_DIMS = (16, 32, 64, 128, 256)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _flex() -> tuple[Any, Any] | None:
    """torch's ``(flex_attention, create_block_mask)``, or None where this torch has none."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return flex_attention, create_block_mask


def unsupported(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Why flex cannot compute this call, or None where it can."""
    if _flex() is None:
        return f"torch {torch.__version__} has no FlexAttention"
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype} (flex takes float16, bfloat16 and float32)"
    D, Dv = q.shape[-1], v.shape[-1]
    if D != Dv or D not in _HEAD_DIMS:
        return f"head dims D={D}, Dv={Dv} (flex takes equal dims of {', '.join(map(str, _HEAD_DIMS))})"
    return None


def usable(q: Tensor, k: Tensor, v: Tensor, kernel: str) -> bool:
    """Whether a mask mechanism's call runs on flex: the fused kernel, on a CUDA device, with
    ``TUNING.flex`` on, and inputs flex takes."""
    return kernel == "fused" and bool(TUNING.flex) and q.device.type in DEVICES and unsupported(q, k, v) is None


class Part(NamedTuple):
    """One of the disjoint key sets of a pattern: its mask_mod (raw indices, query i at i), what
    decides it besides (L, S) and the device (None: built for one call), and its layout: ``stride``
    0 keeps positions in order; ``l`` regroups them by residue mod l (``_regroup``), so that the
    Sparse Transformer's column step, which meets every block in order, is block-diagonal."""

    mask_mod: MaskMod
    key: Hashable | None
    stride: int = 0


def masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_mod: MaskMod,
    key: Hashable | None,
    key_padding_mask: Tensor | None,
    scale: float | None,
    enable_gqa: bool,
    heads_vary: bool = False,
    batch_varies: bool = False,
) -> Tensor | None:
    """Softmax attention of q ``(B, H, L, D)`` over k, v ``(B, Hkv, S, D)`` under ``mask_mod``.

    Args:
        mask_mod: which keys each query sees (``subquad.masks``), raw indices, query i at i.
        key: what decides the mask besides (L, S) and the device (e.g. a frozen config): its block
            mask is built once and kept; None builds it for this call only (a user's function).
        key_padding_mask: bool ``(B, S)``, True marks a real key; a mask term of the call's own.
        heads_vary, batch_varies: whether the mask reads ``h`` or ``b``.

    Returns:
        ``(B, H, L, D)``; zero rows for queries that see no key. None where torch refuses another
        compile (``union_attention``): the caller's engine runs.
    """
    parts = [Part(mask_mod, key)]
    return union_attention(q, k, v, parts, key_padding_mask, scale, enable_gqa, heads_vary, batch_varies)


def union_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    parts: Sequence[Part],
    key_padding_mask: Tensor | None,
    scale: float | None,
    enable_gqa: bool,
    heads_vary: bool = False,
    batch_varies: bool = False,
) -> Tensor | None:
    """One softmax over the union of ``parts`` (disjoint key sets): a flex call per part, joined by
    their log-sum-exps (``_merge``, differentiable through both). Arguments as ``masked_attention``.
    None where torch refuses another compile (``_RECOMPILES`` reached): the caller's engine runs."""
    lse = len(parts) > 1
    try:
        done = [_part(q, k, v, p, key_padding_mask, scale, enable_gqa, heads_vary, batch_varies, lse) for p in parts]
    except _limit_hit():
        _warn_limit()
        return None
    return done[0][0].contiguous() if not lse else _merge(done).to(q.dtype)  # regrouped: a slice


def _part(q, k, v, part: Part, key_padding_mask, scale, enable_gqa, heads_vary, batch_varies, lse):
    """``(out, lse or None)`` of one part, in the queries' order."""
    mask_mod, L, S = part.mask_mod, q.shape[2], k.shape[2]
    key = None if part.key is None or L == 1 else (part.key, part.stride, L, S)  # a decoding step: not kept
    if key_padding_mask is not None:
        mask_mod, key, batch_varies = and_masks(mask_mod, padding_mask(key_padding_mask)), None, True
    if part.stride:
        mask_mod = _regrouped(mask_mod, part.stride, L, S)
        q, k, v = (_regroup(x, part.stride) for x in (q, k, v))
    shape = (q.shape[0] if batch_varies else None, q.shape[1] if heads_vary else None, q.shape[2], k.shape[2])
    block_mask = _block_mask(mask_mod, key, shape, q.device)
    kwargs = {"block_mask": block_mask, "scale": scale, "enable_gqa": enable_gqa, **_lse_request(lse)}
    if q.device.type not in COMPILED:  # the tests' CPU runs: flex's eager forward
        result = _flex()[0](q, k, v, **kwargs)
    else:
        with _recompiles_allowed():
            result = _compiled()(q, k, v, **kwargs)
    out, logsumexp = (result[0], getattr(result[1], "lse", result[1])) if lse else (result, None)
    if part.stride:
        out = _ungroup(out, part.stride, L)
        logsumexp = None if logsumexp is None else _ungroup(logsumexp[..., None], part.stride, L)[..., 0]
    return out, logsumexp


def _merge(done: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Σ_p out_p · exp(lse_p − lse) with lse = log Σ_p exp(lse_p), in float32: the softmax over the
    parts' union. A part with no key for a row has lse −inf and weight 0; a row no part reaches is 0.
    The shift by the largest lse is detached (it cancels), so no gradient meets −inf − (−inf)."""
    outs, lses = zip(*done)
    lses = [x.float() for x in lses]
    top = torch.stack(lses).amax(0).detach()
    top = torch.where(torch.isfinite(top), top, 0.0)
    weights = [torch.exp(x - top) for x in lses]  # (B, H, L)
    total = sum(weights)
    total = torch.where(total > 0, total, 1.0)
    return sum(o.float() * (w / total)[..., None] for o, w in zip(outs, weights))


def _regroup(x: Tensor, stride: int) -> Tensor:
    """Positions regrouped by residue: ``(B, H, N, D)`` → ``(B, H, l·n, D)`` with n = ⌈N/l⌉, row
    ``r·n + a`` holding position ``a·l + r`` (zeros past N)."""
    B, H, N, D = x.shape
    n = -(-N // stride)
    x = torch.nn.functional.pad(x, (0, 0, 0, n * stride - N))
    return x.view(B, H, n, stride, D).transpose(2, 3).reshape(B, H, n * stride, D)


def _ungroup(x: Tensor, stride: int, N: int) -> Tensor:
    """``_regroup``'s inverse on ``(B, H, l·n, D)``: positions back in order, the first N."""
    B, H, M, D = x.shape
    return x.view(B, H, stride, M // stride, D).transpose(2, 3).reshape(B, H, M, D)[:, :, :N]


def _regrouped(mask_mod: MaskMod, stride: int, L: int, S: int) -> MaskMod:
    """``mask_mod`` on regrouped indices (``_regroup`` of queries and keys); rows and keys past the
    ends are masked (their positions clamped, so a mask reading a tensor by index stays in it)."""
    nq, nk = -(-L // stride), -(-S // stride)

    def mask_mod_regrouped(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        query = (q_idx % nq) * stride + q_idx // nq
        key = (kv_idx % nk) * stride + kv_idx // nk
        inside = (query < L) & (key < S)
        return inside & mask_mod(b, h, query.clamp(max=L - 1), key.clamp(max=S - 1))

    return mask_mod_regrouped


def _lse_request(lse: bool) -> dict[str, Any]:
    """flex's argument asking for the log-sum-exp: ``return_aux`` where torch has it (from 2.9;
    ``return_lse`` is deprecated there), else ``return_lse``."""
    if not lse:
        return {}
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


@contextlib.contextmanager
def _recompiles_allowed() -> Iterator[None]:
    """The recompile limit raised to ``_RECOMPILES`` (its name before torch 2.7:
    ``cache_size_limit``) while subquad's calls run, and put back when a thread's last one ends
    (``config.patch`` costs 0.1 ms a call). torch keeps the value per thread in recent versions
    and for the process in older ones: each thread puts back what it found, and a thread that
    finds the value another thread raised puts back the value from before the first raise."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    entered = False
    try:
        with _LOCK:
            if not getattr(_THREAD, "depth", 0):
                found = getattr(config, name)
                raised = _ACTIVE[0] and found == max(_RECOMPILES, _ACTIVE[1])  # another thread's raise
                if not _ACTIVE[0]:
                    _ACTIVE[1] = found
                _THREAD.saved = _ACTIVE[1] if raised else found
                setattr(config, name, max(_RECOMPILES, _THREAD.saved))
            _THREAD.depth = getattr(_THREAD, "depth", 0) + 1
            _ACTIVE[0] += 1
            entered = True
        yield
    finally:
        if entered:
            with _LOCK:
                _THREAD.depth -= 1
                _ACTIVE[0] -= 1
                if not _THREAD.depth:
                    setattr(config, name, _THREAD.saved)


def _block_mask(mask_mod: MaskMod, key: Hashable | None, shape: tuple, device: torch.device) -> Any:
    """The BlockMask of ``mask_mod`` at ``shape`` = (B or None, H or None, L, S): kept by ``key``."""
    kept = None if key is None else (key, shape, str(device))
    with _LOCK:
        block_mask = None if kept is None else _MASKS.get(kept)
        if block_mask is not None:
            _MASKS.move_to_end(kept)
            return block_mask
    if device.type not in COMPILED:  # the tests' CPU runs
        block_mask = _flex()[1](mask_mod, *shape, device=device)
    else:  # compiled, the mask is evaluated tile by tile: no (L, S) tensor
        with _recompiles_allowed():
            block_mask = _compiled_builder()(mask_mod, *shape, device=device)
    if kept is not None:
        with _LOCK:
            _MASKS[kept] = block_mask
            while len(_MASKS) > _KEPT:
                _MASKS.popitem(last=False)
    return block_mask


@functools.cache
def _compiled_builder() -> Any:
    """``create_block_mask`` under ``torch.compile`` in a function of subquad's own (its compiles
    are its own), made once: what ``create_block_mask``'s deprecated ``_compile`` did, the mask
    evaluated tile by tile."""
    create_block_mask = _flex()[1]

    def build(mask_mod: MaskMod, B: int | None, H: int | None, L: int, S: int, device: torch.device) -> Any:
        return create_block_mask(mask_mod, B, H, L, S, device=device)

    return torch.compile(build, fullgraph=True, backend=BACKEND)


@functools.cache
def _compiled() -> Any:
    """``flex_attention`` under ``torch.compile``, likewise (its eager form materialises the scores)."""
    flex_attention = _flex()[0]

    def attend(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:
        return flex_attention(q, k, v, **kwargs)

    return torch.compile(attend, fullgraph=True, backend=BACKEND)


def _limit_hit() -> tuple[type[Exception], ...]:
    """What torch raises past the recompile limit of a ``fullgraph`` compile (named for the cache
    size limit in older versions)."""
    names = ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
    return tuple(getattr(torch._dynamo.exc, n) for n in names if hasattr(torch._dynamo.exc, n))


def _warn_limit() -> None:
    warnings.warn(
        f"FlexAttention has compiled {_RECOMPILES} masks in this process (torch's recompile limit, raised to that for "
        "subquad's calls), so this call of local, sparse or pattern runs on the block engine (slower on a GPU); "
        "fewer distinct masks, lengths or dtypes per process avoid it",
        RuntimeWarning,
        stacklevel=4,
    )

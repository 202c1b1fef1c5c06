"""Containment: what a padded or future position holds never reaches a real output.

Every mechanism excludes padded keys and future positions with masks: a zero weight, a ``-inf``
score, a cut tile. Against finite content that exclusion is exact (``0 · x = 0``), but a NaN or an
inf defeats it (``0 · NaN = NaN``), and real batches carry both in their padding (uninitialised
buffers, overflowed fp16 activations) and in positions a causal call must not look at.

``contained`` runs a mechanism so that such content cannot reach a real output, nor a gradient,
whatever the mechanism does inside:

- **Check**: when every entry of q, k, v and the position-aligned extra tensors is finite,
  run the mechanism on them as they are: its masks exclude finite content exactly, in the forward
  and in the backward. The check is one read of each input (a sum: a NaN or inf entry always
  makes it non-finite; an overflow only sends the call down the safe path).
  Off the CPU the check makes the host wait for the device (one read of one number), so it runs
  there only on large inputs (``check_from`` elements in q, k and v together or more; callers pass
  ``TUNING.contain_check``), where sanitising costs far more (at 64k positions on an H200, 3 of
  local's 6 ms in causal form), and never while a CUDA graph is captured or ``torch.compile``
  traces (a host wait breaks both).
- **Sanitise** (when an entry is not finite, and off the CPU on smaller inputs): run it on copies
  of the inputs whose padded positions and non-finite entries are zero, then write NaN into every
  output that may depend on a non-finite entry at a real position:

  - a query's (or a query-aligned extra tensor's) entry: that query's output (for a mechanism that
    groups its queries, as for a key: its content reaches the others);
  - a key's or value's (or a key-aligned extra's) entry at position p: in causal form, every output
    at position p or later; otherwise every output of that batch row.

  All heads of the row are marked, as some mechanisms mix heads (class softmax, routers).

So a NaN at a real position is never hidden behind a finite output that depends on it, and it
reaches no output before it (causal) and no other batch row; padded content reaches nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from subquad.registry import KEY, QUERY

__all__ = ["KEY", "QUERY", "checks_first", "contained"]


Run = Callable[[Tensor, Tensor, Tensor, dict], Tensor]


def contained(
    run: Run,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    tensors: dict,
    *,
    positions: Mapping[str, str],
    key_padding_mask: Tensor | None,
    query_padding_mask: Tensor | None,
    is_causal: bool,
    uses_qk: bool = True,
    groups_queries: bool = False,
    check_from: int,
) -> Tensor:
    """``run(q, k, v, tensors)`` with padded and future content kept out of real outputs.

    Args:
        run: the mechanism, called with (possibly sanitised) inputs and extra tensors.
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, Dv)``, already validated.
        tensors: the extra keyword arguments (extra tensors, masks, callables).
        positions: for each extra tensor aligned with positions, ``QUERY`` or ``KEY``: its last
            dimension runs over the queries or the keys.
        key_padding_mask, query_padding_mask: bool ``(B, S)`` and ``(B, L)``, True = real.
        is_causal: the causal form: query ``i`` sits at key position ``i + S - L``.
        uses_qk: False for a mechanism that reads only the shapes of q and k: they are not checked.
        groups_queries: a query's content reaches the outputs of others (clusters, balanced tiles),
            so a non-finite query entry spreads as a key's does.
        check_from: off the CPU, the elements of q, k and v together from which the inputs are
            checked before they are sanitised (module docstring).

    Returns:
        ``run``'s output, with NaN where a non-finite real entry may reach (module docstring).
    """
    if not (is_causal or key_padding_mask is not None or query_padding_mask is not None):
        return run(q, k, v, tensors)  # no position is padded or in the future
    extras = [tensors.get(name) for name in positions]
    checked = ([q, k] if uses_qk else []) + [v, *(x for x in extras if isinstance(x, Tensor) and x.is_floating_point())]
    if checks_first(q, k, v, check_from) and _all_finite(checked, together=q.device.type != "cpu"):
        return run(q, k, v, tensors)
    return _sanitised(
        run, q, k, v, tensors, positions, key_padding_mask, query_padding_mask, is_causal, uses_qk, groups_queries
    )


def checks_first(q: Tensor, k: Tensor, v: Tensor, check_from: int) -> bool:
    """Whether a call checks its inputs before it sanitises (module docstring): always on the CPU;
    off it from ``check_from`` elements of q, k and v together (a decoding step's cache counts), and
    never while a CUDA graph is captured or ``torch.compile`` traces."""
    if q.device.type == "cpu":
        return True
    if q.numel() + k.numel() + v.numel() < check_from or torch.compiler.is_compiling():
        return False
    return not (q.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _all_finite(xs: list[Tensor], together: bool = False) -> bool:
    """Whether every entry is finite. A sum of finite numbers can overflow (then this says no and
    the caller takes the safe path), but a NaN or inf entry always makes the sum non-finite. One
    sum per tensor read back as a number (on the CPU: fewer operations than adding them on the
    device), or, ``together`` (off the CPU), all of them in one read, so the host waits once."""
    sums = [x.sum(dtype=torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x.sum() for x in xs]
    if together and sums:
        return bool(torch.isfinite(torch.stack([x.to(sums[0].dtype) for x in sums])).all())
    return all(math.isfinite(x.item()) for x in sums)


def _clean(x: Tensor, real: Tensor | None, dim: int) -> tuple[Tensor, Tensor]:
    """``x`` with padded positions and non-finite entries zero, and which real positions held a
    non-finite entry: bool ``(B, N)``. ``dim`` is the position dimension, ``real`` bool ``(B, N)``."""
    dim = dim % x.dim()
    finite = torch.isfinite(x)
    shape = [1] * x.dim()
    shape[0], shape[dim] = x.shape[0], x.shape[dim]
    keep = finite if real is None else finite & real.view(shape)
    others = [d for d in range(1, x.dim()) if d != dim]
    bad = (~finite).any(dim=others) if others else ~finite  # (B, N)
    if real is not None:
        bad &= real
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device)), bad


def _sanitised(
    run: Run,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    tensors: dict,
    positions: Mapping[str, str],
    key_padding_mask: Tensor | None,
    query_padding_mask: Tensor | None,
    is_causal: bool,
    uses_qk: bool,
    groups_queries: bool,
) -> Tensor:
    B, L, S = q.shape[0], q.shape[2], k.shape[2]
    v, bad_k = _clean(v, key_padding_mask, 2)
    bad_q = torch.zeros(B, L, dtype=torch.bool, device=q.device)
    if uses_qk:  # else q and k only give shapes: nothing in them is read
        q, bad_q = _clean(q, query_padding_mask, 2)
        k, bad = _clean(k, key_padding_mask, 2)
        bad_k = bad_k | bad
    tensors = dict(tensors)
    for name, side in positions.items():
        x = tensors.get(name)
        n = L if side == QUERY else S
        if isinstance(x, Tensor) and x.is_floating_point() and x.dim() >= 2 and x.shape[:: x.dim() - 1] == (B, n):
            real = query_padding_mask if side == QUERY else key_padding_mask
            tensors[name], bad = _clean(x, real, -1)
            if side == QUERY:
                bad_q = bad_q | bad
            else:
                bad_k = bad_k | bad
    out = run(q, k, v, tensors)  # extras of a wrong shape go in as they are: the mechanism says what is wrong
    spreading = bad_q if groups_queries else torch.zeros_like(bad_q)  # queries that reach others
    if is_causal:  # query i (key position i + S - L) sees a bad key at or before its position
        seen = bad_k.cummax(dim=1).values  # (B, S): a bad key at or before each position
        first = max(0, L - S)  # queries before every key see none
        reached = spreading.cummax(dim=1).values
        reached[:, first:] |= seen[:, max(0, S - L) :]
    else:
        reached = (bad_k.any(dim=1, keepdim=True) | spreading.any(dim=1, keepdim=True)).expand_as(bad_q)
    poisoned = bad_q | reached  # (B, L)
    if query_padding_mask is not None:
        poisoned &= query_padding_mask  # padded queries keep their finite outputs
    return out.masked_fill(poisoned[:, None, :, None], float("nan"))

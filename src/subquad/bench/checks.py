"""What a benchmark cell reports about a forward's output besides its time: non-finite entries, rows
that are all zero, and the relative error against full attention computed in float64 on evenly
spaced query rows (exact for those rows, and affordable at any length)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from subquad.registry import get_mechanism, make_config

__all__ = ["error_parts", "output_checks", "reference_rows", "relative_error", "set_checks"]


def output_checks(out: Tensor) -> dict[str, Any]:
    """Whether any entry of ``out`` is not finite, and the fraction of its rows that are all zero."""
    return {
        "nonfinite": not bool(torch.isfinite(out).all()),  # NaN or inf anywhere in the output
        "zero_rows": float((out.detach().abs().amax(dim=-1) == 0).float().mean()),
    }


def set_checks(call: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor, v: Tensor, cell: dict):
    """``output_checks`` over every set of the inputs file, and ``error_inputs``: the relative error
    against full attention over all the sets' compared rows."""
    nonfinite, zero_rows, diff, ref = False, 0.0, 0.0, 0.0
    for i in range(q.shape[0]):
        out = call(q[i], k[i], v[i])
        checks = output_checks(out)
        nonfinite, zero_rows = nonfinite or checks["nonfinite"], zero_rows + checks["zero_rows"] / q.shape[0]
        d, r = error_parts(out, q[i], k[i], v[i], cell)
        diff, ref = diff + d, ref + r
    return {"nonfinite": nonfinite, "zero_rows": zero_rows, "error_inputs": (diff / max(ref, 1e-300)) ** 0.5}


def reference_rows(q: Tensor, k: Tensor, v: Tensor, rows: Tensor, is_causal: bool) -> Tensor:
    """Full attention in float64 for the queries ``rows``: ``(B, H, len(rows), Dv)``; keys and values
    of fewer heads serve consecutive query heads (grouped-query)."""
    L, S, G = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    mask = None
    if is_causal:
        mask = torch.arange(S, device=q.device) <= (rows + S - L).unsqueeze(-1)  # (R, S), bottom-right
    eager = make_config("full", backend="eager")
    heads = [
        get_mechanism("full").fn(
            q[:, h : h + 1, rows].double(), k[:, h // G : h // G + 1].double(), v[:, h // G : h // G + 1].double(),
            attn_mask=mask, config=eager,
        )
        for h in range(q.shape[1])  # one head at a time keeps the (R, S) scores small
    ]  # fmt: skip
    return torch.cat(heads, dim=1)


def relative_error(out: Tensor, q: Tensor, k: Tensor, v: Tensor, cell: dict[str, Any]) -> float:
    """``‖out − full‖_F / ‖full‖_F`` over evenly spaced query rows, in float64."""
    diff, ref = error_parts(out, q, k, v, cell)
    return (diff / max(ref, 1e-300)) ** 0.5


def error_parts(out: Tensor, q: Tensor, k: Tensor, v: Tensor, cell: dict[str, Any]) -> tuple[float, float]:
    """``‖out − full‖²`` and ``‖full‖²`` over evenly spaced query rows, in float64."""
    L = q.shape[2]
    rows = torch.linspace(0, L - 1, min(L, cell["error_rows"]), device=q.device).round().long().unique()
    ref = reference_rows(q, k, v, rows, cell["causal"])
    diff = out.detach()[:, :, rows].double() - ref
    return float(diff.square().sum()), float(ref.square().sum())

"""Retrieval attention: a window with sinks, and the far key blocks each query's bound ranks highest,
in one softmax. Ours, composed from StreamingLLM (Xiao et al. 2024: the sinks and the window),
Quest (Tang et al. 2024: query-aware block selection by an upper bound on q·k) and LoLA (arXiv
2505.23666: a few far "hard" keys beside the window restore the recall a window loses).

Query i, at key position p = i + S − L (bottom-right alignment), sees:

- **the window**: keys with ``0 ≤ p − j < window`` (non-causal: ``|p − j| < window``);
- **the sinks**: the first ``sinks`` keys (causal: those ≤ p);
- **far blocks**: the keys are cut by position into blocks of ``block`` (block b holds keys
  ``b·block … (b+1)·block − 1``). A block is *eligible* for query i when every key of it lies
  outside i's window (causal: before it) and it holds a real key that is not a sink. Each eligible
  block gets Quest's bound ``Σ_d max(q_d·min_d, q_d·max_d)`` over the elementwise minimum and
  maximum of its real non-sink keys (= relu(q)·max − relu(−q)·min: two matmuls), an upper bound
  on q·k for every key of the block. The ``blocks`` highest (fewer where fewer are eligible; equal
  bounds as ``torch.topk`` orders them) join the query's keys, less sinks and padding. With
  ``shared = G``, each group of G consecutive query heads ranks blocks by its heads' bounds
  summed and all its heads take the group's blocks (NSA's group-shared selection, Yuan et al.
  2025): set to the query heads per key/value head, a group gathers each block once.

The three parts are disjoint by construction (a far block lies outside the window; sinks are kept
out of far blocks), so no key is counted twice, and softmax is exact over their union: the output
equals full attention under the dense mask of the keys each query sees. Under causality that
mask, the bounds and the ranking read only keys ≤ p: the output at p depends on q_p and the keys
and values up to p, so ``RetrievalCache`` decodes it exactly. The far keys cost O(blocks · block)
per query beside the window's; ranking costs O(S/block) per query, a small quadratic term (S/block
bounds per query, as in Quest) where full attention pays S dot products.

**Computation.** Queries go in chunks (``TUNING.retrieval_gather`` gathered far-key elements at a
time); each chunk scores its sinks and its windows' key range together, and each query its own
far blocks (whole blocks, gathered per query, so that one query's arithmetic never depends on what
others chose: the past's output stays bit-identical when the future changes), merged in one
softmax. With gradients, each chunk is checkpointed (the gathered blocks are recomputed in the
backward, not kept). Grouped-query keys and values are read in place for the far blocks; only a
chunk's sinks and window range are repeated to the query heads (never the whole sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from subquad._validate import check_grouped_inputs
from subquad.decoding import Decoder
from subquad.kernels.softmax import work_dtype
from subquad.kernels.tuning import TUNING
from subquad.masks import window_covers
from subquad.registry import Config, Mechanism, option

if TYPE_CHECKING:
    from torch import nn

__all__ = ["RetrievalCache", "RetrievalConfig", "retrieval_attention"]


@dataclass(frozen=True)
class RetrievalConfig(Config):
    mechanism = "retrieval"
    window: int = option(256, "w: keys with |p − j| < w (causal: the last w, itself included)", ge=1)
    sinks: int = option(4, "the first s keys are visible to every query as well (StreamingLLM's attention sinks)", ge=0)
    blocks: int = option(4, "far key blocks each query adds, those its bound (Quest's) ranks highest", ge=1)
    block: int = option(32, "keys per far block (by position)", ge=1)
    shared: int = option(
        1, "consecutive query heads that choose their far blocks together (bounds summed; NSA's group selection)", ge=1
    )


def retrieval_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    config: RetrievalConfig | None = None,
    state: nn.Module | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Window + sinks + each query's top far key blocks, one softmax (module docstring).

    Args:
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, Dv)``.
        key_padding_mask: bool ``(B, S)``, True marks a real key.
        is_causal: query i (at key position p = i + S − L) sees keys ≤ p only.
        scale: softmax scale, default ``D ** -0.5``.
        config: ``RetrievalConfig``.
        enable_gqa: k and v may have a divisor of q's heads (grouped-query).

    Returns:
        ``(B, H, L, Dv)``; zero rows for queries that see no real key.
    """
    config = config or RetrievalConfig()
    check_grouped_inputs(q, k, v, key_padding_mask, is_causal, scale, enable_gqa)
    B, H, L, _ = q.shape
    S, per = k.shape[2], H // k.shape[1]  # per: query heads per key/value head
    if H % config.shared:
        raise ValueError(
            f"retrieval's shared={config.shared} groups query heads that choose blocks together, but there are {H} "
            f"heads: give a divisor of {H}"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    real = torch.ones(B, S, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    size = min(config.block, max(S, 1))  # a block past the last key: one block of them all, the same choices
    n = -(-S // size)
    counted = real.clone()
    counted[:, : config.sinks] = False  # the keys far blocks may hold: real, not sinks
    counted = torch.nn.functional.pad(counted, (0, n * size - S)).view(B, n, size)
    full, keys = S // size, k.detach()  # the whole blocks are a view of the keys (a step copies nothing)
    parts = [_bounds(keys[:, :, : full * size].view(*k.shape[:2], full, size, k.shape[-1]), counted[:, :full])]
    if full < n:  # the last block, partly filled
        parts.append(_bounds(keys[:, :, full * size :].unsqueeze(2), counted[:, full:, : S - full * size]))
    low, high = (torch.cat(x, dim=2).repeat_interleave(per, dim=1) for x in zip(*parts))  # (B, H, n, D)
    far = min(config.blocks, n) * size
    step = max(1, TUNING.retrieval_gather // (B * H * far * max(q.shape[-1], v.shape[-1])))
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    outputs = []
    for a in range(0, L, step):
        args = (q[:, :, a : a + step], k, v, real, counted, low, high, a + S - L, is_causal, scale, config)
        outputs.append(checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args))
    return torch.cat(outputs, dim=2)


def _bounds(kb: Tensor, counted: Tensor) -> tuple[Tensor, Tensor]:
    """Each block's elementwise min and max ``(B, H, n, D)`` over its counted keys (zero for a
    block without one, which is never eligible)."""
    held = counted[:, None, :, :, None]
    low = kb.masked_fill(~held, float("inf")).amin(3)
    high = kb.masked_fill(~held, float("-inf")).amax(3)
    empty = ~held.any(3)
    return low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)


def _chunk(
    q: Tensor, k: Tensor, v: Tensor, real: Tensor, counted: Tensor, low: Tensor, high: Tensor, first: int,
    is_causal: bool, scale: float, config: RetrievalConfig,
) -> Tensor:  # fmt: skip
    """The output ``(B, H, c, Dv)`` of c queries at key positions ``first …``: their sinks, their
    windows' key range and the union of the far blocks they chose, each query masked to its own.
    ``k``, ``v``: the key/value heads; only the sinks and the window's range are repeated to the
    query heads."""
    c, S, w, s = q.shape[2], k.shape[2], config.window, config.sinks
    p = torch.arange(first, first + c, device=q.device)
    lo = min(S, max(0, first - w + 1))
    hi = max(lo, min(S, first + c if is_causal else first + c - 1 + w))  # queries may lie before the keys
    near = torch.arange(lo, hi, device=q.device)
    sink = torch.cat([torch.arange(min(s, lo), device=q.device), torch.arange(hi, min(S, max(s, hi)), device=q.device)])
    chosen = _chosen(q, low, high, counted, p, is_causal, config)  # each query's far blocks
    per = q.shape[1] // k.shape[1]
    keys, values = (torch.cat([x.index_select(2, sink), x[:, :, lo:hi]], dim=2).repeat_interleave(per, dim=1)
                    for x in (k, v))  # fmt: skip
    seen = torch.cat([_seen(sink, p, real, is_causal, w, s, False), _seen(near, p, real, is_causal, w, s, True)], -1)
    return _merge(_part(q, keys, values, seen, scale), _far(q, k, v, counted, *chosen, scale)).to(q.dtype)


def _part(q: Tensor, k: Tensor, v: Tensor, seen: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """One part of a softmax: the largest seen score (-inf: none), the sum of exp(score − it) and
    the values weighted by those exponentials (no log: a part without keys keeps finite gradients)."""
    work = work_dtype(q.dtype)
    if not k.shape[-2]:  # no key in reach (queries before every key)
        top = q.new_full((*q.shape[:-1], 1), float("-inf"), dtype=work)
        return top, torch.zeros_like(top), q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=work)
    scores = torch.matmul(q.to(work) * scale, k.to(work).transpose(-1, -2)).masked_fill(~seen, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - torch.where(torch.isfinite(top), top, 0.0))
    return top, weights.sum(-1, keepdim=True), weights @ v.to(work)


def _merge(*parts: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """One softmax over the union of disjoint parts (``_part``), rescaled to their common maximum."""
    top = torch.stack([t for t, _, _ in parts]).amax(0)
    top = torch.where(torch.isfinite(top), top, 0.0)
    total = sum(s * torch.exp(t - top) for t, s, _ in parts)
    out = sum(o * torch.exp(t - top) for t, _, o in parts)
    return out / torch.where(total > 0, total, 1.0)


def _far(q: Tensor, k: Tensor, v: Tensor, counted: Tensor, index: Tensor, ok: Tensor, scale: float):
    """The far part (``_part``) of each query: its own blocks ``index`` ``(B, H / shared, c,
    blocks)``, read whole from the key/value heads ``k``, ``v``, so that what one query computes
    never depends on what the others chose. The heads of a group read one gathered copy where
    they share a key/value head."""
    B, H, c, D = q.shape
    groups, per, size = index.shape[1], H // k.shape[1], counted.shape[-1]
    shared = H // groups
    if per % shared:  # a group spans key/value heads: each head gathers its own
        index, ok, shared = index.repeat_interleave(shared, dim=1), ok.repeat_interleave(shared, dim=1), 1
    units = H // shared
    rows = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    source = (torch.arange(units, device=q.device) * shared // per).view(1, units, 1, 1)
    at = (index[..., None] * size + torch.arange(size, device=q.device)).flatten(-2)  # (B, U, c, F) positions
    seen = ok.repeat_interleave(size, dim=-1) & counted.flatten(1)[rows, at]
    keys, values = (x[rows, source, at.clamp_max(x.shape[2] - 1)] for x in (k, v))  # (B, U, c, F, ·)
    grouped = q.view(B, units, shared, c, D).transpose(2, 3)  # (B, U, c, shared, D)
    parts = _part(grouped, keys, values, seen.unsqueeze(-2), scale)
    return tuple(x.transpose(2, 3).reshape(B, H, c, -1) for x in parts)


def _seen(keys: Tensor, p: Tensor, real: Tensor, is_causal: bool, w: int, s: int, window: bool) -> Tensor:
    """``(B, 1, c, n)``: which of the positions ``keys`` the queries at ``p`` see as window or sinks."""
    j, at = keys[None, :], p[:, None]
    near = (at - j < w) & (j - at < w) if window else torch.zeros_like(j - at, dtype=torch.bool)
    seen = near | (j < s)
    if is_causal:
        seen = seen & (j <= at)
    return (seen[None] & real[:, None, keys])[:, None]


def _chosen(
    q: Tensor, low: Tensor, high: Tensor, counted: Tensor, p: Tensor, is_causal: bool, config: RetrievalConfig
) -> tuple[Tensor, Tensor]:
    """``(B, H, c, blocks)``: each query's far blocks, the eligible ones of highest bound, and
    whether each is one (fewer are eligible than ``blocks``)."""
    n, size, w = low.shape[2], counted.shape[-1], config.window
    start = torch.arange(n, device=q.device) * size
    outside = (start + size - 1)[None] <= p[:, None] - w  # (c, n): the whole block older than the window
    if not is_causal:
        outside = outside | (start[None] >= p[:, None] + w)
    eligible = outside[None, None] & counted.any(-1)[:, None, None]
    q = q.detach()
    bound = q.clamp_min(0) @ high.transpose(-1, -2) - (-q).clamp_min(0) @ low.transpose(-1, -2)
    if config.shared > 1:  # a group ranks blocks by its heads' bounds summed
        bound = bound.view(bound.shape[0], -1, config.shared, *bound.shape[2:]).sum(2)
    top, index = bound.masked_fill(~eligible, float("-inf")).topk(min(config.blocks, n), dim=-1, sorted=False)
    return index, torch.isfinite(top)


class RetrievalCache(Decoder):
    """Decoding cache of each row's keys and values, its real tokens first (a row's sinks are its
    first real tokens, as in the parallel pass under padding): each step runs the mechanism for
    the new queries over the row's keys, exactly. It takes over a parallel prefill (``absorb``).
    Each token costs its window, sinks and far blocks plus the bounds of every block: O(S·D) per
    head, with a small constant, where exact attention's KV cache pays S dot products and S
    weighted values."""

    absorbs = True
    description = "KV cache of each row's real tokens (the window, sinks and far blocks are chosen from them)"
    holds = "keys"

    def __init__(self, mechanism: Mechanism, config: RetrievalConfig, state: nn.Module | None) -> None:
        super().__init__(mechanism, config, state)
        self.keys: Tensor | None = None  # (B, H, capacity, D), each row's real tokens first
        self.values: Tensor | None = None
        self.filled: Tensor | None = None  # (B,): each row's tokens held

    def _absorb(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> None:
        if key_padding_mask is None:
            self.keys, self.values = k.clone(), v.clone()
            self.filled = torch.full((k.shape[0],), k.shape[2], device=k.device)
            return
        order = torch.argsort((~key_padding_mask).to(torch.int8), dim=1, stable=True)  # real tokens first
        self.keys, self.values = (x.gather(2, order[:, None, :, None].expand(-1, *x.shape[1:2], -1, x.shape[-1]))
                                  for x in (k, v))  # fmt: skip
        self.filled = key_padding_mask.sum(1)

    @torch.no_grad()
    def _step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Append the ``T`` new tokens after each row's own and attend them causally to the row."""
        B, T = q.shape[0], q.shape[2]
        if self.keys is None:
            self.keys, self.values = k[:, :, :0], v[:, :, :0]
            self.filled = torch.zeros(B, dtype=torch.long, device=q.device)
        needed = int(self.filled.max()) + T
        if needed > self.keys.shape[2]:
            grow = max(needed, 2 * self.keys.shape[2], 16) - self.keys.shape[2]
            self.keys, self.values = (torch.nn.functional.pad(x, (0, 0, 0, grow)) for x in (self.keys, self.values))
        at = self.filled[:, None] + torch.arange(T, device=q.device)  # (B, T)
        for held, new in ((self.keys, k), (self.values, v)):
            held.scatter_(2, at[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[-1]), new)
        self.filled = self.filled + T

        def run(b: slice, n: int) -> Tensor:  # row(s) b over their first n keys
            keys, values = self.keys[b, :, :n], self.values[b, :, :n]
            return retrieval_attention(q[b], keys, values, is_causal=True, scale=self.scale, config=self.config)

        if bool((self.filled == self.filled[0]).all()):
            return run(slice(None), int(self.filled[0]))
        return torch.cat([run(slice(b, b + 1), int(self.filled[b])) for b in range(B)])


MECHANISM = Mechanism(
    name="retrieval",
    sinks="sinks",
    fn=retrieval_attention,
    config=RetrievalConfig,
    summary="window + sinks + each query's top far key blocks by Quest's bound, one softmax; cache of every key",
    paper="ours: StreamingLLM's sinks and window (Xiao et al. 2024) with Quest's block selection (Tang et al. 2024)",
    causal=True,
    cross=True,
    decoder=RetrievalCache,  # exact: the output at p reads q_p and keys <= p only
    gqa=True,
    exact_full=lambda config, shape, causal, state, tensors: window_covers(
        config.window, shape.queries, shape.keys, causal
    ),
    examples=({}, {"window": 3, "sinks": 1, "blocks": 2, "block": 2}),
)

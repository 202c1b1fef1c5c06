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
  on q·k for every key of the block. The ``blocks`` highest (fewer where fewer are eligible; of
  exactly equal bounds either may be taken: ``ops.far_blocks.largest``, ``torch.topk`` in
  decoding's step) join the query's keys, less sinks and padding. With
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

**A kernel part (``feature_map``: LoLA's linear state beside the hard keys).** The far keys no chosen
block holds (real, not sinks) enter by kernel attention, ``(m·o + Σ φ(q)·φ(k) v) / (m + Σ φ(q)·φ(k))``
(``linear``'s window formula; o the softmax above, m = 1 where it holds a real key): the sums over
every key beyond the window less the chosen blocks' share, so no key counts twice. φ: elu, relu or
hedgehog (``LinearState``, trained by ``convert`` + ``distill``); the cache keeps the sums.

**Computation** (``ops.far_blocks``). Queries in chunks (``TUNING.retrieval_gather`` elements of
far work; with gradients ``retrieval_gather_grad`` bytes, checkpointed). Sinks and window: all
queries at once on the block engine (``kernels.band.window_softmax``; with gradients through
``ops.near_window``, whose backward runs block by block), outside the checkpoints, joined by
log-sum-exp. The far part block by block, the queries that chose a block in
segments of ``TUNING.retrieval_rows`` in position order; a query whose keys are few
(``TUNING.retrieval_dense``) reads them all under its mask instead. Causal, unpadded, without a
kernel part, where every query takes every block it may: ``ops.far_all`` (masked sdpa).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from subquad._validate import check_grouped_inputs
from subquad.decoding import Decoder, room_for
from subquad.kernels.softmax import work_dtype
from subquad.kernels.tuning import TUNING
from subquad.masks import window_covers_all
from subquad.ops.far_all import every_block
from subquad.ops.far_blocks import attend_rows, block_bounds, kernel_inputs
from subquad.ops.far_step import one_query
from subquad.ops.windowed_linear import LinearState, far_sums, learned_state, phi
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
    feature_map: str = option(
        "none",
        "the far keys no chosen block holds: none (not seen), or kernel attention with φ = elu, relu or hedgehog "
        "(learned, LinearState), under one normaliser with the softmax part (LoLA's linear state)",
        choices=("none", "elu", "relu", "hedgehog"),
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
        scale: softmax scale, default ``D ** -0.5``; config: ``RetrievalConfig``.
        state: a ``LinearState`` (feature_map=hedgehog: the learned maps; default the initial ones).
        enable_gqa: k and v may have a divisor of q's heads (grouped-query).

    Returns ``(B, H, L, Dv)``; zero rows for queries that see no real key.
    """
    config = config or RetrievalConfig()
    check_grouped_inputs(q, k, v, key_padding_mask, is_causal, scale, enable_gqa)
    if q.shape[1] % config.shared:
        raise ValueError(
            f"retrieval's shared={config.shared} groups query heads that choose blocks together, but there are "
            f"{q.shape[1]} heads: give a divisor of {q.shape[1]}"
        )
    plain = is_causal and key_padding_mask is None and config.feature_map == "none"
    short = every_block(q, k, v, scale, config) if plain else None  # where every query takes every block it may
    learned = learned_state(state, config, q.shape[1], q.shape[-1], q.device)
    return _attend(q, k, v, key_padding_mask, is_causal, scale, config, learned)[0] if short is None else short


def _attend(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, is_causal: bool, scale: float | None,
    config: RetrievalConfig, learned: nn.Module | None, known: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:  # fmt: skip
    """``retrieval_attention`` on checked inputs (``learned``: hedgehog's ``LinearState``), and the
    bounds (low, high) of the keys' whole blocks, ``(B, Hk, S // block, D)`` each (None where the
    keys are fewer than a block), for a decoder to keep. ``known``: those of the first blocks, from
    an earlier call over the same keys (min and max are exact: the same bounds, read instead of
    recomputed)."""
    B, H = q.shape[:2]
    S, per = k.shape[2], H // k.shape[1]  # per: query heads per key/value head
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    real = torch.ones(B, S, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    size = min(config.block, max(S, 1))  # a block past the last key: one block of them all, the same choices
    n = -(-S // size)
    counted = real.clone()
    counted[:, : config.sinks] = False  # the keys far blocks may hold: real, not sinks
    counted = torch.nn.functional.pad(counted, (0, n * size - S)).view(B, n, size)
    full, keys = S // size, k.detach()  # the whole blocks are a view of the keys (a step copies nothing)
    m = 0 if known is None else known[0].shape[2]
    fresh = keys[:, :, m * size : full * size].view(*k.shape[:2], full - m, size, k.shape[-1])
    whole = block_bounds(fresh, counted[:, m:full])
    if known is not None:
        whole = tuple(torch.cat(pair, dim=2) for pair in zip(known, whole))
    parts = [whole]
    if full < n:  # the last block, partly filled
        parts.append(block_bounds(keys[:, :, full * size :].unsqueeze(2), counted[:, full:, : S - full * size]))
    low, high = (torch.cat(x, dim=2).repeat_interleave(per, dim=1) for x in zip(*parts))  # (B, H, n, D)
    trained = () if learned is None else tuple(learned.parameters())  # only the maps may need gradients (distill)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, *trained))
    gather = TUNING.retrieval_gather_grad // q.element_size() if grad else TUNING.retrieval_gather
    step = max(1, gather // (B * H * min(config.blocks, n) * (size + q.shape[-1] + v.shape[-1])))
    kernel = None if config.feature_map == "none" else kernel_inputs(q, k, v, real, is_causal, config, learned)
    out = attend_rows(q, k, v, key_padding_mask, real, counted, low, high, is_causal, scale, config, kernel, grad, step)
    return out, whole if size == config.block else None


class RetrievalCache(Decoder):
    """Decoding cache of each row's keys and values, its real tokens first (a row's sinks are its
    first real tokens, as in the parallel pass under padding), and the bounds of its whole blocks:
    each step runs the mechanism for the new queries over the row's keys, exactly, computing the
    bounds of the blocks completed since the last step only. It takes over a parallel prefill
    (``absorb``). A token then costs its window, sinks and far blocks plus one bound per block:
    O(S/block · D) per head, where exact attention's KV cache pays S dot products and S weighted
    values."""

    absorbs = True
    grouped = True  # grouped-query keys and values are kept unrepeated (read in place by the far blocks)
    description = (
        "KV cache of each row's real tokens, each whole block's bounds (the far blocks are chosen by them) and, with a "
        "feature_map, the kernel sums of the keys beyond the window"
    )
    holds = "keys"

    def __init__(self, mechanism: Mechanism, config: RetrievalConfig, state: nn.Module | None) -> None:
        super().__init__(mechanism, config, state)
        self.keys = self.values = None  # (B, Hk, capacity, ·), each row's real tokens first
        self.filled: Tensor | None = None  # (B,): each row's tokens held
        self.bounds = None  # (B, Hk, capacity / block, 2D): [high, low] of each row's whole blocks, as steps read them
        self.known: Tensor | None = None  # (B,): whole blocks whose bounds are held
        self.held, self.whole = None, 0  # where every row holds as many tokens: that count, its whole blocks known
        self.sums = self.summed = None  # a kernel part's Σ φ(k) [v, 1]ᵀ (B, H, F, Dv + 1) over keys [sinks, summed)

    def _absorb(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> None:
        self.known = torch.zeros(k.shape[0], dtype=torch.long, device=k.device)
        if key_padding_mask is None:
            self.keys, self.values = k.clone(), v.clone()
            self.filled = torch.full((k.shape[0],), k.shape[2], device=k.device)
            self.held = k.shape[2]
            return
        order = torch.argsort((~key_padding_mask).to(torch.int8), dim=1, stable=True)  # real tokens first
        self.keys, self.values = (x.gather(2, order[:, None, :, None].expand(-1, *x.shape[1:2], -1, x.shape[-1]))
                                  for x in (k, v))  # fmt: skip
        self.filled = key_padding_mask.sum(1)
        self.held = int(self.filled[0]) if bool((self.filled == self.filled[0]).all()) else None  # else per row

    @torch.no_grad()
    def _step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Append the ``T`` new tokens after each row's own and attend them causally to the row."""
        B, T = q.shape[0], q.shape[2]
        if self.keys is None:
            self.keys, self.values = k[:, :, :0], v[:, :, :0]
            self.filled = self.known = torch.zeros(B, dtype=torch.long, device=q.device)
            self.held = 0
        if k.shape[1] != self.keys.shape[1]:
            raise ValueError(f"the cache holds keys of {self.keys.shape[1]} key/value heads, got {k.shape[1]}; "
                             "start a new cache for a new batch")  # fmt: skip
        even = self.held is not None  # every row holds as many tokens (counted on the host: no sync)
        needed = (self.held if even else int(self.filled.max())) + T
        if needed > self.keys.shape[2]:  # an eighth more room (a copy per eighth: O(1) per token, amortised)
            grow = room_for(needed) - self.keys.shape[2]
            self.keys, self.values = (torch.nn.functional.pad(x, (0, 0, 0, grow)) for x in (self.keys, self.values))
        at = None if even else self.filled[:, None, None, None] + torch.arange(T, device=q.device)[:, None]
        for held, new in ((self.keys, k), (self.values, v)):  # all rows at one slice, else each row after its own
            if even:
                held[:, :, needed - T : needed] = new
            else:
                held.scatter_(2, at.expand(-1, new.shape[1], -1, new.shape[-1]), new)
        self.filled = self.filled + T
        if even:
            self.held = needed
            return self._run(q, slice(None), needed, self.whole)
        return torch.cat([self._run(q[b : b + 1], slice(b, b + 1), int(self.filled[b]), int(self.known[b]))
                          for b in range(B)])  # fmt: skip

    def _run(self, q: Tensor, rows: slice, n: int, m: int) -> Tensor:
        """The new queries of ``rows`` over their first ``n`` keys, the bounds of whose first ``m`` whole
        blocks are held (and of those completed since, kept). One query a row: ``one_query``."""
        size = self.config.block
        keys, values = self.keys[rows, :, :n], self.values[rows, :, :n]
        learned = learned_state(self.state, self.config, q.shape[1], q.shape[-1], q.device)
        if q.shape[2] == 1 and n >= size:
            count = n // size
            if count > m:
                fresh = keys[:, :, m * size : count * size].view(*keys.shape[:2], count - m, size, keys.shape[-1])
                counted = torch.arange(m * size, count * size, device=q.device).view(1, -1, size) >= self.config.sinks
                self._keep(rows, m, block_bounds(fresh, counted.expand(keys.shape[0], -1, -1)))
            sums = None if self.config.feature_map == "none" else self._sums(rows, q, keys, values, learned)
            return one_query(q, keys, values, self.bounds[rows, :, :count], self.scale,
                             self.config, None if sums is None else (learned, sums))  # fmt: skip
        D = q.shape[-1]
        known = None if m == 0 else (self.bounds[rows, :, :m, D:], self.bounds[rows, :, :m, :D])  # low, high
        out, whole = _attend(q, keys, values, None, True, self.scale, self.config, learned, known)
        if whole is not None and whole[0].shape[2] > m:
            self._keep(rows, m, tuple(x[:, :, m:] for x in whole))
        return out

    def _sums(self, rows: slice, q: Tensor, keys: Tensor, values: Tensor, learned: nn.Module | None) -> Tensor:
        """The kernel sums of ``rows`` over the keys beyond the new (last) key's window, less sinks."""
        if self.sums is None:
            F = phi(q[:1, :, :0], self.config.feature_map, learned).shape[-1]
            self.sums = q.new_zeros(self.keys.shape[0], q.shape[1], F, values.shape[-1] + 1, dtype=work_dtype(q.dtype))
            self.summed = torch.full_like(self.filled, self.config.sinks)
        start, end = int(self.summed[rows].min()), keys.shape[2] - self.config.window
        if end > start:  # rows stepped together hold as many keys, so they have summed as many
            part = (x[:, :, start:end].repeat_interleave(q.shape[1] // keys.shape[1], dim=1) for x in (keys, values))
            self.sums[rows] += far_sums(*part, None, self.config.feature_map, learned)
            self.summed[rows] = end
        return self.sums[rows]

    def _keep(self, rows: slice, m: int, bounds: tuple[Tensor, Tensor]) -> None:
        """Hold ``bounds``, those of ``rows``' whole blocks from ``m`` on."""
        count, D = m + bounds[0].shape[2], bounds[0].shape[-1]
        if self.bounds is None or count > self.bounds.shape[2]:
            shape = (self.keys.shape[0], *bounds[0].shape[1:2], room_for(count), 2 * D)
            joined = bounds[0].new_zeros(shape)
            if self.bounds is not None:
                joined[:, :, : self.bounds.shape[2]] = self.bounds
            self.bounds = joined
        self.bounds[rows, :, m:count, D:], self.bounds[rows, :, m:count, :D] = bounds
        self.known[rows] = count
        if rows == slice(None):
            self.whole = count


MECHANISM = Mechanism(
    name="retrieval",
    sinks="sinks",
    fn=retrieval_attention,
    config=RetrievalConfig,
    summary="window + sinks + each query's top far key blocks by Quest's bound, one softmax; cache of every key",
    paper="ours: StreamingLLM's sinks and window (Xiao et al. 2024) with Quest's block selection (Tang et al. 2024); "
    "optionally LoLA's linear state for the rest (arXiv 2505.23666)",
    causal=True,
    cross=True,
    decoder=RetrievalCache,  # exact: the output at p reads q_p and keys <= p only
    gqa=True,
    exact_full=window_covers_all,
    state=LinearState,  # hedgehog's learned maps; other feature maps hold no tensor
    examples=(
        {},
        {"window": 3, "sinks": 1, "blocks": 2, "block": 2},
        {"window": 3, "sinks": 1, "blocks": 1, "block": 2, "feature_map": "hedgehog"},
    ),
)

"""The chunks of block-sparse attention (``kernels.blocksparse``), shared by its forward and backward.

A part of the pattern is a sequence of ``Group`` (``kernels.layouts``). Its blocks are read a chunk at
a time (``Chunk``, ``chunks``), by gathering the listed rows or, for regular layouts, through views
(``query_view``, ``key_view``: windows, strides) that copy nothing. Memory is O(chunk) above the
inputs and outputs: no (L, S) tensor exists, and blocks a part does not list are never touched (in
particular the upper triangle of a causal pattern). A chunk's blocks form the batch of one kernel
call (``as_batch``, ``from_batch``, ``fused_mask``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from subquad.kernels.layouts import Group
from subquad.kernels.memory import kept_buffer
from subquad.kernels.softmax import additive_mask, merge_into
from subquad.kernels.tuning import TUNING

__all__ = ["Chunk", "Part", "as_batch", "chunks", "from_batch", "fused_mask", "padded", "pads"]


Part = Sequence[Group]


class Chunk:
    """One chunk of a group: the gathered indices and the element mask, shared by both passes."""

    def __init__(
        self, group: Group, start: int, stop: int, H: int, L: int, S: int, pad: int, key_padding_mask: Tensor | None,
        groups: int = 1,
    ) -> None:  # fmt: skip
        self.group, self.start, self.stop, self.pad, self.groups = group, start, stop, pad, groups
        self.query_view = None if group.views is None else group.views.query_view
        self.writes = group.views is not None and group.views.writes  # outputs go through query_view
        self.queries = group.queries[start:stop]  # (n, bq)
        # Rows read for the empty slot L: any real row will do, as its probabilities are zero in the
        # backward pass and its forward output is written to the discarded row L.
        self.reads = self.queries.masked_fill(self.queries == L, 0)
        keys = group.keys[:, start:stop]  # (Hk, n, W)
        self.keys, self.H, self.S = keys, H, S
        self.shape = (H, *keys.shape[1:])  # (H, n, W)
        # Without key padding, the masks below depend on the layout alone: a group kept across calls
        # keeps them too (Group.memo), and a later call of the same shape builds none.
        self.memo = group.memo if key_padding_mask is None else None

        def layout_mask() -> Tensor:
            if group.facts.uniform:
                return group.allowed(start, start + 1)  # (.., 1, bq, W): broadcast over the blocks
            if group.facts.in_range:
                return group.allowed(start, stop)
            return group.allowed(start, stop) & (keys >= 0).unsqueeze(-2) & (keys < S).unsqueeze(-2)

        allowed = self.kept(("allowed",), layout_mask)
        self.causal = group.facts.causal and key_padding_mask is None
        # Nothing masked: the fused kernel runs without a mask.
        self.open = group.facts.dense and group.facts.in_range and key_padding_mask is None
        if key_padding_mask is not None:
            real = key_padding_mask[:, keys.clamp(0, S - 1)]  # (B, Hk, n, W)
            allowed = allowed & real.unsqueeze(-2)  # (B, Hk, n, 1, W)
        self.allowed = allowed

    def kept(self, key: tuple, build: Callable[[], Tensor]) -> Tensor:
        """``build()``, from the group's memo where it has one; masks over ``TUNING.blocksparse_kept_mask``
        elements are built each time (a long sequence's layout would hold them all), and a memo of
        many chunkings starts again at ``TUNING.blocksparse_kept_masks``."""
        if self.memo is None:
            return build()
        key = (self.start, self.stop, *key)
        value = self.memo.get(key)
        if value is None:
            value = build()
            if value.numel() <= TUNING.blocksparse_kept_mask:
                if len(self.memo) >= TUNING.blocksparse_kept_masks:
                    self.memo.clear()
                self.memo[key] = value
        return value

    def additive(self, B: int, H: int, dtype: torch.dtype) -> Tensor:
        """The element mask as the fused kernel's additive one (``fused_mask``)."""
        return self.kept(("additive", B, H, dtype), lambda: fused_mask(self.allowed, B, H, dtype))

    def keyless(self) -> Tensor:
        """Rows that see no key ``(.., n, bq)``, where the fused kernel reports lse = 0."""
        return self.kept(("keyless",), lambda: ~self.allowed.any(-1))

    @functools.cached_property
    def flat(self) -> Tensor:
        """The key rows of the chunk in the ``(B, H_kv·(S + 2 pad), ·)`` keys, flattened (query head h
        reads key head h // G): built only when gathered or scattered, as view groups read without
        them."""
        heads = torch.arange(self.H, device=self.keys.device).view(self.H, 1, 1) // self.groups
        heads = heads * (self.S + 2 * self.pad)
        return (heads + self.pad + self.keys.clamp(0, self.S - 1)).reshape(-1)

    def gather(self, x: Tensor, sources: dict, name: str, grouped: bool = False) -> Tensor:
        """This chunk's keys (or values) from ``x`` ``(B, H_kv, S + 2 pad, F)``: ``(B, H, n, W, F)``.
        ``sources`` keeps each ``key_source`` sequence for the whole pass (built once). Grouped-query
        key heads are repeated for their G query heads here, but with ``grouped`` a view keeps H_kv.
        A gathered copy (not a view) is written into the thread's kept buffer ``name``
        (``memory.kept_buffer``): it lives until the next chunk's gather."""
        views = self.group.views
        if views is not None:
            if views.key_source is not None:
                key = (id(views.key_source), id(x))
                if key not in sources:
                    sources[key] = views.key_source(x, self.pad)
                x = sources[key]
            y = views.key_view(x, self.pad, self.start, self.stop)
            if y.shape[1] == self.H or grouped:
                return y
            B, Hkv = y.shape[:2]
            return y.unsqueeze(2).expand(B, Hkv, self.H // Hkv, *y.shape[2:]).flatten(1, 2)
        B, F_ = x.shape[0], x.shape[-1]
        rows = x.reshape(-1, F_)  # index_select along dim 0 of a matrix: the fast gather on CPU
        flat = self.flat
        if B > 1:
            flat = (torch.arange(B, device=x.device)[:, None] * (rows.shape[0] // B) + flat).flatten()
        out = kept_buffer(name, flat.numel() * F_, x.dtype, x.device).view(-1, F_)
        return torch.index_select(rows, 0, flat, out=out).view(B, *self.shape, F_)

    def take(self, x: Tensor, view: bool = True) -> Tensor:
        """This chunk's rows of queries (``view``) or of per-query tensors ``x`` ``(B, H, L(+pad), F)``:
        ``(B, H, n, bq, F)``."""
        if view and self.query_view is not None:
            return self.query_view(x, self.start, self.stop)
        return x[:, :, self.reads]

    def merge(self, out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
        """Merge this chunk's softmax over its keys into the one over earlier parts' (disjoint) keys:
        ``out = (e^lse out + e^block_lse block_out) / e^total``, ``total = log(e^lse + e^block_lse)``."""
        if self.writes:
            out_rows, lse_rows = self.take(out), self.take(lse)  # views: updated in place
        else:
            out_rows, lse_rows = out[:, :, self.queries], lse[:, :, self.queries]
        merge_into(out_rows, lse_rows, block_out, block_lse)
        if not self.writes:
            out[:, :, self.queries], lse[:, :, self.queries] = out_rows, lse_rows

    def write(self, out: Tensor, block_out: Tensor) -> None:
        """Put ``block_out`` ``(B, H, n, bq, F)`` into the rows of ``out`` ``(B, H, L + pad, F)``."""
        if self.writes:
            self.take(out).copy_(block_out)
        else:
            out[:, :, self.queries] = block_out.to(out.dtype)


def pads(parts: Sequence[Part]) -> tuple[int, int]:
    """Rows to pad the queries with at the end and the keys at both ends: what the views read past
    the ends. Usually none: padding copies the inputs."""
    groups = [g for part in parts for g in part]
    return max([0] + [g.query_pad for g in groups]), max([0] + [g.key_pad for g in groups])


def padded(x: Tensor, front: int, back: int) -> Tensor:
    return F.pad(x, (0, 0, front, back)) if front or back else x


def chunks(
    group: Group, B: int, H: int, L: int, S: int, pad: int, key_padding_mask: Tensor | None, tile: int, views: bool,
    groups: int = 1,
):  # fmt: skip
    """The group's chunks of at most ``tile`` scores; with ``views``, a group read through views
    with one block's mask, whose chunks hold nothing but their output, of ``TUNING.blocksparse_view_tile``;
    at most ``TUNING.blocksparse_rows`` query rows each, whose output exists beside the result's."""
    n, bq = group.queries.shape
    W = group.keys.shape[-1]
    if views and group.facts.uniform and group.views is not None and key_padding_mask is None:
        tile = TUNING.blocksparse_view_tile
    per_chunk = max(1, min(tile // max(1, B * H * bq * W), TUNING.blocksparse_rows // max(1, B * H * bq)))
    for start in range(0, n, per_chunk):
        yield Chunk(group, start, min(start + per_chunk, n), H, L, S, pad, key_padding_mask, groups)


def as_batch(x: Tensor) -> Tensor:
    """``(B, H, n, r, F)`` -> ``(n, B·H, r, F)``: one chunk's blocks as the batch of a fused call."""
    B, H, n = x.shape[:3]
    return x.permute(2, 0, 1, 3, 4).reshape(n, B * H, *x.shape[3:])


def from_batch(x: Tensor, B: int, H: int) -> Tensor:
    """Inverse of ``as_batch``."""
    n = x.shape[0]
    return x.reshape(n, B, H, *x.shape[2:]).movedim(0, 2)


def fused_mask(allowed: Tensor, B: int, H: int, dtype: torch.dtype) -> Tensor:
    """The element mask as the fused kernel's additive mask ``(n | 1, B·H | 1, bq, W)``."""
    while allowed.dim() < 5:
        allowed = allowed.unsqueeze(0)
    if allowed.shape[0] == 1 and allowed.shape[1] == 1:
        allowed = allowed[0, 0].unsqueeze(1)  # (n | 1, 1, bq, W)
    else:
        allowed = allowed.expand(B, H, *allowed.shape[2:]).movedim(2, 0).flatten(1, 2)  # (n | 1, B·H, bq, W)
    return additive_mask(allowed, dtype)

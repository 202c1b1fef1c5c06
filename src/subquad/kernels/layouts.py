"""Block layouts: which query blocks a chunked softmax computes, against which keys, read how.

A ``Group`` is a batch of query blocks of one size that all see the same number ``W`` of keys:

- ``queries`` ``(n, bq)``: the query indices of each block (``L`` marks an empty slot).
- ``keys`` ``(Hk, n, W)``: the key indices each block attends to, per head (``Hk = H``) or shared
  (``Hk = 1``); out-of-range indices are allowed and are masked.
- ``allowed(start, stop)``: the exact element mask of blocks ``start:stop``, broadcastable to
  ``(B, H, n, bq, W)``, evaluated from the pattern's ``mask_mod`` on the blocks' positions.

A *transposed* group (``transposed=True``) lists the pattern the other way round: its "queries"
are blocks of keys and its "keys" the windows of queries that see them, and ``allowed`` is indexed
(key, query). Only a backward layout holds them (``blocksparse.block_sparse_attention``'s
``backward_parts``): a key block's gradients are then whole, where query blocks' overlapping key
windows each give a part of them to be summed (``band_groups(transposed=True)``).

Two optional records say what the engine may skip, each checked when built:

- ``MaskFacts``: what is known of the element mask (the same for every block, all in range, all
  visible, exactly causal, triangular), so a chunk needs less of it or none.
- ``Views``: for regular layouts, how to read the blocks' rows through views of the inputs (a
  band's overlapping windows, a segment's strided rows) instead of gathering them.
- ``leading``: a group whose every block reads the sequence's first ``W`` keys (the sinks) gives
  their mask over any run of queries, so the forward computes it for many queries in one product
  (``blocksparse_forward``) instead of block by block.

The layouts built here are the band (``band_groups``: a sliding window, Sparse Transformer's local
step) and the segments (``segment_groups``: dense attention inside runs of positions, the strided
pattern's columns and the fixed pattern's own blocks). Patterns with other geometry list their
blocks as gathered groups (no views). ``kernels.tiles`` is the third layout, windows of a key table,
for content-based routing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from subquad.masks import MaskMod

__all__ = [
    "Group", "MaskFacts", "Views", "band_groups", "query_slots", "segment_groups", "sink_groups", "sink_mask",
    "strided_view",
]  # fmt: skip


@dataclass(frozen=True)
class MaskFacts:
    """What is known of a group's element mask; each fact lets the engine skip work.

    Attributes:
        in_range: every key index lies in ``[0, S)``: no range mask.
        uniform: the element mask is the same for every block (needs ``in_range``): one block's
            mask serves the chunk.
        dense: every listed key is visible (needs ``in_range``): no element mask at all.
        causal: the mask is exactly ``j <= i`` in square blocks (needs ``triangular``): the
            kernels' own causal flag replaces it.
        triangular: square blocks whose visible keys all satisfy ``j <= i``: a kernel's causal flag
            may skip the keys past each query, though the mask is still applied.
    """

    in_range: bool = False
    uniform: bool = False
    dense: bool = False
    causal: bool = False
    triangular: bool = False

    def __post_init__(self) -> None:
        for fact, needs in (("uniform", "in_range"), ("dense", "in_range"), ("causal", "triangular")):
            if getattr(self, fact) and not getattr(self, needs):
                raise ValueError(f"MaskFacts({fact}=True) needs {needs}=True")


@dataclass(frozen=True)
class Views:
    """How a regular layout reads its blocks' rows without a gather.

    Attributes:
        key_view: ``key_view(x_ext, pad, start, stop) -> (B, H, n, W, F)``: blocks ``start:stop``'s
            keys (or values) from ``x_ext``, the sequence padded by ``pad >= key_pad`` rows at
            both ends (or, with ``key_source``, from what it returns).
        query_view: ``query_view(q_ext, start, stop) -> (B, H, n, bq, D)`` from the queries padded
            at the end by ``query_pad`` rows; None: queries are gathered.
        query_pad, key_pad: rows the views read past the ends.
        key_source: ``key_source(x_ext, pad)``: the sequence ``key_view`` reads, built once per
            pass (e.g. a zero-padded copy of the few keys a band's end blocks reach).
        writes: ``query_view`` reads no real query outside the blocks, so outputs are written
            through it (needs ``query_view``).
    """

    key_view: Callable[[Tensor, int, int, int], Tensor]
    query_view: Callable[[Tensor, int, int], Tensor] | None = None
    query_pad: int = 0
    key_pad: int = 0
    key_source: Callable[[Tensor, int], Tensor] | None = None
    writes: bool = False

    def __post_init__(self) -> None:
        if self.query_pad < 0 or self.key_pad < 0:
            raise ValueError(f"Views pads must be >= 0, got query_pad={self.query_pad}, key_pad={self.key_pad}")
        if self.writes and self.query_view is None:
            raise ValueError("Views(writes=True) needs a query_view to write through")


@dataclass(frozen=True)
class Group:
    """Query blocks of one size that see one number of keys (module docstring)."""

    queries: Tensor  # (n, bq) long; L = empty slot
    keys: Tensor  # (Hk, n, W) long
    allowed: Callable[[int, int], Tensor]  # (start, stop) -> bool broadcastable to (B, H, stop-start, bq, W)
    facts: MaskFacts = MaskFacts()
    views: Views | None = None
    # A group kept across calls (a layout cached per shape) holds here the masks its chunks derive
    # from the layout alone, so that later calls without key padding reuse them; None: not kept.
    memo: dict | None = field(default=None, compare=False, repr=False)
    transposed: bool = False  # blocks of keys against windows of queries (module docstring)
    # every block reads keys 0 … W − 1: leading(a, b) -> bool (heads, b − a, W), which of them
    # queries a … b − 1 see (module docstring); None for other layouts
    leading: Callable[[int, int], Tensor] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.queries.dim() != 2 or self.keys.dim() != 3 or self.keys.shape[1] != self.queries.shape[0]:
            raise ValueError(
                f"a Group needs queries (n, bq) and keys (Hk, n, W), got {tuple(self.queries.shape)} and "
                f"{tuple(self.keys.shape)}"
            )
        if self.facts.triangular and self.queries.shape[1] != self.keys.shape[2]:
            raise ValueError(
                f"triangular blocks must be square, got bq={self.queries.shape[1]}, W={self.keys.shape[2]}"
            )

    @property
    def query_pad(self) -> int:
        return 0 if self.views is None else self.views.query_pad

    @property
    def key_pad(self) -> int:
        return 0 if self.views is None else self.views.key_pad


def band_groups(
    L: int,
    offset: int,
    left: int,
    right: int,
    block: int,
    mask_mod: MaskMod,
    device,
    kept: bool = False,
    transposed: bool = False,
) -> list[Group]:
    """Blocks of consecutive queries, each against the keys from ``left`` before its first query's
    position to ``right`` after its last one; the queries are the last L of the ``L + offset`` keys.
    Blocks whose window lies inside the sequence read views of the inputs. Where keys follow the
    queries (``right > 0``), the few blocks at either end, whose windows cross it, all read the
    sequence's first (last) W keys, a view repeated for each block, which holds every key their
    windows reach; the element mask leaves out the rest. Otherwise (a causal band: the keys these
    blocks list must not pass their last query), or where the sequence is shorter than W, they read
    windows over a zero-padded copy of the keys they reach, with the keys outside masked. ``kept``:
    the caller keeps the groups for later calls of this shape (``Group.memo``).

    ``transposed``: the same band as transposed groups (``Group.transposed``), blocks of ``block``
    keys against the queries that see them: the band of the transposed pattern, built as above with
    the roles of queries and keys swapped (``S`` of them, against the ``L`` queries)."""
    if transposed:
        flipped = lambda b, h, key, query: mask_mod(b, h, query, key)  # noqa: E731
        groups = band_groups(L + offset, -offset, right, left, block, flipped, device, kept)
        return [dataclasses.replace(group, transposed=True) for group in groups]
    n, W = -(-L // block), block + left + right
    queries = torch.arange(n * block, device=device).view(n, block)
    keys = (queries[:, :1] + offset - left) + torch.arange(W, device=device)  # (n, W)
    queries = queries.masked_fill(queries >= L, L)
    zero = torch.zeros((), dtype=torch.long, device=device)
    # Inner blocks: their whole window lies inside the sequence.
    inner_lo, inner_hi = max(0, -(-(left - offset) // block)), max(0, (L - right) // block)
    groups = []
    for where, lo, hi in (("start", 0, inner_lo), ("inner", inner_lo, inner_hi), ("end", max(inner_lo, inner_hi), n)):
        if lo >= hi:
            continue
        rows = queries[lo:hi]
        cols, views, facts = _band_reads(where, lo, rows, keys[lo:hi], L, offset, left, right, block, device)

        def allowed(start: int, stop: int, rows=rows, cols=cols) -> Tensor:
            return mask_mod(zero, zero, rows[start:stop, :, None], cols[start:stop, None, :])  # (n, bq, W)

        groups.append(Group(rows, cols.unsqueeze(0), allowed, facts, views, {} if kept else None))
    return groups


def _band_reads(
    where: str, lo: int, rows: Tensor, cols: Tensor, L: int, offset: int, left: int, right: int, block: int, device,
) -> tuple[Tensor, Views, MaskFacts]:  # fmt: skip
    """How ``band_groups`` reads its blocks ``lo, lo + 1, …`` of the region ``where`` (``start``,
    ``inner`` or ``end``), queries ``rows`` against the keys ``cols`` of their windows: the keys they
    list (their windows, or the sequence's first or last W keys), the views that read them, and what
    is known of their element mask."""
    W, S = block + left + right, L + offset

    def query_view(q: Tensor, start: int, stop: int) -> Tensor:
        return q.narrow(2, (lo + start) * block, (stop - start) * block).unflatten(2, (stop - start, block))

    def key_view(x: Tensor, pad: int, start: int, stop: int) -> Tensor:
        return _windows(x, offset - left + pad + (lo + start) * block, stop - start, block, W)

    if where == "inner":  # views, and one element mask for all (the pattern depends on p − j only)
        views = Views(key_view, query_view, writes=True)
        facts = MaskFacts(in_range=True, uniform=True)
    elif W <= S and right > 0:  # the first (last) W keys hold every key these blocks' windows reach
        first = 0 if where == "start" else S - W
        cols = (first + torch.arange(W, device=device)).expand(rows.shape[0], W)
        whole = (lo + rows.shape[0]) * block <= L  # no empty query slot: written through the query view
        views = Views(_repeated_view(first, W), query_view if whole else None, writes=whole)
        facts = MaskFacts(in_range=True)
    else:  # windows over a copy of the few keys the end blocks read, zero-padded past the ends
        begin, blocks = offset - left + lo * block, rows.shape[0]  # hi may pass n when w > L
        views = Views(_edge_view(block, W), key_source=_edge_source(begin, (blocks - 1) * block + W, S))
        facts = MaskFacts()
    return cols, views, facts


def sink_mask(sinks: int, covered: MaskMod, is_causal: bool, offset: int) -> MaskMod:
    """The first ``sinks`` keys that ``covered`` (the rest of the pattern) leaves out: the sink part,
    disjoint from the pattern; causal: only keys up to the query's position ``q_idx + offset``."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        sink = (kv_idx < sinks) & ~covered(b, h, q_idx, kv_idx)
        return sink & (kv_idx <= q_idx + offset) if is_causal else sink

    return mask_mod


def sink_groups(L: int, sinks: int, block: int, heads: int, mask_mod: MaskMod, device) -> list[Group]:
    """Blocks of ``block`` consecutive queries against the first ``sinks`` keys (StreamingLLM's
    attention sinks), under ``mask_mod`` (``sink_mask``), evaluated per head where it depends on
    the head. ``sinks`` must not exceed the number of keys. Where the blocks hold the queries
    whole, they read views: the queries in place, the sinks repeated for each block, and the
    outputs merged in place (a gather and a scatter of every query's row otherwise). The group's
    ``leading`` lets the forward compute it for many queries at once."""
    n = -(-L // block)
    views = None
    if n * block == L:

        def query_view(q: Tensor, start: int, stop: int) -> Tensor:
            return q.narrow(2, start * block, (stop - start) * block).unflatten(2, (stop - start, block))

        views = Views(_repeated_view(0, sinks), query_view, writes=True)
    queries = torch.arange(n * block, device=device).view(n, block)
    queries = queries.masked_fill(queries >= L, L)
    keys = torch.arange(sinks, device=device).expand(1, n, sinks)
    zero = torch.zeros((), dtype=torch.long, device=device)
    head = torch.arange(heads, device=device).view(heads, 1, 1, 1)

    def allowed(start: int, stop: int) -> Tensor:
        rows, cols = queries[start:stop, :, None], keys[0, start:stop, None, :]
        return mask_mod(zero, head, rows, cols) & (rows < L)  # (H, n, bq, W)

    def leading(start: int, stop: int) -> Tensor:
        rows = torch.arange(start, stop, device=device)[:, None]
        return mask_mod(zero, head[..., 0], rows, keys[0, 0][None])  # (H, stop − start, W)

    return [Group(queries, keys, allowed, MaskFacts(in_range=True), views, leading=leading)]


def _repeated_view(first: int, W: int) -> Callable[[Tensor, int, int, int], Tensor]:
    """Keys ``first : first + W`` of the sequence for each of blocks ``start:stop``, as a
    ``(B, H, n, W, F)`` view that repeats them (no copy)."""

    def key_view(x: Tensor, pad: int, start: int, stop: int) -> Tensor:
        window = x.narrow(2, pad + first, W).unsqueeze(2)
        return window.expand(*window.shape[:2], stop - start, *window.shape[3:])

    return key_view


def _edge_source(begin: int, length: int, S: int) -> Callable[[Tensor, int], Tensor]:
    """Key rows ``begin : begin + length`` of the sequence, zero where they fall outside ``[0, S)``."""

    def source(x: Tensor, pad: int) -> Tensor:
        lo = min(max(begin, 0), S)
        hi = max(min(begin + length, S), lo)
        return F.pad(x.narrow(2, pad + lo, hi - lo), (0, 0, lo - begin, begin + length - hi))

    return source


def _edge_view(block: int, W: int) -> Callable[[Tensor, int, int, int], Tensor]:
    """Blocks ``start:stop`` of an ``_edge_source`` as ``(B, H, n, W, F)`` windows, ``block`` apart."""

    def key_view(x: Tensor, pad: int, start: int, stop: int) -> Tensor:
        return _windows(x, start * block, stop - start, block, W)

    return key_view


def _windows(x: Tensor, begin: int, count: int, step: int, W: int) -> Tensor:
    """``count`` windows of ``W`` rows of ``x`` ``(B, H, ·, F)``, the first at row ``begin``, ``step``
    apart: an overlapping view ``(B, H, count, W, F)``, no copy."""
    return x.narrow(2, begin, (count - 1) * step + W).unfold(2, W, step).transpose(-1, -2)


def query_slots(positions: Tensor, offset: int, L: int) -> Tensor:
    """Query index of each key position (``L`` where no query sits there)."""
    index = positions - offset
    return index.masked_fill((index < 0) | (index >= L), L)


def strided_view(x: Tensor, first: int, blocks: int, block_step: int, rows: int, row_step: int) -> Tensor:
    """``(B, H, blocks, rows, F)`` view of ``x`` ``(B, H, N, F)``: row r of block s is position
    ``first + s·block_step + r·row_step``."""
    B, H, _, F_ = x.shape
    sb, sh, sn, sf = x.stride()
    return x.as_strided(
        (B, H, blocks, rows, F_), (sb, sh, block_step * sn, row_step * sn, sf), x.storage_offset() + first * sn
    )


def segment_groups(
    positions: Tensor,
    L: int,
    offset: int,
    block: int,
    causal: bool,
    mask_mod: MaskMod,
    steps: tuple[int, int],
    whole: bool = False,
) -> list[Group]:
    """Dense attention inside each segment (a row of ``positions`` ``(segments, R)``, in order).

    Row blocks of ``block`` queries see the whole segment, or, when causal, its rows up to their
    own last one. Blocks with no query are dropped. ``positions[s, r] = s·a + r·b`` with
    ``steps = (a, b)``, so when every segment has queries (and L = S) the blocks are strided views
    and share one element mask (it depends on the rows only). ``whole``: one block per segment;
    causal, its mask is exactly ``j <= p`` there (the fused kernel's own causal flag).
    """
    segments, R = positions.shape
    block = R if whole else min(block, R)  # a block past the segment's rows would hold only empty slots
    slots = query_slots(positions, offset, L)
    zero = torch.zeros((), dtype=torch.long, device=positions.device)
    groups = []
    for first in range(0, R, block):
        last = min(R, first + block)
        queries = F.pad(slots[:, first:last], (0, block - (last - first)), value=L)
        keep = (queries < L).any(1)
        if not bool(keep.any()):
            continue
        width = last if causal else R
        keys = positions[keep, :width]  # (n, W)
        views, facts = None, MaskFacts()
        if offset == 0 and bool(keep.all()):  # every segment has queries: strided views
            views, facts = _segment_views(segments, R, L, steps, first, block, width, causal, whole, keys)
        queries = queries[keep]

        def allowed(start: int, stop: int, queries=queries, keys=keys) -> Tensor:
            return mask_mod(zero, zero, queries[start:stop, :, None], keys[start:stop, None, :])

        groups.append(Group(queries, keys.unsqueeze(0), allowed, facts, views))
    return groups


def _segment_views(
    segments: int, R: int, L: int, steps: tuple[int, int], first: int, block: int, width: int, causal: bool,
    whole: bool, keys: Tensor,
) -> tuple[Views, MaskFacts]:  # fmt: skip
    """The strided views of ``segment_groups``' row blocks at row ``first`` (L = S, no empty
    segment), and what is known of their mask."""
    a, b = steps

    def query_view(q_ext: Tensor, start: int, stop: int) -> Tensor:
        return strided_view(q_ext, start * a + first * b, stop - start, a, block, b)

    def key_view(x: Tensor, pad: int, start: int, stop: int) -> Tensor:
        return strided_view(x, pad + start * a, stop - start, a, width, b)

    in_range = bool((keys < L).all())
    views = Views(
        key_view,
        query_view,
        query_pad=max(0, (segments - 1) * a + (first + block - 1) * b + 1 - L),  # rows the views read
        key_pad=max(0, (segments - 1) * a + (width - 1) * b + 1 - L),
        writes=b * R >= a * segments,  # padded rows lie past the last position, not on a query
    )
    facts = MaskFacts(
        in_range=in_range,
        uniform=in_range,
        dense=in_range and not causal,  # a whole segment: all of it is visible
        causal=whole and causal and in_range,
        triangular=whole and causal,  # row j is allowed only for queries of rows >= j
    )
    return views, facts

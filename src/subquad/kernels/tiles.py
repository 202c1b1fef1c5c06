"""Exact softmax attention of query blocks to windows of a key table.

Routing attention reduces to this (a regular band such as a sliding window is cheaper through
``kernels.blocksparse``). Per (batch, head) row, a *table* lists key positions in slots
(``-1``: empty), cut into tiles of ``tile`` slots. Queries come in *blocks* of up to ``Tq``;
block b owns the window of table slots starting at tile ``start[b]``, and its query i sees the
window's first ``seen[b, i]`` slots, which must hold real keys:

    out_i = Σ_{j < seen_i} softmax_j(scale · q_i · k_{w_j}) v_{w_j}        (w_j: the j-th window slot)

Optionally query i also sees its own key, at position ``i + S − L`` (``own[i]``; it must not be
in its window), merged through the log-sum-exp: with ``ℓ`` the window's and ``s = scale · q_i ·
k_{i+S−L}``, ``λ = logaddexp(ℓ, s)`` and ``out = e^{ℓ − λ} out_window + e^{s − λ} v_{i+S−L}``.
A query that sees no key returns zeros.

``window_attention`` is one autograd Function. It runs the blocks in chunks of similar shape: a
block at most half full runs narrower (the next power of two holding its queries, at least
``TUNING.tiles_min_block``), and the keys of a chunk's windows are cut to the longest need in it, so
blocks whose queries see few keys cost few. On the CPU a chunk holds blocks of similar need;
elsewhere it holds every block of one width (up to the chunk size), as each chunk costs dozens of
kernel launches there. Each chunk goes through torch's CPU flash-attention kernel where it exists
(the unseen slots as an additive mask), else an eager softmax (both in ``kernels.softmax``). Chunk
buffers are allocated once per call, as large as the largest chunk, and reused: on CPU a fresh large
tensor costs more in page faults than the copy into it, so they are carved from huge pages
(``kernels.memory.new_buffers``). The slots no query of a block sees are zeroed by index. The
chunks' outputs are written in chunk order into a buffer the thread keeps
(``kernels.memory.kept_buffer``) and put in query order by one gather at the end. The Function saves
its inputs, the output and the log-sum-exp; the backward recomputes each chunk's probabilities.
Scores and softmax are fp32 for fp16/bf16 inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from subquad.kernels.memory import kept_buffer, new_buffers
from subquad.kernels.softmax import eager_backward, eager_forward, fused_available, fused_forward, work_dtype
from subquad.kernels.threads import adapted_backward
from subquad.kernels.tuning import TUNING, block_elements

__all__ = ["Windows", "window_attention"]

# Windows are computed in whole multiples of this many key slots. A row's softmax and its P·V sum
# run over the chunk's slot count, and vectorised reductions group their terms by that length; in
# whole multiples the unseen slots only add exact zeros to the same groups, so a query's output is
# bit-identical whichever other blocks share its chunk (in causal routing: whatever comes later).
_KEY_QUANTUM = 16


def _key_slots(need: int) -> int:
    """The key slots computed for blocks needing ``need``: whole multiples of ``_KEY_QUANTUM``."""
    return -(-max(1, need) // _KEY_QUANTUM) * _KEY_QUANTUM


@dataclass(frozen=True)
class Windows:
    """Query blocks and the key-table windows they see (module docstring).

    Shapes: R rows (batch × heads), M table slots, nb blocks of Tq query slots.

    Attributes:
        table: ``(R, M)`` key positions, ``-1`` for an empty slot.
        tile: slots per table tile; windows start on tile boundaries.
        queries: ``(R, nb, Tq)`` query positions, ``-1`` for an empty slot (empty slots last in
            a block); every position in exactly one slot.
        start: ``(R, nb)`` the first table tile of each block's window.
        seen: ``(R, nb, Tq)`` or ``(R, nb, 1)``: how many leading window slots each query sees.
        own: bool ``(R, L)``: query i also sees the key at position ``i + S − L``; or None.
    """

    table: Tensor
    tile: int
    queries: Tensor
    start: Tensor
    seen: Tensor
    own: Tensor | None = None


def window_attention(q: Tensor, k: Tensor, v: Tensor, windows: Windows, scale: float) -> Tensor:
    """Softmax attention of each query to the keys its block's window (and ``own``) shows it.

    Args:
        q, k, v: ``(R, L, D)``, ``(R, S, D)``, ``(R, S, Dv)`` (rows are batch × heads).
        windows: the blocks and windows.
        scale: the softmax scale.

    Returns:
        ``(R, L, Dv)``; zeros for queries with no visible key.
    """
    w = windows
    return _WindowAttention.apply(q, k, v, w.table, w.tile, w.queries, w.start, w.seen, w.own, scale)


def _take(buffer: Tensor, x: Tensor, index: Tensor) -> Tensor:
    """Rows ``x[index]`` of ``x`` ``(N, D)``, written into the front of ``buffer``: ``(*index.shape, D)``."""
    out = buffer[: index.numel() * x.shape[1]].view(index.numel(), x.shape[1])
    if x.dtype == buffer.dtype:
        torch.index_select(x, 0, index.flatten(), out=out)
    else:
        out.copy_(x.index_select(0, index.flatten()))
    return out.view(*index.shape, x.shape[1])


def _hidden_slots(shown: Tensor) -> Tensor | None:
    """The flat indices of the slots no query sees, on the CPU (None elsewhere: a count there would
    wait for the device)."""
    return torch.nonzero(~shown.view(-1)).view(-1) if shown.device.type == "cpu" else None


def _zero_rows(x: Tensor, shown: Tensor, hidden: Tensor | None) -> Tensor:
    """``x`` ``(n, Tk, F)`` with the rows of the unshown slots zeroed in place. On the CPU the
    hidden rows are filled by index: a bool mask broadcast over F (``masked_fill_``) defeats torch's
    vectorised fill there (the figures are in docs/performance.md)."""
    if hidden is None:
        return x.masked_fill_(~shown[..., None], 0)
    if hidden.numel():
        x.view(-1, x.shape[-1]).index_fill_(0, hidden, 0)
    return x


class _Plan:
    """Flat row indices of the blocks, sorted by width and by the window slots they need, in chunks."""

    def __init__(self, R: int, L: int, S: int, table: Tensor, tile: int, queries: Tensor, start: Tensor,
                 seen: Tensor) -> None:  # fmt: skip
        M, (nb, Tq) = table.shape[1], queries.shape[1:]
        rows = torch.arange(R, device=table.device)[:, None]
        self.dummy = R * L  # row R·L of the outputs takes the empty query slots
        self.keys = torch.where(table >= 0, table + rows * S, 0).flatten()  # (R·M) rows of k
        self.filled = (table >= 0).flatten()  # (R·M): slots holding a key
        need = seen.amax(-1).flatten()  # (R·nb)
        used = (queries >= 0).sum(-1).flatten()
        width = torch.full_like(used, TUNING.tiles_min_block)  # the next power of two holding a block's queries
        while bool((width < used).any()):
            width = torch.where(width < used, width * 2, width)
        width = torch.where(used > Tq // 2, Tq, width.clamp(max=Tq))  # at most half full: narrower
        order = (width * (int(need.max()) + 1) + need).argsort()
        self.queries = torch.where(queries >= 0, queries + rows[..., None] * L, R * L).view(R * nb, Tq)[order]
        self.start = (start * tile + rows * M).flatten()[order]  # each window's first slot
        self.seen = seen.reshape(R * nb, -1)[order]  # (R·nb, Tq or 1)
        self.need = need[order, None]  # (R·nb, 1): the slots a block's queries see at most
        self.longest = _key_slots(int(need.max()))  # buffers hold `step` blocks of Tq queries and this many keys
        # Chunks of about `tiles_group` scores (within a core's L2), but not more than about
        # `tiles_chunks` of them: each costs its dozens of small operations (docs/performance.md).
        step = block_elements(TUNING.tiles_group, table.device) // (Tq * self.longest)
        self.Tq, self.step = Tq, max(1, step, -(-R * nb // TUNING.tiles_chunks))
        # Off the CPU each chunk costs dozens of kernel launches, more than computing unseen slots.
        tight = table.device.type == "cpu"
        self.chunks = _chunks(width[order].tolist(), need[order].tolist(), self.step, tight)
        # The fewest slots a query of each block sees (an empty query slot: 0), read once on the
        # CPU so that each chunk knows without a check whether it needs a mask.
        self.least = self.seen.amin(-1).tolist() if tight else None
        self._slot: Tensor | None = None
        self._lookup: dict[int, Tensor] = {}

    def slot_rows(self, name: str, width: int, dtype: torch.dtype) -> Tensor:
        """A buffer of a row of ``width`` for each query slot of the chunks, in chunk order
        ``(Σ n·Tq, width)``: the chunks write their rows into it one after another. The thread's
        kept buffer ``name`` (``memory.kept_buffer``): no output may be a view of it."""
        slots = sum((end - first) * Tq for first, end, Tq, _ in self.chunks)
        return kept_buffer(name, slots * width, dtype, self.start.device).view(slots, width)

    def in_query_order(self, rows: Tensor) -> Tensor:
        """``rows`` of ``slot_rows`` as a new ``(R·L, ·)`` in query order: one gather. Writing each
        chunk into place instead (``index_copy_``) is several times slower on the CPU
        (docs/performance.md)."""
        if self._slot is None:  # each query's slot among the chunks' slots, in chunk order
            query = torch.cat([self.queries[first:end, :Tq].reshape(-1) for first, end, Tq, _ in self.chunks])
            slots = torch.arange(len(query), device=query.device)
            self._slot = torch.empty(self.dummy + 1, dtype=torch.long, device=query.device).index_copy_(0, query, slots)
        return rows.index_select(0, self._slot[: self.dummy])

    def chunk(self, first: int, end: int, Tq: int, Tk: int, q, k, v, buffers: dict[str, Tensor]) -> _Chunk:
        blocks = slice(first, end)
        slots = (self.start[blocks, None] + torch.arange(Tk, device=self.start.device)).clamp_(max=len(self.keys) - 1)
        # The slots no query of a block sees (empty ones, those past its window: another row's)
        # are computed with zero keys and values, so nothing they hold meets a zero weight.
        shown = self.filled[slots] & (torch.arange(Tk, device=slots.device) < self.need[blocks])
        least = None if self.least is None else min(self.least[blocks])
        return _Chunk(self.queries[blocks, :Tq], self.dummy, self.keys[slots], shown, self.seen[blocks, :Tq], least,
                      q, k, v, buffers)  # fmt: skip

    def lookup(self, Tk: int, dtype: torch.dtype) -> Tensor:
        """``(Tk + 1, Tk)``: row s is s zeros, then −inf (the additive masks' rows), made once per call."""
        table = self._lookup.get(Tk)
        if table is None:
            table = torch.full((Tk + 1, Tk), -torch.inf, dtype=dtype, device=self.start.device).triu_()
            self._lookup[Tk] = table
        return table


def _chunks(widths: list[int], needs: list[int], step: int, tight: bool = True) -> list[tuple[int, int, int, int]]:
    """Cut blocks sorted by (width, need) into runs ``(first, end, Tq, Tk)`` of at most ``step``
    blocks of one width, each computed ``Tq`` queries by ``Tk`` = its longest need (at least 1)
    keys. If ``tight``, the needs in a run exceed its first's by at most an eighth plus 8 slots."""
    chunks, first = [], 0
    for end in range(1, len(needs) + 1):
        if (end == len(needs) or end - first == step or widths[end] != widths[first]
                or (tight and needs[end] > needs[first] * 9 // 8 + 8)):  # fmt: skip
            chunks.append((first, end, widths[first], _key_slots(needs[end - 1])))
            first = end
    return chunks


class _Chunk:
    """One chunk of blocks: gathered queries, window keys and values, and the unseen slots."""

    def __init__(self, query_rows, dummy, key_rows, shown, seen, least, q, k, v, buffers: dict[str, Tensor]) -> None:
        self.query_rows, self.dummy = query_rows, dummy  # (n, Tq), `dummy` for an empty slot
        self.q_rows = query_rows.clamp(max=dummy - 1)  # (n, Tq): empty slots compute on a real row
        self.key_rows = key_rows  # (n, Tk)
        self.q = _take(buffers["q"], q, self.q_rows)  # (n, Tq, D)
        hidden = _hidden_slots(shown)
        self.k = _zero_rows(_take(buffers["k"], k, key_rows), shown, hidden)  # (n, Tk, D)
        self.v = _zero_rows(_take(buffers["v"], v, key_rows), shown, hidden)  # (n, Tk, Dv)
        self.seen = seen  # (n, Tq or 1), at most Tk (the longest need in the chunk)
        # `least`: the fewest slots a query sees, known on the CPU only (elsewhere reading it would
        # wait for the device; None). Every query sees the whole window: no mask.
        self.least = least
        self.full = least is not None and least >= key_rows.shape[1]

    def q_ok(self) -> Tensor:
        """The query slots holding a query, bool ``(n, Tq)``."""
        return self.query_rows < self.dummy

    def additive_mask(self, buffer: Tensor, lookup: Tensor) -> Tensor | None:
        """The unseen slots as −inf, else 0, ``(n, Tq or 1, Tk)``: rows of ``lookup`` (``_Plan.lookup``)."""
        if self.full:
            return None
        return _take(buffer, lookup, self.seen)

    def allowed(self) -> Tensor | None:
        """The slots each query sees, bool ``(n, Tq or 1, Tk)``; None where it sees them all."""
        if self.full:
            return None
        return torch.arange(self.k.shape[1], device=self.seen.device) < self.seen[..., None]

    def output(self, scale: float, fused: bool, buffers: dict[str, Tensor], plan: _Plan) -> tuple[Tensor, Tensor]:
        """Softmax over the window: output ``(n, Tq, Dv)`` and log-sum-exp ``(n, Tq)`` (−inf where
        no slot is seen, with a zero output)."""
        n, Tq, D = self.q.shape
        Tk = self.k.shape[1]
        if fused:
            mask = self.additive_mask(buffers["mask"], plan.lookup(Tk, buffers["mask"].dtype))
            out, lse = fused_forward(
                self.q.view(n, 1, Tq, D), self.k.view(n, 1, Tk, D), self.v.view(n, 1, Tk, -1),
                None if mask is None else mask.view(n, 1, *mask.shape[1:]), False, scale,
            )  # fmt: skip
            out, lse = out.view(n, Tq, -1), lse.view(n, Tq)
        else:
            out, lse = eager_forward(self.q, self.k, self.v, self.allowed(), scale)
        if self.least is not None and self.least > 0:  # every query sees a slot
            return out, lse
        return out, lse.masked_fill((self.seen == 0).expand(n, Tq), -torch.inf)


def _buffers(plan: _Plan, q: Tensor, v: Tensor, work: torch.dtype) -> dict[str, Tensor]:
    """Chunk buffers, allocated once per call (module docstring)."""
    rows, D, Dv = max(end - first for first, end, _, _ in plan.chunks), q.shape[-1], v.shape[-1]
    sizes = {"q": rows * plan.Tq * D, "k": rows * plan.longest * D, "v": rows * plan.longest * Dv,
             "mask": rows * plan.Tq * plan.longest}  # fmt: skip
    return dict(zip(sizes, new_buffers([(size,) for size in sizes.values()], work, q.device, zero=False)))


def _own_keys(q: Tensor, k: Tensor, v: Tensor, own: Tensor, scale: float, work: torch.dtype):
    """Each query's own key and value ``(R, L, ·)`` (at position i + S − L) and its score
    ``(R, L)``, −inf where ``own`` is False."""
    L, S = q.shape[1], k.shape[1]
    k_own, v_own = k[:, max(0, S - L) :].to(work), v[:, max(0, S - L) :].to(work)
    if L > S:  # queries before the first key have no own key
        pad = lambda x: torch.cat([x.new_zeros(x.shape[0], L - S, x.shape[2]), x], dim=1)  # noqa: E731
        k_own, v_own = pad(k_own), pad(v_own)
    score = torch.empty(q.shape[:2], dtype=work, device=q.device)
    product = torch.empty(q.shape[1:], dtype=work, device=q.device)  # reused: one row at a time
    for r in range(q.shape[0]):
        score[r] = torch.mul(q[r], k_own[r], out=product).sum(-1)
    return k_own, v_own, score.mul_(scale).masked_fill_(~own, -torch.inf)


class _WindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, table, tile, queries, start, seen, own, scale):  # type: ignore[override]
        R, L, D = q.shape
        S, Dv = k.shape[1], v.shape[2]
        work = work_dtype(q.dtype)
        plan = _Plan(R, L, S, table, tile, queries, start, seen)
        q_, k_, v_ = q.reshape(R * L, D), k.reshape(R * S, D), v.reshape(R * S, Dv)
        fused = fused_available(q.device, D, Dv)
        buffers = _buffers(plan, q, v, work)
        outs, lses = plan.slot_rows("tiles.rows", Dv, work), plan.slot_rows("tiles.lse", 1, work)
        at = 0
        for first, end, Tq, Tk in plan.chunks:
            chunk = plan.chunk(first, end, Tq, Tk, q_, k_, v_, buffers)
            o, m = chunk.output(scale, fused, buffers, plan)
            outs[at : at + m.numel()] = o.flatten(0, 1)
            lses[at : at + m.numel(), 0] = m.flatten()
            at += m.numel()
        out = plan.in_query_order(outs).view(R, L, Dv)
        lse = plan.in_query_order(lses).view(R, L)
        if own is not None:  # merge the own key through the log-sum-exp (module docstring)
            _, v_own, s_own = _own_keys(q, k, v, own, scale, work)
            total = torch.logaddexp(lse, s_own)
            total.masked_fill_(total == -torch.inf, 0)  # no key at all: both weights below are 0
            out.lerp_(v_own, (s_own - total).exp_()[..., None])  # the two weights sum to 1
            lse = total
        lse.masked_fill_(lse == -torch.inf, 0)  # the backward's probabilities exp(−inf − 0) = 0
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, own)
        ctx.plan, ctx.scale, ctx.work = plan, scale, work
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    @adapted_backward
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        q, k, v, out, lse, own = ctx.saved_tensors
        plan, scale, work = ctx.plan, ctx.scale, ctx.work
        R, L, D = q.shape
        S, Dv = k.shape[1], v.shape[2]
        grad = grad.to(work)
        delta = (grad * out.to(work)).sum(-1)  # (R, L): Σ_d dO·O, the softmax backward's row term
        grad_q, at = plan.slot_rows("tiles.rows", D, work), 0
        grad_k = torch.zeros(R * S, D, dtype=work, device=q.device)
        grad_v = torch.zeros(R * S, Dv, dtype=work, device=q.device)
        flat = lambda x: x.reshape(R * L, *x.shape[2:])  # noqa: E731
        q_, k_, v_ = flat(q), k.reshape(R * S, D), v.reshape(R * S, Dv)
        buffers = _buffers(plan, q, v, work)
        for first, end, Tq, Tk in plan.chunks:
            g = plan.chunk(first, end, Tq, Tk, q_, k_, v_, buffers)
            rows = g.q_rows.flatten()
            go = flat(grad).index_select(0, rows).view(*g.q_rows.shape, Dv)  # (n, Tq, Dv)
            real = g.q_ok()
            total = flat(lse)[rows].view_as(real).masked_fill_(~real, torch.inf)  # empty slots: probabilities 0
            dq, dk, dv = eager_backward(g.q, g.k, g.v, go, total, flat(delta)[rows].view_as(real), g.allowed(), scale)
            keys = g.key_rows.flatten()
            grad_v.index_add_(0, keys, dv.flatten(0, 1))
            grad_k.index_add_(0, keys, dk.flatten(0, 1))
            grad_q[at : at + len(rows)] = dq.flatten(0, 1)
            at += len(rows)
        grad_q = plan.in_query_order(grad_q).view(R, L, D)
        grad_k, grad_v = grad_k.view(R, S, D), grad_v.view(R, S, Dv)
        if own is not None:
            k_own, v_own, s_own = _own_keys(q, k, v, own, scale, work)
            p_own = (s_own - lse).exp_()[..., None]  # (R, L, 1), 0 where there is no own key
            ds_own = p_own * ((grad * v_own).sum(-1, keepdim=True) - delta[..., None]) * scale
            grad_q += ds_own * k_own
            first = max(0, L - S)  # the first query with a key of its own
            grad_k[:, max(0, S - L) :] += (ds_own * q.to(work))[:, first:]
            grad_v[:, max(0, S - L) :] += (p_own * grad)[:, first:]
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), *([None] * 7)

"""Kernel (linear) attention (Katharopoulos, Vyas, Pappas & Fleuret 2020).

Softmax similarity is replaced by a feature map φ, so the sums over keys factor out of the queries:

    out_i = φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / (φ(q_i)ᵀ Σ_j φ(k_j) + ε)

with φ = elu(x) + 1 (their default) or ReLU (AdaMRA's). ε keeps a query whose features are all
zero (possible under ReLU), or that sees no key, at a zero output instead of 0/0. Padded keys get
φ(k) = 0. The non-causal form costs O(N·D·Dv) time and O(D·Dv) state per head. It is one
autograd Function (``_NonCausal``) that runs block by block in both passes, recomputing φ in the
backward, so only q, k, v and the two sums are saved.

**Causal form.** The sums run over j ≤ i. Writing the normaliser as one more value column (v' = [v, 1])
makes numerator and denominator one causal product ``y_i = Σ_{j≤i} (a_i·b_j) c_j`` with a = φ(q),
b = φ(k), c = v'. It is computed in chunks of ``chunk`` positions: inside a chunk by a masked
(chunk × chunk) product, across chunks through the running state ``S = Σ b_j c_jᵀ`` (D × Dv+1).
The per-position cost is about 4·chunk·D + 4·D·Dv, least near chunk = √(D·Dv): 64 by default.
One autograd Function (``_Causal``) runs over blocks of positions in time order, computing φ and
v for the block only, with the block's chunk states as running sums, so memory stays
O(N·D + block·D·Dv), never O(N·D²). Its forward carries the normaliser's state Σ φ(k) beside
S rather than as a ones column: (D × Dv+1) products run a quarter slower than (D × Dv) ones.
Its backward is the same product run forwards in time (for ∂q) and backwards in time (for ∂k,
∂v), recomputing φ per block: only q, k, v, the output and the denominators are saved. With
L ≠ S the queries are the last L positions of the keys (bottom-right alignment): keys before them
enter as the initial state. ``causal_dot`` exposes the bare product,
differentiable, for mechanisms built on it.

**Decoding.** ``LinearDecoder`` carries S and the normaliser per head (O(D·Dv), whatever the prefix
length) and runs the same chunked product from that state for each new block of tokens. Sums are
accumulated in fp32 for fp16/bf16 inputs.

There is no softmax, so there is no scale: ``scale`` must be left None.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from subquad._blocks import Scratch, block_elements, new_buffers, new_output, new_output_like
from subquad._validate import check_attention_inputs
from subquad.registry import Config, Mechanism, option

if TYPE_CHECKING:
    from torch import nn

__all__ = ["LinearConfig", "LinearDecoder", "causal_dot", "feature_map", "linear_attention"]

_BLOCK_STATE_ELEMENTS = 1 << 18  # chunk states held at once: rows × chunks × D × Dc
_BLOCK_ELEMENTS = 1 << 19  # non-causal form: positions × rows × width per block of keys or queries
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class LinearConfig(Config):
    mechanism = "linear"
    feature_map: str = option(
        "elu", "φ: elu (elu(x) + 1, Katharopoulos et al.) or relu (AdaMRA)", choices=("elu", "relu")
    )
    eps: float = option(1e-6, "ε added to the normaliser φ(q)ᵀ Σ φ(k)", gt=0)
    chunk: int = option(64, "causal form: positions per chunk of the exact in-chunk product", ge=1)


def feature_map(x: Tensor, name: str) -> Tensor:
    """φ(x): ``elu`` gives elu(x) + 1 > 0; ``relu`` gives max(x, 0)."""
    if name == "elu":  # elu(x) + 1 = exp(min(x, 0)) + max(x, 0): a third faster on CPU than F.elu
        if torch.is_grad_enabled() and x.requires_grad:
            return torch.exp(x.clamp(max=0)) + F.relu(x)
        return _features_into(x, name, torch.empty_like(x, memory_format=torch.contiguous_format))
    if name == "relu":
        return F.relu(x)
    raise ValueError(f"unknown feature map {name!r}; choose elu or relu")


# ---------------------------------------------------------------------------------------------
# The causal product y_i = Σ_{j≤i} (a_i·b_j) c_j + a_iᵀ S0
# ---------------------------------------------------------------------------------------------


def _causal_dot_blocked(a: Tensor, b: Tensor, c: Tensor, initial: Tensor | None, chunk: int) -> Tensor:
    """``y_i = Σ_{j≤i} (a_i·b_j) c_j + a_iᵀ initial`` for rows ``(R, N, ·)``, without autograd."""
    R, N, Da = a.shape
    Dc = c.shape[-1]
    chunk = max(1, min(chunk, N))
    chunks = -(-N // chunk)
    pad = chunks * chunk - N
    if pad:  # zero rows add nothing to the state; their outputs are cut off below
        a, b, c = (F.pad(x, (0, 0, 0, pad)) for x in (a, b, c))
    a, b, c = (x.view(R, chunks, chunk, x.shape[-1]) for x in (a, b, c))
    state = a.new_zeros(R, 1, Da, Dc) if initial is None else initial.unsqueeze(1)
    per_block = max(1, block_elements(_BLOCK_STATE_ELEMENTS, a.device) // (R * Da * Dc))
    out = a.new_empty(R, chunks, chunk, Dc)
    for start in range(0, chunks, per_block):
        block = slice(start, start + per_block)
        ab, bb, cb = a[:, block], b[:, block], c[:, block]
        scores = torch.matmul(ab, bb.transpose(-1, -2)).tril_()  # (R, n, chunk, chunk)
        updates = torch.matmul(bb.transpose(-1, -2), cb)  # (R, n, Da, Dc): each chunk's Σ b cᵀ
        before = F.pad(torch.cumsum(updates[:, :-1], dim=1), (0, 0, 0, 0, 1, 0)) + state  # entering each chunk
        out[:, block] = torch.matmul(scores, cb) + torch.matmul(ab, before)
        state = before[:, -1:] + updates[:, -1:]
    return out.view(R, chunks * chunk, Dc)[:, :N]


class _CausalDot(torch.autograd.Function):
    """The chunked causal product with a backward pass that is the same product, run forwards
    (for a) and backwards in time (for b and c), so only the inputs are saved."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, c: Tensor, initial: Tensor | None, chunk: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b, c, initial)
        ctx.chunk = chunk
        return _causal_dot_blocked(a, b, c, initial, chunk)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        a, b, c, initial = ctx.saved_tensors
        chunk = ctx.chunk
        grad_a = grad_b = grad_c = grad_initial = None
        if ctx.needs_input_grad[0]:
            # ∂/∂a_i = Σ_{j≤i} (g_i·c_j) b_j + initial g_i
            grad_a = _causal_dot_blocked(grad, c, b, None if initial is None else initial.transpose(1, 2), chunk)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            flip = lambda x: x.flip(1)  # noqa: E731 - reversed time: Σ_{i≥j} becomes a causal sum
            if ctx.needs_input_grad[1]:  # ∂/∂b_j = Σ_{i≥j} (g_i·c_j) a_i
                grad_b = flip(_causal_dot_blocked(flip(c), flip(grad), flip(a), None, chunk))
            if ctx.needs_input_grad[2]:  # ∂/∂c_j = Σ_{i≥j} (a_i·b_j) g_i
                grad_c = flip(_causal_dot_blocked(flip(b), flip(a), flip(grad), None, chunk))
        if initial is not None and ctx.needs_input_grad[3]:
            grad_initial = torch.matmul(a.transpose(1, 2), grad)  # Σ_i a_i g_iᵀ
        return grad_a, grad_b, grad_c, grad_initial, None


def causal_dot(a: Tensor, b: Tensor, c: Tensor, initial: Tensor | None = None, chunk: int = 64) -> Tensor:
    """``y_i = Σ_{j≤i} (a_i·b_j) c_j + a_iᵀ initial`` over rows ``(R, N, ·)``; differentiable.

    Args:
        a, b: ``(R, N, Da)``.
        c: ``(R, N, Dc)``.
        initial: ``(R, Da, Dc)`` state before the first position, or None.
        chunk: positions per chunk.

    Returns:
        ``(R, N, Dc)``.
    """
    return _CausalDot.apply(a, b, c, initial, chunk)


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


def _features(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, config: LinearConfig):
    """φ(q), φ(k) with padded keys zeroed, and v with a ones column (the normaliser), in fp32+."""
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    fq = feature_map(q.to(work), config.feature_map)
    fk = feature_map(k.to(work), config.feature_map)
    if key_padding_mask is not None:
        fk = fk * key_padding_mask[:, None, :, None].to(work)
    v1 = torch.cat([v.to(work), v.new_ones(*v.shape[:-1], 1, dtype=work)], dim=-1)  # (B, H, S, Dv + 1)
    return fq, fk, v1


def _normalise(y: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """Numerator over (denominator + ε), from the product with the ones column last."""
    return (y[..., :-1] / (y[..., -1:] + eps)).to(dtype)


def _feature_grad(x: Tensor, name: str) -> Tensor:
    """φ'(x): elu+1 has derivative 1 above 0 and exp(x) below; ReLU has 1 above 0 and 0 below."""
    if name == "elu":
        return torch.where(x > 0, 1.0, torch.exp(x.clamp(max=0)))
    return (x > 0).to(x.dtype)


class _NonCausal(torch.autograd.Function):
    """Non-causal linear attention, computed block by block forwards and backwards.

    Forward: Σ φ(k) vᵀ and Σ φ(k) over blocks of keys, then each block of queries against them.
    Backward recomputes φ block by block and writes the gradients in place, so only q, k, v and the
    two small sums are saved: no full-size feature tensor exists in either pass.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, name: str, eps: float) -> Tensor:  # type: ignore[override]
        B, H, L, D = q.shape
        S, Dv = k.shape[2], v.shape[3]
        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        block = max(1, block_elements(_BLOCK_ELEMENTS, q.device) // (B * H * max(D, Dv)))
        kv = q.new_zeros(B, H, D, Dv, dtype=work)
        z = q.new_zeros(B, H, 1, D, dtype=work)
        scratch = Scratch(work, q.device)
        for start in range(0, S, block):
            x = k[:, :, start : start + block]
            fk = _features_into(x, name, scratch("phi", x.shape), scratch)
            if mask is not None:
                fk *= mask[:, None, start : start + block, None]
            _add_matmul_(kv, fk.transpose(-1, -2), v[:, :, start : start + block].to(work))
            z += fk.sum(2, keepdim=True)
        out = new_output((B, H, L, Dv), q.dtype, q.device)
        for start in range(0, L, block):
            x = q[:, :, start : start + block]
            fq = _features_into(x, name, scratch("phi", x.shape), scratch)
            # φ(q)·z as a product and a sum: a matrix product with one column is slow in BLAS
            den = torch.mul(fq, z, out=scratch("product", fq.shape)).sum(-1, keepdim=True).add_(eps)
            num = torch.matmul(fq, kv, out=scratch("num", (*fq.shape[:-1], Dv)))
            torch.div(num, den, out=out[:, :, start : start + block])
        z = z.transpose(-1, -2)
        ctx.save_for_backward(q, k, v, mask, kv, z)
        ctx.name, ctx.eps, ctx.block, ctx.work = name, eps, block, work
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        q, k, v, mask, kv, z = ctx.saved_tensors
        name, eps, block, work = ctx.name, ctx.eps, ctx.block, ctx.work
        L, S = q.shape[2], k.shape[2]
        grad_kv, grad_z = torch.zeros_like(kv), torch.zeros_like(z)
        grad_q = new_output_like(q) if ctx.needs_input_grad[0] else None
        for start in range(0, L, block):  # out = num / den with num = φ(q) KV, den = φ(q) z + ε
            x = q[:, :, start : start + block].to(work)
            fq = feature_map(x, name)
            den = torch.matmul(fq, z).add_(eps)
            g = grad[:, :, start : start + block].to(work)
            grad_num = g / den
            grad_den = -(grad_num * torch.matmul(fq, kv)).sum(-1, keepdim=True) / den
            grad_kv += torch.matmul(fq.transpose(-1, -2), grad_num)
            grad_z += torch.matmul(fq.transpose(-1, -2), grad_den)
            if grad_q is not None:
                grad_fq = torch.matmul(grad_num, kv.transpose(-1, -2)) + grad_den * z.transpose(-1, -2)
                grad_q[:, :, start : start + block] = grad_fq * _feature_grad(x, name)
        grad_k = new_output_like(k) if ctx.needs_input_grad[1] else None
        grad_v = new_output_like(v) if ctx.needs_input_grad[2] else None
        for start in range(0, S, block):  # KV = Σ φ(k) vᵀ, z = Σ φ(k)
            fk = _key_features(k, mask, start, block, name, work)
            if grad_v is not None:
                grad_v[:, :, start : start + block] = torch.matmul(fk, grad_kv)
            if grad_k is not None:
                x = k[:, :, start : start + block].to(work)
                grad_fk = torch.matmul(v[:, :, start : start + block].to(work), grad_kv.transpose(-1, -2))
                grad_fk += grad_z.transpose(-1, -2)
                if mask is not None:
                    grad_fk *= mask[:, None, start : start + block, None].to(work)
                grad_k[:, :, start : start + block] = grad_fk * _feature_grad(x, name)
        return grad_q, grad_k, grad_v, None, None, None


def _key_features(k: Tensor, mask: Tensor | None, start: int, block: int, name: str, work: torch.dtype) -> Tensor:
    fk = feature_map(k[:, :, start : start + block].to(work), name)
    if mask is not None:
        fk = fk * mask[:, None, start : start + block, None].to(work)
    return fk


def _chunk_states(updates: Tensor, state: Tensor, reverse: bool = False) -> tuple[Tensor, Tensor]:
    """From per-chunk ``updates`` ``(B, H, m, ·, ·)`` (consumed), the state entering each chunk,
    ``state`` plus the chunks before it in time order (after it when ``reverse``), and the state
    after the last chunk."""
    if reverse:
        before, after = _chunk_states(updates.flip(2), state)
        return before.flip(2), after
    before = torch.empty_like(updates)
    before[:, :, 0] = state
    if updates.shape[2] > 1:
        updates[:, :, 0] += state
        torch.cumsum(updates[:, :, :-1], dim=2, out=before[:, :, 1:])
    return before, before[:, :, -1] + updates[:, :, -1]


def _add_matmul_(y: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``y += a @ b`` in place over any leading dims (one fused BLAS call per matrix)."""
    y.view(-1, *y.shape[-2:]).baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return y


def _chunked(x: Tensor, chunk: int) -> Tensor:
    """``(B, H, n, ·)`` as ``(B, H, n / chunk, chunk, ·)``, zero-padded to whole chunks."""
    pad = -x.shape[2] % chunk
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.view(*x.shape[:2], -1, chunk, x.shape[-1])


class _CausalBlock:
    """The buffers of one block of ``n`` positions (``m`` chunks) of ``_Causal``'s forward, and the
    views of them it uses, made once per call: at a few hundred positions per block, making a view
    costs about as much as a small op."""

    def __init__(
        self, B: int, H: int, n: int, chunk: int, D: int, Dv: int, name: str, work: torch.dtype, device
    ) -> None:
        m = -(-n // chunk)
        rows = m * chunk
        self.n, self.scaled = n, name == "elu" and work != torch.float64  # φ through exp2 of x·log2 e
        (ab, self.t, c, self.updates, self.before, self.z_updates, self.z_before, self.scores, y, self.inter, d) = (
            new_buffers(
                [
                    (2, B, H, rows, D),  # φ(q), φ(k)
                    (2, B, H, n if self.scaled else 0, D),  # x·log2 e for φ(q), φ(k)
                    (B, H, rows, Dv),
                    (B, H, m, D, Dv),
                    (B, H, m, D, Dv),
                    (B, H, m, D),
                    (B, H, m, D),
                    (B, H, m, chunk, chunk),
                    (B, H, rows, Dv),
                    (B, H, m, chunk, D),
                    (B, H, m, chunk),
                ],
                work,
                device,
                # zeros: the rows of a last, partial block past n stay zero, and add nothing to the state
                zero=n < rows,
            )
        )
        self.ab, self.ab_rows, self.t_q, self.t_k = ab, ab[:, :, :, :n], self.t[0], self.t[1]
        self.a, self.b = (x.view(B, H, m, chunk, D) for x in ab)
        self.b_rows = ab[1, :, :, :n]
        self.c, self.c_rows = c.view(B, H, m, chunk, Dv), c[:, :, :n]
        self.z_before_row = self.z_before.unsqueeze(-2)
        self.y, self.y_3, self.y_rows = y.view(B, H, m, chunk, Dv), y.view(-1, chunk, Dv), y[:, :, :n]
        self.a_3, self.before_3 = self.a.view(-1, chunk, D), self.before.view(-1, D, Dv)
        self.d, self.d_rows = d, d.view(B, H, rows, 1)[:, :, :n]
        self.b_t3, self.c_3 = self.b.view(-1, chunk, D).transpose(1, 2), self.c.view(-1, chunk, Dv)
        self.updates_3, self.scores_3 = self.updates.view(-1, D, Dv), self.scores.view(-1, chunk, chunk)
        # chunk j's entering state is the block's plus the updates of chunks i < j: a product with a
        # strictly lower-triangular matrix of ones, faster on CPU than a cumsum along a middle dim
        earlier = torch.ones(m, m, dtype=work, device=device).tril_(-1).expand(B * H, m, m)
        self.states = tuple(
            (earlier, u.view(B * H, m, -1), b.view(B * H, m, -1), b[:, :, -1], u[:, :, -1])
            for u, b in ((self.updates, self.before), (self.z_updates, self.z_before))
        )

    def features(self, q: Tensor, k: Tensor, name: str) -> None:
        """φ(q) and φ(k) of the block's positions into the first n rows of ``a`` and ``b``."""
        if self.scaled:  # one pass over both after the products
            torch.mul(q, _LOG2E, out=self.t_q)
            torch.mul(k, _LOG2E, out=self.t_k)
            _elu_from_scaled(self.t, self.ab_rows)
        else:
            _features_into(q, name, self.ab[0])
            _features_into(k, name, self.ab[1])

    def chunk_states(self, which: int, state: Tensor) -> Tensor:
        """Into ``before`` (``which`` 0) or ``z_before`` (1), ``(B, H, m, ·)``: the state entering
        each chunk, ``state`` plus the updates of the chunks before it. Returns the state after the
        last chunk."""
        earlier, updates, before, last, last_update = self.states[which]
        torch.baddbmm(state.reshape(updates.shape[0], 1, -1), earlier, updates, out=before)
        return last + last_update


class _Causal(torch.autograd.Function):
    """Causal linear attention, fused: features, chunked causal product and normalisation.

    Forward runs over blocks of positions in time order carrying ``S = Σ φ(k) vᵀ`` and
    ``z = Σ φ(k)``; each block computes φ for its own positions only, in buffers reused across
    blocks. It saves q, k, v, the output and the denominators. The backward recomputes φ per block
    (with S as ``Σ φ(k) [v, 1]ᵀ``) in two sweeps: forwards in time for ∂q (which needs S), and
    backwards in time for ∂k and ∂v (which need ``R = Σ_{i later} φ(q_i) G_iᵀ``, G the gradient of
    the un-normalised product). So no full-size feature or product tensor exists in either pass.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, initial, name: str, eps: float, chunk: int) -> Tensor:  # type: ignore[override]
        B, H, N, D = q.shape
        Dv = v.shape[-1]
        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        chunk = max(1, min(chunk, N))
        step = chunk * max(1, block_elements(_BLOCK_STATE_ELEMENTS, q.device) // (B * H * D * (Dv + 1)))
        if initial is None:
            state, z = q.new_zeros(B, H, D, Dv, dtype=work), q.new_zeros(B, H, D, dtype=work)
        else:
            state, z = initial[..., :Dv].to(work), initial[..., Dv].to(work)
        out = new_output((B, H, N, Dv), q.dtype, q.device)
        den = q.new_empty(B, H, N, 1, dtype=work)
        w: _CausalBlock | None = None  # every block but the last has the same length
        # one split per tensor rather than a slice per block: making a view costs about as much as a small op
        pieces = (x.split(step, dim=2) for x in (q, k, v, out, den))
        masks = itertools.repeat(None) if mask is None else mask[:, None, :, None].split(step, dim=2)
        for qb, kb, vb, out_b, den_b, mask_b in zip(*pieces, masks):
            n = qb.shape[2]
            if w is None or w.n != n:
                w = None  # the last block's buffers replace the others': one set at a time
                w = _CausalBlock(B, H, n, chunk, D, Dv, name, work, q.device)
            w.features(qb, kb, name)
            if mask_b is not None:
                w.b_rows *= mask_b
            w.c_rows.copy_(vb)
            # the normaliser runs beside the values, not as a ones column: 65-wide products are slow
            torch.bmm(w.b_t3, w.c_3, out=w.updates_3)
            state = w.chunk_states(0, state)
            torch.sum(w.b, 3, out=w.z_updates)
            z = w.chunk_states(1, z)
            torch.bmm(w.a_3, w.b_t3, out=w.scores_3).tril_()
            torch.bmm(w.scores_3, w.c_3, out=w.y_3)
            w.y_3.baddbmm_(w.a_3, w.before_3)
            torch.sum(w.scores, -1, out=w.d).add_(torch.mul(w.a, w.z_before_row, out=w.inter).sum(-1)).add_(eps)
            den_b.copy_(w.d_rows)
            torch.div(w.y_rows, w.d_rows, out=out_b)
        ctx.save_for_backward(q, k, v, mask, initial, out, den)
        ctx.name, ctx.chunk, ctx.step, ctx.work = name, chunk, step, work
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        q, k, v, mask, initial, out, den = ctx.saved_tensors
        name, chunk, step, work = ctx.name, ctx.chunk, ctx.step, ctx.work
        B, H, N, D = q.shape
        Dv = v.shape[-1]

        def grad_product(s: int, e: int) -> Tensor:
            """G = ∂loss/∂y for y = [num, den - ε]: out = num / den."""
            g = grad[:, :, s:e].to(work) / den[:, :, s:e]
            return _chunked(torch.cat([g, -(g * out[:, :, s:e].to(work)).sum(-1, keepdim=True)], dim=-1), chunk)

        grad_q = new_output_like(q) if ctx.needs_input_grad[0] else None
        if grad_q is not None:  # forwards in time: ∂a_i = Σ_{j≤i} (G_i·c_j) b_j + S_before G_i
            state = q.new_zeros(B, H, D, Dv + 1, dtype=work) if initial is None else initial.to(work)
            for s in range(0, N, step):
                e = min(s + step, N)
                _, b, c = _block_inputs(None, k, v, mask, s, e, name, work, chunk)
                G = grad_product(s, e)
                before, state = _chunk_states(torch.matmul(b.transpose(-1, -2), c), state)
                ga = torch.matmul(torch.matmul(G, c.transpose(-1, -2)).tril_(), b)
                ga = _add_matmul_(ga, G, before.transpose(-1, -2)).view(B, H, -1, D)[:, :, : e - s]
                grad_q[:, :, s:e] = ga * _feature_grad(q[:, :, s:e].to(work), name)
        grad_k = new_output_like(k) if ctx.needs_input_grad[1] else None
        grad_v = new_output_like(v) if ctx.needs_input_grad[2] else None
        grad_initial = None
        if grad_k is not None or grad_v is not None or ctx.needs_input_grad[4]:
            # backwards in time: ∂b_j = Σ_{i≥j} (G_i·c_j) a_i and ∂c_j = Σ_{i≥j} (a_i·b_j) G_i
            state = q.new_zeros(B, H, D, Dv + 1, dtype=work)  # R = Σ_{i later} a_i G_iᵀ
            starts = list(range(0, N, step))
            for s in reversed(starts):
                e = min(s + step, N)
                a, b, c = _block_inputs(q, k, v, mask, s, e, name, work, chunk)
                G = grad_product(s, e)
                after, state = _chunk_states(torch.matmul(a.transpose(-1, -2), G), state, reverse=True)
                if grad_k is not None:
                    gb = torch.matmul(torch.matmul(c, G.transpose(-1, -2)).triu_(), a)
                    gb = _add_matmul_(gb, c, after.transpose(-1, -2)).view(B, H, -1, D)[:, :, : e - s]
                    gb *= _feature_grad(k[:, :, s:e].to(work), name)
                    if mask is not None:
                        gb *= mask[:, None, s:e, None]
                    grad_k[:, :, s:e] = gb
                if grad_v is not None:
                    gc = torch.matmul(torch.matmul(b, a.transpose(-1, -2)).triu_(), G[..., :-1])
                    grad_v[:, :, s:e] = _add_matmul_(gc, b, after[..., :-1]).view(B, H, -1, Dv)[:, :, : e - s]
            if ctx.needs_input_grad[4]:
                grad_initial = state.to(initial.dtype)
        return grad_q, grad_k, grad_v, None, grad_initial, None, None, None


def _features_into(x: Tensor, name: str, out: Tensor, scratch: Scratch | None = None) -> Tensor:
    """φ(x), without autograd, for ``x`` ``(..., n, D)`` written into the first n rows of ``out``
    ``(..., ≥ n, D)``, which is returned whole; its temporary goes into ``scratch`` if given."""
    y = out if out.shape == x.shape else out[..., : x.shape[-2], :]
    if name == "relu" and x.dtype == y.dtype:
        torch.clamp(x, min=0, out=y)
    elif name == "relu":  # bf16/fp16 inputs into fp32 features: clamp's out= takes no other dtype
        y.copy_(x).clamp_(min=0)
    elif out.dtype == torch.float64:
        torch.clamp(x, max=0, out=y).exp_().add_(F.relu(x))
    else:
        _elu_from_scaled(torch.mul(x, _LOG2E, out=None if scratch is None else scratch("features", x.shape)), y)
    return out


def _elu_from_scaled(t: Tensor, y: Tensor) -> None:
    """elu(x) + 1 into ``y``, from ``t = x·log2 e`` (consumed), for fp32 and lower: exp(u) = 2^(u·log2 e),
    as torch's exp2 is twice as fast as exp on CPU, and max(x, 0) = max(t, 0) / log2 e. The
    product is the one pass that reads x."""
    torch.clamp(t, max=0, out=y).exp2_().add_(t.clamp_(min=0), alpha=1 / _LOG2E)


def _block_inputs(q, k, v, mask, s: int, e: int, name: str, work: torch.dtype, chunk: int):
    """φ(q), φ(k) (padded keys zeroed) and [v, 1] for positions ``[s, e)``, in chunks."""
    fk = feature_map(k[:, :, s:e].to(work), name)
    if mask is not None:
        fk *= mask[:, None, s:e, None]
    v1 = torch.cat([v[:, :, s:e].to(work), v.new_ones(*v.shape[:2], e - s, 1, dtype=work)], dim=-1)
    fq = None if q is None else _chunked(feature_map(q[:, :, s:e].to(work), name), chunk)
    return fq, _chunked(fk, chunk), _chunked(v1, chunk)


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    config: LinearConfig | None = None,
    state: nn.Module | None = None,
) -> Tensor:
    """Kernel attention ``φ(Q)(φ(K)ᵀV) / (φ(Q)φ(K)ᵀ1 + ε)``, non-causal or causal (chunked).

    Args:
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, Dv)``.
        key_padding_mask: bool ``(B, S)``, True marks a real key.
        is_causal: query i sees keys ``j <= i + S - L``.
        scale: must be None (there is no softmax).
        config: ``LinearConfig``.

    Returns:
        ``(B, H, L, Dv)``; zero rows for queries that see no key.
    """
    config = config or LinearConfig()
    shape = check_attention_inputs(q, k, v, key_padding_mask, is_causal, None)
    if scale is not None:
        raise ValueError(f"linear attention has no softmax scale; leave scale=None (got {scale})")
    B, H, L, S, Dv = shape.batch, shape.heads, shape.queries, shape.keys, shape.value_dim
    if not is_causal:
        return _NonCausal.apply(q, k, v, key_padding_mask, config.feature_map, config.eps)
    offset = S - L  # query i sits at key position i + offset
    initial, mask = None, key_padding_mask
    if offset > 0:  # keys before the first query: every query sees them
        before = None if mask is None else mask[:, :offset]
        _, fk, v1 = _features(q[:, :, :0], k[:, :, :offset], v[:, :, :offset], before, config)
        initial = torch.matmul(fk.transpose(-1, -2), v1)  # (B, H, D, Dv + 1)
        k, v, mask = k[:, :, offset:], v[:, :, offset:], None if mask is None else mask[:, offset:]
    elif offset < 0:  # the first -offset queries see no key
        q = q[:, :, -offset:]
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    mask = None if mask is None else mask.to(work)
    out = _Causal.apply(q, k, v, mask, initial, config.feature_map, config.eps, config.chunk)
    if offset < 0:
        out = torch.cat([out.new_zeros(B, H, -offset, Dv), out], dim=2)
    return out


class LinearDecoder:
    """Recurrent decoding of causal linear attention: per head, the running ``Σ φ(k) [v, 1]ᵀ``
    (D × Dv+1, fp32 for half inputs). Each step costs the same whatever the prefix length."""

    recurrent = True
    description = "recurrent state (Σ φ(k) vᵀ and Σ φ(k) per head: O(1) in the prefix length)"

    def __init__(self, mechanism: Mechanism, config: LinearConfig, state: nn.Module | None) -> None:
        self.mechanism, self.config = mechanism, config
        self.sums: Tensor | None = None  # (B·H, D, Dv + 1)
        self.shape: tuple[int, int, int, int] | None = None
        self.length = 0

    @torch.no_grad()
    def step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attend the ``T`` new queries ``(B, H, T, D)`` causally to the prefix and the new keys."""
        shape = check_attention_inputs(q, k, v, None, True, None)
        if shape.queries != shape.keys:
            raise ValueError(f"a decoding step takes as many queries as keys, got {shape.queries} and {shape.keys}")
        B, H, T, D, Dv = shape.batch, shape.heads, shape.queries, shape.head_dim, shape.value_dim
        if self.shape is not None and self.shape != (B, H, D, Dv):
            raise ValueError(
                f"the decoder holds state for (B, H, D, Dv) = {self.shape}, got {(B, H, D, Dv)}; "
                "start a new cache for a new batch"
            )
        fq, fk, v1 = _features(q, k, v, None, self.config)
        a, b, c = fq.reshape(B * H, T, D), fk.reshape(B * H, T, D), v1.reshape(B * H, T, Dv + 1)
        y = _causal_dot_blocked(a, b, c, self.sums, self.config.chunk)
        update = torch.matmul(b.transpose(1, 2), c)
        self.sums = update if self.sums is None else self.sums + update
        self.shape, self.length = (B, H, D, Dv), self.length + T
        return _normalise(y.view(B, H, T, Dv + 1), self.config.eps, q.dtype)


MECHANISM = Mechanism(
    name="linear",
    fn=linear_attention,
    config=LinearConfig,
    summary="kernel attention φ(Q)(φ(K)ᵀV): linear time, chunked causal form, recurrent decoding",
    paper="Katharopoulos, Vyas, Pappas & Fleuret 2020, Transformers are RNNs, eq. 4-9",
    causal=True,
    cross=True,
    decoder=LinearDecoder,
    examples=({"chunk": 5}, {"feature_map": "relu", "chunk": 3}, {}),
)

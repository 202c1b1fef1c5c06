"""Kernel (linear) attention run block by block: the autograd Functions behind ``linear``.

``NonCausal``: Σ φ(k) vᵀ and Σ φ(k) over blocks of keys, then each block of queries against them;
the backward recomputes φ block by block. ``Causal``: the chunked causal product fused with the
features and the normalisation, over blocks of positions in time order. Neither holds a full-size
feature or product tensor. The maths and the choice of chunk are in ``mechanisms.linear``.

Off the CPU (``ops.scan.whole_scan``) both forms run instead as whole-sequence ops under autograd
(``causal_whole``, ``noncausal_whole``): a few large kernels rather than a loop of small blocks. For
bf16 inputs the matrix products take bf16 operands (fp32 accumulation inside, each product rounded
once to bf16: a chunk's scores, its Σ φ(k) vᵀ, the non-causal Σ φ(k) vᵀ); the features, the sums
over chunks, the normaliser and the division stay in fp32. They keep what the backward needs:
O(N·(D + chunk) + (N / chunk)·D·Dv) per head.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from subquad.kernels.memory import Scratch, new_buffers, new_output, new_output_like
from subquad.kernels.softmax import work_dtype
from subquad.kernels.threads import adapted_backward
from subquad.kernels.tuning import TUNING, block_elements
from subquad.ops.features import LOG2E, elu_from_scaled, feature_grad, feature_map, features_into
from subquad.ops.scan import add_matmul_, chunk_states, chunked, entering

__all__ = ["Causal", "NonCausal", "causal_whole", "features", "noncausal_whole", "normalise"]


def features(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, name: str):
    """φ(q), φ(k) with padded keys zeroed, and v with a ones column (the normaliser), in fp32+."""
    work = work_dtype(q.dtype)
    fq = feature_map(q.to(work), name)
    fk = feature_map(k.to(work), name)
    if key_padding_mask is not None:
        fk = fk * key_padding_mask[:, None, :, None].to(work)
    v1 = torch.cat([v.to(work), v.new_ones(*v.shape[:-1], 1, dtype=work)], dim=-1)  # (B, H, S, Dv + 1)
    return fq, fk, v1


def normalise(y: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """Numerator over (denominator + ε), from the product with the ones column last."""
    return (y[..., :-1] / (y[..., -1:] + eps)).to(dtype)


class NonCausal(torch.autograd.Function):
    """Non-causal linear attention, computed block by block forwards and backwards.

    Forward: Σ φ(k) vᵀ and Σ φ(k) over blocks of keys, then each block of queries against them.
    Backward recomputes φ block by block and writes the gradients in place, so only q, k, v and the
    two small sums are saved: no full-size feature tensor exists in either pass.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, name: str, eps: float) -> Tensor:  # type: ignore[override]
        B, H, L, D = q.shape
        S, Dv = k.shape[2], v.shape[3]
        work = work_dtype(q.dtype)
        block = max(1, block_elements(TUNING.linear_block, q.device) // (B * H * max(D, Dv)))
        kv = q.new_zeros(B, H, D, Dv, dtype=work)
        z = q.new_zeros(B, H, 1, D, dtype=work)
        scratch = Scratch(work, q.device)
        for start in range(0, S, block):
            x = k[:, :, start : start + block]
            fk = features_into(x, name, scratch("phi", x.shape), scratch)
            if mask is not None:
                fk *= mask[:, None, start : start + block, None]
            add_matmul_(kv, fk.transpose(-1, -2), v[:, :, start : start + block].to(work))
            z += fk.sum(2, keepdim=True)
        out = new_output((B, H, L, Dv), q.dtype, q.device)
        for start in range(0, L, block):
            x = q[:, :, start : start + block]
            fq = features_into(x, name, scratch("phi", x.shape), scratch)
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
    @adapted_backward
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
                grad_q[:, :, start : start + block] = grad_fq * feature_grad(x, name)
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
                grad_k[:, :, start : start + block] = grad_fk * feature_grad(x, name)
        return grad_q, grad_k, grad_v, None, None, None


def _key_features(k: Tensor, mask: Tensor | None, start: int, block: int, name: str, work: torch.dtype) -> Tensor:
    fk = feature_map(k[:, :, start : start + block].to(work), name)
    if mask is not None:
        fk = fk * mask[:, None, start : start + block, None].to(work)
    return fk


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
            torch.mul(q, LOG2E, out=self.t_q)
            torch.mul(k, LOG2E, out=self.t_k)
            elu_from_scaled(self.t, self.ab_rows)
        else:
            features_into(q, name, self.ab[0])
            features_into(k, name, self.ab[1])

    def chunk_states(self, which: int, state: Tensor) -> Tensor:
        """Into ``before`` (``which`` 0) or ``z_before`` (1), ``(B, H, m, ·)``: the state entering
        each chunk, ``state`` plus the updates of the chunks before it. Returns the state after the
        last chunk."""
        earlier, updates, before, last, last_update = self.states[which]
        torch.baddbmm(state.reshape(updates.shape[0], 1, -1), earlier, updates, out=before)
        return last + last_update


class Causal(torch.autograd.Function):
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
        work = work_dtype(q.dtype)
        chunk = max(1, min(chunk, N))
        step = chunk * max(1, block_elements(TUNING.linear_state_block, q.device) // (B * H * D * (Dv + 1)))
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
    @adapted_backward
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        q, k, v, mask, initial, out, den = ctx.saved_tensors
        name, chunk, step, work = ctx.name, ctx.chunk, ctx.step, ctx.work
        B, H, N, D = q.shape
        Dv = v.shape[-1]

        def grad_product(s: int, e: int) -> Tensor:
            """G = ∂loss/∂y for y = [num, den - ε]: out = num / den."""
            g = grad[:, :, s:e].to(work) / den[:, :, s:e]
            return chunked(torch.cat([g, -(g * out[:, :, s:e].to(work)).sum(-1, keepdim=True)], dim=-1), chunk)

        grad_q = new_output_like(q) if ctx.needs_input_grad[0] else None
        if grad_q is not None:  # forwards in time: ∂a_i = Σ_{j≤i} (G_i·c_j) b_j + S_before G_i
            state = q.new_zeros(B, H, D, Dv + 1, dtype=work) if initial is None else initial.to(work)
            for s in range(0, N, step):
                e = min(s + step, N)
                _, b, c = _block_inputs(None, k, v, mask, s, e, name, work, chunk)
                G = grad_product(s, e)
                before, state = chunk_states(torch.matmul(b.transpose(-1, -2), c), state)
                ga = torch.matmul(torch.matmul(G, c.transpose(-1, -2)).tril_(), b)
                ga = add_matmul_(ga, G, before.transpose(-1, -2)).view(B, H, -1, D)[:, :, : e - s]
                grad_q[:, :, s:e] = ga * feature_grad(q[:, :, s:e].to(work), name)
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
                after, state = chunk_states(torch.matmul(a.transpose(-1, -2), G), state, reverse=True)
                if grad_k is not None:
                    gb = torch.matmul(torch.matmul(c, G.transpose(-1, -2)).triu_(), a)
                    gb = add_matmul_(gb, c, after.transpose(-1, -2)).view(B, H, -1, D)[:, :, : e - s]
                    gb *= feature_grad(k[:, :, s:e].to(work), name)
                    if mask is not None:
                        gb *= mask[:, None, s:e, None]
                    grad_k[:, :, s:e] = gb
                if grad_v is not None:
                    gc = torch.matmul(torch.matmul(b, a.transpose(-1, -2)).triu_(), G[..., :-1])
                    grad_v[:, :, s:e] = add_matmul_(gc, b, after[..., :-1]).view(B, H, -1, Dv)[:, :, : e - s]
            if ctx.needs_input_grad[4]:
                grad_initial = state.to(initial.dtype)
        return grad_q, grad_k, grad_v, None, grad_initial, None, None, None


def _block_inputs(q, k, v, mask, s: int, e: int, name: str, work: torch.dtype, chunk: int):
    """φ(q), φ(k) (padded keys zeroed) and [v, 1] for positions ``[s, e)``, in chunks."""
    fk = feature_map(k[:, :, s:e].to(work), name)
    if mask is not None:
        fk *= mask[:, None, s:e, None]
    v1 = torch.cat([v[:, :, s:e].to(work), v.new_ones(*v.shape[:2], e - s, 1, dtype=work)], dim=-1)
    fq = None if q is None else chunked(feature_map(q[:, :, s:e].to(work), name), chunk)
    return fq, chunked(fk, chunk), chunked(v1, chunk)


def _product_dtype(dtype: torch.dtype) -> torch.dtype:
    """The matrix products' operand dtype in the whole-sequence forms: bf16 for bf16 inputs (its
    range is fp32's), else the work dtype (fp16 features could overflow)."""
    return dtype if dtype == torch.bfloat16 else work_dtype(dtype)


def _whole_features(x: Tensor, name: str, mask: Tensor | None = None) -> Tensor:
    fx = feature_map(x.to(work_dtype(x.dtype)), name)
    return fx if mask is None else fx * mask[:, None, :, None].to(fx.dtype)


def noncausal_whole(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, name: str, eps: float) -> Tensor:
    """``NonCausal`` as whole-sequence ops under autograd: Σ φ(k) vᵀ and Σ φ(k) in one product and
    one sum, then every query against them."""
    mm = _product_dtype(q.dtype)
    fq, fk = _whole_features(q, name), _whole_features(k, name, mask)
    kv = torch.matmul(fk.to(mm).transpose(-1, -2), v.to(mm))  # (B, H, D, Dv), rounded once to mm
    den = (fq * fk.sum(2, keepdim=True)).sum(-1, keepdim=True) + eps  # (B, H, L, 1), in fp32+
    return torch.matmul(fq.to(mm), kv).to(fq.dtype) / den


def causal_whole(q, k, v, mask, initial, name: str, eps: float, chunk: int) -> Tensor:
    """``Causal`` as whole-sequence ops under autograd: every chunk's masked (chunk × chunk) product
    at once, and the states ``S = Σ φ(k) vᵀ``, ``z = Σ φ(k)`` entering each chunk from one cumulative
    sum over the chunks (``ops.scan.entering``), with ``initial`` ``(B, H, D, Dv + 1)`` before them."""
    N, Dv = q.shape[2], v.shape[-1]
    mm = _product_dtype(q.dtype)
    chunk = max(1, min(chunk, N))
    fq, fk = (chunked(x, chunk) for x in (_whole_features(q, name), _whole_features(k, name, mask)))
    a, b, c = fq.to(mm), fk.to(mm), chunked(v.to(mm), chunk)  # (B, H, m, chunk, ·)
    scores = torch.matmul(a, b.transpose(-1, -2)).tril()
    state, z = (None, None) if initial is None else (initial[..., :Dv].to(fq.dtype), initial[..., Dv].to(fq.dtype))
    before = entering(torch.matmul(b.transpose(-1, -2), c).to(fq.dtype), state, 2)  # (B, H, m, D, Dv)
    num = torch.matmul(scores, c).to(fq.dtype) + torch.matmul(a, before.to(mm)).to(fq.dtype)
    z_before = entering(fk.sum(3), z, 2)  # (B, H, m, D)
    den = scores.sum(-1, dtype=fq.dtype) + (fq * z_before.unsqueeze(-2)).sum(-1) + eps
    return (num / den.unsqueeze(-1)).flatten(2, 3)[:, :, :N]

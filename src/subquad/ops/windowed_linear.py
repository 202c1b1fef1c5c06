"""Linear attention with a softmax window (LoLCATs, Zhang et al. 2025), and Hedgehog's learned
feature map (Zhang, Bhatia, Kumbong & Ré 2024): the parts of ``linear``'s options beyond the plain
kernel form.

``windowed``: exact softmax over the keys less than w positions from each query (``local``'s
window, and its sinks), kernel attention over the rest, under one normaliser; the far sums are
causal products (``ops.scan.causal_dot``) of the keys shifted by w, and non-causal also of the
reversed sequences. ``learned_features``: ``[softmax(x W + b), softmax(−(x W + b))]`` per head. The
maths and the choices are in ``mechanisms.linear``.

Decoding (``LinearDecoder``): ``far_sums`` sums ``φ(k) [v, 1]ᵀ`` over the keys a mask names, in
blocks (a prompt's keys that left the window, handed over from the prefill); ``windowed_step``
attends new tokens to the kept window and sinks (``ops.kept_window``) and to those sums, by the
same formula as ``windowed``, and moves the keys that leave the window into the sums.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from subquad._validate import work_dtype
from subquad.kernels.band import window_attention
from subquad.ops.features import feature_map
from subquad.ops.kept_window import Kept, extend, one_step, reach, trim
from subquad.ops.linear_blocks import features
from subquad.ops.scan import causal_dot
from subquad.registry import Config

__all__ = [
    "LinearState",
    "beyond_window",
    "far_sums",
    "learned_features",
    "learned_state",
    "phi",
    "windowed",
    "windowed_step",
    "with_ones",
]

_BLOCK = 4096  # keys per block of far_sums: the features of one block exist at a time


class LinearState(nn.Module):
    """The learned feature maps of ``feature_map="hedgehog"``: per head, ``weight`` ``(H, D, D)``
    (initially the identity) and ``bias`` ``(H, D)`` (initially 0). Other feature maps learn
    nothing and the state holds no tensor.

    Args:
        config: a config with ``feature_map`` (``LinearConfig``, ``RetrievalConfig``).
        num_heads: H; every head has its own map.
        head_dim: D, the query and key width.
        seed: unused (the initial map is the identity); taken for the state signature.
    """

    def __init__(self, config: Config, num_heads: int, head_dim: int, seed: int = 0) -> None:
        super().__init__()
        self.learned = config.feature_map == "hedgehog"
        if self.learned:
            self.weight = nn.Parameter(torch.eye(head_dim).repeat(num_heads, 1, 1))
            self.bias = nn.Parameter(torch.zeros(num_heads, head_dim))

    def extra_repr(self) -> str:
        if not self.learned:
            return "no learned feature map"
        heads, dim, _ = self.weight.shape
        return f"hedgehog, heads={heads}, head_dim={dim}"


def learned_state(state: nn.Module | None, config: Config, heads: int, dim: int, device) -> LinearState | None:
    """The ``LinearState`` whose maps a call with ``config.feature_map`` uses: None unless hedgehog;
    ``state`` checked, or the initial map (W = I, frozen: nothing would train it) when it is None."""
    if config.feature_map != "hedgehog":
        return None
    if state is None:
        return _initial(heads, dim, torch.device(device))
    if not isinstance(state, LinearState) or not state.learned:
        got = "one built for another feature map" if isinstance(state, LinearState) else type(state).__name__
        raise ValueError(
            f"{config.mechanism} with feature_map=hedgehog needs a LinearState built with that config, got {got}"
        )
    if tuple(state.weight.shape) != (heads, dim, dim):
        raise ValueError(
            f"the {config.mechanism} state's maps are (heads, head_dim, head_dim) = {tuple(state.weight.shape)} but "
            f"this call needs {(heads, dim, dim)}; build it as LinearState(config, {heads}, {dim})"
        )
    return state


@functools.lru_cache(maxsize=16)
def _initial(heads: int, dim: int, device: torch.device) -> LinearState:
    """The initial hedgehog maps of a call without a state, built once per shape and device (they
    were built afresh at every call and decoder step) and frozen: a call whose inputs need no
    gradient then runs as inference does."""
    return LinearState(_Hedgehog(), heads, dim).to(device).requires_grad_(False)


class _Hedgehog:
    feature_map = "hedgehog"  # what LinearState reads of a config


def learned_features(x: Tensor, state: nn.Module) -> Tensor:
    """Hedgehog's ``[softmax(xW + b), softmax(−(xW + b))]`` of ``x`` ``(B, H, N, D)``: ``(B, H, N, 2D)``,
    in fp32 for half-precision inputs; W and b are ``state``'s (a ``LinearState``)."""
    B, H, N, D = x.shape
    work = work_dtype(x.dtype)
    heads_first = x.to(work).transpose(0, 1).reshape(H, B * N, D)  # one batched product per head
    t = torch.baddbmm(state.bias.to(work)[:, None, :], heads_first, state.weight.to(work))
    if torch.is_grad_enabled() and t.requires_grad:
        both = torch.softmax(torch.stack([t, -t], dim=2), dim=-1)  # (H, B·N, 2, D)
    else:  # inference: the same softmax in one buffer, with no stacked copy beside it
        both = torch.stack([t, t], dim=2)
        both[:, :, 1].neg_()
        both -= both.amax(-1, keepdim=True)
        both.exp_().div_(both.sum(-1, keepdim=True))
    return both.view(H, B, N, 2 * D).transpose(0, 1)


def windowed(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    config: Config,
    learned: nn.Module | None,
    initial: Tensor | None = None,
) -> Tensor:
    """Linear attention with a softmax window (``mechanisms.linear``), ``(B, H, L, Dv)`` in fp32 or
    fp64. ``config``: a ``LinearConfig``; ``learned``: its ``LinearState`` under hedgehog, else None.
    ``initial`` ``(B·H, F, Dv + 1)`` (causal only): the far sums of keys before ``k``'s first, which
    every query sees (decoding)."""
    B, H, L, _ = q.shape
    S, Dv, w = k.shape[2], v.shape[-1], config.window
    work = work_dtype(q.dtype)
    s = min(config.sinks, S)
    near = window_attention(q, k, v, key_padding_mask, is_causal, scale, w, s, "fused").to(work)
    # m_i: whether query i's window (key positions p - w < j <= p, or |j - p| < w) or its sinks hold a real key
    real = torch.ones(B, S, device=q.device) if key_padding_mask is None else key_padding_mask.to(torch.float32)
    counts = torch.nn.functional.pad(real.cumsum(1), (1, 0))  # (B, S + 1): real keys before each position
    p = torch.arange(L, device=q.device) + (S - L)
    lo, hi = (p - w + 1).clamp(0, S), (p + (1 if is_causal else w)).clamp(0, S)
    seen = (counts[:, hi] - counts[:, lo]) > 0
    if s:
        seen = seen | (counts[:, (p + 1).clamp(0, s) if is_causal else torch.full_like(p, s)] > 0)
    mass = seen.to(work)[:, None, :, None]  # (B, 1, L, 1)
    if learned is not None:
        fq, fk = learned_features(q, learned), learned_features(k, learned)
        if key_padding_mask is not None:
            fk = fk * key_padding_mask[:, None, :, None].to(fk.dtype)
        v1 = torch.cat([v.to(work), v.new_ones(B, H, S, 1, dtype=work)], dim=-1)
    else:
        fq, fk, v1 = features(q, k, v, key_padding_mask, config.feature_map)
    if s and fk.requires_grad:  # the sinks are in the softmax part for every query that sees them
        fk = torch.cat([torch.zeros_like(fk[:, :, :s]), fk[:, :, s:]], dim=2)
    elif s:  # fk is this call's own tensor, and nothing records it
        fk[:, :, :s] = 0
    far = beyond_window(fq, fk, v1, w, is_causal, config.chunk, initial)
    return (mass * near + far[..., :Dv]) / (mass + far[..., Dv:] + config.eps)


def beyond_window(
    fq: Tensor, fk: Tensor, v1: Tensor, w: int, is_causal: bool, chunk: int, initial: Tensor | None = None
) -> Tensor:
    """``Σ_j φ(q_i)·φ(k_j) [v_j, 1]`` ``(B, H, L, Dv + 1)`` over the keys j outside query i's window of
    ``w`` (causal: ``j ≤ p − w``; non-causal also ``j ≥ p + w``; p = i + S − L), from the features
    ``fq`` ``(B, H, L, F)``, ``fk`` ``(B, H, S, F)`` (a key to leave out: zero features) and ``v1``
    ``(B, H, S, Dv + 1)``. ``initial`` ``(B·H, F, Dv + 1)`` (causal only): sums every query adds."""
    B, H, L, _ = fq.shape
    S = fk.shape[2]
    a, b, c = (x.reshape(B * H, x.shape[2], x.shape[3]) for x in (fq, fk, v1))
    far = _shifted_product(a, b, c, S - L - w, initial, chunk)  # keys j <= p - w
    if not is_causal:  # keys j >= p + w: the same product over the reversed sequences
        flip = lambda x: x.flip(1)  # noqa: E731
        far = far + flip(_shifted_product(flip(a), flip(b), flip(c), -w, None, chunk))
    return far.view(B, H, L, -1)


def _shifted_product(a: Tensor, b: Tensor, c: Tensor, shift: int, initial: Tensor | None, chunk: int) -> Tensor:
    """``y_i = Σ_{j ≤ i + shift} (a_i·b_j) c_j + a_iᵀ initial`` for rows ``(R, L, ·)`` against keys
    ``(R, S, ·)``, differentiable."""
    R, L, _ = a.shape
    S = b.shape[1]
    if shift >= 0:  # keys before `shift` are seen by every query; query i then pairs with key i + shift
        seen = min(shift, S)
        start = torch.matmul(b[:, :seen].transpose(1, 2), c[:, :seen])
        start = start if initial is None else start + initial
        kb, kc = (_rows(x, shift, L) for x in (b, c))
        return causal_dot(a, kb, kc, start, chunk)
    first = min(-shift, L)  # these queries see no key of k (only `initial`)
    out = [torch.zeros(R, first, c.shape[-1], dtype=c.dtype, device=c.device) if initial is None
           else torch.matmul(a[:, :first], initial)]  # fmt: skip
    if L > first:
        n = L - first
        kb, kc = (_rows(x, 0, n) for x in (b, c))
        out.append(causal_dot(a[:, first:], kb, kc, initial, chunk))
    return torch.cat(out, dim=1)


def _rows(x: Tensor, start: int, count: int) -> Tensor:
    """Rows ``start .. start + count`` of ``x`` ``(R, S, ·)``, zero-filled past its end."""
    part = x[:, start : start + count]
    return part if part.shape[1] == count else torch.nn.functional.pad(part, (0, 0, 0, count - part.shape[1]))


def phi(x: Tensor, name: str, learned: nn.Module | None) -> Tensor:
    """φ(x) ``(B, H, N, F)`` in fp32+: the learned map if there is one, else the named one."""
    return learned_features(x, learned) if learned is not None else feature_map(x.to(work_dtype(x.dtype)), name)


def with_ones(v: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.cat([v.to(dtype), v.new_ones(*v.shape[:-1], 1, dtype=dtype)], dim=-1)


def far_sums(k: Tensor, v: Tensor, mask: Tensor | None, name: str, learned: nn.Module | None) -> Tensor:
    """``Σ_j φ(k_j) [v_j, 1]ᵀ`` ``(B, H, F, Dv + 1)`` over the keys ``(B, H, S, D)`` that ``mask``
    ``(B, S)`` names (None: all), ``_BLOCK`` keys at a time."""
    total = None
    for start in range(0, max(k.shape[2], 1), _BLOCK):
        fk = phi(k[:, :, start : start + _BLOCK], name, learned)
        if mask is not None:
            fk = fk * mask[:, None, start : start + _BLOCK, None].to(fk.dtype)
        part = torch.matmul(fk.transpose(2, 3), with_ones(v[:, :, start : start + _BLOCK], fk.dtype))
        total = part if total is None else total + part
    return total


def windowed_step(
    q: Tensor, k: Tensor, v: Tensor, kept: Kept, sums: Tensor, config: Config, learned: nn.Module | None,
    scale: float | None,
) -> tuple[Tensor, Kept, Tensor]:  # fmt: skip
    """New tokens ``(B, H, T, ·)`` after ``kept`` and the far ``sums`` ``(B, H, F, Dv + 1)``: their
    outputs ``(B, H, T, Dv)`` in fp32+ (``windowed``'s formula; each query's own key is in its
    window, so m = 1), the kept keys after them, and the sums with the keys that left."""
    s, w, Dv = config.sinks, config.window, v.shape[-1]
    if q.shape[2] == 1:  # generation's step: the key leaving the window joins the sums first
        old_k, old_v, left, filled = one_step(kept, k, v, s)
        fq, fk = phi(torch.cat([q, old_k], dim=2), config.feature_map, learned).unbind(2)  # one call for both
        if left is not None:
            fk = fk * left[:, None, None]  # an empty slot adds nothing
        v1 = torch.nn.functional.pad(old_v.to(fk.dtype), (0, 1), value=1.0)  # [v, 1]
        sums.addcmul_(fk[..., None], v1)  # the outer product φ(k) [v, 1]ᵀ, in place
        near = torch.nn.functional.scaled_dot_product_attention(q, kept.keys, kept.values, filled, scale=scale)
        far = torch.matmul(fq[:, :, None], sums)
        return far[..., :Dv].add_(near).div_(far[..., Dv:].add_(1 + config.eps)), kept, sums
    keys, values, positions, new = extend(kept, k, v)
    near_mask, far_mask = reach(positions, new, s, w)
    near = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=near_mask[:, None], scale=scale)
    fq, fk = phi(q, config.feature_map, learned), phi(keys, config.feature_map, learned)
    v1 = with_ones(values, fk.dtype)
    far = torch.matmul(fq, sums) + torch.matmul(torch.matmul(fq, fk.transpose(2, 3)) * far_mask[:, None], v1)
    out = (near.to(far.dtype) + far[..., :Dv]) / (1 + far[..., Dv:] + config.eps)
    kept, leaving = trim(keys, values, positions, new[:, -1] + 1, s, w)
    sums = sums + torch.matmul((fk * leaving[:, None, :, None]).transpose(2, 3), v1)
    return out, kept, sums

"""Adaptive multi-resolution attention, AdaMRA (Zhang, Ma, Seidl & Tresp 2021, §3.2–3.4).

R resolution heads, each with a compression rate c_h. Head h replaces the S keys and values by
the means of consecutive segments of ℓ_h = ⌊1/c_h⌋ positions (landmarks): m_h = ⌈S/ℓ_h⌉ of them,
which is the paper's ⌈S·c_h⌉ whenever 1/c_h is a whole number (all the paper's rates are) and
never fewer otherwise. The last segment may be short. A query attends to its head's landmarks with
kernel attention, φ = ReLU (elu+1 as an option), with ε in the normaliser (eq. 7):

    Head_h(q_i) = φ(q_i)ᵀ Σ_j φ(k̃_j) ṽ_jᵀ / (φ(q_i)ᵀ Σ_j φ(k̃_j) + ε)

The segment length depends on the rate only, not on S, so a position's segment never changes
when more positions follow: the causal form below gives the same outputs in one pass as token by
token from a KV cache.

A router picks one resolution per query: P = softmax(F(Q)) over the R heads (eq. 6); the query
uses only its argmax head, and that head's output is multiplied by its probability, which is how
the router's weights learn. The other heads return zeros for that query. Each resolution has
S' subheads with their own projections at the same resolution (eq. 8–9).

**Heads.** The mechanism's H heads are the R·S' subheads, resolution-major: heads
``h·S' .. (h+1)·S' − 1`` run at ``rates[h]``, so H must be a multiple of ``len(rates)``. The router
logits arrive as a tensor ``router_logits`` ``(B, R, L)``, one logit per resolution for each query
(softmax across R). ``MultiresInputs`` makes them from the layer's input x as ``x W`` (no bias):
the paper's F(Q) = Q W with Q = x W^Q is the same linear map of x, learned here as one matrix.
In a layer the heads are concatenated and projected by the output matrix, which gives
Σ_h Head_h W^O_h: the paper's eq. 8 with one output block per resolution instead of a shared W^O.

**Padding.** Segment means count real keys only (key padding masks, and the zeros that pad S to
a multiple of ℓ_h); a segment without a real key is no landmark at all. Every landmark weighs the
same, however many real keys it averages, as in the paper. A query with no landmark, or with
φ(q) = 0 under ReLU, returns zeros (ε keeps 0/0 away).

**Causal form (our extension; the paper is encoder-only).** Segment means mix future keys into
the past, so a query at key position p uses the completed segments before its own and the running
mean of its own segment up to p:

    visible(p) = {k̃_s : s < ⌊p/ℓ⌋} ∪ {k̄_p = mean of the real keys in [⌊p/ℓ⌋·ℓ, p]}

(values alike). This is exactly the non-causal mechanism applied to the prefix [0, p] on the same
segment grid: a completed segment is one landmark, and the partial one is compressed the same way
as far as it goes, so at the last position of a segment the running mean is that segment's
landmark. We chose it over exact kernel terms for the partial segment's keys because it keeps one
definition of what a query attends to in both forms (landmarks, each weighing the same: the
current segment's keys do not outweigh the older ones ℓ to 1), and it costs only O(N·D) more. The
completed segments enter through linear attention's causal product (``causal_dot``) over a
sequence that merges the head's queries and its landmarks in order of position, each landmark
after its segment's queries, so a query sums only earlier landmarks, with O(N·D) memory and a
backward pass that stores no per-chunk state; the running-mean term is one dot product per
query. The router reads only its own query's logits, so it is causal. With L ≠ S the queries are
the last L positions (bottom-right alignment).

**Ablations (§4.3, Table 5).** ``similarity="softmax"``: softmax(q·k̃ᵀ·scale) over the same
landmarks instead of the kernel (cost O(N·m_h·D), computed in blocks of queries).
``routing="random"``: each query goes to a resolution drawn uniformly from a counter-based hash of
(seed, query position), with weight 1: reproducible, independent of the batch and of global RNG
state, and causal. The position is the causal one (i + S − L, as in cached decoding) when
``is_causal``, else i. The seed lives in ``MultiresState`` (the layer's seed; 0 without a state).

**Cost.** Segment means O(S·D) per head, and kernel attention over m_h landmarks O(m_h·D·Dv) for
the sums and O(D·Dv) per query. Non-causal, every head computes every query in one product with
all heads' sums, and the router's choice zeroes the others: the fewest operations, which on a
busy 2-core CPU is what counts (against gathering each head's queries: 3.4× faster at N = 4096,
within 20% either way otherwise). The
causal form and the softmax ablation gather the queries routed to each head (padded to the most
any batch row has) and scatter their outputs back: 1.4–1.6× faster there, as their per-query
work is larger. No (N × N) and no (N × H × D × D) tensor exists in either pass. Half-precision
inputs are computed in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from subquad._blocks import BlockOutput, block_elements, tracks_grad
from subquad._validate import (
    AttentionShape,
    check_attention_inputs,
    check_logits,
    check_query_padding_mask,
    resolve_scale,
)
from subquad.decoding import KVCache
from subquad.mechanisms.linear import causal_dot, feature_map
from subquad.ops import softmax
from subquad.registry import QUERY, Config, Mechanism, option

__all__ = [
    "MultiresConfig",
    "MultiresInputs",
    "MultiresState",
    "multires_attention",
    "route",
    "segment_length",
    "segment_means",
]

_SOFTMAX_BLOCK_ELEMENTS = 1 << 20  # softmax ablation: query rows × landmarks scored at once
_QUERY_BLOCK_ELEMENTS = 1 << 21  # non-causal form without autograd: query rows × width per block
_CAUSAL_CHUNK = 64  # causal form: slots (queries and landmarks) per chunk of the causal product


@dataclass(frozen=True)
class MultiresConfig(Config):
    mechanism = "multires"
    rates: tuple[float, ...] = option(
        (0.5, 0.25, 0.125, 0.0625), "compression rate c_h of each resolution head, in (0, 1]", gt=0, le=1
    )
    feature_map: str = option("relu", "φ: relu (the paper's) or elu (elu(x) + 1)", choices=("relu", "elu"))
    eps: float = option(1e-6, "ε added to the normaliser φ(q)ᵀ Σ φ(k̃)", gt=0)
    similarity: str = option(
        "kernel",
        "kernel: φ(q)·φ(k̃) (eq. 7); softmax: softmax over the landmarks (ablation)",
        choices=("kernel", "softmax"),
    )
    routing: str = option(
        "learned", "learned: argmax of the router (eq. 6); random: a seeded uniform choice (ablation)",
        choices=("learned", "random"),
    )  # fmt: skip

    def check(self) -> None:
        if not self.rates:
            raise ValueError("multires option rates must name at least one rate, e.g. rates=(0.5, 0.25)")


class MultiresState(nn.Module):
    """The seed of random routing (``routing="random"``), from the layer's seed.

    Args:
        config: ``MultiresConfig``.
        num_heads, head_dim: the group's sizes (unused: nothing else persists).
        seed: the layer's seed.
    """

    def __init__(self, config: MultiresConfig, num_heads: int, head_dim: int, seed: int = 0) -> None:
        super().__init__()
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.register_buffer("seed", torch.tensor(seed % 2**32, dtype=torch.long))

    def extra_repr(self) -> str:
        return f"seed={int(self.seed)}"


class MultiresInputs(nn.Module):
    """The router of a multires head group: ``router_logits = x W`` ``(B, R, L)``, W ∈ R^{E×R}
    (eq. 6). Random routing has no router and produces nothing.

    Args:
        config: ``MultiresConfig``.
        embed_dim: the layer's query width E.
        num_heads: the group's heads; a multiple of ``len(config.rates)``.
    """

    def __init__(self, config: MultiresConfig, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        _subheads(num_heads, config.rates)
        learned = config.routing == "learned"
        self.router = nn.Linear(embed_dim, len(config.rates), bias=False) if learned else None

    def forward(self, query_x: Tensor, key_x: Tensor) -> dict[str, Tensor]:
        if self.router is None:
            return {}
        return {"router_logits": self.router(query_x).transpose(1, 2)}  # (B, R, L)


# ---------------------------------------------------------------------------------------------
# Compression (§3.2): segment means
# ---------------------------------------------------------------------------------------------


def segment_length(rate: float, keys: int | None = None) -> int:
    """ℓ = ⌊1/c⌋ positions per segment: the longest segment that gives at least m = ⌈N·c⌉ landmarks
    at every N (exactly m when 1/c is a whole number, as for all the paper's rates). At most the
    ``keys`` S: one segment of all the keys is the same landmark as any longer one (segments start
    at position 0, causal ones too), and the work stays O(S) for any rate."""
    length = max(1, math.floor(1 / rate + 1e-9))
    return length if keys is None else max(1, min(length, keys))


def segment_means(x: Tensor, key_padding_mask: Tensor | None, length: int) -> tuple[Tensor, Tensor]:
    """Means of consecutive segments of ``length`` positions over the real positions only.

    Args:
        x: ``(B, H, N, F)``.
        key_padding_mask: bool ``(B, N)``, True marks a real position, or None.
        length: ℓ, positions per segment; the last segment may be short.

    Returns:
        The means ``(B, H, n, F)`` with n = ⌈N/ℓ⌉ (zero for an empty segment), and ``valid`` bool
        ``(B, n)``: whether a segment holds a real position.
    """
    B, H, N, Fx = x.shape
    n = -(-N // length)
    pad = n * length - N
    if pad:
        x = F.pad(x, (0, 0, 0, pad))  # zeros add nothing
    if key_padding_mask is None:
        sums = x.view(B, H, n, length, Fx).sum(3)
        counts = (N - torch.arange(n, device=x.device) * length).clamp(max=length).expand(B, n)
    else:
        weight = F.pad(key_padding_mask, (0, pad)).view(B, 1, n, length, 1)
        sums = (x.view(B, H, n, length, Fx) * weight.to(x.dtype)).sum(3)
        counts = weight.view(B, n, length).sum(-1)
    means = sums / counts.clamp(min=1).to(x.dtype)[:, None, :, None]
    return means, counts > 0


def _running_means(x: Tensor, key_padding_mask: Tensor | None, length: int) -> tuple[Tensor, Tensor]:
    """Causal form: at each position p the mean of the real positions of its segment up to p,
    ``(B, H, N, F)``, and whether there is one, ``(B, N)``."""
    B, H, N, Fx = x.shape
    n = -(-N // length)
    pad = n * length - N
    weight = F.pad(x.new_ones(B, N) if key_padding_mask is None else key_padding_mask.to(x.dtype), (0, pad))
    weight = weight.view(B, 1, n, length, 1)
    sums = torch.cumsum(F.pad(x, (0, 0, 0, pad)).view(B, H, n, length, Fx) * weight, dim=3)
    counts = torch.cumsum(weight, dim=3)
    means = (sums / counts.clamp(min=1)).view(B, H, n * length, Fx)[:, :, :N]
    return means, (counts.view(B, n * length)[:, :N] > 0)


# ---------------------------------------------------------------------------------------------
# Routing (eq. 6)
# ---------------------------------------------------------------------------------------------


def route(
    router_logits: Tensor | None,
    config: MultiresConfig,
    batch: int,
    queries: int,
    first: int,
    seed: int,
    work: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """Each query's resolution ``(B, L)`` (long) and the weight of its output ``(B, L)``.

    Learned: the argmax of P = softmax(logits) over the R resolutions, weighted by its probability
    (eq. 6). Random: a uniform draw from a hash of (seed, query position), weighted 1; query i sits
    at position ``first + i``.
    """
    if config.routing == "learned":
        probs = softmax(router_logits.to(work), dim=1)  # (B, R, L)
        choice = probs.argmax(dim=1)  # (B, L)
        return choice, probs.gather(1, choice.unsqueeze(1)).squeeze(1)
    positions = torch.arange(first, first + queries)
    choice = (_hash_uniform(seed, positions) * len(config.rates)).long().clamp(max=len(config.rates) - 1)
    return choice.expand(batch, queries), torch.ones(batch, queries, dtype=work, device=positions.device)


def _hash_uniform(seed: int, positions: Tensor) -> Tensor:
    """Uniforms in [0, 1), a fixed function of (seed, position): a 32-bit integer mix, no generator."""
    mask = 0xFFFFFFFF
    x = (positions * 0x9E3779B1 + (seed * 0x85EBCA77 + 0x632BE5AB) % 2**32) & mask
    for multiplier in (0x7FEB352D, 0x4C6A68B3):  # odd constants below 2^31: products stay below 2^63
        x = ((x ^ (x >> 16)) * multiplier) & mask
    x = x ^ (x >> 15)
    return (x >> 8).to(torch.float64) * 2.0**-24


# ---------------------------------------------------------------------------------------------
# Kernel attention over the landmarks (eq. 7), non-causal and causal; the softmax ablation
# ---------------------------------------------------------------------------------------------


def _kernel(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, config: MultiresConfig, subheads: int, gate: Tensor
) -> Tensor:
    """Eq. 7 for every head at once: each head group's Σ φ(k̃) [ṽ, 1]ᵀ over its own landmarks, then
    one product of all queries with them, weighted by ``gate`` ``(B, H, L)`` (zero where a query chose
    another resolution)."""
    Dv = v.shape[3]
    sums = []
    for h, rate in enumerate(config.rates):
        heads = slice(h * subheads, (h + 1) * subheads)
        length = segment_length(rate, k.shape[2])
        k_means, valid = segment_means(k[:, heads], mask, length)  # (B, S', n, D), (B, n)
        v_means, _ = segment_means(v[:, heads], mask, length)
        fk = feature_map(k_means, config.feature_map) * valid[:, None, :, None].to(q.dtype)
        v1 = torch.cat([v_means, v_means.new_ones(*v_means.shape[:3], 1)], dim=-1)  # the normaliser column
        sums.append(torch.matmul(fk.transpose(-1, -2), v1))  # (B, S', D, Dv + 1)
    sums = torch.cat(sums, dim=1)  # (B, H, D, Dv + 1)
    if tracks_grad(q, k, v, gate):
        y = torch.matmul(feature_map(q, config.feature_map), sums)  # (B, H, L, Dv + 1)
        return y[..., :Dv] * (gate.unsqueeze(-1) / (y[..., Dv:] + config.eps))
    # Without autograd, blocks of queries are written into the output: no full-size temporaries.
    B, H, L, D = q.shape
    out = q.new_empty(B, H, L, Dv)
    block = max(1, block_elements(_QUERY_BLOCK_ELEMENTS, q.device) // (B * H * (D + Dv + 1)))
    for start in range(0, L, block):
        y = torch.matmul(feature_map(q[:, :, start : start + block], config.feature_map), sums)
        weight = gate[:, :, start : start + block, None] / (y[..., Dv:] + config.eps)
        torch.mul(y[..., :Dv], weight, out=out[:, :, start : start + block])
    return out


def _causal_kernel(
    q: Tensor,
    position: Tensor,
    real: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    length: int,
    config: MultiresConfig,
) -> Tensor:
    """Causal eq. 7 for the queries ``(B, H, w, D)`` at key positions ``position`` ``(B, w)``, in
    increasing order where ``real``: the completed segments before each, and its own segment's
    running mean. Rows that are not ``real`` return zeros.

    The completed landmarks come from ``causal_dot`` over a merged sequence holding the queries and
    the landmarks in order of position, each landmark after the queries of its segment (queries have
    b = c = 0, landmarks a = 0), so each query sums exactly the landmarks of earlier segments. Its
    own segment enters as φ(q)·φ(k̄_p) [v̄_p, 1].
    """
    B, H, w, D = q.shape
    Dv = v.shape[3]
    k_means, valid = segment_means(k, mask, length)  # (B, H, n, D), (B, n)
    v_means, _ = segment_means(v, mask, length)
    n = k_means.shape[2]
    position = position.clamp(min=0)  # rows before every key are not real
    segment = torch.where(real, torch.div(position, length, rounding_mode="floor"), n)  # others go last
    # Query j goes after the landmarks of the segments before its own; landmark s after the queries
    # of segments <= s.
    query_slot = torch.arange(w, device=q.device) + segment  # (B, w)
    per_segment = torch.zeros(B, n + 1, dtype=torch.long, device=q.device).scatter_add_(1, segment, real.long())
    landmark_slot = torch.arange(n, device=q.device) + torch.cumsum(per_segment[:, :n], dim=1)  # (B, n)
    # Whole chunks: w counts the queries routed here, later ones included, and a shorter last chunk
    # would sum the earlier slots in another order, so the past would move with the future.
    slots = -(-(w + n) // _CAUSAL_CHUNK) * _CAUSAL_CHUNK

    fq = feature_map(q, config.feature_map) * real[:, None, :, None].to(q.dtype)
    fk = feature_map(k_means, config.feature_map) * valid[:, None, :, None].to(q.dtype)
    v1 = torch.cat([v_means, v_means.new_ones(B, H, n, 1)], dim=-1)  # the normaliser as a value column
    a, b, c = _scatter(fq, query_slot, slots), _scatter(fk, landmark_slot, slots), _scatter(v1, landmark_slot, slots)
    rows = B * H
    y = causal_dot(a.view(rows, slots, D), b.view(rows, slots, D), c.view(rows, slots, Dv + 1), None, _CAUSAL_CHUNK)
    y = _gather(y.view(B, H, slots, Dv + 1), query_slot)  # (B, H, w, Dv + 1)

    k_run, seen = _running_means(k, mask, length)  # the own segment up to p: (B, H, S, D), (B, S)
    v_run, _ = _running_means(v, mask, length)
    own = (fq * feature_map(_gather(k_run, position), config.feature_map)).sum(-1, keepdim=True)
    own = own * seen.gather(1, position)[:, None, :, None].to(q.dtype)
    v_own = _gather(v_run, position)
    y = y + own * torch.cat([v_own, v_own.new_ones(B, H, w, 1)], dim=-1)
    return y[..., :Dv] / (y[..., Dv:] + config.eps)  # zero where not real: φ(q) = 0 there


def _softmax(
    q: Tensor,
    position: Tensor,
    real: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    length: int,
    is_causal: bool,
    scale: float,
) -> Tensor:
    """The Softmax ablation: softmax(q·k̃ᵀ·scale) ṽ over the same landmarks as the kernel form, in
    blocks of queries; causal: the completed segments before p and the running mean at p. Rows that
    are not ``real``, or see no landmark, return zeros."""
    B, H, w, _ = q.shape
    Dv = v.shape[3]
    k_means, valid = segment_means(k, mask, length)  # (B, H, n, D), (B, n)
    v_means, _ = segment_means(v, mask, length)
    n = k_means.shape[2]
    if is_causal:
        k_run, seen = _running_means(k, mask, length)
        v_run, _ = _running_means(v, mask, length)
    out = BlockOutput((B, H, w, Dv), 2, q, track=tracks_grad(q, k, v))
    block = max(1, block_elements(_SOFTMAX_BLOCK_ELEMENTS, q.device) // (B * H * (n + 1)))
    for start in range(0, w, block):
        qb, pb, rb = q[:, :, start : start + block], position[:, start : start + block], real[:, start : start + block]
        scores = torch.matmul(qb, k_means.transpose(-1, -2)) * scale  # (B, H, b, n)
        visible = (valid[:, None, :] & rb[:, :, None]).unsqueeze(1)  # (B, 1, b, n)
        if is_causal:
            pb = pb.clamp(min=0)  # rows before every key are not real
            completed = torch.arange(n, device=q.device) < torch.div(pb, length, rounding_mode="floor").unsqueeze(-1)
            own_k, own_v = _gather(k_run, pb), _gather(v_run, pb)
            scores = torch.cat([scores, (qb * own_k).sum(-1, keepdim=True) * scale], dim=-1)
            own_seen = (seen.gather(1, pb) & rb).unsqueeze(-1)  # (B, b, 1)
            visible = torch.cat([visible & completed.unsqueeze(1), own_seen.unsqueeze(1)], dim=-1)
        scores = scores.masked_fill(~visible, -math.inf)
        top = scores.amax(-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)  # finite when none is seen
        weights = torch.exp(scores - top)
        result = torch.matmul(weights[..., :n], v_means)
        if is_causal:
            result = result + weights[..., n:] * own_v
        out.put(result / weights.sum(-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).tiny))
    return out.result()


def _routed_queries(routed: Tensor) -> tuple[Tensor, Tensor]:
    """The queries routed to a head, ``routed`` ``(B, L)``, as indices ``(B, w)`` in increasing order,
    w the most any batch row has; shorter rows are filled with other queries, ``real`` False."""
    count = routed.sum(1)  # (B,)
    width = int(count.max())
    order = torch.argsort((~routed).to(torch.uint8), dim=1, stable=True)[:, :width]  # routed first, in order
    return order, torch.arange(width, device=routed.device) < count.unsqueeze(1)


def _gather(x: Tensor, index: Tensor) -> Tensor:
    """``x[b, h, index[b, j]]``: rows of ``x`` ``(B, H, N, F)`` for ``index`` ``(B, n)``."""
    B, H, _, Fx = x.shape
    return x.gather(2, index[:, None, :, None].expand(B, H, index.shape[1], Fx))


def _scatter(x: Tensor, index: Tensor, size: int) -> Tensor:
    """Rows of ``x`` ``(B, H, n, F)`` placed at ``index`` ``(B, n)`` of a zero ``(B, H, size, F)``."""
    B, H, n, Fx = x.shape
    return x.new_zeros(B, H, size, Fx).scatter(2, index[:, None, :, None].expand(B, H, n, Fx), x)


# ---------------------------------------------------------------------------------------------
# The mechanism
# ---------------------------------------------------------------------------------------------


def _subheads(heads: int, rates: tuple[float, ...]) -> int:
    """S' subheads per resolution; raises unless the heads split evenly between the rates."""
    if heads % len(rates):
        raise ValueError(
            f"multires splits its heads evenly between its {len(rates)} resolutions (rates={rates}), "
            f"but got {heads} heads; use a multiple of {len(rates)} heads, or pass as many rates as "
            f"divide {heads}"
        )
    return heads // len(rates)


def _check_router_logits(
    logits: Tensor | None, config: MultiresConfig, shape: AttentionShape, device: torch.device
) -> None:
    want = (shape.batch, len(config.rates), shape.queries)
    if config.routing == "random":
        if logits is not None:
            raise ValueError(
                "multires with routing='random' takes no router_logits; drop them, or use routing='learned'"
            )
        return
    missing = (
        f"multires needs router_logits of shape (B, R, L) = {want}: one logit per resolution for each "
        "query (its nn layer makes them; see MultiresInputs), or set routing='random'"
    )
    check_logits(logits, "router_logits", "(B, R, L)", want, device, "q", missing)


def _resolve_seed(state: nn.Module | None) -> int:
    if state is None:
        return 0
    if not isinstance(state, MultiresState):
        raise ValueError(f"multires needs a MultiresState, got {type(state).__name__}")
    return int(state.seed)


def multires_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    config: MultiresConfig | None = None,
    state: nn.Module | None = None,
    router_logits: Tensor | None = None,
    query_padding_mask: Tensor | None = None,
) -> Tensor:
    """AdaMRA: each query attends to the landmarks of the resolution its router picks (eq. 6–9).

    Args:
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, Dv)``; heads ``h·S' .. (h+1)·S' − 1``
            run at ``config.rates[h]`` (H = R·S').
        key_padding_mask: bool ``(B, S)``, True marks a real key.
        is_causal: completed segments before each query plus its own segment's running mean.
        scale: the softmax ablation's scale (default D^-1/2); the kernel form takes none.
        config: ``MultiresConfig``.
        state: ``MultiresState`` holding the seed of random routing (seed 0 when None).
        router_logits: ``(B, R, L)``, one logit per resolution for each query (learned routing).
        query_padding_mask: bool ``(B, L)``, True marks a real query; padded queries are routed to
            no resolution and return zeros. Optional: a query's output depends on the others only
            through rounding (how many share its resolution sets the shapes of its products), but
            with it, what padded queries hold cannot change even that.

    Returns:
        ``(B, H, L, Dv)``: a query's chosen heads weighted by its router probability, zeros in the
        others.
    """
    config = config or MultiresConfig()
    shape = check_attention_inputs(q, k, v, key_padding_mask, is_causal, scale)
    if config.similarity == "kernel" and scale is not None:
        raise ValueError(
            f"multires kernel attention has no softmax scale; leave scale=None, or set similarity='softmax' "
            f"(got {scale})"
        )
    subheads = _subheads(shape.heads, config.rates)
    _check_router_logits(router_logits, config, shape, q.device)
    seed = _resolve_seed(state)
    dtype = q.dtype
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    q, k, v = q.to(work), k.to(work), v.to(work)
    first = shape.keys - shape.queries if is_causal else 0  # the position of query 0 (random routing)
    choice, weight = route(router_logits, config, shape.batch, shape.queries, first, seed, work)
    choice, weight = choice.to(q.device), weight.to(q.device)
    check_query_padding_mask(query_padding_mask, shape, q.device)
    visible = torch.ones(1, shape.queries, dtype=torch.bool, device=q.device)
    if is_causal:  # queries before every key (L > S) see nothing
        visible = visible & (torch.arange(shape.queries, device=q.device) >= shape.queries - shape.keys)
    if query_padding_mask is not None:
        visible = visible & query_padding_mask  # (B, L)
    B, L, Dv = shape.batch, shape.queries, shape.value_dim
    if config.similarity == "kernel" and not is_causal:  # every head for every query, in one product
        resolution = torch.arange(shape.heads, device=q.device) // subheads
        chosen = (choice[:, None, :] == resolution[None, :, None]) & visible[:, None, :]
        gate = torch.where(chosen, weight[:, None, :], 0.0)  # (B, H, L)
        return _kernel(q, k, v, key_padding_mask, config, subheads, gate).to(dtype)
    # Without autograd every head group writes into one output; with it, the groups are concatenated.
    track = tracks_grad(q, k, v, *(() if router_logits is None else (router_logits,)))
    out = None if track else q.new_zeros(B, shape.heads, L, Dv)
    outputs = []
    for h, rate in enumerate(config.rates):
        heads = slice(h * subheads, (h + 1) * subheads)
        kh, vh = k[:, heads], v[:, heads]
        routed = (choice == h) & visible
        if config.similarity == "softmax":
            # The ablation runs every query, so a row's matmul shapes, and with them its rounding,
            # do not depend on how many other queries (later ones, other rows) pick this head.
            order, real = torch.arange(L, device=q.device).expand(B, L), routed.expand(B, L)
        else:
            order, real = _routed_queries(routed)  # each head computes its own queries only
        if order.shape[1] == 0:  # no query chose this resolution
            outputs.append(q.new_zeros(B, subheads, L, Dv))
            continue
        qh = _gather(q[:, heads], order)  # (B, S', w, D)
        position = order + (shape.keys - L if is_causal else 0)  # key positions (causal)
        length = segment_length(rate, shape.keys)
        if config.similarity == "softmax":
            scale_h = resolve_scale(scale, shape.head_dim)
            rows = _softmax(qh, position, real, kh, vh, key_padding_mask, length, is_causal, scale_h)
        else:
            rows = _causal_kernel(qh, position, real, kh, vh, key_padding_mask, length, config)
        rows = rows * (weight.gather(1, order) * real)[:, None, :, None]  # the router's weight; 0 on fill rows
        if out is None:
            outputs.append(_scatter(rows, order, L))  # (B, S', L, Dv)
        else:
            out[:, heads].scatter_(2, order[:, None, :, None].expand_as(rows), rows)
    return (torch.cat(outputs, dim=1) if out is None else out).to(dtype)  # (B, H, L, Dv)


def _example_logits(q: Tensor, k: Tensor, v: Tensor, config: Config, generator: torch.Generator) -> dict[str, Tensor]:
    if config.routing == "random":
        return {}
    B, _, L, _ = q.shape
    logits = torch.randn(B, len(config.rates), L, generator=generator)
    return {"router_logits": logits.to(device=q.device, dtype=q.dtype)}


MECHANISM = Mechanism(
    name="multires",
    fn=multires_attention,
    config=MultiresConfig,
    summary="AdaMRA: each query routed to one resolution, kernel attention over its segment means: linear time",
    paper="Zhang, Ma, Seidl & Tresp 2021, Adaptive Multi-Resolution Attention, §3.2, eq. 6-9",
    causal=True,
    cross=True,
    tensor_args=("router_logits", "query_padding_mask"),
    positions={"router_logits": QUERY},
    examples=(
        {},
        {"rates": (0.5, 0.25)},
        {"rates": (1.0, 0.34), "similarity": "softmax"},
        {"rates": (0.5,), "routing": "random", "feature_map": "elu"},
    ),
    state=MultiresState,
    inputs=MultiresInputs,
    example_tensors=_example_logits,
    decoder=KVCache,
)

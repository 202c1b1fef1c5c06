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
busy 2-core CPU is what counts (docs/performance.md). The causal form and the softmax ablation
gather the queries routed to each head (padded to the most any batch row has) and scatter their
outputs back (``ops.resolution_routing``): faster there, as their per-query work is larger. No
(N × N) and no (N × H × D × D) tensor exists in either pass. Half-precision inputs are computed in
fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from subquad._validate import AttentionShape, check_attention_inputs, check_logits, check_query_padding_mask, work_dtype
from subquad.decoding import KVCache
from subquad.kernels.memory import tracks_grad
from subquad.ops.landmarks import landmark_kernel
from subquad.ops.resolution_routing import per_resolution, route
from subquad.registry import QUERY, Config, Mechanism, option

__all__ = [
    "MultiresConfig",
    "MultiresInputs",
    "MultiresState",
    "multires_attention",
    "route",
]


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
    check_query_padding_mask(query_padding_mask, shape, q.device)
    dtype = q.dtype
    work = work_dtype(dtype)
    q, k, v = q.to(work), k.to(work), v.to(work)
    first = shape.keys - shape.queries if is_causal else 0  # the position of query 0 (random routing)
    choice, weight = route(router_logits, config, shape.batch, shape.queries, first, _resolve_seed(state), work)
    choice, weight = choice.to(q.device), weight.to(q.device)
    visible = _visible(shape, is_causal, query_padding_mask, q.device)
    if config.similarity == "kernel" and not is_causal:  # every head for every query, in one product
        resolution = torch.arange(shape.heads, device=q.device) // subheads
        chosen = (choice[:, None, :] == resolution[None, :, None]) & visible[:, None, :]
        gate = torch.where(chosen, weight[:, None, :], 0.0)  # (B, H, L)
        return landmark_kernel(
            q, k, v, key_padding_mask, config.rates, subheads, gate, config.feature_map, config.eps
        ).to(dtype)
    track = tracks_grad(q, k, v, *(() if router_logits is None else (router_logits,)))
    routed = [(choice == h) & visible for h in range(len(config.rates))]
    return per_resolution(q, k, v, key_padding_mask, is_causal, scale, config, routed, weight, track).to(dtype)


def _visible(shape: AttentionShape, is_causal: bool, query_padding_mask: Tensor | None, device) -> Tensor:
    """The queries that see a key, bool ``(B | 1, L)``: causal, not those before every key (L > S);
    not padded ones."""
    visible = torch.ones(1, shape.queries, dtype=torch.bool, device=device)
    if is_causal:
        visible = visible & (torch.arange(shape.queries, device=device) >= shape.queries - shape.keys)
    return visible if query_padding_mask is None else visible & query_padding_mask


def _example_logits(q: Tensor, k: Tensor, v: Tensor, config: Config, generator: torch.Generator) -> dict[str, Tensor]:
    if config.routing == "random":
        return {}
    B, _, L, _ = q.shape
    logits = torch.randn(B, len(config.rates), L, generator=generator)
    return {"router_logits": logits.to(device=q.device, dtype=q.dtype)}


def _softmax_similarity(config: MultiresConfig) -> bool:
    """``Mechanism.scaled``: the softmax similarity has a scale, the kernel one none."""
    return config.similarity == "softmax"


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
    scaled=_softmax_similarity,
    plain_backward=True,
)

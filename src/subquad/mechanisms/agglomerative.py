"""Agglomerative attention (Spellings 2019).

Each position is softly assigned to one of m classes, separately as a reference (key) and as a
query: ``c^r = softmax(x W^r + b^r)``, ``c^q = softmax(x W^q + b^q)``, m-way. Each class k keeps the
average of the reference values assigned to it, and each query takes its own classes' averages,
weighted by its class probabilities:

    a^k_i = Σ_{j≤i} c^r_jk v^k_j / max(Σ_{j≤i} c^r_jk, clip)        (masked: the prefix includes i)
    a^k   = Σ_j   c^r_jk v^k_j / max(Σ_j   c^r_jk, clip)            (full)
    out_i = concat_k(c^q_ik · a^k_i), then the output matrix

The classes are the heads: ``v^k = x P^k`` is head k's value projection (width d/m), and the output
matrix is the layer's output projection. In the ``(B, H, N, D)`` contract the class assignments
arrive as one logit per head for each position: ``query_logits`` ``(B, H, L)`` and ``key_logits``
``(B, H, S)``; the softmax runs across the heads, not across time. ``AgglomerativeInputs`` makes them
from the layer's input, as the author's layer does (``shared_classes`` uses one W for both sides).
Queries and keys as vectors are not used: the layer builds no q/k projections for it.

Where this differs from the author's Keras layer, on purpose:

- Padding: padded positions get ``c^r = 0``, so they add nothing to any class average (the author's
  layer sums pads in).
- Prefix sums and their normalisers are accumulated in fp32 under fp16/bf16.

The masked form is one autograd Function (``ops.class_averages.CausalAgglomerative``): prefix sums
block by block (a lower-triangular matmul per chunk, carried across blocks), and a backward that
recomputes them and accumulates suffix sums of the gradients, so only c^q, c^r and the values are
saved.

As there, the denominator is clipped at ``clip`` (1e-3), not given an ε: a query whose classes have
seen no reference mass returns zeros. Cost O(N·m·d/m) = O(N·d): linear time. With L ≠ S and
``is_causal`` the queries are the last L positions (bottom-right alignment). ``AgglomerativeDecoder``
keeps each class's running sum and mass (O(d) per sequence), so decoding a token costs the same
whatever the prefix length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from subquad._validate import AttentionShape, check_attention_inputs, check_logits, work_dtype
from subquad.decoding import Decoder
from subquad.ops import softmax
from subquad.ops.class_averages import CausalAgglomerative
from subquad.registry import KEY, QUERY, Config, Mechanism, option

__all__ = ["AgglomerativeConfig", "AgglomerativeDecoder", "AgglomerativeInputs", "agglomerative_attention"]


@dataclass(frozen=True)
class AgglomerativeConfig(Config):
    mechanism = "agglomerative"
    clip: float = option(1e-3, "lower clip of each class's reference mass (the author's 1e-3)", gt=0)
    shared_classes: bool = option(False, "layers: one class projection for queries and references")


def _check_logits(name: str, logits: Tensor | None, shape: tuple[int, int, int], device: torch.device) -> Tensor:
    missing = (
        f"agglomerative needs {name} of shape (B, H, N) = {shape}: one class logit per head for each "
        "position (its nn layer makes them; see AgglomerativeInputs)"
    )
    return check_logits(logits, name, "(B, H, N)", shape, device, "v", missing)


def _weights(
    shape: AttentionShape,
    v: Tensor,
    query_logits: Tensor | None,
    key_logits: Tensor | None,
    key_padding_mask: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """fp32+ class probabilities c^q ``(B, H, L, 1)`` and c^r ``(B, H, S, 1)``, and v in that dtype."""
    B, H, L, S = shape.batch, shape.heads, shape.queries, shape.keys
    query_logits = _check_logits("query_logits", query_logits, (B, H, L), v.device)
    key_logits = _check_logits("key_logits", key_logits, (B, H, S), v.device)
    work = work_dtype(v.dtype)
    c_q = softmax(query_logits.to(work), dim=1).unsqueeze(-1)  # across the classes (heads)
    c_r = softmax(key_logits.to(work), dim=1).unsqueeze(-1)
    if key_padding_mask is not None:
        c_r = c_r * key_padding_mask[:, None, :, None].to(work)
    return c_q, c_r, v.to(work)


def agglomerative_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    config: AgglomerativeConfig | None = None,
    state: nn.Module | None = None,
    query_logits: Tensor | None = None,
    key_logits: Tensor | None = None,
) -> Tensor:
    """Agglomerative attention: each query gets its classes' (running) averages of the values.

    Args:
        q, k: only their shapes ``(B, H, L, ·)`` and ``(B, H, S, ·)`` are used.
        v: ``(B, H, S, Dv)``, head k holding class k's projection ``x P^k``.
        key_padding_mask: bool ``(B, S)``, True marks a real position.
        is_causal: masked form; query i averages references ``j <= i + S - L``.
        scale: must be None (there are no dot products).
        config: ``AgglomerativeConfig``.
        query_logits, key_logits: ``(B, H, L)`` and ``(B, H, S)`` class logits (softmax over H).

    Returns:
        ``(B, H, L, Dv)``.
    """
    config = config or AgglomerativeConfig()
    shape = check_attention_inputs(q, k, v, key_padding_mask, is_causal, None)
    if scale is not None:
        raise ValueError(f"agglomerative attention has no dot products to scale; leave scale=None (got {scale})")
    c_q, c_r, values = _weights(shape, v, query_logits, key_logits, key_padding_mask)
    if not is_causal:
        sums = torch.matmul(c_r.transpose(-1, -2), values)  # (B, H, 1, Dv): Σ_j c^r_j v_j
        # c_q as SDPA's layout (it is a view of the logits' softmax over heads), so the output is too
        return (c_q.contiguous() * (sums / c_r.sum(2, keepdim=True).clamp_min(config.clip))).to(v.dtype)
    return CausalAgglomerative.apply(c_q, c_r, values, shape.keys - shape.queries, config.clip).to(v.dtype)


class AgglomerativeInputs(nn.Module):
    """The class logits of an agglomerative head group, from the layer's inputs: ``x W + b`` with
    one output per head (class), for the query side and the reference side.

    Args:
        config: ``AgglomerativeConfig`` (``shared_classes``: one projection for both sides).
        embed_dim: the layer's input width E (queries and keys share it in self-attention).
        num_heads: the group's heads m.
    """

    def __init__(self, config: AgglomerativeConfig, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.query_classes = nn.Linear(embed_dim, num_heads)
        self.key_classes = self.query_classes if config.shared_classes else nn.Linear(embed_dim, num_heads)

    def forward(self, query_x: Tensor, key_x: Tensor) -> dict[str, Tensor]:
        if key_x.shape[-1] != self.key_classes.in_features:
            raise ValueError(
                f"agglomerative classifies references from inputs of width {self.key_classes.in_features}, "
                f"got {key_x.shape[-1]}; use kdim equal to embed_dim"
            )
        return {
            "query_logits": self.query_classes(query_x).transpose(1, 2),  # (B, H, L)
            "key_logits": self.key_classes(key_x).transpose(1, 2),  # (B, H, S)
        }


def _example_logits(q: Tensor, k: Tensor, v: Tensor, config: Config, generator: torch.Generator) -> dict[str, Tensor]:
    B, H, L, _ = q.shape
    S = k.shape[2]
    return {
        "query_logits": torch.randn(B, H, L, generator=generator).to(device=q.device, dtype=q.dtype),
        "key_logits": torch.randn(B, H, S, generator=generator).to(device=q.device, dtype=q.dtype),
    }


class AgglomerativeDecoder(Decoder):
    """Recurrent decoding of masked agglomerative attention: per class, the running ``Σ c^r v`` and
    ``Σ c^r`` (fp32 for half inputs). Each step costs the same whatever the prefix length."""

    recurrent = True
    absorbs = True
    description = "recurrent state (Σ c^r v and Σ c^r per class: O(1) in the prefix length)"
    fixed = ("B", "H", "Dv")  # q and k lend only their shapes: D plays no part

    def __init__(self, mechanism: Mechanism, config: AgglomerativeConfig, state: nn.Module | None) -> None:
        super().__init__(mechanism, config, state)
        self.sums: Tensor | None = None  # (B, H, 1, Dv)
        self.mass: Tensor | None = None  # (B, H, 1, 1)

    def step(
        self, q: Tensor, k: Tensor, v: Tensor, query_logits: Tensor | None = None, key_logits: Tensor | None = None
    ) -> Tensor:
        """``Decoder.step``, whose class logits ``(B, H, T)`` may also come by position."""
        return super().step(q, k, v, query_logits=query_logits, key_logits=key_logits)

    @torch.no_grad()
    def _absorb(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, query_logits: Tensor | None = None,
        key_logits: Tensor | None = None,
    ) -> None:  # fmt: skip
        """The sums of a prompt's real positions, handed over from the parallel pass."""
        B, H, S, D = q.shape
        shape = AttentionShape(B, H, S, S, D, v.shape[-1], D**-0.5)
        _, c_r, values = _weights(shape, v, query_logits, key_logits, key_padding_mask)
        self.sums, self.mass = (c_r * values).sum(2, keepdim=True), c_r.sum(2, keepdim=True)

    @torch.no_grad()
    def _step(
        self, q: Tensor, k: Tensor, v: Tensor, query_logits: Tensor | None = None, key_logits: Tensor | None = None
    ) -> Tensor:
        """The ``T`` new positions' outputs ``(B, H, T, Dv)``, each over the prefix and itself."""
        B, H, T, D = q.shape
        shape = AttentionShape(B, H, T, T, D, v.shape[-1], D**-0.5)
        c_q, c_r, values = _weights(shape, v, query_logits, key_logits, None)
        sums, mass = torch.cumsum(c_r * values, dim=2), torch.cumsum(c_r, dim=2)
        if self.sums is not None:
            sums, mass = sums + self.sums, mass + self.mass
        self.sums, self.mass = sums[:, :, -1:], mass[:, :, -1:]
        return (c_q * sums / mass.clamp_min(self.config.clip)).to(v.dtype)


MECHANISM = Mechanism(
    name="agglomerative",
    output_gain=True,
    conv_input=True,
    fn=agglomerative_attention,
    config=AgglomerativeConfig,
    summary="soft class assignments; each query takes its classes' (running) value averages: linear time",
    paper="Spellings 2019, Agglomerative Attention, Methods",
    causal=True,
    cross=True,
    tensor_args=("query_logits", "key_logits"),
    positions={"query_logits": QUERY, "key_logits": KEY},
    examples=({}, {"clip": 0.5}),
    inputs=AgglomerativeInputs,
    example_tensors=_example_logits,
    decoder=AgglomerativeDecoder,
    uses_qk=False,
    scaled=False,
    plain_backward=True,
)

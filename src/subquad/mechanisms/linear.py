"""Kernel (linear) attention (Katharopoulos, Vyas, Pappas & Fleuret 2020).

Softmax similarity is replaced by a feature map φ, so the sums over keys factor out of the queries:

    out_i = φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / (φ(q_i)ᵀ Σ_j φ(k_j) + ε)

with φ = elu(x) + 1 (their default) or ReLU (AdaMRA's). ε keeps a query whose features are all
zero (possible under ReLU), or that sees no key, at a zero output instead of 0/0. Padded keys get
φ(k) = 0. The non-causal form costs O(N·D·Dv) time and O(D·Dv) state per head. It is one
autograd Function (``kernels.linear.NonCausal``) that runs block by block in both passes, recomputing φ in the
backward, so only q, k, v and the two sums are saved.

**Causal form.** The sums run over j ≤ i. Writing the normaliser as one more value column (v' = [v, 1])
makes numerator and denominator one causal product ``y_i = Σ_{j≤i} (a_i·b_j) c_j`` with a = φ(q),
b = φ(k), c = v'. It is computed in chunks of ``chunk`` positions: inside a chunk by a masked
(chunk × chunk) product, across chunks through the running state ``S = Σ b_j c_jᵀ`` (D × Dv+1).
The per-position cost is about 4·chunk·D + 4·D·Dv, least near chunk = √(D·Dv): 64 by default.
One autograd Function (``kernels.linear.Causal``) runs over blocks of positions in time order, computing φ and
v for the block only, with the block's chunk states as running sums, so memory stays
O(N·D + block·D·Dv), never O(N·D²). Its forward carries the normaliser's state Σ φ(k) beside
S rather than as a ones column: (D × Dv+1) products run a quarter slower than (D × Dv) ones.
Its backward is the same product run forwards in time (for ∂q) and backwards in time (for ∂k,
∂v), recomputing φ per block: only q, k, v, the output and the denominators are saved. With
L ≠ S the queries are the last L positions of the keys (bottom-right alignment): keys before them
enter as the initial state. ``subquad.ops.scan.causal_dot`` is the bare product,
differentiable, for mechanisms built on it.

**Decoding.** ``LinearDecoder`` carries S and the normaliser per head (O(D·Dv), whatever the prefix
length) and runs the same chunked product from that state for each new block of tokens. Sums are
accumulated in fp32 for fp16/bf16 inputs.

There is no softmax, so there is no scale: ``scale`` must be left None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from subquad._validate import check_attention_inputs
from subquad.decoding import Decoder
from subquad.kernels.linear import Causal, NonCausal, features, normalise
from subquad.ops.scan import causal_dot_forward
from subquad.registry import Config, Mechanism, option

if TYPE_CHECKING:
    from torch import nn

__all__ = ["LinearConfig", "LinearDecoder", "linear_attention"]


@dataclass(frozen=True)
class LinearConfig(Config):
    mechanism = "linear"
    feature_map: str = option(
        "elu", "φ: elu (elu(x) + 1, Katharopoulos et al.) or relu (AdaMRA)", choices=("elu", "relu")
    )
    eps: float = option(1e-6, "ε added to the normaliser φ(q)ᵀ Σ φ(k)", gt=0)
    chunk: int = option(64, "causal form: positions per chunk of the exact in-chunk product", ge=1)


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
        return NonCausal.apply(q, k, v, key_padding_mask, config.feature_map, config.eps)
    offset = S - L  # query i sits at key position i + offset
    initial, mask = None, key_padding_mask
    if offset > 0:  # keys before the first query: every query sees them
        before = None if mask is None else mask[:, :offset]
        _, fk, v1 = features(q[:, :, :0], k[:, :, :offset], v[:, :, :offset], before, config.feature_map)
        initial = torch.matmul(fk.transpose(-1, -2), v1)  # (B, H, D, Dv + 1)
        k, v, mask = k[:, :, offset:], v[:, :, offset:], None if mask is None else mask[:, offset:]
    elif offset < 0:  # the first -offset queries see no key
        q = q[:, :, -offset:]
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    mask = None if mask is None else mask.to(work)
    out = Causal.apply(q, k, v, mask, initial, config.feature_map, config.eps, config.chunk)
    if offset < 0:
        out = torch.cat([out.new_zeros(B, H, -offset, Dv), out], dim=2)
    return out


class LinearDecoder(Decoder):
    """Recurrent decoding of causal linear attention: per head, the running ``Σ φ(k) [v, 1]ᵀ``
    (D × Dv+1, fp32 for half inputs). Each step costs the same whatever the prefix length."""

    recurrent = True
    description = "recurrent state (Σ φ(k) vᵀ and Σ φ(k) per head: O(1) in the prefix length)"

    def __init__(self, mechanism: Mechanism, config: LinearConfig, state: nn.Module | None) -> None:
        super().__init__(mechanism, config, state)
        self.sums: Tensor | None = None  # (B·H, D, Dv + 1)

    @torch.no_grad()
    def _step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attend the ``T`` new queries ``(B, H, T, D)`` causally to the prefix and the new keys."""
        B, H, T, D = q.shape
        Dv = v.shape[-1]
        fq, fk, v1 = features(q, k, v, None, self.config.feature_map)
        a, b, c = fq.reshape(B * H, T, D), fk.reshape(B * H, T, D), v1.reshape(B * H, T, Dv + 1)
        y = causal_dot_forward(a, b, c, self.sums, self.config.chunk)
        update = torch.matmul(b.transpose(1, 2), c)
        self.sums = update if self.sums is None else self.sums + update
        return normalise(y.view(B, H, T, Dv + 1), self.config.eps, q.dtype)


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
    scaled=False,
)

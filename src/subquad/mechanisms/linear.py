"""Kernel (linear) attention (Katharopoulos, Vyas, Pappas & Fleuret 2020).

Softmax similarity is replaced by a feature map φ, so the sums over keys factor out of the queries:

    out_i = φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / (φ(q_i)ᵀ Σ_j φ(k_j) + ε)

with φ = elu(x) + 1 (their default) or ReLU (AdaMRA's). ε keeps a query whose features are all
zero (possible under ReLU), or that sees no key, at a zero output instead of 0/0. Padded keys get
φ(k) = 0. The non-causal form costs O(N·D·Dv) time and O(D·Dv) state per head. It is one
autograd Function (``ops.linear_blocks.NonCausal``) that runs block by block in both passes, recomputing φ in the
backward, so only q, k, v and the two sums are saved.

**Causal form.** The sums run over j ≤ i. Writing the normaliser as one more value column (v' = [v, 1])
makes numerator and denominator one causal product ``y_i = Σ_{j≤i} (a_i·b_j) c_j`` with a = φ(q),
b = φ(k), c = v'. It is computed in chunks of ``chunk`` positions: inside a chunk by a masked
(chunk × chunk) product, across chunks through the running state ``S = Σ b_j c_jᵀ`` (D × Dv+1).
The per-position cost is about 4·chunk·D + 4·D·Dv, least near chunk = √(D·Dv): 64 by default.
One autograd Function (``ops.linear_blocks.Causal``) runs over blocks of positions in time order, computing φ and
v for the block only, with the block's chunk states as running sums, so memory stays
O(N·D + block·D·Dv), never O(N·D²). Its forward carries the normaliser's state Σ φ(k) beside
S rather than as a ones column: (D × Dv+1) products run a quarter slower than (D × Dv) ones.
Its backward is the same product run forwards in time (for ∂q) and backwards in time (for ∂k,
∂v), recomputing φ per block: only q, k, v, the output and the denominators are saved. With
L ≠ S the queries are the last L positions of the keys (bottom-right alignment): keys before them
enter as the initial state. ``subquad.ops.scan.causal_dot`` is the bare product,
differentiable, for mechanisms built on it.

**Off the CPU** (``TUNING.whole_scan``) both forms run as whole-sequence ops under autograd
instead (``ops.linear_blocks.causal_whole``, ``noncausal_whole``): every chunk's product at once and
the states entering the chunks from one cumulative sum, a few large kernels rather than a loop of
blocks, with bf16 operands for bf16 inputs. They keep O(N·(D + chunk) + (N / chunk)·D·Dv) per
head for the backward, about twice the blocks' peak memory at 64k on a GPU.

**Decoding.** ``LinearDecoder`` carries S and the normaliser per head (O(D·Dv), whatever the prefix
length) and runs the same chunked product from that state for each new block of tokens. Sums are
accumulated in fp32 for fp16/bf16 inputs.

There is no softmax, so there is no scale: ``scale`` must be left None.

**Learned feature maps.** ``feature_map="hedgehog"`` is Hedgehog's softmax-mimicking map (Zhang,
Bhatia, Kumbong & Ré 2024): per head, ``φ(x) = [softmax(x W + b), softmax(−(x W + b))]`` over the
D features (2D features in all, each positive), with W and b learned in ``LinearState``. They start
at W = I, b = 0; ``subquad.hf.convert`` and ``subquad distill`` train them so that the kernel
matches a pretrained model's softmax attention. Without a state the call uses that initial map.
The learned φ runs in autograd; the kernels above then take it as it is (ReLU of positive
features is the identity, with gradient 1).

**A softmax window (our option, as in LoLCATs, Zhang et al. 2025).** ``window = w > 0`` keeps exact
softmax for the keys less than w positions from the query (``local``'s window: causal, the previous
w − 1 and its own; non-causal, w − 1 on each side too) and kernel attention for the rest, under one
normaliser. The window's softmax output o^W (``local``) enters with mass 1 against the kernel's raw
weights of the far keys F(i):

    out_i = (m_i · o^W_i + Σ_{j∈F(i)} φ(q_i)·φ(k_j) v_j) / (m_i + Σ_{j∈F(i)} φ(q_i)·φ(k_j) + ε)

where m_i is 1 if the window holds a real key and 0 otherwise: softmax's own stabiliser (its
log-sum-exp) sets the window's scale, and a learned φ learns the far keys' weight against it.
Nearby tokens, which a pretrained model's attention leans on most, are exact; the cost stays
linear, O(N·(w + D)·D). The far sums are causal products (``ops.scan.causal_dot``) of the keys
shifted by w, and non-causal also of the reversed sequences, so no band is subtracted and no
weight can come out negative (``ops.windowed_linear``). ``scale`` applies to the window's softmax
(default 1/√D).

**Sinks.** ``sinks = s`` (with a window) moves the first s keys from the far part into the
softmax part for every query that sees them: ``local``'s attention sinks (StreamingLLM, Xiao et al.
2024). A pretrained decoder puts much of its attention on the first token, a weight no bounded
kernel feature reproduces; in the softmax part it is exact. m_i is then 1 when the window or the
sinks hold a real key, and the far sums skip the sinks. ``LinearDecoder`` keeps the sinks beside
the window's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from subquad._validate import check_attention_inputs, work_dtype
from subquad.decoding import Decoder
from subquad.ops.causal_blocks import in_query_blocks
from subquad.ops.kept_window import Kept, kept_from_prompt, pieces
from subquad.ops.linear_blocks import Causal, NonCausal, causal_whole, features, noncausal_whole, normalise
from subquad.ops.scan import causal_dot_forward, whole_scan
from subquad.ops.windowed_linear import LinearState, far_sums, learned_features, learned_state, windowed, windowed_step
from subquad.registry import Config, Mechanism, option

__all__ = ["LinearConfig", "LinearDecoder", "LinearState", "learned_features", "learned_state", "linear_attention"]


@dataclass(frozen=True)
class LinearConfig(Config):
    mechanism = "linear"
    feature_map: str = option(
        "elu",
        "φ: elu (elu(x) + 1, Katharopoulos et al.), relu (AdaMRA) or hedgehog (learned softmax features in "
        "LinearState, Zhang et al. 2024)",
        choices=("elu", "relu", "hedgehog"),
    )
    eps: float = option(1e-6, "ε added to the normaliser φ(q)ᵀ Σ φ(k)", gt=0)
    chunk: int = option(64, "causal form: positions per chunk of the exact in-chunk product", ge=1)
    window: int = option(
        0, "w > 0: exact softmax over the keys less than w positions away, kernel attention beyond (LoLCATs)", ge=0
    )
    sinks: int = option(
        0, "with a window: the first s keys join the window's softmax for every query (attention sinks)", ge=0
    )

    def check(self) -> None:
        if self.sinks and not self.window:
            raise ValueError(
                f"linear option sinks={self.sinks} joins the first keys to the softmax window, but window is 0; "
                "set window=w > 0 as well, or leave sinks=0"
            )


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
    shape = check_attention_inputs(q, k, v, key_padding_mask, is_causal, scale if config.window else None)
    if scale is not None and not config.window:
        raise ValueError(f"linear attention has no softmax scale; leave scale=None (got {scale})")
    B, H, L, S, Dv = shape.batch, shape.heads, shape.queries, shape.keys, shape.value_dim
    name, dtype = config.feature_map, q.dtype
    learned = learned_state(state, config, H, shape.head_dim, q.device)
    if config.window:
        return _windowed(q, k, v, key_padding_mask, is_causal, scale, config, learned).to(dtype)
    if learned is not None:  # φ in autograd; the kernels' ReLU passes positive features through
        q, k, name = learned_features(q, learned), learned_features(k, learned), "relu"
        v = v.to(q.dtype)
    whole = whole_scan(q.device)  # off the CPU: whole-sequence ops, not blocks (ops.scan)
    if not is_causal:
        run = noncausal_whole if whole else NonCausal.apply
        return run(q, k, v, key_padding_mask, name, config.eps).to(dtype)
    offset = S - L  # query i sits at key position i + offset
    initial, mask = None, key_padding_mask
    if offset > 0:  # keys before the first query: every query sees them
        before = None if mask is None else mask[:, :offset]
        _, fk, v1 = features(q[:, :, :0], k[:, :, :offset], v[:, :, :offset], before, name)
        initial = torch.matmul(fk.transpose(-1, -2), v1)  # (B, H, D, Dv + 1)
        k, v, mask = k[:, :, offset:], v[:, :, offset:], None if mask is None else mask[:, offset:]
    elif offset < 0:  # the first -offset queries see no key
        q = q[:, :, -offset:]
    work = work_dtype(q.dtype)
    mask = None if mask is None else mask.to(work)
    out = (causal_whole if whole else Causal.apply)(q, k, v, mask, initial, name, config.eps, config.chunk)
    if offset < 0:
        out = torch.cat([out.new_zeros(B, H, -offset, Dv), out], dim=2)
    return out.to(dtype)


def _windowed(q, k, v, key_padding_mask, is_causal, scale, config, learned) -> Tensor:
    """``windowed``; causal inference in query blocks (``ops.causal_blocks``)."""
    if is_causal:
        far = lambda k, v, mask: far_sums(k, v, mask, config.feature_map, learned)  # noqa: E731
        run = lambda q, k, v, mask, initial: windowed(q, k, v, mask, True, scale, config, learned, initial)  # noqa: E731
        grads = () if learned is None else tuple(learned.parameters())
        out = in_query_blocks(q, k, v, key_padding_mask, config.sinks, config.window, run, far, grads)
        if out is not None:
            return out
    return windowed(q, k, v, key_padding_mask, is_causal, scale, config, learned)


class LinearDecoder(Decoder):
    """Recurrent decoding of causal linear attention: per head, the running ``Σ φ(k) [v, 1]ᵀ``
    (F × Dv+1, fp32 for half inputs). Each step costs the same whatever the prefix length. With a
    softmax ``window``, each row's ``sinks`` and last ``window`` keys are kept too
    (``ops.kept_window``), and a key enters the sums when it leaves the window (the sinks never
    do). It takes over a parallel prefill (``absorb``): the sums of the prompt's far keys."""

    recurrent = True
    absorbs = True
    description = (
        "recurrent state (Σ φ(k) vᵀ and Σ φ(k) per head, and any window's and sinks' keys: O(1) in the prefix length)"
    )

    def __init__(self, mechanism: Mechanism, config: LinearConfig, state: nn.Module | None) -> None:
        super().__init__(mechanism, config, state)
        self.sums: Tensor | None = None  # (B, H, F, Dv + 1)
        self.kept: Kept | None = None  # the window's keys and values

    @torch.no_grad()
    def _absorb(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> None:
        learned = learned_state(self.state, self.config, q.shape[1], q.shape[-1], q.device)
        far = key_padding_mask
        if self.config.window:
            self.kept, far = kept_from_prompt(k, v, key_padding_mask, self.config.sinks, self.config.window)
        self.sums = far_sums(k, v, far, self.config.feature_map, learned)

    @torch.no_grad()
    def _step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attend the ``T`` new queries ``(B, H, T, D)`` causally to the prefix and the new keys."""
        B, H, T, D = q.shape
        learned = learned_state(self.state, self.config, H, D, q.device)
        if self.config.window:
            if self.kept is None:
                self._absorb(q[:, :, :0], k[:, :, :0], v[:, :, :0], None)
            outputs = []
            for piece in pieces(T) if T > 1 else [slice(None)]:
                out, self.kept, self.sums = windowed_step(
                    q[:, :, piece], k[:, :, piece], v[:, :, piece], self.kept, self.sums, self.config, learned,
                    self.scale,
                )  # fmt: skip
                outputs.append(out)
            return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)).to(q.dtype)
        name, dtype, Dv = self.config.feature_map, q.dtype, v.shape[-1]
        if learned is not None:
            q, k, name = learned_features(q, learned), learned_features(k, learned), "relu"
        fq, fk, v1 = features(q, k, v, None, name)
        F = fq.shape[-1]
        a, b, c = fq.reshape(B * H, T, F), fk.reshape(B * H, T, F), v1.reshape(B * H, T, Dv + 1)
        before = None if self.sums is None else self.sums.reshape(B * H, F, Dv + 1)
        y = causal_dot_forward(a, b, c, before, self.config.chunk)
        update = torch.matmul(b.transpose(1, 2), c).view(B, H, F, Dv + 1)
        self.sums = update if self.sums is None else self.sums + update
        return normalise(y.view(B, H, T, Dv + 1), self.config.eps, dtype)


def _softmax_part(config: LinearConfig) -> bool:
    """``Mechanism.scaled``: with a window, linear has a softmax part to scale."""
    return config.window > 0


MECHANISM = Mechanism(
    name="linear",
    sinks="sinks",
    fn=linear_attention,
    config=LinearConfig,
    summary="kernel attention φ(Q)(φ(K)ᵀV): linear time, chunked causal form, recurrent decoding",
    paper="Katharopoulos, Vyas, Pappas & Fleuret 2020, Transformers are RNNs, eq. 4-9",
    causal=True,
    cross=True,
    decoder=LinearDecoder,
    state=LinearState,
    examples=(
        {"chunk": 5},
        {"feature_map": "relu", "chunk": 3},
        {},
        {"feature_map": "hedgehog", "chunk": 4},
        {"window": 3, "chunk": 2},
        {"feature_map": "hedgehog", "window": 4, "chunk": 3},
        {"feature_map": "hedgehog", "window": 3, "sinks": 2, "chunk": 2},
    ),
    scaled=_softmax_part,
)

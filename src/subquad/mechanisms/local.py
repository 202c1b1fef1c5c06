"""Local (sliding-window) attention, the Routing Transformer's companion heads (Roy et al. 2021).

Query i attends to the keys less than ``window`` positions from it, ``|i - j| < window``:
causal, the previous ``window - 1`` keys and its own (``i - window < j <= i``); non-causal,
``window - 1`` on each side as well (``window`` means the same in ``pattern``). With L ≠ S the
function's queries are the last L positions of the keys (bottom-right alignment, as in every
mechanism's ``fn``; ``subquad.attention`` aligns ``is_causal`` top-left, as SDPA does). Softmax is
exact over the window.

**Computation.** Queries go in blocks of ``block`` consecutive positions; a block's keys are the
contiguous range its queries' windows cover (``block + window - 1`` keys causal,
``block + 2·window - 2`` non-causal), read as overlapping views of k and v (no copy), with the exact
band as the element mask, which is the same for every inner block. This is the local step of the
block-sparse engine (``kernels.layouts.band_groups``) shared with the Sparse Transformer's strided
pattern: torch's CPU flash-attention kernel per batch of blocks (or, with ``kernel="native"``, the
opt-in C kernel of ``subquad.kernels.native`` for the forward), one autograd Function that saves the
output and log-sum-exp and recomputes blocks in the backward, so memory is O(N·D) plus one batch of
blocks, never O(N·window).

The forward runs blocks of ``TUNING.local_inference_block`` (32) queries where the CPU flash
kernel (or the native one) runs it, with gradients or without, and ``TUNING.local_block`` (64)
otherwise. The backward recomputes the band in a layout of its own (the engine's backward needs
only the saved output and log-sum-exp). Under torch's flash backward it is the band transposed:
blocks of ``TUNING.local_backward_block`` (128) keys, each against the queries that see it
(``block + 2·window − 2`` of them non-causal), so that a block's key and value gradients come
whole from one call; query blocks' key windows overlap, and each gave a part of its keys'
gradients that the kernel zero-filled and the engine summed. It also runs faster with the long
side on the kernel's queries: forward+backward 8–14% faster at N = 1024 and 2048, w = 256
(docs/performance.md). Off that kernel the backward takes ``TUNING.local_block`` queries, 128
where a query sees more than 256 keys (``kernels.blocksparse.band_blocks``). A call with
gradients returns exactly what one without returns, so a reentrant checkpoint recomputes the
values it first returned.

**Sinks.** ``sinks = s`` keeps the first s keys visible to every query (causal: those before it),
besides its window: StreamingLLM's attention sinks (Xiao et al. 2024), which pretrained decoders
lean on. They are a second, disjoint part of the block-sparse engine (``kernels.layouts.sink_groups``):
the first s keys each query's window leaves out, computed for all queries in one product
(``kernels.blocksparse_forward.leading_keys``) and merged by log-sum-exp. Causal inference in
query blocks (``ops.causal_blocks``) runs each block's window alone, its keys a view of the inputs,
and the sinks once for the whole call.

**Decoding.** ``WindowCache`` keeps the sinks and the last ``window`` keys and values: each new
token attends to them and itself, so decoding cost and memory do not grow with the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention

from subquad._validate import check_grouped_inputs
from subquad.decoding import Decoder
from subquad.kernels import flex
from subquad.kernels.band import window_attention, window_mask, window_softmax
from subquad.kernels.blocksparse_forward import leading_keys
from subquad.kernels.layouts import sink_mask
from subquad.masks import MaskMod, or_masks, window_covers_all
from subquad.mechanisms._options import kernel_option
from subquad.ops.causal_blocks import in_query_blocks
from subquad.ops.kept_window import Kept, extend, kept_from_prompt, one_step, pieces, reach, trim
from subquad.registry import Config, Mechanism, option

if TYPE_CHECKING:
    from torch import nn

__all__ = ["LocalConfig", "WindowCache", "local_attention", "local_mask_mod", "window_mask"]


@dataclass(frozen=True)
class LocalConfig(Config):
    mechanism = "local"
    window: int = option(256, "w: keys with |p − j| < w (causal: the last w, itself included)", ge=1)
    sinks: int = option(0, "the first s keys are visible to every query as well (StreamingLLM's attention sinks)", ge=0)
    kernel: str = kernel_option()


def local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    config: LocalConfig | None = None,
    state: nn.Module | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Sliding-window softmax attention.

    Args:
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, Dv)``.
        key_padding_mask: bool ``(B, S)``, True marks a real key.
        is_causal: query i (at key position i + S - L) sees keys ``i + S - L - window < j <= i + S - L``;
            otherwise ``|j - (i + S - L)| < window``.
        scale: softmax scale, default ``D ** -0.5``.
        config: ``LocalConfig``.
        enable_gqa: k and v may have a divisor of q's heads (grouped-query), read in place.

    Returns:
        ``(B, H, L, Dv)``; zero rows for queries whose window holds no real key.
    """
    config = config or LocalConfig()
    shape = check_grouped_inputs(q, k, v, key_padding_mask, is_causal, scale, enable_gqa)
    w, s = config.window, config.sinks
    if flex.usable(q, k, v, config.kernel):  # CUDA: FlexAttention under the same mask
        mask = local_mask_mod(config, shape.queries, shape.keys, is_causal)
        out = flex.masked_attention(q, k, v, mask, (config, is_causal), key_padding_mask, shape.scale, enable_gqa)
        if out is not None:
            return out

    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, initial: None = None) -> Tensor:
        return window_attention(q, k, v, mask, is_causal, scale, w, s, config.kernel, enable_gqa)

    if is_causal and s and config.kernel == "fused":  # inference by blocks: the window, then the sinks once
        out = _window_then_sinks(q, k, v, key_padding_mask, shape.scale, w, s)
        if out is not None:
            return out
    out = in_query_blocks(q, k, v, key_padding_mask, s, w, run) if is_causal else None  # inference: by blocks
    return run(q, k, v, key_padding_mask) if out is None else out


def _window_then_sinks(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, scale: float, w: int, s: int
) -> Tensor | None:  # fmt: skip
    """Causal inference in query blocks (``ops.causal_blocks``) with sinks: each block's window
    alone, its keys a view of the inputs (``kernels.band.window_softmax``, with its log-sum-exp),
    then the sinks each query's window leaves out for all queries at once, merged
    (``kernels.blocksparse_forward.leading_keys``): a sinks part per block was a dozen small
    operations each (docs/performance.md). None where blocks do not apply."""

    def window(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, initial: None = None) -> tuple[Tensor, Tensor]:
        return window_softmax(q, k, v, mask, True, scale, w, 0)

    parts = in_query_blocks(q, k, v, key_padding_mask, 0, w, window)
    if parts is None:
        return None
    out, lse = parts
    s, offset = min(s, k.shape[2]), k.shape[2] - q.shape[2]
    sinks = sink_mask(s, window_mask(w, True, offset), True, offset)
    zero = torch.zeros((), dtype=torch.long, device=q.device)
    columns = torch.arange(s, device=q.device)

    def seen(a: int, b: int) -> Tensor:
        return sinks(zero, zero, torch.arange(a, b, device=q.device)[:, None], columns)

    leading_keys(q, k[:, :, :s], v[:, :, :s], seen, key_padding_mask, scale, out, lse)
    return out.to(q.dtype)


def local_mask_mod(config: LocalConfig, num_queries: int, num_keys: int, is_causal: bool) -> MaskMod:
    """The keys ``local`` lets each query see, sinks included: its dense oracle, and its block
    mask under FlexAttention."""
    window = window_mask(config.window, is_causal, num_keys - num_queries)
    if not config.sinks:
        return window
    return or_masks(window, sink_mask(config.sinks, window, is_causal, num_keys - num_queries))


class WindowCache(Decoder):
    """Decoding cache of each row's first ``sinks`` and last ``window`` keys and values
    (``ops.kept_window``): each step attends the new tokens to them and to each other, so its
    cost is independent of the prompt length. It takes over a parallel prefill (``absorb``), with
    padding: a row's sinks are its first real tokens. Grouped-query keys and values are kept as
    given, one slot set per key/value head, and read by its query heads in place."""

    recurrent = True
    absorbs = True
    grouped = True
    description = "window cache (the sinks and the last window keys and values: O(window) per head)"
    holds = "keys"

    def __init__(self, mechanism: Mechanism, config: LocalConfig, state: nn.Module | None) -> None:
        super().__init__(mechanism, config, state)
        self.kept: Kept | None = None

    def _absorb(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> None:
        self.kept, _ = kept_from_prompt(k, v, key_padding_mask, self.config.sinks, self.config.window)

    @torch.no_grad()
    def _step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attend the ``T`` new queries ``(B, H, T, D)`` to the sinks, the window and each other
        (``PIECE`` at a time), by position; the keys that leave the window are dropped."""
        s, w = self.config.sinks, self.config.window
        if self.kept is None:
            self.kept, _ = kept_from_prompt(k[:, :, :0], v[:, :, :0], None, s, w)
        if k.shape[1] != self.kept.keys.shape[1]:
            raise ValueError(f"the cache holds keys of {self.kept.keys.shape[1]} key/value heads, got {k.shape[1]}; "
                             "start a new cache for a new batch")  # fmt: skip
        if q.shape[2] == 1:  # generation's step: in place, every kept key in view
            *_, filled = one_step(self.kept, k, v, s, leaving=False)
            return scaled_dot_product_attention(q, self.kept.keys, self.kept.values, filled, scale=self.scale,
                                                enable_gqa=True)  # fmt: skip
        outputs = []
        for piece in pieces(q.shape[2]):
            keys, values, positions, new = extend(self.kept, k[:, :, piece], v[:, :, piece])
            near, _ = reach(positions, new, s, w)
            outputs.append(scaled_dot_product_attention(q[:, :, piece], keys, values, near[:, None], scale=self.scale,
                                                        enable_gqa=True))  # fmt: skip
            self.kept, _ = trim(keys, values, positions, new[:, -1] + 1, s, w)
        return torch.cat(outputs, dim=2)


MECHANISM = Mechanism(
    name="local",
    sinks="sinks",
    fn=local_attention,
    config=LocalConfig,
    summary="sliding-window softmax attention over keys with |p − j| < w, block-sparse; window cache",
    paper="Roy, Saffar, Vaswani & Grangier 2021 (local heads of the Routing Transformer); Parmar et al. 2018",
    causal=True,
    cross=True,
    decoder=WindowCache,
    gqa=True,
    exact_full=window_covers_all,
    examples=(
        {},
        {"window": 5},
        {"window": 3, "kernel": "eager"},
        {"window": 9, "kernel": "native"},
        {"window": 4, "sinks": 3},
        {"window": 1, "sinks": 1, "kernel": "eager"},
    ),
)

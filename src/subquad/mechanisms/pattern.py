"""Attention under any mask pattern, block-sparse, with autograd: the ``pattern`` mechanism.

A config holds simple values only, so a pattern reaches the mechanism in one of two ways:

- by name (``PatternConfig.name``): built-ins ``window`` (sliding window, optionally dilated, plus
  global tokens), and any factory added with ``register_pattern``. Names work everywhere a config
  does: ``HeadGroup("pattern", name="window", window=64)``, the bench, ``subquad list``.
- as a callable for one call: ``subquad.attention(q, k, v, mechanism="pattern", mask_mod=fn)`` (or
  ``pattern_attention(..., mask_mod=fn)``). A user mask_mod sees raw indices ``q_idx ∈ [0, L)``,
  ``kv_idx ∈ [0, S)`` and the layer head ``head_offset + h``, like ``dense_mask``; ``is_causal`` adds
  the causal mask.

Its layout is found by evaluating the mask on every (query block, key block) tile, a chunk of query
blocks at a time (O(L·S) cheap boolean work, O(block·S) memory); each query block then attends to its
non-empty key blocks only, with query blocks bucketed by how many they have.

The blocks run on the engine of the Sparse Transformer (``kernels.blocksparse``) as gathered groups.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import Tensor

from subquad._validate import AttentionShape, check_grouped_inputs
from subquad.kernels import flex
from subquad.kernels.blocksparse import block_sparse_attention
from subquad.kernels.layouts import Group
from subquad.kernels.tuning import TUNING, block_elements
from subquad.masks import MaskMod, and_masks, causal_mask, window_covers
from subquad.mechanisms._options import head_offset_option, kernel_option
from subquad.registry import Config, Mechanism, option

__all__ = ["PATTERNS", "PatternConfig", "pattern_attention", "pattern_mask_mod", "register_pattern"]


@dataclasses.dataclass(frozen=True)
class PatternConfig(Config):
    mechanism = "pattern"
    name: str = option("window", "a registered pattern (PATTERNS); a mask_mod argument replaces it")
    window: int = option(128, "window: keys with |p − j| < window (positions, counted before dilation)", ge=1)
    dilation: int = option(1, "window: keep only keys with (p − j) mod dilation = 0", ge=1)
    global_tokens: int = option(0, "window: the first g positions see, and are seen by, every position", ge=0)
    head_offset: int = head_offset_option()
    block: int = option(64, "query and key block length of the layout (speed only)", ge=1, le=4096)
    kernel: str = kernel_option()

    def check(self) -> None:
        if self.name not in PATTERNS:
            raise ValueError(
                f"pattern option name must be a registered pattern, got {self.name!r}; registered: "
                f"{', '.join(PATTERNS)} (add one with register_pattern)"
            )


PatternFactory = Callable[[PatternConfig, int, int], MaskMod]


def _window_pattern(config: PatternConfig, num_queries: int, num_keys: int) -> MaskMod:
    """Sliding window ``|p − j| < window`` keeping ``(p − j) mod dilation = 0``, plus global tokens
    (the first ``global_tokens`` positions see and are seen by all), as in Longformer."""
    offset, window, dilation, g = num_keys - num_queries, config.window, config.dilation, config.global_tokens

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        distance = q_idx + offset - kv_idx
        allowed = (distance.abs() < window) & (distance.remainder(dilation) == 0)
        return allowed | (q_idx + offset < g) | (kv_idx < g) if g else allowed

    return mask_mod


PATTERNS: dict[str, PatternFactory] = {"window": _window_pattern}


def register_pattern(name: str, factory: PatternFactory, *, replace: bool = False) -> None:
    """Make ``factory(config, L, S) -> mask_mod`` available as ``PatternConfig(name=...)``.

    The mask_mod takes raw indices ``q_idx ∈ [0, L)``, ``kv_idx ∈ [0, S)`` and the layer head index.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a pattern name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise ValueError(f"register_pattern needs a factory (config, L, S) -> mask_mod, got {type(factory).__name__}")
    if name in PATTERNS and not replace:
        raise ValueError(f"a pattern named {name!r} exists; pass replace=True to override it")
    PATTERNS[name] = factory


def pattern_mask_mod(
    config: PatternConfig, num_queries: int, num_keys: int, is_causal: bool, mask_mod: MaskMod | None = None
) -> MaskMod:
    """The mask ``pattern`` computes: ``mask_mod`` (or the named pattern), and causal when asked."""
    if mask_mod is None:
        mask_mod = PATTERNS[config.name](config, num_queries, num_keys)
    return and_masks(mask_mod, causal_mask(num_queries, num_keys)) if is_causal else mask_mod


def _evaluate(mask_mod: MaskMod, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    try:
        out = mask_mod(b, h, q_idx, kv_idx)
    except RuntimeError as error:
        if "Boolean value of Tensor" not in str(error):
            raise
        raise ValueError(
            "mask_mod is called with index tensors, so Python's 'and', 'or', 'not' and 'if' cannot "
            "combine its conditions; use & | ~ and torch.where, e.g. (q_idx >= kv_idx) & (q_idx - kv_idx < w)"
        ) from error
    if not isinstance(out, Tensor) or out.dtype != torch.bool:
        got = out.dtype if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(
            f"mask_mod must return a bool tensor (True = may attend) from broadcastable index tensors, got {got}; "
            "combine conditions with & and |, not 'and'/'or'"
        )
    return out


def _occupancy(mask_mod: MaskMod, shape: AttentionShape, block: int, head_offset: int, device) -> Tensor:
    """Which (query block, key block) tiles hold an allowed pair, per head: bool ``(H|1, nq, nk)``."""
    B, H, L, S = shape.batch, shape.heads, shape.queries, shape.keys
    nq, nk = -(-L // block), -(-S // block)
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = (torch.arange(H, device=device) + head_offset).view(1, H, 1, 1)
    kv_idx = torch.arange(S, device=device).view(1, 1, 1, S)
    per_chunk = max(1, block_elements(TUNING.sparse_layout, torch.device(device)) // (B * H * block * S))
    tiles = []
    for first in range(0, nq, per_chunk):
        rows = torch.arange(first * block, min(L, (first + per_chunk) * block), device=device)
        m = _evaluate(mask_mod, b, h, rows.view(1, 1, -1, 1), kv_idx)
        m = m.expand(*m.shape[:2], len(rows), S)  # (B|1, H|1, rows, S)
        m = torch.nn.functional.pad(m, (0, nk * block - S, 0, -len(rows) % block))
        tiles.append(m.view(*m.shape[:2], -1, block, nk, block).any(-1).any(-2).any(0))  # (H|1, n, nk)
    return torch.cat(tiles, dim=1)


def _from_layer_head(mask_mod: MaskMod, head_offset: int) -> MaskMod:
    """``mask_mod`` as FlexAttention calls it, with the call's head h: the layer head h + head_offset."""
    if not head_offset:
        return mask_mod
    return lambda b, h, q_idx, kv_idx: mask_mod(b, h + head_offset, q_idx, kv_idx)


def _pattern_groups(
    mask_mod: MaskMod, shape: AttentionShape, block: int, head_offset: int, device, kept: bool = False
) -> list[Group]:
    """Each query block against its non-empty key blocks, blocks bucketed by how many they have.
    ``kept``: the caller keeps the groups for later calls of this shape (``Group.memo``)."""
    H, L, S = shape.heads, shape.queries, shape.keys
    occupied = _occupancy(mask_mod, shape, block, head_offset, device)  # (Hm, nq, nk)
    counts = occupied.sum(-1)  # (Hm, nq)
    order = torch.argsort((~occupied).to(torch.uint8), dim=-1, stable=True)  # occupied key blocks first
    most = counts.amax(0)  # (nq,)
    quantum = max(1, -(-int(most.max()) // 8))
    widths = (-(-most // quantum) * quantum).clamp(max=occupied.shape[-1])  # no wider than the key blocks
    h = (torch.arange(H, device=device) + head_offset).view(1, H, 1, 1, 1)
    b = torch.arange(shape.batch, device=device).view(-1, 1, 1, 1, 1)
    groups = []
    for width in widths.unique().tolist():
        if width == 0:
            continue  # these query blocks see no key: their rows stay zero
        rows = torch.nonzero(widths == width).flatten()
        key_blocks = order[:, rows, :width]  # (Hm, n, w)
        key_blocks = key_blocks.masked_fill(torch.arange(width, device=device) >= counts[:, rows, None], -1)
        keys = (key_blocks[..., None] * block + torch.arange(block, device=device)).flatten(-2)  # (Hm, n, W)
        keys = keys.masked_fill(key_blocks.repeat_interleave(block, dim=-1) < 0, -1)
        queries = rows[:, None] * block + torch.arange(block, device=device)
        queries = queries.masked_fill(queries >= L, L)

        def allowed(start: int, stop: int, queries=queries, keys=keys) -> Tensor:
            q_idx = queries[start:stop].clamp(max=L - 1)[None, None, :, :, None]  # (1, 1, n, bq, 1)
            kv_idx = keys[:, start:stop].clamp(0, S - 1)[None, :, :, None, :]  # (1, Hm, n, 1, W)
            return _evaluate(mask_mod, b, h, q_idx, kv_idx)

        groups.append(Group(queries, keys, allowed, memo={} if kept else None))
    return groups


@functools.lru_cache(maxsize=16)
def _named_pattern_groups(
    config: PatternConfig, factory: PatternFactory, shape: AttentionShape, is_causal: bool, device
) -> list[Group]:
    """The layout of a registered pattern (``factory``: a replaced registration is a new key)."""
    mod = pattern_mask_mod(config, shape.queries, shape.keys, is_causal)
    return _pattern_groups(mod, shape, config.block, config.head_offset, device, kept=True)


def pattern_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    config: PatternConfig | None = None,
    state: None = None,
    mask_mod: MaskMod | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Softmax attention under any ``mask_mod``, computed on its non-empty blocks only.

    Args:
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, Dv)``.
        key_padding_mask: bool ``(B, S)``, True marks a real key.
        is_causal: also apply the causal mask (key ``j <= i + S - L``).
        scale: softmax scale, default ``D ** -0.5``.
        config: ``PatternConfig``: the named pattern and the block length.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` on broadcastable index tensors; replaces
            the named pattern. ``h`` is the layer head ``head_offset + h``.
        enable_gqa: k and v may have a divisor of q's heads (grouped-query), read in place.

    Returns:
        ``(B, H, L, Dv)``; zero rows for queries that see no key.
    """
    config = config or PatternConfig()
    shape = check_grouped_inputs(q, k, v, key_padding_mask, is_causal, scale, enable_gqa)
    if mask_mod is not None and not callable(mask_mod):
        raise ValueError(
            f"mask_mod must be a function mask_mod(b, h, q_idx, kv_idx) -> bool tensor, got {type(mask_mod).__name__}"
        )
    if flex.usable(q, k, v, config.kernel):  # CUDA: FlexAttention under the same mask
        mod = pattern_mask_mod(config, shape.queries, shape.keys, is_causal, mask_mod)
        layer_mod = _from_layer_head(mod, config.head_offset)
        if mask_mod is not None:  # the engine's checks of a user's function, on a probe of 2 × 2 at most
            zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=q.device)
            rows, cols = (torch.arange(min(2, n), device=q.device) for n in (shape.queries, shape.keys))
            _evaluate(layer_mod, zero, zero, rows.view(1, 1, -1, 1), cols.view(1, 1, 1, -1))
        named = None if mask_mod is not None else PATTERNS[config.name]  # a factory may be replaced
        key = None if named is None else (named, dataclasses.replace(config, block=1), is_causal)
        out = flex.masked_attention(  # a registered factory's mask_mod, like a user's, may read b and h
            q, k, v, layer_mod, key, key_padding_mask, shape.scale, enable_gqa, heads_vary=True, batch_varies=True
        )
        if out is not None:
            return out
    if mask_mod is None:  # a named pattern's layout depends only on these: computed once
        groups = _named_pattern_groups(config, PATTERNS[config.name], shape, is_causal, q.device)
    else:  # a user's function may close over anything: its layout is evaluated on every call
        mod = pattern_mask_mod(config, shape.queries, shape.keys, is_causal, mask_mod)
        groups = _pattern_groups(mod, shape, config.block, config.head_offset, q.device)
    return block_sparse_attention(q, k, v, [groups], key_padding_mask, shape.scale, config.kernel)


def _exactly_full(config: PatternConfig, shape: AttentionShape, is_causal: bool, state: None, tensors: dict) -> bool:
    """The named window, undilated, leaving out no pair that is not global: two positions at least
    ``window`` apart both past the first ``global_tokens`` need ``max(L, S) > window + global_tokens``."""
    plain = "mask_mod" not in tensors and config.name == "window" and config.dilation == 1
    return plain and window_covers(config.window + config.global_tokens, shape.queries, shape.keys, is_causal)


MECHANISM = Mechanism(
    name="pattern",
    sinks="global_tokens",
    fn=pattern_attention,
    config=PatternConfig,
    summary="any mask_mod (named, or passed as mask_mod=), block-sparse with autograd",
    paper="mask_mod(b, h, q_idx, kv_idx) patterns, as in FlexAttention",
    tensor_args=("mask_mod",),
    gqa=True,
    exact_full=_exactly_full,
    examples=({}, {"window": 4, "block": 4}, {"window": 3, "dilation": 2, "global_tokens": 1, "block": 5}),
)

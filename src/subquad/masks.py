"""Attention masks as ``mask_mod(b, h, q_idx, kv_idx) -> bool`` functions.

A mask_mod says whether query ``q_idx`` may attend to key ``kv_idx`` in batch ``b``, head ``h``.
The arguments are broadcastable integer tensors, so one definition yields dense masks for tests
(``dense_mask``) and, in block-sparse mechanisms, block layouts for compute. Masks compose with
``and_masks`` / ``or_masks``.

Causal alignment in these masks and in every mechanism's ``fn``: when L != S, query ``i`` sits at
position ``i + S - L`` (bottom-right aligned), so a block of new queries appended to a key prefix
(decoding with a cache, chunked prefill) sees exactly the keys at or before its own position. The
public call follows SDPA instead: ``subquad.attention(is_causal=True)`` is top-left, and the
bottom-right form is asked for with ``attn_mask=causal_lower_right(L, S)`` (``subquad.call``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "MaskMod",
    "and_masks",
    "causal_mask",
    "contract_mask",
    "dense_mask",
    "not_mask",
    "or_masks",
    "padding_mask",
    "visible_queries",
    "window_covers",
    "window_covers_all",
]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def window_covers(window: int, num_queries: int, num_keys: int, is_causal: bool) -> bool:
    """Whether the window ``|p − j| < window`` (causal: ``0 ≤ p − j < window``), with query i at
    ``p = i + S − L``, leaves out no key a full (causal) attention would see: then it *is* full
    attention. Causal, the farthest key is S − 1 positions back; otherwise max(L, S) − 1 away."""
    return (num_keys if is_causal else max(num_queries, num_keys)) <= window


def window_covers_all(config: Any, shape: Any, causal: bool, state: Any, tensors: Any) -> bool:
    """``Mechanism.exact_full`` of a windowed mechanism (``config.window``): its window leaves out no
    key (``window_covers``). A named function, so a model holding the record pickles."""
    return window_covers(config.window, shape.queries, shape.keys, causal)


def causal_mask(num_queries: int, num_keys: int) -> MaskMod:
    """Key ``j`` is visible to query ``i`` iff ``j <= i + S - L`` (bottom-right alignment)."""
    offset = num_keys - num_queries

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx + offset

    return mask_mod


def padding_mask(key_padding_mask: Tensor) -> MaskMod:
    """Key ``j`` of batch ``b`` is visible iff ``key_padding_mask[b, j]`` (True = real token)."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return key_padding_mask[b, kv_idx]

    return mask_mod


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """A key is visible iff every mask_mod allows it."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = torch.ones((), dtype=torch.bool, device=q_idx.device)
        for mod in mask_mods:
            out = out & mod(b, h, q_idx, kv_idx)
        return out

    return mask_mod


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """A key is visible iff any mask_mod allows it."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = torch.zeros((), dtype=torch.bool, device=q_idx.device)
        for mod in mask_mods:
            out = out | mod(b, h, q_idx, kv_idx)
        return out

    return mask_mod


def not_mask(mask_mod: MaskMod) -> MaskMod:
    """A key is visible iff ``mask_mod`` hides it."""

    def mask_mod_not(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return ~mask_mod(b, h, q_idx, kv_idx)

    return mask_mod_not


def dense_mask(mask_mod: MaskMod, B: int, H: int, L: int, S: int, device: torch.device | str | None = None) -> Tensor:
    """Materialise ``mask_mod`` as a bool tensor ``(B, H, L, S)``. O(B·H·L·S): for tests and oracles."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    q_idx = torch.arange(L, device=device).view(1, 1, L, 1)
    kv_idx = torch.arange(S, device=device).view(1, 1, 1, S)
    return mask_mod(b, h, q_idx, kv_idx).expand(B, H, L, S)


def contract_mask(
    L: int, S: int, key_padding_mask: Tensor | None, is_causal: bool, device: torch.device | str | None = None
) -> Tensor | None:
    """The contract's masks (padding and causal) as one bool mask broadcastable to ``(B, H, L, S)``.

    Returns ``None`` when nothing is masked, ``(B, 1, 1, S)`` for padding alone, else ``(B|1, 1, L, S)``.
    """
    if key_padding_mask is not None and not is_causal:
        return key_padding_mask[:, None, None, :]
    if not is_causal:
        return None
    mask = dense_mask(causal_mask(L, S), 1, 1, L, S, device)
    if key_padding_mask is not None:
        mask = mask & key_padding_mask[:, None, None, :]
    return mask


def visible_queries(
    L: int, S: int, key_padding_mask: Tensor | None, is_causal: bool, device: torch.device | str | None = None
) -> Tensor | None:
    """Whether each query sees at least one key under the contract's masks: bool ``(B|1, L)``.

    Returns ``None`` when every query sees a key. Costs O(B·(L + S)), with no ``(L, S)`` tensor.
    """
    if key_padding_mask is not None:
        device = key_padding_mask.device
    if not is_causal:
        if key_padding_mask is None:
            return None
        return key_padding_mask.any(dim=-1, keepdim=True).expand(-1, L)  # (B, L)
    if key_padding_mask is None:
        if L <= S:
            return None
        first_key = torch.zeros(1, 1, dtype=torch.long, device=device)
    else:
        # Index of each batch's first real key, S when it has none.
        real = key_padding_mask.long()
        first_key = torch.where(real.any(-1), real.argmax(-1), S).unsqueeze(-1)  # (B, 1)
    position = torch.arange(L, device=device) + (S - L)  # (L,) query positions on the key axis
    return position.unsqueeze(0) >= first_key  # (B|1, L)

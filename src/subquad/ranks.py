"""Inputs of any rank SDPA takes, as the mechanisms' ``(B, H, L, D)``.

``torch.nn.functional.scaled_dot_product_attention`` takes ``(N, ..., H, L, E)``: any number of
batch dimensions before the heads, or none (``(H, L, E)``: dim −3 is the heads, as its
``enable_gqa`` reads it; ``(L, E)``: one head). ``subquad.attention`` takes the same: the batch
dimensions are flattened into one, a missing head or batch dimension is added, and the output gets
the query's shape back (``Dv`` last). A dense ``attn_mask`` broadcastable to ``(N, ..., H, L, S)``
is brought to the 4-D form the same way; ``key_padding_mask`` (subquad's own) is
``(N, ..., S)``: the query's batch dimensions, then the keys.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

__all__ = ["as_4d"]


def as_4d(
    query: Any, key: Any, value: Any, attn_mask: Any, dense: bool, key_padding_mask: Any, extra: dict[str, Any]
):  # fmt: skip
    """``(query, key, value, attn_mask, key_padding_mask, shape)`` in 4-D where ``query`` is a
    tensor of another rank ≥ 2 (``shape``: the output's, to reshape to), else the inputs as given
    with ``shape`` None. ``dense``: ``attn_mask`` is a dense mask (a ``CausalBias`` names lengths
    only and passes as it is). Raises where the ranks or batch dimensions disagree."""
    if not all(isinstance(x, Tensor) for x in (query, key, value)) or all(x.dim() == 4 for x in (query, key, value)):
        return query, key, value, attn_mask, key_padding_mask, None
    if query.dim() < 2:
        raise ValueError(f"query must have at least 2 dimensions (L, E), as SDPA's; got shape {tuple(query.shape)}")
    rank, batch = query.dim(), tuple(query.shape[:-3])
    for name, x in (("key", key), ("value", value)):
        if x.dim() != rank or tuple(x.shape[:-3]) != batch:
            raise ValueError(
                f"query is {tuple(query.shape)} and {name} {tuple(x.shape)}: give them the same rank and the same "
                "batch dimensions (those before the heads, L or S and the head size)"
            )
    tensors = sorted(name for name, x in extra.items() if isinstance(x, Tensor))
    if tensors or (extra and rank > 4):  # a mask_mod's b would index the flattened batch
        raise ValueError(
            f"{tensors or sorted(extra)} {'are given per (B, H, L) position' if tensors else 'index (B, H, L, S)'}: "
            f"pass query, key and value as 4-D (B, H, L, D) with them, not {rank}-D"
        )
    flat = [_flat(x) for x in (query, key, value)]
    if dense:
        attn_mask = _flat_mask(attn_mask, batch, rank)
    if key_padding_mask is not None:
        key_padding_mask = _flat_padding(key_padding_mask, batch, key.shape[-2])
    return (*flat, attn_mask, key_padding_mask, (*query.shape[:-1], value.shape[-1]))


def _flat(x: Tensor) -> Tensor:
    """``(N, ..., H, L, E)`` as ``(N·…, H, L, E)``, ``(H, L, E)`` as ``(1, H, L, E)``, ``(L, E)`` as
    ``(1, 1, L, E)``."""
    if x.dim() == 2:
        return x.view(1, 1, *x.shape)
    return x.reshape(math.prod(x.shape[:-3]), *x.shape[-3:])


def _flat_mask(mask: Tensor, batch: tuple[int, ...], rank: int) -> Tensor:
    """A dense mask broadcastable to ``(*batch, H, L, S)`` in the 4-D form, its heads, L and S kept
    (a broadcast size stays 1)."""
    if mask.dim() > rank:
        raise ValueError(f"attn_mask is {tuple(mask.shape)}, more dimensions than the query's {rank}")
    mask = mask.view(*(1,) * (max(rank, 3) - mask.dim()), *mask.shape)  # at least (H, L, S)
    if rank <= 3:
        return mask.unsqueeze(0)
    mask = mask.expand(*batch, *mask.shape[-3:])  # raises as torch does where a size cannot broadcast
    return mask.reshape(math.prod(batch), *mask.shape[-3:])


def _flat_padding(mask: Any, batch: tuple[int, ...], keys: int) -> Any:
    """``key_padding_mask`` ``(*batch, S)`` as ``(N·…, S)``."""
    if not isinstance(mask, Tensor) or tuple(mask.shape) != (*batch, keys):
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(
            f"key_padding_mask must be bool {(*batch, keys)} for these inputs (the query's batch dimensions, then "
            f"the {keys} keys), got {got}"
        )
    return mask.reshape(math.prod(batch), keys)

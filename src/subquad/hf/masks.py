"""transformers' masks as subquad reads them: a key padding mask, or a clear refusal.

The registered mask function reduces transformers' mask to ``(B, 1, 1, S)`` bool (True = real), or
None; causality comes from the module (``is_causal``). A mask that is not causal-or-bidirectional
attention plus padding raises, naming what was found.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, prepare_padding_mask


def _mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = causal_mask_function,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    **kwargs: Any,
) -> Tensor | None:
    """transformers' mask for subquad: the key padding mask as ``(B, 1, 1, S)`` bool, or None."""
    if local_size is not None or mask_function not in (causal_mask_function, bidirectional_mask_function):
        what = getattr(mask_function, "__name__", "?") if local_size is None else f"a sliding window of {local_size}"
        raise ValueError(
            f"this model asks for a mask subquad cannot express ({what}); subquad takes causal or bidirectional "
            "attention with padding: swap in a mechanism only for models (and inputs) without sliding windows, "
            "packed sequences or image overlays"
        )
    if int(q_offset) + q_length < kv_length:  # key slots past the last query: a cache of fixed size
        raise ValueError(
            f"this cache gives {kv_length} key slots for {int(q_offset) + q_length} tokens (a static cache?); "
            "subquad's mechanisms read the keys by position and need the cache to hold the sequence as it is: "
            "generate without cache_implementation (subquad's cache is the default after subquad.hf.use)"
        )
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is None or bool(padding.all()):
        return None
    return padding[:, None, None, :]


def _key_padding(mask: Any, queries: int, keys: int, causal: bool) -> Tensor | None:
    """The key padding mask ``(B, S)`` a 4-D mask stands for; raises where it stands for more."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dim() != 4 or mask.shape[-1] != keys:
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"subquad.hf needs a (B, 1, L, {keys}) attention mask, got {shape}")
    if mask.dtype == torch.bool:
        allowed = mask
    else:  # additive: 0 where allowed, -inf (or the dtype's minimum) where not
        allowed = mask == 0
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((allowed | blocked).all()):
            raise ValueError("subquad.hf cannot take an additive attention bias (values other than 0 and -inf)")
    keep = allowed[:, 0, -1, :]  # the last query: under causality too, it may see every real key
    expected = keep[:, None, None, :]
    if causal and allowed.shape[-2] > 1:
        offset = keys - queries
        rows = torch.arange(queries, device=mask.device)[:, None] + offset
        expected = expected & (torch.arange(keys, device=mask.device) <= rows)
    if not bool((allowed == expected).all()):
        raise ValueError(
            "this attention mask is not a padding mask over "
            f"{'causal' if causal else 'bidirectional'} attention; subquad cannot express it"
        )
    return None if bool(keep.all()) else keep

"""Which Hugging Face models ``subquad.hf`` can drive: their attention modules, and the refusal of
those it cannot (attention computed by the model's own code, cross-attention)."""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["attention_modules", "check_model", "layer_index"]


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that call transformers' attention interface (those with an
    ``is_causal`` and a ``layer_idx``, or whose code calls the interface: ViT, CLIP, DistilBERT), in
    order. Where some carry a ``layer_idx``, those (as a vision-language model's decoder layers);
    where none does, all, each numbered by its order (``subquad_layer``; ``layer_index`` reads
    either)."""
    found = [
        m for m in model.modules() if hasattr(m, "is_causal") and (hasattr(m, "layer_idx") or _interface_driven(m))
    ]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no attention modules that transformers' attention interface drives "
            "(modules with is_causal whose code calls it); subquad.hf supports models whose attention modules call it"
        )
    numbered = [m for m in found if hasattr(m, "layer_idx")]
    if numbered:  # the numbered ones are the layers (a vision-language model's decoder; its vision tower stays)
        return numbered
    for i, module in enumerate(found):
        module.subquad_layer = i
    return found


def layer_index(module: nn.Module) -> int:
    """The layer index of an attention module (``attention_modules``): its ``layer_idx``, or its
    order among the model's where the model numbers none."""
    index = getattr(module, "layer_idx", None)
    return int(module.subquad_layer if index is None else index)


def check_model(model: nn.Module) -> None:
    """Refuse a model whose attention ``use`` cannot reach or whose layers it cannot all run."""
    name = type(model).__name__
    own = sorted({type(m).__name__ for m in attention_modules(model) if not _interface_driven(m)})
    if own:
        raise ValueError(
            f"{name}'s attention ({', '.join(own)}) is computed by its own code, not through transformers' attention "
            "interface: a mechanism set on it would never run; subquad.hf supports models whose attention "
            "modules call that interface (Llama, Qwen, Mistral, GPT-2, BERT and most others)"
        )
    if any(name.rsplit(".", 1)[-1] in _CROSS for name, _ in model.named_modules()):
        raise ValueError(
            f"{name} has cross-attention (its queries read another sequence's keys), which subquad's mechanisms, "
            "reading keys by position, have no form for; subquad.hf swaps attention in encoders and decoders "
            "without cross-attention"
        )


_CROSS = {"encoder_attn", "crossattention", "EncDecAttention", "cross_attn", "cross_attention"}  # transformers' names


def _interface_driven(module: nn.Module) -> bool:
    """Whether ``module``'s code reaches transformers' attention interface: the modeling file of the
    class that defines its forward (a user's subclass inherits it) imports the interface
    (``ALL_ATTENTION_FUNCTIONS``), as every model that calls it does."""
    owner = next((c for c in type(module).__mro__ if "forward" in vars(c)), type(module))
    return getattr(sys.modules.get(owner.__module__), "ALL_ATTENTION_FUNCTIONS", None) is not None

"""Where subquad's generation cache comes in without being asked for: ``install`` (called by
``use``, ``convert`` and ``from_pretrained``) lets ``model.generate``, and a decoder's forward call
without gradients, build a ``SubquadCache`` (``subquad.hf.cache``) where transformers would build
a ``DynamicCache``; ``uninstall`` (``restore``) undoes it."""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from subquad.hf.cache import SubquadCache, ragged

__all__ = ["install", "replaces", "uninstall"]


def install(model: nn.Module) -> None:
    """Let ``model.generate``, and a forward call without gradients, build a ``SubquadCache`` where
    transformers would build a ``DynamicCache`` (a cache the caller passes is used as it is)."""
    from subquad.hf.support import attention_modules

    if "_prepare_cache_for_generation" not in model.__dict__:
        model._prepare_cache_for_generation = types.MethodType(_prepare_cache, model)
    names = list(inspect.signature(type(model).forward).parameters)[1:]
    causal = all(module.is_causal for module in attention_modules(model))  # a decoder: encoders keep no cache
    if _HOOK not in model.__dict__ and "cache" in names and causal:
        at = {name: _index(names, name) for name in ("attention_mask", "cache", "use_cache")}
        model.__dict__[_HOOK] = model.register_forward_pre_hook(
            functools.partial(_forward_cache, at=at), with_kwargs=True
        )


def uninstall(model: nn.Module) -> None:
    """Undo ``install``."""
    model.__dict__.pop("_prepare_cache_for_generation", None)
    hook = model.__dict__.pop(_HOOK, None)
    if hook is not None:
        hook.remove()


_HOOK = "_subquad_forward_cache"
_CACHE_NAMES = ("cache", "past_key_values", "cache_params")  # transformers' name and its deprecated ones


def _index(names: list[str], name: str) -> int:
    return names.index(name) if name in names else len(names)


def _forward_cache(model: nn.Module, args: tuple, kwargs: dict, at: dict[str, int]) -> tuple | None:
    """A forward call that would build transformers' ``DynamicCache`` (``use_cache``, given or the
    config's, and no cache) without gradients gets a ``SubquadCache``: a decoding loop that calls
    the model token by token then steps each layer's decoder rather than rerunning its mechanism
    over the whole prefix. transformers' cache stays with gradients (training), where a row has
    padding after its first real token (a later step could not take it), and where ``replaces``
    says so. ``at``: the positions of the forward's arguments."""
    given = [name for name in _CACHE_NAMES if name in kwargs]
    if given:
        cache = kwargs[given[0]]
    else:
        cache = args[at["cache"]] if len(args) > at["cache"] else None
    use = args[at["use_cache"]] if len(args) > at["use_cache"] else kwargs.get("use_cache")
    if use is None:
        use = getattr(model.config, "use_cache", False)
    if torch.is_grad_enabled() or cache is not None or not use:
        return None
    mask = args[at["attention_mask"]] if len(args) > at["attention_mask"] else kwargs.get("attention_mask")
    if mask is not None and (mask.dim() != 2 or bool(ragged(mask.bool()).any())):
        return None
    made = replaces(model, automatic=True)
    if made is None:
        return None
    if len(args) > at["cache"]:
        args = (*args[: at["cache"]], made, *args[at["cache"] + 1 :])
    else:
        kwargs[given[0] if given else "cache"] = made
    return args, kwargs


def replaces(model: nn.Module, automatic: bool) -> SubquadCache | None:
    """A ``SubquadCache`` for ``model`` where it may stand in for ``DynamicCache(config)``: subquad's
    attention is the model's (``use``, not switched away since) and that cache's layers are
    transformers' plain ones (not a hybrid's linear-attention layers, which subquad does not keep);
    else None."""
    from subquad.hf.interface import NAME

    if getattr(model.config, "_attn_implementation", None) != NAME:
        return None
    if any(type(layer) is not DynamicLayer for layer in DynamicCache(config=model.config).layers):
        return None
    try:
        return SubquadCache(model, automatic=automatic)
    except ValueError:  # layers SubquadCache cannot number: transformers' own cache, as before
        return None


def _prepare_cache(model: nn.Module, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any) -> Any:
    _check_positions(model, generation_config)
    result = type(model)._prepare_cache_for_generation(model, generation_config, model_kwargs, *args, **kwargs)
    made = model_kwargs.get("cache")
    if type(made) is DynamicCache and not getattr(made, "_is_user_defined", False) and not made.offloading:
        model_kwargs["cache"] = replaces(model, automatic=False) or made
    return result


def _check_positions(model: nn.Module, generation_config: Any) -> None:
    """A model with learned absolute positions (an embedding named for them) cannot go past them."""
    tables = [
        m for name, m in model.named_modules()
        if isinstance(m, nn.Embedding) and ("position" in name or name.endswith("wpe"))
    ]  # fmt: skip
    longest = getattr(generation_config, "max_length", None)
    if tables and longest is not None and longest > tables[0].num_embeddings:
        raise ValueError(
            f"this generation would reach {longest} tokens (prompt and max_new_tokens), but the model has learned "
            f"positions for {tables[0].num_embeddings}: shorten the prompt or max_new_tokens"
        )

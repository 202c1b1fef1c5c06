"""A model's own queries, keys and values, as its attention receives them, to time mechanisms on.

A mechanism that chooses what to read (retrieval's far blocks, routing's and clustering's groups)
costs what the inputs make it cost: on a model's queries and keys after its position encoding it
reads other keys, in other proportions, than on drawn ones. ``record(model, ids)`` runs the model
once on ``ids`` and keeps, at a few layers spread over its depth, the queries ``(B, H, N, D)`` and
the keys and values ``(B, Hk, N, D)`` (grouped-query heads as the model holds them) that its
attention function receives; the queries carry the model's softmax scale, so that the default
``1/√D`` gives the model's scores. ``save`` writes them for ``subquad bench --inputs``.
``observe(model, ids, layers, take)`` runs the same pass and keeps, at each layer, what ``take``
(a non-empty list) makes of those inputs and the mask, where a whole tensor per layer would be too
much (``subquad.hf.heads`` keeps one attention row).

The pass runs in eval mode (no dropout), without a generation cache, with exact attention through
torch's sdpa (transformers' ``"sdpa"``), whatever the model was set to, and puts the model's own
setting and mode back after it, also when it raises. The kept tensors go to the CPU as each layer
runs, so a model on a GPU does not hold them there. ``"subquad-record"`` stays registered in
transformers' attention and mask interfaces after a pass, as ``subquad.hf.register``'s names do;
run by a model it is torch's sdpa.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from subquad.hf.support import attention_modules, layer_index

__all__ = ["Recorded", "observe", "record", "spread_layers"]

NAME = "subquad-record"  # the attention implementation of the recording pass
Take = Callable[[Tensor, Tensor, Tensor, "Tensor | None"], list[Any]]  # what a pass keeps of a layer's inputs
_WANTED: dict[nn.Module, list[Any]] | None = None  # while recording: what is kept of each chosen module's inputs
_TAKE: Take | None = None  # and how


@dataclass
class Recorded:
    """The queries, keys and values of ``layers``: ``q`` ``(S, B, H, N, D)``, ``k`` ``(S, B, Hk, N, D)``
    and ``v`` ``(S, B, Hk, N, Dv)``, one set per layer, on the CPU."""

    layers: tuple[int, ...]
    q: Tensor
    k: Tensor
    v: Tensor

    def heads(self, runs: Sequence[tuple[int, int]]) -> Recorded:
        """The query heads of ``runs`` (``(first, count)`` each: heads ``first … first + count − 1``),
        in that order, and the key/value heads they read."""
        group = self.q.shape[2] // self.k.shape[2]
        for first, count in runs:
            if first % group or count % group:
                raise ValueError(f"heads {first}..{first + count - 1} split a key/value head of {group} query heads")
        pick = lambda x, per: torch.cat([x[:, :, a // per : (a + n) // per] for a, n in runs], dim=2)  # noqa: E731
        return Recorded(self.layers, pick(self.q, 1), pick(self.k, group), pick(self.v, group))

    def save(self, path: str | os.PathLike) -> None:
        """Write them as ``subquad bench --inputs`` reads them."""
        from subquad.bench.inputs import save_inputs

        save_inputs(path, self.q, self.k, self.v)


def spread_layers(model: nn.Module, count: int) -> list[int]:
    """``count`` layer indices spread evenly over the model's attention layers, first and last included."""
    indices = sorted({layer_index(m) for m in attention_modules(model)})
    if count < 1:
        raise ValueError(f"count must be >= 1 layer, got {count}")
    if count == 1:
        return [indices[len(indices) // 2]]
    return sorted({indices[round(i * (len(indices) - 1) / (count - 1))] for i in range(count)})


@torch.no_grad()
def record(model: nn.Module, ids: Tensor, layers: Sequence[int] | None = None) -> Recorded:
    """Run ``model`` on ``ids`` ``(B, N)`` and keep the queries, keys and values of ``layers``
    (their ``layer_idx``; default: three spread over the depth, ``spread_layers``)."""
    layers = list(spread_layers(model, 3) if layers is None else layers)
    kept = observe(model, ids, layers, _copies)
    q, k, v = (torch.stack([kept[i][n] for i in layers]) for n in range(3))
    return Recorded(tuple(layers), q, k, v)


@torch.no_grad()
def observe(model: nn.Module, ids: Tensor, layers: Sequence[int], take: Take) -> dict[int, list[Any]]:
    """Run ``model`` once on ``ids`` ``(B, N)`` (as ``record`` does) and return, for each of ``layers``,
    what ``take(q, k, v, attention_mask)`` made of the inputs of its attention's first call: the
    queries carry the model's scale, ``attention_mask`` is the one transformers built for sdpa
    (None, or boolean or additive ``(B, 1, L, S)``)."""
    modules = {layer_index(m): m for m in attention_modules(model)}
    unknown = sorted(set(layers) - set(modules))
    if not layers:
        raise ValueError(f"record at least one layer of {type(model).__name__}; its layers are {sorted(modules)}")
    if unknown:
        raise ValueError(f"{type(model).__name__} has no layer {unknown}; its layers are {sorted(modules)}")
    with _recording([modules[i] for i in layers], model, take) as kept:
        body = getattr(model, "base_model", model)  # no language-model head: its logits are not needed
        body(input_ids=ids, use_cache=False)
    missing = [i for i in layers if not kept[modules[i]]]
    if missing:
        raise ValueError(f"layers {missing} of {type(model).__name__} did not run their attention on these inputs")
    return {i: kept[modules[i]] for i in layers}


def _copies(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None) -> list[Tensor]:
    """``record``'s take: the inputs themselves, copied to the CPU."""
    return [x.detach().to("cpu", copy=True).contiguous() for x in (query, key, value)]


@contextlib.contextmanager
def _recording(modules: list[nn.Module], model: nn.Module, take: Take) -> Iterator[dict[nn.Module, list[Any]]]:
    """While open, ``model`` runs ``NAME``, which keeps what ``take`` makes of the chosen modules' q, k, v."""
    global _WANTED, _TAKE
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, _record_forward)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    previous, training = model.config._attn_implementation, model.training
    _WANTED, _TAKE = {m: [] for m in modules}, take
    try:
        model.set_attn_implementation(NAME)
        model.eval()
        yield _WANTED
    finally:
        _WANTED = _TAKE = None
        model.set_attn_implementation(previous)
        model.train(training)


def _record_forward(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
) -> tuple[Tensor, Any]:
    """transformers' sdpa attention, keeping the chosen modules' inputs on the way."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _WANTED is not None and module in _WANTED and not _WANTED[module]:
        scaling = kwargs.get("scaling")
        factor = 1.0 if scaling is None else scaling * query.shape[-1] ** 0.5  # then 1/√D gives the model's scores
        scaled = query if factor == 1.0 else query * factor
        _WANTED[module].extend(_TAKE(scaled, key, value, attention_mask))
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

"""subquad's generation cache in transformers' Cache API: each layer keeps what its mechanism needs.

``SubquadCache(model)`` has one layer per attention module of a model that ``use``, ``convert``
or ``from_pretrained`` set up:

- a layer whose mechanism's decoder takes over a prefill (``Decoder.absorbs``: local, linear,
  agglomerative, retrieval) is a ``DecoderLayer``. The prefill runs the parallel pass once and hands
  the prompt to the decoder (``Decoder.absorb``). ``local``, ``linear`` and ``agglomerative`` keep
  only what their next tokens can reach (the sinks and window, the running sums and window, the
  class sums), so each new token costs the same whatever the prompt's length; ``retrieval`` keeps
  every key with its whole blocks' bounds (a far block may be any), and a step reads its window,
  sinks and chosen blocks plus one bound per block;
- every other layer (exact attention, and mechanisms without such a decoder: sparse, multires,
  routing in a pretrained model) is transformers' ``DynamicLayer``, and the mechanism runs over
  the whole prefix as before;
- a head mix with such a decoder in one of its groups is a ``MixLayer``: a ``DecoderLayer`` per
  such group and a ``DynamicLayer`` of its own key/value heads per other group.

The sequence length reported to transformers (``get_seq_length``, ``get_mask_sizes``) is the
whole sequence's, so positions and masks are the model's own. After ``use``, ``convert`` or
``from_pretrained``, ``model.generate`` builds this cache by itself (``subquad.hf.automatic.install``), and so does a
decoder's forward call without gradients where transformers would build a ``DynamicCache`` (a
decoding loop that feeds ``out.cache`` back), except where that cache could not stand in for
transformers' (a right-padded batch, attention switched away from subquad's, a hybrid model's
linear-attention layers). With gradients a forward call takes one as ``cache=SubquadCache(model)``.
A copy (``copy.deepcopy``: a prompt's cache kept for reuse) shares the model's specs and states.

How it connects: transformers' attention modules hand the cache the same keyword dict that they
then pass to the attention function. A ``DecoderLayer`` returns only the new keys and values and
puts itself in that dict, and ``subquad.hf.interface`` runs the decoder. A model whose modules do
not pass that dict is refused by ``generate``, naming the fix; a forward call's automatic cache
keeps every key for such a layer instead, as transformers' cache would.

Supported: greedy and sampling, left-padded batches (each row decodes as if alone; its sinks are
its first real tokens), continuing from a returned cache, beam search (rows are reordered) and
``num_return_sequences``. Refused, with the reason: cropping (assisted generation, whose
rollback a running sum cannot undo), padding after a row's first real token, a cache built for
another model or before ``use`` changed a layer.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from subquad.decoding import Decoder

__all__ = ["KEY", "DecoderLayer", "MixLayer", "SubquadCache", "decodes_from_state", "ragged"]

KEY = "subquad_cache_layer"  # the name under which a DecoderLayer reaches the attention function


def decodes_from_state(spec: Any) -> bool:
    """Whether a layer's ``LayerAttention`` decodes from its decoder's state (``Decoder.absorbs``);
    a head mix (``subquad.hf.mixes.LayerMix``) does where one of its groups does."""
    if getattr(spec, "groups", None) is not None:
        return any(decodes_from_state(group) for group in spec.groups)
    mechanism = getattr(spec, "mechanism", None)
    decoder = None if mechanism is None else mechanism.decoder
    return decoder is not None and decoder.absorbs


class DecoderLayer(CacheLayerMixin):
    """One layer's decoder: built at the prefill from its prompt, stepped at each new token."""

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, spec: Any, layer_idx: int) -> None:
        super().__init__()
        self.spec, self.layer_idx = spec, layer_idx
        self.decoder: Decoder | None = None
        self.seen = 0  # tokens of the whole sequence, as transformers counts them
        self.ragged = False  # a row had padding after its first real token

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, kwargs: dict | None = None, **_: Any):
        """The new tokens' keys and values, returned as they are; the layer joins ``kwargs``."""
        if kwargs is None:
            raise ValueError(
                f"this model's attention (layer {self.layer_idx}) does not hand its keyword arguments to the "
                "cache, so subquad's decoders cannot be reached; generate with transformers' DynamicCache "
                "(cache=DynamicCache(config=model.config)): exact, at the cost of the whole prefix per token"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        kwargs[KEY] = self
        self.seen += key_states.shape[-2]
        return key_states, value_states

    def attend(
        self, spec: Any, state: nn.Module | None, query: Tensor, key: Tensor, value: Tensor, real: Tensor | None,
        scale: float | None, tensors: dict[str, Tensor], parallel: Any,
    ) -> Tensor:  # fmt: skip
        """The layer's attention ``(B, H, L, Dv)``: at the prefill, the parallel pass (``parallel()``),
        whose prompt the decoder then absorbs; afterwards, the decoder's step over the new tokens.
        A refused call leaves the layer as it was (``update`` counted its tokens: uncounted here)."""
        try:
            if spec is not self.spec:
                raise ValueError(
                    f"this cache was built for another model, or before layer {self.layer_idx}'s attention changed "
                    f"(it holds {self.spec.mechanism.name if self.spec else 'exact attention'}'s state); start a new "
                    "one: subquad.hf.SubquadCache(model), or generate without passing a cache"
                )
            if not spec.mechanism.decoder.grouped:  # a grouped decoder keeps the key/value heads unrepeated
                key, value = _heads(key, query.shape[1]), _heads(value, query.shape[1])
            if self.decoder is None:
                out = parallel()
                decoder = spec.mechanism.decoder(spec.mechanism, spec.config, state)
                decoder.scale = scale
                decoder.absorb(query, key, value, real, **tensors)
                self.decoder, self.ragged = decoder, real is not None and bool(ragged(real).any())
                return out
            new = query.shape[2]
            _refuse_padding(real, new, self.ragged)
            return self.decoder.step(query, key, value, **tensors)
        except Exception:
            self.seen -= query.shape[2]
            raise

    def __deepcopy__(self, memo: dict) -> DecoderLayer:
        """A copy of the layer's state (a prompt's cache kept to be reused) that still belongs to
        the same model: the layer's spec, its mechanism and learned state are shared, not copied
        (``attend`` checks the spec by identity)."""
        decoder = self.decoder
        for shared in (self.spec, getattr(decoder, "mechanism", None), getattr(decoder, "state", None)):
            if shared is not None:
                memo[id(shared)] = shared
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update({name: copy.deepcopy(value, memo) for name, value in self.__dict__.items()})
        return copied

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.decoder, self.seen, self.ragged, self.is_initialized = None, 0, False, False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.decoder is not None:
            self.decoder.select_rows(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.decoder is not None:
            self.decoder.select_rows(torch.as_tensor(indices, device=self.device).reshape(-1))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.decoder is not None and self.decoder.shape is not None:
            rows = torch.arange(self.decoder.shape[0], device=self.device)
            self.decoder.select_rows(rows.repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            f"layer {self.layer_idx}'s {self.spec.mechanism.name} state cannot be cropped: a decoder's running state "
            "cannot forget tokens (assisted generation and prompt lookup need that); generate without them, or pass "
            "cache=DynamicCache(config=model.config), which keeps every key"
        )

    def offload(self) -> None:
        raise ValueError("subquad's decoder layers are small and cannot be offloaded; use cache_implementation=None")

    @property
    def nbytes(self) -> int:
        """The bytes the layer holds."""
        return 0 if self.decoder is None else self.decoder.nbytes


class MixLayer(DecoderLayer):
    """A head mix's layer: one part per group, a ``DecoderLayer`` where the group's decoder takes
    over a prefill and a ``DynamicLayer`` of its key/value heads otherwise (``subquad.hf.mixes``)."""

    def __init__(self, spec: Any, layer_idx: int) -> None:
        super().__init__(spec, layer_idx)
        self.parts = [DecoderLayer(g, layer_idx) if decodes_from_state(g) else DynamicLayer() for g in spec.groups]

    def order(self) -> list[int]:
        """The groups in the order a step runs them: those that keep keys first, whose refusals
        leave nothing changed (``undo``), then the decoders, which refuse before they step."""
        return sorted(range(len(self.parts)), key=lambda i: isinstance(self.parts[i], DecoderLayer))

    def share(self, spec: Any, index: int, key: Tensor, value: Tensor, kwargs: dict) -> tuple[Tensor, Tensor, dict]:
        """Group ``index``'s keys, values and keyword arguments for this call (its heads' own)."""
        if spec is not self.spec:
            raise ValueError(
                f"this cache was built for another model, or before layer {self.layer_idx}'s attention changed "
                f"(it holds the head mix {self.spec.text!r}); start a new one: subquad.hf.SubquadCache(model), "
                "or generate without passing a cache"
            )
        part, kwargs = self.parts[index], dict(kwargs)
        if isinstance(part, DecoderLayer):
            part.update(key, value, kwargs=kwargs)
            return key, value, kwargs
        return *part.update(key, value), kwargs

    def undo(self, new: int) -> None:
        """Forget a refused call's ``new`` tokens (the decoders refused before stepping)."""
        self.seen -= new
        for part in self.parts:
            extra = 0 if isinstance(part, DecoderLayer) else part.get_seq_length() - self.seen
            if extra > 0:
                part.crop(-extra)

    def reset(self) -> None:
        super().reset()
        for part in self.parts:
            part.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for part in self.parts:
            part.reorder_cache(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        for part in self.parts:
            part.batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for part in self.parts:
            part.batch_repeat_interleave(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            f"layer {self.layer_idx}'s head mix {self.spec.text!r} cannot be cropped: a decoder's running state "
            "cannot forget tokens (assisted generation and prompt lookup need that); generate without them, or pass "
            "cache=DynamicCache(config=model.config), which keeps every key"
        )

    @property
    def nbytes(self) -> int:
        return sum(_layer_bytes(part) for part in self.parts)


def _layer_bytes(layer: Any) -> int:
    """The bytes one cache layer holds: a decoder's state, or its keys and values."""
    if isinstance(layer, DecoderLayer):
        return layer.nbytes
    return layer.keys.nbytes + layer.values.nbytes if layer.is_initialized and layer.keys is not None else 0


class SubquadCache(Cache):
    """The generation cache of a model whose layers run subquad mechanisms (module docstring).
    ``automatic``: made for a forward call in place of transformers' ``DynamicCache``
    (``subquad.hf.automatic``), so a layer whose attention does not hand its keyword arguments to
    the cache keeps every key as that cache would, rather than being refused."""

    def __init__(self, model: nn.Module, automatic: bool = False) -> None:
        from subquad.hf.support import attention_modules, layer_index

        modules = sorted(attention_modules(model), key=layer_index)
        if [layer_index(m) for m in modules] != list(range(len(modules))):
            raise ValueError(
                f"{type(model).__name__}'s attention modules are layers {[layer_index(m) for m in modules]}; "
                "SubquadCache needs one self-attention module per layer, numbered from 0"
            )
        layers = []
        for module in modules:
            spec = getattr(module, "subquad_attention", None)
            kind = MixLayer if getattr(spec, "groups", None) is not None else DecoderLayer
            layers.append(kind(spec, layer_index(module)) if decodes_from_state(spec) else DynamicLayer())
        super().__init__(layers=layers)
        self.automatic = automatic

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        layer = self.layers[layer_idx]
        if self.automatic and kwargs.get("kwargs") is None and isinstance(layer, DecoderLayer) and not layer.seen:
            self.layers[layer_idx] = DynamicLayer()  # exact, as the cache this one stands in for
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def nbytes(self) -> int:
        """The bytes all layers hold: the decoders' state and the other layers' keys and values."""
        return sum(_layer_bytes(layer) for layer in self.layers)


def cache_bytes(cache: Any) -> int:
    """The bytes a generation cache holds: ``SubquadCache.nbytes``, or the keys and values of
    transformers' caches."""
    if isinstance(cache, SubquadCache):
        return cache.nbytes
    layers = getattr(cache, "layers", [])
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in layers if getattr(layer, "keys", None) is not None)


def _heads(x: Tensor, heads: int) -> Tensor:
    """Grouped-query keys or values ``(B, Hkv, N, ·)`` repeated to the queries' ``heads``."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _refuse_padding(real: Tensor | None, new: int, ragged: bool) -> None:
    """Refuse ``new`` tokens with padding a decoder cannot take (``real``: the sequence's key padding
    mask; ``ragged``: the prefill had padding after a row's first real token)."""
    if not ragged and (real is None or bool(real[:, -new:].all())):
        return
    if not ragged and bool((~real[:, -new:] & (real.cumsum(1) == 0)[:, -new:]).any()):
        raise ValueError(
            f"a row's left padding runs past the first chunk of this prefill (chunks of {new} tokens: "
            "generate's prefill_chunk_size?); subquad's decoders take a row's padding in the chunk that "
            "starts the cache: use a prefill_chunk_size at least the longest padding, or none"
        )
    raise ValueError(
        "subquad's decoders take padding only before each row's first real token (left padding: "
        "tokenizer.padding_side = 'left'); this batch has padding after it. Pad on the left, or "
        "generate such rows one by one"
    )


def ragged(real: Tensor) -> Tensor:
    """Rows ``(B,)`` of a padding mask ``(B, S)`` with padding after their first real token."""
    return (real.long().diff(dim=1) < 0).any(dim=1)

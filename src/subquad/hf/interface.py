"""The attention interface: every mechanism as an attention implementation of transformers >= 5.

``register()`` adds, to transformers' ``AttentionInterface`` and to its mask interface:

- ``"subquad:<mechanism>"`` for every registered mechanism, at its default options, so that
  ``AutoModel.from_pretrained(path, attn_implementation="subquad:local")`` and
  ``model.set_attn_implementation("subquad:local")`` work;
- ``"subquad"``, which runs in each attention module what ``use`` set there (layers it did not
  set run exact attention), so layers may differ.

``use(model, "improved-clustered", clusters=25, layers=range(3))`` registers, sets the mechanism
and options of the chosen layers (all by default; ``layers`` are the modules' ``layer_idx``) and
switches the model to ``"subquad"``. ``restore(model)`` undoes it.

What the model hands over is translated exactly or refused:

- **Masks.** The registered mask function reduces transformers' mask to a key padding mask,
  ``(B, 1, 1, S)`` bool (True = real), or None; causality comes from the module (``is_causal``).
  Without a registered mask function transformers would pass no mask at all and padding would be
  silently ignored. A mask that is not causal-or-bidirectional plus padding (a sliding window,
  packed sequences, image overlays, any other 4-D mask) raises, naming what was found.
- **Generation caches.** With subquad's cache (``subquad.hf.cache``, what ``model.generate``
  builds after ``use``), a layer whose mechanism's decoder takes over a prefill runs the parallel
  pass once, hands the prompt to the decoder, and steps it for each new token. With transformers'
  cache (every key kept), new queries are aligned to the last keys (``causal_lower_right``): exact,
  at O(prefix) per token.
- **Padding and sinks.** Rows with padding before real tokens run with their real tokens first
  when the mechanism has sinks, so a row's sinks are its first real tokens.
- **Grouped-query models** (Llama, SmolLM2, Qwen) pass K/V with fewer heads; they go to the core
  with ``enable_gqa`` (read in place where the mechanism can, repeated otherwise).
- **Scale and dropout.** The model's ``scaling`` is the softmax scale; mechanisms without a softmax
  (linear, agglomerative, kernel multires) accept only the default 1/√D, which they drop. Attention
  dropout in training goes to mechanisms that have it; for the others it raises (``model.eval()``,
  or set the model's attention dropout to 0).
- **State.** Mechanisms with persistent state (routing's centroids) get one per layer, seeded by
  the layer index, kept on the module as ``subquad_state`` (follows ``.to()``, saved with it).
- Mechanisms needing learned inputs the model lacks (agglomerative's class logits, multires'
  router) are refused by ``use`` with that reason; ``convert`` adds them.
- **Head mixes** (``"local:window=256,sinks=4*6+routing*3"``) split each layer's query heads
  between mechanisms, along the key/value groups (``subquad.hf.mixes``); a ``.toml`` plan names
  one spec per layer (``subquad.hf.plans``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from subquad.call import attention, causal_lower_right
from subquad.config import one_mechanism, parse_spec
from subquad.hf.automatic import install, uninstall
from subquad.hf.cache import KEY
from subquad.hf.masks import _key_padding, _mask
from subquad.hf.mixes import LayerMix, build_mix, check_heads, mixed_forward, shares
from subquad.hf.plans import LayerPlan, is_plan, read_plan, use_plan
from subquad.hf.support import attention_modules, check_model, layer_index
from subquad.registry import Config, Mechanism, get_mechanism, make_config, mechanism_names

NAME = "subquad"


@dataclass
class LayerAttention:
    """What one attention module of a Hugging Face model computes: a mechanism and its config."""

    mechanism: Mechanism
    config: Config

    @classmethod
    def build(cls, mechanism: str, *, converted: bool = False, **options: Any) -> LayerAttention:
        mech = get_mechanism(mechanism)
        if mech.inputs is not None and not converted:
            raise ValueError(
                f"{mech.name} needs inputs from learned projections a pretrained model does not have "
                f"({', '.join(a for a in mech.tensor_args if a != 'query_padding_mask')}); it cannot be swapped in "
                "without converting and training them: subquad.hf.convert, then subquad distill"
            )
        return cls(mech, make_config(mech, **options))

    @property
    def options(self) -> dict[str, Any]:
        """The config's options that differ from the mechanism's defaults."""
        default, names = self.mechanism.config(), [f.name for f in dataclasses.fields(self.config)]
        return {n: getattr(self.config, n) for n in names if getattr(self.config, n) != getattr(default, n)}


_FULL = None  # LayerAttention of exact attention, built on first use
_CAPTURE: dict[nn.Module, list[Tensor]] | None = None  # capturing(): each layer's query and key directions
_UNUSED = None  # calibrate(): each routing layer's query and key directions


def register() -> None:
    """Add ``"subquad"`` and ``"subquad:<mechanism>"`` for every registered mechanism to
    transformers' attention and mask interfaces (again after new mechanisms are registered)."""
    AttentionInterface.register(NAME, _forward)
    AttentionMaskInterface.register(NAME, _mask)
    for name in mechanism_names():
        AttentionInterface.register(f"{NAME}:{name}", _named_forward(name))
        AttentionMaskInterface.register(f"{NAME}:{name}", _mask)


def layer_spec(spec: str, **options: Any) -> tuple[str, dict[str, Any]]:
    """A spec string (``subquad.config.parse_spec``) as the one mechanism and options a pretrained
    model's layer runs; ``options`` join the spec's own."""
    mix = ", and this takes one mechanism (e.g. local:window=128); a mix is applied with subquad.hf.use or convert"
    return one_mechanism(spec, options, mix)


def use(model: nn.Module, mechanism: str | LayerPlan, *, layers: Iterable[int] | None = None, **options) -> nn.Module:
    """Compute the attention of ``layers`` (their ``layer_idx``; all by default) with ``mechanism``
    (a name or a spec such as ``"local:window=128"``) and ``options``, and switch ``model`` to
    ``"subquad"``; returns ``model``. Calls for different layers combine; layers never set run
    exact attention. A head mix (``"local:window=256,sinks=4*6+full*3"``) splits each layer's
    heads (``subquad.hf.mixes``); a ``.toml`` path or a ``LayerPlan`` names one spec per layer."""
    if is_plan(mechanism) or isinstance(mechanism, LayerPlan):  # subquad.hf.plans
        return use_plan(
            model, mechanism if isinstance(mechanism, LayerPlan) else read_plan(mechanism), layers, **options
        )
    _apply(model, model_attention(model, mechanism, **options), layers)
    return model


def is_mix(spec: str) -> bool:
    """Whether ``spec`` splits a layer's heads between mechanisms (``subquad.hf.mixes``)."""
    groups = parse_spec(spec)
    return len(groups) > 1 or groups[0].heads is not None


def check_spec(spec: str, *, converted: bool = False) -> None:
    """Fail on a bad spec before a model loads: every mechanism and its options (a head mix's
    counts are checked against the model's heads when it is applied); a plan file's every spec."""
    if is_plan(spec):
        read_plan(spec, converted=converted)
        return
    for group in parse_spec(spec) if is_mix(spec) else [parse_spec(spec)[0]]:
        LayerAttention.build(group.name, converted=converted, **dict(group.options))


def model_attention(
    model: nn.Module, spec: str, *, converted: bool = False, **options: Any
) -> LayerAttention | LayerMix:
    """What ``use`` sets on ``model``'s layers for ``spec``: one mechanism (``options`` join the
    spec's), or a head mix split by the model's query and key/value head counts."""
    if not is_mix(spec):
        name, options = layer_spec(spec, **options)
        return LayerAttention.build(name, converted=converted, **options)
    if options:
        raise ValueError(f"options {sorted(options)} apply to a single mechanism; put them in the mix {spec!r}")
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return build_mix(
        parse_spec(spec), spec, heads, kv_heads, functools.partial(LayerAttention.build, converted=converted)
    )


def _apply(model: nn.Module, spec: LayerAttention | LayerMix, layers: Iterable[int] | None) -> list[nn.Module]:
    """``use``'s work: set ``spec`` on the chosen layers; returns their attention modules."""
    register()
    check_model(model)
    modules = attention_modules(model)
    indices = sorted({layer_index(m) for m in modules})
    chosen = set(indices) if layers is None else set(layers)
    unknown = sorted(chosen - set(indices))
    if unknown:
        raise ValueError(f"{type(model).__name__} has no layer {unknown}; its layers are {indices[0]}..{indices[-1]}")
    for module in modules:
        if layer_index(module) in chosen and isinstance(spec, LayerMix):
            check_heads(model, module, spec)
    for module in modules:
        if layer_index(module) in chosen:
            module.subquad_attention = spec
            _clear(module, "subquad_state", "subquad_inputs", "subquad_shares")  # a new mechanism: a new state
            if isinstance(spec, LayerMix):
                module.subquad_shares = shares(spec, layer_index(module)).train(module.training)
    if not hasattr(model, "subquad_previous"):
        model.subquad_previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    install(model)  # model.generate builds subquad's cache
    return [m for m in modules if layer_index(m) in chosen]


def _clear(module: nn.Module, *names: str) -> None:
    for name in names:
        if hasattr(module, name):
            delattr(module, name)


def restore(model: nn.Module, implementation: str | None = None) -> nn.Module:
    """Remove what ``use`` (or ``convert``) set and switch ``model`` back to ``implementation`` (by
    default the one it had before the first ``use``); the weights ``convert`` froze train again."""
    named = dict(model.named_parameters())
    for name in model.__dict__.pop("subquad_frozen", ()):
        if name in named:
            named[name].requires_grad_(True)
    for module in attention_modules(model):
        _clear(module, "subquad_attention", "subquad_state", "subquad_inputs", "subquad_shares", "subquad_layer")
    uninstall(model)
    current = model.config._attn_implementation or "sdpa"
    previous = model.__dict__.pop("subquad_previous", None) or ("sdpa" if current.startswith(NAME) else current)
    model.set_attn_implementation(implementation or previous)
    return model


def _named_forward(name: str):
    def forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, **kwargs: Any):
        spec = getattr(module, "subquad_attention", None)
        if not isinstance(spec, LayerAttention) or spec.mechanism.name != name:
            module.subquad_attention = LayerAttention.build(name)
            _clear(module, "subquad_state", "subquad_inputs", "subquad_shares")
        return _forward(module, query, key, value, attention_mask, **kwargs)

    forward.__name__ = f"subquad_{name.replace('-', '_')}_forward"
    return forward


def _scale(spec: LayerAttention, scaling: float | None, head_dim: int) -> float | None:
    if spec.mechanism.takes_scale(spec.config):
        return scaling
    if scaling is not None and abs(scaling - head_dim**-0.5) > 1e-6 * head_dim**-0.5:
        raise ValueError(
            f"{spec.mechanism.name} has no softmax to scale, but this model scales its attention by {scaling:g} "
            f"(not 1/sqrt({head_dim})); its attention cannot be swapped for {spec.mechanism.name} as it is"
        )
    return None


def _state(module: nn.Module, spec: LayerAttention, query: Tensor) -> nn.Module | None:
    """The mechanism's state of this layer, made on first use, seeded by the layer index."""
    if spec.mechanism.state is None:
        return None
    if getattr(module, "subquad_state", None) is None:
        _new_state(module, spec, query.shape[1], query.shape[-1], query.device, query.dtype)
    return module.subquad_state


def _new_state(module: nn.Module, spec: LayerAttention, heads: int, head_dim: int, device, dtype) -> None:
    index = getattr(module, "layer_idx", None)  # a head share's seed, else the layer's index
    seed = int(getattr(module, "subquad_seed", getattr(module, "subquad_layer", 0) if index is None else index))
    state = spec.mechanism.state(spec.config, heads, head_dim, seed).to(device)
    if any(p.is_floating_point() for p in state.parameters()):  # learned maps follow the model's dtype
        state = state.to(dtype)
    module.subquad_state = state.train(module.training)  # EMA updates only in training


def _forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention call: ``(B, H, L, D)`` in, ``(B, L, H, D)`` and no weights out."""
    global _FULL
    for name in ("position_bias", "softcap", "sliding_window", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"subquad.hf cannot take this model's {name}={kwargs[name]!r}")
    if kwargs.get("output_attentions"):
        warnings.warn("subquad's mechanisms return no attention weights (output_attentions=True gives none); "
                      "subquad.hf.restore(model, 'eager') computes them", stacklevel=2)  # fmt: skip
    spec = getattr(module, "subquad_attention", None)
    if spec is None:
        spec = _FULL = _FULL or LayerAttention.build("full")
    causal = bool(getattr(module, "is_causal", False) if is_causal is None else is_causal)
    if isinstance(spec, LayerMix):
        merge = _CAPTURE is None  # a capture records each group's own heads
        return mixed_forward(
            module, _forward, query, key, value, attention_mask, dropout, scaling, causal, merge, **kwargs
        )
    if dropout and not spec.mechanism.dropout:
        raise ValueError(
            f"{spec.mechanism.name} has no attention dropout, but this model applies {dropout} in training: call "
            "model.eval(), or set the model's attention dropout to 0 (e.g. attention_probs_dropout_prob, "
            "attention_dropout or attn_pdrop in its config) before training"
        )
    layer = kwargs.get(KEY)  # subquad's cache layer: the keys are the new tokens', the mask the sequence's
    queries, keys = query.shape[2], key.shape[2] if layer is None else layer.seen
    key_padding_mask = _key_padding(attention_mask, queries, keys, causal)
    tensors = _tensors(module, spec, query, key, key_padding_mask)
    if _CAPTURE is not None and module in _CAPTURE:
        _capture(module, query, key, key_padding_mask)
    scale, state = _scale(spec, scaling, query.shape[-1]), _state(module, spec, query)

    def parallel() -> Tensor:
        return _parallel(spec, state, query, key, value, key_padding_mask, dropout, causal, scale, tensors)

    if layer is not None:
        out = layer.attend(spec, state, query, key, value, key_padding_mask, scale, dict(tensors), parallel)
    else:
        out = parallel()
    gain = getattr(getattr(module, "subquad_inputs", None), "gain", None)
    if gain is not None:
        out = out * gain.to(out.dtype)[:, None, None]
    return out.transpose(1, 2), None


def _tensors(module: nn.Module, spec: LayerAttention, query: Tensor, key: Tensor, key_padding_mask: Tensor | None):
    """The mechanism's extra tensors for this call: the query padding mask, the converted inputs."""
    tensors = {}
    queries, keys = query.shape[2], key.shape[2]
    if "query_padding_mask" in spec.mechanism.tensor_args and key_padding_mask is not None:
        # self-attention (with or without a cache): the queries are the last keys
        real = key_padding_mask[:, -queries:] if queries <= keys else None
        tensors["query_padding_mask"] = real if real is not None else torch.ones_like(query[:, 0, :, 0], dtype=bool)
    if spec.mechanism.inputs is not None:
        inputs = getattr(module, "subquad_inputs", None)
        if inputs is None:
            raise ValueError(
                f"{spec.mechanism.name} needs the learned projections subquad.hf.convert adds; this layer has none"
            )
        tensors.update(inputs(query, key))
    return tensors


def _parallel(
    spec: LayerAttention, state: nn.Module | None, query: Tensor, key: Tensor, value: Tensor,
    key_padding_mask: Tensor | None, dropout: float, causal: bool, scale: float | None, tensors: dict[str, Tensor],
) -> Tensor:  # fmt: skip
    """The mechanism's parallel pass, ``(B, H, L, Dv)``. Under causality the queries continue the
    keys (a cache's prefix first): the end-aligned form. Rows with padding before real tokens run
    with their real tokens first when the mechanism has sinks, so a row's sinks are its first
    real tokens (and its output that of the row alone); under causality the padding before them sees
    no key (zeros), as where nothing is reordered."""
    queries, keys = query.shape[2], key.shape[2]
    sinks = getattr(spec.config, spec.mechanism.sinks) if spec.mechanism.sinks else 0
    order = None
    if sinks and key_padding_mask is not None and not bool(key_padding_mask[:, : min(sinks, keys)].all()):
        if queries != keys:
            raise ValueError(
                f"{spec.mechanism.name}'s sinks are each row's first real tokens, but this call continues a cache "
                "of all keys with padding before them; generate with subquad's cache (the default after use()), "
                "pad on the right, or run such sequences one by one"
            )
        unseen = key_padding_mask.cumsum(1) == 0  # padding before a row's first real token: it sees no key
        order = torch.argsort((~key_padding_mask).to(torch.int8), dim=1, stable=True)  # real tokens first
        query, key, value = (_rows(x, order, 2) for x in (query, key, value))
        key_padding_mask = key_padding_mask.gather(1, order)
        positions = spec.mechanism.positions
        tensors = {n: _rows(t, order, t.dim() - 1) if n in positions or n == "query_padding_mask" else t
                   for n, t in tensors.items()}  # fmt: skip
    aligned = causal_lower_right(queries, keys) if causal and queries != keys else None
    out = attention(
        query, key, value, aligned, dropout, causal and aligned is None, scale,
        enable_gqa=key.shape[1] != query.shape[1], mechanism=spec.mechanism.name, key_padding_mask=key_padding_mask,
        config=spec.config, state=state, **tensors,
    )  # fmt: skip
    if order is None:
        return out
    out = torch.empty_like(out).scatter_(2, order[:, None, :, None].expand_as(out), out)
    if not causal:  # bidirectional: padding queries see the row's real keys, as in the model
        return out
    return out.masked_fill(unseen[:, None, :, None], 0.0)  # as without sinks (moved last, it would see the row)


def _rows(x: Tensor, order: Tensor, dim: int) -> Tensor:
    """``x`` with each batch row's positions on ``dim`` taken in ``order`` ``(B, N)``."""
    index = order.view(order.shape[0], *([1] * (dim - 1)), order.shape[1], *([1] * (x.dim() - dim - 1)))
    return x.gather(dim, index.expand(*x.shape[:dim], order.shape[1], *x.shape[dim + 1 :]))


@contextlib.contextmanager
def capturing(modules: Iterable[nn.Module]) -> Iterator[dict[nn.Module, list[Tensor]]]:
    """While open, each forward of ``modules`` keeps the directions ``(H, n, D)`` of its real
    queries and keys, in the dict it yields (``calibrate`` fits centroids to them)."""
    global _CAPTURE
    _CAPTURE = {m: [] for m in modules}
    try:
        yield _CAPTURE
    finally:
        _CAPTURE = None


def _capture(module: nn.Module, query: Tensor, key: Tensor, key_padding_mask: Tensor | None) -> None:
    """Keep the directions ``(H, n, D)`` of one call's real queries and keys for ``calibrate``."""
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    for x in (query, key):
        x = nn.functional.normalize(x.detach().float(), dim=-1).transpose(0, 1)  # (H, B, N, D)
        if key_padding_mask is not None:
            x = x[:, key_padding_mask[:, -x.shape[2] :]]  # (H, n, D): the real tokens
        _CAPTURE[module].append(x.reshape(x.shape[0], -1, x.shape[-1]))

"""subquad inside pretrained Hugging Face models (transformers >= 5): every mechanism as an attention
implementation.

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
- **Generation caches.** New queries are aligned to the last keys (the core's causal contract),
  so a token decoded with transformers' cache meets the cached keys as in the parallel pass. That
  cache holds every key and value, so each new token runs the mechanism over the whole prefix:
  exact, but O(prefix) per token; the mechanisms' recurrent decoders are not used here.
- **Grouped-query models** (Llama, SmolLM2, Qwen) pass K/V with fewer heads; they go to the core
  with ``enable_gqa`` (read in place where the mechanism can, repeated otherwise).
- **Scale and dropout.** The model's ``scaling`` is the softmax scale; mechanisms without a softmax
  (linear, agglomerative, kernel multires) accept only the default 1/√D, which they drop. Attention
  dropout in training goes to mechanisms that have it; for the others it raises (``model.eval()``,
  or set the model's attention dropout to 0).
- **State.** Mechanisms with persistent state (routing's centroids) get one per layer, seeded by
  the layer index, kept on the attention module as ``subquad_state`` (it follows ``.to()`` and is
  saved with the model).
- Mechanisms whose inputs come from learned projections the model lacks (agglomerative's class
  logits, multires' router) are refused by ``use`` with that reason; ``convert`` adds them.

**Conversion.** ``convert(model, "linear", feature_map="hedgehog")`` is ``use`` plus what the
mechanism needs and the model lacks, initialised, on every chosen attention module, with every
original weight frozen (``requires_grad=False``):

- agglomerative: the class projections (the mechanism's ``AgglomerativeInputs``) and, per head, an
  output gain that starts at H: the classes' weights c^q sum to 1 across the heads, so without it
  each head would start at about 1/H of its scale (the gain is a diagonal factor of the output
  matrix, which the paper learns);
- multires: the router (``MultiresInputs``);
- routing: the centroids, by spherical k-means on ``calibration`` batches (``calibrate``);
- linear with ``feature_map="hedgehog"``: the learned feature maps (``LinearState``).

The projections read the layer's own projected queries and keys, ``(B, N, H·D)`` (keys repeated
to H heads under grouped-query attention), where the papers' layers read the hidden states: the
same linear maps whenever the query and key projections are invertible, and what the attention
interface is handed, so a generation cache needs nothing more. They are kept on the attention
module as ``subquad_inputs`` and the state as ``subquad_state``; ``converted_parameters(model)``
lists what to train (``subquad distill`` does). ``save(model, folder)`` writes the model (loadable
by transformers as the original architecture), ``subquad.json`` (each layer's mechanism and
options, the SHA-256 of the model's config and weights and of ``subquad.safetensors``, and a
checksum of its own) and ``subquad.safetensors`` (what conversion added); ``from_pretrained(folder)``
checks every recorded file and loads it back with subquad attention. A changed or damaged file is
refused by name (``subquad.files.FileError``), and only data is read: safetensors and JSON, never
a pickle or the folder's own code (``model_source``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from subquad.call import attention, causal_lower_right
from subquad.config import parse_spec
from subquad.files import FileError, check_fields, check_gguf, json_checksum, load_safetensors, read_json, sha256
from subquad.mechanisms.routing import RoutingState
from subquad.registry import Config, Mechanism, get_mechanism, make_config, mechanism_names

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        AttentionMaskInterface,
        bidirectional_mask_function,
        causal_mask_function,
        prepare_padding_mask,
    )
except ImportError as error:  # pragma: no cover - the hf extra installs it
    raise ImportError("subquad.hf needs transformers >= 5: pip install 'subquad[hf]'") from error

__all__ = [
    "NAME",
    "ConvertedInputs",
    "LayerAttention",
    "attention_modules",
    "calibratable",
    "calibrate",
    "convert",
    "converted_parameters",
    "from_pretrained",
    "layer_spec",
    "loading",
    "model_source",
    "register",
    "restore",
    "save",
    "saved_layers",
    "use",
]

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
        default = self.mechanism.config()
        return {
            f.name: getattr(self.config, f.name)
            for f in dataclasses.fields(self.config)
            if getattr(self.config, f.name) != getattr(default, f.name)
        }


_FULL = None  # LayerAttention of exact attention, built on first use
_CAPTURE: dict[nn.Module, list[Tensor]] | None = None  # calibrate(): each routing layer's query and key directions


def register() -> None:
    """Add ``"subquad"`` and ``"subquad:<mechanism>"`` for every registered mechanism to
    transformers' attention and mask interfaces (again after new mechanisms are registered)."""
    AttentionInterface.register(NAME, _forward)
    AttentionMaskInterface.register(NAME, _mask)
    for name in mechanism_names():
        AttentionInterface.register(f"{NAME}:{name}", _named_forward(name))
        AttentionMaskInterface.register(f"{NAME}:{name}", _mask)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that call transformers' attention interface (those with a
    ``layer_idx`` and an ``is_causal``), in order."""
    found = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no attention modules that transformers' attention interface drives "
            "(modules with layer_idx and is_causal); subquad.hf supports models with _supports_attention_backend"
        )
    return found


def layer_spec(spec: str, **options: Any) -> tuple[str, dict[str, Any]]:
    """A spec string (``subquad.config.parse_spec``) as the one mechanism and options a pretrained
    model's layer runs; ``options`` join the spec's own."""
    groups = parse_spec(spec)
    if len(groups) > 1 or groups[0].heads is not None:
        raise ValueError(
            f"{spec!r} is a head mix; inside a pretrained model each layer runs one mechanism on all its heads "
            "for now: give one (e.g. local:window=128), and choose it per layer with layers="
        )
    both = sorted(set(dict(groups[0].options)) & set(options))
    if both:
        raise ValueError(f"option(s) {both} given both in the spec {spec!r} and as arguments; pass each once")
    return groups[0].name, {**dict(groups[0].options), **options}


def use(model: nn.Module, mechanism: str, *, layers: Iterable[int] | None = None, **options: Any) -> nn.Module:
    """Compute the attention of ``layers`` (their ``layer_idx``; all by default) with ``mechanism``
    (a name or a spec such as ``"local:window=128"``) and ``options``, and switch ``model`` to
    ``"subquad"``; returns ``model``. Calls for different layers combine; layers never set run
    exact attention."""
    name, options = layer_spec(mechanism, **options)
    _apply(model, LayerAttention.build(name, **options), layers)
    return model


def _apply(model: nn.Module, spec: LayerAttention, layers: Iterable[int] | None) -> list[nn.Module]:
    """``use``'s work: set ``spec`` on the chosen layers; returns their attention modules."""
    register()
    modules = attention_modules(model)
    indices = sorted({m.layer_idx for m in modules})
    chosen = set(indices) if layers is None else set(layers)
    unknown = sorted(chosen - set(indices))
    if unknown:
        raise ValueError(f"{type(model).__name__} has no layer {unknown}; its layers are {indices[0]}..{indices[-1]}")
    for module in modules:
        if module.layer_idx in chosen:
            module.subquad_attention = spec
            _clear(module, "subquad_state", "subquad_inputs")  # a new mechanism starts from a new state
    if not hasattr(model, "subquad_previous"):
        model.subquad_previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    return [m for m in modules if m.layer_idx in chosen]


def _clear(module: nn.Module, *names: str) -> None:
    for name in names:
        if hasattr(module, name):
            delattr(module, name)


def restore(model: nn.Module, implementation: str | None = None) -> nn.Module:
    """Remove what ``use`` set and switch ``model`` back to ``implementation`` (by default the one
    it had before the first ``use``)."""
    for module in attention_modules(model):
        _clear(module, "subquad_attention", "subquad_state", "subquad_inputs")
    previous = model.__dict__.pop("subquad_previous", None) or "sdpa"
    model.set_attn_implementation(implementation or previous)
    return model


def _named_forward(name: str):
    def forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, **kwargs: Any):
        spec = getattr(module, "subquad_attention", None)
        if spec is None or spec.mechanism.name != name:
            module.subquad_attention = LayerAttention.build(name)
            _clear(module, "subquad_state", "subquad_inputs")
        return _forward(module, query, key, value, attention_mask, **kwargs)

    forward.__name__ = f"subquad_{name.replace('-', '_')}_forward"
    return forward


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
    seed = int(getattr(module, "layer_idx", 0) or 0)
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
    spec = getattr(module, "subquad_attention", None)
    if spec is None:
        spec = _FULL = _FULL or LayerAttention.build("full")
    if dropout and not spec.mechanism.dropout:
        raise ValueError(
            f"{spec.mechanism.name} has no attention dropout, but this model applies {dropout} in training: call "
            "model.eval(), or set the model's attention dropout to 0 (e.g. attention_probs_dropout_prob, "
            "attention_dropout or attn_pdrop in its config) before training"
        )
    causal = bool(getattr(module, "is_causal", False) if is_causal is None else is_causal)
    queries, keys = query.shape[2], key.shape[2]
    key_padding_mask = _key_padding(attention_mask, queries, keys, causal)
    sinks = getattr(spec.config, "sinks", 0) or getattr(spec.config, "global_tokens", 0)  # pattern's globals too
    if sinks and key_padding_mask is not None and not bool(key_padding_mask[:, : min(sinks, keys)].all()):
        raise ValueError(
            f"{spec.mechanism.name}'s sinks are the first {sinks} positions, but padding falls there (left "
            "padding?): pad on the right (tokenizer.padding_side = 'right'), or run such sequences one by one"
        )
    tensors = {}
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
    if _CAPTURE is not None and module in _CAPTURE:
        _capture(module, query, key, key_padding_mask)
    # transformers' queries continue the keys (a cache's prefix first): the end-aligned causal form
    aligned = causal_lower_right(queries, keys) if causal and queries != keys else None
    out = attention(
        query, key, value, aligned, dropout, causal and aligned is None, _scale(spec, scaling, query.shape[-1]),
        enable_gqa=key.shape[1] != query.shape[1], mechanism=spec.mechanism.name, key_padding_mask=key_padding_mask,
        config=spec.config, state=_state(module, spec, query), **tensors,
    )  # fmt: skip
    gain = getattr(getattr(module, "subquad_inputs", None), "gain", None)
    if gain is not None:
        out = out * gain.to(out.dtype)[:, None, None]
    return out.transpose(1, 2), None


def _capture(module: nn.Module, query: Tensor, key: Tensor, key_padding_mask: Tensor | None) -> None:
    """Keep the directions ``(H, n, D)`` of one call's real queries and keys for ``calibrate``."""
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    for x in (query, key):
        x = nn.functional.normalize(x.detach().float(), dim=-1).transpose(0, 1)  # (H, B, N, D)
        if key_padding_mask is not None:
            x = x[:, key_padding_mask[:, -x.shape[2] :]]  # (H, n, D): the real tokens
        _CAPTURE[module].append(x.reshape(x.shape[0], -1, x.shape[-1]))


def calibratable(spec: LayerAttention | str | None) -> bool:
    """Whether ``calibrate`` fits this mechanism (its state holds routing centroids)."""
    if spec is None:
        return False
    mech = get_mechanism(spec) if isinstance(spec, str) else spec.mechanism
    return mech.state is not None and issubclass(mech.state, RoutingState)


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable[dict[str, Tensor]], iterations: int = 20, seed: int = 0) -> int:
    """Fit the centroids of every routing layer by spherical k-means on the directions of the
    model's own queries and keys over ``batches`` (keyword arguments of the model's forward);
    returns the number of layers fitted. Routing's centroids start random otherwise, and a
    pretrained model's queries and keys do not lie where random directions cut them."""
    global _CAPTURE
    routed = [m for m in attention_modules(model) if calibratable(getattr(m, "subquad_attention", None))]
    if not routed:
        raise ValueError("no layer of this model has a mechanism with centroids; subquad.hf.use(model, 'routing')")
    _CAPTURE = {m: [] for m in routed}
    try:
        for batch in batches:
            model(**batch)
    finally:
        captured, _CAPTURE = _CAPTURE, None
    for module in routed:
        if not captured[module]:
            raise ValueError("calibrate saw no batch; pass at least one")
        centroids = module.subquad_state.centroids
        points = torch.cat(captured[module], dim=1)
        centroids.copy_(spherical_kmeans(points, centroids.shape[1], iterations, seed + module.layer_idx))
    return len(routed)


def spherical_kmeans(points: Tensor, clusters: int, iterations: int, seed: int) -> Tensor:
    """Unit centroids ``(H, C, D)`` of unit ``points`` ``(H, n, D)``: Lloyd's iterations with the dot
    product, from C distinct seeded points; a cluster left empty keeps its centroid."""
    H, n, D = points.shape
    if n < clusters:
        raise ValueError(f"calibration saw {n} tokens per head, fewer than clusters={clusters}; pass more batches")
    generator = torch.Generator().manual_seed(seed)
    start = torch.stack([torch.randperm(n, generator=generator)[:clusters] for _ in range(H)]).to(points.device)
    centroids = torch.gather(points, 1, start[..., None].expand(-1, -1, D))
    for _ in range(iterations):
        assign = torch.bmm(points, centroids.transpose(1, 2)).argmax(-1)  # (H, n)
        sums = torch.zeros_like(centroids).scatter_add_(1, assign[..., None].expand(-1, -1, D), points)
        filled = sums.norm(dim=-1, keepdim=True) > 0
        centroids = torch.where(filled, nn.functional.normalize(sums, dim=-1), centroids)
    return centroids


# ---------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------

SPEC_FILE, TENSOR_FILE = "subquad.json", "subquad.safetensors"


class ConvertedInputs(nn.Module):
    """The learned extra inputs of one converted attention module: the mechanism's own ``inputs``
    module (agglomerative's class projections, multires' router), reading the layer's projected
    queries and keys ``(B, N, H·D)``, and for agglomerative a per-head output ``gain`` (see the
    module docstring).

    Args:
        spec: the layer's mechanism and config.
        heads: H, the query heads; keys with fewer heads (grouped-query) are repeated to H.
        head_dim: D.
    """

    def __init__(self, spec: LayerAttention, heads: int, head_dim: int) -> None:
        super().__init__()
        self.inputs = spec.mechanism.inputs(spec.config, heads * head_dim, heads)
        self.gain = nn.Parameter(torch.full((heads,), float(heads))) if spec.mechanism.name == "agglomerative" else None

    def forward(self, query: Tensor, key: Tensor) -> dict[str, Tensor]:
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        weight = next(self.inputs.parameters(), None)
        dtype = query.dtype if weight is None else weight.dtype
        flat = lambda x: x.transpose(1, 2).flatten(2).to(dtype)  # noqa: E731 - (B, N, H·D)
        return {name: x.to(query.dtype) for name, x in self.inputs(flat(query), flat(key)).items()}


def _heads(model: nn.Module) -> tuple[int, int]:
    config = model.config
    heads = config.num_attention_heads
    return heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def convert(
    model: nn.Module,
    mechanism: str,
    *,
    layers: Iterable[int] | None = None,
    calibration: Iterable[dict[str, Tensor]] | None = None,
    freeze: bool = True,
    seed: int = 0,
    **options: Any,
) -> nn.Module:
    """Swap ``mechanism`` into ``layers`` (all by default) as ``use`` does, and add what it needs
    and the model lacks, initialised (see the module docstring); returns ``model``.

    Args:
        model: a transformers model whose attention runs through the attention interface.
        mechanism, options: the mechanism and its options (``linear`` with
            ``feature_map="hedgehog"`` for learned feature maps).
        layers: the attention modules' ``layer_idx`` to convert.
        calibration: batches (keyword arguments of ``model``'s forward) whose queries and keys fit
            routing's centroids; required for routing.
        freeze: set ``requires_grad=False`` on every weight the model had; only what conversion
            adds is trained (``converted_parameters``).
        seed: seeds the new projections' initial weights (layer i from ``seed`` and i, without
            touching the global random state) and routing's k-means.
    """
    spec = LayerAttention.build(mechanism, converted=True, **options)
    if calibratable(spec) and calibration is None:
        raise ValueError(
            f"{spec.mechanism.name}'s centroids are fitted by k-means on the model's own queries and keys: pass "
            "calibration=[{'input_ids': ...}, ...] (a few batches of real text)"
        )
    if freeze:
        for parameter in model.parameters():
            parameter.requires_grad_(False)
    _add(model, spec, layers, seed)
    if calibration is not None and calibratable(spec):
        calibrate(model, calibration, seed=seed)
    return model


def _add(model: nn.Module, spec: LayerAttention, layers: Iterable[int] | None, seed: int = 0) -> list[nn.Module]:
    modules = _apply(model, spec, layers)
    heads, head_dim = _heads(model)
    reference = next(model.parameters())
    for module in modules:
        if spec.mechanism.state is not None:
            _new_state(module, spec, heads, head_dim, reference.device, reference.dtype)
        if spec.mechanism.inputs is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed * 1_000_003 + int(module.layer_idx))
                inputs = ConvertedInputs(spec, heads, head_dim)
            module.subquad_inputs = inputs.to(reference.device, reference.dtype)
    return modules


def _converted(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, getattr(module, n)) for n in ("subquad_state", "subquad_inputs") if hasattr(module, n)]


def converted_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What ``convert`` added that gradients train: feature maps, class projections, routers, gains."""
    return [p for m in attention_modules(model) for _, part in _converted(m) for p in part.parameters()]


def save(model: nn.Module, folder: str | Path, tokenizer: Any = None) -> Path:
    """Write a converted (or ``use``d) model to ``folder``: the model's own files (which
    transformers loads as the original architecture), ``subquad.json`` and ``subquad.safetensors``;
    and the tokenizer's, if given. ``from_pretrained(folder)`` loads it with subquad attention."""
    from safetensors.torch import save_file

    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file; save needs a folder (it is created if missing)")
    layers, tensors = {}, {}
    for module in attention_modules(model):
        spec = getattr(module, "subquad_attention", None)
        if spec is None:
            continue
        index = int(module.layer_idx)
        layers[str(index)] = {"mechanism": spec.mechanism.name, "options": _jsonable(spec.options)}
        for name, part in _converted(module):
            for key, value in part.state_dict().items():
                tensors[f"{index}.{name}.{key}"] = value.detach().cpu().contiguous().clone()
    if not layers:
        raise ValueError("this model has no subquad attention to save; subquad.hf.convert (or use) it first")
    own = {k: v for k, v in model.state_dict().items() if ".subquad_" not in k}
    with _dequantized(model):
        model.save_pretrained(folder, state_dict=own)
    save_file(tensors, str(folder / TENSOR_FILE))
    record = {"format": 1, "layers": layers, "sha256": {p.name: sha256(p) for p in _recorded(folder)}}
    record["checksum"] = json_checksum(record)
    (folder / SPEC_FILE).write_text(json.dumps(record, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def _dequantized(model: nn.Module):
    """A model loaded from a GGUF file with its weights de-quantised (every weight a float tensor)
    saves as the plain model it is: transformers refuses any model that still carries the GGUF
    quantizer, which is dropped for the save and put back after."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = str(getattr(getattr(quantizer, "quantization_config", None), "quant_method", ""))
    if quantizer is None or "gguf" not in method.lower():
        yield
        return
    if not all(p.is_floating_point() for p in model.parameters()):
        raise ValueError("this model keeps GGUF-quantised weights; load it de-quantised (float weights) to save it")
    config = model.config
    quantization = config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    try:
        yield
    finally:
        model.hf_quantizer = quantizer
        if quantization is not None:
            config.quantization_config = quantization


def _recorded(folder: Path) -> list[Path]:
    """The files of a saved folder that its ``subquad.json`` records the SHA-256 of: the model's
    config and weights (one file or shards and their index) and what conversion added."""
    names = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json", TENSOR_FILE)
    return sorted({p for name in names for p in folder.glob(name) if p.is_file()})


def _jsonable(options: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}


def from_pretrained(folder: str | Path, *, model_class: Any = None, **kwargs: Any) -> nn.Module:
    """Load what ``save`` wrote: the model (``model_class``, by default the architecture its config
    names), then each layer's mechanism and what conversion added; in eval mode. Only data is read
    (safetensors and JSON; never a pickle, never the folder's own code), and a broken file raises
    FileError naming it."""
    import transformers

    folder = Path(folder)
    fixed = sorted({"local_files_only", "trust_remote_code", "use_safetensors", "gguf_file"} & set(kwargs))
    if fixed:
        raise ValueError(f"from_pretrained sets {fixed} itself: it loads local safetensors and no model code only")
    source = {**model_source(folder), **kwargs}  # first: a pickle-only folder is refused as such
    layers = _read_spec(folder)
    with loading(folder):
        if model_class is None:
            config = transformers.AutoConfig.from_pretrained(**source)
            names = config.architectures or []
            model_class = getattr(transformers, names[0], None) if names else None
            if model_class is None:
                raise FileError(folder / "config.json", f"names no architecture transformers has ({names})",
                                "pass model_class")  # fmt: skip
        model = model_class.from_pretrained(**source)
    spec_file = folder / SPEC_FILE
    for index, (mechanism, options) in layers.items():
        try:
            _add(model, LayerAttention.build(mechanism, converted=True, **options), [index])
        except ValueError as error:
            raise FileError(spec_file, f"layer {index}: {error}", _RESAVE) from error
    tensors = load_safetensors(folder / TENSOR_FILE, fix=_RESAVE)
    by_index = {int(m.layer_idx): m for m in attention_modules(model)}
    expected = set()
    for index, module in by_index.items():
        for name, part in _converted(module):
            state = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"{index}.{name}.")}
            expected.update(f"{index}.{name}.{k}" for k in part.state_dict())
            try:
                part.load_state_dict(state)
            except RuntimeError as error:
                raise FileError(folder / TENSOR_FILE, f"does not fit layer {index}'s {name}: {error}") from error
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise FileError(folder / TENSOR_FILE, f"holds tensors no converted layer takes: {unexpected[:5]}", _RESAVE)
    return model.eval()


_RESAVE = "save the model again with subquad.hf.save, or copy the folder again from where it was written"


def saved_layers(folder: str | Path) -> dict[int, tuple[str, dict[str, Any]]]:
    """Each converted layer's (mechanism, options), from the ``subquad.json`` of a folder ``save``
    wrote; FileError naming the file for one that is broken, changed, or from another version."""
    return _read_spec(folder)


def _read_spec(folder: str | Path) -> dict[int, tuple[str, dict[str, Any]]]:
    """``saved_layers``, with every file ``subquad.json`` records checked against its SHA-256 and
    ``subquad.json`` against its checksum (folders saved before they were recorded are read unchecked)."""
    folder = Path(folder)
    spec_file = folder / SPEC_FILE
    if not spec_file.is_file():
        raise FileNotFoundError(
            f"{folder} has no {SPEC_FILE}: it is not a model subquad.hf.save (or subquad distill) wrote; load a plain "
            "model with transformers, then subquad.hf.convert or use it"
        )
    saved = read_json(spec_file, SPEC_FILE, _RESAVE)
    check_fields(saved, spec_file, {"format": int, "layers": dict, "sha256": dict, "checksum": str},
                 required=("format", "layers"), fix=_RESAVE)  # fmt: skip
    if saved["format"] != 1:
        raise FileError(spec_file, f"is format {saved['format']}; this version of subquad reads format 1",
                        "load it with the subquad version that wrote it")  # fmt: skip
    if "sha256" in saved or "checksum" in saved:  # written with its checks: they are all there
        if saved.get("checksum") != json_checksum({k: v for k, v in saved.items() if k != "checksum"}):
            raise FileError(spec_file, "was changed after it was written (its checksum does not match it)", _RESAVE)
        for name, digest in saved.get("sha256", {}).items():
            path = folder / name
            if Path(name).name != name:
                raise FileError(spec_file, f"records a file {name!r} outside its folder", _RESAVE)
            if not path.is_file():
                raise FileError(folder, f"lacks {name}, which {SPEC_FILE} records", _RESAVE)
            if sha256(path) != digest:
                raise FileError(path, f"was changed or damaged after it was written (its SHA-256 is not "
                                f"{SPEC_FILE}'s)", _RESAVE)  # fmt: skip
    if not saved["layers"]:
        raise FileError(spec_file, "names no converted layer", _RESAVE)
    layers = {}
    for index, layer in saved["layers"].items():
        if not index.isdigit():
            raise FileError(spec_file, f"names layer {index!r}; layers are numbers", _RESAVE)
        where = f"layer {index}"
        if not isinstance(layer, dict):
            raise FileError(spec_file, f"{where} is not an object", _RESAVE)
        check_fields(layer, spec_file, {"mechanism": str, "options": dict}, ("mechanism", "options"), where, _RESAVE)
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in layer["options"].items()}
        try:
            LayerAttention.build(layer["mechanism"], converted=True, **options)
        except (ValueError, TypeError) as error:
            raise FileError(spec_file, f"{where}: {error}", _RESAVE) from error
        layers[int(index)] = layer["mechanism"], options
    return layers


_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle")


def model_source(path: str | Path) -> dict[str, Any]:
    """The keyword arguments with which transformers' ``from_pretrained`` loads the local model
    ``path`` (a folder, or a ``.gguf`` file) as data only: safetensors weights (never pickled
    ones), no code of the model's own (``trust_remote_code=False``, which also keeps transformers
    from asking on a terminal), nothing from a hub. A folder that is not a model, a pickle-only
    one, one that asks for its own code, or a file that is not GGUF raises FileError naming it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}: pass a local Hugging Face model folder or a .gguf file")
    where = {"local_files_only": True, "trust_remote_code": False}
    if path.is_file():
        check_gguf(path)
        return {**where, "pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    config = path / "config.json"
    if not config.is_file():
        raise FileError(path, "holds no config.json: it is not a Hugging Face model folder",
                        "pass the folder save_pretrained wrote, or a .gguf file")  # fmt: skip
    values = read_json(config, "model config", "copy the model folder again from where it came")
    if "auto_map" in values:
        raise FileError(config, "asks to run the model's own code (auto_map), which subquad never does",
                        "use a model whose architecture transformers itself has")  # fmt: skip
    if not any((path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        pickled = sorted(p.name for pattern in _PICKLES for p in path.glob(pattern))
        if pickled:
            raise FileError(
                path / pickled[0], "holds the weights in a pickle format, which subquad never loads: a pickle from "
                "elsewhere can run code",
                "where you trust the model, save it as safetensors (model.save_pretrained(folder)) and pass that "
                "folder",
            )  # fmt: skip
        raise FileError(path, "holds no model.safetensors", "pass a model folder with safetensors weights")
    return {**where, "pretrained_model_name_or_path": str(path), "use_safetensors": True}


@contextlib.contextmanager
def loading(path: str | Path):
    """Errors of transformers while it loads the local model ``path`` (a truncated weights file, a
    config it cannot read, a tokenizer that does not fit) as FileError naming it."""
    try:
        yield
    except FileError:
        raise
    except ImportError:  # a package the model needs (gguf): its own message says which
        raise
    except Exception as error:  # whatever the files made transformers raise: named, never a traceback
        reason = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise FileError(
            path, f"could not be loaded as a Hugging Face model ({type(error).__name__}: {reason[:300]})",
            "check that the folder (or .gguf file) is whole: copy it again from where it came",
        ) from error  # fmt: skip

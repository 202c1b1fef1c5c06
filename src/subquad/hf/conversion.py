"""Conversion: what a mechanism needs and a pretrained model lacks.

``convert(model, "linear", feature_map="hedgehog")`` is ``use`` plus what the
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
lists what to train (``subquad distill`` does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from subquad.config import parse_spec
from subquad.hf.interface import LayerAttention, _apply, _new_state, capturing, model_attention
from subquad.hf.mixes import LayerMix, units
from subquad.hf.plans import LayerPlan, clear_layers, is_plan, read_plan, resolved
from subquad.hf.support import attention_modules, layer_index
from subquad.ops.spherical import spherical_kmeans
from subquad.registry import get_mechanism


def calibratable(spec: LayerAttention | LayerMix | LayerPlan | str | None) -> bool:
    """Whether ``calibrate`` fits this mechanism, or a group of this head mix or spec string (its
    state holds routing centroids)."""
    if spec is None:
        return False
    if isinstance(spec, LayerMix):
        return any(calibratable(group) for group in spec.groups)
    if isinstance(spec, LayerPlan) or is_plan(spec):  # a plan: any of its specs (learned inputs: convert adds them)
        return any(
            calibratable(s) for s in (spec if isinstance(spec, LayerPlan) else read_plan(spec, converted=True)).specs()
        )
    if isinstance(spec, str):
        return any(get_mechanism(group.name).calibratable for group in parse_spec(spec))
    return spec.mechanism.calibratable


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable[dict[str, Tensor]], iterations: int = 20, seed: int = 0) -> int:
    """Fit the centroids of every routing layer by spherical k-means on the directions of the
    model's own queries and keys over ``batches`` (keyword arguments of the model's forward);
    returns the number of layers fitted. Routing's centroids start random otherwise, and a
    pretrained model's queries and keys do not lie where random directions cut them."""
    routed = [m for m in units(attention_modules(model)) if calibratable(getattr(m, "subquad_attention", None))]
    if not routed:
        raise ValueError("no layer of this model has a mechanism with centroids; subquad.hf.use(model, 'routing')")
    with capturing(routed) as captured:
        for batch in batches:
            model(**batch)
    for module in routed:
        if not captured[module]:
            raise ValueError("calibrate saw no batch; pass at least one")
        centroids = module.subquad_state.centroids
        points = torch.cat(captured[module], dim=1)
        layer_seed = getattr(module, "subquad_seed", layer_index(module))  # a mix's groups: seeds of their own
        centroids.copy_(spherical_kmeans(points, centroids.shape[1], iterations, seed + layer_seed))
    return len(routed)


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
        self.gain = nn.Parameter(torch.full((heads,), float(heads))) if spec.mechanism.output_gain else None

    def forward(self, query: Tensor, key: Tensor) -> dict[str, Tensor]:
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        weight = next(self.inputs.parameters(), None)
        dtype = query.dtype if weight is None else weight.dtype
        flat = lambda x: x.transpose(1, 2).flatten(2).to(dtype)  # noqa: E731 - (B, N, H·D)
        return {name: x.to(query.dtype) for name, x in self.inputs(flat(query), flat(key)).items()}


def _heads(module: nn.Module, model: nn.Module) -> tuple[int, int]:
    """An attention module's query heads and head size, from its own config (a two-tower model's
    towers differ: CLIP's text and vision), else the model's."""
    config = getattr(module, "config", None) or model.config
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
    and the model lacks, initialised (see the module docstring); returns ``model``. A ``.toml``
    layer plan converts each of its tables on its layers (``subquad.hf.plans``).

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
    if is_plan(mechanism):  # one spec per layer: each table on its layers (subquad.hf.plans)
        plan = read_plan(mechanism, converted=True)
        if layers is not None or options:
            raise ValueError(
                f"{plan.path} names each layer's attention and options; pass no layers= or options with it"
            )
        groups = resolved(model, plan, lambda spec: model_attention(model, spec, converted=True))
        if all(made is None for made, _ in groups):
            raise ValueError(f"{plan.path} converts no layer of {type(model).__name__}: name a spec for some layers")
    else:
        groups = [(model_attention(model, mechanism, converted=True, **options), layers)]
    needs = any(calibratable(made) for made, _ in groups)  # once, after every layer is converted
    if needs and calibration is None:
        raise ValueError(
            f"{mechanism}'s centroids are fitted by k-means on the model's own queries and keys: pass "
            "calibration=[{'input_ids': ...}, ...] (a few batches of real text)"
        )
    before = dict(model.named_parameters())  # frozen once the conversion has gone through (a refusal leaves them)
    for made, chosen in groups:
        if made is None:
            clear_layers(model, chosen)
        else:
            _add(model, made, chosen, seed)
    if freeze:
        _freeze(model, before)
    if needs:
        calibrate(model, calibration, seed=seed)
    return model


def _freeze(model: nn.Module, before: dict[str, nn.Parameter]) -> nn.Module:
    """``requires_grad=False`` on the weights ``before`` (restore() gives back what this froze)."""
    frozen = [name for name, parameter in before.items() if parameter.requires_grad]
    model.subquad_frozen = sorted({*getattr(model, "subquad_frozen", ()), *frozen})
    for parameter in before.values():
        parameter.requires_grad_(False)
    return model


def _add(model: nn.Module, spec: LayerAttention | LayerMix, layers: Iterable[int] | None, seed: int = 0):
    """``_apply``, then each unit's state and converted inputs (a mix's groups on their heads)."""
    modules = _apply(model, spec, layers)
    reference = next(model.parameters())
    for module in modules:
        heads, head_dim = _heads(module, model)
        for unit in units([module]):
            spec, unit_heads = unit.subquad_attention, getattr(unit, "heads", heads)
            if spec.mechanism.state is not None:
                _new_state(unit, spec, unit_heads, head_dim, reference.device, reference.dtype)
            if spec.mechanism.inputs is not None:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed * 1_000_003 + int(getattr(unit, "subquad_seed", layer_index(unit))))
                    inputs = ConvertedInputs(spec, unit_heads, head_dim)
                unit.subquad_inputs = inputs.to(reference.device, reference.dtype)
    return modules


def _converted(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """What conversion added to an attention module, by name (a mix's: per ``HeadShare``)."""
    if isinstance(getattr(module, "subquad_attention", None), LayerMix):
        return [
            (f"subquad_shares.{i}.{n}", p)
            for i, share in enumerate(module.subquad_shares)
            for n, p in _converted(share)
        ]
    return [(n, getattr(module, n)) for n in ("subquad_state", "subquad_inputs") if hasattr(module, n)]


def converted_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What ``convert`` added that gradients train: feature maps, class projections, routers, gains."""
    return [p for m in attention_modules(model) for _, part in _converted(m) for p in part.parameters()]

"""Head mixes inside pretrained models: a layer's query heads split between mechanisms.

The Routing Transformer runs routing heads beside local heads in every layer; a pretrained model
that keeps a few heads exact, or gives some heads a window and others a routed reach, is the same
kind of layer. ``subquad.hf.use(model, "local:window=256,sinks=4*6+full*3")`` gives the first six
query heads of each chosen layer a window with sinks and the last three exact attention; a group
without ``*N`` takes the heads the others leave (the spec grammar of ``subquad.config.parse_spec``).

- Groups take consecutive query heads, in the spec's order, with the key/value heads those
  queries read: under grouped-query attention (G query heads per key/value head, as transformers'
  ``repeat_kv`` pairs them) each group's count must be a multiple of G, so no key/value head is
  split between groups.
- Each group runs in a ``HeadShare``, a child module of the attention module that holds the group's
  mechanism and, like an attention module, its state (routing's centroids, seeded by layer and
  first head; ``calibrate`` fits them): the layer's output is the groups' outputs side by side,
  exactly what each group's call gives on its heads.
- Groups of one spec whose mechanism keeps no state (no learned inputs, no state tensors: a
  window, retrieval without a learned map) run as one call on their heads together, wherever they
  lie in the layer (``LayerMix.calls``): ``retrieval*3+local*3+retrieval*3`` is one retrieval
  call on the first and last key/value heads, and its output is the per-group calls' (every
  mechanism is computed head by head). A call is a fixed cost (about 65 µs a token in SmolLM2's
  generation, docs/performance.md); ``subquad approx`` times such groups together as well.
- Generation: in ``SubquadCache`` a mixed layer is a ``MixLayer``: each group whose decoder takes
  over a prefill (local, linear) steps at its own cost, each other group keeps its key/value heads
  (groups run as one call keep theirs in the first one's part).
- ``convert`` adds what each group's mechanism needs on the group's heads (``distill`` trains it),
  ``save`` writes the mix's spec, and ``subquad approx`` measures a mix as any spec.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from subquad.config import SpecGroup
from subquad.hf.cache import KEY
from subquad.hf.support import layer_index

__all__ = ["HeadShare", "LayerMix", "build_mix", "check_heads", "mixed_forward", "units"]


@dataclass
class LayerMix:
    """A layer's head groups: ``groups[i]`` (a ``LayerAttention``) on ``heads[i]`` consecutive query heads."""

    groups: tuple[Any, ...]
    heads: tuple[int, ...]
    text: str  # the spec, for messages

    @property
    def firsts(self) -> list[int]:
        return [sum(self.heads[:i]) for i in range(len(self.heads))]

    @functools.cached_property
    def calls(self) -> tuple[tuple[int, ...], ...]:
        """The groups each call runs (module docstring), in the order of their first group: the
        groups of one spec whose mechanism keeps no state together, every other group alone."""
        calls: list[list[int]] = []
        for index, group in enumerate(self.groups):
            same = next((c for c in calls if stateless(group) and self.groups[c[0]] == group), None)
            if same is None:
                calls.append([index])
            else:
                same.append(index)
        return tuple(tuple(c) for c in calls)


def stateless(group: Any) -> bool:
    """Whether a group's ``LayerAttention`` computes from its inputs alone: no learned inputs and
    no state, or a state holding no tensor (``retrieval`` and ``linear`` without hedgehog's maps);
    seeded states (routing's centroids, clustered's seed) hold theirs."""
    mechanism = group.mechanism
    if mechanism.inputs is not None:
        return False
    if mechanism.state is None:
        return True
    try:
        probe = mechanism.state(group.config, 1, 8, 0)
    except Exception:  # a state that cannot be built so small: kept apart
        return False
    return not any(True for _ in probe.parameters()) and not any(True for _ in probe.buffers())


class HeadShare(nn.Module):
    """One head group of a mixed layer: its mechanism (``subquad_attention``), its first query head
    and head count, and the state its mechanism keeps, as an attention module holds them."""

    def __init__(self, spec: Any, first: int, heads: int, layer_idx: int) -> None:
        super().__init__()
        self.subquad_attention, self.first, self.heads, self.layer_idx = spec, first, heads, layer_idx
        self.subquad_seed = 1009 * int(layer_idx or 0) + first  # two groups of one layer: two seeds

    def extra_repr(self) -> str:
        return f"heads {self.first}..{self.first + self.heads - 1}: {self.subquad_attention.mechanism.name}"


def build_mix(groups: tuple[SpecGroup, ...], text: str, heads: int, kv_heads: int, build: Any) -> LayerMix:
    """The ``LayerMix`` of a parsed spec for layers of ``heads`` query and ``kv_heads`` key/value heads;
    ``build(name, **options)`` makes each group's ``LayerAttention``."""
    open_groups = [g for g in groups if g.heads is None]
    claimed = sum(g.heads for g in groups if g.heads is not None)
    if len(open_groups) > 1 or (open_groups and claimed >= heads) or (not open_groups and claimed != heads):
        several = " and leaves the rest to several groups" if len(open_groups) > 1 else ""
        raise ValueError(
            f"the head mix {text!r} gives {claimed} heads{several}, but this model's layers have {heads} query heads: "
            f"give every group its count (NAME*N) summing to {heads}, or leave one group without *N to take the rest"
        )
    counts = tuple(heads - claimed if g.heads is None else g.heads for g in groups)
    per = heads // kv_heads
    if any(n % per for n in counts):
        raise ValueError(
            f"the head mix {text!r} splits {counts} of {heads} query heads, but this model's query heads share "
            f"key/value heads {per} at a time ({kv_heads} key/value heads): give each group a multiple of {per}"
        )
    return LayerMix(tuple(build(g.name, **dict(g.options)) for g in groups), counts, text)


def check_heads(model: nn.Module, module: nn.Module, mix: LayerMix) -> None:
    """Refuse a mix split for another head count than ``module``'s own (a two-tower model's towers differ)."""
    heads = getattr(getattr(module, "config", None) or model.config, "num_attention_heads", None)
    if isinstance(heads, int) and heads != sum(mix.heads):
        raise ValueError(
            f"the head mix {mix.text!r} splits {sum(mix.heads)} query heads, but layer {layer_index(module)} "
            f"({type(module).__name__}) has {heads}: {type(model).__name__}'s layers differ in heads; apply the mix "
            "to the layers it fits (layers=...) or to each part of the model on its own"
        )


def shares(mix: LayerMix, layer_idx: int) -> nn.ModuleList:
    """A layer's ``HeadShare`` modules for ``mix``."""
    return nn.ModuleList(HeadShare(s, f, n, layer_idx) for s, f, n in zip(mix.groups, mix.firsts, mix.heads))


def mixed_forward(
    module: nn.Module, forward: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, dropout: float,
    scaling: float | None, causal: bool, merge: bool = True, **kwargs: Any,
) -> tuple[Tensor, None]:  # fmt: skip
    """A mixed layer's attention: each call of ``module``'s mix (``LayerMix.calls``; with ``merge``
    False, each group alone) runs ``forward`` (the interface's attention call) through its first
    ``HeadShare`` on its groups' query heads and their key/value heads, with that group's part of
    subquad's cache (``subquad.hf.cache.MixLayer``) if one is passed; the outputs ``(B, L, h, D)``
    side by side, in the groups' order."""
    per, layer = query.shape[1] // key.shape[1], kwargs.pop(KEY, None)
    shares = list(module.subquad_shares)
    if sum(share.heads for share in shares) != query.shape[1]:
        raise ValueError(
            f"the head mix {module.subquad_attention.text!r} splits {sum(s.heads for s in shares)} query heads, but "
            f"this layer's attention hands over {query.shape[1]}: apply the mix to layers of that many heads"
        )
    calls = module.subquad_attention.calls if merge else tuple((i,) for i in range(len(shares)))
    if layer is not None:  # those that keep keys first (MixLayer.order)
        calls = [call for index in layer.order() for call in calls if call[0] == index]
    outputs: list[Tensor | None] = [None] * len(shares)
    try:
        for call in calls:
            members = [shares[i] for i in call]
            q, k, v = (_heads(x, members, n) for x, n in ((query, 1), (key, per), (value, per)))
            extra = kwargs
            if layer is not None:
                k, v, extra = layer.share(module.subquad_attention, call[0], k, v, kwargs)
            out, _ = forward(members[0], q, k, v, attention_mask, dropout, scaling, causal, **extra)
            for index, part in zip(call, out.split([share.heads for share in members], dim=2)):
                outputs[index] = part
    except Exception:
        if layer is not None:
            layer.undo(key.shape[2])
        raise
    return torch.cat(outputs, dim=2), None


def _heads(x: Tensor, members: list[HeadShare], per: int) -> Tensor:
    """The heads of ``x`` ``(B, H, ·, ·)`` the ``members`` read, ``per`` of their query heads to one
    of x's: a slice for one group, the groups' slices joined for several."""
    parts = [x[:, s.first // per : (s.first + s.heads) // per] for s in members]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def units(modules: list[nn.Module]) -> list[nn.Module]:
    """The modules that hold one mechanism each: attention modules, and mixed layers' ``HeadShare``s."""
    found = []
    for module in modules:
        if isinstance(getattr(module, "subquad_attention", None), LayerMix):
            found.extend(module.subquad_shares)
        else:
            found.append(module)
    return found

"""Mechanism registry: a name maps to its config dataclass, its function and its optional modules.

Every mechanism is one record (``Mechanism``) built in its own file under ``mechanisms/`` and listed
once in ``_BUILTIN_MODULES`` below. Options live in exactly one place, the mechanism's frozen config
dataclass; the dispatcher, the layers and the command line all read them from there.

A package adds mechanisms without touching subquad by naming its module as an entry point of the
group ``subquad.mechanisms`` (in its ``pyproject.toml``: ``[project.entry-points."subquad.mechanisms"]``
then ``mine = "my_package.attention"``). The module defines ``MECHANISM`` or ``MECHANISMS`` like a
built-in one and is registered after the built-ins; one that fails to load is skipped with a warning.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import KW_ONLY, MISSING, dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from subquad._validate import SUPPORTED_DTYPES, AttentionShape
from subquad.config import Config, option, parse_value

__all__ = [
    "KEY",
    "QUERY",
    "Config",
    "Mechanism",
    "get_mechanism",
    "make_config",
    "mechanism_names",
    "no_causal_form",
    "option",
    "parse_value",
    "register",
]

QUERY, KEY = "query", "key"  # what an extra tensor's last dimension runs over (``Mechanism.positions``)

# One line per built-in module: each defines its ``MECHANISM`` record, or several as ``MECHANISMS``.
# Installed packages add modules of their own under the entry-point group ``PLUGIN_GROUP``.
PLUGIN_GROUP = "subquad.mechanisms"
_BUILTIN_MODULES = (
    "subquad.mechanisms.full",
    "subquad.mechanisms.clustered",
    "subquad.mechanisms.improved_clustered",
    "subquad.mechanisms.linear",
    "subquad.mechanisms.agglomerative",
    "subquad.mechanisms.local",
    "subquad.mechanisms.routing",
    "subquad.mechanisms.multires",
    "subquad.mechanisms.sparse",
    "subquad.mechanisms.pattern",
    "subquad.mechanisms.retrieval",
)


@dataclass(frozen=True)
class Mechanism:
    """One attention mechanism and what it supports. After ``name``, ``fn``, ``config`` and ``summary``,
    every field is given by keyword; they come in four groups.

    What it is:
        name: the registry name, e.g. ``"full"``.
        fn: ``fn(q, k, v, *, key_padding_mask, is_causal, scale, config, state, **tensors)``.
        config: its frozen ``Config`` dataclass.
        summary: one line for ``subquad list``.
        paper: the paper and section it implements.

    Capabilities (what a call may ask of it):
        causal, cross: whether ``is_causal=True`` and L != S are supported.
        longer_queries: with ``cross``, whether L > S is supported too (else only L < S).
        dtypes: the floating dtypes it computes in.
        gqa: ``fn`` takes grouped-query inputs itself (k and v with H / G heads, and
            ``enable_gqa=True``) without copying them; otherwise the call repeats them.
        dropout: ``fn`` takes ``dropout_p`` (attention dropout on its weights).
        scaled: whether ``scale`` means something (a softmax temperature): a bool, or a function of
            the config where it depends on it. False: ``fn`` takes only ``scale=None``.
        exact_full: ``exact_full(config, shape, is_causal, state, tensors) -> bool``: whether the
            call is exactly full attention (a window covering every key, clusters >= L, top-k >= S);
            such a call runs full attention's kernel, the same maths without blocks or clustering.
            It raises where the mechanism itself would. ``None``: never.
        plain_backward: its backward is torch's own operations, run by autograd (no autograd
            Function of its own): the call runs through ``kernels.threads.backward_adapted``, so
            that backward too runs on the cores other processes leave free.

    Inputs (what it reads besides q, k and v):
        tensor_args: extra keyword arguments ``fn`` takes, tensors (e.g. class logits) or a
            ``mask_mod`` callable, all optional for ``fn`` unless ``inputs`` produces them in layers.
            ``query_padding_mask`` among them: it takes a bool ``(B, L)`` mask of real queries.
        positions: for each extra tensor whose last dimension runs over positions, ``QUERY`` or
            ``KEY``; padded and non-finite entries there are contained like those of q, k and v.
        groups_queries: its outputs depend on which queries share a group (clusters, balanced
            tiles), so it needs a ``query_padding_mask`` whenever a ``key_padding_mask`` is given.
        uses_qk: False for a mechanism that reads only the shapes of ``q`` and ``k`` (agglomerative);
            layers then build no query/key projections for it.
        conv_input: its paper's model reads a convolution of the token embeddings rather than
            learned positions (agglomerative); models trained by ``subquad train`` follow it.
        sinks: the config option counting its positional sinks (the first keys every query sees),
            e.g. ``"sinks"``; inside a pretrained model padding may not fall on them.

    Modules (what layers and models build around it):
        state: an ``nn.Module`` class built as ``state(config, num_heads, head_dim, seed)`` holding
            what persists across calls (centroids, hash planes); passed to ``fn`` as ``state``.
        inputs: an ``nn.Module`` class built as ``inputs(config, embed_dim, num_heads)`` that a layer
            calls as ``inputs(query_x, key_x) -> dict`` to produce ``tensor_args`` from ``(B, N, E)``.
        decoder: the decoding cache of layers' generation, a ``subquad.decoding.Decoder`` subclass
            built as ``decoder(mechanism, config, state)`` (e.g. ``KVCache``); ``None``: none.
        calibratable: its state's ``centroids`` ``(H, C, D)`` may be fit by spherical k-means to a
            pretrained model's own queries and keys (``subquad.hf.calibrate``).
        output_gain: swapped into a pretrained model, its output is scaled per head by a learned
            gain (its weights sum to 1 across heads, so each head starts at 1/H of its scale).

    Examples (what tests and benchmarks run it on):
        examples: small option sets (dicts for ``make_config``) that reach the mechanism's code
            paths at short lengths; the contract suite runs every property on each.
        example_tensors: ``example_tensors(q, k, v, config, generator) -> dict`` makes the extra
            tensor arguments for benchmarks from seeded random draws; needed when ``tensor_args``
            are required.
    """

    name: str
    fn: Callable[..., Tensor]
    config: type[Config]
    summary: str
    _: KW_ONLY
    paper: str = ""
    # capabilities
    causal: bool = True
    cross: bool = True
    longer_queries: bool = True
    dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES
    gqa: bool = False
    dropout: bool = False
    scaled: bool | Callable[[Config], bool] = True
    exact_full: Callable[[Config, AttentionShape, bool, Any, typing.Mapping[str, Any]], bool] | None = None
    plain_backward: bool = False
    # inputs
    tensor_args: tuple[str, ...] = ()
    positions: typing.Mapping[str, str] = field(default_factory=dict, hash=False)
    groups_queries: bool = False
    uses_qk: bool = True
    conv_input: bool = False
    sinks: str = ""
    # modules
    state: type[torch.nn.Module] | None = None
    inputs: type[torch.nn.Module] | None = None
    decoder: type | None = None
    calibratable: bool = False
    output_gain: bool = False
    # examples
    examples: tuple[typing.Mapping[str, Any], ...] = field(default=({},), hash=False)
    example_tensors: Callable[..., dict[str, Tensor]] | None = None

    def __post_init__(self) -> None:
        if self.groups_queries and "query_padding_mask" not in self.tensor_args:
            raise ValueError(f"{self.name}: groups_queries needs query_padding_mask among its tensor_args")
        for name, side in self.positions.items():
            if name not in self.tensor_args or side not in (QUERY, KEY):
                raise ValueError(
                    f"{self.name}: positions must map names of tensor_args {list(self.tensor_args)} to "
                    f"{QUERY!r} or {KEY!r}, got {name!r}: {side!r}"
                )

    def takes_scale(self, config: Config) -> bool:
        """Whether ``scale`` applies under ``config`` (see ``scaled``)."""
        return bool(self.scaled(config) if callable(self.scaled) else self.scaled)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"a Mechanism record is not called directly: use subquad.attention(q, k, v, mechanism={self.name!r}, "
            "...), or subquad.call.call(record, q, k, v, ...) for a record that is not registered"
        )

    @property
    def recurrent(self) -> bool:
        """Whether it decodes token by token with O(1) state per head."""
        return bool(getattr(self.decoder, "recurrent", False))


def no_causal_form(name: str) -> str:
    """The error for ``is_causal=True`` on a mechanism without a causal form: names those with one."""
    causal = ", ".join(n for n in mechanism_names() if get_mechanism(n).causal)
    return f"{name} has no causal form; mechanisms with one: {causal}"


_REGISTRY: dict[str, Mechanism] = {}
_builtins_loaded = False


def _load_builtins() -> None:
    """Register the built-in mechanisms, then those of installed plugins (module docstring)."""
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in _BUILTIN_MODULES:
            _register_module(importlib.import_module(module), module)
        for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP):
            try:
                _register_module(entry.load(), entry.value)
            except Exception as error:  # a broken plugin must not take the library down
                warnings.warn(
                    f"subquad plugin {entry.name!r} ({entry.value}) failed to load and is skipped: "
                    f"{type(error).__name__}: {error}",
                    RuntimeWarning,
                    stacklevel=3,
                )


def _register_module(module: types.ModuleType, where: str) -> None:
    """Register a module's ``MECHANISM``, or each of its ``MECHANISMS``."""
    mechanisms = getattr(module, "MECHANISMS", None) or (getattr(module, "MECHANISM", None),)
    for mechanism in mechanisms:
        if not isinstance(mechanism, Mechanism):
            raise ValueError(f"{where} must define MECHANISM (a Mechanism) or MECHANISMS (a tuple of them)")
        if mechanism.name in _REGISTRY:
            raise ValueError(f"{where} registers {mechanism.name!r}, a name already taken")
        _REGISTRY[mechanism.name] = mechanism


def register(mechanism: Mechanism, *, replace: bool = False) -> Mechanism:
    """Add a mechanism under its name; ``replace=True`` overrides an existing one."""
    _load_builtins()
    if not isinstance(mechanism, Mechanism):
        raise ValueError(f"register needs a Mechanism, got {type(mechanism).__name__}")
    if mechanism.name in _REGISTRY and not replace:
        raise ValueError(f"a mechanism named {mechanism.name!r} exists; pass replace=True to override it")
    _REGISTRY[mechanism.name] = mechanism
    return mechanism


def mechanism_names() -> list[str]:
    """Registered mechanism names, built-ins first, in registration order."""
    _load_builtins()
    return list(_REGISTRY)


def get_mechanism(name: str) -> Mechanism:
    """The mechanism registered as ``name``; raises ValueError listing the available names."""
    _load_builtins()
    if not isinstance(name, str):
        hint = "; pass a mask as attn_mask=..." if isinstance(name, Tensor) else ""
        raise ValueError(f"mechanism must be a registered name, got {type(name).__name__}{hint}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown mechanism {name!r}; available: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def make_config(mechanism: str | Mechanism, **options: Any) -> Config:
    """Build a mechanism's config from keyword options; unknown options raise, listing valid ones."""
    mech = get_mechanism(mechanism) if isinstance(mechanism, str) else mechanism
    for old, new in mech.config.renamed.items():
        if old in options:
            warnings.warn(
                f"{mech.name} option {old} is now called {new}; {old}= is accepted until the next release",
                DeprecationWarning,
                stacklevel=3,
            )
            if new in options:
                raise ValueError(f"{mech.name}: pass {new} only ({old} is its old name), got both")
            options[new] = options.pop(old)
    if not options:
        return default_config(mech.config)
    valid = [f.name for f in fields(mech.config)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        listed = ", ".join(f"{f.name}={f.default!r}" for f in fields(mech.config) if f.default is not MISSING)
        hint = "; a dense attn_mask is accepted by full only" if "attn_mask" in unknown else ""
        raise ValueError(f"unknown option(s) {unknown} for {mech.name}; valid options: {listed or 'none'}{hint}")
    return mech.config(**options)


@functools.cache
def default_config(cls: type[Config]) -> Config:
    """``cls()``, built once: configs are frozen, and checking every field of a new one cost more
    than a short attention call's own kernel."""
    return cls()

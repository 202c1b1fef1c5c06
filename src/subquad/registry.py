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
import math
import operator
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import Tensor

from subquad._contain import KEY, QUERY, contained
from subquad._validate import (
    SUPPORTED_DTYPES,
    AttentionShape,
    check_attention_inputs,
    check_dtype,
    check_gqa,
    check_query_padding_mask,
)
from subquad.kernels.threads import adapted, backward_adapted

__all__ = [
    "KEY",
    "QUERY",
    "Config",
    "Mechanism",
    "attention",
    "get_mechanism",
    "make_config",
    "mechanism_names",
    "no_causal_form",
    "option",
    "parse_value",
    "register",
]

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
)


def option(
    default: Any,
    help: str,
    *,
    choices: tuple[Any, ...] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
) -> Any:
    """Declare a config field: its default, a help line, and the constraints ``Config`` enforces."""
    metadata = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le}
    if isinstance(default, (list, dict, set)):
        raise TypeError("option defaults must be immutable; use a tuple")
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Config:
    """Base class of mechanism configs: checks each field's type and declared constraints.

    Subclasses are frozen dataclasses whose fields are declared with ``option``; cross-field rules
    go in ``check``. Lists given for tuple fields are converted to tuples.
    """

    mechanism: ClassVar[str] = ""
    renamed: ClassVar[typing.Mapping[str, str]] = {}  # old option name -> new: make_config warns and maps it

    def __post_init__(self) -> None:
        hints = _type_hints(type(self))
        for f in fields(self):
            value = _coerce(self._label(f.name), getattr(self, f.name), hints[f.name])
            _check_constraints(self._label(f.name), value, f.metadata)
            object.__setattr__(self, f.name, value)
        self.check()

    def check(self) -> None:
        """Cross-field validation; raise ValueError naming the values and the fix."""

    def _label(self, name: str) -> str:
        return f"{self.mechanism or type(self).__name__} option {name}"


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """A config class's field annotations, resolved once: ``typing.get_type_hints`` evaluates the
    string annotations anew on every call, which cost more than short attention calls themselves."""
    return typing.get_type_hints(cls)


def _coerce(label: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp`` (int, float, bool, str, tuples, optionals)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(label, value, inner)
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            raise ValueError(f"{label} must be a tuple, got {value!r}")
        return tuple(_coerce(label, item, args[0]) for item in value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{label} must be True or False, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{label} must be an int, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{label} must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{label} must be a string, got {value!r}")
        return value
    raise TypeError(f"{label}: unsupported option type {tp!r}")


def _check_constraints(label: str, value: Any, meta: typing.Mapping[str, Any]) -> None:
    items = value if isinstance(value, tuple) else (value,)
    for item in items:
        if item is None:
            continue
        if meta.get("choices") is not None and item not in meta["choices"]:
            valid = ", ".join(repr(c) for c in meta["choices"])
            raise ValueError(f"{label} must be one of {valid}, got {item!r}")
        for key, ok, word in (("ge", operator.ge, ">="), ("gt", operator.gt, ">"), ("le", operator.le, "<=")):
            bound = meta.get(key)
            if bound is not None and not ok(item, bound):
                raise ValueError(f"{label} must be {word} {bound}, got {item!r}")


@dataclass(frozen=True)
class Mechanism:
    """One attention mechanism and what it supports.

    Attributes:
        name: the registry name, e.g. ``"full"``.
        fn: ``fn(q, k, v, *, key_padding_mask, is_causal, scale, config, state, **tensors)``.
        config: its frozen ``Config`` dataclass.
        summary: one line for ``subquad list``.
        paper: the paper and section it implements.
        causal, cross: whether ``is_causal=True`` and L != S are supported.
        longer_queries: with ``cross``, whether L > S is supported too (else only L < S).
        dtypes: the floating dtypes it computes in.
        tensor_args: extra keyword arguments ``fn`` takes, tensors (e.g. class logits) or a
            ``mask_mod`` callable, all optional for ``fn`` unless ``inputs`` produces them in layers.
            ``query_padding_mask`` among them: it takes a bool ``(B, L)`` mask of real queries.
        groups_queries: its outputs depend on which queries share a group (clusters, balanced
            tiles), so it needs a ``query_padding_mask`` whenever a ``key_padding_mask`` is given.
        positions: for each extra tensor whose last dimension runs over positions, ``QUERY`` or
            ``KEY``; padded and non-finite entries there are contained like those of q, k and v.
        state: an ``nn.Module`` class built as ``state(config, num_heads, head_dim, seed)`` holding
            what persists across calls (centroids, hash planes); passed to ``fn`` as ``state``.
        inputs: an ``nn.Module`` class built as ``inputs(config, embed_dim, num_heads)`` that a layer
            calls as ``inputs(query_x, key_x) -> dict`` to produce ``tensor_args`` from ``(B, N, E)``.
        example_tensors: ``example_tensors(q, k, v, config, generator) -> dict`` makes the extra
            tensor arguments for benchmarks from seeded random draws; needed when ``tensor_args``
            are required.
        decoder: the decoding cache layers use for generation: a subclass of
            ``subquad.decoding.Decoder``, built as ``decoder(mechanism, config, state)``, whose
            ``step(q, k, v, **tensors) -> out`` checks each step and keeps the length, and whose
            ``_step`` holds the mechanism's maths; class attributes ``recurrent`` (O(1) state per
            head) and ``description``. E.g. ``subquad.decoding.KVCache``. ``None``: no cached decoding.
        uses_qk: False for a mechanism that reads only the shapes of ``q`` and ``k`` (agglomerative);
            layers then build no query/key projections for it.
        examples: small option sets (dicts for ``make_config``) that reach the mechanism's code
            paths at short lengths; the contract suite runs every property on each.
        gqa: ``fn`` takes grouped-query inputs itself (k and v with H / G heads, and
            ``enable_gqa=True``) without copying them; otherwise the call repeats them.
        dropout: ``fn`` takes ``dropout_p`` (attention dropout on its weights).
        scaled: whether ``scale`` means something (a softmax temperature): a bool, or a function of
            the config where it depends on it. False: ``fn`` takes only ``scale=None``.
        plain_backward: its backward is torch's own operations, run by autograd (no autograd
            Function of its own): the call runs through ``kernels.threads.backward_adapted``, so
            that backward too runs on the cores other processes leave free.
        exact_full: ``exact_full(config, shape, is_causal, state, tensors) -> bool``: whether the
            call (its ``AttentionShape``) is exactly full attention (a window that covers every key,
            clusters >= L, top-k >= S). Such a call runs full attention's kernel instead: the same
            maths, without the fixed costs of blocks, layouts or clustering. It raises where the
            mechanism itself would (a state of the wrong kind). ``None``: never.
    """

    name: str
    fn: Callable[..., Tensor]
    config: type[Config]
    summary: str
    paper: str = ""
    causal: bool = True
    cross: bool = True
    longer_queries: bool = True
    groups_queries: bool = False
    dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES
    tensor_args: tuple[str, ...] = ()
    state: type[torch.nn.Module] | None = None
    inputs: type[torch.nn.Module] | None = None
    example_tensors: Callable[..., dict[str, Tensor]] | None = None
    decoder: type | None = None
    uses_qk: bool = True
    gqa: bool = False
    dropout: bool = False
    scaled: bool | Callable[[Config], bool] = True
    exact_full: Callable[[Config, AttentionShape, bool, Any, typing.Mapping[str, Any]], bool] | None = None
    plain_backward: bool = False
    positions: typing.Mapping[str, str] = field(default_factory=dict, hash=False)
    examples: tuple[typing.Mapping[str, Any], ...] = field(default=({},), hash=False)

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

    @property
    def recurrent(self) -> bool:
        """Whether it decodes token by token with O(1) state per head."""
        return bool(getattr(self.decoder, "recurrent", False))

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
        config: Config | None = None,
        state: torch.nn.Module | None = None,
        enable_gqa: bool = False,
        dropout_p: float = 0.0,
        **tensors: Tensor,
    ) -> Tensor:
        """Check this mechanism's capabilities, then run it with padded and future content
        contained (``subquad._contain``). With ``enable_gqa``, ``k`` and ``v`` may have fewer heads
        (a divisor of q's): native mechanisms (``gqa``) read them as they are; for the others each
        key/value head is repeated for its query heads first."""
        if enable_gqa and check_gqa(q, k, v) > 1:
            if not self.gqa:
                groups = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            else:
                tensors["enable_gqa"] = True
        query_padding_mask, shape = self._check_call(q, k, v, key_padding_mask, is_causal, config, tensors, dropout_p)
        exact = self.exact_full is not None and self.exact_full(
            config or _default_config(self.config), shape, is_causal, state, tensors
        )
        if dropout_p:
            tensors["dropout_p"] = dropout_p

        def run(q: Tensor, k: Tensor, v: Tensor, tensors: dict[str, Any]) -> Tensor:
            if exact:  # the same maths as full attention at this shape: full's kernel, without fixed costs
                out = get_mechanism("full").fn(
                    q, k, v, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale,
                    enable_gqa=bool(tensors.get("enable_gqa")), dropout_p=dropout_p,
                )  # fmt: skip
                # padded queries return zeros, as from the mechanisms that take a query mask
                return out if query_padding_mask is None else out.masked_fill(~query_padding_mask[:, None, :, None], 0)
            if self.plain_backward:
                return self._backward_adapted(q, k, v, key_padding_mask, is_causal, scale, config, state, tensors)
            return self.fn(
                q, k, v, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale, config=config,
                state=state, **tensors,
            )  # fmt: skip

        with adapted(q.device):  # fewer threads while other processes keep cores busy
            return contained(
                run, q, k, v, tensors, positions=self.positions, key_padding_mask=key_padding_mask,
                query_padding_mask=query_padding_mask, is_causal=is_causal, uses_qk=self.uses_qk,
                groups_queries=self.groups_queries,
            )  # fmt: skip

    def _backward_adapted(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, is_causal: bool,
        scale: float | None, config: Config | None, state: torch.nn.Module | None, tensors: dict[str, Any],
    ) -> Tensor:  # fmt: skip
        """``fn`` through ``backward_adapted``, with the extra tensors that take a gradient among its
        inputs (and q and k only where it reads them)."""
        names = [name for name, x in tensors.items() if isinstance(x, Tensor) and x.requires_grad]
        qk = [q, k] if self.uses_qk else []

        def call(*inputs: Tensor) -> Tensor:
            q_, k_ = inputs[:2] if self.uses_qk else (q, k)
            v_, *extra = inputs[len(qk) :]
            return self.fn(
                q_, k_, v_, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale, config=config,
                state=state, **{**tensors, **dict(zip(names, extra))},
            )  # fmt: skip

        return backward_adapted(call, [*qk, v, *(tensors[name] for name in names)])

    def _check_call(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, is_causal: bool,
        config: Config | None, tensors: dict[str, Any], dropout_p: float,
    ) -> tuple[Tensor | None, AttentionShape]:  # fmt: skip
        """Validate a call against the contract and this record; returns its query padding mask and
        its shape."""
        if config is not None and type(config) is not self.config:
            raise ValueError(f"{self.name} needs a {self.config.__name__}, got {type(config).__name__}")
        unknown = sorted(set(tensors) - set(self.tensor_args) - {"enable_gqa"})
        if unknown:
            raise ValueError(f"{self.name} takes no tensor argument {unknown}; it takes {list(self.tensor_args)}")
        if is_causal is True and not self.causal:
            raise ValueError(no_causal_form(self.name))
        if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
            raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
        if dropout_p and not self.dropout:
            with_dropout = ", ".join(n for n in mechanism_names() if get_mechanism(n).dropout)
            raise ValueError(
                f"{self.name} has no attention dropout (dropout_p={dropout_p}); pass dropout_p=0.0, or use one "
                f"of: {with_dropout}"
            )
        if tensors.get("enable_gqa"):  # native grouped-query: check the shapes against q's heads
            k, v = (x[:, :1].expand(-1, q.shape[1], -1, -1) for x in (k, v))
        shape = check_attention_inputs(q, k, v, key_padding_mask, is_causal, None)
        if not self.cross and shape.queries != shape.keys:
            raise ValueError(f"{self.name} needs as many queries as keys, got L={shape.queries} and S={shape.keys}")
        check_dtype(q.dtype, self.dtypes)
        query_padding_mask = tensors.get("query_padding_mask")
        check_query_padding_mask(query_padding_mask, shape, q.device)
        if key_padding_mask is not None and query_padding_mask is None and self.groups_queries:
            raise ValueError(
                f"{self.name} groups its queries, so padded queries would change real outputs: with "
                "key_padding_mask, pass query_padding_mask too, bool (B, L), True = real query (in "
                "self-attention the same mask; torch.ones(B, L, dtype=torch.bool) if no query is padded)"
            )
        return query_padding_mask, shape


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


def parse_value(text: str, tuples: str = ",") -> Any:
    """An option's value written as text (command lines, specs): true/false, an int, a float, a
    tuple of those where ``tuples`` separates items, else the string itself."""
    if tuples and tuples in text:
        return tuple(parse_value(item, "") for item in text.split(tuples))
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


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
        return _default_config(mech.config)
    valid = [f.name for f in fields(mech.config)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        listed = ", ".join(f"{f.name}={f.default!r}" for f in fields(mech.config) if f.default is not MISSING)
        hint = "; a dense attn_mask is accepted by full only" if "attn_mask" in unknown else ""
        raise ValueError(f"unknown option(s) {unknown} for {mech.name}; valid options: {listed or 'none'}{hint}")
    return mech.config(**options)


@functools.cache
def _default_config(cls: type[Config]) -> Config:
    """``cls()``, built once: configs are frozen, and checking every field of a new one cost more
    than a short attention call's own kernel."""
    return cls()


def _tensor_arguments(mech: Mechanism, attn_mask: Tensor | None, options: dict[str, Any]) -> dict[str, Any]:
    """The call's extra tensor arguments, taken out of ``options``, with ``attn_mask`` where the
    mechanism takes one (else a ValueError naming what it takes)."""
    tensors = {name: options.pop(name) for name in mech.tensor_args if name in options}
    if attn_mask is not None:
        if "attn_mask" not in mech.tensor_args:
            raise ValueError(
                f"{mech.name} takes no dense attn_mask; pass key_padding_mask, bool (B, S) with True = real "
                "token, or use mechanism='full' (any dense mask) or 'pattern' (a mask_mod)"
            )
        tensors["attn_mask"] = attn_mask
    return tensors


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    mechanism: str = "full",
    key_padding_mask: Tensor | None = None,
    config: Config | None = None,
    state: torch.nn.Module | None = None,
    **options: Any,
) -> Tensor:
    """Attention by mechanism name, as a drop-in for ``torch.nn.functional.scaled_dot_product_attention``:
    the same positional arguments, then the mechanism and its options by keyword.

    Args:
        q: queries ``(B, H, L, D)``.
        k: keys ``(B, H, S, D)`` (``(B, H / G, S, D)`` with ``enable_gqa``).
        v: values ``(B, H, S, Dv)`` (likewise).
        attn_mask: a dense mask broadcastable to ``(B, H, L, S)``, bool (True = may attend) or
            additive; ``full`` takes it. Other mechanisms take ``key_padding_mask``.
        dropout_p: attention dropout (mechanisms with ``dropout``: ``full``); 0 elsewhere.
        is_causal: strict causality; for L != S queries are aligned to the last keys.
        scale: softmax scale, default ``D ** -0.5``.
        enable_gqa: grouped-query attention: k and v have a divisor of q's heads, each serving
            consecutive query heads.
        mechanism: a registered name (``subquad list`` shows them).
        key_padding_mask: bool ``(B, S)``, True marks a real token.
        config: a ready config; otherwise ``options`` build one.
        state: the mechanism's persistent state module, if it has one.
        **options: the mechanism's config options, and its extra tensor arguments by name.

    Returns:
        ``(B, H, L, Dv)``, in the dtype of ``q``.
    """
    if isinstance(attn_mask, str):  # the spelling of 0.1: attention(q, k, v, "linear", ...)
        warnings.warn(
            f"subquad.attention(q, k, v, {attn_mask!r}): the fourth positional argument is attn_mask, as in "
            f"torch's scaled_dot_product_attention; pass mechanism={attn_mask!r} by keyword (the positional "
            "spelling goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        mechanism, attn_mask = attn_mask, None
    mech = get_mechanism(mechanism)
    tensors = _tensor_arguments(mech, attn_mask, options)
    if config is not None and options:
        raise ValueError(f"pass either config or options, not both (got options {sorted(options)})")
    if config is None:
        config = make_config(mech, **options)
    return mech(
        q, k, v, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale, config=config, state=state,
        enable_gqa=enable_gqa, dropout_p=dropout_p, **tensors,
    )  # fmt: skip

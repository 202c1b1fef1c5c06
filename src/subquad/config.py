"""Mechanism configs and the one spec grammar.

A mechanism's options live in exactly one place: its frozen ``Config`` dataclass, whose fields are
declared with ``option`` (default, help line, constraints). ``Config`` checks each field's type and
constraints when it is built. ``parse_value`` reads an option's value written as text, and
``subquad.spec`` reads a whole attention spec (``NAME:opt=value,...`` and head mixes).
"""

from __future__ import annotations

import functools
import math
import operator
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

__all__ = ["SPEC_GRAMMAR", "Config", "SpecGroup", "option", "parse_spec", "parse_value"]


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


@dataclass(frozen=True)
class SpecGroup:
    """One group of a parsed attention spec: a mechanism name, its head count (None: all heads, or
    in a mix the heads no other group claims) and its options as written."""

    name: str
    heads: int | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        written = ",".join(f"{k}={_written(v)}" for k, v in self.options)
        return f"{self.name}{':' + written if written else ''}{'' if self.heads is None else f'*{self.heads}'}"


SPEC_GRAMMAR = (
    "NAME, NAME:option=value,... (tuples as a|b), or a head mix joined by +, each group's heads after *: "
    "local:window=128*2+routing:clusters=16*2"
)


def parse_spec(text: str) -> tuple[SpecGroup, ...]:
    """Read an attention spec (``SPEC_GRAMMAR``): one group, or a head mix of several.

    ``local:window=64`` runs local attention on every head; ``local:window=128*2+routing*2`` runs
    it on two heads and routing on two; a group without ``*N`` in a mix takes the heads the others
    leave. Values read as ``parse_value`` reads them; ``a|b`` is a tuple. Names are checked where
    the spec is used (against the registry), options against the mechanism's config.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"an attention spec is {SPEC_GRAMMAR}; got {text!r}")
    groups = []
    for part in text.strip().split("+"):
        body, star, count = part.rpartition("*")
        if not star:
            body, count = part, ""
        heads = None
        if star:
            if not count.isdigit() or int(count) < 1:
                raise ValueError(f"in the spec {text!r}, {part!r} must end in *HEADS, a positive count")
            heads = int(count)
        name, _, written = body.strip().partition(":")
        if not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"an attention spec is {SPEC_GRAMMAR}; got {text!r} (bad name {name!r})")
        options = {}
        for item in filter(None, written.split(",")):
            key, sep, value = item.partition("=")
            if not sep or not key.strip() or key.strip() in options:
                raise ValueError(f"an attention spec is {SPEC_GRAMMAR}; got {text!r} (bad option {item!r})")
            options[key.strip()] = parse_value(value.strip(), tuples="|")
        groups.append(SpecGroup(name, heads, tuple(options.items())))
    return tuple(groups)


def joined_options(group: SpecGroup, options: typing.Mapping[str, Any], text: str) -> dict[str, Any]:
    """``group``'s options from the spec ``text`` with ``options`` (keyword arguments) joined; an
    option given in both is refused."""
    both = sorted(set(dict(group.options)) & set(options))
    if both:
        raise ValueError(f"option(s) {both} given both in the spec {text!r} and as arguments; pass each once")
    return {**dict(group.options), **options}


def one_mechanism(text: str, options: typing.Mapping[str, Any], mix: str) -> tuple[str, dict[str, Any]]:
    """The mechanism name and options of a spec of one group (``local:window=64``) where one
    mechanism runs on every head, ``options`` joined (``joined_options``). A head mix is refused
    as ``f"{text!r} is a head mix{mix}"``: ``mix`` says what runs one mechanism and where a mix goes."""
    groups = parse_spec(text)
    if len(groups) > 1 or groups[0].heads is not None:
        raise ValueError(f"{text!r} is a head mix{mix}")
    return groups[0].name, joined_options(groups[0], options, text)


def _written(value: Any) -> str:
    if isinstance(value, tuple):
        return "|".join(_written(v) for v in value)
    return str(value).lower() if isinstance(value, bool) else str(value)

"""Command-line flags from dataclass fields: the one way every ``subquad`` command declares its flags.

A job declares its settings as a dataclass whose fields are made with `setting` (a default, a help
line, and where needed a metavar, choices, another flag name, or a deprecated old name). `add_flags`
turns the fields into ``argparse`` flags and `flag_values` reads them back, so a job's flags, their
defaults and its library API cannot drift apart. The conventions, the same in every command:

- a flag is the field's name with dashes (``eval_every`` → ``--eval-every``) unless ``flag=`` names it;
- a ``bool`` field is a switch, ``--x`` / ``--no-x``;
- a sequence field takes several values; an optional field's default is shown as ``shown_default``;
- choices given as a mapping stand for their values (``--causal both`` → ``(False, True)``);
- a renamed flag keeps its old name for one release, hidden from the help, with a `DeprecationWarning`.

A command is a `Command`: its name, help, arguments and ``run``; ``subquad.cli`` only wires them.
"""

from __future__ import annotations

import argparse
import types
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

__all__ = [
    "DEVICE_HELP", "DTYPES", "Command", "add_flags", "check_choices", "flag_name", "flag_values", "named",
    "old_spellings", "option_parser", "setting", "typed",
]  # fmt: skip

DEVICE_HELP = "auto, cpu, cuda or cuda:N; auto: cuda where this torch sees one (default: %(default)s)"
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Command:
    """One ``subquad`` command: ``arguments(parser)`` declares its flags, ``run(args)`` returns the exit status."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None


def setting(
    default: Any = MISSING,
    help: str = "",
    *,
    metavar: str | None = None,
    choices: Sequence[str] | Mapping[str, Any] | None = None,
    shown_default: str | None = None,
    flag: str | None = None,
    old: str | None = None,
) -> Any:
    """A dataclass field with its command-line flag: a help line (followed by the default, or by
    ``shown_default`` in its place), a metavar, and choices (a mapping gives the value each one stands
    for); ``flag`` names the flag where the field's name would not say what it counts, and ``old`` is a
    flag's earlier name, still read (with a warning) for one release."""
    metadata = {"help": help, "metavar": metavar, "choices": choices, "shown_default": shown_default, "flag": flag,
                "old": old}  # fmt: skip
    return field(metadata=metadata) if default is MISSING else field(default=default, metadata=metadata)


def flag_name(f: Field) -> str:
    """A field's flag: ``--eval-every`` for ``eval_every``, or the name its `setting` gives."""
    return f.metadata.get("flag") or f"--{f.name.replace('_', '-')}"


def named(settings: Any, name: str) -> str:
    """How an error names the field ``name`` of the dataclass ``settings``: by its name, and by its
    flag too where the flag is named otherwise (``batch (--examples-per-step)``)."""
    f = next(f for f in fields(settings) if f.name == name)
    return f"{name} ({f.metadata['flag']})" if f.metadata.get("flag") else name


def add_flags(
    parser: argparse.ArgumentParser,
    settings: type,
    *,
    skip: Sequence[str] = (),
    positional: Sequence[str] = (),
    unset: Mapping[str, str] | None = None,
) -> None:
    """A flag for each field of the dataclass ``settings`` but those in ``skip``; ``positional`` fields
    are arguments without dashes. The flags of the fields in ``unset`` default to `None`, and the help
    says where their value then comes from (``unset[name]``)."""
    hints = typing.get_type_hints(settings)
    for f in fields(settings):
        if f.name in skip:
            continue
        if f.name in positional:
            parser.add_argument(f.name, metavar=f.metadata.get("metavar") or f.name.upper(), help=f.metadata["help"])
            continue
        kwargs = _flag(f, hints[f.name])
        if unset and f.name in unset:
            kwargs.update(default=None, help=f"{f.metadata['help']} (default: {unset[f.name]})")
        parser.add_argument(flag_name(f), dest=f.name, **kwargs)
        if f.metadata.get("old"):
            parser.add_argument(f.metadata["old"], dest=f.name, help=argparse.SUPPRESS,
                                action=_renamed(flag_name(f), kwargs))  # fmt: skip


def flag_values(args: argparse.Namespace, settings: type, *, skip: Sequence[str] = ()) -> dict[str, Any]:
    """The fields of ``settings`` (but ``skip``) as ``add_flags``'s flags parsed them: what a choice
    stands for, a tuple for several values."""
    values = {}
    for f in fields(settings):
        if f.name in skip or not hasattr(args, f.name):
            continue
        value, choices = getattr(args, f.name), f.metadata.get("choices")
        if isinstance(choices, Mapping) and not isinstance(value, bool) and value is not None:
            value = choices[value]
        elif isinstance(value, list):
            value = tuple(value)
        values[f.name] = value
    return values


def typed(parser: argparse.ArgumentParser, argv: Sequence[str]) -> frozenset[str]:
    """The settings ``argv`` itself sets on ``parser``: argparse fills the others with their defaults,
    so a flag given at its default value could not be told from one left out. Parsed again into a
    namespace holding a marker for each, which argparse keeps where no flag sets it."""
    unset = object()
    namespace = argparse.Namespace(**{a.dest: unset for a in parser._actions})
    parser.parse_args(list(argv), namespace)
    return frozenset(name for name, value in vars(namespace).items() if value is not unset)


def check_choices(settings: Any) -> None:
    """Raise ValueError, naming the field, the value and the choices, where a field of the dataclass
    instance ``settings`` declared with choices holds another value (as a config file may)."""
    for f in fields(settings):
        choices, value = f.metadata.get("choices"), getattr(settings, f.name)
        if choices is None or isinstance(choices, Mapping):  # a mapping's names stand for values its owner checks
            continue
        if value not in choices:
            raise ValueError(f"{f.name} must be one of {', '.join(map(str, choices))}, got {value!r}")


def _flag(f: Field, tp: Any) -> dict[str, Any]:
    """The ``add_argument`` keywords of a field, from its type and metadata."""
    meta = f.metadata
    default = None if f.default is MISSING else f.default
    required = f.default is MISSING and f.default_factory is MISSING
    if required:
        return {"required": True, "metavar": meta.get("metavar"), "help": meta["help"],
                **_typed(tp, meta)}  # fmt: skip
    shown = meta.get("shown_default") or "%(default)s"
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction, "default": default,
                "help": f"{meta['help']} (default: {'on' if default else 'off'})"}  # fmt: skip
    kwargs = {"metavar": meta.get("metavar"), "help": f"{meta['help']} (default: {shown})".lstrip()}
    choices = meta.get("choices")
    if isinstance(choices, Mapping):  # the flag takes a choice's name; its value is what it stands for
        default = next(name for name, value in choices.items() if value == default)
    typed = _typed(tp, meta)
    if "nargs" in typed and default is not None:
        default = list(default)
        if not default:  # nothing by default: the flag may be given with nothing too
            typed["nargs"] = "*"
            kwargs["help"] = f"{meta['help']} (default: {meta.get('shown_default') or 'none'})"
    return {**kwargs, **typed, "default": default}


def _typed(tp: Any, meta: Mapping[str, Any]) -> dict[str, Any]:
    """``type``, ``nargs`` and ``choices`` for a field's annotation."""
    if meta.get("choices") is not None:
        return {"choices": list(meta["choices"])}
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # an optional setting: None is its default
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) in (Sequence, tuple):
        return {"nargs": "+", "type": typing.get_args(tp)[0]}
    return {"type": tp}


class _Renamed(argparse.Action):
    """The action of a flag's old name: parse as the new one (``new``) does, and warn."""

    new = ""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option: str | None = None) -> None:
        warnings.warn(f"{option} is deprecated (until the next release): write {self.new}", DeprecationWarning,
                      stacklevel=2)  # fmt: skip
        setattr(namespace, self.dest, values)


def _renamed(new: str, kwargs: Mapping[str, Any]) -> type[argparse.Action]:
    """A `_Renamed` action class for the flag ``new``, parsing values as its ``kwargs`` do."""
    plain = {k: v for k, v in kwargs.items() if k in ("type", "nargs", "choices")}

    class Renamed(_Renamed):
        def __init__(self, option_strings: list[str], dest: str, **rest: Any) -> None:
            super().__init__(option_strings, dest, **{**rest, **plain})
            self.new = new

    return Renamed


def old_spellings(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with the spellings of the last release written as now, each with a `DeprecationWarning`
    (shown by default: it is attributed to the caller's caller, the program): a switch's ``--x yes|no``
    as ``--x`` / ``--no-x``, and a renamed flag's old name (``--old V``, ``--old=V``) as its new one."""
    subparsers = parser._subparsers._group_actions[0].choices if parser._subparsers else {}
    command = next((word for word in argv if word in subparsers), None)
    scope = [parser, subparsers[command]] if command else [parser]
    switches = {
        name
        for sub in [parser, *subparsers.values()]
        for action in sub._actions
        if isinstance(action, argparse.BooleanOptionalAction)
        for name in action.option_strings
        if not name.startswith("--no-")
    }
    renamed = {old: action.new for sub in scope for action in sub._actions if isinstance(action, _Renamed)
               for old in action.option_strings}  # fmt: skip
    out: list[str] = []
    for word in argv:
        flag, equals, value = word.partition("=")
        if out and out[-1] in switches and word in ("yes", "no"):
            switch = out.pop()
            now = switch if word == "yes" else f"--no-{switch[2:]}"
            _deprecated(f"{switch} {word}", now)
            word = now
        elif flag in renamed:
            _deprecated(flag, renamed[flag])
            word = renamed[flag] + equals + value
        out.append(word)
    return out


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated (until the next release): write {new}", DeprecationWarning, stacklevel=4)


def option_parser(tp: Any) -> tuple[Callable[[str], Any], str]:
    """A string parser and metavar for a mechanism option's annotation (``--NAME.OPTION`` values)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = next(a for a in args if a is not type(None))
        parse, metavar = option_parser(inner)
        return (lambda s: None if s.lower() == "none" else parse(s)), f"{metavar}|none"
    if origin is tuple:
        parse, metavar = option_parser(args[0])
        return (lambda s: tuple(parse(x) for x in s.split(","))), f"{metavar},..."
    if tp is bool:
        return _parse_bool, "true|false"
    return tp, tp.__name__.upper()


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")

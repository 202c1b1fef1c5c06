"""The ``subquad`` command: wires each job's commands (``subquad.flags.Command``) into one parser.

Every command declares its own flags and ``run`` where its job lives: ``list`` in ``subquad.listing``;
``bench`` in ``subquad.bench.command``; ``tune`` in ``subquad.bench.tune``; ``train``, ``evaluate``,
``generate``, ``upgrade-run`` and ``compare`` in ``subquad.train.command``; ``approx``, ``distill`` and
``heads`` in ``subquad.hf.command``.
"""

from __future__ import annotations

import argparse
import sys

from subquad.bench.command import BENCH
from subquad.bench.tune import TUNE
from subquad.flags import Command, old_spellings, typed
from subquad.hf.command import COMMANDS as HF_COMMANDS
from subquad.listing import LIST
from subquad.train.command import COMMANDS as TRAIN_COMMANDS
from subquad.version import __version__

__all__ = ["COMMANDS", "build_parser", "main"]

COMMANDS: tuple[Command, ...] = (LIST, BENCH, TUNE, *TRAIN_COMMANDS, *HF_COMMANDS)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = old_spellings(parser, sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    args.given = _given(parser, args.command, argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as exc:  # bad input: the message says what and how to fix it
        parser.exit(2, f"subquad {args.command}: error: {exc}\n")
    except ImportError as exc:  # an optional dependency this command needs: the message says which extra
        parser.exit(2, f"subquad {args.command}: error: {exc}\n")
    except KeyboardInterrupt:  # the user stopped it: what it saved is kept (train and distill: --resume)
        parser.exit(130, f"subquad {args.command}: interrupted\n")


def _given(parser: argparse.ArgumentParser, command: str, argv: list[str]) -> frozenset[str]:
    """The settings the command line itself set, for ``command`` (``subquad.flags.typed``)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return typed(sub, argv[argv.index(command) + 1 :])


def build_parser() -> argparse.ArgumentParser:
    """The ``subquad`` parser: a subcommand per `Command`, each with its own flags."""
    parser = argparse.ArgumentParser(prog="subquad", description="Sub-quadratic attention for PyTorch.")
    parser.add_argument("--version", action="version", version=f"subquad {__version__}")
    commands = parser.add_subparsers(dest="command")
    for command in COMMANDS:
        sub = commands.add_parser(command.name, help=command.help, description=command.description or command.help)
        command.arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


if __name__ == "__main__":
    sys.exit(main())

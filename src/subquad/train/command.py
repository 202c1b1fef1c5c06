"""The training job's commands: ``train``, ``evaluate``, ``generate``, ``upgrade-run`` and ``compare``,
each its flags (from a dataclass, through ``subquad.flags``) and its ``run``."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

from subquad.files import FileError
from subquad.flags import DEVICE_HELP, Command, add_flags, flag_values, old_spellings, setting, typed

__all__ = ["COMMANDS", "train_arguments"]

_RUN = "the run folder (subquad train --out)"


def train_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config``, a flag per `TrainConfig` field (``layers`` is for config files only), and ``--resume``."""
    from subquad.train.config import TrainConfig

    parser.add_argument(
        "--config", metavar="FILE", help="settings from a TOML file (or a run's config.json); flags given here win"
    )
    add_flags(parser, TrainConfig, skip=("layers",))
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")


def _train(args: argparse.Namespace) -> int:
    from subquad.train.loop import train

    summary = train(_train_config(args), resume=args.resume)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
        print(json.dumps(summary))
    return 0


def _train_config(args: argparse.Namespace):
    """The run's ``TrainConfig``: the flags typed win over ``--config``'s file, which wins over the defaults."""
    from subquad.train.config import TrainConfig, load_config_file, train_config

    given = load_config_file(args.config) if args.config else {}
    values = {"layers": given.get("layers", ())}
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    typed = getattr(args, "given", None)  # the flags typed on the command line (subquad.cli), which win
    for name, value in flag_values(args, TrainConfig, skip=("layers",)).items():
        left = name not in typed if typed is not None else value == defaults[name]  # called without the cli: by value
        values[name] = given[name] if name in given and left else value
    data = given.get("data")
    if data and values["data"] == data and not Path(data).exists():
        raise FileError(args.config, f"names data at {data}, where there is none", "pass --data PATH, or fix the file")
    return train_config(values, args.config)


@dataclass(frozen=True)
class _Evaluate:
    folder: str = setting(help=_RUN, metavar="RUN")
    split: str = setting("test", "val or test")
    batches: int | None = setting(
        None, "evaluate only the first N (text: windows; classification: batches; as eval_windows counts them)",
        shown_default="all", old="--windows",
    )  # fmt: skip
    step: int | None = setting(None, "a checkpoint's step", shown_default="the newest")
    device: str = setting("auto", DEVICE_HELP.removesuffix(" (default: %(default)s)"))


def _evaluate(args: argparse.Namespace) -> int:
    from subquad.train.use import evaluate_run

    print(json.dumps(evaluate_run(*flag_values(args, _Evaluate).values())))
    return 0


@dataclass(frozen=True)
class _Generate:
    folder: str = setting(help=_RUN, metavar="RUN")
    prompt: str = setting(help="the text to continue")
    new_bytes: int = setting(200, "bytes to generate", old="--tokens")
    temperature: float = setting(0.0, "0: greedy")
    top_k: int | None = setting(None, "sample among the k likeliest (with --temperature > 0)", shown_default="all")
    seed: int = setting(0, "the sampling seed")
    device: str = setting("auto", DEVICE_HELP.removesuffix(" (default: %(default)s)"))


def _generate(args: argparse.Namespace) -> int:
    from subquad.train.use import generate_text

    print(generate_text(*flag_values(args, _Generate).values()))
    return 0


def _upgrade(args: argparse.Namespace) -> int:
    from subquad.train.checkpoint import upgrade

    done = upgrade(args.folder)
    print(f"converted {len(done)} checkpoint(s) of {args.folder}" + "".join(f"\n  {p.name}" for p in done))
    return 0


@dataclass(frozen=True)
class _Compare:
    out: str = setting(help="the comparison folder: one run folder per variant")
    variants: tuple[str, ...] = setting(help="what to compare: specs or .toml configs", metavar="VARIANT")
    minutes: float | None = setting(
        None, "an equal wall-clock budget: each variant's steps fill this many minutes of training, from its speed "
        "in a short probe run", shown_default="the same --steps for all",
    )  # fmt: skip


def _compare_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, _Compare)
    parser.add_argument("train_flags", nargs=argparse.REMAINDER, help="after --: subquad train's flags for all")


def _compare(args: argparse.Namespace) -> int:
    from subquad.train.compare import compare, format_table, variant_arguments

    flags = args.train_flags[1:] if args.train_flags[:1] == ["--"] else args.train_flags
    if "--out" in flags or "--resume" in flags:
        raise ValueError(
            "pass --out before --; each variant gets its own folder in it, and reruns resume by themselves"
        )
    train_arguments(probe := argparse.ArgumentParser(prog="subquad compare (train flags)"))
    probe.parse_args(old_spellings(probe, flags))  # bad training flags fail before any variant runs
    configs = {}  # each variant's config, built as its run will build it: a bad variant fails before any runs
    for variant in args.variants:
        argv = old_spellings(probe, [*flags, *variant_arguments(variant)])
        parsed = probe.parse_args(argv)
        parsed.given = typed(probe, argv)
        configs[variant] = _train_config(parsed)
    rows = compare(list(args.variants), flags, args.out, args.minutes, configs)
    print(format_table(rows))
    print(f"wrote {args.out}/compare.json, compare.csv and compare.png")
    return 0


COMMANDS = (
    Command(
        "train", "train a byte-level language model on a text file, with checkpoints and --resume", train_arguments,
        _train, "Train a causal byte-level language model of any mechanism on a text file. Metrics go to "
        "OUT/metrics.jsonl, checkpoints to OUT/checkpoints; --resume continues a run exactly.",
    ),
    Command("evaluate", "a trained run's metric on a split, from its checkpoint",
            lambda p: add_flags(p, _Evaluate, positional=("folder",)), _evaluate),
    Command("generate", "continue a prompt with a trained text run",
            lambda p: add_flags(p, _Generate, positional=("folder",)), _generate),
    Command(
        "upgrade-run",
        "convert a run's checkpoints from the earlier pickle format (state.pt), which subquad no longer reads",
        lambda p: p.add_argument("folder", metavar="RUN", help="the run folder (subquad train or distill --out)"),
        _upgrade,
        "Convert the checkpoints of a subquad train or distill run written in the earlier pickle format (state.pt) "
        "to safetensors and JSON, which --resume reads. state.pt is read with torch's weights-only reader "
        "(torch >= 2.6), which builds tensors and plain data only and refuses anything else; run it on runs you "
        "trust. A run stopped halfway through can be upgraded again.",
    ),
    Command(
        "compare", "train several attention specs on one task at an equal budget and compare them",
        _compare_arguments, _compare,
        "Train each variant (NAME, NAME:option=value,... or a .toml config) with the same subquad train flags, one "
        "after another, each in its own process; rerunning skips finished variants and resumes an interrupted one. "
        "Example: subquad compare --out runs/cmp --variants full local:window=128 linear -- --data corpus.txt "
        "--steps 500",
    ),
)  # fmt: skip

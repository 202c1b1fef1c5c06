"""The ``subquad`` command: ``subquad list`` and ``subquad bench``.

Each mechanism's option flags (``--<mechanism>.<option> V [V ...]``) are generated from its config
dataclass; several values sweep the option, and the sweeps of one mechanism combine as a product.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
import types
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from subquad.files import FileError
from subquad.registry import Mechanism, get_mechanism, make_config, mechanism_names
from subquad.version import __version__

if TYPE_CHECKING:
    from subquad.bench.runner import BenchSettings

__all__ = ["main"]

_DEVICE_HELP = "auto, cpu, cuda or cuda:N; auto: cuda where this torch sees one (default: %(default)s)"


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(_old_switches(parser, sys.argv[1:] if argv is None else list(argv)))
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as exc:  # bad input: the message says what and how to fix it
        parser.exit(2, f"subquad {args.command}: error: {exc}\n")
    except ImportError as exc:  # an optional dependency this command needs: the message says which extra
        parser.exit(2, f"subquad {args.command}: error: {exc}\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="subquad", description="Sub-quadratic attention for PyTorch.")
    parser.add_argument("--version", action="version", version=f"subquad {__version__}")
    commands = parser.add_subparsers(dest="command")

    listing = commands.add_parser("list", help="every mechanism with its options and capabilities")
    listing.add_argument("--json", action="store_true", help="print JSON instead of text")
    listing.set_defaults(run=_run_list)

    bench = commands.add_parser(
        "bench",
        help="time, memory and error of mechanisms against full attention",
        description="Benchmark mechanisms against full attention over sequence lengths. The cells of each length "
        "run in a worker process of their own; time is the median of repeats after a warm-up; memory is the peak "
        "above the inputs; error is relative to full attention on iid and clustered inputs.",
    )
    _add_bench_arguments(bench)
    bench.set_defaults(run=_run_bench)

    train = commands.add_parser(
        "train",
        help="train a byte-level language model on a text file, with checkpoints and --resume",
        description="Train a causal byte-level language model of any mechanism on a text file. Metrics go "
        "to OUT/metrics.jsonl, checkpoints to OUT/checkpoints; --resume continues a run exactly.",
    )
    _add_train_arguments(train)
    train.set_defaults(run=_run_train)

    evaluate = commands.add_parser("evaluate", help="a trained run's metric on a split, from its checkpoint")
    evaluate.add_argument("folder", metavar="RUN", help="the run folder (subquad train --out)")
    evaluate.add_argument("--split", default="test", help="val or test (default: %(default)s)")
    evaluate.add_argument("--windows", type=int, default=None, help="evaluate only this many batches (default: all)")
    evaluate.add_argument("--step", type=int, default=None, help="a checkpoint's step (default: the newest)")
    evaluate.add_argument("--device", default="auto", help=_DEVICE_HELP)
    evaluate.set_defaults(run=_run_evaluate)

    generate = commands.add_parser("generate", help="continue a prompt with a trained text run")
    generate.add_argument("folder", metavar="RUN", help="the run folder (subquad train --out)")
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--tokens", type=int, default=200, help="bytes to generate (default: %(default)s)")
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)")
    generate.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest (default: all)")
    generate.add_argument("--seed", type=int, default=0, help="the sampling seed (default: %(default)s)")
    generate.add_argument("--device", default="auto", help=_DEVICE_HELP)
    generate.set_defaults(run=_run_generate)

    upgrade = commands.add_parser(
        "upgrade-run",
        help="convert a run's checkpoints from the earlier pickle format (state.pt), which subquad no longer reads",
        description="Convert the checkpoints of a subquad train or distill run written in the earlier pickle format "
        "(state.pt) to safetensors and JSON, which --resume reads. state.pt is read with torch's weights-only reader "
        "(torch >= 2.6), which builds tensors and plain data only and refuses anything else; run it on runs you "
        "trust. A run stopped halfway through can be upgraded again.",
    )
    upgrade.add_argument("folder", metavar="RUN", help="the run folder (subquad train or distill --out)")
    upgrade.set_defaults(run=_run_upgrade)

    compare = commands.add_parser(
        "compare",
        help="train several attention specs on one task at an equal budget and compare them",
        description="Train each variant (NAME, NAME:option=value,... or a .toml config) with the same subquad "
        "train flags, one after another, each in its own process; rerunning skips finished variants and "
        "resumes an interrupted one. Example: subquad compare --out runs/cmp --variants full local:window=128 "
        "linear -- --data corpus.txt --steps 500",
    )
    compare.add_argument("--out", required=True, help="the comparison folder: one run folder per variant")
    compare.add_argument("--variants", nargs="+", required=True, metavar="VARIANT", help="what to compare")
    compare.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="an equal wall-clock budget: each variant's steps fill this many minutes of training, from its "
        "speed in a short probe run (default: the same --steps for all)",
    )
    compare.add_argument("train_flags", nargs=argparse.REMAINDER, help="after --: subquad train's flags for all")
    compare.set_defaults(run=_run_compare)

    approx = commands.add_parser(
        "approx",
        help="swap mechanisms into a pretrained Hugging Face model and measure how closely they reproduce it",
        description="Run a local Hugging Face model (a folder, or a .gguf file) on real text, then each mechanism "
        "swapped in, and report embedding cosine, Spearman and a probe's accuracy (encoders) or perplexity and "
        "top-1 agreement (decoders), with the attention's time and memory and the whole model's forward time at the "
        "model's longest context. "
        "Example: subquad approx MODEL --data passages.jsonl --mechanisms improved-clustered:clusters=25 "
        "local:window=64 --out runs/approx",
    )
    approx.add_argument("model", help="a local Hugging Face model folder or .gguf file")
    approx.add_argument("--data", required=True, help="a .jsonl file (text, label), a text file or a folder of .txt")
    approx.add_argument("--mechanisms", nargs="+", default=[], metavar="SPEC",
                        help="NAME or NAME:option=value,... (tuple values as a|b)")  # fmt: skip
    approx.add_argument("--converted", nargs="+", default=[], metavar="FOLDER",
                        help="model folders subquad distill wrote (OUT/model) from the same model")  # fmt: skip
    approx.add_argument("--out", required=True, help="folder for approx.json and approx.png")
    approx.add_argument("--tokens", type=int, default=256, help="tokens per window (default: %(default)s)")
    approx.add_argument("--samples", type=int, default=300, help="windows measured (default: %(default)s)")
    approx.add_argument("--batch", type=int, default=8, help="windows per forward (default: %(default)s)")
    approx.add_argument("--context", type=int, default=None,
                        help="length of the speed measurement (default: the model's longest context)")  # fmt: skip
    approx.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the attention's and the model's speed (default: on)")  # fmt: skip
    approx.add_argument("--seed", type=int, default=0, help="window order and probe split (default: %(default)s)")
    approx.add_argument("--device", default="auto", help=_DEVICE_HELP)
    approx.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the model's dtype; quality is compared in float32 (default: %(default)s)")  # fmt: skip
    approx.set_defaults(run=_run_approx)

    distill = commands.add_parser(
        "distill",
        help="convert a pretrained Hugging Face model to a mechanism and train what it adds (attention transfer)",
        description="Convert a local Hugging Face model (a folder, or a .gguf file) to a mechanism (subquad.hf."
        "convert), then train the new parameters so that each layer's attention output matches the original's on "
        "the text (the original runs alongside; no labels), optionally followed by the whole attention blocks. "
        "Metrics go to OUT/metrics.jsonl, checkpoints to OUT/checkpoints (--resume continues a run exactly), the "
        "converted model to OUT/model (subquad.hf.from_pretrained loads it). "
        "Example: subquad distill MODEL --data passages.jsonl --mechanism linear:feature_map=hedgehog --out runs/d",
    )
    distill.add_argument("model", help="a local Hugging Face model folder or .gguf file")
    distill.add_argument("--data", required=True, help="a .jsonl file (text), a text file or a folder of .txt")
    distill.add_argument("--mechanism", required=True, metavar="SPEC",
                         help="NAME or NAME:option=value,... (tuple values as a|b)")  # fmt: skip
    distill.add_argument("--out", required=True, help="folder for the run")
    distill.add_argument("--layers", type=int, nargs="+", default=None, help="layers to convert (default: all)")
    distill_help = {
        "tokens": "tokens per window", "batch": "windows per step",
        "steps": "steps training only what conversion added",
        "finetune_steps": "then steps training the whole attention blocks too",
        "lr": "peak learning rate of the first stage", "finetune_lr": "peak learning rate of the second stage",
        "warmup": "warm-up steps of each stage", "heldout": "windows kept out of training, for the held-out error",
        "eval_every": "steps between held-out errors", "checkpoint_every": "steps between checkpoints",
        "calibration": "windows routing's k-means reads", "keep": "checkpoints kept",
        "seed": "window order and the new weights' initialisation",
        "device": "auto, cpu, cuda or cuda:N; auto: cuda where this torch sees one",
        "dtype": "the model's dtype: float32, bfloat16 or float16",
    }  # fmt: skip
    from subquad.hf.distill import DistillConfig

    for field in fields(DistillConfig):
        if field.name in distill_help:
            distill.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default,
                                 help=f"{distill_help[field.name]} (default: %(default)s)")  # fmt: skip
    distill.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    distill.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                         help="a progress bar (default: on)")  # fmt: skip
    distill.set_defaults(run=_run_distill)
    return parser


def _run_distill(args: argparse.Namespace) -> int:
    from subquad.hf.distill import DistillConfig, distill

    names = {f.name for f in fields(DistillConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["layers"] = tuple(args.layers) if args.layers else None
    summary = distill(DistillConfig(**values), resume=args.resume, progress=args.progress)
    print(
        f"held-out relative error {summary['heldout_error_before']:.4f} -> {summary['heldout_error_after']:.4f} in "
        f"{summary['seconds']:.0f} s of training; wrote {args.out}/model (subquad.hf.from_pretrained loads it)"
    )
    return 0


def _run_approx(args: argparse.Namespace) -> int:
    from subquad.hf.approx import approx, format_table

    for name in ("tokens", "samples", "batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.mechanisms and not args.converted:
        raise ValueError("pass --mechanisms SPEC ..., --converted FOLDER ..., or both")
    rows = approx(args.model, args.data, args.mechanisms, args.out, tokens=args.tokens, samples=args.samples,
                  batch=args.batch, context=args.context, speed=args.speed, seed=args.seed,
                  converted=args.converted, device=args.device, dtype=args.dtype)  # fmt: skip
    print(format_table(rows))
    print(f"wrote {args.out}/approx.json and approx.png")
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    from subquad.train.compare import compare, format_table

    flags = args.train_flags[1:] if args.train_flags[:1] == ["--"] else args.train_flags
    if "--out" in flags or "--resume" in flags:
        raise ValueError(
            "pass --out before --; each variant gets its own folder in it, and reruns resume by themselves"
        )
    _add_train_arguments(probe := argparse.ArgumentParser(prog="subquad compare (train flags)"))
    probe.parse_args(_old_switches(probe, flags))  # bad training flags fail before any variant runs
    rows = compare(args.variants, flags, args.out, args.minutes)
    print(format_table(rows))
    print(f"wrote {args.out}/compare.json, compare.csv and compare.png")
    return 0


def _run_evaluate(args: argparse.Namespace) -> int:
    from subquad.train.use import evaluate_run

    print(json.dumps(evaluate_run(args.folder, args.split, args.windows, args.step, args.device)))
    return 0


def _run_upgrade(args: argparse.Namespace) -> int:
    from subquad.train.checkpoint import upgrade

    done = upgrade(args.folder)
    print(f"converted {len(done)} checkpoint(s) of {args.folder}" + "".join(f"\n  {p.name}" for p in done))
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    from subquad.train.use import generate_text

    print(generate_text(args.folder, args.prompt, args.tokens, args.temperature, args.top_k, args.seed, args.device))
    return 0


# --------------------------------------------------------------------------------------------- train


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per `TrainConfig` field, and ``--resume``."""
    from subquad.train.loop import TrainConfig

    parser.add_argument(
        "--config", metavar="FILE", help="settings from a TOML file (or a run's config.json); flags given here win"
    )
    hints = typing.get_type_hints(TrainConfig)
    for f in fields(TrainConfig):
        flag = f"--{f.name.replace('_', '-')}"
        if f.name == "layers":  # structured: config files only
            continue
        if typing.get_origin(hints[f.name]) is tuple:  # name=value items
            meta = f.metadata
            parser.add_argument(flag, nargs="*", default=[], metavar=meta["metavar"], help=meta["help"])
        else:
            parser.add_argument(flag, **_setting_flag(f, hints[f.name]))
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")


def _run_train(args: argparse.Namespace) -> int:
    from subquad.train.loop import TrainConfig, load_config_file, train, train_config

    hints = typing.get_type_hints(TrainConfig)
    given = load_config_file(args.config) if args.config else {}
    values = {"layers": given.get("layers", ())}
    for f in fields(TrainConfig):
        if f.name != "layers":
            value = _setting_value(f, hints[f.name], args)
            # a flag left at its default yields to the file (argparse cannot tell "not given" apart)
            values[f.name] = given[f.name] if f.name in given and value == f.default else value
    data = given.get("data")
    if data and values["data"] == data and not Path(data).exists():
        raise FileError(args.config, f"names data at {data}, where there is none", "pass --data PATH, or fix the file")
    summary = train(train_config(values, args.config), resume=args.resume)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
        print(json.dumps(summary))
    return 0


# ---------------------------------------------------------------------------------------------- list


def _describe(mech: Mechanism) -> dict[str, Any]:
    hints = typing.get_type_hints(mech.config)
    return {
        "name": mech.name,
        "summary": mech.summary,
        "paper": mech.paper,
        "causal": mech.causal,
        "cross": mech.cross,
        "longer_queries": mech.cross and mech.longer_queries,
        "recurrent": mech.recurrent,
        "gqa": "reads grouped K/V in place" if mech.gqa else "repeats grouped K/V heads (a copy per call)",
        "dropout": mech.dropout,
        "decoding": getattr(mech.decoder, "description", None),
        "dtypes": [str(d).replace("torch.", "") for d in mech.dtypes],
        "tensor_args": list(mech.tensor_args),
        "options": [
            {
                "name": f.name,
                "type": _type_name(hints[f.name]),
                "default": f.default if f.default is not MISSING else None,
                "choices": list(f.metadata["choices"]) if f.metadata.get("choices") else None,
                "help": f.metadata.get("help", ""),
            }
            for f in fields(mech.config)
        ],
    }


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _run_list(args: argparse.Namespace) -> int:
    described = [_describe(get_mechanism(name)) for name in mechanism_names()]
    if args.json:
        print(json.dumps(described, indent=2, default=str))
        return 0
    yes = {True: "yes", False: "no"}
    cross = lambda d: "yes" if d["longer_queries"] else "yes (L <= S)" if d["cross"] else "no"  # noqa: E731
    for d in described:
        print(f"{d['name']}: {d['summary']}")
        if d["paper"]:
            print(f"  paper: {d['paper']}")
        print(
            f"  causal: {yes[d['causal']]}   cross (L != S): {cross(d)}   "
            f"recurrent: {yes[d['recurrent']]}   dtypes: {', '.join(d['dtypes'])}"
        )
        print(f"  cached decoding: {d['decoding'] or 'none (generate with use_cache=False)'}")
        print(f"  grouped-query (enable_gqa): {d['gqa']}   dropout_p: {yes[d['dropout']]}")
        if d["tensor_args"]:
            print(f"  extra call arguments: {', '.join(d['tensor_args'])}")
        print("  options:" if d["options"] else "  options: none")
        for o in d["options"]:
            choices = f"  {{{', '.join(map(str, o['choices']))}}}" if o["choices"] else ""
            print(f"    {o['name']}: {o['type']} = {o['default']!r}{choices}  {o['help']}")
        print()
    return 0


# --------------------------------------------------------------------------------------------- bench


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per `BenchSettings` field, then ``--out``, ``--no-plots`` and each mechanism's options."""
    from subquad.bench.runner import GRIDS, BenchSettings

    names = mechanism_names()
    hints = typing.get_type_hints(BenchSettings)
    for f in fields(BenchSettings):
        if f.name == "variants":  # mechanism names here; with the --NAME.OPTION flags they make the variants
            parser.add_argument(
                "--mechanisms", nargs="+", default=names, metavar="SPEC",
                help=f"mechanisms to run, each NAME or NAME:option=value,... (default: all: {' '.join(names)}); "
                "full always runs as baseline",
            )  # fmt: skip
        elif f.name in GRIDS["default"]:  # unset, it comes from --grid
            flag = _setting_flag(f, hints[f.name])
            shown = "; ".join(f"{grid}: {_shown(values[f.name])}" for grid, values in GRIDS.items())
            flag["help"] = f"{f.metadata['help']} (default: from --grid, {shown})"
            parser.add_argument(f"--{f.name.replace('_', '-')}", **{**flag, "default": None})
        else:
            parser.add_argument(f"--{f.name.replace('_', '-')}", **_setting_flag(f, hints[f.name]))
    parser.add_argument(
        "--grid",
        choices=list(GRIDS),
        default="default",
        help="default: N = 256 … 4096 with short warm-ups, about 4 minutes on 2 CPU cores; full: N up to 16384 "
        "with 2 s warm-ups, half an hour or more (default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("subquad-bench"),
        help="folder for results.csv, results.json and the plots (default: %(default)s)",
    )
    parser.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                        help="write the PNG plots (default: on)")  # fmt: skip
    for name in names:
        mech = get_mechanism(name)
        group = parser.add_argument_group(f"{name} options (several values sweep)")
        hints = typing.get_type_hints(mech.config)
        for f in fields(mech.config):
            parse, metavar = _option_parser(hints[f.name])
            # argparse compares a whole parsed value with the choices, so only scalar options get them;
            # the config dataclass checks every value anyway.
            choices = None if typing.get_origin(hints[f.name]) is tuple else f.metadata.get("choices")
            group.add_argument(
                f"--{name}.{f.name}", dest=f"opt:{name}:{f.name}", nargs="+", type=parse, metavar=metavar,
                choices=choices, help=f"{f.metadata.get('help', '')} (default: {f.default!r})",
            )  # fmt: skip


def _old_switches(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with the old ``--x yes|no`` of a boolean setting written ``--x`` / ``--no-x``, as
    flags are now; it still works until the next release, with a warning."""
    parsers = [parser, *(parser._subparsers._group_actions[0].choices.values() if parser._subparsers else ())]
    switches = {
        name
        for sub in parsers
        for action in sub._actions
        if isinstance(action, argparse.BooleanOptionalAction)
        for name in action.option_strings
        if not name.startswith("--no-")
    }
    out: list[str] = []
    for word in argv:
        if out and out[-1] in switches and word in ("yes", "no"):
            flag = out.pop()
            plain = flag if word == "yes" else f"--no-{flag[2:]}"
            warnings.warn(f"{flag} {word} is deprecated (until the next release): write {plain}", DeprecationWarning,
                          stacklevel=3)  # fmt: skip
            out.append(plain)
        else:
            out.append(word)
    return out


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _setting_flag(f: Field, tp: Any) -> dict[str, Any]:
    """The ``add_argument`` keywords of a `BenchSettings` field, from its type and metadata."""
    meta, default = f.metadata, f.default
    shown = meta["shown_default"] or "%(default)s"
    kwargs = {"metavar": meta["metavar"], "help": f"{meta['help']} (default: {shown})".lstrip()}
    if isinstance(meta["choices"], Mapping) and set(meta["choices"]) == {"yes", "no"}:  # a boolean: --x / --no-x
        return {
            "action": argparse.BooleanOptionalAction,
            "default": default,
            "help": f"{meta['help']} (default: {'on' if default else 'off'})",
        }
    if meta["choices"] is not None:  # a mapping's choices stand for its values
        choices = meta["choices"]
        if isinstance(choices, Mapping):
            default = next(name for name, value in choices.items() if value == default)
        return {**kwargs, "choices": list(choices), "default": default}
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # an optional setting: None is its default
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is Sequence:
        return {**kwargs, "nargs": "+", "type": typing.get_args(tp)[0], "default": list(default)}
    return {**kwargs, "type": tp, "default": default}


def _bench_settings(args: argparse.Namespace) -> BenchSettings:
    """The `BenchSettings` that ``subquad bench``'s parsed arguments ask for."""
    from subquad.bench.runner import BenchSettings

    hints = typing.get_type_hints(BenchSettings)
    return BenchSettings(**{f.name: _setting_value(f, hints[f.name], args) for f in fields(BenchSettings)})


def _setting_value(f: Field, tp: Any, args: argparse.Namespace) -> Any:
    """One `BenchSettings` field's value from the parsed arguments: what a choice stands for, a tuple of
    several values."""
    from subquad.bench.runner import GRIDS

    if f.name == "variants":
        return _variants(args)
    value, choices = getattr(args, f.name), f.metadata["choices"]
    if value is None and f.name in GRIDS[args.grid]:
        return GRIDS[args.grid][f.name]
    if isinstance(choices, Mapping):
        return value if isinstance(value, bool) else choices[value]
    return tuple(value) if typing.get_origin(tp) in (Sequence, tuple) else value


def _option_parser(tp: Any) -> tuple[Callable[[str], Any], str]:
    """A string parser and metavar for a config field's annotation."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = next(a for a in args if a is not type(None))
        parse, metavar = _option_parser(inner)
        return (lambda s: None if s.lower() == "none" else parse(s)), f"{metavar}|none"
    if origin is tuple:
        parse, metavar = _option_parser(args[0])
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


def _variants(args: argparse.Namespace) -> list[Any]:
    from subquad.bench.runner import Variant

    sweeps: dict[str, dict[str, list[Any]]] = {}
    for key, values in vars(args).items():
        if key.startswith("opt:") and values is not None:
            _, mech, option = key.split(":")
            sweeps.setdefault(mech, {})[option] = values
    specs = [_bench_spec(text) for text in args.mechanisms]
    unselected = sorted(set(sweeps) - {name for name, _ in specs})
    if unselected:
        raise ValueError(f"options given for {unselected}, which --mechanisms does not select")
    variants = []
    for name, fixed in specs:
        options = {k: [v] for k, v in fixed.items()} | sweeps.get(name, {})  # a --NAME.OPTION sweep wins
        for combo in itertools.product(*options.values()):
            variants.append(Variant(name, tuple(zip(options, combo))))
    return variants


def _bench_spec(text: str) -> tuple[str, dict[str, Any]]:
    """One ``--mechanisms`` entry: a spec of one mechanism (a bench cell runs one on every head)."""
    from subquad.config import parse_spec

    groups = parse_spec(text)
    if len(groups) > 1 or groups[0].heads is not None:
        raise ValueError(
            f"{text!r} is a head mix; a bench cell times one mechanism on all heads: give each as its own spec"
        )
    make_config(groups[0].name, **dict(groups[0].options))  # an unknown name or option raises now
    return groups[0].name, dict(groups[0].options)


def _run_bench(args: argparse.Namespace) -> int:
    import torch

    from subquad.bench import report
    from subquad.bench.runner import run_bench

    settings = _bench_settings(args)
    args.out.mkdir(parents=True, exist_ok=True)  # before the run, so a bad folder fails at once
    threads = settings.threads or torch.get_num_threads()
    title = f"B={settings.batch} H={settings.heads} D={settings.head_dim} {settings.dtype} {settings.device}"
    title += f", {threads} threads"
    cells = settings.cells()
    print(f"subquad {__version__} bench: {len(cells)} cells, {title}, torch {torch.__version__}", file=sys.stderr)
    meta = {
        "subquad": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "machine": _machine(), "threads": threads,
        "settings": {k: v for k, v in vars(args).items() if k not in ("run", "out") and not callable(v)},
    }  # fmt: skip
    started = time.time()
    done: list[dict] = []

    def save(rows: list[dict]) -> None:
        """results.csv and results.json as they stand: after each cell, so a stopped run keeps its rows."""
        done[:] = rows
        elapsed = round(time.time() - started, 1)
        report.write_csv(rows, args.out / "results.csv")
        report.write_json(rows, {**meta, "elapsed_s": elapsed, "cells_done": len(rows), "cells": len(cells)},
                          args.out / "results.json")  # fmt: skip

    try:
        with _Progress() as progress:
            rows = run_bench(settings, progress, on_row=save)
    except KeyboardInterrupt:
        print(report.format_table(done) if done else "no cell finished")
        note = report.short_op_note(done)
        if note:
            print(note)
        print(f"\ninterrupted after {len(done)} of {len(cells)} cells; their rows are in {args.out}", file=sys.stderr)
        return 130
    save(rows)  # also when there was no cell to run
    elapsed = time.time() - started

    print(report.format_table(rows))
    print("\ntime = median per call; × full = median of time ÷ full attention's, timed call for call in the cell;")
    print("peak MB = above the inputs;", end=" ")
    print("err = ‖out − full‖ / ‖full‖ on iid and clustered q, k (float64 reference on sampled rows).")
    note = report.short_op_note(rows)
    if note:
        print(note)
    if len(settings.lengths) > 1:
        print("\n" + report.format_crossovers(rows))
        print("crossover N = the smallest N from which the mechanism beats full at every longer N measured.")
    written = [args.out / "results.csv", args.out / "results.json"]
    if args.plots:
        try:
            written += report.plot_results(rows, args.out, title)
        except ImportError:
            print("matplotlib is not installed: no plots (pip install 'subquad[bench]')", file=sys.stderr)
    print(f"\nwrote {', '.join(map(str, written))} in {elapsed:.0f} s")
    failed = [r for r in rows if r.get("error")]
    if failed:
        print(f"{len(failed)} of {len(rows)} cells failed; see the table", file=sys.stderr)
    return 1 if failed else 0


def _machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class _Progress:
    """A progress bar on a terminal (with rich installed), else one line per cell on stderr."""

    def __enter__(self) -> Callable[[int, int, str], None]:
        self._bar = None
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            Progress = None
        if Progress is None or not sys.stderr.isatty():  # a log file gets one line per cell
            return lambda i, n, label: print(f"[{i}/{n}] {label}", file=sys.stderr, flush=True)
        self._bar = Progress(
            TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            transient=False,
        )  # fmt: skip
        self._bar.__enter__()
        task = None

        def update(i: int, n: int, label: str) -> None:
            nonlocal task
            if task is None:
                task = self._bar.add_task(label, total=n)
            self._bar.update(task, completed=i, description=label)

        return update

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)


if __name__ == "__main__":
    sys.exit(main())

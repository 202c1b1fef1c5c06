"""The pretrained-model job's commands: ``approx`` and ``distill``, each its flags (from `ApproxConfig`
and `DistillConfig`, through ``subquad.flags``) and its ``run``."""

from __future__ import annotations

import argparse

from subquad.flags import Command, add_flags, flag_values

__all__ = ["COMMANDS"]


def _approx_arguments(parser: argparse.ArgumentParser) -> None:
    from subquad.hf.approx import ApproxConfig

    add_flags(parser, ApproxConfig, positional=("model",))


def _approx(args: argparse.Namespace) -> int:
    from subquad.hf.approx import ApproxConfig, format_table, run_approx

    config = ApproxConfig(**flag_values(args, ApproxConfig))
    if not config.mechanisms and not config.converted:
        raise ValueError("pass --mechanisms SPEC ..., --converted FOLDER ..., or both")
    rows = run_approx(config)
    print(format_table(rows))
    print(f"wrote {config.out}/approx.json and approx.png")
    return 0


def _distill_arguments(parser: argparse.ArgumentParser) -> None:
    from subquad.hf.distill import DistillConfig

    add_flags(parser, DistillConfig, positional=("model",))
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="a progress bar (default: on)")  # fmt: skip


def _distill(args: argparse.Namespace) -> int:
    from subquad.hf.distill import DistillConfig, distill

    summary = distill(DistillConfig(**flag_values(args, DistillConfig)), resume=args.resume, progress=args.progress)
    print(
        f"held-out relative error {summary['heldout_error_before']:.4f} -> {summary['heldout_error_after']:.4f} in "
        f"{summary['seconds']:.0f} s of training; wrote {args.out}/model (subquad.hf.from_pretrained loads it)"
    )
    return 0


COMMANDS = (
    Command(
        "approx", "swap mechanisms into a pretrained Hugging Face model and measure how closely they reproduce it",
        _approx_arguments, _approx,
        "Run a local Hugging Face model (a folder, or a .gguf file) on real text, then each mechanism swapped in, and "
        "report embedding cosine, Spearman and a probe's accuracy (encoders) or perplexity and top-1 agreement "
        "(decoders), with the attention's time and memory and the whole model's forward time at the model's longest "
        "context. Example: subquad approx MODEL --data passages.jsonl --mechanisms improved-clustered:clusters=25 "
        "local:window=64 --out runs/approx",
    ),
    Command(
        "distill", "convert a pretrained Hugging Face model to a mechanism and train what it adds (attention transfer)",
        _distill_arguments, _distill,
        "Convert a local Hugging Face model (a folder, or a .gguf file) to a mechanism (subquad.hf.convert), then "
        "train the new parameters so that each layer's attention output matches the original's on the text (the "
        "original runs alongside; no labels), optionally followed by the whole attention blocks. Metrics go to "
        "OUT/metrics.jsonl, checkpoints to OUT/checkpoints (--resume continues a run exactly), the converted model "
        "to OUT/model (subquad.hf.from_pretrained loads it). "
        "Example: subquad distill MODEL --data passages.jsonl --mechanism linear:feature_map=hedgehog --out runs/d",
    ),
)  # fmt: skip

"""The pretrained-model job's commands: ``approx``, ``distill`` and ``heads``, each its flags (from
`ApproxConfig`, `DistillConfig` and `HeadsConfig`, through ``subquad.flags``) and its ``run``."""

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


def _heads_arguments(parser: argparse.ArgumentParser) -> None:
    from subquad.hf.heads import HeadsConfig

    add_flags(parser, HeadsConfig, positional=("model",))


def _heads(args: argparse.Namespace) -> int:
    from subquad.hf.heads import HeadsConfig, format_scores, run_heads

    config = HeadsConfig(**flag_values(args, HeadsConfig))
    scores, _ = run_heads(config)
    print(format_scores(scores, config.per_layer, config.total))
    print(f"wrote {config.out}/heads.json and {config.out}/plan.toml (subquad approx MODEL --mechanisms "
          f"{config.out}/plan.toml measures it)")  # fmt: skip
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
    Command(
        "heads", "find the heads of a pretrained decoder that fetch what it read long before, and write a layer plan",
        _heads_arguments, _heads,
        "Run a local decoder (a folder, or a .gguf file) on needle cases made of your text (a sentence giving a "
        "number, the question asking for it) and score each query head by the attention its answer gives the needle "
        "(subquad.hf.heads). Writes OUT/heads.json and OUT/plan.toml: in each layer the --per-layer key/value heads "
        "that fetch most (or the --total that fetch most in any layer) take --far (default retrieval's far blocks), "
        "the others --near (a window with sinks), so every layer stays sub-quadratic. Example: subquad heads MODEL "
        "--data train.jsonl --out runs/heads; then subquad approx MODEL --data heldout.jsonl --mechanisms "
        "runs/heads/plan.toml --out runs/approx",
    ),
)  # fmt: skip

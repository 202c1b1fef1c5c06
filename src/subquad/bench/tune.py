"""``subquad tune``: time the tuning knobs on this machine and write its profile (``kernels.profile``).

The profile is keyed by CPU model, thread count and torch version, and every later call with that
thread count on this machine uses it (``subquad bench`` names it in its header and results). The
measurement itself is ``bench.autotune``; it runs with no profile applied, from the defaults.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from subquad.files import out_folder
from subquad.flags import Command
from subquad.version import __version__

__all__ = ["TUNE"]


def arguments(parser: argparse.ArgumentParser) -> None:
    from subquad.bench.autotune import KNOBS

    names = [k.name for k in KNOBS]
    parser.add_argument("--budget", type=float, default=240.0, metavar="SECONDS",
                        help="time to spend measuring, shared between the knobs (default: %(default)s)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=None,
                        help="the thread count to tune for, and the profile's (default: torch's)")  # fmt: skip
    parser.add_argument("--knobs", nargs="+", choices=names, default=names, metavar="KNOB",
                        help=f"the knobs to tune (default: all: {' '.join(names)})")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None,
                        help="write the profile here instead of this machine's cache folder (use it with "
                        "SUBQUAD_TUNING_PROFILE=PATH)")  # fmt: skip
    parser.add_argument("--show", action="store_true", help="print the profile in use at this thread count and stop")
    parser.add_argument("--reset", action="store_true", help="delete this machine's profile at this thread count")


def run(args: argparse.Namespace) -> int:
    import torch

    from subquad.kernels import profile

    if args.budget is not None and not args.budget > 0:
        raise ValueError(f"--budget is seconds of measurement and must be > 0, got {args.budget}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    path = args.out or profile.profile_path(threads)
    if args.show:
        print(f"tuning profile at {threads} threads: {profile.active().describe()}")
        print(f"this machine's profile path: {profile.profile_path(threads)}")
        return 0
    if args.reset:
        target = profile.profile_path(threads)
        existed = target.is_file()
        target.unlink(missing_ok=True)
        print(f"{'deleted' if existed else 'there was no'} profile {target}")
        return 0
    if path.is_dir():  # before minutes of measurement that could not be written
        raise ValueError(f"--out {path} is a folder; pass the profile's file path")
    out_folder(path.parent, "--out's folder")
    return _measure(args, path, threads)


def _measure(args: argparse.Namespace, path: Path, threads: int) -> int:
    import torch

    from subquad.bench import autotune
    from subquad.bench.command import Progress
    from subquad.kernels import profile

    knobs = tuple(k for k in autotune.KNOBS if k.name in args.knobs)
    cpu = profile.cpu_model()
    print(f"subquad {__version__} tune: {len(knobs)} knobs in about {args.budget:.0f} s on {cpu}, {threads} threads, "
          f"torch {torch.__version__}", file=sys.stderr)  # fmt: skip
    saved = os.environ.get(profile.ENV)
    os.environ[profile.ENV] = "off"  # measured from the defaults, whatever profile exists
    started = time.time()
    try:
        with Progress() as progress:
            records = autotune.tune(args.budget, knobs, progress)
    finally:
        if saved is None:
            os.environ.pop(profile.ENV, None)
        else:
            os.environ[profile.ENV] = saved
    values = {r["knob"]: r["chosen"] for r in records if r["chosen"] != r["default"]}
    record = {"cpu": cpu, "threads": threads, "torch": torch.__version__, "subquad": __version__,
              "python": platform.python_version(), "seconds": round(time.time() - started, 1),
              "written": time.strftime("%Y-%m-%dT%H:%M:%S"), "measured": records}  # fmt: skip
    profile.write_profile(path, values, record)
    profile.forget()
    print(_table(records))
    print(f"\nscore = geometric mean over the knob's calls of time ÷ the default's (medians); a value is taken where "
          f"it is ≥ {autotune.GAIN:.0%} faster and no call ≥ {autotune.HARM:.0%} slower")  # fmt: skip
    print(f"wrote {path} ({len(values)} of {len(records)} knobs changed)")
    return 0


def _table(records: list[dict]) -> str:
    lines = [f"{'knob':<24} {'default':>9} {'chosen':>9} {'score':>7} {'rounds':>6}  best other (score)"]
    for r in records:
        others = {v: s for v, s in r["score"].items() if int(v) != r["chosen"]}
        best = min(others, key=others.__getitem__, default=None)
        shown = f"{best} ({others[best]:.3f})" if best is not None else "-"
        lines.append(f"{r['knob']:<24} {r['default']:>9} {r['chosen']:>9} {r['score'][str(r['chosen'])]:>7.3f} "
                     f"{r['rounds']:>6}  {shown}")  # fmt: skip
    return "\n".join(lines)


TUNE = Command(
    "tune",
    "time the block-size knobs on this machine and write its tuning profile, used automatically",
    arguments,
    run,
    "Time the tuning knobs (kernels.tuning) that decide block sizes on this CPU, at this thread count, within a "
    "time budget, and write a profile keyed by CPU model, thread count and torch version in the user's cache "
    "folder ($SUBQUAD_CACHE, else $XDG_CACHE_HOME/subquad, else ~/.cache/subquad). Every later call at that "
    "thread count uses it; SUBQUAD_TUNING_PROFILE=off runs with the defaults. No value changes what a mechanism "
    "computes, only how fast.",
)

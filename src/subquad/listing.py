"""``subquad list``: every registered mechanism with its options and capabilities, as text or JSON."""

from __future__ import annotations

import argparse
import json
import typing
from dataclasses import MISSING, fields
from typing import Any

from subquad.flags import Command
from subquad.registry import Mechanism, get_mechanism, mechanism_names

__all__ = ["LIST", "describe"]


def describe(mech: Mechanism) -> dict[str, Any]:
    """A mechanism's record as ``subquad list --json`` gives it."""
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


def _run(args: argparse.Namespace) -> int:
    described = [describe(get_mechanism(name)) for name in mechanism_names()]
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


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


LIST = Command("list", "every mechanism with its options and capabilities", _arguments, _run)

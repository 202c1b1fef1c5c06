"""The README, CI and lint stay true to the code."""

import re
import subprocess
import sys
from pathlib import Path

import subquad

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readme_test_command():
    bench, tests = _readme_commands()[:2]
    assert "subquad bench" in bench and "pytest" in tests
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_table_lists_every_registered_mechanism():
    rows = re.findall(r"^\| `([\w-]+)` \|", (ROOT / "README.md").read_text(), flags=re.M)
    assert rows == subquad.mechanism_names()


def test_ruff_is_clean():
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "src", "tests"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout


def test_readme_quick_start_runs():
    (example,) = re.findall(r"```python\n(.+?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["out"].shape == (2, 8, 1024, 64)
    assert namespace["y"].shape == (2, 100, 512)
    assert namespace["tokens"].shape == (1, 66)

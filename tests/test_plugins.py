"""A mechanism added from outside subquad, by an entry point, gets everything a built-in one gets.

``tests/plugins`` holds a package as an installer would leave it: ``subquad_toy_plugin.py`` (block-
local attention, built from subquad's kernels) and its ``.dist-info`` naming it under the entry-point
group ``subquad.mechanisms``. Put on the path of a fresh interpreter, it is registered with the
built-ins: ``subquad list`` shows it, the bench times it, the contract suite and the GPU tests run on
it. Nothing in subquad names it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
PLUGINS = Path(__file__).parent / "plugins"


def _run(args, tmp_path=None, path=PLUGINS, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(path), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_subquad_list_shows_a_plugin_mechanism():
    done = _run(["-m", "subquad", "list"])
    assert done.returncode == 0, done.stderr
    assert "toy-blocks: block-local attention (a plugin example)" in done.stdout
    assert "size: int = 16" in done.stdout
    assert done.stdout.index("toy-blocks") > done.stdout.index("pattern:")  # after the built-ins


def test_the_contract_suite_runs_on_a_plugin_mechanism():
    done = _run(["-m", "pytest", "tests/contract", "-q", "-p", "no:cacheprovider", "-k", "toy-blocks"], timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    passed = int(done.stdout.strip().splitlines()[-1].split(" passed")[0].split()[-1])
    assert passed >= 20  # every property, on each of its three examples


def test_the_gpu_tests_include_a_plugin_mechanism():
    done = _run(["-m", "pytest", "tests/test_cuda.py", "--collect-only", "-q", "-p", "no:cacheprovider"])
    assert done.returncode == 0, done.stdout[-2000:]
    assert "test_float64_on_cuda_equals_the_cpu[self-toy-blocks[example 0]]" in done.stdout
    assert "test_low_precision_on_cuda_is_finite_and_close[dtype0-toy-blocks[example 1]]" in done.stdout


def test_the_bench_times_a_plugin_mechanism_against_full(tmp_path):
    args = ["-m", "subquad", "bench", "--mechanisms", "toy-blocks", "--lengths", "64", "--heads", "2"]
    args += ["--head-dim", "8", "--causal", "yes", "--backward", "no", "--repeats", "2", "--max-seconds", "0.1"]
    args += ["--warmup-seconds", "0", "--error-rows", "8", "--no-plots", "--out", str(tmp_path)]
    done = _run(args)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    (toy,) = [r for r in rows if r["mechanism"] == "toy-blocks"]
    assert toy["time_s"] > 0 and toy["ratio"] > 0 and toy["error_iid"] >= 0 and not toy.get("error")


def test_a_broken_plugin_is_skipped_with_a_warning(tmp_path):
    info = tmp_path / "broken_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[subquad.mechanisms]\nbroken = broken_plugin\n")
    (tmp_path / "broken_plugin.py").write_text("raise ImportError('no such dependency')\n")
    done = _run(["-W", "always", "-c", "import subquad; print(subquad.mechanism_names())"], path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "'full'" in done.stdout and "broken" not in done.stdout
    assert "subquad plugin 'broken' (broken_plugin) failed to load and is skipped: ImportError: no such" in done.stderr

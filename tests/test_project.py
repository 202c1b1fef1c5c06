"""The README, CI and lint stay true to the code."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import subquad

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readme_test_command():
    bench, tests = _readme_commands()[:2]
    assert "subquad bench" in bench and "pytest" in tests
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_package_s_version_is_the_one_pip_installs_and_the_changelog_s_newest():
    declared = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
    newest = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), flags=re.M).group(1)
    assert subquad.__version__ == declared and declared.startswith(newest + ".")


def test_readme_table_lists_every_registered_mechanism():
    rows = re.findall(r"^\| `([\w-]+)` \|", (ROOT / "README.md").read_text(), flags=re.M)
    assert rows == subquad.mechanism_names()


def test_ruff_is_clean():
    pytest.importorskip("ruff", reason="ruff is a dev dependency: pip install -e '.[dev]'")
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "src", "tests"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.+?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_quick_start_runs():
    example = _python_blocks()[0]
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["out"].shape == (2, 8, 1024, 64)
    assert namespace["y"].shape == (2, 100, 512)
    assert namespace["torch_out"].shape == (100, 2, 512) and namespace["weights"] is None
    assert [g.heads for g in namespace["mixed"].groups] == [g.heads for g in namespace["same"].groups] == [4, 4]
    assert namespace["tokens"].shape == (1, 66)


def test_no_import_goes_up_the_layers():
    """``scripts/layers.py``: the design's layers, lowest first; no module imports one above it."""
    spec = importlib.util.spec_from_file_location("layers", Path(__file__).parent.parent / "scripts" / "layers.py")
    layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layers)
    assert layers.upward(Path(subquad.__file__).parent) == []


def test_no_file_function_or_class_is_over_the_size_limits(tmp_path):
    """``scripts/sizes.py``: files at most 400 lines (mechanisms 300), functions 60, classes 120."""
    spec = importlib.util.spec_from_file_location("sizes", Path(__file__).parent.parent / "scripts" / "sizes.py")
    sizes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sizes)
    assert sizes.oversize(Path(subquad.__file__).parent) == []
    # and it sees what is over: a 61-line function in a 301-line mechanism file
    (tmp := tmp_path / "subquad" / "mechanisms").mkdir(parents=True)
    (tmp / "big.py").write_text("def f():\n" + "    x = 1\n" * 60 + "\n" * 240)
    assert sizes.oversize(tmp.parent) == [
        "subquad/mechanisms/big.py: 301 lines (at most 300)",
        "subquad/mechanisms/big.py:1: f is 61 lines (at most 60)",
    ]


def test_readme_hugging_face_example_runs(tmp_path):
    """The README's subquad.hf block, with ``path`` a tiny BERT saved from a config."""
    transformers = pytest.importorskip("transformers", minversion="5")
    (example,) = [block for block in _python_blocks() if "subquad.hf.use" in block]
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64)  # fmt: skip
    transformers.BertModel(config).save_pretrained(tmp_path)
    namespace: dict = {"path": str(tmp_path)}
    exec(compile(example, "README.md", "exec"), namespace)
    model = namespace["model"]
    assert model.config._attn_implementation == "sdpa"  # restore() at the end
    assert model(input_ids=torch.arange(1, 20)[None]).last_hidden_state.shape == (1, 19, 32)


def test_readme_conversion_example_runs(tmp_path, monkeypatch):
    """The README's conversion block, on a tiny BERT, with a batch of calibration tokens; each
    convert replaces the one before, and the last (routing) is saved and loaded back."""
    transformers = pytest.importorskip("transformers", minversion="5")
    (example,) = [block for block in _python_blocks() if "subquad.hf.convert" in block]
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    batches = [{"input_ids": torch.randint(1, 50, (2, 40))}]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"model": model, "batches": batches}
    exec(compile("import subquad.hf\n" + example, "README.md", "exec"), namespace)
    loaded = namespace["model"]
    assert loaded is not model and (tmp_path / "converted" / "subquad.json").is_file()
    ids = batches[0]["input_ids"]
    torch.testing.assert_close(loaded(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)


def test_importing_subquad_leaves_torchs_compiler_stack_unloaded():
    """``torch.nn.attention.bias`` imports torch's compiler stack (about 2 s a process, which every
    ``subquad`` command paid): subquad reads a causal bias only once the caller has imported it."""
    code = "import sys, subquad, subquad.nn, subquad.cli; print('torch.nn.attention.bias' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr

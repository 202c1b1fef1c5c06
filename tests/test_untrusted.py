"""Files from elsewhere never run code: a pickle payload planted in a run folder, a distillation run,
a model folder or the data cache must not execute, whatever command reads the folder.

The payload, unpickled, calls ``open(MARKER, "w")``: the marker file appearing means code from the
file ran. Each test fails if it appears."""

from __future__ import annotations

import ast
import builtins
import shutil
import sys
from pathlib import Path

import pytest
import torch

from subquad.cli import main
from subquad.train.config import TrainConfig
from subquad.train.loop import train
from subquad.train.tasks import make_task


class _Payload:
    """Unpickled, it creates ``marker``: stands for any code a pickle can run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def plant(path, marker):
    """Write a pickle payload to ``path`` in torch's own file format, as ``torch.save`` writes a checkpoint."""
    torch.save({"optimizer": _Payload(marker), "step": 1}, path)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(300)))
    return path


def _run(corpus, out, **extra):
    settings = dict(data=str(corpus), out=str(out), seq_len=16, dim=16, depth=1, heads=2, batch=4, steps=4, warmup=1,
                    eval_every=4, eval_windows=2, checkpoint_every=2, keep=2)  # fmt: skip
    return TrainConfig(**{**settings, **extra})


def _legacy(run_folder, marker):
    """Every checkpoint of the run as the pickle format left it: the weights, and a ``state.pt``
    (here, a payload) beside them, nothing else."""
    for step in (run_folder / "checkpoints").glob("step-*"):
        for f in step.iterdir():
            if f.name != "model.safetensors":
                f.unlink()
        plant(step / "state.pt", marker)


def test_evaluating_generating_and_resuming_a_run_never_unpickles_its_files(corpus, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    config = _run(corpus, tmp_path / "run")
    train(config, progress=False)
    _legacy(tmp_path / "run", marker)
    # evaluate and generate need the weights and the config only, and still work
    assert main(["evaluate", str(tmp_path / "run"), "--split", "val", "--batches", "1", "--device", "cpu"]) == 0
    assert '"val_bpb"' in capsys.readouterr().out
    assert main(["generate", str(tmp_path / "run"), "--prompt", "line", "--new-bytes", "3", "--device", "cpu"]) == 0
    assert not marker.exists(), "evaluate or generate ran code from the run folder"
    # a resume refuses the pickle state, says how to convert it, and changes nothing
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", str(tmp_path / "run" / "config.json"), "--resume", "--steps", "6"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "state.pt" in err and "pickle" in err and "subquad upgrade-run" in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before
    assert not marker.exists(), "train --resume ran code from the run folder"


def test_upgrading_a_run_loads_plain_data_only_and_refuses_a_payload(corpus, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    train(_run(corpus, tmp_path / "run"), progress=False)
    _legacy(tmp_path / "run", marker)
    with pytest.raises(SystemExit) as exit_:
        main(["upgrade-run", str(tmp_path / "run")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "state.pt" in err and "not plain data" in err and "Traceback" not in err
    assert not marker.exists(), "upgrade-run ran code from the run folder"


def test_a_model_folder_s_pickled_weights_are_never_loaded(tmp_path, capsys):
    pytest.importorskip("transformers", minversion="5")
    from transformers import BertConfig, BertModel

    from subquad import hf
    from subquad.hf.data import load_model

    from .conftest import word_passages

    marker = tmp_path / "code-ran"
    tokenizer = word_passages(tmp_path, 4)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)  # fmt: skip
    model = BertModel(config, add_pooling_layer=False)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    plant(tmp_path / "m" / "pytorch_model.bin", marker)
    with pytest.raises(ValueError, match=r"pytorch_model.bin.*pickle.*safetensors"):
        load_model(tmp_path / "m")
    hf.save(hf.convert(BertModel(config, add_pooling_layer=False), "local", window=4), tmp_path / "c")
    (tmp_path / "c" / "model.safetensors").unlink()
    plant(tmp_path / "c" / "pytorch_model.bin", marker)
    with pytest.raises(ValueError, match=r"pytorch_model.bin.*pickle.*safetensors"):
        hf.from_pretrained(tmp_path / "c")
    assert not marker.exists(), "a model folder's pickle ran"


def test_a_listops_cache_file_is_never_unpickled(tmp_path, monkeypatch):
    from subquad.train.tasks import listops

    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path / "cache"))
    marker = tmp_path / "code-ran"
    first = listops.load_splits(sizes=(3, 2, 2), min_length=5, max_length=40)
    (cached,) = (tmp_path / "cache" / "data").glob("listops-*")
    plant(cached, marker)  # the cache file replaced by a payload
    with pytest.warns(RuntimeWarning, match="the ListOps cache .* is damaged .*; generating it again"):
        again = listops.load_splits(sizes=(3, 2, 2), min_length=5, max_length=40)
    assert not marker.exists(), "the ListOps cache ran code"
    for name in first:
        assert all(torch.equal(a, b) for a, b in zip(first[name][0], again[name][0]))
        assert torch.equal(first[name][1], again[name][1])


def test_a_run_of_the_pickle_format_upgrades_and_resumes_to_the_weights_of_one_never_stopped(corpus, tmp_path, capsys):
    from safetensors.torch import load_file

    from subquad.train import checkpoint

    whole = _run(corpus, tmp_path / "whole", steps=6, keep=3, dropout=0.1)
    train(whole, progress=False)
    shutil.copytree(tmp_path / "whole", tmp_path / "old")
    steps = sorted((tmp_path / "old" / "checkpoints").glob("step-*"))
    for later in steps[1:]:
        shutil.rmtree(later)
    state = checkpoint.load(steps[0], make_task(whole).model())
    for f in ("state.json", "state.safetensors"):
        (steps[0] / f).unlink()
    torch.save(state, steps[0] / "state.pt")  # as the pickle format wrote it
    assert main(["upgrade-run", str(tmp_path / "old")]) == 0
    assert "converted 1 checkpoint(s)" in capsys.readouterr().out
    assert sorted(f.name for f in steps[0].iterdir()) == ["model.safetensors", "state.json", "state.safetensors"]
    assert main(["upgrade-run", str(tmp_path / "old")]) == 0  # again: nothing left to convert
    assert "converted 0 checkpoint(s)" in capsys.readouterr().out
    train(_run(corpus, tmp_path / "old", steps=6, keep=3, dropout=0.1), resume=True, progress=False)
    a, b = (load_file(str(sorted((tmp_path / r / "checkpoints").glob("step-*"))[-1] / "model.safetensors"))
            for r in ("whole", "old"))  # fmt: skip
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_nothing_in_the_package_unpickles():
    """Every load in the package reads a data format: no module imports pickle (or its relatives),
    and the one ``torch.load`` call (a run of the pickle format being upgraded, on the user's
    request) is torch's restricted, weights-only reader."""
    source = Path(sys.modules["subquad"].__file__).parent
    imports, loads = [], []
    for path in sorted(source.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                imports += [n for n in names if n and n.split(".")[0] in ("pickle", "cPickle", "dill", "joblib")]
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("torch.load", "torch.serialization.load"):
                loads.append((str(path.relative_to(source)), {k.arg: ast.unparse(k.value) for k in node.keywords}))
    assert imports == []
    assert loads == [("train/checkpoint.py", {"map_location": "'cpu'", "weights_only": "True"})]

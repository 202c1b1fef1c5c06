"""Every broken file a user hands in gets a clear error of subquad's own kind, and nothing else.

Each file kind subquad reads is damaged at the byte level (truncated, a byte changed, bytes
inserted or cut, replaced by junk, emptied) and, for JSON, TOML and JSON lines, at the value level
(a field of another type, a field missing, a field unknown), by hypothesis, then read through the
public command or function that reads it. Each case must either work (a damage that leaves a valid
file of the same meaning, or a log line cut off) or raise ``FileError`` naming the file (the
commands: exit status 2, the file named on stderr). Any other exception fails the test, and so
does a checkpoint that loads after any change to its bytes. A failed ``--resume`` must leave every
file of the run as it was.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from subquad.cli import main
from subquad.files import FileError
from subquad.train.config import TrainConfig
from subquad.train.loop import train

pytest.importorskip("transformers", minversion="5")

EXAMPLES = settings(max_examples=50, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip


# ------------------------------------------------------------------------------------------ damage


def byte_damage(data: bytes) -> st.SearchStrategy[bytes]:
    """``data`` truncated, with a byte changed, with bytes inserted or cut out, replaced by junk, or emptied."""
    n = len(data)
    at = st.integers(0, n - 1)
    return st.one_of(
        at.map(lambda i: data[:i]),
        st.tuples(at, st.integers(1, 255)).map(lambda t: data[: t[0]] + bytes([data[t[0]] ^ t[1]]) + data[t[0] + 1 :]),
        st.tuples(st.integers(0, n), st.binary(min_size=1, max_size=16)).map(
            lambda t: data[: t[0]] + t[1] + data[t[0] :]),
        st.tuples(at, st.integers(1, 64)).map(lambda t: data[: t[0]] + data[t[0] + t[1] :]),
        st.binary(max_size=64),
        st.just(b""),
    )  # fmt: skip


def _paths(value, prefix=()):
    """Every path to a value inside a JSON document (object keys and array indices)."""
    yield prefix
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield from _paths(inner, (*prefix, key))


_OTHER = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=False), st.text(max_size=8),
                   st.lists(st.integers(), max_size=3),
                   st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))  # fmt: skip


def value_damage(document) -> st.SearchStrategy:
    """``document`` with one value replaced by one of another kind, one field removed, or an unknown one added."""
    paths = [p for p in _paths(document) if p]

    def replaced(choice):
        path, value = choice
        copy = json.loads(json.dumps(document))
        *parent, last = path
        node = copy
        for key in parent:
            node = node[key]
        node[last] = value
        return copy

    def removed(path):
        copy = json.loads(json.dumps(document))
        *parent, last = path
        node = copy
        for key in parent:
            node = node[key]
        del node[last]
        return copy

    objects = [p for p in paths if isinstance(p[-1], str)]
    return st.one_of(
        st.tuples(st.sampled_from(paths), _OTHER).map(replaced),
        st.sampled_from(objects).map(removed),
        st.just({**document, "nonesuch": 1}) if isinstance(document, dict) else st.just([*document, {"nonesuch": 1}]),
    )


def damage(data: bytes, kind: str) -> st.SearchStrategy[bytes]:
    """Byte damage for any file; value damage too for JSON (``json``) and JSON lines (``jsonl``)."""
    if kind == "json":
        return st.one_of(byte_damage(data), value_damage(json.loads(data)).map(lambda d: json.dumps(d).encode()))
    if kind == "jsonl":
        lines = [json.loads(line) for line in data.splitlines() if line.strip()]
        return st.one_of(byte_damage(data), value_damage(lines).map(
            lambda d: b"".join(json.dumps(x).encode() + b"\n" for x in d)))  # fmt: skip
    return byte_damage(data)


# ------------------------------------------------------------------------------------------ outcomes


def files_of(folder: Path) -> dict[Path, bytes]:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class Copy:
    """A fresh copy of a pristine folder with one file damaged; removed on exit."""

    def __init__(self, pristine: Path, name: str, data: bytes) -> None:
        self.pristine, self.name, self.data = pristine, name, data

    def __enter__(self) -> Path:
        self.tmp = tempfile.TemporaryDirectory()
        folder = Path(self.tmp.name) / self.pristine.name
        shutil.copytree(self.pristine, folder)
        (folder / self.name).write_bytes(self.data)
        return folder

    def __exit__(self, *exc) -> None:
        self.tmp.cleanup()


def command(args: list[str], capsys) -> tuple[int, str]:
    """Run ``subquad ARGS`` in this process: (exit status, stderr). An exception the command does not
    turn into status 2 propagates: a traceback fails the test."""
    try:
        code = main(args)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def call(fn) -> FileError | None:
    """None where ``fn()`` works, its FileError where it refuses; anything else propagates."""
    try:
        fn()
    except FileError as error:
        return error
    return None


def assert_named(error: FileError | None, name: str, may_work: bool) -> None:
    if error is None:
        assert may_work, f"damaged {name} was accepted"
    else:
        assert name in str(error), error


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One of everything subquad reads, written by subquad itself."""
    from transformers import BertConfig, BertModel

    from subquad import hf

    from .conftest import word_passages

    root = tmp_path_factory.mktemp("pristine")
    corpus = root / "corpus.txt"
    corpus.write_text(" ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(300)))
    settings_ = dict(data=str(corpus), out=str(root / "run"), seq_len=16, dim=16, depth=1, heads=2, batch=4, steps=2,
                     warmup=1, eval_every=2, eval_windows=2, checkpoint_every=2)  # fmt: skip
    train(TrainConfig(**settings_), progress=False)
    (root / "config.toml").write_text(
        f'data = "{corpus}"\nseq-len = 16\ndim = 16\ndepth = 1\nheads = 2\nbatch = 4\nsteps = 1\nwarmup = 1\n'
        'eval-windows = 1\nattention = "local"\noptions = ["window=8"]\n'
    )
    (root / "data").mkdir()
    tokenizer = word_passages(root / "data", 6)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                        max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    hf.save(hf.convert(BertModel(config, add_pooling_layer=False), "linear", feature_map="hedgehog", window=4),
            root / "converted", tokenizer)  # fmt: skip
    return root


def _step(root: Path) -> str:
    (step,) = [p.name for p in (root / "run" / "checkpoints").iterdir()]
    return f"checkpoints/{step}"


# ------------------------------------------------------------------------------------------ run folders


@pytest.mark.parametrize("name", ["config.json", "CHECKPOINT/model.safetensors"])
def test_evaluate_names_a_damaged_run_file(pristine, capsys, name):
    name = name.replace("CHECKPOINT", _step(pristine))
    original = (pristine / "run" / name).read_bytes()

    @EXAMPLES
    @given(damage(original, "json" if name.endswith(".json") else "bytes"))
    def check(data):
        with Copy(pristine / "run", name, data) as run:
            code, err = command(["evaluate", str(run), "--split", "val", "--batches", "1", "--device", "cpu"], capsys)
        if code:
            assert code == 2 and Path(name).name in err and "error: " in err, err
        else:  # only a file of the same meaning evaluates
            assert name == "config.json" and _same_config(data, original), data

    check()


def _same_config(data: bytes, original: bytes) -> bool:
    """Whether a damaged run config (which evaluated) still describes the run: defaults filled in,
    only what evaluate lets differ (the steps, the folder, the device, the data file's path) differs."""
    from subquad.train.config import jsonable as _jsonable

    free = {"steps", "out", "device", "data"}
    now, before = (_jsonable(TrainConfig(**{k: v for k, v in json.loads(d).items() if k != "subquad"}))
                   for d in (data, original))  # fmt: skip
    return {k: v for k, v in now.items() if k not in free} == {k: v for k, v in before.items() if k not in free}


@pytest.mark.parametrize("name", ["CHECKPOINT/state.json", "CHECKPOINT/state.safetensors", "metrics.jsonl"])
def test_resume_names_a_damaged_run_file_and_changes_nothing(pristine, capsys, name):
    name = name.replace("CHECKPOINT", _step(pristine))
    original = (pristine / "run" / name).read_bytes()
    kind = "json" if name.endswith(".json") else "jsonl" if name.endswith(".jsonl") else "bytes"

    @EXAMPLES
    @given(damage(original, kind))
    def check(data):
        with Copy(pristine / "run", name, data) as run:
            before = files_of(run)
            code, err = command(["train", "--config", str(run / "config.json"), "--out", str(run), "--resume"], capsys)
            if code:
                assert code == 2 and Path(name).name in err and "error: " in err, err
                assert files_of(run) == before  # a failed resume changes nothing
            elif name.endswith("state.json"):  # only the same record loads
                assert json.loads(data) == json.loads(original)
            else:  # a log with its last line cut off, or a value of a line changed, resumes
                assert name == "metrics.jsonl", data

    check()


# ------------------------------------------------------------------------------------------ settings and data


def test_a_damaged_toml_config_is_named(pristine, tmp_path):
    from subquad.train.config import load_config_file, train_config

    original = (pristine / "config.toml").read_bytes()

    @EXAMPLES
    @given(byte_damage(original))
    def check(data):
        path = tmp_path / "config.toml"
        path.write_bytes(data)
        assert_named(call(lambda: train_config(load_config_file(path), path)), "config.toml", may_work=True)

    check()


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_passages_name_a_damaged_data_file(tmp_path, suffix):
    from subquad.hf.data import read_passages

    if suffix == ".jsonl":
        lines = [json.dumps({"text": f"passage {i} about cats", "label": "cats"}) for i in range(6)]
        original = ("\n".join(lines) + "\n").encode()
    else:
        original = "\n\n".join(f"passage {i} about ships" for i in range(6)).encode()

    @EXAMPLES
    @given(damage(original, "jsonl" if suffix == ".jsonl" else "bytes"))
    def check(data):
        path = tmp_path / f"passages{suffix}"
        path.write_bytes(data)
        error = call(lambda: read_passages(path))
        assert_named(error, path.name, may_work=True)

    check()


def test_a_damaged_text_corpus_is_named(tmp_path, monkeypatch):
    from subquad.train.tasks.text import ByteCorpus

    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path / "cache"))
    original = " ".join(f"line {i} of a corpus." for i in range(40)).encode()

    @EXAMPLES
    @given(byte_damage(original))
    def check(data):
        path = tmp_path / "corpus.txt"
        path.write_bytes(data)
        assert_named(call(lambda: ByteCorpus(path, seq_len=16, block=64)), "corpus.txt", may_work=True)

    check()


def test_a_damaged_idx_file_is_named(tmp_path):
    from subquad.train.tasks.pixels import load_idx

    original = bytes([0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 3]) + bytes(range(18))

    @EXAMPLES
    @given(byte_damage(original))
    def check(data):
        path = tmp_path / "train-images-idx3-ubyte"
        path.write_bytes(data)
        assert_named(call(lambda: load_idx(path)), path.name, may_work=True)

    check()


# ------------------------------------------------------------------------------------------ model folders


@pytest.mark.parametrize("name", ["subquad.json", "subquad.safetensors", "model.safetensors", "config.json"])
def test_from_pretrained_names_a_damaged_model_file(pristine, name):
    from subquad import hf

    original = (pristine / "converted" / name).read_bytes()
    reference = hf.from_pretrained(pristine / "converted")
    ids = torch.arange(2, 12)[None]

    @EXAMPLES
    @given(damage(original, "json" if name.endswith(".json") else "bytes"))
    def check(data):
        with Copy(pristine / "converted", name, data) as folder:
            loaded = []
            error = call(lambda: loaded.append(hf.from_pretrained(folder)))
        # subquad.json records every file's SHA-256 and its own checksum: only the same JSON may load
        assert_named(error, name, may_work=_same_json(data, original))
        if error is None and name == "subquad.json":
            with torch.no_grad():
                torch.testing.assert_close(loaded[0](input_ids=ids).last_hidden_state,
                                           reference(input_ids=ids).last_hidden_state, rtol=0, atol=0)  # fmt: skip

    check()


def _same_json(data: bytes, original: bytes) -> bool:
    try:
        return json.loads(data) == json.loads(original)
    except (ValueError, UnicodeDecodeError):
        return False


def test_a_file_that_is_not_gguf_is_named(tmp_path, capsys):
    from subquad.hf.data import load_model

    @EXAMPLES
    @given(st.one_of(st.binary(max_size=32), st.binary(max_size=8).map(lambda b: b"GGUF" + b)))
    def check(data):
        path = tmp_path / "model.gguf"
        path.write_bytes(data)
        try:
            error = call(lambda: load_model(path))
        except ImportError as missing:  # a real GGUF header: transformers needs the gguf package
            assert "gguf" in str(missing).lower()
            return
        assert error is not None and "model.gguf" in str(error), error

    check()
    (tmp_path / "weights.gguf").write_bytes(b"PK\x03\x04 a zip file")
    code, err = command(["approx", str(tmp_path / "weights.gguf"), "--data", str(tmp_path / "x.jsonl"), "--mechanisms",
                         "local", "--out", str(tmp_path / "o")], capsys)  # fmt: skip
    assert code == 2 and "weights.gguf: is not a GGUF file (it starts with b'PK\\x03\\x04'" in err, err


# ------------------------------------------------------------------------------------------ versions, commands


def test_files_of_another_version_say_so(pristine, tmp_path):
    from subquad import hf
    from subquad.train.config import load_config_file

    run = tmp_path / "run"
    shutil.copytree(pristine / "run", run)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "subquad": "9.0", "attention_cache": "x"}))
    unknown = r"config.json: has unknown setting\(s\) \['attention_cache'\]; .*it was written by subquad 9.0 \(this is "
    with pytest.raises(FileError, match=unknown):
        load_config_file(run / "config.json")
    (run / "config.json").write_text(json.dumps(config))
    step = run / _step(pristine)
    record = json.loads((step / "state.json").read_text())
    (step / "state.json").write_text(json.dumps({**record, "format": 3, "subquad": "9.0"}))
    other = r"state.json: is checkpoint format 3 \(subquad 9.0\); subquad .* reads format 2; resume it with subquad 9.0"
    with pytest.raises(FileError, match=other):
        train(TrainConfig(**{**{k: v for k, v in config.items() if k != "subquad"}, "out": str(run)}), resume=True,
              progress=False)  # fmt: skip
    converted = tmp_path / "converted"
    shutil.copytree(pristine / "converted", converted)
    spec = json.loads((converted / hf.SPEC_FILE).read_text())
    (converted / hf.SPEC_FILE).write_text(json.dumps({**spec, "format": 2}))
    with pytest.raises(FileError, match=r"subquad.json: is format 2; this version of subquad reads format 1; load it "):
        hf.from_pretrained(converted)


def test_the_commands_name_a_broken_file_and_exit_2(pristine, tmp_path, capsys):
    broken = tmp_path / "passages.jsonl"
    broken.write_text('{"text": "one"}\n{"text": "two"\n{"text": "three"}\n')
    code, err = command(["approx", str(pristine / "converted"), "--data", str(broken), "--mechanisms", "local",
                         "--out", str(tmp_path / "o")], capsys)  # fmt: skip
    assert code == 2 and "passages.jsonl: line 2 is not valid JSON (Expecting ',' delimiter)" in err, err
    toml = tmp_path / "bad.toml"
    toml.write_text('dim = 16\nattention = "local\n')
    code, err = command(["train", "--config", str(toml)], capsys)
    assert code == 2 and "bad.toml: is not valid TOML (" in err and "line 2" in err, err
    toml.write_text(f'data = "{tmp_path / "moved.txt"}"\n')
    code, err = command(["train", "--config", str(toml)], capsys)
    assert code == 2 and f"bad.toml: names data at {tmp_path / 'moved.txt'}, where there is none" in err, err
    (tmp_path / "blob.txt").write_bytes(bytes(range(256)))
    code, err = command(["train", "--data", str(tmp_path / "blob.txt"), "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "blob.txt: is binary (it holds NUL bytes), not text" in err, err
    assert not (tmp_path / "r").exists()
    run = tmp_path / "run"
    shutil.copytree(pristine / "run", run)
    model = run / _step(pristine) / "model.safetensors"
    model.write_bytes(model.read_bytes()[:100])
    code, err = command(["evaluate", str(run), "--device", "cpu"], capsys)
    assert code == 2 and "model.safetensors: was changed or damaged after it was written" in err, err


def test_a_checkpoint_of_another_run_s_config_is_refused(pristine, tmp_path, capsys):
    """A run folder whose config.json was edited to another model that the weights still fit (one
    head instead of two: the same shapes) is refused, not evaluated as another model."""
    run = tmp_path / "run"
    shutil.copytree(pristine / "run", run)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "heads": 1}))
    code, err = command(["evaluate", str(run), "--device", "cpu"], capsys)
    assert code == 2 and "config.json: the checkpoint was trained with another config; these differ (trained, " in err
    assert "'heads': (2, 1)" in err, err
    (run / "config.json").write_text(json.dumps({**config, "steps": 9, "device": "cpu", "data": str(tmp_path / "x")}))
    code, err = command(["evaluate", str(run), "--device", "cpu"], capsys)  # free to differ; the data is not there
    assert code == 2 and f"config.json: names data that cannot be read (no text file at {tmp_path / 'x'}" in err, err

"""``subquad train``: a run killed with SIGKILL and resumed ends with the weights of one never killed."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from subquad.train.config import TrainConfig
from subquad.train.loop import resolve_device, train
from subquad.train.tasks import make_task

ROOT = Path(__file__).parent.parent
SMALL = ["--seq-len", "32", "--dim", "32", "--depth", "2", "--heads", "2", "--examples-per-step", "4", "--warmup", "5",
         "--eval-every", "50", "--eval-windows", "4", "--checkpoint-every", "5", "--dropout", "0.1"]  # fmt: skip


@pytest.fixture
def corpus(tmp_path):
    text = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}." for i in range(400))
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return path


def _command(corpus, out, steps, *extra):
    return [sys.executable, "-m", "subquad", "train", "--data", str(corpus), "--out", str(out),
            "--steps", str(steps), *SMALL, *extra]  # fmt: skip


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def _final_weights(out):
    (last,) = sorted((out / "checkpoints").glob("step-*"))[-1:]
    return load_file(str(last / "model.safetensors"))


def test_resume_after_sigkill_is_bit_identical(corpus, tmp_path):
    steps = 200
    whole = subprocess.run(_command(corpus, tmp_path / "whole", steps), env=_env(), capture_output=True, timeout=300)
    assert whole.returncode == 0, whole.stderr.decode()[-2000:]
    killed = subprocess.Popen(_command(corpus, tmp_path / "killed", steps), env=_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    checkpoints = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 120
    while not list(checkpoints.glob("step-*/state.json")) and time.time() < deadline:
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed" / "summary.json").exists(), "the run ended before it could be killed"
    resumed = subprocess.run(_command(corpus, tmp_path / "killed", steps, "--resume"), env=_env(), capture_output=True,
                             timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    a, b = _final_weights(tmp_path / "whole"), _final_weights(tmp_path / "killed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in lines if "loss_bpb" in r]
    assert train_steps == list(range(1, steps + 1))  # every step logged once, none lost or doubled
    first = [r["loss_bpb"] for r in map(json.loads, (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines())
             if "loss_bpb" in r]  # fmt: skip
    assert [r["loss_bpb"] for r in lines if "loss_bpb" in r] == first
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("whole", "killed")]
    assert summaries[0]["best_val_bpb"] == summaries[1]["best_val_bpb"]  # evaluations before the kill count too


def test_the_same_config_gives_the_same_numbers_and_learns(corpus, tmp_path):
    config = dict(data=str(corpus), seq_len=32, dim=32, depth=2, heads=2, batch=8, steps=60, warmup=5,
                  eval_every=30, eval_windows=8, checkpoint_every=30, lr=3e-3)  # fmt: skip
    a = train(TrainConfig(out=str(tmp_path / "a"), **config), progress=False)
    b = train(TrainConfig(out=str(tmp_path / "b"), **config), progress=False)
    assert a["best_val_bpb"] == b["best_val_bpb"]
    first = json.loads((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[0])["loss_bpb"]
    assert a["best_val_bpb"] < first - 2  # it learns: 8 bits of a uniform guess down to the text's bytes


@pytest.mark.parametrize(
    "options, match",
    [
        ({"attention": "nope"}, "unknown mechanism 'nope'"),
        ({"attention": "local:window=0"}, "local option window must be >= 1, got 0"),
        ({"attention": "local:window"}, r"an attention spec is NAME.*bad option 'window'"),
        ({"attention": "local*3+full", "heads": 2}, r"head groups claim 3 of 2 heads"),
        ({"batch": 6, "accumulate": 4}, r"batch \(--examples-per-step\) 6 must split into accumulate=4 equal micro"),
        ({"dim": 30, "heads": 4}, "dim 30 must divide between heads=4"),
        ({"data": ""}, "pass --data PATH"),
    ],
)
def test_bad_configs_are_refused(corpus, options, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{"data": str(corpus), **options})


def test_the_old_options_spelling_still_works_for_one_release_and_says_so(corpus):
    with pytest.warns(DeprecationWarning, match=r"--options is deprecated .*--attention local:window=8"):
        old = TrainConfig(data=str(corpus), attention="local", options=("window=8",))
    new = TrainConfig(data=str(corpus), attention="local:window=8")
    assert repr(old.attention_specs()) == repr(new.attention_specs())
    with (
        pytest.raises(ValueError, match=r"an attention option is name=value, got 'window'"),
        pytest.warns(DeprecationWarning),
    ):
        TrainConfig(data=str(corpus), attention="local", options=("window",))


def test_a_head_mix_in_one_spec_builds_each_layer_from_it(corpus):
    config = TrainConfig(data=str(corpus), attention="local:window=8*2+routing:clusters=2", heads=4, depth=2)
    specs = config.attention_specs()
    assert len(specs) == 2 and [(g.mechanism.name, g.heads) for g in specs[0]] == [("local", 2), ("routing", None)]
    assert config.input_position() == "learned"
    assert TrainConfig(data=str(corpus), attention="agglomerative*2+full").input_position() == "conv"


def test_the_input_position_is_the_convolution_where_a_layer_is_agglomerative(corpus):
    assert TrainConfig(data=str(corpus)).input_position() == "learned"
    assert TrainConfig(data=str(corpus), attention="agglomerative").input_position() == "conv"
    mix = ({"groups": [{"mechanism": "local", "heads": 2, "window": 8}, {"mechanism": "agglomerative", "heads": 2}]},)
    assert TrainConfig(data=str(corpus), layers=mix).input_position() == "conv"
    config = TrainConfig(data=str(corpus), attention="agglomerative", position="both", seq_len=16, dim=16, heads=1)
    assert make_task(config).model().backbone.embed.position == "both"
    with pytest.raises(ValueError, match="position must be one of auto, learned, conv, both, got 'rope'"):
        TrainConfig(data=str(corpus), position="rope", seq_len=16, dim=16, heads=1)  # refused before any model


@pytest.mark.parametrize(
    "device, match",
    [("tpu", "--device must be auto, cpu, cuda or cuda:N, got 'tpu'"), ("meta", "got 'meta'")]
    + ([] if torch.cuda.is_available() else [("cuda", "--device cuda: this torch sees no CUDA device")]),
)
def test_bad_devices_are_refused_before_the_run_exists(corpus, tmp_path, device, match):
    with pytest.raises(ValueError, match=match):
        train(TrainConfig(data=str(corpus), out=str(tmp_path / "r"), device=device), progress=False)
    assert not (tmp_path / "r").exists()


def test_a_cuda_device_the_machine_lacks_is_refused_with_the_fix(corpus, tmp_path, monkeypatch):
    """More torchrun processes than GPUs, or a cuda:N past the last one, fail with what to pass instead,
    before the run exists: not with CUDA's invalid device ordinal from inside torch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail(f"set_device({device}) was reached"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    for device in ("auto", "cuda"):
        match = (
            rf"--device {device}: the process of LOCAL_RANK 1 takes cuda:1, but this machine has 1 CUDA device\(s\); "
            r"start at most 1 process\(es\) per node \(torchrun --nproc_per_node 1\), or pass --device cpu"
        )
        with pytest.raises(ValueError, match=match):
            train(TrainConfig(data=str(corpus), out=str(tmp_path / "r"), device=device), progress=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match=r"--device cuda:2: this machine has 1 CUDA device\(s\), cuda:0 to cuda:0"):
        train(TrainConfig(data=str(corpus), out=str(tmp_path / "r"), device="cuda:2"), progress=False)
    assert not (tmp_path / "r").exists()
    assert resolve_device("cpu", local_rank=5) == torch.device("cpu")
    assert resolve_device("cuda", local_rank=0) == torch.device("cuda", 0)  # in range: the rank's device


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
)
def test_a_moved_run_that_lost_its_last_checkpoint_resumes_to_the_same_weights(corpus, tmp_path, device):
    settings = dict(data=str(corpus), seq_len=32, dim=32, depth=2, heads=2, batch=4, warmup=2, eval_every=5, steps=10,
                    eval_windows=4, checkpoint_every=5, dropout=0.1, attention="local:window=8",
                    device=device)  # fmt: skip
    whole = train(TrainConfig(out=str(tmp_path / "whole"), **settings), progress=False)
    assert whole["best_val_bpb"] < 8
    shutil.copytree(tmp_path / "whole", tmp_path / "moved")
    shutil.rmtree(tmp_path / "moved" / "checkpoints" / "step-000000010")
    train(TrainConfig(out=str(tmp_path / "moved"), **settings), resume=True, progress=False)
    weights = [_final_weights(tmp_path / run) for run in ("whole", "moved")]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert json.loads((tmp_path / "moved" / "config.json").read_text())["out"] == str(tmp_path / "moved")
    if device == "cuda":
        bf16 = train(TrainConfig(out=str(tmp_path / "bf16"), bf16=True, **settings), progress=False)
        assert 0 < bf16["best_val_bpb"] < 9


def test_bad_runs_are_refused(corpus, tmp_path):
    with pytest.raises(FileNotFoundError, match="no text file at .*missing.txt"):
        train(TrainConfig(data=str(tmp_path / "missing.txt"), out=str(tmp_path / "r")), progress=False)
    assert not (tmp_path / "r").exists()  # a failed start leaves no run behind
    config = TrainConfig(data=str(corpus), out=str(tmp_path / "r"), seq_len=16, dim=16, depth=1, heads=1, steps=2)
    train(config, progress=False)
    with pytest.raises(ValueError, match="already holds a run; pass --resume"):
        train(config, progress=False)
    changed = TrainConfig(data=str(corpus), out=str(tmp_path / "r"), seq_len=16, dim=32, depth=1, heads=1, steps=2)
    with pytest.raises(ValueError, match=r"--resume needs the run's config; these differ .*'dim': \(16, 32\)"):
        train(changed, resume=True, progress=False)


def test_two_processes_follow_the_loss_curve_of_one(corpus, tmp_path):
    """torchrun with 2 CPU processes (gloo), each computing half of every global batch under DDP."""
    args = ["--steps", "20", "--examples-per-step", "8", "--lr", "3e-3", "--dropout", "0.0", "--checkpoint-every", "10"]
    args += ["--device", "cpu"]  # CPU processes on any machine: auto would give each a GPU of its own
    one = subprocess.run(_command(corpus, tmp_path / "one", 20, *args), env=_env(), capture_output=True, timeout=300)
    assert one.returncode == 0, one.stderr.decode()[-2000:]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    two = subprocess.run([*launch, *_command(corpus, tmp_path / "two", 20, *args)[1:]], env=_env(),
                         capture_output=True, timeout=300)  # fmt: skip
    assert two.returncode == 0, two.stderr.decode()[-3000:]
    assert two.stdout.decode().count('"processes": 2') == 1  # rank 0 alone reports
    curves = [
        [r["loss_bpb"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
         if "loss_bpb" in r]
        for name in ("one", "two")
    ]  # fmt: skip
    assert len(curves[0]) == len(curves[1]) == 20
    assert max(abs(a - b) for a, b in zip(*curves)) <= 1e-4 * max(curves[0])
    assert curves[1][-1] < curves[1][0] - 1


def _idx(dims, data):
    return bytes([0, 0, 8, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims) + bytes(data)


@pytest.fixture
def images(tmp_path):
    """An IDX folder of 200 4×4 images whose label is the quadrant holding their bright pixel."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (200,), generator=g)
    pictures = torch.zeros(200, 4, 4, dtype=torch.uint8)
    for i, label in enumerate(labels.tolist()):
        pictures[i, 2 * (label // 2) + int(torch.randint(0, 2, (), generator=g)), 2 * (label % 2)] = 255
    folder = tmp_path / "idx"
    folder.mkdir()
    (folder / "train-images-idx3-ubyte").write_bytes(_idx([200, 4, 4], pictures.flatten().tolist()))
    (folder / "train-labels-idx1-ubyte").write_bytes(_idx([200], labels.tolist()))
    return folder


def test_pixels_and_listops_train_and_report_accuracy(images, tmp_path, monkeypatch):
    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path / "cache"))
    common = dict(dim=32, depth=1, heads=2, batch=16, warmup=5, lr=3e-3, eval_every=40, eval_windows=4,
                  checkpoint_every=40)  # fmt: skip
    pixels = train(TrainConfig(task="pixels", data=str(images), out=str(tmp_path / "p"), seq_len=16, steps=120,
                               attention="local:window=4", **common), progress=False)  # fmt: skip
    assert pixels["best_val_accuracy"] >= 0.9  # which quadrant is bright: learnable from 16 pixels
    lo = train(TrainConfig(task="listops", out=str(tmp_path / "l"), seq_len=48, steps=40, **common), progress=False)
    assert 0 <= lo["best_val_accuracy"] <= 1
    assert (tmp_path / "l" / "curve.png").stat().st_size > 0
    with pytest.raises(ValueError, match="the images have 16 pixels; pass --seq-len 16 or more"):
        train(TrainConfig(task="pixels", data=str(images), out=str(tmp_path / "q"), seq_len=8, **common))
    with pytest.raises(FileNotFoundError, match="no data folder at .*nowhere.*dataset-fashion-mnist"):
        train(TrainConfig(task="pixels", data=str(tmp_path / "nowhere"), out=str(tmp_path / "q"), **common))


MIXED = """
task = "text"
seq_len = 32
dim = 32
depth = 2
heads = 4
steps = 6
batch = 4
eval_every = 3
eval_windows = 2
checkpoint_every = 3
bf16 = false

[[layers]]
groups = [{ mechanism = "local", heads = 2, window = 8 }, { mechanism = "routing", heads = 2, clusters = 3 }]
"""


def test_a_config_file_gives_head_splits_and_a_run_reproduces_from_its_config_json(corpus, tmp_path):
    (tmp_path / "mixed.toml").write_text(MIXED)
    first = [*_command(corpus, tmp_path / "a", 6)[:4], "--config", str(tmp_path / "mixed.toml"),
             "--data", str(corpus), "--out", str(tmp_path / "a")]  # fmt: skip
    done = subprocess.run(first, env=_env(), capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    assert saved["layers"] == [{"groups": [{"heads": 2, "mechanism": "local", "window": 8},
                                           {"clusters": 3, "heads": 2, "mechanism": "routing"}]}]  # fmt: skip
    again = [sys.executable, "-m", "subquad", "train", "--config", str(tmp_path / "a" / "config.json"),
             "--out", str(tmp_path / "b")]  # fmt: skip
    done = subprocess.run(again, env=_env(), capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    a, b = _final_weights(tmp_path / "a"), _final_weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any("routing" in k or "attn" in k for k in a)


@pytest.mark.parametrize(
    "layers, match",
    [
        ([{"groups": [{"mechanism": "local", "heads": 3}]}], r"head groups \[3\] cover 3 heads but the layer has"),
        ([{"groups": [{"heads": 4}]}], "a head group needs a mechanism"),
        ([{"nothing": 1}], r"each \[\[layers\]\] table needs groups"),
        ([{"groups": [{"mechanism": "full"}]}] * 3, r"for every layer or one per layer \(2\), got 3"),
    ],
)  # fmt: skip
def test_bad_head_splits_are_refused(corpus, layers, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(data=str(corpus), depth=2, heads=4, dim=32, layers=layers)


def test_bad_config_files_are_named(tmp_path):
    from subquad.train.config import load_config_file

    (tmp_path / "bad.toml").write_text("depht = 3\n")
    with pytest.raises(ValueError, match=r"bad.toml: has unknown setting\(s\) \['depht'\]; known: .*depth"):
        load_config_file(tmp_path / "bad.toml")
    with pytest.raises(FileNotFoundError, match="no config file at .*none.toml"):
        load_config_file(tmp_path / "none.toml")


def test_a_config_file_may_name_a_setting_by_its_flag(tmp_path):
    from subquad.train.config import load_config_file

    (tmp_path / "flags.toml").write_text("examples-per-step = 8\nseq_len = 64\n")
    assert load_config_file(tmp_path / "flags.toml") == {"batch": 8, "seq_len": 64}


def test_evaluate_and_generate_load_a_run(corpus, tmp_path):
    from subquad.train.use import evaluate_run, generate_text

    config = TrainConfig(data=str(corpus), out=str(tmp_path / "r"), seq_len=32, dim=32, depth=1, heads=2, batch=8,
                         steps=80, warmup=5, lr=3e-3, eval_every=40, eval_windows=4, checkpoint_every=40,
                         attention="local:window=16")  # fmt: skip
    train(config, progress=False)
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    last_val = [r["val_bpb"] for r in records if "val_bpb" in r][-1]  # the run's own evaluation at step 80
    val = evaluate_run(tmp_path / "r", "val", windows=4)
    assert val == {"run": str(tmp_path / "r"), "task": "text", "val_bpb": pytest.approx(last_val, rel=1e-12)}
    assert evaluate_run(tmp_path / "r", "val", windows=4, step=40)["val_bpb"] != val["val_bpb"]
    text = generate_text(tmp_path / "r", "line 1", 12)
    assert text.startswith("line 1") and len(text.encode()) >= 12
    cli = [sys.executable, "-m", "subquad", "generate", str(tmp_path / "r"), "--prompt", "line 1", "--new-bytes", "12"]
    assert subprocess.run(cli, env=_env(), capture_output=True, text=True, timeout=120).stdout.strip() == text.strip()
    with pytest.raises(FileNotFoundError, match="has no checkpoint 7; it has: .*step-000000080"):
        evaluate_run(tmp_path / "r", step=7)
    with pytest.raises(FileNotFoundError, match="holds no run"):
        evaluate_run(tmp_path)
    with pytest.raises(ValueError, match="must be non-empty and, with --new-bytes, fit seq_len=32"):
        generate_text(tmp_path / "r", "x" * 30, 10)
    on_cpu = evaluate_run(tmp_path / "r", "val", windows=4, device="cpu")["val_bpb"]
    # the run's own value where it trained on the CPU; within fp32 rounding where it trained on a GPU
    assert on_cpu == pytest.approx(last_val, rel=1e-5)
    with pytest.raises(ValueError, match="--device must be auto, cpu, cuda or cuda:N, got 'tpu'"):
        evaluate_run(tmp_path / "r", device="tpu")
    with pytest.raises(ValueError, match="--device must be auto, cpu, cuda or cuda:N, got 'tpu'"):
        generate_text(tmp_path / "r", "line 1", 4, device="tpu")
    for extra in ([str(tmp_path / "none")], [str(tmp_path / "r"), "--device", "tpu"]):
        bad = subprocess.run([sys.executable, "-m", "subquad", "evaluate", *extra], env=_env(),
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert bad.returncode == 2 and "subquad evaluate: error: " in bad.stderr and "Traceback" not in bad.stderr
    assert "got 'tpu'" in bad.stderr


def test_compare_trains_each_variant_once_and_tabulates_them(corpus, tmp_path):
    flags = ["--data", str(corpus), "--seq-len", "32", "--dim", "32", "--depth", "1", "--heads", "2", "--steps", "20",
             "--examples-per-step", "8", "--eval-every", "10", "--checkpoint-every", "10", "--warmup", "5"]  # fmt: skip
    command = [sys.executable, "-m", "subquad", "compare", "--out", str(tmp_path / "cmp"), "--variants", "full",
               "local:window=8", "--", *flags]  # fmt: skip
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| full |" in done.stdout and "| local:window=8 |" in done.stdout and "val_bpb:" in done.stdout
    rows = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [r["variant"] for r in rows] == ["full", "local:window=8"]
    assert all(r["peak_mb"] > 0 and r["s_per_step"] > 0 and 0 < r["best"] <= r["final"] + 1e-12 for r in rows)
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 0
    local = json.loads((tmp_path / "cmp" / "local_window=8" / "config.json").read_text())
    assert local["attention"] == "local:window=8" and local["options"] == []
    stamp = (tmp_path / "cmp" / "full" / "metrics.jsonl").stat().st_mtime_ns
    again = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and (tmp_path / "cmp" / "full" / "metrics.jsonl").stat().st_mtime_ns == stamp
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text()) == rows  # finished variants are not rerun
    wrong_calls = [(["--variants", ":window=8"], "a variant is an attention spec or a .toml file; an attention"),
                   (["--variants", "full", "--", "--out", "x"], "pass --out before --")]  # fmt: skip
    for bad, message in wrong_calls:
        wrong = subprocess.run([sys.executable, "-m", "subquad", "compare", "--out", str(tmp_path / "w"), *bad],
                               env=_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
        assert wrong.returncode == 2 and message in wrong.stderr


def test_compare_at_equal_wall_clock_sets_each_variant_s_steps_from_its_probe(corpus, tmp_path):
    flags = ["--data", str(corpus), "--seq-len", "32", "--dim", "32", "--depth", "1", "--heads", "2",
             "--examples-per-step", "8", "--eval-every", "10", "--checkpoint-every", "10", "--warmup", "5"]  # fmt: skip
    out = tmp_path / "cmp"
    command = [sys.executable, "-m", "subquad", "compare", "--out", str(out), "--minutes", "0.01", "--variants", "full",
               "linear", "--", *flags]  # fmt: skip
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    budget = json.loads((out / "budget.json").read_text())
    rows = {r["variant"]: r for r in json.loads((out / "compare.json").read_text())}
    for variant in ("full", "linear"):
        entry = budget[variant]
        assert entry["minutes"] == 0.01 and entry["steps"] == max(1, round(0.6 / entry["probe_s_per_step"]))
        assert rows[variant]["steps"] == entry["steps"]  # the run took exactly the budgeted steps
        assert json.loads((out / variant / "config.json").read_text())["steps"] == entry["steps"]
    assert not list(out.glob(".probe-*"))  # probe runs are thrown away
    bad = subprocess.run([*command[:-len(flags)], *flags, "--steps", "5"], env=_env(), capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "--minutes sets each variant's steps" in bad.stderr
    zero = subprocess.run([*command[:7], "0", *command[8:]], env=_env(), capture_output=True, text=True, timeout=120)
    assert zero.returncode == 2 and "minutes must be a number > 0, got 0.0" in zero.stderr


def test_a_metrics_log_is_read_as_steps_and_numbers_and_a_cut_off_last_line_dropped(tmp_path):
    from subquad.files import FileError
    from subquad.train.loop import read_metrics, trimmed_log

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "loss_bpb": 2.5}\n{"step": 2, "val_bpb": 2.0}\n{"step": 3, "loss_b')
    assert read_metrics(log) == [{"step": 1, "loss_bpb": 2.5}, {"step": 2, "val_bpb": 2.0}]
    assert trimmed_log(log, 1) == [{"step": 1, "loss_bpb": 2.5}] and log.read_text() == '{"step": 1, "loss_bpb": 2.5}\n'
    broken = [('{"loss_bpb": 2.5}', "line 2 has no integer step"), ('{"step": true}', "line 2 has no integer"),
              ('{"step": 2, "lr": "x", "a": null}', "line 2: lr, a are not a number; a run's own log"),
              ('{"step": 2, "lr": [1]}', "line 2: lr is not a number")]  # fmt: skip
    for line, match in broken:
        log.write_text('{"step": 1}\n' + line + "\n")
        with pytest.raises(FileError, match=match):
            read_metrics(log)

import argparse
import json
import re
import subprocess
import sys
from dataclasses import fields, replace

import pytest
import torch

import subquad
from subquad import registry
from subquad.bench.command import arguments as bench_arguments
from subquad.bench.command import settings_from as _bench_settings
from subquad.bench.runner import BenchSettings
from subquad.cli import build_parser, main
from subquad.flags import old_spellings, option_parser

from .test_registry import TOY


def test_list_shows_options_defaults_and_capabilities(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "full: exact softmax attention" in out
    assert "causal: yes   cross (L != S): yes   recurrent: no   dtypes: float16, bfloat16, float32, float64" in out
    assert "cached decoding: KV cache (each new token attends to the whole prefix)" in out
    assert "backend: str = 'sdpa'  {sdpa, eager}" in out
    assert "grouped-query (enable_gqa): reads grouped K/V in place   dropout_p: yes" in out  # full
    assert "grouped-query (enable_gqa): repeats grouped K/V heads (a copy per call)   dropout_p: no" in out


def test_list_json(capsys):
    main(["list", "--json"])
    (full,) = [m for m in json.loads(capsys.readouterr().out) if m["name"] == "full"]
    assert full["causal"] and full["cross"] and not full["recurrent"] and full["decoding"].startswith("KV cache")
    assert full["options"] == [
        {"name": "backend", "type": "str", "default": "sdpa", "choices": ["sdpa", "eager"],
         "help": full["options"][0]["help"]}
    ]  # fmt: skip


def test_bench_runs_a_small_grid_and_writes_its_files(tmp_path, capsys):
    argv = ["bench", "--lengths", "32", "--heads", "4", "--head-dim", "4", "--causal", "no", "--backward", "no"]
    argv += ["--repeats", "2", "--max-seconds", "0.2", "--out", str(tmp_path), "--full.backend", "eager", "sdpa"]
    argv += ["--centres", "4", "--spread", "0.2", "--warmup-seconds", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "full(backend=eager)  non-causal  forward  32" in out
    assert "full(backend=sdpa)" not in out, "the default config runs once, as the baseline full"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["error.png", "memory.png", "ratio.png", "results.csv", "results.json", "time.png"]
    meta = json.loads((tmp_path / "results.json").read_text())["meta"]
    assert meta["settings"]["lengths"] == [32] and meta["torch"]
    assert meta["settings"]["centres"] == 4 and meta["settings"]["spread"] == 0.2
    assert meta["settings"]["warmup_seconds"] == 0


def test_bench_runs_on_the_queries_keys_and_values_of_a_file(tmp_path, capsys):
    from subquad.bench.inputs import save_inputs

    g = torch.Generator().manual_seed(0)
    save_inputs(tmp_path / "in.safetensors", *(torch.randn(2, 1, 2, 48, 4, generator=g) for _ in range(3)))
    argv = ["bench", "--inputs", str(tmp_path / "in.safetensors"), "--mechanisms", "local:window=8", "--causal", "no"]
    argv += ["--backward", "no", "--repeats", "2", "--max-seconds", "0.2", "--warmup-seconds", "0"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "error.png").exists()  # one panel: the file's inputs
    out = capsys.readouterr().out
    assert f"on the queries, keys and values of {tmp_path / 'in.safetensors'}" in out and "err (file)" in out
    rows = json.loads((tmp_path / "o" / "results.json").read_text())["results"]
    assert [(r["mechanism"], r["length"]) for r in rows] == [("full", 48), ("local(window=8)", 48)]
    assert rows[0]["error_inputs"] < 1e-6 < 1e-3 < rows[1]["error_inputs"] and "error_iid" not in rows[1]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--lengths", "64", "--heads", "2", "--out", str(tmp_path / "p")])
    assert exit_.value.code == 2
    assert "--inputs gives the cells' N, B, H, key/value heads and D; drop --lengths --heads" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_an_interrupted_bench_keeps_and_prints_the_cells_it_finished(tmp_path, capsys, monkeypatch):
    from subquad.bench import runner

    def run_cells(settings, cells):
        yield {"time_s": 0.002, "peak_bytes": 2**20, "times_s": [0.002]}
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "_run_cells", run_cells)
    argv = ["bench", "--mechanisms", "full", "--lengths", "32", "--backward", "no", "--out", str(tmp_path)]
    assert main(argv) == 130
    captured = capsys.readouterr()
    assert "full       non-causal  forward  32    2.000   1.000" in captured.out
    assert f"interrupted after 1 of 2 cells; their rows are in {tmp_path}" in captured.err
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["meta"]["cells_done"] == 1 and saved["meta"]["cells"] == 2
    assert [(r["mechanism"], r["causal"], r["ratio"]) for r in saved["results"]] == [("full", False, 1.0)]
    assert len((tmp_path / "results.csv").read_text().splitlines()) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--mechanisms", "nope"], "unknown mechanism 'nope'; available: full"),
        (["bench", "--lengths", "0"], "lengths must be positive, got [0]"),
        (["bench", "--mechanisms", "full", "--max-seconds", "0"], "max_seconds must be > 0 seconds, got 0.0"),
    ],
)
def test_bench_errors_exit_with_the_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_bench_rejects_bad_option_values(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--full.backend", "flash"])
    assert "invalid choice: 'flash'" in capsys.readouterr().err


def test_option_parsers_follow_the_field_types():
    parse, metavar = option_parser(tuple[float, ...])
    assert parse("0.5,0.25") == (0.5, 0.25) and metavar == "FLOAT,..."
    parse, metavar = option_parser(int | None)
    assert parse("none") is None and parse("3") == 3 and metavar == "INT|none"
    parse, _ = option_parser(bool)
    assert parse("yes") is True and parse("False") is False
    with pytest.raises(argparse.ArgumentTypeError, match="expected true or false, got 'maybe'"):
        parse("maybe")


def test_options_for_an_unselected_mechanism_raise(monkeypatch, capsys):
    subquad.mechanism_names()
    monkeypatch.setitem(registry._REGISTRY, "toy", TOY)
    with pytest.raises(SystemExit):
        main(["bench", "--mechanisms", "full", "--toy.width", "3"])
    assert "options given for ['toy'], which --mechanisms does not select" in capsys.readouterr().err


def _bench_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_arguments(parser)
    return parser.parse_args(argv)


def test_every_bench_setting_has_a_flag_whose_default_is_the_settings_default():
    args = _bench_args([])
    assert {f.name for f in fields(BenchSettings)} - {"variants"} <= set(vars(args))
    settings = _bench_settings(args)
    assert replace(settings, variants=()) == BenchSettings()
    assert [v.mechanism for v in settings.variants] == subquad.mechanism_names()


def test_bench_flags_build_the_settings():
    argv = ["--mechanisms", "full", "--lengths", "8", "16", "--causal", "yes", "--backward", "no", "--threads", "3"]
    argv += ["--dtype", "float64", "--warmup-seconds", "0.5", "--baseline-max-length", "8"]
    settings = _bench_settings(_bench_args(argv))
    assert settings.lengths == (8, 16) and settings.causal == (True,) and settings.backward == (False,)
    assert settings.threads == 3 and settings.dtype == "float64" and settings.warmup_seconds == 0.5
    assert settings.baseline_max_length == 8 and [v.label for v in settings.variants] == ["full"]


def test_python_m_subquad_runs_the_command():
    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "subquad", *argv], capture_output=True, text=True, timeout=300)

    listing = run("list")
    assert listing.returncode == 0, listing.stderr
    names = [line.split(":")[0] for line in listing.stdout.splitlines() if line and not line.startswith(" ")]
    assert names == subquad.mechanism_names()
    bench_help = run("bench", "--help")
    assert bench_help.returncode == 0, bench_help.stderr
    assert "--warmup-seconds" in bench_help.stdout


def test_the_grid_gives_lengths_and_warm_ups_that_are_not_set():
    from subquad.bench.runner import GRIDS

    parse = lambda *argv: _bench_settings(build_parser().parse_args(["bench", *argv]))
    default, full = parse(), parse("--grid", "full")
    assert tuple(default.lengths) == GRIDS["default"]["lengths"] and default.warmup_seconds == 0.5
    assert tuple(full.lengths) == GRIDS["full"]["lengths"] and full.warmup_seconds == 2.0 and full.repeats == 20
    mixed = parse("--grid", "full", "--lengths", "64", "--warmup-seconds", "0")
    assert tuple(mixed.lengths) == (64,) and mixed.warmup_seconds == 0 and mixed.max_seconds == 2.0
    with pytest.raises(SystemExit):
        parse("--grid", "huge")
    gpu = parse("--grid", "gpu")
    assert (gpu.device, gpu.dtype, gpu.heads, gpu.batch, gpu.head_dim) == ("cuda", "bfloat16", 16, 1, 64)
    assert tuple(gpu.lengths) == (4096, 16384, 65536, 131072) and gpu.timeout == 300
    own = parse("--grid", "gpu", "--heads", "8", "--dtype", "float16", "--device", "cuda:1")
    assert (own.heads, own.dtype, own.device, own.batch) == (8, "float16", "cuda:1", 1)
    assert parse("--heads", "4").device == "cpu" and parse().dtype == "float32"  # the default grid sets neither


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals of a machine without a CUDA device")
def test_bench_refuses_a_cuda_device_it_does_not_have(tmp_path, capsys):
    refusals = {
        ("--grid", "gpu"): r"sees no CUDA device here; .*\(the gpu grid needs one; on a CPU, give --grid default",
        ("--device", "cuda:0"): r"--device cuda:0: torch .* sees no CUDA device here; .*\(or --device cpu\)",
        ("--device", "gpu"): r"--device 'gpu' is not a device torch knows; give cpu, cuda or cuda:N",
    }
    for argv, message in refusals.items():
        with pytest.raises(SystemExit):
            main(["bench", *argv, "--out", str(tmp_path)])
        assert re.search(message, capsys.readouterr().err)
    assert not any(tmp_path.iterdir())


def test_list_and_bench_need_no_train_or_hf_extra_and_train_says_which_to_install(tmp_path):
    """``pip install subquad[bench]`` then ``subquad bench`` (the README's first command) has neither
    safetensors nor transformers: building the command line must not import them, and a run that
    needs them stops before any work with the extra to install."""
    shim = (
        "import sys\n"
        "for name in ('safetensors', 'transformers'):\n"
        "    sys.modules[name] = None  # importing it raises ImportError, as when it is not installed\n"
        "from subquad.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", shim, *argv], capture_output=True, text=True, timeout=300)

    listed = run("list")
    assert listed.returncode == 0 and "full:" in listed.stdout
    assert run("bench", "--help").returncode == 0
    out = tmp_path / "run"
    trained = run("train", "--task", "listops", "--out", str(out))
    assert trained.returncode == 2 and "Traceback" not in trained.stderr
    assert "checkpoints need safetensors" in trained.stderr and "pip install 'subquad[train]'" in trained.stderr
    assert not out.exists()


def test_bench_mechanisms_take_the_one_spec_grammar_beside_the_sweep_flags():
    settings = _bench_settings(
        _bench_args(["--mechanisms", "local:window=64,sinks=2", "full", "--local.window", "8", "16"])
    )
    assert [v.label for v in settings.variants][-1] == "full"
    assert [dict(v.options) for v in settings.variants[:2]] == [{"window": 8, "sinks": 2}, {"window": 16, "sinks": 2}]
    one = _bench_settings(_bench_args(["--mechanisms", "local:window=64"]))
    assert [dict(v.options) for v in one.variants] == [{"window": 64}]
    with pytest.raises(ValueError, match=r"'local\*2\+full' is a head mix; a bench cell times one mechanism"):
        _bench_settings(_bench_args(["--mechanisms", "local*2+full"]))
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['windw'\] for local"):
        _bench_settings(_bench_args(["--mechanisms", "local:windw=3"]))


def test_boolean_flags_are_x_and_no_x_and_the_old_yes_no_warns_for_one_release(monkeypatch):
    parser = build_parser()
    parse = lambda *argv: parser.parse_args(old_spellings(parser, list(argv)))
    assert parse("train", "--bf16").bf16 is True and parse("train", "--no-bf16").bf16 is False
    assert parse("train").grad_checkpoint is False and parse("train", "--grad-checkpoint").grad_checkpoint is True
    assert parse("bench").plots is True and parse("bench", "--no-plots").plots is False
    assert parse("bench", "--adaptive-threads").adaptive_threads is True
    assert parse("approx", "m", "--data", "d", "--out", "o", "--no-speed").speed is False
    with pytest.warns(DeprecationWarning, match=r"--bf16 yes is deprecated \(until the next release\): write --bf16"):
        assert parse("train", "--bf16", "yes").bf16 is True
    with pytest.warns(DeprecationWarning, match=r"write --no-adaptive-threads"):
        assert parse("bench", "--adaptive-threads", "no").adaptive_threads is False
    with pytest.raises(SystemExit):
        parse("train", "--no-bf16", "maybe")


def test_renamed_flags_say_what_they_count_and_the_old_names_warn_for_one_release():
    parser = build_parser()
    parse = lambda *argv: parser.parse_args(list(argv))
    model = ("m", "--data", "d", "--out", "o")
    renamed = [
        (("train", "--examples-per-step", "8"), ("train", "--batch", "8"), "batch", 8),
        (("approx", *model, "--window-tokens", "64"), ("approx", *model, "--tokens", "64"), "tokens", 64),
        (("approx", *model, "--windows", "9"), ("approx", *model, "--samples", "9"), "samples", 9),
        (("approx", *model, "--windows-per-forward", "2"), ("approx", *model, "--batch", "2"), "batch", 2),
        (("distill", *model, "--mechanism", "linear", "--window-tokens", "64"),
         ("distill", *model, "--mechanism", "linear", "--tokens", "64"), "tokens", 64),
        (("distill", *model, "--mechanism", "linear", "--windows-per-step", "3"),
         ("distill", *model, "--mechanism", "linear", "--batch", "3"), "batch", 3),
        (("evaluate", "run", "--batches", "2"), ("evaluate", "run", "--windows", "2"), "batches", 2),
        (("generate", "run", "--prompt", "a", "--new-bytes", "5"),
         ("generate", "run", "--prompt", "a", "--tokens", "5"), "new_bytes", 5),
    ]  # fmt: skip
    for new, old, dest, value in renamed:
        assert getattr(parse(*new), dest) == value
        with pytest.warns(DeprecationWarning, match=rf"{old[-2]} is deprecated \(until the next release\): write "
                          rf"{new[-2]}"):  # fmt: skip
            assert getattr(parse(*old), dest) == value
    assert "--tokens" not in _help(parser, "approx") and "--window-tokens" in _help(parser, "approx")


def _help(parser: argparse.ArgumentParser, command: str) -> str:
    return parser._subparsers._group_actions[0].choices[command].format_help()


def test_every_command_that_computes_takes_device_and_the_model_commands_take_dtype():
    parser = build_parser()
    for command in ("bench", "train", "evaluate", "generate", "approx", "distill"):
        assert "--device" in _help(parser, command), command
    for command in ("bench", "approx", "distill"):
        assert "--dtype" in _help(parser, command), command
    args = parser.parse_args(["approx", "m", "--data", "d", "--out", "o", "--device", "cpu", "--dtype", "bfloat16"])
    assert (args.device, args.dtype) == ("cpu", "bfloat16")
    with pytest.raises(SystemExit):
        parser.parse_args(["distill", "m", "--data", "d", "--out", "o", "--mechanism", "x", "--dtype", "int8"])


def test_the_model_commands_flags_are_their_configs_fields_with_the_same_defaults():
    from subquad.flags import flag_values
    from subquad.hf.approx import ApproxConfig
    from subquad.hf.distill import DistillConfig

    parser = build_parser()
    approx = flag_values(parser.parse_args(["approx", "m", "--data", "d", "--out", "o"]), ApproxConfig)
    assert ApproxConfig(**approx) == ApproxConfig("m", "d", "o")
    distill = parser.parse_args(["distill", "m", "--data", "d", "--out", "o", "--mechanism", "linear"])
    assert DistillConfig(**flag_values(distill, DistillConfig)) == DistillConfig("m", "d", "linear", "o")
    layers = parser.parse_args(["distill", "m", "--data", "d", "--out", "o", "--mechanism", "x", "--layers", "1", "3"])
    assert flag_values(layers, DistillConfig)["layers"] == (1, 3)


def test_approx_settings_name_the_flag_of_a_bad_value():
    from subquad.hf.approx import ApproxConfig

    for field, flag in (("tokens", "--window-tokens"), ("samples", "--windows"), ("batch", "--windows-per-forward")):
        with pytest.raises(ValueError, match=rf"{flag} must be >= 1, got 0"):
            ApproxConfig("m", "d", "o", **{field: 0})
    with pytest.raises(
        ValueError,
        match=r"--windows must be >= 2 \(an encoder's measures compare windows; every run takes two\), got 1",
    ):
        ApproxConfig("m", "d", "o", samples=1)
    with pytest.raises(ValueError, match="--calibration must be >= 0, got -1"):
        ApproxConfig("m", "d", "o", calibration=-1)
    with pytest.raises(ValueError, match="--context must be >= 1, got 0"):
        ApproxConfig("m", "d", "o", context=0)


def test_cli_only_wires_the_commands_each_job_declares():
    from subquad.cli import COMMANDS

    names = [c.name for c in COMMANDS]
    assert names == ["list", "bench", "tune", "train", "evaluate", "generate", "upgrade-run", "compare", "approx",
                     "distill", "heads"]  # fmt: skip
    modules = {c.name: c.run.__module__ for c in COMMANDS}
    assert modules["tune"] == "subquad.bench.tune"
    assert (
        modules["bench"] == "subquad.bench.command" and modules["distill"] == modules["heads"] == "subquad.hf.command"
    )
    assert all(not m.startswith("subquad.cli") for m in modules.values())


def test_a_config_file_value_outside_a_settings_choices_is_refused_by_name():
    from subquad.hf.approx import ApproxConfig
    from subquad.train.config import TrainConfig

    with pytest.raises(ValueError, match="task must be one of text, listops, pixels, got 'uext'"):
        TrainConfig(task="uext")
    with pytest.raises(ValueError, match="position must be one of auto, learned, conv, both, got 'x'"):
        TrainConfig(task="listops", position="x")
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, got 'int8'"):
        ApproxConfig("m", "d", "o", dtype="int8")


def test_the_old_spellings_are_rewritten_with_a_warning_a_user_sees():
    parser = build_parser()
    with pytest.warns(DeprecationWarning, match=r"--batch is deprecated \(until the next release\): write "
                      r"--examples-per-step"):  # fmt: skip
        assert old_spellings(parser, ["train", "--batch=8"]) == ["train", "--examples-per-step=8"]
    with pytest.warns(DeprecationWarning, match="write --window-tokens"):
        assert old_spellings(parser, ["approx", "m", "--tokens", "9"]) == ["approx", "m", "--window-tokens", "9"]
    assert old_spellings(parser, ["bench", "--batch", "2"]) == ["bench", "--batch", "2"]  # bench's own B
    assert parser.parse_args(["train", "--options"]).options == []  # an empty deprecated list, as before
    # the warning is the program's, so Python's default filter shows it on the terminal
    shown = subprocess.run([sys.executable, "-m", "subquad", "evaluate", "no-such-run", "--windows", "3"],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert "DeprecationWarning: --windows is deprecated (until the next release): write --batches" in shown.stderr

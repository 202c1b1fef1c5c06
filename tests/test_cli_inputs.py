"""Bad input to the jobs' commands gets a clear error before any work, and the command line's flags
win over a config file's (found by a review of the commands as a user runs them)."""

import json

import pytest

from subquad.cli import main
from subquad.train.config import TrainConfig

TINY = ["--seq-len", "32", "--dim", "16", "--depth", "1", "--heads", "2", "--examples-per-step", "2",
        "--eval-windows", "2", "--device", "cpu"]  # fmt: skip


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(300)))
    return path


def _error(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_flags_typed_on_the_command_line_win_over_the_config_file_even_at_their_default(corpus, tmp_path, capsys):
    """A flag given at its default value yielded to the file (argparse fills defaults in)."""
    config = tmp_path / "c.toml"
    config.write_text("seq_len = 48\ndropout = 0.1\nheads = 4\n")
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), "--data", str(corpus), *TINY, "--dropout", "0.0", "--steps", "2",
                 "--out", str(out)]) == 0  # fmt: skip
    saved = json.loads((out / "config.json").read_text())
    assert (saved["seq_len"], saved["dropout"], saved["heads"]) == (32, 0.0, 2)  # typed: 32 and 0.0 (the default)
    assert json.loads((out / "config.json").read_text())["steps"] == 2
    capsys.readouterr()


def test_a_run_that_is_not_there_or_a_file_as_out_is_refused_before_any_work(corpus, tmp_path, capsys):
    flags = ["train", "--data", str(corpus), *TINY, "--steps", "2"]
    err = _error(capsys, [*flags, "--out", str(tmp_path / "moved"), "--resume"])
    assert "--resume: " in err and "holds no run to continue (no config.json there)" in err
    assert not (tmp_path / "moved").exists()
    (tmp_path / "file").write_text("")
    assert "is a file; pass a folder (it is created if missing)" in _error(
        capsys, [*flags, "--out", str(tmp_path / "file")]
    )


@pytest.mark.parametrize("name", ["lr", "min_lr", "clip", "dropout", "weight_decay"])
def test_settings_that_are_not_finite_numbers_are_refused_by_name(corpus, name):
    with pytest.raises(ValueError, match=rf"{name} must be a finite number, got nan"):
        TrainConfig(data=str(corpus), **{name: float("nan")})


def test_a_floor_above_the_learning_rate_is_refused(corpus):
    with pytest.raises(ValueError, match=r"min_lr = 3e-05 is above lr = 1e-05: .* give min_lr 1e-05 or less"):
        TrainConfig(data=str(corpus), lr=1e-5)
    assert TrainConfig(data=str(corpus), lr=1e-5, min_lr=1e-5).min_lr == 1e-5


def test_a_run_that_diverges_stops_and_says_so_instead_of_logging_nan(corpus, tmp_path, capsys):
    err = _error(capsys, ["train", "--data", str(corpus), *TINY, "--steps", "30", "--lr", "1e6", "--clip", "0",
                          "--out", str(tmp_path / "run")])  # fmt: skip
    assert "the training loss is nan at step" in err and "the run diverged (lr=1000000.0" in err


def test_a_mechanism_without_a_causal_form_is_refused_for_the_language_model(corpus):
    with pytest.raises(ValueError, match="clustered has no causal form; mechanisms with one: full"):
        TrainConfig(data=str(corpus), attention="local*1+clustered*1", heads=2)


def test_evaluate_and_generate_refuse_what_they_cannot_do_by_name(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), *TINY, "--steps", "2", "--out", str(run)]) == 0
    capsys.readouterr()
    assert "--batches must be a count >= 1" in _error(capsys, ["evaluate", str(run), "--batches", "0"])
    assert "this task's splits are train, val, test, got 'foo'" in _error(
        capsys, ["evaluate", str(run), "--split", "foo"]
    )
    generate = ["generate", str(run), "--prompt", "the ", "--new-bytes", "2"]
    assert "it needs k >= 1 and --temperature > 0 (at 0 generation is greedy)" in _error(
        capsys, [*generate, "--top-k", "5"]
    )
    assert "--temperature must be >= 0 (0: greedy), got nan" in _error(capsys, [*generate, "--temperature", "nan"])


def test_compare_refuses_a_bad_variant_shared_folders_and_runs_of_other_settings_before_training(corpus, tmp_path,
                                                                                                   capsys):  # fmt: skip
    out = tmp_path / "cmp"
    flags = ["--data", str(corpus), *TINY]
    err = _error(
        capsys, ["compare", "--out", str(out), "--variants", "full", "clustered", "--", *flags, "--steps", "2"]
    )
    assert "clustered has no causal form" in err and not (out / "full").exists()  # nothing trained first
    for folder, spec in (("a", "full"), ("b", "local")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "v.toml").write_text(f'attention = "{spec}"\n')
    err = _error(capsys, ["compare", "--out", str(out), "--variants", str(tmp_path / "a" / "v.toml"),
                          str(tmp_path / "b" / "v.toml"), "--", *flags, "--steps", "2"])  # fmt: skip
    assert "would share the run folder" in err and "rename one" in err
    run = out / "full"
    assert main(["train", *flags, "--steps", "2", "--attention", "full", "--out", str(run)]) == 0
    capsys.readouterr()
    err = _error(capsys, ["compare", "--out", str(out), "--variants", "full", "--", *flags, "--steps", "3"])
    assert "is a run of 'full' with other settings (run, now): {'steps': (2, 3)}" in err


def test_bench_says_which_mechanisms_have_no_causal_cells_and_refuses_a_file_as_out(tmp_path, capsys):
    argv = ["bench", "--mechanisms", "clustered", "--lengths", "32", "--heads", "4", "--head-dim", "4", "--causal",
            "yes", "--backward", "no", "--repeats", "2", "--max-seconds", "0.2", "--warmup-seconds", "0",
            "--no-plots"]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert "no causal cells for clustered (no causal form)" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert "--out " in _error(capsys, [*argv, "--out", str(tmp_path / "file")])
    assert "is a folder; pass the profile's file path" in _error(
        capsys, ["tune", "--out", str(tmp_path), "--budget", "1"]
    )


def test_an_interrupted_command_exits_130_without_a_traceback(monkeypatch, capsys):
    import subquad.cli
    from subquad.flags import Command

    def stopped(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(subquad.cli, "COMMANDS", (Command("stop", "is stopped", lambda parser: None, stopped),))
    with pytest.raises(SystemExit) as exit_:
        main(["stop"])
    assert exit_.value.code == 130 and "subquad stop: interrupted" in capsys.readouterr().err

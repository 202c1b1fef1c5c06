"""Tuning profiles (kernels.profile), the autotuner's choice (bench.autotune) and ``subquad tune``.
No test times anything: the autotuner's clock is replaced by a function of the knob's value."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import subquad
from subquad.bench import autotune
from subquad.cli import main
from subquad.kernels import profile
from subquad.kernels.tuning import TUNING, Tuning, tuned

from .conftest import qkv

DEFAULTS = {f.name: f.default for f in dataclasses.fields(Tuning)}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder of our own, profiles looked up there; the layer forgotten after."""
    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path))
    monkeypatch.delenv(profile.ENV, raising=False)
    profile.forget()
    yield tmp_path
    profile.forget()


def _write(values, threads=None, **record):
    path = profile.profile_path(threads)
    profile.write_profile(path, values, {"cpu": profile.cpu_model(), **record})
    return path


def test_the_key_names_cpu_threads_and_torch_and_is_a_safe_file_name():
    key = profile.profile_key(3, "Intel(R) Xeon(R) Platinum 8480C / v2", "2.13.0+cpu")
    assert key == "Intel-R-Xeon-R-Platinum-8480C-v2_3t_torch-2.13.0+cpu"
    assert profile.profile_key(3, "", "") == "unknown_3t_torch-unknown"
    assert profile.profile_key(2) != profile.profile_key(4)


def test_the_cache_folder_follows_subquad_cache_then_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("SUBQUAD_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert profile.cache_folder() == tmp_path / "xdg" / "subquad"
    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path / "own"))
    assert profile.profile_path(5).parent == tmp_path / "own" / "tuning"
    assert profile.profile_path(5).name.endswith("_5t_torch-" + torch.__version__.replace("/", "-") + ".json")


def test_a_profile_is_applied_at_its_thread_count_only_and_forgotten_after(cache):
    threads = torch.get_num_threads()
    _write({"clustered_tile": 8, "local_block": 16}, threads)
    used = profile.apply_for_threads(threads)
    assert used.values == {"clustered_tile": 8, "local_block": 16} and str(cache) in used.describe()
    assert (TUNING.clustered_tile, TUNING.local_block) == (8, 16)
    assert profile.apply_for_threads(threads + 1).path is None  # no profile for that count: the defaults
    assert (TUNING.clustered_tile, TUNING.local_block) == (DEFAULTS["clustered_tile"], DEFAULTS["local_block"])
    profile.apply_for_threads(threads)
    profile.forget()
    assert TUNING.clustered_tile == DEFAULTS["clustered_tile"] and TUNING.local_block == DEFAULTS["local_block"]


def test_a_call_applies_the_profile_and_computes_what_the_defaults_compute(cache):
    q, k, v = qkv(B=1, H=2, L=300, D=8, dtype=torch.float32)
    expected = subquad.attention(q, k, v, mechanism="local", window=40, is_causal=True)  # no profile yet
    _write({"local_inference_block": 8, "local_block": 8}, torch.get_num_threads())
    profile.forget()  # as a new process would, after `subquad tune`
    out = subquad.attention(q, k, v, mechanism="local", window=40, is_causal=True)
    assert TUNING.local_inference_block == 8 and TUNING.local_block == 8
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_the_caller_s_own_values_win_over_the_profile(cache):
    threads = torch.get_num_threads()
    _write({"linear_block": 1 << 10}, threads)
    with tuned(linear_block=77):
        profile.apply_for_threads(threads)
        assert TUNING.linear_block == 77
    profile.forget()
    TUNING.linear_block = 99
    try:
        profile.apply_for_threads(threads)
        assert TUNING.linear_block == 99
    finally:
        TUNING.linear_block = DEFAULTS["linear_block"]


def test_the_environment_turns_profiles_off_or_names_one(cache, monkeypatch, tmp_path):
    threads = torch.get_num_threads()
    _write({"tiles_group": 1 << 12}, threads)
    monkeypatch.setenv(profile.ENV, "off")
    assert profile.apply_for_threads(threads).path is None and TUNING.tiles_group == DEFAULTS["tiles_group"]
    elsewhere = tmp_path / "mine.json"
    profile.write_profile(elsewhere, {"tiles_group": 1 << 13}, {})
    monkeypatch.setenv(profile.ENV, str(elsewhere))
    assert profile.apply_for_threads(threads).path == elsewhere and TUNING.tiles_group == 1 << 13


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "cannot be read"),
        ("[1, 2]", "is not a format-1 profile"),
        (json.dumps({"format": 2, "values": {}}), "is not a format-1 profile"),
        (json.dumps({"format": 1, "values": {"no_such_knob": 4}}), r"names \['no_such_knob'\], which are not"),
        (json.dumps({"format": 1, "values": {"adaptive_threads": 1}}), r"names \['adaptive_threads'\]"),
        (json.dumps({"format": 1, "values": {"local_block": 0}}), "local_block must be an int >= 1, got 0"),
        (json.dumps({"format": 1, "values": {"local_block": "__import__('os')"}}), "local_block must be an int"),
        (json.dumps({"format": 1, "values": {"local_block": True}}), "local_block must be an int"),
    ],
)
def test_a_bad_profile_is_refused_naming_the_file_and_the_fix(tmp_path, text, match):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as error:
        profile.read_profile(path)
    assert str(path) in str(error.value) and "run `subquad tune` again or delete" in str(error.value)


def test_a_bad_profile_warns_once_and_calls_run_on_the_defaults(cache):
    path = profile.profile_path(torch.get_num_threads())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": 1, "values": {"local_block": -3}}))
    q, k, v = qkv(B=1, H=1, L=20, D=4, dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="local_block must be an int >= 1, got -3.*using the default tuning"):
        subquad.attention(q, k, v, mechanism="local", window=4)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        subquad.attention(q, k, v, mechanism="local", window=4)  # read once: no second warning
    assert TUNING.local_block == DEFAULTS["local_block"]


def test_write_profile_refuses_switches_and_bad_values_and_leaves_no_partial_file(tmp_path):
    with pytest.raises(ValueError, match=r"\['adaptive_threads'\] are not tuning knobs a profile may set"):
        profile.write_profile(tmp_path / "p.json", {"adaptive_threads": 1}, {})
    with pytest.raises(ValueError, match="clustered_tile must be an int >= 1"):
        profile.write_profile(tmp_path / "p.json", {"clustered_tile": 0}, {})
    assert list(tmp_path.iterdir()) == []


def test_candidates_are_whole_numbers_around_the_incumbent_each_once():
    knob = autotune.Knob("x", ())
    assert autotune.candidates(knob, 16) == [16, 4, 8, 32, 64]
    assert autotune.candidates(knob, 1) == [1, 2, 4]
    assert autotune.candidates(autotune.Knob("x", (), (0.5, 2.0)), 3) == [3, 2, 6]


def _clock(monkeypatch, seconds):
    """The autotuner's clock replaced: a call 'takes' ``seconds(value, workload index)``."""
    monkeypatch.setattr(autotune, "_call", lambda work: work)
    monkeypatch.setattr(autotune, "_seconds", lambda work: seconds(TUNING.clustered_tile, work))


def _knob(*names):
    return autotune.Knob("clustered_tile", tuple(autotune.Workload(n, 64, False, False) for n in names))


def test_the_fastest_candidate_is_taken_when_clearly_faster_everywhere(monkeypatch):
    _clock(monkeypatch, lambda value, work: 1.0 + abs(value - 32) / 16)
    record = autotune.tune_knob(_knob("a", "b"), budget=0)
    assert record["default"] == 16 and record["chosen"] == 32 and record["rounds"] == autotune.MIN_ROUNDS
    assert record["score"]["32"] == pytest.approx(0.5) and record["score"]["4"] == pytest.approx(2.75 / 2)
    assert TUNING.clustered_tile == 16  # measuring changes nothing


def test_the_default_stays_when_the_gain_is_small_or_some_call_gets_slower(monkeypatch):
    _clock(monkeypatch, lambda value, work: 1.0 - 0.03 * (value == 64))  # 3% faster: below GAIN
    assert autotune.tune_knob(_knob("a"), budget=0)["chosen"] == 16
    # twice as fast on one call, 10% slower on the other: the geometric mean gains, one call is harmed
    _clock(monkeypatch, lambda value, work: 1.0 if value != 64 else (0.5 if work.mechanism == "a" else 1.1))
    record = autotune.tune_knob(_knob("a", "b"), budget=0)
    assert record["score"]["64"] < 1 - autotune.GAIN and record["chosen"] == 16


def test_tune_carries_each_choice_into_the_next_knob_and_restores_the_table(monkeypatch):
    monkeypatch.setattr(autotune, "_call", lambda work: work)
    seen = []

    def seconds(work):
        seen.append((TUNING.clustered_tile, TUNING.topk_chunk))
        return 1.0 + abs(TUNING.clustered_tile - 64) + abs(TUNING.topk_chunk - 8)

    monkeypatch.setattr(autotune, "_seconds", seconds)
    work = (autotune.Workload("a", 64, False, False),)
    records = autotune.tune(0, (autotune.Knob("clustered_tile", work), autotune.Knob("topk_chunk", work)))
    assert [(r["knob"], r["chosen"]) for r in records] == [("clustered_tile", 64), ("topk_chunk", 8)]
    assert {tile for tile, chunk in seen[-5:]} == {64}  # the second knob was timed with the first one's choice
    assert (TUNING.clustered_tile, TUNING.topk_chunk) == (16, 4)


def test_every_knob_tuned_is_a_block_size_of_the_table_and_its_calls_run():
    names = {f.name for f in dataclasses.fields(Tuning) if not f.metadata.get("switch")}
    assert {k.name for k in autotune.KNOBS} <= names
    for knob in autotune.KNOBS:
        assert knob.workloads and all(w.length >= 1024 for w in knob.workloads), knob.name
        subquad.make_config(knob.workloads[0].mechanism)  # a mechanism the registry has


def test_subquad_tune_writes_the_profile_later_calls_use(cache, monkeypatch, capsys):
    _clock(monkeypatch, lambda value, work: 1.0 + abs(value - 8) / 8)
    knob = autotune.Knob("clustered_tile", (autotune.Workload("improved-clustered", 1024, False, False),))
    monkeypatch.setattr(autotune, "KNOBS", (knob,))
    assert main(["tune", "--budget", "1", "--knobs", "clustered_tile"]) == 0
    out = capsys.readouterr().out
    path = profile.profile_path()
    assert f"wrote {path} (1 of 1 knobs changed)" in out and "clustered_tile" in out
    saved = json.loads(path.read_text())
    assert saved["values"] == {"clustered_tile": 8} and saved["threads"] == torch.get_num_threads()
    assert saved["measured"][0]["score"]["8"] < saved["measured"][0]["score"]["16"]
    assert main(["tune", "--show"]) == 0
    assert f"{path} (clustered_tile=8)" in capsys.readouterr().out
    assert main(["tune", "--reset"]) == 0 and not path.exists()
    assert "deleted profile" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [(["--budget", "0"], "--budget is seconds"), (["--threads", "0"], "--threads")])
def test_subquad_tune_refuses_bad_flags(argv, match, capsys):
    with pytest.raises(SystemExit):
        main(["tune", *argv])
    assert match in capsys.readouterr().err


def test_bench_names_the_profile_it_runs_with(cache, tmp_path, capsys):
    argv = ["bench", "--mechanisms", "full", "--lengths", "16", "--heads", "2", "--head-dim", "4", "--causal", "no",
            "--backward", "no", "--repeats", "1", "--max-seconds", "0.1", "--warmup-seconds", "0", "--no-plots",
            "--out", str(tmp_path / "none")]  # fmt: skip
    assert main(argv) == 0
    assert "tuning profile: none (the defaults)" in capsys.readouterr().err
    path = _write({"tiles_group": 1 << 12}, torch.get_num_threads())
    profile.forget()
    argv[-1] = str(tmp_path / "with")
    assert main(argv) == 0
    assert f"tuning profile: {path} (tiles_group=4096)" in capsys.readouterr().err
    meta = json.loads((tmp_path / "with" / "results.json").read_text())["meta"]
    assert meta["tuning_profile"] == f"{path} (tiles_group=4096)"

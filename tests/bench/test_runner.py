import sys
import textwrap

import pytest

import subquad
from subquad import registry
from subquad.bench import runner
from subquad.bench.runner import BASELINE, GRIDS, BenchSettings, Variant, _run_cell, _run_in_workers, run_bench

from ..test_registry import TOY


def test_bench_measures_memory_time_error_and_ratio():
    """Eager full attention holds two (H, N, N) fp32 buffers at once (its peak sits within a few pages
    of 2 × scores); the fused kernel holds none."""
    N, H = 1024, 4
    settings = BenchSettings(
        variants=[Variant("full", (("backend", "eager"),))], lengths=[N], heads=H, head_dim=16,
        causal=(False,), repeats=2, max_seconds=0.5, warmup_seconds=0.0,
    )  # fmt: skip
    calls, saved = [], []
    rows = run_bench(
        settings,
        progress=lambda i, n, label: calls.append((i, n)),
        on_row=lambda rows: saved.append([r["ratio"] for r in rows]),
    )
    assert calls[0] == (0, 4) and calls[-1] == (4, 4)
    # after each cell, the rows so far with their ratios (the baseline runs first in each group)
    assert [len(s) for s in saved] == [1, 2, 3, 4] and saved[0] == [1.0] and saved[-1] == [r["ratio"] for r in rows]
    by = {(r["mechanism"], r["pass"]): r for r in rows}
    scores_bytes = H * N * N * 4
    assert by["full(backend=eager)", "forward"]["peak_bytes"] >= 1.9 * scores_bytes
    assert by["full", "forward"]["peak_bytes"] < scores_bytes / 4
    assert by["full", "forward"]["ratio"] == 1.0 and by["full", "forward+backward"]["ratio"] == 1.0
    assert by["full(backend=eager)", "forward"]["ratio"] > 0
    for r in rows:  # the baseline's rows are its own; every other row's ratio is its paired one
        paired = r["mechanism"] != "full"
        assert ("paired_ratio" in r) == paired and (not paired or r["ratio"] == r["paired_ratio"])
    for r in rows:
        assert "error" not in r and r["time_s"] > 0
        if r["pass"] == "forward":
            assert r["error_iid"] < 1e-5 and r["error_clustered"] < 1e-5 and r["zero_rows"] == 0


def test_cells_put_the_baseline_first_and_skip_impossible_causal_cells(monkeypatch):
    subquad.mechanism_names()
    monkeypatch.setitem(registry._REGISTRY, "toy", TOY)
    settings = BenchSettings(
        variants=[Variant("toy"), Variant("full", (("backend", "sdpa"),)), Variant("full", (("backend", "eager"),))],
        lengths=[64, 32], backward=(False,),
    )  # fmt: skip
    labels = [(v.label, n, c) for v, n, c, _ in settings.cells()]
    assert labels == [
        ("full", 32, False), ("toy", 32, False), ("full(backend=eager)", 32, False),
        ("full", 32, True), ("full(backend=eager)", 32, True),
        ("full", 64, False), ("toy", 64, False), ("full(backend=eager)", 64, False),
        ("full", 64, True), ("full(backend=eager)", 64, True),
    ]  # fmt: skip
    assert BASELINE.label == "full"


def test_a_failing_cell_is_reported_not_raised(monkeypatch):
    subquad.mechanism_names()
    monkeypatch.setitem(registry._REGISTRY, "toy", TOY)  # registered here only, unknown to the worker
    result = _run_cell(BenchSettings(), Variant("toy"), 16, False, False)
    assert result["error"].startswith("ValueError: unknown mechanism 'toy'; available: full")
    slow = _run_cell(BenchSettings(timeout=0.01), BASELINE, 16, False, False)
    assert slow["error"] == "timed out after 0.01 s"


def test_one_worker_runs_several_cells_and_each_cell_measures_its_own_peak():
    """Eager full attention's peak is twice the scores in every cell, also after the cells before it
    freed that much: the freed memory goes back to the system between cells, so it is not reused
    unseen."""
    N, H = 1024, 4
    settings = BenchSettings(lengths=[N], heads=H, head_dim=16, repeats=1, max_seconds=0.1, warmup_seconds=0.0)
    eager = Variant("full", (("backend", "eager"),))
    cells = [(eager, N, False, False), (BASELINE, N, False, False), (eager, N, False, False)]
    first, fused, again = _run_in_workers(settings, cells)
    scores_bytes = H * N * N * 4
    assert first["peak_bytes"] >= 1.9 * scores_bytes and again["peak_bytes"] >= 1.9 * scores_bytes
    assert fused["peak_bytes"] < scores_bytes / 4


def test_a_cell_that_fails_in_a_shared_worker_costs_only_itself(monkeypatch):
    subquad.mechanism_names()
    monkeypatch.setitem(registry._REGISTRY, "toy", TOY)  # registered here only, unknown to the worker
    settings = BenchSettings(repeats=1, max_seconds=0.1, warmup_seconds=0.0, heads=2, head_dim=4)
    cells = [(BASELINE, 16, False, False), (Variant("toy"), 16, False, False), (BASELINE, 16, True, False)]
    before, failed, after = _run_in_workers(settings, cells)
    assert failed["error"].startswith("ValueError: unknown mechanism 'toy'")
    assert before["time_s"] > 0 and after["time_s"] > 0 and "error" not in after


# A stand-in worker: answers each cell with its length, dies at length 13 and hangs at length 21.
_FAKE_WORKER = textwrap.dedent("""
    import json, os, sys, time
    for cell in json.load(sys.stdin):
        if cell["length"] == 13:
            sys.stderr.write("boom\\n")
            sys.stderr.flush()
            os._exit(3)
        if cell["length"] == 21:
            time.sleep(60)
        print(json.dumps({"time_s": cell["length"]}), flush=True)
""")


def test_a_worker_that_dies_or_hangs_costs_its_cell_and_a_new_worker_takes_the_rest(monkeypatch):
    monkeypatch.setattr(runner, "_WORKER", [sys.executable, "-c", _FAKE_WORKER])
    settings = BenchSettings(timeout=2.0)
    cells = [(BASELINE, n, False, False) for n in (8, 13, 9, 21, 10)]
    results = list(_run_in_workers(settings, cells))
    assert results == [
        {"time_s": 8}, {"error": "worker exited with code 3 boom"}, {"time_s": 9},
        {"error": "timed out after 2 s"}, {"time_s": 10},
    ]  # fmt: skip


def test_the_default_grid_is_the_settings_default_and_the_full_grid_reaches_16k():
    settings = BenchSettings()
    assert tuple(settings.lengths) == GRIDS["default"]["lengths"] == (256, 512, 1024, 2048, 4096)
    assert settings.warmup_seconds == GRIDS["default"]["warmup_seconds"]
    assert max(GRIDS["full"]["lengths"]) == 16384 and GRIDS["full"]["warmup_seconds"] >= 2


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"heads": 0}, "heads must be >= 1, got 0"),
        ({"heads": 6, "kv_heads": 4}, "kv_heads must divide heads (6), got 4: each key/value head serves"),
        ({"heads": 6, "kv_heads": 0}, "kv_heads must divide heads (6), got 0"),
        ({"lengths": []}, "lengths must be positive, got []"),
        ({"lengths": [0, 8]}, "lengths must be positive, got [0, 8]"),
        ({"dtype": "int8"}, "dtype must be one of float16, bfloat16, float32, float64, got 'int8'"),
        ({"max_seconds": 0}, "max_seconds must be > 0 seconds, got 0"),
        ({"warmup_seconds": -1}, "warmup_seconds must be finite and >= 0 seconds, got -1"),
        ({"warmup_seconds": float("inf")}, "warmup_seconds must be finite and >= 0 seconds, got inf"),
        ({"timeout": -1.0}, "timeout must be > 0 seconds, got -1.0"),
        ({"threads": 0}, "threads must be >= 1, got 0"),
        ({"busy": -1}, "busy must be >= 0, got -1"),
        ({"centres": 0}, "centres must be >= 1, got 0"),
        ({"spread": -0.1}, "spread must be >= 0, got -0.1"),
        ({"baseline_max_length": 0}, "baseline_max_length must be >= 1 or None, got 0"),
        ({"causal": ()}, "select at least one of causal/non-causal"),
    ],
)
def test_bad_settings_raise(settings, message):
    with pytest.raises(ValueError) as err:
        BenchSettings(**settings)
    assert message in str(err.value)


def test_variant_checks_its_options():
    with pytest.raises(ValueError, match="full option backend must be one of"):
        Variant("full", (("backend", "flash"),))


def test_the_baseline_runs_only_up_to_its_max_length():
    settings = BenchSettings(variants=[Variant("linear")], lengths=[8, 64], baseline_max_length=8, causal=(False,),
                             backward=(False,))  # fmt: skip
    cells = [(variant.mechanism, length) for variant, length, _, _ in settings.cells()]
    assert cells == [("full", 8), ("linear", 8), ("linear", 64)]


def test_busy_processes_spin_while_the_grid_runs_and_stop_after():
    with runner._busy_processes(2) as spinners:
        assert len(spinners) == 2 and all(s.poll() is None for s in spinners)
    assert all(s.returncode is not None for s in spinners)


def test_ratios_take_the_paired_one_else_the_baseline_cell_else_none():
    def row(mechanism, length, time_s, **extra):
        return {"mechanism": mechanism, "length": length, "causal": False, "pass": "forward", "time_s": time_s, **extra}

    rows = [row("full", 8, 2.0), row("linear", 8, 1.0, paired_ratio=0.25), row("sparse", 8, 1.0), row("linear", 64, 3)]
    runner._add_ratios(rows)
    assert [r["ratio"] for r in rows] == [1.0, 0.25, 0.5, None]
    assert not any("baseline_short_op_speedup" in r for r in rows)  # full's row had no probe


def test_a_ratio_over_full_attentions_row_carries_that_rows_probes():
    def row(mechanism, time_s, **extra):
        return {"mechanism": mechanism, "length": 8, "causal": False, "pass": "forward", "time_s": time_s, **extra}

    probes = [1.3, 0.95]
    rows = [row("full", 2.0, short_op_speedup=probes), row("linear", 1.0, paired_ratio=0.25), row("sparse", 1.0)]
    runner._add_ratios(rows)
    assert [r.get("baseline_short_op_speedup") for r in rows] == [None, None, probes]


def test_cells_are_paired_with_full_attention_where_the_baseline_runs(monkeypatch):
    settings = BenchSettings(variants=[Variant("linear")], lengths=[8, 16], baseline_max_length=8, causal=(False,),
                             backward=(False,))  # fmt: skip
    sent = []

    class Worker:  # records the payload, answers nothing (each cell then reports the worker's exit)
        def __init__(self, *args, **kwargs):
            self.stdin, self.stdout, self.stderr = self, iter(()), iter(())

        def write(self, text):
            sent.extend(__import__("json").loads(text))

        def close(self):
            pass

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(runner.subprocess, "Popen", Worker)
    list(_run_in_workers(settings, settings.cells()))
    assert [(c["mechanism"], c["length"], c["paired"]) for c in sent][:3] == [
        ("full", 8, False), ("linear", 8, True), ("linear", 16, False),
    ]  # fmt: skip


_NO_FULL_WORKER = textwrap.dedent("""
    import json, os, sys
    for cell in json.load(sys.stdin):
        if cell["mechanism"] == "full":
            print(json.dumps({"error": "MemoryError: full attention does not fit"}), flush=True)
        elif cell["paired"]:
            os._exit(3)  # full attention's paired call took the worker down
        else:
            print(json.dumps({"paired": False, "time_s": 1.0}), flush=True)
""")


def test_where_the_baseline_cell_failed_the_rest_of_its_group_is_not_paired(monkeypatch):
    """A cell paired with a full attention that cannot run would fail with it: after the baseline
    cell failed, or a cell's worker died, the cells of that length, causality and pass left to run
    go without full attention's calls."""
    monkeypatch.setattr(runner, "_WORKER", [sys.executable, "-c", _NO_FULL_WORKER])
    cells = [(BASELINE, 8, False, False), (Variant("linear"), 8, False, False), (Variant("sparse"), 8, False, False)]
    results = list(_run_in_workers(BenchSettings(timeout=30.0), cells))
    assert results[0]["error"].startswith("MemoryError") and results[1]["error"].startswith("worker exited")
    assert results[2] == {"paired": False, "time_s": 1.0}

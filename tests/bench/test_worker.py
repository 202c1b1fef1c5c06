import pytest
import torch

from subquad.bench.worker import measure_cell, reference_rows
from subquad.mechanisms.full import full_attention

from ..conftest import qkv

CELL = dict(
    mechanism="full", options={}, length=48, batch=1, heads=2, head_dim=8, dtype="float32", device="cpu",
    threads=None, causal=True, backward=False, repeats=3, max_seconds=1.0, warmup_seconds=0.0, error_rows=16,
    seed=0,
)  # fmt: skip


def test_reference_rows_are_rows_of_full_attention():
    q, k, v = qkv(2, 3, 9, 13, 4)
    rows = torch.tensor([0, 4, 8])
    for is_causal in (False, True):
        full = full_attention(q, k, v, is_causal=is_causal)
        assert torch.allclose(reference_rows(q, k, v, rows, is_causal), full[:, :, rows], atol=1e-12)


def test_full_attention_cell_has_no_error_and_no_zero_rows():
    result = measure_cell(CELL)
    assert result["error_iid"] < 1e-6 and result["error_clustered"] < 1e-6
    assert result["zero_rows"] == 0.0
    assert 1 <= len(result["times_s"]) <= 3 and result["time_s"] > 0 and result["nonfinite"] is False


@pytest.mark.parametrize("mechanism", ["full", "local"])
def test_a_grouped_query_cell_reads_fewer_key_value_heads_as_the_model_does(monkeypatch, mechanism):
    """``kv_heads``: the cell's keys and values have that many heads, each serving consecutive query
    heads, and the call asks for grouped-query attention (``enable_gqa``), as a model's layer does;
    full attention's error against the float64 reference (each query head on its group's keys) is 0."""
    from subquad.bench import worker

    seen = []
    original = worker.call_mechanism
    monkeypatch.setattr(worker, "call_mechanism", lambda m, q, k, v, **kw: seen.append((k.shape[1], kw["enable_gqa"]))
                        or original(m, q, k, v, **kw))  # fmt: skip
    result = measure_cell({**CELL, "mechanism": mechanism, "heads": 4, "kv_heads": 2, "causal": False})
    assert seen and set(seen) == {(2, True)}
    assert result["error_iid"] < (1e-6 if mechanism == "full" else 1.0) and result["nonfinite"] is False
    plain = measure_cell({**CELL, "mechanism": mechanism, "heads": 4, "causal": False})
    assert plain["error_iid"] != result["error_iid"] or mechanism == "full"


def test_a_cell_times_at_least_one_call_and_backward_cells_have_no_error_fields():
    result = measure_cell({**CELL, "backward": True, "max_seconds": 1e-9})
    assert len(result["times_s"]) == 1 and result["time_s"] > 0
    assert "error_iid" not in result and "zero_rows" not in result


def test_the_clustered_inputs_follow_the_centres_and_spread_settings():
    """With one centre and no spread every query is the same point, so one cluster is exact; with the
    default structure it is not. Proves the settings reach the inputs of the error column."""
    cell = {**CELL, "mechanism": "clustered", "options": {"clusters": 1}, "causal": False}
    exact = measure_cell({**cell, "centres": 1, "spread": 0.0})
    assert exact["error_clustered"] < 1e-6
    assert measure_cell({**cell, "centres": 16, "spread": 0.5})["error_clustered"] > 0.1


def test_the_warm_up_repeats_the_call_until_its_time_has_passed(monkeypatch):
    from subquad.bench import worker

    lengths = []
    make_call = worker._make_call

    def counting(*args):
        call = make_call(*args)
        return lambda q, k, v: (lengths.append(q.shape[2]), call(q, k, v))[1]

    monkeypatch.setattr(worker, "_make_call", counting)
    for seconds in (0.0, 0.3):
        lengths.clear()
        result = measure_cell({**CELL, "length": 96, "warmup_seconds": seconds})
        # full-size calls: the first (memory), the warm-up's others, the timed ones, the clustered error's
        warm_up = lengths.count(96) - 1 - len(result["times_s"]) - 1
        assert lengths[0] == 64 and (warm_up == 0 if seconds == 0 else warm_up >= 1)


def test_a_paired_cell_times_full_attention_call_for_call_and_reports_the_median_ratio():
    """Several rounds even when max_seconds allows one, each with a time of both; the ratio is the
    median of the rounds' ratios (computed from the reported times, not timed here)."""
    import statistics

    from subquad.bench import worker

    cell = {**CELL, "mechanism": "linear", "causal": False, "paired": True, "max_seconds": 1e-9, "repeats": 10}
    result = measure_cell(cell)
    times, base = result["times_s"], result["baseline_times_s"]
    assert len(times) == len(base) == worker._PAIRED_ROUNDS >= 2 and min(base) > 0
    assert result["paired_ratio"] == statistics.median(t / b for t, b in zip(times, base))
    assert result["baseline_time_s"] == statistics.median(base)
    unpaired = measure_cell({**cell, "paired": False})
    assert len(unpaired["times_s"]) == 1 and "paired_ratio" not in unpaired and "baseline_time_s" not in unpaired


def test_the_warm_up_of_a_paired_cell_runs_full_attention_too(monkeypatch):
    from subquad.bench import worker

    names = []
    make_call = worker._make_call

    def recording(mech, *args):
        call = make_call(mech, *args)
        return lambda q, k, v: (names.append((mech.name, q.shape[2])), call(q, k, v))[1]

    monkeypatch.setattr(worker, "_make_call", recording)
    result = measure_cell({**CELL, "mechanism": "linear", "length": 96, "paired": True, "warmup_seconds": 0.3})
    full_calls = names.count(("full", 96))
    assert full_calls > len(result["baseline_times_s"])  # some ran in the warm-up
    assert names[:2] == [("linear", 64), ("linear", 96)]  # the memory call comes before any of full's


def test_cells_are_not_paired_where_the_baseline_cell_took_longer_than_max_seconds(monkeypatch):
    from subquad.bench import worker

    monkeypatch.setattr(worker, "_BASELINE_SECONDS", {})
    cell = {**CELL, "mechanism": "linear", "causal": False, "paired": True, "max_seconds": 1e-9, "repeats": 2}
    measure_cell({**cell, "mechanism": "full"})  # the baseline cell: its calls take longer than 1e-9 s
    assert len(worker._BASELINE_SECONDS) == 1
    assert "paired_ratio" not in measure_cell(cell)
    assert "paired_ratio" in measure_cell({**cell, "max_seconds": 1e9})  # calls shorter than this: paired
    assert "paired_ratio" in measure_cell({**cell, "length": 40})  # another shape: no baseline known


def test_a_paired_cell_whose_full_attention_fails_is_measured_unpaired(monkeypatch):
    from subquad.bench import worker

    make_call = worker._make_call

    def failing_full(mech, *args):
        call = make_call(mech, *args)
        if mech.name != "full":
            return call
        return lambda q, k, v: (_ for _ in ()).throw(RuntimeError("DefaultCPUAllocator: not enough memory"))

    monkeypatch.setattr(worker, "_make_call", failing_full)
    result = measure_cell({**CELL, "mechanism": "linear", "causal": False, "paired": True})
    assert "paired_ratio" not in result and result["time_s"] > 0
    assert result["paired_error"] == "RuntimeError: DefaultCPUAllocator: not enough memory"


def test_a_backward_call_takes_one_gradient_of_ones_made_once(monkeypatch):
    """The gradient fed to the backward is made once per output shape, outside the calls that are
    timed, and is ones: the leaves' gradients are those of ``out.sum()``."""
    from subquad.bench import worker
    from subquad.mechanisms.full import FullConfig
    from subquad.registry import get_mechanism

    seen = []
    backward = torch.Tensor.backward

    def spy(self, gradient=None, *args, **kwargs):
        seen.append(gradient)
        return backward(self, gradient, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", spy)
    call = worker._make_call(get_mechanism("full"), FullConfig(), None, True, True, 0)
    q, k, v = qkv(1, 2, 12, 12, 4)
    for _ in range(3):
        call(q, k, v)
    assert len(seen) == 3 and all(g is seen[0] for g in seen)
    assert torch.equal(seen[0], torch.ones(1, 2, 12, 4, dtype=q.dtype))
    call(*qkv(1, 2, 20, 20, 4))  # another shape: another gradient
    assert seen[-1].shape == (1, 2, 20, 4) and seen[-1] is not seen[0]


@pytest.mark.parametrize("backward", [False, True])
def test_extra_tensors_are_made_once_per_input_shape(monkeypatch, backward):
    """Agglomerative's class logits are drawn once per input shape, outside the timed calls, from the
    cell's seed: every call of that shape gets the same tensors, and another shape its own."""
    import dataclasses

    from subquad.bench import worker
    from subquad.registry import get_mechanism, make_config

    mech = get_mechanism("agglomerative")
    made, passed = [], []

    def example_tensors(q, k, v, config, generator):
        made.append(q.shape)
        return mech.example_tensors(q, k, v, config, generator)

    def fn(q, k, v, **kwargs):
        passed.append(kwargs["query_logits"])
        return mech.fn(q, k, v, **kwargs)

    spied = dataclasses.replace(mech, example_tensors=example_tensors, fn=fn)
    call = worker._make_call(spied, make_config("agglomerative"), None, False, backward, 3)
    q, k, v = qkv(1, 2, 12, 12, 4)
    outs = [call(q, k, v) for _ in range(3)]
    assert made == [q.shape] and all(p is passed[0] for p in passed)
    assert all(torch.equal(o, outs[0]) for o in outs)
    fresh = mech.example_tensors(q, k, v, make_config("agglomerative"), torch.Generator().manual_seed(3))
    assert torch.equal(passed[0], fresh["query_logits"])
    call(*qkv(1, 2, 20, 20, 4))  # another shape: tensors of its own
    assert made == [q.shape, (1, 2, 20, 4)] and passed[-1].shape == (1, 2, 20)


def test_a_round_times_a_short_call_as_often_as_it_fits_in_one_of_full_attentions(monkeypatch):
    """Times are scripted (nothing is timed here): full attention's calls take 5 units, the
    mechanism's 1, so each round times the mechanism 5 times and reports their median; at 20 units
    against 1, the rounds stop at ``_ROUND_CALLS``; where the mechanism is the slower, one call."""
    import itertools
    import statistics

    from subquad.bench import worker

    def scripted(own, full):
        counts = {"linear": 0, "full": 0}
        own_times = itertools.cycle(own)

        def timed(call, q, k, v, device):
            name = call.mechanism_name
            counts[name] += 1
            return call(q, k, v), (next(own_times) if name == "linear" else full)

        return counts, timed

    make_call = worker._make_call

    def tagged(mech, *args):
        call = make_call(mech, *args)

        def run(q, k, v):
            return call(q, k, v)

        run.mechanism_name = mech.name
        return run

    monkeypatch.setattr(worker, "_make_call", tagged)
    cell = {**CELL, "mechanism": "linear", "causal": False, "paired": True, "warmup_seconds": 1e-9, "repeats": 3}
    cell["max_seconds"] = 1e9
    scripts = (([1.0, 1.0, 9.0, 1.0, 1.0], 5.0, 5), ([1.0], 20.0, worker._ROUND_CALLS), ([6.0], 5.0, 1))
    for own, full, per_round in scripts:
        counts, timed = scripted(own, full)
        monkeypatch.setattr(worker, "_timed", timed)
        result = measure_cell(cell)
        assert result["calls_per_round"] == per_round
        assert len(result["times_s"]) == len(result["baseline_times_s"]) == 3
        assert counts["linear"] - 3 * per_round >= 1  # the warm-up's calls, then the rounds'
        median = statistics.median(own[:per_round]) if per_round == 5 else own[0]
        assert result["times_s"] == [median] * 3  # a slow call (9) is not the round's time
        assert result["paired_ratio"] == median / full


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_short_operation_probe_compares_two_threads_with_one_and_restores_the_count(monkeypatch, restore_threads):
    """What it reads depends on the machine (not asserted); that it reads, and leaves the thread
    count as it found it, even when a copy fails, is."""
    from subquad.bench import worker

    torch.set_num_threads(2)
    speedup = worker.short_op_speedup()
    assert isinstance(speedup, float) and speedup > 0 and torch.get_num_threads() == 2
    torch.set_num_threads(1)
    assert worker.short_op_speedup() is None and torch.get_num_threads() == 1
    torch.set_num_threads(2)
    monkeypatch.setattr(worker, "_probe_buffers", [torch.zeros(4), torch.zeros(5)])  # copy_ cannot broadcast
    with pytest.raises(RuntimeError):
        worker.short_op_speedup()
    assert torch.get_num_threads() == 2


def test_a_cpu_cell_probes_short_operations_before_and_after_its_timing(monkeypatch, restore_threads):
    from subquad.bench import worker

    readings = iter([1.31, 0.94])
    held = []  # what the probes allocate stays resident through the cell

    def probe():
        held.append(torch.ones(16 << 20))  # 64 MB
        return next(readings)

    monkeypatch.setattr(worker, "short_op_speedup", probe)
    result = measure_cell({**CELL, "threads": 2})
    assert result["short_op_speedup"] == [1.31, 0.94] and len(held) == 2
    assert result["peak_bytes"] < 32 << 20  # the first probe runs before the memory baseline
    monkeypatch.undo()
    assert "short_op_speedup" not in measure_cell({**CELL, "threads": 1})  # one thread: nothing to probe


def test_a_cell_on_an_inputs_file_runs_every_set_and_reports_its_error_over_them(tmp_path, monkeypatch):
    """One timed call runs each set (a model's layers) in turn; the error is over all the sets'
    compared rows: exact on the first set and all zeros on the second gives ‖ref₁‖ / ‖(ref₀, ref₁)‖."""
    from subquad.bench import checks, worker
    from subquad.bench.inputs import save_inputs

    q, k, v = (torch.randn(2, 1, 4, 40, 8, generator=torch.Generator().manual_seed(10 + i)) for i in range(3))
    k, v = k[:, :, :2], v[:, :, :2]  # grouped-query: 2 key/value heads for 4 query heads
    save_inputs(tmp_path / "in.safetensors", q, k, v)
    cell = {
        **CELL,
        "inputs": str(tmp_path / "in.safetensors"),
        "error_rows": 40,
        "length": 40,
        "heads": 4,
        "kv_heads": 2,
    }
    seen = []
    real = worker._make_call

    def make_call(*args, **kwargs):
        call = real(*args, **kwargs)

        def recorded(x, k, v):
            seen.append(next((i for i in range(2) if torch.equal(x, q[i])), None))
            out = call(x, k, v)
            return torch.zeros_like(out) if seen[-1] == 1 else out

        return recorded

    monkeypatch.setattr(worker, "_make_call", make_call)
    result = measure_cell(cell)
    assert seen[0] is None and seen[1:] == [0, 1] * (len(seen) // 2)  # drawn rows start the pool; then both sets
    ref = [reference_rows(q[i], k[i], v[i], torch.arange(40), True) for i in range(2)]
    expected = float(ref[1].norm() / torch.cat(ref, 2).norm())
    assert result["error_inputs"] == pytest.approx(expected, rel=1e-9)
    assert result["zero_rows"] == 0.5 and result["nonfinite"] is False
    assert "error_iid" not in result and "error_clustered" not in result
    single = checks.set_checks(real(*_full_args()), q, k, v, {**cell, "error_rows": 40})
    assert single["error_inputs"] < 1e-6 and single["zero_rows"] == 0.0


def _full_args():
    from subquad.registry import get_mechanism, make_config

    return get_mechanism("full"), make_config("full"), None, True, False, 0, True

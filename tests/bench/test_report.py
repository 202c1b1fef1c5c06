import csv
import json

from subquad.bench.report import crossovers, format_crossovers, format_table, plot_results, write_csv, write_json


def _rows():
    rows = []
    for name, factor in (("full", 1.0), ("full(backend=eager)", 2.5)):
        for n in (256, 512):
            for causal in (False, True):
                for pass_ in ("forward", "forward+backward"):
                    row = {
                        "mechanism": name, "name": "full", "options": {}, "length": n, "causal": causal,
                        "pass": pass_, "time_s": factor * n**2 * 1e-8, "times_s": [1, 2, 3], "ratio": factor,
                        "peak_bytes": n * 2**12,
                    }  # fmt: skip
                    if pass_ == "forward":
                        row.update(error_iid=1e-7, error_clustered=2e-7, zero_rows=0.0)
                    rows.append(row)
    rows.append({**rows[0], "mechanism": "broken", "error": "worker exited with code -9 (killed: out of memory?)"})
    return rows


def test_table_lists_every_cell_with_formatted_numbers():
    table = format_table(_rows()).splitlines()
    assert table[0].split()[:4] == ["mechanism", "causal", "pass", "N"]
    eager = [line for line in table if line.startswith("full(backend=eager)  non-causal  forward ") and " 512 " in line]
    assert len(eager) == 1 and eager[0].split()[4:] == ["6.554", "2.500", "2.0", "1.0e-07", "2.0e-07", "3"]
    assert any("failed: worker exited with code -9" in line for line in table)
    assert len(table) == 2 + len(_rows())


def test_csv_and_json_hold_every_row(tmp_path):
    rows = _rows()
    rows[0].update(error_iid=float("nan"), nonfinite=True)
    assert " nan " in format_table(rows)
    write_csv(rows, tmp_path / "r.csv")
    write_json(rows, {"torch": "x"}, tmp_path / "r.json")
    with open(tmp_path / "r.csv") as f:
        read = list(csv.DictReader(f))
    assert len(read) == len(rows) and read[0]["mechanism"] == "full" and read[0]["repeats"] == "3"
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["meta"] == {"torch": "x"} and len(data["results"]) == len(rows)
    assert data["results"][0]["error_iid"] is None and data["results"][0]["nonfinite"] is True


def test_plots_are_written_as_png(tmp_path):
    paths = plot_results(_rows(), tmp_path, "test")
    assert [p.name for p in paths] == ["time.png", "ratio.png", "memory.png", "error.png", "crossover.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def _series(name, ratios, causal=False, pass_="forward"):
    return [
        {"mechanism": name, "length": n, "causal": causal, "pass": pass_, "ratio": ratio}
        for n, ratio in zip((256, 512, 1024, 2048), ratios)
    ]


def test_the_crossover_is_where_a_mechanism_starts_beating_full_for_good():
    rows = [
        *_series("full", [1, 1, 1, 1]),
        *_series("late", [3.0, 1.4, 0.9, 0.5]),  # wins from 1024 on
        *_series("noisy", [0.95, 1.2, 0.8, 0.6]),  # one win at 256 before a loss: from 1024
        *_series("early", [0.9, 0.8, 0.5, 0.2]),  # already wins at the shortest N
        *_series("never", [4.0, 2.0, 1.3, 1.0]),  # a tie is not a win
        *_series("gap", [0.5, 0.5, None, 0.5]),  # a cell without a ratio is not a win
        *_series("late", [5.0, 3.0, 2.0, 0.7], causal=True, pass_="forward+backward"),
    ]
    found = crossovers(rows)
    assert found == {
        ("late", False, "forward"): ("at", 1024), ("noisy", False, "forward"): ("at", 1024),
        ("early", False, "forward"): ("below", 256), ("never", False, "forward"): ("above", 2048),
        ("gap", False, "forward"): ("at", 2048), ("late", True, "forward+backward"): ("at", 2048),
    }  # fmt: skip
    table = format_crossovers(rows).splitlines()
    assert table[0].split() == ["crossover", "N", "non-causal", "forward", "causal", "forward+backward"]
    assert table[2].split() == ["late", "1024", "2048"]
    assert table[4].split() == ["early", "<=", "256", "-"]
    assert table[5].split() == ["never", ">", "2048", "-"]


def test_a_crossover_set_by_a_marked_cell_is_marked():
    from subquad.bench.report import SHORT_OP_SPEEDUP, marked_crossovers

    slow = [1.3, SHORT_OP_SPEEDUP - 0.1]
    rows = [
        *_series("full", [1, 1, 1, 1]),
        *_series("late", [3.0, 1.4, 1.05, 0.5]),  # its crossover, 2048, is set by the loss at 1024
        *_series("quiet", [3.0, 1.4, 1.05, 0.5]),  # the same, with a marked cell that sets nothing
        *_series("never", [4.0, 2.0, 1.3, 1.1]),  # no win: the longest N's loss sets it
        *_series("early", [0.9, 0.8, 0.5, 0.2]),  # no loss sets it
    ]
    by = {(r["mechanism"], r["length"]): r for r in rows}
    for name, n in (("late", 1024), ("quiet", 512), ("never", 2048), ("early", 256)):
        by[name, n]["short_op_speedup"] = slow
    by["full", 1024]["short_op_speedup"] = slow  # full's own probe does not mark a paired cell's crossover
    assert marked_crossovers(rows) == {("late", False, "forward"), ("never", False, "forward")}
    table = format_crossovers(rows).splitlines()
    assert [line.split()[1:] for line in table[2:6]] == [["2048*"], ["2048"], [">", "2048*"], ["<=", "256"]]
    assert table[-1].startswith("* 2 crossovers are set by a loss in a cell marked * above")
    by["never", 2048]["short_op_speedup"] = None
    assert format_crossovers(rows).splitlines()[-1].startswith("* 1 crossover is set by")
    by["late", 1024]["short_op_speedup"] = [1.3, 1.3]
    assert "*" not in format_crossovers(rows)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from subquad.bench.report import _crossover_plot

    by["late", 1024]["short_op_speedup"] = slow
    fig = _crossover_plot(plt, rows)
    stars = [t.xy for t in fig.axes[0].texts if t.get_text() == "*"]
    assert stars == [(2048, 0 - 0.24)]  # "late" is the first row; non-causal forward's markers sit at −0.24
    plt.close(fig)


def test_cells_whose_probe_found_two_threads_no_faster_than_one_are_marked(tmp_path):
    from subquad.bench.report import SHORT_OP_SPEEDUP, short_op_note, slow_short_ops

    rows = [{**r, "mechanism": "linear"} for r in _rows()[:4]]
    rows[0]["short_op_speedup"] = [1.31, SHORT_OP_SPEEDUP - 0.01]  # slow after the timing
    rows[1]["short_op_speedup"] = [1.31, 1.29]  # rows[2] and [3] were never probed (off the CPU)
    assert [slow_short_ops(r) for r in rows] == [True, False, False, False]
    assert slow_short_ops({**rows[1], "baseline_short_op_speedup": [0.9, 1.3]})  # not paired: full's row counts
    assert not slow_short_ops({**rows[0], "mechanism": "full"})  # full's own row: ratio 1 by definition
    table = format_table(rows).splitlines()
    ratios = [line.split()[5] for line in table[2:]]
    assert sorted(ratios) == ["1.000", "1.000", "1.000", "1.000*"]
    note = short_op_note(rows)
    assert note.startswith(f"* 1 of 4 cells ran while two threads were less than {SHORT_OP_SPEEDUP}× as fast as one")
    assert short_op_note(rows[1:]) is None and "*" not in format_table(rows[1:])
    write_csv(rows, tmp_path / "r.csv")
    with open(tmp_path / "r.csv") as f:
        read = list(csv.DictReader(f))
    assert [r["short_op_speedup"] for r in read] == ["1.310 1.090", "1.310 1.290", "", ""]


def test_the_plots_draw_marked_cells_as_open_markers(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from subquad.bench.report import _open_slow_cells, _panels

    rows = _rows()[:-1]
    marked = next(
        r for r in rows if r["mechanism"] != "full" and r["length"] == 512 and r["causal"] and r["pass"] == "forward"
    )
    marked["short_op_speedup"] = [0.95, 1.3]
    colours = {"full": "C0", "full(backend=eager)": "C1"}
    fig = _panels(plt, rows, "ratio", 1.0, "ratio", colours, guides=False)
    _open_slow_cells(fig, rows, "ratio", 1.0, colours)
    drawn = {ax.get_title(): [c.get_offsets().tolist() for c in ax.collections] for ax in fig.axes}
    assert drawn.pop("forward, causal") == [[[512.0, marked["ratio"]]]]
    assert all(not points for points in drawn.values())
    plt.close(fig)
    paths = plot_results(rows, tmp_path, "test")  # the figures with a marked cell are written too
    assert all(p.stat().st_size > 10_000 for p in paths)

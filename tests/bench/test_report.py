import csv
import json

from subquad.bench.report import format_table, plot_results, write_csv, write_json


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
    assert [p.name for p in paths] == ["time.png", "ratio.png", "memory.png", "error.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000

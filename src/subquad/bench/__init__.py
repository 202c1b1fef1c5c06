"""``subquad bench``: time, peak memory and approximation error of mechanisms against full attention."""

from subquad.bench.runner import BASELINE, BenchSettings, Variant, run_bench

__all__ = ["BASELINE", "BenchSettings", "Variant", "run_bench"]

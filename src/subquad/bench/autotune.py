"""``subquad tune``'s measurement: the knobs of ``TUNING`` that decide block sizes, timed on this machine.

Each knob in ``KNOBS`` names the calls it shapes (``Workload``: a mechanism, N, causal, pass, as the
bench times them: B = 1, H = 8, D = 64, fp32) and candidate values around its default (¼×, ½×, 2×,
4×). Knobs are tuned one after another (coordinate descent): for each, the calls run in rounds, each
round timing every candidate once per call, in an order that rotates between rounds (drift in the
machine's speed spreads over all of them); a candidate's score is the geometric mean, over the
knob's calls, of its median time ÷ the incumbent's. A candidate replaces the incumbent only where it
is at least ``GAIN`` faster overall and no call is more than ``HARM`` slower: a knob stays at its
default unless the measurement says clearly otherwise, so noise does not move values about.

None of these values changes what a mechanism computes (``kernels.tuning``), so a profile is safe to
use whatever it holds; its values are checked as the table checks its own. The time budget is
shared between the knobs; each runs at least ``MIN_ROUNDS`` rounds.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from subquad.kernels.tuning import TUNING, tuned

__all__ = ["GAIN", "HARM", "KNOBS", "Knob", "Workload", "candidates", "tune"]

GAIN = 0.05  # a candidate must be this much faster (geometric mean over the knob's calls) to be taken
HARM = 0.05  # and no call of the knob this much slower
MIN_ROUNDS = 3


@dataclass(frozen=True)
class Workload:
    """One call a knob shapes, timed as ``subquad bench`` times a cell."""

    mechanism: str
    length: int
    causal: bool
    backward: bool
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return f"{self.mechanism} N={self.length} {'causal' if self.causal else 'non-causal'} " + (
            "fwd+bwd" if self.backward else "fwd"
        )


@dataclass(frozen=True)
class Knob:
    name: str
    workloads: tuple[Workload, ...]
    factors: tuple[float, ...] = (0.25, 0.5, 2.0, 4.0)


def _cells(mechanism: str, lengths: tuple[int, ...], causal: tuple[bool, ...], backward: tuple[bool, ...],
           **options: Any) -> tuple[Workload, ...]:  # fmt: skip
    return tuple(
        Workload(mechanism, n, c, b, tuple(options.items())) for n in lengths for c in causal for b in backward
    )


_BOTH = (False, True)
KNOBS: tuple[Knob, ...] = (
    Knob("clustered_tile", _cells("improved-clustered", (1024, 4096), (False,), _BOTH)),
    Knob("topk_chunk", _cells("improved-clustered", (1024, 4096), (False,), (False,))),
    Knob("clustered_chunk", _cells("improved-clustered", (1024, 4096), (False,), (False,))),
    Knob("clustered_group", _cells("clustered", (1024, 4096), (False,), _BOTH)),
    Knob("local_block", _cells("local", (1024, 4096), _BOTH, (True,))),
    Knob("local_inference_block", _cells("local", (1024, 4096), _BOTH, (False,))),
    Knob("local_backward_block", _cells("local", (1024, 4096), (True,), (True,))),
    Knob("blocksparse_tile", _cells("sparse", (1024, 4096), _BOTH, _BOTH)),
    Knob("blocksparse_fused_tile", _cells("sparse", (1024, 4096), _BOTH, (False,))),
    Knob("tiles_group", _cells("routing", (1024, 4096), _BOTH, _BOTH)),
    Knob("routing_query_block", _cells("routing", (1024, 4096), (True,), _BOTH)),
    Knob("linear_block", _cells("linear", (1024, 4096), (False,), _BOTH)),
    Knob("linear_state_block", _cells("linear", (1024, 4096), (True,), _BOTH)),
    Knob("multires_causal_chunk", _cells("multires", (1024, 4096), (True,), _BOTH), (0.5, 2.0)),
    Knob("multires_query_block", _cells("multires", (1024, 4096), (False,), (False,))),
    Knob("agglomerative_chunk", _cells("agglomerative", (1024, 4096), (True,), _BOTH), (0.5, 2.0)),
    Knob("retrieval_gather", _cells("retrieval", (1024, 4096), _BOTH, (False,))),
    Knob("retrieval_rows", _cells("retrieval", (1024, 4096), (True,), (False,)), (0.5, 2.0)),
    # which causal rows read every key in place (sdpa under a mask) rather than gathering their far blocks:
    # where sdpa is fast against small products (another CPU's cores, its kernels), more rows pay
    Knob("retrieval_dense", _cells("retrieval", (1024, 4096), (True,), (False,)), (0.5, 1.5, 2.0)),
    Knob("retrieval_window_block", _cells("retrieval", (1024, 4096), _BOTH, (True,)), (0.5, 2.0)),
)


def candidates(knob: Knob, incumbent: int) -> list[int]:
    """The incumbent first, then ``factors`` × it (whole numbers ≥ 1, each once)."""
    out = [incumbent]
    for f in knob.factors:
        value = max(1, round(incumbent * f))
        if value not in out:
            out.append(value)
    return out


def _call(work: Workload, seed: int = 0) -> Callable[[], Any]:
    """The workload as the bench runs it: inputs made once, extra tensors and gradient once."""
    from subquad.bench.inputs import make_qkv
    from subquad.bench.worker import _make_call
    from subquad.registry import get_mechanism, make_config

    mech = get_mechanism(work.mechanism)
    config = make_config(mech, **dict(work.options))
    state = mech.state(config, 8, 64, seed).eval() if mech.state is not None else None
    run = _make_call(mech, config, state, work.causal, work.backward, seed)
    q, k, v = make_qkv("iid", (1, 8, work.length, 64), torch.float32, torch.device("cpu"), seed)
    return lambda: run(q, k, v)


def _seconds(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def tune_knob(knob: Knob, budget: float, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Time ``knob``'s candidates on its workloads for about ``budget`` seconds (at least
    ``MIN_ROUNDS`` rounds); the record: each candidate's score and the value taken."""
    incumbent = getattr(TUNING, knob.name)
    values = candidates(knob, incumbent)
    runs = [_call(w) for w in knob.workloads]
    times: dict[int, list[list[float]]] = {v: [[] for _ in runs] for v in values}
    start, rounds = time.perf_counter(), 0
    for value in values:  # warm-up: every candidate once per call (first-call costs, buffers)
        with tuned(**{knob.name: value}):
            for run in runs:
                _seconds(run)
    while rounds < MIN_ROUNDS or time.perf_counter() - start < budget:
        order = values[rounds % len(values) :] + values[: rounds % len(values)]
        for i, run in enumerate(runs):
            for value in order:
                with tuned(**{knob.name: value}):
                    times[value][i].append(_seconds(run))
        rounds += 1
        progress(f"{knob.name}: round {rounds}")
    base = [statistics.median(t) for t in times[incumbent]]
    ratios = {v: [statistics.median(t) / b for t, b in zip(times[v], base)] for v in values}
    score = {v: math.exp(statistics.fmean(math.log(r) for r in ratios[v])) for v in values}
    fair = [v for v in values if v != incumbent and score[v] <= 1 - GAIN and max(ratios[v]) <= 1 + HARM]
    chosen = min(fair, key=score.__getitem__, default=incumbent)
    return {
        "knob": knob.name, "default": incumbent, "chosen": chosen, "rounds": rounds,
        "score": {str(v): round(score[v], 4) for v in values},
        "workloads": [w.label for w in knob.workloads],
        "ratios": {str(v): [round(r, 4) for r in ratios[v]] for v in values},
    }  # fmt: skip


def tune(budget: float, knobs: tuple[Knob, ...] = KNOBS,
         progress: Callable[[int, int, str], None] = lambda i, n, label: None) -> list[dict[str, Any]]:  # fmt: skip
    """Tune ``knobs`` in turn within about ``budget`` seconds; each knob's record. The values taken
    stay set in ``TUNING`` while later knobs are timed and are restored at the end."""
    records: list[dict[str, Any]] = []
    chosen: dict[str, int] = {}
    start = time.perf_counter()
    for i, knob in enumerate(knobs):
        share = max(0.0, (budget - (time.perf_counter() - start)) / (len(knobs) - i))
        progress(i, len(knobs), knob.name)
        with tuned(**chosen):
            record = tune_knob(knob, share, lambda label, i=i: progress(i, len(knobs), label))
        records.append(record)
        if record["chosen"] != record["default"]:
            chosen[knob.name] = record["chosen"]
    progress(len(knobs), len(knobs), "done")
    return records

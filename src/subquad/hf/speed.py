"""What a user of a swapped or converted model feels, measured for ``subquad approx``.

- ``attention_speed``: the attention alone, on the model's own queries, keys and values of a few
  layers (``hf.record``) or on drawn ones at its heads and head size (``subquad bench``'s
  measurement), time and peak memory against exact attention;
- ``model_speed``: the whole model's forward on one window (batch 1);
- ``decode_speed``: generation. For each prompt length, the prefill's seconds, the median
  milliseconds per new token after it (greedy, batch 1, ``new_tokens`` tokens), the megabytes the
  generation cache holds after them, and the process's peak resident memory during both. The
  model builds the cache ``model.generate`` would: subquad's after ``use``/``convert``/
  ``from_pretrained`` (``subquad.hf.cache``), transformers' ``DynamicCache`` for the original.

Peak RSS is sampled every few milliseconds by a thread (Linux ``/proc``; elsewhere the process's
lifetime peak, which only grows); freed heap is handed back to the system first where the C
library allows, so one measurement does not inherit the last one's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from subquad.hf.data import Windows, token_windows
from subquad.hf.recording import Recorded

Share = tuple[tuple[int, int], ...]  # a call's query heads: runs of (first head, count)

__all__ = ["PeakRss", "attention_speed", "decode_speed", "decode_windows", "each", "model_speed", "own_inputs"]


def attention_speed(
    model: nn.Module,
    specs: list[str],
    context: int,
    causal: bool,
    device: torch.device,
    dtype: str,
    inputs: Recorded | None = None,
    progress: Any = None,
) -> dict[str, dict[str, Any]]:
    """Time and peak memory of each spec's attention at ``context``, with the model's heads, key/value
    heads (grouped-query, read as the model reads them) and head size, against exact attention's:
    on the model's own queries, keys and values (``inputs``, ``hf.record``: one call runs each
    recorded layer in turn), else on the bench's drawn ones. A head mix's time is the sum of its
    calls' (``LayerMix.calls``: groups of one stateless spec together), each timed on its own heads
    and their key/value heads (its peak, the largest of theirs).
    ``progress(label)`` before each bench cell, if given."""
    from subquad.bench.runner import BASELINE, BenchSettings, Variant, run_bench
    from subquad.hf.interface import model_attention

    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    group = heads // (getattr(config, "num_key_value_heads", None) or heads)  # query heads per key/value head
    parts = {}  # each spec's calls: (variant, share)
    own = inputs is not None  # drawn inputs: any heads alike, a call timed by its count
    variant = lambda g: Variant(g.mechanism.name, tuple(sorted(g.options.items())))  # noqa: E731
    whole: Share = ((0, heads),)
    for spec in specs:
        made = model_attention(model, spec, converted=True)  # the timing only: the bench makes learned inputs
        if not hasattr(made, "groups"):
            parts[spec] = [(variant(made), whole)]
            continue
        firsts = made.firsts  # the groups one call runs (LayerMix.calls) are timed together, on their heads
        pieces = [tuple((firsts[i], made.heads[i]) for i in call) for call in made.calls]
        parts[spec] = [
            (variant(made.groups[c[0]]), p if own else ((0, _count(p)),)) for c, p in zip(made.calls, pieces)
        ]
    rows = {}  # (label, share) -> bench row
    with tempfile.TemporaryDirectory(prefix="subquad-inputs-") as folder:
        for share in sorted({s for groups in parts.values() for _, s in groups} | {whole}):
            timed = dict.fromkeys(v for g in parts.values() for v, s in g if s == share)
            variants, count = [v for v in timed if v != BASELINE], _count(share)
            kv_heads = count // group if count % group == 0 and group > 1 else None  # a mix splits along the groups
            shape: dict[str, Any] = {"lengths": (context,), "heads": count, "kv_heads": kv_heads, "head_dim": head_dim}
            named = ",".join(f"{a}-{a + n - 1}" for a, n in share)
            if inputs is not None:
                shape = {"inputs": os.path.join(folder, f"heads-{named}.safetensors")}
                inputs.heads(share).save(shape["inputs"])
            settings = BenchSettings(variants=variants, **shape, causal=(causal,), backward=(False,), repeats=5,
                                     warmup_seconds=1.0, max_seconds=3.0, device=device.type, dtype=dtype)  # fmt: skip
            shown = progress and functools.partial(_cell_progress, progress, f"heads {named}")
            rows.update({(r["mechanism"], share): r for r in run_bench(settings, shown)})
    full = {share: row.get("time_s", math.nan) for (label, share), row in rows.items() if label == "full"}
    out = {"original": _cell([(rows.get(("full", whole), {}), whole)], full, whole)}
    for spec, groups in parts.items():
        out[spec] = _cell([(rows.get((v.label, s), {}), s) for v, s in groups], full, whole)
    return out


def _count(share: Share) -> int:
    return sum(n for _, n in share)


def _cell_progress(progress: Any, heads: str, done: int, total: int, label: str) -> None:
    if done < total:
        progress(f"{label}, {heads}")


def own_inputs(model: nn.Module, ids: torch.Tensor, count: int) -> Recorded | None:
    """The queries, keys and values ``model``'s attention receives on ``ids`` at ``count`` layers
    spread over its depth (``hf.record``); None for 0."""
    from subquad.hf.recording import record, spread_layers

    return record(model, ids, spread_layers(model, count)) if count else None


def _cell(rows: list[tuple[dict[str, Any], Share]], full: dict[Share, float], whole: Share) -> dict[str, Any]:
    """One spec's time (its groups' summed), ratio to exact attention's on the ``whole`` layer's heads
    (each group's paired ratio to exact attention on its heads, weighted by that one's time) and
    peak MB. A ``Share`` is a call's query heads, as runs of (first head, count)."""
    time_s = sum(r.get("time_s", math.nan) for r, _ in rows)
    ratio = sum((r.get("ratio") or math.nan) * full.get(s, math.nan) for r, s in rows) / full.get(whole, math.nan)
    peaks = [r["peak_bytes"] / 2**20 for r, _ in rows if r.get("peak_bytes")]
    return {"time_ms": time_s * 1e3, "ratio": ratio, "peak_mb": max(peaks) if len(peaks) == len(rows) else None}


@torch.no_grad()
def model_speed(
    models: dict[str, Any], ids: torch.Tensor, budget: float = 20.0, progress: Any = None
) -> dict[str, dict[str, float]]:
    """The whole model's forward time on ``ids`` ``(1, N)``, for each label's model (a callable
    that sets it up and returns it, or None after it): the median of up to 3 timed calls after
    one untimed call (fewer where the calls take over ``budget`` seconds). The body runs without a
    language-model head, whose logits do not change with the attention. ``"original"`` first.
    ``progress(label)`` before each, if given."""

    def timed(model: nn.Module) -> float:
        body = getattr(model, "base_model", model)
        body(input_ids=ids)  # untimed: the first call of a shape
        times: list[float] = []
        while len(times) < 3 and sum(times) < budget:
            start = time.perf_counter()
            body(input_ids=ids)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    seconds = {}
    for label, setup in models.items():
        if progress is not None:
            progress(label)
        seconds[label] = each(setup, timed)
    return {label: {"model_ms": t * 1e3, "model_ratio": t / seconds["original"]} for label, t in seconds.items()}


def each(setup: Any, measure: Any) -> Any:
    """``measure(model)`` of the model ``setup()`` returns; ``setup.done()`` after, if it has one."""
    model = setup()
    try:
        return measure(model)
    finally:
        getattr(setup, "done", lambda: None)()


@torch.no_grad()
def decode_speed(
    model: nn.Module, ids: torch.Tensor, lengths: list[int], new_tokens: int, progress: Any = None
) -> dict[str, dict]:
    """For each prompt length n (the first n of ``ids`` ``(1, N)``): ``prefill_s``,
    ``ms_per_token`` (median over ``new_tokens`` greedy steps), ``cache_mb`` (after them) and
    ``peak_rss_mb`` (the process, during both). Keyed by ``str(n)``. ``progress(done, total)``
    after each length, if given."""
    from subquad.hf.cache import cache_bytes

    out = {}
    for i, n in enumerate(lengths, 1):
        if n > ids.shape[1]:
            raise ValueError(f"a {n}-token prompt needs {n} tokens of text; the data gives {ids.shape[1]}")
        _release()
        with PeakRss() as rss:
            cache, prompt = _new_cache(model), ids[:, :n]
            start = time.perf_counter()
            logits = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1).logits
            prefill = time.perf_counter() - start
            steps = []
            for _ in range(new_tokens):
                token = logits[:, -1].argmax(-1, keepdim=True)
                start = time.perf_counter()
                logits = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1).logits
                steps.append(time.perf_counter() - start)
        out[str(n)] = {
            "prefill_s": prefill, "ms_per_token": statistics.median(steps) * 1e3 if steps else math.nan,
            "cache_mb": cache_bytes(cache) / 2**20, "peak_rss_mb": rss.peak / 2**20,
        }  # fmt: skip
        del cache, logits
        if progress is not None:
            progress(i, len(lengths))
    return out


def _new_cache(model: nn.Module) -> Any:
    """The cache ``model.generate`` would build for ``model``."""
    from transformers import DynamicCache

    from subquad.hf.automatic import replaces

    made = replaces(model, automatic=False) if "_prepare_cache_for_generation" in model.__dict__ else None
    return made or DynamicCache(config=model.config.get_text_config(decoder=True))


def decode_windows(tokenizer: Any, texts: list[str], longest: int, seed: int) -> torch.Tensor:
    """One window ``(1, longest)`` of the text's tokens for ``decode_speed``."""
    windows: Windows = token_windows(tokenizer, texts, None, longest, 1, seed)
    return windows.ids[:1]


class PeakRss:
    """A context that measures the process's resident memory; ``peak`` is the highest, ``start``
    the first, in bytes. Where the system keeps the peak (Linux's VmHWM, reset on entry), it is read
    on exit, with nothing running beside the measured code; elsewhere a thread samples the size
    every ``every`` seconds, taking the interpreter from the measured code at each sample (a Python-
    heavy loop, such as a decoding step, then reads slower than it runs)."""

    def __init__(self, every: float = 0.002) -> None:
        self.every, self.peak = every, 0
        self._stop = threading.Event()
        self._statm = Path("/proc/self/statm")
        self._page = resource.getpagesize()
        self._thread: threading.Thread | None = None

    def _now(self) -> int:
        if self._statm.exists():
            return int(self._statm.read_text().split()[1]) * self._page
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak if sys.platform == "darwin" else peak * 1024

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._now())
            self._stop.wait(self.every)

    def __enter__(self) -> PeakRss:
        from subquad.bench.worker import reset_high_water

        self.start = self.peak = self._now()
        if not reset_high_water():
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        from subquad.bench.worker import status_kib

        if self._thread is None:  # the kernel's peak since the reset
            self.peak = max(self.peak, status_kib("VmHWM") * 1024)
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._now())


def _release() -> None:
    """Hand freed heap back to the system where the C library can (glibc's ``malloc_trim``)."""
    name = ctypes.util.find_library("c")
    if name:
        libc = ctypes.CDLL(name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)

"""The tuning table: every size that decides how work is cut into blocks, in one place.

None of these values changes what a mechanism computes, only how much of it is computed at once
(and so, at most, the order of floating-point sums). Each was chosen on CPUs, where a block should
fit in the caches and a fresh buffer costs page faults; ``accelerator_scale`` makes the element
budgets larger elsewhere, where each op of a block is a kernel launch with a fixed cost. The
measurements behind them are in ``docs/performance.md``.

Read a value where it is used (``TUNING.linear_block``), never copy it into a module constant, so
that an override reaches every call::

    from subquad.kernels.tuning import tuned
    with tuned(blocksparse_tile=1 << 16):   # smaller chunks, e.g. to test chunk boundaries
        out = subquad.attention(q, k, v, mechanism="sparse")

Tests override values the same way (or with ``monkeypatch.setattr(TUNING, name, value)``) to
drive every code path at small sizes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import torch

__all__ = ["TUNING", "Tuning", "block_elements", "tuned"]


def _knob(default: int, why: str) -> int:
    return field(default=default, metadata={"why": why})


def _switch(default: int, why: str) -> int:
    return field(default=default, metadata={"why": why, "switch": True})


@dataclass
class Tuning:
    """Block sizes and element budgets; each field's ``metadata["why"]`` says why it has its value."""

    adaptive_threads: int = _switch(
        0,
        "0: calls run on the threads the caller set, which a library call never changes; 1 (opt-in): on fewer "
        "while other processes keep cores busy (kernels.threads), a help on busy VMs, none measured on quiet ones",
    )
    flex: int = _switch(1, "1: on CUDA, local, sparse and pattern's fused kernel is FlexAttention (kernels.flex)")
    whole_scan: int = _switch(
        1, "1: off the CPU, the causal products (linear, multires) and non-causal linear run as whole-sequence "
        "ops under autograd (ops.scan), not block by block: a block there is a few launches",
    )  # fmt: skip
    accelerator_scale: int = _knob(32, "element budgets are this many times larger off the CPU: fewer launches")
    contain_check: int = _knob(1 << 22, "off the CPU, a masked call whose q has this many elements checks its "
                               "inputs for NaN with one wait for the device rather than sanitising copies")  # fmt: skip
    kept_buffer: int = _knob(1 << 24, "CPU working buffers of up to this many elements kept by a thread between calls")
    huge_page_mib: int = _knob(2, "new CPU outputs of this many MiB or more go in huge pages (not tuned: see memory)")
    # block-sparse engine (sparse, pattern, local)
    blocksparse_tile: int = _knob(1 << 19, "eager kernel: scores (B·H·blocks·bq·W) held at once, about 2 MB "
                                  "in fp32, within L2")  # fmt: skip
    blocksparse_fused_tile: int = _knob(
        1 << 20, "torch's flash kernel: a gathered chunk's keys, values and additive mask (scores-sized) in cache"
    )
    blocksparse_backward_tile: int = _knob(
        1 << 20, "the fused backward returns key gradients per block before they are summed: keep them small"
    )
    blocksparse_view_tile: int = _knob(1 << 28, "view groups with one block's mask hold only their output: "
                                       "few calls per group")  # fmt: skip
    blocksparse_rows: int = _knob(
        1 << 13,
        "query rows (B·H·queries) per call: its output (2 MB at Dv = 64, fp32) and any gathered queries "
        "exist beside the result's",
    )
    blocksparse_kept_mask: int = _knob(1 << 20, "the largest element mask a kept layout group keeps between calls "
                                       "(Group.memo): 4 MB additive")  # fmt: skip
    blocksparse_kept_masks: int = _knob(256, "masks a kept layout group holds before it starts again (Group.memo)")
    native_queries: int = _knob(128, "the native kernel's gain is on short blocks; longer ones go to torch's kernel")
    native_keys: int = _knob(1024, "as native_queries, for the keys a block sees")
    local_block: int = _knob(
        64,
        "local, and sparse's block=0: queries per block of the backward (twice that for wide bands), and of the "
        "forward off the flash kernels",
    )
    local_inference_block: int = _knob(
        32,
        "local, and sparse's block=0: queries per block of the forward on the flash kernels (fewer keys)",
    )
    local_backward_block: int = _knob(
        128,
        "local, and sparse's block=0 band: keys per block of the backward under torch's flash backward, which runs "
        "the band transposed (blocks of keys against the queries that see them): 128 was fastest or within 5% of "
        "it at N = 512 to 4096",
    )
    sparse_layout: int = _knob(1 << 22, "pattern: mask values evaluated at once while finding a layout")
    sparse_summary_queries: int = _knob(
        1024, "fixed pattern, CPU: queries per call against the gathered summaries (large products, few calls)"
    )
    sparse_summary_scores: int = _knob(
        1 << 19, "fixed pattern, off the CPU: scores per call against the summaries, scaled by accelerator_scale"
    )
    # gathered tiles (routing)
    tiles_group: int = _knob(1 << 18, "score entries computed at once, about 1 MB in fp32: within one core's L2")
    tiles_chunks: int = _knob(32, "window attention: the most chunks of about tiles_group, larger ones past it")
    tiles_min_block: int = _knob(16, "the narrowest query block run: narrower ones cost more per query than they save")
    retrieval_gather: int = _knob(
        1 << 23, "retrieval: elements of a chunk's far part, queries × blocks × (block + D + Dv): rows, scores, outputs"
    )
    retrieval_rows: int = _knob(64, "retrieval: query rows scored together against one far block (a segment)")
    retrieval_window_block: int = _knob(64, "retrieval with gradients: queries scored together against their window")
    retrieval_step_dense: int = _knob(
        1, "retrieval's decoding step reads every key in place under a mask (one sdpa call) where they number at most "
        "this many times those it would gather (each unit's sinks, window and chosen blocks); else it gathers them",
    )  # fmt: skip
    retrieval_step_in_place: int = _knob(1024, "retrieval's decoding step reads a cache of up to this many "
                                         "keys in place whatever it chose (a gather's fixed cost)")  # fmt: skip
    retrieval_dense: int = _knob(
        2, "retrieval's parallel pass: a query whose keys (up to its own; all, non-causal) number at most its window "
        "and sinks plus this many times its blocks' keys reads them all in place under its mask (one sdpa call)",
    )  # fmt: skip
    retrieval_gather_grad: int = _knob(
        40 << 20, "retrieval with gradients: bytes of a checkpointed chunk's far part (as retrieval_gather counts it); "
        "chunks of per-query gathers far smaller than glibc's largest mmap threshold (32 MiB), freed under the "
        "small tensors each chunk leaves to autograd, once left the heap holed (1.1 MB per query and layer)",
    )  # fmt: skip
    routing_query_block: int = _knob(64, "causal routing: queries sharing a window, computed together")
    routing_assign: int = _knob(1 << 19, "position × centroid scores held at once while routing")
    # clustered
    clustered_tile: int = _knob(16, "improved-clustered: queries per tile sharing their cluster's top-k keys "
                                "(twice that for large clusters)")  # fmt: skip
    clustered_group: int = _knob(1 << 22, "(C × S) score elements per group of (batch × head) rows")
    clustered_tiles: int = _knob(1 << 23, "improved-clustered: tile elements (queries, top keys and values) per "
                                 "group of rows")  # fmt: skip
    clustered_chunk: int = _knob(
        1 << 20, "improved-clustered without autograd: tile elements gathered and multiplied at once, about 4 MB"
    )
    topk_chunk: int = _knob(4, "improved-clustered's two-stage top-k on CPU: chunks of this many keys (top_keys)")
    topk_two_stage_from: int = _knob(
        32, "two stages where S >= this many times k: below, torch's CPU top-k over whole rows is as fast"
    )
    topk_two_stage_below: int = _knob(
        64, "two stages where S < this many times k: from there torch's CPU top-k runs a partial sort, as fast"
    )
    # kernel attention and its causal scan (linear, multires, agglomerative)
    linear_state_block: int = _knob(1 << 18, "causal scan: chunk states (rows × chunks × D × Dc) held at once")
    linear_block: int = _knob(1 << 19, "non-causal linear: positions × rows × width per block of keys or queries")
    multires_softmax_block: int = _knob(1 << 20, "multires softmax ablation: query rows × landmarks scored at once")
    multires_query_block: int = _knob(1 << 21, "non-causal multires without autograd: query rows × width per block")
    multires_causal_chunk: int = _knob(64, "causal multires: slots (queries and landmarks) per chunk of the scan")
    agglomerative_chunk: int = _knob(32, "positions per lower-triangular matmul of the prefix sums")
    agglomerative_block: int = _knob(1 << 19, "causal agglomerative: positions × heads × width handled at once")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("switch"):
                if type(value) is not int or value not in (0, 1):
                    raise ValueError(f"tuning switch {f.name} must be 0 or 1, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"tuning value {f.name} must be an int >= 1, got {value!r}")


TUNING = Tuning()


@contextlib.contextmanager
def tuned(**values: int) -> Iterator[Tuning]:
    """Override tuning values inside a ``with`` block (checked like the table's own values)."""
    names = {f.name for f in fields(Tuning)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown tuning value(s) {unknown}; known: {', '.join(sorted(names))}")
    Tuning(**values)  # validates
    saved = {name: getattr(TUNING, name) for name in values}
    for name, value in values.items():
        setattr(TUNING, name, value)
    try:
        yield TUNING
    finally:
        for name, value in saved.items():
            setattr(TUNING, name, value)


def block_elements(cpu: int, device: torch.device) -> int:
    """Elements one block of a loop holds on ``device``: ``cpu`` on the CPU, ``accelerator_scale``
    times more elsewhere."""
    return cpu if device.type == "cpu" else cpu * TUNING.accelerator_scale

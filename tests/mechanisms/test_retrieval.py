"""Retrieval attention: window + sinks + each query's top far blocks, one softmax.

The oracle below builds, key by key and in plain Python, the dense mask of what each query sees
(its window, its sinks, and the far blocks Quest's bound ranks highest), and full attention under
that mask is what the mechanism must return.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import subquad
from subquad.kernels.tuning import TUNING, tuned
from subquad.mechanisms.full import full_attention
from subquad.mechanisms.retrieval import RetrievalConfig, retrieval_attention
from subquad.ops.far_blocks import block_bounds, dense_rows  # dense_rows as defined (patched below)

from ..conftest import padding, qkv


@pytest.fixture(autouse=True, scope="module")
def _far_segments_unless_asked():
    """The far part's segments (``retrieval_chunk``) by default here: at these sizes every query would
    read its keys in place (``TUNING.retrieval_dense``); the tests of that path ask for it."""
    from unittest import mock

    import subquad.ops.far_blocks as far_blocks

    with mock.patch.object(far_blocks, "dense_rows", lambda *a: 0):
        yield


def visible(q, k, key_padding_mask, is_causal, config):
    """``(B, H, L, S)``: window and sinks, then per query the ``blocks`` eligible blocks of largest
    bound Σ_d max(q_d·min_d, q_d·max_d) over their real non-sink keys, summed over the ``shared``
    heads of its group (random inputs: no ties)."""
    B, H, L, _ = q.shape
    S, w, G = k.shape[2], config.window, config.shared
    real = torch.ones(B, S, dtype=torch.bool) if key_padding_mask is None else key_padding_mask
    mask = torch.zeros(B, H, L, S, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i in range(L):
                p = i + S - L
                for j in range(S):
                    seen = abs(p - j) < w or j < config.sinks
                    mask[b, h, i, j] = seen and real[b, j] and (j <= p or not is_causal)
                bounds = {}
                for start in range(0, S, config.block):
                    span = range(max(start, config.sinks), min(S, start + config.block))
                    members = [j for j in span if real[b, j]]
                    last = start + config.block - 1
                    outside = last <= p - w or (not is_causal and start >= p + w)
                    if members and outside:
                        group = range(h // G * G, h // G * G + G)
                        bounds[start] = sum(
                            float(
                                torch.maximum(
                                    q[b, g, i] * k[b, g, members].amin(0), q[b, g, i] * k[b, g, members].amax(0)
                                ).sum()
                            )
                            for g in group
                        )
                for start in sorted(bounds, key=lambda x: (-bounds[x], x))[: config.blocks]:
                    for j in range(start, min(S, start + config.block)):
                        mask[b, h, i, j] |= bool(real[b, j]) and j >= config.sinks
    return mask


def matches_the_oracle(out, q, keys, values, leaves, kpm, config):
    """A causal ``out`` and the gradients it sends to ``leaves`` equal full attention's over ``keys``,
    ``values`` (the query heads' own) under ``visible``'s mask (zero rows where it sees nothing)."""
    mask = visible(q.detach(), keys.detach(), kpm, True, config)
    expected = full_attention(q, keys, values, attn_mask=mask).masked_fill(~mask.any(-1, keepdim=True), 0.0)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    weight = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    grads = [torch.autograd.grad((x * weight).sum(), leaves) for x in (out, expected)]
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@settings(max_examples=25, deadline=None)
@given(
    L=st.integers(1, 40), S=st.integers(1, 40), window=st.sampled_from([1, 3, 8]), sinks=st.sampled_from([0, 1, 3]),
    blocks=st.sampled_from([1, 2, 5]), block=st.sampled_from([1, 3, 4]), shared=st.sampled_from([1, 2]),
    is_causal=st.booleans(), pad=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_retrieval_equals_full_attention_under_the_keys_each_query_sees(
    L, S, window, sinks, blocks, block, shared, is_causal, pad, seed
):
    if is_causal and L > S:
        L = S
    q, k, v = qkv(2, 2, L, S, 4, 3, seed=seed)
    kpm = padding(2, S, seed) if pad else None
    config = RetrievalConfig(window=window, sinks=sinks, blocks=blocks, block=block, shared=shared)
    out = retrieval_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=config)
    mask = visible(q, k, kpm, is_causal, config)
    expected = full_attention(q, k, v, attn_mask=mask)
    expected = expected.masked_fill(~mask.any(-1, keepdim=True), 0.0)  # a query that sees nothing: zeros
    assert (out - expected).abs().max() <= 1e-10


def test_chunks_grouped_keys_and_gradients_change_nothing(monkeypatch):
    q, k, v = qkv(1, 4, 50, 50, 8, 8, seed=3)
    config = RetrievalConfig(window=6, sinks=2, blocks=2, block=4)
    whole = retrieval_attention(q, k, v, is_causal=True, config=config)
    monkeypatch.setattr(TUNING, "retrieval_gather", 1)  # one query per chunk: the same up to rounding
    torch.testing.assert_close(retrieval_attention(q, k, v, is_causal=True, config=config), whole, rtol=0, atol=1e-12)
    whole = retrieval_attention(q, k, v, is_causal=True, config=config)
    for shared in (1, 2, 4):  # within a key/value head, one gathered copy per group; across two, one per head
        options = RetrievalConfig(window=6, sinks=2, blocks=2, block=4, shared=shared)
        grouped = retrieval_attention(q, k[:, :2], v[:, :2], is_causal=True, config=options, enable_gqa=True)
        repeated = (x[:, :2].repeat_interleave(2, dim=1) for x in (k, v))
        expected = retrieval_attention(q, *repeated, is_causal=True, config=options)
        torch.testing.assert_close(grouped, expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="retrieval's shared=3 groups query heads that choose blocks together, but"):
        retrieval_attention(q, k, v, config=RetrievalConfig(shared=3))
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    with tuned(retrieval_gather_grad=TUNING.retrieval_gather * 8):  # float64: the inference call's chunks
        out = retrieval_attention(q, k, v, is_causal=True, config=config)
    # checkpointed chunks return what an inference call returns (whose window part runs on the block
    # engine, without autograd: the same up to rounding)
    torch.testing.assert_close(out.detach(), whole, rtol=0, atol=1e-12)
    out.square().sum().backward()
    assert all(torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0 for x in (q, k, v))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dims", [(8, 8), (4, 3)])  # torch's flash kernel (Dv = D), else the eager one
def test_without_gradients_the_window_runs_on_the_block_engine_and_equals_the_oracle(monkeypatch, is_causal, dims):
    """An inference call computes every query's sinks and window at once (``window_softmax``) and
    joins its far blocks by the window's log-sum-exp. Row 1's sinks and keys 20-27 are padding, so
    queries 23-27 (window 4) see far blocks only: the window's part must carry no mass there (the
    flash kernel reports lse = 0 for a row without keys); queries whose far blocks are all padding
    too see nothing (zeros). With gradients the call does not use it."""
    import subquad.ops.far_blocks as far_blocks

    calls = []
    original = far_blocks.window_softmax
    monkeypatch.setattr(far_blocks, "window_softmax", lambda *a: calls.append(1) or original(*a))
    L, S = (37, 37) if is_causal else (29, 41)
    q, k, v = qkv(2, 2, L, S, *dims, seed=11)
    kpm = torch.ones(2, S, dtype=torch.bool)
    kpm[1, :2] = kpm[1, 20:28] = False
    config = RetrievalConfig(window=4, sinks=2, blocks=2, block=4)
    with torch.no_grad():
        out = retrieval_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=config)
    assert calls == [1]
    mask = visible(q, k, kpm, is_causal, config)
    offset = S - L
    window_empty = [i for i in range(L) if not mask[1, 0, i, max(0, i + offset - 3) : i + offset + 4].any()]
    assert window_empty and mask[1, :, window_empty].any()  # the case the test is for: far blocks only
    expected = full_attention(q, k, v, attn_mask=mask).masked_fill(~mask.any(-1, keepdim=True), 0.0)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    retrieval_attention(q.requires_grad_(), k, v, key_padding_mask=kpm, is_causal=is_causal, config=config)
    assert calls == [1]


@pytest.mark.parametrize("rows, window_block", [(1, 1), (3, 5), (64, 7), (1000, 1000)])
def test_segment_rows_and_window_blocks_change_only_rounding(rows, window_block):
    """The far part's segments (a block's queries, ``retrieval_rows`` at a time: one per segment,
    several segments per block, or all in one) and the window part's query blocks: the outputs and
    gradients the oracle's mask gives, whatever their sizes."""
    q, k, v = (x.requires_grad_() for x in qkv(2, 4, 45, 45, 6, 5, seed=11))
    kpm = padding(2, 45, 11)
    config = RetrievalConfig(window=5, sinks=3, blocks=3, block=4, shared=2)
    with tuned(retrieval_rows=rows, retrieval_window_block=window_block):
        out = retrieval_attention(q, k[:, :2], v[:, :2], key_padding_mask=kpm, is_causal=True, config=config,
                                  enable_gqa=True)  # fmt: skip
    repeated = [x[:, :2].repeat_interleave(2, dim=1) for x in (k, v)]
    matches_the_oracle(out, q, *repeated, (q, k, v), kpm, config)


def test_a_non_finite_query_reaches_no_other_row_s_gradients():
    """A segment's empty slots are scored with zeros, never another query: a NaN query of batch row
    1 (the mechanism called directly, past the containment of ``subquad.attention``) leaves row 0's
    output and the gradients it sends bit-identical."""
    q, k, v = (x.requires_grad_() for x in qkv(2, 2, 40, 40, 8, 8, seed=9))
    config = RetrievalConfig(window=4, sinks=1, blocks=3, block=4)
    results = []
    for fill in (None, float("nan")):
        query = q if fill is None else torch.cat([q[:1], torch.full_like(q[1:], fill)])
        out = retrieval_attention(query, k, v, config=config)[0]
        results.append((out.detach(), *torch.autograd.grad(out.sum(), (k, v))))
    for clean, poisoned in zip(*results):
        assert torch.equal(clean[0], poisoned[0])


def test_each_query_sums_its_slots_by_index_add_or_by_its_own_slots():
    """Off the CPU (where index_add adds with atomics, in any order) each query sums its own slots
    gathered; both ways give each query its slots' sum, an empty slot and an unchosen pair nothing."""
    from subquad.ops.far_segments import per_query as _per_query
    from subquad.ops.far_segments import segments as _segments

    ids = torch.tensor([[0, 2], [2, 5], [5, 0], [1, 5]])  # 4 queries, 2 pairs each; 5: no block
    asker, owner, slot = _segments(ids, 5, 2)
    assert owner.tolist() == [0, 1, 2] and asker.tolist() == [0, 2, 3, 4, 0, 1]  # 4: an empty slot
    assert slot.tolist() == [0, 4, 5, 6, 6, 1, 2, 6]  # 6: past the last slot (no block)
    x = torch.arange(6.0).view(6, 1, 1) + 1
    for ordered in (True, False):
        assert _per_query(x, asker, slot, 4, ordered).flatten().tolist() == [1 + 5, 6, 2, 3]  # slots 0 + 4; 5; 1; 2


@pytest.mark.parametrize("feature_map", ["none", "elu"])
def test_query_heads_of_one_key_value_head_fill_its_blocks_segments_together(monkeypatch, feature_map):
    """Without a kernel part, a far block's segments are its key/value head's: the query heads that
    share it (grouped-query) put their rows in the same segments, each block's keys gathered once
    for them; with one (a feature map per query head), each query head has its own."""
    import subquad.ops.far_blocks as far_blocks

    owners = []
    original = far_blocks.segments
    monkeypatch.setattr(far_blocks, "segments", lambda *a: owners.append(original(*a)[1]) or original(*a))
    q, k, v = qkv(1, 4, 40, 40, 8, 8, seed=5)
    config = RetrievalConfig(window=4, sinks=0, blocks=2, block=4, feature_map=feature_map)
    with tuned(retrieval_rows=1000), torch.no_grad():  # one segment per block that some row chose
        out = retrieval_attention(q, k[:, :1], v[:, :1], is_causal=True, config=config, enable_gqa=True)
    n = 10  # blocks of 4 among 40 keys
    (owner,) = owners
    assert owner.unique().numel() == owner.numel()  # one segment per chosen block
    assert int(owner.max()) < (n if feature_map == "none" else 4 * n) and (feature_map == "none" or owner.max() >= n)
    expected = retrieval_attention(q, *(x[:, :1].expand(-1, 4, -1, -1) for x in (k, v)), is_causal=True, config=config)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_with_gradients_chunks_gather_retrieval_gather_grad_bytes(monkeypatch):
    """A chunk's far part holds queries × blocks × (block + D + Dv) elements (each query's row, scores
    and output per chosen block): with gradients ``TUNING.retrieval_gather_grad`` bytes of them,
    without ``retrieval_gather`` elements. Same outputs and gradients."""
    from subquad.ops import far_blocks

    calls = []
    run = far_blocks.retrieval_chunk
    monkeypatch.setattr(far_blocks, "retrieval_chunk", lambda q, *a: calls.append(q.shape[2]) or run(q, *a))
    q, k, v = qkv(1, 4, 60, 60, 8, 8, seed=5)
    config = RetrievalConfig(window=6, sinks=2, blocks=2, block=4)  # 4 heads · 2 blocks · (4 + 8 + 8) a query
    monkeypatch.setattr(TUNING, "retrieval_gather", 160 * 3)
    monkeypatch.setattr(TUNING, "retrieval_gather_grad", 160 * 5 * 8)  # bytes in float64: 5 queries
    whole = retrieval_attention(q, k, v, is_causal=True, config=config)
    assert calls == [3] * 20
    calls.clear()
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = retrieval_attention(q, k, v, is_causal=True, config=config)
    assert calls == [5] * 12  # other chunks: the same up to rounding (each chunk's window range differs)
    torch.testing.assert_close(out.detach(), whole, rtol=0, atol=1e-12)
    out.square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    monkeypatch.setattr(TUNING, "retrieval_gather_grad", 1 << 30)  # one chunk
    for x in (q, k, v):
        x.grad = None
    retrieval_attention(q, k, v, is_causal=True, config=config).square().sum().backward()
    for x, g in zip((q, k, v), grads):
        torch.testing.assert_close(x.grad, g, rtol=0, atol=1e-12)


def test_a_far_key_that_matches_the_query_is_found_where_a_window_misses_it():
    """The passkey in miniature: one far key aligned with the last query carries the value to find."""
    torch.manual_seed(0)
    S, D = 200, 16
    k, v = torch.randn(1, 1, S, D) * 0.1, torch.zeros(1, 1, S, 1)
    needle = torch.randn(D)
    k[0, 0, 37], v[0, 0, 37] = needle * 3, 1.0
    q = needle.view(1, 1, 1, D) * 3
    config = RetrievalConfig(window=16, sinks=2, blocks=1, block=8)
    found = subquad.attention(q, k, v, mechanism="retrieval", is_causal=False, **vars(config))
    local = subquad.attention(q, k, v, mechanism="local", window=16, sinks=2)
    assert found.item() > 0.9 and local.item() == 0.0


def test_retrieval_is_registered_with_its_options():
    mech = subquad.get_mechanism("retrieval")
    assert mech.decoder is not None and mech.sinks == "sinks" and mech.gqa
    with pytest.raises(ValueError, match="blocks"):
        RetrievalConfig(blocks=0)


@pytest.mark.parametrize("gather", [False, True])
def test_decoding_computes_only_new_blocks_bounds_and_returns_what_a_fresh_call_returns(monkeypatch, gather):
    """A step reads the bounds of the blocks whole at the last step from the cache and computes
    only those completed since (and, for several tokens, the partial last block): its output is the
    mechanism's called afresh on the row's real keys (a step of one token is one sdpa call: the
    same up to rounding), a left-padded row included, in steps of 1 and 3; with every key read in
    place, and with each row's keys gathered (rows of uneven lengths step one by one, from views
    that start at their row's storage)."""
    import contextlib

    import subquad.mechanisms.retrieval as retrieval
    import subquad.ops.far_step as far_step

    def knobs():
        return tuned(retrieval_step_dense=1, retrieval_step_in_place=1) if gather else contextlib.nullcontext()

    config = RetrievalConfig(window=5, sinks=2, blocks=2, block=4)
    q, k, v = qkv(2, 2, 40, 40, 8, 3, seed=7)
    kpm = torch.ones(2, 40, dtype=torch.bool)
    kpm[1, :5] = False  # row 1: five pads before its prompt
    rows = [(k[b : b + 1, :, kpm[b]], v[b : b + 1, :, kpm[b]]) for b in range(2)]  # each row's real tokens
    decoder = retrieval.RetrievalCache(subquad.get_mechanism("retrieval"), config, None)
    decoder.absorb(q[:, :, :17], k[:, :, :17], v[:, :, :17], key_padding_mask=kpm[:, :17])
    counted, real, gathers = [], kpm[:, :17].sum(1).tolist(), []
    monkeypatch.setattr(retrieval, "block_bounds", lambda kb, c: counted.append(kb.shape[2]) or block_bounds(kb, c))
    gathered = far_step._gathered
    monkeypatch.setattr(far_step, "_gathered", lambda *a: gathers.append(a[0].storage_offset()) or gathered(*a))
    t = 17
    for T in (1, 1, 3, 1, 1, 1, 3, 1, 3, 1, 1, 1, 3, 1, 1):
        counted.clear()
        before = decoder.known.tolist()  # none at the first step: the prefill computed no bounds
        with knobs():
            out = decoder.step(q[:, :, t : t + T], k[:, :, t : t + T], v[:, :, t : t + T])
        new = [(n + T) // 4 - w + 1 for n, w in zip(real, before)]  # each row's blocks completed, and its partial one
        assert sum(counted) <= sum(new), (t, counted, new)
        for b in range(2):
            n = real[b] + T
            keys, values = (x[:, :, :n] for x in rows[b])
            expected = retrieval_attention(q[b : b + 1, :, t : t + T], keys, values, is_causal=True, config=config)
            torch.testing.assert_close(out[b : b + 1], expected, rtol=0, atol=1e-12)
            real[b] = n
        t += T
    assert decoder.known.tolist() == [n // 4 for n in real]
    assert bool(gathers) == gather and (not gather or max(gathers) > 0)  # row 1's view starts past row 0's
    for b in range(2):
        keys = rows[b][0][:, :, : real[b] // 4 * 4]
        held = torch.arange(keys.shape[2]).view(1, -1, 4) >= config.sinks
        low, high = block_bounds(keys.view(1, 2, -1, 4, 8), held)
        assert torch.equal(decoder.bounds[b : b + 1, :, : real[b] // 4], torch.cat([high, low], -1))  # held joined


def test_rows_holding_as_many_tokens_step_together_after_a_reorder_too():
    """Rows that hold as many real tokens (here each after three pads) keep that count on the host
    and step at one slice, without reading it back from the device; a reorder that repeats a row
    (beam search's ``select_rows``) keeps it. Each step equals the mechanism called afresh on the
    row's real keys, through the bounds computed at the step and the masked read alike."""
    from subquad.mechanisms.retrieval import RetrievalCache

    config = RetrievalConfig(window=5, sinks=2, blocks=2, block=4)
    q, k, v = qkv(2, 2, 40, 40, 8, 3, seed=11)
    kpm = torch.arange(40)[None, :].expand(2, -1) >= 3
    decoder = RetrievalCache(subquad.get_mechanism("retrieval"), config, None)
    decoder.absorb(q[:, :, :17], k[:, :, :17], v[:, :, :17], key_padding_mask=kpm[:, :17])
    assert decoder.held == 14
    order = torch.tensor([1, 1, 0])
    decoder.select_rows(order)
    q, k, v = (x[order] for x in (q, k, v))
    t = 17
    for T in (1, 3, 1, 1, 2, 1, 1, 1, 3, 1, 1, 1, 1):
        out = decoder.step(q[:, :, t : t + T], k[:, :, t : t + T], v[:, :, t : t + T])
        t += T
        assert (decoder.held, decoder.whole) == (t - 3, (t - 3) // 4)  # the tokens and whole blocks held
        expected = retrieval_attention(q[:, :, t - T : t], k[:, :, 3:t], v[:, :, 3:t], is_causal=True, config=config)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert decoder.known.tolist() == [decoder.whole] * 3 == [(t - 3) // 4] * 3


@settings(max_examples=30, deadline=None)
@given(
    S=st.integers(1, 60), window=st.sampled_from([1, 3, 8]), sinks=st.sampled_from([0, 1, 3, 4, 9]),
    blocks=st.sampled_from([1, 2, 5]), block=st.sampled_from([1, 3, 4]), shared=st.sampled_from([1, 2, 4]),
    kv=st.sampled_from([1, 2, 4]), dense=st.sampled_from([0, 1000]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_a_one_token_step_is_the_parallel_pass_s_last_query(S, window, sinks, blocks, block, shared, kv, dense, seed):
    """Decoding's single-query path (``one_query``) against the mechanism's parallel pass, over
    grouped-query keys kept unrepeated, groups within and across key/value heads, and sinks inside
    and beyond the first block; the chosen blocks gathered (``retrieval_step_dense`` 0, below the
    knob's range: always) or every key read under a mask (a large value)."""
    from types import SimpleNamespace
    from unittest import mock

    import subquad.mechanisms.retrieval as retrieval
    import subquad.ops.far_step as far_step

    config = RetrievalConfig(window=window, sinks=sinks, blocks=blocks, block=block, shared=shared)
    q, k, v = qkv(2, 4, S, S, 6, 3, seed=seed)
    k, v = k[:, :kv], v[:, :kv]
    decoder = retrieval.RetrievalCache(subquad.get_mechanism("retrieval"), config, None)
    if S > 1:
        decoder.absorb(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1])
    with mock.patch.object(far_step, "TUNING", SimpleNamespace(retrieval_step_dense=dense, retrieval_step_in_place=0)):
        out = decoder.step(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:])
    expected = retrieval_attention(q, k, v, is_causal=True, config=config, enable_gqa=True)[:, :, -1:]
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert decoder.keys.shape[1] == kv


@pytest.mark.parametrize("shared", [1, 2])
@pytest.mark.parametrize("feature_map", ["none", "elu"])
def test_decoders_stepping_in_turn_keep_their_outputs_though_their_gathers_share_the_thread_s_buffers(
    feature_map, shared
):
    """The chosen blocks of a step are gathered into the thread's kept buffers: two caches (batches
    of 2, of different lengths) stepping in turn, each step's gather overwriting the other's, still
    give each step the parallel pass's last query, with and without a kernel part over the rest,
    and no output shares memory with a kept buffer."""
    from types import SimpleNamespace
    from unittest import mock

    import subquad.kernels.memory as memory
    import subquad.ops.far_step as far_step
    from subquad.mechanisms.retrieval import RetrievalCache

    config = RetrievalConfig(window=4, sinks=1, blocks=2, block=4, feature_map=feature_map, shared=shared)
    runs = []
    for S, seed in ((40, 1), (57, 2)):
        q, k, v = qkv(2, 4, S, S, 8, 8, seed=seed)
        k, v = k[:, :2], v[:, :2]
        decoder = RetrievalCache(subquad.get_mechanism("retrieval"), config, None)
        decoder.absorb(q[:, :, : S - 6], k[:, :, : S - 6], v[:, :, : S - 6])
        runs.append(((q, k, v), decoder, []))
    gathered = []
    gather = far_step._gathered
    with (  # the chosen blocks gathered at every length (0, below the knob's range)
        mock.patch.object(far_step, "TUNING", SimpleNamespace(retrieval_step_dense=0, retrieval_step_in_place=0)),
        mock.patch.object(far_step, "_gathered", lambda *a: gathered.append(a[-1]) or gather(*a)),
    ):
        for p in range(6, 0, -1):
            for (q, k, v), decoder, outs in runs:
                outs.append(decoder.step(*(x[:, :, -p:][:, :, :1] for x in (q, k, v))))
    assert gathered == ["retrieval.keys", "retrieval.values"] * 12
    kept = {b.untyped_storage().data_ptr() for b in memory._kept.buffers.values()}
    assert not kept.intersection(out.untyped_storage().data_ptr() for _, _, outs in runs for out in outs)
    for (q, k, v), _, outs in runs:
        expected = retrieval_attention(q, k, v, is_causal=True, config=config, enable_gqa=True)[:, :, -6:]
        torch.testing.assert_close(torch.cat(outs, dim=2), expected, rtol=0, atol=1e-12)


def test_a_step_gathers_every_row_s_and_unit_s_keys_in_one_call_a_tensor():
    """A gathered step reads each unit's sinks, window and chosen blocks, of all rows and units, with
    one ``index_select`` for keys and one for values over the cache's storage, and equals the
    parallel pass's last query. ``_gathered`` reads any view whose tokens are rows of its storage
    (one starting mid-block, a length of no whole blocks) in place and copies other layouts
    (tokens not rows of F from the storage's start) first; all give each unit its key/value head's tokens."""
    from unittest import mock

    import subquad.ops.far_step as far_step
    from subquad.mechanisms.retrieval import RetrievalCache

    config = RetrievalConfig(window=4, sinks=2, blocks=2, block=4)
    q, k, v = qkv(2, 4, 41, 41, 8, 8, seed=3)
    k, v = k[:, :2], v[:, :2]
    decoder = RetrievalCache(subquad.get_mechanism("retrieval"), config, None)
    decoder.absorb(q[:, :, :-3], k[:, :, :-3], v[:, :, :-3])
    selects, select = [], torch.index_select
    with (
        tuned(retrieval_step_dense=1, retrieval_step_in_place=1),
        mock.patch.object(far_step.torch, "index_select", lambda *a, **kw: selects.append(1) or select(*a, **kw)),
    ):
        outs = [decoder.step(*(x[:, :, t : t + 1] for x in (q, k, v))) for t in (38, 39, 40)]
    assert len(selects) == 2 * 3  # keys and values, one call each a step
    expected = retrieval_attention(q, k, v, is_causal=True, config=config, enable_gqa=True)[:, :, -3:]
    torch.testing.assert_close(torch.cat(outs, dim=2), expected, rtol=0, atol=1e-12)

    tokens = torch.tensor([[[0, 5, 9], [3, 1, 1], [2, 27, 8], [6, 0, 4]], [[1, 1, 0], [0, 4, 7], [5, 3, 2], [2, 6, 9]]])
    held = torch.randn(2, 2, 32, 8, dtype=torch.float64)
    copies, clone = [], torch.Tensor.clone
    shifted = torch.randn(held.numel() + 3, dtype=torch.float64)[3:].view(held.shape)  # rows start mid-row
    for x, copied in ((held[:, :, :29], False), (held[:, :, 2:], False),
                      (held.transpose(2, 3).contiguous().transpose(2, 3), True), (shifted, True)):  # fmt: skip
        copies.clear()
        with mock.patch.object(torch.Tensor, "clone", lambda t, **kw: copies.append(1) or clone(t, **kw)):
            got = clone(far_step._gathered(x, tokens, 2, "test.tokens"))
        assert bool(copies) == copied
        for b in range(2):
            for u in range(4):
                assert torch.equal(got[b, u], x[b, u // 2, tokens[b, u]])


@pytest.mark.parametrize("knobs", [dict(retrieval_step_dense=4, retrieval_step_in_place=1),
                                   dict(retrieval_step_dense=1, retrieval_step_in_place=144)])  # fmt: skip
@pytest.mark.parametrize("S, gathers", [(144, False), (145, True), (200, True)])
def test_a_step_reads_a_short_cache_or_few_keys_per_chosen_key_in_place_then_gathers(knobs, S, gathers):
    """The step's crossover: 2 key/value heads × S keys read in place while S is at most
    ``retrieval_step_in_place`` or 2 · S at most ``retrieval_step_dense`` times the keys a gather
    reads, 4 units × (2 sinks + a window of 8 + 2 chosen blocks × 4 keys) (here each term alone puts
    it at S = 144); past it they are gathered. Either way the output is the parallel pass's last
    query."""
    from unittest import mock

    import subquad.ops.far_step as far_step
    from subquad.mechanisms.retrieval import RetrievalCache

    config = RetrievalConfig(window=8, sinks=2, blocks=2, block=4)
    q, k, v = qkv(1, 4, S, S, 8, 8, seed=S)
    k, v = k[:, :2], v[:, :2]
    decoder = RetrievalCache(subquad.get_mechanism("retrieval"), config, None)
    decoder.absorb(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1])
    paths, gather = [], far_step._gathered
    with tuned(**knobs), mock.patch.object(far_step, "_gathered", lambda *a: paths.append(a[-1]) or gather(*a)):
        out = decoder.step(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:])
    assert paths == (["retrieval.keys", "retrieval.values"] if gathers else [])
    expected = retrieval_attention(q, k, v, is_causal=True, config=config, enable_gqa=True)[:, :, -1:]
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("S, sinks", [(20, 2), (18, 2), (9, 3)])
def test_a_step_that_takes_every_eligible_block_is_one_masked_call(S, sinks):
    """Where the choice would take every eligible block (or none is eligible), decoding's step is
    ``ops.far_all.every_block`` (no bounds ranked), equal to the parallel pass's last query: blocks
    of 4 all taken with keys 12, 13 before the window seen by no part (S = 20), the window starting
    at a block's edge (18), and no whole block before the window (9)."""
    from unittest import mock

    import subquad.mechanisms.retrieval as retrieval
    import subquad.ops.far_step as far_step

    config = RetrievalConfig(window=6, sinks=sinks, blocks=3, block=4)
    q, k, v = qkv(2, 4, S, S, 6, 3, seed=S)
    k, v = k[:, :2], v[:, :2]
    decoder = retrieval.RetrievalCache(subquad.get_mechanism("retrieval"), config, None)
    decoder.absorb(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1])
    taken = []
    every = far_step.every_block
    with mock.patch.object(far_step, "every_block", lambda *a: taken.append(every(*a)) or taken[-1]):
        with mock.patch.object(far_step, "_step_blocks", side_effect=AssertionError("no choice to make")):
            out = decoder.step(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:])
    assert len(taken) == 1 and taken[0] is not None
    repeated = [x.repeat_interleave(2, dim=1) for x in (k, v)]  # the oracle, not the parallel pass (which uses it too)
    reference = full_attention(q, *repeated, attn_mask=visible(q, repeated[0], None, True, config))[:, :, -1:]
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-12)


@pytest.mark.parametrize("L, kv, blocks", [(40, 4, 8), (7, 2, 8), (40, 1, 8), (40, 2, 7)])
def test_where_every_query_takes_every_block_it_may_the_parallel_pass_is_one_masked_call_per_rows(L, kv, blocks):
    """Causal, unpadded, no kernel part, and the last query's eligible blocks at most ``blocks``
    ((40 − 6) // 4 = 8): the parallel pass is ``every_block``'s masked sdpa calls (rows of 128
    patched to 16 here), the oracle's output, for queries at the end of the keys (L < S) and
    grouped-query keys; one block fewer and it declines, and the blocks are chosen as before."""
    from unittest import mock

    import subquad.mechanisms.retrieval as retrieval
    import subquad.ops.far_all as far_all

    config = RetrievalConfig(window=6, sinks=2, blocks=blocks, block=4)
    q, k, v = qkv(2, 4, L, 40, 6, 3, seed=L + kv)
    k, v = k[:, :kv], v[:, :kv]
    taken = []
    every = retrieval.every_block
    with mock.patch.object(retrieval, "every_block", lambda *a: taken.append(every(*a)) or taken[-1]):
        with mock.patch.object(far_all, "ROWS", 16):
            out = retrieval_attention(q, k, v, is_causal=True, config=config, enable_gqa=True)
    assert len(taken) == 1 and (taken[0] is None) == (blocks < 8)
    repeated = [x.repeat_interleave(4 // kv, dim=1) for x in (k, v)]
    expected = full_attention(q, *repeated, attn_mask=visible(q, repeated[0], None, True, config))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)


@settings(max_examples=30, deadline=None)
@given(
    L=st.integers(1, 40), S=st.integers(1, 40), window=st.sampled_from([1, 3, 8]), sinks=st.sampled_from([0, 1, 3]),
    blocks=st.sampled_from([1, 2, 5]), block=st.sampled_from([1, 3, 4]), shared=st.sampled_from([1, 2]),
    is_causal=st.booleans(), pad=st.booleans(), lead=st.integers(0, 40), kv=st.sampled_from([1, 2]),
    rows=st.sampled_from([1, 3, 1000]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_queries_that_read_their_keys_in_place_equal_the_oracle(
    L, S, window, sinks, blocks, block, shared, is_causal, pad, lead, kv, rows, seed
):
    """The leading queries computed by ``_dense`` (every key up to theirs read under the mask of the
    sinks, window and chosen blocks: ``lead`` of them, forced here, and ``every_block`` kept out, in
    chunks of ``rows`` queries, whose gather budget also sizes the in-place chunks, and whose chosen
    blocks may lie past the keys an early chunk reads), the rest by the far segments,
    whose windows come from one block-engine call over the rest only: the oracle's output, with
    padding (zero rows for queries that see nothing) and grouped-query keys."""
    from unittest import mock

    import subquad.mechanisms.retrieval as retrieval
    import subquad.ops.far_blocks as far_blocks

    q, k, v = qkv(2, 2, L, S, 4, 3, seed=seed)  # causal L > S too: the first L − S queries see no key
    k, v = k[:, :kv], v[:, :kv]
    kpm = padding(2, S, seed) if pad else None
    config = RetrievalConfig(window=window, sinks=sinks, blocks=blocks, block=block, shared=shared)
    gather = rows * 2 * min(blocks, -(-S // block)) * (min(block, S) + 4 + 3)  # chunks of `rows` queries
    with mock.patch.object(far_blocks, "dense_rows", lambda *a: min(lead, L)), tuned(retrieval_gather=gather):
        with torch.no_grad(), mock.patch.object(retrieval, "every_block", lambda *a: None):
            out = retrieval_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=config,
                                      enable_gqa=True)  # fmt: skip
    repeated = [x.repeat_interleave(2 // kv, dim=1) for x in (k, v)]
    mask = visible(q, repeated[0], kpm, is_causal, config)
    expected = full_attention(q, *repeated, attn_mask=mask).masked_fill(~mask.any(-1, keepdim=True), 0.0)
    assert (out - expected).abs().max() <= 1e-10


def test_queries_that_read_their_keys_in_place_take_the_oracle_s_gradients():
    """With gradients (checkpointed chunks), rows computed in place and by the segments give the
    gradients of full attention under the oracle's mask."""
    from unittest import mock

    import subquad.ops.far_blocks as far_blocks

    q, k, v = (x.requires_grad_() for x in qkv(2, 4, 45, 45, 6, 5, seed=3))
    kpm = padding(2, 45, 3)
    config = RetrievalConfig(window=5, sinks=3, blocks=3, block=4, shared=2)
    with mock.patch.object(far_blocks, "dense_rows", lambda *a: 30):
        out = retrieval_attention(q, k, v, key_padding_mask=kpm, is_causal=True, config=config)
    matches_the_oracle(out, q, k, v, (q, k, v), kpm, config)


def test_dense_rows_are_the_queries_whose_keys_are_at_most_their_window_and_sinks_and_retrieval_dense_blocks():
    """A causal query at p reads p + 1 keys in place; it does where that is at most window + sinks +
    ``TUNING.retrieval_dense`` × blocks · block; non-causal, every query reads all S (window counted
    on both sides)."""
    config = RetrievalConfig(window=10, sinks=2, blocks=3, block=4)  # window and sinks 12, blocks 3·4 = 12
    with tuned(retrieval_dense=2):  # at most 12 + 2 · 12 = 36 keys in place
        assert dense_rows(100, 100, True, config, 4, 25) == 36  # queries at p = 0 … 35
        assert dense_rows(10, 100, True, config, 4, 25) == 0  # the last 10 queries of 100 keys
        assert dense_rows(20, 50, True, config, 4, 12) == 6  # p = 30 … 35 of 30 … 49
        assert dense_rows(7, 46, False, config, 4, 12) == 7 and dense_rows(7, 47, False, config, 4, 12) == 0  # 22 + 24
        assert dense_rows(100, 100, True, config, 4, 1) == 12 + 2 * 4  # one block only: it holds 4
    with tuned(retrieval_dense=1):  # at most 12 + 12: what the query's blocks, window and sinks hold
        assert dense_rows(100, 100, True, config, 4, 25) == 24


def test_every_block_runs_on_cpus_only():
    """Off the CPU (a meta device here) ``every_block`` declines: sdpa under a mask with grouped-query
    keys may fall back to its math kernel there, not measured."""
    from subquad.ops.far_all import every_block

    config = RetrievalConfig(window=6, sinks=2, blocks=8, block=4)
    q, k, v = (x.float() for x in qkv(1, 4, 12, 12, 6, 3, seed=0))
    assert every_block(q, k[:, :2], v[:, :2], None, config) is not None
    assert every_block(*(x.to("meta") for x in (q, k[:, :2], v[:, :2])), None, config) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_choose_the_same_blocks_step_by_step_prefix_or_whole(dtype):
    """The bounds were ranked in bf16 / fp16: near ties flipped with the call's shape, so a decoder
    step, a causal prefix and the whole call chose different blocks (rows off by up to 1.4)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 150, d, generator=g, dtype=torch.float64).to(dtype) for d in (16, 16, 8))
    config = RetrievalConfig(window=8, sinks=2, blocks=2, block=8)
    whole = retrieval_attention(q, k, v, is_causal=True, config=config)
    from subquad.mechanisms.retrieval import RetrievalCache

    decoder = RetrievalCache(subquad.get_mechanism("retrieval"), config, None)
    steps = torch.cat([decoder.step(*(x[:, :, t : t + 1] for x in (q, k, v))) for t in range(150)], dim=2)
    for part in (steps, *(retrieval_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], is_causal=True, config=config)
                          for n in (33, 64, 100))):  # fmt: skip
        n = part.shape[2]
        error = (part.double() - whole[:, :, :n].double()).norm(dim=-1) / whole[:, :, :n].double().norm(dim=-1)
        assert error.max() < 1e-2  # the same blocks: rounding only (a flip costs ~0.1 to 1.4)


@pytest.mark.parametrize(("S", "is_causal", "kpm"), [(40, True, False), (38, True, True), (37, False, True)])
def test_without_gradients_the_segments_gather_whole_blocks_into_kept_buffers(monkeypatch, S, is_causal, kpm):
    """Without autograd the far part's segments read k and v as rows of whole blocks (zero-padded past
    the last key) and gather queries, keys and values, scores and outputs into buffers the thread
    keeps (``far_segments.SegmentBuffers``), or the call keeps across its chunks where they are larger: the
    same output, bit for bit, as gathering fresh tensors by indexing, and the same memory on the next
    call. With gradients nothing is kept."""
    from subquad.ops import far_blocks, far_segments

    q, k, v = qkv(2, 4, S, S, 8, 8, seed=7)
    mask = padding(2, S, seed=8) if kpm else None
    config = RetrievalConfig(window=4, sinks=2, blocks=3, block=4)  # 38 and 37 keys: a partial last block
    taken = []  # (name, data pointer) of each kept buffer the far part asks for
    keep = far_segments.kept_buffer
    monkeypatch.setattr(far_segments, "kept_buffer", lambda *a: taken.append((a[0], keep(*a).data_ptr())) or keep(*a))
    with torch.no_grad():
        out = retrieval_attention(q, k, v, key_padding_mask=mask, is_causal=is_causal, config=config)
        assert {name for name, _ in taken} == {
            f"retrieval.segments.{n}" for n in ("queries", "keys", "values", "scores", "out")
        }
        kept, taken[:] = out.clone(), []
        retrieval_attention(q.flip(2), k.flip(2), v * 2, key_padding_mask=mask, is_causal=is_causal, config=config)
        assert torch.equal(out, kept)  # no result is a view of a buffer the next call rewrites
        first, taken[:] = dict(taken), []  # the buffers as large as both calls needed
        assert torch.equal(retrieval_attention(q, k, v, key_padding_mask=mask, is_causal=is_causal, config=config), out)
        assert dict(taken) == first  # the next call used the same memory
        with tuned(kept_buffer=16):  # larger than the thread keeps: buffers of the call, kept across its chunks
            taken[:] = []
            assert torch.equal(
                retrieval_attention(q, k, v, key_padding_mask=mask, is_causal=is_causal, config=config), out
            )
            assert taken == []
        monkeypatch.setattr(far_blocks, "whole_blocks", lambda *a: None)  # fresh tensors, keys by indexing
        fresh, original = [], far_segments.segment_blocks
        monkeypatch.setattr(far_blocks, "segment_blocks", lambda *a: fresh.append(a[7:]) or original(*a))
        assert torch.equal(retrieval_attention(q, k, v, key_padding_mask=mask, is_causal=is_causal, config=config), out)
        assert fresh and all(scratch.rows is None and not scratch.kept for (scratch,) in fresh)
    with torch.enable_grad():
        taken[:] = []
        retrieval_attention(*(x.requires_grad_() for x in (q, k, v)), key_padding_mask=mask, is_causal=is_causal,
                            config=config).sum().backward()  # fmt: skip
        assert taken == []  # with gradients: fresh tensors (autograd keeps them)


@settings(max_examples=25, deadline=None)
@given(
    L=st.integers(1, 30), S=st.integers(1, 30), window=st.sampled_from([1, 3, 8]), sinks=st.sampled_from([0, 2]),
    window_block=st.sampled_from([1, 4, 64]), kv=st.sampled_from([1, 3]), is_causal=st.booleans(),
    pad=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_with_gradients_the_window_part_gives_the_oracle_s_outputs_and_gradients(
    L, S, window, sinks, window_block, kv, is_causal, pad, seed
):
    """The window part under autograd (``ops.near_window``: its own backward, block by block), causal
    or not, queries fewer or more than the keys (causal: some before every key), grouped keys,
    padding, no sinks: full attention's outputs and gradients under the oracle's mask."""
    q, k, v = (x.requires_grad_() for x in qkv(1, 3, L, S, 4, 3, seed=seed))
    kpm = padding(1, S, seed) if pad else None
    config = RetrievalConfig(window=window, sinks=sinks, blocks=2, block=3)
    keys, values = k[:, :kv], v[:, :kv]
    with tuned(retrieval_window_block=window_block):
        out = retrieval_attention(q, keys, values, key_padding_mask=kpm, is_causal=is_causal, config=config,
                                  enable_gqa=True)  # fmt: skip
    keys, values = (x.repeat_interleave(3 // kv, dim=1) for x in (keys, values))
    mask = visible(q.detach(), keys.detach(), kpm, is_causal, config)
    if is_causal and L > S:  # the first L − S queries lie before every key
        mask[:, :, : L - S] = False
    expected = full_attention(q, keys, values, attn_mask=mask).masked_fill(~mask.any(-1, keepdim=True), 0.0)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    weight = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    for got, want in zip(*(torch.autograd.grad((x * weight).sum(), (q, k, v)) for x in (out, expected))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_with_gradients_the_window_blocks_add_into_one_key_gradient():
    """Each query block's key and value gradients are added into one buffer in place: a slice of k
    per block made each a zero tensor of k's size, summed by the engine (O(S² / block) per call)."""
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 60, 60, 4, 4, seed=5))
    config = RetrievalConfig(window=4, sinks=2, blocks=1, block=4)
    with tuned(retrieval_window_block=2):  # 30 query blocks
        out = retrieval_attention(q, k, v, is_causal=True, config=config)
    with torch.profiler.profile(record_shapes=True) as profile:
        out.sum().backward()
    names = ("aten::zeros", "aten::zero_", "aten::fill_", "aten::add_", "aten::add")
    k_sized = [
        e for e in profile.events() if e.name in names and e.input_shapes and list(e.input_shapes[0]) == [1, 2, 60, 4]
    ]
    assert 0 < len(k_sized) <= 12, len(k_sized)


def test_leading_queries_whose_window_holds_every_earlier_key_are_plain_causal_attention():
    """Causal, unpadded, L = S: the first ``window`` queries see every key up to theirs, so they are
    one causal sdpa call without a mask (the next in-place rows under their mask): the oracle's
    outputs and gradients."""
    from unittest import mock

    import subquad.mechanisms.retrieval as retrieval
    import subquad.ops.far_blocks as far_blocks

    q, k, v = (x.requires_grad_() for x in qkv(1, 4, 40, 40, 6, 5, seed=9))
    config = RetrievalConfig(window=8, sinks=2, blocks=2, block=3, shared=2)
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def recorded(query, *args, **kwargs):
        calls.append((query.shape[2], kwargs.get("is_causal", False), kwargs.get("attn_mask") is None))
        return sdpa(query, *args, **kwargs)

    with (
        mock.patch.object(far_blocks, "dense_rows", lambda *a: 20),
        mock.patch.object(retrieval, "every_block", lambda *a: None),
    ):
        with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", recorded):
            out = retrieval_attention(q, k[:, :2], v[:, :2], is_causal=True, config=config, enable_gqa=True)
    assert calls[0] == (8, True, True) and all(not causal for _, causal, _ in calls[1:]), calls
    matches_the_oracle(out, q, *(x[:, :2].repeat_interleave(2, dim=1) for x in (k, v)), (q, k, v), None, config)


def test_in_place_rows_give_the_keys_and_values_their_gradients_when_the_queries_need_none():
    """Only k and v need gradients, the rows read in place in several chunks of one size (non-causal,
    padded; each chunk's mask built afresh, as sdpa keeps it for the backward): the oracle's outputs
    and gradients."""
    from unittest import mock

    import subquad.mechanisms.retrieval as retrieval
    import subquad.ops.far_blocks as far_blocks

    q, k, v = qkv(1, 2, 40, 40, 6, 5, seed=4)
    k, v = k.requires_grad_(), v.requires_grad_()
    config, kpm = RetrievalConfig(window=3, sinks=2, blocks=2, block=3), padding(1, 40, 4)
    with (
        mock.patch.object(far_blocks, "dense_rows", lambda *a: 40),
        mock.patch.object(retrieval, "every_block", lambda *a: None),
    ):
        with tuned(retrieval_gather=3 * 2 * 40 * 4):  # four rows a chunk
            out = retrieval_attention(q, k, v, key_padding_mask=kpm, config=config)
    mask = visible(q, k.detach(), kpm, False, config)
    expected = full_attention(q, k, v, attn_mask=mask).masked_fill(~mask.any(-1, keepdim=True), 0.0)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    weight = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    for got, want in zip(*(torch.autograd.grad((x * weight).sum(), (k, v)) for x in (out, expected))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_the_largest_bounds_of_rows_padded_for_torch_s_partial_sort_are_topk_s_and_the_oracle_s_blocks(monkeypatch):
    """``far_blocks.largest`` on rows of 3/8 · 64·k to 64·k entries: padded with −inf to 64·k
    (where torch's top-k sorts partially); the same values and index sets as ``torch.topk``, and
    where fewer than k are finite the rest −inf at indices inside the row. Rows of 64·k or more,
    and too few rows, go to ``topk`` as they are. Retrieval whose rows take that path equals the
    oracle."""
    from subquad.ops import far_blocks

    scores = torch.randn(2, 150, 150, generator=torch.Generator().manual_seed(0))
    scores[1, 1, 3:] = float("-inf")  # three finite
    pads = []
    plain_pad = torch.nn.functional.pad

    def spy_pad(x, widths, *args, **kwargs):
        pads.append((x.shape[-1], widths))
        return plain_pad(x, widths, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "pad", spy_pad)
    values, indices = far_blocks.largest(scores.clone(), 4)
    assert pads == [(150, (0, 106))]
    top = scores.topk(4, dim=-1)
    assert torch.equal(values.sort(-1, descending=True).values, top.values)
    plain = torch.isfinite(top.values).all(-1)
    assert torch.equal(indices.sort(-1).values[plain], top.indices.sort(-1).values[plain])
    assert torch.isfinite(values[1, 1]).sum() == 3 and int(indices.max()) < 150
    assert set(indices[1, 1][torch.isfinite(values[1, 1])].tolist()) == {0, 1, 2}
    for rows, n in ((300, 96), (300, 255)):  # the path's ends
        pads.clear()
        far_blocks.largest(torch.randn(rows, n), 4)
        assert pads == [(n, (0, 256 - n))]
    for rows, n in ((300, 95), (300, 256), (100, 150)):  # rounds of max, or topk as they are
        pads.clear()
        far_blocks.largest(torch.randn(rows, n), 4)
        assert pads == []
    monkeypatch.setattr(torch.nn.functional, "pad", plain_pad)
    calls = []
    chosen = far_blocks.largest

    def spy(scores, k):
        calls.append((scores.numel() // scores.shape[-1], scores.shape[-1], k))
        return chosen(scores, k)

    monkeypatch.setattr(far_blocks, "largest", spy)
    q, k, v = qkv(2, 2, 240, 240, 4, 3, seed=5)
    config = RetrievalConfig(window=6, sinks=1, blocks=4, block=2)
    out = retrieval_attention(q, k, v, config=config)
    assert calls and all(rows >= 256 and 96 <= n < 256 for rows, n, _ in calls)  # the padded path ran
    mask = visible(q, k, None, False, config)
    expected = full_attention(q, k, v, attn_mask=mask).masked_fill(~mask.any(-1, keepdim=True), 0.0)
    assert (out - expected).abs().max() <= 1e-10


def test_the_largest_bounds_by_rounds_of_max_are_topk_s_and_the_oracle_s_blocks(monkeypatch):
    """``far_blocks.largest``: for a few of at most 128 in many rows, k rounds of max; the same
    values and index sets as ``torch.topk``, of equal values the lower index, and where fewer are
    finite the rest −inf. Retrieval on enough query rows to take that path equals the oracle."""
    from subquad.ops import far_blocks

    calls = []
    rounds = far_blocks.largest

    def spy(scores, k):
        calls.append((scores.numel() // scores.shape[-1], k))
        return rounds(scores, k)

    scores = torch.randn(4, 300, 50, generator=torch.Generator().manual_seed(0))
    scores[0, 0, 10:14] = 7.0  # a tie: the lower indices first
    scores[1, 1, 2:] = float("-inf")  # two finite
    values, indices = rounds(scores.clone(), 3)
    top = scores.topk(3, dim=-1)
    assert torch.equal(values.sort(-1, descending=True).values, top.values)
    assert indices[0, 0].tolist() == [10, 11, 12]
    assert torch.isfinite(values[1, 1]).tolist() == [True, True, False]
    plain = torch.isfinite(top.values).all(-1)
    plain[0, 0] = False  # no tie, all finite: topk's index set
    assert torch.equal(indices.sort(-1).values[plain], top.indices.sort(-1).values[plain])
    monkeypatch.setattr(far_blocks, "largest", spy)
    q, k, v = qkv(2, 2, 80, 80, 4, 3, seed=4)
    config = RetrievalConfig(window=6, sinks=1, blocks=3, block=4)
    out = retrieval_attention(q, k, v, is_causal=True, config=config)
    assert calls and all(rows >= 256 for rows, _ in calls)  # the rounds of max ran
    mask = visible(q, k, None, True, config)
    expected = full_attention(q, k, v, attn_mask=mask).masked_fill(~mask.any(-1, keepdim=True), 0.0)
    assert (out - expected).abs().max() <= 1e-10

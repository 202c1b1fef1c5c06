"""Retrieval with a kernel part (``feature_map``): the far keys no chosen block holds enter by kernel
attention, under one normaliser with the softmax over the window, sinks and chosen blocks.

The oracle is dense and plain: the mask of the keys each query sees exactly (``visible``, the
retrieval oracle), the mask of the far keys (real, not sinks, outside the window) less those, and
``(m·o + Σ_far\\T φ(q)·φ(k) v) / (m + Σ_far\\T φ(q)·φ(k))`` over them (0 where nothing is seen),
with o the softmax output over the exact keys and m whether they hold a real key.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from subquad.mechanisms.full import full_attention
from subquad.mechanisms.linear import LinearState, learned_features
from subquad.mechanisms.retrieval import RetrievalConfig, retrieval_attention
from subquad.ops.features import feature_map

from ..conftest import padding, qkv
from .test_retrieval import visible


def far_keys(B, L, S, key_padding_mask, is_causal, config):
    """``(B, 1, L, S)``: the keys outside each query's window, real and not sinks."""
    real = torch.ones(B, S, dtype=torch.bool) if key_padding_mask is None else key_padding_mask
    p = torch.arange(L)[:, None] + S - L
    j = torch.arange(S)[None]
    outside = (j <= p - config.window) | ((j >= p + config.window) & (not is_causal))
    return (outside[None] & real[:, None] & (j >= config.sinks)[None])[:, None]


def oracle(q, k, v, key_padding_mask, is_causal, config, state):
    exact = visible(q, k, key_padding_mask, is_causal, config)
    kernel = far_keys(q.shape[0], q.shape[2], k.shape[2], key_padding_mask, is_causal, config) & ~exact
    if state is not None:
        fq, fk = learned_features(q, state), learned_features(k, state)
    else:
        fq, fk = feature_map(q, config.feature_map), feature_map(k, config.feature_map)
    weights = (fq @ fk.transpose(-1, -2)) * kernel
    o = full_attention(q, k, v, attn_mask=exact).masked_fill(~exact.any(-1, keepdim=True), 0.0)
    m = exact.any(-1, keepdim=True).to(q.dtype)
    total = m + weights.sum(-1, keepdim=True)
    return (m * o + weights @ v) / torch.where(total > 0, total, 1.0)


def random_state(H, D, seed):
    config = RetrievalConfig(feature_map="hedgehog")
    state = LinearState(config, H, D).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        state.weight.add_(0.5 * torch.randn(state.weight.shape, generator=g, dtype=torch.float64))
        state.bias.add_(0.5 * torch.randn(state.bias.shape, generator=g, dtype=torch.float64))
    return state


@settings(max_examples=25, deadline=None)
@given(
    L=st.integers(1, 30), S=st.integers(1, 30), window=st.sampled_from([1, 3, 8]), sinks=st.sampled_from([0, 1, 3]),
    blocks=st.sampled_from([1, 2]), block=st.sampled_from([1, 3, 4]), shared=st.sampled_from([1, 2]),
    feature=st.sampled_from(["elu", "relu", "hedgehog"]), is_causal=st.booleans(), pad=st.booleans(),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_the_kernel_part_covers_the_far_keys_no_block_brought_under_one_normaliser(
    L, S, window, sinks, blocks, block, shared, feature, is_causal, pad, seed
):
    if is_causal and L > S:
        L = S
    q, k, v = qkv(2, 2, L, S, 4, 3, seed=seed)
    kpm = padding(2, S, seed) if pad else None
    config = RetrievalConfig(window=window, sinks=sinks, blocks=blocks, block=block, shared=shared, feature_map=feature)
    state = random_state(2, 4, seed) if feature == "hedgehog" else None
    out = retrieval_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=config, state=state)
    expected = oracle(q, k, v, kpm, is_causal, config, state)
    assert (out - expected).abs().max() <= 1e-10


@pytest.mark.parametrize("is_causal", [True, False])
def test_gradients_reach_the_inputs_and_the_learned_maps_as_the_oracle_s(is_causal):
    q, k, v = qkv(1, 4, 21, 21, 4, 3, seed=5)
    config = RetrievalConfig(window=3, sinks=2, blocks=2, block=3, shared=2, feature_map="hedgehog")
    state = random_state(4, 4, 5)
    grads = []
    for fn in (retrieval_attention, None):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        if fn is None:
            out = oracle(*xs, None, is_causal, config, state)
        else:
            out = fn(*xs, is_causal=is_causal, config=config, state=state)
        params = list(state.parameters())
        grads.append(torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), xs + params))
    for got, want in zip(*grads):
        assert (got - want).abs().max() <= 1e-10


def test_grouped_keys_equal_the_keys_repeated_to_the_query_heads():
    q, k, v = qkv(2, 6, 40, 40, 4, 3, seed=1)
    k, v = k[:, :2], v[:, :2]
    config = RetrievalConfig(window=4, sinks=1, blocks=2, block=4, shared=3, feature_map="hedgehog")
    state = random_state(6, 4, 1)
    grouped = retrieval_attention(q, k, v, is_causal=True, config=config, state=state, enable_gqa=True)
    repeated = retrieval_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True, config=config, state=state
    )
    assert (grouped - repeated).abs().max() <= 1e-12


def test_hedgehog_needs_its_state_of_the_call_s_shape():
    q, k, v = qkv(1, 2, 8, 8, 4, 3, seed=0)
    config = RetrievalConfig(window=2, blocks=1, block=2, feature_map="hedgehog")
    with pytest.raises(ValueError, match="retrieval with feature_map=hedgehog needs a LinearState built with that"):
        retrieval_attention(q, k, v, is_causal=True, config=config, state=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"the retrieval state's maps are .* = \(3, 4, 4\) but this call needs"):
        retrieval_attention(q, k, v, is_causal=True, config=config, state=random_state(3, 4, 0))


@settings(max_examples=30, deadline=None)
@given(
    S=st.integers(2, 50), window=st.sampled_from([1, 3, 8]), sinks=st.sampled_from([0, 1, 3, 5]),
    blocks=st.sampled_from([1, 2]), block=st.sampled_from([1, 3, 4]), shared=st.sampled_from([1, 2, 4]),
    kv=st.sampled_from([1, 2, 4]), feature=st.sampled_from(["elu", "relu", "hedgehog"]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_decoding_steps_keep_the_kernel_sums_and_equal_the_parallel_pass(
    S, window, sinks, blocks, block, shared, kv, feature, seed
):
    """One-token steps after a prefill (the sums of the keys that left the window, kept and grown
    in the cache; the chosen blocks' share taken out) and a three-token step (the parallel pass over
    the cache), a left-padded row included: each step's output is a fresh call's on the row's keys."""
    import subquad
    from subquad.mechanisms.retrieval import RetrievalCache

    config = RetrievalConfig(window=window, sinks=sinks, blocks=blocks, block=block, shared=shared, feature_map=feature)
    state = random_state(4, 6, seed) if feature == "hedgehog" else None
    q, k, v = qkv(2, 4, S + 6, S + 6, 6, 3, seed=seed)
    k, v = k[:, :kv], v[:, :kv]
    kpm = torch.ones(2, S + 6, dtype=torch.bool)
    kpm[1, : min(3, S - 1)] = False
    decoder = RetrievalCache(subquad.get_mechanism("retrieval"), config, state)
    decoder.absorb(q[:, :, :S], k[:, :, :S], v[:, :, :S], key_padding_mask=kpm[:, :S])
    t = S
    for T in (1, 1, 3, 1):
        out = decoder.step(q[:, :, t : t + T], k[:, :, t : t + T], v[:, :, t : t + T])
        for b in range(2):
            keys, values = (x[b : b + 1, :, : t + T][:, :, kpm[b, : t + T]] for x in (k, v))
            expected = retrieval_attention(
                q[b : b + 1, :, t : t + T], keys, values, is_causal=True, config=config, state=state, enable_gqa=True
            )
            torch.testing.assert_close(out[b : b + 1], expected, rtol=0, atol=1e-12)
        t += T


@pytest.mark.parametrize("feature", ["elu", "hedgehog"])
def test_where_every_far_key_was_chosen_the_output_is_the_softmax_s_exactly_in_fp32(feature):
    """Counted, not inferred from the sums' differences (whose fp32 rounding, ε·Σ φ(q)·φ(k), would
    remain against the softmax's mass of 1): the rows whose far keys the chosen blocks hold all, and
    those with no far key, equal the mechanism without a kernel part bit for bit."""
    from unittest import mock

    import subquad.mechanisms.retrieval as retrieval
    import subquad.ops.far_blocks as far_blocks

    q, k, v = (x.float() for x in qkv(1, 2, 12, 12, 64, 64, seed=2))
    options = dict(window=4, sinks=0, blocks=2, block=4)
    # without a kernel part on the same path (segments), not in place (every_block, _dense): the same rounding
    with mock.patch.object(retrieval, "every_block", lambda *a: None):
        with mock.patch.object(far_blocks, "dense_rows", lambda *a: 0):
            plain = retrieval_attention(q, k, v, is_causal=True, config=RetrievalConfig(**options))
    mixed = retrieval_attention(q, k, v, is_causal=True, config=RetrievalConfig(**options, feature_map=feature))
    far = [max(0, p - 3) for p in range(12)]  # keys j <= p - 4; whole blocks of 4 among them: far // 4, 2 chosen
    nothing_left = torch.tensor([n == 4 * min(2, n // 4) for n in far])
    assert nothing_left.tolist() == [True] * 4 + [False] * 3 + [True] + [False] * 3 + [True]
    assert torch.equal(mixed[:, :, nothing_left], plain[:, :, nothing_left])
    assert not torch.allclose(mixed[:, :, ~nothing_left], plain[:, :, ~nothing_left])


def test_the_learned_maps_train_when_only_they_need_gradients_and_chunks_are_checkpointed(monkeypatch):
    """Distillation's case: frozen projections (q, k, v need no gradient), the maps do; each chunk
    is then checkpointed as with gradients to the inputs, and the maps' gradients are the oracle's."""
    import subquad.ops.far_blocks as far_blocks

    calls = []
    original = far_blocks.checkpoint
    monkeypatch.setattr(far_blocks, "checkpoint", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    q, k, v = qkv(1, 2, 30, 30, 4, 3, seed=4)
    config = RetrievalConfig(window=3, sinks=1, blocks=1, block=3, feature_map="hedgehog")
    state = random_state(2, 4, 4)
    weights = torch.linspace(-1, 1, q.shape[2] * 3 * 2).view(1, 2, q.shape[2], 3)
    out = retrieval_attention(q, k, v, is_causal=True, config=config, state=state)
    got = torch.autograd.grad((out * weights).sum(), list(state.parameters()))
    assert calls
    want = torch.autograd.grad((oracle(q, k, v, None, True, config, state) * weights).sum(), list(state.parameters()))
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-10

"""The ``Decoder`` base class: the checks every decoding step shares, and the length bookkeeping."""

import pytest
import torch

import subquad
from subquad.decoding import Decoder, KVCache

from .conftest import qkv


class PrefixSum(Decoder):
    """Outputs the running sum of the values; records what its ``_step`` saw."""

    description = "test only"

    def __init__(self, mechanism, config, state):
        super().__init__(mechanism, config, state)
        self.total = None
        self.calls = []

    def _step(self, q, k, v, **tensors):
        self.calls.append((self.length, sorted(tensors)))
        sums = v.cumsum(2) + (0 if self.total is None else self.total)
        self.total = sums[:, :, -1:]
        return sums


def prefix_sum():
    return PrefixSum(subquad.get_mechanism("full"), subquad.make_config("full"), None)


def test_every_built_in_decoder_is_a_decoder():
    decoders = {subquad.get_mechanism(n).decoder for n in subquad.mechanism_names()} - {None}
    assert {d.__name__ for d in decoders} >= {"KVCache", "LinearDecoder", "AgglomerativeDecoder", "WindowCache",
                                             "RoutingCache"}  # fmt: skip
    assert all(issubclass(d, Decoder) and d.description for d in decoders)
    with pytest.raises(TypeError, match="abstract"):
        Decoder(subquad.get_mechanism("full"), subquad.make_config("full"), None)


def test_step_keeps_the_length_and_the_subclass_sees_the_first_position():
    decoder = prefix_sum()
    q, k, v = qkv(2, 3, 7, 7, 4, 5)
    first, rest = (decoder.step(q[:, :, t], k[:, :, t], v[:, :, t]) for t in (slice(0, 3), slice(3, 7)))
    out = torch.cat([first, rest], dim=2)
    assert torch.allclose(out, v.cumsum(2), rtol=0, atol=1e-12)
    assert decoder.length == 7 and [start for start, _ in decoder.calls] == [0, 3]
    assert decoder.shape == (2, 3, 4, 5) and decoder.dtype == torch.float64 and decoder.device == q.device


def test_a_refused_step_changes_nothing():
    decoder = prefix_sum()
    decoder.step(*qkv(2, 3, 1, 1, 4))
    bad = [
        (qkv(2, 3, 1, 2, 4), "a decoding step takes as many queries as keys, got 1 and 2"),
        (qkv(3, 3, 1, 1, 4), r"the decoder holds state for \(B, H, D, Dv\) = \(2, 3, 4, 4\), got \(3, 3, 4, 4\); "
                             "start a new cache for a new batch"),
        (qkv(2, 3, 1, 1, 4, 6), r"holds state for \(B, H, D, Dv\) = \(2, 3, 4, 4\), got \(2, 3, 4, 6\)"),
        (qkv(2, 3, 1, 1, 4, dtype=torch.float32), "holds state of torch.float64 inputs, got torch.float32"),
        (tuple(x.to("meta") for x in qkv(2, 3, 1, 1, 4)), "the cache is on cpu but q, k and v are on meta"),
        ((torch.zeros(2, 3, 4),) * 3, "q must be 4-D"),
    ]  # fmt: skip
    for (q, k, v), message in bad:
        with pytest.raises(ValueError, match=message):
            decoder.step(q, k, v)
    assert decoder.length == 1 and len(decoder.calls) == 1


def test_extra_tensors_are_checked_and_none_ones_left_out():
    decoder = prefix_sum()
    q, k, v = qkv(1, 2, 1, 1, 4)
    with pytest.raises(ValueError, match=r"full takes no tensor argument \['gate'\]; it takes \['attn_mask'\]"):
        decoder.step(q, k, v, gate=q)
    with pytest.raises(ValueError, match="attn_mask must be a tensor for a decoding step, got list"):
        decoder.step(q, k, v, attn_mask=[True])
    with pytest.raises(ValueError, match="attn_mask is on meta but q, k and v are on cpu"):
        decoder.step(q, k, v, attn_mask=torch.ones(1, 1, dtype=torch.bool, device="meta"))
    decoder.step(q, k, v, attn_mask=None)
    decoder.step(q, k, v, attn_mask=torch.ones(1, 2, dtype=torch.bool))
    assert decoder.calls == [(0, []), (1, ["attn_mask"])]


def test_caches_of_keys_name_the_keys_or_the_values_that_do_not_fit():
    cache = KVCache(subquad.get_mechanism("full"), subquad.make_config("full"), None)
    cache.step(*qkv(2, 2, 1, 1, 4))
    with pytest.raises(ValueError, match=r"the cache holds keys of \(B, H, D\) = \(2, 2, 4\), got \(2, 2, 1, 8\)"):
        cache.step(*qkv(2, 2, 1, 1, 8))
    with pytest.raises(ValueError, match=r"the cache holds values of \(B, H, Dv\) = \(2, 2, 4\), got \(2, 2, 1, 3\)"):
        cache.step(*qkv(2, 2, 1, 1, 4, 3))
    with pytest.raises(ValueError, match="holds keys and values of torch.float64 inputs, got torch.float32"):
        cache.step(*qkv(2, 2, 1, 1, 4, dtype=torch.float32))
    assert cache.length == 1


def test_agglomerative_fixes_no_head_dim_and_takes_its_logits_by_position():
    mech = subquad.get_mechanism("agglomerative")
    decoder = mech.decoder(mech, subquad.make_config("agglomerative"), None)
    q, k, v = qkv(1, 2, 1, 1, 4, 3)
    logits = torch.zeros(1, 2, 1, dtype=torch.float64)
    decoder.step(q, k, v, logits, logits)
    q8, k8, _ = qkv(1, 2, 1, 1, 8, 3)
    decoder.step(q8, k8, v, query_logits=logits, key_logits=logits)  # q and k lend only their shapes
    assert decoder.length == 2


def _window_decoder(**options):
    mech = subquad.get_mechanism("local")
    return mech.decoder(mech, subquad.make_config("local", **options), None)


def test_absorb_is_refused_where_it_cannot_hand_over_and_after_a_step():
    with pytest.raises(
        ValueError, match=r"full's decoder cannot take over a parallel prefill; step it over the prompt"
    ):
        prefix_sum().absorb(*qkv(1, 2, 4, 4, 4))
    decoder = _window_decoder(window=3)
    decoder.step(*qkv(1, 2, 2, 2, 4))
    with pytest.raises(ValueError, match=r"has already decoded 2 tokens; absorb a prompt into a new one"):
        decoder.absorb(*qkv(1, 2, 4, 4, 4))
    q, k, v = qkv(1, 2, 3, 5, 4)
    with pytest.raises(ValueError, match=r"a prompt has as many queries as keys, got 3 and 5"):
        _window_decoder(window=3).absorb(q, k, v)


def test_select_rows_reorders_what_a_decoder_holds_and_nbytes_counts_it():
    decoder = _window_decoder(window=2, sinks=1)
    q, k, v = qkv(3, 2, 5, 5, 4)
    decoder.absorb(q, k, v)
    assert decoder.nbytes == decoder.kept.nbytes == 2 * (3 * 2 * 3 * 4 * 8) + 3 * 3 * 8 + 3 * 8  # fp64, int64
    before = decoder.kept.keys.clone()
    decoder.select_rows(torch.tensor([2, 2, 0, 1]))
    assert decoder.shape[0] == 4 and torch.equal(decoder.kept.keys, before[[2, 2, 0, 1]])
    step = decoder.step(*qkv(4, 2, 1, 1, 4))
    assert step.shape == (4, 2, 1, 4)


def _by_position(kept):
    """The kept keys and values of each row ordered by position, with the positions: slot order aside."""
    order = torch.argsort(kept.positions, dim=1)
    index = order[:, None, :, None]
    return (
        kept.positions.gather(1, order),
        kept.keys.gather(2, index.expand_as(kept.keys)),
        kept.values.gather(2, index.expand_as(kept.values)),
    )


@pytest.mark.parametrize("lengths", [(9, 9), (3, 3), (3, 9), (9, 1, 6)])
def test_one_token_steps_turn_the_slots_as_a_ring_and_keep_what_the_search_keeps(lengths):
    from subquad.ops.kept_window import extend, kept_from_prompt, one_step, trim

    sinks, window, S = 2, 3, max(lengths)
    real = torch.arange(S)[None, :] >= S - torch.tensor(lengths)[:, None]  # left padding
    _, k, v = qkv(len(lengths), 2, S, S, 4)
    ring, _ = kept_from_prompt(k, v, real, sinks, window)
    search, _ = kept_from_prompt(k, v, real, sinks, window)
    assert (ring.ring == sinks) == (min(lengths) >= sinks + window)  # a full prompt: slots by position
    agreed = []
    for step in range(8):
        new_k, new_v = qkv(len(lengths), 2, 1, 1, 4, seed=10 + step)[1:]
        search.ring = None  # always the search
        expected, got = one_step(search, new_k, new_v, sinks), one_step(ring, new_k, new_v, sinks)
        agreed.append(ring.ring is not None)
        left = torch.ones(len(lengths), dtype=torch.bool) if got[2] is None else got[2]
        assert torch.equal(left, expected[2]) and torch.equal(got[0][left], expected[0][left])
        assert torch.equal(got[1][left], expected[1][left]) and (got[3] is None) == (expected[3] is None)
        for a, b in zip(_by_position(ring), _by_position(search)):
            assert torch.equal(a, b)
    # rows that filled at different steps turn at different slots: the search goes on
    assert agreed[-1] == (len(set(min(n, sinks + window) for n in lengths)) == 1 or min(lengths) >= sinks + window)
    keys, values, positions, new = extend(ring, *qkv(len(lengths), 2, 2, 2, 4)[1:])
    trimmed, _ = trim(keys, values, positions, new[:, -1] + 1, sinks, window)
    assert trimmed.ring == sinks and bool((trimmed.positions.diff(dim=1) > 0).all())  # by position again


@pytest.mark.parametrize(
    ("name", "options"),
    [("full", {}), ("sparse", {"stride": 3}), ("multires", {"rates": (1.0, 0.5), "similarity": "softmax"}),
     ("routing", {"clusters": 2, "tile": 4}), ("local", {"window": 4}),
     ("retrieval", {"window": 3, "sinks": 1, "blocks": 1, "block": 2})],
)  # fmt: skip
def test_a_decoder_s_scale_is_the_parallel_pass_s(name, options):
    """``Decoder.scale`` ("set it after building"): the exact-attention and routing caches used
    1/√D whatever it said."""
    q, k, v = qkv(1, 2, 12, 12, 4)
    mech = subquad.get_mechanism(name)
    config = subquad.make_config(mech, **options)
    extra = {"router_logits": torch.randn(1, 2, 12, dtype=torch.float64)} if name == "multires" else {}
    expected = subquad.attention(q, k, v, mechanism=name, config=config, is_causal=True, scale=0.37, **extra)
    decoder = mech.decoder(mech, config, None)
    decoder.scale = 0.37
    steps = [decoder.step(*(x[:, :, t : t + 1] for x in (q, k, v)), **{n: x[..., t : t + 1] for n, x in extra.items()})
             for t in range(12)]  # fmt: skip
    assert (torch.cat(steps, dim=2) - expected).abs().max() <= 1e-12

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import subquad
from subquad import registry
from subquad.decoding import KVCache
from subquad.mechanisms.full import full_attention
from subquad.nn import Attention, HeadGroup
from subquad.registry import Config, Mechanism, option


def _copy_into_torch_mha(layer: Attention) -> nn.MultiheadAttention:
    ref = nn.MultiheadAttention(layer.embed_dim, layer.num_heads, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([layer.q_proj.bias, layer.k_proj.bias, layer.v_proj.bias]))
        ref.out_proj.weight.copy_(layer.out_proj.weight)
        ref.out_proj.bias.copy_(layer.out_proj.bias)
    return ref


@pytest.mark.parametrize("is_causal", [False, True])
def test_layer_equals_torch_multihead_attention(is_causal):
    layer = Attention(16, 4).double()
    ref = _copy_into_torch_mha(layer)
    x = torch.randn(3, 10, 16, dtype=torch.float64)
    kpm = torch.ones(3, 10, dtype=torch.bool)
    kpm[1, 7:] = False
    kpm[2, 3:] = False
    causal_mask = torch.ones(10, 10, dtype=torch.bool).triu(1) if is_causal else None  # torch: True = blocked
    expected, _ = ref(x, x, x, key_padding_mask=~kpm, attn_mask=causal_mask, need_weights=False)
    out = layer(x, key_padding_mask=kpm, is_causal=is_causal)
    assert torch.allclose(out, expected, atol=1e-12)


def test_cross_attention_with_other_key_and_value_widths():
    layer = Attention(16, 2, kdim=6, vdim=5).double()
    x, mem, val = torch.randn(2, 4, 16), torch.randn(2, 9, 6), torch.randn(2, 9, 5)
    x, mem, val = x.double(), mem.double(), val.double()
    out = layer(x, mem, val)
    q = layer.q_proj(x).view(2, 4, 2, 8).transpose(1, 2)
    k = layer.k_proj(mem).view(2, 9, 2, 8).transpose(1, 2)
    v = layer.v_proj(val).view(2, 9, 2, 8).transpose(1, 2)
    expected = layer.out_proj(full_attention(q, k, v).transpose(1, 2).reshape(2, 4, 16))
    assert out.shape == (2, 4, 16) and torch.allclose(out, expected, atol=1e-12)


def test_split_heads_equal_one_group_with_the_same_weights():
    torch.manual_seed(1)
    split = Attention(24, 6, (HeadGroup("full", 2), HeadGroup("full", backend="eager"))).double()
    whole = Attention(24, 6, "full").double()
    whole.load_state_dict(split.state_dict())
    x = torch.randn(2, 8, 24, dtype=torch.float64)
    assert [g.heads for g in split.groups] == [2, 4]
    assert torch.allclose(split(x, is_causal=True), whole(x, is_causal=True), atol=1e-12)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            (HeadGroup("full", 2), HeadGroup("full", 3)),
            "head groups [2, 3] cover 5 heads but the layer has num_heads=4",
        ),
        ((HeadGroup("full"), HeadGroup("full")), "at most one HeadGroup may leave heads=None"),
        ((HeadGroup("full", 4), HeadGroup("full")), "head groups claim 4 of 4 heads, leaving none for heads=None"),
        ((), "attention must be a mechanism name, a HeadGroup or a sequence of them"),
        (("full", "full"), "attention must be a mechanism name, a HeadGroup or a sequence of them"),
        ("nope", "unknown mechanism 'nope'; available: full"),
    ],
)
def test_bad_head_groups_raise(spec, message):
    with pytest.raises(ValueError) as err:
        Attention(16, 4, spec)
    assert message in str(err.value)


def test_bad_layer_arguments_raise():
    with pytest.raises(ValueError, match="embed_dim=10 must be divisible by num_heads=4"):
        Attention(10, 4)
    with pytest.raises(ValueError, match="num_heads must be a positive int, got 0"):
        Attention(10, 0)
    with pytest.raises(ValueError, match="HeadGroup heads must be a positive int or None, got 0"):
        HeadGroup("full", 0)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['window'\] for full"):
        Attention(16, 4, "full", window=3)
    with pytest.raises(ValueError, match=r"options \['backend'\] apply to a mechanism name only"):
        Attention(16, 4, HeadGroup("full"), backend="eager")


def test_bad_layer_inputs_raise():
    layer = Attention(16, 4)
    with pytest.raises(ValueError, match=r"query must be \(B, N, 16\) \(batch first\), got \(5, 16\)"):
        layer(torch.randn(5, 16))
    with pytest.raises(ValueError, match=r"key must be \(B, N, 16\) \(batch first\), got \(2, 5, 8\)"):
        layer(torch.randn(2, 5, 16), torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="batch sizes differ: query 2, key 3, value 3"):
        layer(torch.randn(2, 5, 16), torch.randn(3, 5, 16))
    with pytest.raises(ValueError, match="key and value lengths differ: 5 and 4"):
        layer(torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.randn(2, 4, 16))
    with pytest.raises(ValueError, match="a decoding cache needs causal self-attention"):
        layer(torch.randn(2, 5, 16), cache=layer.new_cache())


def test_kv_cache_decoding_equals_the_parallel_causal_pass():
    layer = Attention(16, 4, (HeadGroup("full", 1), HeadGroup("full", backend="eager"))).double()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    parallel = layer(x, is_causal=True)
    cache = layer.new_cache()
    chunks = [layer(x[:, :5], is_causal=True, cache=cache)]  # a prompt, then one token at a time
    chunks += [layer(x[:, t : t + 1], is_causal=True, cache=cache) for t in range(5, 12)]
    assert all(isinstance(c, KVCache) and c.length == 12 for c in cache)
    assert torch.allclose(torch.cat(chunks, dim=1), parallel, atol=1e-12)


# A mechanism defined only here proves the layer's plug-in points without a change to nn/: a state
# module (a learned temperature), a producer of an extra tensor (a per-query gate from the layer
# input), and a recurrent decoder.


@dataclass(frozen=True)
class GatedConfig(Config):
    mechanism = "gated"
    width: int = option(1, "unused", ge=1)


class GatedState(nn.Module):
    def __init__(self, config, num_heads, head_dim, seed):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer("temperature", 1 + torch.rand(num_heads, 1, 1, generator=generator))


class GatedInputs(nn.Module):
    def __init__(self, config, embed_dim, num_heads):
        super().__init__()
        self.proj = nn.Linear(embed_dim, num_heads)

    def forward(self, query_x, key_x):
        return {"gate": torch.sigmoid(self.proj(query_x)).transpose(1, 2)}  # (B, H, L)


def gated(q, k, v, *, key_padding_mask=None, is_causal=False, scale=None, config=None, state=None, gate=None):
    out = full_attention(q * state.temperature, k, v, key_padding_mask=key_padding_mask, is_causal=is_causal)
    return out * gate.unsqueeze(-1)


class GatedDecoder(KVCache):
    steps = 0

    def step(self, q, k, v, **tensors):
        GatedDecoder.steps += 1
        return super().step(q, k, v, **tensors)


GATED = Mechanism(
    name="gated", fn=gated, config=GatedConfig, summary="test only", tensor_args=("gate",),
    state=GatedState, inputs=GatedInputs, decoder=GatedDecoder,
)  # fmt: skip


@pytest.fixture
def gated_mechanism(monkeypatch):
    subquad.mechanism_names()
    monkeypatch.setitem(registry._REGISTRY, "gated", GATED)


def test_layer_owns_state_inputs_and_decoder_of_a_plugged_in_mechanism(gated_mechanism):
    layer = Attention(16, 4, (HeadGroup("gated", 2), HeadGroup("full")), seed=7).double()
    assert "states.0.temperature" in layer.state_dict() and "inputs.0.proj.weight" in layer.state_dict()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    q, k, v = (p(x).view(2, 6, 4, 4).transpose(1, 2) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    gate = torch.sigmoid(layer.inputs["0"].proj(x)).transpose(1, 2)
    heads = torch.cat(
        [
            full_attention(q[:, :2] * layer.states["0"].temperature, k[:, :2], v[:, :2], is_causal=True)
            * gate[..., None],
            full_attention(q[:, 2:], k[:, 2:], v[:, 2:], is_causal=True),
        ],
        dim=1,
    )
    expected = layer.out_proj(heads.transpose(1, 2).reshape(2, 6, 16))
    assert torch.allclose(layer(x, is_causal=True), expected, atol=1e-12)

    cache = layer.new_cache()
    assert isinstance(cache[0], GatedDecoder) and type(cache[1]) is KVCache
    before = GatedDecoder.steps
    stepped = torch.cat([layer(x[:, t : t + 1], is_causal=True, cache=cache) for t in range(6)], dim=1)
    assert GatedDecoder.steps - before == 6
    assert torch.allclose(stepped, expected, atol=1e-12)


def test_state_is_seeded_by_the_layer(gated_mechanism):
    a = Attention(16, 4, "gated", seed=3).states["0"].temperature
    b = Attention(16, 4, "gated", seed=3).states["0"].temperature
    c = Attention(16, 4, "gated", seed=4).states["0"].temperature
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_mechanism_without_a_decoder_cannot_decode_from_a_cache(monkeypatch):
    from .. import test_registry

    subquad.mechanism_names()
    monkeypatch.setitem(registry._REGISTRY, "toy", test_registry.TOY)
    layer = Attention(16, 4, "toy")
    with pytest.raises(ValueError, match="toy has no decoder for cached generation; generate with use_cache=False"):
        layer.new_cache()
    with pytest.raises(ValueError, match="toy needs a causal form that takes L != S to decode from a KV cache"):
        KVCache(test_registry.TOY, test_registry.ToyConfig(), None)


def test_kv_cache_checks_new_entries_before_writing():
    cache = KVCache(subquad.get_mechanism("full"), subquad.make_config("full"), None)
    q = torch.randn(3, 2, 1, 4)
    cache.step(q, q, q)
    with pytest.raises(
        ValueError, match=r"the cache holds keys of \(B, H, D\) = \(3, 2, 4\), got \(1, 2, 1, 4\); start a new cache"
    ):
        cache.step(q[:1], q[:1], q[:1])
    assert cache.length == 1 and cache.keys.shape[0] == 3


def test_cross_attention_with_a_query_grouping_mechanism_takes_the_query_padding_mask():
    torch.manual_seed(0)
    layer = Attention(16, 2, "clustered", clusters=3).eval()
    query, memory = torch.randn(2, 9, 16), torch.randn(2, 7, 16)
    kpm, qpm = torch.ones(2, 7, dtype=torch.bool), torch.ones(2, 9, dtype=torch.bool)
    kpm[0, 5:], qpm[1, 6:] = False, False
    with pytest.raises(ValueError, match="clustered groups its queries.*pass query_padding_mask too"):
        layer(query, memory, key_padding_mask=kpm)
    out = layer(query, memory, key_padding_mask=kpm, query_padding_mask=qpm)
    junk = query.clone()
    junk[1, 6:] = float("nan")  # what the padded queries hold reaches no real query's output
    again = layer(junk, memory, key_padding_mask=kpm, query_padding_mask=qpm)
    assert torch.equal(out[qpm], again[qpm])

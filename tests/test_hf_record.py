"""subquad.hf.record: a model's own queries, keys and values, and approx's attention time on them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5")

from subquad.hf import Recorded, record, spread_layers

from .test_hf_mixes import llama


def _attention_outputs(model):
    """Each layer's attention output, as its o_proj receives it, through forward hooks."""
    seen = {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.o_proj.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[0]))
    return seen


def test_recorded_inputs_give_the_model_s_attention_and_its_setting_comes_back():
    """Exact attention at the default scale on what ``record`` keeps is what the layer computed: the
    queries carry the layer's own scale (here set unlike 1/√D), the keys and values stay grouped."""
    model = llama(heads=4, kv_heads=2)
    model.model.layers[1].self_attn.scaling = 0.2  # not 8 ** -0.5: the recorded queries carry it
    ids = torch.randint(0, 40, (1, 24), generator=torch.Generator().manual_seed(0))
    seen = _attention_outputs(model)
    recorded = record(model, ids, layers=[0, 1])
    during = dict(seen)
    model.model(input_ids=ids)  # the recording pass computes what the model computes
    assert all(torch.allclose(during[i], seen[i], atol=1e-6) for i in range(2))
    assert isinstance(recorded, Recorded) and recorded.layers == (0, 1) and recorded.q.shape == (2, 1, 4, 24, 8)
    assert recorded.k.shape == recorded.v.shape == (2, 1, 2, 24, 8)
    for i in range(2):
        out = torch.nn.functional.scaled_dot_product_attention(
            recorded.q[i], recorded.k[i], recorded.v[i], is_causal=True, enable_gqa=True
        )
        assert torch.allclose(out.transpose(1, 2).reshape(1, 24, 32), seen[i], atol=1e-6)
    assert model.config._attn_implementation == "sdpa"  # as it was
    half = recorded.heads([(2, 2)])
    assert torch.equal(half.q, recorded.q[:, :, 2:]) and torch.equal(half.k, recorded.k[:, :, 1:])
    turned = recorded.heads([(2, 2), (0, 2)])  # runs in their order: the second key/value head first
    assert torch.equal(turned.q, recorded.q[:, :, [2, 3, 0, 1]]) and torch.equal(turned.v, recorded.v[:, :, [1, 0]])
    with pytest.raises(ValueError, match="heads 1..2 split a key/value head of 2 query heads"):
        recorded.heads([(0, 2), (1, 2)])


def test_the_model_s_implementation_and_mode_come_back_also_when_the_pass_raises():
    model = llama()
    model.set_attn_implementation("eager")
    model.train()
    recorded = record(model, torch.randint(0, 40, (1, 8)), layers=[1])
    assert recorded.layers == (1,) and model.config._attn_implementation == "eager" and model.training
    with pytest.raises(IndexError):
        record(model, torch.full((1, 8), 10_000), layers=[0])  # past the vocabulary: the embedding raises
    assert model.config._attn_implementation == "eager" and model.training
    from subquad.hf import recording

    assert recording._WANTED is None


def test_layers_spread_over_the_depth_and_a_bad_choice_is_refused():
    model = llama()
    assert spread_layers(model, 2) == [0, 1] and spread_layers(model, 5) == [0, 1] and spread_layers(model, 1) == [1]
    with pytest.raises(ValueError, match="count must be >= 1 layer, got 0"):
        spread_layers(model, 0)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has no layer \[7\]; its layers are \[0, 1\]"):
        record(model, torch.zeros(1, 4, dtype=torch.long), layers=[0, 7])
    with pytest.raises(ValueError, match=r"record at least one layer of LlamaForCausalLM; its layers are \[0, 1\]"):
        record(model, torch.zeros(1, 4, dtype=torch.long), layers=[])


def test_approx_times_the_attention_on_the_models_own_inputs(monkeypatch):
    """``attention_speed`` with recorded inputs: each head group is benched on its own heads of the
    file (a mix's groups at their first heads), with the file's shape."""
    from subquad.bench import runner
    from subquad.bench.inputs import read_inputs
    from subquad.hf.speed import attention_speed

    model = llama(heads=4, kv_heads=2)
    recorded = record(model, torch.randint(0, 40, (1, 16), generator=torch.Generator().manual_seed(1)), [1])
    calls = []

    def bench(settings, progress=None):
        q, k, _ = read_inputs(settings.inputs)
        first = next(h for h in range(4) if torch.equal(q[0, 0, 0], recorded.q[0, 0, h]))
        calls.append((first, settings.heads, settings.kv_heads, settings.lengths, [v.label for v in settings.variants]))
        assert torch.equal(k, recorded.k[:, :, first // 2 : (first + settings.heads) // 2])
        labels = ["full", *(v.label for v in settings.variants)]
        return [{"mechanism": x, "time_s": 1.0, "ratio": 1.0, "peak_bytes": 2**20} for x in labels]

    monkeypatch.setattr(runner, "run_bench", bench)
    attention_speed(model, ["local:window=3*2+full*2"], 16, True, torch.device("cpu"), "float32", recorded)
    assert calls == [(0, 2, 1, (16,), ["local(window=3)"]), (0, 4, 2, (16,), []), (2, 2, 1, (16,), [])]

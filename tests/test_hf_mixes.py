"""Head mixes inside pretrained models (``subquad.hf.mixes``): a layer's query heads split between
mechanisms along the key/value groups.

A mix equals, head for head, full attention under each group's dense mask; each group's state is
its own (seeded apart, calibrated apart, converted on its heads, saved and loaded); generation with
subquad's cache equals generation without it over left-padded batches; every refusal is asserted
with its message.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")
hf = pytest.importorskip("subquad.hf")

from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.cache_utils import DynamicLayer  # noqa: E402

from subquad.hf.cache import DecoderLayer, MixLayer, SubquadCache  # noqa: E402
from subquad.hf.mixes import HeadShare, LayerMix  # noqa: E402

from .test_hf_cache import V, left_padded, tokens  # noqa: E402


def llama(heads=4, kv_heads=2):
    config = LlamaConfig(vocab_size=V, hidden_size=8 * heads, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=64, max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=256)).eval()


MODELS = {"llama": llama, "gpt2": gpt2}


def oracle(visible):
    """A transformers attention function: softmax over the keys ``visible(h, N)`` (bool ``(N, N)``)
    lets head h see; keys repeated to the query heads as ``repeat_kv`` does."""

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        heads, n = query.shape[1], query.shape[2]
        key, value = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (key, value))
        mask = torch.stack([visible(h, n) for h in range(heads)])
        scores = (query @ key.transpose(-1, -2)) * scaling
        out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ value
        return out.transpose(1, 2).contiguous(), None

    return forward


def window_sinks(window, sinks):
    def visible(n):
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        return (j <= i) & ((i - j < window) | (j < sinks))

    return visible


@pytest.mark.parametrize("name", list(MODELS))
def test_a_head_mix_equals_full_attention_under_each_group_s_dense_mask(name):
    """Heads 0-1 a window of 3 with a sink, heads 2-3 exact: the model's logits equal the same model
    whose attention is a dense-masked softmax per head (under GQA, heads 0-1 read key/value head 0)."""
    ids = tokens(2, 13)
    band, causal = window_sinks(3, 1), window_sinks(10**9, 0)
    AttentionInterface.register("mix_oracle", oracle(lambda h, n: band(n) if h < 2 else causal(n)))
    model = MODELS[name]()
    model.set_attn_implementation("mix_oracle")
    reference = model(ids).logits
    hf.use(model, "local:window=3,sinks=1*2+full*2")
    torch.testing.assert_close(model(ids).logits, reference, rtol=1e-5, atol=1e-5)
    AttentionInterface.register("mix_oracle", oracle(lambda h, n: causal(n) if h < 2 else band(n)))
    model.set_attn_implementation("mix_oracle")
    reference = model(ids).logits
    hf.use(model, "full*2+local:window=3,sinks=1")  # the open group takes the heads left
    torch.testing.assert_close(model(ids).logits, reference, rtol=1e-5, atol=1e-5)


def test_each_group_holds_its_own_state_seeded_and_calibrated_apart():
    model = hf.use(llama(heads=4, kv_heads=2), "routing:clusters=2*2+routing:clusters=2*2")
    model(tokens(1, 16))
    module = hf.attention_modules(model)[1]
    first, second = module.subquad_shares
    assert isinstance(module.subquad_attention, LayerMix) and isinstance(first, HeadShare)
    assert (first.first, first.heads, second.first, second.heads) == (0, 2, 2, 2)
    assert first.subquad_state.centroids.shape[0] == 2  # the group's heads, not the layer's
    assert not first.training and not first.subquad_state.training  # the model's mode: no EMA updates in eval
    assert not torch.equal(first.subquad_state.centroids, second.subquad_state.centroids)
    assert hf.calibratable(module.subquad_attention) and hf.calibratable("local*2+routing*2")
    assert not hf.calibratable("local*2+full*2")
    before = first.subquad_state.centroids.clone()
    assert hf.calibrate(model, [{"input_ids": tokens(2, 16)}]) == 4  # two groups in each of two layers
    assert not torch.equal(first.subquad_state.centroids, before)
    state = model.state_dict()
    assert "model.layers.1.self_attn.subquad_shares.1.subquad_state.centroids" in state
    hf.use(model, "local:window=4")  # one mechanism again: the groups are gone
    assert not hasattr(module, "subquad_shares")
    hf.use(model, "local*2+full*2")
    hf.restore(model)
    assert not hasattr(module, "subquad_shares") and not hasattr(module, "subquad_attention")


# Each mix, with the cache part of each group: a decoder's state, or the group's own keys.
MIXES = {
    "local:window=4,sinks=2*2+full*2": (DecoderLayer, DynamicLayer),
    "full*2+linear:window=3,sinks=1,chunk=4": (DynamicLayer, DecoderLayer),
    "retrieval:window=3,sinks=1,blocks=2,block=2*2+full*2": (DecoderLayer, DynamicLayer),
}


@pytest.mark.parametrize("spec", list(MIXES))
@pytest.mark.parametrize("name", list(MODELS))
def test_cached_generation_of_a_mix_equals_uncached_over_a_left_padded_batch(name, spec):
    model = hf.use(MODELS[name](), spec)
    prompt, mask = tokens(3, 11), left_padded(3, 11)
    settings = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0, "attention_mask": mask}
    out = model.generate(prompt, use_cache=True, return_dict_in_generate=True, **settings)
    assert isinstance(out.cache.layers[0], MixLayer)
    assert tuple(type(p) for p in out.cache.layers[0].parts) == MIXES[spec]
    assert torch.equal(out.sequences, model.generate(prompt, use_cache=False, **settings))
    kept = out.cache.layers[0].parts[MIXES[spec].index(DynamicLayer)]
    assert kept.keys.shape == (3, 1 if name == "llama" else 2, 11 + 11, 8)  # its own key/value heads only
    beams = {"max_new_tokens": 6, "num_beams": 3, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(prompt[:1], **beams), model.generate(prompt[:1], use_cache=False, **beams))


def test_groups_of_one_stateless_spec_run_as_one_call_equal_to_the_groups_apart(monkeypatch):
    """Non-adjacent groups of one spec whose mechanism keeps no state run as one call on their heads
    together (``LayerMix.calls``), in the parallel pass and in generation (the first group's cache
    part holds both groups' key/value heads); logits and generated tokens equal the groups run
    apart. Seeded or learned states, other options and learned inputs keep their groups apart."""
    far = "retrieval:window=3,sinks=1,blocks=2,block=2"
    spec = f"{far}*2+local:window=4,sinks=1*2+{far}*2"
    model = hf.use(llama(heads=6, kv_heads=3), spec)
    assert hf.attention_modules(model)[0].subquad_attention.calls == ((0, 2), (1,))
    calls = lambda s: hf.model_attention(model, s, converted=True).calls
    assert calls("local:window=4*2+local:window=5*2+local:window=4*2") == ((0, 2), (1,))
    assert calls("routing:clusters=2*2+local*2+routing:clusters=2*2") == ((0,), (1,), (2,))  # seeded centroids
    hedgehog = "linear:feature_map=hedgehog"
    assert calls(f"{hedgehog}*2+local*2+{hedgehog}*2") == ((0,), (1,), (2,))  # learned maps per group
    assert calls("linear*2+local*2+linear*2") == ((0, 2), (1,))  # elu: nothing learned
    ids, mask = tokens(2, 24), left_padded(2, 24)
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, "attention_mask": mask}
    merged = model(ids, attention_mask=mask).logits
    out = model.generate(ids, use_cache=True, return_dict_in_generate=True, **settings)
    first, _, last = out.cache.layers[0].parts
    assert first.decoder.keys.shape[1] == 2 and last.decoder is None  # both far groups' key/value heads, one part
    monkeypatch.setattr(LayerMix, "calls", property(lambda mix: tuple((i,) for i in range(len(mix.groups)))))
    apart = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(merged, apart, rtol=1e-6, atol=1e-6)
    out_apart = model.generate(ids, use_cache=True, return_dict_in_generate=True, **settings)
    assert out_apart.cache.layers[0].parts[2].decoder.keys.shape[1] == 1  # apart: each its own
    assert torch.equal(out.sequences, out_apart.sequences)


def test_a_mix_without_a_decoder_keeps_keys_and_a_refused_step_changes_nothing():
    model = hf.use(llama(), "local:window=4,sinks=2*2+full*2")
    assert isinstance(SubquadCache(hf.use(llama(), "routing*2+full*2")).layers[0], DynamicLayer)
    cache = SubquadCache(model)
    model(tokens(2, 6), attention_mask=torch.ones(2, 6, dtype=torch.long), cache=cache)
    layer = cache.layers[0]
    with pytest.raises(ValueError, match="subquad's decoders take padding only before each row's first real token"):
        model(tokens(2, 1), attention_mask=torch.tensor([[1] * 6 + [0], [1] * 7]), cache=cache)
    assert layer.seen == 6 and layer.parts[1].get_seq_length() == 6 and layer.parts[0].seen == 6
    with pytest.raises(ValueError, match="head mix 'local:window=4,sinks=2\\*2\\+full\\*2' cannot be cropped"):
        cache.crop(2)
    hf.use(model, "local:window=4,sinks=2*2+full*2")  # a new mix: the old cache is refused
    with pytest.raises(ValueError, match="this cache was built for another model, or before layer 0's attention"):
        model(tokens(2, 1), cache=cache)


def test_convert_adds_each_group_s_inputs_on_its_heads_and_a_saved_mix_loads_back(tmp_path):
    spec = "local:window=3*2+linear:feature_map=hedgehog,window=3,sinks=1,chunk=4*2"
    model = hf.convert(llama(), spec, freeze=False)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in hf.converted_parameters(model):
            p.add_(0.3 * torch.randn(p.shape, generator=generator))
    module = hf.attention_modules(model)[0]
    assert not hasattr(module.subquad_shares[0], "subquad_state")
    assert len(hf.converted_parameters(model)) == 2 * len(list(module.subquad_shares[1].subquad_state.parameters()))
    ids = tokens(2, 12)
    reference = model(ids).logits
    hf.save(model, tmp_path / "m")
    assert hf.saved_layers(tmp_path / "m")[0] == (spec, {})
    loaded = hf.from_pretrained(tmp_path / "m")
    torch.testing.assert_close(loaded(ids).logits, reference)
    with pytest.raises(ValueError, match="routing:clusters=2\\*2\\+local\\*2's centroids are fitted by k-means"):
        hf.convert(llama(), "routing:clusters=2*2+local*2")


def test_a_mix_s_refusals_name_the_fix():
    counts = r"gives 3 heads, but this model's layers have 4 query heads: give every group its count \(NAME\*N\)"
    with pytest.raises(ValueError, match=r"the head mix 'local\*2\+full\*1' " + counts):
        hf.use(llama(), "local*2+full*1")
    with pytest.raises(ValueError, match=r"gives 2 heads and leaves the rest to several groups"):
        hf.use(llama(), "local*2+full+routing")
    with pytest.raises(ValueError, match=r"gives 4 heads, .*or leave one group without \*N to take the rest"):
        hf.use(llama(), "local*4+full")
    with pytest.raises(ValueError, match=r"splits \(1, 3\) of 4 query heads, but this model's query heads share "
                                         r"key/value heads 2 at a time \(2 key/value heads\): give each group a "
                                         r"multiple of 2"):  # fmt: skip
        hf.use(llama(), "local*1+full")
    with pytest.raises(ValueError, match=r"options \['window'\] apply to a single mechanism; put them in the mix"):
        hf.use(llama(), "local*2+full*2", window=4)
    with pytest.raises(ValueError, match="unknown mechanism|no mechanism"):
        hf.check_spec("local*2+nonesuch*2")
    with pytest.raises(ValueError, match="agglomerative needs inputs from learned projections"):
        hf.use(llama(), "agglomerative*2+full*2")
    assert hf.is_mix("local*4") and hf.is_mix("local+full*2") and not hf.is_mix("local:window=4")


def test_a_mix_s_attention_time_is_its_groups_timed_on_their_heads(monkeypatch):
    """``subquad approx``'s attention column: each group is benched on its own heads and their
    key/value heads (grouped-query, as the model runs them); the mix's time is their sum, its ratio
    that sum over exact attention's on all heads."""
    from subquad.bench import runner
    from subquad.hf.speed import attention_speed

    calls = []

    def bench(settings, progress=None):  # exact attention 1 s per head, local 0.25 s (ratio 0.25), 10 MB per head
        calls.append((settings.heads, settings.kv_heads, [v.label for v in settings.variants]))
        cost = {"full": 1.0, "local(window=3)": 0.25}
        labels = ["full", *(v.label for v in settings.variants)]
        h = settings.heads
        return [{"mechanism": x, "time_s": cost[x] * h, "ratio": cost[x], "peak_bytes": 10 * h * 2**20} for x in labels]

    monkeypatch.setattr(runner, "run_bench", bench)
    out = attention_speed(
        llama(), ["local:window=3*2+full*2", "local:window=3"], 64, True, torch.device("cpu"), "float32"
    )
    # exact attention: the baseline; each group on its heads and their key/value heads (the model's 2 of 4)
    assert calls == [(2, 1, ["local(window=3)"]), (4, 2, ["local(window=3)"])]
    assert out["original"] == {"time_ms": 4000.0, "ratio": 1.0, "peak_mb": 40.0}
    assert out["local:window=3*2+full*2"] == {"time_ms": 2500.0, "ratio": 0.625, "peak_mb": 20.0}
    assert out["local:window=3"] == {"time_ms": 1000.0, "ratio": 0.25, "peak_mb": 40.0}


def test_groups_run_as_one_call_are_timed_together_on_their_heads(monkeypatch):
    """``subquad approx``'s attention column times what the model runs: the groups one call runs
    (``LayerMix.calls``) in one bench cell on their query heads together, in their order, with the
    key/value heads they read (the model's own inputs: the recorded heads picked)."""
    from safetensors.torch import load_file

    from subquad.bench import runner
    from subquad.hf.recording import record
    from subquad.hf.speed import attention_speed

    calls = []

    def bench(settings, progress=None):
        heads = settings.heads if settings.inputs is None else load_file(settings.inputs)
        calls.append((heads, [v.label for v in settings.variants]))
        labels = ["full", *(v.label for v in settings.variants)]
        return [{"mechanism": x, "time_s": 1.0, "ratio": 1.0, "peak_bytes": 2**20} for x in labels]

    monkeypatch.setattr(runner, "run_bench", bench)
    model, spec = llama(heads=6, kv_heads=3), "local:window=3*2+full*2+local:window=3*2"
    attention_speed(model, [spec], 64, True, torch.device("cpu"), "float32")
    assert calls == [(2, []), (4, ["local(window=3)"]), (6, [])]  # the full group; both window groups; the layer
    calls.clear()
    recorded = record(model, tokens(1, 16), layers=[1])
    attention_speed(model, [spec], 16, True, torch.device("cpu"), "float32", inputs=recorded)
    ((both, labels),) = [c for c in calls if c[1]]
    assert labels == ["local(window=3)"]
    assert torch.equal(both["q"], recorded.q[:, :, [0, 1, 4, 5]].contiguous())
    assert torch.equal(both["k"], recorded.k[:, :, [0, 2]].contiguous())

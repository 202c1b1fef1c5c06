"""subquad.hf: mechanisms inside tiny, randomly initialised Hugging Face models built from configs.

Encoder (BERT), decoders (GPT-2; Llama with grouped-query attention). ``full`` through the interface
reproduces the model's own sdpa attention; padding in any position, causality, the generation
cache, GQA, dropout, dtypes and every refusal are checked.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")
hf = pytest.importorskip("subquad.hf")

from transformers import (  # noqa: E402
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

V = 96


def bert(**extra):
    config = BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=256, **extra)  # fmt: skip
    torch.manual_seed(0)
    return BertModel(config, add_pooling_layer=False).eval()


def gpt2(**extra):
    config = GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=256, **extra)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


def llama(**extra):
    config = LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256, **extra)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


DECODERS = {"gpt2": gpt2, "llama": llama}
MODELS = {"bert": bert, **DECODERS}


def outputs(model, ids, mask=None):
    """Logits (decoders) or hidden states (encoders); left-padded rows keep their positions from 0."""
    positions = None
    if mask is not None and mask.dim() == 2 and not isinstance(model, BertModel):
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def tokens(B, N, seed=1):
    return torch.randint(1, V, (B, N), generator=torch.Generator().manual_seed(seed))


def padded(B, N, left: bool):
    """A padding mask (B, N) with row b missing 3·b tokens on the left or the right."""
    mask = torch.ones(B, N, dtype=torch.long)
    for b in range(B):
        if left:
            mask[b, : 3 * b] = 0
        elif b:
            mask[b, N - 3 * b :] = 0
    return mask


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("left", [True, False])
def test_full_through_the_interface_equals_the_model_s_own_sdpa_with_padding(name, left):
    model = MODELS[name]()
    ids, mask = tokens(3, 24), padded(3, 24, left)
    reference = outputs(model, ids, mask)
    hf.use(model, "full")
    real = mask.bool()
    torch.testing.assert_close(outputs(model, ids, mask)[real], reference[real], rtol=1e-5, atol=1e-5)


# Each mechanism at options that cut through a 24-token sequence.
DECODING = {
    "local": {"window": 5},
    "sparse": {"stride": 4, "block": 4},
    "linear": {"chunk": 8},
    "routing": {"clusters": 3, "tile": 4},
    "pattern": {"window": 6, "block": 4},
}
ENCODING = {
    "improved-clustered": {"clusters": 4, "topk": 6},
    "clustered": {"clusters": 4},
    "local": {"window": 5},
    "sparse": {"stride": 4, "block": 4},
    "linear": {},
}


@pytest.mark.parametrize("name", list(DECODERS))
@pytest.mark.parametrize("mechanism", list(DECODING))
def test_a_left_padded_batch_equals_each_sequence_alone_in_decoders(name, mechanism):
    model = hf.use(DECODERS[name](), mechanism, **DECODING[mechanism])
    ids, mask = tokens(3, 24), padded(3, 24, left=True)
    batch = outputs(model, ids, mask)
    assert torch.isfinite(batch).all()
    for b in range(3):
        real = mask[b].bool()
        alone = outputs(model, ids[b : b + 1, real])
        torch.testing.assert_close(batch[b, real], alone[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mechanism", list(ENCODING))
def test_a_padded_batch_equals_each_sequence_alone_in_encoders(mechanism):
    model = hf.use(bert(), mechanism, **ENCODING[mechanism])
    ids, mask = tokens(3, 24), padded(3, 24, left=False)
    batch = outputs(model, ids, mask)
    for b in range(3):
        real = mask[b].bool()
        torch.testing.assert_close(batch[b, real], outputs(model, ids[b : b + 1, real])[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(DECODERS))
@pytest.mark.parametrize("mechanism", list(DECODING))
def test_generation_with_the_cache_equals_generation_without_it(name, mechanism):
    model = hf.use(DECODERS[name](), mechanism, **DECODING[mechanism])
    prompt, mask = tokens(2, 9), padded(2, 9, left=True)
    settings = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, attention_mask=mask)
    cached = model.generate(prompt, use_cache=True, **settings)
    assert torch.equal(cached, model.generate(prompt, use_cache=False, **settings))


@pytest.mark.parametrize(("mechanism", "options"), [("local", {"window": 5, "sinks": 2}),
                                                    ("sparse", {"stride": 4, "block": 4, "sinks": 3}),
                                                    ("linear", {"window": 4, "sinks": 2})])  # fmt: skip
def test_sinks_are_each_row_s_first_real_tokens_under_either_padding_and_the_cache(mechanism, options):
    model = hf.use(llama(), mechanism, **options)
    for left in (False, True):
        ids, mask = tokens(3, 24), padded(3, 24, left=left)
        batch = outputs(model, ids, mask)
        for b in range(3):
            real = mask[b].bool()
            alone = outputs(model, ids[b : b + 1, real])[0]
            torch.testing.assert_close(batch[b, real], alone, rtol=1e-4, atol=1e-4)
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:1, :9], use_cache=True, **settings),
                       model.generate(ids[:1, :9], use_cache=False, **settings))  # fmt: skip
    plain = hf.use(llama(), mechanism, **{k: v for k, v in options.items() if k != "sinks"})
    assert not torch.allclose(outputs(model, ids[:1]), outputs(plain, ids[:1]))


def test_a_causal_mechanism_is_causal_inside_the_model():
    model = hf.use(llama(), "local", window=5)
    ids = tokens(1, 24)
    edited = ids.clone()
    edited[0, 15:] = (edited[0, 15:] + 1) % V
    torch.testing.assert_close(outputs(model, ids)[0, :15], outputs(model, edited)[0, :15], rtol=0, atol=0)


def test_grouped_query_attention_is_exact_where_the_mechanism_sees_every_key():
    """Llama's 4 query heads share 2 key/value heads: a window and a stride covering every key are full."""
    model = llama()
    ids, mask = tokens(2, 24), padded(2, 24, left=True)
    reference = outputs(model, ids, mask)
    real = mask.bool()
    for mechanism, options in [("local", {"window": 64}), ("sparse", {"stride": 64, "block": 8})]:
        hf.use(model, mechanism, **options)
        torch.testing.assert_close(outputs(model, ids, mask)[real], reference[real], rtol=1e-5, atol=1e-5)


def test_layers_may_differ_and_restore_brings_back_sdpa():
    model = llama()
    ids = tokens(1, 24)
    reference = outputs(model, ids)
    hf.use(model, "local", window=4, layers=[1])
    modules = hf.attention_modules(model)
    assert [getattr(m, "subquad_attention", None) is not None for m in modules] == [False, True]
    assert not torch.allclose(outputs(model, ids), reference)
    hf.use(model, "linear", layers=[0])
    assert [m.subquad_attention.mechanism.name for m in modules] == ["linear", "local"]
    hf.restore(model)
    assert model.config._attn_implementation == "sdpa" and not hasattr(modules[0], "subquad_attention")
    torch.testing.assert_close(outputs(model, ids), reference, rtol=0, atol=0)
    model.set_attn_implementation("eager")
    hf.restore(hf.use(model, "local", window=4))
    assert model.config._attn_implementation == "eager"  # what it had before use


def test_registered_names_load_with_from_pretrained_and_set_attn_implementation(tmp_path):
    hf.register()
    gpt2().save_pretrained(tmp_path)
    ids = tokens(1, 24)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="subquad:local").eval()
    assert loaded.config._attn_implementation == "subquad:local"
    direct = hf.use(GPT2LMHeadModel.from_pretrained(tmp_path).eval(), "local")  # local's default options
    torch.testing.assert_close(outputs(loaded, ids), outputs(direct, ids), rtol=0, atol=0)
    loaded.set_attn_implementation("subquad:linear")
    torch.testing.assert_close(outputs(loaded, ids), outputs(hf.use(direct, "linear"), ids), rtol=0, atol=0)


def test_routing_gets_a_state_per_layer_that_follows_the_model():
    model = hf.use(llama(), "routing", clusters=3, tile=4)
    first = outputs(model, tokens(1, 24))
    assert torch.equal(first, outputs(model, tokens(1, 24)))  # in eval mode the centroids stay put
    states = [m.subquad_state for m in hf.attention_modules(model)]
    first, second = (dict(s.named_buffers()) for s in states)
    assert first.keys() == second.keys()
    assert any(not torch.equal(first[k], second[k]) for k in first)  # seeded by the layer index
    assert any("subquad_state" in key for key in model.state_dict())
    hf.use(model, "local", window=4)
    assert not any(hasattr(m, "subquad_state") for m in hf.attention_modules(model))


def test_dropout_in_training_goes_to_mechanisms_that_have_it_and_raises_elsewhere():
    model = hf.use(bert(attention_probs_dropout_prob=0.5), "full").train()
    ids = tokens(2, 16)
    torch.manual_seed(0)
    first = outputs(model, ids)
    assert not torch.allclose(first, outputs(model, ids))  # attention dropout is applied
    hf.use(model, "local", window=4)
    with pytest.raises(ValueError, match=r"local has no attention dropout, but this model applies 0.5 in training"):
        outputs(model, ids)
    model.eval()
    assert torch.isfinite(outputs(model, ids)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mechanism", ["local", "linear"])
def test_low_precision_models_run_finite_and_close(dtype, mechanism):
    model = hf.use(llama(), mechanism, **DECODING[mechanism])
    ids, mask = tokens(2, 24), padded(2, 24, left=True)
    reference = outputs(model, ids, mask)
    low = outputs(model.to(dtype), ids, mask)
    real = mask.bool()
    assert low.dtype == dtype and torch.isfinite(low[real]).all()
    torch.testing.assert_close(low[real].float(), reference[real], rtol=0.1, atol=0.1)


def test_mechanisms_that_need_projections_the_model_lacks_are_refused():
    for mechanism, needs in [("agglomerative", "query_logits, key_logits"), ("multires", "router_logits")]:
        with pytest.raises(ValueError, match=rf"{mechanism} needs inputs from learned projections .*\({needs}\)"):
            hf.use(bert(), mechanism)


def test_unsupported_cases_raise():
    with pytest.raises(ValueError, match=r"has no layer \[5\]; its layers are 0..1"):
        hf.use(bert(), "local", layers=[5])
    with pytest.raises(ValueError, match="clustered has no causal form"):
        outputs(hf.use(gpt2(), "clustered"), tokens(1, 8))
    scaled = hf.use(gpt2(scale_attn_by_inverse_layer_idx=True), "linear")
    with pytest.raises(ValueError, match=r"linear has no softmax to scale, but this model scales its attention by"):
        outputs(scaled, tokens(1, 8))
    config = MistralConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, sliding_window=4)  # fmt: skip
    sliding = MistralForCausalLM(config)
    with pytest.raises(ValueError, match="a mask subquad cannot express"):
        outputs(hf.use(sliding.eval(), "local"), tokens(1, 8))
    with pytest.raises(ValueError, match=r"no attention modules"):
        hf.use(torch.nn.Linear(2, 2), "local")


def test_four_d_masks_are_reduced_to_padding_or_refused():
    model = hf.use(llama(), "local", window=64)
    ids, mask = tokens(2, 12), padded(2, 12, left=True)
    reference = outputs(model, ids, mask)
    real = mask.bool()
    causal = torch.tril(torch.ones(12, 12, dtype=torch.bool))
    dense = (causal & real[:, None, :])[:, None]  # (B, 1, L, S): causal and padding, as a 4-D mask
    torch.testing.assert_close(outputs(model, ids, dense)[real], reference[real], rtol=1e-5, atol=1e-5)
    additive = torch.zeros(2, 1, 12, 12).masked_fill(~dense, float("-inf"))
    torch.testing.assert_close(outputs(model, ids, additive)[real], reference[real], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not a padding mask over causal attention"):
        outputs(model, ids, dense & ~torch.eye(12, dtype=torch.bool))
    with pytest.raises(ValueError, match="additive attention bias"):
        outputs(model, ids, additive.masked_fill(dense, 0.5))


def test_use_reads_the_one_spec_grammar():
    model = hf.use(llama(), "local:window=4")
    assert {
        (m.subquad_attention.mechanism.name, m.subquad_attention.config.window) for m in hf.attention_modules(model)
    } == {("local", 4)}
    mixed = hf.use(llama(), "local:window=4*2+full")  # a head mix (tests/test_hf_mixes.py)
    assert {m.subquad_attention.heads for m in hf.attention_modules(mixed)} == {(2, 2)}
    with pytest.raises(ValueError, match=r"option\(s\) \['window'\] given both in the spec 'local:window=4' and as"):
        hf.use(llama(), "local:window=4", window=8)


def test_models_whose_attention_never_reaches_the_interface_or_has_cross_attention_are_refused():
    """Falcon computes its attention itself (its modules have layer_idx and is_causal): use() set a
    mechanism that never ran. Cross-attention was refused later, blaming a static cache."""
    falcon = transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True,
        num_kv_heads=2))  # fmt: skip
    with pytest.raises(ValueError, match=r"FalconForCausalLM's attention \(FalconAttention\) is computed by its own"):
        hf.use(falcon, "local")
    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64))  # fmt: skip
    with pytest.raises(ValueError, match=r"BartForConditionalGeneration has cross-attention \(its queries read"):
        hf.use(bart, "full")
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has cross-attention"):
        hf.use(gpt2(add_cross_attention=True), "local")
    assert bart.config._attn_implementation != hf.NAME  # refused before anything was set


@pytest.mark.parametrize(("mechanism", "options"), [("local", {"window": 64, "sinks": 2}),
                                                    ("retrieval", {"window": 64, "sinks": 4})])  # fmt: skip
def test_with_sinks_left_padding_sees_no_key_as_in_the_model_and_the_loss_is_the_model_s(mechanism, options):
    """Rows run with their real tokens first (sinks are the first real tokens); the padding moved
    after them saw the whole row, so the logits at padding positions, and the loss (the last pad
    predicts the first real token), differed from the model's own."""
    ids, mask = tokens(3, 16), padded(3, 16, left=True)
    labels = ids.masked_fill(mask == 0, -100)
    original, ours = llama().train(), hf.use(llama(), mechanism, **options).train()
    expected, got = (m(input_ids=ids, attention_mask=mask, labels=labels) for m in (original, ours))
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)  # padding positions too
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-6, atol=1e-6)


def test_a_chunked_prefill_takes_left_padding_within_its_first_chunk_and_names_the_fix_beyond_it():
    model = hf.use(llama(), "local", window=64, sinks=2)
    original = llama()
    ids = tokens(2, 16)
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, prefill_chunk_size=5)
    for pads, fits in ((3, True), (6, False)):
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, :pads] = 0
        if fits:
            expected = original.generate(ids, attention_mask=mask, **settings)
            assert torch.equal(model.generate(ids, attention_mask=mask, **settings), expected)
        else:
            past = r"a row's left padding runs past the first chunk of this prefill \(chunks of 5 tokens: generate's"
            with pytest.raises(ValueError, match=past):
                model.generate(ids, attention_mask=mask, **settings)


def test_output_attentions_warns_that_there_are_none_and_restore_keeps_an_untouched_model_s_implementation():
    model = hf.use(llama(), "full")
    with pytest.warns(UserWarning, match=r"subquad's mechanisms return no attention weights \(output_attentions"):
        out = model(tokens(1, 8), output_attentions=True)
    assert not out.attentions
    eager = llama()
    eager.set_attn_implementation("eager")
    assert hf.restore(eager).config._attn_implementation == "eager"  # use() never touched it
    assert hf.restore(hf.use(eager, "local")).config._attn_implementation == "eager"


def test_an_encoder_s_left_padding_with_sinks_sees_the_row_as_in_the_model_and_a_subclassed_attention_is_driven():
    ids, mask = tokens(3, 16), padded(3, 16, left=True)
    original, ours = bert(), hf.use(bert(), "local", window=64, sinks=2)
    torch.testing.assert_close(outputs(ours, ids, mask), outputs(original, ids, mask), rtol=1e-5, atol=1e-5)

    class Subclassed(transformers.models.llama.modeling_llama.LlamaAttention):  # a user's, defined here
        pass

    model = llama()
    for layer in model.model.layers:
        replaced = Subclassed(model.config, layer.self_attn.layer_idx)
        replaced.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = replaced
    expected = outputs(model, tokens(1, 8))
    torch.testing.assert_close(outputs(hf.use(model, "full"), tokens(1, 8)), expected)

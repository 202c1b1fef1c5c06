"""subquad's generation cache inside transformers models (``subquad.hf.cache``).

Every mechanism whose decoder takes over a prefill generates the same tokens with the cache as
without it (where each step reruns the mechanism over the whole sequence), in Llama with grouped
keys, GPT-2 and Mistral, over left-padded batches, by greedy search, sampling and beam search, and
when a returned cache (or a copy of it) is continued, and by a loop of forward calls that gets the
cache without asking. What the window and running-sum decoders hold does not grow with the
prompt. Each refusal is asserted with its message.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")
hf = pytest.importorskip("subquad.hf")

from transformers import (  # noqa: E402
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)
from transformers.cache_utils import DynamicLayer  # noqa: E402

from subquad.hf.cache import DecoderLayer, SubquadCache, cache_bytes  # noqa: E402

V = 96


def llama():
    config = LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=512)).eval()


def mistral():
    config = MistralConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=1, intermediate_size=64, max_position_embeddings=512,
                           sliding_window=None)  # fmt: skip
    torch.manual_seed(0)
    return MistralForCausalLM(config).eval()


MODELS = {"llama": llama, "gpt2": gpt2, "mistral": mistral}
# Each decoder that takes over a prefill, at options that cut through short sequences.
SPECS = {
    "local": ("local", {"window": 5}),
    "local-sinks": ("local", {"window": 4, "sinks": 2}),
    "linear": ("linear", {"chunk": 4}),
    "linear-window-sinks": ("linear", {"window": 4, "sinks": 2, "chunk": 4}),
    "hedgehog-window-sinks": ("linear", {"feature_map": "hedgehog", "window": 4, "sinks": 2, "chunk": 4}),
    "agglomerative": ("agglomerative", {}),
    "retrieval": ("retrieval", {"window": 3, "sinks": 1, "blocks": 2, "block": 2}),
    "retrieval-shared": ("retrieval", {"window": 3, "sinks": 1, "blocks": 2, "block": 2, "shared": 2}),
}


def swapped(name: str, spec: str):
    """The model with ``spec``; mechanisms that need learned inputs are converted, with random
    (not initial) weights so that what they add matters."""
    model = MODELS[name]()
    mechanism, options = SPECS[spec]
    if mechanism == "linear" and options.get("feature_map") != "hedgehog":
        return hf.use(model, mechanism, **options)
    hf.convert(model, mechanism, freeze=False, **options)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in hf.converted_parameters(model):
            p.add_(0.3 * torch.randn(p.shape, generator=generator))
    return model


def tokens(B, N, seed=1):
    return torch.randint(1, V, (B, N), generator=torch.Generator().manual_seed(seed))


def left_padded(B, N):
    mask = torch.ones(B, N, dtype=torch.long)
    for b in range(B):
        mask[b, : 3 * b] = 0
    return mask


def both(model, prompt, **settings):
    """Tokens generated with subquad's cache (checked to be the one generate used) and without a cache."""
    out = model.generate(prompt, use_cache=True, return_dict_in_generate=True, **settings)
    assert isinstance(out.cache, SubquadCache)
    return out.sequences, model.generate(prompt, use_cache=False, **settings)


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("name", list(MODELS))
def test_cached_generation_equals_uncached_over_a_left_padded_batch(name, spec):
    model = swapped(name, spec)
    prompt = tokens(3, 11)
    cached, uncached = both(model, prompt, max_new_tokens=14, do_sample=False, pad_token_id=0,
                            attention_mask=left_padded(3, 11))  # fmt: skip
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("spec", ["local-sinks", "hedgehog-window-sinks", "agglomerative", "retrieval"])
def test_sampling_and_beam_search_with_the_cache_equal_them_without(spec):
    model = swapped("llama", spec)
    prompt, mask = tokens(2, 9), left_padded(2, 9)
    torch.manual_seed(3)
    sampled = model.generate(prompt, attention_mask=mask, do_sample=True, max_new_tokens=10, pad_token_id=0)
    torch.manual_seed(3)
    again = model.generate(prompt, attention_mask=mask, do_sample=True, max_new_tokens=10, pad_token_id=0,
                           use_cache=False)  # fmt: skip
    assert torch.equal(sampled, again)
    cached, uncached = both(model, prompt, attention_mask=mask, num_beams=3, max_new_tokens=8, pad_token_id=0)
    assert torch.equal(cached, uncached)
    cached, uncached = both(model, prompt[:1], num_beams=2, num_return_sequences=2, max_new_tokens=6, pad_token_id=0)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("spec", ["local-sinks", "linear-window-sinks", "agglomerative"])
def test_a_returned_cache_continues_as_a_chat_does(spec):
    model = swapped("llama", spec)
    first = model.generate(tokens(1, 7), max_new_tokens=6, do_sample=False, pad_token_id=0,
                           return_dict_in_generate=True)  # fmt: skip
    turn = torch.cat([first.sequences, tokens(1, 5, seed=2)], dim=1)  # the user's next message
    continued = model.generate(turn, cache=first.cache, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(continued, model.generate(turn, use_cache=False, max_new_tokens=6, do_sample=False,
                                                 pad_token_id=0))  # fmt: skip


def test_the_cache_s_layers_follow_the_layers_mechanisms_and_hold_what_the_mechanism_reaches():
    model = hf.use(llama(), "local", window=4, sinks=2, layers=[0])  # layer 1 stays exact
    cache = SubquadCache(model)
    assert [type(layer) for layer in cache.layers] == [DecoderLayer, DynamicLayer]
    sizes = []
    for n in (20, 60):
        cache = SubquadCache(model)
        model(tokens(1, n), cache=cache)
        sizes.append((cache.layers[0].nbytes, cache.layers[1].keys.shape[2]))
        assert cache.get_seq_length() == n and cache.layers[0].decoder.length == n
    # layer 0 keeps 2 sinks and the last 4 keys (its key/value heads, unrepeated) at any length
    assert sizes[0][0] == sizes[1][0] == cache.layers[0].decoder.kept.nbytes
    assert cache.layers[0].decoder.kept.keys.shape[1:3] == (model.config.num_key_value_heads, 6)
    assert (sizes[0][1], sizes[1][1]) == (20, 60)  # the exact layer keeps every key
    assert cache_bytes(cache) == cache.nbytes == sizes[1][0] + 2 * cache.layers[1].keys.nbytes


def test_retrieval_s_cache_keeps_grouped_keys_unrepeated_with_an_eighth_of_room():
    model = hf.use(llama(), "retrieval", window=3, sinks=1, blocks=2, block=4)
    cache = SubquadCache(model)
    logits = model(tokens(1, 40), cache=cache).logits
    model(logits[:, -1:].argmax(-1), cache=cache)  # one step: the cache grows once
    decoder = cache.layers[0].decoder
    heads = model.config.num_key_value_heads
    assert heads < model.config.num_attention_heads
    assert decoder.keys.shape[:3] == (1, heads, 41 + 16) and decoder.known.tolist() == [10]
    with pytest.raises(ValueError, match=f"the cache holds keys of {heads} key/value heads, got 4; start a new"):
        q = torch.zeros(1, 4, 1, decoder.keys.shape[-1])
        decoder.step(q, q, q)
    assert decoder.length == 41  # the refused step changed nothing


def test_a_forward_with_the_cache_equals_the_parallel_pass_token_by_token():
    model = swapped("llama", "hedgehog-window-sinks")
    ids = tokens(2, 30)
    whole = model(ids).logits
    cache = SubquadCache(model)
    parts = [model(ids[:, :17], cache=cache).logits]
    parts += [model(ids[:, t : t + 1], cache=cache).logits for t in range(17, 30)]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=1e-4, atol=1e-5)


def test_padding_after_a_real_token_is_refused_at_the_first_step():
    model = swapped("llama", "local-sinks")
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, -3:] = 0  # right padding: generated tokens would follow the pads
    with pytest.raises(ValueError, match=r"padding only before each row's first real token .*padding_side = 'left'"):
        model.generate(tokens(2, 9), attention_mask=mask, max_new_tokens=3, pad_token_id=0)


def test_a_cache_from_another_model_or_spec_is_refused():
    model = swapped("llama", "local-sinks")
    cache = SubquadCache(model)
    model(tokens(1, 8), cache=cache)
    hf.use(model, "local", window=6)  # the layers' attention changed since the cache was built
    with pytest.raises(ValueError, match=r"this cache was built for another model, or before layer 0's attention"):
        model(tokens(1, 1), cache=cache)
    assert cache.get_seq_length() == 8, "a refused call leaves the cache as it was"


def test_cropping_and_models_that_hide_their_kwargs_are_refused():
    model = swapped("llama", "local-sinks")
    cache = SubquadCache(model)
    model(tokens(1, 8), cache=cache)
    with pytest.raises(ValueError, match=r"state cannot be cropped: .*assisted generation"):
        cache.crop(-2)
    config = GPTNeoXConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    neox = hf.use(GPTNeoXForCausalLM(config).eval(), "local", window=4)
    with pytest.raises(ValueError, match=r"does not hand its keyword arguments to the cache.*DynamicCache"):
        neox.generate(tokens(1, 6), max_new_tokens=2, pad_token_id=0)
    plain = neox.generate(tokens(1, 6), max_new_tokens=2, pad_token_id=0, cache=DynamicCache(config=neox.config))
    assert torch.equal(plain, neox.generate(tokens(1, 6), max_new_tokens=2, pad_token_id=0, use_cache=False))


def test_restore_gives_generate_its_own_cache_back():
    model = swapped("llama", "local")
    hf.restore(model)
    out = model.generate(tokens(1, 6), max_new_tokens=2, pad_token_id=0, return_dict_in_generate=True)
    assert type(out.cache) is DynamicCache


def test_generation_past_a_model_s_learned_positions_is_refused_before_it_starts():
    model = swapped("gpt2", "local")  # 512 learned positions
    with pytest.raises(ValueError, match=r"would reach 520 tokens .* learned positions for 512"):
        model.generate(tokens(1, 500), max_new_tokens=20, pad_token_id=0)


def test_a_static_cache_is_refused_rather_than_read_as_keys():
    model = swapped("llama", "local-sinks")
    with pytest.raises(ValueError, match=r"gives 10 key slots for 9 tokens \(a static cache\?\)"):
        model.generate(tokens(1, 9), max_new_tokens=2, cache_implementation="static", pad_token_id=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_decoding_loop_without_a_cache_gets_subquad_s_and_equals_the_parallel_pass(name):
    """A forward call that transformers would give a fresh DynamicCache (use_cache, no cache, no
    gradients) gets a SubquadCache: a loop that feeds the returned cache back token by token steps
    the decoders (each token's cost flat in the prompt) and gives the parallel pass's logits."""
    model = swapped(name, "retrieval")
    ids = tokens(2, 30)
    with torch.no_grad():
        whole = model(ids, use_cache=False).logits
        out = model(ids[:, :17])  # use_cache from the config
        assert isinstance(out.cache, SubquadCache)
        assert isinstance(out.cache.layers[0], DecoderLayer) and out.cache.layers[0].decoder is not None
        parts, cache = [out.logits], out.cache
        for t in range(17, 30):
            step = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            assert step.cache is cache
            parts.append(step.logits)
        first = model(ids[:, :5], past_key_values=None)  # the deprecated name, given as None, gets one too
        assert isinstance(first.cache, SubquadCache)
        assert model(ids[:, :5], use_cache=False).cache is None
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=1e-4, atol=1e-5)


def test_with_gradients_or_after_restore_a_forward_keeps_transformers_cache():
    model = swapped("llama", "local-sinks")
    assert type(model(tokens(1, 6)).cache) is DynamicCache, "a training forward keeps transformers' cache"
    with torch.no_grad():
        given = DynamicCache(config=model.config)
        assert model(tokens(1, 6), None, None, given).cache is given, "a cache given by position is used"
        assert isinstance(model(tokens(1, 6), None, None, None).cache, SubquadCache), "None by position, as by name"
        hf.restore(model)
        assert type(model(tokens(1, 6)).cache) is DynamicCache
        assert "_subquad_forward_cache" not in model.__dict__ and not model._forward_pre_hooks


def test_a_forward_loop_on_a_model_that_hides_its_kwargs_keeps_every_key_instead_of_refusing():
    config = GPTNeoXConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    neox = hf.use(GPTNeoXForCausalLM(config).eval(), "local", window=4)
    ids = tokens(1, 12)
    with torch.no_grad():
        whole = neox(ids, use_cache=False).logits
        out = neox(ids[:, :8])
        assert isinstance(out.cache, SubquadCache) and all(type(x) is DynamicLayer for x in out.cache.layers)
        parts, cache = [out.logits], out.cache
        for t in range(8, 12):
            parts.append(neox(ids[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=1e-4, atol=1e-5)


def test_an_encoder_gets_no_cache_hook():
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    bert = hf.use(BertModel(config).eval(), "local", window=4)
    assert "_subquad_forward_cache" not in bert.__dict__ and not bert._forward_pre_hooks


def test_the_automatic_cache_stands_aside_where_it_could_not_stand_in():
    """transformers' cache stays where subquad's could not take its place: a right-padded batch (a
    later step could not take it), a model whose attention was switched away from subquad's, and a
    hybrid whose cache holds linear-attention layers."""
    model = swapped("llama", "local-sinks")
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, -3:] = 0
    with torch.no_grad():
        out = model(tokens(2, 9), attention_mask=mask)
        assert type(out.cache) is DynamicCache
        step = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        model(tokens(2, 1), attention_mask=step, cache=out.cache)  # steps on, exact, as before
        assert isinstance(model(tokens(2, 9), attention_mask=torch.ones(2, 9, dtype=torch.long)).cache, SubquadCache)
        model.set_attn_implementation("sdpa")  # subquad's attention no longer runs: its decoders would not be fed
        assert type(model(tokens(1, 6)).cache) is DynamicCache
        out = model.generate(tokens(1, 6), max_new_tokens=2, pad_token_id=0, return_dict_in_generate=True)
        assert type(out.cache) is DynamicCache
    from transformers import FalconH1Config, FalconH1ForCausalLM

    config = FalconH1Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, mamba_d_ssm=32, mamba_n_heads=4,
                            mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_expand=1,
                            max_position_embeddings=64, mamba_chunk_size=4, projectors_bias=False)  # fmt: skip
    torch.manual_seed(0)
    hybrid = hf.use(FalconH1ForCausalLM(config).eval(), "local", window=4)
    with torch.no_grad():
        assert type(hybrid(tokens(1, 10)).cache) is DynamicCache


def test_a_deep_copied_cache_continues_as_the_original_does():
    """A prompt's cache copied to be reused (``copy.deepcopy``) still belongs to its model: each copy
    continues to the same logits, and stepping one leaves the other as it was."""
    import copy

    for spec in ("retrieval", "hedgehog-window-sinks"):
        model = swapped("llama", spec)
        ids = tokens(2, 20)
        with torch.no_grad():
            whole = model(ids, use_cache=False).logits
            prompt = model(ids[:, :12]).cache
            for _ in range(2):
                cache = copy.deepcopy(prompt)
                steps = [model(ids[:, t : t + 1], cache=cache).logits for t in range(12, 20)]
                torch.testing.assert_close(torch.cat(steps, 1), whole[:, 12:], rtol=1e-4, atol=1e-5)
            assert prompt.get_seq_length() == 12

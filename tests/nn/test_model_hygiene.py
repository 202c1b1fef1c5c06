"""Models built from subquad's layers move, copy, pickle and train as torch modules do (found by a
review of the layers as a user builds models with them)."""

import copy
import pickle

import pytest
import torch

from subquad.nn import Attention, CausalLM


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_routing_trains_after_a_move_to_half_precision(dtype):
    """The centroids' moving average scattered fp32 points into half sums (a dtype error)."""
    torch.manual_seed(0)
    layer = Attention(32, 4, "routing:clusters=2,tile=4").to(dtype).train()
    before = layer.states["0"].centroids.clone()
    x = torch.randn(2, 16, 32, dtype=dtype, requires_grad=True)
    layer(x, is_causal=True).float().sum().backward()
    after = layer.states["0"].centroids
    assert after.dtype == dtype and not torch.equal(after, before) and torch.isfinite(x.grad).all()
    assert torch.allclose(after.float().norm(dim=-1), torch.ones(()), atol=1e-2)  # on the unit sphere


@pytest.mark.parametrize("spec", ["retrieval:window=4,sinks=1,blocks=1,block=2,feature_map=elu",
                                  "retrieval:window=4,sinks=1,blocks=1,block=2", "linear:feature_map=hedgehog,window=3",
                                  "routing:clusters=2,tile=4"])  # fmt: skip
def test_bf16_autocast_runs_every_mechanism_forward_and_backward_close_to_fp32(spec):
    """retrieval's scatters and the hedgehog scan's backward mixed autocast's bf16 products with fp32."""
    torch.manual_seed(0)
    layer = Attention(32, 4, spec).eval()
    x = torch.randn(2, 13, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = layer(x, is_causal=True)
    low.float().sum().backward()
    exact = layer(x, is_causal=True)
    assert low.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()
    assert (low.float() - exact).norm() / exact.norm() < 0.05


def test_a_model_copies_and_pickles_after_a_training_forward_whatever_its_mechanisms():
    """Routing kept its last commitment loss (a graph) on its state: deepcopy refused it; the
    windowed mechanisms' records held lambdas, which pickle refuses."""
    model = CausalLM(vocab_size=17, dim=32, depth=1, num_heads=4, attention="routing:clusters=2,tile=4", max_len=32)
    model.train()(torch.randint(0, 17, (2, 8))).sum().backward()
    copied = copy.deepcopy(model)
    assert copied.backbone.blocks[0].attn.states["0"].loss is None
    assert torch.equal(copied.backbone.blocks[0].attn.states["0"].centroids,
                       model.backbone.blocks[0].attn.states["0"].centroids)  # fmt: skip
    for spec in ("local", "linear:window=4", "multires", "retrieval", "routing"):
        layer = Attention(32, 4, spec)
        x = torch.randn(1, 6, 32)
        assert torch.equal(pickle.loads(pickle.dumps(layer))(x), layer(x))


def test_is_causal_must_be_a_bool():
    """A tensor was read as a causal bias by full (and silently not causal), an int refused with
    another argument's message."""
    layer = Attention(16, 2, "full")
    for value in (torch.tensor(True), 1):
        with pytest.raises(ValueError, match=r"is_causal must be True or False, got"):
            layer(torch.randn(1, 4, 16), is_causal=value)


def test_a_refused_decoding_step_leaves_a_convolutional_input_s_history_as_it_was():
    torch.manual_seed(0)
    lm = CausalLM(vocab_size=17, dim=32, depth=1, num_heads=4, attention="full", position="conv", max_len=64).eval()
    prompt, nxt = torch.randint(0, 17, (2, 6)), torch.randint(0, 17, (2, 1))
    with torch.no_grad():
        expected = lm(torch.cat([prompt, nxt], 1))[:, -1:]
        cache = lm.new_cache()
        lm(prompt, cache=cache)
        with pytest.raises(ValueError, match="a decoding cache needs causal self-attention without key_padding_mask"):
            lm(nxt, key_padding_mask=torch.ones(2, 1, dtype=torch.bool), cache=cache)
        with pytest.raises(ValueError, match=r"this cache holds a batch of 2, got 1 rows; start a new cache"):
            lm(nxt[:1], cache=cache)
        assert (lm(nxt, cache=cache) - expected).abs().max() < 1e-5


def test_a_causal_model_of_a_mechanism_without_a_causal_form_and_bad_generate_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="clustered has no causal form"):
        CausalLM(vocab_size=17, dim=32, depth=1, num_heads=4, attention="clustered")
    lm = CausalLM(vocab_size=17, dim=32, depth=1, num_heads=4, max_len=16)
    prompt = torch.randint(0, 17, (1, 3))
    with pytest.raises(ValueError, match="top_k must be a positive int or None, got True"):
        lm.generate(prompt, 2, temperature=1.0, top_k=True)
    with pytest.raises(ValueError, match="generator must be a torch.Generator"):
        lm.generate(prompt, 2, temperature=1.0, generator=123)


def test_an_integer_padding_mask_is_refused_as_torch_s_layer_takes_bool_or_float():
    from subquad.nn import MultiheadAttention

    layer = MultiheadAttention(16, 4, batch_first=True, mechanism="local")
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"key_padding_mask must be bool \(True = padding\) or float .*torch.int64"):
        layer(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.long))

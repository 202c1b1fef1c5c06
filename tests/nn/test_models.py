import pytest
import torch

from subquad.nn import CausalLM, Encoder, HeadGroup


def _tokens(B, N, vocab, seed=0):
    return torch.randint(0, vocab, (B, N), generator=torch.Generator().manual_seed(seed))


def test_causal_lm_overfits_a_small_batch():
    torch.manual_seed(0)
    model = CausalLM(32, 64, 2, 4, max_len=64)
    tokens = _tokens(4, 33, 32)
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = model.loss(tokens)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    assert loss.item() < 0.1


def test_output_head_is_tied_to_the_token_embedding():
    model = CausalLM(32, 16, 1, 2)
    assert model.head.weight is model.backbone.embed.tokens.weight


@pytest.mark.parametrize(
    "attention",
    [
        "full",
        [HeadGroup("full", backend="eager"), "full"],
        (HeadGroup("full", 1), HeadGroup("full", backend="eager")),
        "routing",  # its defaults once depended on the length: cached and uncached tokens differed
    ],
)
def test_generate_gives_the_same_tokens_with_and_without_the_cache(attention):
    torch.manual_seed(0)
    model = CausalLM(40, 32, 2, 4, attention=attention, max_len=64).eval()
    prompt = _tokens(3, 7, 40)
    cached = model.generate(prompt, 30, use_cache=True)
    uncached = model.generate(prompt, 30, use_cache=False)
    assert cached.shape == (3, 37) and torch.equal(cached[:, :7], prompt)
    assert torch.equal(cached, uncached)
    sampled = [
        model.generate(prompt, 20, use_cache=c, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(1))
        for c in (True, False)
    ]
    assert torch.equal(*sampled)


def test_causal_lm_logits_do_not_depend_on_future_tokens():
    model = CausalLM(40, 32, 2, 4, max_len=64)
    tokens = _tokens(2, 20, 40)
    edited = tokens.clone()
    edited[:, 12:] = (edited[:, 12:] + 5) % 40
    a, b = model(tokens), model(edited)
    assert torch.equal(a[:, :12], b[:, :12]) and not torch.allclose(a[:, 12:], b[:, 12:])


def test_causal_lm_loss_ignores_padded_targets():
    model = CausalLM(40, 32, 1, 4)
    tokens = _tokens(2, 10, 40)
    kpm = torch.ones(2, 10, dtype=torch.bool)
    kpm[1, 6:] = False
    garbage = tokens.clone()
    garbage[1, 6:] = 0
    assert torch.allclose(model.loss(tokens, kpm), model.loss(garbage, kpm))


def test_encoder_ignores_padding():
    model = Encoder(50, 32, 2, 4, num_classes=3, attention=["full", HeadGroup("full", backend="eager")]).eval()
    tokens = _tokens(2, 9, 50)
    padded = torch.cat([tokens, torch.zeros(2, 5, dtype=torch.long)], dim=1)
    kpm = torch.arange(14) < 9
    logits = model(tokens)
    assert logits.shape == (2, 3)
    assert torch.allclose(model(padded, kpm.expand(2, 14)), logits, atol=1e-5)


def test_models_check_their_inputs():
    model = CausalLM(10, 16, 1, 2, max_len=8)
    with pytest.raises(ValueError, match=r"tokens must be a \(B, N\) long tensor, got \(2, 3\) torch.float32"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 10\), got range \[0, 12\]"):
        model(torch.tensor([[0, 12]]))
    with pytest.raises(ValueError, match="sequence reaches position 9 but max_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="prompt plus max_new_tokens is 10 tokens but max_len=8"):
        model.generate(torch.zeros(1, 4, dtype=torch.long), 6)
    with pytest.raises(ValueError, match="max_new_tokens must be a non-negative int, got -1"):
        model.generate(torch.zeros(1, 4, dtype=torch.long), -1)
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        model.generate(torch.zeros(1, 4, dtype=torch.long), 2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k must be a positive int or None, got 0"):
        model.generate(torch.zeros(1, 4, dtype=torch.long), 2, top_k=0)
    with pytest.raises(ValueError, match=r"generate continues a prompt of shape \(B, T\) with T >= 1, got \(2, 0\)"):
        model.generate(torch.zeros(2, 0, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="a list of attention specs gives one per layer: got 3 for depth=2"):
        CausalLM(10, 16, 2, 2, attention=["full"] * 3)
    with pytest.raises(ValueError, match="depth must be a positive int, got 0"):
        Encoder(10, 16, 0, 2, 3)

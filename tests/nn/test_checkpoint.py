import pytest
import torch

from subquad.nn import CausalLM, HeadGroup, TransformerBlock

SPARSE = [HeadGroup("sparse", pattern="strided", stride=8), HeadGroup("sparse", pattern="fixed", stride=8, summary=2)]


def _gradients(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(3)  # the same dropout masks in both runs
    loss = model.loss(tokens)
    return loss.detach(), list(torch.autograd.grad(loss, list(model.parameters())))


@pytest.mark.parametrize("attention", ["full", SPARSE])
def test_recomputation_gives_identical_gradients(attention):
    torch.manual_seed(0)
    plain = CausalLM(30, 32, 2, 4, attention=attention, max_len=64, dropout=0.1).double().train()
    recomputed = CausalLM(30, 32, 2, 4, attention=attention, max_len=64, dropout=0.1, checkpoint=True).double()
    recomputed.load_state_dict(plain.state_dict())
    recomputed.train()
    tokens = torch.randint(0, 30, (2, 50), generator=torch.Generator().manual_seed(1))
    loss, grads = _gradients(plain, tokens)
    loss_ckpt, grads_ckpt = _gradients(recomputed, tokens)
    assert torch.equal(loss, loss_ckpt)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ckpt))
    assert all(block.checkpoint for block in recomputed.backbone.blocks)


def test_recomputation_with_training_state_matches_and_updates_once():
    # Routing moves its centroids in training mode after attending. The recomputed forward must
    # route with the centroids the original forward used, and must not move them a second time.
    torch.manual_seed(0)
    routing = (HeadGroup("local", 2, window=8), HeadGroup("routing", 2, clusters=4, decay=0.5))
    plain = CausalLM(30, 32, 2, 4, attention=routing, max_len=64).double().train()
    recomputed = CausalLM(30, 32, 2, 4, attention=routing, max_len=64, checkpoint=True).double()
    recomputed.load_state_dict(plain.state_dict())
    recomputed.train()
    tokens = torch.randint(0, 30, (2, 50), generator=torch.Generator().manual_seed(1))
    before = {name: b.clone() for name, b in plain.named_buffers()}
    loss, grads = _gradients(plain, tokens)
    loss_ckpt, grads_ckpt = _gradients(recomputed, tokens)
    assert torch.equal(loss, loss_ckpt)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ckpt))
    moved = [name for name, b in plain.named_buffers() if "centroids" in name and not torch.equal(b, before[name])]
    assert moved  # decay 0.5: the centroids did move, once
    for (name, b), (_, b_ckpt) in zip(plain.named_buffers(), recomputed.named_buffers()):
        assert torch.equal(b, b_ckpt), name


def _saved_bytes(block: TransformerBlock, x: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward pass during one forward."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x, is_causal=True)
    out.sum().backward()
    return total


def test_recomputation_keeps_only_the_block_input():
    torch.manual_seed(0)
    x = torch.randn(2, 256, 64, requires_grad=True)
    plain = TransformerBlock(64, 4, SPARSE[0])
    recomputed = TransformerBlock(64, 4, SPARSE[0], checkpoint=True)
    recomputed.load_state_dict(plain.state_dict())
    kept, kept_ckpt = _saved_bytes(plain, x), _saved_bytes(recomputed, x)
    size = x.numel() * x.element_size()
    assert kept > 10 * size  # activations: norms, projections, attention, MLP hidden (4x wide)
    assert kept_ckpt <= size  # with recomputation, the block's input at most


def test_recomputation_is_off_for_decoding_and_outside_autograd():
    torch.manual_seed(0)
    model = CausalLM(30, 32, 2, 4, max_len=64, checkpoint=True).eval()
    prompt = torch.randint(0, 30, (1, 5), generator=torch.Generator().manual_seed(2))
    assert torch.equal(model.generate(prompt, 8), model.generate(prompt, 8, use_cache=False))


def test_bad_checkpoint_raises():
    with pytest.raises(ValueError, match="checkpoint must be True or False, got 'yes'"):
        TransformerBlock(16, 2, checkpoint="yes")

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import subquad.hooks
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


def test_recomputation_with_auxiliary_losses_matches_and_reports_each_loss_once():
    # The commitment losses go into the loss: their backward too runs through the recomputation.
    torch.manual_seed(0)
    routing = (HeadGroup("local", 2, window=8), HeadGroup("routing", 2, clusters=4, decay=0.5, commitment=0.1))
    plain = CausalLM(30, 32, 2, 4, attention=routing, max_len=64).double().train()
    recomputed = CausalLM(30, 32, 2, 4, attention=routing, max_len=64, checkpoint=True).double()
    recomputed.load_state_dict(plain.state_dict())
    recomputed.train()
    tokens = torch.randint(0, 30, (2, 50), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (plain, recomputed):
        with subquad.hooks.auxiliary_losses() as losses:
            loss = model.loss(tokens)
        total = loss + sum(losses)
        results.append((len(losses), total.detach(), torch.autograd.grad(total, list(model.parameters()))))
    (count, total, grads), (count_ckpt, total_ckpt, grads_ckpt) = results
    assert count == count_ckpt == 2, "one loss per routing layer, none from the recomputation"
    assert torch.equal(total, total_ckpt)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ckpt))
    for (name, b), (_, b_ckpt) in zip(plain.named_buffers(), recomputed.named_buffers()):
        assert torch.equal(b, b_ckpt), name


def test_the_recompute_flag_stops_a_second_update(monkeypatch):
    from subquad.mechanisms.routing import RoutingState

    updates, flags = [], []
    update = RoutingState.update

    def counted(self, points):
        flags.append(subquad.hooks.is_recomputing())
        updates.append(self.centroids.clone())
        update(self, points)

    monkeypatch.setattr(RoutingState, "update", counted)
    seen = []
    replayed = subquad.hooks.replayed
    monkeypatch.setattr(
        "subquad.mechanisms.routing.replayed", lambda x: seen.append(subquad.hooks.is_recomputing()) or replayed(x)
    )
    torch.manual_seed(0)
    block = TransformerBlock(16, 2, HeadGroup("routing", clusters=3, decay=0.5), checkpoint=True).double().train()
    before = block.attn.states["0"].centroids.clone()
    block(torch.randn(2, 12, 16, dtype=torch.float64), is_causal=True).sum().backward()
    assert seen == [False, True], "the forward ran twice, the second time as a recomputation"
    assert flags == [False] and torch.equal(updates[0], before), "the centroids moved once, from where they were"
    assert not torch.equal(block.attn.states["0"].centroids, before)
    assert not subquad.hooks.is_recomputing()


def test_recomputation_replays_what_the_forward_saw():
    state = torch.zeros(3, dtype=torch.float64)
    seen = []

    def moving(x: torch.Tensor) -> torch.Tensor:
        s = subquad.hooks.replayed(state)
        seen.append((subquad.hooks.is_recomputing(), s.clone()))
        out = (x * (s + 1)).sin()
        if not subquad.hooks.is_recomputing():
            state.add_(1)  # in place, after use: what routing does to its centroids
        return out

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    out = checkpoint(moving, x, use_reentrant=False, context_fn=subquad.hooks.checkpoint_contexts)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert [flag for flag, _ in seen] == [False, True]
    assert torch.equal(seen[1][1], torch.zeros_like(state)) and torch.equal(state, torch.ones_like(state))
    assert torch.equal(grad, torch.cos(x.detach()))
    # Without the hooks the recomputation would see the moved state: other activations, other gradients.
    state.zero_()
    out = checkpoint(moving, x, use_reentrant=False)
    (wrong,) = torch.autograd.grad(out.sum(), x)
    assert not torch.equal(wrong, grad)

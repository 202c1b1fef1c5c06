import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

import subquad
import subquad.hooks
import subquad.kernels.tiles
import subquad.nn
from subquad.kernels.tuning import TUNING
from subquad.mechanisms.full import full_attention
from subquad.mechanisms.routing import (
    RoutingCache,
    RoutingConfig,
    RoutingState,
    routing_attention,
    routing_loss,
)
from subquad.nn import HeadGroup
from subquad.ops.spherical import nearest_direction as route

from ..conftest import padding, qkv, randn


def state(clusters, heads=2, dim=6, seed=1):
    return RoutingState(RoutingConfig(clusters=clusters), heads, dim, seed=seed).double().eval()


def visible(q, k, centroids, window, is_causal, kpm):
    """The dense (B, H, L, S) mask of the routing schemes, built position by position in Python
    from the clusters.

    Causal: key tiles of `window` members per cluster in position order; a query sees its
    cluster's tile holding the latest key at or before it and the tile before, at positions <= its
    own, plus its own position's key. Non-causal: queries and real keys sorted by (cluster,
    position) and cut into k balanced tiles (query tile t: ranks [tL/k, (t+1)L/k); key tile t:
    ranks [tS/k, max((t+1)S/k, tS/k + 1)) of the S real keys, rounded down); query tile t sees key
    tile t."""
    B, H, L, _ = q.shape
    S, C = k.shape[2], centroids.shape[1]
    cq, ck = route(q, centroids), route(k, centroids)
    mask = torch.zeros(B, H, L, S, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            real = [j for j in range(S) if kpm is None or kpm[b, j]]
            if not is_causal:
                queries = sorted(range(L), key=lambda i: (int(cq[b, h, i]), i))
                keys = sorted(real, key=lambda j: (int(ck[b, h, j]), j))
                n = len(keys)
                for t in range(C):
                    first = t * n // C
                    last = max((t + 1) * n // C, first + 1) if n else 0
                    for i in queries[t * L // C : (t + 1) * L // C]:
                        for j in keys[first:last]:
                            mask[b, h, i, j] = True
                continue
            members, tile_of = {}, {}
            for j in real:
                c = int(ck[b, h, j])
                tile_of[j] = (c, members.get(c, 0) // window)
                members[c] = members.get(c, 0) + 1
            for i in range(L):
                p, c = i + S - L, int(cq[b, h, i])
                earlier = [j for j in tile_of if j <= p and tile_of[j][0] == c]
                tiles = -(-members.get(c, 0) // window)
                t = min(tile_of[earlier[-1]][1] if earlier else 0, max(tiles - 1, 0))
                for j, (cj, tj) in tile_of.items():
                    mask[b, h, i, j] = cj == c and tj in (t - 1, t) and j <= p
                if 0 <= p < S and (kpm is None or kpm[b, p]):
                    mask[b, h, i, p] = True
    return mask


@settings(max_examples=40, deadline=None)
@given(
    L=st.integers(1, 40), S=st.integers(1, 40), clusters=st.integers(1, 6), window=st.integers(1, 12),
    is_causal=st.booleans(), pad=st.booleans(), Dv=st.sampled_from([6, 4]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_routing_equals_full_under_the_dense_mask_of_its_own_assignments(
    L, S, clusters, window, is_causal, pad, Dv, seed
):
    """Outputs and gradients. Dv = D runs the forward through the fused kernel, Dv != D through
    the eager softmax."""
    q, k, v = (x.requires_grad_(True) for x in qkv(2, 2, L, S, 6, Dv, seed=seed))
    kpm = padding(2, S, seed) if pad else None
    st_ = state(clusters, seed=seed)
    config = RoutingConfig(clusters=clusters, tile=window)
    out = routing_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=config, state=st_)
    expected = full_attention(q, k, v, attn_mask=visible(q.detach(), k.detach(), st_.centroids, window, is_causal, kpm))
    assert (out - expected).abs().max() <= 1e-10
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    for grad, want in zip(grads, torch.autograd.grad(expected.square().sum(), (q, k, v))):
        assert (grad - want).abs().max() <= 1e-10


@pytest.mark.parametrize("is_causal", [False, True])
def test_one_cluster_with_enough_capacity_is_full_attention(is_causal):
    q, k, v = qkv(2, 2, 50, 50, 6)
    kpm = padding(2, 50, seed=5)
    config = RoutingConfig(clusters=1, tile=50)
    out = routing_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=config, state=state(1))
    assert (out - full_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal)).abs().max() <= 1e-10


def test_causal_with_one_tile_per_cluster_queries_see_their_cluster_and_themselves():
    """Capacity at least S: the causal mask is exactly 'same cluster and j <= i, or j = i'."""
    q, k, v = qkv(1, 2, 60, 60, 6, seed=3)
    st_ = state(4)
    cq, ck = route(q, st_.centroids), route(k, st_.centroids)
    i, j = torch.arange(60)[:, None], torch.arange(60)[None, :]
    mask = (cq[..., :, None] == ck[..., None, :]) & (j <= i) | (i == j)
    out = routing_attention(q, k, v, is_causal=True, config=RoutingConfig(clusters=4, tile=60), state=st_)
    assert (out - full_attention(q, k, v, attn_mask=mask)).abs().max() <= 1e-10


def test_balanced_tiles_of_self_attention_hold_each_query_with_its_own_key():
    """Non-causal, q = k and k | S: query tile t and key tile t are the same S/k positions, those
    of ranks [tS/k, (t+1)S/k) in (cluster, position) order, so each query sees exactly S/k keys,
    its own among them, and the tiles follow the clusters."""
    q, _, v = qkv(2, 2, 48, 48, 6, seed=8)
    st_ = state(4)
    out = routing_attention(q, q, v, config=RoutingConfig(clusters=4), state=st_)
    cluster = route(q, st_.centroids)
    order = (cluster * 48 + torch.arange(48)).argsort(-1)  # (B, H, 48)
    tile = torch.empty_like(order).scatter_(-1, order, torch.arange(48).expand_as(order) // 12)
    mask = tile[..., :, None] == tile[..., None, :]
    assert (out - full_attention(q, q, v, attn_mask=mask)).abs().max() <= 1e-10
    assert (mask.sum(-1) == 12).all() and mask.diagonal(dim1=-2, dim2=-1).all()


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("Dv", "window"), [(6, 5), (4, 5), (6, 60)])
def test_outputs_and_gradients_equal_full_attention_under_the_mask_in_chunks_of_any_size(
    monkeypatch, is_causal, Dv, window
):
    """Query blocks run in chunks of one width and similar need with reused buffers
    (subquad.kernels.tiles): with one block per chunk, with at most 2 chunks, as with all in one,
    and with chunks cut by width only (as off the CPU), outputs and gradients equal those of full
    attention under the dense mask. A window of 60 makes blocks of every width."""
    q, k, v = (x.requires_grad_(True) for x in qkv(2, 2, 150, 160, 6, Dv, seed=11))
    kpm = padding(2, 160, seed=4)
    st_ = state(3)
    mask = visible(q.detach(), k.detach(), st_.centroids, window, is_causal, kpm)
    expected = full_attention(q, k, v, attn_mask=mask)
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    config = RoutingConfig(clusters=3, tile=window)
    cut = subquad.kernels.tiles._chunks
    # one block per chunk, the chunks capped at 2 (each then of many small ones), all in one, cut by width only
    for elements, most, tight in ((1, 1 << 30, True), (1, 2, True), (1 << 20, 32, True), (1 << 20, 32, False)):
        monkeypatch.setattr(TUNING, "tiles_group", elements)
        monkeypatch.setattr(TUNING, "tiles_chunks", most)
        monkeypatch.setattr(subquad.kernels.tiles, "_chunks", lambda w, n, step, _, tight=tight: cut(w, n, step, tight))
        out = routing_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=config, state=st_)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        assert (out - expected).abs().max() <= 1e-10
        for grad, want in zip(grads, expected_grads):
            assert (grad - want).abs().max() <= 1e-10


@pytest.mark.parametrize("L", [64, 48])
def test_causality_editing_the_future_changes_no_earlier_output(L):
    """Future edits that move tokens between clusters (and so shift tile boundaries) leave every
    earlier output unchanged."""
    S = 64
    q, k, v = qkv(2, 2, L, S, 6, seed=7)
    st_ = state(3)
    config = RoutingConfig(clusters=3, tile=4)
    out = routing_attention(q, k, v, is_causal=True, config=config, state=st_)
    for t in (0, 20, L - 2):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[:, :, t + 1 :] = randn(*q2[:, :, t + 1 :].shape, seed=t) * 3
        k2[:, :, t + 1 + S - L :] = randn(*k2[:, :, t + 1 + S - L :].shape, seed=t + 1) * 3
        v2[:, :, t + 1 + S - L :] = randn(*v2[:, :, t + 1 + S - L :].shape, seed=t + 2) * 3
        ck, ck2 = route(k, st_.centroids), route(k2, st_.centroids)
        assert (ck != ck2).any(), "the edit moves keys between clusters"
        out2 = routing_attention(q2, k2, v2, is_causal=True, config=config, state=st_)
        assert (out2[:, :, : t + 1] - out[:, :, : t + 1]).abs().max() <= 1e-7
        assert (out2[:, :, t + 1 :] - out[:, :, t + 1 :]).abs().max() > 1e-3


@pytest.mark.parametrize("is_causal", [False, True])
def test_every_real_query_gets_a_real_output(is_causal):
    """Even with queries and keys in disjoint regions (every cluster holds only queries or only
    keys), no real query's output is zero: causal, it always sees its own key; non-causal, every
    balanced tile holds a real key."""
    q, k, v = qkv(2, 4, 200, 200, 8, dtype=torch.float32)
    q, k = q.abs() + 1, -(k.abs() + 1)  # opposite orthants: no shared cluster
    kpm = padding(2, 200, seed=2)
    out = routing_attention(q, k, v, key_padding_mask=kpm, is_causal=is_causal, config=RoutingConfig(clusters=8))
    zero = (out == 0).all(-1)  # (B, H, L)
    assert not zero[kpm[:, None].expand_as(zero)].any()


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("Dv", [3, 4])  # Dv = D runs the forward through the fused kernel
def test_gradcheck(is_causal, Dv):
    q, k, v = (x.requires_grad_(True) for x in qkv(1, 2, 15, 15, 4, Dv))
    kpm = padding(1, 15, seed=3)
    fn = functools.partial(
        routing_attention, key_padding_mask=kpm, is_causal=is_causal,
        config=RoutingConfig(clusters=3, tile=3), state=state(3, dim=4),
    )  # fmt: skip
    assert gradcheck(fn, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_low_precision(dtype, tol, is_causal):
    q, k, v = qkv(1, 2, 128, 128, 16, seed=4)
    config = RoutingConfig(clusters=4, tile=16)
    ref = routing_attention(q, k, v, is_causal=is_causal, config=config)
    out = routing_attention(*(x.to(dtype) for x in (q, k, v)), is_causal=is_causal, config=config)
    assert out.dtype == dtype
    # Rounding can move a token near a cluster boundary: compare where routing agrees.
    assert (out.double() - ref).abs().median() <= tol * ref.abs().max()


# --------------------------------------------------------------------------------------------
# Centroids
# --------------------------------------------------------------------------------------------


def test_the_default_centroids_do_not_depend_on_the_length_and_survive_a_state_dict_round_trip():
    layer = subquad.nn.Attention(32, 4, "routing", seed=3)
    assert layer.states["0"].centroids.shape == (4, 64, 8), "k fixed by the config, before any input"
    x = randn(1, 100, 32, dtype=torch.float32)
    out = layer(x)
    assert layer.states["0"].centroids.shape == (4, 64, 8)
    small = subquad.nn.Attention(32, 4, "routing", clusters=10, seed=3)
    with pytest.raises(ValueError, match=r"centroids of shape \(4, 64, 8\) do not fit .* = \(4, 10, 8\)"):
        small.load_state_dict(layer.state_dict())
    copy = subquad.nn.Attention(32, 4, "routing", seed=99)
    copy.load_state_dict(layer.state_dict())
    assert torch.equal(copy.states["0"].centroids, layer.states["0"].centroids)
    layer.eval(), copy.eval()
    assert torch.equal(copy(x), layer.eval()(x))
    assert out.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_route_is_the_argmax_first_of_ties_and_needs_no_normalised_input(dtype):
    """Integer vectors and 0/1 centroids score exactly, so ties are exact: route takes the first,
    as argmax does. A NaN row stays in range."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(-2, 3, (2, 3, 500, 6), generator=gen).to(dtype)
    centroids = torch.randint(0, 2, (3, 7, 6), generator=gen).to(dtype)
    scores = torch.matmul(x, centroids.transpose(-1, -2)).tolist()
    expected = [[[row.index(max(row)) for row in head] for head in batch] for batch in scores]
    assert route(x, centroids).tolist() == expected
    x[0, 0, 0] = torch.nan
    assert 0 <= route(x, centroids)[0, 0, 0] < 7
    unit = F.normalize(randn(3, 9, 8, dtype=dtype, seed=6), dim=-1)
    y = randn(2, 3, 300, 8, dtype=dtype, seed=7) * 5
    assert torch.equal(route(y, unit), torch.matmul(F.normalize(y, dim=-1), unit.transpose(-1, -2)).argmax(-1))


def test_a_fresh_layer_routes_with_unit_centroids_from_its_seed():
    a = RoutingState(RoutingConfig(clusters=5), 2, 8, seed=4)
    b = RoutingState(RoutingConfig(clusters=5), 2, 8, seed=4)
    c = RoutingState(RoutingConfig(clusters=5), 2, 8, seed=5)
    assert torch.equal(a.centroids, b.centroids) and not torch.equal(a.centroids, c.centroids)
    assert torch.allclose(a.centroids.norm(dim=-1), torch.ones(2, 5))


def test_ema_update_moves_centroids_towards_their_real_members_only():
    """In training mode one call moves each centroid by (1 - decay) towards the mean of the real
    normalised queries and keys routed to it; padded keys and padded queries change nothing."""
    torch.manual_seed(0)
    q, k, v = qkv(2, 1, 30, 30, 4)
    kpm = padding(2, 30, seed=6)
    config = RoutingConfig(clusters=3, decay=0.9)
    st_ = RoutingState(config, 1, 4, seed=2).double().train()
    before = st_.centroids.clone()
    routing_attention(q, k, v, key_padding_mask=kpm, config=config, state=st_, query_padding_mask=kpm)
    qn, kn = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    cq, ck = route(qn, before), route(kn, before)
    expected = before.clone()
    for c in range(3):
        members = torch.cat([qn[0, 0][(cq[0, 0] == c) & kpm[0]], qn[1, 0][(cq[1, 0] == c) & kpm[1]],
                             kn[0, 0][(ck[0, 0] == c) & kpm[0]], kn[1, 0][(ck[1, 0] == c) & kpm[1]]])  # fmt: skip
        if len(members):
            expected[0, c] = F.normalize(0.9 * before[0, c] + 0.1 * members.mean(0), dim=-1)
    assert (st_.centroids - expected).abs().max() <= 1e-12
    # Garbage at padded positions changes neither the update nor the real outputs.
    st2 = RoutingState(config, 1, 4, seed=2).double().train()
    q2, k2 = q.clone(), k.clone()
    q2[~kpm[:, None].expand(2, 1, 30)] = 1e3
    k2[~kpm[:, None].expand(2, 1, 30)] = -1e3
    routing_attention(q2, k2, v, key_padding_mask=kpm, config=config, state=st2, query_padding_mask=kpm)
    assert (st2.centroids - expected).abs().max() <= 1e-12


def test_eval_mode_and_the_functional_form_do_not_update():
    q, k, v = qkv(1, 2, 20, 20, 6)
    st_ = state(3)
    before = st_.centroids.clone()
    routing_attention(q, k, v, config=RoutingConfig(clusters=3), state=st_)
    assert torch.equal(st_.centroids, before) and st_.loss is None
    a = routing_attention(q, k, v, config=RoutingConfig(clusters=3))
    assert torch.equal(a, routing_attention(q, k, v, config=RoutingConfig(clusters=3)))


def test_commitment_loss_is_beta_times_the_distance_to_the_centroids_and_goes_to_the_collector():
    q, k, v = qkv(2, 2, 20, 20, 6, seed=4)
    config = RoutingConfig(clusters=3, commitment=0.25)
    st_ = state(3).train()
    before = st_.centroids.clone()
    with subquad.hooks.auxiliary_losses() as losses:
        routing_attention(q, k, v, config=config, state=st_)
    (loss,) = losses
    assert losses.names == ["routing.commitment"] and losses.named() == [("routing.commitment", loss)]
    heads = torch.arange(2)[None, :, None]
    distance = [(F.normalize(x, dim=-1) - before[heads, route(x, before)]).pow(2).sum(-1).mean() for x in (q, k)]
    assert torch.allclose(loss, 0.25 * (distance[0] + distance[1]), rtol=0, atol=1e-14)
    assert loss is st_.loss  # kept for the deprecated routing_loss


def test_the_collected_loss_reaches_the_inputs_and_collectors_nest():
    torch.manual_seed(0)
    model = subquad.nn.CausalLM(31, 16, 2, 2, attention=HeadGroup("routing", clusters=3), max_len=40).double()
    tokens = torch.randint(0, 31, (2, 20))
    with subquad.hooks.auxiliary_losses() as outer:
        model(tokens)
        with subquad.hooks.auxiliary_losses() as inner:
            model(tokens)
    assert len(outer) == 2 and len(inner) == 2, "one per layer, to the innermost collector only"
    loss = sum(outer)
    assert loss.item() > 0 and loss.requires_grad
    loss.backward()
    assert model.backbone.blocks[0].attn.q_proj.weight.grad.abs().sum() > 0


def test_without_a_collector_a_training_forward_warns_that_its_loss_is_dropped():
    torch.manual_seed(0)
    model = subquad.nn.CausalLM(31, 16, 1, 2, attention=HeadGroup("routing", clusters=3), max_len=40).double()
    tokens = torch.randint(0, 31, (2, 20))
    with pytest.warns(
        subquad.hooks.UncollectedLossWarning,
        match="'routing.commitment' of this training forward is "
        "dropped: no collector is active. Run the forward inside `with subquad.hooks.auxiliary_losses",
    ):
        model(tokens).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none where the loss is collected, cannot train, or weighs nothing
        with subquad.hooks.auxiliary_losses() as collected:
            model(tokens)
        with torch.no_grad():
            model(tokens)
        with subquad.hooks.auxiliary_losses() as losses:
            model.eval()(tokens)
        unweighted = subquad.nn.CausalLM(31, 16, 1, 2, attention=HeadGroup("routing", clusters=3, commitment=0.0),
                                         max_len=40).double()  # fmt: skip
        unweighted(tokens).sum().backward()
    assert len(collected) == 1 and losses == [], "eval mode reports no loss"


def test_functional_routing_without_a_state_warns_where_its_inputs_train():
    q, k, v = qkv(1, 2, 20, 20, 6)
    config = RoutingConfig(clusters=3)
    with pytest.warns(UserWarning, match=r"routing without state= routes with fixed centroids \(seed 0\) that never "
                      r"move, even in training: pass state=RoutingState"):  # fmt: skip
        routing_attention(q.requires_grad_(), k, v, config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        routing_attention(q.detach(), k, v, config=config)  # inference: fixed centroids are what it asks for
        with torch.no_grad():
            routing_attention(q.requires_grad_(), k, v, config=config)
        with subquad.hooks.auxiliary_losses():
            routing_attention(q, k, v, config=config, state=state(3).train())


def test_the_deprecated_routing_loss_sums_each_layers_last_loss_and_warns():
    torch.manual_seed(0)
    model = subquad.nn.CausalLM(31, 16, 2, 2, attention=HeadGroup("routing", clusters=3), max_len=40).double()
    with subquad.hooks.auxiliary_losses() as losses:
        model(torch.randint(0, 31, (2, 20)))
    with pytest.warns(DeprecationWarning, match="subquad.hooks.auxiliary_losses"):
        loss = routing_loss(model)
    assert torch.equal(loss, torch.stack(list(losses)).sum()) and loss.requires_grad
    with pytest.warns(DeprecationWarning):
        assert routing_loss(torch.nn.Linear(2, 2)).item() == 0


# --------------------------------------------------------------------------------------------
# Layers and models
# --------------------------------------------------------------------------------------------


def test_a_layer_mixes_local_and_routing_heads():
    """Heads split between local and routing: each group equals its mechanism alone."""
    torch.manual_seed(0)
    groups = [HeadGroup("local", 2, window=4), HeadGroup("routing", 2, clusters=3, tile=5)]
    layer = subquad.nn.Attention(16, 4, groups).double().eval()
    x = randn(2, 30, 16)
    out = layer(x, is_causal=True)
    q = layer._split_heads(layer.q_proj(x))
    k = layer._split_heads(layer.k_proj(x))
    v = layer._split_heads(layer.v_proj(x))
    heads = torch.cat(
        [
            subquad.attention(q[:, :2], k[:, :2], v[:, :2], mechanism="local", is_causal=True, window=4),
            routing_attention(q[:, 2:], k[:, 2:], v[:, 2:], is_causal=True, state=layer.states["1"],
                              config=RoutingConfig(clusters=3, tile=5)),
        ],
        dim=1,
    )  # fmt: skip
    expected = layer.out_proj(heads.transpose(1, 2).reshape(2, 30, 16))
    assert (out - expected).abs().max() <= 1e-12


def test_a_tiny_causal_lm_with_local_and_routing_heads_overfits_and_generates_like_no_cache():
    torch.manual_seed(0)
    groups = [HeadGroup("local", 2, window=8), HeadGroup("routing", 2, clusters=4)]
    model = subquad.nn.CausalLM(23, 32, 2, 4, attention=["local", groups], max_len=64)
    tokens = torch.randint(0, 23, (4, 32))
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        with subquad.hooks.auxiliary_losses() as auxiliary:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 23), tokens[:, 1:].reshape(-1))
        optimiser.zero_grad()
        (loss + sum(auxiliary)).backward()
        optimiser.step()
        losses.append(loss.item())
    assert losses[0] > 2.9 and losses[-1] < 0.5
    model.eval()
    prompt = tokens[:2, :10]
    assert torch.equal(model.generate(prompt, 30), model.generate(prompt, 30, use_cache=False))


def test_routing_cache_equals_parallel_token_by_token_over_200_steps():
    """The ring of each cluster's last two tiles gives the parallel causal outputs, after a prompt
    and then token by token, with a cache whose size does not depend on the prefix."""
    from subquad.registry import get_mechanism

    q, k, v = qkv(2, 3, 200, 200, 6, seed=9)
    config = RoutingConfig(clusters=5, tile=7)
    st_ = state(5, heads=3, dim=6)
    parallel = routing_attention(q, k, v, is_causal=True, config=config, state=st_)
    cache = RoutingCache(get_mechanism("routing"), config, st_)
    first = cache.step(q[:, :, :40], k[:, :, :40], v[:, :, :40])
    steps = [cache.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]) for t in range(40, 200)]
    assert (torch.cat([first, *steps], dim=2) - parallel).abs().max() <= 1e-12
    assert cache.keys.shape == (2, 3, 5, 14, 6), "clusters × 2 windows per head, whatever the prefix"
    assert (cache.count.sum(-1) == 200).all()


def test_generate_with_a_fixed_window_uses_the_bounded_cache_and_matches_no_cache():
    torch.manual_seed(0)
    groups = [HeadGroup("local", 2, window=5), HeadGroup("routing", 2, clusters=3, tile=4)]
    model = subquad.nn.CausalLM(29, 16, 2, 4, attention=tuple(groups), max_len=64).double().eval()
    prompt = torch.randint(0, 29, (2, 7))
    assert torch.equal(model.generate(prompt, 40), model.generate(prompt, 40, use_cache=False))


def test_routing_cache_rejects_bad_steps():
    from subquad.registry import get_mechanism

    cache = RoutingCache(get_mechanism("routing"), RoutingConfig(clusters=2, tile=3), None)
    cache.step(*qkv(2, 2, 1, 1, 4))
    with pytest.raises(ValueError, match=r"holds keys of \(B, H, D\) = \(2, 2, 4\), got \(3, 2, 1, 4\)"):
        cache.step(*qkv(3, 2, 1, 1, 4))
    with pytest.raises(ValueError, match="as many queries as keys, got 1 and 2"):
        cache.step(*qkv(2, 2, 1, 2, 4))


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"clusters": 0}, "routing option clusters must be >= 1, got 0"),
        ({"tile": 0}, "routing option tile must be >= 1, got 0"),
        ({"decay": 1.5}, "routing option decay must be <= 1, got 1.5"),
        ({"commitment": -1.0}, "routing option commitment must be >= 0, got -1.0"),
    ],
)
def test_bad_options_raise(options, message):
    with pytest.raises(ValueError, match=message):
        subquad.attention(*qkv(), mechanism="routing", **options)


def test_bad_state_and_masks_raise():
    q, k, v = qkv(2, 2, 10, 10, 6)
    with pytest.raises(ValueError, match="routing needs a RoutingState, got Linear"):
        routing_attention(q, k, v, state=torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"centroids of shape \(heads, clusters, head_dim\) = \(3, 4, 6\)"):
        routing_attention(q, k, v, state=RoutingState(RoutingConfig(clusters=4), 3, 6))
    with pytest.raises(ValueError, match=r"query_padding_mask must have shape \(B, L\) = \(2, 10\), got \(2, 9\)"):
        routing_attention(q, k, v, query_padding_mask=torch.ones(2, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="seed must be an int, got 1.5"):
        RoutingState(RoutingConfig(), 2, 6, seed=1.5)
    layer = subquad.nn.Attention(12, 2, "routing", clusters=4)
    with pytest.raises(ValueError, match=r"routing centroids of shape \(2, 5, 6\) do not fit"):
        layer.load_state_dict({**layer.state_dict(), "states.0.centroids": torch.zeros(2, 5, 6)})


def test_the_old_option_name_window_still_works_and_warns():
    with pytest.warns(DeprecationWarning, match="routing option window is now called tile"):
        config = subquad.make_config("routing", clusters=3, window=5)
    assert config == RoutingConfig(clusters=3, tile=5)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="pass tile only"):
        subquad.make_config("routing", window=5, tile=6)


@pytest.mark.parametrize(("elements", "most", "expected"), [(1, 4, "cap"), (1, 1 << 30, 1), (1 << 30, 4, "all")])
def test_a_plan_takes_chunks_of_tiles_group_scores_but_no_more_than_tiles_chunks(monkeypatch, elements, most, expected):
    """Chunks hold about ``tiles_group`` scores (at least one block), but a plan of many small
    chunks takes larger ones, ``blocks / tiles_chunks`` blocks, instead."""
    import subquad.kernels.tiles as tiles

    plans = []
    init = tiles._Plan.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        plans.append(self)

    monkeypatch.setattr(tiles._Plan, "__init__", recording)
    monkeypatch.setattr(TUNING, "tiles_group", elements)
    monkeypatch.setattr(TUNING, "tiles_chunks", most)
    q, k, v = qkv(2, 2, 150, 150, 6, seed=1)
    routing_attention(q, k, v, is_causal=True, config=RoutingConfig(clusters=3, tile=8), state=state(3))
    (plan,) = plans
    blocks = plan.queries.shape[0]
    want = {"cap": -(-blocks // most), "all": elements // (plan.Tq * plan.longest)}.get(expected, expected)
    assert blocks > 4 and plan.step == want

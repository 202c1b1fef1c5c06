"""``subquad.nn.MultiheadAttention`` is torch's class, with torch's conventions, whatever its heads run."""

import pytest
import torch
from torch import nn

import subquad
from subquad.nn import Attention, MultiheadAttention


def _pair(mechanism="full", batch_first=False, kdim=None, vdim=None, **options):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(16, 4, kdim=kdim, vdim=vdim, batch_first=batch_first, dtype=torch.float64)
    ours = MultiheadAttention(16, 4, kdim=kdim, vdim=vdim, batch_first=batch_first, dtype=torch.float64,
                              mechanism=mechanism, **options)  # fmt: skip
    ours.load_state_dict(ref.state_dict())  # the same parameters, by torch's names
    return ref, ours


def _padding(B=3, S=10):
    pad = torch.zeros(B, S, dtype=torch.bool)  # torch: True = padding
    pad[1, 7:] = True
    pad[-1, 3:] = True
    return pad


def test_it_is_torchs_class_and_full_attention_is_torchs_own_forward_weights_included():
    ref, ours = _pair()
    assert isinstance(ours, nn.MultiheadAttention)
    x = torch.randn(10, 3, 16, dtype=torch.float64)  # sequence first, torch's default
    expected = ref(x, x, x, key_padding_mask=_padding())
    got = ours(x, x, x, key_padding_mask=_padding())
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])  # the (B, L, S) weights averaged over heads


@pytest.mark.parametrize("mechanism", [{"mechanism": "full", "backend": "eager"}, {"mechanism": "local", "window": 16}])
@pytest.mark.parametrize("causal", [False, True])
def test_a_torch_padding_mask_means_padding_and_the_answer_is_torchs(mechanism, causal):
    """The silent case: the layer of this name used to read True as a *real* token, inverting a
    torch-convention mask without a word."""
    ref, ours = _pair(**mechanism)
    x = torch.randn(10, 3, 16, dtype=torch.float64)
    blocked = torch.ones(10, 10, dtype=torch.bool).triu(1) if causal else None  # torch: True = not allowed
    expected, _ = ref(x, x, x, key_padding_mask=_padding(), attn_mask=blocked, need_weights=False)
    out, weights = ours(x, x, x, key_padding_mask=_padding(), attn_mask=blocked, is_causal=causal)
    assert weights is None
    real = ~_padding().T[:, :, None]  # (L, B, 1): padded queries are torch's garbage, ours are zeros
    torch.testing.assert_close(out * real, expected * real)
    if causal:  # is_causal alone means the same top-left mask
        torch.testing.assert_close(ours(x, x, x, key_padding_mask=_padding(), is_causal=True)[0] * real, out * real)


def test_batch_first_unbatched_cross_attention_and_float_masks_follow_torch():
    ref, ours = _pair("local", batch_first=True, kdim=6, vdim=5, window=32)
    q, k, v = (torch.randn(2, n, d, dtype=torch.float64) for n, d in ((7, 16), (12, 6), (12, 5)))
    pad = torch.zeros(2, 12, dtype=torch.float64).masked_fill(_padding(2, 12), float("-inf"))  # -inf = padding
    torch.testing.assert_close(ours(q, k, v, key_padding_mask=pad)[0], ref(q, k, v, key_padding_mask=pad)[0])
    torch.testing.assert_close(ours(q[0], k[0], v[0])[0], ref(q[0], k[0], v[0])[0])  # unbatched (L, E)
    lower_right = torch.ones(7, 12, dtype=torch.bool).tril(5).logical_not()
    torch.testing.assert_close(
        ours(q, k, v, attn_mask=lower_right)[0], ref(q, k, v, attn_mask=lower_right, need_weights=False)[0]
    )


def test_head_mixes_run_each_group_on_its_heads():
    mixed = MultiheadAttention(16, 4, batch_first=True, mechanism="local:window=2*2+full", dtype=torch.float64)
    assert [(g.mechanism.name, g.heads) for g in mixed.groups] == [("local", 2), ("full", 2)]
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    out, _ = mixed(x, x, x, is_causal=True)
    assert out.shape == (2, 9, 16) and torch.isfinite(out).all()


def test_what_torchs_class_takes_and_a_mechanism_cannot_is_refused_by_name():
    with pytest.raises(ValueError, match=r"the third is dropout\), got 'local': pass mechanism=\.\.\. by keyword.*"
                       r"subquad.nn.Attention"):  # fmt: skip
        MultiheadAttention(16, 4, "local")
    with pytest.raises(ValueError, match=r"add_bias_kv and add_zero_attn append a key .* local×4"):
        MultiheadAttention(16, 4, add_bias_kv=True, mechanism="local")
    with pytest.raises(ValueError, match=r"local×4 has no attention dropout \(dropout=0.1\); pass dropout=0.0"):
        MultiheadAttention(16, 4, 0.1, mechanism="local")
    layer = MultiheadAttention(16, 4, batch_first=True, mechanism="local")
    x = torch.randn(2, 6, 16)
    with pytest.raises(ValueError, match=r"takes query, key and value as torch's does .*subquad.nn.Attention"):
        layer(x)
    with pytest.raises(ValueError, match=r"local×4 takes no attn_mask but a causal one .*mechanism='full'"):
        layer(x, x, x, attn_mask=torch.eye(6, dtype=torch.bool))
    eager = MultiheadAttention(16, 4, batch_first=True, mechanism="full:backend=eager")  # not torch's forward
    with pytest.raises(ValueError, match=r"use mechanism='full' with its default options \(torch's own forward"):
        eager(x, x, x, attn_mask=torch.eye(6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"a float key_padding_mask here may hold only 0 \(a token\) and -inf"):
        layer(x, x, x, key_padding_mask=torch.full((2, 6), 0.5))
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(B, S\), True = padding, got \(6,\)"):
        layer(x, x, x, key_padding_mask=torch.zeros(6, dtype=torch.bool))


def test_subquads_own_layer_keeps_its_conventions_under_its_own_name():
    layer = Attention(16, 4, "full").double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    real = torch.tensor([[True] * 5, [True, True, True, False, False]])
    out = layer(x, key_padding_mask=real)  # True = real token, the output alone
    assert isinstance(out, torch.Tensor) and out.shape == (2, 5, 16)
    q, k, v = (p(x).view(2, 5, 4, 4).transpose(1, 2) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    inner = subquad.attention(q, k, v, key_padding_mask=real).transpose(1, 2).reshape(2, 5, 16)
    torch.testing.assert_close(out, layer.out_proj(inner))


def _encoder_layer(mechanism):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    full = layer.self_attn
    layer.self_attn = MultiheadAttention(16, 4, batch_first=True, mechanism=mechanism)
    layer.self_attn.load_state_dict(full.state_dict())
    return layer.eval(), full


@pytest.mark.skipif(torch.__version__ < "2.5", reason="torch's encoder layer checks for hooks from 2.5 on")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("mechanism", ["local:window=2", "routing:clusters=2"])
def test_inside_torchs_encoder_in_inference_the_heads_run_the_mechanism_not_torchs_fast_path(mechanism):
    """torch's TransformerEncoderLayer, in eval mode without gradients, ran its fused kernel on the
    layer's projections (full attention) and never called it: the mechanism was silently ignored."""
    layer, full = _encoder_layer(mechanism)
    x = torch.randn(3, 12, 16)
    with torch.no_grad():
        fast = layer(x)
    assert torch.allclose(fast, layer(x), atol=1e-6)  # with gradients torch takes its slow path, which calls it
    ours, theirs = layer.self_attn, full
    layer.self_attn = theirs
    with torch.no_grad():
        assert (fast - layer(x)).abs().max() > 1e-2  # full attention answers differently
    layer.self_attn = ours
    pad = torch.zeros(3, 12, dtype=torch.bool)
    pad[0, 7:], pad[2, 10:] = True, True
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    with torch.no_grad():  # torch passes the layers a nested batch here
        nested = encoder(x, src_key_padding_mask=pad)
    padded = encoder(x, src_key_padding_mask=pad)
    assert torch.allclose(nested[~pad], padded[~pad], atol=1e-6) and (nested[pad] == 0).all()


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_nested_batch_is_taken_in_self_attention_only():
    layer = MultiheadAttention(16, 4, batch_first=True, mechanism="local")
    x = torch.nested.as_nested_tensor([torch.randn(5, 16), torch.randn(3, 16)], layout=torch.strided)
    out, weights = layer(x, x, x)
    assert out.is_nested and weights is None and [t.shape for t in out.unbind()] == [(5, 16), (3, 16)]
    torch.testing.assert_close(out.unbind()[1], layer(x.unbind()[1], x.unbind()[1], x.unbind()[1])[0])
    y = torch.nested.as_nested_tensor([torch.randn(5, 16), torch.randn(3, 16)], layout=torch.strided)
    with pytest.raises(ValueError, match=r"a nested query is taken in self-attention only \(mha\(x, x, x\)\)"):
        layer(x, y, y)


@pytest.mark.parametrize("mechanism", ["routing:clusters=2", "multires"])
def test_torchs_state_dict_loads_and_the_mechanisms_own_state_keeps_its_values(mechanism):
    ref = nn.MultiheadAttention(16, 4)
    ours = MultiheadAttention(16, 4, mechanism=mechanism)
    own = {name: x.clone() for name, x in ours.state_dict().items() if name.startswith(("states.", "inputs."))}
    assert own  # routing's centroids; multires' seed and router
    ours.load_state_dict(ref.state_dict())
    torch.testing.assert_close(ours.in_proj_weight, ref.in_proj_weight)
    assert all(torch.equal(ours.state_dict()[name], x) for name, x in own.items())
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"(states|inputs)\.0\."):
        ref.load_state_dict(ours.state_dict())  # torch's layer has no place for it (documented)
    ref.load_state_dict({n: x for n, x in ours.state_dict().items() if n not in own})


def test_a_state_dict_holding_part_of_the_mechanisms_state_is_loaded_as_it_is():
    ours = MultiheadAttention(16, 4, mechanism="multires")
    partial = {n: x for n, x in ours.state_dict().items() if not n.startswith("inputs.")}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"inputs\.0\.router\.weight\""):
        ours.load_state_dict(partial)

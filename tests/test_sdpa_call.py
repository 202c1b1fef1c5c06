"""``subquad.attention`` takes SDPA's arguments: attn_mask, dropout_p, is_causal, scale, enable_gqa."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import subquad
from subquad.mechanisms.full import full_attention

from .conftest import padding


def _qkv(H=6, Hkv=2, L=20, S=20, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, L, D, dtype=torch.float64, generator=g)
    k = torch.randn(2, Hkv, S, D, dtype=torch.float64, generator=g)
    v = torch.randn(2, Hkv, S, 5 if D == 8 else D, dtype=torch.float64, generator=g)
    return q, k, v


def _repeated(q, k, v):
    G = q.shape[1] // k.shape[1]
    return q, k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("causal", [False, True])
def test_full_reads_grouped_keys_in_place_and_equals_repeated_heads(backend, causal):
    q, k, v = (x.requires_grad_(True) for x in _qkv(L=12, S=20))
    kpm = padding(2, 20, seed=1)
    aligned = subquad.causal_lower_right(12, 20) if causal else None  # as the oracle aligns them
    out = subquad.attention(q, k, v, aligned, enable_gqa=True, key_padding_mask=kpm, backend=backend)
    ref = full_attention(*_repeated(q, k, v), is_causal=causal, key_padding_mask=kpm)
    assert (out - ref).abs().max() <= 1e-12
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert all((a - b).abs().max() <= 1e-10 for a, b in zip(grads, expected))
    assert grads[1].shape == k.shape  # the key gradient has the key/value heads


def test_full_grouped_with_a_dense_mask_per_query_head():
    q, k, v = _qkv()
    mask = torch.rand(2, 6, 20, 20, generator=torch.Generator().manual_seed(3)) > 0.3
    for backend in ("sdpa", "eager"):
        out = subquad.attention(q, k, v, mask, enable_gqa=True, backend=backend)
        ref = full_attention(*_repeated(q, k, v), attn_mask=mask)
        assert (out - ref).abs().max() <= 1e-12


@pytest.mark.parametrize(
    "mechanism, options",
    [("local", {"window": 4}), ("linear", {}), ("sparse", {"stride": 4, "block": 4}), ("routing", {"clusters": 3})],
)
def test_every_mechanism_takes_grouped_keys_as_repeated_heads(mechanism, options):
    q, k, v = _qkv(D=8)
    out = subquad.attention(q, k, v, mechanism=mechanism, is_causal=True, enable_gqa=True, **options)
    ref = subquad.attention(*_repeated(q, k, v), mechanism=mechanism, is_causal=True, **options)
    assert torch.equal(out, ref)


@pytest.mark.parametrize(
    "heads, match",
    [((6, 4, 4), "k and v with one head count that divides q's, got q H=6, k H=4, v H=4"),
     ((6, 2, 3), "got q H=6, k H=2, v H=3")],
)  # fmt: skip
def test_grouped_heads_that_do_not_divide_are_refused(heads, match):
    H, Hk, Hv = heads
    q, k, v = torch.randn(1, H, 5, 4), torch.randn(1, Hk, 5, 4), torch.randn(1, Hv, 5, 4)
    for mechanism in ("full", "linear"):
        with pytest.raises(ValueError, match=match):
            subquad.attention(q, k, v, mechanism=mechanism, enable_gqa=True)


def test_fewer_key_heads_without_enable_gqa_say_how():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="head counts differ.*pass enable_gqa=True"):
        subquad.attention(q, k, v)


def test_dropout_follows_torchs_sdpa_and_is_refused_where_there_is_none():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    torch.manual_seed(5)
    ours = subquad.attention(q, k, v, None, 0.5)
    torch.manual_seed(5)
    theirs = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(ours, theirs)
    eager = subquad.attention(q, k, v, dropout_p=0.5, backend="eager")
    kept = (eager - subquad.attention(q, k, v, backend="eager")).abs().max()
    assert torch.isfinite(eager).all() and kept > 0  # weights dropped and the rest scaled by 2
    with pytest.raises(ValueError, match=r"linear has no attention dropout \(dropout_p=0.1\).*use one of: full"):
        subquad.attention(q, k, v, dropout_p=0.1, mechanism="linear")
    with pytest.raises(ValueError, match="dropout_p must be a number in \\[0, 1\\), got 1.0"):
        subquad.attention(q, k, v, dropout_p=1.0)


def test_the_old_positional_mechanism_still_works_and_warns():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    with pytest.warns(DeprecationWarning, match="pass mechanism='linear' by keyword"):
        old = subquad.attention(q, k, v, "linear", is_causal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = subquad.attention(q, k, v, mechanism="linear", is_causal=True)
    assert torch.equal(old, new)


@pytest.mark.parametrize("causal", [False, True])
def test_a_spec_names_the_mechanism_and_its_options_as_keywords_do(causal):
    # The grammar of the commands and layers (subquad.config.parse_spec) is taken by the function too.
    q, k, v = _qkv(L=24, S=24)
    kw = dict(is_causal=causal, enable_gqa=True)
    by_spec = subquad.attention(q, k, v, mechanism="local:window=5,sinks=2", **kw)
    assert torch.equal(by_spec, subquad.attention(q, k, v, mechanism="local", window=5, sinks=2, **kw))
    joined = subquad.attention(q, k, v, mechanism="local:window=5", sinks=2, **kw)  # keywords join the spec's
    assert torch.equal(joined, by_spec)
    # the spec's options are the ones used: another window gives another answer
    assert not torch.equal(by_spec, subquad.attention(q, k, v, mechanism="local:window=3,sinks=2", **kw))
    tupled = subquad.attention(q, k, v, mechanism="multires:rates=0.5|0.25,routing=random", **kw)
    assert torch.equal(
        tupled, subquad.attention(q, k, v, mechanism="multires", rates=(0.5, 0.25), routing="random", **kw)
    )


def test_a_spec_that_cannot_be_one_mechanism_on_every_head_is_refused(monkeypatch):
    import dataclasses

    from subquad import registry

    q, k, v = (torch.randn(1, 4, 16, 8) for _ in range(3))
    mix = r"'local\*2\+full' is a head mix; attention\(\) runs one mechanism on all heads: a mix is a layer's \("
    with pytest.raises(ValueError, match=mix + r"subquad.nn.Attention\(E, H, SPEC\)\)"):
        subquad.attention(q, k, v, mechanism="local*2+full")
    with pytest.raises(ValueError, match=r"'local:window=4\*4' is a head mix"):  # a count is a mix's
        subquad.attention(q, k, v, mechanism="local:window=4*4")
    with pytest.raises(ValueError, match=r"option\(s\) \['window'\] given both in the spec 'local:window=4' and as"):
        subquad.attention(q, k, v, mechanism="local:window=4", window=8)
    both = r"pass either config or options \(keywords, a spec's\), not both \(got \['window'\]\)"
    with pytest.raises(ValueError, match=both):
        subquad.attention(q, k, v, mechanism="local:window=4", config=subquad.make_config("local"))
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['windw'\] for local"):
        subquad.attention(q, k, v, mechanism="local:windw=4")
    with pytest.raises(ValueError, match=r"unknown mechanism 'lokal'; available: full, "):
        subquad.attention(q, k, v, mechanism="lokal:window=4")
    with pytest.raises(ValueError, match=r"an attention spec is .*got 'local:window' \(bad option 'window'\)"):
        subquad.attention(q, k, v, mechanism="local:window")
    # a registered name is a name, whatever it holds (a plugin may register "my.full")
    monkeypatch.setitem(
        registry._REGISTRY, "my.full:v2", dataclasses.replace(registry.get_mechanism("full"), name="my.full:v2")
    )
    assert torch.equal(subquad.attention(q, k, v, mechanism="my.full:v2"), subquad.attention(q, k, v))
    with pytest.warns(DeprecationWarning, match="pass mechanism='local:window=4' by keyword"):
        old = subquad.attention(q, k, v, "local:window=4")  # 0.1's positional spelling reads specs too
    assert torch.equal(old, subquad.attention(q, k, v, mechanism="local", window=4))


def test_positional_arguments_are_sdpas():
    q, k, v = (torch.randn(1, 2, 10, 8) for _ in range(3))
    mask = torch.rand(10, 10) > 0.5
    mask[:, 0] = True
    ours = subquad.attention(q, k, v, mask, 0.0, False, 0.3)
    assert torch.allclose(ours, F.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=0.3), atol=1e-6)


@pytest.mark.parametrize(
    "mechanism, options",
    [
        ("local", {"window": 5}),
        ("local", {"window": 5, "kernel": "eager"}),
        ("sparse", {"stride": 4, "block": 4}),
        ("sparse", {"pattern": "fixed", "stride": 6, "summary": 2, "groups": 2, "block": 4}),
        ("sparse", {"stride": 5, "step": "column", "block": 3, "kernel": "eager"}),
        ("pattern", {"window": 4, "block": 4}),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_mechanisms_read_grouped_keys_in_place(mechanism, options, causal, monkeypatch):
    """Outputs and gradients equal those of the repeated heads, and no K/V copy is made."""
    q, k, v = (x.requires_grad_(True) for x in _qkv(H=6, Hkv=3, L=30, S=30))
    kpm = padding(2, 30, seed=2)
    ref = subquad.attention(*_repeated(q, k, v), mechanism=mechanism, is_causal=causal, key_padding_mask=kpm, **options)
    expected = torch.autograd.grad(ref.square().sum(), (q, k, v))

    repeat = torch.Tensor.repeat_interleave

    def refuse(x, *args, **kwargs):  # layouts may repeat index tensors; keys and values never
        if x.is_floating_point():
            raise AssertionError("keys or values were repeated")
        return repeat(x, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", refuse)
    out = subquad.attention(
        q, k, v, mechanism=mechanism, is_causal=causal, key_padding_mask=kpm, enable_gqa=True, **options
    )
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert (out - ref).abs().max() <= 1e-12
    assert all(a.shape == b.shape and (a - b).abs().max() <= 1e-10 for a, b in zip(grads, expected))


def test_sdpas_keyword_names_and_numpy_scalars_are_taken_as_torch_takes_them():
    np = pytest.importorskip("numpy")
    q, k, v = _qkv(H=2, Hkv=2)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    by_name = subquad.attention(query=q, key=k, value=v, is_causal=True, scale=0.5)
    assert torch.equal(by_name, subquad.attention(q, k, v, is_causal=True, scale=0.5))
    assert (by_name - expected).abs().max() <= 1e-12
    for number in (np.float32(0.5), np.float64(0.5), np.int64(1)):
        ours = subquad.attention(q, k, v, scale=number, dropout_p=np.float32(0.0), mechanism="local", window=4)
        assert torch.equal(ours, subquad.attention(q, k, v, scale=float(number), mechanism="local", window=4))
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\), got np.float32\(1.0\)"):
        subquad.attention(q, k, v, dropout_p=np.float32(1.0))


def test_the_earlier_keywords_q_k_v_are_read_for_one_release_with_a_warning():
    q, k, v = _qkv(H=2, Hkv=2)
    with pytest.warns(DeprecationWarning, match=r"attention\(q=\.\.\.\) is now query=, as in torch's SDPA"):
        old = subquad.attention(q=q, k=k, v=v)
    assert torch.equal(old, subquad.attention(q, k, v))
    with pytest.raises(TypeError, match=r"attention\(\) missing required argument\(s\): key, value"):
        subquad.attention(q)

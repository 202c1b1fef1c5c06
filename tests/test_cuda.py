"""Every mechanism on a CUDA device computes what it computes on the CPU.

Outputs and gradients in float64 on the GPU equal those of the CPU run (the CPU paths are checked
against full attention by each mechanism's own tests), the low-precision dtypes run finite and
close to float64, and the models generate the same tokens with and without the cache. Skipped
where no CUDA device is present.
"""

import pytest
import torch

from subquad.call import call
from subquad.nn import CausalLM, HeadGroup
from subquad.registry import get_mechanism, make_config, mechanism_names

from .conftest import padding, qkv

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    # a FlexAttention call that fell back to the engine would compare the engine with itself
    pytest.mark.filterwarnings("error:FlexAttention has compiled"),
]

# Options small enough for N = 100 to cross many blocks, chunks, tiles and segments: case -> (mechanism, options).
CASES = {
    "full": ("full", {}),
    "full-eager": ("full", {"backend": "eager"}),
    "clustered": ("clustered", {"clusters": 5}),
    "clustered-hamming": ("clustered", {"clusters": 5, "kmeans": "hamming", "bits": 16}),
    "improved-clustered": ("improved-clustered", {"clusters": 5, "topk": 7}),
    "linear": ("linear", {"chunk": 16}),
    "linear-relu": ("linear", {"chunk": 13, "feature_map": "relu"}),
    "agglomerative": ("agglomerative", {}),
    "local": ("local", {"window": 9}),
    "routing": ("routing", {"clusters": 4, "tile": 8}),
    "multires": ("multires", {"rates": (0.5, 0.25, 0.2, 0.1)}),
    "multires-softmax": ("multires", {"rates": (0.5, 0.25, 0.2, 0.1), "similarity": "softmax"}),
    "sparse": ("sparse", {"stride": 8, "block": 8}),
    "sparse-column": ("sparse", {"stride": 8, "step": "column", "block": 8}),
    "sparse-fixed": ("sparse", {"pattern": "fixed", "stride": 16, "summary": 3, "groups": 2, "block": 8}),
    "pattern": ("pattern", {"window": 9, "dilation": 2, "global_tokens": 3, "block": 16}),
}
# Every registered mechanism, built-in or added, also runs with each example option set of its
# record (``Mechanism.examples``): registering one is enough to be tested here.
for _name in mechanism_names():
    for _i, _example in enumerate(get_mechanism(_name).examples):
        CASES.setdefault(f"{_name}[example {_i}]", (_name, dict(_example)))
B, H, D = 2, 4, 16


def _mechanism(case):
    return CASES[case][0]


def _run(case, device, dtype, is_causal, L, S, backward, stateless=False):
    """One call of the case on ``device`` in ``dtype``: ``(out, gradients)`` as CPU float64;
    without the mechanism's state object if ``stateless``."""
    mech = get_mechanism(_mechanism(case))
    config = make_config(mech, **CASES[case][1])
    q, k, v = qkv(B, H, L, S, D, seed=3)
    kpm = padding(B, S, seed=4)
    tensors = {}
    if mech.example_tensors is not None:
        tensors = mech.example_tensors(q, k, v, config, torch.Generator().manual_seed(5))
    if "query_padding_mask" in mech.tensor_args:
        tensors["query_padding_mask"] = padding(B, L, seed=6)
    state = mech.state(config, H, D, 7).eval() if mech.state is not None and not stateless else None
    q, k, v = (x.to(device, dtype).requires_grad_(backward) for x in (q, k, v))
    tensors = {name: t.to(device, dtype if t.is_floating_point() else t.dtype) for name, t in tensors.items()}
    logits = [t.requires_grad_(backward) for t in tensors.values() if t.is_floating_point()]
    if state is not None:
        state = state.to(device, dtype)
    out = call(
        mech, q, k, v, key_padding_mask=kpm.to(device), is_causal=is_causal, config=config, state=state, **tensors
    )
    assert out.device.type == device and out.dtype == dtype
    grads = ()
    if backward:
        inputs = (q, k, v, *logits)  # agglomerative reads only the shapes of q and k: zero gradients
        grads = torch.autograd.grad(out, inputs, torch.ones_like(out).cos(), allow_unused=True, materialize_grads=True)
    return out.detach().cpu().double(), tuple(g.cpu().double() for g in grads)


def _causal_forms(case):
    return (False, True) if get_mechanism(_mechanism(case)).causal else (False,)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", ["self", "cross"])
def test_float64_on_cuda_equals_the_cpu(case, shape):
    L, S = (100, 100) if shape == "self" else (37, 100)
    for is_causal in _causal_forms(case):
        out_cpu, grads_cpu = _run(case, "cpu", torch.float64, is_causal, L, S, backward=True)
        out_gpu, grads_gpu = _run(case, "cuda", torch.float64, is_causal, L, S, backward=True)
        torch.testing.assert_close(out_gpu, out_cpu, rtol=1e-9, atol=1e-10)
        for g_gpu, g_cpu in zip(grads_gpu, grads_cpu):
            torch.testing.assert_close(g_gpu, g_cpu, rtol=1e-9, atol=1e-10)


STATEFUL = [case for case in CASES if get_mechanism(_mechanism(case)).state is not None]


@pytest.mark.parametrize("case", STATEFUL)
def test_a_call_without_a_state_on_cuda_equals_the_cpu(case):
    # The state a call builds for itself must live on the inputs' device.
    for is_causal in _causal_forms(case):
        out_cpu, _ = _run(case, "cpu", torch.float64, is_causal, 100, 100, backward=False, stateless=True)
        out_gpu, _ = _run(case, "cuda", torch.float64, is_causal, 100, 100, backward=False, stateless=True)
        torch.testing.assert_close(out_gpu, out_cpu, rtol=1e-9, atol=1e-10)


def test_routing_refuses_a_state_on_another_device():
    mech = get_mechanism("routing")
    config = make_config(mech, **CASES["routing"][1])
    q, k, v = (x.cuda() for x in qkv(B, H, 20, 20, D, seed=3))
    with pytest.raises(ValueError, match=r"centroids are on cpu but the inputs are on cuda:0; move the state"):
        call(mech, q, k, v, config=config, state=mech.state(config, H, D, 7))


def test_the_routing_cache_without_a_state_on_cuda_equals_the_parallel_form():
    mech = get_mechanism("routing")
    config = make_config(mech, **CASES["routing"][1])
    q, k, v = (x.cuda() for x in qkv(B, H, 30, 30, D, seed=3, dtype=torch.float64))
    cache = mech.decoder(mech, config, None)
    steps = torch.cat([cache.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]) for t in range(30)], 2)
    torch.testing.assert_close(steps, call(mech, q, k, v, is_causal=True, config=config), rtol=1e-9, atol=1e-10)


# Mechanisms with a discrete choice (clusters, resolution, retrieval's far blocks) that rounding can
# flip; the others are close to float64 in every dtype.
DISCRETE = {"clustered", "improved-clustered", "routing", "multires", "retrieval"}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_on_cuda_is_finite_and_close(case, dtype):
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16 arithmetic")
    for is_causal in _causal_forms(case):
        out, grads = _run(case, "cuda", dtype, is_causal, 100, 100, backward=True)
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
        if _mechanism(case) not in DISCRETE:
            ref, _ = _run(case, "cpu", torch.float64, is_causal, 100, 100, backward=False)
            tol = 2e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_the_same_call_twice_on_cuda_gives_identical_results():
    for case in ("clustered", "improved-clustered", "routing", "multires", "sparse-fixed"):
        first, _ = _run(case, "cuda", torch.float32, False, 100, 100, backward=False)
        second, _ = _run(case, "cuda", torch.float32, False, 100, 100, backward=False)
        assert torch.equal(first, second), case


ATTENTION = {
    "full": "full",
    "linear": "linear",
    "agglomerative": "agglomerative",
    "local": HeadGroup("local", window=6),
    "routing+local": (HeadGroup("local", 2, window=6), HeadGroup("routing", clusters=3, tile=5)),
    "sparse": [HeadGroup("sparse", stride=4, block=4), HeadGroup("sparse", pattern="fixed", stride=8, summary=2)],
    "multires": HeadGroup("multires", rates=(0.5, 0.25, 0.25, 0.125)),
}


@pytest.mark.parametrize("name", list(ATTENTION))
def test_causal_lm_on_cuda_matches_the_cpu_and_generates_with_the_cache(name):
    torch.manual_seed(0)
    position = "conv" if name == "agglomerative" else "learned"
    model = CausalLM(40, 32, 2, 4, attention=ATTENTION[name], max_len=64, position=position).double().eval()
    tokens = torch.randint(0, 40, (2, 20), generator=torch.Generator().manual_seed(1))
    logits_cpu, tokens_cpu = model(tokens), model.generate(tokens[:, :7], 25)
    model.cuda()
    torch.testing.assert_close(model(tokens.cuda()).cpu(), logits_cpu, rtol=1e-9, atol=1e-10)
    prompt = tokens[:, :7].cuda()
    cached = model.generate(prompt, 25, use_cache=True)
    assert torch.equal(cached, model.generate(prompt, 25, use_cache=False))
    assert torch.equal(cached.cpu(), tokens_cpu)


def test_sampling_on_cuda_with_a_cpu_generator_reproduces_the_cpu_tokens():
    torch.manual_seed(0)
    model = CausalLM(40, 32, 2, 4, attention="linear", max_len=64).double().eval()
    prompt = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(1))
    options = {"temperature": 0.9, "top_k": 10}
    on_cpu = model.generate(prompt, 20, generator=torch.Generator().manual_seed(2), **options)
    on_gpu = model.cuda().generate(prompt.cuda(), 20, generator=torch.Generator().manual_seed(2), **options)
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), on_cpu)
    first, second = (
        model.generate(prompt.cuda(), 20, generator=torch.Generator("cuda").manual_seed(2), **options) for _ in range(2)
    )
    assert torch.equal(first, second)  # a CUDA generator draws on the GPU, reproducibly


# FlexAttention (kernels.flex): local, sparse and pattern run it on CUDA, compiled, forward and
# backward; the engine (TUNING.flex = 0) is the reference. Lengths that are not multiples of flex's
# 128-blocks, padding, sinks, grouped-query heads, head-varying masks, and the regrouped parts of
# the strided and fixed patterns joined by their log-sum-exps (gradients through both).
FLEX = {
    "local-sinks": ("local", {"window": 40, "sinks": 4}),
    "sparse": ("sparse", {"stride": 32}),
    "sparse-column-sinks": ("sparse", {"stride": 16, "step": "column", "sinks": 3}),
    "sparse-fixed": ("sparse", {"pattern": "fixed", "stride": 64, "summary": 4, "groups": 2}),
    "pattern": ("pattern", {"window": 33, "dilation": 2, "global_tokens": 3}),
}


@pytest.mark.parametrize("case", list(FLEX))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_on_cuda_equals_the_engine_forward_and_backward(case, dtype, monkeypatch):
    from subquad.kernels import flex
    from subquad.kernels.tuning import tuned

    name, options = FLEX[case]
    mech = get_mechanism(name)
    config = make_config(mech, **options)
    calls = []
    union = flex.union_attention

    def counted(*args, **kwargs):
        out = union(*args, **kwargs)
        calls.append(out is not None)
        return out

    def run(q, k, v, is_causal, mask):
        inputs = [x.cuda().to(dtype).requires_grad_() for x in (q, k, v)]
        out = call(mech, *inputs, key_padding_mask=mask, is_causal=is_causal, config=config, enable_gqa=True)
        grads = torch.autograd.grad(out, inputs, torch.ones_like(out).cos())
        return [x.float() for x in (out, *grads)]

    tol = 2e-4 if dtype == torch.float32 else 3e-2
    for L, S in ((300, 300), (200, 300)):  # lengths off flex's 128-blocks; queries at the end of the keys
        q, _, _ = qkv(2, 6, L, S, 64, seed=11)
        _, k, v = qkv(2, 2, L, S, 64, seed=12)
        empty = padding(2, S, seed=13)
        empty[1] = False  # a row with no key: zero output and gradients, through the parts' log-sum-exps
        for is_causal in (False, True):
            for mask in (None, padding(2, S, seed=13).cuda(), empty.cuda()):
                with monkeypatch.context() as patched:
                    patched.setattr(flex, "union_attention", counted)
                    got = run(q, k, v, is_causal, mask)
                with tuned(flex=0):
                    want = run(q, k, v, is_causal, mask)
                for g, w in zip(got, want):
                    assert torch.isfinite(g).all()
                    torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    assert calls == [True] * 12


@pytest.mark.parametrize("spec", ["local:window=40,sinks=4", "sparse:stride=16", "sparse:stride=32,pattern=fixed"])
def test_flex_on_cuda_decodes_as_it_computes_in_parallel(spec):
    """A model on FlexAttention (float32) generates the same tokens with its cache as without, and
    its logits equal the engine's: decoding steps of one query, each at another length."""
    from subquad.kernels import flex
    from subquad.kernels.tuning import tuned

    torch.manual_seed(0)
    model = CausalLM(40, 64, 2, 4, attention=spec, max_len=160).cuda().eval()
    tokens = torch.randint(0, 40, (2, 150), generator=torch.Generator().manual_seed(1)).cuda()
    flex._MASKS.clear()
    logits = model(tokens)
    assert flex._MASKS  # the parallel pass ran on flex
    with tuned(flex=0):
        torch.testing.assert_close(logits, model(tokens), rtol=2e-4, atol=2e-4)
    prompt = tokens[:, :100]
    assert torch.equal(model.generate(prompt, 30, use_cache=True), model.generate(prompt, 30, use_cache=False))


@pytest.mark.parametrize("case", ["local", "linear", "sparse", "multires"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e30])
def test_a_checked_call_on_cuda_keeps_padding_out_as_a_sanitised_one_does(case, bad):
    """From TUNING.contain_check elements a call off the CPU checks its inputs (one read back)
    instead of running on sanitised copies: finite padding is then excluded by the masks alone, and
    a non-finite entry sends the call to the copies. Either way the real outputs are the clean ones."""
    from subquad._contain import _all_finite
    from subquad.kernels.tuning import tuned

    mech = get_mechanism(_mechanism(case))
    config = make_config(mech, **CASES[case][1])
    q, k, v = (x.cuda().float() for x in qkv(B, H, 60, 60, D, seed=3))
    mask = padding(B, 60, seed=4).cuda()
    tensors = (
        {} if mech.example_tensors is None else mech.example_tensors(q, k, v, config, torch.Generator().manual_seed(5))
    )
    clean = call(mech, q, k, v, key_padding_mask=mask, is_causal=True, config=config, **tensors)
    k_bad, v_bad = (x.masked_fill(~mask[:, None, :, None], bad) for x in (k, v))
    assert _all_finite([q, k_bad, v_bad], together=True) is (bad == 1e30)
    for check_from in (1, 1 << 40):  # checked, sanitised
        with tuned(contain_check=check_from):
            out = call(mech, q, k_bad, v_bad, key_padding_mask=mask, is_causal=True, config=config, **tensors)
        torch.testing.assert_close(out, clean, rtol=1e-5, atol=1e-5)

"""The optional native kernel (``subquad.kernels.native``) against softmax attention in float64."""

import os

import pytest
import torch

from subquad.kernels import native as _native

from .conftest import needs_native, randn


def softmax_reference(q, k, v, mask, causal, scale):
    """Output and log-sum-exp in float64; a query that sees no key: zeros and −inf."""
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask.double()
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0))
    return torch.matmul(p, v.double()), lse


def random_mask(shape, seed, hide=0.5):
    """An additive mask hiding about ``hide`` of the keys; the second query of the first item sees none."""
    allowed = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > hide
    if shape[-2] > 1:
        allowed[(0,) * (len(shape) - 2) + (1,)] = False
    return torch.zeros(shape).masked_fill(~allowed, float("-inf"))


def assert_close(out, lse, ref_out, ref_lse, tol=3e-6):
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())
    finite = ~ref_lse.isneginf()
    if finite.any():
        assert (lse[finite].double() - ref_lse[finite]).abs().max() <= tol * max(1.0, ref_lse[finite].abs().max())
    if out.numel():
        assert (out.double() - ref_out).abs().max() <= tol * max(1.0, ref_out.abs().max())
    assert (out[~finite.expand_as(out)] == 0).all()


@needs_native
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [None, "per item", "broadcast", "over queries and heads"])
@pytest.mark.parametrize(("Lq", "Lk"), [(1, 1), (5, 7), (20, 45), (32, 32), (37, 50), (100, 100), (32, 159), (9, 0)])
@pytest.mark.parametrize(("D", "Dv"), [(64, 64), (12, 20), (8, 3), (80, 16)])
def test_block_attention_equals_softmax_attention(Lq, Lk, D, Dv, causal, masked):
    """Last query blocks of 5 and 20 queries (16 and 32 lanes), head sizes that are not multiples
    of 8, Dv ≠ D, D = 80 (two depth slices), no keys at all."""
    q, k, v = (randn(*shape, dtype=torch.float32, seed=i) for i, shape in enumerate(
        [(3, 2, Lq, D), (3, 2, Lk, D), (3, 2, Lk, Dv)]))  # fmt: skip
    mask = {
        "per item": lambda: random_mask((3, 2, Lq, Lk), 1),
        "broadcast": lambda: random_mask((1, 1, Lq, Lk), 2),
        "over queries and heads": lambda: random_mask((3, 1, 1, Lk), 7) if Lk else torch.zeros(3, 1, 1, 0),
    }
    mask = mask[masked]() if masked else None
    out, lse = _native.block_attention(q, k, v, mask, causal, 0.3)
    assert out.shape == (3, 2, Lq, Dv) and lse.shape == (3, 2, Lq, 1)
    assert_close(out, lse, *softmax_reference(q, k, v, mask, causal, 0.3))


@needs_native
def test_scores_far_apart_and_hidden_keys_stay_exact():
    """Scores spread over hundreds: the exponential must underflow to zero, not wrap or NaN."""
    q, k, v = (randn(2, 2, 40, 16, dtype=torch.float32, seed=i) for i in range(3))
    q = q * 30
    mask = random_mask((2, 2, 40, 40), 3, hide=0.9)
    out, lse = _native.block_attention(q, k, v, mask, False, 1.0)
    assert torch.isfinite(out).all()
    assert_close(out, lse, *softmax_reference(q, k, v, mask, False, 1.0), tol=2e-5)


@needs_native
def test_strided_views_give_the_same_bits_as_contiguous_inputs():
    """Rows far apart (the strided pattern's columns) are packed first; the batch dimension of
    the smaller stride runs first: neither changes any result."""
    x = [randn(1, 4, 64 * 16, 32, dtype=torch.float32, seed=i)[0] for i in range(3)]  # (H, N, D)
    # column c of head h: positions c, c + 16, c + 32, ...: (16 columns, 4 heads, 64 rows, 32)
    views = [t.as_strided((16, 4, 64, 32), (32, t.stride(0), 16 * 32, 1)) for t in x]
    assert all(not t.is_contiguous() for t in views)
    mask = random_mask((1, 4, 64, 64), 4)
    for causal in (False, True):
        strided = _native.block_attention(*views, mask, causal, 0.2)
        contiguous = _native.block_attention(*(t.contiguous() for t in views), mask, causal, 0.2)
        heads_first = _native.block_attention(*(t.transpose(0, 1).contiguous().transpose(0, 1) for t in views),
                                              mask, causal, 0.2)  # fmt: skip
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(strided, contiguous, heads_first))
        assert_close(*strided, *softmax_reference(*views, mask, causal, 0.2))


@needs_native
def test_one_thread_and_two_give_the_same_bits():
    q, k, v = (randn(5, 3, 70, 16, dtype=torch.float32, seed=i) for i in range(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _native.block_attention(q, k, v, None, True, 0.25)
        torch.set_num_threads(2)
        two = _native.block_attention(q, k, v, None, True, 0.25)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@needs_native
@pytest.mark.parametrize("causal", [False, True])
def test_into_views_and_merging_a_second_key_set(causal):
    """Attention over keys A written into views of a larger output, then merged with attention
    over the disjoint keys B, equals attention over A ∪ B; a query that sees neither stays zero."""
    q, k, v = (randn(2, 3, 45, 8, dtype=torch.float32, seed=i) for i in range(3))
    mask = random_mask((2, 3, 45, 45), 5, hide=0.3)
    in_a = torch.rand(45, generator=torch.Generator().manual_seed(6)) > 0.5
    hide_a = mask.masked_fill(~in_a, float("-inf"))
    hide_b = mask.masked_fill(in_a, float("-inf"))
    big_out = torch.full((2, 3, 50, 8), float("nan"))  # rows 45..49 must stay untouched
    big_lse = torch.full((2, 3, 50, 1), float("nan"))
    into = (big_out[:, :, :45], big_lse[:, :, :45])
    written = _native.block_attention(q, k, v, hide_a, causal, 0.4, into)
    assert written[0].data_ptr() == big_out.data_ptr() and written[1].data_ptr() == big_lse.data_ptr()
    assert_close(*into, *softmax_reference(q, k, v, hide_a, causal, 0.4))
    _native.block_attention(q, k, v, hide_b, causal, 0.4, into, merge=True)
    assert_close(*into, *softmax_reference(q, k, v, mask, causal, 0.4))
    assert big_out[:, :, 45:].isnan().all() and big_lse[:, :, 45:].isnan().all()


@needs_native
def test_into_rows_spaced_wider_than_the_output():
    q, k, v = (randn(2, 2, 30, 8, dtype=torch.float32, seed=i) for i in range(3))
    wide = torch.zeros(2, 2, 30, 13)
    lse = torch.zeros(2, 2, 30, 1)
    _native.block_attention(q, k, v, None, True, 0.5, (wide[..., 2:10], lse))
    assert_close(wide[..., 2:10], lse, *softmax_reference(q, k, v, None, True, 0.5))
    assert (wide[..., :2] == 0).all() and (wide[..., 10:] == 0).all()


@needs_native
def test_a_nan_score_gives_nan_as_torch_does():
    """A NaN (or an overflow to inf) must show, not vanish into a zero weight."""
    q, k, v = (randn(1, 2, 20, 8, dtype=torch.float32, seed=i) for i in range(3))
    q[0, 1, 7, 3] = float("nan")
    k[0, 0, 15, 0] = float("inf")
    out, lse = _native.block_attention(q, k, v, None, True, 0.5)
    torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    assert torch.equal(out.isnan(), torch_out.isnan()) and out.isnan().any()
    assert torch.equal(lse.isnan().squeeze(-1), torch_out.isnan().any(-1))
    fine = ~torch_out.isnan()
    assert (out[fine] - torch_out[fine]).abs().max() <= 1e-5


@needs_native
@pytest.mark.parametrize(
    ("shapes", "mask", "message"),
    [
        (((1, 2, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8)), None, r"the native kernel needs q \(n0, n1, Lq, D\)"),
        (((1, 1, 4, 8), (1, 1, 5, 8), (1, 1, 4, 8)), None, r"the native kernel needs q"),
        (((1, 1, 4, 8), (1, 1, 4, 6), (1, 1, 4, 8)), None, r"the native kernel needs q"),
        (((1, 1, 4, 8),) * 3, torch.ones(1, 1, 4, 4, dtype=torch.bool), r"mask is additive \(float"),
        (((2, 1, 4, 8),) * 3, torch.zeros(3, 1, 4, 4), r"broadcasts to \(2, 1, 4, 4\), got torch.float32 of shape"),
    ],
)
def test_inputs_the_kernel_cannot_take_raise(shapes, mask, message):
    q, k, v = (torch.zeros(shape) for shape in shapes)
    with pytest.raises(ValueError, match=message):
        _native.block_attention(q, k, v, mask, False, 1.0)
    with pytest.raises(ValueError, match="takes 4-D float32 CPU tensors, got q of shape"):
        _native.block_attention(q.double(), k, v, None, False, 1.0)


@needs_native
def test_bad_into_raises():
    q, k, v = (randn(1, 1, 4, 8, dtype=torch.float32, seed=i) for i in range(3))
    with pytest.raises(ValueError, match=r"merge=True merges into the softmax that `into` holds"):
        _native.block_attention(q, k, v, None, False, 1.0, merge=True)
    with pytest.raises(ValueError, match=r"into must be \(out, lse\) of shapes \(1, 1, 4, 8\) and \(1, 1, 4, 1\)"):
        _native.block_attention(q, k, v, None, False, 1.0, (torch.empty(1, 1, 4, 8), torch.empty(1, 1, 4)))
    with pytest.raises(ValueError, match="into must be float32 tensors"):
        _native.block_attention(q, k, v, None, False, 1.0, (torch.empty(1, 1, 4, 8).double(), torch.empty(1, 1, 4, 1)))


def test_a_missing_compiler_makes_it_unavailable_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(_native, "_state", {})
    monkeypatch.setattr(_native, "_unsupported", lambda: None)
    monkeypatch.setenv("CC", "no-such-compiler-for-subquad")
    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path))
    assert not _native.native_available()
    assert "no C compiler 'no-such-compiler-for-subquad'" in _native.native_unavailable_reason()
    with pytest.raises(RuntimeError, match="the native kernel cannot run: it could not be built or loaded"):
        _native.block_attention(*(torch.zeros(1, 1, 2, 8) for _ in range(3)), None, False, 1.0)


def test_a_cpu_without_avx2_and_fma_is_named(monkeypatch):
    monkeypatch.setattr(_native.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(_native.sys, "platform", "linux")
    monkeypatch.setattr(_native, "_cpu_flags", lambda: {"sse2", "avx"})
    assert _native._unsupported() == "it needs AVX2 and FMA, this CPU lacks avx2, fma"
    monkeypatch.setattr(_native, "_cpu_flags", lambda: {"avx2", "fma"})
    assert _native._unsupported() is None
    monkeypatch.setattr(_native.platform, "machine", lambda: "aarch64")
    assert _native._unsupported() == "it needs an x86-64 CPU, this is aarch64"


@needs_native
def test_values_without_features_still_give_the_log_sum_exp():
    q, k = (randn(1, 2, 10, 8, dtype=torch.float32, seed=i) for i in range(2))
    out, lse = _native.block_attention(q, k, torch.zeros(1, 2, 10, 0), None, True, 0.5)
    assert out.shape == (1, 2, 10, 0)
    assert_close(out, lse, *softmax_reference(q, k, torch.zeros(1, 2, 10, 0), None, True, 0.5))


def test_inputs_it_does_not_take_are_named():
    q = torch.zeros(1, 1, 2, 8, dtype=torch.float64)
    assert _native.supports(q, q, q) == "it computes in float32, the inputs are torch.float64"


def test_only_a_library_this_user_built_is_loaded(tmp_path):
    """Loading a library runs its code: a cached file someone else could have written is not loaded."""
    library = tmp_path / "block_attention-0.so"
    assert not _native._own_file(library)  # missing
    library.write_bytes(b"\x7fELF")
    library.chmod(0o700)
    assert _native._own_file(library)
    for mode in (0o720, 0o702, 0o777):  # writable by the group or by anyone
        library.chmod(mode)
        assert not _native._own_file(library)
    (tmp_path / "link.so").symlink_to(library)
    assert not _native._own_file(tmp_path / "link.so")


def test_the_cache_folder_is_made_private_or_refused(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    _native._private_folder(folder)
    assert folder.stat().st_mode & 0o777 == 0o755
    if os.getuid() != 0:
        pytest.skip("giving the folder to another user needs root")
    os.chown(folder, 12345, -1)
    with pytest.raises(RuntimeError, match=r"cache folder .*cache belongs to another user \(uid 12345\); a library "
                       r"loaded from it runs their code: set SUBQUAD_CACHE to a folder of your own"):  # fmt: skip
        _native._private_folder(folder)


@needs_native
def test_a_planted_library_in_the_cache_is_replaced_by_a_fresh_build(monkeypatch, tmp_path):
    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path))
    _native._compile()
    (built,) = tmp_path.glob("block_attention-*.so")
    assert built.stat().st_mode & 0o777 == 0o700
    planted = tmp_path / "planted"
    planted.write_bytes(b"not a library")  # what another user, or a bad download, could leave there
    planted.chmod(0o666)
    os.replace(planted, built)  # a new file (the loaded library keeps its own pages)
    assert _native._compile().subquad_block_attention is not None  # loaded: rebuilt, not the planted file
    assert built.read_bytes()[:4] == b"\x7fELF" and built.stat().st_mode & 0o777 == 0o700

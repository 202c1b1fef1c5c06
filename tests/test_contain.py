"""subquad._contain through the dispatcher: where a non-finite real entry goes."""

from __future__ import annotations

import pytest
import torch

import subquad


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _nan_rows(out):
    return out.isnan().any(-1).any(1)  # (B, L)


@pytest.mark.parametrize("name", ["clustered", "improved-clustered", "routing"])
def test_a_nan_query_of_a_mechanism_that_groups_queries_marks_its_whole_row(name):
    """Its content reaches other queries' outputs (clusters, balanced tiles), so they are NaN too,
    not finite values that depend on a NaN."""
    q, k, v = (_randn(2, 2, 12, 4, seed=s) for s in range(3))
    real = torch.ones(2, 12, dtype=torch.bool)
    q[0, :, 3] = float("nan")
    out = subquad.attention(q, k, v, mechanism=name, key_padding_mask=real, query_padding_mask=real)
    assert _nan_rows(out)[0].all() and not _nan_rows(out)[1].any()


@pytest.mark.parametrize("masked", [False, True])
def test_a_nan_key_in_causal_form_marks_every_later_output_whatever_the_mechanism_sees(masked):
    """Routing's queries see only their cluster's tiles, yet key 0's cluster shapes those tiles:
    with or without an all-True mask, every output from position 0 on is NaN."""
    q, k, v = (_randn(1, 2, 8, 4, seed=s) for s in range(3))
    k[0, :, 0] = float("nan")
    mask = torch.ones(1, 8, dtype=torch.bool) if masked else None
    extra = {"query_padding_mask": mask} if masked else {}
    out = subquad.attention(q, k, v, mechanism="routing", is_causal=True, key_padding_mask=mask, **extra)
    assert _nan_rows(out).all()
    local = subquad.attention(q, k, v, mechanism="local", is_causal=True, window=3, key_padding_mask=mask)
    assert _nan_rows(local).all(), "the documented rule, not how far the arithmetic happens to spread it"


def test_what_a_mechanism_does_not_read_cannot_mark_an_output():
    """agglomerative reads only the shapes of q and k: a NaN there changes nothing."""
    q, k, v = (_randn(1, 2, 6, 4, seed=s) for s in range(3))
    logits = {"query_logits": _randn(1, 2, 6, seed=4), "key_logits": _randn(1, 2, 6, seed=5)}
    real = torch.ones(1, 6, dtype=torch.bool)
    real[0, 4:] = False
    clean = subquad.attention(q, k, v, mechanism="agglomerative", key_padding_mask=real, **logits)
    q[0, :, 2], k[0, :, 2] = float("nan"), float("nan")
    assert torch.equal(subquad.attention(q, k, v, mechanism="agglomerative", key_padding_mask=real, **logits), clean)


def test_off_the_cpu_only_large_inputs_are_checked_before_they_are_sanitised(monkeypatch):
    """Off the CPU a check waits for the device, so it runs from TUNING.contain_check elements of q,
    k and v together (where sanitised copies cost far more: a decoding step's cache counts), and
    never while torch.compile traces; the CPU always checks first."""
    from subquad._contain import checks_first
    from subquad.kernels.tuning import TUNING, tuned
    from subquad.registry import get_mechanism, make_config

    n = TUNING.contain_check

    def meta(size):
        return torch.empty(size, device="meta")

    assert not checks_first(meta(1), meta(n // 2 - 1), meta(n // 2 - 1), n)  # n - 1 elements
    assert checks_first(meta(1), meta(n // 2), meta(n // 2 - 1), n)  # one query against a long cache
    assert checks_first(torch.empty(1), torch.empty(1), torch.empty(1), 1 << 40)  # the CPU, however small
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not checks_first(meta(n), meta(n), meta(n), n)
    monkeypatch.undo()
    seen = []
    real = subquad._contain.checks_first
    monkeypatch.setattr(subquad._contain, "checks_first", lambda q, k, v, n: seen.append(n) or real(q, k, v, n))
    q = _randn(1, 1, 4, 2)
    with tuned(contain_check=7):
        subquad.attention(q, q, q, mechanism="local", window=2, is_causal=True)
        sparse = get_mechanism("sparse")  # its decoder keeps the keys (KVCache), whose steps are contained
        sparse.decoder(sparse, make_config(sparse, stride=2), None).step(q[:, :, :1], q[:, :, :1], q[:, :, :1])
    assert seen == [7, 7]  # the call path and the decoding path pass the table's value


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("together", [False, True])
def test_the_check_finds_a_non_finite_entry_in_any_input(bad, dtype, together):
    """Read back one sum at a time (the CPU) or all together (off the CPU: one wait)."""
    from subquad._contain import _all_finite

    xs = [_randn(2, 3, 5, seed=s).to(dtype) for s in range(3)] + [_randn(4, seed=4).double()]
    if bad is not None:
        xs[2][1, 2, 3] = bad
    assert _all_finite(xs, together=together) is (bad is None)


def test_the_sanitised_path_answers_as_the_checked_one(monkeypatch):
    """Which path the gate picks changes no output: finite inputs give the same values, and a NaN
    key marks the same rows (its position and later, causal), the earlier ones unchanged."""
    import subquad._contain as contain

    q, k, v = (_randn(1, 2, 10, 4, seed=s) for s in range(3))
    bad = k.clone()
    bad[0, :, 6] = float("nan")
    run = lambda k: subquad.attention(q, k, v, mechanism="local", is_causal=True, window=3)
    checked = run(k), run(bad)
    monkeypatch.setattr(contain, "checks_first", lambda q, k, v, check_from: False)
    sanitised = run(k), run(bad)
    torch.testing.assert_close(sanitised[0], checked[0])
    for out in (checked[1], sanitised[1]):
        assert _nan_rows(out)[0, 6:].all() and not _nan_rows(out)[0, :6].any()
        torch.testing.assert_close(out[:, :, :6], checked[0][:, :, :6])

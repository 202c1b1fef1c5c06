import re

import pytest
import torch

from subquad.bench.inputs import InputShape, input_shape, make_qkv, read_inputs, save_inputs
from subquad.files import FileError


def _mean_entropy(q, k):
    weights = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
    return float(-(weights * weights.clamp_min(1e-30).log()).sum(-1).mean())


def test_inputs_are_reproducible_and_seeded():
    a = make_qkv("clustered", (1, 2, 64, 16), seed=3)
    b = make_qkv("clustered", (1, 2, 64, 16), seed=3)
    c = make_qkv("clustered", (1, 2, 64, 16), seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not torch.equal(a[0], c[0])
    q, _, _ = make_qkv("iid", (1, 2, 8, 4), dtype=torch.bfloat16)
    assert q.dtype == torch.bfloat16 and q.shape == (1, 2, 8, 4)


def test_clustered_inputs_concentrate_attention():
    """A query's attention falls on its centre's keys: far lower entropy than on iid inputs."""
    shape = (1, 4, 512, 64)
    clustered, iid = _mean_entropy(*make_qkv("clustered", shape)[:2]), _mean_entropy(*make_qkv("iid", shape)[:2])
    assert clustered < 0.7 * iid
    assert clustered < torch.log(torch.tensor(512 / 16 * 2)).item()  # about one centre's share of the keys


def test_unknown_kind_raises():
    with pytest.raises(ValueError, match="unknown input kind 'uniform'; choose one of iid, clustered"):
        make_qkv("uniform", (1, 1, 4, 4))


@pytest.mark.parametrize("kind", ["iid", "clustered"])
def test_grouped_query_inputs_have_fewer_key_value_heads_each_serving_its_query_heads(kind):
    """``kv_heads``: keys and values of that many heads; with as many as the queries, the same draws
    as without; clustered, a group's query heads lie around its key/value head's centres."""
    shape = (2, 6, 32, 8)
    q, k, v = make_qkv(kind, shape, seed=5, kv_heads=2)
    assert q.shape == shape and k.shape == v.shape == (2, 2, 32, 8)
    plain, same = make_qkv(kind, shape, seed=5), make_qkv(kind, shape, seed=5, kv_heads=6)
    assert all(torch.equal(a, b) for a, b in zip(plain, same))
    if kind == "clustered":  # one centre, no spread: every query and key of a group is its centre
        q, k, _ = make_qkv(kind, shape, seed=5, centres=1, spread=0.0, kv_heads=2)
        assert torch.equal(q, k.repeat_interleave(3, dim=1)) and not torch.equal(k[:, 0], k[:, 1])
    with pytest.raises(ValueError, match="kv_heads must divide the 6 heads, got 4: each serves H / kv_heads"):
        make_qkv(kind, shape, kv_heads=4)


def _sets(tmp_path, q_shape=(2, 1, 4, 24, 8), kv_heads=2, name="in.safetensors"):
    g = torch.Generator().manual_seed(0)
    kv = (*q_shape[:-3], kv_heads, *q_shape[-2:])
    q, k, v = torch.randn(q_shape, generator=g), torch.randn(kv, generator=g), torch.randn(kv, generator=g)
    save_inputs(tmp_path / name, q, k, v)
    return tmp_path / name, (q, k, v)


def test_an_inputs_file_reads_back_as_sets_with_its_shape_from_the_header(tmp_path):
    path, (q, k, v) = _sets(tmp_path)
    assert input_shape(path) == InputShape(sets=2, batch=1, heads=4, kv_heads=2, length=24, head_dim=8, value_dim=8)
    read = read_inputs(path, torch.float64)
    assert all(torch.equal(a, b.double()) and a.dtype == torch.float64 for a, b in zip(read, (q, k, v)))
    single, (q, k, v) = _sets(tmp_path, (1, 4, 24, 8), name="one.safetensors")  # one set: no leading dimension
    assert input_shape(single).sets == 1 and torch.equal(read_inputs(single)[0], q[None])


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"q": (1, 2, 8, 4), "k": (1, 2, 8, 4)}, "holds no tensor v"),
        ({"q": (1, 2, 8, 4), "k": (1, 2, 8, 4), "v": (2, 8, 4)}, "all 4-D, or all 5-D"),
        ({"q": (1, 2, 8, 4), "k": (1, 2, 8, 4), "v": (1, 1, 8, 4)}, "k and v must have the same heads"),
        ({"q": (1, 3, 8, 4), "k": (1, 2, 8, 4), "v": (1, 2, 8, 4)}, "their number of heads must divide q's"),
        ({"q": (1, 2, 8, 4), "k": (1, 2, 9, 4), "v": (1, 2, 9, 4)}, "share q's sets, batch and length"),
        ({"q": (1, 2, 8, 4), "k": (1, 2, 8, 5), "v": (1, 2, 8, 5)}, "k q's head dim"),
        ({"q": (1, 2, 0, 4), "k": (1, 2, 0, 4), "v": (1, 2, 0, 4)}, "a dimension of size 0"),
    ],
)
def test_an_inputs_file_that_does_not_fit_is_refused_naming_it(tmp_path, tensors, message):
    from safetensors.torch import save_file

    path = tmp_path / "bad.safetensors"
    save_file({n: torch.zeros(s) for n, s in tensors.items()}, str(path))
    with pytest.raises(FileError, match=re.escape(message)) as error:
        input_shape(path)
    assert str(path) in str(error.value) and "save floating-point tensors q (B, H, N, D)" in str(error.value)
    with pytest.raises(FileError, match=re.escape(message)):
        read_inputs(path)
    if len(tensors) == 3:  # nothing that does not fit is written either
        with pytest.raises(FileError, match=re.escape(message)):
            save_inputs(tmp_path / "out.safetensors", *(torch.zeros(s) for s in tensors.values()))
        assert not (tmp_path / "out.safetensors").exists()


def test_an_inputs_file_that_is_not_one_or_holds_integers_is_refused(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(FileNotFoundError, match="no inputs file at"):
        input_shape(tmp_path / "missing.safetensors")
    (tmp_path / "text.safetensors").write_text("not a safetensors file")
    with pytest.raises(FileError, match="is not a readable safetensors file"):
        input_shape(tmp_path / "text.safetensors")
    save_file({n: torch.zeros(1, 2, 8, 4, dtype=torch.int32) for n in "qkv"}, str(tmp_path / "int.safetensors"))
    with pytest.raises(FileError, match=re.escape("holds q as I32, not a floating-point type (F64, F32")):
        input_shape(tmp_path / "int.safetensors")  # refused before any cell runs
    with pytest.raises(FileError, match=re.escape("holds q as torch.int32, not a floating-point tensor")):
        read_inputs(tmp_path / "int.safetensors")


def test_values_may_have_their_own_head_dim(tmp_path):
    """Multi-head latent attention's values are narrower than its queries and keys: a cell runs on them."""
    from subquad.bench.worker import measure_cell

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 32, 12, generator=g), torch.randn(1, 4, 32, 12, generator=g), torch.randn(1, 4, 32, 6)
    save_inputs(tmp_path / "mla.safetensors", q, k, v)
    assert input_shape(tmp_path / "mla.safetensors")[-2:] == (12, 6)
    cell = dict(mechanism="local", options={"window": 8}, length=32, batch=1, heads=4, head_dim=12, dtype="float32",
                device="cpu", causal=True, backward=False, repeats=1, max_seconds=0.1, warmup_seconds=0.0,
                error_rows=32, seed=0, inputs=str(tmp_path / "mla.safetensors"))  # fmt: skip
    result = measure_cell(cell)
    assert "error" not in result and 0 < result["error_inputs"] < 1 and result["nonfinite"] is False


def test_bench_settings_take_the_cells_shape_from_an_inputs_file(tmp_path):
    from subquad.bench.runner import BenchSettings

    path, _ = _sets(tmp_path)
    settings = BenchSettings(inputs=path, lengths=(4096,), heads=16)  # a Path: kept as the text the workers read
    assert settings.inputs == str(path)
    assert (settings.lengths, settings.batch, settings.heads, settings.kv_heads, settings.head_dim) == (
        (24,),
        1,
        4,
        2,
        8,
    )
    path, _ = _sets(tmp_path, kv_heads=4, name="mha.safetensors")
    assert BenchSettings(inputs=str(path)).kv_heads is None  # as many key/value heads as query heads

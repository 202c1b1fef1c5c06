import pytest
import torch

from subquad.bench.inputs import make_qkv


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

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

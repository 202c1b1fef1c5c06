import dataclasses

import pytest
import torch

from subquad.kernels.tuning import TUNING, Tuning, block_elements, tuned


def test_every_value_says_why_it_has_its_value():
    for f in dataclasses.fields(Tuning):
        assert len(f.metadata.get("why", "")) > 20, f.name


def test_blocks_are_larger_off_the_cpu_only():
    assert block_elements(1 << 19, torch.device("cpu")) == 1 << 19
    assert block_elements(1 << 19, torch.device("cuda")) == (1 << 19) * TUNING.accelerator_scale > 1 << 19


def test_tuned_overrides_inside_the_block_and_restores_after_it():
    before = TUNING.linear_block
    with tuned(linear_block=7, accelerator_scale=2) as table:
        assert table is TUNING and TUNING.linear_block == 7
        assert block_elements(3, torch.device("cuda")) == 6
    assert TUNING.linear_block == before and TUNING.accelerator_scale == 32


def test_tuned_restores_after_an_error():
    before = TUNING.local_block
    with pytest.raises(RuntimeError), tuned(local_block=1):
        raise RuntimeError
    assert TUNING.local_block == before


@pytest.mark.parametrize(
    "values, match",
    [
        ({"no_such_value": 1}, "unknown tuning value.*no_such_value"),
        ({"linear_block": 0}, "linear_block must be"),
        ({"local_block": 2.5}, "local_block must be an int"),
        ({"local_block": True}, "local_block must be an int"),
    ],
)
def test_bad_overrides_are_refused_and_change_nothing(values, match):
    saved = dataclasses.asdict(TUNING)
    with pytest.raises(ValueError, match=match), tuned(**values):
        pass
    assert dataclasses.asdict(TUNING) == saved


def test_a_smaller_tile_changes_no_output():
    import subquad

    q, k, v = (
        torch.randn(1, 2, 70, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    expected = subquad.attention(q, k, v, mechanism="sparse", stride=8, is_causal=True)
    with tuned(blocksparse_tile=1, blocksparse_fused_tile=1, blocksparse_view_tile=1):
        out = subquad.attention(q, k, v, mechanism="sparse", stride=8, is_causal=True)
    assert (out - expected).abs().max() <= 1e-12


def test_a_call_of_the_block_engine_holds_at_most_blocksparse_rows_query_rows(monkeypatch):
    """Each chunk's output exists beside the result's: ``blocksparse_rows`` bounds it (one block at
    least), and smaller chunks change no output."""
    import subquad
    from subquad.kernels import blocksparse_forward

    q, k, v = (
        torch.randn(1, 2, 256, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    rows = []
    chunks = blocksparse_forward.chunks

    def counted(group, B, H, *args, **kwargs):
        for chunk in chunks(group, B, H, *args, **kwargs):
            rows.append(B * H * (chunk.stop - chunk.start) * group.queries.shape[1])
            yield chunk

    monkeypatch.setattr(blocksparse_forward, "chunks", counted)
    options = {"mechanism": "sparse", "stride": 16, "sinks": 2, "is_causal": True}
    expected = subquad.attention(q, k, v, **options)
    assert max(rows) > 128
    rows.clear()
    with tuned(blocksparse_rows=128):
        out = subquad.attention(q, k, v, **options)
    assert max(rows) <= 128 and sum(rows) >= 2 * 256
    assert (out - expected).abs().max() <= 1e-12

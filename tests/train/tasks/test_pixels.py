import gzip

import pytest
import torch

from subquad.train.tasks.pixels import load_idx, load_split


def _idx(dims, data, kind=0x08):
    header = bytes([0, 0, kind, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims)
    return header + bytes(data)


@pytest.fixture
def folder(tmp_path):
    images = torch.randint(0, 256, (5, 4, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(_idx([5, 4, 3], images.flatten().tolist()))
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx([5], [3, 1, 4, 1, 5])))
    return tmp_path, images


def test_a_split_reads_plain_and_gzipped_idx_files(folder):
    path, images = folder
    x, y = load_split(path, "train")
    assert torch.equal(x, images.flatten(1)) and x.shape == (5, 12)
    assert y.tolist() == [3, 1, 4, 1, 5] and y.dtype == torch.long


@pytest.mark.parametrize(
    "content, match",
    [
        (b"\x01\x00\x08\x01", "is not an IDX file"),
        (_idx([2], [1, 2], kind=0x0D), "holds IDX type 0x0d"),
        (_idx([3], [1, 2]), r"declares dimensions \[3\] \(3 bytes\) but holds 2"),
        (b"\x1f\x8bbroken", "looks like gzip but cannot be decompressed"),
    ],
)
def test_malformed_files_are_named(tmp_path, content, match):
    (tmp_path / "f").write_bytes(content)
    with pytest.raises(ValueError, match=match):
        load_idx(tmp_path / "f")


def test_missing_and_mismatched_data_say_how_to_get_it(folder, tmp_path):
    path, _ = folder
    with pytest.raises(FileNotFoundError, match="has no t10k-images-idx3-ubyte.*dataset-fashion-mnist"):
        load_split(path, "test")
    with pytest.raises(FileNotFoundError, match="no data folder at .*nowhere"):
        load_split(tmp_path / "nowhere", "train")
    with pytest.raises(ValueError, match="split must be one of train, test, got 'val'"):
        load_split(path, "val")
    (path / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx([4], [1, 2, 3, 4])))
    with pytest.raises(ValueError, match=r"images \(5, 4, 3\) and labels \(4,\) do not pair up"):
        load_split(path, "train")

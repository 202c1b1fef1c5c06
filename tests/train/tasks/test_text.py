import gzip
import itertools
import math

import pytest
import torch

from subquad.files import FileError
from subquad.train.tasks.text import ByteCorpus, bits_per_byte


@pytest.fixture
def corpus_file(tmp_path):
    data = bytes(i % 255 + 1 for i in range(10240))  # byte i holds i mod 255, plus 1: text has no NUL bytes
    path = tmp_path / "corpus.txt"
    path.write_bytes(data)
    return path


def test_splits_cover_the_file_once_and_follow_the_fractions(corpus_file):
    c = ByteCorpus(corpus_file, seq_len=15, fractions=(0.8, 0.1, 0.1), block=256, seed=3)
    spans = sorted((r.start, r.stop) for runs in c.runs.values() for r in runs)
    assert spans[0][0] == 0 and spans[-1][1] == 10240
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # disjoint and contiguous
    assert c.bytes_in("val") == c.bytes_in("test") == 4 * 256  # 40 blocks: 4 each
    assert c.bytes_in("train") == 32 * 256
    other = ByteCorpus(corpus_file, seq_len=15, fractions=(0.8, 0.1, 0.1), block=256, seed=4)
    assert other.runs != c.runs  # the seed moves the split


def test_windows_are_contiguous_bytes_of_their_split_and_reproducible(corpus_file):
    c = ByteCorpus(corpus_file, seq_len=15, fractions=(0.8, 0.1, 0.1), block=256, seed=0)
    batch = c.train_batch(step=7, batch=32)
    assert batch.shape == (32, 16) and batch.dtype == torch.long
    assert bool(((batch[:, 1:] - batch[:, :-1]) % 255 == 1).all())  # consecutive bytes
    assert torch.equal(batch, c.train_batch(step=7, batch=32))  # a function of (seed, step)
    assert not torch.equal(batch, c.train_batch(step=8, batch=32))
    train = [(r.start, r.stop) for r in c.runs["train"]]
    data = torch.arange(10240) % 255 + 1
    for row in batch:  # every window lies inside one training run
        starts = [s for s in range(10240 - 15) if torch.equal(data[s : s + 16], row)]
        assert any(a <= s and s + 16 <= b for s in starts for a, b in train)


def test_ranks_take_slices_of_the_same_global_batch(corpus_file):
    c = ByteCorpus(corpus_file, seq_len=15, block=256)
    whole = c.train_batch(5, 8)
    assert torch.equal(torch.cat([c.train_batch(5, 8, rank=r, world=2) for r in range(2)]), whole)
    with pytest.raises(ValueError, match="the global batch 8 must divide between 3 processes"):
        c.train_batch(5, 8, rank=0, world=3)


def test_evaluation_windows_tile_the_split_without_overlap(corpus_file):
    c = ByteCorpus(corpus_file, seq_len=15, fractions=(0.8, 0.1, 0.1), block=256)
    windows = torch.cat(list(c.eval_batches("val", batch=5)))
    per_run = sum((r.stop - r.start - 1) // 15 for r in c.runs["val"])
    assert windows.shape == (per_run, 16)
    assert len(torch.cat(list(c.eval_batches("val", batch=5, max_windows=3)))) == 3


def test_gzip_input_is_read_through_the_cache(corpus_file, tmp_path, monkeypatch):
    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path / "cache"))
    packed = tmp_path / "corpus.dict.dz"
    packed.write_bytes(gzip.compress(corpus_file.read_bytes()))
    plain, zipped = ByteCorpus(corpus_file, 15, block=256), ByteCorpus(packed, 15, block=256)
    assert torch.equal(plain.data, zipped.data)
    assert len(list((tmp_path / "cache" / "data").iterdir())) == 1
    ByteCorpus(packed, 15, block=256)  # the second time reads the cached file
    assert len(list((tmp_path / "cache" / "data").iterdir())) == 1


def test_bits_per_byte():
    assert bits_per_byte(math.log(2)) == pytest.approx(1.0)


def _file(name, content):
    def make(folder):
        (folder / name).write_bytes(content)
        return folder / name

    return make


@pytest.mark.parametrize(
    "make, kwargs, error, match",
    [
        (
            lambda p: p / "missing.txt",
            {},
            FileNotFoundError,
            "no text file at .*missing.txt; any text file.*dict-gcide",
        ),
        (_file("empty.txt", b""), {}, FileError, "empty.txt: is empty"),
        (_file("blank.txt", b" \n\n"), {}, FileError, "blank.txt: is empty"),
        (
            _file("weights.bin", b"abc\0def" * 100),
            {},
            FileError,
            r"weights.bin: is binary \(it holds NUL bytes\), not text",
        ),
        (_file("empty.gz", gzip.compress(b"")), {}, FileError, "empty.gz: is empty"),
        (_file("short.txt", b"abc"), {}, ValueError, r"\(3 bytes\) holds no 17-byte window for the train split"),
        (_file("bad.gz", b"\x1f\x8bnot gzip"), {}, FileError, "bad.gz: looks like gzip but cannot be decompressed"),
        (lambda p: p / "corpus.txt", {"fractions": (0.5, 0.5)}, ValueError, "fractions must be three numbers"),
        (lambda p: p / "corpus.txt", {"block": 8}, ValueError, "need 1 <= seq_len < block, got seq_len=16, block=8"),
    ],
)
def test_bad_input_is_named(tmp_path, corpus_file, monkeypatch, make, kwargs, error, match):
    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path / "cache"))
    with pytest.raises(error, match=match):
        ByteCorpus(make(tmp_path), seq_len=16, **kwargs)

"""Shared test helpers."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor

from subquad.kernels import native as _native


def randn(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> Tensor:
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def qkv(B=2, H=3, L=7, S=None, D=8, Dv=None, dtype=torch.float64, seed=0) -> tuple[Tensor, Tensor, Tensor]:
    S = L if S is None else S
    Dv = D if Dv is None else Dv
    return (
        randn(B, H, L, D, dtype=dtype, seed=seed),
        randn(B, H, S, D, dtype=dtype, seed=seed + 1),
        randn(B, H, S, Dv, dtype=dtype, seed=seed + 2),
    )


def padding(B: int, S: int, seed: int = 0, p: float = 0.3) -> Tensor:
    """A random key padding mask (True = real) where every row keeps at least one real key."""
    mask = torch.rand(B, S, generator=torch.Generator().manual_seed(seed)) > p
    mask[:, 0] = True
    return mask


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _no_tuning_profile():
    """The suite runs on the defaults, whatever profile ``subquad tune`` wrote on this machine
    (tests/test_tune.py sets its own folder and profiles)."""
    import os

    from subquad.kernels import profile

    saved = os.environ.get(profile.ENV)
    os.environ[profile.ENV] = "off"
    yield
    if saved is None:
        os.environ.pop(profile.ENV, None)
    else:
        os.environ[profile.ENV] = saved


needs_native = pytest.mark.skipif(
    not _native.native_available(), reason=f"the native kernel cannot run here: {_native.native_unavailable_reason()}"
)


@pytest.fixture
def native_calls(monkeypatch):
    """The native kernel's calls (True for one that wrote into the output in place), and an error
    on a fallback warning: the kernel really ran."""
    calls = []
    run = _native.block_attention

    def counted(*args, **kwargs):
        calls.append((len(args) > 6 and args[6] is not None) or kwargs.get("into") is not None)
        return run(*args, **kwargs)

    monkeypatch.setattr(_native, "block_attention", counted)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield calls


WORDS = "the a of and to in is was for on as with by at from it an be this that which or are his her".split()
TOPICS = {"cats": "cat purr whisker mouse fur paw".split(), "ships": "ship sail harbour mast keel deck".split()}
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *(w for ws in TOPICS.values() for w in ws)]


def word_passages(folder, count: int):
    """A word-level tokenizer over ``VOCAB`` (``vocab.txt`` in ``folder``) and ``passages.jsonl``:
    ``count`` seeded passages of 40 words, alternately about cats and ships (labelled so). Returns
    the tokenizer, for tiny models saved beside it."""
    import json

    from transformers import BertTokenizerFast

    (folder / "vocab.txt").write_text("\n".join(VOCAB))
    tokenizer = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))
    g = torch.Generator().manual_seed(0)
    lines = []
    for i in range(count):
        label = list(TOPICS)[i % 2]
        pool = WORDS + TOPICS[label] * 3
        words = [pool[j] for j in torch.randint(0, len(pool), (40,), generator=g).tolist()]
        lines.append(json.dumps({"text": " ".join(words), "label": label}))
    (folder / "passages.jsonl").write_text("\n".join(lines) + "\n")
    return tokenizer

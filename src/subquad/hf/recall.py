"""Recall of what a decoder read long before: the passkey probe of ``subquad approx``.

Perplexity hides recall: a window with sinks is within a few percent of a model's perplexity and
cannot find a fact told 2,000 tokens earlier. The passkey probe (Mohtashami & Jaggi 2023, the
prompt LongLoRA and LoLA report) asks for it directly:

- the instruction ``INSTRUCTION``, then whole repetitions of ``FILLER`` (each after a space), with
  ``NEEDLE`` (a five-digit key, twice) after the first ``round(depth · n)`` of the n repetitions,
  then ``QUESTION``; as many repetitions as keep the prompt within ``length`` tokens (the
  tokenizer's own leading tokens, such as a BOS, first). The pieces are tokenized apart and joined,
  so every prompt of a length has the same tokens but for the key's;
- the key of each case is drawn from a generator seeded by ``(seed, length, depth, sample)``:
  the same cases in every run and for every model, whatever else the run measures;
- the model continues greedily for ``NEW_TOKENS`` tokens, with the cache ``model.generate``
  would build (subquad's after ``use``/``convert``, transformers' for the original);
- **scoring** (``score``): the case is found when the first number in the continuation is the key,
  exactly. A continuation that names another number first, or none, misses.

The **needle** probe (RULER's ``niah_single_2``, Hsieh et al. 2024) is different in kind: the
haystack is real prose (whole passages of the run's own text, in an order seeded by the case),
the needle a sentence that gives a seven-digit number for a seeded word (``MAGIC``), placed at the
passage boundary nearest its depth, and the question asks for that word's number
(``MAGIC_QUESTION``); scored as the passkey. The model must find one sentence among sentences
that all look like text, where the passkey's needle is the one sentence unlike the filler.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["FILLER", "INSTRUCTION", "MAGIC", "NEEDLE", "QUESTION", "PasskeyCase", "needle_case", "passkey",
           "passkey_case", "score", "seeded_needle"]  # fmt: skip

INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
NEW_TOKENS = 8  # a five-digit key and what a tokenizer may put around it
MAGIC_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)
MAGIC = "One of the special magic numbers for {word} is: {key}."
MAGIC_QUESTION = (
    "What is the special magic number for {word} mentioned in the provided text? The special magic number for "
    "{word} mentioned in the provided text is"
)
NEEDLE_TOKENS = 12  # a seven-digit key and what may come before it
WORDS = ("apple", "river", "lantern", "violet", "harbor", "meadow", "copper", "falcon", "glacier", "orchid")


@dataclass(frozen=True)
class PasskeyCase:
    """One prompt: its token ids ``(1, n)``, the key, where the needle's tokens start and how many
    they are."""

    ids: torch.Tensor
    key: str
    needle_at: int
    needle_tokens: int = 0


def passkey_case(tokenizer: Any, length: int, depth: float, key: str) -> PasskeyCase:
    """The prompt of at most ``length`` tokens with ``key``'s needle at ``depth`` (0: right after
    the instruction, 1: right before the question)."""
    from subquad.hf.data import _special_tokens

    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"a passkey depth is a fraction of the filler, from 0 to 1; got {depth}")
    tokens = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    head = _special_tokens(tokenizer)[0] + tokens(INSTRUCTION)
    unit, needle, question = tokens(" " + FILLER), tokens(" " + NEEDLE.format(key=key)), tokens(" " + QUESTION)
    room = length - len(head) - len(needle) - len(question)
    if room < 2 * len(unit):
        fixed = length - room
        raise ValueError(
            f"a {length}-token passkey prompt leaves room for {max(room, 0) // len(unit)} filler repetitions of "
            f"{len(unit)} tokens after its {fixed} fixed tokens; pass a length of at least {fixed + 2 * len(unit)}"
        )
    count = room // len(unit)
    before = round(depth * count)
    ids = head + unit * before + needle + unit * (count - before) + question
    return PasskeyCase(torch.tensor([ids]), key, len(head) + len(unit) * before, len(needle))


def needle_case(tokenizer: Any, haystack: list[str], length: int, depth: float, word: str, key: str) -> PasskeyCase:
    """The needle prompt of at most ``length`` tokens: ``haystack``'s passages in order, as many
    whole ones as fit, with ``word``'s number ``key`` told at the boundary nearest ``depth``."""
    from subquad.hf.data import _special_tokens

    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"a needle depth is a fraction of the text, from 0 to 1; got {depth}")
    tokens = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    head = _special_tokens(tokenizer)[0] + tokens(MAGIC_INSTRUCTION)
    needle = tokens(" " + MAGIC.format(word=word, key=key))
    question = tokens(" " + MAGIC_QUESTION.format(word=word))
    room, pieces = length - len(head) - len(needle) - len(question), []
    for text in haystack:
        piece = tokens(" " + text)
        if len(piece) > room:
            break
        pieces.append(piece)
        room -= len(piece)
    if len(pieces) < 2:
        raise ValueError(
            f"a {length}-token needle prompt holds {len(pieces)} whole passage(s) of the text; pass a longer length "
            "or text with shorter passages"
        )
    before = round(depth * len(pieces))
    start = len(head) + sum(map(len, pieces[:before]))
    ids = head + [t for p in pieces[:before] for t in p] + needle + [t for p in pieces[before:] for t in p] + question
    return PasskeyCase(torch.tensor([ids]), key, start, len(needle))


def seeded_needle(
    tokenizer: Any, haystack: list[str], seed: int, length: int, depth: float, sample: int
) -> PasskeyCase:
    """One needle case: its word, key and passage order drawn from a generator seeded by the case."""
    rng = random.Random(f"needle:{seed}:{length}:{depth:g}:{sample}")
    order = rng.sample(range(len(haystack)), len(haystack))
    word, key = rng.choice(WORDS), str(rng.randrange(1_000_000, 10_000_000))
    return needle_case(tokenizer, [haystack[i] for i in order], length, depth, word, key)


def case_key(seed: int, length: int, depth: float, sample: int) -> str:
    """The five-digit key of one case, from a generator seeded by the case alone."""
    return str(random.Random(f"passkey:{seed}:{length}:{depth:g}:{sample}").randrange(10_000, 100_000))


_NUMBER = re.compile(r"\d+")


def score(continuation: str, key: str) -> tuple[bool, str | None]:
    """Whether the first number in ``continuation`` is ``key``, and that number (None: none)."""
    first = _NUMBER.search(continuation)
    answer = None if first is None else first.group()
    return answer == key, answer


@torch.no_grad()
def passkey(
    model: nn.Module, tokenizer: Any, lengths: list[int], depths: list[float], samples: int, seed: int = 0,
    progress: Any = None, haystack: list[str] | None = None,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """The probe at each length: ``{str(length): {"found", "cases", "by_depth": {depth: found},
    "answers": [...]}}``, ``samples`` cases at each depth. ``progress(done, total)`` is called
    after each case. With ``haystack`` (passages of text), the needle probe instead."""
    device = next(model.parameters()).device
    out, total, done = {}, len(lengths) * len(depths) * samples, 0
    for length in lengths:
        answers, by_depth = [], {}
        for depth in depths:
            found = 0
            for sample in range(samples):
                if haystack is None:
                    case = passkey_case(tokenizer, length, depth, case_key(seed, length, depth, sample))
                else:
                    case = seeded_needle(tokenizer, haystack, seed, length, depth, sample)
                count = NEW_TOKENS if haystack is None else NEEDLE_TOKENS
                text = tokenizer.decode(_greedy(model, case.ids.to(device), count), skip_special_tokens=True)
                hit, answer = score(text, case.key)
                found += hit
                answers.append({"depth": depth, "key": case.key, "answer": answer, "found": hit})
                done += 1
                if progress is not None:
                    progress(done, total)
            by_depth[f"{depth:g}"] = found
        out[str(length)] = {"found": sum(by_depth.values()), "cases": len(answers), "by_depth": by_depth,
                            "answers": answers}  # fmt: skip
    return out


def _greedy(model: nn.Module, ids: torch.Tensor, count: int = NEW_TOKENS) -> list[int]:
    """``count`` greedy tokens after ``ids`` ``(1, n)``, with the cache generate would build."""
    from subquad.hf.speed import _new_cache

    cache, new = _new_cache(model), []
    logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    while True:
        token = logits[:, -1].argmax(-1, keepdim=True)
        new.append(int(token))
        if len(new) == count:
            return new
        logits = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1).logits

"""The data the Hugging Face jobs read: passages, token windows of them, and a model folder.

Passages: a ``.jsonl`` file of ``{"text": ..., "label": ...}`` lines (label optional), a text file
of passages separated by blank lines, or a folder of ``.txt`` files (labelled by their subfolder).
Every file is read as data (``subquad.files``); a model is loaded through ``subquad.hf.io`` checks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from subquad.files import FileError, read_jsonl, read_text

__all__ = ["Windows", "check_window", "is_decoder", "load_model", "read_passages", "token_windows"]


_DATA_FIX = (
    'pass a .jsonl file of {"text": ..., "label": ...} lines, a text file of passages separated by blank '
    "lines, or a folder of .txt files"
)


def read_passages(path: str | Path) -> tuple[list[str], list[str] | None]:
    """The passages of ``path`` and their labels (None where the data has none); FileError naming
    the file (and the line of a ``.jsonl``) for data that is empty, binary or malformed."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise FileError(path, "holds no .txt files", _DATA_FIX)
        texts = [read_text(f, "text file", _DATA_FIX, errors="replace") for f in files]
        nested = all(f.parent != path for f in files)
        return texts, [str(f.parent.relative_to(path)) for f in files] if nested else None
    if not path.is_file():
        raise FileNotFoundError(f"no text data at {path}: pass a .jsonl file, a text file or a folder of .txt files")
    if path.suffix == ".jsonl":
        records = read_jsonl(path, "JSON-lines file of passages", _DATA_FIX)
        if not records:
            raise FileError(path, "holds no passage", _DATA_FIX)
        for number, record in records:
            if not isinstance(record.get("text"), str):
                raise FileError(path, f"line {number} has no text (a string)", _DATA_FIX)
        texts, labels = [r["text"] for _, r in records], [r.get("label") for _, r in records]
        has = [label is not None for label in labels]
        if any(has) and not all(has):
            raise FileError(path, "some lines have a label and some do not", "label all or none")
        return texts, [str(label) for label in labels] if all(has) else None
    text = read_text(path, "text file", _DATA_FIX, errors="replace")
    return [p.strip() for p in text.split("\n\n") if p.strip()], None


@dataclass
class Windows:
    """Token windows ``(n, tokens)`` and their labels."""

    ids: Tensor
    labels: list[str] | None


def token_windows(tokenizer: Any, texts: list[str], labels: list[str] | None, tokens: int, limit: int,
                  seed: int = 0) -> Windows:  # fmt: skip
    """Windows of exactly ``tokens`` tokens (special tokens included), packed from consecutive
    passages of one label, shuffled with ``seed``; at most ``limit``."""
    prefix, suffix = _special_tokens(tokenizer)
    room = tokens - len(prefix) - len(suffix)
    if room < 1:
        raise ValueError(f"tokens={tokens} leaves no room beside the tokenizer's {tokens - room} special tokens")
    groups: dict[str | None, list[int]] = {}
    windows: list[tuple[list[int], str | None]] = []
    for text, label in zip(texts, labels or [None] * len(texts)):
        run = groups.setdefault(label, [])
        run.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id is not None and tokenizer.cls_token_id is None:
            run.append(tokenizer.eos_token_id)
        while len(run) >= room:
            windows.append((prefix + run[:room] + suffix, label))
            del run[:room]
    if not windows:
        raise ValueError(f"the text holds no window of {tokens} tokens; pass more text or fewer --window-tokens")
    random.Random(seed).shuffle(windows)
    windows = windows[:limit]
    ids = torch.tensor([w for w, _ in windows])
    return Windows(ids, [label for _, label in windows] if labels is not None else None)


def _special_tokens(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The tokens the tokenizer puts before and after a text (e.g. BERT's [CLS] and [SEP])."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    wrapped = tokenizer("a", add_special_tokens=True)["input_ids"]
    for start in range(len(wrapped) - len(plain) + 1):
        if wrapped[start : start + len(plain)] == plain:
            return wrapped[:start], wrapped[start + len(plain) :]
    return [], []


def load_model(path: str | Path) -> tuple[nn.Module, Any, bool]:
    """A local model folder (or a ``.gguf`` file) as (model in eval mode, tokenizer, is_decoder).
    Only data is read (``subquad.hf.model_source``); a broken or unsafe model raises FileError naming it."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    from subquad import hf

    where = hf.model_source(path)
    with hf.loading(path):
        config = AutoConfig.from_pretrained(**where)
        decoder = is_decoder(config)
        model = (AutoModelForCausalLM if decoder else AutoModel).from_pretrained(**where, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(**{k: v for k, v in where.items() if k != "use_safetensors"})
    return model.eval(), tokenizer, decoder


def check_window(model: nn.Module, tokens: int, flag: str = "--window-tokens") -> None:
    """Refuse windows longer than ``max_position_embeddings`` where a model has a table of positions
    (an embedding named as BERT's, GPT-2's or OPT's), which would fail deep in it; rotary positions
    (Llama's) have no table and run on past their trained length."""
    most = getattr(model.config, "max_position_embeddings", None)
    named = ("position_embeddings", "wpe", "embed_positions")  # BERT's, GPT-2's, OPT's tables
    table = any(isinstance(m, nn.Embedding) and n.endswith(named) for n, m in model.named_modules())
    if isinstance(most, int) and table and tokens > most:
        raise ValueError(f"{flag} {tokens} is longer than the {most} positions this model reads "
                         f"(max_position_embeddings); pass at most {most}")  # fmt: skip


def is_decoder(config: Any) -> bool:
    """Whether a model's config names a causal language model: ``is_decoder``, an architecture named
    as one, or, where the config names none (a GGUF file's), a model type that has a causal-LM head
    and no masked-LM head (Llama, GPT-2, Mistral; not BERT or RoBERTa, which have both)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    if getattr(config, "is_decoder", False):
        return True
    if config.architectures:
        return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in config.architectures)
    kind = config.model_type
    return kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind not in MODEL_FOR_MASKED_LM_MAPPING_NAMES

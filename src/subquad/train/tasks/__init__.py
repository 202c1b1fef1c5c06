"""The tasks ``subquad train`` runs, one small interface each: the data, the model, the loss and the
evaluation metric.

- ``text``: a causal byte-level LM (``CausalLM``) on any file; metric: validation bits per byte.
- ``listops``: ListOps classification (``Encoder``, mean pooling over real tokens, padding masked);
  metric: validation accuracy.
- ``pixels``: sequential image classification, one pixel a token; metric: validation accuracy
  (the last tenth of the training images is held out as validation).

A task's training batch is a function of (seed, step), drawn whole on every process, each rank
taking its slice: resuming needs only the step, and 1 and N processes see the same global batch.
Batches are drawn on the CPU and moved to the task's ``device`` (``subquad train --device``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from subquad.nn import CausalLM, Encoder
from subquad.train.tasks import listops, pixels
from subquad.train.tasks.text import ByteCorpus, bits_per_byte

__all__ = ["TASKS", "make_task"]


def _spec(config) -> list:
    return config.attention_specs()


def _draw(seed: int, step: int, count: int, batch: int, rank: int, world: int) -> Tensor:
    """This rank's slice of ``batch`` indices in ``[0, count)`` for ``step``: a function of (seed, step)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**63)
    index = torch.randint(0, count, (batch,), generator=g)
    return index[rank * (batch // world) : (rank + 1) * (batch // world)]


class TextTask:
    """Byte-level language modelling; the training metric is bits per byte too."""

    metric, lower_is_better = "val_bpb", True
    device = torch.device("cpu")

    def __init__(self, config) -> None:
        self.config = config
        self.corpus = ByteCorpus(config.data, config.seq_len, seed=config.seed)

    def model(self) -> nn.Module:
        c = self.config
        return CausalLM(256, c.dim, c.depth, c.heads, attention=_spec(c), max_len=c.seq_len, dropout=c.dropout,
                        seed=c.seed, position=c.input_position(), checkpoint=c.grad_checkpoint)  # fmt: skip

    def batch(self, step: int, rank: int, world: int) -> Any:
        return self.corpus.train_batch(step, self.config.batch, rank, world).to(self.device)

    def split(self, batch: Any, parts: int) -> list:
        return list(batch.chunk(parts))

    def loss(self, model: nn.Module, batch: Tensor) -> Tensor:
        return model.loss(batch)

    def train_metric(self, loss: float) -> dict[str, float]:
        return {"loss_bpb": bits_per_byte(loss)}

    def evaluate(self, model: nn.Module, split: str = "val", limit: int | None = -1) -> float:
        """Bits per byte on ``split``: its first ``limit`` windows (-1: ``eval_windows``; None: all)."""
        if split not in self.corpus.runs:
            raise ValueError(f"this task's splits are {', '.join(self.corpus.runs)}, got {split!r}")
        limit = self.config.eval_windows if limit == -1 else limit
        total = count = 0.0
        for tokens in self.corpus.eval_batches(split, self.config.batch, limit):
            total += model.loss(tokens.to(self.device)).item() * tokens.shape[0]
            count += tokens.shape[0]
        return bits_per_byte(total / count)


class _Classification:
    """Sequences and labels per split; padded batches with their masks; accuracy."""

    metric, lower_is_better = "val_accuracy", False
    vocab, classes = 0, 0
    device = torch.device("cpu")
    splits: dict[str, tuple[list[Tensor], Tensor]]

    def __init__(self, config) -> None:
        self.config = config

    def model(self) -> nn.Module:
        c = self.config
        return Encoder(self.vocab, c.dim, c.depth, c.heads, self.classes, attention=_spec(c), max_len=c.seq_len,
                       dropout=c.dropout, seed=c.seed, position=c.input_position(),
                       checkpoint=c.grad_checkpoint)  # fmt: skip

    def _padded(self, split: str, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        sequences, labels = self.splits[split]
        ids, real = listops.pad_batch([sequences[i] for i in index.tolist()])
        return ids.to(self.device), real.to(self.device), labels[index].to(self.device)

    def batch(self, step: int, rank: int, world: int) -> Any:
        count = len(self.splits["train"][1])
        return self._padded("train", _draw(self.config.seed, step, count, self.config.batch, rank, world))

    def split(self, batch: Any, parts: int) -> list:
        return list(zip(*(x.chunk(parts) for x in batch)))

    def loss(self, model: nn.Module, batch: Any) -> Tensor:
        ids, real, labels = batch
        return nn.functional.cross_entropy(model(ids, key_padding_mask=real), labels)

    def train_metric(self, loss: float) -> dict[str, float]:
        return {"loss": loss}

    def evaluate(self, model: nn.Module, split: str = "val", limit: int | None = -1) -> float:
        """Accuracy on ``split``: its first ``limit`` batches (-1: ``eval_windows``; None: all)."""
        if split not in self.splits:
            raise ValueError(f"this task's splits are {', '.join(self.splits)}, got {split!r}")
        count = len(self.splits[split][1])
        limit = self.config.eval_windows if limit == -1 else limit
        limit = count if limit is None else min(count, limit * self.config.batch)
        correct = 0
        for start in range(0, limit, self.config.batch):
            ids, real, labels = self._padded(split, torch.arange(start, min(start + self.config.batch, limit)))
            correct += int((model(ids, key_padding_mask=real).argmax(-1) == labels).sum())
        return correct / limit if limit else math.nan


class ListOpsTask(_Classification):
    """ListOps at lengths from a quarter of ``seq_len`` to ``seq_len`` (LRA: 500 to 2000)."""

    vocab, classes = len(listops.VOCAB), 10

    def __init__(self, config) -> None:
        super().__init__(config)
        self.splits = listops.load_splits(
            config.listops_preset, config.seed, max(1, config.seq_len // 4), config.seq_len
        )


class PixelsTask(_Classification):
    """Images of the IDX folder ``data`` as pixel sequences; the last tenth of train validates."""

    vocab, classes = 256, 10

    def __init__(self, config) -> None:
        super().__init__(config)
        images, labels = pixels.load_split(config.data, "train")
        if images.shape[1] > config.seq_len:
            raise ValueError(f"the images have {images.shape[1]} pixels; pass --seq-len {images.shape[1]} or more")
        held = max(1, len(labels) // 10)
        rows = [row.long() + 1 for row in images]  # 0 is padding: grey level g is token g + 1
        self.vocab = 257
        self.splits = {"train": (rows[:-held], labels[:-held]), "val": (rows[-held:], labels[-held:])}
        try:  # the t10k files, where the folder has them
            test_images, test_labels = pixels.load_split(config.data, "test")
            self.splits["test"] = ([row.long() + 1 for row in test_images], test_labels)
        except FileNotFoundError:
            pass
        self.classes = max(10, int(labels.max()) + 1)


TASKS = {"text": TextTask, "listops": ListOpsTask, "pixels": PixelsTask}


def make_task(config):
    """The task object of ``config.task``."""
    return TASKS[config.task](config)

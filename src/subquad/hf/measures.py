"""Quality measures of ``subquad approx``: how alike two sets of embeddings rank and separate."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["probe_accuracy", "spearman"]


def _ranks(x: Tensor) -> Tensor:
    return torch.empty_like(x).scatter_(0, x.argsort(), torch.arange(len(x), dtype=x.dtype))


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman's rank correlation of two 1-D tensors."""
    ra, rb = _ranks(a.double()), _ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def probe_accuracy(embeddings: Tensor, labels: list[str], seed: int = 0) -> float:
    """Test accuracy of a multinomial logistic regression (L2, LBFGS) trained on a seeded half."""
    names = sorted(set(labels))
    y = torch.tensor([names.index(label) for label in labels])
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    train, test = order[: len(y) // 2], order[len(y) // 2 :]
    x = embeddings.double()
    mean, std = x[train].mean(0), x[train].std(0).clamp_min(1e-6)
    x = (x - mean) / std
    weight = torch.zeros(x.shape[1], len(names), dtype=x.dtype, requires_grad=True)
    bias = torch.zeros(len(names), dtype=x.dtype, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(x[train] @ weight + bias, y[train]) + 1e-3 * weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return float(((x[test] @ weight + bias).argmax(-1) == y[test]).double().mean())

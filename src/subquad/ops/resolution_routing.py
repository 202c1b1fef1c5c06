"""AdaMRA's resolution heads (Zhang, Ma, Seidl & Tresp 2021, §3.2–3.4): which resolution each query
uses, and each resolution's head group over the queries routed to it.

- ``route``: each query's resolution, the argmax of the router's softmax (eq. 6) or a seeded
  uniform draw (the ablation), and the weight of its output.
- ``per_resolution``: the causal kernel form and the softmax ablation, resolution by resolution:
  the queries routed to a head are gathered (padded to the most any batch row has), attend to its
  landmarks (``ops.landmarks``), and are scattered back, weighted by the router.

The maths and the choices are in ``mechanisms.multires``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from subquad._validate import resolve_scale
from subquad.ops import softmax
from subquad.ops.hashing import seeded_uniform
from subquad.ops.landmarks import causal_landmark_kernel, gather_positions, landmark_softmax, scatter_positions
from subquad.ops.segments import segment_length
from subquad.registry import Config

__all__ = ["per_resolution", "route"]


def route(
    router_logits: Tensor | None,
    config: Config,
    batch: int,
    queries: int,
    first: int,
    seed: int,
    work: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """Each query's resolution ``(B, L)`` (long) and the weight of its output ``(B, L)``.

    Learned: the argmax of P = softmax(logits) over the R resolutions, weighted by its probability
    (eq. 6). Random: a uniform draw from a hash of (seed, query position), weighted 1; query i sits
    at position ``first + i``. ``config``: a ``MultiresConfig``.
    """
    if config.routing == "learned":
        probs = softmax(router_logits.to(work), dim=1)  # (B, R, L)
        choice = probs.argmax(dim=1)  # (B, L)
        return choice, probs.gather(1, choice.unsqueeze(1)).squeeze(1)
    positions = torch.arange(first, first + queries)
    choice = (seeded_uniform(seed, positions) * len(config.rates)).long().clamp(max=len(config.rates) - 1)
    return choice.expand(batch, queries), torch.ones(batch, queries, dtype=work, device=positions.device)


def _routed_queries(routed: Tensor) -> tuple[Tensor, Tensor]:
    """The queries routed to a head, ``routed`` ``(B, L)``, as indices ``(B, w)`` in increasing order,
    w the most any batch row has; shorter rows are filled with other queries, ``real`` False."""
    count = routed.sum(1)  # (B,)
    width = int(count.max())
    order = torch.argsort((~routed).to(torch.uint8), dim=1, stable=True)[:, :width]  # routed first, in order
    return order, torch.arange(width, device=routed.device) < count.unsqueeze(1)


def per_resolution(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, is_causal: bool, scale: float | None,
    config: Config, routed: list[Tensor], weight: Tensor, track: bool,
) -> Tensor:  # fmt: skip
    """Each resolution's head group computes the queries routed to it (``routed[h]`` ``(B, L)``),
    weighted by the router; the causal kernel form and the softmax ablation of ``config`` (a
    ``MultiresConfig``). Without autograd every group writes into one output; with it, the groups
    are concatenated."""
    B, H, L, D = q.shape
    S, Dv = k.shape[2], v.shape[3]
    subheads = H // len(config.rates)
    out = None if track else q.new_zeros(B, H, L, Dv)
    outputs = []
    for h, rate in enumerate(config.rates):
        heads = slice(h * subheads, (h + 1) * subheads)
        if config.similarity == "softmax":
            # The ablation runs every query, so a row's matmul shapes, and with them its rounding,
            # do not depend on how many other queries (later ones, other rows) pick this head.
            order, real = torch.arange(L, device=q.device).expand(B, L), routed[h].expand(B, L)
        else:
            order, real = _routed_queries(routed[h])  # each head computes its own queries only
        if order.shape[1] == 0:  # no query chose this resolution
            outputs.append(q.new_zeros(B, subheads, L, Dv))
            continue
        qh, kh, vh = gather_positions(q[:, heads], order), k[:, heads], v[:, heads]  # qh: (B, S', w, D)
        position = order + (S - L if is_causal else 0)  # key positions (causal)
        length = segment_length(rate, S)
        if config.similarity == "softmax":
            scale_h = resolve_scale(scale, D)
            rows = landmark_softmax(qh, position, real, kh, vh, key_padding_mask, length, is_causal, scale_h)
        else:
            rows = causal_landmark_kernel(
                qh, position, real, kh, vh, key_padding_mask, length, config.feature_map, config.eps
            )
        rows = rows * (weight.gather(1, order) * real)[:, None, :, None]  # the router's weight; 0 on fill rows
        if out is None:
            outputs.append(scatter_positions(rows, order, L))  # (B, S', L, Dv)
        else:
            out[:, heads].scatter_(2, order[:, None, :, None].expand_as(rows), rows)
    return torch.cat(outputs, dim=1) if out is None else out  # (B, H, L, Dv)

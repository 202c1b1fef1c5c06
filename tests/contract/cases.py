"""The contract suite's cases and inputs, derived from the registry alone.

A case is a registered mechanism with one of the example option sets of its record
(``Mechanism.examples``). Inputs are q, k, v and the extra tensors its ``example_tensors`` makes;
``Mechanism.positions`` says which extra tensors run over query or key positions, so the helpers
here can cut, edit and pad every position-aligned input without knowing any mechanism.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from torch import Tensor

import subquad
from subquad.call import call as call_mechanism
from subquad.call import causal_lower_right
from subquad.registry import KEY, QUERY, Config, Mechanism, get_mechanism

settings.register_profile(
    "contract",
    max_examples=int(os.environ.get("SUBQUAD_CONTRACT_EXAMPLES", "15")),
    deadline=None,
    derandomize=True,  # CI sees the same examples every run; raise the count to explore more
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CONTRACT = settings.get_profile("contract")


class Case:
    """One mechanism with one of its example option sets (a plain class: failures print its name)."""

    def __init__(self, mech: Mechanism, options: tuple[tuple[str, object], ...]) -> None:
        self.mech, self.options = mech, options

    @property
    def config(self) -> Config:
        return subquad.make_config(self.mech, **dict(self.options))

    @property
    def takes_query_mask(self) -> bool:
        return "query_padding_mask" in self.mech.tensor_args

    def __repr__(self) -> str:
        return str(self)

    def __str__(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.mech.name}[{opts}]" if opts else self.mech.name


def all_cases(*, causal: bool | None = None, decoder: bool | None = None) -> list:
    """Every (mechanism, example) pair of the registry, as pytest params; filtered by capability."""
    params = []
    for name in subquad.mechanism_names():
        mech = get_mechanism(name)
        if causal is not None and mech.causal != causal:
            continue
        if decoder is not None and (mech.decoder is not None) != decoder:
            continue
        for example in mech.examples:
            case = Case(mech, tuple(sorted(example.items())))
            params.append(pytest.param(case, id=str(case)))
    return params


@dataclass(frozen=True)
class Inputs:
    """One call's tensors: q ``(B, H, L, D)``, k and v ``(B, H, S, ·)``, and the extra tensors."""

    q: Tensor
    k: Tensor
    v: Tensor
    extras: dict

    @property
    def shape(self) -> tuple[int, int, int, int]:
        B, H, L, _ = self.q.shape
        return B, H, L, self.k.shape[2]

    def leaves(self) -> Inputs:
        """Copies that require gradients (q and k only where the mechanism reads them)."""
        grad = lambda x: x.detach().clone().requires_grad_(x.is_floating_point())
        return Inputs(grad(self.q), grad(self.k), grad(self.v), {n: grad(x) for n, x in self.extras.items()})

    def differentiable(self, case: Case) -> list[Tensor]:
        xs = [self.q, self.k, self.v] if case.mech.uses_qk else [self.v]
        return xs + [x for x in self.extras.values() if x.is_floating_point()]


def make_inputs(case: Case, B: int, H: int, L: int, S: int, D: int, Dv: int, dtype: torch.dtype, seed: int) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    q, k, v = draw(B, H, L, D), draw(B, H, S, D), draw(B, H, S, Dv)
    extras = {}
    if case.mech.example_tensors is not None:
        extras = case.mech.example_tensors(q, k, v, case.config, g)
    return Inputs(q, k, v, extras)


def call(
    case: Case,
    x: Inputs,
    *,
    is_causal: bool = False,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | None = None,
    state: torch.nn.Module | None = None,
) -> Tensor:
    """The mechanism through the call path, as ``subquad.attention`` calls it. The causal form is
    the mechanisms' own, end-aligned (query ``i`` at key position ``i + S - L``): the properties
    below are those of decoding; ``test_alignment`` pins SDPA's top-left form."""
    tensors = dict(x.extras)
    if case.takes_query_mask and (query_padding_mask is not None or key_padding_mask is not None):
        B, _, L, _ = x.q.shape
        tensors["query_padding_mask"] = (
            torch.ones(B, L, dtype=torch.bool) if query_padding_mask is None else query_padding_mask
        )
    L, S = x.q.shape[2], x.k.shape[2]
    causal = {"attn_mask": causal_lower_right(L, S)} if is_causal else {}
    return call_mechanism(
        case.mech, x.q, x.k, x.v, key_padding_mask=key_padding_mask, config=case.config, state=state, **causal,
        **tensors,
    )  # fmt: skip


def _side(case: Case, name: str) -> str | None:
    return case.mech.positions.get(name)


def edit(case: Case, x: Inputs, queries: Tensor, keys: Tensor, fill: Callable[[Tensor], Tensor]) -> Inputs:
    """``x`` with the entries at the selected query positions (bool ``(B, L)``) and key positions
    (bool ``(B, S)``) replaced by ``fill(x)``: of q and query-aligned extras, and of k, v and
    key-aligned extras."""

    def put(t: Tensor, where: Tensor, dim: int) -> Tensor:
        shape = [1] * t.dim()
        shape[0], shape[dim] = where.shape
        return torch.where(where.view(shape), fill(t), t)

    extras = {}
    for name, t in x.extras.items():
        side = _side(case, name)
        extras[name] = t if side is None else put(t, queries if side == QUERY else keys, t.dim() - 1)
    return Inputs(put(x.q, queries, 2), put(x.k, keys, 2), put(x.v, keys, 2), extras)


def cut(case: Case, x: Inputs, queries: slice | Tensor, keys: slice | Tensor, rows: slice = slice(None)) -> Inputs:
    """The inputs of a smaller call: the selected batch rows, query and key positions."""

    def take(t: Tensor, index: slice | Tensor, dim: int) -> Tensor:
        t = t[rows]
        return t[(slice(None),) * dim + (index,)]

    extras = {}
    for name, t in x.extras.items():
        side = _side(case, name)
        extras[name] = t[rows] if side is None else take(t, queries if side == QUERY else keys, t.dim() - 1)
    return Inputs(take(x.q, queries, 2), take(x.k, keys, 2), take(x.v, keys, 2), extras)


def grads_at(case: Case, leaves: Inputs, queries: Tensor, keys: Tensor) -> dict[str, Tensor]:
    """The gradients of the inputs the mechanism reads, at the selected query positions (bool
    ``(B, L)``) and key positions (bool ``(B, S)``): each ``(selected, ...)``; zeros where none came."""
    named = {"q": leaves.q, "k": leaves.k, "v": leaves.v, **leaves.extras}
    grads = {}
    for name, t in named.items():
        if not t.is_floating_point() or (name in ("q", "k") and not case.mech.uses_qk):
            continue
        g = torch.zeros_like(t) if t.grad is None else t.grad
        side = {"q": QUERY, "k": KEY, "v": KEY}.get(name, _side(case, name))
        if side is not None:
            g = g.movedim(2 if name in ("q", "k", "v") else -1, 1)[queries if side == QUERY else keys]
        grads[name] = g
    return grads


def fill_with(kind: str, seed: int) -> Callable[[Tensor], Tensor]:
    """Content for edited positions: fresh random values, NaN, or ±inf."""

    def fill(t: Tensor) -> Tensor:
        if kind == "nan":
            return torch.full_like(t, float("nan"))
        if kind == "inf":
            signs = torch.randint(0, 2, t.shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1
            return (signs * float("inf")).to(t.dtype)
        g = torch.Generator().manual_seed(seed)
        return (3 * torch.randn(t.shape, generator=g, dtype=torch.float64)).to(t.dtype)

    return fill


FILLS = st.sampled_from(["random", "nan", "inf"])
DTYPES = st.sampled_from([torch.float64, torch.float32, torch.bfloat16])
SEEDS = st.integers(0, 2**16)


@st.composite
def sizes(draw, case: Case, *, cross: bool = True, most: int = 300) -> dict:
    """Batch, heads, lengths and widths: L and S from 1 to ``most``, not tied to any block size;
    L = S unless ``cross`` and the mechanism takes L != S. Four heads: a mechanism may split its
    heads between groups (multires, between its resolutions)."""
    small = st.integers(1, 24)
    length = st.one_of(small, st.integers(1, most))  # mostly short: the suite runs on every push
    L = draw(length)
    S = draw(length) if cross and case.mech.cross else L
    if not case.mech.longer_queries:
        L, S = min(L, S), max(L, S)
    H = 4
    D = draw(st.sampled_from([4, 8]))
    Dv = draw(st.sampled_from([D, 6]))
    return {"B": draw(st.integers(1, 3)), "H": H, "L": L, "S": S, "D": D, "Dv": Dv}


def with_batch(size: dict, B: int) -> dict:
    return {**size, "B": B}


def positions_after(t: int, B: int, L: int, S: int) -> tuple[Tensor, Tensor]:
    """Bool ``(B, L)`` and ``(B, S)``: the queries and keys at key positions after ``t`` (query i
    sits at position ``i + S − L``)."""
    q_pos = torch.arange(L) + (S - L)
    return (q_pos > t).expand(B, L), (torch.arange(S) > t).expand(B, S)


__all__ = [
    "CONTRACT",
    "DTYPES",
    "FILLS",
    "KEY",
    "QUERY",
    "SEEDS",
    "Case",
    "Inputs",
    "all_cases",
    "call",
    "cut",
    "edit",
    "fill_with",
    "grads_at",
    "make_inputs",
    "positions_after",
    "sizes",
    "with_batch",
]

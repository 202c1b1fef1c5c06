"""Options at the edge of their range, for every mechanism: each is refused with a ValueError when
the config is built, or the call runs in bounded memory and returns finite values. No option may
make an allocation explode (a huge window, stride, block, or a rate of 1e-9 once asked torch for
terabytes)."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

import subquad
from subquad.registry import get_mechanism

from .cases import Case, all_cases, call, make_inputs


def _extremes(config_class) -> list:
    """(option, value) pairs far beyond any sensible setting: every int option at 2**40, every
    tuple of rates at 1e-9."""
    hints = typing.get_type_hints(config_class)
    extremes = []
    for f in dataclasses.fields(config_class):
        tp = hints[f.name]
        if tp in (int, int | None):
            extremes.append((f.name, 2**40))
        elif typing.get_origin(tp) is tuple and typing.get_args(tp)[0] is float:
            extremes.append((f.name, (1e-9,) * len(f.default)))
    return extremes


PARAMS = [
    pytest.param(case.values[0], name, value, id=f"{case.values[0]}-{name}")
    for case in all_cases()
    if not case.values[0].options
    for name, value in _extremes(case.values[0].mech.config)
]


@pytest.mark.parametrize(("case", "option", "value"), PARAMS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_an_extreme_option_is_refused_or_runs_in_bounded_memory(case, option, value, is_causal):
    if is_causal and not case.mech.causal:
        pytest.skip(f"{case.mech.name} has no causal form")
    try:
        config = subquad.make_config(case.mech, **{option: value})
    except ValueError as error:
        assert option in str(error), f"the message names the option: {error}"
        return
    bounded = Case(case.mech, ((option, value),))
    assert bounded.config == config
    x = make_inputs(bounded, B=1, H=4, L=40, S=40, D=8, Dv=8, dtype=torch.float32, seed=0)
    out = call(bounded, x, is_causal=is_causal)
    assert out.shape == (1, 4, 40, 8) and torch.isfinite(out).all()


def test_every_registered_mechanism_has_an_edge_case_here():
    tested = {p.values[0].mech.name for p in PARAMS}
    with_options = {n for n in subquad.mechanism_names() if _extremes(get_mechanism(n).config)}
    assert tested == with_options

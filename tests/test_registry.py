from dataclasses import FrozenInstanceError, dataclass

import pytest
import torch

import subquad
from subquad import registry
from subquad.call import call
from subquad.mechanisms.full import FullConfig, full_attention
from subquad.registry import Config, Mechanism, get_mechanism, make_config, option

from .conftest import qkv


@dataclass(frozen=True)
class ToyConfig(Config):
    mechanism = "toy"
    width: int = option(4, "an int >= 1", ge=1)
    rate: float = option(0.5, "in (0, 1]", gt=0, le=1)
    rates: tuple[float, ...] = option((0.5, 0.25), "each in (0, 1]", gt=0, le=1)
    mode: str = option("a", "a or b", choices=("a", "b"))
    flag: bool = option(False, "a bool")
    limit: int | None = option(None, "optional int")


def _toy_fn(q, k, v, *, key_padding_mask=None, is_causal=False, scale=None, config=None, state=None, gate=None):
    out = full_attention(q, k, v, key_padding_mask=key_padding_mask, scale=scale)
    return out if gate is None else out * gate[..., None]


TOY = Mechanism(
    name="toy", fn=_toy_fn, config=ToyConfig, summary="test only", causal=False, cross=False,
    dtypes=(torch.float32, torch.float64), tensor_args=("gate",),
)  # fmt: skip


@pytest.fixture
def toy(monkeypatch):
    subquad.mechanism_names()  # load the built-ins first
    monkeypatch.setitem(registry._REGISTRY, "toy", TOY)
    return TOY


def test_builtins_are_registered_in_order():
    assert subquad.mechanism_names()[0] == "full"
    assert subquad.get_mechanism("full").config is FullConfig


def test_attention_dispatches_by_name_with_options():
    q, k, v = qkv()
    eager = subquad.attention(q, k, v, mechanism="full", backend="eager", is_causal=True)
    assert torch.allclose(eager, full_attention(q, k, v, is_causal=True), atol=1e-12)
    same = subquad.attention(q, k, v, config=FullConfig(backend="eager"), is_causal=True)
    assert torch.equal(same, eager)


def test_unknown_mechanism_lists_the_available_ones():
    with pytest.raises(ValueError, match="unknown mechanism 'nope'; available: full"):
        subquad.attention(*qkv(), mechanism="nope")


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['clusters'\] for full; valid options: backend='sdpa'"):
        subquad.attention(*qkv(), clusters=3)


def test_options_and_config_together_raise():
    with pytest.raises(ValueError, match="pass either config or options"):
        subquad.attention(*qkv(), config=FullConfig(), backend="eager")


def test_wrong_config_class_raises(toy):
    with pytest.raises(ValueError, match="full needs a FullConfig, got ToyConfig"):
        subquad.attention(*qkv(), config=ToyConfig())


def test_attn_mask_is_for_full_only(toy):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="toy takes no dense attn_mask; pass key_padding_mask"):
        subquad.attention(q, k, v, mechanism="toy", attn_mask=torch.ones(7, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="toy takes no dense attn_mask"):
        subquad.attention(q, k, v, torch.ones(7, 7, dtype=torch.bool), mechanism="toy")  # SDPA's position


def test_config_is_frozen_and_checks_values():
    config = ToyConfig(width=3, rates=[0.5, 1])  # a list becomes a tuple, ints become floats
    assert config.rates == (0.5, 1.0) and isinstance(config.rates[1], float)
    with pytest.raises(FrozenInstanceError):
        config.width = 5


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"width": 0}, "toy option width must be >= 1, got 0"),
        ({"width": 2.5}, "toy option width must be an int, got 2.5"),
        ({"width": True}, "toy option width must be an int, got True"),
        ({"rate": 0.0}, "toy option rate must be > 0, got 0.0"),
        ({"rate": 1.5}, "toy option rate must be <= 1, got 1.5"),
        ({"rate": float("nan")}, "toy option rate must be a finite number, got nan"),
        ({"rates": (0.5, 2.0)}, "toy option rates must be <= 1, got 2.0"),
        ({"rates": 0.5}, "toy option rates must be a tuple, got 0.5"),
        ({"mode": "c"}, "toy option mode must be one of 'a', 'b', got 'c'"),
        ({"flag": 1}, "toy option flag must be True or False, got 1"),
        ({"limit": "3"}, "toy option limit must be an int, got '3'"),
    ],
)
def test_bad_option_values_raise(options, message):
    with pytest.raises(ValueError) as err:
        ToyConfig(**options)
    assert message in str(err.value)


def test_optional_option_accepts_none_and_values():
    assert ToyConfig(limit=None).limit is None and ToyConfig(limit=3).limit == 3


def test_register_rejects_duplicates_and_non_mechanisms(toy):
    with pytest.raises(ValueError, match="a mechanism named 'toy' exists; pass replace=True"):
        registry.register(TOY)
    with pytest.raises(ValueError, match="register needs a Mechanism, got str"):
        registry.register("toy")


def test_capabilities_are_enforced(toy):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="toy has no causal form; mechanisms with one: full"):
        subquad.attention(q, k, v, mechanism="toy", is_causal=True)
    with pytest.raises(ValueError, match="toy needs as many queries as keys, got L=7 and S=4"):
        subquad.attention(q, k[:, :, :4], v[:, :, :4], mechanism="toy")
    with pytest.raises(ValueError, match="unsupported dtype torch.bfloat16; use one of float32, float64"):
        subquad.attention(*(x.bfloat16() for x in (q, k, v)), mechanism="toy")


def test_tensor_arguments_are_routed_by_name(toy):
    q, k, v = qkv()
    gate = torch.rand(2, 3, 7, dtype=torch.float64)
    out = subquad.attention(q, k, v, mechanism="toy", gate=gate, width=2)
    assert torch.allclose(out, full_attention(q, k, v) * gate[..., None])
    with pytest.raises(ValueError, match=r"toy takes no tensor argument \['bias'\]; it takes \['gate'\]"):
        call(TOY, q, k, v, bias=gate)
    with pytest.raises(TypeError, match=r"not called directly: use subquad.attention\(q, k, v, mechanism='toy'"):
        TOY(q, k, v)


def test_make_config_builds_defaults():
    assert make_config("full") == FullConfig()


def test_int_option_with_a_float_bound_is_checked():
    @dataclass(frozen=True)
    class Bounded(Config):
        n: int = option(4, "above one half", gt=0.5)

    with pytest.raises(ValueError, match="Bounded option n must be > 0.5, got 0"):
        Bounded(n=0)


def test_mutable_option_default_and_unsupported_type_are_refused():
    with pytest.raises(TypeError, match="option defaults must be immutable; use a tuple"):
        option([1, 2], "a list")

    @dataclass(frozen=True)
    class Odd(Config):
        x: complex = option(1j, "a complex")

    with pytest.raises(TypeError, match="Odd option x: unsupported option type <class 'complex'>"):
        Odd()


def test_a_tensor_given_as_the_mechanism_hints_at_attn_mask():
    q, k, v = qkv()
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="mechanism must be a registered name, got Tensor; pass a mask as attn_mask"):
        subquad.attention(q, k, v, mechanism=mask)
    assert torch.equal(subquad.attention(q, k, v, mask), full_attention(q, k, v, attn_mask=mask))  # SDPA's slot


def test_builtins_load_before_the_first_registration(monkeypatch):
    builtins = subquad.mechanism_names()
    assert builtins[0] == "full" and "toy" not in builtins
    monkeypatch.setattr(registry, "_REGISTRY", {})
    monkeypatch.setattr(registry, "_builtins_loaded", False)
    registry.register(TOY)
    assert subquad.mechanism_names() == [*builtins, "toy"]


class _Entry:
    def __init__(self, name, load):
        self.name, self.value, self.load = name, f"{name}_module", load


def _fresh_registry(monkeypatch, entries):
    monkeypatch.setattr(registry, "_REGISTRY", {})
    monkeypatch.setattr(registry, "_builtins_loaded", False)
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: entries)


def test_plugins_register_after_the_builtins(monkeypatch):
    import types

    builtins = subquad.mechanism_names()
    _fresh_registry(monkeypatch, [_Entry("toy", lambda: types.SimpleNamespace(MECHANISM=TOY))])
    assert subquad.mechanism_names() == [*builtins, "toy"]


def test_a_plugin_that_fails_is_skipped_with_a_warning(monkeypatch):
    import types

    def broken():
        raise ImportError("no module named nowhere")

    entries = [
        _Entry("broken", broken),
        _Entry("empty", lambda: types.SimpleNamespace()),
        _Entry("clash", lambda: types.SimpleNamespace(MECHANISM=get_mechanism("full"))),
    ]
    builtins = subquad.mechanism_names()
    _fresh_registry(monkeypatch, entries)
    with pytest.warns(RuntimeWarning) as caught:
        assert subquad.mechanism_names() == builtins
    messages = [str(w.message) for w in caught]
    assert "plugin 'broken' (broken_module) failed to load and is skipped: ImportError: no module" in messages[0]
    assert "empty_module must define MECHANISM (a Mechanism) or MECHANISMS" in messages[1]
    assert "clash_module registers 'full', a name already taken" in messages[2]

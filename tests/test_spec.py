"""The one spec grammar (``subquad.config.parse_spec``) and where it resolves into head groups."""

import argparse

import pytest

from subquad.config import SpecGroup, parse_spec
from subquad.nn.attention import spec_head_groups


def test_a_name_options_tuples_and_a_head_mix_parse_and_print_back():
    assert parse_spec("full") == (SpecGroup("full"),)
    assert parse_spec("local:window=64") == (SpecGroup("local", None, (("window", 64),)),)
    (multires,) = parse_spec("multires:rates=0.5|0.25,similarity=softmax")
    assert multires.options == (("rates", (0.5, 0.25)), ("similarity", "softmax"))
    mix = parse_spec("local:window=128*2+routing:clusters=16,commitment=0.0*2")
    assert mix == (
        SpecGroup("local", 2, (("window", 128),)),
        SpecGroup("routing", 2, (("clusters", 16), ("commitment", 0.0))),
    )
    for text in ("local:window=128*2+routing:clusters=16*2", "multires:rates=0.5|0.25", "improved-clustered*3+full"):
        assert "+".join(str(g) for g in parse_spec(text)) == text


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", r"got ''"),
        ("local:window", r"bad option 'window'"),
        ("local:window=3,window=4", r"bad option 'window=4'"),
        ("local*0", r"'local\*0' must end in \*HEADS, a positive count"),
        ("local*x", r"must end in \*HEADS"),
        ("lo cal", r"bad name 'lo cal'"),
        ("local+", r"bad name ''"),
    ],
)
def test_a_bad_spec_names_the_grammar_and_the_part(text, problem):
    with pytest.raises(ValueError, match=r"an attention spec is NAME, NAME:option=value|" + problem) as error:
        parse_spec(text)
    assert any(word in str(error.value) for word in ("NAME", "HEADS"))


def test_a_spec_resolves_into_head_groups_checked_against_the_registry():
    (one,) = spec_head_groups("local:window=8")
    assert (one.mechanism.name, one.heads, one.config.window) == ("local", None, 8)
    groups = spec_head_groups("local:window=8*2+full")
    assert [(g.mechanism.name, g.heads) for g in groups] == [("local", 2), ("full", None)]
    assert groups[0].config.window == 8
    with pytest.raises(ValueError, match=r"unknown mechanism 'nope'"):
        spec_head_groups("nope*2+full")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['windw'\] for local"):
        spec_head_groups("local:windw=8")


def test_one_spec_string_is_the_same_attention_in_every_command_and_in_hf_use():
    """``local:window=8,sinks=2`` read by bench, train, compare, approx, distill and ``subquad.hf.use``:
    each resolves it to the same mechanism and config."""
    pytest.importorskip("transformers")
    from subquad import hf
    from subquad.bench.command import settings_from
    from subquad.cli import build_parser
    from subquad.flags import flag_values
    from subquad.hf.approx import ApproxConfig, parse_spec
    from subquad.hf.distill import DistillConfig
    from subquad.registry import make_config
    from subquad.train.command import train_arguments
    from subquad.train.compare import variant_arguments
    from subquad.train.config import TrainConfig

    from .test_hf import bert

    spec = "local:window=8,sinks=2"
    want = make_config("local", window=8, sinks=2)
    parser = build_parser()
    model = ("m", "--data", "d", "--out", "o")

    (variant,) = settings_from(parser.parse_args(["bench", "--mechanisms", spec])).variants
    assert make_config(variant.mechanism, **dict(variant.options)) == want
    train = TrainConfig(**flag_values(parser.parse_args(["train", "--task", "listops", "--attention", spec]),
                                      TrainConfig, skip=("layers",)))  # fmt: skip
    assert [(g.mechanism.name, g.config) for g in train.attention_specs()[0]] == [("local", want)]
    train_arguments(probe := argparse.ArgumentParser())
    compared = probe.parse_args(["--task", "listops", *variant_arguments(spec)])
    assert TrainConfig(**flag_values(compared, TrainConfig, skip=("layers",))) == train
    approx = ApproxConfig(**flag_values(parser.parse_args(["approx", *model, "--mechanisms", spec]), ApproxConfig))
    distill = DistillConfig(**flag_values(parser.parse_args(["distill", *model, "--mechanism", spec]), DistillConfig))
    for text in (*approx.mechanisms, distill.mechanism):
        name, options = parse_spec(text)
        assert make_config(name, **options) == want
    used = hf.use(bert(), spec)
    configs = [m.subquad_attention.config for m in hf.attention_modules(used)]
    assert len(configs) == 2 and all(c == want for c in configs)

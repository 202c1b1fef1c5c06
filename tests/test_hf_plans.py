"""Layer plans (``subquad.hf.plans``): one attention spec per layer of a pretrained model, from TOML.

A plan equals the ``use`` calls it stands for, layer for layer; ``original`` layers run the
model's own attention (also after an earlier ``use``); ``approx`` measures a plan as a row of its
own (quality, a per-layer average of the attention time) and measures it again when the file
changes; every refusal names the file, the table and the fix.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", minversion="5")

from transformers import LlamaConfig, LlamaForCausalLM

from subquad import hf
from subquad.files import FileError
from subquad.hf import approx as ap
from subquad.hf.plans import plan_cell, plan_layers, read_plan, saved_plan

from .test_approx import data  # noqa: F401 - the tiny saved models


def llama(layers=4):
    config = LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def write(tmp_path, text, name="plan.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


PLAN = """
[[layers]]
attention = "local:window=3,sinks=1"
[[layers]]
layers = [1]
attention = "original"
[[layers]]
layers = [2]
attention = "local:window=2*2+full*2"
"""


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_a_plan_equals_the_use_calls_it_stands_for(tmp_path):
    ids = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(1))
    model = llama()
    original = logits(model, ids)
    expected = logits(hf.use(hf.use(model, "local:window=3,sinks=1", layers=[0, 3]), "local:window=2*2+full*2",
                             layers=[2]), ids)  # fmt: skip
    hf.restore(model)
    plan = write(tmp_path, PLAN)
    assert plan_layers(model, read_plan(plan)) == [
        ("local:window=3,sinks=1", [0, 3]), ("original", [1]), ("local:window=2*2+full*2", [2])
    ]  # fmt: skip
    torch.testing.assert_close(logits(hf.use(model, plan), ids), expected, rtol=0, atol=0)
    assert not torch.allclose(expected, original)
    hf.restore(model)
    everything = write(tmp_path, '[[layers]]\nattention = "local:window=100"\n', "all.toml")  # covers every key
    torch.testing.assert_close(logits(hf.use(model, everything), ids), original, rtol=1e-5, atol=1e-5)


def test_original_layers_take_back_the_model_s_attention_after_an_earlier_use(tmp_path):
    ids = torch.randint(0, 50, (1, 16), generator=torch.Generator().manual_seed(2))
    model = llama(2)
    original = logits(model, ids)
    hf.use(model, "local:window=2")  # every layer
    plan = write(tmp_path, '[[layers]]\nlayers = [0, 1]\nattention = "original"\n')
    torch.testing.assert_close(logits(hf.use(model, plan), ids), original, rtol=1e-5, atol=1e-5)
    assert [getattr(m, "subquad_attention", None) for m in hf.attention_modules(model)] == [None, None]


def test_a_plan_is_calibratable_where_one_of_its_specs_is(tmp_path):
    assert hf.calibratable(write(tmp_path, PLAN.replace("local:window=2*2+full*2", "routing:clusters=2")))
    assert not hf.calibratable(write(tmp_path, PLAN, "plain.toml"))


def test_a_plan_s_attention_time_is_its_layers_average(tmp_path):
    model = llama()
    cells = {"original": {"time_ms": 8.0, "ratio": 1.0, "peak_mb": 10.0},
             "local:window=3,sinks=1": {"time_ms": 2.0, "ratio": 0.25, "peak_mb": 4.0},
             "local:window=2*2+full*2": {"time_ms": 6.0, "ratio": 0.75, "peak_mb": None}}  # fmt: skip
    cell = plan_cell(model, read_plan(write(tmp_path, PLAN)), cells)
    assert cell == {"time_ms": (2 + 8 + 6 + 2) / 4, "ratio": (0.25 + 1 + 0.75 + 0.25) / 4, "peak_mb": None}


def test_approx_measures_a_plan_as_a_row_and_again_once_the_file_changes(data, tmp_path):  # noqa: F811
    plan = write(tmp_path, '[[layers]]\nattention = "local:window=3"\n[[layers]]\nlayers = [1]\nattention = "full"\n')
    run = lambda: ap.approx(data / "decoder", data / "passages.jsonl", [plan], tmp_path / "out", tokens=32,
                            samples=8, batch=4, context=32)  # fmt: skip
    rows = {r["spec"]: r for r in run()}
    row = rows[str(plan)]
    assert row["plan"] == [{"attention": "local:window=3", "layers": None}, {"attention": "full", "layers": [1]}]
    assert row["perplexity"] != rows["original"]["perplexity"] and row["time_ms"] > 0 and row["model_ms"] > 0
    again = {r["spec"]: r for r in run()}[str(plan)]
    assert again == row  # kept from approx.json
    plan.write_text('[[layers]]\nattention = "full"\n')
    changed = {r["spec"]: r for r in run()}[str(plan)]
    assert changed["plan"] == [{"attention": "full", "layers": None}]
    assert changed["perplexity"] == pytest.approx(rows["original"]["perplexity"], rel=1e-5)
    saved = json.loads((tmp_path / "out" / "approx.json").read_text())
    assert [r["spec"] for r in saved["rows"]] == ["original", str(plan)]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("layers = 3", r"field 'layers' is an integer \(3\), not an array"),
        ("[[layers]]\nlayers = [0]\n", r"\[\[layers\]\] table 1 lacks 'attention'"),
        ('[[layers]]\nattention = "local"\nwindow = 3\n', r"table 1 has unknown field\(s\) \['window'\]"),
        ('[[layers]]\nattention = "local"\nlayers = [-1]\n', r"table 1 has layers \[-1\]: give layer indices >= 0"),
        ('[[layers]]\nattention = "local"\nlayers = []\n', r"table 1 has layers \[\]"),
        ('[[layers]]\nattention = "local"\nlayers = [true]\n', r"table 1 has layers \[True\]"),
        ('[[layers]]\nattention = "local"\nlayers = [1, 1]\n', r"table 1 names layer\(s\) \[1\] that another"),
        (
            '[[layers]]\nattention = "local"\nlayers = [0, 2]\n[[layers]]\nattention = "full"\nlayers = [2]\n',
            r"table 2 names layer\(s\) \[2\] that another table",
        ),
        ('[[layers]]\nattention = "local"\n[[layers]]\nattention = "full"\n', r"has 2 tables without layers"),
        ('[[layers]]\nattention = "nosuch"\n', r"\[\[layers\]\] table 1: unknown mechanism 'nosuch'"),
        ('[[layers]]\nattention = "local:window=0"\n', r"table 1: .*window"),
        ("[layers]\n", r"field 'layers' is an object"),
        ("layers = []\n", r"has no \[\[layers\]\] table"),
        ("layers = [1]\n", r"\[\[layers\]\] table 1 is not a table"),
        ("[[layers\n", r"is not valid TOML"),
        (
            '[[layers]]\nattention = "other.toml"\n',
            r"table 1 names the plan 'other.toml': a table's attention is a spec",
        ),
    ],
)
def test_every_refusal_of_a_plan_file_names_it_and_the_fix(tmp_path, text, match):
    path = write(tmp_path, text)
    with pytest.raises(FileError, match=match) as caught:
        hf.check_spec(str(path))
    assert str(path) in str(caught.value) and "each [[layers]] table holds attention = SPEC" in str(caught.value)


def test_a_plan_refuses_layers_the_model_lacks_and_arguments_it_names_itself(tmp_path):
    model = llama(2)
    with pytest.raises(ValueError, match=r"plan.toml: LlamaForCausalLM has no layer \[5\]; its layers are 0..1"):
        hf.use(model, write(tmp_path, '[[layers]]\nattention = "local"\nlayers = [5]\n'))
    plan = write(tmp_path, '[[layers]]\nattention = "local"\n', "ok.toml")
    with pytest.raises(ValueError, match=r"names each layer's attention and options; pass no layers= or options"):
        hf.use(model, plan, layers=[0])
    with pytest.raises(ValueError, match=r"pass no layers= or options"):
        hf.use(model, plan, window=3)
    with pytest.raises(FileNotFoundError):
        hf.check_spec(str(tmp_path / "missing.toml"))


def test_distill_converts_a_plan_s_layers_and_refuses_to_resume_an_edited_one(tmp_path):
    from subquad.hf import distill as ds

    from .test_distill import MODELS, word_passages

    tokenizer = word_passages(tmp_path, 40)
    MODELS["llama"]().save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    plan = write(tmp_path, '[[layers]]\nlayers = [1]\nattention = "linear:feature_map=hedgehog"\n')
    # pathlib paths, kept as text (the checkpoints record them)
    paths = {
        "model": tmp_path / "llama",
        "data": tmp_path / "passages.jsonl",
        "mechanism": plan,
        "out": tmp_path / "run",
    }
    config = ds.DistillConfig(
        **paths, tokens=24, batch=4, steps=4, warmup=1, heldout=4, eval_every=2, checkpoint_every=2
    )
    assert (config.model, config.mechanism) == (str(tmp_path / "llama"), str(plan))
    summary = ds.distill(config, progress=False)
    assert summary["layers"] == [1] and summary["trained_parameters"] == 4 * 8 * 8 + 4 * 8  # one layer's feature map
    assert hf.saved_layers(tmp_path / "run" / "model") == {1: ("linear", {"feature_map": "hedgehog"})}
    assert saved_plan(tmp_path / "run" / "model").groups == (("linear:feature_map=hedgehog", (1,)),)  # approx's timing
    plan.write_text('[[layers]]\nlayers = [0, 1]\nattention = "linear:feature_map=hedgehog"\n')  # other weights
    with pytest.raises(ValueError, match=r"--resume with other settings than the run's \(plan\)"):
        ds.distill(config, resume=True, progress=False)
    with pytest.raises(ValueError, match=r"plan.toml names each layer's attention; pass no --layers with it"):
        ds.distill(ds.DistillConfig(**{**vars(config), "out": str(tmp_path / "other"), "layers": (0,)}), progress=False)


def test_convert_trains_every_table_s_new_weights_and_freezes_only_the_model_s(tmp_path):
    model = llama(3)
    own = {name for name, _ in model.named_parameters()}
    tables = [("[0]", "linear:feature_map=hedgehog"), ("[2]", "linear:feature_map=hedgehog,window=4")]
    plan = write(tmp_path, "".join(f'[[layers]]\nlayers = {n}\nattention = "{spec}"\n' for n, spec in tables))
    hf.convert(model, plan)
    new = {name: p for name, p in model.named_parameters() if name not in own}
    assert new and all(p.requires_grad for p in new.values())
    assert {name.split(".")[2] for name in new} == {"0", "2"}  # model.layers.<i>...
    assert not any(p.requires_grad for name, p in model.named_parameters() if name in own)
    assert {p.data_ptr() for p in hf.converted_parameters(model)} == {p.data_ptr() for p in new.values()}
    with pytest.raises(ValueError, match=r"pass no layers= or options with it"):
        hf.convert(llama(3), plan, layers=[0])


def test_a_refused_table_leaves_the_model_as_it_was_and_names_the_file_and_table(tmp_path):
    model = llama()  # 4 query heads in 2 key/value groups: a mix of 3 + 1 does not fit
    plan = write(tmp_path, '[[layers]]\nlayers = [0]\nattention = "local:window=2"\n'
                           '[[layers]]\nlayers = [2]\nattention = "local:window=2*3+full*1"\n')  # fmt: skip
    with pytest.raises(ValueError, match=r"plan.toml, the table of 'local:window=2\*3\+full\*1' \(layers \[2\]\): "):
        hf.use(model, plan)
    with pytest.raises(ValueError, match=r"the table of 'local:window=2\*3\+full\*1'"):
        hf.convert(model, plan)
    assert all(getattr(m, "subquad_attention", None) is None for m in hf.attention_modules(model))
    assert all(p.requires_grad for p in model.parameters())  # nothing frozen either


def test_convert_calibrates_once_from_a_one_pass_iterable_and_refuses_a_plan_that_converts_nothing(tmp_path):
    model = llama()
    batches = (
        {"input_ids": torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(i))} for i in range(2)
    )
    plan = write(tmp_path, '[[layers]]\nlayers = [0]\nattention = "routing:clusters=2"\n'
                           '[[layers]]\nlayers = [3]\nattention = "routing:clusters=2"\n'
                           '[[layers]]\nlayers = [1]\nattention = "multires"\n')  # fmt: skip
    assert hf.calibratable(plan)  # multires's learned inputs are allowed in a plan for convert
    hf.convert(model, plan, calibration=batches)  # a generator: read once, after every layer is converted
    kinds = [getattr(m, "subquad_attention", None) for m in hf.attention_modules(model)]
    assert [k and k.mechanism.name for k in kinds] == ["routing", "multires", None, "routing"]
    with pytest.raises(ValueError, match=r"plan.toml.s centroids are fitted by k-means on the model.s own queries"):
        hf.convert(llama(), plan)
    nothing = write(tmp_path, '[[layers]]\nattention = "original"\n', "nothing.toml")
    with pytest.raises(ValueError, match=r"nothing.toml converts no layer of LlamaForCausalLM"):
        hf.convert(llama(), nothing)


def test_convert_s_original_layers_take_back_exact_attention_as_use_s_do(tmp_path):
    model = llama(2)
    hf.use(model, "local:window=2")
    hf.convert(model, write(tmp_path, '[[layers]]\nlayers = [1]\nattention = "linear:feature_map=hedgehog"\n'))
    kinds = [getattr(m, "subquad_attention", None) for m in hf.attention_modules(model)]
    assert kinds[0] is None and kinds[1].mechanism.name == "linear"


def test_approx_reads_each_plan_once_and_use_takes_a_read_plan(data, tmp_path, monkeypatch):  # noqa: F811
    from subquad.hf import plans

    plan = write(tmp_path, '[[layers]]\nattention = "routing:clusters=2"\n')
    reads = []
    real = plans.read_plan
    monkeypatch.setattr(plans, "read_plan", lambda path, **kw: reads.append(path) or real(path, **kw))
    ap.approx(data / "decoder", data / "passages.jsonl", [plan], tmp_path / "out", tokens=32, samples=8, batch=4,
              calibration=4, context=32, decode=(16,), new_tokens=2)  # fmt: skip
    assert reads == [str(plan)]  # quality, calibration, speed and decoding all used that one reading
    read = real(plan)
    assert hf.calibratable(read)
    model = llama(2)
    hf.use(model, read)
    assert [m.subquad_attention.mechanism.name for m in hf.attention_modules(model)] == ["routing", "routing"]

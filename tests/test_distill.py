"""subquad.hf.convert, save / from_pretrained, AttentionTransfer and subquad distill, on tiny models
saved to disk with a word-level tokenizer: an encoder (BERT) and a grouped-query decoder (Llama)."""

from __future__ import annotations

import itertools
import json
import math
import shutil

import pytest
import torch

pytest.importorskip("transformers", minversion="5")

from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

from subquad import hf
from subquad.cli import main
from subquad.hf import approx as ap
from subquad.hf import distill as ds
from subquad.hf.plans import saved_plan

from .conftest import VOCAB, word_passages

# mechanism, options, parameters conversion adds per layer (heads 4, head size 8)
CONVERSIONS = [
    ("linear", {"feature_map": "hedgehog"}, 4 * 8 * 8 + 4 * 8),
    ("linear", {"feature_map": "hedgehog", "window": 5}, 4 * 8 * 8 + 4 * 8),
    ("linear", {"feature_map": "hedgehog", "window": 3, "sinks": 2}, 4 * 8 * 8 + 4 * 8),
    ("agglomerative", {}, 2 * (32 * 4 + 4) + 4),
    ("multires", {"rates": (0.5, 0.25)}, 32 * 2),
    ("routing", {"clusters": 2}, 0),
    ("retrieval", {"window": 3, "sinks": 1, "blocks": 1, "block": 2, "feature_map": "hedgehog"}, 4 * 8 * 8 + 4 * 8),
]


def bert():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, initializer_range=0.5)  # fmt: skip
    return BertModel(config, add_pooling_layer=False).eval()


def llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                         initializer_range=0.5)  # fmt: skip
    return LlamaForCausalLM(config).eval()


MODELS = {"bert": bert, "llama": llama}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("distill")
    tokenizer = word_passages(folder, 80)
    for name, make in MODELS.items():
        make().save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    return folder


def ids(B=2, N=24, seed=1):
    return torch.randint(5, len(VOCAB), (B, N), generator=torch.Generator().manual_seed(seed))


def output(model, x):
    out = model(input_ids=x)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def converted(make, mechanism, options, seed=3):
    """A converted tiny model whose added parameters are moved off their initial values."""
    model = make()
    calibration = [{"input_ids": ids(4, 24, seed=9)}] if mechanism == "routing" else None
    hf.convert(model, mechanism, calibration=calibration, **options)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.converted_parameters(model):
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize(("mechanism", "options", "added"), CONVERSIONS)
def test_convert_adds_what_each_mechanism_needs_and_freezes_the_rest(model_name, mechanism, options, added):
    model = MODELS[model_name]()
    calibration = [{"input_ids": ids(4, 24, seed=9)}] if mechanism == "routing" else None
    own = {id(p) for p in model.parameters()}
    hf.convert(model, mechanism, calibration=calibration, **options)
    new = hf.converted_parameters(model)
    assert sum(p.numel() for p in new) == 2 * added  # two layers
    assert all(p.requires_grad for p in new) and not any(id(p) in own for p in new)
    assert not any(p.requires_grad for p in model.parameters() if id(p) in own)
    out = output(model, ids())
    assert torch.isfinite(out).all()
    if mechanism == "routing":  # centroids fitted to the model's own queries and keys, unit length
        centroids = [m.subquad_state.centroids for m in hf.attention_modules(model)]
        fresh = hf.LayerAttention.build("routing", **options)
        seeded = fresh.mechanism.state(fresh.config, 4, 8, 0).centroids
        assert not torch.allclose(centroids[0], seeded)
        assert torch.allclose(centroids[0].norm(dim=-1), torch.ones(()), atol=1e-5)


def test_conversion_is_seeded_and_leaves_the_global_random_state_alone():
    model = bert()  # (which seeds torch itself)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    first = [p.clone() for p in hf.converted_parameters(hf.convert(model, "agglomerative"))]
    assert torch.equal(torch.rand(3), expected)
    second = hf.converted_parameters(hf.convert(bert(), "agglomerative"))
    other = hf.converted_parameters(hf.convert(bert(), "agglomerative", seed=1))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    weight = 1  # [gain, query classes' weight, ...] per layer
    assert not torch.equal(first[weight], other[weight])
    assert not torch.equal(first[weight], first[len(first) // 2 + weight])  # layers differ


def test_a_converted_hedgehog_model_starts_at_the_identity_map_and_agglomerative_at_gain_h():
    model = hf.convert(bert(), "linear", feature_map="hedgehog")
    plain = hf.use(bert(), "linear", feature_map="hedgehog")  # no state made yet: the initial map
    torch.testing.assert_close(output(model, ids()), output(plain, ids()), rtol=0, atol=0)
    model = hf.convert(bert(), "agglomerative")
    assert all(torch.equal(m.subquad_inputs.gain, torch.full((4,), 4.0)) for m in hf.attention_modules(model))


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize(("mechanism", "options", "added"), CONVERSIONS)
def test_a_converted_model_saves_reloads_and_gives_the_same_outputs(tmp_path, model_name, mechanism, options, added):
    model = converted(MODELS[model_name], mechanism, options)
    before = output(model, ids())
    hf.save(model, tmp_path / "m")
    saved = json.loads((tmp_path / "m" / hf.SPEC_FILE).read_text())
    assert saved["layers"]["0"]["mechanism"] == mechanism
    reloaded = hf.from_pretrained(tmp_path / "m")
    torch.testing.assert_close(output(reloaded, ids()), before, rtol=0, atol=0)
    # transformers alone loads the original architecture, with the original weights
    plain = type(model).from_pretrained(tmp_path / "m").eval()
    torch.testing.assert_close(output(plain, ids()), output(MODELS[model_name](), ids()), rtol=1e-6, atol=1e-6)


def test_a_damaged_converted_folder_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    hf.save(converted(bert, "linear", {"feature_map": "hedgehog"}), tmp_path / "m")
    tensors = load_file(str(tmp_path / "m" / hf.TENSOR_FILE))
    save_file({k: v for k, v in tensors.items() if not k.endswith("bias")}, str(tmp_path / "m" / hf.TENSOR_FILE))
    with pytest.raises(ValueError, match=r"subquad.safetensors: was changed or damaged after it was written"):
        hf.from_pretrained(tmp_path / "m")
    record = json.loads((tmp_path / "m" / hf.SPEC_FILE).read_text())
    assert sorted(record["sha256"]) == ["config.json", "model.safetensors", hf.TENSOR_FILE]
    del record["sha256"]
    with pytest.raises(ValueError, match=r"subquad.json: was changed after it was written \(its checksum"):
        (tmp_path / "m" / hf.SPEC_FILE).write_text(json.dumps(record))
        hf.from_pretrained(tmp_path / "m")
    del record["checksum"]  # as saved before the checks were recorded: read unchecked
    (tmp_path / "m" / hf.SPEC_FILE).write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"subquad.safetensors: does not fit layer 0's subquad_state: (.|\n)*bias"):
        hf.from_pretrained(tmp_path / "m")
    save_file({**tensors, "7.subquad_state.weight": tensors["0.subquad_state.weight"].clone()},
              str(tmp_path / "m" / hf.TENSOR_FILE))  # fmt: skip
    with pytest.raises(ValueError, match=r"holds tensors no converted layer takes: \['7.subquad_state.weight'\]"):
        hf.from_pretrained(tmp_path / "m")
    (tmp_path / "m" / hf.SPEC_FILE).write_text('{"layers": []}')
    with pytest.raises(ValueError, match="subquad.json: lacks 'format'; save the model again"):
        hf.from_pretrained(tmp_path / "m")


@pytest.mark.parametrize(
    "name, options",
    [("linear", {"feature_map": "hedgehog"}), ("linear", {"feature_map": "hedgehog", "window": 4}),
     ("linear", {"feature_map": "hedgehog", "window": 3, "sinks": 2}),
     ("retrieval", {"window": 3, "sinks": 1, "blocks": 1, "block": 2, "feature_map": "hedgehog"})],
)  # fmt: skip
def test_a_converted_decoder_generates_the_same_tokens_with_and_without_the_cache(name, options):
    model = converted(llama, name, options)
    prompt = ids(1, 6)
    cached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True)
    uncached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_under_transfer_full_has_zero_loss_and_every_mechanism_passes_the_original_outputs_on(model_name):
    original = output(MODELS[model_name](), ids())
    model = hf.convert(MODELS[model_name](), "full")
    with ds.AttentionTransfer(model) as transfer:
        torch.testing.assert_close(output(model, ids()), original, rtol=1e-6, atol=1e-6)
        assert len(transfer.losses) == 2 and float(transfer.loss()) == pytest.approx(0.0, abs=1e-12)
    model = converted(MODELS[model_name], "linear", {"feature_map": "hedgehog"})
    with ds.AttentionTransfer(model) as transfer:
        torch.testing.assert_close(output(model, ids()), original, rtol=1e-6, atol=1e-6)
        loss = transfer.loss()
        assert loss > 0 and loss.requires_grad
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in hf.converted_parameters(model))
        with pytest.raises(ValueError, match="no converted layer ran since the last loss"):
            transfer.loss()
        if model_name == "llama":  # a prefill with the cache is a whole sequence; a decoding step is not
            with pytest.raises(ValueError, match="not cached decoding steps: call the model with use_cache=False"):
                model.generate(ids(1, 6), max_new_tokens=2, do_sample=False)
    assert not torch.allclose(output(model, ids()), original)  # the hooks are gone


def run(data, tmp_path, model_name, **changes):
    settings = dict(model=str(data / model_name), data=str(data / "passages.jsonl"),
                    mechanism="linear:feature_map=hedgehog", out=str(tmp_path / "run"), tokens=24, batch=4, steps=30,
                    lr=3e-2, warmup=2, heldout=4, eval_every=10, checkpoint_every=10)  # fmt: skip
    return ds.DistillConfig(**{**settings, **changes})


@pytest.mark.parametrize("model_name", list(MODELS))
def test_distillation_lowers_the_heldout_error_at_every_evaluation(data, tmp_path, model_name):
    summary = ds.distill(run(data, tmp_path, model_name), progress=False)
    assert summary["trained_parameters"] == 2 * (4 * 8 * 8 + 4 * 8)  # the feature maps only
    again = ds.distill(run(data, tmp_path, model_name), resume=True, progress=False)  # a finished run: nothing more
    assert again["trained_parameters"] == summary["trained_parameters"] and again["history"] == summary["history"]
    errors = [h["heldout_error"] for h in summary["history"]]
    assert [h["step"] for h in summary["history"]] == [0, 10, 20, 30]
    assert all(b < a for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < 0.8 * errors[0]
    model = hf.from_pretrained(tmp_path / "run" / "model")
    assert isinstance(model, BertModel if model_name == "bert" else LlamaForCausalLM)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 31))
    # the distilled model's held-out error is the one the run reported
    with ds.AttentionTransfer(model) as transfer:
        windows = ap.token_windows(ap.load_model(data / model_name)[1], ap.read_passages(data / "passages.jsonl")[0],
                                   None, 24, 10**9, 0).ids[-4:]  # fmt: skip
        body = getattr(model, "base_model", model)
        with torch.no_grad():
            body(input_ids=windows, **({"use_cache": False} if model_name == "llama" else {}))
        assert float(transfer.loss()) == pytest.approx(errors[-1], rel=1e-5)


def test_a_finetuning_stage_trains_the_attention_blocks_too(data, tmp_path):
    summary = ds.distill(run(data, tmp_path, "llama", steps=10, finetune_steps=10, eval_every=5), progress=False)
    errors = [h["heldout_error"] for h in summary["history"]]
    assert errors[-1] < errors[0]
    blocks = 2 * (32 * 32 * 2 + 32 * 16 * 2)  # q and o (32 × 32), k and v (32 × 16), in two layers
    assert summary["trained_parameters"] == 2 * (4 * 8 * 8 + 4 * 8) + blocks
    reloaded = hf.from_pretrained(tmp_path / "run" / "model")
    new, old = reloaded.model.layers[0], llama().model.layers[0]
    assert not torch.equal(new.self_attn.q_proj.weight, old.self_attn.q_proj.weight)
    assert torch.equal(new.mlp.up_proj.weight, old.mlp.up_proj.weight)


def test_a_killed_run_resumes_to_the_same_result(data, tmp_path, monkeypatch):
    whole = ds.distill(run(data, tmp_path / "a", "bert", steps=20, finetune_steps=6), progress=False)
    rate = ds._rate

    def dies_after_step_12(config, step):
        if step == 13:
            raise KeyboardInterrupt
        return rate(config, step)

    config = run(data, tmp_path / "b", "bert", steps=20, finetune_steps=6)
    monkeypatch.setattr(ds, "_rate", dies_after_step_12)
    with pytest.raises(KeyboardInterrupt):
        ds.distill(config, progress=False)
    monkeypatch.setattr(ds, "_rate", rate)
    with pytest.raises(ValueError, match="already holds a distillation run; pass --resume"):
        ds.distill(config, progress=False)
    resumed = ds.distill(config, resume=True, progress=False)
    assert resumed["history"] == whole["history"]
    a, b = (hf.from_pretrained(tmp_path / x / "run" / "model") for x in "ab")
    torch.testing.assert_close(output(a, ids()), output(b, ids()), rtol=0, atol=0)
    lines = lambda x: [json.loads(r) for r in (tmp_path / x / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines("a") == lines("b")  # losses, rates and held-out errors, step by step
    shutil.copytree(tmp_path / "b", tmp_path / "c")  # a run folder may move; --finetune-steps may grow
    longer = ds.distill(run(data, tmp_path / "c", "bert", steps=20, finetune_steps=8), resume=True, progress=False)
    assert longer["history"][:-1] == whole["history"] and longer["history"][-1]["step"] == 28
    with pytest.raises(ValueError, match=r"--resume with other settings than the run's \(lr\)"):
        ds.distill(run(data, tmp_path / "b", "bert", steps=20, finetune_steps=6, lr=1e-3), resume=True, progress=False)


def test_approx_measures_a_converted_model_folder(data, tmp_path):
    model = hf.convert(ap.load_model(data / "bert")[0], "full")
    hf.save(model, tmp_path / "full")
    model = converted(bert, "linear", {"feature_map": "hedgehog"})
    hf.save(model, tmp_path / "hedgehog")
    rows = ap.approx(data / "bert", data / "passages.jsonl", ["linear"], tmp_path / "out", tokens=24, samples=12,
                     batch=4, context=24, converted=[tmp_path / "full", tmp_path / "hedgehog"])  # fmt: skip
    by = {r["spec"]: r for r in rows}
    assert by[f"converted:{tmp_path / 'full'}"]["cosine"] == pytest.approx(1.0, abs=1e-6)
    assert by[f"converted:{tmp_path / 'hedgehog'}"]["cosine"] < 1 - 1e-4
    assert all(r["model_ms"] > 0 and r["time_ms"] > 0 for r in rows)
    assert saved_plan(tmp_path / "hedgehog").specs() == ["linear:feature_map=hedgehog"]  # what approx times


def test_bad_specs_and_inputs_raise(data, tmp_path):
    with pytest.raises(ValueError, match="unknown mechanism"):
        hf.convert(bert(), "nonesuch")
    with pytest.raises(ValueError, match="linear option feature_map must be one of"):
        hf.convert(bert(), "linear", feature_map="cosine")
    with pytest.raises(ValueError, match="routing's centroids are fitted by k-means .* pass calibration="):
        hf.convert(bert(), "routing")
    with pytest.raises(ValueError, match="multires heads .*|multiple of"):
        hf.convert(bert(), "multires", rates=(0.5, 0.25, 0.125))
    with pytest.raises(ValueError, match="it cannot be swapped in without converting .* subquad.hf.convert"):
        hf.use(bert(), "agglomerative")
    with pytest.raises(ValueError, match="no subquad attention to save; subquad.hf.convert"):
        hf.save(bert(), tmp_path / "x")
    with pytest.raises(FileNotFoundError, match=r"has no subquad.json: it is not a model subquad.hf.save \(or"):
        hf.from_pretrained(data / "bert")
    with pytest.raises(ValueError, match="no layer of this model runs subquad attention"):
        ds.AttentionTransfer(bert())
    with pytest.raises(ValueError, match="unknown mechanism"):  # before the model loads
        ds.distill(run(data, tmp_path, "bert", mechanism="nonesuch", model="/no/such/model"), progress=False)
    with pytest.raises(ValueError, match="'routing:clusters=2' adds no parameters that gradients train .* --finetune"):
        ds.distill(run(data, tmp_path, "bert", mechanism="routing:clusters=2"), progress=False)
    with pytest.raises(ValueError, match=r"gives \d+ windows of 24 tokens: fewer than heldout \(500\)"):
        ds.distill(run(data, tmp_path / "h", "bert", heldout=500), progress=False)
    with pytest.raises(FileNotFoundError, match="no model at"):
        ds.distill(run(data, tmp_path / "m", "nonesuch"), progress=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file; pass a folder"):
        ds.distill(run(data, tmp_path, "bert", out=str(tmp_path / "file")), progress=False)
    bad = [("batch", 0, r"batch \(--windows-per-step\) must be >= 1, got 0"), ("steps", -1, "steps must be >= 0"),
           ("lr", 0.0, "lr must be > 0"), ("steps", 0, "needs steps or finetune_steps > 0")]  # fmt: skip
    for field, value, message in bad:
        with pytest.raises(ValueError, match=message):
            run(data, tmp_path, "bert", **{field: value})
    with pytest.raises(FileNotFoundError, match="has no subquad.json: it is not a model subquad.hf.save"):
        saved_plan(data / "bert")


def test_the_command_line(data, tmp_path, capsys):
    code = main(["distill", str(data / "bert"), "--data", str(data / "passages.jsonl"), "--mechanism",
                 "agglomerative", "--out", str(tmp_path / "cli"), "--window-tokens", "24", "--steps", "4",
                 "--heldout", "4", "--eval-every", "2", "--layers", "1", "--no-progress"])  # fmt: skip
    assert code == 0 and "held-out relative error" in capsys.readouterr().out
    saved = json.loads((tmp_path / "cli" / "model" / hf.SPEC_FILE).read_text())
    assert list(saved["layers"]) == ["1"]
    with pytest.raises(SystemExit):
        main(["approx", str(data / "bert"), "--data", str(data / "passages.jsonl"), "--out", str(tmp_path / "o")])
    assert "pass --mechanisms SPEC ..., --converted FOLDER ..., or both" in capsys.readouterr().err


def test_a_damaged_checkpoint_is_named_and_a_failed_resume_changes_nothing(data, tmp_path):
    from subquad.files import FileError

    config = run(data, tmp_path, "bert", steps=4, eval_every=2, checkpoint_every=2)
    ds.distill(config, progress=False)
    longer = run(data, tmp_path, "bert", steps=4, finetune_steps=2, eval_every=2, checkpoint_every=2)
    newest = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1]
    for name, cut in (("state.json", 40), ("state.safetensors", 200), ("model.safetensors", 100)):
        original = (newest / name).read_bytes()
        (newest / name).write_bytes(original[:cut])
        before = {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()}
        with pytest.raises(FileError, match=f"{name}: "):
            ds.distill(longer, resume=True, progress=False)
        assert {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()} == before
        (newest / name).write_bytes(original)
    assert ds.distill(longer, resume=True, progress=False)["history"][-1]["step"] == 6  # whole again: it resumes


def test_distillation_runs_in_the_dtype_asked_for_and_resumes_only_in_it(data, tmp_path):
    config = run(data, tmp_path, "bert", dtype="bfloat16", device="cpu", steps=4, eval_every=2, checkpoint_every=2)
    summary = ds.distill(config, progress=False)
    errors = [h["heldout_error"] for h in summary["history"]]
    assert len(errors) == 3 and all(math.isfinite(e) for e in errors)
    model = hf.from_pretrained(tmp_path / "run" / "model")
    assert {p.dtype for p in hf.converted_parameters(model)} == {torch.bfloat16}
    with pytest.raises(ValueError, match=r"--resume with other settings than the run's \(dtype\)"):
        ds.distill(run(data, tmp_path, "bert", steps=4, eval_every=2, checkpoint_every=2), resume=True, progress=False)
    with pytest.raises(ValueError, match=r"--dtype must be one of float32, bfloat16, float16, got 'int8'"):
        run(data, tmp_path, "bert", dtype="int8")

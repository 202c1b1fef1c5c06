"""subquad approx and subquad.hf.calibrate on tiny models saved to disk with a word-level tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", minversion="5")

from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

from subquad import hf
from subquad.files import FileError
from subquad.hf import approx as ap
from subquad.hf.data import is_decoder
from subquad.hf.interface import capturing

from .conftest import VOCAB, word_passages


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("approx")
    vocab = VOCAB
    tokenizer = word_passages(folder, 60)
    torch.manual_seed(0)
    encoder = BertModel(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=64, initializer_range=0.5),
                      add_pooling_layer=False)  # fmt: skip
    encoder.save_pretrained(folder / "encoder")
    tokenizer.save_pretrained(folder / "encoder")
    decoder = GPT2LMHeadModel(
        GPT2Config(vocab_size=len(vocab), n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.5)
    )  # attention that matters
    decoder.save_pretrained(folder / "decoder")
    tokenizer.save_pretrained(folder / "decoder")
    return folder


def test_an_encoder_s_full_attention_reproduces_it_and_others_are_scored(data, tmp_path):
    rows = ap.approx(data / "encoder", data / "passages.jsonl", ["full", "local:window=4", "routing:clusters=2"],
                     tmp_path, tokens=32, samples=20, batch=4, calibration=4, speed=False)  # fmt: skip
    by = {r["spec"]: r for r in rows}
    assert by["original"]["cosine"] == pytest.approx(1.0) and by["original"]["spearman"] == pytest.approx(1.0)
    assert by["full"]["cosine"] == pytest.approx(1.0, abs=1e-6) and by["full"]["spearman"] == pytest.approx(1.0)
    assert by["full"]["probe_accuracy"] == by["original"]["probe_accuracy"]
    assert 0 < by["local:window=4"]["cosine"] < 1 - 1e-4 and by["local:window=4"]["cosine_p5"] <= by["local:window=4"][
        "cosine"]  # fmt: skip
    assert -1 <= by["routing:clusters=2"]["spearman"] <= 1
    saved = json.loads((tmp_path / "approx.json").read_text())
    assert [r["spec"] for r in saved["rows"]] == ["original", "full", "local:window=4", "routing:clusters=2"]
    assert saved["settings"]["samples"] == 20 and not saved["settings"]["decoder"]


def test_a_decoder_s_perplexity_and_agreement_and_the_speed_columns(data, tmp_path, capsys):
    rows = ap.approx(data / "decoder", data / "passages.jsonl", ["full", "local:window=3"], tmp_path, tokens=32,
                     samples=8, batch=4, context=32)  # fmt: skip
    shown = capsys.readouterr().out  # each model's pass over the windows shows its progress
    assert all(
        f"\r  windows {label}: {n}/8" in shown for label in ("original", "full", "local:window=3") for n in (0, 4, 8)
    )
    by = {r["spec"]: r for r in rows}
    assert by["full"]["perplexity"] == pytest.approx(by["original"]["perplexity"], rel=1e-5)
    assert by["full"]["top1_agreement"] == 1.0 and by["original"]["top1_agreement"] == 1.0
    assert by["local:window=3"]["top1_agreement"] < 1.0
    assert all(r["time_ms"] > 0 and r["context"] == 32 and r["ratio"] > 0 for r in rows)
    assert all(r["model_ms"] > 0 for r in rows) and by["original"]["model_ratio"] == 1.0
    assert all(r["attention_layers"] == [0, 1] and r["speed_layers"] == 3 for r in rows)  # the model's own q, k, v
    again = ap.approx(data / "decoder", data / "passages.jsonl", ["full", "local:window=3"], tmp_path, tokens=32,
                      samples=8, batch=4, context=32, speed_layers=0)  # fmt: skip
    assert all(r["attention_layers"] == [] and r["speed_layers"] == 0 and r["time_ms"] > 0 for r in again)
    assert by["full"]["model_ratio"] == pytest.approx(by["full"]["model_ms"] / by["original"]["model_ms"])
    assert (tmp_path / "approx.png").stat().st_size > 0
    table = ap.format_table(rows)
    assert "| local:window=3 |" in table and "perplexity" in table and "attn ÷" in table and "model ÷" in table


def test_decode_lengths_measure_generation_with_subquad_s_cache_beside_the_original(data, tmp_path, capsys):
    rows = ap.approx(data / "decoder", data / "passages.jsonl", ["local:window=3,sinks=1"], tmp_path, tokens=32,
                     samples=4, batch=4, speed=False, decode=(12, 40), new_tokens=3)  # fmt: skip
    by = {r["spec"]: r["decode"] for r in rows}
    for decode in by.values():
        assert set(decode) == {"12", "40"}
        for m in decode.values():
            assert m["prefill_s"] > 0 and m["ms_per_token"] > 0 and m["peak_rss_mb"] > 10
    # GPT-2 (4 heads of 8, 2 layers, fp32): the original keeps every key and value; local only 1 sink + 2 keys
    original, local = by["original"], by["local:window=3,sinks=1"]
    assert original["40"]["cache_mb"] * 2**20 == 2 * 2 * 4 * (40 + 3) * 8 * 4
    assert local["12"]["cache_mb"] == local["40"]["cache_mb"] < original["12"]["cache_mb"]
    table = ap.format_decode_table(rows)
    assert "| local:window=3,sinks=1 | 40 |" in table and "ms / token" in table
    saved = json.loads((tmp_path / "approx.json").read_text())
    assert saved["rows"][1]["decode"] == local
    shown = capsys.readouterr().out  # each model's lengths as they finish
    for spec in ("original", "local:window=3,sinks=1"):
        assert f"\r  decoding {spec}: 1/2" in shown and f"\r  decoding {spec}: 2/2\n" in shown
    with pytest.raises(ValueError, match=r"a 99-token prompt needs 99 tokens of text"):
        from subquad.hf.speed import decode_speed

        decode_speed(GPT2LMHeadModel.from_pretrained(data / "decoder"), torch.ones(1, 50, dtype=torch.long), [99], 1)


@pytest.mark.parametrize("kept", [True, False])
def test_peak_rss_sees_memory_held_or_freed_inside_its_context(kept, monkeypatch):
    """Where Linux keeps the peak (VmHWM, reset on entry) nothing samples beside the measured code,
    and memory freed before the context closes still counts; elsewhere a thread samples it."""
    import subquad.bench.worker as worker
    from subquad.hf.speed import PeakRss

    if not kept:
        monkeypatch.setattr(worker, "reset_high_water", lambda: False)
    elif not worker.reset_high_water():
        pytest.skip("this system keeps no resettable peak resident size (/proc/self/clear_refs)")
    with PeakRss() as rss:
        assert (rss._thread is None) == kept
        held = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched; alive when the context closes
        if kept:
            freed = torch.ones(96 * 2**20 // 4)  # 96 MiB more, gone before it closes: only the kept peak sees it
            del freed
    assert rss.peak - rss.start >= (156 if kept else 60) * 2**20
    del held


def test_a_rerun_keeps_the_mechanisms_it_measured(data, tmp_path):
    settings = dict(tokens=32, samples=10, batch=5, speed=False)
    first = ap.approx(data / "encoder", data / "passages.jsonl", ["local:window=4"], tmp_path, **settings)
    stamp = (tmp_path / "approx.json").read_text()
    rows = ap.approx(data / "encoder", data / "passages.jsonl", ["local:window=4", "linear"], tmp_path, **settings)
    assert rows[:2] == first and [r["spec"] for r in rows] == ["original", "local:window=4", "linear"]
    assert json.loads(stamp)["rows"] == first


def test_a_rerun_with_other_mechanisms_keeps_the_rows_it_does_not_measure(data, tmp_path, monkeypatch):
    settings = dict(tokens=32, samples=10, batch=5, speed=False)
    first = ap.approx(data / "encoder", data / "passages.jsonl", ["local:window=4"], tmp_path, **settings)
    rows = ap.approx(data / "encoder", data / "passages.jsonl", ["linear"], tmp_path, **settings)
    assert [r["spec"] for r in rows] == ["original", "linear"] and rows[0] == first[0]  # this run's rows
    saved = json.loads((tmp_path / "approx.json").read_text())["rows"]
    assert saved == [*rows, first[1]]  # the file keeps the earlier spec's row

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ap, "_add_speed", stopped)  # stopped after a new spec, before the rows given again
    with pytest.raises(KeyboardInterrupt):
        ap.approx(data / "encoder", data / "passages.jsonl", ["linear:feature_map=relu", "local:window=4"], tmp_path,
                  **{**settings, "speed": True})  # fmt: skip
    saved = json.loads((tmp_path / "approx.json").read_text())["rows"]
    assert [r["spec"] for r in saved] == ["original", "linear:feature_map=relu", "linear", "local:window=4"]
    assert saved[2] == rows[1] and saved[3] == first[1]


def test_a_rerun_with_other_settings_is_refused_before_the_model_loads_and_the_results_are_kept(
    data, tmp_path, monkeypatch
):
    settings = dict(tokens=32, samples=10, batch=5, speed=False)
    first = ap.approx(data / "encoder", data / "passages.jsonl", ["local:window=4"], tmp_path, **settings)
    stamp = (tmp_path / "approx.json").read_text()
    monkeypatch.chdir(data)  # the same files by relative paths: the same settings, the rows read back
    assert ap.approx("encoder", "./passages.jsonl", ["local:window=4"], tmp_path, **settings) == first
    fix = "pass another --out to keep them, rerun with the earlier values, or remove it"
    with pytest.raises(FileError, match=rf"other settings \(--windows 10 → 8\).*{fix}"):
        ap.approx("encoder", "passages.jsonl", ["linear"], tmp_path, **{**settings, "samples": 8})
    assert (tmp_path / "approx.json").read_text() == stamp

    def load(*args):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(ap._Run, "load", load)
    with pytest.raises(FileError, match=r"other settings \(--window-tokens 32 → 16, --seed 0 → 1\)"):
        ap.approx("encoder", "passages.jsonl", ["linear"], tmp_path, **{**settings, "tokens": 16, "seed": 1})
    with pytest.raises(FileError, match=r"other settings \(MODEL .*encoder' → 'decoder'\)"):
        ap.approx("decoder", "passages.jsonl", ["linear"], tmp_path, **settings)
    saved = json.loads(stamp)
    (tmp_path / "approx.json").write_text(json.dumps({"rows": saved["rows"]}))
    with pytest.raises(FileError, match="holds no settings object: it is not approx's own; remove it"):
        ap.approx("encoder", "passages.jsonl", ["linear"], tmp_path, **settings)


def test_calibration_fits_routing_centroids_to_the_model_s_queries_and_keys(data):
    model = hf.use(BertModel.from_pretrained(data / "encoder").eval(), "routing", clusters=3)
    ids = torch.randint(5, 30, (4, 32), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids)
    before = [m.subquad_state.centroids.clone() for m in hf.attention_modules(model)]
    with capturing(hf.attention_modules(model)) as captured:
        model(input_ids=ids)
    assert hf.calibrate(model, [{"input_ids": ids}]) == 2
    for module, old in zip(hf.attention_modules(model), before):
        points = torch.cat(captured[module], dim=1)
        new = module.subquad_state.centroids
        fit_new, fit_old = (torch.bmm(points, c.transpose(1, 2)).amax(-1).mean() for c in (new, old))
        assert torch.allclose(new.norm(dim=-1), torch.ones(()), atol=1e-5) and fit_new > fit_old
    with pytest.raises(ValueError, match="no layer of this model has a mechanism with centroids"):
        hf.calibrate(hf.use(model, "local", window=4), [{"input_ids": ids}])


def test_spearman_and_the_probe_on_known_answers():
    x = torch.arange(10.0)
    assert ap.spearman(x, x**3) == pytest.approx(1.0) and ap.spearman(x, -x) == pytest.approx(-1.0)
    g = torch.Generator().manual_seed(0)
    labels = ["a", "b"] * 40
    separable = torch.randn(80, 4, generator=g) + torch.tensor([[3.0, 0, 0, 0], [-3.0, 0, 0, 0]]).repeat(40, 1)
    assert ap.probe_accuracy(separable, labels) == 1.0


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"text": "a"}\n{"label": "x"}\n', r"passages.jsonl: line 2 has no text \(a string\); pass a .jsonl file"),
        ('{"text": "a", "label": "x"}\n{"text": "b"}\n', "some lines have a label and some do not"),
    ],
)
def test_malformed_data_is_named(tmp_path, text, match):
    (tmp_path / "passages.jsonl").write_text(text)
    with pytest.raises(ValueError, match=match):
        ap.read_passages(tmp_path / "passages.jsonl")


def test_bad_inputs_are_refused(data, tmp_path):
    with pytest.raises(FileNotFoundError, match="no text data at .*missing.jsonl"):
        ap.read_passages(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="holds no .txt files"):
        ap.read_passages(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.txt").write_text("one")
    assert ap.read_passages(tmp_path) == (["one"], ["a"])
    with pytest.raises(ValueError, match=r"an attention spec is NAME, NAME:option=value.*bad option 'window'"):
        ap.parse_spec("local:window")
    with pytest.raises(ValueError, match=r"'local\*2\+full' is a head mix, and this takes one mechanism"):
        ap.parse_spec("local*2+full")
    assert ap.parse_spec("multires:rates=0.5|0.25,similarity=softmax") == (
        "multires", {"rates": (0.5, 0.25), "similarity": "softmax"})  # fmt: skip
    with pytest.raises(ValueError, match="agglomerative needs inputs from learned projections"):
        ap.approx(data / "encoder", data / "passages.jsonl", ["agglomerative"], tmp_path / "o")
    with pytest.raises(ValueError, match="--window-tokens 4096 is longer than the 64 positions this model reads"):
        ap.approx(data / "encoder", data / "passages.jsonl", ["local"], tmp_path / "o", tokens=4096, speed=False)
    (tmp_path / "short.jsonl").write_text('{"text": "one two three"}\n')
    with pytest.raises(ValueError, match="holds no window of 48 tokens"):
        ap.approx(data / "encoder", tmp_path / "short.jsonl", ["local"], tmp_path / "o", tokens=48, speed=False)
    (tmp_path / "taken").write_text("")
    with pytest.raises(ValueError, match="--out .*taken is a file; pass a folder"):
        ap.approx(data / "encoder", data / "passages.jsonl", ["local"], tmp_path / "taken", speed=False)
    cli = [sys.executable, "-m", "subquad", "approx", str(tmp_path / "none"), "--data", str(data / "passages.jsonl"),
           "--mechanisms", "local", "--out", str(tmp_path / "o")]  # fmt: skip
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no model at" in done.stderr and "Traceback" not in done.stderr


def test_a_config_without_architectures_is_a_decoder_by_its_model_type():
    """A GGUF file's config names no architecture: Llama and GPT-2 types are causal LMs, BERT (which
    also has a causal-LM head) is not; a named architecture or is_decoder decides where present."""
    from transformers import LlamaConfig

    assert is_decoder(LlamaConfig()) and is_decoder(GPT2Config())
    assert not is_decoder(BertConfig())
    assert not is_decoder(LlamaConfig(architectures=["LlamaModel"]))
    assert is_decoder(BertConfig(architectures=["BertLMHeadModel"])) and is_decoder(BertConfig(is_decoder=True))


def test_the_model_runs_in_the_dtype_and_on_the_device_asked_for(data, tmp_path):
    rows = ap.approx(data / "encoder", data / "passages.jsonl", ["full"], tmp_path / "bf16", tokens=16, samples=12,
                     batch=4, speed=False, device="cpu", dtype="bfloat16")  # fmt: skip
    full = next(r for r in rows if r["spec"] == "full")
    assert 0.99 < full["cosine"] <= 1.0 + 1e-6  # bf16 on both sides, compared in float32
    saved = json.loads((tmp_path / "bf16" / "approx.json").read_text())
    assert saved["settings"]["dtype"] == "bfloat16" and saved["settings"]["device"] == "cpu"
    with pytest.raises(ValueError, match=r"dtype must be one of float32, bfloat16, float16, got 'int8'"):
        ap.approx(data / "encoder", data / "passages.jsonl", ["full"], tmp_path / "x", dtype="int8")
    with pytest.raises(ValueError, match=r"--device must be auto, cpu, cuda or cuda:N, got 'tpu'"):
        ap.approx(data / "encoder", data / "passages.jsonl", ["full"], tmp_path / "x", device="tpu")


def test_a_converted_folder_of_a_mechanism_with_learned_inputs_gets_its_speed_row(data, tmp_path):
    """The speed step rebuilt the folder's spec on the unconverted model and refused multires (its
    router is learned): after the quality rows, no table was written."""
    model = GPT2LMHeadModel.from_pretrained(data / "decoder")
    hf.save(hf.convert(model, "multires"), tmp_path / "mr")
    rows = ap.approx(data / "decoder", data / "passages.jsonl", [], tmp_path / "o", tokens=32, samples=4, batch=4,
                     context=64, converted=[tmp_path / "mr"])  # fmt: skip
    (row,) = [r for r in rows if r["spec"] == f"converted:{tmp_path / 'mr'}"]
    assert row["time_ms"] > 0 and row["model_ms"] > 0 and (tmp_path / "o" / "approx.json").exists()


def test_a_converted_folder_of_another_model_class_is_refused_by_name(data, tmp_path):
    encoder = BertModel.from_pretrained(data / "encoder")
    hf.save(hf.convert(encoder, "local"), tmp_path / "enc")
    with pytest.raises(ValueError, match=r"--converted .*enc is a BertModel, not this GPT2LMHeadModel"):
        ap.approx(data / "decoder", data / "passages.jsonl", [], tmp_path / "o", tokens=32, samples=4, batch=4,
                  speed=False, converted=[tmp_path / "enc"])  # fmt: skip


def test_the_speed_step_is_saved_before_the_steps_after_it(data, tmp_path, monkeypatch):
    """A run stopped during generation keeps its speed columns: a rerun does not time them again."""

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ap._Run, "add_decoding", stopped)
    with pytest.raises(KeyboardInterrupt):
        ap.approx(data / "decoder", data / "passages.jsonl", ["local:window=3"], tmp_path, tokens=32, samples=4,
                  batch=4, context=32, decode=(12,), new_tokens=2)  # fmt: skip
    rows = json.loads((tmp_path / "approx.json").read_text())["rows"]
    assert [r["spec"] for r in rows] == ["original", "local:window=3"]
    assert all(r["time_ms"] > 0 and r["model_ms"] > 0 and r["attention_layers"] == [0, 1] for r in rows)

"""subquad.hf.heads and ``subquad heads``: each head's attention on the needle, and the layer plan
that gives the heads that fetch a far reach."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", minversion="5")

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from subquad import hf
from subquad.cli import main
from subquad.hf import heads as hd
from subquad.hf.heads import HeadsConfig, HeadScores, retrieval_scores
from subquad.hf.plans import plan_layers, read_plan
from subquad.hf.recall import seeded_needle

from .test_approx import data  # noqa: F401 - tiny saved encoder and decoder (GPT-2, 64 positions)
from .test_recall import HAYSTACK, CharTokenizer
from .test_recall import llama as saved_llama  # noqa: F401 - the tiny saved model and its passages


def char_llama():
    """A tiny Llama over CharTokenizer's code points: 4 query heads on 2 key/value heads, layer 1 at
    its own softmax scale."""
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.model.layers[1].self_attn.scaling = 0.5  # not 1/√8: the score reads the layer's own scale
    return model


def char_gpt2():
    """A tiny GPT-2 (no grouped-query heads, a table of positions) over CharTokenizer's code points."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=3, n_head=4, n_positions=1024)).eval()


@pytest.mark.parametrize("build", [char_llama, char_gpt2])
def test_a_head_s_score_is_its_answer_s_attention_on_the_needle_averaged_over_the_cases(build):
    """The oracle: transformers' eager attention probabilities of the prompt's last position, summed
    over the needle sentence's tokens, averaged over the seeded cases; the model's setting comes back."""
    model, tokenizer = build(), CharTokenizer()
    scores = retrieval_scores(model, tokenizer, HAYSTACK, length=700, depths=(0.2, 0.8), samples=2, seed=3)
    assert model.config._attn_implementation == "sdpa" and not model.training
    expected = torch.zeros(3, 4)
    model.set_attn_implementation("eager")
    for depth in (0.2, 0.8):
        for sample in range(2):
            case = seeded_needle(tokenizer, HAYSTACK, 3, 700, depth, sample)
            span = slice(case.needle_at, case.needle_at + case.needle_tokens)
            sentence = tokenizer.decode(case.ids[0, span].tolist())  # the whole needle sentence, no more
            assert sentence.startswith(" One of the special magic numbers for ") and sentence.endswith(f": {case.key}.")
            weights = model(case.ids, output_attentions=True).attentions  # (1, H, N, N) each
            expected += torch.stack([w[0, :, -1, span].sum(-1) for w in weights])
    torch.testing.assert_close(scores.scores, expected / 4, rtol=1e-4, atol=1e-6)
    kv = model.config.num_key_value_heads if build is char_llama else 4
    assert (scores.layers, scores.kv_heads, scores.length, scores.cases) == ((0, 1, 2), kv, 700, 4)
    torch.testing.assert_close(scores.groups(), scores.scores.view(3, kv, 4 // kv).sum(-1))


def test_a_mask_the_model_builds_is_applied_to_the_answer_s_row():
    """Boolean (True: seen) and additive masks give the softmax over the keys the row sees only."""
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    seen = torch.tensor([True, False, True, True, False])
    keys = k[0].repeat_interleave(2, 0)[:, seen]
    probs = torch.softmax(q[0, :, -1:] @ keys.transpose(-1, -2) * 8**-0.5, -1)[:, 0]  # over keys 0, 2, 3
    expected = probs[:, 1:3].sum(-1)  # keys 2 and 3
    boolean = torch.zeros(1, 1, 5, 5, dtype=torch.bool)
    boolean[..., -1, :] = seen
    additive = torch.zeros(1, 1, 5, 5).masked_fill(~boolean, float("-inf"))
    for mask in (boolean, additive):
        got, kv = hd._answer_weight(q, k, None, mask, start=2, end=4)
        torch.testing.assert_close(got, expected)
        assert kv == 2


ROWS = [[0.1, 0.0, 0.3, 0.1, 0.0, 0.0], [0.5, 0.1, 0.0, 0.0, 0.2, 0.1], [0.0] * 6, [0.0, 0.1, 0.0, 0.0, 0.3, 0.0]]
SCORES = HeadScores(layers=(0, 1, 2, 3), scores=torch.tensor(ROWS), kv_heads=3, length=4096, cases=5)


def test_each_layer_s_top_key_value_heads_take_the_far_spec_as_a_plan_of_head_mixes(tmp_path):
    # summed per key/value head: layer 0 (0.1, 0.4, 0.0), 1 (0.6, 0.0, 0.3), 2 all 0 (the first wins), 3 (0.1, 0, 0.3)
    assert SCORES.chosen(1) == [[1], [0], [0], [2]]
    assert SCORES.chosen(2) == [[0, 1], [0, 2], [0, 1], [0, 2]]
    text = SCORES.plan("retrieval:blocks=2,block=4", "local:window=4,sinks=1", 1)
    far, near = "retrieval:blocks=2,block=4", "local:window=4,sinks=1"
    assert text.splitlines()[1:] == [
        "", "[[layers]]", "layers = [0]", f'attention = "{near}*2+{far}*2+{near}*2"',
        "", "[[layers]]", "layers = [1, 2]", f'attention = "{far}*2+{near}*4"',
        "", "[[layers]]", "layers = [3]", f'attention = "{near}*4+{far}*2"',
    ]  # fmt: skip
    assert 'attention = "local:window=4"\n' in SCORES.plan(near="local:window=4", per_layer=0)  # no far heads
    assert SCORES.chosen() == SCORES.chosen(1) and SCORES.plan(far, near) == text  # one per layer by default
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=6, num_key_value_heads=3)).eval()  # fmt: skip
    path = tmp_path / "plan.toml"
    path.write_text(text)
    assert plan_layers(model, read_plan(path)) == [
        (f"{near}*2+{far}*2+{near}*2", [0]), (f"{far}*2+{near}*4", [1, 2]), (f"{near}*4+{far}*2", [3])
    ]  # fmt: skip
    ids = torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(hf.use(model, path)(ids).logits).all()
    SCORES.save(tmp_path / "heads.json")
    saved = json.loads((tmp_path / "heads.json").read_text())
    assert saved == {**SCORES.to_dict(), "scores": SCORES.scores.tolist()} and saved["kv_heads"] == 3


def test_several_far_specs_go_to_bands_of_consecutive_layers_the_first_to_the_earliest():
    # chosen, one per layer: layer 0 kv 1, layer 1 kv 0, layer 2 kv 0, layer 3 kv 2
    near, a, b, c = "local:window=4,sinks=1", "retrieval:blocks=4,block=4", "retrieval:blocks=3,block=4", "local"
    lines = SCORES.plan((a, b), near, 1).splitlines()
    assert lines[0].startswith("# subquad heads: per layer, the 1 key/value head(s) that fetch most take the far spec "
                               "of their band (2 bands of consecutive layers, the earliest first)")  # fmt: skip
    assert lines[1:] == [
        "", "[[layers]]", "layers = [0]", f'attention = "{near}*2+{a}*2+{near}*2"',
        "", "[[layers]]", "layers = [1]", f'attention = "{a}*2+{near}*4"',
        "", "[[layers]]", "layers = [2]", f'attention = "{b}*2+{near}*4"',
        "", "[[layers]]", "layers = [3]", f'attention = "{near}*4+{b}*2"',
    ]  # fmt: skip
    three = SCORES.plan([a, b, c], near, 2).splitlines()[1:]  # 4 layers in 3 bands: 0-1, 2, 3
    assert three == [
        "", "[[layers]]", "layers = [0]", f'attention = "{a}*4+{near}*2"',
        "", "[[layers]]", "layers = [1]", f'attention = "{a}*2+{near}*2+{a}*2"',
        "", "[[layers]]", "layers = [2]", f'attention = "{b}*4+{near}*2"',
        "", "[[layers]]", "layers = [3]", f'attention = "{c}*2+{near}*2+{c}*2"',
    ]  # fmt: skip
    assert SCORES.plan((a,), near, 1) == SCORES.plan(a, near, 1)  # one spec: every layer's
    assert HeadsConfig("m", "d", "o", far=a).far == (a,)
    for far, match in (
        ((a,) * 5, r"5 far specs for 4 layers: give at most one a layer"),
        ((), "no far spec: give one, or one for each band of consecutive layers"),
        ((a, "retrieval:blok=2"), r"unknown option\(s\) \['blok'\] for retrieval"),
    ):
        with pytest.raises(ValueError, match=match):
            SCORES.plan(far, near, 1)


def test_a_total_takes_the_key_value_heads_of_highest_score_in_any_layer():
    # summed: layer 0 (0.1, 0.4, 0.0), 1 (0.6, 0.0, 0.3), 2 all 0, 3 (0.1, 0, 0.3): 0.3 twice, the earlier layer first
    assert SCORES.chosen(total=3) == [[1], [0, 2], [], []]
    assert SCORES.chosen(total=4) == [[1], [0, 2], [], [2]]
    assert SCORES.chosen(total=0) == [[], [], [], []] and SCORES.chosen(total=12) == [[0, 1, 2]] * 4
    far, near = "retrieval:blocks=2,block=4", "local:window=4,sinks=1"
    lines = SCORES.plan(far, near, total=3).splitlines()
    assert lines[0].startswith("# subquad heads: the 3 key/value head(s) across all layers that fetch most")
    assert lines[1:] == [
        "", "[[layers]]", "layers = [0]", f'attention = "{near}*2+{far}*2+{near}*2"',
        "", "[[layers]]", "layers = [1]", f'attention = "{far}*2+{near}*2+{far}*2"',
        "", "[[layers]]", "layers = [2, 3]", f'attention = "{near}"',
    ]  # fmt: skip
    assert hd.format_scores(SCORES, total=3).splitlines()[2:4] == [
        "    0   0.100    0.400*   0.000 ", "    1   0.600*   0.000    0.300*"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: SCORES.chosen(4), r"per_layer=4: give 0 to 3 key/value heads per layer \(the model has 3\)"),
        (
            lambda: SCORES.chosen(total=13),
            r"total=13: give 0 to 12 key/value heads in all \(the model has 3 in each "
            r"of 4 layers\)",
        ),
        (lambda: SCORES.chosen(1, 2), r"per_layer=1 and total=2: give one \(per layer, or across layers\)"),
        (lambda: SCORES.plan(far="local*2+full"), r"'local\*2\+full' is a head mix \(the far spec\); give one"),
        (lambda: SCORES.plan(near="local:windw=3"), r"unknown option\(s\) \['windw'\] for local"),
        (lambda: SCORES.plan(near="nosuch"), "unknown mechanism 'nosuch'"),
        (lambda: retrieval_scores(None, None, [], samples=0), r"give samples >= 1 and depths from 0 to 1; got 0"),
        (lambda: retrieval_scores(None, None, [], depths=(1.5,)), r"got 1 and \(1.5,\)"),
        (
            lambda: HeadsConfig("m", "d", "o", length=0),
            "--samples must be >= 1 and --per-layer and --total >= 0, got 0, 1, None and None",
        ),
        (lambda: HeadsConfig("m", "d", "o", per_layer=-1), "got 4096, 1, -1 and None"),
        (lambda: HeadsConfig("m", "d", "o", total=-1), "got 4096, 1, None and -1"),
        (lambda: HeadsConfig("m", "d", "o", per_layer=1, total=3), "--per-layer 1 and --total 3: give one of them"),
        (lambda: HeadsConfig("m", "d", "o", depths=()), r"--depths are fractions from 0 to 1, got \(\)"),
        (lambda: HeadsConfig("m", "d", "o", far="full*2+local"), "is a head mix"),  # before any model loads
    ],
)
def test_every_refusal_names_the_value_and_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_command_writes_the_scores_and_a_plan_the_model_takes(saved_llama, tmp_path, capsys, monkeypatch):  # noqa: F811
    out = tmp_path / "heads"
    argv = ["heads", str(saved_llama / "model"), "--data", str(saved_llama / "passages.jsonl"), "--out", str(out),
            "--length", "300", "--depths", "0.3", "0.7", "--far", "retrieval:window=8,blocks=2,block=4",
            "--near", "local:window=8,sinks=2"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "needle cases: 2/2" in printed and "layer     kv0      kv1 \n" in printed and "plan.toml" in printed
    saved = json.loads((out / "heads.json").read_text())
    assert saved["layers"] == [0, 1] and len(saved["scores"][0]) == 4 and saved["cases"] == 2
    assert saved["settings"]["depths"] == [0.3, 0.7] and saved["settings"]["length"] == 300
    model, _, _ = hf.data.load_model(saved_llama / "model")
    layers = plan_layers(model, read_plan(out / "plan.toml"))
    assert sorted(i for _, group in layers for i in group) == [0, 1]
    assert all("retrieval:window=8,blocks=2,block=4*2" in spec and "local:window=8,sinks=2*2" in spec
               for spec, _ in layers)  # fmt: skip

    def fail(*args, **kwargs):
        raise AssertionError("scored again")

    monkeypatch.setattr(hd, "retrieval_scores", fail)
    assert main([*argv, "--per-layer", "2"]) == 0  # the same cases: a new plan from the saved scores
    assert "scores of the same cases from" in capsys.readouterr().out
    assert plan_layers(model, read_plan(out / "plan.toml")) == [("retrieval:window=8,blocks=2,block=4", [0, 1])]
    bands = ["--far", "retrieval:window=8,blocks=2,block=4", "retrieval:window=8,blocks=1,block=4"]
    assert main([*argv, *bands, "--per-layer", "2"]) == 0  # one far spec for each layer (2 bands of 1)
    assert plan_layers(model, read_plan(out / "plan.toml")) == [
        ("retrieval:window=8,blocks=2,block=4", [0]), ("retrieval:window=8,blocks=1,block=4", [1])
    ]  # fmt: skip
    capsys.readouterr()
    assert main([*argv, "--total", "1"]) == 0  # one key/value head in all: where the saved scores are highest
    best = torch.tensor(saved["scores"]).view(2, 2, 2).sum(-1).flatten().argmax().item()
    layers = plan_layers(model, read_plan(out / "plan.toml"))
    far_layer = [group for spec, group in layers if "retrieval" in spec]
    assert far_layer == [[best // 2]] and ("local:window=8,sinks=2", [1 - best // 2]) in layers
    assert "across all layers" in (out / "plan.toml").read_text() and capsys.readouterr().out.count("*") == 1
    with pytest.raises(SystemExit):
        main([*argv, "--per-layer", "3"])
    assert "per_layer=3: give 0 to 2 key/value heads per layer" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="scored again"):
        main([*argv, "--seed", "1"])  # other cases: scored again
    saved["scores"][1] = saved["scores"][1][:3]
    (out / "heads.json").write_text(json.dumps(saved))
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err
    assert "heads.json: does not hold one row of numbers per layer" in err and "to score the heads again" in err
    (out / "heads.json").write_text(json.dumps({**saved, "kv_heads": "2"}))
    with pytest.raises(SystemExit):
        main(argv)
    assert "kv_heads" in capsys.readouterr().err


def test_an_encoder_and_a_case_past_a_table_of_positions_are_refused_before_any_case_runs(data, tmp_path):  # noqa: F811
    run = dict(data=str(data / "passages.jsonl"), out=str(tmp_path / "h"))
    with pytest.raises(ValueError, match="encoder is an encoder: the needle cases ask a decoder to answer"):
        hd.run_heads(HeadsConfig(str(data / "encoder"), **run))
    with pytest.raises(ValueError, match="--length 4096 is longer than the 64 positions this model reads"):
        hd.run_heads(HeadsConfig(str(data / "decoder"), **run))

"""subquad.hf in models whose attention modules carry no ``layer_idx`` (DistilBERT, ViT, CLIP,
ALBERT, whose one module serves every layer): found by the code that calls transformers'
attention interface, numbered by their order, each tower of a two-tower model by its own heads.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")
hf = pytest.importorskip("subquad.hf")

from transformers import (  # noqa: E402
    AlbertConfig,
    AlbertModel,
    CLIPConfig,
    CLIPModel,
    CLIPTextConfig,
    CLIPTextModel,
    DistilBertConfig,
    DistilBertModel,
    ViTConfig,
    ViTModel,
)

SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def distilbert():
    torch.manual_seed(0)
    return DistilBertModel(DistilBertConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, hidden_dim=64)).eval()


def clip_text():
    torch.manual_seed(0)
    return CLIPTextModel(CLIPTextConfig(vocab_size=96, max_position_embeddings=32, **SIZES)).eval()


def albert():
    torch.manual_seed(0)
    return AlbertModel(AlbertConfig(vocab_size=96, embedding_size=16, **SIZES)).eval()


def vit():
    torch.manual_seed(0)
    return ViTModel(ViTConfig(image_size=32, patch_size=8, **SIZES)).eval()


TEXT = {"distilbert": distilbert, "clip_text": clip_text, "albert": albert}


def text_inputs():
    ids = torch.randint(3, 96, (3, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 14:], mask[2, 8:] = 0, 0
    return ids, mask


def hidden(model, **inputs):
    with torch.no_grad():
        return model(**inputs).last_hidden_state


@pytest.mark.parametrize("name", list(TEXT))
def test_a_window_covering_every_key_equals_the_model_and_a_padded_batch_equals_each_row_alone(name):
    model = TEXT[name]()
    ids, mask = text_inputs()
    reference = hidden(model, input_ids=ids, attention_mask=mask)
    real = mask.bool()
    hf.use(model, "local", window=64)
    torch.testing.assert_close(hidden(model, input_ids=ids, attention_mask=mask)[real], reference[real])
    hf.use(model, "local", window=3, sinks=1)
    batch = hidden(model, input_ids=ids, attention_mask=mask)
    assert (batch[real] - reference[real]).abs().max() > 1e-3  # the window cuts through: another answer
    for b in range(3):
        alone = hidden(model, input_ids=ids[b : b + 1, real[b]])
        torch.testing.assert_close(batch[b, real[b]], alone[0], rtol=1e-5, atol=1e-5)


def test_clip_s_text_tower_stays_causal_and_its_vision_tower_does_not():
    model = clip_text()
    hf.use(model, "local", window=3)
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(2))
    edited = ids.clone()
    edited[0, 9] = 5 if ids[0, 9] != 5 else 6
    a, b = hidden(model, input_ids=ids), hidden(model, input_ids=edited)
    assert torch.equal(a[:, :9], b[:, :9]) and not torch.equal(a[:, 9:], b[:, 9:])
    image = vit()
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    reference = hidden(image, pixel_values=pixels)
    hf.use(image, "full")
    torch.testing.assert_close(hidden(image, pixel_values=pixels), reference)
    hf.use(image, "local", window=2)  # the class token, then 16 patches: two layers reach 2 positions on
    later = pixels.clone()
    later[..., :8, 8:16] += 1.0  # the second patch, at position 2: after the class token, which reads it
    assert not torch.equal(hidden(image, pixel_values=pixels)[:, 0], hidden(image, pixel_values=later)[:, 0])


def test_modules_without_layer_idx_are_numbered_in_order_seeded_apart_and_saved_by_that_number(tmp_path):
    model = hf.convert(vit(), "multires", freeze=False)  # its router: new weights, seeded by the layer
    modules = hf.attention_modules(model)
    assert [m.subquad_layer for m in modules] == [0, 1]
    routers = [next(m.subquad_inputs.parameters()) for m in modules]
    assert not torch.equal(routers[0], routers[1])  # each layer's own seed
    with torch.no_grad():
        routers[1].add_(0.25)  # as if trained
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    expected = hidden(model, pixel_values=pixels)
    hf.save(model, tmp_path / "vit")
    assert set(hf.saved_layers(tmp_path / "vit")) == {0, 1}
    loaded = hf.from_pretrained(tmp_path / "vit")
    assert torch.equal(hidden(loaded, pixel_values=pixels), expected)
    hf.restore(model)
    assert not any(hasattr(m, "subquad_layer") for m in modules)


def test_use_chooses_unnumbered_layers_by_their_order():
    model = distilbert()
    hf.use(model, "local", window=2, layers=[1])
    chosen = [getattr(m, "subquad_attention", None) is not None for m in hf.attention_modules(model)]
    assert chosen == [False, True]
    with pytest.raises(ValueError, match=r"has no layer \[2\]; its layers are 0..1"):
        hf.use(model, "local", layers=[2])


def test_albert_s_one_module_for_every_layer_is_layer_0():
    model = albert()
    assert len(hf.attention_modules(model)) == 1
    hf.use(model, "local", window=2, layers=[0])
    assert hf.attention_modules(model)[0].subquad_layer == 0


def test_each_tower_of_a_two_tower_model_gets_its_own_heads():
    text = dict(vocab_size=96, max_position_embeddings=32, hidden_size=32, num_hidden_layers=1,
                num_attention_heads=4, intermediate_size=64)  # fmt: skip
    vision = dict(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64)  # fmt: skip
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).eval()
    hf.convert(model, "linear", feature_map="hedgehog")
    sizes = {m.config.hidden_size: m.subquad_state for m in hf.attention_modules(model)}
    # hedgehog's maps are per head, of the head's size: 4 heads of 8 (text), 2 heads of 24 (vision)
    assert next(tuple(p.shape[:2]) for p in sizes[32].parameters()) == (4, 8)
    assert next(tuple(p.shape[:2]) for p in sizes[48].parameters()) == (2, 24)
    ids = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=torch.randn(1, 3, 32, 32))
    assert torch.isfinite(out.logits_per_image).all()


def test_a_vision_language_model_keeps_its_numbered_decoder_layers_and_its_vision_tower_exact():
    """LLaVA: the decoder's modules carry layer_idx, the CLIP vision tower's do not; as before the
    numbering, only the decoder's layers are driven."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64)  # fmt: skip
    text = LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=64)  # fmt: skip
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=127))
    model.eval()
    ids = torch.randint(3, 120, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    hf.use(model, "full")
    modules = hf.attention_modules(model)
    assert [type(m).__name__ for m in modules] == ["LlamaAttention"] * 2
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference)


def test_a_head_mix_is_refused_where_a_tower_has_other_heads():
    text = dict(vocab_size=96, max_position_embeddings=32, hidden_size=32, num_hidden_layers=1,
                num_attention_heads=4, intermediate_size=64)  # fmt: skip
    vision = dict(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64)  # fmt: skip
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).eval()
    with pytest.raises(ValueError, match=r"splits 4 query heads, but layer 1 \(CLIPAttention\) has 2"):
        hf.use(model, "local:window=2*2+full*2")  # layer 0: the text tower (4 heads), 1: the vision tower
    assert not any(hasattr(m, "subquad_attention") for m in hf.attention_modules(model))  # nothing half set


def test_restore_after_convert_gives_back_the_weights_it_froze():
    model = distilbert()
    model.embeddings.word_embeddings.weight.requires_grad_(False)  # the user's own choice: kept
    hf.convert(model, "linear", feature_map="hedgehog")
    hf.convert(model, "linear", feature_map="hedgehog")  # twice: the first call's record stands
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".subquad_" not in n)
    hf.restore(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters()} - {"embeddings.word_embeddings.weight"}

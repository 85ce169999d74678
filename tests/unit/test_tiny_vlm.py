"""The tiny VLM fixtures (tests/helpers/tiny_vlm.py): each folder loads in transformers, its
outputs depend on the image, and ``expand_count`` gives exactly the placeholder count the
transformers model accepts (it raises on any other count)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_vlm
from tests.helpers.tiny_vlm import VLM_KINDS, expand_count, hf_vlm_greedy, load_images_for_test

_ARCH = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made: dict[str, str] = {}

    def get(kind: str, **overrides) -> str:
        key = kind + "".join(f"-{k}={v}" for k, v in sorted(overrides.items()))
        if key not in made:
            made[key] = tiny_vlm.save_tiny_vlm(kind, tmp_path_factory.mktemp(key), **overrides)
        return made[key]

    return get


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _chat_prompt(path: str, n_images: int = 1) -> list[int]:
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": "What is in the picture?"}]
    tok = _tokenizer(path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def _raw_inputs(path: str, ids: list[int], images) -> dict:
    """Model inputs for ``ids`` exactly as given (no expansion)."""
    inputs = tiny_vlm.load_image_processor(path)(images=images, return_tensors="pt")
    t = torch.tensor([ids])
    inputs = dict(inputs, input_ids=t, attention_mask=torch.ones_like(t))
    if "image_grid_thw" in inputs:
        inputs["mm_token_type_ids"] = (t == tiny_vlm.load_config(path).image_token_id).int()
    return inputs


@pytest.mark.parametrize("kind", VLM_KINDS)
def test_folder_loads_in_transformers(kind, folders):
    from transformers import AutoConfig, AutoImageProcessor

    path = folders(kind)
    files = {p.name for p in Path(path).iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "preprocessor_config.json"} <= files
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= files
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == kind and config.architectures == [_ARCH[kind]]
    tok = _tokenizer(path)
    text = config.text_config
    assert text.vocab_size == len(tok) and (text.bos_token_id, text.eos_token_id) == (1, 2)
    assert (text.hidden_size, text.num_hidden_layers, text.num_key_value_heads) == (64, 2, 2)
    placeholder = tiny_vlm.placeholder_token(kind)
    assert tok.convert_tokens_to_ids(placeholder) == config.image_token_id
    assert tok(placeholder, add_special_tokens=False)["input_ids"] == [config.image_token_id]
    if kind.startswith("qwen"):
        assert text.rope_parameters["mrope_section"] == [2, 3, 3]
        assert sum(text.rope_parameters["mrope_section"]) * 2 == text.hidden_size // text.num_attention_heads
        assert tok.convert_tokens_to_ids("<|vision_start|>") == config.vision_start_token_id
    else:
        assert config.vision_feature_layer == -2 and config.vision_feature_select_strategy == "default"
    assert "Pil" in type(AutoImageProcessor.from_pretrained(path)).__name__
    gen = json.loads((Path(path) / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


@pytest.mark.parametrize("kind", VLM_KINDS)
def test_chat_template_renders_one_placeholder_per_image(kind, folders):
    path = folders(kind)
    tok = _tokenizer(path)
    image_id = tok.convert_tokens_to_ids(tiny_vlm.placeholder_token(kind))
    parts = [
        {"type": "text", "text": "Compare "},
        {"type": "image"},
        {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": "data:"}},
    ]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": "Both are noise."}]
    text = tok.apply_chat_template(messages, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(image_id) == 2
    if kind.startswith("qwen"):
        assert text == (
            "<|im_start|>user\nCompare <|vision_start|><|image_pad|><|vision_end|> and "
            "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
            "<|im_start|>assistant\nBoth are noise.<|im_end|>\n"
        )
    else:
        assert text == "USER: Compare <image>\n and <image>\n ASSISTANT: Both are noise. "
    plain = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert plain.endswith("<|im_start|>assistant\n" if kind.startswith("qwen") else "USER: Hi ASSISTANT:")


@pytest.mark.parametrize("kind", VLM_KINDS)
def test_greedy_output_depends_on_the_image(kind, folders):
    path = folders(kind)
    prompt = _chat_prompt(path)
    a, b = load_images_for_test(2, seed=3)
    out_a = hf_vlm_greedy(path, prompt, [a], 8)
    out_b = hf_vlm_greedy(path, prompt, [b], 8)
    assert len(out_a) == len(out_b) == 8
    assert out_a != out_b
    assert hf_vlm_greedy(path, prompt, [a], 8) == out_a
    if kind.startswith("qwen"):  # the reference ran M-RoPE (image tokens share positions)
        assert int(tiny_vlm.load_hf_vlm(path).model.rope_deltas.flatten()[0]) < 0


@pytest.mark.parametrize("kind", VLM_KINDS)
def test_expand_count_is_what_the_model_accepts(kind, folders):
    path = folders(kind)
    image_id = tiny_vlm.load_config(path).image_token_id
    model = tiny_vlm.load_hf_vlm(path)
    images = load_images_for_test(3, seed=5)
    counts = expand_count(path, images)
    assert all(c > 4 for c in counts)
    with torch.inference_mode():
        for image, n in zip(images, counts):  # one image at a time: the model checks the total
            for delta in (-1, 1):
                with pytest.raises(ValueError, match="do not match"):
                    model(**_raw_inputs(path, [5] + [image_id] * (n + delta) + [6], [image]))
        ids = [5]
        for n in counts:
            ids += [image_id] * n + [6]
        logits = model(**_raw_inputs(path, ids, images)).logits
    assert logits.shape[1] == len(ids)
    assert torch.allclose(
        logits[0], tiny_vlm.hf_vlm_logits(path, [5, image_id, 6, image_id, 6, image_id, 6], images)
    )
    assert tiny_vlm.expand_prompt(path, [5, image_id, 6, image_id, 6, image_id, 6], images) == ids


# placeholder counts of the default images (100x80, 64x96, 120x120), worked out by hand:
# Qwen: smart_resize to 112x140 / 140x112 / 112x112 pixels -> 8x10 / 10x8 / 8x8 patches -> / 2x2;
# LLaVA-1.5: (84 / 14)^2; LLaVA-NeXT: best pinpoint 112x112 (2x2 tiles of 4x4 patches), the 8x8
# grid unpadded to 6x8 / 8x6 / 8x8, + one newline per row, + 16 base-image tokens
_EXPECTED_COUNTS = {
    "qwen2_vl": [20, 20, 16],
    "qwen2_5_vl": [20, 20, 16],
    "llava": [36, 36, 36],
    "llava_next": [70, 72, 88],
}


@pytest.mark.parametrize("kind", VLM_KINDS)
def test_expand_count_of_the_default_sizes(kind, folders):
    assert expand_count(folders(kind), load_images_for_test(3, seed=0)) == _EXPECTED_COUNTS[kind]


def test_load_images_for_test_is_deterministic():
    images = load_images_for_test(3, seed=0)
    assert [im.size for im in images] == [(100, 80), (64, 96), (120, 120)]
    assert [im.size for im in load_images_for_test(2, 1, sizes=[(30, 40)])] == [(30, 40)] * 2
    assert all(a.tobytes() == b.tobytes() for a, b in zip(images, load_images_for_test(3, seed=0))), (
        "not deterministic"
    )
    assert images[0].tobytes() != load_images_for_test(1, seed=1)[0].tobytes()


def test_llava_full_feature_strategy_keeps_the_cls_token(folders):
    default, full = folders("llava"), folders("llava", vision_feature_select_strategy="full")
    assert tiny_vlm.load_config(full).vision_feature_select_strategy == "full"
    images = load_images_for_test(2, seed=7)
    assert expand_count(full, images) == [n + 1 for n in expand_count(default, images)] == [37, 37]
    prompt = _chat_prompt(full, n_images=2)
    assert len(hf_vlm_greedy(full, prompt, images, 3)) == 3  # the model accepts the count


def test_llava_next_rejects_the_full_strategy(tmp_path):
    # transformers' LLaVA-NeXT cannot pack anyres tiles that keep the CLS token
    with pytest.raises(ValueError, match="only vision_feature_select_strategy='default'"):
        tiny_vlm.save_tiny_vlm("llava_next", tmp_path, vision_feature_select_strategy="full")


def test_qwen2_5_vl_tower_attends_in_padded_windows(folders):
    from transformers.vision_utils import get_vision_window_index

    path = folders("qwen2_5_vl")
    vision = tiny_vlm.load_config(path).vision_config
    assert vision.fullatt_block_indexes == [1]  # block 0 windowed, block 1 full
    inputs = tiny_vlm.load_image_processor(path)(images=load_images_for_test(1, seed=0), return_tensors="pt")
    grid = inputs["image_grid_thw"]
    assert grid.tolist() == [[1, 8, 10]]  # 4x5 merged: 2x2-merged windows leave a half column
    _, cu = get_vision_window_index(grid, vision.spatial_merge_size, vision.window_size, vision.patch_size)
    sizes = torch.as_tensor(cu).diff().tolist()
    assert sizes == [16, 16, 8, 16, 16, 8]  # patches per window (a merged token is 2x2 patches)
    visual = tiny_vlm.load_hf_vlm(path).model.visual
    with torch.inference_mode():
        windowed = visual(inputs["pixel_values"], grid_thw=grid).pooler_output
        visual.window_size = 10**4  # one window: block 0 attends to everything
        try:
            whole = visual(inputs["pixel_values"], grid_thw=grid).pooler_output
        finally:
            visual.window_size = vision.window_size
    assert windowed.shape == whole.shape == (20, 64)
    assert not torch.allclose(windowed, whole, atol=1e-3)

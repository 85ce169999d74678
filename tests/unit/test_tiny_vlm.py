"""The tiny VLM fixtures (tests/helpers/tiny_vlm.py): each folder loads in transformers, its
outputs depend on the image, and ``expand_count`` gives exactly the placeholder count the
transformers model accepts (it raises on any other count). Gemma 3: its tokenizer works with
transformers' ``Gemma3Processor``, the id-level expansion is the processor's where the text around
an image tokenizes alike, the bidirectional image attention (``token_type_ids``) and the sliding
window change transformers' outputs, and greedy continuations vary and have clear top-2 margins."""

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
    "gemma3": "Gemma3ForConditionalGeneration",
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
    config = tiny_vlm.load_config(path)
    if "image_grid_thw" in inputs:
        inputs["mm_token_type_ids"] = (t == config.image_token_id).int()
    if config.model_type == "gemma3":
        del inputs["num_crops"]
        inputs["token_type_ids"] = (t == config.image_token_id).long()
    return inputs


def _image_wrap(path: str) -> tuple[list[int], list[int]]:
    """The ids around an image's expanded tokens: Gemma 3's ids("\n\n") + [boi] / [eoi] +
    ids("\n\n"); nothing for the other kinds."""
    config = tiny_vlm.load_config(path)
    if config.model_type != "gemma3":
        return [], []
    nl = _tokenizer(path).encode("\n\n", add_special_tokens=False)
    return [*nl, config.boi_token_id], [config.eoi_token_id, *nl]


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
    placeholder_id = config.boi_token_id if kind == "gemma3" else config.image_token_id
    assert tok.convert_tokens_to_ids(placeholder) == placeholder_id
    assert tok(placeholder, add_special_tokens=False)["input_ids"] == [placeholder_id]
    if kind == "gemma3":
        assert text.layer_types == ["sliding_attention", "full_attention"] and text.sliding_window == 24
        assert (text.head_dim, text.query_pre_attn_scalar, text.pad_token_id) == (16, 16, 2)
        assert config.mm_tokens_per_image == 16 and config.tie_word_embeddings
        assert (config.vision_config.image_size, config.vision_config.patch_size) == (64, 8)
    elif kind.startswith("qwen"):
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
    elif kind == "gemma3":
        assert text == (
            "<start_of_turn>user\nCompare <start_of_image> and <start_of_image><end_of_turn>\n"
            "<start_of_turn>model\nBoth are noise.<end_of_turn>\n"
        )
    else:
        assert text == "USER: Compare <image>\n and <image>\n ASSISTANT: Both are noise. "
    plain = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    ending = {"gemma3": "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"}
    default = "<|im_start|>assistant\n" if kind.startswith("qwen") else "USER: Hi ASSISTANT:"
    assert plain.endswith(ending.get(kind, default))


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
    placeholder = _tokenizer(path).convert_tokens_to_ids(tiny_vlm.placeholder_token(kind))
    before, after = _image_wrap(path)
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
            ids += before + [image_id] * n + after + [6]
        logits = model(**_raw_inputs(path, ids, images)).logits
    assert logits.shape[1] == len(ids)
    prompt = [5, placeholder, 6, placeholder, 6, placeholder, 6]
    assert torch.allclose(logits[0], tiny_vlm.hf_vlm_logits(path, prompt, images))
    assert tiny_vlm.expand_prompt(path, prompt, images) == ids


# placeholder counts of the default images (100x80, 64x96, 120x120), worked out by hand:
# Qwen: smart_resize to 112x140 / 140x112 / 112x112 pixels -> 8x10 / 10x8 / 8x8 patches -> / 2x2;
# LLaVA-1.5: (84 / 14)^2; LLaVA-NeXT: best pinpoint 112x112 (2x2 tiles of 4x4 patches), the 8x8
# grid unpadded to 6x8 / 8x6 / 8x8, + one newline per row, + 16 base-image tokens; Gemma 3:
# 64x64 -> 8x8 patches pooled 2x2 (soft tokens; boi, eoi and the "\n\n"s come on top)
_EXPECTED_COUNTS = {
    "qwen2_vl": [20, 20, 16],
    "qwen2_5_vl": [20, 20, 16],
    "llava": [36, 36, 36],
    "llava_next": [70, 72, 88],
    "gemma3": [16, 16, 16],
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


# ---------------------------------------------------------------- Gemma 3
def _chat_text(path: str, *parts: str | int) -> str:
    """One user message: str parts are text, int parts images."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
    return _tokenizer(path).apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


def _ids(path: str, text: str) -> list[int]:
    return _tokenizer(path)(text, add_special_tokens=False)["input_ids"]


def test_gemma3_tokenizer_names_the_image_tokens(folders):
    from transformers import AutoProcessor, Gemma3Processor

    path = folders("gemma3")
    tok, config = _tokenizer(path), tiny_vlm.load_config(path)
    assert (tok.boi_token, tok.image_token, tok.eoi_token) == tiny_vlm.GEMMA_TOKENS
    ids = (tok.boi_token_id, tok.image_token_id, tok.eoi_token_id)
    assert ids == (config.boi_token_id, config.image_token_id, config.eoi_token_id) == (49152, 49153, 49154)
    assert tok.encode("\n\n", add_special_tokens=False) == [1116]
    processor = Gemma3Processor(
        image_processor=tiny_vlm.load_image_processor(path), tokenizer=tok, image_seq_length=16
    )
    assert processor.full_image_sequence == (
        "\n\n<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>\n\n"
    )
    auto = AutoProcessor.from_pretrained(path)  # processor_config.json: 16, not Gemma3Processor's 256
    assert isinstance(auto, Gemma3Processor) and auto.image_seq_length == 16
    assert auto.full_image_sequence == processor.full_image_sequence


def test_gemma3_ties_lm_head_to_the_embeddings(folders):
    from safetensors import safe_open

    path = folders("gemma3")
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "lm_head" in k]
    model = tiny_vlm.load_hf_vlm(path)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    built = tiny_vlm.build_tiny_vlm("gemma3").state_dict()
    loaded = model.state_dict()
    assert built.keys() == loaded.keys() and all(torch.equal(built[k], loaded[k]) for k in built)


def test_gemma3_id_expansion_is_the_processors_where_the_text_allows(folders):
    path = folders("gemma3")
    config = tiny_vlm.load_config(path)
    images = load_images_for_test(2, seed=1)
    # "\n\n" stays a token of its own next to "Compare" and " with", so both ways agree
    text = "Compare<start_of_image> with<start_of_image> please"
    ref = tiny_vlm.hf_text_inputs(path, text, images)
    assert set(ref) == {"input_ids", "attention_mask", "pixel_values", "token_type_ids"}
    ours = tiny_vlm.hf_vlm_inputs(path, _ids(path, text), images)
    assert set(ours) == set(ref) and all(torch.equal(ours[k], ref[k]) for k in ref)
    assert ref["token_type_ids"].sum() == 32 and ref["pixel_values"].shape == (2, 3, 64, 64)
    # a chat prompt: the processor's BPE merges "\n\n" with its neighbours ("user\n" + "\n\n" is
    # one token, "\n\nWhich" three), so its ids differ from the id-level expansion
    chat = _chat_text(path, 0, "Compare", 1, "Which is brighter?")
    ref_ids = tiny_vlm.hf_text_inputs(path, chat, images)["input_ids"][0].tolist()
    ids = tiny_vlm.expand_prompt(path, _ids(path, chat), images)
    soft, eoi = config.image_token_id, config.eoi_token_id
    assert ref_ids.count(soft) == ids.count(soft) == 32 and ref_ids != ids
    after_image = ref_ids.index(eoi) + 1
    assert ids[ids.index(eoi) + 1] == 1116 and ref_ids[after_image : after_image + 2] == [198, 198]


def test_gemma3_token_type_ids_make_image_attention_bidirectional(folders):
    path = folders("gemma3")
    model = tiny_vlm.load_hf_vlm(path)
    prompt = _ids(path, _chat_text(path, "What is in the picture?", 0))
    image = load_images_for_test(1, seed=3)
    inputs = tiny_vlm.hf_vlm_inputs(path, prompt, image)
    types = inputs["token_type_ids"][0]
    assert torch.equal(types.bool(), inputs["input_ids"][0] == tiny_vlm.load_config(path).image_token_id)
    first = int(types.nonzero()[0])
    causal = {k: v for k, v in inputs.items() if k != "token_type_ids"}
    with torch.inference_mode():
        diff = (model(**inputs).logits[0] - model(**causal).logits[0]).abs().amax(-1)
    assert diff[:first].max() == 0  # nothing before the image changes ...
    assert diff[first:].min() > 1e-2  # ... everything from it on does
    out = tiny_vlm.hf_vlm_greedy(path, prompt, image, 16)
    assert out != tiny_vlm.hf_greedy_from_inputs(model, causal, 16)


def test_gemma3_sliding_window_cuts_in(folders):
    path = folders("gemma3")
    model = tiny_vlm.load_hf_vlm(path)
    inputs = tiny_vlm.hf_vlm_inputs(path, _chat_prompt(path), load_images_for_test(1, seed=3))
    text = model.config.text_config
    window = text.sliding_window
    assert window == 24 and inputs["input_ids"].shape[1] > 2 * window
    with torch.inference_mode():
        windowed = model(**inputs).logits[0]
        text.sliding_window = 10**4
        try:
            whole = model(**inputs).logits[0]
        finally:
            text.sliding_window = window
    diff = (windowed - whole).abs().amax(-1)
    first = int(inputs["token_type_ids"][0].nonzero()[0])
    # a token sees itself and the 23 before it in layer 0; the image's first tokens see its
    # last ones, which lose the prompt's start
    assert diff[: min(first, window)].max() == 0
    assert (diff[window:] > 0).all()  # 24 loses only the prompt's first token: a small change
    assert diff[window + 1 :].min() > 1e-2


def test_gemma3_greedy_varies_and_has_clear_margins(folders):
    """Continuations are not one token repeated, depend on the image, and every step's top-2
    logits stay more than 1e-3 apart (float32), for id-level and text-level prompts."""
    path = folders("gemma3")
    model = tiny_vlm.load_hf_vlm(path)
    a, b = load_images_for_test(2, seed=3)
    one, two = _chat_text(path, "Describe", 0, "briefly."), _chat_text(path, "Compare", 0, "with", 1, "?")
    cases = [(one, [a]), (one, [b]), (two, [a, b]), (two, [b, a]), (_chat_text(path, "Hello there!"), [])]
    outs = []
    for text, images in cases:
        for inputs in (tiny_vlm.hf_vlm_inputs(path, _ids(path, text), images),) + (
            (tiny_vlm.hf_text_inputs(path, text, images),) if images else ()
        ):
            out = tiny_vlm.hf_greedy_from_inputs(model, inputs, 16)
            assert len(set(out)) >= 8, out
            n = inputs["input_ids"].shape[1]
            full = dict(inputs, input_ids=torch.cat([inputs["input_ids"], torch.tensor([out[:-1]])], 1))
            full["attention_mask"] = torch.ones_like(full["input_ids"])
            if "token_type_ids" in inputs:
                pad = torch.zeros(1, len(out) - 1, dtype=torch.long)
                full["token_type_ids"] = torch.cat([inputs["token_type_ids"], pad], 1)
            with torch.inference_mode():
                logits = model(**full).logits[0, n - 1 :]
            assert logits.argmax(-1).tolist() == out
            top2 = logits.topk(2, dim=-1).values
            assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
            outs.append(out)
    assert outs[0] != outs[2] and outs[1] != outs[3]  # image a vs b (ids, text)
    assert outs[4] != outs[6] and outs[5] != outs[7]  # images (a, b) vs (b, a)
    assert tiny_vlm.hf_text_greedy(path, two, [a, b], 16) == outs[5]

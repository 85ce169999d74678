"""Tiny random-weight vision-language models (HF directories) and transformers references.

``save_tiny_vlm(kind, path)`` writes a folder that transformers loads (``AutoConfig``, the
model class, ``AutoImageProcessor``, ``AutoTokenizer``): config.json, model.safetensors,
generation_config.json, the SmolLM2 tokenizer plus the image special tokens,
preprocessor_config.json (small images) and chat_template.jinja. Kinds (``VLM_KINDS``):

    qwen2_vl    Qwen2VLForConditionalGeneration: ViT depth 2 (embed 32, patch 14, temporal
                patch 2, merge 2), M-RoPE mrope_section [2, 3, 3] (head_dim 16); images resized
                to 16..64 merged tokens (min/max_pixels 28*28*16 / 28*28*64)
    qwen2_5_vl  Qwen2_5_VLForConditionalGeneration: RMSNorm + gated-MLP ViT, window_size 56
                (windows of 2x2 merged patches: the 100x80 image's 4x5 merged grid needs a
                padded window column),
                fullatt_block_indexes [1] (block 0 windowed, block 1 full)
    llava       LlavaForConditionalGeneration (LLaVA-1.5): CLIP tower 84/14 (36 image tokens
                with strategy "default", 37 with "full"), feature layer -2, Llama text model
    llava_next  LlavaNextForConditionalGeneration: CLIP tower 56/14, grid pinpoints
                56x56 .. 112x112 (anyres: base 16 tokens + the unpadded grid and its newlines)
    gemma3      Gemma3ForConditionalGeneration: SigLIP tower 64/8 (8x8 patches, no head), the
                projector's 2x2 average pool -> mm_tokens_per_image 16; Gemma 3 text model
                (head_dim 16, query_pre_attn_scalar 16, layer 0 sliding window 24, layer 1 full,
                tied embeddings scaled by sqrt(64)); every image squashed to 64x64 (no pan and
                scan); tokens <start_of_image> (boi) / <image_soft_token> / <end_of_image> (eoi),
                named on the tokenizer as Gemma3Processor wants them

The text model is tiny (hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128; vocab =
len(tokenizer); bos 1 / eos 2 as in SmolLM2). Weights are ``tiny_models.randomize_``'s O(1)
draws, plus norm weights around 1 and convolutions scaled by their real fan-in, so the image
features reach the logits and two images give different greedy continuations (Gemma 3's norms
and projector are tuned further: ``randomize_vlm_``).

The image placeholder is one token per image in a prompt (``placeholder_token(kind)``:
``<|image_pad|>`` for Qwen, ``<image>`` for LLaVA, ``<start_of_image>`` for Gemma 3);
``expand_count`` says how many copies (Gemma 3: soft tokens) each image takes and
``hf_vlm_greedy`` / ``hf_vlm_logits`` expand it and run transformers. Gemma 3 expands each
``<start_of_image>`` to "\n\n<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>\n\n":
transformers' ``Gemma3Processor`` does it on the text before tokenizing (``hf_text_inputs`` /
``hf_text_greedy``), ``expand_prompt`` on token ids; the two differ where SmolLM2's BPE merges
the "\n\n" with its neighbours (a chat prompt's "<end_of_image>\n\nWhich" or "user\n\n\n").
Gemma 3's references pass ``token_type_ids`` (1 on the soft tokens), so transformers attends
both ways within each image.
"""

from __future__ import annotations

import copy
import json
import math
import os
from functools import cache
from pathlib import Path

import numpy as np
import torch

from tests.helpers.hf_reference import REF_THREADS
from tests.helpers.threads import torch_threads
from tests.helpers.tiny_models import randomize_

VLM_KINDS = ("qwen2_vl", "qwen2_5_vl", "llava", "llava_next", "gemma3")

QWEN_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
LLAVA_TOKEN = "<image>"
GEMMA_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")  # boi, image (soft), eoi
DEFAULT_SIZES = ((100, 80), (64, 96), (120, 120))  # PIL (width, height)

_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
_TEXT.update(
    num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2
)
_CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=14)
_QWEN_MIN_PIXELS = 28 * 28 * 16
_QWEN_MAX_PIXELS = 28 * 28 * 64
_NEXT_PINPOINTS = [[56, 56], [56, 112], [112, 56], [112, 112]]
# Gemma 3: head_dim 16 (query_pre_attn_scalar 16: scores scaled by 1/4), layer 0 sliding (a window
# of 24 tokens: each token sees itself and the 23 before it), layer 1 full; rope at the defaults
# (theta 10^6 full, 10^4 sliding); SigLIP 64/8 (8x8 patches) average-pooled 2x2 to 16 tokens
_GEMMA_TEXT = dict(_TEXT, head_dim=16, query_pre_attn_scalar=16, sliding_window=24, pad_token_id=2)
_GEMMA_TEXT.update(layer_types=["sliding_attention", "full_attention"])
_SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
_SIGLIP.update(image_size=64, patch_size=8, vision_use_head=False)
_GEMMA_MM_TOKENS = 16

# ChatML; a message's content is a string or a list of {"type": "text", "text"} /
# {"type": "image" | "image_url"} parts (written for trim_blocks / lstrip_blocks: all output
# comes from {{ }} expressions, so block whitespace never leaks)
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ['image', 'image_url'] %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# LLaVA-1.5 style: "USER: <image>\nWhat is this? ASSISTANT: It is ... "; a system message
# opens the prompt as plain text
LLAVA_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- 'USER: ' }}"
    "{%- elif message['role'] == 'assistant' %}{{- 'ASSISTANT: ' }}{%- endif %}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ['image', 'image_url'] %}{{- '<image>\\n' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- ' ' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'ASSISTANT:' }}{%- endif %}"
)

# Gemma style turns ("<start_of_turn>user\n...<end_of_turn>\n", the assistant's role is "model");
# an image part is "<start_of_image>", which the processor expands (``GEMMA_TOKENS``)
GEMMA_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ['image', 'image_url'] %}{{- '<start_of_image>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)


def _check_kind(kind: str) -> None:
    if kind not in VLM_KINDS:
        raise ValueError(f"unknown tiny VLM kind {kind!r}; use one of {VLM_KINDS}")


def placeholder_token(kind: str) -> str:
    """The one token a prompt holds per image (expanded to ``expand_count`` copies; Gemma 3's
    ``<start_of_image>`` to its soft tokens wrapped in text, see ``expand_prompt``)."""
    _check_kind(kind)
    if kind == "gemma3":
        return GEMMA_TOKENS[0]
    return QWEN_TOKENS[1] if kind.startswith("qwen") else LLAVA_TOKEN


def image_special_tokens(kind: str) -> tuple[str, ...]:
    _check_kind(kind)
    if kind == "gemma3":
        return GEMMA_TOKENS
    return QWEN_TOKENS if kind.startswith("qwen") else (LLAVA_TOKEN,)


# ---------------------------------------------------------------- configs
@cache
def _base_tokenizer():
    from tests.helpers.hf_reference import load_default_tokenizer

    return load_default_tokenizer()


def vlm_tokenizer(kind: str):
    """SmolLM2's tokenizer with ``kind``'s image tokens added as special tokens (new ids at the
    end: 49152, ...) and ``kind``'s chat template. Gemma 3's are also named (``boi_token``,
    ``image_token``, ``eoi_token`` and their ``*_id``s, as ``Gemma3Processor`` reads them): saved
    as top-level keys of tokenizer_config.json, which ``AutoTokenizer`` loads back as named tokens."""
    tok = copy.deepcopy(_base_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": list(image_special_tokens(kind))})
    if kind == "gemma3":
        boi, image, eoi = GEMMA_TOKENS
        # transformers 5's hook for named model-specific special tokens (what loading a
        # tokenizer_config.json with "boi_token" ... calls); add_special_tokens takes only the standard names
        tok._set_model_specific_special_tokens({"boi_token": boi, "image_token": image, "eoi_token": eoi})
        tok.chat_template = GEMMA_CHAT_TEMPLATE
    else:
        tok.chat_template = QWEN_CHAT_TEMPLATE if kind.startswith("qwen") else LLAVA_CHAT_TEMPLATE
    return tok


def tiny_vlm_config(kind: str, tokenizer, **overrides):
    """The transformers config of a tiny ``kind`` VLM whose ids come from ``tokenizer``.
    ``overrides`` set top-level config fields (e.g. ``vision_feature_select_strategy="full"``)."""
    _check_kind(kind)
    text = dict(_TEXT, vocab_size=len(tokenizer))
    if kind.startswith("qwen"):
        start, pad, end, video = tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS))
        text.update(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, rope_theta=1000000.0)
        ids = dict(
            image_token_id=pad, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end
        )
        if kind == "qwen2_vl":
            from transformers import Qwen2VLConfig as cls

            vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
        else:
            from transformers import Qwen2_5_VLConfig as cls

            vision = dict(
                depth=2,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=64,
                window_size=56,
                fullatt_block_indexes=[1],
            )
        vision.update(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        fields = dict(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    elif kind == "gemma3":
        from transformers import Gemma3Config as cls
        from transformers import Gemma3TextConfig, SiglipVisionConfig

        boi, image, eoi = tokenizer.convert_tokens_to_ids(list(GEMMA_TOKENS))
        fields = dict(
            text_config=Gemma3TextConfig(**dict(_GEMMA_TEXT, vocab_size=len(tokenizer))),
            vision_config=SiglipVisionConfig(**_SIGLIP),
            mm_tokens_per_image=_GEMMA_MM_TOKENS,
            boi_token_index=boi,
            image_token_index=image,
            eoi_token_index=eoi,
        )  # tie_word_embeddings: Gemma 3's default (True: lm_head is embed_tokens)
    else:
        from transformers import CLIPVisionConfig, LlamaConfig

        text_config = LlamaConfig(**text, tie_word_embeddings=False, rope_theta=10000.0)
        image_size = 84 if kind == "llava" else 56
        fields = dict(
            text_config=text_config,
            vision_config=CLIPVisionConfig(**_CLIP, image_size=image_size, projection_dim=32),
            image_token_index=tokenizer.convert_tokens_to_ids(LLAVA_TOKEN),
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
            projector_hidden_act="gelu",
            tie_word_embeddings=False,
        )
        if kind == "llava":
            from transformers import LlavaConfig as cls

            fields["image_seq_length"] = (image_size // _CLIP["patch_size"]) ** 2
        else:
            from transformers import LlavaNextConfig as cls

            fields.update(image_grid_pinpoints=_NEXT_PINPOINTS, image_seq_length=16)  # the base image
    fields.update(overrides)
    if kind == "llava_next" and fields["vision_feature_select_strategy"] != "default":
        # transformers' anyres packing reshapes each tile's features to a (side/patch)^2 grid:
        # with the CLS kept it fails, so no reference could be computed
        raise ValueError("llava_next supports only vision_feature_select_strategy='default'")
    return cls(**fields)  # save_pretrained writes ``architectures`` (the model class)


def tiny_image_processor(kind: str):
    """The PIL image processor of ``kind`` (transformers' torchvision ones need torchvision)."""
    _check_kind(kind)
    if kind.startswith("qwen"):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil(
            min_pixels=_QWEN_MIN_PIXELS, max_pixels=_QWEN_MAX_PIXELS, patch_size=14, merge_size=2
        )
    if kind == "gemma3":  # every image squashed to 64x64 (no pan and scan crops)
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        side = _SIGLIP["image_size"]
        return Gemma3ImageProcessorPil(size={"height": side, "width": side}, do_pan_and_scan=False)
    side = 84 if kind == "llava" else 56
    square = dict(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    if kind == "llava":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        return CLIPImageProcessorPil(**square)
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    return LlavaNextImageProcessorPil(**square, image_grid_pinpoints=_NEXT_PINPOINTS)


# ---------------------------------------------------------------- weights and folder
# Gemma 3's RMSNorm gains (the (1 + w) it multiplies by) by module name suffix; the rest ~ 1
_GEMMA_NORM_GAINS = {
    "post_attention_layernorm": 16.0,
    "post_feedforward_layernorm": 32.0,
    "q_norm": 3.0,
    "k_norm": 3.0,
    "language_model.norm": 4.0,
}


def _gemma_norm_gain(name: str) -> float:
    return next((g for suffix, g in _GEMMA_NORM_GAINS.items() if name.endswith(suffix)), 1.0)


def randomize_vlm_(model: torch.nn.Module, seed: int) -> None:
    """``randomize_``'s O(1) draws, then every norm weight ~ 1 + 0.2 N(0, 1) (the vision towers'
    ``norm1`` / ``ln_q`` / ``layer_norm1`` escape randomize_'s name rule) and every convolution
    scaled by its real fan-in (in_channels x kernel), not just the kernel's last side.

    Gemma 3 (tied embeddings; text embeddings scaled by sqrt(hidden) = 8) is tuned, since plain
    O(1) draws make every greedy continuation one token repeated (the tied ``lm_head`` reads the
    current token's own 8x embedding back out of the residual stream) and hide the image:

    - its RMSNorms multiply by (1 + w), so w is drawn as gain * (1 + 0.2 N(0, 1)) - 1, the gain
      (``_GEMMA_NORM_GAINS``) 16 after attention and 32 after the MLP (the sublayers outweigh the
      token's own embedding, so the next token depends on the context and varies), 3 on the
      queries and keys (sharper attention: it picks out image tokens and follows the new token),
      4 on the final norm (logits ~4x: top-2 margins ~4x wider), 1 elsewhere (the soft-embedding norm);
    - ``mm_input_projection_weight`` (a bare [vision hidden, text hidden] Parameter: randomize_
      divides by the wrong side) ~ N(0, 1) * sqrt(text hidden / vision hidden), so the image soft
      embeddings are as large as the scaled text embeddings.

    With them (seed 0) 16-token continuations rarely repeat a token, two images give two
    continuations, dropping ``token_type_ids`` (the bidirectional attention within an image)
    changes transformers' logits and mostly its greedy tokens, and the top-2 logit margins along
    the greedy continuations stay well above 1e-3 (tests/unit/test_tiny_vlm.py)."""
    randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    gemma = getattr(model.config, "model_type", None) == "gemma3"
    with torch.no_grad():
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.nn.Parameter):
                continue
            if "Norm" in type(module).__name__:
                noise = torch.randn(weight.shape, generator=gen)
                if gemma and type(module).__name__ == "Gemma3RMSNorm":
                    weight.copy_(_gemma_norm_gain(name) * (1.0 + 0.2 * noise) - 1.0)
                else:
                    weight.copy_(1.0 + 0.2 * noise)
            elif isinstance(module, torch.nn.modules.conv._ConvNd):
                fan_in = math.prod(weight.shape[1:])
                weight.copy_(torch.randn(weight.shape, generator=gen) / math.sqrt(fan_in))
        if gemma:
            proj = model.model.multi_modal_projector.mm_input_projection_weight
            vision_hidden, text_hidden = proj.shape
            proj.copy_(torch.randn(proj.shape, generator=gen) * math.sqrt(text_hidden / vision_hidden))


def build_tiny_vlm(kind: str, seed: int = 0, tokenizer=None, **overrides):
    """A transformers VLM (float32, eval) of ``kind`` with ``randomize_vlm_`` weights."""
    from transformers import AutoModelForImageTextToText

    tokenizer = tokenizer if tokenizer is not None else vlm_tokenizer(kind)
    config = tiny_vlm_config(kind, tokenizer, **overrides)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    randomize_vlm_(model, seed)
    model.generation_config.update(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return model.eval()


def save_tiny_vlm(kind: str, path: str | os.PathLike, seed: int = 0, **overrides) -> str:
    """Write the HF folder of a tiny ``kind`` VLM (module docstring) at ``path``; returns the path.
    ``overrides`` set top-level config fields (``vision_feature_select_strategy="full"``, ...).
    Gemma 3's also holds processor_config.json (image_seq_length = mm_tokens_per_image), as real
    checkpoints do, so ``AutoProcessor`` builds the right ``Gemma3Processor``."""
    path = str(path)
    tokenizer = vlm_tokenizer(kind)
    model = build_tiny_vlm(kind, seed, tokenizer=tokenizer, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    tiny_image_processor(kind).save_pretrained(path)
    if kind.startswith("qwen"):  # the keys real Qwen2-VL / Qwen2.5-VL checkpoints also carry
        cfg_path = Path(path) / "preprocessor_config.json"
        pre = json.loads(cfg_path.read_text())
        pre.update(min_pixels=_QWEN_MIN_PIXELS, max_pixels=_QWEN_MAX_PIXELS)
        cfg_path.write_text(json.dumps(pre, indent=2, sort_keys=True) + "\n")
    if kind == "gemma3":  # else AutoProcessor's Gemma3Processor expands an image to 256 soft tokens
        proc = {"image_seq_length": model.config.mm_tokens_per_image, "processor_class": "Gemma3Processor"}
        (Path(path) / "processor_config.json").write_text(json.dumps(proc, indent=2) + "\n")
    return path


def load_images_for_test(n: int, seed: int, sizes=None) -> list:
    """``n`` deterministic random RGB PIL images; sizes (width, height) cycle through ``sizes``
    (default ``DEFAULT_SIZES``). Smooth blobs over noise, so resizing keeps them distinct."""
    from PIL import Image

    sizes = list(sizes or DEFAULT_SIZES)
    rng = np.random.default_rng(seed)
    images = []
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        coarse = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
        base = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BILINEAR), dtype=np.int16)
        noise = rng.integers(-40, 41, size=(h, w, 3))
        images.append(Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8)))
    return images


# ---------------------------------------------------------------- transformers reference
def _folder_kind(path: str) -> str:
    model_type = json.loads((Path(path) / "config.json").read_text())["model_type"]
    _check_kind(model_type)
    return model_type


def load_config(path: str | os.PathLike):
    """The folder's transformers config (``AutoConfig``)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def load_image_processor(path: str | os.PathLike):
    """The folder's image processor: ``AutoImageProcessor`` falls back to the PIL class."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path)


def _next_counts(path: str, config, proc, images) -> list[int]:
    """LLaVA-NeXT counts from transformers' own processor (it builds without torchvision)."""
    from transformers import AutoTokenizer, LlavaNextProcessor

    strategy = config.vision_feature_select_strategy
    nxt = LlavaNextProcessor(
        image_processor=proc,
        tokenizer=AutoTokenizer.from_pretrained(path),
        patch_size=config.vision_config.patch_size,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=1,  # CLIP's CLS; "default" drops it again
    )
    side = config.vision_config.image_size
    counts = []
    for im in images:
        n = nxt._get_number_of_features(im.height, im.width, side, side)
        counts.append(n - 1 if strategy == "default" else n)
    return counts


def expand_count(path: str | os.PathLike, images) -> list[int]:
    """How many placeholder tokens each image of ``images`` takes in the folder's model."""
    path = str(path)
    kind, config, proc = _folder_kind(path), load_config(path), load_image_processor(path)
    if kind.startswith("qwen"):
        grid = proc(images=list(images), return_tensors="pt")["image_grid_thw"]
        return [int(t * h * w) // proc.merge_size**2 for t, h, w in grid.tolist()]
    if kind == "llava":
        vc = config.vision_config
        n = (vc.image_size // vc.patch_size) ** 2
        return [n + (config.vision_feature_select_strategy == "full")] * len(images)
    if kind == "gemma3":  # soft tokens only (the "\n\n" + boi ... eoi + "\n\n" around them aside)
        return [config.mm_tokens_per_image] * len(images)
    return _next_counts(path, config, proc, images)


@cache
def _double_newline_ids(path: str, _mtime_ns: int) -> tuple[int, ...]:
    from transformers import AutoTokenizer

    return tuple(AutoTokenizer.from_pretrained(path).encode("\n\n", add_special_tokens=False))


def _gemma_wrap(path: str) -> tuple[list[int], list[int]]:
    """The ids Gemma 3 puts before and after an image's soft tokens, in place of its
    ``<start_of_image>``: ids("\n\n") + [boi] and [eoi] + ids("\n\n")."""
    config = load_config(path)
    nl = _double_newline_ids(path, (Path(path) / "tokenizer.json").stat().st_mtime_ns)
    return [*nl, config.boi_token_id], [config.eoi_token_id, *nl]


def expand_prompt(path: str | os.PathLike, prompt_ids: list[int], images) -> list[int]:
    """``prompt_ids`` with its k-th placeholder token repeated ``expand_count(...)[k]`` times.

    Gemma 3 (placeholder ``<start_of_image>``): each boi id becomes ids("\n\n") + [boi] +
    [image soft token] * mm_tokens_per_image + [eoi] + ids("\n\n") (ids: the tokenizer's
    ``encode(..., add_special_tokens=False)``), the id-level form of ``Gemma3Processor``'s text
    expansion. It equals the processor's ids only where the text around the image tokenizes the
    same with the "\n\n"s glued on (SmolLM2's BPE: "\n\nWhat" is ids("\n") * 2 + ids("What"),
    not ids("\n\n") + ids("What")); ``hf_text_inputs`` gives the processor's own."""
    path = str(path)
    config = load_config(path)
    gemma = _folder_kind(path) == "gemma3"
    token = config.boi_token_id if gemma else config.image_token_id
    counts = expand_count(path, images)
    if sum(t == token for t in prompt_ids) != len(counts):
        raise ValueError(
            f"prompt has {sum(t == token for t in prompt_ids)} image tokens for {len(counts)} images"
        )
    before, after = _gemma_wrap(path) if gemma else ([], [])
    out: list[int] = []
    it = iter(counts)
    for t in prompt_ids:
        if t != token:
            out.append(t)
        elif gemma:
            out += [*before, *[config.image_token_id] * next(it), *after]
        else:
            out += [t] * next(it)
    return out


def load_hf_vlm(path: str | os.PathLike):
    """The folder's transformers model (float32, eval), loaded once per (path, weights file state)."""
    st = (Path(path) / "model.safetensors").stat()
    return _load_model_cached(str(path), st.st_mtime_ns, st.st_size)


@cache
def _load_model_cached(path: str, _mtime_ns: int, _size: int):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def hf_vlm_inputs(path: str | os.PathLike, prompt_ids: list[int], images) -> dict:
    """The keyword inputs of the folder's transformers model for one prompt (batch 1). Gemma 3's
    carry ``token_type_ids`` (1 on the image soft tokens, 0 elsewhere): with them transformers
    lets each image's soft tokens attend to each other both ways (without, it is all causal)."""
    path = str(path)
    kind = _folder_kind(path)
    ids = torch.tensor([expand_prompt(path, prompt_ids, images)], dtype=torch.int64)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    if images:
        inputs.update(load_image_processor(path)(images=list(images), return_tensors="pt"))
        if kind.startswith("qwen"):
            # text 0 / image 1: without it transformers 5 silently runs M-RoPE on 1-D text positions
            inputs["mm_token_type_ids"] = (ids == load_config(path).image_token_id).int()
    if kind == "gemma3":
        if inputs.pop("num_crops", torch.zeros(1)).any():  # what Gemma3Processor drops
            raise ValueError("pan and scan crops are not supported")
        inputs["token_type_ids"] = (ids == load_config(path).image_token_id).long()
    return inputs


def hf_text_inputs(path: str | os.PathLike, text: str, images) -> dict:
    """The model inputs of a text prompt (one placeholder per image, e.g. a rendered chat
    template) expanded at the text level, as a server expands a text prompt: for Gemma 3
    transformers' own ``Gemma3Processor`` (each ``<start_of_image>`` becomes "\n\n<start_of_image>"
    + "<image_soft_token>" * mm_tokens_per_image + "<end_of_image>\n\n", then the whole text is
    tokenized): input_ids, attention_mask, pixel_values, token_type_ids. The other kinds'
    placeholders expand to copies of themselves, so there it is ``hf_vlm_inputs`` of the
    tokenized text. No special tokens are added (the tokenizer adds none anyway)."""
    from transformers import AutoTokenizer, Gemma3Processor

    path = str(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if _folder_kind(path) != "gemma3":
        return hf_vlm_inputs(path, tokenizer(text, add_special_tokens=False)["input_ids"], images)
    processor = Gemma3Processor(
        image_processor=load_image_processor(path),
        tokenizer=tokenizer,
        image_seq_length=load_config(path).mm_tokens_per_image,
    )
    out = processor(text=text, images=list(images) or None, add_special_tokens=False, return_tensors="pt")
    return dict(out)


def hf_greedy_from_inputs(model, inputs: dict, max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (EOS disabled: exactly ``max_new_tokens`` tokens) of
    prepared model ``inputs`` (``hf_vlm_inputs``, ``hf_text_inputs``, or such with keys dropped)."""
    from transformers import GenerationConfig

    gen_config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        eos_token_id=[],  # never stop early (None would fall back to the model's EOS)
        pad_token_id=2,
    )
    with torch_threads(REF_THREADS), torch.inference_mode():
        out = model.generate(**inputs, generation_config=gen_config)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def hf_vlm_greedy(
    path: str | os.PathLike, prompt_ids: list[int], images, max_new_tokens: int, model=None
) -> list[int]:
    """transformers' greedy continuation (EOS disabled: exactly ``max_new_tokens`` tokens) of
    ``prompt_ids`` (one placeholder token per image) with ``images``; the model is loaded once
    per folder (float32, eval) unless given."""
    model = model if model is not None else load_hf_vlm(str(path))
    return hf_greedy_from_inputs(model, hf_vlm_inputs(path, prompt_ids, images), max_new_tokens)


def hf_text_greedy(path: str | os.PathLike, text: str, images, max_new_tokens: int, model=None) -> list[int]:
    """``hf_vlm_greedy`` of a text prompt expanded at the text level (``hf_text_inputs``)."""
    model = model if model is not None else load_hf_vlm(str(path))
    return hf_greedy_from_inputs(model, hf_text_inputs(path, text, images), max_new_tokens)


def hf_vlm_logits(path: str | os.PathLike, prompt_ids: list[int], images, model=None) -> torch.Tensor:
    """transformers' float32 logits [expanded prompt length, vocab] of one forward pass."""
    model = model if model is not None else load_hf_vlm(str(path))
    with torch.inference_mode():
        return model(**hf_vlm_inputs(path, prompt_ids, images)).logits[0].float()

"""Qwen2-VL's M-RoPE in srt against transformers: the positions of a prompt with images
(srt/multimodal/mrope.py vs ``Qwen2VLModel.get_rope_index``), the rotation by three position rows
(srt/layers/mrope.py vs ``Qwen2VLRotaryEmbedding`` + ``apply_rotary_pos_emb``), and the scheduler's
per-chunk slices of them (``ReqImages.rope_positions``)."""

from __future__ import annotations

import random
from functools import cache

import numpy as np
import pytest
import torch

from srt.layers.mrope import MRotaryEmbedding
from srt.layers.rotary_embedding import RotaryEmbedding, get_rope
from srt.models.qwen2_vl import _mrope_decoder_config
from srt.multimodal.inputs import ImageInput, MultimodalInputs
from srt.multimodal.mrope import mrope_positions
from srt.multimodal.req_images import ReqImages
from tests.helpers.tiny_vlm import QWEN_TOKENS, build_tiny_vlm

MERGE = 2
IMG = 7  # the placeholder id of the prompts built here (any id: get_rope_index reads the types)


class _Vocab:
    """The two things the tiny config reads of a tokenizer (the real one takes seconds to parse):
    its size and the ids of the Qwen image tokens."""

    def __len__(self) -> int:
        return 512

    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int]:
        return [508 + QWEN_TOKENS.index(t) for t in tokens]


@cache
def _hf_model():
    """The tiny Qwen2-VL (transformers) whose ``model.get_rope_index`` is the reference."""
    return build_tiny_vlm("qwen2_vl", tokenizer=_Vocab())


# ---------------------------------------------------------------- prompts
def _prompt(parts: list) -> tuple[list[int], list[tuple[int, int, tuple[int, int, int]]]]:
    """``parts``: ints (that many text tokens) and (t, h, w) patch grids (one image span each)
    -> the token ids and srt's spans ``(offset, count, grid)``."""
    ids: list[int] = []
    spans = []
    for p in parts:
        if isinstance(p, int):
            ids.extend(100 + (len(ids) + i) % 50 for i in range(p))
        else:
            t, h, w = p
            count = t * (h // MERGE) * (w // MERGE)
            spans.append((len(ids), count, p))
            ids.extend([IMG] * count)
    return ids, spans


def _hf_rope_index(ids: list[int], spans) -> tuple[np.ndarray, int]:
    """transformers' positions ``[3, L]`` and delta. Two spans that touch would be one run of
    image tokens to transformers (it groups equal token types), so every other image is typed
    as a video (type 2) with its grid in ``video_grid_thw``: transformers places both kinds
    with the same ``get_vision_position_ids(start, grid, 1, merge)``, so the reference is the
    same and each span stays its own group."""
    types = torch.zeros(1, len(ids), dtype=torch.int32)
    images, videos = [], []
    for k, (offset, count, grid) in enumerate(spans):
        kind = 1 + k % 2
        types[0, offset : offset + count] = kind
        (images if kind == 1 else videos).append(list(grid))
    input_ids = torch.tensor([ids], dtype=torch.int64)
    pos, delta = _hf_model().model.get_rope_index(
        input_ids,
        mm_token_type_ids=types,
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None,
        attention_mask=torch.ones_like(input_ids),
    )
    assert pos.shape == (3, 1, len(ids))
    return pos[:, 0].numpy(), int(delta.reshape(-1)[0])


CASES = {
    "text only": [9],
    "one image inside": [3, (1, 4, 6), 5],
    "one image at the start": [(1, 8, 4), 6],
    "one image at the end": [4, (1, 4, 10)],
    "only an image": [(1, 6, 6)],
    # <|vision_end|><|vision_start|> between two images: two text tokens apart
    "two images between vision tokens": [2, (1, 4, 4), 2, (1, 6, 2), 3],
    "two images touching": [1, (1, 4, 8), (1, 10, 2), 2],
    "three images: start, touching, end": [(1, 2, 2), (1, 12, 4), 3, (1, 2, 14)],
    "three images, a 1x1 merged grid": [2, (1, 2, 2), 1, (1, 16, 6), 4, (1, 6, 16), 1],
}


@pytest.mark.parametrize("name", list(CASES))
def test_mrope_positions_match_transformers(name):
    ids, spans = _prompt(CASES[name])
    pos, delta = mrope_positions(len(ids), spans, MERGE)
    ref, ref_delta = _hf_rope_index(ids, spans)
    assert pos.dtype == np.int32 and pos.shape == (3, len(ids))
    np.testing.assert_array_equal(pos, ref)
    assert delta == ref_delta
    if not spans:
        assert delta == 0 and (pos == np.arange(len(ids))).all()
    else:
        assert delta < 0  # every image here saves rows (its grid is more than 1 merged patch)


def test_mrope_positions_random_layouts_match_transformers():
    rng = random.Random(0)
    for _ in range(40):
        parts: list = []
        for _ in range(rng.randint(0, 4)):
            if rng.random() < 0.7:
                parts.append(rng.randint(1, 5))
            parts.append((1, 2 * rng.randint(1, 8), 2 * rng.randint(1, 8)))
        parts.append(rng.randint(0 if parts else 1, 4))
        ids, spans = _prompt([p for p in parts if p != 0])
        pos, delta = mrope_positions(len(ids), spans, MERGE)
        ref, ref_delta = _hf_rope_index(ids, spans)
        np.testing.assert_array_equal(pos, ref, err_msg=str(parts))
        assert delta == ref_delta, parts


def test_mrope_positions_rejects_a_span_that_does_not_fit_its_grid():
    with pytest.raises(ValueError, match="2x3"):
        mrope_positions(10, [(1, 5, (1, 4, 6))], MERGE)


# ---------------------------------------------------------------- the rotation
def _text_config(kind: str):
    """The decoder config transformers' rotary reads (M-RoPE keys included)."""
    if kind == "tiny":  # head_dim 16, mrope_section [2, 3, 3], theta 1e6
        return _hf_model().config.text_config
    from transformers import Qwen2VLTextConfig

    # Qwen2-VL-7B's rope: head_dim 128, mrope_section [16, 24, 24]
    return Qwen2VLTextConfig(
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    )


def _plain_config(text_config):
    """srt/models/qwen2_vl.py's decoder config (a plain rope) and ``mrope_section``."""
    vl = type("VL", (), {"get_text_config": lambda self: text_config, "model_type": "qwen2_vl"})()
    return _mrope_decoder_config(vl)


def _srt_rope(text_config) -> MRotaryEmbedding:
    """srt's rope built the way srt/models/qwen2_vl.py builds it."""
    plain, sections = _plain_config(text_config)
    head_dim = text_config.hidden_size // text_config.num_attention_heads
    assert sections == list(text_config.rope_parameters["mrope_section"])
    return MRotaryEmbedding(head_dim, plain, sections)


def _hf_rotate(text_config, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """transformers' Qwen2-VL rotation of q ``[T, H*D]`` / k at positions ``[3, T]``."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb

    head_dim = text_config.hidden_size // text_config.num_attention_heads
    n = positions.shape[1]
    rot = Qwen2VLRotaryEmbedding(text_config)
    cos, sin = rot(q, positions[:, None, :])  # [1, T, D]
    qh = q.view(n, -1, head_dim).transpose(0, 1)[None]  # [1, H, T, D]
    kh = k.view(n, -1, head_dim).transpose(0, 1)[None]
    qo, ko = apply_rotary_pos_emb(qh, kh, cos, sin)
    return qo[0].transpose(0, 1).reshape(n, -1), ko[0].transpose(0, 1).reshape(n, -1)


def _random_positions(n: int, limit: int, gen: torch.Generator) -> torch.Tensor:
    """``[3, n]`` rows that differ (an image's) plus equal-row text columns, as a prompt has."""
    pos = torch.randint(0, limit, (3, n), generator=gen)
    pos[:, : n // 3] = pos[0, : n // 3]
    return pos


@pytest.mark.parametrize("kind", ["tiny", "7b"])
def test_mrotary_matches_transformers_with_three_rows(kind):
    text = _text_config(kind)
    rope = _srt_rope(text)
    head_dim = rope.head_dim
    gen = torch.Generator().manual_seed(1)
    n, heads, kv_heads = 37, text.num_attention_heads, text.num_key_value_heads
    positions = _random_positions(n, text.max_position_embeddings, gen)
    q = torch.randn(n, heads * head_dim, generator=gen)
    k = torch.randn(n, kv_heads * head_dim, generator=gen)
    ref_q, ref_k = _hf_rotate(text, positions, q, k)
    out_q, out_k = rope(positions, q.clone(), k.clone())
    torch.testing.assert_close(out_q, ref_q, rtol=0, atol=2e-5)
    torch.testing.assert_close(out_k, ref_k, rtol=0, atol=2e-5)
    # the three rows each matter: rotating by row 0 alone differs from the reference
    plain_q, _ = rope(positions[0].contiguous(), q.clone(), k.clone())
    assert (plain_q - ref_q).abs().max() > 1e-2
    # 3-D q / k ([T, H, D]) take the same path
    q3, k3 = rope(positions, q.view(n, heads, head_dim).clone(), k.view(n, kv_heads, head_dim).clone())
    torch.testing.assert_close(q3.reshape(n, -1), out_q, rtol=0, atol=0)
    torch.testing.assert_close(k3.reshape(n, -1), out_k, rtol=0, atol=0)


def test_mrotary_one_row_is_the_plain_rope_and_three_equal_rows():
    text = _text_config("tiny")
    rope = _srt_rope(text)
    plain_cfg, _ = _plain_config(text)
    plain = get_rope(rope.head_dim, plain_cfg)
    assert type(plain) is RotaryEmbedding
    gen = torch.Generator().manual_seed(2)
    n = 29
    positions = torch.randint(0, text.max_position_embeddings, (n,), generator=gen)
    q = torch.randn(n, text.num_attention_heads * rope.head_dim, generator=gen)
    k = torch.randn(n, text.num_key_value_heads * rope.head_dim, generator=gen)
    one_q, one_k = rope(positions, q.clone(), k.clone())
    ref_q, ref_k = plain(positions, q.clone(), k.clone())
    torch.testing.assert_close(one_q, ref_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(one_k, ref_k, rtol=0, atol=1e-6)
    three_q, three_k = rope(positions.expand(3, -1).contiguous(), q.clone(), k.clone())
    torch.testing.assert_close(three_q, ref_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(three_k, ref_k, rtol=0, atol=1e-5)
    # and transformers agrees that equal rows are the plain rope
    hf_q, hf_k = _hf_rotate(text, positions.expand(3, -1), q, k)
    torch.testing.assert_close(three_q, hf_q, rtol=0, atol=2e-5)
    torch.testing.assert_close(three_k, hf_k, rtol=0, atol=2e-5)


def test_mrotary_rejects_sections_that_do_not_cover_the_rotary_dims():
    text = _text_config("tiny")
    plain, _ = _plain_config(text)
    with pytest.raises(ValueError, match="mrope_section"):
        MRotaryEmbedding(16, plain, [2, 3, 2])
    with pytest.raises(ValueError, match="mrope_section"):
        MRotaryEmbedding(16, plain, [4, 4])


# ---------------------------------------------------------------- ReqImages.rope_positions
def _req_images(parts) -> tuple[ReqImages, np.ndarray, int, int]:
    ids, spans = _prompt(parts)
    pos, delta = mrope_positions(len(ids), spans, MERGE)
    images = [
        ImageInput.of_array(
            np.zeros((count * MERGE * MERGE, 4), np.float32),
            offset=offset,
            length=count,
            hash=1000 + i,
            grid_thw=list(grid),
        )
        for i, (offset, count, grid) in enumerate(spans)
    ]
    mm = MultimodalInputs(images=images, token_id=IMG, mrope_positions=pos.tobytes(), mrope_delta=delta)
    return ReqImages(mm, len(ids)), pos, delta, len(ids)


def test_rope_positions_over_chunks_concatenate_to_the_prompt():
    req, pos, delta, n = _req_images([3, (1, 4, 6), (1, 8, 2), 2, (1, 6, 6), 4])
    full = torch.from_numpy(pos.astype(np.int64))
    torch.testing.assert_close(req.rope_positions(0, n), full, rtol=0, atol=0)
    rng = random.Random(3)
    for _ in range(30):
        cuts = sorted({0, n, *(rng.randint(1, n - 1) for _ in range(rng.randint(1, 6)))})
        parts = [req.rope_positions(a, b) for a, b in zip(cuts, cuts[1:])]
        assert all(p.dtype == torch.int64 and p.shape == (3, b - a) for p, a, b in zip(parts, cuts, cuts[1:]))
        torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=0)


def test_rope_positions_past_the_prompt_add_the_delta_in_every_row():
    req, pos, delta, n = _req_images([(1, 4, 8), 3, (1, 10, 2), 2])
    assert delta < 0
    # the last prompt position + 1 is where generation starts: n + delta
    assert int(pos.max()) + 1 == n + delta
    for p in (n, n + 1, n + 17):  # DECODE steps
        torch.testing.assert_close(
            req.rope_positions(p, p + 1), torch.full((3, 1), p + delta), rtol=0, atol=0
        )
    # an extend across the prompt's end (a retracted request's prompt + kept output)
    across = req.rope_positions(n - 4, n + 3)
    torch.testing.assert_close(across[:, :4], torch.from_numpy(pos[:, n - 4 :].astype(np.int64)))
    torch.testing.assert_close(across[:, 4:], (torch.arange(n, n + 3) + delta).expand(3, -1))
    # and the tail continues the text positions one by one, with no gap and no repeat
    assert across[0, 4] == pos[0, -1] + 1

"""srt/multimodal/processor.py against transformers: each tiny VLM folder's placeholder expands to
the count the transformers model takes (``expand_count``), the pixels are its image processor's,
Qwen's M-RoPE positions are ``get_rope_index``'s, LLaVA-NeXT's tiling is transformers' anyres
(``select_best_resolution`` / ``get_anyres_image_grid_shape`` / ``unpad_image``); the images
cross the tokenizer manager -> scheduler socket bit-exact."""

from __future__ import annotations

import random
from functools import cache

import msgspec
import numpy as np
import pytest
import torch

from srt.managers import io_struct
from srt.multimodal.image_io import image_hash
from srt.multimodal.inputs import ImageInput, MultimodalInputs
from srt.multimodal.processor import (
    Gemma3Processor,
    LlavaNextProcessor,
    QwenVLProcessor,
    anyres_grid,
    create_image_processor,
    unpadded_shape,
)
from srt.sampling.sampling_params import SamplingParams
from srt.utils.errors import ConfigError, RequestError
from tests.helpers import tiny_vlm
from tests.helpers.tiny_vlm import expand_count, load_images_for_test, placeholder_token

# (folder name, kind, config overrides)
FOLDERS = {
    "qwen2_vl": ("qwen2_vl", {}),
    "qwen2_5_vl": ("qwen2_5_vl", {}),
    "llava": ("llava", {}),
    "llava-full": ("llava", {"vision_feature_select_strategy": "full"}),
    "llava_next": ("llava_next", {}),
    "gemma3": ("gemma3", {}),
}

# PIL (width, height): wide, tall, square, tiny, large; for llava_next they pick each pinpoint
SIZES = {
    "qwen": [(100, 80), (300, 40), (40, 300), (20, 20), (1000, 1000), (130, 70)],
    "llava": [(100, 80), (300, 40), (40, 300), (84, 84), (10, 10)],
    "llava_next": [(40, 40), (200, 60), (60, 200), (150, 150), (112, 56), (90, 70), (30, 500)],
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            kind, overrides = FOLDERS[name]
            made[name] = tiny_vlm.save_tiny_vlm(kind, tmp_path_factory.mktemp(name), **overrides)
        return made[name]

    return get


@cache
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _processor(path: str):
    from transformers import AutoConfig

    return create_image_processor(path, AutoConfig.from_pretrained(path), _tokenizer(path))


def _sizes(name: str) -> list[tuple[int, int]]:
    return SIZES["qwen" if name.startswith("qwen") else name.split("-")[0]]


def _prompt(path: str, kind: str, n_images: int) -> list[int]:
    """A prompt with ``n_images`` placeholders: the first at the very start, the last at the very
    end (Qwen's inside its vision tokens, as its chat template writes them)."""
    tok = _tokenizer(path)
    image = "<|vision_start|><|image_pad|><|vision_end|>" if kind.startswith("qwen") else "<image>"
    if n_images == 0:
        text = " What changed?"
    elif n_images == 1:
        text = image + " What changed?"
    else:
        text = image + "".join(t + image for t in [" Look:", " and", " then"][: n_images - 1])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids(placeholder_token(kind))) == n_images
    return ids


def _hf_pixels(path: str, image) -> dict:
    return dict(tiny_vlm.load_image_processor(path)(images=[image], return_tensors="np"))


def _check_expansion(
    path: str, kind: str, ids: list[int], images, counts: list[int]
) -> tuple[list[int], MultimodalInputs]:
    """``counts``: ``expand_count(path, images)`` (transformers' count of each image's rows)."""
    proc = _processor(path)
    hashes = [image_hash(im) for im in images]
    out, mm = proc.expand(ids, images, hashes)
    token = proc.token_id
    assert token == tiny_vlm.load_config(path).image_token_id
    # the expansion is transformers': the k-th placeholder repeated counts[k] times
    it = iter(counts)
    assert out == [x for t in ids for x in ([t] * next(it) if t == token else [t])]
    assert [im.length for im in mm.images] == counts
    assert mm.token_id == token and len(mm.images) == len(images)
    # offsets: each image's span is a run of placeholders, the spans in order and covering them all
    covered = np.zeros(len(out), bool)
    for k, (item, image) in enumerate(zip(mm.images, images)):
        assert out[item.offset : item.offset + item.length] == [token] * item.length
        assert item.offset == 0 or out[item.offset - 1] != token or covered[item.offset - 1]
        covered[item.offset : item.offset + item.length] = True
        assert item.hash == hashes[k]
        ref = _hf_pixels(path, image)
        arr = item.array()
        assert arr.dtype == np.float32 and item.dtype == "float32"
        if kind.startswith("qwen"):
            np.testing.assert_array_equal(arr, ref["pixel_values"])
            assert item.grid_thw == ref["image_grid_thw"][0].tolist()
            assert item.image_size == []
        else:
            np.testing.assert_array_equal(arr, ref["pixel_values"][0])
            assert item.grid_thw == []
            assert item.image_size == ([image.height, image.width] if kind == "llava_next" else [])
    assert covered.tolist() == [t == token for t in out]
    assert [im.offset for im in mm.images] == sorted(im.offset for im in mm.images)
    return out, mm


def _hf_rope_index(path: str, kind: str, out: list[int], images) -> tuple[np.ndarray, int]:
    model = tiny_vlm.load_hf_vlm(path)
    ids = torch.tensor([out])
    grid = tiny_vlm.load_image_processor(path)(images=list(images), return_tensors="pt")["image_grid_thw"]
    pos, delta = model.model.get_rope_index(
        ids,
        mm_token_type_ids=(ids == model.config.image_token_id).int(),
        image_grid_thw=grid,
        attention_mask=torch.ones_like(ids),
    )
    return pos[:, 0].numpy(), int(delta.reshape(-1)[0])


@pytest.mark.parametrize("name", [n for n in FOLDERS if n != "gemma3"])  # (gemma3: its own test)
def test_expand_matches_transformers(name, folder):
    path = folder(name)
    kind = FOLDERS[name][0]
    sizes = _sizes(name)
    images = load_images_for_test(len(sizes), seed=5, sizes=sizes)
    # each size alone (1 image), then the first three together (start, middle, end)
    counts = expand_count(path, images)  # each image's count is its own (one call: it is slow)
    cases = [[k] for k in range(len(images))] + [[0, 1, 2]]
    for case in cases:
        group = [images[k] for k in case]
        ids = _prompt(path, kind, len(group))
        out, mm = _check_expansion(path, kind, ids, group, [counts[k] for k in case])
        if kind.startswith("qwen"):
            pos, delta = _hf_rope_index(path, kind, out, group)
            np.testing.assert_array_equal(mm.mrope_array(len(out)), pos)
            assert mm.mrope_delta == delta
            assert len(mm.mrope_positions) == 3 * len(out) * 4
        else:
            assert mm.mrope_positions == b"" and mm.mrope_delta == 0
            assert mm.mrope_array(len(out)) is None
    if kind.startswith("qwen"):  # the sizes give different grids
        assert len({tuple(_hf_pixels(path, im)["image_grid_thw"][0]) for im in images}) == len(images)


def test_llava_next_sizes_pick_every_pinpoint(folder):
    path = folder("llava_next")
    proc = _processor(path)
    assert isinstance(proc, LlavaNextProcessor)
    cfg = proc.config
    grids = {
        anyres_grid((h, w), cfg.image_grid_pinpoints, cfg.vision_config.image_size)
        for w, h in SIZES["llava_next"]
    }
    assert grids == {(1, 1), (1, 2), (2, 1), (2, 2)}
    # and the tiles transformers cut agree: 1 base + rows * cols
    for w, h in SIZES["llava_next"]:
        (image,) = load_images_for_test(1, seed=1, sizes=[(w, h)])
        rows, cols = anyres_grid((h, w), cfg.image_grid_pinpoints, cfg.vision_config.image_size)
        assert _hf_pixels(path, image)["pixel_values"].shape[1] == 1 + rows * cols


def test_llava_next_counts_over_random_sizes(folder):
    path = folder("llava_next")
    rng = random.Random(11)
    sizes = [(rng.randint(8, 400), rng.randint(8, 400)) for _ in range(30)]
    images = load_images_for_test(len(sizes), seed=2, sizes=sizes)
    ids = _prompt(path, "llava_next", 1)
    counts = expand_count(path, images)
    assert len(set(counts)) > 3
    proc = _processor(path)
    for image, count in zip(images, counts):
        _, mm = proc.expand(ids, [image], [0])
        assert mm.images[0].length == count, image.size


@pytest.mark.parametrize("name", ["qwen2_vl", "llava"])
def test_placeholders_and_images_must_pair_up(name, folder):
    path = folder(name)
    kind = FOLDERS[name][0]
    proc = _processor(path)
    placeholder = placeholder_token(kind)
    assert proc.placeholder == placeholder
    images = load_images_for_test(2, seed=3)
    two = _prompt(path, kind, 2)
    for ids, given in (
        (two, images[:1]),
        (_prompt(path, kind, 1), images),
        (_prompt(path, kind, 0), images[:1]),
    ):
        with pytest.raises(RequestError) as err:
            proc.expand(ids, given, [image_hash(im) for im in given])
        assert placeholder in str(err.value) and str(proc.token_id) in str(err.value)
        assert err.value.param == "image_data"
    with pytest.raises(RequestError, match=placeholder.replace("|", r"\|")):
        proc.expand(two, [], [])
    # a prompt without images and no placeholder passes through
    plain = _prompt(path, kind, 0)
    out, mm = proc.expand(plain, [], [])
    assert out == plain and mm.images == []


def test_gemma3_expansion_is_transformers_processor(folder):
    """Text prompts expand in the text (``expand_text``), as transformers' Gemma3Processor does,
    and their ids then pass ``expand`` unchanged; id prompts expand with the ids of "\n\n"
    (``expand_prompt``). Each image's rows are its soft tokens, marked bidirectional, its pixels
    the image processor's."""
    path = folder("gemma3")
    proc, tok, config = _processor(path), _tokenizer(path), tiny_vlm.load_config(path)
    assert isinstance(proc, Gemma3Processor) and proc.placeholder == "<start_of_image>"
    images = load_images_for_test(2, seed=4)
    text = "Look:\n<start_of_image> and<start_of_image>\nthen?"
    ref = tiny_vlm.hf_text_inputs(path, text, images)
    ids = tok(proc.expand_text(text), add_special_tokens=False)["input_ids"]
    assert ids == ref["input_ids"][0].tolist()
    hashes = [image_hash(im) for im in images]
    out, mm = proc.expand(ids, images, hashes)
    assert out == ids and mm.bidirectional and mm.token_id == config.image_token_id
    soft = ref["token_type_ids"][0].tolist()
    for item, image in zip(mm.images, images):
        assert item.length == config.mm_tokens_per_image
        assert soft[item.offset : item.offset + item.length] == [1] * item.length
        assert out[item.offset - 1] == config.boi_token_id
        assert out[item.offset + item.length] == config.eoi_token_id
        np.testing.assert_array_equal(item.array(), _hf_pixels(path, image)["pixel_values"][0])
    assert sum(soft) == 2 * config.mm_tokens_per_image
    # an id prompt: the id-level expansion
    plain = tok("Look:<start_of_image> and<start_of_image> then?", add_special_tokens=False)["input_ids"]
    out, mm = proc.expand(plain, images, hashes)
    assert out == tiny_vlm.expand_prompt(path, plain, images)
    soft_id = config.image_token_id
    runs = [i for i, t in enumerate(out) if t == soft_id and out[i - 1] != soft_id]
    assert [im.offset for im in mm.images] == runs and len(runs) == 2
    with pytest.raises(RequestError, match="<start_of_image>"):
        proc.expand(plain, images[:1], hashes[:1])


def test_gemma3_pan_and_scan_is_refused(folder, tmp_path):
    import shutil

    from transformers import AutoConfig

    path = shutil.copytree(folder("gemma3"), tmp_path / "pan")
    pre = path / "preprocessor_config.json"
    pre.write_text(pre.read_text().replace('"do_pan_and_scan": false', '"do_pan_and_scan": true'))
    assert '"do_pan_and_scan": true' in pre.read_text()
    with pytest.raises(ConfigError, match="pan_and_scan"):
        create_image_processor(str(path), AutoConfig.from_pretrained(path), _tokenizer(str(path)))


def test_text_only_model_has_no_image_processor():
    from transformers import LlamaConfig

    assert create_image_processor("/nonexistent", LlamaConfig(), None) is None


# ---------------------------------------------------------------- anyres against transformers
PINPOINTS = {
    "tiny": [[56, 56], [56, 112], [112, 56], [112, 112]],
    "llava-v1.6": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    "wide range": [[384 * a, 384 * b] for a in range(1, 7) for b in range(1, 7)],
}
TILES = {"tiny": 56, "llava-v1.6": 336, "wide range": 384}


@pytest.mark.parametrize("which", list(PINPOINTS))
def test_anyres_grid_matches_transformers(which):
    from transformers.image_processing_utils import select_best_resolution
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape

    pins, tile = PINPOINTS[which], TILES[which]
    rng = random.Random(which)
    seen = set()
    for _ in range(1500):
        h = rng.randint(8, 3000)
        w = rng.randint(max(8, h // 20), min(3000, h * 20))
        ref_h, ref_w = select_best_resolution((h, w), pins)
        grid = anyres_grid((h, w), pins, tile)
        assert grid == (ref_h // tile, ref_w // tile), (h, w)
        assert grid == tuple(get_anyres_image_grid_shape([h, w], pins, tile)), (h, w)
        seen.add(grid)
    assert len(seen) == len(pins)  # every pinpoint was picked by some size


def test_unpadded_shape_matches_transformers():
    from transformers.models.llava_next.modeling_llava_next import unpad_image

    rng = random.Random(7)
    for _ in range(3000):
        h, w = rng.randint(1, 2000), rng.randint(1, 2000)
        rows, cols = rng.randint(1, 120), rng.randint(1, 120)
        ref = unpad_image(torch.empty(1, rows, cols), (h, w)).shape[1:]
        assert unpadded_shape(h, w, rows, cols) == tuple(ref), (h, w, rows, cols)
    # sizes whose scaled side lands a hair below an integer (47 * (12 / 94) = 5.999...): the
    # rounding to 7 places, not a truncation, keeps the row or column
    for h, w, rows, cols in [(49, 147, 7, 12), (147, 49, 12, 9), (196, 147, 4, 8), (214, 214, 9, 4)]:
        ref = unpad_image(torch.empty(1, rows, cols), (h, w)).shape[1:]
        assert unpadded_shape(h, w, rows, cols) == tuple(ref), (h, w, rows, cols)
    # the shapes the model unpads: a tiled grid of 4x4-feature tiles, each pinpoint
    side = 4
    for _ in range(500):
        h, w = rng.randint(8, 600), rng.randint(8, 600)
        gh, gw = anyres_grid((h, w), PINPOINTS["tiny"], 56)
        ref = unpad_image(torch.empty(1, gh * side, gw * side), (h, w)).shape[1:]
        assert unpadded_shape(h, w, gh * side, gw * side) == tuple(ref), (h, w)


# ---------------------------------------------------------------- the socket
def test_multimodal_inputs_round_trip_bit_exact(folder):
    path = folder("qwen2_vl")
    kind = "qwen2_vl"
    images = load_images_for_test(3, seed=9)
    ids = _prompt(path, kind, 3)
    proc = _processor(path)
    assert isinstance(proc, QwenVLProcessor)
    out, mm = proc.expand(ids, images, [image_hash(im) for im in images])
    # bit patterns a float compare would hide: -0.0, NaN payloads, denormals, and a float16 tensor
    odd = np.array([-0.0, np.nan, 1e-45, -np.inf, 3.4e38], np.float32)
    odd.view(np.uint32)[1] = 0x7FC01234
    extra = ImageInput.of_array(odd.reshape(1, 5), offset=len(out), length=1, hash=(1 << 63) - 1)
    half = ImageInput.of_array(
        np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float16),
        offset=len(out) + 1,
        length=1,
        hash=0,
    )
    mm = msgspec.structs.replace(mm, images=[*mm.images, extra, half])
    msg = io_struct.TokenizedGenerateReqInput(
        rid="img", input_ids=out + [mm.token_id] * 2, sampling_params=SamplingParams(max_new_tokens=4), mm=mm
    )
    wire = io_struct.encode(msg)
    raw = sum(len(im.pixel_values) for im in mm.images) + len(mm.mrope_positions)
    assert len(wire) < raw + 4096  # pixels travel as bytes (msgpack bin), not as lists of numbers
    back = io_struct.scheduler_input_decoder.decode(wire)
    assert isinstance(back, io_struct.TokenizedGenerateReqInput) and back.mm is not None
    assert back.input_ids == msg.input_ids
    assert len(back.mm.images) == len(mm.images)
    for a, b in zip(back.mm.images, mm.images):
        assert (a.shape, a.dtype, a.offset, a.length, a.hash, a.grid_thw, a.image_size) == (
            b.shape,
            b.dtype,
            b.offset,
            b.length,
            b.hash,
            b.grid_thw,
            b.image_size,
        )
        assert a.pixel_values == b.pixel_values
        assert a.array().dtype == b.array().dtype and a.array().shape == b.array().shape
        np.testing.assert_array_equal(a.array().view(np.uint8), b.array().view(np.uint8))
    np.testing.assert_array_equal(back.mm.mrope_array(len(out)), mm.mrope_array(len(out)))
    assert back.mm.mrope_delta == mm.mrope_delta and back.mm.token_id == mm.token_id
    # a text-only request carries no mm at all
    plain = io_struct.TokenizedGenerateReqInput(rid="t", input_ids=[1, 2], sampling_params=SamplingParams())
    assert b"mm" not in io_struct.encode(plain)
    assert io_struct.scheduler_input_decoder.decode(io_struct.encode(plain)).mm is None

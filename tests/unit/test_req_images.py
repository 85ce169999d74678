"""The images of a request in the scheduler (srt/multimodal/req_images.py): prefix-cache keys,
model ids, the image rows each extend chunk takes, the step's M-RoPE rows, and the merge of
image embeddings into the step's token embeddings (srt/models/vision_common.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from srt.managers.io_struct import TokenizedGenerateReqInput
from srt.managers.scheduler.req import Req, ReqStatus
from srt.models.vision_common import merge_image_rows
from srt.multimodal.inputs import ImageInput, MultimodalInputs
from srt.multimodal.mrope import mrope_positions
from srt.multimodal.req_images import ImageRun, ReqImages, batch_image_inputs, pad_id
from srt.sampling.sampling_params import SamplingParams

TOK = 151655  # the placeholder id
HIDDEN = 6


def _image(offset: int, length: int, content_hash: int, grid: list[int] | None = None) -> ImageInput:
    pixels = np.full((length, 3), content_hash % 1000, np.float32)
    return ImageInput.of_array(pixels, offset=offset, length=length, hash=content_hash, grid_thw=grid or [])


def _prompt(n: int, spans: list[tuple[int, int]]) -> list[int]:
    """``n`` text ids (10, 11, ...) with ``spans`` ``(offset, length)`` holding the placeholder."""
    ids = [10 + i for i in range(n)]
    for offset, length in spans:
        ids[offset : offset + length] = [TOK] * length
    return ids


def _mm(spans: list[tuple[int, int, int]], n: int, mrope: bool = False) -> MultimodalInputs:
    """``spans``: ``(offset, length, hash)``; with ``mrope``, each span is the squarest merged
    grid of its length (merge 2) and the prompt's positions are srt's (tests/unit/test_vision_positions.py
    checks them against transformers)."""
    if not mrope:
        return MultimodalInputs(images=[_image(o, ln, h) for o, ln, h in spans], token_id=TOK)
    rows = [max(d for d in range(1, ln + 1) if ln % d == 0 and d * d <= ln) for _, ln, _ in spans]
    grids = [[1, 2 * r, 2 * (ln // r)] for (_, ln, _), r in zip(spans, rows)]
    pos, delta = mrope_positions(n, [(o, ln, tuple(g)) for (o, ln, _), g in zip(spans, grids)], 2)
    images = [_image(o, ln, h, g) for (o, ln, h), g in zip(spans, grids)]
    return MultimodalInputs(images=images, token_id=TOK, mrope_positions=pos.tobytes(), mrope_delta=delta)


# ---------------------------------------------------------------- keys and model ids
def test_key_ids_tell_images_apart_and_model_ids_map_back():
    spans = [(2, 4), (8, 3), (11, 2)]
    ids = _prompt(16, spans)
    a = ReqImages(_mm([(2, 4, 111), (8, 3, 222), (11, 2, 111)], 16), 16)
    same = ReqImages(_mm([(2, 4, 111), (8, 3, 222), (11, 2, 111)], 16), 16)
    other = ReqImages(_mm([(2, 4, 111), (8, 3, 333), (11, 2, 111)], 16), 16)
    key = a.key_ids(ids)
    assert key == same.key_ids(ids)  # the same images: the same key (a prefix-cache hit)
    other_key = other.key_ids(ids)
    assert other_key[:8] == key[:8] and other_key[11:] == key[11:]
    assert other_key[8:11] != key[8:11]  # a different image differs at its span only
    assert len(key) == len(ids)
    for i, (t, k) in enumerate(zip(ids, key)):
        in_image = any(o <= i < o + ln for o, ln in spans)
        assert (k < 0) == in_image and (k == t) != in_image, i  # pads negative, text untouched
    # one pad per image, from its hash: the image used twice has one pad at both spans
    assert set(key[2:6]) == {pad_id(111)} and set(key[11:13]) == {pad_id(111)}
    assert set(key[8:11]) == {pad_id(222)} and pad_id(222) != pad_id(111)
    assert a.model_ids(key) == ids and other.model_ids(other_key) == ids
    assert a.model_ids(key[3:10]) == ids[3:10]  # any slice (a chunk's fill ids)
    assert ids == _prompt(16, spans)  # key_ids copies


def test_pad_ids_are_negative_for_every_63_bit_hash():
    rng = random.Random(0)
    hashes = [0, 1, (1 << 62) - 1, 1 << 62, (1 << 63) - 1] + [rng.getrandbits(63) for _ in range(1000)]
    pads = [pad_id(h) for h in hashes]
    assert all(p < 0 for p in pads)
    assert len(set(pads[5:])) == 1000  # random hashes do not collide


# ---------------------------------------------------------------- spans over chunks
def test_spans_over_chunk_windows_cover_every_image_row_once():
    spans = [(0, 5), (5, 3), (10, 7), (20, 4)]  # one at the start, two touching, one at the end
    n = 24
    req = ReqImages(_mm([(o, ln, 500 + k) for k, (o, ln) in enumerate(spans)], n), n)
    rng = random.Random(1)
    windows = [[0, 1, 2, 3, 4, 5, 6, 24], [0, 24], [0, 7, 12, 13, 21, 24], list(range(25))]
    windows += [sorted({0, n, *(rng.randint(1, n - 1) for _ in range(rng.randint(1, 8)))}) for _ in range(40)]
    for cuts in windows:
        seen = {id(im): np.zeros(im.length, int) for im in req.images}
        for start, end in zip(cuts, cuts[1:]):
            row0 = rng.randint(0, 50)  # the chunk's first token's row in the step
            for s in req.spans(start, end, row0):
                assert s.n > 0 and 0 <= s.src and s.src + s.n <= s.image.length
                seq = start + (s.row - row0)  # the sequence position of the span's first row
                assert start <= seq and seq + s.n <= end
                assert seq == s.image.offset + s.src
                seen[id(s.image)][s.src : s.src + s.n] += 1
        assert all((c == 1).all() for c in seen.values()), cuts
    assert req.spans(5, 5, 0) == [] and req.spans(17, 20, 0) == []  # empty, and text only


# ---------------------------------------------------------------- the step's inputs
def _batch(reqs_images, num_extend, prefix_lens, extend_lens):
    reqs = [SimpleNamespace(images=im) for im in reqs_images]
    return SimpleNamespace(
        reqs=reqs, num_extend_reqs=num_extend, prefix_lens=prefix_lens, extend_lens=extend_lens
    )


def test_batch_image_inputs_of_a_mixed_batch():
    qwen = ReqImages(_mm([(2, 6, 1), (12, 4, 2)], 20, mrope=True), 20)
    qwen_dec = ReqImages(_mm([(0, 3, 3)], 9, mrope=True), 9)
    llava = ReqImages(_mm([(1, 5, 4)], 8), 8)
    assert qwen.mrope_delta < 0 and llava.mrope is None
    reqs = [None, qwen, llava, qwen_dec, None, llava]
    prefix = [2, 4, 0, 9 + 3, 7, 8 + 5]  # the decodes: past their prompts
    extend = [4, 10, 8, 1, 1, 1]
    out = batch_image_inputs(_batch(reqs, 3, prefix, extend))
    assert set(out) == {"image_spans", "mrope_positions"}
    # image rows only from the extends, at the step's rows: text 0..4, qwen 4..14, llava 14..22
    got = [(s.row, s.image, s.src, s.n) for s in out["image_spans"]]
    want = [(4, qwen.images[0], 2, 4), (12, qwen.images[1], 0, 2), (15, llava.images[0], 0, 5)]
    assert len(got) == len(want) and all(
        g[0] == w[0] and g[1] is w[1] and g[2:] == w[2:] for g, w in zip(got, want)
    )
    rope = out["mrope_positions"]
    assert rope.dtype == torch.int64 and rope.shape == (3, sum(extend))
    cols = np.cumsum([0, *extend])
    expect = [
        torch.arange(2, 6).expand(3, -1),
        qwen.rope_positions(4, 14),
        torch.arange(0, 8).expand(3, -1),
        torch.full((3, 1), 12 + qwen_dec.mrope_delta),
        torch.full((3, 1), 7),
        torch.full((3, 1), 13),
    ]
    for i, want_rows in enumerate(expect):
        torch.testing.assert_close(rope[:, cols[i] : cols[i + 1]], want_rows, rtol=0, atol=0)
    # the qwen extend's rows really are 3-D (its image) and the rest are the 1-D positions
    assert not torch.equal(rope[0, 4:14], rope[1, 4:14])
    one_d = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend)])
    mask = torch.ones(sum(extend), dtype=torch.bool)
    mask[4:14] = False
    mask[22] = False
    assert (rope[:, mask] == one_d[mask]).all()


def test_batch_image_inputs_without_mrope_or_images():
    llava = ReqImages(_mm([(0, 4, 9)], 6), 6)
    out = batch_image_inputs(_batch([llava, None], 2, [0, 0], [6, 3]))
    assert set(out) == {"image_spans"}  # no M-RoPE: the model keeps its 1-D positions
    assert [(s.row, s.src, s.n) for s in out["image_spans"]] == [(0, 0, 4)]
    # a chunk past the image, and decodes: nothing at all
    assert batch_image_inputs(_batch([llava, None], 1, [4, 5], [2, 1])) == {}
    qwen = ReqImages(_mm([(1, 2, 9)], 5, mrope=True), 5)
    out = batch_image_inputs(_batch([qwen, None], 0, [5, 3], [1, 1]))  # DECODE: M-RoPE, no spans
    assert set(out) == {"mrope_positions"}
    torch.testing.assert_close(out["mrope_positions"], torch.tensor([[5 + qwen.mrope_delta, 3]] * 3))


# ---------------------------------------------------------------- merging the rows
class _Encoder:
    """A vision tower that counts its calls; image ``h``'s row ``r`` is ``h * 100 + r``."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, images: list[ImageRun]) -> list[torch.Tensor]:
        self.calls.append([im.input.hash for im in images])
        return [self.rows(im.input.hash, im.length) for im in images]

    @staticmethod
    def rows(h: int, n: int) -> torch.Tensor:
        return (h * 100 + torch.arange(n, dtype=torch.float32))[:, None].expand(n, HIDDEN).clone()


def _step(reqs: list[tuple[ReqImages, int, int]], encoder: _Encoder) -> tuple[torch.Tensor, list]:
    """One step's merge: ``reqs`` are (images, start, end) extends in row order; text rows are -1."""
    spans, row = [], 0
    for im, start, end in reqs:
        spans.extend(im.spans(start, end, row))
        row += end - start
    hidden = torch.full((row, HIDDEN), -1.0)
    return merge_image_rows(hidden, spans, encoder), spans


def _expected(reqs: list[tuple[ReqImages, int, int]]) -> torch.Tensor:
    out = []
    for im, start, end in reqs:
        for p in range(start, end):
            hit = [r for r in im.images if r.offset <= p < r.end]
            out.append(_Encoder.rows(hit[0].input.hash, hit[0].length)[p - hit[0].offset] if hit else None)
    return torch.stack([torch.full((HIDDEN,), -1.0) if r is None else r for r in out])


def test_merge_image_rows_over_chunks():
    n = 20
    req = ReqImages(_mm([(2, 5, 1), (9, 3, 2), (12, 6, 3)], n), n)
    a, b, c = req.images
    enc = _Encoder()
    chunks = [(0, 4), (4, 10), (10, 13), (13, 20)]
    expect_calls = [[1], [2], [3], []]
    kept = [{1}, {2}, {3}, set()]  # partly consumed images keep their rows for the next chunk
    for (start, end), calls, keep in zip(chunks, expect_calls, kept):
        before = len(enc.calls)
        hidden, _ = _step([(req, start, end)], enc)
        torch.testing.assert_close(hidden, _expected([(req, start, end)]), rtol=0, atol=0)
        assert enc.calls[before:] == ([calls] if calls else [])
        assert {im.input.hash for im in (a, b, c) if im.embedding is not None} == keep
    assert enc.calls == [[1], [2], [3]]  # each image encoded exactly once


def test_merge_image_rows_encodes_a_steps_images_in_one_call():
    n1, n2 = 14, 9
    r1 = ReqImages(_mm([(0, 4, 11), (6, 5, 12)], n1), n1)
    r2 = ReqImages(_mm([(3, 6, 21)], n2), n2)
    text = ReqImages(_mm([], 5), 5)
    enc = _Encoder()
    step = [(r1, 0, 8), (text, 0, 5), (r2, 0, 9)]
    hidden, spans = _step(step, enc)
    assert enc.calls == [[11, 12, 21]]  # one tower call for the step, each image once
    torch.testing.assert_close(hidden, _expected(step), rtol=0, atol=0)
    assert r1.images[0].embedding is None and r2.images[0].embedding is None  # fully consumed
    assert r1.images[1].embedding is not None  # rows 2..5 still to come
    # the next chunk (a cached prefix ended inside r1's second image) takes the kept rows
    hidden, _ = _step([(r1, 8, 14)], enc)
    assert enc.calls == [[11, 12, 21]]
    torch.testing.assert_close(hidden, _expected([(r1, 8, 14)]), rtol=0, atol=0)
    assert r1.images[1].embedding is None


def test_merge_image_rows_mid_image_start_dtype_and_wrong_row_count():
    n = 12
    req = ReqImages(_mm([(2, 8, 5)], n), n)
    enc = _Encoder()
    spans = req.spans(6, 12, 0)  # the prefix cache held positions 0..6: the extend starts mid-image
    hidden = torch.full((6, HIDDEN), -1.0, dtype=torch.bfloat16)
    out = merge_image_rows(hidden, spans, enc)
    assert out.dtype == torch.bfloat16 and enc.calls == [[5]]
    want = _expected([(req, 6, 12)]).to(torch.bfloat16)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert req.images[0].embedding is None

    def short(images):
        return [torch.zeros(im.length - 1, HIDDEN) for im in images]

    with pytest.raises(RuntimeError, match="7 rows of an image with 8"):
        merge_image_rows(torch.zeros(6, HIDDEN), req.spans(6, 12, 0), short)


# ---------------------------------------------------------------- through Req
def _msg(rid: str, ids: list[int], mm: MultimodalInputs | None) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=rid, input_ids=ids, sampling_params=SamplingParams(max_new_tokens=8), mm=mm
    )


def _req(msg: TokenizedGenerateReqInput) -> Req:
    return Req.from_input(msg, msg.sampling_params, seed=0, eos_token_ids=[2], queue_seq=0)


def test_req_from_input_keys_by_image_and_keeps_the_token_ids():
    spans = [(1, 4), (7, 3)]
    ids = _prompt(12, spans)
    req = _req(_msg("a", ids, _mm([(1, 4, 77), (7, 3, 88)], 12)))
    assert req.prompt_ids == ids
    assert req.origin_input_ids == [10, *[pad_id(77)] * 4, 15, 16, *[pad_id(88)] * 3, 20, 21]
    assert req.images is not None and req.images.model_ids(req.origin_input_ids) == ids
    assert req.all_ids_len == len(ids)
    # another image at the same place: the same token ids, another key
    other = _req(_msg("b", ids, _mm([(1, 4, 77), (7, 3, 99)], 12)))
    assert other.prompt_ids == ids and other.origin_input_ids[:7] == req.origin_input_ids[:7]
    assert other.origin_input_ids[7:10] != req.origin_input_ids[7:10]
    # text only: one list, no images
    plain = _req(_msg("c", ids, None))
    assert plain.images is None and plain.origin_input_ids == ids == plain.prompt_ids


def test_req_drops_kept_embeddings_when_retracted_or_released():
    ids = _prompt(10, [(2, 5)])
    req = _req(_msg("a", ids, _mm([(2, 5, 7)], 10)))
    enc = _Encoder()
    merge_image_rows(torch.zeros(4, HIDDEN), req.images.spans(0, 4, 0), enc)
    assert req.images.images[0].embedding is not None  # 2 of its 5 rows consumed
    req.set_state(ReqStatus.PREFILLING)
    req.retract()
    assert req.images.images[0].embedding is None
    merge_image_rows(torch.zeros(4, HIDDEN), req.images.spans(0, 4, 0), enc)
    assert enc.calls == [[7], [7]]  # recomputed after the retraction
    req.set_state(ReqStatus.PREFILLING)
    req.mark_released()
    assert req.images.images[0].embedding is None

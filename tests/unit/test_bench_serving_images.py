"""bench_serving's image dataset: rows, images, seeding, request bodies (no server), and the bodies a
local fake OpenAI server receives."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest

from srt import bench_serving
from srt.bench_serving import _input_factory, _unshared, benchmark
from srt.bench_serving_images import (
    DEFAULT_IMAGE_PLACEHOLDER,
    ImageRow,
    add_image_section,
    check_image_endpoint,
    decode_image,
    image_summary,
    image_workload,
    parse_image_resolution,
    sample_image_requests,
)
from srt.benchmark.datasets import sample_random_requests
from srt.benchmark.metrics import RESULT_BLOCK_TITLE, parse_result_block
from tests.helpers.fake_openai_server import FakeOpenAIServer

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]
PH = DEFAULT_IMAGE_PLACEHOLDER


class WordTokenizer:
    """A word-level stand-in for a BPE tokenizer (" word" is one token) with a ChatML-like template
    that renders an image part as Qwen2-VL's placeholder."""

    def __init__(self) -> None:
        self.vocab = ["<s>", "</s>"] + [f"Ġ{w}" for w in WORDS]
        self.index = {t: i for i, t in enumerate(self.vocab)}
        self.all_special_ids = [0, 1]

    def __len__(self) -> int:
        return len(self.vocab)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.vocab[i] for i in ids]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.index["Ġ" + w] for w in text.split() if "Ġ" + w in self.index]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.vocab[i].replace("Ġ", " ") for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True) -> str:
        parts = messages[0]["content"]
        body = "".join(PH if p["type"] == "image" else p["text"] for p in parts)
        return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def _rows(n=3, count=1, resolution="32x48", fmt="jpeg", content="random", seed=0, **kw) -> list[ImageRow]:
    rng = np.random.default_rng(seed)
    return sample_image_requests(WordTokenizer(), rng, n, count, 12, 6, 0.5, resolution, fmt, content, **kw)


def test_parse_image_resolution_presets_and_sglang_height_by_width():
    assert parse_image_resolution("1080p") == (1920, 1080)
    assert parse_image_resolution("720P") == (1280, 720)
    assert parse_image_resolution("360p") == (640, 360)
    assert parse_image_resolution("4k") == (3840, 2160)
    assert parse_image_resolution("1080x1920") == (1920, 1080)  # HEIGHTxWIDTH, as SGLang reads it
    for bad in ("", "1080", "0x10", "axb", "10x10x10"):
        with pytest.raises(ValueError, match="image-resolution"):
            parse_image_resolution(bad)


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_each_request_carries_its_images_at_the_resolution_and_format(fmt):
    rows = _rows(n=4, count=2, resolution="24x40", fmt=fmt)
    assert len(rows) == 4
    for r in rows:
        assert len(r.image_data) == 2 and (r.width, r.height) == (40, 24) and r.image_format == fmt
        for uri in r.image_data:
            assert uri.startswith(f"data:image/{fmt};base64,")
            img = decode_image(uri)
            assert img.format == fmt.upper() and img.size == (40, 24) and img.mode == "RGB"
        assert r.prompt == PH * 2 + r.text  # the /generate text: a placeholder per image, then the text
        assert r.prompt_len == len(r.text.split()) and 6 <= r.prompt_len <= 12 and 3 <= r.output_len <= 6
    all_images = [u for r in rows for u in r.image_data]
    assert len(set(all_images)) == len(all_images)  # random content: every image its own


def test_seeded_and_text_as_the_random_dataset():
    a, b, c = _rows(seed=5), _rows(seed=5), _rows(seed=6)
    assert [(r.text, r.output_len, r.image_data) for r in a] == [
        (r.text, r.output_len, r.image_data) for r in b
    ]
    assert [r.image_data for r in a] != [r.image_data for r in c]
    text = sample_random_requests(WordTokenizer(), np.random.default_rng(5), 3, 12, 6, 0.5)
    assert [(r.prompt, r.output_len) for r in text] == [(r.text, r.output_len) for r in a]


def test_random_image_count_and_blank_content():
    rows = _rows(n=40, count=3, random_image_count=True)
    counts = [len(r.image_data) for r in rows]
    assert set(counts) == {1, 2, 3}
    blank = _rows(n=2, count=2, fmt="png", content="blank")
    assert len({u for r in blank for u in r.image_data}) == 1
    assert (np.asarray(decode_image(blank[0].image_data[0])) == 255).all()
    summary = image_summary(rows)
    assert summary["total_images"] == sum(counts) and summary["images_per_request"] == [1, 3]
    assert summary["resolution"] == "48x32" and image_summary(text_rows := []) is None and not text_rows


def test_chat_template_for_native_text_and_bad_flags():
    rows = _rows(n=2, count=2, chat_template=True)
    assert rows[0].prompt == f"<|im_start|>user\n{PH}{PH}{rows[0].text}<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="image-placeholder"):
        _rows(count=1, chat_template=True, placeholder="<image>")
    with pytest.raises(ValueError, match="image-count"):
        _rows(count=0)
    with pytest.raises(ValueError, match="image-content"):
        _rows(content="noise")


def test_request_bodies_chat_and_native():
    row = _rows(n=1, count=2)[0]
    chat = _input_factory("http://h/v1/chat/completions", "m", True, True, {"top_k": 1})(row)
    assert chat.prompt == row.text and chat.output_len == row.output_len and chat.extra_body["top_k"] == 1
    content = chat.extra_body["messages"][0]["content"]
    assert chat.extra_body["messages"][0]["role"] == "user" and len(content) == 3
    assert content[:2] == [{"type": "image_url", "image_url": {"url": u}} for u in row.image_data]
    assert content[2] == {"type": "text", "text": row.text}
    native = _input_factory("http://h/generate", "m", True, True, None)(row, 4)
    assert native.prompt == PH * 2 + row.text and native.output_len == 4
    assert native.extra_body == {"image_data": row.image_data}


def test_completion_backends_are_refused_with_the_chat_backends_named():
    with pytest.raises(ValueError, match="vllm-chat"):
        check_image_endpoint("vllm", "/v1/completions")
    check_image_endpoint("openai-chat", "/v1/chat/completions")
    check_image_endpoint("srt", "/generate")
    args = SimpleNamespace(backend="openai", num_prompts=1, image_count=1)
    with pytest.raises(SystemExit, match="chat backend"):
        image_workload(args, WordTokenizer(), np.random.default_rng(0))
    make_input = _input_factory("http://h/v1/completions", "m", True, True, None)
    with pytest.raises(ValueError):
        make_input(_rows(n=1)[0])


def test_warmup_copy_changes_the_first_image_only():
    row = _rows(n=1, count=2, fmt="png")[0]
    warm = _unshared(row, 0)
    assert warm.image_data[0] != row.image_data[0] and warm.image_data[1] == row.image_data[1]
    assert decode_image(warm.image_data[0]).size == (48, 32) and warm.text == row.text
    assert (warm.prompt, warm.output_len) == (row.prompt, row.output_len)


def test_result_block_gets_an_images_section():
    rows = _rows(n=2, count=1)
    block = f"{RESULT_BLOCK_TITLE:=^50}\nBackend:                                 x\n" + "=" * 50
    out = add_image_section(block, rows, "random").splitlines()
    assert out[-1] == "=" * 50 and out[1].startswith("Backend:") and "Images" in out[2]
    parsed = parse_result_block("\n".join(out))
    assert parsed["Total images"] == 2 and parsed["Image resolution (WxH)"] == "48x32"
    assert add_image_section(block, [], "random") == block


def _run_fake(backend: str, rows: list[ImageRow]) -> list[dict]:
    with FakeOpenAIServer(ttft_s=0.0, itl_s=0.0) as srv:
        res = asyncio.run(benchmark(rows, backend=backend, base_url=srv.base_url, max_concurrency=2))
        bodies = list(srv.requests)
    assert res.metrics.completed == len(rows) and res.metrics.failed == 0
    return bodies


def test_bodies_sent_to_a_server():
    rows = _rows(n=3, count=2)
    bodies = _run_fake("openai-chat", rows)
    assert len(bodies) == 4  # the warm-up, then the rows
    measured = {json.dumps(b["messages"]): b for b in bodies[1:]}
    for r in rows:
        msgs = [
            {
                "role": "user",
                "content": [
                    *({"type": "image_url", "image_url": {"url": u}} for u in r.image_data),
                    {"type": "text", "text": r.text},
                ],
            }
        ]
        body = measured[json.dumps(msgs)]
        assert body["max_tokens"] == r.output_len and body["stream"] is True and body["ignore_eos"] is True
    warm_urls = [p["image_url"]["url"] for p in bodies[0]["messages"][0]["content"][:-1]]
    assert not set(warm_urls[:1]) & {u for r in rows for u in r.image_data}
    native = _run_fake("srt", rows)[1:]
    assert sorted((b["text"], b["image_data"]) for b in native) == sorted(
        (r.prompt, r.image_data) for r in rows
    )


def test_cli_prints_images_and_records_them(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench_serving, "load_tokenizer", lambda path: WordTokenizer())
    out = tmp_path / "runs.jsonl"
    with FakeOpenAIServer(ttft_s=0.0, itl_s=0.0) as srv:
        argv = ["--backend", "vllm-chat", "--base-url", srv.base_url, "--dataset-name", "image"]
        argv += ["--num-prompts", "2", "--image-count", "2", "--image-resolution", "16x24"]
        argv += ["--random-input-len", "8", "--random-output-len", "3", "--output-file", str(out)]
        assert bench_serving.main(argv) == 0
    printed = capsys.readouterr().out
    assert "#Images: 4 of 24x16 (jpeg, random)" in printed
    assert parse_result_block(printed)["Images per request"] == 2
    rec = json.loads(out.read_text())
    assert rec["images"]["total_images"] == 4 and rec["image_resolution"] == "16x24"
    with pytest.raises(SystemExit, match="chat backend"):
        bench_serving.main(["--backend", "vllm", "--dataset-name", "image", "--num-prompts", "1"])

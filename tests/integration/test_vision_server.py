"""Vision-language models through the real server (``python -m srt.launch_server``): the five tiny
random-weight kinds of tests/helpers/tiny_vlm.py (Qwen2-VL, Qwen2.5-VL, LLaVA-1.5, LLaVA-NeXT,
Gemma 3, whose image tokens attend to each other both ways under a sliding window).

Per kind (one server each, ``--max-images-per-request 2``): greedy tokens of image + text prompts
equal transformers' (a 2-image prompt of two sizes and a 1-image prompt, sent concurrently, as
data URI / raw base64 / http URL, alone and in one batch), through /generate and the OpenAI chat
route; the Responses API's ``input_image`` gives the chat's output; the prefix cache keys an image
by its pixels (the same image again is a hit past its span, another image at the same place is a
miss from its start, and changes the output); every bad image is a 400 in OpenAI's error shape
naming the input while good requests sent with it still get transformers' tokens; the pool is
idle afterwards.

A Qwen2-VL server with ``--chunked-prefill-size 16 --page-size 4`` splits image spans across
prefill chunks and reuses a cached prefix that ends inside an image, still equal to transformers,
then takes a short mixed soak (streams, disconnects, deadlines, chat) and goes back to idle. A
Gemma 3 server with the same flags keeps each image in one prefill chunk (a chunk that would cut
one ends before it, or takes all of it), also from a cached prefix ending inside an image, and
still equals transformers. The default (text-only) model refuses images with a 400.
Text prompts are checked against transformers' processor run on the text (Gemma 3 expands its
placeholder in the text, before tokenizing), id prompts against the id-level expansion.
A refused image is named by its place in the request (``image_data[1]``, a batch's
``image_data[1]``, a chat part), whichever check refuses it.
"""

from __future__ import annotations

import base64
import concurrent.futures
import functools
import hashlib
import io
import json
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from PIL import Image

from tests.helpers import tiny_vlm
from tests.helpers.ref_cache import cached_json, folder_digest
from tests.helpers.server import DEFAULT_TEST_ARGS, ServerProcess, free_port
from tests.helpers.tiny_vlm import (
    VLM_KINDS,
    expand_prompt,
    hf_text_greedy,
    hf_text_inputs,
    hf_vlm_greedy,
    load_config,
    load_images_for_test,
    save_tiny_vlm,
)

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
MAX_IMAGES = 2  # --max-images-per-request of the per-kind servers
# 0 and 2 differ in size (and, for Qwen and LLaVA-NeXT, in token count); 3 and 4 share a size;
# then the odd shapes: 1x1, 1x300 (Qwen refuses an aspect ratio past 200), 300x2
IMAGES = [
    *load_images_for_test(5, seed=0, sizes=((100, 80), (64, 96), (120, 120), (72, 72), (72, 72))),
    *(Image.new("RGB", size, (200, 10, 10)) for size in ((1, 1), (1, 300), (300, 2))),
]
TINY, TALL, WIDE = 5, 6, 7


# ---------------------------------------------------------------------------- images and prompts
def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_uri(data: bytes | Image.Image) -> str:
    data = png(data) if isinstance(data, Image.Image) else data
    return "data:image/png;base64," + base64.b64encode(data).decode()


def raw_b64(image: Image.Image) -> str:
    return base64.b64encode(png(image)).decode()


def huge_png(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of ``width x height`` black pixels: ~50 KB for 20000 x 20000."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    row = b"\0" * (1 + (width + 7) // 8)  # filter byte + the packed row
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def image_host():
    """A loopback HTTP server: ``/<i>.png`` is IMAGES[i]; anything else is a 404."""
    files = {f"/{i}.png": png(im) for i, im in enumerate(IMAGES)}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            data = files.get(self.path)
            if data is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@dataclass
class Vlm:
    kind: str
    path: str
    server: ServerProcess
    tokenizer: object
    model: str  # the served model name (/v1/models)

    def chat_text(self, *parts: str | int) -> str:
        """The chat template's prompt of one user message: str parts are text, int parts images."""
        content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )

    def chat_ids(self, *parts: str | int) -> list[int]:
        return self.tokenizer(self.chat_text(*parts), add_special_tokens=False)["input_ids"]

    def reference(self, ids: list[int], images: tuple[int, ...]) -> list[int]:
        return _reference(self.path, tuple(ids), images)

    def image_span(self, ids: list[int], images: tuple[int, ...], k: int = 0) -> tuple[int, int]:
        """[start, end) of the k-th image's placeholder run in the expanded prompt."""
        expanded = expand_prompt(self.path, ids, [IMAGES[i] for i in images])
        token = load_config(self.path).image_token_id
        runs, start = [], None
        for pos, t in enumerate([*expanded, -1]):
            if t == token and start is None:
                start = pos
            elif t != token and start is not None:
                runs.append((start, pos))
                start = None
        return runs[k]

    def expanded_len(self, ids: list[int], images: tuple[int, ...]) -> int:
        return len(expand_prompt(self.path, ids, [IMAGES[i] for i in images]))

    def text_reference(self, text: str, images: tuple[int, ...]) -> tuple[list[int], int]:
        """transformers' greedy tokens of a text prompt, and its expanded length."""
        return _text_reference(self.path, text, images)


# transformers' references, cached on disk by the folder's and the images' bytes
# (tests/helpers/ref_cache.py): computing them is about a third of this module's time
@functools.cache
def _reference(path: str, ids: tuple[int, ...], images: tuple[int, ...]) -> list[int]:
    pics = [IMAGES[i] for i in images]
    key = [_folder_digest(path), list(ids), _images_digest(images), MAX_NEW]
    return cached_json("vlm-greedy", key, lambda: hf_vlm_greedy(path, list(ids), pics, MAX_NEW), [tiny_vlm])


@functools.cache
def _text_reference(path: str, text: str, images: tuple[int, ...]) -> tuple[list[int], int]:
    pics = [IMAGES[i] for i in images]

    def compute() -> list:
        n = hf_text_inputs(path, text, pics)["input_ids"].shape[1]
        return [hf_text_greedy(path, text, pics, MAX_NEW), n]

    key = [_folder_digest(path), text, _images_digest(images), MAX_NEW]
    tokens, n = cached_json("vlm-text-greedy", key, compute, [tiny_vlm])
    return tokens, n


_folder_digest = functools.cache(folder_digest)


def _images_digest(images: tuple[int, ...]) -> str:
    h = hashlib.sha256()
    for i in images:
        h.update(f"{IMAGES[i].mode}{IMAGES[i].size}".encode() + IMAGES[i].tobytes())
    return h.hexdigest()[:32]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in made:
            made[kind] = save_tiny_vlm(kind, tmp_path_factory.mktemp(kind))
        return made[kind]

    return get


def _args(path: str, *extra: str) -> list[str]:
    return [*DEFAULT_TEST_ARGS, "--model-path", path, *extra]


def _vlm(kind: str, path: str, server: ServerProcess) -> Vlm:
    from transformers import AutoTokenizer

    model = requests.get(server.url("/v1/models"), timeout=10).json()["data"][0]["id"]
    return Vlm(kind, path, server, AutoTokenizer.from_pretrained(path), model)


@pytest.fixture(scope="module", params=VLM_KINDS)
def vlm(request, folders):
    kind, path = request.param, folders(request.param)
    with ServerProcess(_args(path, "--max-images-per-request", str(MAX_IMAGES))) as server:
        yield _vlm(kind, path, server)


# ---------------------------------------------------------------------------- request helpers
def generate(server: ServerProcess, body: dict):
    """POST /generate (greedy unless ``body`` says otherwise); the 200 response's JSON."""
    r = requests.post(server.url("/generate"), json={"sampling_params": GREEDY, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def run_concurrently(fns, workers: int = 8) -> list:
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return [f.result() for f in [pool.submit(fn) for fn in fns]]


def assert_error(r: requests.Response, *needles: str, param: str | None = None) -> None:
    """A 400 in OpenAI's error shape whose message holds ``needles`` (and names ``param``)."""
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and err["message"], err
    for needle in needles:
        assert needle in err["message"], (needle, err["message"])
    if param is not None:
        assert err["param"] == param, err


def server_state(server: ServerProcess) -> dict:
    return requests.get(server.url("/get_server_info"), timeout=10).json()["internal_states"][0]


def assert_idle(server: ServerProcess) -> None:
    """No request left, every KV slot free or cached, no radix lock, every request row free."""
    deadline = time.monotonic() + 30
    state = server_state(server)
    while (state["num_running_reqs"] or state["num_queued_reqs"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        state = server_state(server)
    assert state["num_running_reqs"] == 0 and state["num_queued_reqs"] == 0, state
    assert state["available_size"] + state["evictable_size"] == state["max_total_num_tokens"], state
    assert state["protected_size"] == 0 and state["free_req_rows"] == state["req_rows"], state
    assert requests.post(server.url("/flush_cache"), json={}, timeout=30).status_code == 200
    assert server_state(server)["available_size"] == state["max_total_num_tokens"]


def good_jobs(vlm: Vlm, image_host: str) -> list[tuple[dict, list[int], int]]:
    """(body, expected output ids, expected prompt_tokens) of the reference prompts: two images
    of different sizes (data URI + raw base64), one image (by URL, not in a list)."""
    two = vlm.chat_ids("Compare", 0, "with", 2, "Which is brighter?")
    one = vlm.chat_ids("Describe", 1, "briefly.")
    return [
        (
            {"input_ids": two, "image_data": [data_uri(IMAGES[0]), raw_b64(IMAGES[2])]},
            vlm.reference(two, (0, 2)),
            vlm.expanded_len(two, (0, 2)),
        ),
        (
            {"input_ids": one, "image_data": f"{image_host}/1.png"},
            vlm.reference(one, (1,)),
            vlm.expanded_len(one, (1,)),
        ),
    ]


def check_good(vlm: Vlm, job: tuple[dict, list[int], int]) -> None:
    body, want, prompt_tokens = job
    out = generate(vlm.server, body)
    assert out["output_ids"] == want, (vlm.kind, body.get("input_ids"))
    assert out["meta_info"]["prompt_tokens"] == prompt_tokens


# ---------------------------------------------------------------------------- per kind
def test_generate_matches_transformers(vlm, image_host):
    jobs = good_jobs(vlm, image_host)
    # each prompt alone, both at once (twice), and the two as one batch of texts
    run_concurrently([functools.partial(check_good, vlm, job) for job in jobs * 2])
    texts = [
        vlm.chat_text("Compare", 0, "with", 2, "Which is brighter?"),
        vlm.chat_text("Describe", 1, "briefly."),
    ]
    wants = [vlm.text_reference(texts[0], (0, 2)), vlm.text_reference(texts[1], (1,))]
    batch = generate(vlm.server, {"text": texts, "image_data": [j[0]["image_data"] for j in jobs]})
    assert [o["output_ids"] for o in batch] == [want for want, _ in wants]
    assert [o["meta_info"]["prompt_tokens"] for o in batch] == [n for _, n in wants]


def test_chat_matches_transformers(vlm, image_host):
    import openai

    client = openai.OpenAI(base_url=vlm.server.url("/v1"), api_key="none", max_retries=0)
    content = [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": data_uri(IMAGES[0]), "detail": "auto"}},
        {"type": "text", "text": "with"},
        {"type": "image_url", "image_url": {"url": f"{image_host}/2.png"}},
        {"type": "text", "text": "Which is brighter?"},
    ]
    out = client.chat.completions.create(
        model=vlm.model,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_NEW,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    want, prompt_tokens = vlm.text_reference(
        vlm.chat_text("Compare", 0, "with", 2, "Which is brighter?"), (0, 2)
    )
    assert out.choices[0].message.content == vlm.tokenizer.decode(want, skip_special_tokens=True)
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == MAX_NEW


def test_responses_input_image_equals_chat(vlm):
    image = data_uri(IMAGES[1])
    chat = requests.post(
        vlm.server.url("/v1/chat/completions"),
        json={
            "model": vlm.model,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Describe"},
                        {"type": "image_url", "image_url": {"url": image}},
                    ],
                }
            ],
            "max_tokens": MAX_NEW,
            "temperature": 0,
        },
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    resp = requests.post(
        vlm.server.url("/v1/responses"),
        json={
            "model": vlm.model,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Describe"},
                        {"type": "input_image", "image_url": image},
                    ],
                }
            ],
            "max_output_tokens": MAX_NEW,
            "temperature": 0,
        },
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    text = "".join(c["text"] for item in body["output"] for c in item.get("content", []))
    assert text and text == chat.json()["choices"][0]["message"]["content"]
    assert body["usage"]["input_tokens"] == chat.json()["usage"]["prompt_tokens"]


def test_prefix_cache_is_keyed_by_image_content(vlm):
    # a long text after the image, so the page-aligned hit can reach past the image's span
    suffix = "Now describe every detail of the picture above, carefully and at length, in plain words."
    ids = vlm.chat_ids(f"Cache check for {vlm.kind}:", 3, suffix)
    start, end = vlm.image_span(ids, (3,))
    first = generate(vlm.server, {"input_ids": ids, "image_data": data_uri(IMAGES[3])})
    assert first["meta_info"]["cached_tokens"] <= start  # nothing of this prompt ran before
    assert first["output_ids"] == vlm.reference(ids, (3,))
    # the same pixels, encoded differently: a hit covering the whole image span
    again = generate(vlm.server, {"input_ids": ids, "image_data": raw_b64(IMAGES[3])})
    assert again["meta_info"]["cached_tokens"] >= end > start
    assert again["output_ids"] == first["output_ids"]
    # another image of the same size at the same place: no hit past the image's start, and
    # another output
    other = generate(vlm.server, {"input_ids": ids, "image_data": data_uri(IMAGES[4])})
    assert other["meta_info"]["cached_tokens"] <= start
    assert other["meta_info"]["prompt_tokens"] == first["meta_info"]["prompt_tokens"]
    assert other["output_ids"] != first["output_ids"]
    assert other["output_ids"] == vlm.reference(ids, (4,))


def _bad_cases(vlm: Vlm) -> list[tuple[str, dict, tuple[str, ...], str | None]]:
    """(name, /generate body, message needles, param) of requests that must be 400s."""
    one = vlm.chat_ids("Look at", 0, "now.")
    good = png(IMAGES[0])
    three = vlm.chat_ids("A", 0, "B", 1, "C", 2, "?")
    return [
        ("truncated", {"input_ids": one, "image_data": data_uri(good[: len(good) // 2])}, ("decode",), "0"),
        # 20000 x 20000: past Pillow's decompression-bomb bound; 8000 x 8000: past --max-image-pixels
        ("huge", {"input_ids": one, "image_data": data_uri(huge_png(20000, 20000))}, ("pixels",), "0"),
        (
            "too many pixels",
            {"input_ids": one, "image_data": data_uri(huge_png(8000, 8000))},
            ("8000x8000", "--max-image-pixels"),
            "0",
        ),
        (
            "bad base64",
            {"input_ids": one, "image_data": "data:image/png;base64,@@not#base64@@"},
            ("base64",),
            "0",
        ),
        (
            "not an image",
            {"input_ids": one, "image_data": base64.b64encode(b"hello").decode()},
            ("format",),
            "0",
        ),
        (
            "closed port",
            {"input_ids": one, "image_data": f"http://127.0.0.1:{free_port()}/x.png"},
            ("fetch",),
            "0",
        ),
        (
            "too many",
            {"input_ids": three, "image_data": [data_uri(IMAGES[i]) for i in range(3)]},
            ("--max-images-per-request",),
            str(MAX_IMAGES),
        ),
        (
            "2 placeholders, 1 image",
            {"input_ids": vlm.chat_ids("A", 0, "B", 1, "?"), "image_data": [data_uri(good)]},
            ("placeholder",),
            None,
        ),
        ("placeholder, no image", {"input_ids": one}, ("no image",), None),
    ]


def test_bad_images_are_400s_and_spare_the_others(vlm, image_host):
    jobs = good_jobs(vlm, image_host)
    cases = _bad_cases(vlm)
    cases.append(
        ("404", {"input_ids": jobs[1][0]["input_ids"], "image_data": f"{image_host}/nope.png"}, ("404",), "0")
    )

    def bad(case) -> None:
        _name, body, needles, index = case
        r = requests.post(vlm.server.url("/generate"), json={"sampling_params": GREEDY, **body}, timeout=60)
        assert_error(r, *needles, param=None if index is None else f"image_data[{index}]")

    def chat_bad() -> None:
        content = [
            {"type": "text", "text": "Look"},
            {"type": "image_url", "image_url": {"url": data_uri(png(IMAGES[0])[:100])}},
        ]
        body = {"model": vlm.model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        r = requests.post(vlm.server.url("/v1/chat/completions"), json=body, timeout=60)
        assert_error(r, "decode", param="messages[0].content[1].image_url")

    fns = [functools.partial(bad, c) for c in cases] + [chat_bad]
    fns += [functools.partial(check_good, vlm, job) for job in jobs * 2]
    run_concurrently(fns[::2] + fns[1::2])  # good and bad interleaved
    # good requests after the bad ones are unharmed too
    run_concurrently([functools.partial(check_good, vlm, job) for job in jobs])


def test_a_1x1_image_is_served_like_transformers(vlm):
    ids = vlm.chat_ids("Look at", TINY, "now.")
    out = generate(vlm.server, {"input_ids": ids, "image_data": data_uri(IMAGES[TINY])})
    assert out["output_ids"] == vlm.reference(ids, (TINY,))


def test_pool_idle_after_everything(vlm):
    assert_idle(vlm.server)


def test_extreme_aspect_ratios_are_served_like_transformers_or_refused(vlm):
    """Last for each kind (a server that died would fail the others): a 300x2 image leaves
    LLaVA-NeXT no unpadded grid row, only the base crop's rows."""
    for index in (TALL, WIDE):
        ids = vlm.chat_ids("Look at", index, "now.")
        body = {"input_ids": ids, "image_data": data_uri(IMAGES[index]), "sampling_params": GREEDY}
        r = requests.post(vlm.server.url("/generate"), json=body, timeout=60)
        try:
            want = vlm.reference(ids, (index,))
        except ValueError as e:  # transformers' image processor refuses it (Qwen: aspect ratio > 200)
            assert "aspect ratio" in str(e)
            assert_error(r, "{}x{}".format(*IMAGES[index].size), "aspect ratio")
            continue
        assert r.status_code == 200, (IMAGES[index].size, r.text)
        assert r.json()["output_ids"] == want, IMAGES[index].size


# ---------------------------------------------------------------------------- chunked prefill
CHUNK, PAGE = 16, 4


def _chunked_server(folders, kind: str):
    path = folders(kind)
    with ServerProcess(_args(path, "--chunked-prefill-size", str(CHUNK), "--page-size", str(PAGE))) as server:
        yield _vlm(kind, path, server)


@pytest.fixture(scope="module")
def chunked(folders):
    yield from _chunked_server(folders, "qwen2_vl")


def test_chunked_prefill_splits_images_and_matches_transformers(chunked, image_host):
    jobs = good_jobs(chunked, image_host)
    two = jobs[0][0]["input_ids"]
    for k in (0, 1):  # both images of the 2-image prompt straddle a chunk boundary
        start, end = chunked.image_span(two, (0, 2), k)
        assert start // CHUNK != (end - 1) // CHUNK, (k, start, end)
    run_concurrently([functools.partial(check_good, chunked, job) for job in jobs])
    # a prompt sharing the first image, then other text: its cached prefix (page-aligned) ends
    # inside that image, so the prefill starts mid-span
    ids = chunked.chat_ids("Compare", 0, "and nothing else, in a few words.")
    start, end = chunked.image_span(ids, (0,))
    assert end % PAGE != 0
    out = generate(chunked.server, {"input_ids": ids, "image_data": data_uri(IMAGES[0])})
    assert start < out["meta_info"]["cached_tokens"] < end, (start, end, out["meta_info"])
    assert out["output_ids"] == chunked.reference(ids, (0,))


@pytest.fixture(scope="module")
def chunked_gemma(folders):
    yield from _chunked_server(folders, "gemma3")


def test_chunked_prefill_keeps_bidirectional_images_whole(chunked_gemma, image_host):
    vlm = chunked_gemma
    jobs = good_jobs(vlm, image_host)
    two = jobs[0][0]["input_ids"]
    for k in (0, 1):  # a chunk of CHUNK tokens would cut both images of the 2-image prompt
        start, end = vlm.image_span(two, (0, 2), k)
        assert start // CHUNK != (end - 1) // CHUNK, (k, start, end)
    run_concurrently([functools.partial(check_good, vlm, job) for job in jobs])
    text = vlm.chat_text("Compare", 0, "with", 2, "Which is brighter?")
    want, n = vlm.text_reference(text, (0, 2))
    out = generate(vlm.server, {"text": text, "image_data": [data_uri(IMAGES[0]), data_uri(IMAGES[2])]})
    assert (out["output_ids"], out["meta_info"]["prompt_tokens"]) == (want, n)
    # an image, then the same image with other text: the page-aligned cached prefix ends inside it
    first = vlm.chat_ids("Look at", 0, "first.")
    assert generate(vlm.server, {"input_ids": first, "image_data": data_uri(IMAGES[0])})["output_ids"] == (
        vlm.reference(first, (0,))
    )
    ids = vlm.chat_ids("Look at", 0, "and nothing else, in a few words.")
    start, end = vlm.image_span(ids, (0,))
    assert end % PAGE != 0
    out = generate(vlm.server, {"input_ids": ids, "image_data": data_uri(IMAGES[0])})
    assert start < out["meta_info"]["cached_tokens"] < end, (start, end, out["meta_info"])
    assert out["output_ids"] == vlm.reference(ids, (0,))
    assert_idle(vlm.server)


def test_image_processor_refusal_names_the_image(chunked):
    # the refusal comes from ImagePromptProcessor._run, shared by every kind
    body = {
        "input_ids": chunked.chat_ids("A", 0, "and", 1, "?"),
        "image_data": [data_uri(IMAGES[0]), data_uri(Image.new("RGB", (1, 300)))],
        "sampling_params": GREEDY,
    }
    r = requests.post(chunked.server.url("/generate"), json=body, timeout=60)
    assert_error(r, "1x300", param="image_data[1]")


def test_batch_image_error_names_the_prompt(chunked):
    text = chunked.chat_text("Look at", 0, "now.")
    body = {"text": [text, text], "image_data": [data_uri(IMAGES[0]), data_uri(b"not a png")]}
    r = requests.post(chunked.server.url("/generate"), json=body, timeout=60)
    assert_error(r, "format")
    assert r.json()["error"]["param"] == "image_data[1]", r.json()
    body["image_data"] = [data_uri(IMAGES[0]), [data_uri(IMAGES[1]), data_uri(b"not a png")]]
    r = requests.post(chunked.server.url("/generate"), json=body, timeout=60)
    assert r.json()["error"]["param"] == "image_data[1][1]", r.json()


@dataclass
class SoakPrompt:
    ids: list[int]
    images: list[str]  # data URIs and URLs of image_host
    ref: list[int]  # transformers' greedy tokens


def _soak_request(vlm: Vlm, i: int, prompt: SoakPrompt, image_host: str) -> str:
    """Request ``i`` of the soak (its kind: ``i % 8``); returns its outcome."""
    server = vlm.server
    body = {"input_ids": prompt.ids, "image_data": prompt.images, "sampling_params": GREEDY}
    long = {**body, "sampling_params": {**GREEDY, "max_new_tokens": 2000}}
    kind = i % 8
    if kind in (0, 1):  # image, plain: transformers' tokens
        assert generate(server, body)["output_ids"] == prompt.ref
        return "complete"
    if kind == 2:  # text only
        assert len(generate(server, {"text": f"Count to {i}:"})["output_ids"]) == MAX_NEW
        return "complete"
    if kind in (3, 4):  # image, streamed (the whole output so far in each event); 4: the
        # client goes away after the first event
        with requests.post(
            server.url("/generate"), json={**body, "stream": True}, stream=True, timeout=60
        ) as r:
            assert r.status_code == 200, r.text
            got = None
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    if kind == 4:
                        return "disconnected"
                    got = json.loads(line[6:])["output_ids"]
        assert got == prompt.ref
        return "complete"
    if kind == 5:  # a deadline that passes during the request
        r = requests.post(server.url("/generate"), json={**long, "timeout": 0.05}, timeout=60)
        assert r.status_code == 408, r.text
        return "timeout"
    if kind == 6:  # the client gives up on a long request (a disconnect mid-generation)
        with pytest.raises(requests.Timeout):
            requests.post(server.url("/generate"), json=long, timeout=0.3)
        return "gave up"
    url = prompt.images[-1] if prompt.images[-1].startswith("http") else f"{image_host}/1.png"
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": f"Hi {i}"}]
    chat = {"model": vlm.model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    r = requests.post(server.url("/v1/chat/completions"), json=chat, timeout=60)
    assert r.status_code == 200, r.text
    return "complete"


def test_soak_then_pool_idle(chunked, image_host):
    """40 mixed requests, 8 at a time, over three image pairs (so prefills miss the cache too)."""
    prompts = []
    for n, (a, b) in enumerate([(0, 2), (3, 1), (2, 4)]):
        ids = chunked.chat_ids(f"Soak {n}:", a, "then", b, "?")
        images = [data_uri(IMAGES[a]), f"{image_host}/{b}.png"]
        prompts.append(SoakPrompt(ids, images, chunked.reference(ids, (a, b))))
    aborted = server_state(chunked.server)["num_aborted"]
    fns = [functools.partial(_soak_request, chunked, i, prompts[i % 3], image_host) for i in range(40)]
    outcomes = run_concurrently(fns, workers=8)
    assert outcomes.count("complete") == 25 and outcomes.count("disconnected") == 5, outcomes
    assert_idle(chunked.server)
    # each client that gave up freed its request (aborted, not run for 2000 tokens)
    assert server_state(chunked.server)["num_aborted"] - aborted >= outcomes.count("gave up")
    for p in prompts:
        assert generate(chunked.server, {"input_ids": p.ids, "image_data": p.images})["output_ids"] == p.ref


# ---------------------------------------------------------------------------- the Engine
def test_engine_takes_pil_images_and_bytes(folders):
    """``Engine.generate(image_data=...)`` in process: a PIL image, PNG bytes, a batch."""
    from srt.entrypoints.engine import Engine

    path = folders("gemma3")
    vlm = Vlm("gemma3", path, None, _tokenizer_of(path), "")  # (no server: references only)
    one, two = vlm.chat_text("Look at", 1, "now."), vlm.chat_text("Compare", 0, "with", 2, "?")
    llm = Engine(model_path=path, max_total_tokens=4096, log_level="warning")
    try:
        out = llm.generate(one, GREEDY, image_data=IMAGES[1])
        assert (out["output_ids"], out["meta_info"]["prompt_tokens"]) == vlm.text_reference(one, (1,))
        outs = llm.generate([one, two], GREEDY, image_data=[png(IMAGES[1]), [IMAGES[0], png(IMAGES[2])]])
        assert [o["output_ids"] for o in outs] == [
            vlm.text_reference(t, i)[0] for t, i in ((one, (1,)), (two, (0, 2)))
        ]
    finally:
        llm.shutdown()


def _tokenizer_of(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# ---------------------------------------------------------------------------- a text-only model
def test_text_only_model_refuses_images(default_server):
    server = default_server  # tests/integration/conftest.py
    r = requests.post(
        server.url("/generate"),
        json={
            "text": "Describe the image.",
            "image_data": data_uri(IMAGES[0]),
            "sampling_params": GREEDY,
        },
        timeout=60,
    )
    assert_error(r, "takes no image input", param="image_data[0]")
    model = requests.get(server.url("/v1/models"), timeout=10).json()["data"][0]["id"]
    content = [
        {"type": "text", "text": "Hi"},
        {"type": "image_url", "image_url": {"url": data_uri(IMAGES[0])}},
    ]
    r = requests.post(
        server.url("/v1/chat/completions"),
        json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2},
        timeout=60,
    )
    assert_error(r, "takes no image input", param="messages[0].content[1].image_url")
    # text requests are still served
    assert len(generate(server, {"text": "Hi", "sampling_params": GREEDY})["output_ids"]) == MAX_NEW

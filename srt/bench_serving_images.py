"""The ``image`` workload of ``srt.bench_serving`` (SGLang's ``--dataset-name image``).

Rows. The text of each request is the ``random`` workload's (``--random-input-len``,
``--random-output-len``, ``--random-range-ratio``; the same text as a ``random`` run with the same
``--seed``, drawn first from the same generator), then ``--image-count`` images (1 to that many with
``--random-image-count``) of ``--image-resolution`` are drawn for it: uniform random RGB bytes
(``--image-content random``) or white (``blank``), encoded once, up front, with PIL as
``--image-format`` (jpeg at quality 85, or png) into ``data:image/<format>;base64,...`` URIs.
``prompt_len`` counts the text tokens only; a server that reports usage replaces it with its own
count (text, template and image tokens).

Requests. Chat backends (``POST /v1/chat/completions``) send one user message whose content is the
images then the text, as SGLang's client and the OpenAI API shape them::

    [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,..."}}, ...,
     {"type": "text", "text": "<the row's text>"}]

Native backends (``POST /generate``: srt, SGLang) send ``text`` with the model's image placeholder
once per image in front of the text (``--image-placeholder``, Qwen2-VL's by default), or the
tokenizer's chat template rendered over the same content (``--apply-chat-template``), and
``image_data``: the list of data URIs. Completion backends (``/v1/completions``) cannot carry
images: the run is refused with a message naming the backends that can.
"""

from __future__ import annotations

import argparse
import base64
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from srt.benchmark.datasets import DatasetRow, Tokenizer, sample_random_requests

IMAGE_RESOLUTIONS = {"4k": (3840, 2160), "1080p": (1920, 1080), "720p": (1280, 720), "360p": (640, 360)}
IMAGE_FORMATS = ("jpeg", "png")
IMAGE_CONTENTS = ("random", "blank")
JPEG_QUALITY = 85  # SGLang's
DEFAULT_IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # Qwen2-VL's
CHAT_ENDPOINT = "/v1/chat/completions"
NATIVE_ENDPOINT = "/generate"


@dataclass(slots=True)
class ImageRow(DatasetRow):
    """A request with images. ``prompt`` is what ``/generate`` sends (placeholders and text), ``text``
    the text part of a chat message, ``image_data`` the data URIs in order."""

    text: str = ""
    image_data: list[str] = field(default_factory=list)
    width: int = 0
    height: int = 0
    image_format: str = "jpeg"


def parse_image_resolution(resolution: str) -> tuple[int, int]:
    """``(width, height)`` of a preset (4k, 1080p, 720p, 360p) or of SGLang's custom form
    ``HEIGHTxWIDTH`` (``1080x1920``: 1080 rows, 1920 columns)."""
    res = resolution.strip().lower()
    if res in IMAGE_RESOLUTIONS:
        return IMAGE_RESOLUTIONS[res]
    parts = res.split("x")
    if len(parts) == 2 and all(p.isdigit() and int(p) > 0 for p in parts):
        return int(parts[1]), int(parts[0])
    raise ValueError(
        f"--image-resolution {resolution!r}: choose one of {', '.join(IMAGE_RESOLUTIONS)} "
        "or HEIGHTxWIDTH (e.g. 1080x1920)"
    )


def encode_image(pixels: np.ndarray, image_format: str) -> str:
    """A ``data:image/<format>;base64,`` URI of ``pixels`` (``[height, width, 3]`` uint8)."""
    from PIL import Image

    if image_format not in IMAGE_FORMATS:
        raise ValueError(f"--image-format {image_format!r}: choose one of {', '.join(IMAGE_FORMATS)}")
    buf = io.BytesIO()
    options = {"quality": JPEG_QUALITY} if image_format == "jpeg" else {}
    Image.fromarray(pixels, "RGB").save(buf, format=image_format.upper(), **options)
    return f"data:image/{image_format};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"


def decode_image(uri: str):
    """The PIL image of a data URI (tests, and the warm-up's altered copies)."""
    from PIL import Image

    _, _, payload = uri.partition(";base64,")
    return Image.open(io.BytesIO(base64.b64decode(payload)))


def random_pixels(rng: np.random.Generator, width: int, height: int, content: str) -> np.ndarray:
    if content == "blank":
        return np.full((height, width, 3), 255, dtype=np.uint8)
    if content == "random":
        return rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    raise ValueError(f"--image-content {content!r}: choose one of {', '.join(IMAGE_CONTENTS)}")


def native_prompt(
    tokenizer: Tokenizer | None, text: str, n_images: int, placeholder: str, chat_template: bool
) -> str:
    """The ``text`` of a ``/generate`` request with ``n_images`` images (see the module docstring)."""
    if not chat_template:
        return placeholder * n_images + text
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    rendered = tokenizer.apply_chat_template(  # type: ignore[union-attr]
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    if rendered.count(placeholder) != n_images:
        raise ValueError(
            f"the tokenizer's chat template renders {rendered.count(placeholder)} image placeholder(s) "
            f"{placeholder!r} for {n_images} image(s); pass the model's --image-placeholder"
        )
    return rendered


def sample_image_requests(
    tokenizer: Tokenizer,
    rng: np.random.Generator,
    num_prompts: int,
    image_count: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    resolution: str = "1080p",
    image_format: str = "jpeg",
    image_content: str = "random",
    random_image_count: bool = False,
    placeholder: str = DEFAULT_IMAGE_PLACEHOLDER,
    chat_template: bool = False,
) -> list[ImageRow]:
    """The ``image`` workload (see the module docstring); every image is drawn from ``rng``."""
    if image_count < 1:
        raise ValueError(f"--image-count must be >= 1, got {image_count}")
    width, height = parse_image_resolution(resolution)
    text_rows = sample_random_requests(tokenizer, rng, num_prompts, input_len, output_len, range_ratio)
    if random_image_count:
        counts = [int(c) for c in rng.integers(1, image_count + 1, size=num_prompts)]
    else:
        counts = [image_count] * num_prompts
    blank = (
        encode_image(random_pixels(rng, width, height, "blank"), image_format)
        if image_content == "blank"
        else ""
    )
    rows = []
    for row, k in zip(text_rows, counts):
        # a blank image is the same bytes every time: encoded once
        images = [
            blank or encode_image(random_pixels(rng, width, height, image_content), image_format)
            for _ in range(k)
        ]
        rows.append(
            ImageRow(
                prompt=native_prompt(tokenizer, row.prompt, k, placeholder, chat_template),
                prompt_len=row.prompt_len,
                output_len=row.output_len,
                text=row.prompt,
                image_data=images,
                width=width,
                height=height,
                image_format=image_format,
            )
        )
    return rows


def chat_content(row: ImageRow) -> list[dict]:
    """The user message's content parts: the images, then the text."""
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": uri}} for uri in row.image_data]
    return [*parts, {"type": "text", "text": row.text}]


def check_image_endpoint(backend: str, endpoint: str) -> None:
    """Raise ``ValueError`` unless ``endpoint`` can carry images."""
    if endpoint not in (CHAT_ENDPOINT, NATIVE_ENDPOINT):
        raise ValueError(
            f"--dataset-name image needs a chat backend (openai-chat, sglang-oai-chat, vllm-chat, "
            f"lmdeploy-chat: {CHAT_ENDPOINT}) or a native one (srt, sglang: {NATIVE_ENDPOINT} with "
            f"image_data); --backend {backend} posts to {endpoint}, which takes no images"
        )


def add_images(body: dict, row: ImageRow, api_url: str) -> str:
    """Put ``row``'s images into ``body`` (a request's ``extra_body``, merged over what the request
    function builds: its ``messages`` replace the text-only message) as ``api_url``'s endpoint takes
    them; returns the prompt the request function should send."""
    if api_url.endswith(CHAT_ENDPOINT):
        body["messages"] = [{"role": "user", "content": chat_content(row)}]
        return row.text
    if api_url.endswith(NATIVE_ENDPOINT):
        body["image_data"] = list(row.image_data)
        return row.prompt
    raise ValueError(f"{api_url}: images go to {CHAT_ENDPOINT} or {NATIVE_ENDPOINT} only")


def unshared_image_row(row: ImageRow, i: int) -> ImageRow:
    """``row`` with its first image altered (one pixel, re-encoded): a warm-up request that no prefix
    or image cache can serve to the measured one."""
    import dataclasses

    img = decode_image(row.image_data[0]).convert("RGB")
    pixels = np.array(img)
    pixels[0, 0] = (pixels[0, 0].astype(np.int64) + 1 + i) % 256
    pixels[-1, -1] = 255 - pixels[-1, -1]
    return dataclasses.replace(row, image_data=[encode_image(pixels, row.image_format), *row.image_data[1:]])


def add_image_args(a: Callable[..., object]) -> None:
    """The image workload's flags (SGLang's names and defaults) on ``parser.add_argument``."""
    a("--image-count", type=int, default=1, help="Images per request (image dataset).")
    a("--random-image-count", action="store_true", help="1 to --image-count images per request.")
    a(
        "--image-resolution",
        default="1080p",
        help="4k, 1080p, 720p, 360p, or HEIGHTxWIDTH (SGLang's order, e.g. 1080x1920).",
    )
    a("--image-format", default="jpeg", choices=IMAGE_FORMATS)
    a("--image-content", default="random", choices=IMAGE_CONTENTS, help="Random pixels or a white image.")
    a(
        "--image-placeholder",
        default=DEFAULT_IMAGE_PLACEHOLDER,
        help="What marks one image in a /generate text (Qwen2-VL's by default).",
    )


def image_workload(args: argparse.Namespace, tokenizer: Tokenizer, rng: np.random.Generator) -> list:
    """The image workload of ``srt.bench_serving``'s parsed flags; ``SystemExit`` with the reason
    when a flag is wrong or ``--backend`` cannot carry images (before any image is drawn)."""
    from srt.benchmark.backends import BACKENDS

    try:
        check_image_endpoint(args.backend, BACKENDS[args.backend][1])
        return _sample_from_args(args, tokenizer, rng)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def _sample_from_args(args: argparse.Namespace, tokenizer: Tokenizer, rng: np.random.Generator) -> list:
    return sample_image_requests(
        tokenizer,
        rng,
        args.num_prompts,
        args.image_count,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        resolution=args.image_resolution,
        image_format=args.image_format,
        image_content=args.image_content,
        random_image_count=args.random_image_count,
        placeholder=args.image_placeholder,
        chat_template=args.apply_chat_template,
    )


def image_summary(rows: Sequence[DatasetRow]) -> dict | None:
    """Counts and sizes of the images of ``rows`` (None when no row has any)."""
    rows = [r for r in rows if isinstance(r, ImageRow)]
    if not rows:
        return None
    counts = [len(r.image_data) for r in rows]
    sizes = [sum(len(u) for u in r.image_data) for r in rows]
    return {
        "total_images": sum(counts),
        "images_per_request": [min(counts), max(counts)],
        "resolution": f"{rows[0].width}x{rows[0].height}",
        "image_format": rows[0].image_format,
        "mean_image_bytes_per_request": round(float(np.mean(sizes))),
    }


def count_line(rows: Sequence[DatasetRow], content: str) -> str:
    """``"  #Images: ..."`` for the workload line (empty without images)."""
    summary = image_summary(rows)
    if summary is None:
        return ""
    kib = summary["mean_image_bytes_per_request"] / 1024
    return (
        f"  #Images: {summary['total_images']} of {summary['resolution']} "
        f"({summary['image_format']}, {content}), {kib:.1f} KiB per request"
    )


def add_image_section(block: str, rows: Sequence[DatasetRow], content: str) -> str:
    """The result block with an ``Images`` section before its closing rule, in its layout (40-character
    labels); ``block`` as is without images."""
    summary = image_summary(rows)
    if summary is None:
        return block
    lo, hi = summary["images_per_request"]
    lines = [
        ("Total images:", summary["total_images"]),
        ("Images per request:", str(lo) if lo == hi else f"{lo}-{hi}"),
        ("Image resolution (WxH):", summary["resolution"]),
        ("Image format / content:", f"{summary['image_format']} / {content}"),
        ("Image data per request (KiB):", f"{summary['mean_image_bytes_per_request'] / 1024:.1f}"),
    ]
    head, _, rule = block.rpartition("\n")
    return "\n".join([head, f"{'Images':-^50}", *(f"{label:<40} {value}" for label, value in lines), rule])

"""The image-input fields of ``ServerArgs`` and how ``resolve()`` checks them.

A vision-language request carries images as data URIs, http(s) URLs, local paths or raw base64
(``srt/multimodal/image_io.py`` reads them). These flags bound what one request may make the server
do: how many images, how large (encoded bytes and decoded pixels), whether it may reach out to the
network and which local directory, if any, it may read.

This module is configuration: it imports nothing of srt but srt.configs.lora_args' ``arg_field``
and srt.utils. ``ImageLimits.from_args`` (in image_io) reads these fields by name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from srt.configs.lora_args import arg_field
from srt.utils.errors import ConfigError


@dataclass
class MultimodalArgs:
    max_images_per_request: int = arg_field(
        16, "The most images one request (one prompt) may carry; more is a 400."
    )
    disable_image_url_fetch: bool = arg_field(
        False,
        "Never fetch http(s) image URLs: a request that gives one gets a 400 (images must then come "
        "inline, as data URIs or base64).",
    )
    image_fetch_timeout: float = arg_field(
        10.0, "Seconds allowed for fetching one remote image (connect, headers and body); past it, a 400."
    )
    max_image_bytes: int = arg_field(
        20 * 1024 * 1024,
        "The largest encoded image accepted, in bytes (the decoded base64 of a data URI, a fetched "
        "body, a local file); larger is a 400, and a fetch stops reading past it.",
    )
    max_image_pixels: int = arg_field(
        50_000_000,
        "The largest image accepted, in width*height pixels, checked from the header before any pixel "
        "is decoded; larger is a 400.",
    )
    allowed_local_media_path: str = arg_field(
        "",
        "A directory under which requests may name images by file:// URL or plain path (the real "
        "path, symlinks resolved, must lie inside it). Empty: local paths are refused.",
    )


def resolve_mm_args(a: Any) -> None:
    """Check the image-input flags; normalize ``allowed_local_media_path`` to its real path."""
    positive = {
        "--max-images-per-request": a.max_images_per_request,
        "--image-fetch-timeout": a.image_fetch_timeout,
        "--max-image-bytes": a.max_image_bytes,
        "--max-image-pixels": a.max_image_pixels,
    }
    for flag, value in positive.items():
        if value is None or value <= 0:
            raise ConfigError(f"{flag} must be positive (got {value!r})")
    root = a.allowed_local_media_path
    if root:
        if not os.path.isdir(root):
            raise ConfigError(f"--allowed-local-media-path {root!r} is not an existing directory")
        a.allowed_local_media_path = os.path.realpath(root)

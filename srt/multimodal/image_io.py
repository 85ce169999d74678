"""Image inputs of vision-language requests: from what a request gives to a decoded RGB image.

What one image spec may be:

    "data:image/png;base64,<b64>"       a data URI (an image/* or octet-stream media type, base64 only)
    "http://..." / "https://..."        fetched with aiohttp (refused with --disable-image-url-fetch)
    "file:///abs/path" or a plain path  read from disk, only inside --allowed-local-media-path
    "<b64>"                             raw base64 (SGLang's /generate ``image_data``)
    bytes                               the encoded image itself
    PIL.Image.Image                     an image already decoded (the offline Engine)

A string that is none of the URIs is raw base64 when every character is of the base64 alphabet
(whitespace and '=' padding allowed), otherwise a path. So a path without '.' or '-' (``/srv/img/cat``)
reads as base64: give such a file as a file:// URL.

Bounds (``ImageLimits``, from ServerArgs' image flags): the encoded size (``max_bytes``: a fetch stops
reading past it, base64 is measured before it is decoded), the pixel count (``max_pixels``: read from
the header, before any pixel is decoded), the fetch time, and which local directory may be read
(its real path: a symlink out of it is refused, and nothing says whether a path outside exists).

Every bad image is an ``ImageInputError`` (a ``RequestError``: HTTP 400) whose message names the
input (``param``, e.g. ``messages[0].content[1].image_url``) and the cause; nothing here warns or
logs. Pillow's decompression-bomb warning is silenced (``max_pixels`` is the rule) and its error is a
400 like the rest. Decoding runs in a worker thread, so the event loop is never blocked by Pillow.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import os
import re
import stat
import threading
import urllib.parse
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from PIL import Image, UnidentifiedImageError

from srt.utils.errors import RequestError

if TYPE_CHECKING:  # imported where a URL is fetched: the scheduler and detokenizer children import
    import aiohttp  # this module too (through srt.entrypoints.launch), and only the main one fetches

# the encoded formats a request may send; others (EPS runs Ghostscript, and so on) are refused.
# MPO, the multi-picture JPEG of phone cameras, is opened by the JPEG plugin.
_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
_BASE64_TEXT = re.compile(r"[A-Za-z0-9+/=\s]+")
_CHUNK = 1 << 16
# warnings.catch_warnings swaps process-wide state: one header parse at a time holds it
_OPEN_LOCK = threading.Lock()


class ImageInputError(RequestError):
    """An image input that cannot be used (HTTP 400); the message starts with the input's ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(f"{param}: {message}" if param else message, param=param)


@dataclass(frozen=True)
class ImageLimits:
    """What reading one image may cost; defaults are ServerArgs' defaults."""

    allow_remote: bool = True  # not --disable-image-url-fetch
    fetch_timeout_s: float = 10.0  # --image-fetch-timeout
    max_bytes: int = 20 * 1024 * 1024  # --max-image-bytes
    max_pixels: int = 50_000_000  # --max-image-pixels
    local_root: str = ""  # --allowed-local-media-path ("": no local files)
    max_images: int = 16  # --max-images-per-request (checked by load_images)

    @classmethod
    def from_args(cls, args: Any) -> ImageLimits:
        """The limits from ServerArgs (read by attribute name; a missing one keeps its default)."""
        d = cls()
        return cls(
            allow_remote=not getattr(args, "disable_image_url_fetch", not d.allow_remote),
            fetch_timeout_s=float(getattr(args, "image_fetch_timeout", d.fetch_timeout_s)),
            max_bytes=int(getattr(args, "max_image_bytes", d.max_bytes)),
            max_pixels=int(getattr(args, "max_image_pixels", d.max_pixels)),
            local_root=getattr(args, "allowed_local_media_path", d.local_root) or "",
            max_images=int(getattr(args, "max_images_per_request", d.max_images)),
        )


async def load_image(
    spec: Any, limits: ImageLimits, param: str, *, session: aiohttp.ClientSession | None = None
) -> Image.Image:
    """One image spec (see the module docstring) -> a fully decoded RGB image.

    ``session``: an aiohttp session to fetch with (``load_images`` shares one); default a new one."""
    if isinstance(spec, Image.Image):
        _check_pixels(spec.size, limits, param)
        return await asyncio.to_thread(_pixels_to_rgb, spec, param)
    data = await _read_spec(spec, limits, param, session)
    return await asyncio.to_thread(decode_image, data, limits, param)


async def load_images(specs: list[Any], limits: ImageLimits, params: list[str]) -> list[Image.Image]:
    """The images of one request (one prompt), read concurrently; ``params[i]`` names ``specs[i]``.

    More than ``limits.max_images`` is an error. The first failure is raised and the other reads
    are cancelled."""
    if len(specs) != len(params):
        raise ValueError(f"load_images: {len(specs)} specs but {len(params)} params")
    if len(specs) > limits.max_images:
        raise ImageInputError(
            f"the request carries {len(specs)} images, more than the {limits.max_images} this server "
            "takes in one request (--max-images-per-request)",
            params[limits.max_images],
        )
    session = _new_session(limits) if limits.allow_remote and any(map(_is_http, specs)) else None
    tasks = [
        asyncio.ensure_future(load_image(spec, limits, param, session=session))
        for spec, param in zip(specs, params)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:  # after a failure, the reads still running are not needed
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if session is not None:
            await session.close()


def image_hash(img: Image.Image) -> int:
    """A 63-bit hash of the decoded pixels (mode, size and bytes): equal for the same pixels however
    they were encoded, so the prefix cache can tell images apart."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{img.mode}:{img.width}x{img.height}:".encode())
    h.update(img.tobytes())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def decode_image(data: bytes, limits: ImageLimits, param: str) -> Image.Image:
    """Encoded bytes -> a fully decoded RGB image; the pixel count is checked from the header before
    any pixel is decoded. Blocking (Pillow): call it in a worker thread."""
    im = _open(data, param)
    try:
        _check_pixels(im.size, limits, param)
        return _pixels_to_rgb(im, param)
    finally:
        im.close()


# ----------------------------------------------------------------------------------------------
# reading the encoded bytes


async def _read_spec(spec: Any, limits: ImageLimits, param: str, session) -> bytes:
    if isinstance(spec, (bytes, bytearray, memoryview)):
        data = bytes(spec)
        _check_bytes(len(data), limits, param, "the image")
        return data
    if not isinstance(spec, str):
        raise ImageInputError(
            f"an image is a URL, data URI, path or base64 string, not {type(spec).__name__}", param
        )
    text = spec.strip()
    if not text:
        raise ImageInputError("the image is an empty string", param)
    head = text[:8].lower()
    if head.startswith("data:"):
        return _read_data_uri(text, limits, param)
    if _is_http(text):
        return await fetch_image_bytes(text, limits, param, session)
    if head.startswith("file:"):
        return await asyncio.to_thread(read_local_image, _file_url_path(text, param), limits, param)
    if _BASE64_TEXT.fullmatch(text):
        return _b64decode(text, limits, param, "the image")
    return await asyncio.to_thread(read_local_image, text, limits, param)


def _is_http(spec: Any) -> bool:
    return isinstance(spec, str) and spec.lstrip()[:8].lower().startswith(("http://", "https://"))


def _read_data_uri(uri: str, limits: ImageLimits, param: str) -> bytes:
    header, comma, payload = uri.partition(",")
    if not comma:
        raise ImageInputError("the data URI has no ',' before its data", param)
    media_type, *opts = (part.strip().lower() for part in header[len("data:") :].split(";"))
    if "base64" not in opts:
        raise ImageInputError("only base64 data URIs are accepted (data:image/png;base64,...)", param)
    if media_type and not media_type.startswith("image/") and media_type != "application/octet-stream":
        raise ImageInputError(f"the data URI's media type {media_type!r} is not an image", param)
    return _b64decode(payload, limits, param, "the data URI's data")


def _b64decode(text: str, limits: ImageLimits, param: str, what: str) -> bytes:
    compact = "".join(text.split())
    _check_bytes(len(compact) // 4 * 3, limits, param, what)  # measured before decoding
    compact += "=" * (-len(compact) % 4)  # tolerate missing padding
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageInputError(f"{what} is not valid base64 ({e})", param) from None
    if not data:
        raise ImageInputError(f"{what} is empty", param)
    _check_bytes(len(data), limits, param, what)
    return data


def _check_bytes(n: int, limits: ImageLimits, param: str, what: str) -> None:
    if n > limits.max_bytes:
        raise ImageInputError(
            f"{what} is larger than the {limits.max_bytes} bytes this server takes (--max-image-bytes)",
            param,
        )


def _new_session(limits: ImageLimits) -> aiohttp.ClientSession:
    import aiohttp

    # identity encoding, no decompression: max_bytes bounds what crosses the wire and what we hold
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=limits.fetch_timeout_s),
        headers={"Accept-Encoding": "identity"},
        auto_decompress=False,
    )


async def fetch_image_bytes(
    url: str, limits: ImageLimits, param: str, session: aiohttp.ClientSession | None = None
) -> bytes:
    """The body of an http(s) image URL, within ``limits``' time and size."""
    if not limits.allow_remote:
        raise ImageInputError(
            "this server does not fetch image URLs (--disable-image-url-fetch); send the image inline "
            "as a data URI or base64",
            param,
        )
    import aiohttp

    shown = _shown(url)
    try:
        return await asyncio.wait_for(_fetch(url, limits, param, session), limits.fetch_timeout_s)
    except ImageInputError:
        raise
    except (asyncio.TimeoutError, TimeoutError):
        raise ImageInputError(
            f"fetching {shown} took longer than {limits.fetch_timeout_s:g} s (--image-fetch-timeout)", param
        ) from None
    except (aiohttp.InvalidURL, ValueError):
        raise ImageInputError(f"{shown} is not a valid URL", param) from None
    except (aiohttp.ClientError, OSError) as e:
        raise ImageInputError(f"could not fetch {shown}: {str(e) or type(e).__name__}", param) from None


def _shown(url: str) -> str:
    return url if len(url) <= 200 else url[:200] + "..."


async def _fetch(url: str, limits: ImageLimits, param: str, session) -> bytes:
    own = session is None
    session = _new_session(limits) if own else session
    try:
        async with session.get(url) as resp:
            if resp.status != 200:
                raise ImageInputError(
                    f"fetching {_shown(url)} returned HTTP {resp.status} {resp.reason or ''}".rstrip(), param
                )
            if resp.content_length is not None:
                _check_bytes(resp.content_length, limits, param, "the fetched image")
            body = bytearray()
            async for chunk in resp.content.iter_chunked(_CHUNK):
                body += chunk
                _check_bytes(len(body), limits, param, "the fetched image")
            return bytes(body)
    finally:
        if own:
            await session.close()


def _file_url_path(url: str, param: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
        raise ImageInputError("a file URL names an absolute local path: file:///dir/image.png", param)
    return urllib.parse.unquote(parts.path)


def read_local_image(path: str, limits: ImageLimits, param: str) -> bytes:
    """The bytes of a local file inside ``limits.local_root`` (real paths compared). Blocking."""
    if not limits.local_root:
        raise ImageInputError(
            "this server does not read local image files; start it with --allowed-local-media-path DIR "
            "to allow files under DIR",
            param,
        )
    try:
        root = os.path.realpath(limits.local_root)
        real = os.path.realpath(path)
        inside = os.path.commonpath([root, real]) == root
    except ValueError:  # a NUL byte; or paths on different drives
        inside = False
    if not inside:
        raise ImageInputError(f"{path!r} is not inside --allowed-local-media-path", param)
    try:
        st = os.stat(real)
        if not stat.S_ISREG(st.st_mode):
            raise ImageInputError(f"{path!r} is not a regular file", param)
        _check_bytes(st.st_size, limits, param, f"{path!r}")
        with open(real, "rb") as f:
            data = f.read(limits.max_bytes + 1)
    except OSError as e:
        raise ImageInputError(f"cannot read {path!r}: {e.strerror or e}", param) from None
    _check_bytes(len(data), limits, param, f"{path!r}")
    return data


# ----------------------------------------------------------------------------------------------
# decoding


def _open(data: bytes, param: str) -> Image.Image:
    """Parse the header (Pillow's open reads no pixel data)."""
    Image.init()
    formats = [f for f in _FORMATS if f in Image.OPEN]
    try:
        with _OPEN_LOCK, warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=formats)
    except Image.DecompressionBombError as e:
        raise ImageInputError(f"the image has too many pixels to decode safely ({e})", param) from None
    except UnidentifiedImageError:
        raise ImageInputError(
            f"the data is not an image in a supported format ({', '.join(formats)})", param
        ) from None
    except Exception as e:  # noqa: BLE001 - any failure on untrusted bytes is the request's fault
        raise ImageInputError(
            f"could not read the image header ({str(e) or type(e).__name__})", param
        ) from None


def _check_pixels(size: tuple[int, int], limits: ImageLimits, param: str) -> None:
    w, h = size
    if w * h > limits.max_pixels:
        raise ImageInputError(
            f"the image is {w}x{h} = {w * h} pixels, more than the {limits.max_pixels} this server takes "
            "(--max-image-pixels)",
            param,
        )
    if w * h == 0:
        raise ImageInputError(f"the image is empty ({w}x{h})", param)


def _pixels_to_rgb(im: Image.Image, param: str) -> Image.Image:
    """Decode every pixel (the first frame of an animation) and convert to RGB: transparency is
    composed over white; palette, grayscale, CMYK and the rest are converted. A new image."""
    try:
        im.load()  # a truncated or corrupt file fails here
        if im.mode in _ALPHA_MODES or "transparency" in im.info:
            rgba = im.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return im.convert("RGB")  # a copy when already RGB
    except Exception as e:  # noqa: BLE001 - Pillow raises OSError, SyntaxError, ValueError, EOFError ...
        raise ImageInputError(f"could not decode the image ({str(e) or type(e).__name__})", param) from None

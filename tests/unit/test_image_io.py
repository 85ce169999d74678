"""srt/multimodal/image_io.py and srt/configs/mm_args.py: every image spec form, every refusal.

Remote fetches go to a local http.server on 127.0.0.1 (a thread): /img.png, /404, /slow (sleeps
past the timeout), /big (a body past max_bytes), /endless (no Content-Length, no end); an
unreachable URL is a port nobody listens on.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import socket
import struct
import threading
import time
import warnings
import zlib
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from PIL import Image

from srt.configs.mm_args import MultimodalArgs, resolve_mm_args
from srt.multimodal.image_io import (
    ImageInputError,
    ImageLimits,
    decode_image,
    image_hash,
    load_image,
    load_images,
)
from srt.utils.errors import ConfigError, RequestError

LIMITS = ImageLimits()


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _picture(seed: int = 0, size=(32, 24)) -> Image.Image:
    img = Image.new("RGB", size)
    img.putdata(
        [
            ((x * 7 + seed) % 256, (y * 11) % 256, (x * y + seed) % 256)
            for y in range(size[1])
            for x in range(size[0])
        ]
    )
    return img


PNG = _encode(_picture(), "PNG")
JPEG = _encode(_picture(), "JPEG", quality=90)


def _load(spec, limits=LIMITS, param="image_data[0]"):
    return asyncio.run(load_image(spec, limits, param))


def _refused(spec, match: str, limits=LIMITS, param="image_data[0]") -> ImageInputError:
    with pytest.raises(ImageInputError, match=match) as info:
        _load(spec, limits, param)
    err = info.value
    assert isinstance(err, RequestError) and err.status_code == 400
    assert err.param == param and err.message.startswith(param + ": ")
    return err


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height (1-bit gray) and whose data is one tiny IDAT."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0"))
        + chunk(b"IEND", b"")
    )


# ---------------------------------------------------------------------------------------------
# the spec forms


def test_data_uri_png_decodes_to_the_same_pixels():
    img = _load("data:image/png;base64," + base64.b64encode(PNG).decode())
    assert img.mode == "RGB" and img.size == (32, 24)
    assert img.tobytes() == _picture().tobytes()


def test_data_uri_jpeg():
    img = _load("data:image/jpeg;base64," + base64.b64encode(JPEG).decode())
    assert img.mode == "RGB" and img.size == (32, 24)


def test_raw_base64_with_line_breaks_and_bytes():
    b64 = base64.encodebytes(JPEG).decode()  # wrapped at 76 columns, as some clients send it
    assert "\n" in b64 and b64.startswith("/9j/")  # a JPEG's base64 starts like a path: still base64
    assert _load(b64).size == (32, 24)
    assert _load(PNG).tobytes() == _picture().tobytes()
    assert _load(bytearray(PNG)).size == (32, 24)


def test_modes_become_rgb_and_transparency_goes_over_white():
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red
    assert _load(_encode(rgba, "PNG")).getpixel((0, 0)) == (255, 255, 255)
    la = Image.new("LA", (4, 4), (0, 255))
    assert _load(_encode(la, "PNG")).getpixel((0, 0)) == (0, 0, 0)
    pal = Image.new("P", (4, 4), 3)
    pal.putpalette([0, 0, 0, 10, 20, 30, 40, 50, 60, 70, 80, 90])
    assert _load(_encode(pal, "PNG")).getpixel((1, 1)) == (70, 80, 90)
    gray = Image.new("L", (4, 4), 77)
    assert _load(_encode(gray, "PNG")).getpixel((0, 0)) == (77, 77, 77)


def test_animated_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    img = _load(buf.getvalue())
    assert img.mode == "RGB" and img.getpixel((0, 0)) == (255, 0, 0)


def test_pil_image_is_accepted():
    assert _load(Image.new("L", (5, 5), 9)).getpixel((0, 0)) == (9, 9, 9)


def test_file_path_and_file_url_under_the_root(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    limits = replace(LIMITS, local_root=str(tmp_path))
    assert _load(str(tmp_path / "a.png"), limits).size == (32, 24)
    assert _load("file://" + str(tmp_path / "a.png"), limits).size == (32, 24)


# ---------------------------------------------------------------------------------------------
# refusals of the data


def test_truncated_png():
    _refused(PNG[: len(PNG) // 2], "could not decode")


def test_invalid_base64():
    _refused("data:image/png;base64,iVBORw0KGgo!!!", "not valid base64")
    _refused("abcde", "not valid base64")  # raw base64 of an impossible length


def test_not_an_image():
    _refused(b"just some text, not an image", "not an image")
    _refused("data:text/plain;base64," + base64.b64encode(PNG).decode(), "media type")
    _refused("data:image/png,rawdata", "only base64")
    _refused(12, "not int")


def test_too_many_pixels_is_refused_from_the_header():
    big = _png_header_only(8000, 8000)  # 64 M pixels > 50 M, below Pillow's own limits
    assert len(big) < 100
    t0 = time.perf_counter()
    _refused(big, "8000x8000 = 64000000 pixels.*--max-image-pixels")
    assert time.perf_counter() - t0 < 0.5  # refused without decoding 64 M pixels
    _refused(PNG, "--max-image-pixels", replace(LIMITS, max_pixels=100))


def test_pillow_decompression_bomb_is_a_400_not_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        _refused(_png_header_only(20000, 20000), "too many pixels")  # 400 M: Pillow's error
        _refused(_png_header_only(10000, 10000), "--max-image-pixels")  # 100 M: Pillow's warning range
        loose = replace(LIMITS, max_pixels=10**9)
        _refused(_png_header_only(10000, 10000), "could not decode", loose)  # bad data, no warning


def test_too_many_bytes():
    limits = replace(LIMITS, max_bytes=len(PNG) - 1)
    _refused(PNG, "--max-image-bytes", limits)
    _refused(base64.b64encode(PNG).decode(), "--max-image-bytes", limits)
    _refused("data:image/png;base64," + base64.b64encode(PNG).decode(), "--max-image-bytes", limits)


def test_decode_image_directly():
    assert decode_image(PNG, LIMITS, "p").size == (32, 24)


# ---------------------------------------------------------------------------------------------
# local files


def test_local_paths_refused_without_a_root(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    _refused(str(tmp_path / "a.png"), "--allowed-local-media-path")
    _refused("file://" + str(tmp_path / "a.png"), "--allowed-local-media-path")


def test_paths_outside_the_root_are_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "secret.png"
    root.mkdir()
    outside.write_bytes(PNG)
    (root / "link.png").symlink_to(outside)
    limits = replace(LIMITS, local_root=str(root))
    _refused(str(outside), "not inside --allowed-local-media-path", limits)
    _refused(str(root / ".." / "secret.png"), "not inside", limits)
    _refused(str(root / "link.png"), "not inside", limits)  # the real path counts
    _refused(str(root / "missing.png"), "cannot read", limits)
    _refused("file://otherhost/x.png", "absolute local path", limits)


# ---------------------------------------------------------------------------------------------
# remote fetches


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/img.png":
            self._send(200, PNG)
        elif self.path == "/slow":
            time.sleep(1.0)
            self._send(200, PNG)
        elif self.path == "/big":
            self._send(200, PNG * 20)
        elif self.path == "/endless":  # no Content-Length: the body runs until the client stops
            self._stream()
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client gave up (timeout test)
            pass

    def _stream(self) -> None:
        try:
            self.send_response(200)
            self.end_headers()
            for _ in range(4000):  # 256 MiB if nobody stopped reading
                self.wfile.write(bytes(1 << 16))
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_http_url(server):
    assert _load(server + "/img.png").tobytes() == _picture().tobytes()


def test_http_failures(server):
    _refused(server + "/missing", "HTTP 404")
    _refused(f"http://127.0.0.1:{_closed_port()}/x.png", "could not fetch")
    _refused(
        server + "/slow", "longer than 0.2 s.*--image-fetch-timeout", replace(LIMITS, fetch_timeout_s=0.2)
    )
    _refused(server + "/big", "--max-image-bytes", replace(LIMITS, max_bytes=len(PNG) * 2))


def test_http_body_is_capped_while_streaming(server):
    t0 = time.perf_counter()
    _refused(server + "/endless", "--max-image-bytes", replace(LIMITS, max_bytes=1 << 20))
    assert time.perf_counter() - t0 < 2.0


def test_remote_fetch_disabled(server):
    _refused(server + "/img.png", "--disable-image-url-fetch", replace(LIMITS, allow_remote=False))


def test_load_images_concurrently_and_first_error(server):
    specs = [server + "/img.png", PNG, "data:image/jpeg;base64," + base64.b64encode(JPEG).decode()]
    params = [f"image_data[{i}]" for i in range(3)]
    imgs = asyncio.run(load_images(specs, LIMITS, params))
    assert [im.size for im in imgs] == [(32, 24)] * 3
    with pytest.raises(ImageInputError) as info:
        asyncio.run(load_images([PNG, b"junk"], LIMITS, params[:2]))
    assert info.value.param == "image_data[1]"
    with pytest.raises(ImageInputError, match="--max-images-per-request") as info:
        asyncio.run(load_images([PNG] * 3, replace(LIMITS, max_images=2), params))
    assert info.value.param == "image_data[2]"


# ---------------------------------------------------------------------------------------------
# hashing and configuration


def test_image_hash_follows_the_pixels():
    h = image_hash(_load(PNG))
    assert h == image_hash(_load("data:image/png;base64," + base64.b64encode(PNG).decode()))
    assert h == image_hash(_load(_encode(_picture(), "BMP")))  # same pixels, another encoding
    assert 0 <= h < 2**63
    assert h != image_hash(_load(_encode(_picture(seed=1), "PNG")))
    assert h != image_hash(_picture().resize((24, 32)))  # same bytes count, other shape
    assert image_hash(Image.new("RGB", (2, 3))) != image_hash(Image.new("RGB", (3, 2)))


def _args(**kw):
    return SimpleNamespace(**{**MultimodalArgs().__dict__, **kw})


def test_limits_from_args(tmp_path):
    limits = ImageLimits.from_args(_args(disable_image_url_fetch=True, max_image_pixels=7))
    assert not limits.allow_remote and limits.max_pixels == 7 and limits.local_root == ""
    assert ImageLimits.from_args(SimpleNamespace()) == ImageLimits()
    assert ImageLimits.from_args(_args()) == ImageLimits()


def test_resolve_mm_args(tmp_path):
    a = _args(allowed_local_media_path=str(tmp_path / "." / ""))
    resolve_mm_args(a)
    assert a.allowed_local_media_path == os.path.realpath(tmp_path)
    for bad in (
        {"max_images_per_request": 0},
        {"image_fetch_timeout": 0.0},
        {"max_image_bytes": -1},
        {"max_image_pixels": 0},
        {"allowed_local_media_path": str(tmp_path / "nope")},
    ):
        with pytest.raises(ConfigError):
            resolve_mm_args(_args(**bad))

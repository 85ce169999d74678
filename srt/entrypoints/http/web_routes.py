"""The built-in web page (off with --disable-web-ui): GET / (index.html), GET /web/<file> (its
scripts and style sheet, shipped in srt/entrypoints/http/web/) and GET /dashboard_state (the
dashboard's JSON, `srt.entrypoints.http.dashboard`).

The static files hold no data: with --api-key they are served without it (`is_public_path`),
and the page sends the key it asks for as a Bearer token on every API call. They are read once
and kept in memory; nothing here runs unless someone has the page open.
"""

from __future__ import annotations

import functools
import importlib.resources

from fastapi import APIRouter
from fastapi.responses import Response

from srt.entrypoints.http.dashboard import dashboard_state
from srt.entrypoints.http.deps import Ctx
from srt.entrypoints.openai.common import error_response, json_response

router = APIRouter()

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
# the page runs only its own files: no inline script, nothing from another origin
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
WEB_PREFIX = "/web/"


def is_public_path(path: str) -> bool:
    """Whether ``path`` is one of the page's static files (served without the API key)."""
    return path == "/" or path.startswith(WEB_PREFIX)


@functools.cache
def _assets() -> dict[str, tuple[bytes, str]]:
    """File name -> (content, media type) of every file in the ``web`` folder."""
    folder = importlib.resources.files("srt.entrypoints.http") / "web"
    out = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in _TYPES:
            out[entry.name] = (entry.read_bytes(), _TYPES[suffix])
    return out


def _asset(name: str, marks: dict[bytes, bytes] | None = None) -> Response:
    found = _assets().get(name)
    if found is None:
        return error_response(f"no such file: {WEB_PREFIX}{name}", 404)
    body, media_type = found
    for old, new in (marks or {}).items():
        body = body.replace(old, new, 1)
    return Response(body, media_type=media_type, headers=_HEADERS)


@router.get("/")
async def index(ctx: Ctx) -> Response:
    """The page; with --api-key marked so that it asks for the key before its first call."""
    if ctx.tm.server_args.api_key:
        return _asset("index.html", {b'data-api-key="no"': b'data-api-key="yes"'})
    return _asset("index.html")


@router.get(WEB_PREFIX + "{name}")
async def web_file(name: str) -> Response:
    return _asset(name)


@router.get("/dashboard_state")
async def get_dashboard_state(ctx: Ctx) -> Response:
    return json_response(await dashboard_state(ctx.tm))

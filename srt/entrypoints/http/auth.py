"""API keys: ``--api-key`` on every route, ``--admin-api-key`` on the admin routes.

    path                                  key it needs
    /health, /metrics                     none (probes and scrapers)
    /, /web/<file> (with the web page)    none (static files holding no data)
    ADMIN_PATHS                           --admin-api-key when set (only it), else --api-key
    everything else, unknown paths too    --api-key (or --admin-api-key, which opens every route)

Keys travel as ``Authorization: Bearer <key>`` and are compared in constant time
(`hmac.compare_digest`). A refused request gets 401 ``invalid_api_key`` in OpenAI's error shape
(403 ``admin_api_key_required`` when a valid non-admin key asks for an admin route).
`redacted_args` is what /get_server_info reports of the server args: the keys are never echoed.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Callable
from typing import Any

from srt.entrypoints.openai.common import error_response

PUBLIC_PATHS = frozenset({"/health", "/metrics"})
# routes that change or inspect the server as a whole rather than serve a request
ADMIN_PATHS = frozenset(
    {
        "/flush_cache",
        "/abort_request",
        "/start_profile",
        "/stop_profile",
        "/update_weights_from_disk",
        "/load_lora_adapter",
        "/unload_lora_adapter",
    }
)
_SECRET_FIELDS = ("api_key", "admin_api_key")


def redacted_args(server_args: Any) -> dict[str, Any]:
    """``server_args`` as a dict with every key field set to ``"<redacted>"`` (None stays None)."""
    out = dataclasses.asdict(server_args)
    for name in _SECRET_FIELDS:
        if out.get(name):
            out[name] = "<redacted>"
    return out


def _bearer(key: str | None) -> bytes | None:
    return f"Bearer {key}".encode() if key else None


def _matches(auth: bytes, expected: bytes | None) -> bool:
    return expected is not None and hmac.compare_digest(auth, expected)


class ApiKeyMiddleware:
    """Pure ASGI middleware enforcing the table above (``is_public`` adds the web page's files)."""

    def __init__(
        self,
        app: Any,
        api_key: str | None,
        admin_api_key: str | None = None,
        is_public: Callable[[str], bool] | None = None,
    ) -> None:
        self.app = app
        self.key = _bearer(api_key)
        self.admin_key = _bearer(admin_api_key)
        self.is_public = is_public

    def _refusal(self, path: str, auth: bytes) -> tuple[str, int, str] | None:
        """(message, status, code) when ``auth`` may not reach ``path``, else None."""
        if path in PUBLIC_PATHS or (self.is_public is not None and self.is_public(path)):
            return None
        if _matches(auth, self.admin_key):
            return None
        if path in ADMIN_PATHS and self.admin_key is not None:
            if _matches(auth, self.key):
                return "this route needs the server's --admin-api-key", 403, "admin_api_key_required"
            what = "missing admin API key" if not auth else "incorrect admin API key"
            return (
                f"{what}: send 'Authorization: Bearer <key>' with the --admin-api-key",
                401,
                "invalid_api_key",
            )
        if self.key is None or _matches(auth, self.key):
            return None
        what = "missing API key" if not auth else "incorrect API key"
        return (
            f"{what}: send 'Authorization: Bearer <key>' with the server's --api-key",
            401,
            "invalid_api_key",
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            refusal = self._refusal(scope.get("path", ""), auth)
            if refusal is not None:
                message, status, code = refusal
                await error_response(message, status, code=code)(scope, receive, send)
                return
        await self.app(scope, receive, send)

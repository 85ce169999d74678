"""What the routes depend on, passed explicitly: a `ServerContext` stored on ``app.state`` by
`srt.entrypoints.http.app.create_app` and injected into each route with the ``Ctx`` dependency."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import Response

from srt.entrypoints.openai.common import error_response
from srt.entrypoints.openai.serving_chat import OpenAIServingChat
from srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from srt.managers.tokenizer.tokenizer_manager import TokenizerManager


@dataclass(slots=True)
class ServerContext:
    """The engine front end and the per-app objects built from it."""

    tm: TokenizerManager
    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    model_names: frozenset[str]  # the names /v1/* accept in "model" (served name, "default", path)

    @classmethod
    def create(cls, tm: TokenizerManager) -> ServerContext:
        names = {tm.model_name, "default"}
        if tm.server_args.model_path:
            names.add(tm.server_args.model_path)
        return cls(tm, OpenAIServingCompletion(tm), OpenAIServingChat(tm), frozenset(names))

    def model_not_found(self, model: str | None) -> Response | None:
        """The 404 response when a request names a ``model`` this server does not serve, else None."""
        if model is None or model in self.model_names:
            return None
        return error_response(
            f"the model {model!r} does not exist; this server serves {self.tm.model_name!r}",
            404,
            param="model",
            code="model_not_found",
        )


async def get_ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


Ctx = Annotated[ServerContext, Depends(get_ctx)]

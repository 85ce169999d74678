"""What the routes depend on, passed explicitly: a `ServerContext` stored on ``app.state`` by
`srt.entrypoints.http.app.create_app` and injected into each route with the ``Ctx`` dependency."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

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


async def get_ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


Ctx = Annotated[ServerContext, Depends(get_ctx)]

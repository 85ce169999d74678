"""What the routes depend on, passed explicitly: a `ServerContext` stored on ``app.state`` by
`srt.entrypoints.http.app.create_app` and injected into each route with the ``Ctx`` dependency."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import Response

from srt.entrypoints.openai.common import error_response
from srt.entrypoints.openai.serving_chat import OpenAIServingChat
from srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from srt.managers.tokenizer.lora_registry import LoRARegistry
from srt.managers.tokenizer.tokenizer_manager import TokenizerManager
from srt.utils.errors import RequestError


@dataclass(slots=True)
class ServerContext:
    """The engine front end and the per-app objects built from it."""

    tm: TokenizerManager
    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    model_names: frozenset[str]  # the names /v1/* accept in "model" (served name, "default", path)
    lora: LoRARegistry = field(default_factory=LoRARegistry)  # the tokenizer manager's adapters

    @classmethod
    def create(cls, tm: TokenizerManager) -> ServerContext:
        names = {tm.model_name, "default"}
        if tm.server_args.model_path:
            names.add(tm.server_args.model_path)
        completions, chat = OpenAIServingCompletion(tm), OpenAIServingChat(tm)
        return cls(tm, completions, chat, frozenset(names), tm.lora_registry)

    def model_not_found(self, model: str | None, adapters: bool = True) -> Response | None:
        """The 404 response when a request names a ``model`` this server does not serve (neither a
        served name, a loaded LoRA adapter, nor ``"<served>:<adapter>"``; with ``adapters`` False,
        for routes that run the base model only, a served name), else None."""
        served, adapter = self.lora.select(model, self.model_names)
        if served and (adapters or adapter is None):
            return None
        why = "does not exist" if not served else "is a LoRA adapter, which this route does not run"
        loaded = sorted(self.lora.adapters) if adapters else []
        also = f" and the LoRA adapters {', '.join(map(repr, loaded))}" if loaded else ""
        return error_response(
            f"the model {model!r} {why}; this server serves {self.tm.model_name!r}{also}",
            404,
            param="model",
            code="model_not_found",
        )

    def request_adapter(self, model: str | None, lora_path: Any) -> Any:
        """The ``lora_path`` of the `GenerateReqInput` serving an OpenAI request (``model`` served):
        the adapter ``model`` selects (it takes precedence, as in SGLang; a ``lora_path`` naming
        another one is a 400), else the request's own ``lora_path``. `RequestError` for a LoRA
        request without --enable-lora or an adapter that is not loaded."""
        _, adapter = self.lora.select(model, self.model_names)
        paths = lora_path if isinstance(lora_path, list) else [lora_path]
        if adapter is None:
            self.lora.check_all(paths, "lora_path")
            return lora_path
        self.lora.check(adapter, "model")
        if any(p is not None and p != adapter for p in paths):
            raise RequestError(
                f"lora_path {lora_path!r} names another adapter than model {model!r} ({adapter!r})",
                param="lora_path",
            )
        return adapter


async def get_ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


Ctx = Annotated[ServerContext, Depends(get_ctx)]

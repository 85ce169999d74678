"""What the chat and completion servings share: the tokenizer manager, the response envelope, the
`GenerateReqInput` fields both build the same way, the non-streaming body and the SSE framing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar

from srt.entrypoints.http.sse import sse_stream
from srt.entrypoints.openai.common import Envelope, raise_abort_error, stream_error_payload, with_timings
from srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from srt.managers.tokenizer.generate_input import GenerateReqInput

_OpenAIRequest = CompletionRequest | ChatCompletionRequest


class OpenAIServing:
    """Base of ``OpenAIServingChat`` and ``OpenAIServingCompletion``: they set ``id_prefix`` and
    implement ``stream_chunks`` (the chunk payloads of an output stream)."""

    id_prefix: ClassVar[str]

    def __init__(self, tokenizer_manager: Any) -> None:
        self.tm = tokenizer_manager

    def _envelope(self, req: _OpenAIRequest, obj: str) -> Envelope:
        """The response envelope; its ``model`` is the request's (a LoRA adapter it named too), else
        the served name."""
        model = req.model or self.tm.model_name
        return Envelope(self.id_prefix, obj, model, self.tm.server_args.enable_cache_report)

    def _generate_input(
        self,
        req: _OpenAIRequest,
        sampling: tuple[dict[str, Any], dict[str, str]],
        add_special_tokens: bool = True,
        **prompt_and_logprobs: Any,
    ) -> GenerateReqInput:
        """The request's `GenerateReqInput`: ``sampling`` is
        `srt.sampling.openai_params.openai_sampling_params`' (dict,
        names); ``prompt_and_logprobs`` the route's own fields (text or input_ids, logprobs).
        Streams always carry deltas."""
        sp, names = sampling
        image_params = prompt_and_logprobs.pop("image_params", None)  # how the route names each image
        obj = GenerateReqInput(
            sampling_params=sp,
            rid=req.rid,
            stream=req.stream,
            priority=req.priority,
            timeout=req.timeout,
            **prompt_and_logprobs,
        )
        obj.image_params = image_params
        return obj.serve_as(incremental_stream=True, add_special_tokens=add_special_tokens, param_names=names)

    def _body(
        self, req: _OpenAIRequest, outputs: list[dict[str, Any]], choices: list[dict[str, Any]], obj: str
    ) -> dict[str, Any]:
        """The non-streaming response of ``choices`` (usage of ``outputs``, their timings when asked)."""
        env = self._envelope(req, obj)
        return with_timings(env.body(choices, env.usage_of(outputs, req.n)), outputs, req.return_timings)

    @staticmethod
    def _raise_aborts(outputs: list[dict[str, Any]]) -> None:
        """Raise the error of the first output aborted with a status (other than 499)."""
        for o in outputs:
            raise_abort_error(o["meta_info"]["finish_reason"])

    def stream(self, req: Any, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
        """SSE events for ``chunks`` (the tokenizer manager's stream), ending in ``data: [DONE]``."""
        return sse_stream(self.stream_chunks(req, chunks), stream_error_payload)

    def stream_chunks(self, req: Any, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        raise NotImplementedError

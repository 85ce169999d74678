"""POST /v1/chat/completions: chat messages -> chat template -> generation -> OpenAI chat shape.

The prompt is the tokenizer's chat template applied to ``messages`` (roles system / developer /
user / assistant / tool; ``developer`` is passed as ``system``; list contents keep their text
parts joined by newlines) with the generation prompt appended, tokenized without adding special
tokens again. Streaming sends, per choice, a first delta with the role, then content deltas, then
the finish reason; with ``stream_options.include_usage`` a last chunk with empty choices and the
usage; and ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from srt.entrypoints.http.sse import sse_stream
from srt.entrypoints.openai.common import (
    ChunkStream,
    Envelope,
    matched_stop,
    openai_finish_reason,
    raise_abort_error,
    stream_error_payload,
    token_text,
    usage_of,
)
from srt.entrypoints.openai.protocol import (
    CHAT_ROLES,
    ChatCompletionRequest,
    check_top_logprobs,
    sampling_params_from_request,
)
from srt.managers.generate_input import GenerateReqInput
from srt.utils.errors import RequestError


def _token_entry(tokenizer: Any, lp: float, tid: int) -> dict[str, Any]:
    text = token_text(tokenizer, tid)
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, meta: dict[str, Any], with_top: bool) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object for the tokens in ``meta`` (one chunk or the whole output)."""
    tops = meta.get("output_top_logprobs", []) if with_top else []
    content = []
    for k, (lp, tid, _) in enumerate(meta.get("output_token_logprobs", [])):
        entry = _token_entry(tokenizer, lp, tid)
        top = tops[k] if k < len(tops) else []
        entry["top_logprobs"] = [_token_entry(tokenizer, v, t) for v, t, _ in top]
        content.append(entry)
    return {"content": content}


class OpenAIServingChat:
    def __init__(self, tokenizer_manager: Any) -> None:
        self.tm = tokenizer_manager

    def build_input(self, req: ChatCompletionRequest) -> GenerateReqInput:
        if not req.messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        messages: list[dict[str, Any]] = []
        for i, m in enumerate(req.messages):
            if m.role not in CHAT_ROLES:
                raise RequestError(
                    f"messages[{i}].role {m.role!r} is not one of {', '.join(sorted(CHAT_ROLES))}",
                    param=f"messages[{i}].role",
                )
            content = m.content
            if isinstance(content, list):
                content = "\n".join(part.text for part in content)
            msg: dict[str, Any] = {
                "role": "system" if m.role == "developer" else m.role,
                "content": content or "",
            }
            if m.name:
                msg["name"] = m.name
            messages.append(msg)
        max_tokens, name = req.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, name = req.max_tokens, "max_tokens"
        sp, names = sampling_params_from_request(req, max_tokens, name)
        top = check_top_logprobs(req.top_logprobs, "top_logprobs")
        if top and not req.logprobs:
            raise RequestError("top_logprobs requires logprobs=true", param="top_logprobs")
        prompt = self.tm.apply_chat_template(messages)
        return GenerateReqInput(
            text=prompt,
            sampling_params=sp,
            rid=req.rid,
            return_logprob=req.logprobs,
            top_logprobs_num=top,
            stream=req.stream,
            add_special_tokens=False,
            param_names=names,
        )

    def build_response(self, req: ChatCompletionRequest, outputs: list[dict[str, Any]]) -> dict[str, Any]:
        for o in outputs:
            raise_abort_error(o["meta_info"]["finish_reason"])
        choices = []
        for o in outputs:
            meta = o["meta_info"]
            choices.append(
                {
                    "index": o["index"],
                    "message": {"role": "assistant", "content": o["text"]},
                    "logprobs": chat_logprobs(self.tm.tokenizer, meta, req.top_logprobs is not None)
                    if req.logprobs
                    else None,
                    "finish_reason": openai_finish_reason(meta["finish_reason"]),
                    "matched_stop": matched_stop(meta["finish_reason"]),
                }
            )
        return Envelope("chatcmpl", "chat.completion", self.tm.model_name).body(
            choices, usage_of(outputs, req.n)
        )

    def stream(
        self, req: ChatCompletionRequest, chunks: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        """SSE events for ``chunks`` (the tokenizer manager's stream), ending in ``data: [DONE]``."""
        return sse_stream(self.stream_chunks(req, chunks), stream_error_payload)

    async def stream_chunks(
        self, req: ChatCompletionRequest, chunks: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[dict[str, Any]]:
        """The ``chat.completion.chunk`` payloads of ``chunks`` (raises the error of an output
        aborted with a status)."""
        cs = ChunkStream(
            Envelope("chatcmpl", "chat.completion.chunk", self.tm.model_name), req.stream_options, req.n
        )
        started: set[int] = set()
        async for out in chunks:
            idx = out["index"]
            meta = cs.see(out)
            if idx not in started:
                started.add(idx)
                delta = {"role": "assistant", "content": ""}
                yield cs.env.chunk([{"index": idx, "delta": delta, "logprobs": None, "finish_reason": None}])
            finish = openai_finish_reason(meta["finish_reason"])
            if not out["text"] and finish is None and not (req.logprobs and out["output_ids"]):
                continue  # nothing to show yet (e.g. text held back by a possible stop string)
            choice: dict[str, Any] = {
                "index": idx,
                "delta": {"content": out["text"]} if out["text"] or finish is None else {},
                "logprobs": chat_logprobs(self.tm.tokenizer, meta, req.top_logprobs is not None)
                if req.logprobs
                else None,
                "finish_reason": finish,
            }
            if finish is not None:
                choice["matched_stop"] = matched_stop(meta["finish_reason"])
            yield cs.chunk([choice], meta)
        for c in cs.closing_chunks():
            yield c

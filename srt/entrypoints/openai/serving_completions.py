"""POST /v1/completions: OpenAI completion requests <-> the tokenizer manager's outputs.

``prompt`` may be a string, a list of strings, a list of token ids, or a list of token-id lists;
with ``n`` choices per prompt, choice ``i * n + j`` is the j-th completion of prompt i (the
tokenizer manager's output index). ``echo`` prepends the prompt (and, with ``logprobs``, the
prompt's token logprobs, the first being null).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from srt.entrypoints.openai.common import ChunkStream, matched_stop, openai_finish_reason, token_text
from srt.entrypoints.openai.protocol import CompletionRequest, check_top_logprobs
from srt.entrypoints.openai.serving_base import OpenAIServing
from srt.managers.tokenizer.generate_input import GenerateReqInput
from srt.sampling.openai_params import openai_sampling_params
from srt.utils.errors import RequestError


class CompletionLogprobs:
    """Builds OpenAI's completion ``logprobs`` object incrementally (text offsets continue)."""

    def __init__(self, tokenizer: Any, with_top: bool) -> None:
        self.tokenizer = tokenizer
        self.with_top = with_top
        self.offset = 0

    def build(self, token_lps: list[tuple], top_lps: list | None) -> dict[str, Any]:
        tokens, lps, offsets, tops = [], [], [], []
        for k, (lp, tid, _) in enumerate(token_lps):
            text = token_text(self.tokenizer, tid)
            tokens.append(text)
            lps.append(lp)
            offsets.append(self.offset)
            self.offset += len(text)
            if self.with_top:
                top = top_lps[k] if top_lps is not None and k < len(top_lps) else None
                tops.append(None if top is None else {token_text(self.tokenizer, t): v for v, t, _ in top})
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": tops if self.with_top else None,
            "text_offset": offsets,
        }


class OpenAIServingCompletion(OpenAIServing):
    id_prefix = "cmpl"

    def build_input(self, req: CompletionRequest) -> GenerateReqInput:
        if req.suffix:
            raise RequestError("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise RequestError("best_of is not supported (use n)", param="best_of")
        prompt = req.prompt
        if isinstance(prompt, list) and (not prompt or (isinstance(prompt[0], list) and not all(prompt))):
            raise RequestError("prompt must not be empty", param="prompt")
        sampling = openai_sampling_params(req)
        top = check_top_logprobs(req.logprobs, "logprobs")
        sampling[1]["top_logprobs_num"] = "logprobs"
        want_lp = req.logprobs is not None
        is_ids = isinstance(prompt, list) and isinstance(prompt[0], (int, list))
        return self._generate_input(
            req,
            sampling,
            text=None if is_ids else prompt,
            input_ids=prompt if is_ids else None,
            return_logprob=want_lp,
            logprob_start_len=0 if (want_lp and req.echo) else -1,
            top_logprobs_num=top,
        )

    def _prompt_text(self, req: CompletionRequest, prompt_index: int) -> str:
        p = req.prompt
        if isinstance(p, str):
            return p
        item = p[prompt_index] if isinstance(p[0], (str, list)) else p
        if isinstance(item, str):
            return item
        return self.tm.tokenizer.decode(item) if self.tm.tokenizer is not None else ""

    def _choice(
        self, req: CompletionRequest, out: dict[str, Any], lp: CompletionLogprobs | None, first: bool
    ) -> dict[str, Any]:
        meta = out["meta_info"]
        text = out["text"]
        logprobs = None
        if req.echo and first:
            text = self._prompt_text(req, out["index"] // req.n) + text
        if lp is not None:
            token_lps = list(meta.get("output_token_logprobs", []))
            top_lps = list(meta.get("output_top_logprobs", [])) if lp.with_top else None
            if req.echo and first and "input_token_logprobs" in meta:
                token_lps = list(meta["input_token_logprobs"]) + token_lps
                if top_lps is not None:
                    top_lps = list(meta.get("input_top_logprobs", [])) + top_lps
            logprobs = lp.build(token_lps, top_lps)
        return {
            "index": out["index"],
            "text": text,
            "logprobs": logprobs,
            "finish_reason": openai_finish_reason(meta["finish_reason"]),
            "matched_stop": matched_stop(meta["finish_reason"]),
        }

    def _logprob_builder(self, req: CompletionRequest) -> CompletionLogprobs | None:
        if req.logprobs is None:
            return None
        return CompletionLogprobs(self.tm.tokenizer, with_top=req.logprobs > 0)

    def build_response(self, req: CompletionRequest, outputs: list[dict[str, Any]]) -> dict[str, Any]:
        """The non-streaming response; raises the abort error of an output aborted with a status."""
        self._raise_aborts(outputs)
        choices = [self._choice(req, o, self._logprob_builder(req), True) for o in outputs]
        return self._body(req, outputs, choices, "text_completion")

    async def stream_chunks(
        self, req: CompletionRequest, chunks: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[dict[str, Any]]:
        """The ``text_completion`` chunk payloads of ``chunks`` (raises the error of an output
        aborted with a status)."""
        cs = ChunkStream(
            self._envelope(req, "text_completion"), req.stream_options, req.n, req.return_timings
        )
        builders: dict[int, CompletionLogprobs | None] = {}
        async for out in chunks:
            idx = out["index"]
            first = idx not in builders
            if first:
                builders[idx] = self._logprob_builder(req)
            meta = cs.see(out)
            yield cs.chunk([self._choice(req, out, builders[idx], first)], meta)
        for c in cs.closing_chunks():
            yield c

"""Per-request state in the tokenizer manager, and the SGLang-shaped outputs built from it.

A `ReqState` accumulates the ``BatchStrOut`` entries of one rid (text pieces, token ids, logprobs,
counts). Its `RequestGroup` (all the rids of one user request: a batch of prompts times ``n``)
shares one ``asyncio.Event``, set whenever any of its states changes; the consumer clears it and
then reads every state, so no update is lost and a lagging consumer gets merged chunks.

Output dict (SGLang's shape)::

    {"index": k, "text": str, "output_ids": list[int],
     "meta_info": {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason",
                   "e2e_latency", ["output_token_logprobs", "output_top_logprobs",
                   "input_token_logprobs", "input_top_logprobs"]}}

Logprob entries are ``(logprob, token_id, None)`` tuples (the None is the token text slot).
Streaming chunks hold the *new* text / ids / logprobs since the previous chunk; meta_info counts
are cumulative.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from srt.managers.io_struct import TokenizedGenerateReqInput


@dataclass(eq=False)
class RequestGroup:
    """Every rid of one user request, sharing one wake-up event."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    states: list[ReqState] = field(default_factory=list)  # the outputs, in index order
    warmups: list[ReqState] = field(default_factory=list)  # prefill-only requests sent first (n > 1)
    stream: bool = False


@dataclass(slots=True, eq=False)
class ReqState:
    req: TokenizedGenerateReqInput
    index: int
    parent_rid: str  # the rid the user gave (== req.rid unless n > 1 or batch suffixes)
    group: RequestGroup
    is_warmup: bool = False
    created: float = field(default_factory=time.perf_counter)
    text_parts: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: dict[str, Any] | None = None
    abort_label: str | None = None  # metrics label when aborted locally
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    out_logprobs: list[float] = field(default_factory=list)
    out_top: list[list[tuple[int, float]]] = field(default_factory=list)
    in_logprobs: list[float | None] = field(default_factory=list)
    in_top: list[list[tuple[int, float]] | None] = field(default_factory=list)
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    # streaming cursors
    sent_parts: int = 0
    sent_ids: int = 0
    sent_input_logprobs: bool = False

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def has_new_output(self) -> bool:
        return len(self.text_parts) > self.sent_parts or len(self.output_ids) > self.sent_ids

    def text(self) -> str:
        return "".join(self.text_parts)

    # ------------------------------------------------------------------ outputs
    def final_output(self) -> dict[str, Any]:
        """The whole result (non-streaming)."""
        return self._output(self.text(), self.output_ids, 0, include_input=True)

    def stream_chunk(self) -> dict[str, Any] | None:
        """What arrived since the previous chunk (None when nothing did and not finished)."""
        if not self.has_new_output and not self.finished:
            return None
        text = "".join(self.text_parts[self.sent_parts :])
        start = self.sent_ids
        ids = self.output_ids[start:]
        include_input = not self.sent_input_logprobs and bool(self.in_logprobs)
        out = self._output(text, ids, start, include_input=include_input)
        self.sent_parts = len(self.text_parts)
        self.sent_ids = len(self.output_ids)
        self.sent_input_logprobs = self.sent_input_logprobs or include_input
        return out

    def _output(self, text: str, ids: list[int], start: int, include_input: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens or len(self.req.input_ids),
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": time.perf_counter() - self.created,
        }
        if self.req.return_logprob:
            end = start + len(ids)
            meta["output_token_logprobs"] = [
                (lp, tid, None) for lp, tid in zip(self.out_logprobs[start:end], ids)
            ]
            if self.req.top_logprobs_num > 0:
                meta["output_top_logprobs"] = [
                    [(lp, tid, None) for tid, lp in top] for top in self.out_top[start:end]
                ]
            if self.req.logprob_start_len >= 0 and include_input:
                prompt = self.req.input_ids[self.req.logprob_start_len :]
                meta["input_token_logprobs"] = [(lp, tid, None) for lp, tid in zip(self.in_logprobs, prompt)]
                if self.req.top_logprobs_num > 0:
                    meta["input_top_logprobs"] = [
                        None if top is None else [(lp, tid, None) for tid, lp in top] for top in self.in_top
                    ]
        return {"index": self.index, "text": text, "output_ids": list(ids), "meta_info": meta}

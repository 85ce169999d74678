"""Prefill-only requests: embeddings (pooled hidden states) and label-token scores.

    GenerateReqInput (max_new_tokens 0) + PrefillOnly(pooling, label_token_ids)
        --TokenizerManager.prepare(obj, spec)--> TokenizedGenerateReqInput per prompt, with the
                                                 pooling fields set (validated like any prompt)
        --run--> scheduler: one prefill, pooled in the logits processor, released at once
        --> final outputs with "pooled": the raw vector, then the label-token logprobs

A batch of prompts is one group of requests (like a batched /generate): the scheduler prefills
them together. `encode_outputs` gives the outputs in prompt order and raises the error of an
aborted one. Normalisation and truncation are the caller's (`normalize_embedding`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from srt.utils.errors import RequestAbortedError, RequestError, RequestTimeoutError

if TYPE_CHECKING:
    from srt.managers.tokenizer.generate_input import GenerateReqInput
    from srt.managers.tokenizer.input_processor import PreparedRequest

POOLING_METHODS = ("last", "mean", "cls")


@dataclass(frozen=True, slots=True)
class PrefillOnly:
    """What a prefill-only request returns: its pooled hidden state (``pooling``: "last" |
    "mean" | "cls"; "" none) and/or the next-token logprobs of ``label_token_ids``."""

    pooling: str = ""
    label_token_ids: tuple[int, ...] = ()

    def apply(self, prep: PreparedRequest, vocab_size: int | None) -> None:
        """Set the pooling fields on every request of ``prep`` (`RequestError` for a label id
        outside the vocabulary)."""
        if self.pooling and self.pooling not in POOLING_METHODS:
            raise RequestError(f"pooling must be one of {POOLING_METHODS}, got {self.pooling!r}")
        bad = [t for t in self.label_token_ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise RequestError(
                f"label token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "label_token_ids"
            )
        labels = list(self.label_token_ids)
        prep.reqs = [
            (msgspec.structs.replace(r, pooling=self.pooling, label_token_ids=labels), parent)
            for r, parent in prep.reqs
        ]


def prefill_only_input(obj: GenerateReqInput) -> GenerateReqInput:
    """``obj`` as a prefill-only request (no output token, no sampling)."""
    obj.sampling_params = {"max_new_tokens": 0}
    obj.stream = False
    return obj


async def encode_outputs(tm: Any, obj: GenerateReqInput, spec: PrefillOnly) -> list[dict[str, Any]]:
    """Run ``obj`` (made prefill-only) with ``spec`` on ``tm`` (the TokenizerManager): the final
    outputs in prompt order, each with ``"pooled"`` (list of floats) and ``"meta_info"``. An
    aborted output raises its error."""
    prep = await tm.prepare(prefill_only_input(obj), spec)
    outs = [o async for o in tm.run(prep)]
    outs.sort(key=lambda o: o["index"])
    for o in outs:
        reason = o["meta_info"]["finish_reason"]
        if reason is not None and reason["type"] == "timeout":
            raise RequestTimeoutError(str(reason.get("message") or "request timed out"))
        if reason is not None and reason["type"] == "abort":
            message = str(reason.get("message") or "request aborted")
            raise RequestAbortedError(
                message, int(reason.get("status_code") or 500), reason.get("retry_after")
            )
        if "pooled" not in o:
            raise RequestAbortedError("the request finished without its pooled output", 500)
    return outs


def normalize_embedding(
    vec: list[float], normalize: bool = True, dimensions: int | None = None
) -> list[float]:
    """``vec`` truncated to its first ``dimensions`` (Matryoshka), then L2-normalised when
    ``normalize`` (a zero vector stays zero)."""
    if dimensions is not None:
        vec = vec[:dimensions]
    if not normalize:
        return list(vec)
    norm = math.sqrt(math.fsum(x * x for x in vec))
    return [x / norm for x in vec] if norm > 0 else list(vec)

"""Prefill-only outputs on the scheduler side: which rows a batch asks the model to pool, and
each request's pooled state over the chunks of its prompt (srt/layers/pooler.py has the math).

An embedding or score request is a ``max_new_tokens == 0`` request with ``Req.pooling`` and/or
``Req.label_token_ids`` set: it finishes after its last prompt chunk (released at once, its KV
handed to the prefix cache like any finished request) and sends ``Req.pooled_out`` with its
finishing output: the raw pooled vector followed by the label-token logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from srt.layers import pooler
from srt.managers.scheduler.req import Req


def forward_kwargs(reqs: Sequence[Req], num_extend_reqs: int) -> dict[str, Any]:
    """The ForwardBatch fields that ask for pooled outputs ({} when no extend row wants one)."""
    extend = reqs[:num_extend_reqs]
    if not any([r.pooling or r.label_token_ids for r in extend]):
        return {}
    kw: dict[str, Any] = {}
    pad = [""] * (len(reqs) - num_extend_reqs)
    if any([r.pooling for r in extend]):
        kw["pool_methods"] = [r.pooling for r in extend] + pad
    if any([r.label_token_ids for r in extend]):
        kw["label_token_ids"] = [r.label_token_ids for r in extend] + [[] for _ in pad]
    return kw


def absorb(req: Req, logits_output: Any, row: int, final: bool) -> None:
    """Fold extend row ``row`` of ``logits_output`` into ``req``'s pooled state; on its ``final``
    chunk set ``req.pooled_out``."""
    pooled = getattr(logits_output, "pooled", None)
    if req.pooling and pooled is not None:
        req.pooled_acc = pooler.combine(req.pooling, req.pooled_acc, pooled[row])
    if not final:
        return
    vec = pooler.finish(req.pooling, req.pooled_acc, len(req.origin_input_ids)) if req.pooling else []
    labels = getattr(logits_output, "label_logprobs", None)
    if req.label_token_ids and labels is not None:
        vec = vec + list(labels[row])
    req.pooled_out = vec
    req.pooled_acc = None

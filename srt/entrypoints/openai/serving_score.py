"""Scoring: POST /v1/rerank and POST /v1/score.

Two ways to score a (query, item) pair:

* embedding similarity (no ``label_token_ids``): the cosine of the query's and the item's
  embeddings (the model's pooling, L2-normalised; serving_embedding.py), query and items
  prefilled as one group;
* next-token label probabilities (``label_token_ids``, decoder scoring / rerankers such as
  Qwen3-Reranker): each item's prompt is prefilled once (no token generated) and the
  log-softmax of its next-token logits at the label ids is read off. /v1/score's prompt is
  ``query + item`` (``item + query`` with ``item_first``; texts or token ids concatenated) and
  each item gets the probability of every label (``apply_softmax``: normalised over the labels,
  else the plain probabilities). /v1/rerank's prompt is ``prompt_template`` with ``{query}`` and
  ``{document}`` filled in (default ``"{query}\\n{document}"``) and its score is the probability
  of the first label among the labels (``P(yes) / (P(yes) + P(no))`` for ``[yes, no]``).

    /v1/rerank -> {"id", "model", "results": [{"index", "relevance_score", "document": {"text"}}]
                   best first (``top_n`` of them), "usage": {"prompt_tokens", "total_tokens"}}
    /v1/score  -> {"object": "scoring", "model", "scores": [per item: float (cosine) or
                   [probability per label]], "data": [{"index", "object": "score", "score"}],
                   "usage"}   (``score``: the cosine, or the first label's probability)
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from srt.entrypoints.openai.protocol_embedding import RerankRequest, ScoreRequest
from srt.entrypoints.openai.serving_embedding import embed, gen_input
from srt.managers.tokenizer.pooled_run import PrefillOnly, encode_outputs
from srt.managers.tokenizer.tokenizer_manager import TokenizerManager
from srt.utils.errors import RequestError

DEFAULT_RERANK_TEMPLATE = "{query}\n{document}"


def _softmax(logprobs: list[float]) -> list[float]:
    top = max(logprobs)
    exps = [math.exp(x - top) for x in logprobs]
    total = sum(exps)
    return [e / total for e in exps]


def _usage(metas: list[dict[str, Any]]) -> dict[str, int]:
    n = sum(int(m["prompt_tokens"]) for m in metas)
    return {"prompt_tokens": n, "total_tokens": n}


async def cosine_scores(
    tm: TokenizerManager, query: str | list[int], items: list[str] | list[list[int]]
) -> tuple[list[float], list[dict[str, Any]]]:
    """Cosine similarity of the query's embedding with each item's; (scores, meta_infos)."""
    results = await embed(tm, gen_input([query, *items]))  # type: ignore[list-item]
    q, _ = results[0]
    scores = [sum(a * b for a, b in zip(q, vec)) for vec, _ in results[1:]]
    return scores, [m for _, m in results]


async def label_logprobs(
    tm: TokenizerManager, prompts: list[str] | list[list[int]], label_token_ids: list[int]
) -> tuple[list[list[float]], list[dict[str, Any]]]:
    """Next-token logprobs of ``label_token_ids`` after each prompt; (per prompt, meta_infos)."""
    if not label_token_ids:
        raise RequestError("label_token_ids must not be empty", param="label_token_ids")
    outs = await encode_outputs(tm, gen_input(prompts), PrefillOnly("", tuple(label_token_ids)))
    return [list(o["pooled"]) for o in outs], [o["meta_info"] for o in outs]


async def create_score(tm: TokenizerManager, req: ScoreRequest) -> dict[str, Any]:
    query, items = req.query_and_items()
    if len(query) == 0 or any(len(i) == 0 for i in items):
        raise RequestError("query and items must not be empty", param="query")
    per_item: list[Any]
    if req.label_token_ids is None:
        per_item, metas = await cosine_scores(tm, query, items)
        firsts = list(per_item)
    else:
        prompts: list[Any] = [(i + query) if req.item_first else (query + i) for i in items]  # type: ignore[operator]
        lps, metas = await label_logprobs(tm, prompts, req.label_token_ids)
        per_item = [_softmax(lp) if req.apply_softmax else [math.exp(x) for x in lp] for lp in lps]
        firsts = [p[0] for p in per_item]
    return {
        "object": "scoring",
        "model": tm.model_name,
        "scores": per_item,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(firsts)],
        "usage": _usage(metas),
    }


async def create_rerank(tm: TokenizerManager, req: RerankRequest) -> dict[str, Any]:
    if not req.query:
        raise RequestError("query must not be empty", param="query")
    if not req.documents or any(not d for d in req.documents):
        raise RequestError("documents must be a non-empty list of non-empty strings", param="documents")
    if req.top_n is not None and req.top_n < 1:
        raise RequestError(f"top_n must be >= 1, got {req.top_n}", param="top_n")
    if req.label_token_ids is None:
        if req.prompt_template is not None:
            raise RequestError("prompt_template needs label_token_ids", param="prompt_template")
        scores, metas = await cosine_scores(tm, req.query, req.documents)
    else:
        template = req.prompt_template or DEFAULT_RERANK_TEMPLATE
        if "{document}" not in template:
            raise RequestError("prompt_template must contain {document}", param="prompt_template")
        prompts = [template.replace("{query}", req.query).replace("{document}", d) for d in req.documents]
        lps, metas = await label_logprobs(tm, prompts, req.label_token_ids)
        scores = [_softmax(lp)[0] for lp in lps]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n]
    results = []
    for i in order:
        r: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            r["document"] = {"text": req.documents[i]}
        results.append(r)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": tm.model_name,
        "results": results,
        "usage": _usage(metas),
    }

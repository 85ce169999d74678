"""Embeddings: POST /v1/embeddings (OpenAI), POST /encode (SGLang) and ``Engine.encode``.

Each prompt of a request is a prefill-only request pooled by the model's pooling (the
checkpoint's sentence-transformers config, else the last token; srt/configs/pooling_config.py);
a list input is one group of requests, prefilled together. The raw pooled vector is truncated to
``dimensions`` (Matryoshka) and then L2-normalised unless ``normalize`` is false.

    /v1/embeddings -> {"object": "list", "model", "data": [{"object": "embedding", "index",
                       "embedding": [float] | base64 of little-endian float32}],
                       "usage": {"prompt_tokens", "total_tokens"}}
    /encode        -> {"embedding": [float], "meta_info": {...}} (a list of them for a batch)
"""

from __future__ import annotations

import base64
import functools
import sys
from array import array
from typing import Any

from srt.configs.pooling_config import read_pooling_config
from srt.entrypoints.openai.protocol_embedding import (
    EmbeddingInput,
    EmbeddingRequest,
    EncodeRequest,
    check_dimensions,
    check_embedding_input,
)
from srt.managers.tokenizer.generate_input import GenerateReqInput
from srt.managers.tokenizer.pooled_run import PrefillOnly, encode_outputs, normalize_embedding
from srt.managers.tokenizer.tokenizer_manager import TokenizerManager
from srt.utils.errors import RequestError


@functools.lru_cache(maxsize=8)
def _pooling_method(model_path: str | None) -> str:
    return read_pooling_config(model_path).method


def pooling_method(tm: TokenizerManager) -> str:
    """The pooling of the served model ("last" | "mean" | "cls")."""
    return _pooling_method(tm.server_args.model_path)


def gen_input(prompts: EmbeddingInput | None, input_ids: Any = None, rid: Any = None) -> GenerateReqInput:
    """The GenerateReqInput of texts or token ids (one or a list)."""
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, list)):
        prompts, input_ids = None, prompts
    return GenerateReqInput(text=prompts, input_ids=input_ids, rid=rid)


async def embed(
    tm: TokenizerManager,
    obj: GenerateReqInput,
    normalize: bool = True,
    dimensions: int | None = None,
) -> list[tuple[list[float], dict[str, Any]]]:
    """(embedding, meta_info) per prompt of ``obj``, in order (`RequestError` for a bad
    ``dimensions``)."""
    check_dimensions(dimensions)
    outs = await encode_outputs(tm, obj, PrefillOnly(pooling_method(tm)))
    hidden = len(outs[0]["pooled"]) if outs else 0
    if dimensions is not None and dimensions > hidden:
        raise RequestError(
            f"dimensions ({dimensions}) must be at most the model's embedding size ({hidden})",
            param="dimensions",
        )
    return [(normalize_embedding(o["pooled"], normalize, dimensions), o["meta_info"]) for o in outs]


def to_base64(vec: list[float]) -> str:
    """OpenAI's base64 encoding: the little-endian float32 bytes."""
    arr = array("f", vec)
    if sys.byteorder != "little":
        arr.byteswap()
    return base64.b64encode(arr.tobytes()).decode("ascii")


async def create_embeddings(tm: TokenizerManager, req: EmbeddingRequest) -> dict[str, Any]:
    """The /v1/embeddings response body of ``req`` (its ``model`` already checked)."""
    check_embedding_input(req.input)
    results = await embed(tm, gen_input(req.input), req.normalize, req.dimensions)
    data = []
    for i, (vec, _) in enumerate(results):
        emb: Any = to_base64(vec) if req.encoding_format == "base64" else vec
        data.append({"object": "embedding", "index": i, "embedding": emb})
    prompt_tokens = sum(int(meta["prompt_tokens"]) for _, meta in results)
    return {
        "object": "list",
        "model": tm.model_name,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


async def encode_native(
    tm: TokenizerManager,
    text: str | list[str] | None = None,
    input_ids: list[int] | list[list[int]] | None = None,
    normalize: bool = True,
    dimensions: int | None = None,
    rid: str | list[str] | None = None,
) -> dict[str, Any] | list[dict[str, Any]]:
    """SGLang's /encode result: ``{"embedding", "meta_info"}``, a list of them for a batch."""
    if text is None and input_ids is None:
        raise RequestError("either text or input_ids must be given", param="text")
    check_embedding_input(
        text if text is not None else input_ids, "text" if text is not None else "input_ids"
    )
    obj = GenerateReqInput(text=text, input_ids=input_ids, rid=rid)
    results = await embed(tm, obj, normalize, dimensions)
    outs = [{"embedding": vec, "meta_info": meta} for vec, meta in results]
    return outs if obj.is_batch else outs[0]


async def encode_request(tm: TokenizerManager, req: EncodeRequest) -> Any:
    return await encode_native(tm, req.text, req.input_ids, req.normalize, req.dimensions, req.rid)

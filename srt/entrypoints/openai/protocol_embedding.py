"""Request models of the embedding, rerank and score routes (pydantic, strict, at the HTTP edge).

    POST /v1/embeddings  EmbeddingRequest   OpenAI's shape (+ ``normalize``)
    POST /encode         EncodeRequest      SGLang's native shape
    POST /v1/rerank      RerankRequest      Cohere / vLLM / SGLang clients' shape
    POST /v1/score       ScoreRequest       SGLang's names (``query`` / ``items``), vLLM's
                                            ``text_1`` / ``text_2`` accepted as aliases

Bodies are validated like the other /v1 routes (`srt.entrypoints.http.serving.parse_body`:
wrong types are a 400 naming the field), and so are fields these models do not declare.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from srt.entrypoints.openai.list_types import PromptInput, Strs, TokenIdLists, TokenIds
from srt.utils.errors import RequestError

# what an input of /v1/embeddings may be: one text, texts, one token id list, token id lists
EmbeddingInput = PromptInput


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbeddingRequest(_Request):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # srt/vLLM extension: L2-normalise the embedding (default true)
    normalize: bool = True


class EncodeRequest(_Request):
    text: str | Strs | None = None
    input_ids: TokenIds | TokenIdLists | None = None
    rid: str | Strs | None = None
    normalize: bool = True
    dimensions: int | None = None


class RerankRequest(_Request):
    model: str | None = None
    query: str
    documents: Strs
    top_n: int | None = None
    return_documents: bool = True
    # decoder rerankers (srt extension): score = P(label_token_ids[0]) among the label tokens at
    # the next position of the prompt ``prompt_template`` ("{query}" / "{document}" filled in)
    label_token_ids: TokenIds | None = None
    prompt_template: str | None = None


class ScoreRequest(_Request):
    model: str | None = None
    query: str | TokenIds | None = None
    items: str | Strs | TokenIdLists | None = None
    text_1: str | TokenIds | None = None  # vLLM's name of ``query``
    text_2: str | Strs | TokenIdLists | None = None  # vLLM's name of ``items``
    label_token_ids: TokenIds | None = None
    apply_softmax: bool = False
    item_first: bool = False

    def query_and_items(self) -> tuple[str | list[int], list[str] | list[list[int]]]:
        """(query, items) from either naming (`RequestError` when missing, empty or mixed)."""
        query = self.query if self.query is not None else self.text_1
        items = self.items if self.items is not None else self.text_2
        if query is None or items is None:
            raise RequestError(
                "give query (text_1) and items (text_2)", param="query" if query is None else "items"
            )
        item_list = [items] if isinstance(items, str) else list(items)
        if not item_list:
            raise RequestError("items must not be empty", param="items")
        as_ids = isinstance(query, list)
        if any(isinstance(i, list) != as_ids for i in item_list):
            raise RequestError("query and items must both be text or both be token ids", param="items")
        return query, item_list


def check_dimensions(dimensions: int | None) -> None:
    if dimensions is not None and dimensions < 1:
        raise RequestError(f"dimensions must be >= 1, got {dimensions}", param="dimensions")


MAX_EMBEDDING_INPUTS = 2048


def check_embedding_input(value: EmbeddingInput, name: str = "input") -> None:
    """An input holds 1 to `MAX_EMBEDDING_INPUTS` prompts, none empty (`RequestError` naming
    ``name`` otherwise)."""
    if isinstance(value, str):
        prompts: list = [value]
    elif value and isinstance(value[0], int):
        prompts = [value]
    else:
        prompts = list(value)
    if not prompts:
        raise RequestError(f"{name} must not be empty", param=name)
    if len(prompts) > MAX_EMBEDDING_INPUTS:
        raise RequestError(
            f"{name} holds {len(prompts)} inputs; at most {MAX_EMBEDDING_INPUTS} per request (the OpenAI "
            "API's bound: each returns a vector, and the whole response is built in memory); send "
            "several requests",
            param=name,
        )
    if any(len(p) == 0 for p in prompts):
        raise RequestError(f"{name} must not contain an empty string or an empty token list", param=name)

"""The llguidance backend (``--grammar-backend llguidance``, the default).

llguidance has no compile step worth caching: a grammar is a small JSON text, and the lexer and
the Earley parser build token masks lazily while decoding. ``compile`` converts and validates
against the tokenizer; ``matcher`` builds an ``LLMatcher`` (it drops the GIL while it parses).
JSON schemas are written compactly (`JSON_DEFAULTS`) and tightened where models go astray
(`tightened_schema`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import Tensor

from srt.constrained.base import Grammar, GrammarBackend, GrammarError, GrammarSpec

# JSON is written with single spaces after separators and no other whitespace: a weak model given
# free whitespace can fill its whole budget with newlines (a schema's "x-guidance" overrides this)
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# integers without bounds are kept to the range every JSON parser reads exactly (2**53): a weak
# model can otherwise spend its whole budget on one number's digits
SAFE_INTEGER = 2**53 - 1
_OPEN_OBJECT_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


def tightened_schema(schema: Any) -> Any:
    """``schema`` made stricter where JSON schema is loose and a model goes astray; every output it
    allows still validates against the schema as given:

    - an object schema that does not say otherwise gets ``"additionalProperties": false`` (as
      xgrammar's strict mode does): the model cannot pad it with keys nobody asked for;
    - an integer schema without bounds gets ``[-SAFE_INTEGER, SAFE_INTEGER]``."""
    if isinstance(schema, list):
        return [tightened_schema(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: tightened_schema(v) for k, v in schema.items()}
    if (out.get("type") == "object" or isinstance(out.get("properties"), dict)) and not any(
        k in out for k in _OPEN_OBJECT_KEYS
    ):
        out["additionalProperties"] = False
    if out.get("type") == "integer":
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    return out


def _grammar_text(spec: GrammarSpec) -> str:
    from llguidance import LLMatcher, grammar_from

    try:
        if spec.kind == "json_schema":
            schema = tightened_schema(json.loads(spec.value))
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
        return grammar_from(spec.kind, spec.value)  # type: ignore[arg-type]
    except (ValueError, TypeError) as e:
        raise GrammarError(spec.kind, f"invalid {spec.kind}: {e}") from None


def _check(spec: GrammarSpec, grammar: str, tokenizer: Any = None) -> None:
    from llguidance import LLMatcher

    err = LLMatcher.validate_grammar(grammar, tokenizer)
    if err:
        raise GrammarError(spec.kind, f"invalid {spec.kind}: {err}")


class LLGuidanceGrammar(Grammar):
    __slots__ = ("_m",)

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def accept_token(self, token: int) -> bool:
        return bool(self._m.consume_token(token))

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
        )
        # a step's masks are computed on every CPU this process may use: nothing else runs then
        # (the forward waits for them)
        self._executor = llguidance.LLExecutor(num_threads=max(1, len(os.sched_getaffinity(0))))

    @classmethod
    def validate(cls, spec: GrammarSpec) -> None:
        _check(spec, _grammar_text(spec))

    def compile(self, spec: GrammarSpec) -> str:
        grammar = _grammar_text(spec)
        _check(spec, grammar, self.tokenizer)
        return grammar

    def fill_bitmasks(self, grammars: list[Grammar], bitmask: Tensor) -> None:
        if len(grammars) < 2 or not all(isinstance(g, LLGuidanceGrammar) for g in grammars):
            super().fill_bitmasks(grammars, bitmask)
            return
        assert bitmask.is_contiguous() and bitmask.dtype == torch.int32
        row_bytes = bitmask.shape[1] * 4
        pairs = [(g._m, k) for k, g in enumerate(grammars)]  # type: ignore[attr-defined]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), row_bytes, bitmask.shape[0])

    def matcher(self, compiled: str) -> Grammar:
        from llguidance import LLMatcher

        m = LLMatcher(self.tokenizer, compiled, log_level=0)
        if m.is_error():
            raise GrammarError("grammar", m.get_error())
        return LLGuidanceGrammar(m)

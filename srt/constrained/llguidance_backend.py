"""The llguidance backend (``--grammar-backend llguidance``, the default).

llguidance has no compile step worth caching: a grammar is a small JSON text, and the lexer and
the Earley parser build token masks lazily while decoding. ``compile`` converts and validates
against the tokenizer; ``matcher`` builds an ``LLMatcher`` (it drops the GIL while it parses).
JSON schemas are written compactly (`JSON_DEFAULTS`) and tightened where models go astray
(`tightened_schema`). With a reasoning parser, grammars apply after the reasoning section
(`after_reasoning`).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from srt.constrained.base import Grammar, GrammarBackend, GrammarError, GrammarSpec

if TYPE_CHECKING:  # not at run time: the main process validates grammars with this module and
    from torch import Tensor  # stays free of torch (the scheduler has it)

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


# With --reasoning-parser, the grammar of a request applies to the answer after the reasoning:
# the lark grammar here comes first and names the request's own grammar as @answer. The reasoning
# is free text up to the first </think> (lazy); deepseek-r1 outputs start inside it, qwen3 ones
# have it only when they open with <think>. At most 8 whitespace characters separate the two.
THINK_END = "</think>"
_AFTER_REASONING = {
    "deepseek-r1": "start: think WS @answer\nthink[lazy]: /(?s:.*)<\\/think>/\nWS: /[ \\t\\r\\n]{0,8}/\n",
    "qwen3": (
        'start: opt_think @answer\nopt_think: "" | /[ \\t\\r\\n]*/ think WS\n'
        "think[lazy]: /<think>(?s:.*)<\\/think>/\nWS: /[ \\t\\r\\n]{0,8}/\n"
    ),
}
_AFTER_REASONING["deepseek-v3"] = _AFTER_REASONING["qwen3"]  # the same section rules
_AFTER_REASONING["qwen3-thinking"] = _AFTER_REASONING["deepseek-r1"]
_STARTS_INSIDE = ("deepseek-r1", "qwen3-thinking")  # reasoning parsers whose output opens in it
REASONING_GRAMMARS = tuple(_AFTER_REASONING)


def after_reasoning(grammar: str, reasoning_parser: str) -> str:
    """``grammar`` (llguidance's JSON form) applied after ``reasoning_parser``'s reasoning section."""
    grammars = json.loads(grammar)["grammars"]
    grammars[0]["name"] = "answer"
    return json.dumps({"grammars": [{"lark_grammar": _AFTER_REASONING[reasoning_parser]}, *grammars]})


class _ReasoningTracker:
    """Whether an output is still inside its reasoning section (the closing rule must not act
    there: reasoning is free text, and only </think> ends it)."""

    __slots__ = ("starts_inside", "text", "done")

    def __init__(self, reasoning_parser: str) -> None:
        self.starts_inside = reasoning_parser in _STARTS_INSIDE
        self.text = ""  # the output so far, kept only until the reasoning is over
        self.done = False

    def add(self, piece: str) -> None:
        if self.done:
            return
        self.text += piece
        if THINK_END in self.text:
            self.done, self.text = True, ""
        elif not self.starts_inside:
            head = self.text.lstrip()
            if head and not (head.startswith("<think>") or "<think>".startswith(head)):
                self.done, self.text = True, ""  # qwen3 answered without reasoning

    @property
    def inside(self) -> bool:
        return not self.done


class LLGuidanceGrammar(Grammar):
    __slots__ = ("_m", "_reasoning", "_tokenizer")

    def __init__(self, matcher: Any, reasoning_parser: str | None = None, tokenizer: Any = None) -> None:
        self._m = matcher
        self._reasoning = _ReasoningTracker(reasoning_parser) if reasoning_parser else None
        self._tokenizer = tokenizer

    def can_close(self) -> bool:
        return self._reasoning is None or not self._reasoning.inside

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def accept_token(self, token: int) -> bool:
        ok = bool(self._m.consume_token(token))
        if ok and self._reasoning is not None and self._reasoning.inside:
            self._reasoning.add(self._tokenizer.decode_str([token]))
        return ok

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    def failed_on_limits(self) -> bool:
        # llguidance's word for a token outside the grammar; any other failure (a lexer or parser
        # limit, e.g. "too many expressions constructed") comes from the grammar's size
        err = self.error()
        return err is not None and "doesn't satisfy the grammar" not in err


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], reasoning_parser: str | None = None
    ) -> None:
        import llguidance.hf

        if reasoning_parser is not None and reasoning_parser not in _AFTER_REASONING:
            raise ValueError(f"no reasoning grammar for {reasoning_parser!r}; known: {REASONING_GRAMMARS}")
        self.reasoning_parser = reasoning_parser

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
        if self.reasoning_parser is not None:
            grammar = after_reasoning(grammar, self.reasoning_parser)
        _check(spec, grammar, self.tokenizer)
        return grammar

    def fill_bitmasks(self, grammars: list[Grammar], bitmask: Tensor) -> None:
        if len(grammars) < 2 or not all(isinstance(g, LLGuidanceGrammar) for g in grammars):
            super().fill_bitmasks(grammars, bitmask)
            return
        assert bitmask.is_contiguous() and bitmask.element_size() == 4 and not bitmask.is_floating_point()
        row_bytes = bitmask.shape[1] * 4
        pairs = [(g._m, k) for k, g in enumerate(grammars)]  # type: ignore[attr-defined]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), row_bytes, bitmask.shape[0])

    def matcher(self, compiled: str) -> Grammar:
        from llguidance import LLMatcher

        m = LLMatcher(self.tokenizer, compiled, log_level=0)
        if m.is_error():
            raise GrammarError("grammar", m.get_error())
        return LLGuidanceGrammar(m, self.reasoning_parser, self.tokenizer)

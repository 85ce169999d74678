"""The xgrammar backend (``--grammar-backend xgrammar``; optional: ``pip install xgrammar``).

xgrammar compiles a grammar against the tokenizer ahead of decoding (token masks precomputed per
grammar state), which costs time per new grammar and is cached by the compiler; matchers share
the compiled grammar.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from srt.constrained.base import Grammar, GrammarBackend, GrammarError, GrammarSpec

if TYPE_CHECKING:
    from torch import Tensor


def _parse(spec: GrammarSpec) -> Any:
    """xgrammar's Grammar of ``spec`` (no tokenizer needed)."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_schema":
            # the same JSON layout as the llguidance backend (single spaces, no free whitespace)
            return xgr.Grammar.from_json_schema(spec.value, any_whitespace=False, separators=(", ", ": "))
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        return xgr.Grammar.from_ebnf(spec.value)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses
        raise GrammarError(spec.kind, f"invalid {spec.kind}: {e}") from None


class XGrammarGrammar(Grammar):
    __slots__ = ("_m", "_error")

    def __init__(self, matcher: Any) -> None:
        self._m = matcher
        self._error: str | None = None

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token: int) -> bool:
        ok = bool(self._m.accept_token(token))
        if not ok:
            self._error = f"token {token} is not allowed by the grammar"
        return ok

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def error(self) -> str | None:
        return self._error


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids) or None
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)

    @classmethod
    def validate(cls, spec: GrammarSpec) -> None:
        _parse(spec)

    def compile(self, spec: GrammarSpec) -> Any:
        return self.compiler.compile_grammar(_parse(spec))

    def matcher(self, compiled: Any) -> Grammar:
        import xgrammar as xgr

        return XGrammarGrammar(xgr.GrammarMatcher(compiled))

"""The grammar backends by ``--grammar-backend`` name (srt/configs/backends.py lists them)."""

from __future__ import annotations

from typing import Any

from srt.constrained.base import GrammarBackend


def backend_class(name: str) -> type[GrammarBackend]:
    """The class of ``--grammar-backend name`` (ImportError naming the package if missing)."""
    if name == "llguidance":
        from srt.constrained.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend
    if name == "xgrammar":
        from srt.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend
    raise ValueError(f"unknown grammar backend {name!r} (see srt.configs.backends.GRAMMAR_BACKENDS)")


def create_grammar_backend(
    name: str,
    tokenizer: Any,
    vocab_size: int,
    eos_token_ids: list[int],
    reasoning_parser: str | None = None,
) -> GrammarBackend:
    """``name``'s backend for a Hugging Face fast ``tokenizer`` over the model's ``vocab_size``
    (tokens past the tokenizer's own are never allowed); ``eos_token_ids`` end a grammar. Its
    ``closing_mask`` holds the tokens that steer an output to its end (bitmask.py). With
    ``reasoning_parser`` (llguidance only) grammars apply after the reasoning section."""
    from srt.constrained.bitmask import closing_token_bitmask

    cls = backend_class(name)
    if reasoning_parser is None:
        backend = cls(tokenizer, vocab_size, eos_token_ids)  # type: ignore[call-arg]
    else:
        backend = cls(tokenizer, vocab_size, eos_token_ids, reasoning_parser=reasoning_parser)  # type: ignore[call-arg]
    backend.closing_mask = closing_token_bitmask(tokenizer, vocab_size, eos_token_ids)
    return backend

"""What a request constrains its output with, and the interfaces of the grammar backends.

A request names at most one of ``json_schema``, ``regex`` or ``ebnf`` (SGLang's sampling params;
the OpenAI routes map ``response_format`` onto ``json_schema``). `GrammarSpec` is that choice.
A `GrammarBackend` turns a spec into a compiled grammar once (thread-safe, so the scheduler
compiles off its loop and caches the result) and makes a fresh `Grammar` (a matcher with its own
state) per request. ``GrammarBackend.validate`` checks a spec without a tokenizer, cheaply enough
for the HTTP front end to answer 400 before a request is queued.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from torch import Tensor

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


class GrammarError(ValueError):
    """A grammar that cannot be used: invalid schema, regex or EBNF (``param`` names the field)."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One request's constraint: ``kind`` in GRAMMAR_KINDS, ``value`` its text (a JSON schema is
    kept as the JSON text the client sent). Hashable: the compile cache's key."""

    kind: str
    value: str

    @classmethod
    def from_fields(cls, json_schema: str | None, regex: str | None, ebnf: str | None) -> GrammarSpec | None:
        """The spec of SGLang's three sampling params (verified: at most one is set)."""
        for kind, value in zip(GRAMMAR_KINDS, (json_schema, regex, ebnf)):
            if value is not None:
                return cls(kind, value)
        return None


class Grammar(ABC):
    """One request's matcher: the grammar plus how far the output has advanced through it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, see bitmask.py)."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar does not allow it (the matcher is then
        in an error state)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and accepts nothing more (the request is done)."""

    @abstractmethod
    def error(self) -> str | None:
        """Why the matcher failed, or None."""

    def failed_on_limits(self) -> bool:
        """Whether the matcher failed because the grammar outgrew the library's limits (it may
        then reject a token its own mask allowed): the request's grammar is at fault, not srt."""
        return False

    def can_close(self) -> bool:
        """Whether steering the output to its end makes sense now (False inside free text that
        only the model can end, e.g. a reasoning section)."""
        return True


class GrammarBackend(ABC):
    """A grammar library bound to one tokenizer (see the module docstring)."""

    name: ClassVar[str]
    closing_mask: Tensor | None = None  # [tiers, width] int32, set by create_grammar_backend

    @classmethod
    @abstractmethod
    def validate(cls, spec: GrammarSpec) -> None:
        """Raise GrammarError if ``spec`` is not a valid grammar (no tokenizer needed)."""

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of ``spec`` (GrammarError if invalid). Thread-safe; may be slow."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Grammar:
        """A fresh matcher at the start of ``compiled``."""

    def fill_bitmasks(self, grammars: list[Grammar], bitmask: Tensor) -> None:
        """``grammars[k].fill_bitmask(bitmask, k)`` for every k (a backend may do them in parallel)."""
        for k, g in enumerate(grammars):
            g.fill_bitmask(bitmask, k)

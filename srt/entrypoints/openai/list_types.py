"""The collection types of the request bodies, validated fail-fast.

By default pydantic validates every item of a list or dict and keeps an error for each bad one,
and a union such as a prompt's (``str | list[str] | list[int] | list[list[int]]``) validates the
whole list against each member. A 1 MiB body of half a million token ids ending in a string then
cost the HTTP process 1.3 GiB and 5 s of CPU (the event loop's), and answered with a 68 MB message;
every route taking a list or a dict did the same at 300-1,400 times its body's size.

Here a list or dict stops at its first bad item, so a bad body costs about what parsing it does
and its error names one item. Use these aliases for every collection a request body holds, or
`fail_fast` (``Field(fail_fast=True)``) on a field that is a list or dict, optional or not; a
union member needs an alias (``ListOf[X]``, ``Strs`` ...): a ``Field`` applies to no union.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import Field

T = TypeVar("T")

# one Field object: pydantic reads its metadata, so sharing it among the aliases is safe
_FAIL_FAST = Field(fail_fast=True)

ListOf = Annotated[list[T], _FAIL_FAST]  # ListOf[X]: a list of X
Strs = Annotated[list[str], _FAIL_FAST]
TokenIds = Annotated[list[int], _FAIL_FAST]
TokenIdLists = Annotated[list[TokenIds], _FAIL_FAST]
# a prompt or an embedding input: text, texts, one token-id list, or one per prompt
PromptInput = str | Strs | TokenIds | TokenIdLists


def fail_fast(default: Any = ...) -> Any:
    """The ``Field`` of a list- or dict-typed field (``default``: its default, if any)."""
    return Field(default, fail_fast=True)

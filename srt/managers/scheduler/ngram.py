"""N-gram (prompt lookup) drafts for speculative decoding: no draft model, only token history.

A request's draft continues its token sequence (prompt + output) the way an earlier occurrence
of its latest tokens continued::

    ids      = ... a b c d e ... x y c d        (the last token is d)
    match    = the earlier position whose preceding tokens agree longest with the suffix
               (here "c d", 2 tokens; at least ``min_match``, compared up to ``max_match``)
    draft    = the tokens after that occurrence: e ...  (at most k of them)

``NgramIndex`` (one per request) keeps, per token id, the positions where it occurred, filled
incrementally: O(1) per new token, and a draft compares at most ``MAX_CANDIDATES`` recent
occurrences of the last token backwards. Occurrences are registered up to the second-to-last
token, so the suffix never matches itself.

``NgramStore`` (shared by the requests of one scheduler, optional: ``--speculative-ngram-capacity``)
remembers, for recent n-grams of finished outputs, the tokens that followed them; a request
whose own history has no match asks it. Bounded: the least recently written entries go first.
Drafts are a pure function of the token history (and of the store, which every tensor-parallel
rank fills the same way), so the ranks draft alike.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# occurrences of the last token compared per draft (the most recent first)
MAX_CANDIDATES = 64
# tokens of the key of the shared store
STORE_KEY_TOKENS = 3


@dataclass(frozen=True, slots=True)
class NgramConfig:
    """``num_draft_tokens``: the most drafts per request per step; ``min_match`` /
    ``max_match``: the suffix length a match needs / is compared over; ``capacity``: entries of
    the shared store (0: no store)."""

    num_draft_tokens: int
    min_match: int = 1
    max_match: int = 12
    capacity: int = 0


class NgramIndex:
    """The token history of one request, indexed for drafting (see the module docstring)."""

    __slots__ = ("_ids", "_positions", "_registered")

    def __init__(self) -> None:
        self._ids: list[int] = []  # the request's tokens so far (prompt + output)
        self._positions: dict[int, list[int]] = {}
        self._registered = 0  # ids[:_registered] are indexed

    def sync(self, prompt: list[int], output: list[int]) -> list[int]:
        """The request's tokens ``prompt + output``, held here and extended by the output tokens
        new since the last call (O(new tokens), not a copy of the history per step)."""
        ids = self._ids
        if not ids:
            ids.extend(prompt)
        ids.extend(output[len(ids) - len(prompt) :])
        return ids

    def draft(self, ids: list[int], k: int, min_match: int, max_match: int) -> list[int]:
        """At most ``k`` tokens continuing ``ids`` after its best earlier match ([] if none)."""
        n = len(ids)
        if k <= 0 or n < 2:
            return []
        positions = self._positions
        for i in range(self._registered, n - 1):
            positions.setdefault(ids[i], []).append(i)
        self._registered = max(self._registered, n - 1)
        cands = positions.get(ids[-1])
        if not cands:
            return []
        best_len, best_pos = 0, -1
        for c in range(len(cands) - 1, max(len(cands) - 1 - MAX_CANDIDATES, -1), -1):
            p = cands[c]
            m = 1
            while m < max_match and m <= p and ids[p - m] == ids[n - 1 - m]:
                m += 1
            if m > best_len:
                best_len, best_pos = m, p
                if m >= max_match:
                    break
        if best_len < min_match:
            return []
        return ids[best_pos + 1 : best_pos + 1 + k]


class NgramStore:
    """Continuations of recent n-grams of finished outputs, shared by requests (module docstring)."""

    def __init__(self, capacity: int, continuation: int) -> None:
        self.capacity = capacity
        self.continuation = continuation
        self._table: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def add(self, ids: list[int]) -> None:
        """Remember what followed every ``STORE_KEY_TOKENS``-gram of ``ids``."""
        if self.capacity <= 0:
            return
        table, n, w = self._table, STORE_KEY_TOKENS, self.continuation
        for i in range(n, len(ids)):
            key = tuple(ids[i - n : i])
            table[key] = tuple(ids[i : i + w])
            table.move_to_end(key)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def draft(self, ids: list[int], k: int) -> list[int]:
        if k <= 0 or len(ids) < STORE_KEY_TOKENS:
            return []
        hit = self._table.get(tuple(ids[-STORE_KEY_TOKENS:]))
        return list(hit[:k]) if hit else []

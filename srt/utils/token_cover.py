"""How much of a text one token can cover, so that a prompt too long for the context at any
tokenization is refused before it is tokenized (`TokenCover`, `token_cover`).

Tokenizing is the one cost a request imposes before any check of its length: a 200 MB prompt
took the tokenizer minutes and 12 GiB. For a fast BPE tokenizer that drops no text, a token
covers at most its longest vocabulary entry's length in characters, so a text of ``n`` characters
has at least ``n / longest`` tokens. Every component that could drop or merge text without bound
(WordPiece's one [UNK] for a whole word, a stripping normalizer or added token, a whitespace
split) makes the bound unknown (None).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# components that never drop characters of the text (a shrink factor: how many characters NFC /
# NFKC may merge into one); anything else (BERT's cleaning, Strip, Whitespace splits, a Split
# that removes its matches, WordPiece's one [UNK] for a whole word) could, and defeats any bound
_KEEPING_NORMALIZERS = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}
_KEEPING_PRE_TOKENIZERS = dict.fromkeys(
    ("ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"), 1
)


def _keeping_factor(component: Any, allowed: dict[str, int]) -> int | None:
    """How many characters of the text one character of ``component``'s output may stand for
    (1 for none, the identity), or None when it may drop characters."""
    if component is None:
        return 1
    factor = 1
    stack = [json.loads(component.__getstate__())]
    while stack:
        node = stack.pop()
        kind = node.get("type")
        removes = str(node.get("behavior", "")).lower() == "removed"  # a Split dropping its matches
        if kind == "Sequence":
            stack.extend(node.get("normalizers") or node.get("pretokenizers") or [])
        elif kind == "Replace":  # (a normalizer) keeps the text when it never shortens it
            pattern, content = node.get("pattern", {}).get("String"), node.get("content", "")
            if not pattern or len(content) < len(pattern):
                return None
        elif removes or kind not in allowed:
            return None
        else:
            factor = max(factor, allowed[kind])
    return factor


@dataclass(frozen=True)
class TokenCover:
    """How much of a text one token covers at most: ``chars`` characters, none of them one that
    matches ``dropped`` (characters the tokenizer may drop: a byte-level vocabulary that lacks
    some bytes' entries drops those bytes)."""

    chars: int
    dropped: re.Pattern | None = None

    def min_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens of ``text``."""
        kept = len(self.dropped.sub("", text)) if self.dropped is not None else len(text)
        return -(-kept // self.chars)


def _chars_of_bytes(missing: set[int]) -> re.Pattern | None:
    """The characters whose UTF-8 form holds one of the ``missing`` bytes (a regex class), or None."""
    ranges = []
    for b in sorted(missing):
        if b < 0x80:
            ranges.append((b, b))
        elif b < 0xC0:  # a continuation byte: any character of two bytes or more
            ranges.append((0x80, 0x10FFFF))
        elif 0xC2 <= b <= 0xF4:  # a lead byte: the characters it starts
            bits, width = (5, 6) if b < 0xE0 else (4, 12) if b < 0xF0 else (3, 18)
            low = (b & ((1 << bits) - 1)) << width
            ranges.append((low, min(low + (1 << width) - 1, 0x10FFFF)))
    if not ranges:  # (0xC0, 0xC1 and 0xF5-0xFF never occur in UTF-8)
        return None
    return re.compile("[" + "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges) + "]")


def token_cover(tokenizer: Any) -> TokenCover | None:
    """How much of a text one token of ``tokenizer`` covers at most (`TokenCover`), or None when
    nothing bounds it. Bounded: a fast BPE tokenizer that maps every character (byte fallback, or
    a byte-level alphabet: its missing bytes are dropped, ``TokenCover.dropped``) and whose
    normalizer, pre-tokenizer and added tokens drop none. The bound is its longest vocabulary entry
    (a byte-level entry has one character per byte of the text), times how many characters its
    normalizer may merge into one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return None
    vocab = tokenizer.get_vocab()
    dropped = None
    if not backend.model.byte_fallback:
        pre = backend.pre_tokenizer
        if pre is None or "ByteLevel" not in pre.__getstate__().decode():
            return None
        dropped = _chars_of_bytes({b for b, c in _BYTE_LEVEL_CHARS.items() if c not in vocab})
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    if any(t.lstrip or t.rstrip or t.single_word for t in added):  # strips or skips text around it
        return None
    shrink = _keeping_factor(backend.normalizer, _KEEPING_NORMALIZERS)
    if shrink is None or _keeping_factor(backend.pre_tokenizer, _KEEPING_PRE_TOKENIZERS) is None:
        return None
    return TokenCover(shrink * max(map(len, vocab), default=1), dropped)


def _byte_level_chars() -> dict[int, str]:
    """The byte-level alphabet: byte -> the character that stands for it (GPT-2's mapping:
    printable Latin-1 bytes are themselves, the others 256 and up, in byte order)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


_BYTE_LEVEL_CHARS = _byte_level_chars()

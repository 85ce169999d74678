"""Small text helpers shared by the parsers."""

from __future__ import annotations

import re

NON_SPACE = re.compile(r"\S")


def held_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``.

    A stream holds back that many characters: the next chunk may complete the marker.
    """
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def none_if_blank(text: str) -> str | None:
    """``text``, or None when it is empty or only whitespace."""
    return text if text.strip() else None

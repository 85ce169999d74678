"""Page arithmetic of the paged KV cache (one place for the rounding).

A sequence of ``n`` tokens occupies ``num_pages(n, P)`` pages, that is ``page_ceil(n, P)``
slots; ``page_floor(n, P)`` is the longest page-aligned prefix of ``n`` tokens.
"""

from __future__ import annotations


def num_pages(n: int, page_size: int) -> int:
    """Pages that ``n`` tokens occupy (ceiling division)."""
    return -(-n // page_size)


def page_ceil(n: int, page_size: int) -> int:
    """``n`` rounded up to a whole number of pages."""
    return -(-n // page_size) * page_size


def page_floor(n: int, page_size: int) -> int:
    """``n`` rounded down to a whole number of pages."""
    return n // page_size * page_size

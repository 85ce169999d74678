"""Page arithmetic of the paged KV cache (one place for the rounding).

A sequence of ``n`` tokens occupies ``num_pages(n, P)`` pages, that is ``page_ceil(n, P)``
slots; ``page_floor(n, P)`` is the longest page-aligned prefix of ``n`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence


def num_pages(n: int, page_size: int) -> int:
    """Pages that ``n`` tokens occupy (ceiling division)."""
    return -(-n // page_size)


def page_ceil(n: int, page_size: int) -> int:
    """``n`` rounded up to a whole number of pages."""
    return -(-n // page_size) * page_size


def page_floor(n: int, page_size: int) -> int:
    """``n`` rounded down to a whole number of pages."""
    return n // page_size * page_size


def uncut_chunk(start: int, chunk: int, spans: Sequence[tuple[int, int]], page_size: int) -> int:
    """A page-aligned prefill chunk of positions ``start .. start + chunk`` that cuts none of the
    ``(lo, hi)`` ``spans``: it ends at the latest page boundary before the span it would cut, or,
    when that leaves nothing, after that span (longer than asked). ``chunk`` <= 0 is returned."""

    def inside(end: int) -> tuple[int, int] | None:
        return next(((lo, hi) for lo, hi in spans if lo < end < hi), None)

    end = start + chunk
    cut = inside(end) if chunk > 0 else None
    while cut is not None and end > start:
        end = page_floor(cut[0], page_size)
        cut = inside(end)
    if end > start:
        return end - start
    end, cut = start + chunk, inside(start + chunk)
    while cut is not None:
        end = page_ceil(cut[1], page_size)
        cut = inside(end)
    return end - start

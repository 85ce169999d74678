"""TokenToKVPoolAllocator: hands out KV-pool slots, one whole page at a time.

Slot layout of the KV pool (``page_size`` = P, ``size`` = S, a multiple of P)::

    slot:   0 .. P-1        P .. 2P-1     ...    S .. S+P-1
    page:   0 (padding)     1             ...    S/P
            never handed out; attention backends may point padding tokens here

A slot ``s`` lives on page ``s // P``. Pages are the unit of allocation: a page is either
wholly free or wholly owned (by one request, or by the prefix cache). Within one sequence,
token ``t`` sits at slot ``page[t // P] * P + t % P``: the tokens of a page are consecutive
and the first token of every page sits at the page's first slot. ``alloc_extend`` and
``alloc_decode`` keep this layout by continuing in the sequence's partially filled last page
before taking fresh pages.

The free list is a stack of page ids in a preallocated numpy array: allocating or freeing k
pages is one slice copy (O(k), no Python loop over slots). Everything runs on the CPU;
returned slot tensors are int64 on ``device``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from srt.utils.pages import num_pages, page_floor

IntSeq = Sequence[int] | np.ndarray | torch.Tensor


def host_int64(values: IntSeq) -> np.ndarray:
    """``values`` (ints, a numpy array, or a tensor on any device) as a flat int64 host array.

    The page bookkeeping lives on the host; a tensor from the device's ``req_to_token`` is
    copied over explicitly (``np.asarray`` of a CUDA tensor raises)."""
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.int64).numpy().reshape(-1)
    return np.asarray(values, dtype=np.int64).reshape(-1)


class InvalidFreeError(RuntimeError):
    """free() was given slots that were never allocatable (padding page, out of range)."""


class DoubleFreeError(InvalidFreeError):
    """free() was given slots whose pages are already free (debug mode only)."""


class TokenToKVPoolAllocator:
    """Allocator of KV slots ``[page_size, size + page_size)``, whole pages at a time.

    Args:
        size: number of usable slots (tokens); must be a positive multiple of ``page_size``.
        page_size: tokens per page (P).
        device: device of the returned slot tensors.
        debug: check every free for pages already free (double free) and every ``last_loc``
            handed to ``alloc_extend``/``alloc_decode``; costs O(pages) per call. Frees of the
            padding page or out-of-range slots are rejected in any mode.

    All methods that allocate return ``None`` and allocate nothing when there are not
    enough free pages; callers then evict from the prefix cache and retry.
    """

    def __init__(self, size: int, page_size: int, device: str | torch.device = "cpu", debug: bool = False):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size or size % page_size:
            raise ValueError(f"size ({size}) must be a positive multiple of page_size ({page_size})")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        self.debug = debug
        # stack of free page ids: _stack[:_top] are free, the top of the stack is _stack[_top-1]
        self._stack = np.empty(self.num_pages, dtype=np.int64)
        self._top = 0
        # debug only: _is_free[page] (index 0 = padding page, never free)
        self._is_free = np.zeros(self.num_pages + 1, dtype=bool) if debug else None
        self._offsets = np.arange(page_size, dtype=np.int64)
        self._scratch = np.empty(self.num_pages + 1, dtype=np.int64) if page_size > 1 else None
        self._free_group: list[torch.Tensor] | None = None
        self.clear()

    # ------------------------------------------------------------------ state
    def clear(self) -> None:
        """Mark every page free (low page ids are handed out first)."""
        self._stack[:] = np.arange(self.num_pages, 0, -1, dtype=np.int64)
        self._top = self.num_pages
        if self._is_free is not None:
            self._is_free[1:] = True
        self._free_group = None

    def available_size(self) -> int:
        """Number of free slots (a multiple of page_size)."""
        return self._top * self.page_size

    def free_page_ids(self) -> np.ndarray:
        """Copy of the ids of the free pages (for integrity checks; O(free pages))."""
        return self._stack[: self._top].copy()

    # ------------------------------------------------------------------ alloc
    def _take_pages(self, k: int) -> np.ndarray | None:
        if k > self._top:
            return None
        pages = self._stack[self._top - k : self._top][::-1].copy()
        self._top -= k
        if self._is_free is not None:
            self._is_free[pages] = False
        return pages

    def _to_tensor(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(slots).to(self.device)

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` slots (n a multiple of page_size): int64 tensor ``[n]`` of whole pages, page
        by page in order, or None if fewer than n slots are free."""
        if n < 0 or n % self.page_size:
            raise ValueError(f"alloc({n}): n must be a non-negative multiple of page_size {self.page_size}")
        pages = self._take_pages(n // self.page_size)
        if pages is None:
            return None
        if self.page_size == 1:
            return self._to_tensor(pages)
        return self._to_tensor((pages[:, None] * self.page_size + self._offsets).reshape(-1))

    def alloc_extend(self, prefix_lens: IntSeq, seq_lens: IntSeq, last_loc: IntSeq) -> torch.Tensor | None:
        """Slots for tokens ``prefix_lens[i] .. seq_lens[i]-1`` of each sequence ``i``.

        Args:
            prefix_lens: ``[bs]`` tokens already holding slots.
            seq_lens: ``[bs]`` lengths after the extend (>= prefix_lens).
            last_loc: ``[bs]`` slot of token ``prefix_lens[i]-1``, or -1 when prefix_lens[i] == 0.
        Returns:
            int64 tensor ``[sum(seq_lens - prefix_lens)]``, sequence after sequence; the first
            ones of a sequence continue in its partially filled last page (``last_loc+1 ...``),
            the rest come from fresh pages. None (nothing allocated) if too few pages are free.
        """
        p, s = host_int64(prefix_lens), host_int64(seq_lens)
        if p.shape != s.shape or np.any(s < p) or np.any(p < 0):
            raise ValueError("alloc_extend: need 0 <= prefix_lens[i] <= seq_lens[i], same length")
        ext = s - p
        total = int(ext.sum())
        P = self.page_size
        if P == 1:
            return self.alloc(total)
        last = host_int64(last_loc)
        if self.debug:
            self._check_last_loc(p, last)
        # pages already holding slots vs pages needed after the extend (elementwise)
        pages_before = num_pages(p, P)
        new_pages = num_pages(s, P) - pages_before
        fresh = self._take_pages(int(new_pages.sum()))
        if fresh is None:
            return None
        if total == 0:
            return self._to_tensor(np.empty(0, dtype=np.int64))
        # Sequence i takes `part` slots continuing its partial last page (last_loc+1, ...),
        # then the first ext-part slots of its run of fresh pages (consecutive in `flat`).
        part = np.where(p % P != 0, np.minimum(s, page_floor(p, P) + P) - p, 0)
        flat = (fresh[:, None] * P + self._offsets).reshape(-1)
        pieces: list[np.ndarray] = []
        base = 0
        for e, k, n_new, lst in zip(ext.tolist(), part.tolist(), new_pages.tolist(), last.tolist()):
            if k:
                pieces.append(np.arange(lst + 1, lst + 1 + k, dtype=np.int64))
            if e > k:
                pieces.append(flat[base : base + e - k])
            base += n_new * P
        return self._to_tensor(np.concatenate(pieces))

    def alloc_decode(self, seq_lens: IntSeq, last_loc: IntSeq) -> torch.Tensor | None:
        """One slot per sequence for its token at position ``seq_lens[i]-1``.

        Args:
            seq_lens: ``[bs]`` lengths *after* the new token (>= 1).
            last_loc: ``[bs]`` slot of token ``seq_lens[i]-2`` (-1 when seq_lens[i] == 1).
        Returns:
            int64 tensor ``[bs]``: ``last_loc+1`` when that is still on the same page, else
            the first slot of a fresh page; None (nothing allocated) if too few pages are free.
        """
        s = host_int64(seq_lens)
        P = self.page_size
        if P == 1:
            return self.alloc(len(s))
        last = host_int64(last_loc)
        if self.debug:
            self._check_last_loc(s - 1, last)
        need_page = (s - 1) % P == 0
        fresh = self._take_pages(int(need_page.sum()))
        if fresh is None:
            return None
        out = last + 1
        out[need_page] = fresh * P
        return self._to_tensor(out)

    def _check_last_loc(self, lens: np.ndarray, last: np.ndarray) -> None:
        P = self.page_size
        bad = (lens > 0) & ((last < P) | (last >= self.size + P) | (last % P != (lens - 1) % P))
        bad |= (lens == 0) & (last != -1)
        if np.any(bad):
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"last_loc[{i}]={int(last[i])} inconsistent with length {int(lens[i])}")
        used = last[(lens % P != 0) & (lens > 0)] // P
        if np.any(self._is_free[used]):
            raise ValueError("last_loc points at a free page")

    # ------------------------------------------------------------------ free
    def free(self, indices: torch.Tensor) -> None:
        """Free the distinct pages the given slots lie on.

        Callers free every slot they own on a page together (whole page-aligned ranges
        plus the tail page of a sequence); freeing one slot frees its whole page. Inside a
        ``free_group_begin()/free_group_end()`` bracket the free is deferred to the end.

        Raises ``InvalidFreeError`` for slots of the padding page or outside the pool, and
        ``DoubleFreeError`` when more pages would be free than exist (always checked, O(1)),
        or, with ``debug=True``, for any page that is already free.
        """
        if indices.numel() == 0:
            return
        if self._free_group is not None:
            self._free_group.append(indices.detach().to("cpu", torch.int64).reshape(-1).clone())
            return
        slots = indices.detach().to("cpu", torch.int64).numpy().reshape(-1)
        P = self.page_size
        pages = slots if P == 1 else slots // P
        if pages.min() < 1 or pages.max() > self.num_pages:  # cheap; the padding page is never freed
            raise InvalidFreeError(f"free of slots outside [{P}, {self.size + P}): {self._outside(slots)}")
        if P > 1:
            pages = self._distinct(pages)
        if self.debug:
            self._check_free(slots, pages)
        k = len(pages)
        if self._top + k > self.num_pages:
            raise DoubleFreeError(f"free of {k} pages with only {self.num_pages - self._top} allocated")
        self._stack[self._top : self._top + k] = pages
        self._top += k
        if self._is_free is not None:
            self._is_free[pages] = True

    def _outside(self, slots: np.ndarray) -> list[int]:
        P = self.page_size
        return slots[(slots < P) | (slots >= self.size + P)][:16].tolist()

    def _distinct(self, pages: np.ndarray) -> np.ndarray:
        """The distinct values of ``pages`` (one occurrence each) in O(n), without sorting:
        every page writes its position into a scratch array, the last writer is kept."""
        pos = np.arange(len(pages))
        self._scratch[pages] = pos
        return pages[self._scratch[pages] == pos]

    def _check_free(self, slots: np.ndarray, pages: np.ndarray) -> None:
        P = self.page_size
        if len(np.unique(pages)) != len(pages):
            raise DoubleFreeError("free of the same slot twice in one call")
        already = self._is_free[pages]
        if np.any(already):
            dup = slots[np.isin(slots // P, pages[already])]
            raise DoubleFreeError(f"double free of slots {dup[:16].tolist()} (pages already free)")

    def free_group_begin(self) -> None:
        """Start collecting frees (e.g. of every request finishing in one step)."""
        if self._free_group is not None:
            raise RuntimeError("free_group_begin() called twice")
        self._free_group = []

    def free_group_end(self) -> None:
        """Free everything collected since ``free_group_begin()`` in one call."""
        group, self._free_group = self._free_group, None
        if group is None:
            raise RuntimeError("free_group_end() without free_group_begin()")
        if not group:
            return
        if self.debug:  # one call per entry, so a page freed by two entries is caught
            for g in group:
                self.free(g)
        else:
            self.free(torch.cat([g.reshape(-1).to(torch.int64) for g in group]))

    def __repr__(self) -> str:
        return (
            f"TokenToKVPoolAllocator(size={self.size}, page_size={self.page_size}, "
            f"free={self.available_size()}, device={self.device})"
        )

"""Running a call under different torch thread counts, for tests that an op's result does not
depend on how its work is split between threads; a block on a set number of threads."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")


def with_threads(fn: Callable[[], T], counts: tuple[int, ...] = (1, 2)) -> list[T]:
    """fn's results under each of ``counts`` threads, in that order (the process's count restored)."""
    results = []
    for n in counts:
        with torch_threads(n):
            results.append(fn())
    return results


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch on ``n`` threads inside the block (the process's count restored after it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

"""The grammar part: compiling requests' grammars off the loop, and their token masks.

``GrammarManager`` owns the grammar backend (built on its worker thread: it loads the tokenizer
and builds the backend's token tables, 1-2 CPU-seconds that must neither delay the server's
readiness nor take cores from its first requests; `idle_tick` starts it once the scheduler has
been idle for `WARM_UP_AFTER_IDLE_S`, the first request with a grammar starts it sooner, and a
server that never sees a grammar and is never idle that long never pays for it), the compile
cache (``GrammarSpec`` -> compiled grammar) and the requests waiting for their grammar. A request with a grammar does not enter the waiting queue until its grammar is
compiled: ``submit`` hands it over, ``poll`` (every step) returns the ones that are ready (each
with its own matcher) and the ones whose grammar failed. Requests without grammars never wait.

Each step, ``fill_masks`` asks the matchers of the batch rows that sample a token for their
allowed tokens (one bitmask row each; the sampler sets the others' logits to -inf; near the end
of its token budget a request may only close its structure, when its grammar allows that), and
``accept`` advances a request's matcher past its sampled token: a grammar that is complete
finishes the request (``stop``), one that rejected the token aborts it.

A retracted request keeps its matcher: its output is kept, so the matcher's position still
matches it when the request resumes.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

import torch

from srt.constrained.base import GrammarBackend, GrammarError, GrammarSpec
from srt.constrained.bitmask import allocate_bitmask
from srt.constrained.registry import create_grammar_backend
from srt.managers.io_struct import FinishReason
from srt.utils.cpu_memory import release_free_memory
from srt.utils.torch_threads import single_threaded_executor

if TYPE_CHECKING:
    from collections.abc import Callable

    from srt.managers.scheduler.req import Req

logger = logging.getLogger("srt.scheduler")

# compiled grammars kept (least recently used dropped first)
COMPILE_CACHE_SIZE = 256
# the backend is built once the scheduler has had no work for this long (a fresh server with no
# traffic: a few seconds after it is ready), unless a grammar asked for it first
WARM_UP_AFTER_IDLE_S = 3.0


def closing_reserve(max_new_tokens: int) -> int:
    """The last tokens of a constrained request's budget, in which it is steered to its end
    (a quarter of the budget, between 8 and 64 tokens)."""
    return min(64, max(8, max_new_tokens // 4))


class GrammarManager:
    """See the module docstring. ``load_backend()`` runs on the worker thread (once)."""

    def __init__(self, load_backend: Callable[[], GrammarBackend]) -> None:
        # torch single-threaded on the worker: a second OpenMP pool would slow every forward
        self._pool = single_threaded_executor(1, "srt-grammar")
        self._load_backend = load_backend
        self._backend_future: Future[GrammarBackend] | None = None
        self._cache: OrderedDict[GrammarSpec, Future[Any]] = OrderedDict()
        self.pending: list[tuple[Req, Future[Any]]] = []
        self.compile_seconds = 0.0  # worker time spent compiling (metrics)
        self.wait_all = False  # poll waits for every pending compile (tensor-parallel lock step)
        self._idle_since: float | None = None  # monotonic time the scheduler went idle (idle_tick)

    @classmethod
    def create(
        cls,
        backend_name: str,
        tokenizer_source: str,
        vocab_size: int,
        eos_token_ids: list[int],
        trust_remote_code: bool = False,
        reasoning_parser: str | None = None,
    ):
        """The manager for ``--grammar-backend backend_name`` (None for ``none``); the backend is
        built on first use or `warm_up`. With ``reasoning_parser`` grammars apply after the
        reasoning section."""
        if backend_name == "none":
            return None

        def load() -> GrammarBackend:
            from srt.utils.hf_tokenizer import load_tokenizer

            t0 = time.perf_counter()
            tokenizer = load_tokenizer(tokenizer_source, trust_remote_code)
            backend = create_grammar_backend(
                backend_name, tokenizer, vocab_size, eos_token_ids, reasoning_parser
            )
            del tokenizer  # llguidance keeps its own copy: the freed pages go back to the OS
            release_free_memory()
            logger.info("grammar backend: %s (ready in %.1f s)", backend_name, time.perf_counter() - t0)
            return backend

        return cls(load)

    # ------------------------------------------------------------------ compiling
    @property
    def _backend(self) -> Future[GrammarBackend]:
        if self._backend_future is None:
            self._backend_future = self._pool.submit(self._load_backend)
        return self._backend_future

    def warm_up(self) -> None:
        """Start building the backend now (`idle_tick` does once the scheduler has been idle long
        enough, and the first request with a grammar does)."""
        _ = self._backend

    @property
    def started(self) -> bool:
        """Whether the backend is built or being built."""
        return self._backend_future is not None

    def idle_tick(self, idle: bool, now: float) -> float | None:
        """Called by the scheduler's loop each turn, ``idle`` being whether it has work (``now``: a
        monotonic clock). Starts the backend's build once the loop has been idle for
        `WARM_UP_AFTER_IDLE_S` in one stretch; returns the seconds left until then (the longest
        the loop may block before calling again), or None when there is nothing to wait for."""
        if self.started or not idle:
            self._idle_since = None
            return None
        if self._idle_since is None:
            self._idle_since = now
        left = self._idle_since + WARM_UP_AFTER_IDLE_S - now
        if left > 0:
            return left
        self.warm_up()
        return None

    def _compile(self, spec: GrammarSpec) -> Any:
        t0 = time.perf_counter()
        try:
            return self._backend.result().compile(spec)
        finally:
            self.compile_seconds += time.perf_counter() - t0

    def _compiled(self, spec: GrammarSpec) -> Future[Any]:
        self.warm_up()  # queued before the compile on the one worker (a compile waits for it)
        fut = self._cache.get(spec)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > COMPILE_CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec)
        return fut

    def submit(self, req: Req) -> None:
        """Start (or reuse) the compile of ``req.grammar_spec``; ``poll`` hands the request back."""
        assert req.grammar_spec is not None
        self.pending.append((req, self._compiled(req.grammar_spec)))

    def poll(self, timeout: float = 0.0) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(requests whose grammar is ready, each given its matcher; (request, error) pairs of
        those whose grammar failed). Waits up to ``timeout`` seconds for the first to finish; with
        ``wait_all`` for every pending one, however long (the outcome must not depend on timing)."""
        if not self.pending:
            return [], []
        if self.wait_all:
            wait_futures([f for _, f in self.pending])
        if timeout > 0 and not any(f.done() for _, f in self.pending):
            wait_futures([f for _, f in self.pending], timeout=timeout, return_when="FIRST_COMPLETED")
        ready: list[Req] = []
        failed: list[tuple[Req, str]] = []
        still: list[tuple[Req, Future[Any]]] = []
        for req, fut in self.pending:
            if not fut.done():
                still.append((req, fut))
                continue
            try:
                req.grammar = self._backend.result().matcher(fut.result())
                ready.append(req)
            except GrammarError as e:
                failed.append((req, str(e)))
            except Exception as e:  # noqa: BLE001 - a backend bug must fail the request, not the server
                logger.exception("grammar of request %r failed", req.rid)
                failed.append((req, f"the grammar could not be compiled: {e}"))
        self.pending = still
        return ready, failed

    def discard(self, req: Req) -> bool:
        """Forget a request still waiting for its grammar (aborted); False if not waiting."""
        for i, (r, _) in enumerate(self.pending):
            if r is req:
                del self.pending[i]
                return True
        return False

    # ------------------------------------------------------------------ per step
    def fill_masks(self, reqs: list[Req], sampling_rows: list[int], vocab_size: int):
        """``(rows, bitmask)`` for the rows of ``reqs`` that sample a token this step
        (``sampling_rows``) and have a grammar, or None when there are none.

        A request in the last `closing_reserve` tokens of its budget is steered to its end: when
        its grammar allows EOS, a closing token (``"``, ``]``, ``}`` ...) or a punctuation token,
        only the best tier of those is allowed (bitmask.closing_token_bitmask), so that a structure
        is closed before ``max_new_tokens`` cuts it."""
        rows = [i for i in sampling_rows if reqs[i].grammar is not None]
        if not rows:
            return None
        bitmask = allocate_bitmask(len(rows), vocab_size)
        backend = self._backend.result()
        backend.fill_bitmasks([reqs[i].grammar for i in rows], bitmask)
        closing = backend.closing_mask
        for k, i in enumerate(rows):
            req = reqs[i]
            if (
                closing is not None
                and req.remaining_new_tokens <= closing_reserve(req.max_new_tokens)
                and req.grammar.can_close()
            ):
                for tier in closing:  # the best tier the grammar allows
                    narrowed = bitmask[k] & tier
                    if bool(narrowed.any()):
                        bitmask[k] = narrowed
                        break
        return torch.tensor(rows, dtype=torch.int64), bitmask

    @staticmethod
    def accept(req: Req, token: int) -> None:
        """Advance ``req``'s matcher past ``token`` (after ``Req.append_token``): a complete
        grammar finishes the request. A rejected token aborts it: with 400 when the grammar outgrew
        the backend's limits (the request's fault), else with 500 (a masking bug: logged)."""
        g = req.grammar
        if not g.accept_token(token):
            error = g.error() or ""
            summary = error.split("\n", 1)[0]  # llguidance appends its parser state
            if g.failed_on_limits():
                logger.warning("request %r: its grammar outgrew the backend's limits: %s", req.rid, summary)
                done = len(req.output_ids) - 1
                why = f"the grammar is too large for the grammar backend after {done} tokens: {summary}"
                req.finish(FinishReason.of_abort(why, 400))
            else:
                logger.error("request %r: the grammar rejected token %d: %s", req.rid, token, error)
                req.finish(FinishReason.of_abort(f"the grammar rejected token {token}: {summary}", 500))
        elif g.is_terminated():
            # "stop" with no matched token: the token is part of the answer (not trimmed)
            req.finish(FinishReason(type="stop"))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

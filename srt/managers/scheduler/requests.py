"""RequestTable: the scheduler's requests not yet reported finished, their arrival and the
finishes that happen between steps.

    add(msg)                 arrival: normalize the params (see below), a Req for the waiting
                             queue (or the grammar part), or a rejection
    abort / finish_between_steps   abort, stop string, deadline: release all it holds
    requeue(retracted)       back to the queue, or aborted when retracted too often
    release(req)             a finished request gives back its KV; reported with the next output
    take_touched / forget_reported   what the step's output reports, and dropping it afterwards

Parameters at arrival: the tokenizer manager sends `SamplingParams` already normalized
(`SamplingParams.normalize` with the prompt's bounds: greedy decided, ``max_new_tokens``
resolved). A client writing straight to the socket may send raw ones (``max_new_tokens=None``:
as many as fit), so arrival calls the same `normalize` -- idempotent on normalized params -- on a
copy (an in-process client may share one `SamplingParams` between requests) with the
scheduler's own bounds and vocabulary. What the scheduler re-checks itself is capacity: the fit
rule (`srt.managers.request_fit`) and token ids inside the vocabulary; a request that can never
run is finished with an abort carrying status 400.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from srt.managers.io_struct import FinishReason, TokenizedGenerateReqInput
from srt.managers.request_fit import check_request_fits
from srt.managers.scheduler.req import Req, ReqStatus
from srt.sampling.sampling_params import LengthBounds

if TYPE_CHECKING:
    from srt.managers.scheduler.cache import CacheManager
    from srt.managers.scheduler.deadlines import DeadlineTracker
    from srt.managers.scheduler.decode import DecodeManager
    from srt.managers.scheduler.grammar import GrammarManager
    from srt.managers.scheduler.lora_slots import LoRASlots
    from srt.managers.scheduler.metrics import SchedulerMetrics
    from srt.managers.scheduler.prefill import PrefillManager

logger = logging.getLogger("srt.scheduler")


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What bounds every request of this scheduler."""

    context_len: int
    max_total_num_tokens: int  # the whole KV pool
    page_size: int
    vocab_size: int
    eos_token_ids: list[int]


class RequestTable:
    """See the module docstring. The parts it finishes requests in (prefill queue, running
    batch, grammar queue) and the cache it releases them to are passed in."""

    def __init__(
        self,
        limits: ModelLimits,
        cache: CacheManager,
        prefill: PrefillManager,
        decode: DecodeManager,
        grammars: GrammarManager | None,
        deadlines: DeadlineTracker,
        metrics: SchedulerMetrics,
        rng: random.Random,
    ) -> None:
        self.limits = limits
        self.cache = cache
        self.prefill = prefill
        self.decode = decode
        self.grammars = grammars
        self.deadlines = deadlines
        self.metrics = metrics
        self.rng = rng  # draws the seed of a request that gave none
        self.lora: LoRASlots | None = None  # the loaded LoRA adapters (None without --enable-lora)
        self.reqs_by_rid: dict[str, Req] = {}  # every request not yet reported finished
        self.finished_outside: list[Req] = []  # finished between steps (abort, reject, stop string)
        self._finished_reqs: list[Req] = []  # released since the last output was built
        self._next_queue_seq = 0

    # ------------------------------------------------------------------ arrival
    def add(self, msg: TokenizedGenerateReqInput, step_clock: float | None = None) -> None:
        """Arrival: a Req for the waiting queue, or a rejection (never fits: abort 400;
        duplicate live rid: dropped). ``step_clock``: the deadlines' clock (None: time.time())."""
        lim = self.limits
        bounds = LengthBounds(len(msg.input_ids), lim.context_len, lim.max_total_num_tokens)
        params = msgspec.structs.replace(msg.sampling_params).normalize(bounds, vocab_size=lim.vocab_size)
        req = Req.from_input(
            msg,
            params,
            seed=params.seed if params.seed is not None else self.rng.getrandbits(63),
            eos_token_ids=lim.eos_token_ids,
            queue_seq=self._next_queue_seq,
        )
        self._next_queue_seq += 1
        if msg.rid in self.reqs_by_rid:
            # the rid names the live request's stream: answering under it would corrupt that stream
            logger.error(
                "dropping a request with the duplicate rid %r (a request with this rid is live)", msg.rid
            )
            self.metrics.num_rejected += 1
            return
        self.reqs_by_rid[req.rid] = req
        error = self._arrival_error(msg.input_ids, req.max_new_tokens) or self._lora_error(msg.lora_name)
        if error is not None:
            self.reject(req, error)
            return
        self.deadlines.track(req, step_clock)
        if req.grammar_spec is not None:
            if self.grammars is None:  # the tokenizer manager rejects these; input_ids-only clients
                self.reject(req, "constrained decoding is off (--grammar-backend none or no tokenizer)")
                return
            self.grammars.submit(req)
            return
        self.prefill.enqueue(req, self.metrics.num_steps)

    def _arrival_error(self, input_ids: list[int], max_new_tokens: int) -> str | None:
        """Why a request can never run (request_fit.py, token ids outside the vocabulary)."""
        lim = self.limits
        error = check_request_fits(
            len(input_ids), max_new_tokens, lim.context_len, lim.max_total_num_tokens, lim.page_size
        )
        if error is None and (min(input_ids) < 0 or max(input_ids) >= lim.vocab_size):
            error = f"Input token ids must be in [0, {lim.vocab_size}) for this model."
        return error

    def _lora_error(self, name: str) -> str | None:
        if not name or (self.lora is not None and self.lora.is_loaded(name)):
            return None
        if self.lora is None:
            return f"LoRA adapter {name!r} requested, but the server runs without --enable-lora"
        return f"LoRA adapter {name!r} is not loaded"

    def users_of_adapter(self, name: str) -> int:
        """Requests not finished that run the LoRA adapter ``name``."""
        return sum(
            1 for r in self.reqs_by_rid.values() if r.lora_name == name and r.state != ReqStatus.FINISHED
        )

    def reject(self, req: Req, message: str) -> None:
        req.finish(FinishReason.of_abort(message, 400))
        self.metrics.num_rejected += 1
        self.release(req)
        self.finished_outside.append(req)

    def admit_grammar_requests(self, timeout: float = 0.0) -> None:
        """Requests whose grammar is compiled join the waiting queue; failed ones are rejected."""
        if self.grammars is None or not self.grammars.pending:
            return
        ready, failed = self.grammars.poll(timeout)
        for req in ready:
            self.prefill.enqueue(req, self.metrics.num_steps)
        for req, message in failed:
            self.reject(req, message)

    # ------------------------------------------------------------------ finishes between steps
    def abort(self, rid: str, message: str = "aborted", status_code: int | None = None) -> None:
        """Abort a request in any state ("" aborts every request); unknown rids are ignored."""
        if rid == "":
            for r in list(self.reqs_by_rid.values()):
                self.finish_between_steps(r.rid, FinishReason.of_abort(message, status_code))
            return
        if self.finish_between_steps(rid, FinishReason.of_abort(message, status_code)):
            self.metrics.num_aborted += 1

    def finish_between_steps(self, rid: str, reason: FinishReason) -> bool:
        """Finish a request outside a forward, releasing all it holds; False if unknown/done."""
        req = self.reqs_by_rid.get(rid)
        if req is None or req.state == ReqStatus.FINISHED:
            return False
        req.finish(reason)
        if not self.prefill.discard(req) and not self.decode.discard(req) and self.grammars is not None:
            self.grammars.discard(req)
        self.release(req)
        self.finished_outside.append(req)
        return True

    def expire_deadlines(self, step_clock: float | None = None) -> None:
        """Finish the requests whose deadline or --max-queue-time passed (deadlines.py)."""
        for req, reason in self.deadlines.expired(step_clock):
            if self.reqs_by_rid.get(req.rid) is req:
                self.finish_between_steps(req.rid, reason)

    def release(self, req: Req) -> None:
        """A finished request gives back all it holds; it is reported with the next output."""
        self.cache.release(req)
        self.metrics.num_finished += 1
        self._finished_reqs.append(req)

    def requeue(self, retracted: list[Req]) -> None:
        """Retracted requests wait again, or are aborted when retracted too often."""
        for req in retracted:
            reason = self.decode.retraction_abort(req)
            if reason is None:
                self.prefill.requeue(req)
                continue
            req.finish(reason)
            self.metrics.num_retract_aborts += 1
            self.release(req)
            self.finished_outside.append(req)

    # ------------------------------------------------------------------ reporting
    def take_touched(self) -> list[Req]:
        """The requests finished between steps since the last call (reported with this step)."""
        touched, self.finished_outside = self.finished_outside, []
        return touched

    def forget_reported(self) -> None:
        """Drop the finished requests just reported: their rids may be reused from here on."""
        for req in self._finished_reqs:
            if self.reqs_by_rid.get(req.rid) is req:
                del self.reqs_by_rid[req.rid]
        self._finished_reqs.clear()

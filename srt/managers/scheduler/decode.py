"""The decode part: the running batch, and retraction with its hysteresis.

``DecodeManager`` owns ``running`` (the decoding requests, in admission order) and the
``NewTokenRatio`` (the estimate of how much of its ``max_new_tokens`` a running request will
still generate, which the prefill part reserves KV for). When one decode step of ``running``
cannot get its KV slots even after evicting cached prefixes, it retracts the requests
``plan_retraction`` (decode_policy.py) picks -- least work lost first -- until the others can
decode ``RETRACT_MARGIN_STEPS`` steps. Two things keep this from flapping: the margin (the
survivors do not run short again on the next step) and the ratio, which jumps up on every
retraction (admission reserves more for the running batch) and decays again over decode steps.

A retracted request hands its KV to the prefix cache (re-admission reuses it) and goes back to
the waiting queue (the scheduler does that); one retracted more than ``MAX_RETRACTIONS_PER_REQ``
times is aborted instead (``retraction_abort``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from srt.managers.io_struct import FinishReason
from srt.managers.scheduler.decode_policy import decode_slots, plan_retraction
from srt.managers.scheduler.req import Req, ReqStatus
from srt.managers.scheduler.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from srt.managers.scheduler.cache import CacheManager
    from srt.managers.scheduler.decode_policy import NewTokenRatio
    from srt.managers.scheduler.metrics import SchedulerMetrics
    from srt.managers.scheduler.speculative import SpeculativeDecoder

# retraction makes room for this many decode steps of the requests that stay
RETRACT_MARGIN_STEPS = 4
# a request retracted more often than this is aborted (the pool is too small for the load)
MAX_RETRACTIONS_PER_REQ = 8


class DecodeManager:
    """The running batch and its retraction (see the module docstring).

    ``max_total_num_tokens``: slots of the KV pool (for the decode log line)."""

    def __init__(
        self,
        cache: CacheManager,
        new_token_ratio: NewTokenRatio,
        metrics: SchedulerMetrics,
        max_total_num_tokens: int,
    ) -> None:
        self.cache = cache
        self.new_token_ratio = new_token_ratio
        self.metrics = metrics
        self.max_total_num_tokens = max_total_num_tokens
        self.running: list[Req] = []

    # ------------------------------------------------------------------ the running batch
    def merge(self, new_decoding: list[Req], drop_finished: bool) -> None:
        """After a forward: drop the requests that finished (``drop_finished``: some did) and
        append those that completed their prompt."""
        if drop_finished:
            self.running = [r for r in self.running if r.state != ReqStatus.FINISHED]
        self.running.extend(new_decoding)

    def discard(self, req: Req) -> bool:
        """Remove a request finished between steps; False if it is not decoding."""
        if req.state != ReqStatus.DECODING:
            return False
        self.running.remove(req)
        return True

    def has_room(self) -> bool:
        """Whether one decode step of ``running`` gets its KV slots (evicting if needed)."""
        return self.cache.ensure_free(ScheduleBatch.decode_slots_needed(self.running, self.cache.page_size))

    def prepare_batch(
        self,
        num_waiting: int,
        in_flight_subset: list[Req] | None = None,
        spec: SpeculativeDecoder | None = None,
    ) -> ScheduleBatch:
        """The DECODE batch of ``running`` (``has_room()`` must hold); with a batch in flight
        (overlap scheduling), of ``in_flight_subset``: the running requests whose token in flight
        is not their last; with ``spec`` (speculative decoding, never with a batch in flight),
        its verify batch while at most ``spec.max_batch_size`` requests run. ``num_waiting`` is for the decode log line."""
        self.new_token_ratio.on_decode_step()
        if spec is not None and len(self.running) <= spec.max_batch_size:
            batch = spec.prepare_batch(self.running, self.cache)
        elif in_flight_subset is None:
            batch = ScheduleBatch.prepare_decode(by_adapter(self.running), self.cache)
        else:
            batch = ScheduleBatch.prepare_decode(
                by_adapter(in_flight_subset), self.cache, batch_in_flight=True
            )
        self.metrics.on_decode_step(
            len(self.running),
            self.max_total_num_tokens - self.cache.available(),
            self.cache.token_usage(),
            num_waiting,
        )
        return batch

    # ------------------------------------------------------------------ retraction
    def retract_for_room(self) -> list[Req]:
        """Retract running requests, in ``plan_retraction`` order, until the others can decode
        ``RETRACT_MARGIN_STEPS`` steps (at least one stays). The plan counts a lower bound of
        what a victim frees, so the real availability is checked before each retraction.

        Returns the victims (WAITING, KV in the prefix cache, out of ``running``) for the
        caller to put back in the waiting queue."""
        P = self.cache.page_size
        plan = plan_retraction(self.running, self.cache.available(), P, RETRACT_MARGIN_STEPS)
        if not plan:
            return []
        need = decode_slots([r.kv_committed_len for r in self.running], P, RETRACT_MARGIN_STEPS)
        victims: list[Req] = []
        for v in plan:
            if need <= self.cache.available():
                break
            need -= decode_slots([v.kv_committed_len], P, RETRACT_MARGIN_STEPS)
            self.retract(v)
            victims.append(v)
        gone = {id(v) for v in victims}
        self.running = [r for r in self.running if id(r) not in gone]
        if victims:
            self.new_token_ratio.on_retract()
        return victims

    def retract(self, req: Req) -> None:
        """Take the KV of a running (or mid-prompt) request back; it becomes WAITING."""
        self.cache.retract(req)
        self.metrics.num_retractions += 1

    def retraction_abort(self, req: Req) -> FinishReason | None:
        """The abort for a request retracted too often (None: it may wait again)."""
        if req.retract_count <= MAX_RETRACTIONS_PER_REQ:
            return None
        return FinishReason.of_abort(
            f"Request was retracted {req.retract_count} times because the KV cache "
            f"({self.max_total_num_tokens} tokens) ran out; the load does not fit. Raise "
            "--max-total-tokens / --mem-fraction-static, lower --max-running-requests, or raise "
            "--schedule-conservativeness.",
            503,
        )


def by_adapter(reqs: list[Req]) -> list[Req]:
    """``reqs`` with the rows of each LoRA adapter slot together (a stable sort; the list itself when
    no request runs an adapter), so each adapter's update is one matmul pair on a run of rows."""
    if not any([r.lora_slot >= 0 for r in reqs]):
        return reqs
    return sorted(reqs, key=lambda r: r.lora_slot)

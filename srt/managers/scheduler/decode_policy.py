"""Decode-side scheduling decisions, pure like ``schedule_policy.py`` (no model, no tensors, no
pools; running requests are seen through the ``RunningReq`` protocol), each unit tested without a
model:

- ``NewTokenRatio``: the estimated fraction of max_new_tokens still to come; decays every decode
  step from ``init`` to ``min``, jumps up on retraction.
- ``retraction_order`` / ``plan_retraction``: which running requests go back to the queue when
  decode runs out of KV slots (least work lost first; srt/managers/scheduler/decode.py acts).
- ``decode_slots``: the fresh KV slots some decode steps take.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from srt.utils.pages import num_pages, page_ceil


class RunningReq(Protocol):
    """What retraction reads of a running request (``srt.managers.scheduler.req.Req`` is one)."""

    @property
    def output_ids(self) -> Sized: ...
    @property
    def all_ids_len(self) -> int: ...
    @property
    def queue_seq(self) -> int: ...
    @property
    def kv_committed_len(self) -> int: ...
    @property
    def prefix_indices(self) -> Sized: ...


R = TypeVar("R", bound=RunningReq)


# ---------------------------------------------------------------------- new-token ratio
DEFAULT_INIT_NEW_TOKEN_RATIO = 0.7
DEFAULT_MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # min = init * factor (0.7 -> ~0.1)
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # decode steps from init down to min


@dataclass(slots=True)
class NewTokenRatio:
    """Estimated fraction of its remaining max_new_tokens a running request will still generate.

    Starts at ``init``; every decode step it decays by ``decay`` down to ``min``; a retraction
    (the estimate was too optimistic) raises it by ``retract_step``, to at least ``init``, at most 1."""

    init: float = DEFAULT_INIT_NEW_TOKEN_RATIO
    min: float = DEFAULT_INIT_NEW_TOKEN_RATIO * DEFAULT_MIN_NEW_TOKEN_RATIO_FACTOR
    decay: float = (
        DEFAULT_INIT_NEW_TOKEN_RATIO * (1 - DEFAULT_MIN_NEW_TOKEN_RATIO_FACTOR) / NEW_TOKEN_RATIO_DECAY_STEPS
    )
    retract_step: float = 0.1
    value: float = field(init=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.min <= self.init <= 1.0:
            raise ValueError(f"need 0 <= min ({self.min}) <= init ({self.init}) <= 1")
        self.value = self.init

    @classmethod
    def from_conservativeness(cls, conservativeness: float) -> NewTokenRatio:
        """``--schedule-conservativeness`` scales the estimate (SGLang's): higher keeps more KV."""
        init = min(1.0, max(0.0, DEFAULT_INIT_NEW_TOKEN_RATIO * conservativeness))
        low = init * DEFAULT_MIN_NEW_TOKEN_RATIO_FACTOR
        return cls(init=init, min=low, decay=(init - low) / NEW_TOKEN_RATIO_DECAY_STEPS)

    def on_decode_step(self) -> None:
        self.value = max(self.min, self.value - self.decay)

    def on_retract(self) -> None:
        self.value = min(1.0, max(self.value, self.init) + self.retract_step)

    def reset(self) -> None:
        self.value = self.init


# ---------------------------------------------------------------------- retraction
def retraction_key(req: RunningReq) -> tuple[int, int, int]:
    """Least work lost first: fewest generated tokens, then shortest sequence, then the latest
    arrival."""
    return (len(req.output_ids), req.all_ids_len, -req.queue_seq)


def retraction_order(reqs: Sequence[R]) -> list[R]:
    return sorted(reqs, key=retraction_key)


def decode_slots(kv_lens: Sequence[int], page_size: int, steps: int = 1) -> int:
    """Fresh slots ``steps`` decode steps of sequences with these KV lengths take."""
    p = page_size
    return sum((num_pages(n + steps, p) - num_pages(n, p)) * p for n in kv_lens)


def plan_retraction(reqs: Sequence[R], available: int, page_size: int, margin_steps: int = 1) -> list[R]:
    """Victims (a prefix of ``retraction_order(reqs)``): the fewest after which the others can
    decode ``margin_steps`` steps. At least one request is always kept.

    ``available``: free + evictable slots now. A victim is assumed to give back the slots it
    owns beyond its cached prefix (its KV goes to the prefix cache, evictable): a lower bound,
    since the prefix pages only it locked become evictable too. The plan may therefore name more
    victims than needed; whoever executes it stops as soon as the real availability suffices."""
    order = retraction_order(reqs)
    need = decode_slots([r.kv_committed_len for r in order], page_size, margin_steps)
    n = 0
    while len(order) - n > 1 and need > available:
        v = order[n]
        need -= decode_slots([v.kv_committed_len], page_size, margin_steps)
        available += page_ceil(v.kv_committed_len, page_size) - len(v.prefix_indices)
        n += 1
    return order[:n]

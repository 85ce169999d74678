"""One request on the scheduler side: its CPU state, state machine and KV bookkeeping.

Request state machine (``ReqStatus``)::

    WAITING --admitted--> PREFILLING --last chunk done--> DECODING --finish--> FINISHED
       ^                    |   ^ (one more chunk per step)  |
       |                    +---+                            | KV short: retracted
       +------------------- RETRACTED <----------------------+
    (any state but FINISHED --abort / stop string--> FINISHED)

KV bookkeeping of a request (positions are token positions of ``origin_input_ids + output_ids``)::

    req_to_token[req_pool_idx, 0 : len(prefix_indices)]   slots shared with the prefix cache
                                                          (locked through ``last_node``)
    req_to_token[req_pool_idx, len(prefix_indices) : kv_committed_len]
                                                          slots owned by the request
    kv_committed_len                                      tokens whose KV is in the pool; for a
                                                          decoding request == len(all ids) - 1
                                                          (the newest token has no KV yet)
    fill_ids                                              the ids whose KV exists after the
                                                          current extend (prompt chunk so far,
                                                          or prompt + kept output after retraction)

A request with images (``images``, srt/multimodal/req_images.py) keeps two prompts:
``origin_input_ids``, the prefix-cache key in which each image span holds the image's pad id,
and ``prompt_ids``, the token ids (sampling penalties, prompt logprobs and drafts read these;
the model embeds them). Without images both are the same list.

The prefix cache (``srt/mem_cache/base_prefix_cache.py``) reads ``origin_input_ids``,
``output_ids``, ``fill_ids``, ``req_pool_idx``, ``prefix_indices``, ``last_node`` and
``kv_committed_len``; ``cache_unfinished_req`` rewrites ``prefix_indices``/``last_node``,
``cache_finished_req`` releases everything the request holds.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from srt.constrained.base import GrammarSpec
from srt.managers.io_struct import FinishReason
from srt.multimodal.req_images import ReqImages
from srt.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from srt.managers.io_struct import TokenizedGenerateReqInput

EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)  # the slots of a request holding no KV


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue, holds no KV and no request slot
    PREFILLING = "prefilling"  # admitted; some (maybe not all) of fill_ids have KV
    DECODING = "decoding"  # in the running batch, one token per step
    RETRACTED = "retracted"  # pushed out of the running batch; released all KV (kept its output)
    FINISHED = "finished"  # done; holds nothing


_TRANSITIONS: dict[ReqStatus, frozenset[ReqStatus]] = {
    ReqStatus.WAITING: frozenset({ReqStatus.PREFILLING, ReqStatus.FINISHED}),
    ReqStatus.PREFILLING: frozenset(
        {ReqStatus.PREFILLING, ReqStatus.DECODING, ReqStatus.RETRACTED, ReqStatus.FINISHED}
    ),
    ReqStatus.DECODING: frozenset({ReqStatus.RETRACTED, ReqStatus.FINISHED}),
    ReqStatus.RETRACTED: frozenset({ReqStatus.WAITING, ReqStatus.FINISHED}),
    ReqStatus.FINISHED: frozenset(),
}


class InvalidTransitionError(RuntimeError):
    """A request was moved along an edge the state machine does not have (a scheduler bug)."""


class Req:
    """One generation request and its scheduler-side state (see the module docstring).

    ``max_new_tokens`` is resolved (never None). ``seed`` is always set (the request's own or
    one drawn at admission). ``stop_ids`` holds the token ids that finish the request once
    ``min_new_tokens`` are generated (``stop_token_ids`` plus the model's EOS unless
    ``ignore_eos``). ``state`` is its ``ReqStatus``; ``finished_reason`` its ``FinishReason``
    once it finished (the first reason recorded wins).
    """

    __slots__ = (
        "rid",
        "origin_input_ids",
        "sampling_params",
        "max_new_tokens",
        "min_new_tokens",
        "seed",
        "stop_ids",
        "stop_strs",
        "grammar_spec",
        "grammar",
        "static_sampling",
        "out_static",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "stream",
        "priority",
        "arrival_time",
        "deadline",
        "queue_seq",
        "state",
        "output_ids",
        "finished_reason",
        "fill_ids",
        "kv_committed_len",
        "kv_allocated_len",
        "prefix_indices",
        "last_node",
        "req_pool_idx",
        "extend_input_len",
        "cached_tokens",
        "admitted_once",
        "wait_start",
        "queue_time",
        "admit_time",
        "first_token_time",
        "retract_count",
        "overtaken",
        "enqueue_step",
        "num_sent",
        "pending_token_logprobs",
        "pending_top_logprobs",
        "input_token_logprobs",
        "input_top_logprobs",
        "input_logprobs_sent",
        "spec",
        "pooling",
        "label_token_ids",
        "pooled_acc",
        "pooled_out",
        "lora_name",
        "lora_slot",
        "prompt_ids",
        "images",
    )

    def __init__(
        self,
        rid: str,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        max_new_tokens: int,
        seed: int,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
        priority: int = 0,
        arrival_time: float = 0.0,
        deadline: float = 0.0,
        queue_seq: int = 0,
        pooling: str = "",
        label_token_ids: list[int] | None = None,
        lora_name: str = "",
        images: ReqImages | None = None,
    ) -> None:
        self.rid = rid
        self.images = images
        self.prompt_ids = list(origin_input_ids)
        self.origin_input_ids = images.key_ids(self.prompt_ids) if images is not None else self.prompt_ids
        self.sampling_params = sampling_params
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = sampling_params.min_new_tokens
        self.seed = seed
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len if return_logprob else -1
        self.top_logprobs_num = top_logprobs_num if return_logprob else 0
        self.stream = stream
        self.priority = priority
        self.arrival_time = arrival_time  # time.time() when the server received it
        self.deadline = deadline  # time.time() past which it times out (0: none)
        self.queue_seq = queue_seq  # arrival order: the fcfs key
        # prefill-only outputs (srt/layers/pooler.py; scheduler/pooling.py): how to pool, which
        # next-token logprobs to return; the partial pooled state; the result, once finished
        self.pooling = pooling
        self.label_token_ids: list[int] = list(label_token_ids or ())
        self.pooled_acc: Any = None
        self.pooled_out: list[float] | None = None
        # the LoRA adapter it runs ("" the base model) and the adapter slot it holds while admitted
        # (-1: none; srt/managers/scheduler/lora_slots.py)
        self.lora_name = lora_name
        self.lora_slot = -1
        self._init_sampling(sampling_params, eos_token_ids)
        self._init_progress()

    def _init_sampling(self, sampling_params: SamplingParams, eos_token_ids: Sequence[int]) -> None:
        """The fields derived from the sampling parameters (fixed for the request's life)."""
        stop = set(sampling_params.stop_token_ids or ())
        if not sampling_params.ignore_eos:
            stop.update(eos_token_ids)
        self.stop_ids: frozenset[int] = frozenset(stop)
        self.stop_strs: list[str] = sampling_params.stop_strs
        # the constraint (json_schema / regex / ebnf) and, once compiled, its matcher
        self.grammar_spec: GrammarSpec | None = GrammarSpec.from_fields(
            sampling_params.json_schema, sampling_params.regex, sampling_params.ebnf
        )
        self.grammar: Any = None
        # no per-step logit edits (penalties, min_new_tokens mask): its sampling rows can be reused
        self.static_sampling = (
            sampling_params.repetition_penalty == 1.0
            and sampling_params.frequency_penalty == 0.0
            and sampling_params.presence_penalty == 0.0
            and sampling_params.min_new_tokens == 0
        )
        # the per-request fields of every BatchTokenIDOut that never change
        self.out_static = (
            self.rid,
            len(self.origin_input_ids),
            sampling_params.skip_special_tokens,
            sampling_params.spaces_between_special_tokens,
            sampling_params.no_stop_trim,
            self.stop_strs,
        )

    def _init_progress(self) -> None:
        """State, output, KV bookkeeping, accounting and streaming of a new (WAITING) request."""
        self.state = ReqStatus.WAITING
        self.output_ids: list[int] = []
        self.finished_reason: FinishReason | None = None

        # KV bookkeeping (module docstring)
        self.fill_ids: list[int] = []
        self.kv_committed_len = 0
        self.kv_allocated_len = 0  # leading req_to_token entries holding slots (>= committed)
        self.prefix_indices: torch.Tensor = EMPTY_SLOTS
        self.last_node: Any = None
        self.req_pool_idx: int | None = None
        self.extend_input_len = 0  # new tokens computed in the current step

        # accounting
        self.cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.admitted_once = False
        self.wait_start = time.perf_counter()  # when the scheduler received it
        self.queue_time: float | None = None  # seconds from arrival to the first admission
        self.admit_time = 0.0  # perf_counter() at the first admission (0: not yet)
        self.first_token_time = 0.0  # perf_counter() when the first output token was sampled
        self.retract_count = 0
        self.overtaken = 0  # times a later request was admitted while this one did not fit
        self.enqueue_step = 0  # scheduler step at which it (re)entered the waiting queue

        # output streaming
        self.num_sent = 0  # output_ids[:num_sent] were already sent
        self.pending_token_logprobs: list[float] = []
        self.pending_top_logprobs: list[list[tuple[int, float]]] = []
        self.input_token_logprobs: list[float | None] = []
        self.input_top_logprobs: list[list[tuple[int, float]] | None] = []
        self.input_logprobs_sent = False
        # speculative decoding: the drafting state (speculative.py; None until the first draft)
        self.spec: Any = None

    @classmethod
    def from_input(
        cls,
        msg: TokenizedGenerateReqInput,
        sampling_params: SamplingParams,
        *,
        seed: int,
        eos_token_ids: list[int],
        queue_seq: int,
    ) -> Req:
        """A WAITING request from the tokenizer manager's message, with its ``sampling_params``
        normalized for the prompt (``max_new_tokens`` resolved; see `RequestTable.add`). A logprob
        start outside the prompt means no prompt logprobs."""
        assert sampling_params.max_new_tokens is not None, "normalize(bounds) resolves max_new_tokens"
        n = len(msg.input_ids)
        return cls(
            msg.rid,
            msg.input_ids,
            sampling_params,
            max_new_tokens=sampling_params.max_new_tokens,
            seed=seed,
            eos_token_ids=eos_token_ids,
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len if 0 <= msg.logprob_start_len < n else -1,
            top_logprobs_num=msg.top_logprobs_num,
            stream=msg.stream,
            priority=msg.priority,
            arrival_time=msg.arrival_time or time.time(),
            deadline=msg.deadline,
            queue_seq=queue_seq,
            pooling=msg.pooling,
            label_token_ids=msg.label_token_ids,
            lora_name=msg.lora_name,
            images=ReqImages(msg.mm, n) if msg.mm is not None else None,
        )

    # ------------------------------------------------------------------ state machine
    def set_state(self, new: ReqStatus) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise InvalidTransitionError(f"request {self.rid!r}: {self.state.value} -> {new.value}")
        self.state = new

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def finish(self, reason: FinishReason) -> None:
        """Record the finish reason (the first one wins); the state moves to FINISHED once the
        scheduler released the request's resources (``mark_released``)."""
        if self.finished_reason is None:
            self.finished_reason = reason

    def mark_released(self) -> None:
        """The request holds no KV and no request slot any more and is done."""
        self.clear_kv_state()
        if self.images is not None:
            self.images.drop_embeddings()
        self.set_state(ReqStatus.FINISHED)

    def clear_kv_state(self) -> None:
        self.prefix_indices = EMPTY_SLOTS
        self.last_node = None
        self.req_pool_idx = None
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.extend_input_len = 0

    def retract(self) -> None:
        """Back to the waiting queue after its KV was handed to the cache: the kept output is
        recomputed as part of the prompt on re-admission."""
        self.set_state(ReqStatus.RETRACTED)
        self.clear_kv_state()
        if self.images is not None:
            self.images.drop_embeddings()  # recomputed when the prompt is prefilled again
        self.pooled_acc = None
        self.retract_count += 1
        self.overtaken = 0
        self.set_state(ReqStatus.WAITING)

    # ------------------------------------------------------------------ lengths
    @property
    def all_ids_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.max_new_tokens - len(self.output_ids))

    @property
    def wants_input_logprobs(self) -> bool:
        """Prompt logprobs requested and not yet delivered."""
        return self.logprob_start_len >= 0 and not self.input_logprobs_sent

    def prefix_match_key(self) -> list[int]:
        """Ids whose KV may come from the prefix cache on (re)admission.

        The last id is always recomputed (its logits give the next token); with prompt
        logprobs pending, nothing from ``logprob_start_len`` on may be skipped either (its
        logits are needed); "mean" / "cls" pooling reads every prompt position."""
        ids = self.origin_input_ids + self.output_ids
        limit = len(ids) - 1
        if self.wants_input_logprobs:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        if self.pooling in ("mean", "cls"):  # pooled over every prompt position
            limit = 0
        return ids[:limit]

    # ------------------------------------------------------------------ results
    def append_token(self, token_id: int) -> None:
        """Append a sampled token and set ``finished_reason`` when a stop condition holds."""
        self.output_ids.append(token_id)
        if len(self.output_ids) >= self.max_new_tokens or token_id in self.stop_ids:
            self.check_finished(token_id)

    def check_finished(self, token_id: int) -> None:
        """The finish rules after ``token_id`` was appended: ``max_new_tokens`` reached ->
        length; a stop token (``stop_token_ids``, EOS unless ``ignore_eos``) once
        ``min_new_tokens`` are generated -> stop. Length wins when both apply."""
        n = len(self.output_ids)
        if n >= self.max_new_tokens:
            self.finish(FinishReason.of_length(n))
        elif n >= self.min_new_tokens and token_id in self.stop_ids:
            self.finish(FinishReason.of_stop(token_id))

    def __repr__(self) -> str:
        return (
            f"Req(rid={self.rid!r}, state={self.state.value}, prompt={len(self.origin_input_ids)}, "
            f"out={len(self.output_ids)}, kv={self.kv_committed_len})"
        )

"""The scheduler's parts that are built from `ServerArgs` (used by ``Scheduler.__init__``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from srt.managers.scheduler.grammar import GrammarManager
from srt.managers.scheduler.overlap import ForwardWorker, same_thread_count
from srt.managers.scheduler.prefill import PrefillConfig
from srt.utils.hf_tokenizer import tokenizer_source

if TYPE_CHECKING:
    from collections.abc import Callable

    from srt.managers.scheduler.runner_protocol import SchedulerModelRunner
    from srt.server_args import ServerArgs


def load_model_runner(server_args: ServerArgs, tp_rank: int) -> SchedulerModelRunner:
    from srt.model_executor.model_runner import ModelRunner

    return ModelRunner(server_args, tp_rank=tp_rank)


def create_grammars(
    server_args: ServerArgs, vocab_size: int, eos_token_ids: list[int]
) -> GrammarManager | None:
    """The grammar part (None without a tokenizer or with ``--grammar-backend none``). Tensor-parallel
    ranks must admit a request at the same step, so with ``--tp-size`` > 1 grammar readiness never
    depends on timing."""
    if server_args.skip_tokenizer_init:
        return None
    grammars = GrammarManager.create(
        server_args.grammar_backend,
        tokenizer_source(server_args),
        vocab_size,
        eos_token_ids,
        server_args.trust_remote_code,
        server_args.reasoning_parser,
    )
    if grammars is not None:
        grammars.wait_all = server_args.tp_size > 1
    return grammars


def create_prefill_config(server_args: ServerArgs, max_running_requests: int) -> PrefillConfig:
    """The prefill part's budgets (``--chunked-prefill-size`` <= 0 disables chunking)."""
    cps = server_args.chunked_prefill_size
    return PrefillConfig(
        max_running_requests=max_running_requests,
        chunked_prefill_size=cps if cps is not None and cps > 0 else None,
        max_prefill_tokens=server_args.max_prefill_tokens,
        enable_mixed_chunk=server_args.enable_mixed_chunk,
        share_in_batch=not server_args.disable_radix_cache,
    )


def start_model_runner(
    server_args: ServerArgs,
    runner: SchedulerModelRunner | None,
    tp_rank: int,
    thread_init: Callable[[], None] | None,
) -> tuple[ForwardWorker, SchedulerModelRunner]:
    """The forward worker (on a thread of its own with overlap scheduling, set up by
    ``thread_init``; default: the calling thread's torch thread count) and the model runner,
    ``runner`` or a ``ModelRunner`` loaded where the worker runs the forwards."""
    if thread_init is None:
        thread_init = same_thread_count(torch.get_num_threads())
    worker = ForwardWorker(not server_args.disable_overlap_schedule, thread_init)
    if runner is None:
        runner = worker.call(load_model_runner, server_args, tp_rank)
    worker.attach(runner)
    return worker, runner


def wire_lora_slots(server_args: ServerArgs, runner: SchedulerModelRunner, cache, prefill, requests):
    """The LoRA adapter slots (lora_slots.py; None without --enable-lora), handed to the parts that
    take them: admission (prefill), release (cache), arrival checks (requests)."""
    from srt.managers.scheduler.lora_slots import LoRASlots

    slots = LoRASlots.create(server_args, getattr(runner, "lora", None))
    cache.lora_slots = prefill.lora_slots = requests.lora = slots
    return slots

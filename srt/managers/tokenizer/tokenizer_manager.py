"""TokenizerManager: the main process's side of the pipeline (asyncio), a facade over five parts.

    user request (GenerateReqInput) --prepare()--> PreparedRequest (validated, nothing sent)
        --run()--> [PUSH scheduler_input_ipc_name]  ...  [PULL tokenizer_ipc_name] <-- BatchStrOut
        --> ReqState (per rid) --> output dicts (streamed chunks or one final output)

The parts, each in its own module:

    input_processor.InputProcessor   normalization and validation: expand, sampling parameters,
                                     batched tokenization, the prompt checks (one fit rule, shared
                                     with the scheduler), the n > 1 fan-out and warm-up
    req_state.ReqRegistry            rid -> ReqState, waiting count, admission (`QueueFullError`
                                     past ``--max-queued-requests``), per-request metrics, fail-all
    req_output                       the SGLang-shaped output dicts (final output, stream chunks)
    tokenizer_ipc.TokenizerIPC       the sockets, the receive loop, replies to control requests
                                     (flush, internal state, profiler, weight updates, LoRA)
    lora_registry.LoRARegistry       the LoRA adapters requests may name (``lora_registry``):
                                     the checks, and the load / unload requests

`prepare` rejects a request before the scheduler sees it (`RequestError`, `ContextLengthError`,
`QueueFullError`, `EngineDeadError`). `run` sends it and yields outputs; leaving it early (client
disconnect, generator close) aborts every unfinished rid with one ``AbortReq``. The scheduler
finishes a request whose deadline passed (`srt.managers.scheduler.deadlines`); ``run``'s backstop
timer does it here ``DEADLINE_GRACE_S`` later if it did not. `abort_all` (graceful drain) aborts
everything in flight. If a child process dies, `on_child_death` (supervisor's thread) fails
every in-flight request with `EngineDeadError` and refuses new ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from srt.managers.data_parallel.replies import split_dp_state
from srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FinishReason,
    FlushCacheReqOutput,
    ProfileReq,
    ProfileReqOutput,
    TokenizedGenerateReqInput,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDiskReqOutput,
)
from srt.managers.tokenizer.generate_input import GenerateReqInput
from srt.managers.tokenizer.image_prompts import ImagePrompts
from srt.managers.tokenizer.input_processor import InputLimits, InputProcessor, PreparedRequest
from srt.managers.tokenizer.ipc import TokenizerIPC
from srt.managers.tokenizer.lora_registry import LoRARegistry
from srt.managers.tokenizer.metrics import TokenizerMetrics
from srt.managers.tokenizer.pooled_run import PrefillOnly
from srt.managers.tokenizer.req_output import final_output, stream_chunk
from srt.managers.tokenizer.req_state import ReqRegistry, ReqState, RequestGroup
from srt.server_args import PortArgs, ServerArgs
from srt.utils.errors import EngineDeadError, RequestError, SrtError

__all__ = ["PreparedRequest", "TokenizerManager", "scheduler_load", "served_model_name"]

logger = logging.getLogger(__name__)

# the tokenizer manager's deadline timer fires this long after a deadline: the scheduler, which
# frees the request's slots, normally reports the timeout first
DEADLINE_GRACE_S = 0.25


def served_model_name(server_args: ServerArgs) -> str:
    """--served-model-name, else the model file/directory name (without .gguf)."""
    if server_args.served_model_name:
        return server_args.served_model_name
    if server_args.model_path:
        return os.path.basename(os.path.normpath(server_args.model_path)).removesuffix(".gguf")
    return "SmolLM2-135M-Instruct"


def scheduler_load(state: dict[str, Any], dp_rank: int = 0) -> dict[str, Any]:
    """SGLang's /get_load entry of one scheduler from its internal state: requests running or
    queued, those queued, and the KV tokens in use (neither free nor evictable cache)."""
    running, queued = int(state["num_running_reqs"]), int(state["num_queued_reqs"])
    free = int(state["available_size"]) + int(state["evictable_size"])
    return {
        "num_reqs": running + queued,
        "num_waiting_reqs": queued,
        "num_tokens": max(0, int(state["max_total_num_tokens"]) - free),
        "dp_rank": dp_rank,
    }


class TokenizerManager:
    """The serving front end of one engine (see the module docstring for its parts)."""

    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        scheduler_info: dict[str, Any],
        tokenizer: Any,
        images: ImagePrompts | None = None,  # how prompts take images (None: they take none)
    ) -> None:
        self.server_args = server_args
        self.port_args = port_args
        self.scheduler_info = scheduler_info
        self.tokenizer = tokenizer
        self.model_name = served_model_name(server_args)
        limits = InputLimits.from_scheduler_info(scheduler_info, tokenizer)
        self.context_len = limits.context_len
        self.metrics = TokenizerMetrics(self.model_name)
        self.ipc = TokenizerIPC(port_args, self._handle_batch_str_out)
        self.lora_registry = LoRARegistry(
            server_args.enable_lora, server_args.lora_paths, self.ipc.lora_adapter, self._check_alive
        )
        self.inputs = InputProcessor(
            limits,
            tokenizer,
            share_prefill=not server_args.disable_radix_cache,
            grammar_backend=server_args.grammar_backend,
            enable_priority=server_args.enable_priority_scheduling,
            max_top_logprobs=server_args.max_top_logprobs_num,
            max_sequences=server_args.max_sequences_per_request,
            incremental_stream=server_args.incremental_streaming_output,
            lora=self.lora_registry,
            images=images,
        )
        self.takes_images = images is not None and images.processor is not None
        self.registry = ReqRegistry(self.metrics, server_args.max_queued_requests, server_args.log_requests)
        self.dead: EngineDeadError | None = None
        self._death_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._weights_lock: asyncio.Lock | None = None  # one weight update at a time (serving loop)
        self.launcher: Any = None  # srt.entrypoints.launch.Launcher (set by launch_subprocesses)

    @property
    def rid_to_state(self) -> dict[str, ReqState]:
        return self.registry.rid_to_state

    # ================================================================== life cycle
    async def start(self) -> None:
        """Start the receive loop in the running event loop (call once, from the serving loop)."""
        self._loop = asyncio.get_running_loop()
        self.inputs.start(self._loop)
        self.ipc.start(self._loop)
        if self.dead is not None:
            self._fail_all()

    async def close(self) -> None:
        """Stop the receive loop and close the sockets (the children are stopped by the launcher)."""
        await self.ipc.close()

    def add_death_callback(self, cb: Callable[[EngineDeadError], None]) -> None:
        self._death_callbacks.append(cb)

    def on_child_death(self, name: str, exitcode: int | None) -> None:
        """A child process exited unexpectedly (called from any thread)."""
        why = f"the {name} process died unexpectedly (exit code {exitcode}); in-flight requests are failed"
        self.on_engine_dead(EngineDeadError(f"{why} and the engine is shutting down"))

    def on_engine_dead(self, error: EngineDeadError) -> None:
        """The engine cannot serve any more (a child died, or the hang watchdog fired; called
        from any thread): fail every in-flight request, refuse new ones, run the death callbacks."""
        self.dead = error
        logger.error("%s", self.dead.message)
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._fail_all)
        for cb in self._death_callbacks:
            try:
                cb(self.dead)
            except Exception:  # noqa: BLE001
                logger.exception("death callback failed")

    def fail_all(self, error: EngineDeadError) -> None:
        """Refuse new requests and fail the in-flight ones with ``error`` (call in the loop)."""
        if self.dead is None:
            self.dead = error
        self._fail_all()

    def _fail_all(self) -> None:
        self.registry.fail_all()
        self.ipc.fail_pending(self.dead or EngineDeadError("engine stopped"))

    @property
    def is_healthy(self) -> bool:
        return self.dead is None

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead

    def num_waiting(self) -> int:
        return len(self.registry.waiting)

    # ================================================================== requests
    async def prepare(
        self, obj: GenerateReqInput, prefill_only: PrefillOnly | None = None
    ) -> PreparedRequest:
        """Validate, tokenize and admit ``obj``; raises `RequestError` / `QueueFullError` /
        `EngineDeadError`. Nothing is sent to the scheduler. ``prefill_only``: an embedding or
        score request (pooled_run.py); the only kind an --is-embedding server takes."""
        self._check_alive()
        if prefill_only is None and self.server_args.is_embedding:
            raise RequestError(
                "this server serves an embedding model (--is-embedding): use /v1/embeddings, /encode, "
                "/v1/rerank or /v1/score"
            )
        prep = await self.inputs.prepare(obj, self.registry.in_use)
        if prefill_only is not None:
            prefill_only.apply(prep, self.inputs.limits.vocab_size)
        self.registry.admit(len(prep.reqs))
        return prep

    async def run(self, prep: PreparedRequest) -> AsyncIterator[dict[str, Any]]:
        """Send ``prep`` and yield its outputs: for streaming, chunks of any index as they arrive
        (the new output, or with ``prep.incremental`` False all of it so far); otherwise each
        index's final output once it finishes (in completion order).

        Leaving early (cancellation, ``aclose``) aborts every unfinished rid."""
        group = RequestGroup(stream=prep.stream)
        deadline = max((r.deadline for r, _ in prep.reqs), default=0.0)
        try:
            if prep.warmups:
                group.warmups = [self._send(r, r.rid, -1, group, warmup=True) for r in prep.warmups]
                while not all(st.finished for st in group.warmups):
                    await self._wait(group, deadline)
            group.states = [self._send(r, parent, i, group) for i, (r, parent) in enumerate(prep.reqs)]
            pending = list(group.states)
            while pending:
                await self._wait(group, deadline)
                still = []
                for st in pending:
                    done = st.finished  # snapshot: the state may finish while we are suspended in yield
                    if prep.stream:
                        chunk = stream_chunk(st, prep.incremental, prep.token_texts)
                        if chunk is not None:
                            yield chunk
                    elif done:
                        yield final_output(st, prep.token_texts)
                    if not done:
                        still.append(st)
                pending = still
        finally:
            unfinished = [st for st in group.warmups + group.states if not st.finished]
            if unfinished and self.dead is None:
                for st in unfinished:
                    self._abort_state(st, "client disconnected", "client")

    async def generate(
        self, obj: GenerateReqInput, prefill_only: PrefillOnly | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """`prepare` + `run`."""
        prep = await self.prepare(obj, prefill_only)
        async for out in self.run(prep):
            yield out

    async def _wait(self, group: RequestGroup, deadline: float = 0.0) -> None:
        """Until any state of ``group`` changes; raises `EngineDeadError` when the engine died.
        With a ``deadline`` (time.time()), past it plus the grace the group's unfinished states
        are finished here with a ``timeout`` reason (and aborted in the scheduler)."""
        if deadline > 0:
            left = deadline + DEADLINE_GRACE_S - time.time()
            try:
                await asyncio.wait_for(group.event.wait(), max(left, 0.0))
            except asyncio.TimeoutError:
                self._time_out(group)
        else:
            await group.event.wait()
        group.event.clear()
        self._check_alive()

    def _time_out(self, group: RequestGroup) -> None:
        for st in group.warmups + group.states:
            if not st.finished:
                timeout = max(st.req.deadline - st.req.arrival_time, 0.0)
                reason = FinishReason.of_timeout(timeout)
                self.ipc.send(AbortReq(rid=st.rid, message=reason.message or "", status_code=408))
                self.registry.finish(st, reason)
        group.event.set()

    def _send(
        self,
        req: TokenizedGenerateReqInput,
        parent: str,
        index: int,
        group: RequestGroup,
        warmup: bool = False,
    ) -> ReqState:
        self._check_alive()
        st = ReqState(req=req, index=index, parent_rid=parent, group=group, is_warmup=warmup)
        if req.arrival_time:  # ttft and e2e count from the server's receipt
            st.created -= max(time.time() - req.arrival_time, 0.0)
        self.registry.add(st)
        self.ipc.send(req)
        return st

    def _handle_batch_str_out(self, out: BatchStrOut) -> None:
        """The receive loop's handler of detokenizer outputs."""
        self.registry.apply(out)

    # ================================================================== abort
    def abort_request(self, rid: str = "") -> int:
        """Abort ``rid`` (and its ``n`` copies); ``""`` aborts everything. Returns how many rids."""
        states = self.registry.matching(rid)
        for st in states:
            self._abort_state(st, "aborted by request", "client")
        return len(states)

    def abort_all(self, message: str, status_code: int, label: str, retry_after: int | None = None) -> int:
        """Abort every request in flight: their outputs finish with ``abort`` (``message``,
        ``status_code``, ``retry_after``), counted under ``label``. Returns how many rids."""
        states = self.registry.matching("")
        for st in states:
            self._abort_state(st, message, label, status_code, retry_after)
        return len(states)

    @property
    def num_in_flight(self) -> int:
        """Requests sent to the scheduler and not finished (warm-ups included)."""
        return len(self.registry.rid_to_state)

    def _abort_state(
        self, st: ReqState, message: str, label: str, status_code: int = 499, retry_after: int | None = None
    ) -> None:
        self.ipc.send(AbortReq(rid=st.rid, message=message, status_code=status_code))
        st.abort_label = label
        self.registry.finish(st, FinishReason.of_abort(message, status_code, retry_after))
        st.group.event.set()

    # ================================================================== control requests
    async def flush_cache(self) -> FlushCacheReqOutput:
        self._check_alive()
        return await self.ipc.flush_cache()

    async def get_internal_state(self) -> dict[str, Any]:
        """The scheduler's live state (concurrent callers share one request)."""
        self._check_alive()
        return await self.ipc.get_internal_state()

    async def get_load(self) -> list[dict[str, Any]]:
        """SGLang's /get_load: one `scheduler_load` dict per scheduler (group), by dp rank."""
        states, _ = split_dp_state(await self.get_internal_state())
        return [scheduler_load(s, rank) for rank, s in enumerate(states)]

    async def profile(self, req: ProfileReq) -> ProfileReqOutput:
        """Start or stop the scheduler's torch profiler (``success`` False: why not)."""
        self._check_alive()
        return await self.ipc.profile(req)

    async def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None
    ) -> UpdateWeightsFromDiskReqOutput:
        """Reload the weights from ``model_path`` once the running requests finished (requests
        arriving meanwhile wait in the scheduler); concurrent calls run one after the other."""
        self._check_alive()
        if self._weights_lock is None:
            self._weights_lock = asyncio.Lock()
        async with self._weights_lock:
            return await self.ipc.update_weights_from_disk(
                UpdateWeightsFromDiskReq(model_path=model_path, load_format=load_format)
            )

    # ================================================================== tokenizer
    async def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text (`RequestError` under --skip-tokenizer-init)."""
        return await self.inputs.tokenize(texts, add_special_tokens)

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (`RequestError` for ids outside the vocabulary, or without a tokenizer)."""
        return self.inputs.detokenize(ids, skip_special_tokens)

    async def render_metrics(self) -> bytes:
        """Prometheus text: the request metrics and the scheduler's live gauges (when it answers)."""
        state: dict[str, Any] | None = None
        try:
            state = await self.get_internal_state()
        except (SrtError, asyncio.TimeoutError):
            state = None
        return self.metrics.render(state)

    # ================================================================== chat
    def chat_template_renders_tools(self) -> bool:
        """Whether the chat template uses the ``tools`` it is given (else the caller describes them)."""
        template = getattr(self.tokenizer, "chat_template", None)
        return isinstance(template, str) and "tools" in template

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """The prompt text of ``messages``; ``kwargs`` go to the tokenizer's ``apply_chat_template``
        (the generation prompt is appended unless they say ``add_generation_prompt=False``)."""
        if self.tokenizer is None:
            raise RequestError("chat requests need a tokenizer (the server runs with --skip-tokenizer-init)")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise RequestError("this model's tokenizer has no chat template; use /v1/completions")
        try:
            kwargs.setdefault("add_generation_prompt", True)
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as e:  # jinja raises on messages the template rejects
            raise RequestError(f"the chat template rejected the messages: {e}", param="messages") from e

"""TokenizerManager: the main process's side of the pipeline (asyncio).

    user request (GenerateReqInput) --prepare()--> validated TokenizedGenerateReqInputs
        --run()--> [PUSH scheduler_input_ipc_name]  ...  [PULL tokenizer_ipc_name] <-- BatchStrOut
        --> ReqState (per rid) --> output dicts (streamed chunks or one final output)

`prepare` does everything that can reject a request *before* the scheduler sees it: shape checks,
sampling-parameter validation (one message per bad value), tokenization (requests arriving in the
same event-loop iteration are tokenized in one batch call), prompt + max_new_tokens against the
context length (the message gives the numbers), and admission control (``--max-queued-requests``:
`QueueFullError` with a Retry-After from the recent completion rate). `run` sends the requests and
yields outputs; leaving it early (client disconnect = task cancellation, generator close) aborts
every unfinished rid at once with an ``AbortReq``.

``n > 1``: the prompt is first sent as a prefill-only request (``max_new_tokens=0``) so that the n
copies (rids ``f"{rid}-{i}"``, seeds ``seed + i``) share its KV through the radix cache.

If a child process dies, `on_child_death` (called from the supervisor's thread) fails every
in-flight request with `EngineDeadError` and refuses new ones.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import zmq

from srt.managers.generate_input import GenerateReqInput, SingleInput, parse_sampling_params
from srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    TokenizedGenerateReqInput,
    encode,
    tokenizer_input_decoder,
)
from srt.managers.metrics import TokenizerMetrics
from srt.managers.req_state import ReqState, RequestGroup
from srt.managers.tokenize_batcher import TokenizeBatcher
from srt.server_args import PortArgs, ServerArgs
from srt.utils.errors import ContextLengthError, EngineDeadError, QueueFullError, RequestError, SrtError
from srt.utils.zmq import get_zmq_socket, new_async_context

logger = logging.getLogger(__name__)

_STATE_TIMEOUT_S = 5.0
_FLUSH_TIMEOUT_S = 30.0
_RATE_WINDOW_S = 60.0


@dataclasses.dataclass
class PreparedRequest:
    """A validated request, ready for `TokenizerManager.run` (nothing sent yet)."""

    reqs: list[tuple[TokenizedGenerateReqInput, str]]  # (request, parent rid) per output index
    warmups: list[TokenizedGenerateReqInput]
    stream: bool
    is_batch: bool


def served_model_name(server_args: ServerArgs) -> str:
    """--served-model-name, else the model file/directory name (without .gguf)."""
    if server_args.served_model_name:
        return server_args.served_model_name
    if server_args.model_path:
        return os.path.basename(os.path.normpath(server_args.model_path)).removesuffix(".gguf")
    return "SmolLM2-135M-Instruct"


class TokenizerManager:
    def __init__(
        self, server_args: ServerArgs, port_args: PortArgs, scheduler_info: dict[str, Any], tokenizer: Any
    ) -> None:
        self.server_args = server_args
        self.port_args = port_args
        self.scheduler_info = scheduler_info
        self.tokenizer = tokenizer
        self.model_name = served_model_name(server_args)
        self.context_len: int = int(scheduler_info["context_len"])
        self.max_req_input_len: int = int(scheduler_info.get("max_req_input_len") or self.context_len)
        self.max_total_num_tokens: int = int(scheduler_info.get("max_total_num_tokens") or 0)
        # input ids must be valid for the model and (when there is one) the tokenizer
        known = [
            int(v) for v in (scheduler_info.get("vocab_size"), len(tokenizer) if tokenizer else None) if v
        ]
        self.vocab_size: int | None = min(known) if known else None
        self.metrics = TokenizerMetrics(self.model_name)

        self.rid_to_state: dict[str, ReqState] = {}
        self._waiting: set[str] = set()  # sent, no output yet
        self._completions: collections.deque[float] = collections.deque()
        self._flush_futures: collections.deque[asyncio.Future] = collections.deque()
        self._state_future: asyncio.Future | None = None
        self.dead: EngineDeadError | None = None
        self._death_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recv_task: asyncio.Task | None = None
        self._batcher: TokenizeBatcher | None = None
        self.launcher: Any = None  # srt.entrypoints.launch.Launcher (set by launch_subprocesses)

        # the PULL socket is bound now (before the detokenizer sends anything); the receive loop
        # starts in the serving event loop with `start()`
        self._actx = new_async_context()
        self._recv_sock = get_zmq_socket(self._actx, zmq.PULL, port_args.tokenizer_ipc_name, bind=True)
        self._sctx = zmq.Context(io_threads=1)
        self._send_sock = get_zmq_socket(self._sctx, zmq.PUSH, port_args.scheduler_input_ipc_name, bind=False)

    # ================================================================== life cycle
    async def start(self) -> None:
        """Start the receive loop in the running event loop (call once, from the serving loop)."""
        self._loop = asyncio.get_running_loop()
        if self.tokenizer is not None:
            self._batcher = TokenizeBatcher(self.tokenizer, self._loop)
        self._recv_task = self._loop.create_task(self._recv_loop(), name="srt-tokenizer-recv")
        if self.dead is not None:
            self._fail_all()

    async def close(self) -> None:
        """Stop the receive loop and close the sockets (the children are stopped by the launcher)."""
        if self._recv_task is not None:
            self._recv_task.cancel()
            try:
                await self._recv_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._recv_task = None
        self._recv_sock.close(linger=0)
        self._send_sock.close(linger=0)
        self._actx.term()
        self._sctx.term()

    def add_death_callback(self, cb: Callable[[EngineDeadError], None]) -> None:
        self._death_callbacks.append(cb)

    def on_child_death(self, name: str, exitcode: int | None) -> None:
        """A child process exited unexpectedly (called from any thread)."""
        self.dead = EngineDeadError(
            f"the {name} process died unexpectedly (exit code {exitcode}); in-flight requests are "
            "failed and the engine is shutting down"
        )
        logger.error("%s", self.dead.message)
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._fail_all)
            except RuntimeError:
                pass
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
        states = list(self.rid_to_state.values())
        self.rid_to_state.clear()
        self._waiting.clear()
        for st in states:
            st.group.event.set()
        for fut in list(self._flush_futures):
            if not fut.done():
                fut.set_exception(self.dead or EngineDeadError("engine stopped"))
        self._flush_futures.clear()
        if self._state_future is not None and not self._state_future.done():
            self._state_future.set_exception(self.dead or EngineDeadError("engine stopped"))

    @property
    def is_healthy(self) -> bool:
        return self.dead is None

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead

    # ================================================================== prepare
    async def prepare(self, obj: GenerateReqInput) -> PreparedRequest:
        """Validate, tokenize and admit ``obj``; raises `RequestError` / `QueueFullError` /
        `EngineDeadError`. Nothing is sent to the scheduler."""
        self._check_alive()
        singles = obj.expand()
        params = [parse_sampling_params(s.sampling_params, self.vocab_size, obj.param_names) for s in singles]
        ids_list = await self._tokenize(singles, obj.add_special_tokens)
        names = obj.param_names
        reqs: list[tuple[TokenizedGenerateReqInput, str]] = []
        warmups: list[TokenizedGenerateReqInput] = []
        seen: set[str] = set()
        now = time.time()
        for s, sp, ids in zip(singles, params, ids_list):
            if "max_new_tokens" not in s.sampling_params and sp.max_new_tokens is not None:
                # the default (128) never makes a request fail: cap it to what the context leaves
                room = min(self.context_len, self.max_total_num_tokens or self.context_len) - len(ids)
                sp.max_new_tokens = max(min(sp.max_new_tokens, room), 1)
            self._check_prompt(s, sp.max_new_tokens, ids, names)
            if s.rid in self.rid_to_state or s.rid in seen:
                raise RequestError(f"rid {s.rid!r} is already in use", param="rid")
            seen.add(s.rid)
            base = TokenizedGenerateReqInput(
                rid=s.rid,
                input_ids=ids,
                sampling_params=sp,
                return_logprob=s.return_logprob,
                logprob_start_len=s.logprob_start_len if s.return_logprob else -1,
                top_logprobs_num=s.top_logprobs_num,
                stream=obj.stream,
                arrival_time=now,
            )
            if sp.n == 1:
                reqs.append((base, s.rid))
                continue
            if not self.server_args.disable_radix_cache:
                warm_sp = msgspec.structs.replace(sp, n=1, max_new_tokens=0, min_new_tokens=0)
                warmups.append(
                    msgspec.structs.replace(
                        base,
                        rid=f"{s.rid}-prefill",
                        sampling_params=warm_sp,
                        return_logprob=False,
                        logprob_start_len=-1,
                        top_logprobs_num=0,
                    )
                )
            for j in range(sp.n):
                seed = None if sp.seed is None else (sp.seed + j) % (2**63)
                copy_sp = msgspec.structs.replace(sp, n=1, seed=seed)
                reqs.append(
                    (msgspec.structs.replace(base, rid=f"{s.rid}-{j}", sampling_params=copy_sp), s.rid)
                )
        self._admit(len(reqs))
        return PreparedRequest(reqs, warmups, obj.stream, obj.is_batch)

    async def _tokenize(self, singles: list[SingleInput], add_special_tokens: bool) -> list[list[int]]:
        texts = [s.text for s in singles if s.text is not None]
        encoded: list[list[int]] = []
        if texts:
            if self._batcher is None:
                raise RequestError("the server runs with --skip-tokenizer-init: send input_ids, not text")
            encoded = await self._batcher.encode(texts, add_special_tokens)
        it = iter(encoded)
        return [list(s.input_ids) if s.input_ids is not None else next(it) for s in singles]

    def _check_prompt(
        self, s: SingleInput, max_new: int | None, ids: list[int], names: dict[str, str]
    ) -> None:
        n = len(ids)
        mnt_name = names.get("max_new_tokens", "max_new_tokens")
        if n == 0:
            raise RequestError("the prompt is empty (0 tokens)", param="prompt")
        if self.vocab_size is not None and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(t for t in ids if t < 0 or t >= self.vocab_size)
            raise RequestError(
                f"input token id {bad} is outside the vocabulary [0, {self.vocab_size})", "prompt"
            )
        if n > self.max_req_input_len:
            raise ContextLengthError(
                f"the prompt has {n} tokens, more than the maximum input length of {self.max_req_input_len} "
                f"tokens (context length {self.context_len}); shorten the prompt",
                param="prompt",
            )
        total = n + (max_new if max_new is not None else 1)
        if total > self.context_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.context_len} tokens, but the request needs "
                f"{total} tokens ({n} in the prompt + {max_new if max_new is not None else 1} for "
                f"{mnt_name}); reduce the prompt or {mnt_name}",
                param=mnt_name if max_new else "prompt",
            )
        if self.max_total_num_tokens and total > self.max_total_num_tokens:
            raise ContextLengthError(
                f"the request needs {total} tokens ({n} in the prompt + {max_new} for {mnt_name}), more than "
                f"the KV cache holds ({self.max_total_num_tokens} tokens); reduce the prompt or {mnt_name}",
                param=mnt_name,
            )
        if s.return_logprob and s.logprob_start_len >= n:
            raise RequestError(
                f"logprob_start_len ({s.logprob_start_len}) must be < the prompt length ({n})",
                "logprob_start_len",
            )

    def _admit(self, num_new: int) -> None:
        limit = self.server_args.max_queued_requests
        if limit is None or len(self._waiting) + num_new <= limit:
            return
        over = len(self._waiting) + num_new - limit
        now = time.monotonic()
        while self._completions and now - self._completions[0] > _RATE_WINDOW_S:
            self._completions.popleft()
        if self._completions:
            span = max(now - self._completions[0], 1.0)
            rate = len(self._completions) / span  # requests completed per second, recently
            retry_after = min(max(math.ceil(over / rate), 1), 600)
        else:
            retry_after = 5
        raise QueueFullError(
            f"too many queued requests ({len(self._waiting)} waiting, limit --max-queued-requests={limit}); "
            f"retry after {retry_after} s",
            retry_after,
        )

    # ================================================================== run
    async def run(self, prep: PreparedRequest) -> AsyncIterator[dict[str, Any]]:
        """Send ``prep`` and yield its outputs: for streaming, chunks of any index as they arrive;
        otherwise each index's final output once it finishes (in completion order).

        Leaving early (cancellation, ``aclose``) aborts every unfinished rid."""
        group = RequestGroup(stream=prep.stream)
        try:
            if prep.warmups:
                group.warmups = [self._send(r, r.rid, -1, group, warmup=True) for r in prep.warmups]
                while not all(st.finished for st in group.warmups):
                    await group.event.wait()
                    group.event.clear()
                    self._check_alive()
            group.states = [self._send(r, parent, i, group) for i, (r, parent) in enumerate(prep.reqs)]
            pending = list(group.states)
            while pending:
                await group.event.wait()
                group.event.clear()
                self._check_alive()
                still = []
                for st in pending:
                    done = st.finished  # snapshot: the state may finish while we are suspended in yield
                    if prep.stream:
                        chunk = st.stream_chunk()
                        if chunk is not None:
                            yield chunk
                    elif done:
                        yield st.final_output()
                    if not done:
                        still.append(st)
                pending = still
        finally:
            unfinished = [st for st in group.warmups + group.states if not st.finished]
            if unfinished and self.dead is None:
                for st in unfinished:
                    self._abort_state(st, "client disconnected", "client_disconnect")

    async def generate(self, obj: GenerateReqInput) -> AsyncIterator[dict[str, Any]]:
        """`prepare` + `run`."""
        prep = await self.prepare(obj)
        async for out in self.run(prep):
            yield out

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
        self.rid_to_state[req.rid] = st
        self._waiting.add(req.rid)
        self._send_sock.send(encode(req))
        return st

    # ================================================================== abort
    def abort_request(self, rid: str = "") -> int:
        """Abort ``rid`` (and its ``n`` copies); ``""`` aborts everything. Returns how many rids."""
        states = [st for st in self.rid_to_state.values() if not rid or st.rid == rid or st.parent_rid == rid]
        for st in states:
            self._abort_state(st, "aborted by request", "user_request")
        return len(states)

    def _abort_state(self, st: ReqState, message: str, label: str) -> None:
        self._send_sock.send(encode(AbortReq(rid=st.rid, message=message)))
        st.abort_label = label
        self._finish(st, {"type": "abort", "message": message, "status_code": 499})
        st.group.event.set()

    def _finish(self, st: ReqState, reason: dict[str, Any]) -> None:
        st.finished = True
        st.finish_reason = reason
        self.rid_to_state.pop(st.rid, None)
        self._waiting.discard(st.rid)
        if st.is_warmup:
            return
        self._completions.append(time.monotonic())
        abort = None
        if reason.get("type") == "abort":
            abort = st.abort_label or str(reason.get("reason") or "scheduler")
        e2e = time.perf_counter() - st.created
        self.metrics.observe_finished(
            e2e, st.prompt_tokens or len(st.req.input_ids), st.completion_tokens, st.cached_tokens, abort
        )
        if self.server_args.log_requests:
            logger.info(
                "finished rid=%s prompt_tokens=%d completion_tokens=%d cached_tokens=%d finish_reason=%s "
                "e2e=%.3fs output=%r",
                st.rid,
                st.prompt_tokens or len(st.req.input_ids),
                st.completion_tokens,
                st.cached_tokens,
                reason,
                e2e,
                st.text()[:200],
            )

    # ================================================================== receive
    async def _recv_loop(self) -> None:
        while True:
            raw = await self._recv_sock.recv()
            try:
                msg = tokenizer_input_decoder.decode(raw)
                if isinstance(msg, BatchStrOut):
                    self._handle_batch_str_out(msg)
                elif isinstance(msg, FlushCacheReqOutput):
                    while self._flush_futures:
                        fut = self._flush_futures.popleft()
                        if not fut.done():
                            fut.set_result(msg)
                            break
                elif isinstance(msg, GetInternalStateReqOutput):
                    if self._state_future is not None and not self._state_future.done():
                        self._state_future.set_result(msg.state)
            except Exception:  # noqa: BLE001 - one bad message must not stop the loop
                logger.exception("failed to handle a message from the detokenizer")

    def _handle_batch_str_out(self, out: BatchStrOut) -> None:
        now = time.perf_counter()
        for i, rid in enumerate(out.rids):
            st = self.rid_to_state.get(rid)
            if st is None:
                continue
            if out.output_strs[i]:
                st.text_parts.append(out.output_strs[i])
            new_ids = out.output_ids[i]
            st.output_ids.extend(new_ids)
            st.prompt_tokens = out.prompt_tokens[i]
            st.completion_tokens = out.completion_tokens[i]
            st.cached_tokens = out.cached_tokens[i]
            if out.output_token_logprobs:
                st.out_logprobs.extend(out.output_token_logprobs[i])
            if out.output_top_logprobs:
                st.out_top.extend(out.output_top_logprobs[i])
            if out.input_token_logprobs and out.input_token_logprobs[i]:
                st.in_logprobs = list(out.input_token_logprobs[i])
                if out.input_top_logprobs:
                    st.in_top = list(out.input_top_logprobs[i])
            if not st.is_warmup:
                if out.queue_times and out.queue_times[i] is not None:
                    self.metrics.observe_queue_time(out.queue_times[i])
                if new_ids:
                    if st.first_token_time == 0.0:
                        st.first_token_time = now
                        self.metrics.observe_first_token(now - st.created)
                        self.metrics.observe_tokens(0.0, len(new_ids) - 1)
                    else:
                        self.metrics.observe_tokens(now - st.last_token_time, len(new_ids))
                    st.last_token_time = now
            self._waiting.discard(rid)
            reason = out.finished_reasons[i]
            if reason is not None:
                self._finish(st, reason)
            st.group.event.set()

    # ================================================================== control requests
    async def flush_cache(self) -> FlushCacheReqOutput:
        self._check_alive()
        fut = asyncio.get_running_loop().create_future()
        self._flush_futures.append(fut)
        self._send_sock.send(encode(FlushCacheReq()))
        return await asyncio.wait_for(fut, _FLUSH_TIMEOUT_S)

    async def get_internal_state(self) -> dict[str, Any]:
        """The scheduler's live state (concurrent callers share one request)."""
        self._check_alive()
        if self._state_future is None or self._state_future.done():
            self._state_future = asyncio.get_running_loop().create_future()
            self._send_sock.send(encode(GetInternalStateReq()))
        return await asyncio.wait_for(asyncio.shield(self._state_future), _STATE_TIMEOUT_S)

    async def render_metrics(self) -> bytes:
        state: dict[str, Any] | None = None
        try:
            state = await self.get_internal_state()
        except (SrtError, asyncio.TimeoutError):
            state = None
        return self.metrics.render(state)

    # ================================================================== chat
    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """The prompt text of ``messages`` (with the generation prompt appended)."""
        if self.tokenizer is None:
            raise RequestError("chat requests need a tokenizer (the server runs with --skip-tokenizer-init)")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise RequestError("this model's tokenizer has no chat template; use /v1/completions")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as e:  # jinja raises on messages the template rejects
            raise RequestError(f"the chat template rejected the messages: {e}", param="messages") from e

    def num_waiting(self) -> int:
        return len(self._waiting)

"""Engine: the offline / embedded API (same processes as the HTTP server, no HTTP).

    from srt import Engine
    with Engine() as llm:                        # the default SmolLM2 model, CPU
        out = llm.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        print(out["text"], out["meta_info"]["finish_reason"])

Threading model: the `TokenizerManager` lives in a private event loop (uvloop when available)
run by a daemon thread. ``generate`` blocks the calling thread on that loop (usable from plain
sync code); ``async_generate`` awaits it from the caller's own event loop (many concurrent calls
under ``asyncio.gather`` are batched together by the scheduler). Cancelling an ``async_generate``
(or closing a stream early) aborts the request.

Outputs are SGLang-shaped dicts (see `srt.managers.tokenizer.req_output`); a batch (list of prompts) or
``n > 1`` returns a list ordered prompt-major. Streams yield chunks as SGLang's Engine does:
each holds the whole output so far (``text``, ``output_ids``, logprobs), or, with
``incremental_streaming_output=True``, only the new part; ``meta_info`` counts are cumulative
either way. ``priority`` needs ``enable_priority_scheduling=True``. Invalid requests raise
`srt.utils.errors.RequestError` (a ``ValueError``); a dead child raises `EngineDeadError`.
``timeout`` (seconds from the call) aborts the request wherever it is once passed: a
non-streaming call raises `RequestTimeoutError`, a stream ends with a chunk whose
``finish_reason`` is ``{"type": "timeout", ...}``. ``meta_info`` carries the phase timings
(`srt.managers.tokenizer.req_output`). With LoRA (``enable_lora``, ``lora_paths``) ``lora_path``
names the adapter of every prompt, or of each (None: the base model); ``load_lora_adapter`` and
``unload_lora_adapter`` change the loaded set at run time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import inspect
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

from srt.entrypoints.launch import launch_subprocesses
from srt.entrypoints.openai.serving_embedding import encode_native
from srt.managers.data_parallel.replies import split_dp_state
from srt.managers.io_struct import LoRAAdapterReqOutput
from srt.managers.tokenizer.generate_fields import check_extra_fields
from srt.managers.tokenizer.generate_input import GenerateReqInput
from srt.managers.tokenizer.tokenizer_manager import TokenizerManager
from srt.server_args import ServerArgs
from srt.utils.errors import ConfigError, EngineDeadError, RequestError, RequestTimeoutError

_Prompt = str | list[str] | None
_Ids = list[int] | list[list[int]] | None
_Params = dict[str, Any] | list[dict[str, Any]] | None
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.new_event_loop()


def engine_server_args(model_path: str | None = None, **kwargs: Any) -> ServerArgs:
    """The `ServerArgs` of ``Engine(model_path, **kwargs)``: every keyword is a `ServerArgs` field
    (the CLI flags' names with underscores). Unknown keywords raise `ConfigError` naming them."""
    unknown = sorted(set(kwargs) - ServerArgs.field_names())
    if unknown:
        raise ConfigError(
            f"unknown Engine argument(s): {', '.join(unknown)} (see srt.server_args.ServerArgs)"
        )
    return ServerArgs(model_path=model_path, **kwargs)


def generate_request(
    prompt: _Prompt = None,
    sampling_params: _Params = None,
    input_ids: _Ids = None,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    stream: bool = False,
    logprob_start_len: int = -1,
    rid: str | list[str] | None = None,
    priority: int | list[int] | None = None,
    timeout: float | None = None,
    lora_path: str | list[str | None] | None = None,
    image_data: Any = None,
    return_text_in_logprobs: bool = False,
    **unsupported: Any,
) -> GenerateReqInput:
    """The `GenerateReqInput` of an ``Engine.generate`` / ``async_generate`` call: SGLang's
    ``Engine.generate`` parameters, written here once (the two methods take exactly these).
    ``lora_path``: a loaded LoRA adapter's name for every prompt, or a list with one entry per
    prompt (None: the base model). ``return_text_in_logprobs``: each logprob entry's third slot
    holds its token's text instead of None. ``image_data``: a prompt's image or images (a URL, data URI,
    base64 string, bytes or a PIL image), or for a batch one entry per prompt (docs/vision.md).
    SGLang's other parameters (``lora_id`` ...) raise `RequestError` naming them unless off
    (`srt.managers.tokenizer.generate_fields`), as do unknown ones."""
    if unsupported:
        params = inspect.signature(generate_request).parameters.values()
        check_extra_fields(unsupported, [p.name for p in params if p.kind is not p.VAR_KEYWORD])
    return GenerateReqInput(
        text=prompt,
        input_ids=input_ids,
        sampling_params=sampling_params,
        rid=rid,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        stream=stream,
        priority=priority,
        timeout=timeout,
        lora_path=lora_path,
        image_data=image_data,
        return_text_in_logprobs=return_text_in_logprobs,
    )


def _with_generate_params(
    build: Callable[_P, GenerateReqInput],
) -> Callable[[Callable[[Any, GenerateReqInput], _R]], Callable[Concatenate[Any, _P], _R]]:
    """Give ``method(self, obj)`` the parameters of ``build`` (`generate_request`): the public
    method takes SGLang's ``generate`` parameters, ``obj = build(...)`` is what it receives.
    The parameter list is written once; `inspect.signature` and type checkers see it."""

    def decorate(method: Callable[[Any, GenerateReqInput], _R]) -> Callable[Concatenate[Any, _P], _R]:
        if inspect.iscoroutinefunction(method):

            async def call(self: Any, *args: _P.args, **kwargs: _P.kwargs) -> Any:
                return await method(self, build(*args, **kwargs))
        else:

            def call(self: Any, *args: _P.args, **kwargs: _P.kwargs) -> Any:
                return method(self, build(*args, **kwargs))

        functools.update_wrapper(call, method)
        params = inspect.signature(build).parameters.values()
        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        call.__signature__ = inspect.signature(method).replace(parameters=[self_param, *params])
        return call

    return decorate


def _lora_reply(out: LoRAAdapterReqOutput, param: str) -> dict[str, Any]:
    """A load / unload reply as a dict; `RequestError` (naming ``param``) when it failed."""
    if not out.success:
        raise RequestError(out.message or "the scheduler refused the LoRA request", param=param)
    return {"success": True, "message": out.message, "loaded_adapters": dict(out.loaded_adapters)}


_END = object()  # what _next_or_end gives once a stream is exhausted


async def _next_or_end(agen: AsyncIterator[dict[str, Any]]) -> Any:
    """The stream's next chunk, or ``_END`` once it is exhausted."""
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return _END


class Engine:
    """Launch the scheduler and detokenizer processes and serve requests in-process.

    ``Engine(model_path=None, **kwargs)``: every keyword is a `ServerArgs` field
    (`engine_server_args`).
    """

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        server_args = engine_server_args(model_path, **kwargs)
        self._closed = False
        self._loop = _new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="srt-engine-loop", daemon=True)
        self._thread.start()
        try:
            self.tokenizer_manager, self.scheduler_info = launch_subprocesses(server_args)
            self._call(self.tokenizer_manager.start())
        except BaseException:
            self._stop_loop()
            raise
        self.server_args: ServerArgs = self.tokenizer_manager.server_args
        self.tokenizer = self.tokenizer_manager.tokenizer

    # ------------------------------------------------------------------ plumbing
    def _call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run ``coro`` on the engine loop and wait for its result in this thread."""
        if self._closed and self._loop.is_closed():
            coro.close()
            raise EngineDeadError("the engine is shut down")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _collect(self, obj: GenerateReqInput) -> dict[str, Any] | list[dict[str, Any]]:
        tm: TokenizerManager = self.tokenizer_manager
        prep = await tm.prepare(obj)
        outs = [out async for out in tm.run(prep)]
        outs.sort(key=lambda o: o["index"])
        for o in outs:
            reason = o["meta_info"]["finish_reason"]
            if reason is not None and reason["type"] == "timeout":
                raise RequestTimeoutError(reason.get("message") or "request timed out")
        if prep.is_batch or len(prep.reqs) > 1:
            return outs
        return outs[0]

    # ------------------------------------------------------------------ generate
    @_with_generate_params(generate_request)
    def generate(
        self, obj: GenerateReqInput
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (a dict) or a list of prompts (a list of dicts);
        ``stream=True`` returns an iterator of chunks (each has ``index``; the output so far, or
        its new part with ``incremental_streaming_output``).
        Parameters: `generate_request`'s."""
        if obj.stream:
            return self._stream_sync(obj)
        return self._call(self._collect(obj))

    def _stream_sync(self, obj: GenerateReqInput) -> Iterator[dict[str, Any]]:
        agen = self.tokenizer_manager.generate(obj)
        try:
            while (chunk := self._call(_next_or_end(agen))) is not _END:
                yield chunk
        finally:
            if not self._loop.is_closed():
                try:
                    self._call(agen.aclose(), timeout=10)
                except (RuntimeError, concurrent.futures.TimeoutError):
                    pass

    @_with_generate_params(generate_request)
    async def async_generate(
        self, obj: GenerateReqInput
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """Awaitable `generate` for the caller's event loop; with ``stream=True`` it returns an
        async iterator of chunks (``async for chunk in await llm.async_generate(..., stream=True)``).
        Parameters: `generate_request`'s."""
        if obj.stream:
            return self._stream_async(obj)
        fut = asyncio.run_coroutine_threadsafe(self._collect(obj), self._loop)
        return await asyncio.wrap_future(fut)

    async def _stream_async(self, obj: GenerateReqInput) -> AsyncIterator[dict[str, Any]]:
        agen = self.tokenizer_manager.generate(obj)
        on_loop = self._loop

        async def call(coro: Coroutine) -> Any:  # run on the engine loop, awaited from the caller's
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, on_loop))

        try:
            while (chunk := await call(_next_or_end(agen))) is not _END:
                yield chunk
        finally:
            if not on_loop.is_closed():
                try:
                    await call(agen.aclose())
                except RuntimeError:  # the generator is still being cancelled: it aborts by itself
                    pass

    # ------------------------------------------------------------------ control
    def encode(
        self,
        prompt: _Prompt = None,
        input_ids: _Ids = None,
        normalize: bool = True,
        dimensions: int | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Embeddings (SGLang's ``Engine.encode``): ``{"embedding": [float], "meta_info"}`` for one
        prompt (text or token ids), a list of them for a list; pooled by the model's pooling,
        truncated to ``dimensions`` and L2-normalised unless ``normalize`` is False."""
        coro = encode_native(self.tokenizer_manager, prompt, input_ids, normalize, dimensions)
        return self._call(coro)

    def get_server_info(self) -> dict[str, Any]:
        """Resolved server args, the scheduler's capacity and its live internal state."""
        state = self._call(self.tokenizer_manager.get_internal_state())
        states, dp_controller = split_dp_state(state)
        return {
            **dataclasses.asdict(self.server_args),
            **self.scheduler_info,
            "internal_states": states,
            **({"dp_controller": dp_controller} if dp_controller is not None else {}),
        }

    def flush_cache(self) -> dict[str, Any]:
        """Drop the prefix cache (only succeeds when no request is running)."""
        out = self._call(self.tokenizer_manager.flush_cache())
        return {"success": out.success, "message": out.message}

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
        """Load the PEFT adapter at ``lora_path`` under ``lora_name`` (``pinned``: never evicted
        from its slot); requests may name it once this returns ``{"success", "message",
        "loaded_adapters": {name: path}}``. `RequestError` when it was not loaded (why)."""
        out = self._call(self.tokenizer_manager.lora_registry.load(lora_name, lora_path, pinned))
        return _lora_reply(out, "lora_path")

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload adapter ``lora_name`` (refused while requests use it); the reply as
        `load_lora_adapter`'s. `RequestError` when it was not unloaded (why)."""
        out = self._call(self.tokenizer_manager.lora_registry.unload(lora_name))
        return _lora_reply(out, "lora_name")

    def abort_request(self, rid: str = "") -> int:
        """Abort request ``rid`` (``""``: every request). Returns the number of rids aborted."""

        async def abort() -> int:
            return self.tokenizer_manager.abort_request(rid)

        return self._call(abort())

    @property
    def child_pids(self) -> dict[str, int | None]:
        return self.tokenizer_manager.launcher.child_pids

    def shutdown(self, graceful_timeout: float | None = None) -> None:
        """Stop the child processes and the event loop (idempotent). With ``graceful_timeout``
        the requests in flight first get that many seconds to finish; the rest (all of them
        without it) are failed with `EngineDeadError`."""
        if self._closed:
            return
        tm = self.tokenizer_manager
        if graceful_timeout and not self._loop.is_closed():

            async def wait_idle(deadline: float) -> None:
                while tm.num_in_flight and self._loop.time() < deadline:
                    await asyncio.sleep(0.05)

            try:
                self._call(wait_idle(self._loop.time() + graceful_timeout), timeout=graceful_timeout + 5)
            except Exception:  # noqa: BLE001 - shut down regardless
                pass
        self._closed = True

        async def close() -> None:
            tm.fail_all(EngineDeadError("the engine was shut down"))
            await tm.close()

        try:
            self._call(close(), timeout=10)
        except Exception:  # noqa: BLE001 - shut down the rest regardless
            pass
        tm.launcher.shutdown()
        self._stop_loop()

    def _stop_loop(self) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

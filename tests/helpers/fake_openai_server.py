"""A tiny OpenAI-compatible (and SGLang-native) streaming server for benchmark tests.

It generates ``max_tokens`` words ``"w0 w1 ..."`` per request, one SSE chunk per token, after
``ttft_s`` seconds and then ``itl_s`` seconds per further token, so that a client's measured
TTFT/ITL/throughput can be checked against known values. Every ``fail_every``-th request (1-based)
answers HTTP 500; ``empty_tokens`` makes the first token chunks of /v1/completions carry empty text
(tokens that decode to nothing yet). ``/generate`` streams incremental text and ids (srt and SGLang with
--incremental-streaming-output), or with ``cumulative_native_text=True`` the output so far (their
default). Runs an aiohttp app on a free loopback port in a daemon thread::

    with FakeOpenAIServer(ttft_s=0.05, itl_s=0.01) as srv:
        ...  # srv.base_url, srv.requests (the JSON bodies received), srv.flush_count
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Any

from aiohttp import web


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeOpenAIServer:
    def __init__(
        self,
        ttft_s: float = 0.02,
        itl_s: float = 0.005,
        fail_every: int = 0,
        cumulative_native_text: bool = False,
        model: str = "fake-model",
        empty_tokens: int = 0,
    ) -> None:
        self.empty_tokens = empty_tokens  # /v1/completions: the first N token chunks carry text ""
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.fail_every = fail_every
        self.cumulative_native_text = cumulative_native_text
        self.model = model
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.requests: list[dict[str, Any]] = []
        self.flush_count = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    # ---------------- lifecycle ----------------
    def __enter__(self) -> FakeOpenAIServer:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._thread is not None
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)  # type: ignore[union-attr]
        fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/flush_cache", self._flush)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._started.set()
        self._loop.run_forever()

    # ---------------- handlers ----------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _flush(self, request: web.Request) -> web.Response:
        self.flush_count += 1
        return web.Response(text="flushed")

    async def _admit(self, request: web.Request) -> tuple[dict[str, Any], web.Response | None]:
        body = await request.json()
        self.requests.append(body)
        if self.fail_every and len(self.requests) % self.fail_every == 0:
            return body, web.json_response({"error": {"message": "injected failure"}}, status=500)
        return body, None

    async def _stream(self, request: web.Request, n: int, make_chunk) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await asyncio.sleep(self.ttft_s if i == 0 else self.itl_s)
            await resp.write(f"data: {json.dumps(make_chunk(i))}\n\n".encode())
        final = make_chunk(None)
        if final is not None:
            await resp.write(f"data: {json.dumps(final)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _prompt_len(prompt: Any) -> int:
        if isinstance(prompt, list):
            return len(prompt)
        return len(str(prompt).split())

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body, err = await self._admit(request)
        if err is not None:
            return err
        n = int(body["sampling_params"]["max_new_tokens"])
        plen = self._prompt_len(body.get("input_ids") or body.get("text", ""))

        def chunk(i: int | None) -> dict[str, Any] | None:
            if i is None:
                return None
            if self.cumulative_native_text:
                text, ids = "".join(f"w{j} " for j in range(i + 1)), list(range(i + 1))
            else:
                text, ids = f"w{i} ", [i]
            meta = {"prompt_tokens": plen, "completion_tokens": i + 1, "cached_tokens": 0}
            if i == n - 1:
                meta["finish_reason"] = {"type": "length", "length": n}
            return {"text": text, "output_ids": ids, "meta_info": meta}

        return await self._stream(request, n, chunk)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body, err = await self._admit(request)
        if err is not None:
            return err
        n = int(body["max_tokens"])
        plen = self._prompt_len(body["prompt"])

        def chunk(i: int | None) -> dict[str, Any]:
            if i is None:
                usage = {"prompt_tokens": plen, "completion_tokens": n, "total_tokens": plen + n}
                return {"object": "text_completion", "choices": [], "usage": usage}
            text = "" if i < self.empty_tokens else f"w{i} "
            return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}

        return await self._stream(request, n, chunk)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body, err = await self._admit(request)
        if err is not None:
            return err
        n = int(body["max_tokens"])
        plen = self._prompt_len(body["messages"][0]["content"])

        def chunk(i: int | None) -> dict[str, Any]:
            if i is None:
                usage = {"prompt_tokens": plen, "completion_tokens": n, "total_tokens": plen + n}
                return {"object": "chat.completion.chunk", "choices": [], "usage": usage}
            delta = {"content": f"w{i} "}
            return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}

        return await self._stream(request, n, chunk)

"""Batch tokenization of requests that arrive together.

`TokenizeBatcher.encode` queues texts and schedules one flush with ``loop.call_soon``: every
request that reaches the tokenizer in the same event-loop iteration (a burst of HTTP requests, a
batch from the Engine) is encoded by one ``tokenizer(texts)`` call. Batches of at most
``_INLINE_MAX_CHARS`` characters are encoded inline; larger ones in a worker thread so the event
loop keeps serving streams.
"""

from __future__ import annotations

import asyncio
from typing import Any

_INLINE_MAX_CHARS = 32_768


class TokenizeBatcher:
    def __init__(self, tokenizer: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.tokenizer = tokenizer
        self.loop = loop
        self._pending: list[tuple[list[str], bool, asyncio.Future]] = []
        self._scheduled = False
        self.num_calls = 0  # tokenizer calls made (observable batching)

    def encode(self, texts: list[str], add_special_tokens: bool) -> asyncio.Future:
        """A future of the token ids of ``texts`` (one list per text)."""
        fut = self.loop.create_future()
        self._pending.append((texts, add_special_tokens, fut))
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        batch, self._pending, self._scheduled = self._pending, [], False
        for flag in (True, False):
            items = [p for p in batch if p[1] == flag]
            if not items:
                continue
            texts = [t for p in items for t in p[0]]
            if sum(len(t) for t in texts) <= _INLINE_MAX_CHARS:
                try:
                    self._deliver(items, self._encode(texts, flag))
                except Exception as e:  # noqa: BLE001
                    self._fail(items, e)
            else:
                self.loop.create_task(self._encode_in_thread(items, texts, flag))

    async def _encode_in_thread(self, items: list, texts: list[str], flag: bool) -> None:
        try:
            ids = await self.loop.run_in_executor(None, self._encode, texts, flag)
        except Exception as e:  # noqa: BLE001
            self._fail(items, e)
        else:
            self._deliver(items, ids)

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        self.num_calls += 1
        return self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]

    @staticmethod
    def _deliver(items: list, ids: list[list[int]]) -> None:
        k = 0
        for texts, _, fut in items:
            if not fut.done():
                fut.set_result([list(x) for x in ids[k : k + len(texts)]])
            k += len(texts)

    @staticmethod
    def _fail(items: list, exc: Exception) -> None:
        for _, _, fut in items:
            if not fut.done():
                fut.set_exception(exc)

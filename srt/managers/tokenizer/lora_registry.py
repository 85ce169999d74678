"""The LoRA adapters requests may name, as the main process knows them (`LoRARegistry`).

    name -> path    seeded from ``--lora-paths`` (the scheduler loads them at start-up, or the
                    server does not start), then replaced by each load/unload reply's
                    ``loaded_adapters`` (the scheduler's list is the truth)

A request names an adapter by its name: /generate's and ``Engine.generate``'s ``lora_path`` (one
name for all prompts, or one entry per prompt, None = the base model), OpenAI's ``model``
(``"<served>:<adapter>"``, SGLang's syntax, or ``"<adapter>"``, vLLM's; `select`) or its
``lora_path`` field. `check` refuses a name before anything is sent (`RequestError`: LoRA needs
--enable-lora; an unknown name, listing the loaded ones); the scheduler aborts with 400 any request
whose adapter was unloaded meanwhile.

`load` and `unload` (POST /load_lora_adapter, /unload_lora_adapter, ``Engine``'s methods) run one
at a time: each waits for its reply (a ``LoRAAdapterReqOutput``) before the next is sent, so that
replies match requests and the registry follows the scheduler. A load of a loaded name is refused
here; an unload first drops the name (new requests naming it get 400), and the reply (or a failed
send) puts it back when the scheduler refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Iterable
from typing import Any

from srt.configs.lora_args import parse_lora_path
from srt.managers.io_struct import LoadLoRAAdapterReq, LoRAAdapterReqOutput, UnloadLoRAAdapterReq
from srt.utils.errors import RequestError

# sends a load/unload request to the scheduler and waits for its reply
SendLoRAReq = Callable[[LoadLoRAAdapterReq | UnloadLoRAAdapterReq], Awaitable[LoRAAdapterReqOutput]]


class LoRARegistry:
    """name -> path of the loaded adapters, the checks of requests naming them, and the load and
    unload requests (``send``: `TokenizerIPC.lora_adapter`; ``check_alive`` raises when the
    engine died)."""

    def __init__(
        self,
        enabled: bool = False,
        lora_paths: Iterable[Any] | None = None,
        send: SendLoRAReq | None = None,
        check_alive: Callable[[], None] | None = None,
    ) -> None:
        self.enabled = enabled  # --enable-lora
        refs = [parse_lora_path(item) for item in lora_paths or []]
        self.adapters: dict[str, str] = {r["lora_name"]: r["lora_path"] for r in refs}
        self._send = send
        self._check_alive = check_alive
        self._lock = asyncio.Lock()  # one load or unload at a time

    # ------------------------------------------------------------------ requests naming adapters
    def check(self, name: Any, param: str = "lora_path") -> None:
        """`RequestError` unless ``name`` is None (the base model) or a loaded adapter's name."""
        if name is None:
            return
        if not self.enabled:
            raise RequestError(
                f"{param}: LoRA adapters need a server started with --enable-lora (or --lora-paths); "
                "this one serves the base model only",
                param=param,
            )
        if not isinstance(name, str) or name not in self.adapters:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise RequestError(
                f"{param}: unknown LoRA adapter {name!r}; loaded adapters: {loaded}",
                param=param,
                code="lora_not_found",
            )

    def check_all(self, names: Iterable[Any], param: str = "lora_path") -> None:
        """`check` each of ``names`` (one per prompt)."""
        for name in names:
            self.check(name, param)

    def select(self, model: str | None, served: Collection[str]) -> tuple[bool, str | None]:
        """``(served, adapter)`` of an OpenAI ``model``: None or a served name -> the base model;
        a loaded adapter's name (vLLM's way) -> that adapter; ``"<served>:<adapter>"`` (SGLang's)
        -> ``adapter`` (not checked here: `check` it; an empty one is the base model); anything
        else is not served (a 404)."""
        if model is None or model in served:
            return True, None
        if model in self.adapters:
            return True, model
        base, sep, adapter = model.partition(":")
        if sep and base.strip() in served:
            return True, adapter.strip() or None
        return False, None

    # ------------------------------------------------------------------ load / unload
    async def load(self, lora_name: str, lora_path: str, pinned: bool = False) -> LoRAAdapterReqOutput:
        """Load the PEFT adapter at ``lora_path`` under ``lora_name``; the scheduler's reply
        (``success`` False: why not). `RequestError` before sending: LoRA off, an empty name or
        path, a name already loaded."""
        self._require_enabled()
        name = _nonempty(lora_name, "lora_name").strip()
        path = _nonempty(lora_path, "lora_path")
        async with self._lock:
            if name in self.adapters:
                raise RequestError(
                    f"lora_name: the adapter {name!r} is already loaded (from {self.adapters[name]}); "
                    "unload it first",
                    param="lora_name",
                    code="lora_already_loaded",
                )
            out = await self._request(LoadLoRAAdapterReq(lora_name=name, lora_path=path, pinned=pinned))
            self.adapters = dict(out.loaded_adapters)
            return out

    async def unload(self, lora_name: str) -> LoRAAdapterReqOutput:
        """Unload adapter ``lora_name``: new requests naming it are refused at once; the scheduler
        refuses while requests use it (its reply says so, and the name is kept)."""
        self._require_enabled()
        name = _nonempty(lora_name, "lora_name").strip()
        async with self._lock:
            self.check(name, "lora_name")
            path = self.adapters.pop(name)
            try:
                out = await self._request(UnloadLoRAAdapterReq(lora_name=name))
            except BaseException:
                self.adapters[name] = path
                raise
            self.adapters = dict(out.loaded_adapters)
            return out

    async def _request(self, req: LoadLoRAAdapterReq | UnloadLoRAAdapterReq) -> LoRAAdapterReqOutput:
        if self._check_alive is not None:
            self._check_alive()
        assert self._send is not None, "a registry without a scheduler link cannot load adapters"
        return await self._send(req)

    def _require_enabled(self) -> None:
        if not self.enabled:
            raise RequestError(
                "loading and unloading LoRA adapters needs a server started with --enable-lora",
                param="lora_name",
            )


def _nonempty(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise RequestError(f"{param} must be a non-empty string, got {value!r}", param=param)
    return value

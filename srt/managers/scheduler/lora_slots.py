"""The scheduler's LoRA part: which adapter holds which slot, who uses it, loads and unloads.

``LoRASlots`` owns the ``--max-loras-per-batch`` slots. A request running an adapter is admitted
only once ``acquire`` gave its adapter a slot (the adapter's slot if it has one, else an empty
one, else the least recently used slot no admitted request uses and no pin holds: the runner's
``LoRAManager.activate`` then puts the adapter there); ``release`` (finish, abort, retraction)
gives the use back. When no slot can be had the prefill part stops admitting for the step, so
the requests behind it wait their turn rather than overtake it (no starvation: the running
requests finish and free their slots).

Loads and unloads (``LoadLoRAAdapterReq`` / ``UnloadLoRAAdapterReq``):
    load    an idle scheduler (or one tensor-parallel rank of several: the ranks must agree at
            every step) reads the adapter at once; a busy one reads it on a thread beside the
            forwards and adds it at the first step after it is read (``poll``), then replies;
            a pinned load that would leave no slot unpinned is refused (as at start-up)
    unload  refused while requests use the adapter (queued, running or held), with the count;
            else the adapter leaves its slot, the runner and the prefix cache (its KV namespace)
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from srt.managers.io_struct import LoadLoRAAdapterReq, LoRAAdapterReqOutput, UnloadLoRAAdapterReq
from srt.utils.errors import LoRAError

if TYPE_CHECKING:
    from srt.lora.manager import LoRAManager
    from srt.managers.scheduler.req import Req

logger = logging.getLogger("srt.scheduler")


class LoRASlots:
    """See the module docstring. ``runner``: the model runner's ``LoRAManager``."""

    def __init__(self, runner: LoRAManager, num_slots: int, pinned: set[str], sync_loads: bool) -> None:
        self.runner = runner
        self.slots: list[str | None] = [None] * num_slots
        self.refs: dict[str, int] = {}  # adapter -> admitted requests using it
        self.pinned = set(pinned)
        self.sync_loads = sync_loads
        self._last_use = [0] * num_slots
        self._clock = itertools.count(1)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[tuple[LoadLoRAAdapterReq, Future]] = []
        for name in sorted(self.pinned):
            self._place(name, self.slots.index(None))

    @classmethod
    def create(cls, server_args: Any, runner: LoRAManager | None) -> LoRASlots | None:
        if runner is None:
            return None
        pinned = {r["lora_name"] for r in server_args.lora_paths if r.get("pinned")}
        return cls(runner, server_args.max_loras_per_batch, pinned, sync_loads=server_args.tp_size > 1)

    def is_loaded(self, name: str) -> bool:
        return name in self.runner.adapters

    # ------------------------------------------------------------------ admission
    def acquire(self, req: Req) -> bool:
        """Give ``req``'s adapter a slot (and count the use); False when none can be had now."""
        name = req.lora_name
        if not name:
            return True
        slot = self._slot_of(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            self._place(name, slot)
        self.refs[name] = self.refs.get(name, 0) + 1
        self._last_use[slot] = next(self._clock)
        req.lora_slot = slot
        return True

    def release(self, req: Req) -> None:
        """``req`` no longer runs (finished, aborted, retracted, or not admitted after all)."""
        if req.lora_slot < 0:
            return
        self.refs[req.lora_name] -= 1
        req.lora_slot = -1

    def _slot_of(self, name: str) -> int | None:
        return self.slots.index(name) if name in self.slots else None

    def _free_slot(self) -> int | None:
        if None in self.slots:
            return self.slots.index(None)
        idle = [
            i
            for i, n in enumerate(self.slots)
            if n is not None and not self.refs.get(n) and n not in self.pinned
        ]
        return min(idle, key=self._last_use.__getitem__) if idle else None

    def _place(self, name: str, slot: int) -> None:
        self.runner.activate(slot, name)
        self.slots[slot] = name

    # ------------------------------------------------------------------ loads and unloads
    def load(self, msg: LoadLoRAAdapterReq, idle: bool) -> list[LoRAAdapterReqOutput]:
        """Start a load; its reply now (idle or tensor-parallel) or from a later ``poll``."""
        if self.is_loaded(msg.lora_name) or any(m.lora_name == msg.lora_name for m, _ in self._pending):
            return [self._reply(False, f"a LoRA adapter named {msg.lora_name!r} is loaded already")]
        pinned = len(self.pinned) + sum(m.pinned for m, _ in self._pending)
        if msg.pinned and pinned + 1 >= len(self.slots):
            # as at start-up (lora_args.py): every slot pinned would starve the other adapters, and
            # the requests queued behind theirs
            return [
                self._reply(
                    False,
                    f"LoRA adapter {msg.lora_name!r} cannot be pinned: {pinned} of the {len(self.slots)} "
                    "--max-loras-per-batch slots are pinned, and one must stay free for the other adapters",
                )
            ]
        if idle or self.sync_loads:
            try:
                adapter = self.runner.build(msg.lora_name, msg.lora_path)
            except (LoRAError, OSError, ValueError) as e:
                return [self._reply(False, str(e))]
            return [self._finish_load(msg, adapter)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self._pending.append((msg, self._pool.submit(self.runner.build, msg.lora_name, msg.lora_path)))
        return []

    @property
    def loading(self) -> bool:
        return bool(self._pending)

    def poll(self) -> list[LoRAAdapterReqOutput]:
        """The replies of the loads that finished reading since the last call."""
        replies = []
        while self._pending and self._pending[0][1].done():
            msg, future = self._pending.pop(0)
            error = future.exception()
            if error is not None:
                replies.append(self._reply(False, str(error)))
            else:
                replies.append(self._finish_load(msg, future.result()))
        return replies

    def _finish_load(self, msg: LoadLoRAAdapterReq, adapter) -> LoRAAdapterReqOutput:
        try:
            self.runner.add(adapter)
        except LoRAError as e:
            return self._reply(False, str(e))
        if msg.pinned:
            self.pinned.add(msg.lora_name)
        return self._reply(True, f"LoRA adapter {msg.lora_name!r} loaded from {msg.lora_path}")

    def unload(self, msg: UnloadLoRAAdapterReq, users: int, tree_cache: Any) -> LoRAAdapterReqOutput:
        """Unload, unless ``users`` requests still run or wait with the adapter."""
        name = msg.lora_name
        if not self.is_loaded(name):
            return self._reply(False, f"no LoRA adapter named {name!r} is loaded")
        if users:
            return self._reply(
                False, f"LoRA adapter {name!r} is used by {users} requests; retry once they finish"
            )
        tree_cache.drop_namespace(name)  # first: it refuses (raises) while a request holds its KV
        slot = self._slot_of(name)
        if slot is not None:
            self.slots[slot] = None
        self.pinned.discard(name)
        self.refs.pop(name, None)
        self.runner.unload(name)
        return self._reply(True, f"LoRA adapter {name!r} unloaded")

    def _reply(self, success: bool, message: str) -> LoRAAdapterReqOutput:
        (logger.info if success else logger.warning)("%s", message)
        return LoRAAdapterReqOutput(success=success, message=message, loaded_adapters=self.runner.loaded)

    def state(self) -> dict[str, Any]:
        """For /get_server_info: slots and uses."""
        return {"lora_slots": list(self.slots), "lora_refs": {k: v for k, v in self.refs.items() if v}}

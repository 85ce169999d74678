"""srt/managers/scheduler/lora_slots.py: ``LoRASlots`` over a fake runner (the ``LoRAManager`` calls
it makes): slot acquire / release, LRU reuse of idle slots, pinned and in-use slots kept, loads
(at once when idle, on a thread when busy, replied by ``poll``) and unloads."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from srt.managers.io_struct import LoadLoRAAdapterReq, LoRAAdapterReqOutput, UnloadLoRAAdapterReq
from srt.managers.scheduler.lora_slots import LoRASlots
from srt.utils.errors import LoRAError


class FakeRunner:
    """The LoRAManager surface LoRASlots uses. ``build`` fails for paths under /bad and waits on
    ``gate`` when one is set (a slow read)."""

    def __init__(self, names: tuple[str, ...] = ()) -> None:
        self.adapters: dict[str, SimpleNamespace] = {}
        self.activated: list[tuple[int, str]] = []
        self.unloaded: list[str] = []
        self.built_on: list[str] = []
        self.gate: threading.Event | None = None
        for n in names:
            self.add(SimpleNamespace(name=n, path=f"/p/{n}"))

    def build(self, name: str, path: str) -> SimpleNamespace:
        self.built_on.append(threading.current_thread().name)
        if self.gate is not None:
            assert self.gate.wait(10)
        if path.startswith("/bad"):
            raise LoRAError(f"{path}: no adapter_config.json")
        return SimpleNamespace(name=name, path=path)

    def add(self, adapter) -> None:
        if adapter.name in self.adapters:
            raise LoRAError(f"a LoRA adapter named {adapter.name!r} is loaded already")
        self.adapters[adapter.name] = adapter

    def activate(self, slot: int, name: str) -> None:
        assert name in self.adapters
        self.activated.append((slot, name))

    def unload(self, name: str) -> None:
        del self.adapters[name]
        self.unloaded.append(name)

    @property
    def loaded(self) -> dict[str, str]:
        return {n: a.path for n, a in self.adapters.items()}


class FakeTree:
    def __init__(self) -> None:
        self.dropped: list[str] = []

    def drop_namespace(self, namespace: str) -> int:
        self.dropped.append(namespace)
        return 0


@dataclass
class FakeReq:
    lora_name: str
    lora_slot: int = -1


def make(num_slots: int, names=("a", "b", "c", "d"), pinned=(), sync_loads=False):
    runner = FakeRunner(tuple(names))
    return LoRASlots(runner, num_slots, set(pinned), sync_loads), runner


# ---------------------------------------------------------------- admission


def _poll_until(slots, n: int) -> list[LoRAAdapterReqOutput]:
    """The replies of ``slots.poll()`` until ``n`` came (or 5 s passed)."""
    replies: list[LoRAAdapterReqOutput] = []
    for _ in range(500):
        replies += slots.poll()
        if len(replies) >= n:
            break
        threading.Event().wait(0.01)
    return replies


def test_acquire_places_the_adapter_in_a_free_slot_once():
    slots, runner = make(3)
    r1, r2, r3 = FakeReq("a"), FakeReq("a"), FakeReq("b")
    assert slots.acquire(r1) and slots.acquire(r2) and slots.acquire(r3)
    assert r1.lora_slot == r2.lora_slot == 0 and r3.lora_slot == 1
    assert runner.activated == [(0, "a"), (1, "b")]  # a second user does not activate again
    assert slots.slots == ["a", "b", None]
    assert slots.refs == {"a": 2, "b": 1}
    assert slots.state() == {"lora_slots": ["a", "b", None], "lora_refs": {"a": 2, "b": 1}}


def test_base_requests_always_acquire_without_a_slot():
    slots, runner = make(1)
    assert slots.acquire(FakeReq("a"))
    for _ in range(3):  # the only slot is in use: the base model still runs
        base = FakeReq("")
        assert slots.acquire(base) and base.lora_slot == -1
        slots.release(base)
    assert runner.activated == [(0, "a")] and slots.refs == {"a": 1}


def test_lru_idle_slot_is_reused():
    slots, runner = make(2)
    ra, rb = FakeReq("a"), FakeReq("b")
    slots.acquire(ra)
    slots.acquire(rb)
    slots.release(ra)
    slots.release(rb)
    again = FakeReq("a")  # a is used again: b is now the least recently used
    assert slots.acquire(again) and again.lora_slot == 0
    slots.release(again)
    rc = FakeReq("c")
    assert slots.acquire(rc) and rc.lora_slot == 1
    assert slots.slots == ["a", "c"] and runner.activated[-1] == (1, "c")
    rd = FakeReq("d")  # c is in use, a idle: a's slot goes
    assert slots.acquire(rd) and rd.lora_slot == 0
    assert slots.slots == ["d", "c"]


def test_in_use_slots_are_never_evicted():
    slots, runner = make(2)
    ra, rb = FakeReq("a"), FakeReq("b")
    assert slots.acquire(ra) and slots.acquire(rb)
    rc = FakeReq("c")
    assert not slots.acquire(rc)
    assert rc.lora_slot == -1 and "c" not in slots.refs and slots.slots == ["a", "b"]
    assert len(runner.activated) == 2
    slots.release(rb)  # b is idle now: c takes its slot
    assert slots.acquire(rc) and rc.lora_slot == 1 and slots.slots == ["a", "c"]


def test_pinned_slots_are_never_evicted():
    slots, runner = make(2, pinned={"a"})
    assert runner.activated == [(0, "a")]  # a pinned adapter takes its slot at start
    rb = FakeReq("b")
    assert slots.acquire(rb) and rb.lora_slot == 1
    slots.release(rb)
    rc = FakeReq("c")  # a is idle but pinned: b's slot is the one reused
    assert slots.acquire(rc) and rc.lora_slot == 1 and slots.slots == ["a", "c"]
    rd = FakeReq("d")  # c in use, a pinned: nothing to be had
    assert not slots.acquire(rd) and rd.lora_slot == -1
    ra = FakeReq("a")
    assert slots.acquire(ra) and ra.lora_slot == 0


def test_release_is_idempotent():
    slots, _ = make(2)
    r1, r2 = FakeReq("a"), FakeReq("a")
    slots.acquire(r1)
    slots.acquire(r2)
    slots.release(r1)
    slots.release(r1)  # a second release (e.g. abort after finish) gives nothing back twice
    assert r1.lora_slot == -1 and slots.refs["a"] == 1
    never = FakeReq("a")  # never admitted
    slots.release(never)
    assert slots.refs["a"] == 1
    slots.release(r2)
    assert slots.refs["a"] == 0 and slots.state()["lora_refs"] == {}


# ---------------------------------------------------------------- loads
def test_load_when_idle_replies_at_once():
    slots, runner = make(2, names=())
    out = slots.load(LoadLoRAAdapterReq(lora_name="x", lora_path="/p/x"), idle=True)
    assert len(out) == 1 and isinstance(out[0], LoRAAdapterReqOutput)
    assert out[0].success and out[0].loaded_adapters == {"x": "/p/x"}
    assert runner.built_on == [threading.current_thread().name]
    assert slots.is_loaded("x") and not slots.loading
    bad = slots.load(LoadLoRAAdapterReq(lora_name="y", lora_path="/bad/y"), idle=True)
    assert not bad[0].success and "adapter_config.json" in bad[0].message
    assert bad[0].loaded_adapters == {"x": "/p/x"} and not slots.is_loaded("y")


def test_tensor_parallel_loads_run_at_once_even_when_busy():
    slots, runner = make(2, names=(), sync_loads=True)
    out = slots.load(LoadLoRAAdapterReq(lora_name="x", lora_path="/p/x"), idle=False)
    assert out and out[0].success and not slots.loading
    assert runner.built_on == [threading.current_thread().name]


def test_load_when_busy_runs_on_a_thread_and_poll_replies():
    slots, runner = make(2, names=())
    runner.gate = threading.Event()
    assert slots.load(LoadLoRAAdapterReq(lora_name="x", lora_path="/p/x"), idle=False) == []
    assert slots.load(LoadLoRAAdapterReq(lora_name="y", lora_path="/bad/y"), idle=False) == []
    assert slots.loading and slots.poll() == []  # still reading
    assert not slots.is_loaded("x")
    runner.gate.set()
    replies = _poll_until(slots, 2)
    assert [r.success for r in replies] == [True, False]  # in the order asked
    assert "adapter_config.json" in replies[1].message
    assert slots.is_loaded("x") and not slots.loading
    assert runner.built_on and all(name.startswith("lora-load") for name in runner.built_on)


def test_duplicate_load_is_refused_loaded_or_pending():
    slots, runner = make(2, names=("a",))
    out = slots.load(LoadLoRAAdapterReq(lora_name="a", lora_path="/p/other"), idle=True)
    assert not out[0].success and "loaded already" in out[0].message
    assert runner.adapters["a"].path == "/p/a"
    runner.gate = threading.Event()
    assert slots.load(LoadLoRAAdapterReq(lora_name="x", lora_path="/p/x"), idle=False) == []
    dup = slots.load(LoadLoRAAdapterReq(lora_name="x", lora_path="/p/x2"), idle=True)
    assert not dup[0].success and "loaded already" in dup[0].message
    runner.gate.set()
    for _ in range(500):
        if replies := slots.poll():
            break
        threading.Event().wait(0.01)
    assert replies[0].success and runner.adapters["x"].path == "/p/x"


def test_pinned_load_is_kept_in_its_slot():
    slots, _ = make(2, names=("b", "c"))
    assert slots.load(LoadLoRAAdapterReq(lora_name="x", lora_path="/p/x", pinned=True), idle=True)[0].success
    assert slots.pinned == {"x"}
    for name, slot in (("x", 0), ("b", 1)):
        req = FakeReq(name)
        assert slots.acquire(req) and req.lora_slot == slot
        slots.release(req)
    rc = FakeReq("c")  # x is the least recently used idle slot, but pinned: b's slot goes
    assert slots.acquire(rc) and rc.lora_slot == 1 and slots.slots == ["x", "c"]


def test_pinned_loads_leave_a_slot_for_the_others():
    """Pinning every slot would starve every other adapter (and, since a request that finds no slot
    holds the queue, the base model's requests behind it): refused, as at start-up."""
    slots, _ = make(2, names=("b",))
    assert slots.load(LoadLoRAAdapterReq(lora_name="x", lora_path="/p/x", pinned=True), idle=True)[0].success
    out = slots.load(LoadLoRAAdapterReq(lora_name="y", lora_path="/p/y", pinned=True), idle=True)
    assert not out[0].success and "pinned" in out[0].message
    assert not slots.is_loaded("y")
    for name in ("x", "b"):  # the pinned one and another adapter can both run
        assert slots.acquire(FakeReq(name))
    # loads still reading count too
    slots, runner = make(3, names=())
    runner.gate = threading.Event()
    assert slots.load(LoadLoRAAdapterReq(lora_name="x", lora_path="/p/x", pinned=True), idle=False) == []
    assert slots.load(LoadLoRAAdapterReq(lora_name="y", lora_path="/p/y", pinned=True), idle=False) == []
    out = slots.load(LoadLoRAAdapterReq(lora_name="z", lora_path="/p/z", pinned=True), idle=False)
    assert not out[0].success and "2 of the 3" in out[0].message
    runner.gate.set()
    replies = _poll_until(slots, 2)
    assert [r.success for r in replies] == [True, True] and slots.pinned == {"x", "y"}


# ---------------------------------------------------------------- unloads
def test_unload_refused_while_used_with_the_count():
    slots, runner = make(2)
    tree = FakeTree()
    out = slots.unload(UnloadLoRAAdapterReq(lora_name="a"), users=3, tree_cache=tree)
    assert not out.success and "3 requests" in out.message
    assert slots.is_loaded("a") and tree.dropped == [] and runner.unloaded == []
    missing = slots.unload(UnloadLoRAAdapterReq(lora_name="zz"), users=0, tree_cache=tree)
    assert not missing.success and "zz" in missing.message


def test_unload_frees_the_slot_and_drops_the_namespace():
    slots, runner = make(2, pinned={"a"})
    rb = FakeReq("b")
    slots.acquire(rb)
    slots.release(rb)
    tree = FakeTree()
    out = slots.unload(UnloadLoRAAdapterReq(lora_name="a"), users=0, tree_cache=tree)
    assert out.success and "a" not in out.loaded_adapters
    assert slots.slots == [None, "b"] and "a" not in slots.pinned
    assert runner.unloaded == ["a"] and tree.dropped == ["a"]
    rc, rd = FakeReq("c"), FakeReq("d")
    assert slots.acquire(rc) and rc.lora_slot == 0  # the freed slot
    assert slots.acquire(rd) and rd.lora_slot == 1  # b idle, no longer behind a pin
    # an adapter without a slot unloads too
    out = slots.unload(UnloadLoRAAdapterReq(lora_name="b"), users=0, tree_cache=tree)
    assert out.success and tree.dropped == ["a", "b"] and slots.slots == ["c", "d"]


def test_create_reads_pinned_and_tp_from_server_args():
    runner = FakeRunner(("a", "b"))
    args = SimpleNamespace(
        lora_paths=[
            {"lora_name": "a", "lora_path": "/p/a", "pinned": True},
            {"lora_name": "b", "lora_path": "/p/b"},
        ],
        max_loras_per_batch=3,
        tp_size=2,
    )
    slots = LoRASlots.create(args, runner)
    assert slots.pinned == {"a"} and slots.slots == ["a", None, None] and slots.sync_loads
    assert LoRASlots.create(args, None) is None


@pytest.mark.parametrize("num_slots", [1, 3])
def test_random_admissions_keep_slots_and_refs_consistent(num_slots: int):
    import random

    rng = random.Random(num_slots)
    slots, runner = make(num_slots)
    running: list[FakeReq] = []
    for _ in range(400):
        if running and rng.random() < 0.45:
            slots.release(running.pop(rng.randrange(len(running))))
        else:
            req = FakeReq(rng.choice(["", "a", "b", "c", "d"]))
            if slots.acquire(req):
                running.append(req)
                if req.lora_name:
                    assert slots.slots[req.lora_slot] == req.lora_name
            else:  # refused only when every slot is used by a running request
                assert all(any(r.lora_name == n for r in running) for n in slots.slots)
        for r in running:  # no running request's adapter lost its slot
            if r.lora_name:
                assert slots.slots[r.lora_slot] == r.lora_name
        users = {n: sum(r.lora_name == n for r in running) for n in "abcd"}
        assert {k: v for k, v in slots.refs.items() if v} == {k: v for k, v in users.items() if v}
        # the runner's last activation of each slot is the adapter the slot holds
        last = {s: n for s, n in runner.activated}
        assert all(last.get(i) == n for i, n in enumerate(slots.slots) if n is not None)

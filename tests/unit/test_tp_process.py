"""The tensor-parallel scheduler loop (srt/managers/scheduler/tp_process.py) driven by fakes, and
the rendezvous / failure helpers of srt/distributed/init.py (a real TCPStore, no model).

Lock step: rank 0 drains its socket and broadcasts the raw messages; every rank handles the same
list in the same order and steps; only rank 0 sends. Idle rank 0 waits at most HEARTBEAT_S and
broadcasts an empty list (the heartbeat)."""

from __future__ import annotations

import threading
import time

import pytest

from srt.distributed.init import GroupLostError, is_group_failure, rendezvous, wait_for_ranks
from srt.distributed.shm_comm import supported as shm_supported
from srt.entrypoints.worker_node import wait_for_local_ranks
from srt.managers.io_struct import AbortReq, FlushCacheReq, GetInternalStateReq, encode
from srt.managers.scheduler.tp_process import HEARTBEAT_S, tp_iteration
from srt.utils.errors import LaunchError
from srt.utils.process import ProcessSupervisor
from tests.helpers.child_targets import ready_then_exit, ready_then_wait
from tests.helpers.server import free_port
from tests.helpers.shm_peer import all_reduce_after_peer_exit
from tests.helpers.tp_worker import run_ranks


class FakeScheduler:
    """An abort gives 2 steps of work; a state request is answered at once."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.handled: list[object] = []
        self.work = 0
        self.steps = 0
        self.step_clock: float | None = None
        self.clocks: list[float | None] = []

    def is_idle(self) -> bool:
        return self.work == 0

    def handle_message(self, msg):
        self.clocks.append(self.step_clock)
        self.handled.append(msg)
        if isinstance(msg, AbortReq):
            self.work += 2
        if isinstance(msg, GetInternalStateReq):
            return [("state", self.rank)]
        return []

    def step(self):
        self.work -= 1
        self.steps += 1
        return [("out", self.rank, self.steps)]

    def take_replies(self):
        return []


class Leader:
    rank = 0

    def __init__(self) -> None:
        self.broadcasts: list[list[bytes]] = []

    def broadcast_messages(self, messages):
        assert messages is not None
        self.broadcasts.append(list(messages))
        return messages


class Follower:
    rank = 1

    def __init__(self, leader: Leader) -> None:
        self.leader = leader
        self.n = 0

    def broadcast_messages(self, messages):
        assert messages is None  # ranks > 0 contribute nothing
        out = self.leader.broadcasts[self.n]
        self.n += 1
        return list(out)


class Inbox:
    def __init__(self, batches: list[list[bytes]]) -> None:
        self.batches = batches
        self.timeouts: list[float | None] = []

    def __call__(self, timeout):
        self.timeouts.append(timeout)
        return self.batches.pop(0) if self.batches else []


def run(batches: list[list[bytes]], iterations: int):
    leader, inbox, sent = Leader(), Inbox(batches), []
    follower = Follower(leader)
    s0, s1 = FakeScheduler(0), FakeScheduler(1)
    clock = iter(range(1000, 2000))
    for _ in range(iterations):
        tp_iteration(s0, leader, inbox, sent.append, clock=lambda: float(next(clock)))
        tp_iteration(s1, follower, None, None, clock=lambda: 0.0)  # rank 1's clock is never read
    return leader, inbox, sent, s0, s1


def test_every_rank_handles_the_same_messages_and_steps_in_lock_step():
    batches = [
        [encode(AbortReq(rid="a")), encode(GetInternalStateReq())],
        [],
        [encode(FlushCacheReq()), encode(AbortReq(rid="b"))],
    ]
    leader, _, sent, s0, s1 = run(batches, 6)
    assert [type(m) for m in s0.handled] == [AbortReq, GetInternalStateReq, FlushCacheReq, AbortReq]
    assert s1.handled == s0.handled and s1.steps == s0.steps == 4
    # rank 0 alone answers and sends outputs (rank 1 was given no send at all)
    assert ("state", 0) in sent and all(item[1] == 0 for item in sent)
    assert [item for item in sent if item[0] == "out"] == [("out", 0, i) for i in range(1, 5)]


def test_idle_rank0_waits_with_a_timeout_and_broadcasts_a_heartbeat():
    leader, inbox, _, s0, _ = run([[], [encode(AbortReq(rid="a"))]], 4)
    # idle: wait up to the heartbeat; busy (after the abort): drain without waiting
    assert inbox.timeouts == [HEARTBEAT_S, HEARTBEAT_S, None, HEARTBEAT_S]
    assert leader.broadcasts[0][1:] == []  # the heartbeat: rank 0's time and no message
    assert 0 < HEARTBEAT_S <= 2
    assert s0.steps == 2


def test_every_rank_uses_rank0s_clock_for_deadlines():
    _, _, _, s0, s1 = run([[encode(AbortReq(rid="a"))], [encode(FlushCacheReq())]], 2)
    assert s0.clocks == s1.clocks == [1000.0, 1001.0]
    assert s1.step_clock == s0.step_clock == 1001.0


def test_an_undecodable_message_is_dropped_on_every_rank():
    _, _, _, s0, s1 = run([[b"\x00garbage", encode(AbortReq(rid="a"))]], 1)
    assert [type(m) for m in s0.handled] == [type(m) for m in s1.handled] == [AbortReq]


def test_a_failed_broadcast_propagates():
    class Broken:
        rank = 1

        def broadcast_messages(self, messages):
            raise GroupLostError("peer gone")

    with pytest.raises(GroupLostError):
        tp_iteration(FakeScheduler(1), Broken(), None, None)


def test_group_failures_are_told_apart_from_bugs():
    assert is_group_failure(GroupLostError("x"))
    assert is_group_failure(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    assert not is_group_failure(RuntimeError("shape mismatch"))
    assert not is_group_failure(ValueError("Connection closed by peer"))


class FakeStore:
    def __init__(self, present: set[str]) -> None:
        self.present = present

    def check(self, keys):
        return all(k in self.present for k in keys)


def test_wait_for_ranks_reports_the_missing_ones():
    store = FakeStore({"srt_rank_0_ready", "srt_rank_2_ready"})
    assert wait_for_ranks(store, 4, timeout_s=0.0) == [1, 3]
    assert wait_for_ranks(FakeStore({f"srt_rank_{r}_ready" for r in range(3)}), 3, 0.0) == []


def test_rank0_rendezvous_timeout_names_the_missing_rank():
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank\(s\) 1 of 2 never joined"):
        rendezvous(f"127.0.0.1:{free_port()}", 0, 2, timeout_s=1.0)
    assert time.monotonic() - t0 < 10


def test_rank1_without_rank0_fails_naming_the_address():
    addr = f"127.0.0.1:{free_port()}"
    with pytest.raises(LaunchError, match="could not reach rank 0's rendezvous at " + addr):
        rendezvous(addr, 1, 2, timeout_s=1.0)


def test_rendezvous_completes_when_every_rank_joins():
    addr = f"127.0.0.1:{free_port()}"
    stores: dict[int, object] = {}

    def join(rank: int) -> None:
        stores[rank] = rendezvous(addr, rank, 2, timeout_s=20.0)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    threads[0].start()
    time.sleep(0.3)  # rank 0 hosts the store
    threads[1].start()
    for t in threads:
        t.join(30)
    assert set(stores) == {0, 1}


@pytest.mark.parametrize(
    "targets, expected",
    [
        ([(ready_then_exit, 0), (ready_then_exit, 0)], 0),  # rank 0 went away: every rank exits 0
        ([(ready_then_exit, 3), (ready_then_wait, "x")], 1),  # a rank failed; the other is stopped
    ],
)
def test_worker_node_exit_code(targets, expected):
    sup = ProcessSupervisor(log_level="warning")
    try:
        for i, (target, arg) in enumerate(targets):
            sup.start(f"scheduler-tp{i + 1}", target, (arg,))
        sup.wait_ready(timeout_s=60)
        t0 = time.monotonic()
        assert wait_for_local_ranks(sup, grace_s=1.0) == expected
        assert time.monotonic() - t0 < 20
    finally:
        sup.stop()


def test_the_engine_refuses_a_nonzero_node_rank():
    from srt import Engine
    from srt.utils.errors import ConfigError

    with pytest.raises(ConfigError, match="--node-rank 1 runs scheduler ranks only"):
        Engine(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1", cpu_omp_threads_bind="nobind")


@pytest.mark.skipif(not shm_supported(), reason="shared-memory collectives need x86-64 and /dev/shm")
def test_shared_memory_collective_fails_fast_when_a_peer_exits():
    (message, waited), _ = run_ranks(all_reduce_after_peer_exit, 2, timeout=120)
    assert "rank(s) [1] exited" in message and is_group_failure(RuntimeError(message))
    assert waited < 5  # not the 60 s timeout

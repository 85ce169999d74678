"""The data-parallel routing policies and reply merging (pure: no sockets, no processes)."""

from __future__ import annotations

import pytest

from srt.managers.data_parallel.policy import DpRouter, PrefixIndex
from srt.managers.data_parallel.replies import ReplyMerger, merge_internal_states, split_dp_state
from srt.managers.io_struct import (
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    ProfileReq,
    ProfileReqOutput,
)


def report(router: DpRouter, g: int, queued: int = 0, running: int = 0, finished=()) -> None:
    """A report of group g that covers every message forwarded to it so far."""
    router.on_report(g, router.groups[g].next_seq, queued, running, finished_rids=finished)


# ---------------------------------------------------------------- minimum_tokens
def test_minimum_tokens_alternates_between_idle_groups():
    r = DpRouter(2)
    picks = [r.route(f"r{i}", [1] * 10) for i in range(6)]
    assert sorted(picks.count(g) for g in (0, 1)) == [3, 3]
    assert r.state()["num_routed_reqs"] == [3, 3]


def test_minimum_tokens_follows_the_reported_load():
    r = DpRouter(3)
    report(r, 0, queued=500, running=100)
    report(r, 1, running=50)
    report(r, 2, running=700)
    assert r.route("a", [1] * 10) == 1
    # a's 10 tokens are not in group 1's report yet: 60 < 600 < 700, group 1 again
    assert r.route("b", [1] * 400) == 1
    # now group 1 holds 50 + 10 + 400 = 460 < 600
    assert r.state()["load_tokens"] == [600, 460, 700]
    assert r.route("c", [1] * 500) == 1
    assert r.route("d", [1] * 10) == 0


def test_routed_tokens_stay_counted_until_a_report_covers_them():
    r = DpRouter(2)
    assert r.route("a", [1] * 100) == 0  # seq 0 in group 0
    assert r.route("b", [1] * 100) == 1
    assert r.route("c", [1] * 30) == 0  # a tie at 100: the rotation; seq 1 in group 0
    assert r.groups[0].load == 130
    # a report taken after a arrived but before c (num_received 1): c stays counted on top of it
    r.on_report(0, 1, queued_tokens=0, running_tokens=120)
    assert r.groups[0].load == 150
    r.on_report(0, 2, queued_tokens=0, running_tokens=150)
    assert r.groups[0].load == 150 and r.groups[0].unseen_tokens == 0
    # an older report arriving late never brings back what a newer one covered
    r.on_report(0, 1, queued_tokens=0, running_tokens=140)
    assert r.groups[0].unseen_tokens == 0


def test_finished_rids_leave_the_owner_map_and_unknown_rids_are_ignored():
    r = DpRouter(2)
    g = r.route("a", [1, 2, 3])
    assert r.owner("a") == g
    report(r, 1 - g, finished=["a"])  # another group cannot finish a
    assert r.owner("a") == g
    report(r, g, finished=["a", "zz"])
    assert r.owner("a") is None
    assert r.state()["num_live_reqs"] == [0, 0]


def test_released_rids_are_forgotten():
    r = DpRouter(2, "round_robin")
    r.route("a", [1])
    r.route("b", [1])
    r.route("c", [1])
    r.release("a")
    r.release("zz")
    assert r.owner("a") is None and r.state()["num_live_reqs"] == [1, 1]
    report(r, 0, finished=["a"])  # its finish arrives later: counted once
    assert r.state()["num_live_reqs"] == [1, 1]
    r.release_all()
    assert r.owner("b") is None and r.state()["num_live_reqs"] == [0, 0]


def test_duplicate_live_rid_keeps_its_first_owner():
    r = DpRouter(2, "round_robin")
    assert r.route("a", [1]) == 0
    assert r.route("a", [1]) == 1
    assert r.owner("a") == 0
    assert r.state()["num_live_reqs"] == [1, 0]


def test_round_robin_cycles_whatever_the_load():
    r = DpRouter(3, "round_robin")
    report(r, 0, running=10_000)
    assert [r.route(f"r{i}", [1]) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError):
        DpRouter(0)
    with pytest.raises(ValueError):
        DpRouter(2, "random")


# ---------------------------------------------------------------- prefix_aware
def test_prefix_aware_keeps_a_shared_prefix_on_one_group_while_loads_are_close():
    r = DpRouter(2, "prefix_aware", margin_tokens=256)
    system = list(range(100, 164))  # 4 blocks of 16
    first = r.route("a", system + [1, 2, 3])
    other = r.route("x", list(range(500, 540)))  # no prefix: the other (less loaded) group
    assert other == 1 - first
    # loads 67 and 40: within the margin, so b follows its prefix to a's group
    assert r.route("b", system + [7, 8, 9]) == first
    assert r.state()["num_prefix_routed_reqs"] == 1


def test_prefix_aware_falls_back_to_the_least_loaded_group_beyond_the_margin():
    r = DpRouter(2, "prefix_aware", margin_tokens=100, margin_fraction=0.0)
    system = list(range(100, 164))
    g = r.route("a", system)
    report(r, g, running=5000)
    report(r, 1 - g, running=10)
    assert r.route("b", system + [1]) == 1 - g


def test_prefix_index_matches_whole_blocks_and_is_bounded():
    idx = PrefixIndex(2, block_size=4, max_blocks_per_group=3)
    ids = list(range(20))
    idx.insert(0, idx.keys(ids[:12]))
    assert idx.match_len(0, idx.keys(ids)) == 12
    assert idx.match_len(0, idx.keys([99] + ids[1:])) == 0  # differs in the first block
    assert idx.match_len(1, idx.keys(ids)) == 0
    assert idx.keys(ids[:3]) == []  # no whole block
    idx.insert(0, idx.keys(list(range(50, 58))))  # 2 more blocks: the oldest 2 are evicted
    assert idx.size(0) == 3
    assert idx.match_len(0, idx.keys(ids)) == 0


# ---------------------------------------------------------------- replies
def test_reply_merger_waits_for_every_group_and_keeps_request_order():
    m = ReplyMerger(2)
    m.expect(FlushCacheReq())
    m.expect(FlushCacheReq())
    assert m.add(1, FlushCacheReqOutput(success=True, message="ok")) == []
    assert m.add(1, FlushCacheReqOutput(success=True, message="ok")) == []
    first = m.add(0, FlushCacheReqOutput(success=False, message="busy"))
    assert len(first) == 1 and first[0].success is False
    assert first[0].message == "dp0: busy; dp1: ok"
    second = m.add(0, FlushCacheReqOutput(success=True, message="ok"))
    assert second == [FlushCacheReqOutput(success=True, message="ok")]
    assert m.num_pending() == 0
    assert m.add(0, FlushCacheReqOutput(success=True)) == []  # nobody waits: dropped


def test_reply_merger_merges_profile_paths_and_states():
    m = ReplyMerger(2)
    m.expect(ProfileReq(action="stop"))
    m.expect(GetInternalStateReq())
    m.add(0, ProfileReqOutput(success=True, message="written", trace_path="/t/a"))
    (p,) = m.add(1, ProfileReqOutput(success=True, message="written", trace_path="/t/b"))
    assert p.trace_path == "/t/a,/t/b" and p.success
    m.add(1, GetInternalStateReqOutput(state={"num_running_reqs": 2}))
    (s,) = m.add(0, GetInternalStateReqOutput(state={"num_running_reqs": 1}))
    assert s.state["num_running_reqs"] == 3
    assert [x["num_running_reqs"] for x in s.state["dp_states"]] == [1, 2]


def test_merge_internal_states_sums_counts_and_weights_usage():
    a = {
        "num_running_reqs": 1,
        "max_total_num_tokens": 100,
        "token_usage": 0.5,
        "gen_throughput": 10.0,
        "cache_hit_rate": 0.25,
        "radix_cache": True,
        "schedule_policy": "fcfs",
    }
    b = {**a, "num_running_reqs": 3, "max_total_num_tokens": 300, "token_usage": 0.1, "gen_throughput": 5.0}
    m = merge_internal_states([a, b])
    assert m["num_running_reqs"] == 4 and m["max_total_num_tokens"] == 400
    assert m["token_usage"] == pytest.approx((50 + 30) / 400)
    assert m["gen_throughput"] == 15.0
    assert m["cache_hit_rate"] == 0.25 and m["radix_cache"] is True and m["schedule_policy"] == "fcfs"
    states, controller = split_dp_state({**m, "dp_controller": {"dp_size": 2}})
    assert states == [a, b] and controller == {"dp_size": 2}
    assert split_dp_state(a) == ([a], None)

"""Where the tensor-parallel ranks run (srt/utils/tp_layout.py): ranks over nodes, CPU shares."""

from __future__ import annotations

import dataclasses
import os

import pytest

from srt.managers.scheduler.tp_process import rank_server_args
from srt.server_args import ServerArgs
from srt.utils.errors import ConfigError
from srt.utils.tp_layout import node_ranks, parse_dist_init_addr, rank_cpus, split_cpus


@pytest.mark.parametrize(
    "tp, nnodes, node, expected",
    [(1, 1, 0, [0]), (2, 1, 0, [0, 1]), (2, 2, 0, [0]), (2, 2, 1, [1]), (4, 2, 1, [2, 3]), (6, 3, 2, [4, 5])],
)
def test_node_ranks_split_evenly_in_order(tp, nnodes, node, expected):
    assert node_ranks(tp, nnodes, node) == expected


def test_every_rank_runs_on_exactly_one_node():
    for tp, nnodes in [(4, 2), (8, 4), (6, 3), (3, 1)]:
        ranks = [r for k in range(nnodes) for r in node_ranks(tp, nnodes, k)]
        assert ranks == list(range(tp))


def test_uneven_nodes_are_refused():
    with pytest.raises(ConfigError, match="multiple of --nnodes"):
        node_ranks(3, 2, 0)


@pytest.mark.parametrize(
    "cpus, parts, expected",
    [
        ([0, 1], 2, [[0], [1]]),
        ([0, 1, 2, 3, 4, 5], 2, [[0, 1, 2], [3, 4, 5]]),
        ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),
        ([2, 5, 7], 3, [[2], [5], [7]]),
        ([0, 1, 2, 3, 4, 5, 6], 3, [[0, 1, 2], [3, 4], [5, 6]]),
        ([0, 1], 1, [[0, 1]]),
    ],
)
def test_split_cpus_contiguous_and_balanced(cpus, parts, expected):
    shares = split_cpus(cpus, parts)
    assert shares == expected
    assert sorted(c for s in shares for c in s) == sorted(cpus)


def test_split_cpus_needs_one_cpu_per_rank():
    with pytest.raises(ConfigError, match="at least 3 CPUs"):
        split_cpus([0, 1], 3)


def test_rank_cpus_is_the_share_of_the_local_rank():
    # two nodes of two ranks each: global ranks 2 and 3 are node 1's local ranks 0 and 1
    assert [rank_cpus("0-3", 4, 2, r) for r in range(4)] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert rank_cpus("nobind", 2, 1, 1) is None


def test_rank_server_args_pins_each_rank_to_its_share():
    args = dataclasses.replace(ServerArgs(), tp_size=2, cpu_omp_threads_bind="0-1", num_threads=2)
    r0, r1 = rank_server_args(args, 0), rank_server_args(args, 1)
    assert (r0.cpu_omp_threads_bind, r0.num_threads) == ("0", 1)
    assert (r1.cpu_omp_threads_bind, r1.num_threads) == ("1", 1)
    assert args.cpu_omp_threads_bind == "0-1"  # the shared args are not mutated
    unbound = rank_server_args(dataclasses.replace(args, cpu_omp_threads_bind="nobind", num_threads=None), 1)
    assert unbound.cpu_omp_threads_bind == "nobind" and unbound.num_threads is None


def test_resolve_tp2_on_two_cpus_gives_one_each():
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    args = ServerArgs(device="cpu", tp_size=2, cpu_omp_threads_bind=f"{cpus[0]},{cpus[1]}").resolve()
    assert [rank_cpus(args.cpu_omp_threads_bind, 2, 1, r) for r in range(2)] == [[cpus[0]], [cpus[1]]]


@pytest.mark.parametrize(
    "addr, expected",
    [("127.0.0.1:29500", ("127.0.0.1", 29500)), ("node0:1", ("node0", 1)), ("[::1]:80", ("::1", 80))],
)
def test_parse_dist_init_addr(addr, expected):
    assert parse_dist_init_addr(addr) == expected


@pytest.mark.parametrize("addr", ["127.0.0.1", ":29500", "h:0", "h:99999", "h:port"])
def test_parse_dist_init_addr_rejects(addr):
    with pytest.raises(ConfigError, match="--dist-init-addr"):
        parse_dist_init_addr(addr)

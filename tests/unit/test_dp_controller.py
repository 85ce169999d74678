"""The data-parallel controller's forwarding and a group's load reports, over real ZMQ sockets in
one process (no scheduler, no model), and the per-group settings of the launch."""

from __future__ import annotations

import shutil
import time
from types import SimpleNamespace

import pytest
import zmq

from srt.entrypoints.dp_launch import dp_group_args, dp_group_port_args, split_cpus
from srt.managers import io_struct as io
from srt.managers.data_parallel.controller import DataParallelController
from srt.managers.scheduler.dp_link import DpGroupLink, measure_load
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import PortArgs, ServerArgs
from srt.utils.errors import ConfigError
from srt.utils.zmq import get_zmq_socket


def recv(sock: zmq.Socket, decoder, timeout_ms: int = 5000):
    assert sock.poll(timeout_ms), "no message arrived"
    return decoder.decode(sock.recv())


def nothing_on(sock: zmq.Socket) -> bool:
    return sock.poll(100) == 0


@pytest.fixture
def wired():
    """A controller with 2 fake groups (PULL sockets) and a fake tokenizer manager (PULL)."""
    ctx = zmq.Context()
    port_args = PortArgs.init_new()
    groups = [
        get_zmq_socket(ctx, zmq.PULL, dp_group_port_args(port_args, g).scheduler_input_ipc_name, True)
        for g in (0, 1)
    ]
    tokenizer = get_zmq_socket(ctx, zmq.PULL, port_args.tokenizer_ipc_name, bind=True)
    names = [dp_group_port_args(port_args, g).scheduler_input_ipc_name for g in (0, 1)]
    ctl = DataParallelController(ServerArgs(load_balance_method="round_robin"), port_args, names, ctx)
    yield ctl, groups, tokenizer, port_args
    ctx.destroy(linger=0)
    shutil.rmtree(port_args.ipc_dir, ignore_errors=True)


def gen(rid: str) -> bytes:
    return io.encode(
        io.TokenizedGenerateReqInput(rid=rid, input_ids=[1, 2, 3], sampling_params=SamplingParams())
    )


def test_requests_aborts_and_stop_strings_reach_the_owning_group(wired):
    ctl, groups, _, _ = wired
    ctl.handle_input(gen("a"))
    ctl.handle_input(gen("b"))
    assert recv(groups[0], io.scheduler_input_decoder).rid == "a"
    assert recv(groups[1], io.scheduler_input_decoder).rid == "b"
    ctl.handle_input(io.encode(io.AbortReq(rid="b")))
    ctl.handle_input(io.encode(io.StopStringHit(rid="a", matched="x")))
    assert recv(groups[1], io.scheduler_input_decoder) == io.AbortReq(rid="b")
    assert recv(groups[0], io.scheduler_input_decoder) == io.StopStringHit(rid="a", matched="x")
    # once group 0 reports a finished, its abort goes nowhere; abort-all goes everywhere
    ctl.handle_group_message(
        io.encode(io.DpLoadReport(dp_rank=0, num_received=2, num_queued_reqs=0, num_running_reqs=0,
                                  queued_tokens=0, running_tokens=0, finished_rids=["a"]))
    )  # fmt: skip
    ctl.handle_input(io.encode(io.AbortReq(rid="a")))
    ctl.handle_input(io.encode(io.AbortReq(rid="")))
    for g in groups:
        assert recv(g, io.scheduler_input_decoder) == io.AbortReq(rid="")
        assert nothing_on(g)
    assert ctl.state()["num_routed_reqs"] == [1, 1]
    assert ctl.state()["num_live_reqs"] == [0, 0]  # a finished, b aborted
    ctl.handle_input(io.encode(io.StopStringHit(rid="b", matched="x")))
    assert nothing_on(groups[1])


def test_control_requests_go_to_every_group_and_one_merged_reply_comes_back(wired):
    ctl, groups, tokenizer, _ = wired
    ctl.handle_input(io.encode(io.GetInternalStateReq()))
    for g in groups:
        assert recv(g, io.scheduler_input_decoder) == io.GetInternalStateReq()
    for rank in (1, 0):
        state = {"num_running_reqs": rank + 1, "available_size": 100}
        ctl.handle_group_message(
            io.encode(io.DpControlReply(dp_rank=rank, reply=io.GetInternalStateReqOutput(state=state)))
        )
    merged = recv(tokenizer, io.tokenizer_input_decoder)
    assert merged.state["num_running_reqs"] == 3 and merged.state["available_size"] == 200
    assert [s["num_running_reqs"] for s in merged.state["dp_states"]] == [1, 2]
    assert merged.state["dp_controller"]["dp_size"] == 2
    assert nothing_on(tokenizer)


class _Req(SimpleNamespace):
    pass


class _Queue(list):
    """A waiting queue: its requests and their token count."""

    @property
    def num_tokens(self) -> int:
        return sum(len(r.origin_input_ids) + len(r.output_ids) for r in self)


def fake_scheduler(waiting=(), running=(), chunked=None, held=()):
    req = lambda n_in, n_out: _Req(origin_input_ids=[0] * n_in, output_ids=[0] * n_out)  # noqa: E731
    return SimpleNamespace(
        waiting_queue=_Queue(req(*w) for w in waiting),
        running=[req(*r) for r in running],
        chunked_req=req(*chunked) if chunked else None,
        grammars=None,
        weight_gate=SimpleNamespace(held=[SimpleNamespace(input_ids=[0] * h) for h in held]),
    )


def test_measure_load_counts_queued_and_running_tokens():
    s = fake_scheduler(waiting=[(10, 0), (5, 3)], running=[(7, 4)], chunked=(100, 0), held=[6])
    assert measure_load(s) == (3, 2, 10 + 8 + 6, 11 + 100)


def test_group_link_reports_when_idle_after_a_change_and_rate_limits_steps():
    ctx = zmq.Context()
    try:
        pull = get_zmq_socket(ctx, zmq.PULL, "inproc://dp-link-test", bind=True)
        link = DpGroupLink(1, ctx, "inproc://dp-link-test", interval_s=3600.0)
        s = fake_scheduler(running=[(4, 1)])
        link.on_idle(s)  # the first report (the controller learns the group is there)
        first = recv(pull, io.dp_controller_input_decoder)
        assert first.dp_rank == 1 and first.idle and first.running_tokens == 5
        link.on_idle(s)
        assert nothing_on(pull)  # nothing changed
        link.on_message()
        out = io.BatchTokenIDOut(
            rids=["x", "y"], output_ids=[[1], [2]], finished_reasons=[None, io.FinishReason.of_length(1)],
            prompt_tokens=[1, 1], completion_tokens=[1, 1], cached_tokens=[0, 0],
            skip_special_tokens=[True, True], spaces_between_special_tokens=[True, True],
            no_stop_trim=[False, False], stop_strs=[[], []],
        )  # fmt: skip
        link.after_step(s, [out])
        assert nothing_on(pull)  # inside the interval: deferred
        link.on_idle(s)
        r = recv(pull, io.dp_controller_input_decoder)
        assert (r.num_received, r.finished_rids, r.idle) == (1, ["y"], True)
        link.interval_s = 0.0
        time.sleep(0.001)
        link.after_step(s, [])
        assert recv(pull, io.dp_controller_input_decoder).idle is False
        link.send_reply(io.FlushCacheReqOutput(success=True))
        assert recv(pull, io.dp_controller_input_decoder) == io.DpControlReply(
            dp_rank=1, reply=io.FlushCacheReqOutput(success=True)
        )
    finally:
        ctx.destroy(linger=0)


# ---------------------------------------------------------------- launch settings
def test_split_cpus_gives_contiguous_shares_and_refuses_too_few():
    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    with pytest.raises(ConfigError, match="--dp-size 3"):
        split_cpus([0, 1], 3)


def test_group_args_split_memory_and_cpus():
    base = ServerArgs(dp_size=2, mem_fraction_static=0.3, cpu_omp_threads_bind="0-1", num_threads=2)
    g0, g1 = dp_group_args(base, 0), dp_group_args(base, 1)
    assert g0.mem_fraction_static == g1.mem_fraction_static == pytest.approx(0.15)
    assert (g0.cpu_omp_threads_bind, g0.num_threads) == ("0", 1)
    assert (g1.cpu_omp_threads_bind, g1.num_threads) == ("1", 1)
    unbound = dp_group_args(ServerArgs(dp_size=2, mem_fraction_static=0.4, cpu_omp_threads_bind="nobind"), 1)
    assert unbound.cpu_omp_threads_bind == "nobind" and unbound.mem_fraction_static == pytest.approx(0.2)
    auto = dp_group_args(ServerArgs(dp_size=2, cpu_omp_threads_bind="nobind"), 0)  # CPU, no fraction
    assert auto.mem_fraction_static == pytest.approx(0.15)
    ports = dp_group_port_args(PortArgs("/d", "ipc:///d/t", "ipc:///d/s", "ipc:///d/k", "ipc:///d/c"), 1)
    assert ports.dp_rank == 1 and ports.scheduler_input_ipc_name == "ipc:///d/scheduler_dp1"
    assert ports.detokenizer_ipc_name == "ipc:///d/k"


def test_resolve_rejects_bad_dp_settings():
    with pytest.raises(ConfigError, match="--dp-size"):
        ServerArgs(dp_size=0).resolve()
    with pytest.raises(ConfigError, match="--load-balance-method"):
        ServerArgs(load_balance_method="random").resolve()

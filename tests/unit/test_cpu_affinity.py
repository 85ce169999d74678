"""CPU placement: ``--cpu-omp-threads-bind`` parsing and resolution, the scheduler's compute threads
really pinned in a process of their own (native op and fallback), and the auxiliary processes
(detokenizer, launch_server's main process) pinned to spare CPUs or niced.

Everything that changes affinity or nice runs in a subprocess (nice cannot be lowered back), and
reads the result back per thread (``os.sched_getaffinity(tid)``, ``os.getpriority(tid)``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from srt.server_args import ServerArgs
from srt.utils.cpu_affinity import (
    AuxPlacement,
    allowed_cpus,
    format_cpu_list,
    parse_cpu_list,
    plan_aux_placement,
    resolve_omp_bind,
)
from srt.utils.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
ALLOWED = allowed_cpus()
needs_two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs this process may use")
pytestmark = pytest.mark.no_lane(
    "reads the priority and CPU affinity of the processes it starts, which a low-priority lane would change"
)


# ---------------------------------------------------------------- parsing and resolution
@pytest.mark.parametrize(
    "spec, cpus",
    [("0", [0]), ("0-1", [0, 1]), ("0,2,4-7", [0, 2, 4, 5, 6, 7]), (" 3, 1 ", [1, 3]), ("5-5", [5])],
)
def test_parse_cpu_list(spec, cpus):
    assert parse_cpu_list(spec) == cpus


@pytest.mark.parametrize("spec", ["", "a", "1-", "-1", "1,,2", "0x1", "1-3-5", "3-1", "1,1", "0-2,2"])
def test_parse_cpu_list_rejects(spec):
    with pytest.raises(ConfigError, match="--cpu-omp-threads-bind"):
        parse_cpu_list(spec)


def test_format_cpu_list():
    assert format_cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert format_cpu_list([3]) == "3"
    assert parse_cpu_list(format_cpu_list([0, 2, 4, 5, 6, 7])) == [0, 2, 4, 5, 6, 7]


def test_flags_and_defaults():
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(
        parser.parse_args(["--cpu-omp-threads-bind", "0", "--aux-process-nice", "0"])
    )
    assert (args.cpu_omp_threads_bind, args.aux_process_nice) == ("0", 0)
    assert (ServerArgs().cpu_omp_threads_bind, ServerArgs().aux_process_nice) == ("auto", 10)


def test_auto_binds_every_allowed_cpu():
    r = ServerArgs(device="cpu").resolve()
    assert r.cpu_omp_threads_bind == format_cpu_list(ALLOWED)
    assert r.num_threads == len(ALLOWED)


def test_auto_with_num_threads_takes_the_first_cpus():
    assert resolve_omp_bind("auto", 1, "cpu") == (str(ALLOWED[0]), 1)
    with pytest.raises(ConfigError, match="exceeds"):
        resolve_omp_bind("auto", len(ALLOWED) + 1, "cpu")


def test_explicit_list_and_num_threads():
    assert resolve_omp_bind(str(ALLOWED[-1]), None, "cpu") == (str(ALLOWED[-1]), 1)
    assert resolve_omp_bind(str(ALLOWED[-1]), 1, "cpu") == (str(ALLOWED[-1]), 1)
    with pytest.raises(ConfigError, match="contradicts"):
        resolve_omp_bind(str(ALLOWED[-1]), 2, "cpu")


def test_nobind_and_cuda_leave_threads_unpinned():
    assert resolve_omp_bind("nobind", None, "cpu") == ("nobind", None)
    assert resolve_omp_bind("NoBind", 3, "cpu") == ("nobind", 3)
    assert resolve_omp_bind("auto", None, "cuda") == ("nobind", None)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cpu_omp_threads_bind": str(max(ALLOWED, default=0) + 1)}, "not one this process may run on"),
        ({"cpu_omp_threads_bind": "4096"}, "not one this process may run on"),
        ({"cpu_omp_threads_bind": "0-"}, "not a CPU id or a range"),
        ({"cpu_omp_threads_bind": ""}, "not a CPU id or a range"),
        ({"num_threads": 0}, "--num-threads must be >= 1"),
        ({"aux_process_nice": -1}, "--aux-process-nice"),
        ({"aux_process_nice": 20}, "--aux-process-nice"),
    ],
)
def test_invalid_values_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ServerArgs(device="cpu", **kwargs).resolve()


def test_aux_placement_plan():
    assert plan_aux_placement([0, 1], [0, 1, 2, 3], 10) == AuxPlacement("pin", cpus=(2, 3))
    assert plan_aux_placement([0, 1], [0, 1], 10) == AuxPlacement("nice", nice=10)
    assert plan_aux_placement(None, [0, 1, 2, 3], 5) == AuxPlacement("nice", nice=5)
    assert plan_aux_placement([0, 1], [0, 1], 0) == AuxPlacement("none")


# ---------------------------------------------------------------- the scheduler's compute threads
_BIND_SCRIPT = """
import json, os, sys
import torch
from srt.managers.scheduler.process import bind_compute_threads
from srt.server_args import ServerArgs

def cpu_ticks(tid):
    stat = open(f"/proc/self/task/{tid}/stat").read()
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime + stime

binding = bind_compute_threads(ServerArgs(cpu_omp_threads_bind=sys.argv[1]))
before = {int(t): cpu_ticks(t) for t in os.listdir("/proc/self/task")}
a = torch.randn(768, 768)
for _ in range(20):
    a = torch.tanh(a @ a)
x = torch.randn(2_000_000)
for _ in range(30):
    x = torch.exp(-x.abs())
threads = {t: {"busy": cpu_ticks(t) - before.get(int(t), 0), "cpus": sorted(os.sched_getaffinity(int(t)))}
           for t in os.listdir("/proc/self/task")}
print(json.dumps({
    "binding": None if binding is None else
        {"native": binding.native, "tids": binding.tids, "cpus": binding.cpus, "failures": binding.failures},
    "torch_threads": torch.get_num_threads(),
    "threads": threads,
}))
"""


def _run_bind(spec: str, native: bool) -> dict:
    env = dict(os.environ)
    env.pop("SRT_DISABLE_NATIVE_KERNELS", None)
    if not native:
        env["SRT_DISABLE_NATIVE_KERNELS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", _BIND_SCRIPT, spec],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def native_built():
    if os.environ.get("SRT_DISABLE_NATIVE_KERNELS", "0") not in ("", "0"):
        pytest.skip("SRT_DISABLE_NATIVE_KERNELS is set")
    from srt.kernels.cpu import build as kbuild

    if kbuild.prebuilt_library() is None:
        try:
            kbuild.build()
        except Exception as e:  # noqa: BLE001 - any build failure skips the native case
            pytest.skip(f"native kernels not built: {kbuild.summarize_error(e)}")


@needs_two_cpus
def test_native_binding_pins_torchs_own_threads_one_per_cpu(native_built):
    cpus = ALLOWED[:2]
    r = _run_bind(format_cpu_list(cpus), native=True)
    b = r["binding"]
    assert b["native"] and b["failures"] == [] and b["cpus"] == cpus
    assert r["torch_threads"] == 2
    for tid, cpu in zip(b["tids"], cpus):
        assert r["threads"][str(tid)]["cpus"] == [cpu]
    # the threads that ran torch's matmuls and element-wise ops are exactly the pinned ones
    busy = {int(t) for t, v in r["threads"].items() if v["busy"] >= 5}
    assert busy and busy <= set(b["tids"]), r


@needs_two_cpus
def test_fallback_confines_the_whole_process():
    cpu = ALLOWED[-1]
    r = _run_bind(str(cpu), native=False)
    b = r["binding"]
    assert not b["native"] and b["failures"] == []
    assert r["torch_threads"] == 1
    assert all(v["cpus"] == [cpu] for v in r["threads"].values()), r


def test_failed_pinning_is_a_warning_not_a_crash(native_built):
    r = _run_bind("4095", native=True)  # a CPU no machine here has: sched_setaffinity says EINVAL
    assert r["binding"]["failures"], r
    assert all(v["cpus"] == ALLOWED for v in r["threads"].values())


def test_nobind_pins_nothing():
    r = _run_bind("nobind", native=False)
    assert r["binding"] is None
    assert all(v["cpus"] == ALLOWED for v in r["threads"].values())


# ---------------------------------------------------------------- auxiliary processes
_AUX_SCRIPT = """
import json, os, sys
from srt.entrypoints.launch import launch_subprocesses
from srt.server_args import ServerArgs
from tests.helpers.fake_scheduler import run_fake_scheduler_process

def threads(pid):
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    return {"nice": sorted({os.getpriority(os.PRIO_PROCESS, t) for t in tids}),
            "cpus": sorted({c for t in tids for c in os.sched_getaffinity(t)})}

report = {"main_before": threads(os.getpid())}
for owns in json.loads(sys.argv[2]):
    args = ServerArgs(log_level="warning", skip_tokenizer_init=True, device="cpu",
                      cpu_omp_threads_bind=sys.argv[1], aux_process_nice=3)
    tm, _ = launch_subprocesses(args, scheduler_entry=run_fake_scheduler_process, owns_process=owns)
    pids = tm.launcher.child_pids
    report[str(owns)] = {"main": threads(os.getpid()), "detokenizer": threads(pids["detokenizer"]),
                         "scheduler": threads(pids["scheduler"])}
    tm.launcher.shutdown()
print(json.dumps(report))
"""


def _run_aux(spec: str, owns: list[bool]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _AUX_SCRIPT, spec, json.dumps(owns)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_aux_processes_are_niced_when_the_compute_set_covers_every_cpu():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    r = _run_aux("auto", [False, True])
    assert r["main_before"]["nice"] == [base]
    engine, server = r["False"], r["True"]
    assert engine["detokenizer"]["nice"] == [min(19, base + 3)]
    assert engine["main"]["nice"] == [base]  # an Engine inside a user's program is left alone
    assert engine["scheduler"]["nice"] == [base]
    assert server["main"]["nice"] == [min(19, base + 3)]  # launch_server's own process steps aside
    assert server["detokenizer"]["cpus"] == ALLOWED  # niced, not pinned


@needs_two_cpus
def test_aux_processes_are_pinned_to_the_spare_cpus():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    r = _run_aux(str(ALLOWED[0]), [True])["True"]
    for name in ("main", "detokenizer"):
        assert r[name]["cpus"] == ALLOWED[1:], (name, r)
        assert r[name]["nice"] == [base], (name, r)

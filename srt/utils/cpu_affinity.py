"""CPU placement of srt's processes: the compute set of ``--cpu-omp-threads-bind`` and where the
auxiliary processes run.

    scheduler          its OpenMP (torch intra-op) threads, one per CPU of the compute set
                       (srt.kernels.cpu.bind_omp_threads; srt.managers.scheduler.process)
    detokenizer,       "auxiliary": pinned to the CPUs outside the compute set when there are any,
    main process of    else niced by ``--aux-process-nice`` so that, when busy, they yield to the
    launch_server      compute threads instead of stalling an OpenMP team (`confine_aux_process`)

Linux semantics this relies on: ``sched_setaffinity`` and ``setpriority`` given a pid act on one
*thread* (that tid), and a new thread inherits both from the thread that creates it. So "the whole
process" here means every thread listed in ``/proc/self/task`` at the time of the call, and
whatever threads those start later.

Spec grammar (``--cpu-omp-threads-bind``): ``auto``, ``nobind``, or a list of CPU ids and
inclusive ranges, ``0-3`` or ``0,2,4-7`` (sorted; a CPU may appear once). ``resolve_omp_bind``
turns ``auto`` into such a list once, in the launching process.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from srt.utils.errors import ConfigError

logger = logging.getLogger(__name__)

AUTO = "auto"
NOBIND = "nobind"
MAX_NICE = 19
_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")


def affinity_supported() -> bool:
    return hasattr(os, "sched_getaffinity") and hasattr(os, "sched_setaffinity")


def allowed_cpus() -> list[int]:
    """The CPUs the calling thread may run on, sorted ([] where the OS has no affinity calls)."""
    return sorted(os.sched_getaffinity(0)) if affinity_supported() else []


def parse_cpu_list(spec: str) -> list[int]:
    """``"0,2,4-7"`` -> ``[0, 2, 4, 5, 6, 7]``; raises ConfigError on bad syntax, an empty list, a
    reversed range or a CPU given twice."""
    cpus: list[int] = []
    for item in spec.split(","):
        m = _ITEM.match(item.strip())
        if m is None:
            raise ConfigError(
                f"--cpu-omp-threads-bind: {item.strip()!r} in {spec!r} is not a CPU id or a range "
                "like 4-7; give auto, nobind, or a list like 0-3 or 0,2,4-7."
            )
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ConfigError(
                f"--cpu-omp-threads-bind: range {item.strip()!r} is reversed (write {hi}-{lo})."
            )
        cpus.extend(range(lo, hi + 1))
    dupes = sorted({c for c in cpus if cpus.count(c) > 1})
    if dupes:
        raise ConfigError(
            f"--cpu-omp-threads-bind {spec!r} names CPU {format_cpu_list(dupes)} more than once "
            "(one compute thread per CPU)."
        )
    return sorted(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """Sorted ids as the shortest list of ranges: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    ids = sorted(set(cpus))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def resolve_omp_bind(spec: str, num_threads: int | None, device: str) -> tuple[str, int | None]:
    """Resolve ``(--cpu-omp-threads-bind, --num-threads)`` for ``device``; returns the pair to store.

    - ``nobind``: ``(nobind, num_threads)`` unchanged (threads not pinned).
    - ``auto``: the CPUs this process may run on, on ``device == "cpu"`` only (elsewhere, or
      without affinity calls, ``nobind``); with ``--num-threads N`` the first N of them.
    - a list: those CPUs; each must be one this process may run on.

    A bound result is ``(canonical list, number of CPUs)``: ``--num-threads`` defaults to the
    number of CPUs, and a different value is rejected (more threads than pinned CPUs, or a listed
    CPU left idle). Raises ConfigError saying what to change."""
    if num_threads is not None and num_threads < 1:
        raise ConfigError(f"--num-threads must be >= 1, got {num_threads}.")
    key = spec.strip().lower()
    if key == NOBIND:
        return NOBIND, num_threads
    if key == AUTO and (device != "cpu" or not affinity_supported()):
        return NOBIND, num_threads
    if not affinity_supported():
        raise ConfigError("--cpu-omp-threads-bind needs CPU affinity calls (Linux); use nobind.")
    allowed = allowed_cpus()
    if key == AUTO:
        if num_threads is not None and num_threads > len(allowed):
            raise ConfigError(
                f"--num-threads {num_threads} exceeds the {len(allowed)} CPUs this process may run on "
                f"({format_cpu_list(allowed)}) that --cpu-omp-threads-bind auto pins one thread each; "
                "lower --num-threads or use --cpu-omp-threads-bind nobind."
            )
        cpus = allowed[: num_threads or len(allowed)]
    else:
        cpus = parse_cpu_list(spec)
        unknown = sorted(set(cpus) - set(allowed))
        if unknown:
            raise ConfigError(
                f"--cpu-omp-threads-bind {spec!r}: CPU {format_cpu_list(unknown)} is not one this process "
                f"may run on ({format_cpu_list(allowed)})."
            )
        if num_threads is not None and num_threads != len(cpus):
            raise ConfigError(
                f"--num-threads {num_threads} contradicts --cpu-omp-threads-bind {spec!r} ({len(cpus)} CPUs, "
                "one thread each): drop --num-threads, make them agree, or use nobind."
            )
    return format_cpu_list(cpus), len(cpus)


def bound_cpus(resolved_spec: str) -> list[int] | None:
    """The compute CPUs of a resolved spec (None for ``nobind``)."""
    if resolved_spec.strip().lower() == NOBIND:
        return None
    return parse_cpu_list(resolved_spec)


def thread_ids() -> list[int]:
    """The tids of this process's threads (just ``[pid]`` where /proc is missing)."""
    try:
        return sorted(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:
        return [os.getpid()]


def set_process_affinity(cpus: Sequence[int]) -> list[str]:
    """Confine every thread of this process to ``cpus``; returns the failures (empty when none).
    A thread that exits meanwhile is not a failure."""
    failures = []
    for tid in thread_ids():
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue
        except OSError as e:
            failures.append(f"tid {tid}: {e.strerror or e}")
    return failures


def lower_process_priority(increment: int) -> list[str]:
    """Add ``increment`` (> 0) to the nice value of every thread of this process (capped at 19);
    returns the failures."""
    failures = []
    for tid in thread_ids():
        try:
            nice = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, nice + increment))
        except ProcessLookupError:
            continue
        except OSError as e:
            failures.append(f"tid {tid}: {e.strerror or e}")
    return failures


@dataclass(slots=True, frozen=True)
class AuxPlacement:
    """What an auxiliary process does: ``pin`` to ``cpus``, ``nice`` by ``nice``, or ``none``."""

    action: str
    cpus: tuple[int, ...] = ()
    nice: int = 0


def plan_aux_placement(compute: Sequence[int] | None, allowed: Sequence[int], nice: int) -> AuxPlacement:
    """Pin to the allowed CPUs outside ``compute`` (None: every allowed CPU computes) when there
    are any; else lower the priority by ``nice`` when it is > 0; else nothing."""
    spare = sorted(set(allowed) - set(allowed if compute is None else compute))
    if spare:
        return AuxPlacement("pin", cpus=tuple(spare))
    if nice > 0:
        return AuxPlacement("nice", nice=nice)
    return AuxPlacement("none")


def confine_aux_process(bind_spec: str, nice: int, name: str) -> AuxPlacement:
    """Apply `plan_aux_placement` to this whole process (named ``name`` in the log line) given the
    resolved ``--cpu-omp-threads-bind`` and ``--aux-process-nice``. Never raises: a failure is
    logged as a warning and the process runs on unchanged."""
    try:
        place = plan_aux_placement(bound_cpus(bind_spec), allowed_cpus(), nice)
        if place.action == "pin":
            failures = set_process_affinity(place.cpus)
            what = f"pinned to CPU {format_cpu_list(place.cpus)} (outside the compute CPUs {bind_spec})"
        elif place.action == "nice":
            failures = lower_process_priority(place.nice)
            what = f"nice +{place.nice} (the compute threads may use every CPU)"
        else:
            failures, what = [], "left as is (no spare CPU, --aux-process-nice 0)"
    except Exception as e:  # noqa: BLE001 - placement is an optimisation, never fatal
        logger.warning("%s process: CPU placement failed (%s); running unconfined", name, e)
        return AuxPlacement("none")
    if failures:
        logger.warning("%s process: %s failed for %s", name, place.action, "; ".join(failures))
    logger.info("%s process: %s", name, what)
    return place

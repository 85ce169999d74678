"""Starting ``--dp-size N`` scheduler groups and the data-parallel controller.

    launch_subprocesses
      start_dp_groups(supervisor, server_args, port_args, scheduler_entry)
        group g (0..N-1): scheduler_entry(dp_group_args(server_args, g), dp_group_port_args(port_args, g))
                          as child "scheduler_dp<g>" (one call per group: a group is one process
                          while --tp-size is 1)
        controller:       run_data_parallel_controller_process as child "dp_controller", bound at
                          the scheduler's ipc name: the tokenizer manager and the detokenizer
                          talk to it as they would to a single scheduler

Each group sizes its own KV pool. On one machine the groups share it, so `dp_group_args` gives
each group ``--mem-fraction-static / N`` (on CPU without the flag ``DP_CPU_MEM_FRACTION / N``:
groups that load at the same time cannot size their pools from what the others leave free) and
a contiguous share of the CPUs of
``--cpu-omp-threads-bind`` (2 CPUs, dp 2: one CPU per group); ``--max-total-tokens`` is taken
per group as given. Every other setting is the same for all groups.
"""

from __future__ import annotations

import dataclasses

from srt.managers.data_parallel.controller import run_data_parallel_controller_process
from srt.server_args import PortArgs, ServerArgs
from srt.utils.cpu_affinity import bound_cpus, format_cpu_list
from srt.utils.errors import ConfigError
from srt.utils.process import ProcessSupervisor

CONTROLLER_NAME = "dp_controller"
# the weights + KV fraction shared by the groups on CPU when --mem-fraction-static is not given
DP_CPU_MEM_FRACTION = 0.3


def group_name(dp_rank: int) -> str:
    return f"scheduler_dp{dp_rank}"


def split_cpus(cpus: list[int], parts: int) -> list[list[int]]:
    """``cpus`` in ``parts`` contiguous shares, sizes differing by at most one (the first
    shares get the extra CPUs). Raises ConfigError when there are fewer CPUs than parts."""
    if len(cpus) < parts:
        raise ConfigError(
            f"--dp-size {parts} needs at least one compute CPU per group, but --cpu-omp-threads-bind "
            f"gives {len(cpus)} ({format_cpu_list(cpus)}); lower --dp-size or use nobind."
        )
    base, extra = divmod(len(cpus), parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        out.append(cpus[start : start + size])
        start += size
    return out


def dp_group_args(server_args: ServerArgs, dp_rank: int) -> ServerArgs:
    """The resolved settings of group ``dp_rank``: its share of the memory fraction and of the
    compute CPUs (see the module docstring); with nobind the threads stay unpinned and
    ``--num-threads`` (if given) applies to each group."""
    n = server_args.dp_size
    fraction = server_args.mem_fraction_static or DP_CPU_MEM_FRACTION
    changes: dict = {"mem_fraction_static": fraction / n}
    cpus = bound_cpus(server_args.cpu_omp_threads_bind)
    if cpus is not None:
        share = split_cpus(cpus, n)[dp_rank]
        changes.update(cpu_omp_threads_bind=format_cpu_list(share), num_threads=len(share))
    return dataclasses.replace(server_args, **changes)


def dp_group_port_args(port_args: PortArgs, dp_rank: int) -> PortArgs:
    """Group ``dp_rank``'s endpoints: its own input socket; the detokenizer and the controller's
    report socket are shared."""
    return dataclasses.replace(
        port_args,
        scheduler_input_ipc_name=f"ipc://{port_args.ipc_dir}/scheduler_dp{dp_rank}",
        dp_rank=dp_rank,
    )


def start_dp_groups(sup: ProcessSupervisor, server_args: ServerArgs, port_args: PortArgs, entry) -> list[str]:
    """Start the N groups and the controller under ``sup``; returns the groups' child names
    (index = dp rank). Raises ConfigError before starting anything when the CPUs cannot be split."""
    n = server_args.dp_size
    group_args = [dp_group_args(server_args, g) for g in range(n)]
    group_ports = [dp_group_port_args(port_args, g) for g in range(n)]
    names = [group_name(g) for g in range(n)]
    for name, args, ports in zip(names, group_args, group_ports):
        sup.start(name, entry, (args, ports))
    inputs = [p.scheduler_input_ipc_name for p in group_ports]
    sup.start(CONTROLLER_NAME, run_data_parallel_controller_process, (server_args, port_args, inputs))
    return names

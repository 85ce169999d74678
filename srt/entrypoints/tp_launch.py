"""The tensor-parallel scheduler ranks of one launch.

Node k of ``--nnodes`` runs the TP ranks ``srt.utils.tp_layout.node_ranks`` gives it, one scheduler
child each (`start_scheduler_ranks`; rank 0's child is named ``scheduler``, rank r's
``scheduler-tp<r>``). All of them meet at ``--dist-init-addr`` (one node without it: a free
loopback port chosen here).

Node 0 is the normal server (`srt.entrypoints.launch`); a node with ``--node-rank`` > 0 runs its
ranks only (`srt.entrypoints.worker_node`).
"""

from __future__ import annotations

import functools
import socket
from typing import Any

from srt.server_args import PortArgs, ServerArgs
from srt.utils.process import ProcessSupervisor
from srt.utils.tp_layout import node_ranks


def rank_process_name(tp_rank: int) -> str:
    return "scheduler" if tp_rank == 0 else f"scheduler-tp{tp_rank}"


def _free_loopback_addr() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def start_scheduler_ranks(
    sup: ProcessSupervisor, server_args: ServerArgs, port_args: PortArgs, entry: Any
) -> list[str]:
    """Start this node's scheduler children (``server_args`` resolved); returns their names.

    ``--tp-size 1``: one child ``entry(server_args, port_args, pipe_writer)`` as before. Otherwise
    one per local rank, called with ``tp_rank=r, dist_init_addr=addr`` as keywords."""
    if server_args.tp_size == 1:
        sup.start("scheduler", entry, (server_args, port_args))
        return ["scheduler"]
    addr = server_args.dist_init_addr or _free_loopback_addr()
    names = []
    for r in node_ranks(server_args.tp_size, server_args.nnodes, server_args.node_rank):
        name = rank_process_name(r)
        sup.start(name, functools.partial(entry, tp_rank=r, dist_init_addr=addr), (server_args, port_args))
        names.append(name)
    return names

"""A node with ``--node-rank`` > 0: its tensor-parallel scheduler ranks and nothing else.

``python -m srt.launch_server ... --nnodes N --node-rank k --dist-init-addr HOST:PORT`` with k > 0
runs no HTTP server, tokenizer or detokenizer: its ranks bind no sockets (rank 0 broadcasts their
inputs and alone sends outputs). `run_worker_node` returns 0 when its ranks exit cleanly because
the group is over (rank 0 went away: each rank exits 0 on a failed collective), 1 when one of them
failed, and 0 after SIGINT / SIGTERM (its ranks are stopped first). The ranks die with this process
(parent-death signal), so killing it takes them down at once.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import signal
import sys
import time
from typing import Any

from srt.entrypoints.launch import Launcher, run_scheduler
from srt.entrypoints.tp_launch import start_scheduler_ranks
from srt.server_args import PortArgs, ServerArgs
from srt.utils.logging_utils import configure_logging
from srt.utils.process import ProcessSupervisor

logger = logging.getLogger(__name__)

# after one rank of a worker node exits, how long the others get to notice before being stopped
_WORKER_GRACE_S = 5.0


def run_worker_node(server_args: ServerArgs) -> int:
    """Run the scheduler ranks of ``--node-rank`` > 0 until they exit (see the module docstring).
    Raises ConfigError / LaunchError like the server's launch."""
    configure_logging(server_args.log_level, "main")
    server_args = server_args.resolve()
    launcher = Launcher(server_args, PortArgs.init_new())
    previous = {s: signal.signal(s, _raise_system_exit) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        names = start_scheduler_ranks(launcher.supervisor, server_args, launcher.port_args, run_scheduler)
        launcher.supervisor.wait_ready()
        logger.info(
            "node %d: ranks %s ready; serving through node 0", server_args.node_rank, ", ".join(names)
        )
        return wait_for_local_ranks(launcher.supervisor)
    except SystemExit:
        logger.info("node %d: stopping", server_args.node_rank)
        return 0
    finally:
        launcher.shutdown()
        for s, handler in previous.items():
            signal.signal(s, handler)


def wait_for_local_ranks(sup: ProcessSupervisor, grace_s: float = _WORKER_GRACE_S) -> int:
    """Block until every rank exited (the others get ``grace_s`` after the first; the caller
    stops any left); 0 when all exited with code 0, else 1."""
    procs = [c.process for c in sup.children]
    multiprocessing.connection.wait([p.sentinel for p in procs])
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    codes = {c.name: c.process.exitcode for c in sup.children}
    if all(code == 0 for code in codes.values()):
        logger.info("the tensor-parallel group is over (rank 0 went away); exiting")
        return 0
    logger.error("scheduler ranks exited: %s", ", ".join(f"{n} code {c}" for n, c in codes.items()))
    return 1


def _raise_system_exit(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)

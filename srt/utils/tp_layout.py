"""Where the tensor-parallel ranks run: pure arithmetic shared by configuration and the launch.

Ranks are split evenly over the nodes, in order (tp 4 over 2 nodes: node 0 runs ranks 0-1, node 1
ranks 2-3), and the ranks of one node split that node's compute CPUs (the resolved
``--cpu-omp-threads-bind`` list) into contiguous, as-even-as-possible shares::

    cpus 0-5, 2 local ranks  ->  local rank 0: 0-2, local rank 1: 3-5
    cpus 0-4, 2 local ranks  ->  local rank 0: 0-2, local rank 1: 3-4

No torch at import time; ``ServerArgs.resolve`` validates with it.
"""

from __future__ import annotations

from srt.utils.cpu_affinity import NOBIND, parse_cpu_list
from srt.utils.errors import ConfigError


def ranks_per_node(tp_size: int, nnodes: int) -> int:
    """Number of ranks each node runs (``tp_size`` must be a multiple of ``nnodes``)."""
    if tp_size % nnodes:
        raise ConfigError(
            f"--tp-size {tp_size} must be a multiple of --nnodes {nnodes} (every node runs the same number of ranks)."
        )
    return tp_size // nnodes


def node_ranks(tp_size: int, nnodes: int, node_rank: int) -> list[int]:
    """The global TP ranks node ``node_rank`` runs, in order."""
    per = ranks_per_node(tp_size, nnodes)
    return list(range(node_rank * per, (node_rank + 1) * per))


def split_cpus(cpus: list[int], parts: int) -> list[list[int]]:
    """Contiguous shares of ``cpus`` for ``parts`` ranks (the first ``len % parts`` get one more).

    Raises ConfigError when there are fewer CPUs than ranks (a rank needs at least one)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if len(cpus) < parts:
        raise ConfigError(
            f"{parts} tensor-parallel ranks on this node need at least {parts} CPUs in "
            f"--cpu-omp-threads-bind, got {len(cpus)}; give more CPUs or use nobind."
        )
    base, extra = divmod(len(cpus), parts)
    out: list[list[int]] = []
    start = 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append(list(cpus[start : start + n]))
        start += n
    return out


def parse_dist_init_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 as ``[::1]:port``) -> ``(host, port)``; ConfigError when malformed."""
    host, sep, port_s = addr.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ConfigError(f"--dist-init-addr must be host:port (e.g. 10.0.0.1:29500), got {addr!r}.")
    return host, int(port_s)


def rank_cpus(resolved_spec: str, tp_size: int, nnodes: int, tp_rank: int) -> list[int] | None:
    """The compute CPUs of global rank ``tp_rank``: its share of this node's resolved
    ``--cpu-omp-threads-bind`` list (None for ``nobind``)."""
    if resolved_spec.strip().lower() == NOBIND:
        return None
    per = ranks_per_node(tp_size, nnodes)
    return split_cpus(parse_cpu_list(resolved_spec), per)[tp_rank % per]


def validate_parallelism(
    tp_size: int,
    nnodes: int,
    node_rank: int,
    dist_init_addr: str | None,
    dist_timeout: float,
    cpu_spec: str,
    device: str,
) -> None:
    """Validate --tp-size / --nnodes / --node-rank / --dist-init-addr / --dist-timeout (resolved
    ``cpu_spec`` and ``device``): this node's ranks must split the compute CPUs (one at least each)
    or have a GPU each. Raises ConfigError saying what to change."""
    if tp_size < 1:
        raise ConfigError(f"--tp-size must be >= 1, got {tp_size}.")
    if nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {nnodes}.")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank must be in [0, --nnodes={nnodes}), got {node_rank}.")
    local = ranks_per_node(tp_size, nnodes)
    if nnodes > 1 and not dist_init_addr:
        raise ConfigError(
            "--nnodes > 1 needs --dist-init-addr host:port (node 0's address, the same on every node)."
        )
    if dist_init_addr:
        parse_dist_init_addr(dist_init_addr)
    if not dist_timeout > 0:
        raise ConfigError(f"--dist-timeout must be > 0 seconds, got {dist_timeout}.")
    if local > 1:
        rank_cpus(cpu_spec, tp_size, nnodes, 0)  # raises when the CPUs are too few
    if tp_size > 1 and device == "cuda":
        import torch

        if torch.cuda.device_count() < local:
            raise ConfigError(
                f"--tp-size {tp_size} over {nnodes} node(s) runs {local} ranks here, one GPU each, "
                f"but {torch.cuda.device_count()} are visible."
            )

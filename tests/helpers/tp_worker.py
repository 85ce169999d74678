"""Tensor-parallel ranks for tests: ``run_ranks(fn, tp_size, *args)`` spawns ``tp_size``
processes that join a gloo group on 127.0.0.1 and each call ``fn(rank, tp_size, *args)``
(a module-level function, so spawn can import it); returns the results in rank order.

``run_scenarios(rank, tp_size, scenarios, prompts, decode_steps)`` is such an ``fn``: for each
``(name, ServerArgs)`` it returns ``drive_runner``'s result under that name.

``drive_runner(args, tp_rank, prompts, decode_steps)`` builds a ModelRunner on a copy of
resolved ``args`` with ``tp_size`` set after ``resolve()`` (ServerArgs itself still refuses
``--tp-size`` > 1) and runs one EXTEND of the prompts then ``decode_steps`` DECODE steps, all
greedy; it returns the float32 logits of every step (numpy: results cross a process queue), the tokens and the rank's weight bytes.
"""

from __future__ import annotations

import dataclasses
import datetime
import socket
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, tp_size: int, port: int, queue: Any, fn: Any, args: tuple) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=tp_size,
            timeout=datetime.timedelta(seconds=120),
        )
        queue.put((rank, "ok", fn(rank, tp_size, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Any, tp_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, tp_size, port, queue, fn, args), daemon=True)
        for r in range(tp_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(tp_size):
            rank, status, value = queue.get(timeout=timeout)
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(tp_size)]


def drive_runner(args: Any, tp_rank: int, prompts: list[list[int]], decode_steps: int) -> dict[str, Any]:
    from srt.model_executor.model_runner import ModelRunner
    from tests.helpers.runner_driver import RunnerDriver

    tp_size = args.tp_size
    resolved = dataclasses.replace(dataclasses.replace(args, tp_size=1).resolve(), tp_size=tp_size)
    runner = ModelRunner(resolved, tp_rank=tp_rank)
    driver = RunnerDriver(runner)
    seqs = [driver.add(p, decode_steps + 1) for p in prompts]
    logits = []
    out, _, _ = driver.step([(s, len(s.prompt)) for s in seqs], [])
    logits.append(out.next_token_logits.numpy().copy())
    for _ in range(decode_steps):
        out, _, _ = driver.step([], seqs)
        logits.append(out.next_token_logits.numpy().copy())
    return {
        "logits": logits,
        "tokens": [s.output_ids for s in seqs],
        "weight_bytes": runner.weight_bytes,
        "sharded_bytes": sharded_bytes(runner.model),
        "down_proj_qtypes": _down_proj_qtypes(runner.model),
        "kv_tokens": runner.max_total_num_tokens,
        "kv_heads": runner.num_kv_heads,
    }


def _down_proj_qtypes(model: torch.nn.Module) -> list[int] | None:
    """ggml types of layer 0's down_proj segments (None: a float32 weight, or a MoE layer)."""
    down = getattr(model.model.layers[0].mlp, "down_proj", None)
    return None if down is None or down.qweight is None else down.qweight.qtypes


def sharded_bytes(model: torch.nn.Module) -> int:
    """Bytes of the matrices tensor parallelism splits (linear layers, embedding, LM head)."""
    from srt.layers.linear import Linear
    from srt.layers.vocab_embedding import LMHead, VocabEmbedding
    from srt.model_loader.weight_utils import weight_bytes

    return sum(weight_bytes(m) for m in model.modules() if isinstance(m, Linear | VocabEmbedding | LMHead))


def collectives(rank: int, tp_size: int) -> dict[str, Any]:
    """``TPInfo``'s collectives on rank-dependent inputs (rank r contributes r + 1 columns)."""
    from srt.distributed import TPInfo

    tp = TPInfo(rank, tp_size)
    sizes = [r + 1 for r in range(tp_size)]
    part = torch.full((2, rank + 1), float(rank))
    summed = tp.all_reduce(torch.full((3,), float(rank + 1)))
    out = {
        "min": tp.all_reduce_min(100 - 7 * rank),
        "gather": tp.all_gather_last_dim(part, sizes).numpy(),
        "sum": summed.numpy(),
    }
    return out | shm_collectives(rank, tp_size)


def shm_collectives(rank: int, tp_size: int) -> dict[str, Any]:
    """The shared-memory collectives against gloo's on the same inputs: a sum, an uneven gather,
    a sum larger than a slot (several rounds), a non-contiguous tensor, and 50 rounds in a row
    (the double buffer reused many times)."""
    from srt.distributed import TPInfo
    from srt.distributed.shm_comm import ShmComm

    tp = TPInfo(rank, tp_size).with_shared_memory("cpu")
    small = ShmComm.create(rank, tp_size, slot_bytes=256)  # 64 float32 per round
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(5, 300, generator=gen)
    ref = x.clone()
    dist.all_reduce(ref)
    chunked = small.all_reduce(x.clone())
    strided = x.clone().t()
    tp.all_reduce(strided)
    repeated = torch.full((7,), float(rank))
    for _ in range(50):
        tp.all_reduce(repeated)
    part = torch.full((2, rank + 1), float(rank))
    return {
        "shm_used": tp.shm is not None,
        "shm_sum": tp.all_reduce(x.clone()).numpy(),
        "gloo_sum": ref.numpy(),
        "shm_chunked": chunked.numpy(),
        "shm_strided": strided.t().numpy(),
        "shm_repeated": repeated.numpy(),
        "shm_gather": tp.all_gather_last_dim(part, [r + 1 for r in range(tp_size)]).numpy(),
    }


def run_scenarios(
    rank: int, tp_size: int, scenarios: list[tuple[str, Any]], prompts: list[list[int]], decode_steps: int
) -> dict[str, dict[str, Any]]:
    """``{"collectives": collectives(...), name: drive_runner(...) for each scenario}``."""
    out = {"collectives": collectives(rank, tp_size)}
    for name, args in scenarios:
        out[name] = drive_runner(dataclasses.replace(args, tp_size=tp_size), rank, prompts, decode_steps)
    return out

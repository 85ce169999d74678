"""Offline throughput: srt's Engine in-process vs transformers, on one seeded workload.

Protocol (a CPU-sized version of the one nano-vllm and mini-sglang publish): ``--num-seqs``
sequences of random token ids, input lengths uniform in ``[--min-input-len, --max-input-len]``,
output lengths uniform in ``[--min-output-len, --max-output-len]``, greedy, ignore_eos, every
sequence generating exactly its requested output length. Every system first runs a small
untimed warmup; the timed wall clock covers submitting the whole workload to getting every
output back. Output tok/s = requested output tokens / wall; total tok/s = (input + output) / wall.

Baselines, on the same workload in the same run, the model loaded in float32 with
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``:

* ``hf-static``: ``model.generate`` on left-padded batches of ``--hf-batch-size`` in workload
  order; a batch runs for its longest requested output (``min_new_tokens = max_new_tokens``) and
  only each sequence's requested tokens are counted. Without ``--hf-batch-size`` the workload is
  run at 8, 16 and 32 and the best is reported.
* ``hf-cb``: transformers' continuous batching (``ContinuousBatchingManager``, the engine behind
  ``generate_batch``) with a per-request ``max_new_tokens`` and EOS disabled.

Each system's CPU time (all threads; srt's child processes included) is recorded too: on a
machine shared with other work, output tokens per (CPU second / cores) estimates the rate the
system would reach with the machine to itself, which wall-clock figures cannot.

The ceiling: float32 matmul rates measured in this run at the model's own shapes, charged with
the workload's FLOPs (``benchmarks/common.py``); srt's total tok/s is shown as a fraction of it.

    python benchmarks/bench_offline_throughput.py --baseline hf-static --baseline hf-cb --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (  # noqa: E402
    ModelShape,
    Workload,
    ceiling_seconds,
    default_model_dir_and_file,
    format_table,
    make_workload,
    measure_matmul_rates,
    versions,
    workload_flops,
)

HF_STATIC_BATCH_SIZES = (8, 16, 32)


@dataclass(slots=True)
class SystemResult:
    """One system's timed run. ``cpu_s`` is the CPU time (user + system, all threads and, for srt,
    its child processes) the run consumed: on a shared machine, ``output_tokens / (cpu_s / cores)``
    estimates the rate with the whole machine to itself."""

    name: str
    wall_s: float
    input_tokens: int
    output_tokens: int
    cpu_s: float

    @property
    def out_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.wall_s

    @property
    def out_tok_per_machine_s(self) -> float:
        return self.output_tokens / (self.cpu_s / (os.cpu_count() or 1))


def _cpu_seconds(pids: list[int]) -> float:
    """CPU time so far of this process (all threads) plus the live processes ``pids``."""
    import psutil

    total = time.process_time()
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _timed(fn: Callable[[], Any], pids: Sequence[int] = ()) -> tuple[Any, float, float]:
    """``(fn(), wall seconds, CPU seconds of this process and pids)``."""
    c0, t0 = _cpu_seconds(list(pids)), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, _cpu_seconds(list(pids)) - c0


def _check_lengths(system: str, got: list[int], want: list[int]) -> None:
    if got != want:
        bad = sum(g != w for g, w in zip(got, want))
        raise RuntimeError(f"{system} generated the wrong number of tokens for {bad} sequences")


def _warmup_workload(wl: Workload) -> Workload:
    """Two short sequences that share no prefix with the workload (no prefix-cache head start)."""
    return Workload([list(range(1000, 1016)), list(range(2000, 2024))], [4, 4])


# ---------------------------------------------------------------- srt
def _srt_sampling_params(output_lens: list[int]) -> list[dict]:
    return [{"max_new_tokens": o, "ignore_eos": True, "temperature": 0.0} for o in output_lens]


def run_srt(wl: Workload, engine_kwargs: dict) -> SystemResult:
    try:
        from srt import Engine  # type: ignore[attr-defined]
    except ImportError:
        from srt.entrypoints.engine import Engine

    engine = Engine(**engine_kwargs)
    try:
        warm = _warmup_workload(wl)
        engine.generate(input_ids=warm.input_ids, sampling_params=_srt_sampling_params(warm.output_lens))
        engine.flush_cache()
        pids = [p for p in engine.child_pids.values() if p is not None]
        params = _srt_sampling_params(wl.output_lens)
        outs, wall, cpu = _timed(
            lambda: engine.generate(input_ids=wl.input_ids, sampling_params=params), pids
        )
    finally:
        engine.shutdown()
    _check_lengths("srt", [int(o["meta_info"]["completion_tokens"]) for o in outs], wl.output_lens)
    return SystemResult("srt", wall, wl.num_input_tokens, wl.num_output_tokens, cpu)


# ---------------------------------------------------------------- transformers
def load_hf_model():
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    d, f = default_model_dir_and_file()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    return model.eval()


def _hf_static_once(model, wl: Workload, batch_size: int, pad_id: int) -> None:
    import torch

    for start in range(0, len(wl.input_ids), batch_size):
        ids = wl.input_ids[start : start + batch_size]
        new = max(wl.output_lens[start : start + batch_size])
        width = max(len(x) for x in ids)
        inp = torch.tensor([[pad_id] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        out = model.generate(
            input_ids=inp,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad_id,
        )
        if out.shape[1] != width + new:
            raise RuntimeError(f"hf-static generated {out.shape[1] - width} tokens, {new} requested")


def run_hf_static(model, wl: Workload, batch_size: int) -> SystemResult:
    import torch

    pad_id = int(model.config.pad_token_id if model.config.pad_token_id is not None else 0)
    with torch.inference_mode():
        _hf_static_once(model, _warmup_workload(wl), batch_size, pad_id)
        _, wall, cpu = _timed(lambda: _hf_static_once(model, wl, batch_size, pad_id))
    name = f"hf-static (batch {batch_size})"
    return SystemResult(name, wall, wl.num_input_tokens, wl.num_output_tokens, cpu)


def _hf_cb_once(model, wl: Workload) -> list[int]:
    """Run wl through a fresh ContinuousBatchingManager; returns generated lengths in order."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    cfg = GenerationConfig(max_new_tokens=max(wl.output_lens), do_sample=False)
    # KV blocks for every sequence at once (CB never waits for memory); left to itself on CPU the
    # manager takes most of the free RAM (over 10 GB here), which a shared machine cannot spare
    page = 256
    blocks = sum(-(-(p + o) // page) for p, o in zip(wl.input_lens, wl.output_lens)) + len(wl.input_ids)
    cb_cfg = ContinuousBatchingConfig(page_size=page, num_blocks=blocks)
    hints = WorkloadHints(
        max_prompt_length=max(wl.input_lens),
        max_generated_length=max(wl.output_lens),
        num_requests=len(wl.input_ids),
    )
    results: dict[str, int] = {}
    with model.continuous_batching_context_manager(
        generation_config=cfg, continuous_batching_config=cb_cfg, block=True, timeout=5, workload_hints=hints
    ) as manager:
        rids = [
            manager.add_request(ids, request_id=f"r{i}", max_new_tokens=o, eos_token_id=-1)
            for i, (ids, o) in enumerate(zip(wl.input_ids, wl.output_lens))
        ]
        while len(results) < len(rids):
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
                continue
            if res.is_finished():
                if res.error is not None:
                    raise RuntimeError(f"hf-cb request {res.request_id} failed: {res.error}")
                results[res.request_id] = len(res.generated_tokens)
    return [results[r] for r in rids]


def run_hf_cb(model, wl: Workload) -> SystemResult:
    # no inference_mode here: the manager builds its tensors in this thread and updates them in
    # its generation thread (it disables autograd itself)
    _hf_cb_once(model, _warmup_workload(wl))
    got, wall, cpu = _timed(lambda: _hf_cb_once(model, wl))
    _check_lengths("hf-cb", got, wl.output_lens)
    return SystemResult("hf-cb (generate_batch)", wall, wl.num_input_tokens, wl.num_output_tokens, cpu)


# ---------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--num-seqs", type=int, default=64)
    a("--min-input-len", type=int, default=32)
    a("--max-input-len", type=int, default=512)
    a("--min-output-len", type=int, default=16)
    a("--max-output-len", type=int, default=256)
    a("--seed", type=int, default=0)
    a(
        "--baseline",
        action="append",
        default=[],
        choices=["hf-static", "hf-cb"],
        help="Also run this baseline (repeatable).",
    )
    a(
        "--hf-batch-size",
        type=int,
        default=None,
        help=f"hf-static batch size (default: best of {', '.join(map(str, HF_STATIC_BATCH_SIZES))}).",
    )
    a("--skip-srt", action="store_true", help="Run only the baselines and the ceiling.")
    a("--engine-args", default="{}", help="JSON object of extra srt Engine (ServerArgs) keyword arguments.")
    a("--ceiling-batch-sizes", default="64,256,1024", help="Batch sizes of the matmul-rate measurement.")
    a("--json", action="store_true", help="Print one JSON object of the figures as the last line.")
    return p


def _report(r: SystemResult) -> None:
    print(
        f"{r.name}: {r.out_tok_s:.1f} output tok/s ({r.wall_s:.1f} s, {r.cpu_s:.0f} CPU s: "
        f"{r.out_tok_per_machine_s:.1f} output tok per machine-second); load average now {os.getloadavg()[0]:.2f}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers import AutoConfig

    d, f = default_model_dir_and_file()
    hf_config = AutoConfig.from_pretrained(d, gguf_file=f)
    shape = ModelShape.from_hf_config(hf_config)
    special = [
        t
        for t in (hf_config.bos_token_id, hf_config.eos_token_id, hf_config.pad_token_id, 0)
        if t is not None
    ]
    wl = make_workload(
        args.num_seqs,
        (args.min_input_len, args.max_input_len),
        (args.min_output_len, args.max_output_len),
        shape.vocab,
        args.seed,
        special,
    )
    flops = workload_flops(shape, wl.input_lens, wl.output_lens)
    total_flops = sum(flops.values())
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    print(f"# {date}  {versions()}  load average {os.getloadavg()[0]:.2f}")
    print(
        f"workload: {args.num_seqs} seqs, input {args.min_input_len}-{args.max_input_len} "
        f"(total {wl.num_input_tokens}), output {args.min_output_len}-{args.max_output_len} "
        f"(total {wl.num_output_tokens}), seed {args.seed}, {total_flops / 1e12:.2f} TFLOP "
        f"(linear {flops['linear'] / 1e12:.2f}, lm head {flops['lm_head'] / 1e12:.2f}, "
        f"attention {flops['attention'] / 1e12:.2f})",
        flush=True,
    )

    rates = measure_matmul_rates(shape, [int(x) for x in args.ceiling_batch_sizes.split(",")])
    for m, r in rates.items():
        print(
            f"float32 matmul at batch {m}: layer {r['layer'] / 1e9:.0f} GFLOP/s, lm head {r['lm_head'] / 1e9:.0f} GFLOP/s"
        )
    ceil_s = ceiling_seconds(flops, rates)
    ceiling_total = (wl.num_input_tokens + wl.num_output_tokens) / ceil_s
    print(
        f"compute ceiling: {ceil_s:.1f} s -> {ceiling_total:.0f} total tok/s, "
        f"{wl.num_output_tokens / ceil_s:.0f} output tok/s",
        flush=True,
    )

    results: list[SystemResult] = []
    srt_res = hf_static_best = hf_cb_res = None
    if not args.skip_srt:
        srt_res = run_srt(wl, json.loads(args.engine_args))
        results.append(srt_res)
        _report(srt_res)
    if args.baseline:
        model = load_hf_model()
        if "hf-static" in args.baseline:
            sizes = [args.hf_batch_size] if args.hf_batch_size else list(HF_STATIC_BATCH_SIZES)
            for bs in sizes:
                r = run_hf_static(model, wl, bs)
                results.append(r)
                _report(r)
                if hf_static_best is None or r.out_tok_s > hf_static_best.out_tok_s:
                    hf_static_best = r
        if "hf-cb" in args.baseline:
            hf_cb_res = run_hf_cb(model, wl)
            results.append(hf_cb_res)
            _report(hf_cb_res)

    rows = [
        [r.name, r.out_tok_s, r.total_tok_s, r.wall_s, f"{r.total_tok_s / ceiling_total:.1%}", r.cpu_s,
         r.out_tok_per_machine_s]
        for r in results
    ]  # fmt: skip
    rows.append(
        [
            "compute ceiling (float32 matmul)",
            wl.num_output_tokens / ceil_s,
            ceiling_total,
            ceil_s,
            "100%",
            "",
            "",
        ]
    )
    header = [
        "system",
        "output tok/s",
        "total tok/s",
        "wall (s)",
        "of ceiling",
        "CPU (s)",
        "output tok/CPU-s x cores",
    ]
    print()
    print(format_table(header, rows))
    if srt_res is not None:
        for base in (hf_static_best, hf_cb_res):
            if base is not None:
                print(
                    f"srt / {base.name}: {srt_res.out_tok_s / base.out_tok_s:.2f}x output tok/s "
                    f"({srt_res.out_tok_per_machine_s / base.out_tok_per_machine_s:.2f}x per CPU second)"
                )
        print(f"srt total tok/s = {srt_res.total_tok_s / ceiling_total:.1%} of the compute ceiling")
    if args.json:
        print(
            json.dumps(
                {
                    "srt_out_tok_s": srt_res.out_tok_s if srt_res else None,
                    "srt_total_tok_s": srt_res.total_tok_s if srt_res else None,
                    "hf_static_out_tok_s": hf_static_best.out_tok_s if hf_static_best else None,
                    "hf_static_batch_size": int(hf_static_best.name.split()[-1][:-1])
                    if hf_static_best
                    else None,
                    "hf_cb_out_tok_s": hf_cb_res.out_tok_s if hf_cb_res else None,
                    "ceiling_total_tok_s": ceiling_total,
                    "srt_out_tok_per_machine_s": srt_res.out_tok_per_machine_s if srt_res else None,
                    "hf_static_out_tok_per_machine_s": hf_static_best.out_tok_per_machine_s
                    if hf_static_best
                    else None,
                    "hf_cb_out_tok_per_machine_s": hf_cb_res.out_tok_per_machine_s if hf_cb_res else None,
                    "date": date,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

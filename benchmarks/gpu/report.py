"""The GPU check's pure parts: the model shapes it benchmarks, FlashInfer's arch string, the
figures as fractions of the device's bounds, test counts, and the Markdown summary (with the
kernels per layer of ``profile_layers`` and the serving runs of ``serving``).

Fractions (each against the bound measured in the same run, ``benchmarks.gpu.bounds``):

    decode   decode_min_bytes[B] / step time / copy bandwidth     (HBM-bound at these batches)
    prefill  prefill_flops / prefill time / bf16 matmul rate      (compute-bound at 2,048 tokens)

where bench_forward.py reports ``decode_min_bytes`` (dense weights once + every sequence's K/V)
and ``prefill_flops``. A fraction near 1 is the hardware's limit; eager decode at small batches
is far below it (launch overhead), which is what CUDA graphs are for.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

# The default model's shapes (SmolLM2-135M-Instruct, as srt reads them from its GGUF header):
# what the GPU check runs with dummy weights when the 94 MiB GGUF is not on the machine.
SMOLLM2_135M: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Llama-3.1-8B's config.json (shapes and rope; weights are seeded random).
LLAMA31_8B: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

MODELS: dict[str, dict] = {"smollm2-135m": SMOLLM2_135M, "llama-3.1-8b": LLAMA31_8B}
BACKENDS = ("flashinfer", "torch_native")


def write_model_config(folder: Path, config: dict) -> Path:
    """A model directory holding only ``config.json`` (for ``--load-format dummy``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def arch_list(major: int, minor: int) -> str:
    """``FLASHINFER_CUDA_ARCH_LIST`` for one device: Hopper and Blackwell datacentre parts need the
    arch-specific ``a`` variant (``9.0a`` on H100/H200); others take the plain number, which
    FlashInfer completes itself."""
    suffix = "a" if major in (9, 10) else ""
    return f"{major}.{minor}{suffix}"


def fractions(bench: dict, bounds: dict) -> dict:
    """Each measured figure of one bench_forward result as a fraction of its bound (see the
    module docstring); figures or bounds missing give no entry."""
    out: dict = {}
    bw = bounds.get("copy_gbs")
    if bw:
        out["decode_hbm_fraction"] = {
            bs: round(bench["decode_min_bytes"][bs] / (ms / 1e3) / (bw * 1e9), 4)
            for bs, ms in bench.get("decode_ms", {}).items()
            if bs in bench.get("decode_min_bytes", {}) and ms > 0
        }
    rate, ms = bounds.get("matmul_tflops"), bench.get("prefill_ms")
    if rate and ms and bench.get("prefill_flops"):
        out["prefill_matmul_fraction"] = round(bench["prefill_flops"] / (ms / 1e3) / (rate * 1e12), 4)
    return out


def speedup(fast: dict, base: dict) -> dict:
    """``base`` time over ``fast`` time per decode batch size and for the prefill."""
    out = {
        bs: round(base["decode_ms"][bs] / ms, 3)
        for bs, ms in fast.get("decode_ms", {}).items()
        if bs in base.get("decode_ms", {}) and ms > 0
    }
    result: dict = {"decode": out}
    if fast.get("prefill_ms") and base.get("prefill_ms"):
        result["prefill"] = round(base["prefill_ms"] / fast["prefill_ms"], 3)
    return result


_OUTCOME = re.compile(r"::\S+ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def count_test_outcomes(log_text: str, junit: Path | None = None) -> dict:
    """passed / failed / skipped / errors of a pytest run: from its JUnit XML when it finished,
    else counted from the ``-v`` lines it printed before it was stopped."""
    if junit is not None and junit.is_file():
        try:
            suite = ET.parse(junit).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            a = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            passed = a["tests"] - a["failures"] - a["errors"] - a["skipped"]
            return {"passed": passed, "failed": a["failures"], "skipped": a["skipped"], "errors": a["errors"]}
        except (ET.ParseError, AttributeError, ValueError):
            pass
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    key = {
        "PASSED": "passed",
        "XPASS": "passed",
        "FAILED": "failed",
        "SKIPPED": "skipped",
        "XFAIL": "skipped",
    }
    for outcome in _OUTCOME.findall(log_text):
        counts[key.get(outcome, "errors")] += 1
    counts["incomplete"] = True
    return counts


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _cell(x: object) -> str:
    return "-" if x is None else str(x)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def bench_table(model: str, entry: dict) -> list[str]:
    """Markdown rows for one model: each backend's time and fraction of its bound."""
    runs = {b: entry.get(b) or {} for b in BACKENDS}
    lines = [f"### {model}: {entry.get('weights', '')}", ""]
    lines.append(
        "| step | " + " | ".join(f"{b} ms | of bound" for b in BACKENDS) + " | flashinfer speed-up |"
    )
    lines.append("|---" * (2 + 2 * len(BACKENDS)) + "|")
    sizes = sorted({bs for r in runs.values() for bs in r.get("decode_ms", {})}, key=int)
    up = entry.get("speedup", {})
    for bs in sizes:
        cells = []
        for b in BACKENDS:
            r = runs[b]
            cells += [
                _ms(r.get("decode_ms", {}).get(bs)),
                _pct(r.get("fractions", {}).get("decode_hbm_fraction", {}).get(bs)),
            ]
        x = up.get("decode", {}).get(bs)
        lines.append(f"| decode bs={bs} | " + " | ".join(cells) + f" | {'-' if x is None else f'{x:.2f}x'} |")
    if any("prefill_ms" in r for r in runs.values()):
        cells = []
        for b in BACKENDS:
            r = runs[b]
            cells += [_ms(r.get("prefill_ms")), _pct(r.get("fractions", {}).get("prefill_matmul_fraction"))]
        x = up.get("prefill")
        n = next((r["prefill_len"] for r in runs.values() if "prefill_len" in r), "")
        lines.append(f"| prefill {n} | " + " | ".join(cells) + f" | {'-' if x is None else f'{x:.2f}x'} |")
    return lines + [""]


def profile_table(profiles: dict) -> list[str]:
    """Markdown: kernels per decode layer, the CUDA profiler's count beside the CPU census's, and
    the kernels of one layer as the profiler names them."""
    lines = ["### Kernels per decode layer, batch 1 (CUDA profiler, CPU census)", ""]
    lines.append("| model | profiler | census | outside the layers: profiler / census | copies per layer |")
    lines.append("|---|---|---|---|---|")
    for model, p in profiles.items():
        cells = [_cell(p.get(k)) for k in ("profiler_kernels_per_layer", "census_kernels_per_layer")]
        cells.append(f"{_cell(p.get('profiler_step_kernels'))} / {_cell(p.get('census_step_kernels'))}")
        cells.append(_cell(p.get("profiler_memops_per_layer")))
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    lines.append("")
    for model, p in profiles.items():
        if p.get("profiler_layer_kernels"):
            kernels = ", ".join(f"{n} x{c}" for n, c in p["profiler_layer_kernels"])
            lines.append(f"- {model}, one layer on the GPU: {kernels}")
        if p.get("census_layer_ops"):
            lines.append(f"- {model}, one layer in the census: {' '.join(p['census_layer_ops'])}")
        if p.get("error"):
            lines.append(f"- {model}: {p['error']}")
    return lines + [""]


def serving_table(serving: dict) -> list[str]:
    """Markdown: each concurrency's throughput and latencies, or why it did not run."""
    head = f"### Serving: {serving.get('model', '')}, {serving.get('input_len')} in / {serving.get('output_len')} out"
    lines = [head, ""]
    if "server_start_s" in serving:
        lines.append(f"server ready after {serving['server_start_s']} s")
    if serving.get("error"):
        lines.append(f"error: {serving['error']}")
    lines += ["", "| concurrency | prompts | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | failed |"]
    lines.append("|---|---|---|---|---|---|")
    for conc, r in serving.get("runs", {}).items():
        asked = r.get("num_prompts_requested")
        prompts = f"{r.get('num_prompts')} of {asked}" if r.get("num_prompts") != asked else str(asked)
        if r.get("status") not in ("ok", "failed") or r.get("output_tok_s") is None:
            lines.append(
                f"| {conc} | {prompts} | {r.get('status')}: {str(r.get('reason', '')).replace('|', '/')} | | | |"
            )
            continue
        ttft, tpot = (
            f"{_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p99_ms'])}",
            f"{_ms(r['tpot_p50_ms'])} / {_ms(r['tpot_p99_ms'])}",
        )
        lines.append(
            f"| {conc} | {prompts} | {r['output_tok_s']:.1f} | {ttft} | {tpot} | {r.get('failed', 0)} |"
        )
    return lines + [""]


def summary_markdown(record: dict) -> str:
    """A short human summary of the check's JSON record."""
    dev = record.get("device", {})
    lines = [f"# srt GPU check: {dev.get('name', 'no CUDA device')}", ""]
    lines.append(
        f"status: {record.get('status')}; started {record.get('started_utc')}; {record.get('elapsed_s')} s"
    )
    lines.append("")
    lines.append("| step | status | s | note |")
    lines.append("|---|---|---|---|")
    for name, s in record.get("steps", {}).items():
        note = (s.get("detail") or "").replace("|", "/").replace("\n", " ")[:120]
        lines.append(f"| {name} | {s['status']} | {s.get('wall_s', '-')} | {note} |")
    lines.append("")
    b = record.get("bounds", {})
    if b:
        lines.append(
            f"bounds: copy {b.get('copy_gbs')} GB/s (read + write), bf16 matmul {b.get('matmul_tflops')} TFLOP/s"
        )
    t = record.get("tests")
    if t:
        lines.append("tests: " + ", ".join(f"{v} {k}" for k, v in t.items() if k != "incomplete"))
    lines.append("")
    for model, entry in record.get("bench", {}).items():
        lines += bench_table(model, entry)
    if record.get("profile"):
        lines += profile_table(record["profile"])
    if record.get("serving"):
        lines += serving_table(record["serving"])
    return "\n".join(lines) + "\n"

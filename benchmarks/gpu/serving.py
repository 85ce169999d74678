"""Online serving on the GPU: the real server under srt's bench_serving at several concurrencies.

    python -m benchmarks.gpu.serving --model-path DIR --json-out FILE --budget-s 280
        [--concurrency 1,16,64] [--prompts 16,128,512] [--input-len 512] [--output-len 256]

``DIR`` gets a Llama-3.1-8B ``config.json`` (``benchmarks.gpu.report.LLAMA31_8B``) unless it has
one, and a word-level tokenizer covering the model's whole vocabulary (``write_word_tokenizer``:
every id a word, so that the server detokenizes whatever the random weights pick, and no
download). ``python -m srt.launch_server --load-format dummy --dtype bfloat16 --device cuda`` is
started on it in this process's group (whoever stops this process's group stops the server too)
and polled on ``/health``; then for each concurrency C ``python -m srt.bench_serving --backend srt
--dataset-name random-ids`` sends its prompts (``--input-len`` token ids each, exactly, and
``--output-len`` new tokens each with ``ignore_eos``), at most C in flight, after one warm-up
request. The server is stopped at the end (SIGTERM, then SIGKILL to what is left of its tree),
also when this process is stopped or runs out of time.

The server runs with ``SERVER_FLAGS``: FlashInfer attention (named, so that a machine where it
cannot run fails instead of measuring torch_native), at most 64 requests, CUDA graphs up to batch
64 and a KV pool of 131,072 tokens (a shorter start than the defaults' graphs up to batch 256 and
profiled pool).

Prompts per concurrency. The issue asks for 512 each; at concurrency 1 that is 512 x 256 decode
steps, about 15 minutes at 7 ms a step. The defaults, 16 / 128 / 512 at 1 / 16 / 64, are 16, 8
and 8 waves of 256 steps, 8,192 steps in all: 57 s at 7 ms a step, 147 s at 18 ms (the range of an
8B decode step on an H200 from batch 1 to 64 with the server's own work), plus the prefills
(335,000 tokens), each run's start and warm-up, and the server's start-up: two to four and a half
minutes in all. Before each run the count is cut (to whole waves) to what fits in the time left at the
pessimistic rate (``estimate_s``), keeping one wave for each run after it; a run that cannot fit
one wave is skipped with the reason. The count used is recorded.

JSON (rewritten after each run): ``model``, ``device``, ``input_len``, ``output_len``,
``vocab_size``, ``server_argv``, ``server_start_s``, ``server_exit``, and ``runs`` {"<C>": {"status",
"num_prompts", "num_prompts_requested", "completed", "failed", "duration_s", "output_tok_s",
"request_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms",
"errors"}}; a skipped or failed run has ``status`` and ``reason``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu import report
from benchmarks.server_health import free_port, wait_healthy

CONCURRENCY = (1, 16, 64)
PROMPTS = (16, 128, 512)
INPUT_LEN, OUTPUT_LEN = 512, 256
STEP_S = 0.018  # pessimistic 8B decode step on an H200 under the server, batch 1 to 64
PREFILL_TOK_S = 20000.0  # pessimistic prefill rate of the server at 512-token prompts
RUN_OVERHEAD_S = 15.0  # bench_serving's start (imports, tokenizer), warm-up and drain
STOP_S = 15.0  # kept back at the end to stop the server and write the JSON
LAUNCH_S = 5.0  # this script's own start and exit, outside its --budget-s
# in ``make gpu-check``: the server's start (about a minute) and the runs (1.5 to 3.5 minutes at
# the defaults); skipped with less than CHECK_MIN_S left, and with less than CHECK_BUDGET_S the
# runs are cut to fit
CHECK_BUDGET_S, CHECK_MIN_S = 330.0, 150.0
STARTUP_S = 240.0  # at most, for the server to answer /health
SERVER_FLAGS = [
    "--attention-backend",
    "flashinfer",
    "--max-running-requests",
    "64",
    "--cuda-graph-max-bs",
    "64",
]
SERVER_FLAGS += ["--max-total-tokens", "131072"]


def check_step(py: str, run_dir: Path, left_s: float) -> tuple:
    """``make gpu-check``'s serving step, ``(name, argv, budget_s, min_s, result file, extra)``: the
    script is told the budget it will get (``CHECK_BUDGET_S``, or what is left of the run's when
    less), less a few seconds for its own start and exit."""
    budget = min(CHECK_BUDGET_S, left_s) - LAUNCH_S
    out = run_dir / "serving.json"
    folder = run_dir / "models" / "llama-3.1-8b"  # the bench's config; the tokenizer is added
    argv = [py, "-m", "benchmarks.gpu.serving", "--model-path", str(folder), "--json-out", str(out)]
    argv += ["--budget-s", f"{max(budget, 1.0):.0f}"]
    return ("serving", argv, CHECK_BUDGET_S, CHECK_MIN_S, out, {})


def estimate_s(prompts: int, concurrency: int, input_len: int, output_len: int) -> float:
    """Seconds one bench_serving run takes at the pessimistic rates above."""
    waves = math.ceil(prompts / concurrency)
    return RUN_OVERHEAD_S + waves * output_len * STEP_S + prompts * input_len / PREFILL_TOK_S


def fit_prompts(prompts: int, concurrency: int, left_s: float, input_len: int, output_len: int) -> int:
    """The most prompts, at most ``prompts`` and in whole waves of ``concurrency`` (or all of
    ``prompts`` when fewer), whose run fits in ``left_s``; 0 when not even one wave fits."""
    n = prompts
    while n > 0 and estimate_s(n, concurrency, input_len, output_len) > left_s:
        n = (math.ceil(n / concurrency) - 1) * concurrency
    return max(n, 0)


def plan_run(i: int, plan: list[tuple[int, int]], left_s: float, input_len: int, output_len: int) -> int:
    """Prompts for run ``i`` of ``plan`` ([(concurrency, prompts)]) with ``left_s`` to go, one wave
    of every later run kept back."""
    later = sum(estimate_s(min(c, p), c, input_len, output_len) for c, p in plan[i + 1 :])
    conc, prompts = plan[i]
    return fit_prompts(prompts, conc, left_s - later, input_len, output_len)


def serving_entry(line: dict) -> dict:
    """One run's figures from bench_serving's JSON line (``--output-file``)."""
    return {
        "status": "ok" if line.get("completed") and not line.get("failed") else "failed",
        "num_prompts": line.get("num_prompts"),
        "completed": line.get("completed"),
        "failed": line.get("failed"),
        "duration_s": _r(line.get("duration_s")),
        "output_tok_s": _r(line.get("output_throughput")),
        "request_per_s": _r(line.get("request_throughput"), 3),
        "ttft_p50_ms": _r(line.get("median_ttft_ms")),
        "ttft_p99_ms": _r(line.get("p99_ttft_ms")),
        "tpot_p50_ms": _r(line.get("median_tpot_ms"), 3),
        "tpot_p99_ms": _r(line.get("p99_tpot_ms"), 3),
        "itl_p50_ms": _r(line.get("median_itl_ms"), 3),
        "errors": list(line.get("errors") or []),
    }


def _r(x: float | None, digits: int = 2) -> float | None:
    return None if x is None else round(float(x), digits)


def word(k: int) -> str:
    """The k-th lowercase word of two or more letters (aa, ab, ..., zz, aaa, ...)."""
    n = 2
    while k >= 26**n:
        k, n = k - 26**n, n + 1
    letters = []
    for _ in range(n):
        k, r = divmod(k, 26)
        letters.append(string.ascii_lowercase[r])
    return "".join(reversed(letters))


def write_word_tokenizer(folder: Path, vocab_size: int, bos_id: int, eos_id: int) -> None:
    """A fast tokenizer of ``vocab_size`` ids in ``folder``: id 0 ``<unk>``, ``bos_id`` ``<s>``,
    ``eos_id`` ``</s>``, every other id a word (``▁`` + letters, split on spaces), so that any id
    decodes and words re-tokenize to the same ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = {0: "<unk>", bos_id: "<s>", eos_id: "</s>"}
    vocab, k = {}, 0
    for i in range(vocab_size):
        if i in special:
            vocab[special[i]] = i
        else:
            vocab["\u2581" + word(k)] = i
            k += 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(folder))


def prepare_model(folder: Path) -> dict:
    """``folder`` with a config (the 8B shape unless one is there) and a tokenizer; its config."""
    if not (folder / "config.json").is_file():
        report.write_model_config(folder, report.LLAMA31_8B)
    config = json.loads((folder / "config.json").read_text())
    if not (folder / "tokenizer.json").is_file():
        eos = config.get("eos_token_id", 2)
        eos = eos[0] if isinstance(eos, list) else eos
        write_word_tokenizer(folder, config["vocab_size"], config.get("bos_token_id", 1), eos)
    return config


def server_argv(py: str, model: Path, port: int, device: str, extra: list[str]) -> list[str]:
    argv = [py, "-m", "srt.launch_server", "--model-path", str(model), "--load-format", "dummy"]
    argv += ["--dtype", "bfloat16", "--device", device, "--host", "127.0.0.1", "--port", str(port)]
    return argv + extra


def bench_argv(
    py: str, url: str, model: Path, conc: int, prompts: int, lens: tuple[int, int], out: Path
) -> list[str]:
    argv = [py, "-m", "srt.bench_serving", "--backend", "srt", "--base-url", url, "--tokenizer", str(model)]
    argv += ["--dataset-name", "random-ids", "--random-input-len", str(lens[0]), "--random-output-len"]
    argv += [str(lens[1]), "--random-range-ratio", "1.0", "--num-prompts", str(prompts)]
    return argv + ["--max-concurrency", str(conc), "--seed", "1", "--disable-tqdm", "--output-file", str(out)]


def stop_server(proc: subprocess.Popen, grace_s: float = 10.0) -> int | None:
    """SIGTERM to the server (it drains and stops its children), then SIGKILL to whatever is left
    of its process tree after ``grace_s``; its exit status."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        code = None
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return proc.wait() if code is None else code


def run_bench(argv: list[str], out: Path, timeout_s: float) -> dict:
    """One bench_serving run: its entry (``serving_entry``), or ``status`` and ``reason``."""
    out.unlink(missing_ok=True)
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": f"bench_serving stopped after {timeout_s:.0f} s"}
    print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n", flush=True)
    lines = out.read_text().splitlines() if out.is_file() else []
    if not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        return {"status": "failed", "reason": f"exit status {proc.returncode}: {tail[0][:300]}"}
    return serving_entry(json.loads(lines[-1]))


def run_plan(args: argparse.Namespace, url: str, result: dict, deadline: float) -> None:
    """Each (concurrency, prompts) of the plan in turn, cut to the time left (``plan_run``)."""
    plan = list(zip(args.concurrency, args.prompts))
    lens = (args.input_len, args.output_len)
    out = Path(args.json_out or "serving.json").with_suffix(".bench.jsonl")
    for i, (conc, prompts) in enumerate(plan):
        left = deadline - time.monotonic() - STOP_S
        n = plan_run(i, plan, left, *lens)
        if n == 0:
            need = estimate_s(min(conc, prompts), conc, *lens)
            entry = {"status": "skipped", "reason": f"{left:.0f} s left, one wave needs {need:.0f} s"}
        else:
            print(f"concurrency {conc}: {n} prompts ({prompts} asked), {left:.0f} s left", flush=True)
            argv = bench_argv(sys.executable, url, Path(args.model_path), conc, n, lens, out)
            entry = run_bench(argv, out, max(left, 1.0))
        result["runs"][str(conc)] = {"num_prompts_requested": prompts, "num_prompts": n, **entry}
        write_json(args.json_out, result)


def write_json(path: str | None, data: dict) -> None:
    if path:
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True, help="folder for config.json and the tokenizer")
    ap.add_argument("--json-out", default=None)
    ap.add_argument(
        "--budget-s", type=float, default=280.0, help="the whole run, server start and stop included"
    )
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--concurrency", type=_ints, default=list(CONCURRENCY))
    ap.add_argument("--prompts", type=_ints, default=list(PROMPTS), help="prompts per concurrency")
    ap.add_argument("--input-len", type=int, default=INPUT_LEN)
    ap.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    ap.add_argument("--server-args", default=shlex.join(SERVER_FLAGS), help="more launch_server flags")
    ap.add_argument("--server-log", default=None, help="the server's output (default: beside --json-out)")
    args = ap.parse_args(argv)
    if len(args.prompts) != len(args.concurrency):
        ap.error("--prompts needs one count per --concurrency")
    return args


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    model = Path(args.model_path)
    config = prepare_model(model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_argv(sys.executable, model, port, args.device, shlex.split(args.server_args))
    result: dict = {"model": model.name, "device": args.device, "input_len": args.input_len}
    result.update(output_len=args.output_len, vocab_size=config["vocab_size"], server_argv=cmd[1:], runs={})
    log_path = Path(args.server_log or Path(args.json_out or "serving.json").with_suffix(".server.log"))
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait = min(STARTUP_S, deadline - time.monotonic() - STOP_S)
        result["server_start_s"] = round(wait_healthy(url + "/health", proc, wait), 1)
        write_json(args.json_out, result)
        run_plan(args, url, result, deadline)
    except RuntimeError as e:
        result["error"] = str(e)
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        print(f"{e}; the server's log ends:", *tail, sep="\n", flush=True)
    finally:
        result["server_exit"] = stop_server(proc)
        write_json(args.json_out, result)
    print(json.dumps(result))
    ok = "error" not in result and all(r["status"] in ("ok", "skipped") for r in result["runs"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

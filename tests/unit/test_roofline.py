"""benchmarks/roofline.py: the least cost of a traced step for a model shape, and a run's sums."""

from __future__ import annotations

import json

import pytest

from benchmarks import model_shapes, roofline
from srt.managers.scheduler.step_timing import step_work


def brute_pairs(prefix: int, new: int) -> int:
    return sum(prefix + i + 1 for i in range(new))  # token i attends to the prefix and itself


@pytest.mark.parametrize("lens", [([0], [7]), ([5, 0, 31], [1, 16, 1]), ([100], [1])])
def test_step_work_counts_causal_pairs(lens):
    prefix, new = lens
    w = step_work(prefix, new)
    assert w == {
        "rows": len(new),
        "tokens": sum(new),
        "kv": sum(prefix) + sum(new),
        "pairs": sum(brute_pairs(p, n) for p, n in zip(prefix, new)),
    }


def test_costs_of_the_bf16_shape():
    shape = model_shapes.load("qwen2.5-1.5b-bf16")
    c = roofline.StepCosts.of_shape(shape)
    cfg = shape.config
    dec, head = model_shapes.matrix_elements(shape)
    assert c.weight_bytes == model_shapes.weight_bytes_per_token(shape)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    # K and V, every layer, bf16
    assert c.kv_bytes_per_token == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2
    assert c.flops_per_token == 2 * dec and c.flops_per_row == 2 * head
    # the float32 shape's KV takes 4 bytes an element
    f32 = roofline.StepCosts.of_shape(model_shapes.load("qwen2.5-1.5b"))
    assert f32.kv_bytes_per_token == 2 * c.kv_bytes_per_token


def test_a_single_row_is_read_bound_and_a_prefill_compute_bound():
    c = roofline.StepCosts.of_shape(model_shapes.load("qwen2.5-1.5b-bf16"))
    read_bps, flops = 50e9, 1e12
    decode = {"rows": 1, "tokens": 1, "kv": 300, "pairs": 300}
    t, which = c.bound_s(decode, read_bps, flops)
    assert which == "read" and t == pytest.approx((c.weight_bytes + 300 * c.kv_bytes_per_token) / read_bps)
    prefill = step_work([0], [2048])
    t, which = c.bound_s(prefill, read_bps, flops)
    want = (2048 * c.flops_per_token + c.flops_per_row + prefill["pairs"] * c.flops_per_pair) / flops
    assert which == "compute" and t == pytest.approx(want)


def test_summary_of_a_trace_window(tmp_path):
    c = roofline.StepCosts(
        weight_bytes=1e9, kv_bytes_per_token=0.0, flops_per_token=1e9, flops_per_row=0.0, flops_per_pair=0.0
    )
    # at 1 GB/s and 1 GFLOP/s: a decode of 1 row is bound at 1 s (read), an extend of 4 tokens at 4 s
    steps = [
        {
            "t": 10.0,
            "step_s": 2.0,
            "forward_s": 1.5,
            "mode": "decode",
            "rows": 1,
            "tokens": 1,
            "kv": 5,
            "pairs": 5,
        },
        {
            "t": 12.0,
            "step_s": 5.0,
            "forward_s": 4.0,
            "mode": "extend",
            "rows": 1,
            "tokens": 4,
            "kv": 4,
            "pairs": 10,
        },
        {
            "t": 30.0,
            "step_s": 1.0,
            "forward_s": 1.0,
            "mode": "decode",
            "rows": 1,
            "tokens": 1,
            "kv": 6,
            "pairs": 6,
        },
    ]
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))
    window = roofline.load_steps(path, start=9.0, end=20.0)
    assert [s["t"] for s in window] == [10.0, 12.0]
    g = roofline.summarize(window, c, read_gbs=1.0, matmul_gflops=1.0)
    assert g["all"]["bound_s"] == pytest.approx(5.0) and g["all"]["step_s"] == pytest.approx(7.0)
    assert g["all"]["roofline_fraction"] == pytest.approx(5 / 7, abs=1e-3)
    assert g["all"]["forward_fraction"] == pytest.approx(5 / 5.5, abs=1e-3)
    assert g["all"]["span_s"] == pytest.approx(7.0)
    assert g["decode"]["read_bound_steps"] == 1 and g["extend"]["compute_bound_steps"] == 1
    assert g["extend"]["roofline_fraction"] == pytest.approx(0.8)
    assert "| all " in roofline.table(g)

"""benchmarks/common.py: the seeded offline workload, its FLOP count and the ceiling arithmetic."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "common.py"
_spec = importlib.util.spec_from_file_location("bench_common", _PATH)
common = importlib.util.module_from_spec(_spec)
sys.modules["bench_common"] = common  # dataclasses look their module up while the class is built
_spec.loader.exec_module(common)

# L=2 layers, hidden 4, intermediate 8, 2 heads, 1 kv head, head_dim 2, vocab 10
SHAPE = common.ModelShape(2, 4, 8, 2, 1, 2, 10)


def test_layer_shapes_and_params():
    assert SHAPE.layer_matmuls() == {"qkv": (4, 8), "o": (4, 4), "gate_up": (4, 16), "down": (8, 4)}
    assert SHAPE.layer_weight_params == 2 * (32 + 16 + 64 + 32)


def test_workload_flops_by_hand():
    # one sequence, P=3 prompt and O=2 output tokens: 4 positions run
    f = common.workload_flops(SHAPE, [3], [2])
    assert f["linear"] == 2 * 288 * 4
    assert f["lm_head"] == 2 * 4 * 10 * 2
    # prefill attends 1+2+3 positions, the one decode step 4: ctx sum 10
    assert f["attention"] == 4 * 2 * 2 * 2 * 10
    two = common.workload_flops(SHAPE, [3, 3], [2, 2])
    assert two == {k: 2 * v for k, v in f.items()}


def test_ceiling_takes_the_best_rate_of_each_part():
    rates = {64: {"layer": 100.0, "lm_head": 10.0}, 256: {"layer": 200.0, "lm_head": 5.0}}
    flops = {"linear": 1000.0, "attention": 200.0, "lm_head": 100.0}
    assert common.ceiling_seconds(flops, rates) == pytest.approx(1200 / 200 + 100 / 10)


def test_workload_is_seeded_and_in_range():
    wl = common.make_workload(200, (32, 512), (16, 256), 1000, seed=7, excluded_ids=[0, 1, 2])
    again = common.make_workload(200, (32, 512), (16, 256), 1000, seed=7, excluded_ids=[0, 1, 2])
    other = common.make_workload(200, (32, 512), (16, 256), 1000, seed=8, excluded_ids=[0, 1, 2])
    assert wl.input_ids == again.input_ids and wl.output_lens == again.output_lens
    assert wl.input_ids != other.input_ids
    assert all(32 <= n <= 512 for n in wl.input_lens) and all(16 <= o <= 256 for o in wl.output_lens)
    assert not {t for ids in wl.input_ids for t in ids} & {0, 1, 2}
    assert wl.num_input_tokens == sum(wl.input_lens) and wl.num_output_tokens == sum(wl.output_lens)
    with pytest.raises(ValueError):
        common.make_workload(1, (10, 5), (1, 2), 100, 0)


def test_format_table():
    t = common.format_table(["a", "b"], [["x", 1.25], ["y", 3]])
    assert t.splitlines() == ["| a | b |", "|---|---|", "| x | 1.2 |", "| y | 3 |"]

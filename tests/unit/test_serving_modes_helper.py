"""The helper of tests/gpu/test_serving_modes_gpu.py on the CPU, as the GPU machine runs it:
without the default model's package it serves a model of the default model's shapes with seeded
random weights and prompts of seeded random ids, and each prompt alone gives the same greedy
tokens with overlap scheduling on and off, and with speculative decoding. The request-to-token
table is a ``DeviceLikeTensor`` there, so host code that would fail on a CUDA table (an
implicit numpy conversion) fails here too."""

from __future__ import annotations

import pytest

import tests.gpu.test_serving_modes_gpu as modes
from tests.helpers.device_like import device_like_pools


@pytest.fixture
def without_default_model(monkeypatch):
    monkeypatch.setattr(modes, "HAS_DEFAULT_MODEL", False)


@pytest.fixture
def device_like(monkeypatch):
    device_like_pools(monkeypatch)


def test_prompts_without_the_default_model_are_seeded_ids_in_its_vocabulary(without_default_model):
    from benchmarks.gpu.report import SMOLLM2_135M

    first, again = modes.prompts(), modes.prompts()
    assert first == again
    assert [len(p) for p in first] == list(modes.PROMPT_LENGTHS)
    assert all(0 <= t < SMOLLM2_135M["vocab_size"] for p in first for t in p)
    assert len({tuple(p[:12]) for p in first}) == len(first)


def test_greedy_alone_on_cpu_with_and_without_overlap(without_default_model, device_like, tmp_path):
    model = modes.model_kw(tmp_path / "shapes")
    assert model["load_format"] == "dummy"
    plain = modes.greedy_alone("cpu", disable_overlap_schedule=True, **model)
    overlapped = modes.greedy_alone("cpu", enable_overlap_schedule=True, **model)
    assert all(len(out) == modes.MAX_NEW for out in plain)
    assert overlapped == plain


def test_greedy_alone_on_cpu_with_speculation(without_default_model, device_like, tmp_path):
    """The speculative check of the GPU module on the CPU: the same tokens, drafts accepted."""
    model = modes.model_kw(tmp_path / "shapes")
    plain = modes.greedy_alone("cpu", **model)
    stats: dict = {}
    spec = modes.greedy_alone("cpu", stats, speculative_algorithm="NGRAM", **model)
    assert spec == plain
    assert stats["num_verify_tokens"] > stats["num_verify_steps"], stats

"""Mixture-of-experts families through the real Engine (tiny random models, no tokenizer): greedy
outputs equal transformers' ``generate`` of each prompt alone, for prompts sent as one batch
(routing is per token: a request's tokens do not depend on its batch) and one at a time.
Qwen2-MoE (shared expert), Qwen3-MoE (top-4, renormalised) and Mixtral, each from safetensors and
from a Q8_0 GGUF with its experts kept in their blocks."""

from __future__ import annotations

import os

import pytest

from srt import Engine
from tests.helpers.hf_reference import assert_tokens_match, hf_greedy_references, make_prompts
from tests.helpers.ref_cache import hf_folder_references
from tests.helpers.tiny_moe import save_tiny_moe, save_tiny_moe_gguf

MAX_NEW_TOKENS = 16
GREEDY = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
PROMPTS = make_prompts([3, 11, 40, 90], seed=13, vocab_size=320)


def _check(outputs: list[list[int]], refs) -> None:
    near_ties = sum(
        assert_tokens_match(out, ref.token_ids, ref.top_logprobs) for out, ref in zip(outputs, refs)
    )
    assert near_ties <= 1


def _run(model_path: str, refs, **engine_kw) -> None:
    llm = Engine(
        model_path=model_path,
        skip_tokenizer_init=True,
        max_total_tokens=2048,
        log_level="warning",
        **engine_kw,
    )
    try:
        batch = llm.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        _check([o["output_ids"] for o in batch], refs)
        alone = [llm.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS[:2]]
        _check(alone, refs[:2])
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_engine_greedy_matches_transformers(tmp_path, kind):
    path = save_tiny_moe(kind, tmp_path / kind, seed=21)
    _run(path, hf_folder_references(path, PROMPTS, MAX_NEW_TOKENS))


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_engine_gguf_experts_quantized_match_transformers(tmp_path, kind):
    path, hf = save_tiny_moe_gguf(kind, os.path.join(tmp_path, "m.gguf"), "Q8_0", seed=22)
    _run(path, hf_greedy_references(None, PROMPTS, MAX_NEW_TOKENS, lambda: hf), quantization="gguf")

"""Greedy generation of tiny Phi-3 models through the real Engine against transformers'
``generate``, each prompt alone.

Two models: Phi-4-mini's layout (partial rotary 0.75, longrope; prompts and outputs stay within
the original context of 64, where srt's rope is exactly transformers') and Phi-3-mini-4k's (full
rotary, sliding window 9, far shorter than the prompts). Both on the torch_native attention
backend is the default (fused_cpu: the native kernels' windows), one batch of prompts per Engine (so prompts share batches in srt).
"""

from __future__ import annotations

import torch

from srt import Engine
from tests.helpers.hf_reference import assert_tokens_match, hf_greedy_references, make_prompts
from tests.helpers.tiny_phi3 import WINDOW_OVERRIDES, save_tiny_phi3, save_tiny_phi3_gguf

MAX_NEW_TOKENS = 16
GREEDY = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def _check_engine_matches_transformers(path: str, prompts: list[list[int]], hf=None) -> None:
    def load_hf():
        from transformers import AutoModelForCausalLM

        return (
            hf if hf is not None else AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        )

    refs = hf_greedy_references(None, prompts, MAX_NEW_TOKENS, load_hf)
    llm = Engine(
        model_path=path,
        skip_tokenizer_init=True,
        max_total_tokens=2048,
        log_level="warning",
    )
    try:
        outs = llm.generate(input_ids=prompts, sampling_params=GREEDY)
    finally:
        llm.shutdown()
    near_ties = sum(
        assert_tokens_match(o["output_ids"], r.token_ids, r.top_logprobs)
        for o, r in zip(outs, refs, strict=True)
    )
    assert near_ties <= 1


def test_phi4_mini_layout_greedy_matches_transformers(tmp_path):
    path = save_tiny_phi3(tmp_path / "phi4mini", seed=12)
    prompts = make_prompts([3, 17, 30, 45], seed=3, vocab_size=320)  # + 16 outputs < 64
    _check_engine_matches_transformers(path, prompts)


def test_phi3_window_layout_greedy_matches_transformers(tmp_path):
    path = save_tiny_phi3(tmp_path / "phi3win", seed=13, **WINDOW_OVERRIDES)
    prompts = make_prompts([4, 25, 60, 120], seed=4, vocab_size=320)
    _check_engine_matches_transformers(path, prompts)


def test_phi4_mini_layout_from_gguf_greedy_matches_transformers(tmp_path):
    """A Q8_0 GGUF (fused qkv and gate_up blocks kept quantized, rope factors as tensors)."""
    path, hf = save_tiny_phi3_gguf(tmp_path / "phi4mini.gguf", "Q8_0", seed=14)
    prompts = make_prompts([5, 20, 40], seed=5, vocab_size=320)
    _check_engine_matches_transformers(path, prompts, hf.eval())

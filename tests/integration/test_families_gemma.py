"""Gemma 2 / Gemma 3 through the real Engine (scheduler process, radix cache, chunked prefill):
greedy outputs equal transformers' ``generate`` of each prompt alone.

Tiny random models (tests/helpers/tiny_gemma.py: sliding window 8 between global layers; Gemma 2
soft-capped), from safetensors and from a Q8_0 GGUF (blocks kept quantized), on the default
attention backend (the native kernels' windows and caps). Prompts of 3 to 70 tokens cross the window; ``chunked_prefill_size`` 16 cuts the
long ones into chunks that each start inside the previous chunk's window; a second group of
prompts shares a 40-token prefix and is sent one after another, so the later ones reuse the
cached prefix (``cached_tokens``, whole KV pages of it) and attend through the window into it.
"""

from __future__ import annotations

import pytest

from srt import Engine
from tests.helpers.hf_reference import (
    assert_tokens_match,
    hf_greedy_references,
    make_prompts,
    make_shared_prefix_group,
)
from tests.helpers.ref_cache import hf_folder_references
from tests.helpers.tiny_gemma import GEMMA_KINDS, hf_model_with, save_tiny_gemma, save_tiny_gemma_gguf

MAX_NEW_TOKENS = 20
GREEDY = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
VOCAB = 320
PREFIX = 40
WINDOW = 8  # tiny_gemma's sliding_window


def _model(kind: str, fmt: str, tmp_path):
    """``(model path, loader of the transformers model with the same weights)``; no loader for a
    safetensors folder, whose references ``hf_folder_references`` loads and caches."""
    if fmt == "gguf":  # Q8_0 blocks kept quantized; transformers runs their dequantized values
        path, cfg, state = save_tiny_gemma_gguf(kind, tmp_path / f"{kind}.gguf", "Q8_0", seed=7)
        return path, lambda: hf_model_with(cfg, state)
    return save_tiny_gemma(kind, tmp_path / kind, seed=7), None  # references cached by its bytes


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("kind", GEMMA_KINDS)
def test_greedy_outputs_match_transformers(tmp_path, kind, fmt):
    path, load_hf = _model(kind, fmt, tmp_path)
    batch = make_prompts([3, 9, 30, 70], seed=1, vocab_size=VOCAB)
    shared = make_shared_prefix_group(PREFIX, [5, 12, 30], seed=2, vocab_size=VOCAB)
    if load_hf is None:
        refs = hf_folder_references(path, batch + shared, MAX_NEW_TOKENS, attn_implementation="eager")
    else:
        refs = hf_greedy_references(None, batch + shared, MAX_NEW_TOKENS, load_hf)
    llm = Engine(
        model_path=path,
        skip_tokenizer_init=True,
        chunked_prefill_size=16,
        max_total_tokens=4096,
        log_level="warning",
    )
    try:
        outs = llm.generate(input_ids=batch, sampling_params=GREEDY)
        outs += [llm.generate(input_ids=p, sampling_params=GREEDY) for p in shared]
    finally:
        llm.shutdown()
    near_ties = sum(
        assert_tokens_match(o["output_ids"], r.token_ids, r.top_logprobs) for o, r in zip(outs, refs)
    )
    assert near_ties <= 1
    # the later shared-prefix prompts reused whole pages of the prefix, more than a window's worth
    assert all(o["meta_info"]["cached_tokens"] > 2 * WINDOW for o in outs[len(batch) + 1 :])

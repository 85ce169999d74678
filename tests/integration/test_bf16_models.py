"""bf16 checkpoints through the real Engine with default flags: ``--dtype auto`` follows the
checkpoint (bf16 where this CPU computes in bf16, float32 activations on bf16 weights elsewhere;
srt/configs/cpu_dtype.py), and greedy outputs equal transformers' ``generate`` of each prompt
alone on the same weights in the dtype srt chose, up to one explained near-tie.

Tiny random models (Llama with llama3 rope scaling, Qwen2 with qkv bias and a tied head, Gemma 2
with sliding windows and soft-caps, Qwen2-MoE with a shared expert; Llama and Gemma 2 again with
head dim 64, the native extend kernel's), saved in bf16 as the Hub's
checkpoints are; prompts sent as one batch (prefill and decode mixed in one step) and prompts
sharing a prefix sent one after another (extends on a cached prefix), through chunked prefill.
"""

from __future__ import annotations

import pytest
import torch

from srt import Engine
from srt.configs.cpu_features import cpu_bf16_units
from tests.helpers.hf_reference import (
    assert_tokens_match,
    make_prompts,
    make_shared_prefix_group,
)
from tests.helpers.ref_cache import hf_folder_references
from tests.helpers.tiny_gemma import build_tiny_gemma
from tests.helpers.tiny_models import build_tiny_hf_model, save_hf_dir
from tests.helpers.tiny_moe import build_tiny_moe

MAX_NEW_TOKENS = 16
GREEDY = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
BUILDERS = {
    "llama": lambda: build_tiny_hf_model("llama", seed=5),
    "qwen2": lambda: build_tiny_hf_model("qwen2", seed=5),
    "gemma2": lambda: build_tiny_gemma("gemma2", seed=5),
    "qwen2_moe": lambda: build_tiny_moe("qwen2_moe", seed=5),
    # head dim 64: extends through the native kernel (bf16 on vdpbf16ps where the CPU's is fast),
    # with Gemma 2's sliding windows and soft-caps; head dim 16 above takes SDPA
    "llama_d64": lambda: build_tiny_hf_model(
        "llama", seed=5, hidden_size=128, num_attention_heads=2, num_key_value_heads=1
    ),
    "gemma2_d64": lambda: build_tiny_gemma("gemma2", seed=5, head_dim=64, query_pre_attn_scalar=64),
}


def _save_bf16(kind: str, path) -> str:
    model = BUILDERS[kind]().to(torch.bfloat16)
    return save_hf_dir(model, path)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_bf16_checkpoint_serves_in_the_dtype_auto_picks_and_matches_transformers(tmp_path, kind):
    path = _save_bf16(kind, tmp_path / kind)
    batch = make_prompts([3, 9, 30, 70], seed=1, vocab_size=320)
    shared = make_shared_prefix_group(24, [5, 20], seed=2, vocab_size=320)
    llm = Engine(
        model_path=path,
        skip_tokenizer_init=True,
        chunked_prefill_size=32,
        max_total_tokens=2048,
        log_level="warning",
    )
    try:
        dtype = llm.server_args.dtype
        assert dtype == ("bfloat16" if cpu_bf16_units() else "float32")  # the bf16 probe passes here
        assert llm.server_args.kv_cache_dtype == dtype
        outs = llm.generate(input_ids=batch, sampling_params=GREEDY)
        outs += [llm.generate(input_ids=p, sampling_params=GREEDY) for p in shared]
    finally:
        llm.shutdown()
    kw = {"attn_implementation": "eager"} if kind.startswith("gemma2") else {}
    refs = hf_folder_references(path, batch + shared, MAX_NEW_TOKENS, getattr(torch, dtype), **kw)
    gaps = []
    for o, r in zip(outs, refs):
        if assert_tokens_match(o["output_ids"], r.token_ids, r.top_logprobs):
            t = next(t for t, (a, b) in enumerate(zip(o["output_ids"], r.token_ids)) if a != b)
            gaps.append(abs(r.top_logprobs[t][r.token_ids[t]] - r.top_logprobs[t][o["output_ids"][t]]))
    # bf16 logits are rounded to 8 bits: two candidates often have the very same logit in the
    # reference (gap 0: transformers takes the lower id, and srt's float32 sums may round one of
    # them a bf16 ulp up); such exact ties are explained by the reference itself. At most one
    # divergence at a gap above 0 (and below NEAR_TIE, which assert_tokens_match checked).
    assert sum(g > 0 for g in gaps) <= 1, gaps
    assert outs[-1]["meta_info"]["cached_tokens"] >= 16  # the second shared-prefix prompt reused the prefix

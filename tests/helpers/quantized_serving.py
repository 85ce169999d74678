"""Serve a quantized checkpoint through the real Engine and compare its greedy tokens with a
reference model's (the near-tie rule of tests/helpers/hf_reference.py)."""

from __future__ import annotations

from srt import Engine
from tests.helpers.hf_reference import NEAR_TIE, assert_tokens_match, hf_greedy_references

MAX_NEW_TOKENS = 12
GREEDY = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def serve_and_match(
    path: str,
    batch: list,
    load_ref,
    served_as: str | None,
    weight_dtype: str = "float32",
    act_dtype: str = "float32",
    near_tie: float = NEAR_TIE,
    max_ties: int = 1,
    **engine_kw,
) -> None:
    """Greedy tokens of ``batch`` through the Engine on ``path`` equal ``load_ref()``'s (near-tie
    rule: at most ``max_ties`` prompts diverge, each at a gap below ``near_tie``); ``served_as``: the
    resolved --quantization, with activations in ``act_dtype`` and the weights stored in
    ``weight_dtype`` (bfloat16 only where that holds the checkpoint's values exactly: a bf16
    checkpoint's float tensors, FP8 codes)."""
    llm = Engine(
        model_path=path, skip_tokenizer_init=True, max_total_tokens=1024, log_level="warning", **engine_kw
    )
    try:
        if served_as is not None:
            assert (llm.server_args.quantization, llm.server_args.dtype) == (served_as, act_dtype)
            assert llm.server_args.weight_dtype == weight_dtype
        outs = llm.generate(input_ids=batch, sampling_params=GREEDY)
    finally:
        llm.shutdown()
    refs = hf_greedy_references(None, batch, MAX_NEW_TOKENS, load_ref)
    ties = sum(
        assert_tokens_match(o["output_ids"], r.token_ids, r.top_logprobs, near_tie)
        for o, r in zip(outs, refs)
    )
    assert ties <= max_ties

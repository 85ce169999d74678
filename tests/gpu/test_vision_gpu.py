"""Image requests on a CUDA device: the vision tower and M-RoPE extends on CUDA, decode steps of
image requests beside CUDA graphs (text rows replay graphs, steps with M-RoPE rows run eagerly).

A tiny random Qwen2-VL (``tests/helpers/tiny_vlm.py``, whose outputs the CPU suite holds to
transformers'): greedy tokens of a mixed batch (two-image, one-image and text-only prompts) on CUDA
in float32 equal the same batch on the CPU up to near-ties of the CPU run's logprobs; a bf16 run
with FlashInfer and CUDA graphs serves the same mix to the end. Skipped without CUDA.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from srt.managers.io_struct import TokenizedGenerateReqInput
from srt.managers.scheduler import Scheduler
from srt.multimodal.image_io import image_hash
from srt.multimodal.processor import create_image_processor
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from tests.helpers.hf_reference import assert_tokens_match
from tests.helpers.scheduler_runs import drain

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_NEW = 12


def _requests(path: str) -> list[TokenizedGenerateReqInput]:
    from transformers import AutoConfig, AutoTokenizer

    from tests.helpers.tiny_vlm import load_images_for_test

    tok = AutoTokenizer.from_pretrained(path)
    proc = create_image_processor(path, AutoConfig.from_pretrained(path), tok)
    assert proc is not None
    ph = "<|vision_start|><|image_pad|><|vision_end|>"
    images = load_images_for_test(3, seed=5)
    prompts = [
        (f"Compare {ph} with {ph} please", images[:2]),
        (f"What is in {ph}?", images[2:]),
        ("A text-only prompt that goes on for a while, with no image at all.", []),
    ]
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    out = []
    for i, (text, imgs) in enumerate(prompts):
        ids = tok(text).input_ids
        mm = None
        if imgs:
            ids, mm = proc.expand(ids, imgs, [image_hash(im) for im in imgs])
        out.append(
            TokenizedGenerateReqInput(
                rid=f"r{i}",
                input_ids=ids,
                sampling_params=params,
                mm=mm,
                return_logprob=True,
                top_logprobs_num=5,
            )
        )
    return out


def _run(device: str, path: str, **kw) -> dict[str, tuple[list[int], list[dict]]]:
    args = ServerArgs(
        model_path=path,
        device=device,
        max_total_tokens=4096,
        max_running_requests=16,
        grammar_backend="none",
        **kw,
    ).resolve()
    sched = Scheduler(args)
    for msg in _requests(path):
        sched.handle_message(msg)
    return drain(sched)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from tests.helpers.tiny_vlm import save_tiny_vlm

    return save_tiny_vlm("qwen2_vl", tmp_path_factory.mktemp("qwen2_vl"), seed=0)


def test_images_on_cuda_float32_match_the_cpu(folder):
    cpu = _run("cpu", folder)
    cuda = _run("cuda", folder, dtype="float32", attention_backend="torch_native")
    ties = 0
    for rid, (ids, tops) in cpu.items():
        assert len(cuda[rid][0]) == MAX_NEW
        ties += assert_tokens_match(cuda[rid][0], ids, tops)
    assert ties <= 1


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python")
def test_images_beside_cuda_graphs_in_bf16(folder):
    out = _run("cuda", folder, dtype="bfloat16", attention_backend="flashinfer", cuda_graph_max_bs=8)
    assert sorted(out) == ["r0", "r1", "r2"]
    assert all(len(ids) == MAX_NEW for ids, _ in out.values())

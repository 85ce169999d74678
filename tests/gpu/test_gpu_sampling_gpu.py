"""FlashInferSampler with the REAL FlashInfer sampling kernels on a CUDA device.

For each parameter set, one batch of N identical rows is sampled (each row of a FlashInfer call
has its own Philox subsequence; the torch sampler gets seeds 0..N-1) and the token frequencies
are compared with srt's exact filtered distribution (`reference_distribution`, float64 on the
CPU): no token outside the support, and a chi-square statistic over the bins (expected counts
below 5 pooled) within 6 standard deviations of its degrees of freedom. Also: the path makes no
host sync (``torch.cuda.set_sync_debug_mode("error")``) and an identical batch draws identical
tokens.

Skipped without CUDA or flashinfer. The first call JIT-compiles the sampling module: point
``FLASHINFER_WORKSPACE_BASE`` at a cache inside the run and set ``FLASHINFER_CUDA_ARCH_LIST``.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from srt.layers.gpu_sampling import create_flashinfer_sampler
from srt.layers.sampler import Sampler
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_params import SamplingParams
from tests.unit.test_gpu_sampling import reference_distribution

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python"),
]
VOCAB = 4096
DRAWS = 40_000
CASES = {
    "plain": SamplingParams(temperature=1.0),
    "top_k": SamplingParams(temperature=0.8, top_k=20),
    "top_p": SamplingParams(top_p=0.7),
    "top_k_top_p": SamplingParams(temperature=1.2, top_k=40, top_p=0.6),
    "min_p": SamplingParams(min_p=0.05),
    "top_p_min_p": SamplingParams(temperature=0.9, top_p=0.8, min_p=0.1),
    "all": SamplingParams(top_k=30, top_p=0.75, min_p=0.08),
    "large_k": SamplingParams(top_k=2000, top_p=0.9),
}


def batch(p: SamplingParams, n: int, device: str = "cuda") -> SamplingBatchInfo:
    p = p.normalize(vocab_size=VOCAB)
    return SamplingBatchInfo.from_reqs([p] * n, list(range(n)), [[] for _ in range(n)], None, VOCAB, device)


def logits_row(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=g) * 2.5


def check_frequencies(tokens: torch.Tensor, ref: torch.Tensor) -> None:
    counts = torch.bincount(tokens.cpu(), minlength=VOCAB).double()
    outside = counts[ref == 0].sum().item()
    assert outside == 0, f"{outside} draws outside the support"
    expected = ref * tokens.numel()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    chi2 = (((obs - exp) ** 2)[keep] / exp[keep]).sum().item()
    dof = max(int(keep.sum().item()) - 1, 1)
    assert chi2 < dof + 6 * math.sqrt(2 * dof), (chi2, dof)


@pytest.fixture(scope="module")
def fi_sampler() -> Sampler:
    fi = create_flashinfer_sampler("cuda", allow_unreproducible=True)
    assert fi is not None
    return Sampler(fi)


@pytest.mark.parametrize("name", sorted(CASES))
def test_flashinfer_matches_srt_distribution(fi_sampler, name):
    p = CASES[name]
    row = logits_row(sorted(CASES).index(name))
    ref = reference_distribution(row, p)
    logits = row.cuda().expand(DRAWS, -1).contiguous()
    check_frequencies(fi_sampler(logits, batch(p, DRAWS)).next_token_ids, ref)


@pytest.mark.parametrize("name", ["top_k_top_p", "min_p", "all"])
def test_torch_sampler_on_gpu_matches_too(name):
    p = CASES[name]
    row = logits_row(sorted(CASES).index(name))
    logits = row.cuda().expand(DRAWS, -1).contiguous()
    check_frequencies(Sampler()(logits, batch(p, DRAWS)).next_token_ids, reference_distribution(row, p))


def test_mixed_batch_no_host_sync_and_repeatable(fi_sampler):
    params = [CASES[k] for k in sorted(CASES)] + [SamplingParams(temperature=0.0)]
    params = [q.normalize(vocab_size=VOCAB) for q in params] * 16
    n = len(params)
    info = SamplingBatchInfo.from_reqs(params, list(range(n)), [[] for _ in range(n)], None, VOCAB, "cuda")
    logits = torch.randn(n, VOCAB, device="cuda") * 2
    fi = fi_sampler._flashinfer
    fi.sample(logits, info)  # compile / warm up outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        a = fi.sample(logits, info)
        b = fi.sample(logits, info)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(a, b)
    greedy = torch.tensor([i for i, q in enumerate(params) if q.temperature == 0.0], device="cuda")
    assert torch.equal(a[greedy], logits[greedy].argmax(dim=1))

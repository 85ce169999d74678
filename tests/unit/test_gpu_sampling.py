"""The FlashInfer sampling path on CPU: the dispatch rule, the call contract against the installed
flashinfer's signatures, and a recording fake of the kernels that checks which rows reach them,
that srt's filters were rewritten into inputs whose kernel acceptance set is srt's, and that the
outputs land back in batch order. The kernels themselves run in tests/gpu/test_gpu_sampling_gpu.py.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass, field

import pytest
import torch

from srt.layers.gpu_sampling import (
    FlashInferSampler,
    FlashInferSamplingOps,
    Route,
    call_key,
    create_flashinfer_sampler,
    route_for_group,
)
from srt.layers.sampler import Sampler
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_params import SamplingParams

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def make_info(params: list[SamplingParams], vocab: int, seeds: list[int] | None = None, step=None):
    params = [p.normalize(vocab_size=vocab) for p in params]
    bs = len(params)
    seeds = seeds if seeds is not None else list(range(bs))
    return SamplingBatchInfo.from_reqs(params, seeds, [[] for _ in range(bs)], None, vocab, "cpu", step=step)


def reference_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """srt's filtered distribution of one row ``logits [V]``, in float64, by brute force."""
    p = p.normalize(vocab_size=logits.shape[0])
    x = logits.double()
    w = ((x - x.max()) / p.temperature).exp()
    if 0 < p.top_k < x.shape[0]:
        w[x < x.sort(descending=True).values[p.top_k - 1]] = 0.0
    keep = w > 0
    if p.top_p < 1.0:
        heavier = ((w.unsqueeze(0) > w.unsqueeze(1)) * w.unsqueeze(0)).sum(dim=1)
        keep &= heavier < p.top_p * w.sum()
    keep &= w >= p.min_p
    d = w * keep
    return d / d.sum()


def accepted(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """FlashInfer's joint acceptance set (sampling.cuh): ``p > 0``, fewer than k strictly heavier
    tokens, and strictly heavier mass below top_p."""
    gt = probs.unsqueeze(1) > probs.unsqueeze(2)  # [n, i, j]: p_j > p_i
    count = gt.sum(dim=2)
    mass = (gt * probs.unsqueeze(1)).sum(dim=2)
    return (probs > 0) & (count < top_k.unsqueeze(1)) & (mass < top_p.unsqueeze(1))


@dataclass
class RecordingOps:
    """Fakes of the two kernels: record the call, return for each row the accepted column of
    LOWEST probability (distinct per row, so the mapping back to the batch is checked), and
    keep the accepted distribution for comparison with `reference_distribution`."""

    calls: list[tuple[str, tuple, dict]] = field(default_factory=list)
    dists: list[torch.Tensor] = field(default_factory=list)

    def joint(self, probs, top_k, top_p, *args, **kwargs):
        self.calls.append(("top_k_top_p_sampling_from_probs", (probs, top_k, top_p, *args), kwargs))
        return self._pick(probs, accepted(probs, top_k, top_p))

    def min_p(self, probs, min_p, *args, **kwargs):
        self.calls.append(("min_p_sampling_from_probs", (probs, min_p, *args), kwargs))
        return self._pick(probs, probs >= min_p.unsqueeze(1) * probs.amax(dim=1, keepdim=True))

    def _pick(self, probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        d = (probs.double() * keep) / (probs.double() * keep).sum(dim=1, keepdim=True)
        self.dists.append(d)
        return torch.where(keep, probs, torch.full_like(probs, 2.0)).argmin(dim=1).to(torch.int32)

    def ops(self) -> FlashInferSamplingOps:
        return FlashInferSamplingOps(self.joint, self.min_p)


# ---------------------------------------------------------------- dispatch
@pytest.mark.parametrize("device", ["cpu", "cuda", "mps"])
@pytest.mark.parametrize("available", [False, True])
@pytest.mark.parametrize("opt_in", [False, True])
def test_route_table(device, available, opt_in):
    assert route_for_group("greedy", device, available, opt_in) is Route.ARGMAX
    want = Route.FLASHINFER if (device == "cuda" and available and opt_in) else Route.TORCH
    for group in ("topk", "full"):
        assert route_for_group(group, device, available, opt_in) is want
    with pytest.raises(ValueError):
        route_for_group("other", device, available, opt_in)


def test_factory_never_loads_flashinfer_on_cpu():
    def boom() -> FlashInferSamplingOps:
        raise AssertionError("flashinfer loaded")

    assert create_flashinfer_sampler("cpu", True, boom, flashinfer_available=True) is None
    assert create_flashinfer_sampler("cuda", False, boom, flashinfer_available=True) is None
    assert create_flashinfer_sampler("cuda", True, boom, flashinfer_available=False) is None
    fi = create_flashinfer_sampler("cuda:0", True, RecordingOps().ops, flashinfer_available=True)
    assert isinstance(fi, FlashInferSampler)


def test_default_sampler_has_no_flashinfer_path():
    assert Sampler()._flashinfer is None


# ---------------------------------------------------------------- semantics through the fake
VOCAB = 48
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.6),
    SamplingParams(top_p=0.8),
    SamplingParams(temperature=1.1, min_p=0.2),
    SamplingParams(top_k=12, top_p=0.7, min_p=0.3),
    SamplingParams(top_k=1),
    SamplingParams(temperature=0.5, top_p=0.5, min_p=0.1),
]


def run_fake(params: list[SamplingParams], logits: torch.Tensor):
    info = make_info(params, logits.shape[1])
    rec = RecordingOps()
    out = Sampler(FlashInferSampler(rec.ops()))(logits, info, return_logprob=True)
    return info, rec, out


def test_fake_distributions_match_srt_semantics():
    torch.manual_seed(0)
    logits = torch.randn(len(PARAMS), VOCAB) * 3
    info, rec, out = run_fake(PARAMS, logits)
    names = [c[0] for c in rec.calls]
    assert names == ["top_k_top_p_sampling_from_probs"] * 2  # top-k group, full group
    got: dict[int, torch.Tensor] = {}
    topk_rows = info.topk_idx.tolist()
    ids = torch.topk(logits[info.topk_idx], info.topk_max, dim=1).indices
    for j, r in enumerate(topk_rows):  # candidates -> vocab ids
        got[r] = torch.zeros(VOCAB, dtype=torch.float64).index_put_((ids[j],), rec.dists[0][j])
    for j, r in enumerate(info.full_idx.tolist()):
        got[r] = rec.dists[1][j]
    for r in got:
        torch.testing.assert_close(got[r], reference_distribution(logits[r], PARAMS[r]), atol=1e-6, rtol=0)
    # each sampled row got its least likely kept token; greedy rows their argmax
    for r, p in enumerate(PARAMS):
        tok = int(out.next_token_ids[r])
        if r in got:
            ref = reference_distribution(logits[r], p)
            assert ref[tok] == ref[ref > 0].min()
        else:
            assert tok == int(logits[r].argmax())
    assert out.next_token_ids.dtype == torch.int64
    lse = torch.logsumexp(logits, dim=1)
    expect_lp = logits.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1) - lse
    torch.testing.assert_close(out.next_token_logprobs, expect_lp)


def test_min_p_only_group_uses_min_p_kernel():
    torch.manual_seed(1)
    params = [
        SamplingParams(min_p=0.25),
        SamplingParams(temperature=0.0),
        SamplingParams(min_p=0.05, temperature=2.0),
    ]
    logits = torch.randn(3, VOCAB) * 2
    info, rec, out = run_fake(params, logits)
    assert [c[0] for c in rec.calls] == ["min_p_sampling_from_probs"]
    probs, min_p = rec.calls[0][1][:2]
    assert probs.shape == (2, VOCAB) and min_p.tolist() == pytest.approx([0.25, 0.05])
    for j, r in enumerate([0, 2]):
        torch.testing.assert_close(
            rec.dists[0][j], reference_distribution(logits[r], params[r]), atol=1e-6, rtol=0
        )
    assert int(out.next_token_ids[1]) == int(logits[1].argmax())


def test_large_top_k_in_full_group():
    torch.manual_seed(2)
    vocab = 1500
    params = [SamplingParams(top_k=1100, top_p=0.9), SamplingParams(top_p=0.95)]
    logits = torch.randn(2, vocab) * 4
    info, rec, _ = run_fake(params, logits)
    assert info.full_needs_top_k and info.full_idx.tolist() == [0, 1]
    for r in range(2):
        torch.testing.assert_close(
            rec.dists[0][r], reference_distribution(logits[r], params[r]), atol=1e-6, rtol=0
        )


def test_all_greedy_batch_never_calls_kernels():
    logits = torch.randn(3, VOCAB)
    _, rec, out = run_fake([SamplingParams(temperature=0.0)] * 3, logits)
    assert rec.calls == [] and out.next_token_ids.tolist() == logits.argmax(1).tolist()


def test_call_key_depends_on_batch_not_on_call():
    params = [SamplingParams(top_p=0.9)] * 3
    a = make_info(params, VOCAB, seeds=[5, 6, 7])
    b = make_info(params, VOCAB, seeds=[5, 6, 7])
    c = make_info(params, VOCAB, seeds=[5, 6, 7], step=[0, 0, 1])
    rows = torch.arange(3)
    ka, oa = call_key(a, rows, "full")
    assert ka.shape == (1,) and ka.dtype == torch.int64 and oa.tolist() == [0]
    assert torch.equal(ka, call_key(b, rows, "full")[0])
    assert not torch.equal(ka, call_key(c, rows, "full")[0])
    assert not torch.equal(ka, call_key(a, rows, "topk")[0])


# ---------------------------------------------------------------- call contract (installed flashinfer)
@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer-python")
def test_calls_bind_to_installed_flashinfer():
    import flashinfer.sampling as fs

    torch.manual_seed(3)
    logits = torch.randn(len(PARAMS), VOCAB)
    _, rec, _ = run_fake(PARAMS, logits)
    _, rec2, _ = run_fake([SamplingParams(min_p=0.2)] * 2, logits[:2])
    for name, args, kwargs in rec.calls + rec2.calls:
        bound = inspect.signature(getattr(fs, name)).bind(*args, **kwargs)
        a = bound.arguments
        probs = a["probs"]
        assert probs.dtype == torch.float32 and probs.dim() == 2 and probs.is_contiguous()
        n = probs.shape[0]
        torch.testing.assert_close(probs.sum(dim=1), torch.ones(n), atol=1e-5, rtol=0)
        params = ("top_k", "top_p") if name.startswith("top_k") else ("min_p",)
        for p in params:
            t = a[p]
            assert t.shape == (n,) and t.device == probs.device
            assert t.dtype == (torch.int32 if p == "top_k" else torch.float32)
        if name.startswith("top_k"):
            assert a["filter_apply_order"] == "joint"
        assert a["deterministic"] is True and a["indices"] is None and a["generator"] is None
        fs._validate_and_convert_seed_offset(a["seed"], a["offset"], probs.device, n)

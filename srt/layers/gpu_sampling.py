"""FlashInfer's sampling kernels as an opt-in path of `srt.layers.sampler.Sampler` on CUDA.

Why opt-in. srt's contract (sampler module docstring) makes a row's token a pure function of its
own logits, parameters, seed and output position, and every request has a seed (its own or one
drawn at admission), so every sampled row is bound by it. FlashInfer's kernels (0.6.x) draw one
Philox stream per call: ``curand_init(seed_arr[0], row_in_call, offset_arr[0])``; a per-row seed
tensor is accepted but only its first element is read. A row's noise therefore depends on its
place in the call and on the call's single key, not on its own (seed, position): no row keeps the
contract. FlashInfer is used only when the sampler is built with a `FlashInferSampler`, i.e. when
the deployment opts out of per-seed reproducibility (`create_flashinfer_sampler`).

Dispatch (`route_for_group`, a pure function of the device type, whether FlashInfer imports, the
opt-in and the row's group, itself a function of the row's own parameters):

=========  ==============================  =========================================
group      CUDA + flashinfer + opt-in       otherwise (CPU, no flashinfer, no opt-in)
=========  ==============================  =========================================
greedy     argmax                          argmax
top-k      FlashInfer (on the candidates)  torch (srt's counter-based sampler)
full       FlashInfer (on the vocab)       torch
=========  ==============================  =========================================

Every sampled row qualifies, because srt's filters are rewritten into inputs for which the
kernels' acceptance tests are srt's own (kept token i; ``gt(i)``: tokens strictly heavier):
- top_k: weights below the k-th largest are zeroed first (ties kept, as srt); the kernel's
  ``count(gt(i)) < k`` test then removes nothing more;
- min_p: weights below ``min_p * max`` (max is 1) are zeroed first; the mass heavier than a kept
  token never includes a zeroed one, so the nucleus is unchanged by it (srt decides top_p before
  min_p);
- top_p: srt keeps i iff ``mass(gt(i)) < top_p * M`` (``M``: the top-k filtered mass); after
  renormalising by ``S`` (the mass left after both masks) the kernel is given
  ``top_p' = top_p * M / S`` (``inf`` for rows without top_p) under ``filter_apply_order="joint"``;
- a group with min_p alone (no top_k, no top_p in the group) uses ``min_p_sampling_from_probs``,
  whose ``p >= min_p * max(p)`` is srt's test.

Randomness: the call key is a hash of every row's (seed, position) and of the group, passed as
device tensors (no host sync): an identical batch in the same order draws the same tokens; a row's
token changes when its batch-mates change. The only host reads are tensor shapes and the batch's
Python flags; nothing calls ``.item()`` / ``.tolist()`` / ``nonzero``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from srt.sampling.sampling_batch_info import SamplingBatchInfo

_KEY_MUL_SEED = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64 (odd)
_KEY_MUL_POS = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64 (odd)
_GROUP_SALT = {"topk": 0x5851F42D4C957F2D, "full": 0x14057B7EF767814F}


class Route(str, Enum):
    ARGMAX = "argmax"
    TORCH = "torch"
    FLASHINFER = "flashinfer"


def route_for_group(
    group: str, device_type: str, flashinfer_available: bool, allow_unreproducible: bool
) -> Route:
    """The implementation for rows of ``group`` ("greedy", "topk" or "full", as decided by
    `SamplingBatchInfo` from each row's own parameters). Pure; module docstring's table."""
    if group == "greedy":
        return Route.ARGMAX
    if group not in ("topk", "full"):
        raise ValueError(f"unknown row group {group!r}")
    if device_type == "cuda" and flashinfer_available and allow_unreproducible:
        return Route.FLASHINFER
    return Route.TORCH


def flashinfer_sampling_available() -> bool:
    """Whether ``flashinfer.sampling`` can be imported (without importing it)."""
    return importlib.util.find_spec("flashinfer") is not None


@dataclass(frozen=True, slots=True)
class FlashInferSamplingOps:
    """The two kernels used, with FlashInfer's signatures (a test injects recording fakes):
    ``top_k_top_p_sampling_from_probs(probs [n, C] f32, top_k [n] i32, top_p [n] f32, indices,
    filter_apply_order, deterministic, generator, check_nan, seed [1] i64, offset [1] i64) -> [n] i32``
    and ``min_p_sampling_from_probs(probs, min_p [n] f32, indices, deterministic, generator,
    check_nan, seed, offset) -> [n] i32``."""

    top_k_top_p_sampling_from_probs: Callable[..., Tensor]
    min_p_sampling_from_probs: Callable[..., Tensor]


def load_flashinfer_sampling_ops() -> FlashInferSamplingOps:
    """The real kernels (imports flashinfer; JIT-compiles on first use on the GPU)."""
    import flashinfer.sampling as fs

    return FlashInferSamplingOps(fs.top_k_top_p_sampling_from_probs, fs.min_p_sampling_from_probs)


def create_flashinfer_sampler(
    device: torch.device | str,
    allow_unreproducible: bool,
    ops_factory: Callable[[], FlashInferSamplingOps] = load_flashinfer_sampling_ops,
    flashinfer_available: bool | None = None,
) -> FlashInferSampler | None:
    """What a ModelRunner passes as ``Sampler(flashinfer_sampler=...)``: a `FlashInferSampler`
    when `route_for_group` sends sampled rows to FlashInfer, else None (the torch sampler, the
    reproducible default; always None on CPU)."""
    if flashinfer_available is None:
        flashinfer_available = flashinfer_sampling_available()
    route = route_for_group("full", torch.device(device).type, flashinfer_available, allow_unreproducible)
    return FlashInferSampler(ops_factory()) if route is Route.FLASHINFER else None


@dataclass(frozen=True, slots=True)
class FilteredProbs:
    """Kernel inputs of one row group: ``probs [n, C]`` float32 (rows sum to 1, top_k and min_p
    applied as zeros), ``top_p [n]`` float32 (the rewritten threshold), ``top_k [n]`` int32."""

    probs: Tensor
    top_p: Tensor
    top_k: Tensor


def filtered_probs(
    logits: Tensor, rows: Tensor, info: SamplingBatchInfo, kth: Tensor | None
) -> FilteredProbs:
    """srt's filters as FlashInfer kernel inputs (module docstring) for ``logits [n, C]`` (float32)
    of the batch rows ``rows [n]``; ``kth [n, 1]``: the k-th largest logit of each row, or None
    when no row of the group uses top_k."""
    temps = info.temperatures.index_select(0, rows).unsqueeze(1)
    w = ((logits - logits.amax(dim=1, keepdim=True)) / temps).exp_()  # max weight exactly 1
    if kth is not None:
        w.masked_fill_(logits < kth, 0.0)
    top_k = info.top_ks.index_select(0, rows).clamp(max=logits.shape[1]).to(torch.int32)
    mass_k = w.sum(dim=1)
    if info.need_min_p:
        w.masked_fill_(w < info.min_ps.index_select(0, rows).unsqueeze(1), 0.0)
    mass = w.sum(dim=1)
    probs = w.div_(mass.unsqueeze(1))
    top_p = info.top_ps.index_select(0, rows)
    top_p = torch.where(top_p < 1.0, top_p * mass_k / mass, torch.full_like(top_p, float("inf")))
    return FilteredProbs(probs=probs, top_p=top_p, top_k=top_k)


def call_key(info: SamplingBatchInfo, rows: Tensor, group: str) -> tuple[Tensor, Tensor]:
    """``(seed [1], offset [1])`` int64 on the batch's device: a wrapping sum of the rows' mixed
    (seed, position) keys plus a group salt. Device arithmetic only."""
    seeds = info.seeds.index_select(0, rows)
    pos = info.positions.index_select(0, rows)
    mixed = (seeds * _KEY_MUL_SEED) ^ ((pos + 1) * _KEY_MUL_POS)
    key = mixed.sum(dim=0, keepdim=True) + _GROUP_SALT[group]
    return key, torch.zeros_like(key)


class FlashInferSampler:
    """Samples the non-greedy rows of a batch with FlashInfer's kernels (no host sync).

    Tokens follow srt's filtered distribution but are NOT reproducible per request seed nor
    batch-invariant (module docstring). Construct through `create_flashinfer_sampler`.
    """

    def __init__(self, ops: FlashInferSamplingOps) -> None:
        self.ops = ops

    def sample(self, work: Tensor, info: SamplingBatchInfo) -> Tensor:
        """``next_ids [bs]`` int64 for ``work [bs, vocab]`` (penalised, masked logits; float32):
        greedy rows by argmax, the top-k and full groups by one kernel call each."""
        bs = work.shape[0]
        next_ids = torch.empty(bs, dtype=torch.int64, device=work.device)
        if info.greedy_idx.numel():
            next_ids[info.greedy_idx] = work.index_select(0, info.greedy_idx).argmax(dim=-1)
        if info.topk_idx.numel():
            next_ids[info.topk_idx] = self._sample_topk(work, info)
        if info.full_idx.numel():
            next_ids[info.full_idx] = self._sample_full(work, info)
        return next_ids

    def _sample_topk(self, work: Tensor, info: SamplingBatchInfo) -> Tensor:
        """Top-k group: the kernel sees the ``[n, topk_max]`` candidates only."""
        rows = info.topk_idx
        vals, ids = torch.topk(work.index_select(0, rows), info.topk_max, dim=1)
        k = info.top_ks.index_select(0, rows)
        kth = vals.gather(1, (k - 1).unsqueeze(1))
        col = self._joint(filtered_probs(vals, rows, info, kth), info, rows, "topk")
        return ids.gather(1, col.long().unsqueeze(1)).squeeze(1)

    def _sample_full(self, work: Tensor, info: SamplingBatchInfo) -> Tensor:
        """Full group: the kernel sees the whole vocabulary (a sort finds large k-th values)."""
        rows = info.full_idx
        logits = work.index_select(0, rows)
        kth = None
        if info.full_needs_top_k:
            k = info.top_ks.index_select(0, rows).clamp(max=logits.shape[1])
            kth = logits.sort(dim=1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        if kth is None and info.need_min_p and not info.need_top_p:
            return self._min_p(logits, info, rows).long()
        return self._joint(filtered_probs(logits, rows, info, kth), info, rows, "full").long()

    def _joint(self, fp: FilteredProbs, info: SamplingBatchInfo, rows: Tensor, group: str) -> Tensor:
        kw = _kernel_kwargs(info, rows, group)
        return self.ops.top_k_top_p_sampling_from_probs(
            fp.probs, fp.top_k, fp.top_p, filter_apply_order="joint", **kw
        )

    def _min_p(self, logits: Tensor, info: SamplingBatchInfo, rows: Tensor) -> Tensor:
        """min_p-only group: softmax at temperature, the kernel applies min_p itself."""
        temps = info.temperatures.index_select(0, rows).unsqueeze(1)
        probs = torch.softmax(logits / temps, dim=1)
        return self.ops.min_p_sampling_from_probs(
            probs, info.min_ps.index_select(0, rows), **_kernel_kwargs(info, rows, "full")
        )


def _kernel_kwargs(info: SamplingBatchInfo, rows: Tensor, group: str) -> dict[str, Any]:
    """The keyword arguments both FlashInfer sampling kernels take from srt: no row subset, the
    deterministic algorithm, no torch generator and no NaN check (both would sync), and the
    call's device-side key (``call_key``)."""
    seed, offset = call_key(info, rows, group)
    return {
        "indices": None,
        "deterministic": True,
        "generator": None,
        "check_nan": False,
        "seed": seed,
        "offset": offset,
    }

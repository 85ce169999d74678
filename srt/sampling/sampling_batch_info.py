"""Per-step sampling state of a batch: per-request parameter tensors and the sparse logit edits.

Built once per forward step by the scheduler/runner from plain Python lists
(`SamplingBatchInfo.from_reqs`) and consumed by `srt.layers.sampler.Sampler`.

Rows are split into three groups, each chosen from the row's OWN parameters only (so a request is
sampled the same way whatever else shares its batch). The parameters are trusted to be normalized
(`SamplingParams.normalize`, with the vocabulary size): greedy was decided there and left as
``temperature=0.0, top_k=1`` (either field marks a greedy row, so a 0 temperature is never divided
by); a disabled top-k is -1 and any other ``top_k`` is below the vocabulary size.

=========  ===========================================  =======================================
group      rows                                          work in the sampler
=========  ===========================================  =======================================
greedy     top_k == 1 or temperature == 0 (normalized)   argmax of the (penalized) logits
top-k      2 <= top_k <= TOPK_CANDIDATE_LIMIT            ``topk`` candidates, filtered, sampled
full       everything else (top_k disabled or large)     whole-vocab weights, filtered, sampled
=========  ===========================================  =======================================
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

from srt.sampling.penalties import BatchTokens, LogitAdjustments, build_logit_adjustments
from srt.sampling.sampling_params import SamplingParams

# rows with top_k up to this many candidates sample from `torch.topk` candidates instead of the vocab
TOPK_CANDIDATE_LIMIT = 1024

_U64 = 1 << 64


def seed_to_int64(seed: int) -> int:
    """Reduce any integer seed to the signed 64-bit value with the same low 64 bits."""
    s = seed % _U64
    return s - _U64 if s >= 1 << 63 else s


@dataclass(slots=True)
class SamplingBatchInfo:
    """Sampling inputs of one batch of ``bs`` rows (row i = request i of the step).

    Tensors (all on ``device``):
    - ``temperatures [bs]`` float32 (1.0 on greedy rows, never 0);
    - ``top_ps [bs]`` float32; ``top_ks [bs]`` int64 (``vocab_size`` when disabled); ``min_ps [bs]`` float32;
    - ``seeds [bs]`` int64 (seed reduced to 64 bits), ``positions [bs]`` int64 (output position of
      the token being sampled = number of output tokens so far): the noise key;
    - ``greedy_idx``, ``topk_idx``, ``full_idx``: int64 row indices of the three groups.
    Flags (Python) let the sampler skip work nobody in the batch needs.
    """

    vocab_size: int
    temperatures: Tensor
    top_ps: Tensor
    top_ks: Tensor
    min_ps: Tensor
    seeds: Tensor
    positions: Tensor
    greedy_idx: Tensor
    topk_idx: Tensor
    full_idx: Tensor
    # max top_k among the top-k group (0 when empty): the topk candidate width
    topk_max: int = 0
    # does any row of the full group use top_k / top_p; does any sampled row use top_p / min_p
    full_needs_top_k: bool = False
    need_top_p: bool = False
    need_min_p: bool = False
    adjustments: LogitAdjustments = field(default_factory=LogitAdjustments)
    # constrained decoding: rows [n] int64 and their token bitmasks [n, ceil(vocab / 32)] int32
    # (srt/constrained/bitmask.py); tokens a row's mask disallows are never sampled
    grammar_rows: Tensor | None = None
    grammar_bitmask: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.temperatures.shape[0])

    def with_grammar_masks(self, rows: Tensor, bitmask: Tensor) -> SamplingBatchInfo:
        """A copy whose rows ``rows`` sample only the tokens ``bitmask`` allows."""
        return dataclasses.replace(
            self, grammar_rows=rows.to(self.device), grammar_bitmask=bitmask.to(self.device)
        )

    @property
    def is_all_greedy(self) -> bool:
        return self.topk_idx.numel() == 0 and self.full_idx.numel() == 0

    @property
    def device(self) -> torch.device:
        return self.temperatures.device

    @classmethod
    def from_reqs(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        output_ids: list[list[int]],
        prompt_ids: list[list[int]] | None,
        vocab_size: int,
        device: torch.device | str = "cpu",
        eos_token_ids: list[int] | None = None,
        step: list[int] | None = None,
    ) -> SamplingBatchInfo:
        """Build the batch's tensors from per-request lists (all of length ``bs``).

        ``params[i]``: normalized (module docstring). ``seeds[i]``: the request's seed (its own
        ``params[i].seed`` or one drawn at admission). ``output_ids[i]``: the tokens generated so
        far (penalties, min_new_tokens, noise position). ``prompt_ids[i]``: prompt tokens
        (repetition penalty only; None -> output tokens only). ``eos_token_ids``: the model's EOS
        ids (masked while ``min_new_tokens`` is not reached). ``step[i]``: overrides the noise
        position (default ``len(output_ids[i])``).
        """
        bs = len(params)
        assert len(seeds) == bs and len(output_ids) == bs
        assert prompt_ids is None or len(prompt_ids) == bs
        positions = step if step is not None else [len(o) for o in output_ids]
        assert len(positions) == bs
        g = _RowGroups.of(params, vocab_size)

        def t(values: list, dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        tokens = BatchTokens(output_ids, prompt_ids, vocab_size, device, eos_token_ids)
        return cls(
            vocab_size=vocab_size,
            temperatures=t(g.temps, torch.float32),
            top_ps=t([float(p.top_p) for p in params], torch.float32),
            top_ks=t(g.top_ks, torch.int64),
            min_ps=t([float(p.min_p) for p in params], torch.float32),
            seeds=t([seed_to_int64(s) for s in seeds], torch.int64),
            positions=t(list(positions), torch.int64),
            greedy_idx=t(g.greedy, torch.int64),
            topk_idx=t(g.topk_rows, torch.int64),
            full_idx=t(g.full_rows, torch.int64),
            topk_max=g.topk_max,
            full_needs_top_k=g.full_needs_top_k,
            need_top_p=g.need_top_p,
            need_min_p=g.need_min_p,
            adjustments=build_logit_adjustments(params, tokens),
        )


@dataclass(slots=True)
class _RowGroups:
    """Per-row temperature and top_k, the rows of each group, and the flags of `SamplingBatchInfo`."""

    temps: list[float] = field(default_factory=list)  # 1.0 on greedy rows: never divide by 0
    top_ks: list[int] = field(default_factory=list)  # vocab_size when disabled
    greedy: list[int] = field(default_factory=list)
    topk_rows: list[int] = field(default_factory=list)
    full_rows: list[int] = field(default_factory=list)
    topk_max: int = 0
    full_needs_top_k: bool = False
    need_top_p: bool = False
    need_min_p: bool = False

    @classmethod
    def of(cls, params: list[SamplingParams], vocab_size: int) -> _RowGroups:
        """The groups of normalized ``params`` (module docstring's table)."""
        g = cls()
        for i, p in enumerate(params):
            k = p.top_k if p.top_k > 0 else vocab_size
            g.top_ks.append(k)
            if k == 1 or p.temperature == 0.0:  # normalize's greedy form (either field marks it)
                g.greedy.append(i)
                g.temps.append(1.0)
                continue
            g.temps.append(float(p.temperature))
            g.need_top_p |= p.top_p < 1.0
            g.need_min_p |= p.min_p > 0.0
            if k < vocab_size and k <= TOPK_CANDIDATE_LIMIT:
                g.topk_rows.append(i)
                g.topk_max = max(g.topk_max, k)
            else:
                g.full_rows.append(i)
                g.full_needs_top_k |= k < vocab_size
        return g

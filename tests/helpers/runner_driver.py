"""A minimal in-test driver of ``ModelRunner``: no scheduler, the test says what each step runs.

The driver owns sequences (a prompt, its req_to_token row, how many of its tokens have KV in
the pool, its greedy outputs) and turns one step's choice -- "extend these sequences by these
many prompt tokens, decode those" -- into a ForwardBatch (EXTEND, DECODE or MIXED), allocating
KV slots with the runner's real allocator and writing them into req_to_token, exactly as the
scheduler does. A sequence may start on another sequence's cached prefix (its first slots are
copied from the donor's row and only the rest is extended).

KV is never freed during a run (``reset()`` clears the pools), so the pool must hold every
sequence of a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_params import SamplingParams


@dataclass
class DriverSeq:
    prompt: list[int]
    max_new_tokens: int
    row: int
    kv_len: int = 0  # leading tokens of ``ids`` whose KV is in the pool
    shared_len: int = 0  # leading slots borrowed from a donor sequence
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.output_ids

    @property
    def prompt_left(self) -> int:
        return max(0, len(self.prompt) - self.kv_len)

    @property
    def needs_decode(self) -> bool:
        return self.prompt_left == 0 and not self.finished and self.kv_len == len(self.ids) - 1

    @property
    def finished(self) -> bool:
        return len(self.output_ids) >= self.max_new_tokens


class RunnerDriver:
    def __init__(self, runner) -> None:
        self.runner = runner
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.modes: list[ForwardMode] = []

    def add(
        self, prompt: list[int], max_new_tokens: int, donor: DriverSeq | None = None, share_len: int = 0
    ) -> DriverSeq:
        """A new sequence; with ``donor``, its first ``share_len`` tokens reuse the donor's KV
        (``share_len`` must be page-aligned, the tokens equal, and present in the donor's KV)."""
        (row,) = self.runner.req_to_token_pool.alloc(1)
        seq = DriverSeq(list(prompt), max_new_tokens, row)
        if donor is not None and share_len:
            assert share_len % self.runner.page_size == 0 and share_len < len(prompt)
            assert donor.kv_len >= share_len and donor.ids[:share_len] == seq.prompt[:share_len]
            self.req_to_token[row, :share_len] = self.req_to_token[donor.row, :share_len]
            seq.kv_len = seq.shared_len = share_len
        return seq

    def _last_loc(self, seq: DriverSeq) -> int:
        return int(self.req_to_token[seq.row, seq.kv_len - 1]) if seq.kv_len else -1

    def step(self, extend: list[tuple[DriverSeq, int]], decode: list[DriverSeq]):
        """Run one forward: ``extend`` = (sequence, number of its next prompt tokens) pairs,
        ``decode`` = sequences that add their last output token. Returns
        ``(logits_output, sample_output, forward_batch)``."""
        assert extend or decode
        alloc = self.runner.token_to_kv_pool_allocator
        seqs = [s for s, _ in extend] + decode
        prefix_lens = [s.kv_len for s in seqs]
        extend_lens = [n for _, n in extend] + [1] * len(decode)
        for s, n in extend:
            assert 0 < n <= s.prompt_left, (n, s.prompt_left)
        for s in decode:
            assert s.needs_decode
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        locs = []
        if extend:
            ne = len(extend)
            loc = alloc.alloc_extend(prefix_lens[:ne], seq_lens[:ne], [self._last_loc(s) for s, _ in extend])
            assert loc is not None, "KV pool too small for the test"
            locs.append(loc)
        if decode:
            loc = alloc.alloc_decode(seq_lens[len(extend) :], [self._last_loc(s) for s in decode])
            assert loc is not None, "KV pool too small for the test"
            locs.append(loc)
        out_cache_loc = torch.cat(locs)
        input_ids: list[int] = []
        start = 0
        for s, p, e in zip(seqs, prefix_lens, extend_lens):
            self.req_to_token[s.row, p : p + e] = out_cache_loc[start : start + e]
            input_ids += s.ids[p : p + e]
            start += e

        if not decode:
            mode, kw = ForwardMode.EXTEND, {}
        elif not extend:
            mode, kw = ForwardMode.DECODE, {}
        else:
            mode, kw = ForwardMode.MIXED, {"num_extend_seqs": len(extend)}
        fb = ForwardBatch.build(
            mode,
            input_ids,
            [s.row for s in seqs],
            prefix_lens,
            extend_lens,
            out_cache_loc,
            device=self.runner.device,
            return_logprob=True,
            **kw,
        )
        fb.sampling_info = SamplingBatchInfo.from_reqs(
            [SamplingParams(temperature=0.0, max_new_tokens=s.max_new_tokens) for s in seqs],
            [0] * len(seqs),
            [s.output_ids for s in seqs],
            None,
            self.runner.model_config.vocab_size,
            self.runner.device,
        )
        logits_output, sample_output = self.runner.forward_batch_generation(fb)
        self.modes.append(mode)
        next_ids = sample_output.next_token_ids.tolist()
        next_lps = sample_output.next_token_logprobs.tolist()
        for i, (s, e) in enumerate(zip(seqs, extend_lens)):
            s.kv_len += e
            if s.kv_len == len(s.ids):  # the prompt is done (or this was a decode): a new token
                s.output_ids.append(next_ids[i])
                s.output_logprobs.append(next_lps[i])
        return logits_output, sample_output, fb

    def reset(self) -> None:
        self.runner.req_to_token_pool.clear()
        self.runner.token_to_kv_pool_allocator.clear()
        self.modes.clear()

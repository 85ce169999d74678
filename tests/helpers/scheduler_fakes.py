"""A fake model runner that checks the scheduler's KV bookkeeping, for fast scheduler tests.

``KVEchoRunner`` satisfies the scheduler's ``SchedulerModelRunner`` protocol
(srt/managers/scheduler/runner_protocol.py) with real ``ReqToTokenPool`` and
``TokenToKVPoolAllocator`` (debug mode on) but no model. Its "KV cache"
stores, per slot, the token id and position written there. Every forward:

1. writes ``input_ids``/``positions`` of the batch at ``out_cache_loc`` (what attention does);
2. for every sequence reads its whole context back through ``req_to_token`` and checks the
   positions are ``0 .. seq_len-1`` (a wrong slot, a stale prefix or an overwritten page fails);
3. returns ``next_token(context)``: a deterministic hash of the token ids READ FROM THE KV CACHE
   (``copy=True``: mostly a copy of what followed the last token before, for speculative decoding).

So a request's output equals ``reference_generate`` (the same function applied to the prompt
alone) exactly when the scheduler gave it the right KV at every step -- with prefix sharing,
chunking, paging, mixing and retraction in play.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from srt.layers.forward_batch import ForwardBatch
from srt.layers.sampler import SampleOutput
from srt.mem_cache.allocator import TokenToKVPoolAllocator
from srt.mem_cache.memory_pool import ReqToTokenPool

VOCAB = 1000
EOS = 2
MAX_CONTEXT = 8192
_PRIME = 2_147_483_647
# position weights of the context hash: sum(token * weight) stays far below 2**63
_WEIGHTS = torch.randint(1, 1 << 24, (MAX_CONTEXT,), generator=torch.Generator().manual_seed(1234))
_WEIGHTS_LIST = _WEIGHTS.tolist()


def _hash(context: Sequence[int]) -> int:
    return sum(t * w for t, w in zip(context, _WEIGHTS_LIST)) % _PRIME


def _token_of_hash(h: int, eos_every: int) -> int:
    if eos_every and h % eos_every == 0:
        return EOS
    return 3 + h % (VOCAB - 3)


def next_token(context: Sequence[int], eos_every: int = 0, copy: bool = False) -> int:
    """The fake model: a position-weighted hash of the whole context, in [3, VOCAB); EOS when
    the hash is a multiple of ``eos_every`` (0: never). ``copy``: a copying model (speculative
    decoding tests) that, for four hashes in five, repeats what followed the latest earlier
    occurrence of the last token, when there is one."""
    h = _hash(context)
    if copy and h % 5:
        nxt = _copied(context)
        if nxt is not None:
            return nxt
    return _token_of_hash(h, eos_every)


def _copied(context: Sequence[int]) -> int | None:
    last = context[-1]
    for j in range(len(context) - 2, -1, -1):
        if context[j] == last:
            return context[j + 1]
    return None


def fake_logprob(context: Sequence[int]) -> float:
    """The fake logprob of the token sampled after ``context``."""
    return -float(len(context) % 7) - 0.5


def fake_prompt_logprob(ids_through_token: Sequence[int]) -> float:
    """The fake logprob of the last id of ``ids_through_token`` given the ids before it."""
    return -float(_hash(ids_through_token) % 1000) / 100.0


def reference_prompt_logprobs(prompt: Sequence[int], start: int) -> list[float | None]:
    """Prompt logprobs from position ``start`` on (None for position 0), as the scheduler must
    deliver them (see srt/layers/logits_processor.py)."""
    return [None if q == 0 else fake_prompt_logprob(prompt[: q + 1]) for q in range(start, len(prompt))]


def reference_generate(
    prompt: Sequence[int],
    max_new_tokens: int,
    eos_every: int = 0,
    ignore_eos: bool = False,
    min_new_tokens: int = 0,
    copy: bool = False,
) -> list[int]:
    """The output the scheduler must produce for ``prompt`` (run alone, token by token)."""
    ctx = list(prompt)
    out: list[int] = []
    while len(out) < max_new_tokens:
        t = next_token(ctx, eos_every, copy)
        out.append(t)
        ctx.append(t)
        if t == EOS and not ignore_eos and len(out) >= min_new_tokens:
            break
    return out


@dataclass(frozen=True, slots=True)
class FakeModelConfig:
    """The model-config fields the scheduler reads."""

    vocab_size: int
    eos_token_ids: list[int]
    context_len: int


@dataclass(slots=True)
class FakeLogitsOutput:
    """The logits-output fields the scheduler reads (prompt logprobs; no logits)."""

    input_token_logprobs: list[list[float | None]] | None = None
    input_top_logprobs: list[list[list[tuple[int, float]] | None]] | None = None


@dataclass
class KVEchoRunner:
    max_total_tokens: int = 4096
    page_size: int = 1
    max_running_requests: int = 64
    context_len: int = 2048
    eos_every: int = 0
    copy: bool = False  # the copying model of next_token
    device: str = "cpu"
    num_forwards: int = 0
    modes: list[str] = field(default_factory=list)
    weight_updates: list[str] = field(default_factory=list)  # model paths, in call order

    def __post_init__(self) -> None:
        assert self.context_len <= MAX_CONTEXT
        self.model_config = FakeModelConfig(
            vocab_size=VOCAB, eos_token_ids=[EOS], context_len=self.context_len
        )
        self.max_total_num_tokens = self.max_total_tokens
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests + 4, self.context_len, "cpu")
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(
            self.max_total_tokens, self.page_size, "cpu", debug=True
        )
        n = self.max_total_tokens + self.page_size
        self.kv_token = torch.full((n,), -1, dtype=torch.int64)
        self.kv_pos = torch.full((n,), -1, dtype=torch.int64)

    def update_weights_from_disk(self, model_path: str, load_format: str | None) -> tuple[bool, str]:
        """Records the call; a path containing "missing" fails (the weights "stay")."""
        self.weight_updates.append(model_path)
        if "missing" in model_path:
            return False, f"{model_path} does not exist"
        return True, f"weights updated from {model_path}"

    def forward_batch_generation(self, fb: ForwardBatch) -> tuple[FakeLogitsOutput, SampleOutput]:
        self.num_forwards += 1
        self.modes.append(fb.forward_mode.name)
        assert fb.sampling_info is not None and fb.sampling_info.batch_size == fb.batch_size
        loc = fb.out_cache_loc
        assert loc.numel() == fb.num_tokens and bool((loc >= self.page_size).all())
        assert len(set(loc.tolist())) == loc.numel(), "a slot was handed out twice in one batch"
        self.kv_token[loc] = fb.input_ids
        self.kv_pos[loc] = fb.positions
        r2t = self.req_to_token_pool.req_to_token
        next_ids: list[int] = []
        lps: list[float] = []
        for i in range(fb.batch_size):
            n = fb.seq_lens_cpu[i]
            slots = r2t[int(fb.req_pool_indices[i]), :n]
            pos = self.kv_pos[slots]
            if not torch.equal(pos, torch.arange(n)):
                bad = int((pos != torch.arange(n)).nonzero()[0])
                raise AssertionError(f"seq {i}: KV of position {bad} holds position {int(pos[bad])}")
            if self.copy:
                next_ids.append(next_token(self.kv_token[slots].tolist(), self.eos_every, copy=True))
            else:
                h = int((self.kv_token[slots] * _WEIGHTS[:n]).sum()) % _PRIME
                next_ids.append(_token_of_hash(h, self.eos_every))
            lps.append(-float(n % 7) - 0.5)
        logits_output = FakeLogitsOutput()
        if fb.return_logprob and fb.extend_logprob_start_lens_cpu is not None:
            logits_output.input_token_logprobs = self._prompt_logprobs(fb)
        out = SampleOutput(next_token_ids=torch.tensor(next_ids, dtype=torch.int64))
        if fb.return_logprob:
            out.next_token_logprobs = torch.tensor(lps)
            nums = fb.top_logprobs_nums or [0] * fb.batch_size
            out.top_logprobs = [[(next_ids[i], lps[i])][: nums[i]] for i in range(fb.batch_size)]
        return logits_output, out

    def _prompt_logprobs(self, fb: ForwardBatch) -> list[list[float | None]]:
        """The logits processor's prompt-logprob contract, on the context read from the KV."""
        r2t = self.req_to_token_pool.req_to_token
        res: list[list[float | None]] = []
        next_ids = fb.extend_logprob_next_token_ids_cpu or [-1] * fb.batch_size
        for i in range(fb.batch_size):
            s, p, n = fb.extend_logprob_start_lens_cpu[i], fb.extend_prefix_lens_cpu[i], fb.seq_lens_cpu[i]
            if i >= fb.num_extend_seqs or s >= n:
                res.append([])
                continue
            ctx = self.kv_token[r2t[int(fb.req_pool_indices[i]), :n]].tolist()
            vals: list[float | None] = [None] if s == 0 and p == 0 else []
            vals += [fake_prompt_logprob(ctx[: q + 1]) for q in range(max(s, p + 1), n)]
            if next_ids[i] >= 0:
                vals.append(fake_prompt_logprob(ctx + [next_ids[i]]))
            res.append(vals)
        return res

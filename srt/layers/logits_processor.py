"""LogitsProcessor: logits only for the rows the sampler needs, prompt logprobs on request.

Rows of ``next_token_logits [bs, vocab]`` (float32), one per sequence: the last token of
each sequence's segment in the batch, i.e. batch index ``extend_start_loc[i] +
extend_seq_lens[i] - 1`` (for a decoding sequence that is its only token). In a DECODE
batch that is every row, so no gather happens.

Prompt logprobs (``forward_batch.return_logprob``; extending sequence ``i`` with
``s = extend_logprob_start_lens_cpu[i]``): the log-softmax of the logits at position ``q``
scores the prompt token at ``q + 1``. Sequence ``i`` holds positions ``p .. L-1`` (``p`` =
prefix length, ``L`` = seq_len) in this batch, so it scores

    tokens at positions max(s, p + 1) .. L - 1      (logits rows max(s - 1, p) .. L - 2)
    + the token at position L, when n = extend_logprob_next_token_ids_cpu[i] >= 0 (the first
      token of the next chunk of a chunked prompt, id n; scored by the segment's last row)

It asks when ``0 <= s <= L - 1`` (``s <= L`` when it has a next token); the list starts with
``None`` for position 0 when ``s == 0`` and ``p == 0`` (the first token has no logprob).
Concatenating the lists of consecutive chunks (each giving the next chunk's first token id)
yields one entry per prompt position from ``s``. The caller must keep a reused prefix at
most ``max(s - 1, 0)`` tokens long, or the positions up to the prefix have no logits here.

The LM head weight is the model's (``lm_head.weight``, the embedding when tied), plus the
backend's prepacked copy of it once ``prepare_weights(weight)`` ran (``head_packed``); a head
kept as GGUF blocks (``lm_head.qweight``) runs its own matmul instead.

Final logit soft-capping (``final_logit_softcap > 0``, Gemma 2): every logits row becomes
``cap * tanh(logits / cap)`` in float32 before anything reads it, so sampling, the next-token
logits and the prompt logprobs all see the capped values (0: the logits are left as they are).

``input_top_logprobs`` (when ``top_logprobs_nums[i] > 0``) is aligned with
``input_token_logprobs``: ``(token_id, logprob)`` pairs, best first. Logits for these rows are
computed in chunks of ``LOGPROB_CHUNK_ROWS``, never as one ``[T, vocab]``, through the model's
``LinearBackend`` (the same matmul as the next-token logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from srt.distributed.communication import TPInfo
from srt.layers import pooler
from srt.layers.linear_backend import TORCH_LINEAR, LinearBackend

if TYPE_CHECKING:
    from srt.layers.forward_batch import ForwardBatch

LOGPROB_CHUNK_ROWS = 1024

TopLogprobs = list[tuple[int, float]]


@dataclass(slots=True)
class LogitsProcessorOutput:
    # float32 [bs, vocab]: logits of each sequence's next token
    next_token_logits: torch.Tensor
    # per sequence (bs entries, [] where not requested; None when the batch has no
    # extend_logprob_start_lens_cpu): logprob of each scored prompt token
    input_token_logprobs: list[list[float | None]] | None = None
    # per sequence, aligned with input_token_logprobs ([] where top logprobs were not requested)
    input_top_logprobs: list[list[TopLogprobs | None]] | None = None
    # prefill-only outputs (srt/layers/pooler.py; None unless the batch asked): per sequence, its
    # partial pooled hidden state, and the next-token logprobs of its label token ids
    pooled: list[torch.Tensor | None] | None = None
    label_logprobs: list[list[float]] | None = None


@dataclass(slots=True)
class _PromptLogprobPlan:
    rows: list[int]  # batch row (token index) whose logits score a token
    targets: list[int]  # the scored token id of each row
    counts: list[int]  # rows per sequence
    leading_none: list[bool]  # sequence starts with the None of position 0
    wanted: list[bool]  # sequence asked for prompt logprobs
    top_k: list[int]  # per sequence


class LogitsProcessor(nn.Module):
    """``forward(hidden_states [T, hidden], lm_head, forward_batch) -> LogitsProcessorOutput``;
    ``lm_head`` is any module with ``weight [vocab, hidden]`` (the embedding when tied), applied
    through ``linear_backend`` (the model's; ``F.linear`` when None); ``final_logit_softcap``:
    see the module docstring (0 = off)."""

    def __init__(
        self, vocab_size: int, linear_backend: LinearBackend | None = None, final_logit_softcap: float = 0.0
    ) -> None:
        super().__init__()
        if final_logit_softcap < 0:
            raise ValueError(f"final_logit_softcap must be >= 0, got {final_logit_softcap}")
        self.vocab_size = vocab_size
        self.final_logit_softcap = float(final_logit_softcap)
        self.linear_backend = linear_backend or TORCH_LINEAR
        self.head_packed: torch.Tensor | None  # the backend's prepacked LM head, if any
        self.register_buffer("head_packed", None, persistent=False)
        self.tp: TPInfo | None = None  # tensor parallelism: the head holds vocab_sizes[rank] rows
        self.vocab_sizes: list[int] = [vocab_size]

    def shard_vocab(self, vocab_sizes: list[int], tp: TPInfo) -> None:
        """Tensor parallelism: the LM head holds rank r's ``vocab_sizes[r]`` rows (in rank
        order); the local logits are gathered into the whole vocabulary."""
        self.tp, self.vocab_sizes = tp, list(vocab_sizes)

    def prepare_weights(self, lm_head_weight: torch.Tensor) -> None:
        """Keep the backend's prepacked copy of the loaded LM head weight, if it makes one."""
        self.head_packed = self.linear_backend.pack_weight(lm_head_weight.data, prefill=False)

    @staticmethod
    def _wants_prompt_logprobs(fb: ForwardBatch) -> bool:
        """Whether this step scores prompt tokens (``_prompt_logprobs`` reads their rows)."""
        return fb.return_logprob and fb.extend_logprob_start_lens_cpu is not None and fb.num_extend_seqs > 0

    def rows_read(self, fb: ForwardBatch) -> torch.Tensor | None:
        """The rows of the final hidden states ``forward`` will read (``[bs]``: the last of each
        sequence), when an EXTEND or MIXED step reads those alone and they are fewer than the
        step's tokens; else None (every row is read, or nothing would be saved). A model given
        these may return just those rows (``LlamaModel.forward``'s ``keep_rows``)."""
        if not fb.forward_mode.is_extend() or fb.input_ids.shape[0] == fb.batch_size:
            return None  # (decode, or one token a sequence: nothing to skip)
        if self._wants_prompt_logprobs(fb) or fb.pool_methods is not None:
            return None
        return self._last_rows(fb)

    @staticmethod
    def _last_rows(fb: ForwardBatch) -> torch.Tensor:
        """Each sequence's last row among the step's tokens, ``[bs]``."""
        return fb.extend_start_loc + fb.extend_seq_lens - 1

    def forward(
        self,
        hidden_states: torch.Tensor,
        lm_head: nn.Module,
        forward_batch: ForwardBatch,
    ) -> LogitsProcessorOutput:
        """Logits of each sequence's last row. ``hidden_states`` holds every row of the step, or
        only those rows (``[bs, hidden]``: a model that took ``rows_read``)."""
        fb = forward_batch
        if fb.forward_mode.is_idle() or fb.batch_size == 0:
            return LogitsProcessorOutput(hidden_states.new_empty((0, self.vocab_size), dtype=torch.float32))
        if fb.forward_mode.is_decode() or hidden_states.shape[0] == fb.batch_size:
            last = hidden_states
        else:
            last = hidden_states.index_select(0, self._last_rows(fb))
        out = LogitsProcessorOutput(self._logits(last, lm_head))
        if self._wants_prompt_logprobs(fb):
            self._prompt_logprobs(hidden_states, lm_head, fb, out)
        if fb.pool_methods is not None:
            lens = fb.extend_seq_lens_cpu or fb.extend_seq_lens.tolist()
            prefix_lens = fb.extend_prefix_lens_cpu or fb.extend_prefix_lens.tolist()
            out.pooled = pooler.pool_segments(hidden_states, fb.pool_methods, lens, prefix_lens)
        if fb.label_token_ids is not None:
            out.label_logprobs = pooler.label_logprobs(out.next_token_logits, fb.label_token_ids)
        return out

    def _logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        qweight = getattr(lm_head, "qweight", None)
        if qweight is not None:
            logits = qweight.linear(hidden)
        else:
            logits = self.linear_backend.apply(hidden, lm_head.weight, None, self.head_packed).float()
        if self.tp is not None:
            logits = self.tp.all_gather_last_dim(logits, self.vocab_sizes)
        if self.final_logit_softcap > 0:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits.float() / cap).mul_(cap)
        return logits

    # ------------------------------------------------------------------
    @staticmethod
    def _plan(fb: ForwardBatch) -> _PromptLogprobPlan:
        bs = fb.batch_size
        starts = fb.extend_logprob_start_lens_cpu or []
        next_ids = fb.extend_logprob_next_token_ids_cpu or []
        top_nums = fb.top_logprobs_nums or []
        seq_lens = fb.seq_lens_cpu or fb.seq_lens.tolist()
        prefix_lens = fb.extend_prefix_lens_cpu or fb.extend_prefix_lens.tolist()
        ext_lens = fb.extend_seq_lens_cpu or fb.extend_seq_lens.tolist()
        input_ids: list[int] | None = None
        plan = _PromptLogprobPlan([], [], [0] * bs, [False] * bs, [False] * bs, [0] * bs)
        row0 = 0
        for i in range(fb.num_extend_seqs):
            s = starts[i] if i < len(starts) else None
            p, seq_len = prefix_lens[i], seq_lens[i]
            nxt = next_ids[i] if i < len(next_ids) else -1
            has_next = nxt is not None and nxt >= 0
            last_tok = seq_len if has_next else seq_len - 1  # last prompt position scored here
            if s is not None and 0 <= s <= last_tok:
                plan.wanted[i] = True
                plan.top_k[i] = top_nums[i] if i < len(top_nums) else 0
                plan.leading_none[i] = s == 0 and p == 0
                first_tok = max(s, p + 1)
                # token at position t is scored by the row of position t - 1
                lo = row0 + first_tok - 1 - p
                hi = row0 + seq_len - 1 - p  # the segment's last row (scores the next token)
                if lo < hi:
                    if input_ids is None:
                        input_ids = fb.input_ids.tolist()
                    plan.rows += range(lo, hi)
                    plan.targets += input_ids[lo + 1 : hi + 1]
                if has_next:
                    plan.rows.append(hi)
                    plan.targets.append(int(nxt))
                plan.counts[i] = max(hi - lo, 0) + int(has_next)
            row0 += ext_lens[i]
        return plan

    def _prompt_logprobs(
        self,
        hidden_states: torch.Tensor,
        lm_head: nn.Module,
        fb: ForwardBatch,
        out: LogitsProcessorOutput,
    ) -> None:
        plan = self._plan(fb)
        if not any(plan.wanted):
            out.input_token_logprobs = [[] for _ in range(fb.batch_size)]
            out.input_top_logprobs = [[] for _ in range(fb.batch_size)]
            return
        device = hidden_states.device
        rows = torch.tensor(plan.rows, dtype=torch.int64, device=device)
        targets = torch.tensor(plan.targets, dtype=torch.int64, device=device)
        # per row: how many top logprobs its sequence wants
        row_top = [k for k, n in zip(plan.top_k, plan.counts) for _ in range(n)]
        max_k = max(row_top, default=0)
        token_lp: list[float] = []
        top_ids: list[list[int]] = []
        top_lp: list[list[float]] = []
        for c0 in range(0, len(plan.rows), LOGPROB_CHUNK_ROWS):
            sel = rows[c0 : c0 + LOGPROB_CHUNK_ROWS]
            picked = hidden_states.index_select(0, sel)
            logits = self._logits(picked, lm_head)
            logprobs = torch.log_softmax(logits, dim=-1)
            del logits
            tgt = targets[c0 : c0 + LOGPROB_CHUNK_ROWS]
            token_lp += logprobs.gather(1, tgt.unsqueeze(1)).squeeze(1).tolist()
            if max_k > 0:
                vals, ids = logprobs.topk(min(max_k, logprobs.shape[-1]), dim=-1)
                top_ids += ids.tolist()
                top_lp += vals.tolist()
        token_out: list[list[float | None]] = []
        top_out: list[list[TopLogprobs | None]] = []
        r = 0
        for i in range(fb.batch_size):
            n = plan.counts[i]
            if not plan.wanted[i]:
                token_out.append([])
                top_out.append([])
                continue
            lead: list = [None] if plan.leading_none[i] else []
            token_out.append(lead + token_lp[r : r + n])
            k = plan.top_k[i]
            if k > 0:
                top_out.append(lead + [list(zip(top_ids[j][:k], top_lp[j][:k])) for j in range(r, r + n)])
            else:
                top_out.append([])
            r += n
        out.input_token_logprobs = token_out
        out.input_top_logprobs = top_out

"""ForwardMode and ForwardBatch: the device-side description of one model step.

Data path:  Req (scheduler, CPU) -> ScheduleBatch (CPU lists) -> ForwardBatch (tensors)
            -> ModelRunner.forward -> LogitsProcessorOutput -> Sampler -> next token ids.

A ForwardBatch is one flat, padding-free batch of tokens from ``bs`` sequences.
Sequence ``i`` contributes ``extend_seq_lens[i]`` new tokens (1 for a decoding
sequence) on top of ``extend_prefix_lens[i]`` tokens whose KV is already in the
pool. Its KV locations are ``req_to_token[req_pool_indices[i], :seq_lens[i]]``;
the new tokens' KV is written to ``out_cache_loc`` (which the scheduler has
already stored in ``req_to_token`` at positions prefix_len .. seq_len-1).

Ordering rule: in a MIXED batch the extending sequences come first, then the
decoding ones (every decoding sequence has extend_seq_len == 1).

    index arithmetic (sequence i):
        tokens of i in input_ids:  [extend_start_loc[i], extend_start_loc[i] + extend_seq_lens[i])
        positions of those tokens: extend_prefix_lens[i] .. seq_lens[i] - 1
        seq_lens[i] == extend_prefix_lens[i] + extend_seq_lens[i]

ForwardBatch is the models' input: layers and models read it, so this module imports nothing
of them. The attention backend the ModelRunner attaches is typed here by what the attention
layers call on it (``BatchAttention``; every ``srt.layers.attention.base.AttentionBackend``
satisfies it), and ``AttentionLayer`` is what a backend reads from the calling layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from srt.mem_cache.memory_pool import KVPool, ReqToTokenPool
    from srt.sampling.sampling_batch_info import SamplingBatchInfo


class AttentionLayer(Protocol):
    """What an attention backend reads from the calling layer (``RadixAttention`` satisfies it)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    layer_id: int
    # keys a query may see behind itself: key position >= query position - sliding_window_size
    # (HF's ``sliding_window`` minus 1; FlashInfer's ``window_left``); -1 = the whole sequence
    sliding_window_size: int
    # attention logit soft-capping: scores -> logit_cap * tanh(scores / logit_cap); 0 = off
    logit_cap: float


class BatchAttention(Protocol):
    """What the model's attention layers call on ``forward_batch.attn_backend``."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """q ``[T, H*D]``, k/v ``[T, H_kv*D]`` -> ``[T, H*D]`` (see srt/layers/attention/base.py)."""
        ...

    def native_decode_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The decode sequences' ``(req_to_token, rows, seq_lens)`` for a native decode stack, or
        None (see srt/layers/attention/base.py)."""
        ...


class ForwardMode(IntEnum):
    EXTEND = 1  # every sequence adds >= 1 new tokens (prefill, possibly on a cached prefix)
    DECODE = 2  # every sequence adds exactly 1 token
    MIXED = 3  # extending sequences first, then decoding ones, in one forward
    IDLE = 4  # nothing to run

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64, total length after this step
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slots of the new tokens
    extend_seq_lens: torch.Tensor  # [bs] int64 (1 for decoding sequences)
    extend_prefix_lens: torch.Tensor  # [bs] int64
    extend_start_loc: torch.Tensor  # [bs] int64, exclusive cumsum of extend_seq_lens
    # CPU copies of the same lengths (python ints), for backends and the logits processor
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)
    # number of leading sequences that extend (== bs for EXTEND, 0 for DECODE)
    num_extend_seqs: int = 0

    # logprobs
    return_logprob: bool = False
    top_logprobs_nums: list[int] | None = None  # per sequence
    # per sequence: first position (absolute) from which prompt logprobs are wanted;
    # None or a value >= seq_len means "only the sampled token's logprob"
    extend_logprob_start_lens_cpu: list[int] | None = None
    # per sequence: the prompt token that follows this extend segment when the prompt goes on in
    # a later chunk (its logprob comes from the segment's last row), else -1; None: no such token
    extend_logprob_next_token_ids_cpu: list[int] | None = None

    # prefill-only outputs (srt/layers/pooler.py), None when no sequence asks: per sequence, how
    # to pool its final hidden states ("last" | "mean" | "cls" | "") and the label token ids
    # whose next-token logprobs it wants (empty: none)
    pool_methods: list[str] | None = None
    label_token_ids: list[list[int]] | None = None
    # per sequence, the LoRA adapter slot it runs under (-1: the base model); None: none runs one
    lora_slots: list[int] | None = None
    # images (srt/multimodal/req_images.py): the ImageSpans whose embedding rows replace the
    # step's placeholder tokens (None: no image row in the step), and the M-RoPE positions
    # [3, num_tokens] of a step with a Qwen2-VL image request (None: ``positions`` in all three)
    image_spans: list[Any] | None = None
    mrope_positions: torch.Tensor | None = None

    sampling_info: SamplingBatchInfo | None = None

    # set by the ModelRunner before forward
    req_to_token_pool: ReqToTokenPool | None = None
    token_to_kv_pool: KVPool | None = None
    attn_backend: BatchAttention | None = None
    # the step's rows per adapter slot (srt/lora/layer.py LoRABatch), None when no row runs one
    lora: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(
        cls,
        forward_mode: ForwardMode,
        input_ids: list[int],
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor | list[int],
        device: str | torch.device = "cpu",
        **kw,
    ) -> ForwardBatch:
        """Build a ForwardBatch from CPU lists (positions and offsets are derived here)."""
        bs = len(req_pool_indices)
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        starts = [0] * bs
        acc = 0
        for i, e in enumerate(extend_lens):
            starts[i] = acc
            acc += e
        positions: list[int] = []
        for p, s in zip(prefix_lens, seq_lens):
            positions.extend(range(p, s))
        if forward_mode == ForwardMode.DECODE:
            num_extend = 0
        elif forward_mode == ForwardMode.EXTEND:
            num_extend = bs
        else:
            num_extend = kw.pop("num_extend_seqs")
        kw.pop("num_extend_seqs", None)
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        if not isinstance(out_cache_loc, torch.Tensor):
            out_cache_loc = t(out_cache_loc)
        return cls(
            forward_mode=forward_mode,
            batch_size=bs,
            input_ids=t(input_ids),
            positions=t(positions),
            req_pool_indices=t(req_pool_indices),
            seq_lens=t(seq_lens),
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            extend_seq_lens=t(extend_lens),
            extend_prefix_lens=t(prefix_lens),
            extend_start_loc=t(starts),
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=list(extend_lens),
            extend_prefix_lens_cpu=list(prefix_lens),
            num_extend_seqs=num_extend,
            **kw,
        )

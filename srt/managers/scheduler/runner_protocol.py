"""The boundary between the scheduler and the model runner: exactly what the scheduler may call
and read. ``srt.model_executor.model_runner.ModelRunner`` satisfies it, and so do the model-free
runners of the tests and benchmarks (tests/helpers/scheduler_fakes.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from srt.layers.forward_batch import ForwardBatch
    from srt.mem_cache.allocator import TokenToKVPoolAllocator
    from srt.mem_cache.memory_pool import ReqToTokenPool


class ModelConfigView(Protocol):
    """The fields of the model's configuration the scheduler reads."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> list[int]: ...

    @property
    def context_len(self) -> int: ...


class LogitsResult(Protocol):
    """What the scheduler reads of a forward's logits output (prompt logprobs): per sequence,
    the logprob of each scored prompt token and its top logprobs (None when the batch asked for
    none; see srt/layers/logits_processor.py)."""

    @property
    def input_token_logprobs(self) -> list[list[float | None]] | None: ...

    @property
    def input_top_logprobs(self) -> list[list[list[tuple[int, float]] | None]] | None: ...


class SampleResult(Protocol):
    """What the scheduler reads of a forward's sampling output: ``next_token_ids [bs]``;
    ``next_token_logprobs [bs]`` and ``top_logprobs[i]`` (``(token_id, logprob)`` pairs) only
    when logprobs were requested."""

    @property
    def next_token_ids(self) -> torch.Tensor: ...

    @property
    def next_token_logprobs(self) -> torch.Tensor | None: ...

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]] | None: ...


class SchedulerModelRunner(Protocol):
    """The model runner as the scheduler sees it: the KV pools it allocates from, their sizes,
    the model's limits, one call per batch, and the weight reload."""

    @property
    def model_config(self) -> ModelConfigView: ...

    @property
    def device(self) -> str | torch.device: ...

    @property
    def req_to_token_pool(self) -> ReqToTokenPool: ...

    @property
    def token_to_kv_pool_allocator(self) -> TokenToKVPoolAllocator: ...

    @property
    def max_total_num_tokens(self) -> int:
        """Slots of the KV pool (the allocator's size)."""
        ...

    @property
    def max_running_requests(self) -> int: ...

    def forward_batch_generation(self, forward_batch: ForwardBatch) -> tuple[LogitsResult, SampleResult]:
        """Run the model on one batch and sample the next token of every sequence."""
        ...

    def update_weights_from_disk(self, model_path: str, load_format: str | None) -> tuple[bool, str]:
        """Replace the weights with ``model_path``'s (same shapes), called only while idle;
        ``(False, why)`` leaves the old weights in place."""
        ...

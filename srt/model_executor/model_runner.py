"""ModelRunner: the model, its KV pools, the attention backend and the sampler, in one place.

Start-up (``ModelRunner(server_args)``, server_args already ``resolve()``d):

    ModelConfig.from_server_args -> linear backend (--linear-backend, passed to the model)
    -> get_model (weights loaded, eval mode)
    -> attention backend (by name, lazily imported) -> Sampler
    -> CUDA graphs (CUDA, a backend with graph hooks, not --disable-cuda-graph): the graph
       runner's fixed buffers (srt/model_executor/cuda_graph_runner.py)
    -> KV pool size: --max-total-tokens, or profiled (srt/mem_cache/pool_size.py):
           one dummy extend of the largest prefill (max_prefill_tokens, or chunked_prefill_size
           if smaller) on throw-away pools measures the activation peak; then
           tokens = (mem_fraction_static * memory - weights - req pool - activation peak
                     - CUDA-graph reserve) / bytes per token
    -> ReqToTokenPool, MHATokenToKVPool, TokenToKVPoolAllocator
    -> one log line "KV cache: N tokens, X GiB, page size P, max prefill tokens M"
    -> CUDA graphs captured (decode batch sizes up to --cuda-graph-max-bs); one log line

Tensor parallelism (``ModelRunner(server_args, tp_rank=r)`` with ``server_args.tp_size`` > 1, the
default torch.distributed group being the TP group): the model is this rank's shard
(srt/model_loader/sharding.py), the KV pool holds the rank's KV heads, the pool size is the
minimum over the ranks, and the native decode-layer call is off (it cannot all-reduce between
layers). Every rank must run the same batches.

Weights from another checkpoint of the same shapes: ``update_weights_from_disk(model_path,
load_format)`` (the scheduler calls it only when idle; srt/model_loader/reload.py).

Per step (called by the scheduler): ``forward_batch_generation(forward_batch)`` =
``forward`` (attach pools + backend to the batch, ``init_forward_metadata``, model forward under
``torch.inference_mode``; a DECODE batch that fits a captured CUDA graph replays it instead)
then ``sample``. The caller has already allocated the batch's KV slots
(``out_cache_loc``) and written every token's slot into ``req_to_token``.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from srt.configs.model_config import ModelConfig
from srt.distributed import TPInfo, head_shard
from srt.layers.attention.registry import check_backend_serves, create_attention_backend
from srt.layers.forward_batch import ForwardBatch
from srt.layers.linear_backend import LinearBackend, create_linear_backend
from srt.layers.logits_processor import LogitsProcessorOutput
from srt.layers.sampler import SampleOutput, Sampler
from srt.lora.manager import create_lora_manager
from srt.mem_cache import pool_size
from srt.mem_cache.allocator import TokenToKVPoolAllocator
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from srt.model_executor.activation_profile import profile_activation_peak
from srt.model_executor.cuda_graph_runner import CudaGraphRunner, cuda_graph_off_reason
from srt.model_executor.finish_model import finish_model
from srt.model_loader import get_model
from srt.model_loader.loader import float32_copy_bytes
from srt.model_loader.reload import replacement_config, shape_mismatch
from srt.model_loader.weight_utils import weight_bytes
from srt.server_args import ServerArgs
from srt.utils.cpu_memory import release_free_memory
from srt.utils.errors import ConfigError
from srt.utils.pages import page_floor

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Owns the model and everything a forward needs. Attributes the scheduler reads:
    ``model_config``, ``req_to_token_pool``, ``token_to_kv_pool``, ``token_to_kv_pool_allocator``,
    ``max_total_num_tokens``, ``max_running_requests``, ``page_size``, ``device``, ``dtype``.
    Also: ``model``, ``attn_backend``, ``linear_backend``, ``sampler``, ``kv_cache_dtype``,
    ``load_time_s``, ``weight_bytes``, ``float32_copy_bytes`` (of those, the float32 copies of GGUF
    weights), ``activation_peak_bytes`` (0 when not profiled),
    ``cuda_graph_runner`` (None when decode runs eagerly), ``cuda_graph_reserve_bytes``,
    ``loaded_model_path`` (the checkpoint the weights came from), ``tp`` (``TPInfo``) and
    ``num_kv_heads`` (this rank's KV heads: what the KV pool holds)."""

    def __init__(self, server_args: ServerArgs, tp_rank: int = 0) -> None:
        self.server_args = server_args
        self.tp = TPInfo(tp_rank, server_args.tp_size)
        self.tp.check_group()
        self.tp = self.tp.with_shared_memory(server_args.device, not server_args.disable_custom_all_reduce)
        self.device = torch.device(server_args.device)
        self.page_size = server_args.page_size
        if server_args.num_threads:
            torch.set_num_threads(server_args.num_threads)
        self._init_model(server_args)
        self.cuda_graph_runner = self._new_cuda_graph_runner(server_args)
        self._init_memory_pools(server_args)
        self._finish_model(self.model)
        self.weight_bytes = weight_bytes(self.model)  # the rope tables cut
        self.float32_copy_bytes = float32_copy_bytes(self.model)
        if self.cuda_graph_runner is not None:
            self.cuda_graph_runner.capture(self.max_running_requests)

    def _init_model(self, server_args: ServerArgs) -> None:
        """Model config, linear backend, weights, sampler and attention backend; one log line."""
        t0 = time.perf_counter()
        self.model_config = ModelConfig.from_server_args(server_args)
        self.dtype: torch.dtype = self.model_config.dtype
        # resolved (and validated) by ServerArgs.resolve
        weight_dtype = (
            _DTYPES[server_args.weight_dtype] if server_args.weight_dtype not in (None, "auto") else None
        )
        self.linear_backend: LinearBackend = create_linear_backend(
            server_args.linear_backend, weight_dtype, server_args.bf16_prefill_copy
        )
        kv_name = server_args.kv_cache_dtype
        self.kv_cache_dtype: torch.dtype = self.dtype if kv_name in (None, "auto") else _DTYPES[kv_name]
        self.model: nn.Module = self._load_model(self.model_config, server_args.load_format)
        self.load_time_s = time.perf_counter() - t0
        self.weight_bytes = weight_bytes(self.model)
        self.loaded_model_path: str = self.model_config.model_path  # changed by update_weights_from_disk
        # the LoRA adapters (--enable-lora; srt/lora/manager.py), None without
        self.lora = create_lora_manager(self.model, server_args, self.dtype, self.device)

        self.sampler = Sampler()
        self.attn_backend = create_attention_backend(server_args.attention_backend, self)
        check_backend_serves(self.model, self.attn_backend, server_args.attention_backend)
        logger.info(
            "Model loaded in %.1f s: %.1f MiB of weights (%s, quantization %s), process RSS %.1f MiB; "
            "attention %s, linear %s, %d threads",
            self.load_time_s,
            self.weight_bytes / (1 << 20),
            str(self.dtype).removeprefix("torch."),
            server_args.quantization,
            pool_size.process_rss_bytes() / (1 << 20),
            server_args.attention_backend,
            self.linear_backend.name,
            torch.get_num_threads(),
        )
        if (summary := self.linear_backend.load_summary()) is not None:
            logger.info("linear %s: %s", self.linear_backend.name, summary)

    def _new_cuda_graph_runner(self, server_args: ServerArgs) -> CudaGraphRunner | None:
        """The graph runner with its fixed buffers (captured once the pools exist), or None."""
        why = cuda_graph_off_reason(
            self.device, server_args.disable_cuda_graph, self.attn_backend, self.tp.enabled
        )
        if why is not None:
            log = logger.info if self.device.type == "cuda" else logger.debug
            log("CUDA graphs off: %s", why)
            return None
        return CudaGraphRunner(self, server_args.cuda_graph_max_bs)

    def _init_memory_pools(self, server_args: ServerArgs) -> None:
        """KV pool size (given or profiled, the minimum over TP ranks), then the req_to_token pool,
        the KV pool and its allocator; one log line."""
        cfg = self.model_config
        self.context_len: int = cfg.context_len
        self.num_kv_heads = cfg.num_key_value_heads  # this rank's
        if self.tp.enabled:
            self.num_kv_heads = head_shard(
                cfg.num_attention_heads, cfg.num_key_value_heads, self.tp.size, self.tp.rank
            ).kv_count
        self.bytes_per_token = pool_size.kv_bytes_per_token(
            cfg.num_hidden_layers, self.num_kv_heads, cfg.head_dim, self.kv_cache_dtype.itemsize
        )
        self.activation_peak_bytes = 0
        self.cuda_graph_reserve_bytes = 0
        self.max_total_num_tokens = self.tp.all_reduce_min(self._resolve_max_total_num_tokens())
        self.max_running_requests = (
            server_args.max_running_requests
            or pool_size.default_max_running_requests(self.max_total_num_tokens, self.device.type)
        )

        self.req_to_token_pool = ReqToTokenPool(
            pool_size.req_to_token_pool_size(self.max_running_requests),
            pool_size.max_positions(self.context_len, self.max_total_num_tokens),
            self.device,
        )
        self.token_to_kv_pool = self._new_kv_pool(self.max_total_num_tokens)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(
            self.max_total_num_tokens, self.page_size, self.device, debug=server_args.enable_debug_checks
        )
        logger.info(
            pool_size.format_kv_cache_line(
                self.max_total_num_tokens,
                self.token_to_kv_pool.mem_bytes(),
                self.page_size,
                self.max_prefill_tokens,
            )
        )

    def _load_model(self, model_config: ModelConfig, load_format: str | None) -> nn.Module:
        a = self.server_args
        return get_model(
            model_config,
            load_format,
            self.device,
            a.random_seed,
            self.linear_backend,
            a.quantization,
            a.enable_int8_activations,
            self.tp,
            a.gguf_float32_rows,
            pool_size.available_cpu_memory() // 8 if self.device.type == "cpu" else 0,
        )

    def _finish_model(self, model: nn.Module) -> None:
        a = self.server_args
        positions = self.req_to_token_pool.max_context_len
        finish_model(
            model,
            positions,
            self.device,
            self.dtype,
            self.tp,
            a.disable_fused_kernels,
            a.disable_native_decode_layers,
        )

    # ------------------------------------------------------------------ weight updates
    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> tuple[bool, str]:
        """Replace the weights with those of ``model_path`` (same architecture and shapes; see
        srt/model_loader/reload.py). The new model is loaded beside the old one (peak memory:
        both sets of weights) and swapped in only once it loaded: on any failure the old weights
        keep serving and ``(False, why)`` is returned. The caller must not run a batch meanwhile,
        and must drop KV cached under the old weights."""
        a = self.server_args
        t0 = time.perf_counter()
        try:
            cfg = replacement_config(
                self.model_config,
                model_path,
                load_format,
                a.dtype,
                a.context_length,
                a.model_override_args,
                self.device.type,
            )
            mismatch = shape_mismatch(self.model_config, cfg)
            if mismatch is not None:
                return False, mismatch
            model = self._load_model(cfg, cfg.load_format)
        except (ValueError, OSError) as e:  # ConfigError, WeightLoadError, GGUFError, a bad file
            return False, f"weights not updated: {e}"
        except Exception as e:  # noqa: BLE001 - a bad checkpoint must not take the scheduler down
            logger.exception("weight update from %s failed", model_path)
            return False, f"weights not updated: {type(e).__name__}: {e}"
        self._finish_model(model)
        if self.lora is not None:
            self.lora.rebind(model)
        self.model = model  # the old model (and its native decode stack) is freed here
        release_free_memory()
        if self.cuda_graph_runner is not None:  # the graphs read the old weights' memory
            self.cuda_graph_runner.capture(self.max_running_requests)
        self.weight_bytes = weight_bytes(model)
        self.float32_copy_bytes = float32_copy_bytes(model)
        self.loaded_model_path = cfg.model_path
        seconds = time.perf_counter() - t0
        return True, f"Weights updated from {cfg.model_path} ({cfg.load_format}) in {seconds:.1f} s."

    # ------------------------------------------------------------------ per step
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Run the model on one batch; IDLE returns empty ``[0, vocab]`` logits."""
        forward_batch.req_to_token_pool = self.req_to_token_pool
        forward_batch.token_to_kv_pool = self.token_to_kv_pool
        forward_batch.attn_backend = self.attn_backend
        if forward_batch.forward_mode.is_idle():
            return LogitsProcessorOutput(
                next_token_logits=torch.empty(0, self.model_config.vocab_size, device=self.device)
            )
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(forward_batch):
            return self.cuda_graph_runner.replay(forward_batch)
        return self._run_model(forward_batch)

    def sample(self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch) -> SampleOutput:
        """Next token per sequence from ``logits_output.next_token_logits`` with the batch's
        ``sampling_info`` (required unless the batch is IDLE)."""
        if forward_batch.forward_mode.is_idle():
            return SampleOutput(next_token_ids=torch.empty(0, dtype=torch.int64, device=self.device))
        if forward_batch.sampling_info is None:
            raise ValueError("forward_batch.sampling_info must be set to sample")
        with torch.inference_mode():
            return self.sampler(
                logits_output.next_token_logits,
                forward_batch.sampling_info,
                forward_batch.return_logprob,
                forward_batch.top_logprobs_nums,
            )

    def forward_batch_generation(
        self, forward_batch: ForwardBatch
    ) -> tuple[LogitsProcessorOutput, SampleOutput]:
        logits_output = self.forward(forward_batch)
        return logits_output, self.sample(logits_output, forward_batch)

    def _run_model(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        # the backend's planning too: FlashInfer's plan() copies into buffers it may have
        # (re)allocated during the CUDA-graph warm-up, which runs in inference mode, and an
        # in-place update of an inference tensor outside inference mode is an error
        with torch.inference_mode():
            if self.lora is not None:
                self.lora.prepare(forward_batch)
            self.attn_backend.init_forward_metadata(forward_batch)
            return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)

    # ------------------------------------------------------------------ pool sizing
    @property
    def max_prefill_tokens(self) -> int:
        """The largest extend the scheduler may form (also the size of the profiling forward)."""
        a = self.server_args
        return pool_size.profile_prefill_tokens(a.max_prefill_tokens, a.chunked_prefill_size)

    def _new_kv_pool(self, size: int) -> MHATokenToKVPool:
        cfg = self.model_config
        return MHATokenToKVPool(
            size,
            self.page_size,
            self.kv_cache_dtype,
            self.num_kv_heads,
            cfg.head_dim,
            cfg.num_hidden_layers,
            self.device,
        )

    def _resolve_max_total_num_tokens(self) -> int:
        a = self.server_args
        if a.max_total_tokens is not None:
            tokens = page_floor(a.max_total_tokens, self.page_size)
            if tokens < self.page_size:
                raise ConfigError(
                    f"--max-total-tokens ({a.max_total_tokens}) must be at least --page-size ({self.page_size})."
                )
            return tokens

        if self.device.type == "cuda":
            total = torch.cuda.mem_get_info(self.device)[1]
        else:
            total = pool_size.available_cpu_memory()
        self.activation_peak_bytes = self._profile_activation_peak()
        if self.cuda_graph_runner is not None:
            self.cuda_graph_reserve_bytes = self.cuda_graph_runner.reserve_bytes(
                self.activation_peak_bytes, self.max_prefill_tokens
            )
        # the request pool is static memory too; size it for the largest running-request cap
        mrr_bound = a.max_running_requests or pool_size.default_max_running_requests(
            1 << 62, self.device.type
        )
        req_pool_bytes = pool_size.req_to_token_pool_size(mrr_bound) * self.context_len * 8
        static = self.weight_bytes + req_pool_bytes + self.cuda_graph_reserve_bytes
        if a.mem_fraction_static is None:  # CPU: half of what is free once the model is in
            tokens = pool_size.cpu_auto_max_num_tokens(
                total,
                static,
                self.activation_peak_bytes,
                self.bytes_per_token,
                self.page_size,
                self.context_len,
            )
        else:
            tokens = pool_size.profile_max_num_tokens(
                available_bytes=total,
                mem_fraction_static=a.mem_fraction_static,
                weight_bytes=static,
                activation_peak_bytes=self.activation_peak_bytes,
                bytes_per_token=self.bytes_per_token,
                page_size=self.page_size,
            )
        if tokens < self.page_size:
            gib = 1 << 30
            share = "the memory" if a.mem_fraction_static is None else f"{a.mem_fraction_static} x"
            raise ConfigError(
                f"No memory left for the KV cache: {share} {total / gib:.2f} GiB "
                f"- weights {self.weight_bytes / gib:.2f} GiB - activations {self.activation_peak_bytes / gib:.2f} GiB "
                f"- CUDA graphs {self.cuda_graph_reserve_bytes / gib:.2f} GiB <= 0. Raise --mem-fraction-static, "
                "lower --max-prefill-tokens/--chunked-prefill-size (or --cuda-graph-max-bs), "
                "or set --max-total-tokens."
            )
        return tokens

    def _profile_activation_peak(self) -> int:
        """Peak memory growth of one dummy extend of ``max_prefill_tokens`` (activation_profile.py)."""
        return profile_activation_peak(
            self.model,
            self._run_model,
            self._new_kv_pool,
            self.attn_backend,
            self.max_prefill_tokens,
            self.context_len,
            self.page_size,
            self.model_config.vocab_size,
            self.device,
        )

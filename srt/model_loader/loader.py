"""get_model: build the model for a ModelConfig and fill its weights.

    model class (registry, by HF architecture) -> parameters allocated uninitialized on the
    target device, every projection on the given linear backend -> weights streamed in:
        safetensors: safetensors_weights_iterator(model dir)   (stored dtype, cast on copy)
        gguf:        gguf_weights_iterator(file, hf_config, keep) (matrices of the types in keep
                     as GGUF blocks, the rest dequantized float32; keep = the types srt's native
                     kernels cover with quantization "gguf", none with "none")
        dummy:       init_dummy_weights(model, seed)           (seeded random, nothing read)
    -> eval mode, no gradients -> weights prepacked for the linear backend (``prepare_weights``).

With tensor parallelism (``tp`` of size > 1) the built model is first cut to the rank's shapes
(``sharding.shard_model``) and the readers of ``shard_reader.py`` read only the rank's slice of
each tensor; dummy weights are drawn whole and cut the same way (``ShardPlan.views``), so every
load format gives a rank exactly its part of the single-rank model.

Peak memory is the parameters plus one checkpoint tensor (and its dequantization
temporaries); no state dict is ever materialized.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch
from torch import nn

from srt.configs.model_config import LOAD_FORMATS, ModelConfig
from srt.configs.quant_config import (
    KEPT_METHODS,
    keeps_blocks,
    parse_quantization,
    read_quantization_config,
)
from srt.distributed.communication import TPInfo
from srt.kernels import cpu as cpu_kernels
from srt.kernels.cpu import gguf as gguf_kernels
from srt.layers.linear import Linear
from srt.layers.linear_backend import LinearBackend
from srt.layers.logits_processor import LogitsProcessor
from srt.layers.moe import MoEExperts
from srt.layers.parameter import released_param
from srt.layers.quantized_weight import INT8_MAX_ROWS, QuantizedWeight
from srt.layers.vocab_embedding import VocabEmbedding
from srt.model_loader.memory_guard import LoadMemoryGuard
from srt.model_loader.quantized_checkpoint import convert_weights, quantize_inputs_of, use_int8_kernels
from srt.model_loader.quantized_shard import sharded_quantized_iterator
from srt.model_loader.shard_reader import sharded_gguf_iterator, sharded_safetensors_iterator
from srt.model_loader.sharding import ShardPlan, shard_model
from srt.model_loader.weight_utils import (
    init_dummy_weights,
    safetensors_weights_iterator,
    weight_bytes,
)
from srt.models.registry import get_model_class
from srt.utils.cpu_memory import release_free_memory
from srt.utils.errors import ConfigError

logger = logging.getLogger(__name__)


def prepare_weights(model: nn.Module) -> None:
    """Let every linear layer, and the LM head's ``logits_processor``, prepack its loaded weight
    for its backend (a no-op for backends without a packed form). Where the backend needs the
    packed form alone, the plain weights are released: each layer's and the LM head's; a head tied
    to the embedding is released once the embedding reads its rows from the packed panels."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepare_weights()
    logits = getattr(model, "logits_processor", None)
    lm_head = getattr(model, "lm_head", None)
    if (
        isinstance(logits, LogitsProcessor)
        and lm_head is not None
        and getattr(lm_head, "qweight", None) is None
        and not lm_head.weight.is_meta
    ):
        logits.prepare_weights(lm_head.weight)
        if logits.head_packed is None or not logits.linear_backend.packed_only:
            return
        if sum(p is lm_head.weight for _, p in model.named_parameters(remove_duplicate=False)) > 1:  # tied
            if not isinstance(lm_head, VocabEmbedding):
                return
            lm_head.read_rows_from(logits.head_packed)  # the tied module: embedding and head at once
        lm_head.weight = released_param(lm_head.weight)


def get_model(
    model_config: ModelConfig,
    load_format: str | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    linear_backend: LinearBackend | None = None,
    quantization: str = "none",
    int8_activations: bool = False,
    tp: TPInfo | None = None,
    float32_rows: int = 0,
    float32_budget: int | None = None,
) -> nn.Module:
    """The model of ``model_config`` with weights loaded, in eval mode.

    ``load_format`` (default: ``model_config.load_format``) is one of safetensors, gguf, dummy
    (``auto`` means the config's). ``seed`` only matters for dummy weights. ``linear_backend``
    runs the model's matmuls (``F.linear`` when None). ``quantization`` "gguf" keeps a GGUF
    file's matrices in their blocks wherever a native kernel covers the type ("none":
    everything dequantized to float32). ``int8_activations`` (with "gguf"): small-batch matmuls
    quantize their input to int8 (``QuantizedWeight.use_int8_activations``). ``tp`` (size > 1):
    the model of rank ``tp.rank``, reading only its shard (see the module docstring).
    ``float32_rows`` > 0 (with "gguf", without int8 activations, on the native linear backend):
    the matmul weights kept quantized also keep float32 copies for matmuls of that many rows or
    more, when the model's quantized weights take at most ``float32_budget`` bytes in float32
    (``keep_float32_copies``)."""
    fmt = _check_load_format(model_config, load_format, quantization)
    model_cls = get_model_class(model_config.architecture)
    t0 = time.perf_counter()
    with torch.device(device):
        model = model_cls(model_config.hf_config, model_config.dtype, linear_backend)
        plan: ShardPlan | None = shard_model(model, tp) if tp is not None and tp.enabled else None
    bf16_storage = getattr(linear_backend, "weight_dtype", None) == torch.bfloat16
    _load_weights(model, model_config, fmt, quantization, seed, plan, bf16_storage, torch.device(device))
    model.shard_plan = plan  # what LoRA adapters are cut by (srt/lora/adapter.py)
    model.eval().requires_grad_(False)
    prepare_weights(model)
    if bf16_storage:
        _store_embeddings_bf16(model)
    use_int8_kernels(model)
    if int8_activations:
        if not keeps_blocks(quantization):
            raise ConfigError("int8 activations need GGUF weights kept quantized (quantization gguf)")
        for module in model.modules():
            if isinstance(module, QuantizedWeight):
                module.use_int8_activations()
            elif isinstance(module, MoEExperts):
                module.use_int8_activations(INT8_MAX_ROWS)
    elif float32_rows > 0 and keeps_blocks(quantization):
        logger.info(keep_float32_copies(model, float32_rows, float32_budget, linear_backend))
    release_free_memory()
    logger.info(
        "Loaded %s (%s weights, %s) in %.1f s: %.1f MiB%s",
        model_config.architecture,
        fmt,
        model_config.dtype,
        time.perf_counter() - t0,
        weight_bytes(model) / 2**20,
        quantized_summary(model),
    )
    return model


def _round_to_bf16_values(model: nn.Module) -> None:
    """Dummy weights under bf16 storage (a bf16 checkpoint served with float32 activations) take
    the values such a checkpoint holds, bf16 ones kept in float32 until packed: as with the real
    checkpoint, packing then loses nothing (a tied LM head's packed rows are the embedding's)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dtype == torch.float32 and not param.is_meta:
                param.copy_(param.to(torch.bfloat16))


def _store_embeddings_bf16(model: nn.Module) -> None:
    """With bf16 weight storage (a bf16 checkpoint served with float32 activations) the embedding
    table is kept in bf16 too (``VocabEmbedding.store_bf16``), unless it is kept as GGUF blocks or
    shared with the LM head."""
    shared = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for m in model.modules():
        if (
            isinstance(m, VocabEmbedding)
            and m.qweight is None
            and m.packed_rows is None
            and m.weight.dtype == torch.float32
            and not m.weight.is_meta
            and shared[id(m.weight)] == 1
        ):
            m.store_bf16()


def matmul_qweights(model: nn.Module) -> list[QuantizedWeight]:
    """The quantized weights ``model`` multiplies by: every ``Linear``'s and the LM head's (a tied
    head is the embedding's; an untied embedding only looks rows up and is left out). A mixture of
    experts' banks are not ``QuantizedWeight``s."""
    out = [m.qweight for m in model.modules() if isinstance(m, Linear) and m.qweight is not None]
    head = getattr(getattr(model, "lm_head", None), "qweight", None)
    if isinstance(head, QuantizedWeight) and all(head is not q for q in out):
        out.append(head)
    return out


def float32_copy_bytes(model: nn.Module) -> int:
    """Bytes of the float32 copies ``keep_float32_copies`` made (0 without)."""
    copies = (q.float32_copy for q in matmul_qweights(model))
    return sum(c.numel() * c.element_size() for c in copies if c is not None)


def keep_float32_copies(
    model: nn.Module, min_rows: int, budget: int | None, linear_backend: LinearBackend | None
) -> str:
    """Give every quantized matmul weight of ``model`` a float32 copy for matmuls of at least
    ``min_rows`` rows (``QuantizedWeight.keep_float32_copy``), all or none: none unless srt's packed
    float32 kernel is the linear backend, or when the model is not small: its quantized weights,
    the experts' included, would take more than ``budget`` bytes in float32 (None: no limit).
    Returns one line for the log."""
    qweights = [q for q in matmul_qweights(model) if not q.token_int8]  # W8A8 ones run on int8
    if not qweights:
        return "float32 copies of the GGUF weights: none (no matmul weight is kept quantized)"
    if linear_backend is None or linear_backend.name != "native" or not cpu_kernels.native_available():
        return "float32 copies of the GGUF weights: none (they run on --linear-backend native only)"
    whole = 0
    for m in model.modules():
        if isinstance(m, QuantizedWeight) and not m.token_int8:
            whole += 4 * m.out_features * m.in_features
        elif isinstance(m, MoEExperts):
            whole += 4 * 3 * m.num_experts * m.hidden_size * m.intermediate_size
    if budget is not None and whole > budget:
        return (
            f"float32 copies of the GGUF weights: none (the quantized weights take {whole / 2**30:.2f} GiB "
            f"in float32, over the {budget / 2**30:.2f} GiB allowed: 1/8 of the memory available)"
        )
    made = sum(q.keep_float32_copy(min_rows) for q in qweights)
    return (
        f"float32 copies of the GGUF weights for matmuls of >= {min_rows} rows: {made / 2**20:.1f} MiB "
        f"({len(qweights)} weights)"
    )


def _check_load_format(model_config: ModelConfig, load_format: str | None, quantization: str) -> str:
    """The load format to use (``None`` / ``auto``: the config's), checked against the model file
    and ``quantization``; ConfigError when they do not fit together."""
    fmt = model_config.load_format if load_format in (None, "auto") else load_format
    if fmt not in LOAD_FORMATS:
        raise ConfigError(f"unknown load format {fmt!r}")
    if fmt == "gguf" and model_config.gguf_file is None:
        raise ConfigError(f"load format gguf needs a .gguf model, got {model_config.model_path}")
    if fmt == "safetensors" and model_config.gguf_file is not None:
        raise ConfigError("load format safetensors was requested for a .gguf model")
    if quantization not in ("none", "gguf") + KEPT_METHODS:
        raise ConfigError(
            f"unknown quantization {quantization!r} (expected gguf, {', '.join(KEPT_METHODS)} or none)"
        )
    if quantization in KEPT_METHODS and fmt != "safetensors":
        raise ConfigError(f"--quantization {quantization} needs a safetensors checkpoint (load format {fmt})")
    if quantization == "gguf" and fmt != "gguf":
        raise ConfigError(f"--quantization gguf needs a .gguf model (load format {fmt})")
    return fmt


def _load_weights(
    model: nn.Module,
    model_config: ModelConfig,
    fmt: str,
    quantization: str,
    seed: int,
    plan: ShardPlan | None,
    bf16_storage: bool,
    device: torch.device,
) -> None:
    """Fill ``model``'s weights from the source ``fmt`` names (only this rank's shard with a ``plan``).
    ``bf16_storage``: float32 activations on bf16 weights, whose dummy values are bf16 ones.
    On the CPU the free memory is checked as the tensors are written (memory_guard.py)."""
    guard = LoadMemoryGuard() if device.type == "cpu" else None
    checked = guard.iterate if guard is not None else iter
    if fmt == "dummy":
        views = None if plan is None else plan.views
        init_dummy_weights(model, seed, views=views, before_write=guard.check if guard else None)
        if bf16_storage:
            _round_to_bf16_values(model)
    elif fmt == "gguf":
        from srt.model_loader.gguf import gguf_weights_iterator

        keep = frozenset()
        if quantization == "gguf":
            keep = gguf_kernels.native_qtypes()
            if not keep:
                _check_float32_fits(model_config.gguf_file)
        if plan is not None:
            weights = sharded_gguf_iterator(model_config.gguf_file, model_config.hf_config, keep, plan)
        else:
            weights = gguf_weights_iterator(model_config.gguf_file, model_config.hf_config, keep)
        model.load_weights(checked(weights))
    else:
        qc = read_quantization_config(model_config.model_path)
        scheme = None if qc is None else parse_quantization(qc)
        quantized: set[str] = set()
        keep = quantization in KEPT_METHODS  # kept as GGUF blocks, or dequantized (quantization none)
        if plan is not None and scheme is not None:
            weights = sharded_quantized_iterator(model_config.model_path, plan, scheme, keep, quantized)
        elif plan is not None:
            weights = sharded_safetensors_iterator(model_config.model_path, plan)
        else:
            weights = safetensors_weights_iterator(model_config.model_path)
            if scheme is not None:
                weights = convert_weights(weights, scheme, keep_blocks=keep, done=quantized)
        model.load_weights(checked(weights))
        if scheme is not None and scheme.token_quant is not None:
            n = quantize_inputs_of(model, quantized, scheme.token_quant)
            logger.info(
                "%s: %d linear layers quantize their inputs per token (%s)",
                scheme.name,
                n,
                scheme.token_quant,
            )


def _check_float32_fits(gguf_file: str) -> None:
    """Without native GGUF kernels the weights are dequantized to float32: fine for a small model
    (with a warning), a ``ConfigError`` when the float32 weights would not fit in memory (a 7B
    Q4_K_M file would need about 28 GB where its blocks need 4)."""
    import math

    from srt.configs.gguf_header import open_gguf
    from srt.mem_cache.pool_size import available_cpu_memory

    need = sum(math.prod(t.shape) * 4 for t in open_gguf(gguf_file).tensors)
    have = available_cpu_memory()
    why = cpu_kernels.kernel_status()
    if need > 0.8 * have:
        raise ConfigError(
            f"--quantization gguf: the native GGUF kernels are unavailable ({why}), and dequantized to "
            f"float32 the weights would need {need / 2**30:.1f} GiB with {have / 2**30:.1f} GiB available. "
            "Build the kernels (python -m srt.kernels.cpu.build) or use a smaller model."
        )
    logger.warning(
        "--quantization gguf: no native GGUF kernels (%s); dequantizing every weight to float32", why
    )


def quantized_summary(model: nn.Module) -> str:
    """``"; kept quantized: Q4_1 x 150 (x MiB), ..."`` for the model's GGUF-block weights, or ""."""
    per_type: dict[str, list[int]] = {}
    for module in model.modules():
        if isinstance(module, QuantizedWeight):
            for i, (_, _, qtype) in enumerate(module.segments):
                name = gguf_kernels.QTYPE_NAMES.get(qtype, "F32")
                entry = per_type.setdefault(name, [0, 0])
                entry[0] += 1
                entry[1] += getattr(module, f"data{i}").nbytes
    if not per_type:
        return ""
    parts = [f"{name} x {n} ({nbytes / 2**20:.1f} MiB)" for name, (n, nbytes) in sorted(per_type.items())]
    return "; kept quantized: " + ", ".join(parts)

"""A Llama-family model's decoder layers for DECODE steps as one native call.

A single-stream decode step of a small model is mostly overhead: the default model's 30 layers
run about 360 small ops, and between them Python and the dispatcher cost about as much as the
matmuls (a third of a 15 ms step on a 2-core CPU). ``NativeDecodeLayers`` hands the whole layer
stack to ``torch.classes.srt_cpu.DecodeLayers`` (srt/kernels/cpu/decode_layers.cpp), which runs
the same kernels in the same order from C++: its output is bit for bit the Python path's
(tests/unit/test_native_decode_layers.py).

It applies when every projection of every layer is either GGUF blocks of natively supported types
(``--quantization gguf``, the default for GGUF models on CPU; a projection whose rows mix types,
as a Q4_K_M file's q/k/v do, runs one kernel per type) or a float32 weight packed for
srt's kernel (``--linear-backend native``, the default on AVX2 CPUs; or a bf16 one with
``--weight-dtype bfloat16``, widened in registers), activations are float32 on
the CPU, and the attention backend decodes through the native paged kernel (``fused_cpu``).
A bf16 model (``--dtype bfloat16``, what a bf16 checkpoint gets on a CPU with bf16 arithmetic)
takes it too, with bf16 activations: its projections bf16 panels, FP8 codes or a W8A8
checkpoint's int8 rows (the int8 kernel takes and returns bf16), its norms and rope table bf16,
the very kernels of the Python path on bf16 rows (elementwise.py), so again the same bits.
EXTEND and MIXED batches, oneDNN or torch matmuls and everything else keep the layer-by-layer
Python path. ``--disable-native-decode-layers`` turns it off.

Weights with float32 copies (``QuantizedWeight.keep_float32_copy``) get a second stack on the
copies, which batches of at least that many sequences take, as ``QuantizedWeight.linear`` does.

Each layer's sliding window and logit soft-cap (its ``RadixAttention``'s ``sliding_window_size``
and ``logit_cap``, e.g. Mistral's ``sliding_window``) go to the native stack with the layer, whose
paged decode kernel applies them as the layer-by-layer path does; a layer whose softmax scale
differs from layer 0's keeps the whole model on the Python path.

A batch running LoRA adapters (``forward_batch.lora``, its rows grouped by adapter in runs) hands
the stack each projection's update per group (``_lora_args``: the layers' ``Linear.lora`` tables,
built once per set of groups and adapter version), which it adds after the projection with the
ops of the Python path (``lora_segments_``); a batch whose groups are not runs of rows takes the
Python path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from srt.kernels import cpu as cpu_kernels
from srt.layers.linear import Linear
from srt.layers.moe import SparseMoeBlock
from srt.layers.quantized_weight import W8A8_TYPE, QuantizedWeight

if TYPE_CHECKING:
    from torch import nn

    from srt.layers.forward_batch import ForwardBatch


# DecodeLayers' qtypes for a float32 weight packed by pack_linear_weight and a bf16 one packed by
# pack_bf16_weight (decode_layers.cpp)
PACKED_F32 = -1
PACKED_BF16 = -2
# an FP8 layer's codes in one byte (pack_fp8_weight, fp8_linear)
PACKED_FP8 = -4
# DecodeLayers.set_token_quant's kinds of Linear.token_quant
TOKEN_QUANT_KINDS = {None: 0, "int8": 1, "fp8": 2}
# activation dtypes of the native stack (a float32 model, a bf16 one)
_DTYPES = (torch.float32, torch.bfloat16)
# the projections' kinds whose kernels take bf16 activations (a bf16 model's)
_BF16_KINDS = (PACKED_BF16, PACKED_FP8, W8A8_TYPE)


def _blocks(linear: Linear, float32: bool = False) -> list[tuple[torch.Tensor, int, int]] | None:
    """The ``(data, qtype, rows)`` segments of a projection as DecodeLayers.add_layer takes them:
    GGUF blocks of native types (one segment per type, in row order), or the native backend's
    packed weight of a float32 layer (float32 panels, ``PACKED_F32``, or bf16 ones with
    ``--weight-dtype bfloat16``, ``PACKED_BF16``, or an FP8 layer's codes in one byte,
    ``PACKED_FP8``; rows = N); None when the projection has neither.
    ``float32``: a quantized weight's float32 copy instead of its blocks (None without one)."""
    if linear.qweight is not None:
        if float32:
            copy = linear.qweight.float32_copy
            return None if copy is None else [(copy, PACKED_F32, linear.out_features)]
        return linear.qweight.native_segments
    packed = linear.packed_weight
    fp8 = linear.weight.dtype == torch.float8_e4m3fn
    if (
        linear.linear_backend.name != "native"
        or packed is None
        or not (fp8 or linear.weight.dtype in _DTYPES)
    ):
        return None
    # the bias in the activations' dtype: the weight's, or float32 for bf16 storage of a float32 model
    if linear.bias is not None and (
        linear.bias.dtype not in (linear.plain_dtype, torch.float32) or not linear.bias.is_contiguous()
    ):
        return None
    qtype = PACKED_FP8 if fp8 else PACKED_BF16 if packed.dtype == torch.bfloat16 else PACKED_F32
    return [(packed, qtype, linear.out_features)]


def _projections(layer: nn.Module) -> tuple[Linear | None, ...]:
    """A layer's (qkv, o, gate_up, down) projections; the MLP's None in a mixture-of-experts layer."""
    attn, mlp = layer.self_attn, layer.mlp
    dense = isinstance(getattr(mlp, "gate_up_proj", None), Linear)
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj if dense else None, mlp.down_proj if dense else None


def _int8_rows(linear: Linear) -> int:
    return 0 if linear.qweight is None else linear.qweight.int8_max_rows


def _set_moe(stack: torch.ScriptObject, block: SparseMoeBlock, float32: bool) -> str | None:
    """Make the stack's last layer's MLP ``block`` (``DecodeLayers.set_moe``); the reason it cannot
    (nothing set), or None."""
    experts = block.experts
    if experts.down is None:  # dummy weights: filled in place, never loaded
        experts.finalize()
    if experts.token_quant is not None:
        return f"has experts whose inputs are quantized per token ({experts.token_quant})"
    banks = experts.native_banks()
    if banks is None:
        return "has experts that are neither float32 nor GGUF blocks of native types"
    dense = [block.gate]
    if block.shared_expert is not None and block.shared_expert_gate is not None:
        dense += [block.shared_expert.gate_up_proj, block.shared_expert.down_proj, block.shared_expert_gate]
    segments = [_blocks(p, float32) for p in dense]
    if any(s is None for s in segments) or any(p.bias is not None for p in dense):
        return "has a router or shared expert that is neither native GGUF blocks nor packed float32"
    int8_rows = {_int8_rows(p) for p in dense if p.qweight is not None} or {0}
    if len(int8_rows) > 1:
        return "has a router and shared expert that differ in their int8-activation choice"
    cols = [[list(col) for col in zip(*seg, strict=True)] for seg in segments]
    shared = [x for c in cols[1:] for x in c] if len(cols) > 1 else [[], [], []] * 3
    gate_up, gate_up_qtypes, down, down_qtype = banks
    stack.set_moe(
        *cols[0], block.top_k, block.renormalize, gate_up, gate_up_qtypes, down, down_qtype,
        experts.int8_max_rows, *shared, int8_rows.pop(),
    )  # fmt: skip
    return None


def _model_refusal(layers: list[nn.Module]) -> str | None:
    """Why the model as a whole cannot take the native stack (its dtype, its rope), or None."""
    dtype = layers[0].input_layernorm.weight.dtype  # the activations'
    rope = layers[0].self_attn.rotary_emb
    if dtype not in _DTYPES:
        return f"the model's dtype is {dtype}, neither float32 nor bfloat16"
    if rope.cos_sin_cache.device.type != "cpu":
        return "the rotary cache is not on the CPU"
    if rope.rotary_dim != rope.head_dim:
        return "the rotary embedding is partial"
    return None


def _add_layer(
    stack: torch.ScriptObject, layer: nn.Module, projections: tuple, blocks: list, moe: bool
) -> None:
    """``stack.add_layer`` of one layer: its norms, its projections' segments (``blocks``), q/k norms,
    window and soft-cap; then which projections quantize their inputs per token (W8A8)."""
    attn = layer.self_attn
    args: list[object] = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    for proj, segments in zip(projections, blocks, strict=True):
        data, qtypes, x8_rows = (list(col) for col in zip(*segments, strict=True))
        args += [data, qtypes, x8_rows, proj.bias]
    args += [None if n is None else n.weight for n in (attn.q_norm, attn.k_norm)]
    if moe:  # no dense gate_up / down: set_moe gives the sparse block
        args[10:10] = [[], [], [], None, [], [], [], None]
    args += [int(attn.attn.sliding_window_size), float(attn.attn.logit_cap)]
    stack.add_layer(*args)
    # a token_int8 weight's kernel quantizes its inputs itself
    kinds = [
        0 if p.qweight is not None and p.qweight.token_int8 else TOKEN_QUANT_KINDS[p.token_quant]
        for p in projections
    ]
    if any(kinds):  # a W8A8 / FP8_DYNAMIC checkpoint's layers
        stack.set_token_quant(kinds + [0] * (4 - len(kinds)))
    scales = [p.output_scale for p in projections]
    if any(s is not None for s in scales):  # an FP8 checkpoint's layers: float8 codes, scaled outputs
        stack.set_output_scales(scales + [None] * (4 - len(scales)))


class NativeDecodeLayers:
    """See the module docstring. ``build(model)`` returns ``(instance or None, why)``."""

    def __init__(
        self,
        stack: torch.ScriptObject,
        num_layers: int,
        float32_stack: torch.ScriptObject | None = None,
        float32_rows: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.stack = stack
        self.num_layers = num_layers
        self.dtype = dtype  # the activations' (the hidden states a step passes)
        # batches of at least float32_rows sequences: the stack on the weights' float32 copies,
        # as QuantizedWeight.linear takes them from that many rows on
        self.float32_stack = float32_stack
        self.float32_rows = float32_rows
        # per layer, its (qkv, o, gate_up, down) Linears (None for a MoE layer's MLP): LoRA updates
        self.linears: list[tuple[Linear | None, ...]] = []
        self._lora_key: tuple | None = None
        self._lora_ab: list[torch.Tensor] = []

    @classmethod
    def build(cls, model: nn.Module) -> tuple[NativeDecodeLayers | None, str]:
        """``model``: a ``srt.models.llama.LlamaModel`` (its ``layers``, loaded)."""
        if not (cpu_kernels.native_available() and hasattr(torch.classes.srt_cpu, "DecodeLayers")):
            return None, f"the native kernels are unavailable ({cpu_kernels.kernel_status()})"
        layers = list(model.layers)
        if not layers:
            return None, "the model has no layers"
        stack, why = cls._build_stack(layers, float32=False)
        if stack is None:
            return None, why
        rows = {m.float32_rows for layer in layers for m in layer.modules() if isinstance(m, QuantizedWeight)}
        if len(rows) != 1 or not min(rows):
            native = cls(stack, len(layers), dtype=layers[0].input_layernorm.weight.dtype)
        else:
            float32_stack, why32 = cls._build_stack(layers, float32=True)
            if float32_stack is None:
                native, why = cls(stack, len(layers)), f"{why}; the float32 copies not: {why32}"
            else:
                n = rows.pop()
                native = cls(stack, len(layers), float32_stack, n)
                why = f"{why} (from {n} sequences on the float32 copies)"
        native.linears = [_projections(layer) for layer in layers]
        return native, why

    @staticmethod
    def _build_stack(layers: list[nn.Module], float32: bool) -> tuple[torch.ScriptObject | None, str]:
        """The DecodeLayers of ``layers`` on their quantized blocks / packed float32 weights, or
        (``float32``) on the float32 copies of the quantized ones; (None, why) when it cannot."""
        why = _model_refusal(layers)
        if why:
            return None, why
        first = layers[0].self_attn
        rope = first.rotary_emb
        dtype = layers[0].input_layernorm.weight.dtype  # the activations'
        norm_eps = layers[0].input_layernorm.eps
        int8_max_rows = _int8_rows(first.qkv_proj)  # one choice for the whole model
        stack = torch.classes.srt_cpu.DecodeLayers(
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            norm_eps,
            first.attn.scaling,
            rope.table(dtype),
            int8_max_rows,
        )
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            moe = mlp if isinstance(mlp, SparseMoeBlock) else None
            dense = () if moe is not None else (mlp.gate_up_proj, mlp.down_proj)
            projections = (attn.qkv_proj, attn.o_proj, *dense)
            blocks = [_blocks(p, float32) for p in projections]
            if dtype == torch.bfloat16 and not all(s[1] in _BF16_KINDS for b in blocks if b for s in b):
                return None, (
                    f"layer {i} has a projection that is neither bf16 panels, FP8 codes nor W8A8 int8 "
                    "rows in a bf16 model"
                )
            if any(b is None for b in blocks):
                return None, (
                    f"layer {i} has a projection that is neither natively supported GGUF types "
                    "nor a float32 weight packed for --linear-backend native"
                )
            if any(_int8_rows(p) != int8_max_rows for p in projections):
                return None, f"layer {i}'s projections differ in their int8-activation choice"
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(n.eps != norm_eps or n.weight.dtype != dtype for n in norms):
                return None, f"layer {i}'s norms differ from layer 0's (eps or dtype)"
            if attn.rotary_emb is not rope:
                return None, f"layer {i} has its own rotary embedding"
            if attn.attn.scaling != first.attn.scaling:
                return None, f"layer {i}'s attention scale differs from layer 0's"
            _add_layer(stack, layer, projections, blocks, moe is not None)
            if moe is not None:
                why = _set_moe(stack, moe, float32)
                if why:
                    return None, f"layer {i}'s mixture of experts {why}"
        return stack, f"{len(layers)} layers in one native call per decode step"

    def forward(
        self, hidden_states: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(mlp output, residual)`` after the last layer for a DECODE batch (the caller adds them
        in the final norm), or None when this batch cannot take the native path."""
        backend = forward_batch.attn_backend
        if backend is None or hidden_states.dtype != self.dtype:
            return None
        args = backend.native_decode_args()
        pool = forward_batch.token_to_kv_pool
        if args is None or pool is None or args[1].numel() != hidden_states.shape[0]:
            return None
        req_to_token, rows, lens = args
        lora = forward_batch.lora
        if lora is not None and not lora.runs_only:
            return None
        lora_ab, starts, ends = self._lora_args(lora) if lora is not None else ([], [], [])
        stack = self.stack
        if self.float32_stack is not None and hidden_states.shape[0] >= self.float32_rows:
            stack = self.float32_stack
        out = stack.forward(
            hidden_states.contiguous(),
            positions.to(torch.int64).contiguous(),
            pool.k_buffer,
            pool.v_buffer,
            forward_batch.out_cache_loc.to(torch.int64).contiguous(),
            req_to_token,
            rows,
            lens,
            lora_ab,
            starts,
            ends,
        )
        return out[0], out[1]

    def _lora_args(self, batch) -> tuple[list[torch.Tensor], list[int], list[int]]:
        """The stack's LoRA arguments for ``batch`` (a LoRABatch of runs; decode_layers.cpp)."""
        slots = tuple(slot for slot, _ in batch.groups)
        key = (slots, batch.version)
        if key != self._lora_key:
            none = torch.empty(0)
            ab: list[torch.Tensor] = []
            for projections in self.linears:
                for linear in projections:
                    table = linear.lora.slots if linear is not None and linear.lora is not None else {}
                    for slot in slots:
                        w = table.get(slot)
                        ab += (w.A, w.B) if w is not None else (none, none)
            self._lora_key, self._lora_ab = key, ab
        return (
            self._lora_ab,
            [rows.start for _, rows in batch.groups],
            [rows.stop for _, rows in batch.groups],
        )

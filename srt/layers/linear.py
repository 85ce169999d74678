"""Linear layers with weights in F.linear's layout (``weight [out, in]``, contiguous).

Fused projections run as one matmul: ``QKVLinear`` stacks q/k/v and ``MergedColumnLinear``
stacks e.g. gate/up along the output dimension. Checkpoints store the parts separately;
``load_shard`` copies one part into its row block:

    QKVLinear rows:          [0, H*D) q | [H*D, (H+Hkv)*D) k | [(H+Hkv)*D, (H+2Hkv)*D) v
    MergedColumnLinear rows: output_sizes[0] rows of shard 0, then shard 1, ...

Parameters are created uninitialized (``empty_param``) with ``requires_grad=False``.

Every layer runs its matmul through the ``LinearBackend`` it was built with (``linear_backend``;
``TORCH_LINEAR``, i.e. ``F.linear``, when none is given). Once its weights are loaded the
loader calls ``prepare_weights()``, which lets the backend make a prepacked copy of the weight
(``packed_weight``, a non-persistent buffer; see ``LinearBackend.pack_weight``); a backend that
needs nothing else (``packed_only``: the native one) gets the plain ``weight`` released, left as a
``meta`` tensor of the same shape and dtype. The ModelRunner builds the backend
named by ``--linear-backend`` and passes it down through the model's constructor; see
``srt/layers/linear_backend.py``.

Tensor parallelism cuts a layer to a rank's part before loading (``shard``, ``shard_outputs``,
``shard_heads``; called by ``srt/model_loader/sharding.py``); the all-reduce after a row-parallel
layer is a forward hook installed there, so ``forward`` is the same with and without TP.

With ``--quantization gguf`` the loader hands a layer ``GGUFTensor`` parts (the file's blocks)
instead of float32 tensors: the first one moves the layer to a ``QuantizedWeight`` (``qweight``;
rows already loaded as float32 move with it) and releases the float32 ``weight`` (left as an empty
``[0, in]`` placeholder that was never touched, so it never took memory); the matmul then runs on
the blocks (``srt/layers/quantized_weight.py``), and the bias stays float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from srt.layers.linear_backend import TORCH_LINEAR, LinearBackend
from srt.layers.parameter import copy_weight, empty_param, released_param
from srt.layers.quantized_weight import (
    BlockScaledCodes,
    GGUFTensor,
    QuantizedWeight,
    ScaledRows,
    expand_block_scale,
)
from srt.utils.errors import WeightLoadError


def fake_quant_rows(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Dynamic symmetric quantization of each row (token), as a W8A8 / FP8_DYNAMIC checkpoint's
    scheme says and compressed-tensors computes it. ``kind`` "int8": scale = max|row| / 127.5,
    codes = clamp(round(x / scale), -128, 127); "fp8": scale = max|row| / 448, codes =
    float8_e4m3(clamp(x / scale, -448, 448)); a row of zeros gets the dtype's eps as its scale.
    Returns codes * scale in x's dtype (the values an 8-bit GEMM with per-token scales multiplies)."""
    scale = x.abs().amax(dim=-1, keepdim=True) / (127.5 if kind == "int8" else 448.0)
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    if kind == "int8":
        return torch.round(x / scale).clamp_(-128, 127) * scale
    return (x / scale).clamp_(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * scale


class Linear(nn.Module):
    """``y = x @ weight.T + bias``; x ``[..., in_features]`` -> ``[..., out_features]``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        linear_backend: LinearBackend | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.linear_backend = linear_backend or TORCH_LINEAR
        # a backend storing float32 weights in bf16 (a bf16 checkpoint served with float32
        # activations) gets them in bf16 from the start: the checkpoint's values, and no float32
        # copy of the whole model in memory before packing
        storage = getattr(self.linear_backend, "weight_dtype", None)
        float32 = (dtype or torch.get_default_dtype()) == torch.float32
        wdtype = torch.bfloat16 if storage == torch.bfloat16 and float32 else dtype
        self.weight = empty_param(out_features, in_features, dtype=wdtype)
        self.plain_dtype = self.weight.dtype  # the weight's dtype unless FP8 codes are kept in one byte
        self.bias = empty_param(out_features, dtype=dtype) if bias else None
        self.packed_weight: torch.Tensor | None
        self.register_buffer("packed_weight", None, persistent=False)
        self.qweight: QuantizedWeight | None = None  # set when the loader gives GGUF blocks
        self._float_rows: list[tuple[int, int]] = []  # (offset, rows) loaded as float32 so far
        # a W8A8 / FP8_DYNAMIC checkpoint's layer: its inputs quantized per token first
        # ("int8" / "fp8": fake_quant_rows), else None
        self.token_quant: str | None = None
        # an FP8 checkpoint's layer: its float8 codes are the weight (in one byte, float8_e4m3fn,
        # where the backend computes on them: ``stores_fp8``; else in the weight's dtype, exact), each
        # output row is multiplied by its scale (ScaledRows); float32 [out_features], 1 for rows
        # loaded as plain floats
        self.register_buffer("output_scale", None, persistent=False)
        # a block-scaled FP8 checkpoint's layer kept as codes (``stores_fp8_blocks``): its float8
        # weight's scale grid, float32 [ceil(out / rows), ceil(in / cols)], and the block (rows, cols)
        self.block_scale: torch.Tensor | None = None
        self.fp8_block: tuple[int, int] | None = None
        # the LoRA adapters' updates of this layer (srt/lora/layer.py), set once an adapter targets it
        self.lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._base_forward(x)
        return out if self.lora is None else self.lora(x, out)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu_and_mul(self(x))`` for a gate/up layer in one pass where the backend has one
        (``LinearBackend.apply_silu_mul``) and nothing else touches the output (no LoRA, quantized
        weight, token quantization or output scale); else None: call the layer, then the activation."""
        altered = (self.lora, self.qweight, self.token_quant, self.output_scale)
        if any(a is not None for a in altered):
            return None
        return self.linear_backend.apply_silu_mul(x, self.weight, self.bias, self.packed_weight)

    def _base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.token_quant is not None and not (self.qweight is not None and self.qweight.token_int8):
            x = fake_quant_rows(x, self.token_quant)  # else the int8 kernel quantizes x itself
        if self.qweight is not None:
            return self.qweight.linear(x, self.bias)
        if self.output_scale is not None:  # FP8 codes as the weight: (x @ codes.T) * scale + bias
            out = self.linear_backend.apply(x, self.weight, None, self.packed_weight)
            scaled = out * self.output_scale  # in float32 for a bf16 model too, then back
            return (scaled if self.bias is None else scaled + self.bias).to(out.dtype)
        return self.linear_backend.apply(x, self.weight, self.bias, self.packed_weight)

    def load_quantized(
        self, loaded: GGUFTensor | ScaledRows | BlockScaledCodes, name: str = "weight"
    ) -> None:
        """Take the whole weight as GGUF blocks, scaled rows or block-scaled codes (``[out, in]``)."""
        self._load_rows(0, loaded, name)

    def _load_rows(
        self, row_offset: int, loaded: GGUFTensor | ScaledRows | BlockScaledCodes | torch.Tensor, name: str
    ) -> None:
        """Place a weight part (GGUF blocks, FP8 codes with their scales, or float32 ``[rows, in]``)
        at ``row_offset``."""
        if isinstance(loaded, BlockScaledCodes):
            if self._keeps_blocks(row_offset, loaded):
                self._load_blocks(row_offset, loaded, name)
                return
            loaded = loaded.value()  # dequantized: float rows
        if isinstance(loaded, ScaledRows):
            if self.qweight is not None:  # beside GGUF blocks: its exact values as float rows
                self.qweight.add(row_offset, loaded.value(), name)
                return
            if self.output_scale is None:  # rows loaded as plain floats keep the scale 1
                self.output_scale = torch.ones(self.out_features, device=self.weight.device)
            self.output_scale[row_offset : row_offset + loaded.shape[0]] = loaded.scale
            if not self._float_rows and getattr(self.linear_backend, "stores_fp8", False):
                # the first rows, FP8 codes: the weight (never touched yet) becomes one byte a code
                self.weight = empty_param(self.out_features, self.in_features, dtype=torch.float8_e4m3fn)
            loaded = loaded.codes
        elif self.weight.dtype == torch.float8_e4m3fn and not isinstance(loaded, GGUFTensor):
            self._widen_codes()  # plain rows beside FP8 codes kept in one byte
        if self.qweight is None and not isinstance(loaded, GGUFTensor):
            copy_weight(self.weight.narrow(0, row_offset, loaded.shape[0]), loaded, name)
            self._float_rows.append((row_offset, loaded.shape[0]))
            return
        if self.qweight is None:
            if self.output_scale is not None:
                raise WeightLoadError(f"weight {name}: GGUF blocks and FP8 scaled rows in one layer")
            self.qweight = QuantizedWeight(self.out_features, self.in_features)
            for offset, n in self._float_rows:
                self.qweight.add(offset, self.weight.data[offset : offset + n].clone(), name)
            self.weight = empty_param(0, self.in_features, dtype=self.weight.dtype)
        self.qweight.add(row_offset, loaded, name)

    def _keeps_blocks(self, row_offset: int, loaded: BlockScaledCodes) -> bool:
        """Whether block-scaled FP8 rows stay codes: the backend widens them in cache, the layer holds
        no other kind of rows (or blocks of the same size), and the rows start a block of rows."""
        rows, cols = loaded.block
        if row_offset % rows:
            return False
        if self.fp8_block is not None:
            return self.fp8_block == loaded.block
        return (
            getattr(self.linear_backend, "stores_fp8_blocks", False)
            and self.qweight is None
            and self.output_scale is None
            and not self._float_rows
            and rows % 32 == 0
            and cols % 2 == 0
            and self.in_features % 2 == 0
        )

    def _load_blocks(self, row_offset: int, loaded: BlockScaledCodes, name: str) -> None:
        rows, cols = loaded.block
        if self.fp8_block is None:  # the weight (never touched yet) becomes one byte a code
            self.weight = empty_param(self.out_features, self.in_features, dtype=torch.float8_e4m3fn)
            grid = (-(-self.out_features // rows), -(-self.in_features // cols))
            self.block_scale = torch.zeros(grid, device=self.weight.device)
            self.fp8_block = loaded.block
        copy_weight(self.weight.narrow(0, row_offset, loaded.shape[0]), loaded.codes, name)
        first = row_offset // rows
        self.block_scale[first : first + loaded.scale.shape[0]] = loaded.scale.float()

    def _widen_codes(self) -> None:
        """FP8 codes kept in one byte -> the weight's plain dtype: the codes (exact in bf16), or each
        times its block's scale."""
        value = self.weight.data
        if self.fp8_block is not None:
            value = value.float() * expand_block_scale(self.block_scale, self.fp8_block, value.shape)
            self.block_scale = self.fp8_block = None
        self.weight = nn.Parameter(value.to(self.plain_dtype), requires_grad=False)

    def prepare_weights(self) -> None:
        """Once loading is done: finish a quantized weight, or let the backend prepack the float
        one, releasing the plain one when the backend needs the packed form alone."""
        if self.qweight is not None:
            self.qweight.finalize()
            self.packed_weight = None
            return
        if self.weight.is_meta:  # packed already; the plain weight was released
            return
        if self.fp8_block is not None:  # kept by a backend that stores_fp8_blocks
            self.packed_weight = self.linear_backend.pack_fp8_blocks(
                self.weight.data, self.block_scale, self.fp8_block
            )
        else:
            self.packed_weight = self.linear_backend.pack_weight(self.weight.data)
        if self.packed_weight is None and self.weight.dtype == torch.float8_e4m3fn:
            self._widen_codes()  # codes the backend did not pack: F.linear takes them widened
            self.packed_weight = self.linear_backend.pack_weight(self.weight.data)
        if self.packed_weight is not None and self.linear_backend.packed_only:
            self.weight = released_param(self.weight)

    def shard(self, in_features: int, out_features: int, keep_bias: bool = True) -> None:
        """Tensor parallelism, before loading: become this rank's ``[out_features, in_features]``
        part (parameters re-created uninitialized on the weight's device). ``keep_bias=False``
        drops the bias: a row-parallel layer's bias is added by one rank only."""
        device, dtype = self.weight.device, self.weight.dtype
        self.in_features, self.out_features = in_features, out_features
        self.weight = empty_param(out_features, in_features, dtype=dtype).to(device)
        if self.bias is not None:
            self.bias = empty_param(out_features, dtype=dtype).to(device) if keep_bias else None

    def extra_repr(self) -> str:
        kind = "gguf" if self.qweight is not None else self.linear_backend.name
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, backend={kind}"


class MergedColumnLinear(Linear):
    """Several projections of the same input, stacked along the output dim (one matmul)."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
        linear_backend: LinearBackend | None = None,
    ) -> None:
        super().__init__(in_features, sum(output_sizes), bias, dtype, linear_backend)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def shard_outputs(self, in_features: int, output_sizes: list[int]) -> None:
        """Tensor parallelism, before loading: each part keeps ``output_sizes[i]`` rows (this
        rank's slice of it); ``load_shard`` then expects parts of these sizes."""
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.shard(in_features, sum(output_sizes))

    def _shard_index(self, shard_id: int | str) -> int:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise WeightLoadError(f"{type(self).__name__}: unknown shard {shard_id!r}")
        return shard_id

    def load_shard(self, param_name: str, loaded: torch.Tensor | GGUFTensor, shard_id: int | str) -> None:
        """Copy one checkpoint part (``weight [size, in]`` or ``bias [size]``, the weight also as
        GGUF blocks) into its rows."""
        idx = self._shard_index(shard_id)
        param = getattr(self, param_name, None)
        if param is None:
            raise WeightLoadError(f"{type(self).__name__} has no parameter {param_name!r}")
        name = f"{param_name}[shard {shard_id}]"
        offset, size = self.offsets[idx], self.output_sizes[idx]
        if param_name == "weight":
            if loaded.shape[0] != size:
                raise WeightLoadError(
                    f"weight {name}: checkpoint shape {tuple(loaded.shape)} != part shape ({size}, {self.in_features})"
                )
            self._load_rows(offset, loaded, name)
            return
        copy_weight(param.narrow(0, offset, size), loaded, name)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of the parts of an output ``[..., sum(output_sizes)]``."""
        return out.split(self.output_sizes, dim=-1)


class QKVLinear(MergedColumnLinear):
    """Fused q/k/v projection; shards ``"q"``, ``"k"``, ``"v"``."""

    _SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        linear_backend: LinearBackend | None = None,
    ) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, dtype, linear_backend)
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.q_size = q_size
        self.kv_size = kv_size

    def shard_heads(self, num_heads: int, num_kv_heads: int) -> None:
        """Tensor parallelism, before loading: keep ``num_heads`` query and ``num_kv_heads`` KV
        heads (this rank's; the loader hands it exactly those rows)."""
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.q_size, self.kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        self.shard_outputs(self.in_features, [self.q_size, self.kv_size, self.kv_size])

    def _shard_index(self, shard_id: int | str) -> int:
        if shard_id not in self._SHARDS:
            raise WeightLoadError(f"QKVLinear: unknown shard {shard_id!r} (expected q, k or v)")
        return self._SHARDS[shard_id]

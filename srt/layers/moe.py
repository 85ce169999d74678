"""Mixture-of-experts blocks (Qwen2-MoE, Qwen3-MoE, Mixtral): router, top-k, experts grouped by expert.

One sparse block for the ``T`` tokens of a batch (E experts, top-k, expert intermediate I)::

    x [T, H] -> gate (router, a Linear [E, H]) -> logits [T, E]
      -> softmax in float32 -> top-k: weights [T, k], expert ids [T, k]
      -> weights renormalised to sum 1 when ``renormalize`` (Qwen's norm_topk_prob; Mixtral always)
      -> experts, grouped: the T*k (token, expert) pairs sorted by expert id; for each expert
         that got rows, one gate_up matmul over all of them, SiLU-and-mul, one down matmul;
         rows scaled by their routing weight and added back to their tokens (one index_add)
      (+ Qwen2-MoE's shared expert: shared_expert(x) * sigmoid(shared_expert_gate(x)))

Expert weights (``MoEExperts``): float ones stacked as HF stores them fused, ``gate_up_proj
[E, 2I, H]`` (gate rows then up rows per expert) and ``down_proj [E, H, I]``. GGUF ones stay in
their blocks (``--quantization gguf``): llama.cpp's merged ``ffn_*_exps`` tensors hold the experts
one after the other, so expert e's matrix is a contiguous row slice of the ``uint8 [E * rows,
row bytes]`` block tensor, which runs through the GGUF matmul op as it is (gate and up of one type
are interleaved once per expert at load time, bytes only, so gate_up stays one call).

``dense_moe_reference`` runs every expert on every token, weighted by the full routing matrix
(zeros where not selected): the reference the grouped path is tested against, and the path
taken while a CUDA graph is captured (the grouped one reads per-expert counts on the host).

Tensor parallelism (``srt/model_loader/sharding.py``) cuts each expert's intermediate dim: gate_up
rows and down columns, then an all-reduce after the experts (a forward hook), as for a dense MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.kernels.cpu import gguf as gguf_kernels
from srt.layers.activation import SiluAndMul
from srt.layers.linear import Linear, MergedColumnLinear, fake_quant_rows
from srt.layers.linear_backend import LinearBackend
from srt.layers.moe_reference import dense_moe_reference, route_topk
from srt.layers.parameter import copy_weight, empty_param
from srt.layers.quantized_weight import F32_TYPE, BlockScaledCodes, GGUFTensor, ScaledRows
from srt.utils.errors import WeightLoadError

PARTS = ("gate", "up", "down")


class _Bank:
    """The E matrices of one projection, ``[E, rows, cols]``: float, or GGUF blocks ``uint8
    [E, rows, row bytes]`` of ``qtype``. ``linear(e, x)`` is ``x @ matrix_e.T`` (one op call)."""

    def __init__(self, data: torch.Tensor, qtype: int, cols: int) -> None:
        self.data, self.qtype, self.cols = data, qtype, cols
        self.mats = list(data.unbind(0))  # per-expert views (contiguous: rows of one expert)
        self._op = None
        if qtype != F32_TYPE and qtype in gguf_kernels.native_qtypes():
            self._op = torch.ops.srt_cpu.gguf_linear

    def linear(self, e: int, x: torch.Tensor, int8_max_rows: int = 0) -> torch.Tensor:
        """``int8_max_rows`` > 0: inputs of at most that many rows, or enough rows for the type's
        int8 GEMM (``q8a_takes``), quantize x to int8 (blocks only)."""
        if self.qtype == F32_TYPE:
            return F.linear(x, self.mats[e])
        if self._op is not None and x.dtype == torch.float32 and x.is_contiguous():
            if gguf_kernels.q8a_takes(self.qtype, x.shape[0], int8_max_rows):
                return torch.ops.srt_cpu.gguf_linear_q8a(x, self.mats[e], self.qtype, None)
            return self._op(x, self.mats[e], self.qtype, None)
        return gguf_kernels.quant_linear(x.float().contiguous(), self.mats[e], self.qtype)

    def dequantize(self) -> torch.Tensor:
        if self.qtype == F32_TYPE:
            return self.data.float()
        e, rows = self.data.shape[0], self.data.shape[1]
        flat = gguf_kernels.dequantize(self.data.reshape(e * rows, -1), self.qtype, self.cols)
        return flat.view(e, rows, self.cols)


class MoEExperts(nn.Module):
    """E SwiGLU experts (see the module docstring). Load with ``load(part, expert, tensor)``
    (part gate / up / down; expert None: all experts at once, ``[E, rows, cols]`` float or a
    ``GGUFTensor`` of ``E * rows`` rows), then ``finalize()``."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = empty_param(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype)
        self.down_proj = empty_param(num_experts, hidden_size, intermediate_size, dtype=dtype)
        self._quant: dict[tuple[str, int | None], GGUFTensor] = {}
        self._received: dict[str, set[int | None]] = {p: set() for p in PARTS}
        self.gate_up: list[_Bank] = []  # one bank [E, 2I, *], or gate and up banks
        self.down: _Bank | None = None
        # > 0: expert matmuls of at most that many rows quantize x to int8 (``use_int8_activations``)
        self.int8_max_rows = 0
        self.act_fn = SiluAndMul()  # one fused kernel on CUDA
        # a W8A8 / FP8_DYNAMIC checkpoint's experts: both matmuls' inputs quantized per token
        self.token_quant: str | None = None

    def shard(self, intermediate_size: int) -> None:
        """Tensor parallelism, before loading: keep ``intermediate_size`` rows of gate/up and
        columns of down per expert (the rank's; the readers hand it exactly those)."""
        device, dtype = self.gate_up_proj.device, self.gate_up_proj.dtype
        self.intermediate_size = intermediate_size
        e, h = self.num_experts, self.hidden_size
        self.gate_up_proj = empty_param(e, 2 * intermediate_size, h, dtype=dtype).to(device)
        self.down_proj = empty_param(e, h, intermediate_size, dtype=dtype).to(device)

    # ------------------------------------------------------------------ loading
    def _float_target(self, part: str, expert: int | None) -> torch.Tensor:
        i = self.intermediate_size
        if part == "down":
            t = self.down_proj.data
        else:
            t = self.gate_up_proj.data.narrow(1, 0 if part == "gate" else i, i)
        return t if expert is None else t[expert]

    def load(
        self,
        part: str,
        expert: int | None,
        tensor: torch.Tensor | GGUFTensor | ScaledRows | BlockScaledCodes,
        name: str,
    ) -> None:
        """One part of one expert (``expert`` None: every expert's, stacked). FP8 codes with their
        scales are taken as their values (the experts hold float weights or GGUF blocks)."""
        if isinstance(tensor, ScaledRows | BlockScaledCodes):
            tensor = tensor.value()
        if part not in (*PARTS, "gate_up") or (expert is not None and not 0 <= expert < self.num_experts):
            raise WeightLoadError(f"{name}: no expert {expert} / part {part!r} in this layer")
        if isinstance(tensor, GGUFTensor) and part != "gate_up":
            rows = self.hidden_size if part == "down" else self.intermediate_size
            cols = self.intermediate_size if part == "down" else self.hidden_size
            want = (rows if expert is not None else rows * self.num_experts, cols)
            if tensor.shape != want:
                raise WeightLoadError(f"weight {name}: checkpoint shape {tensor.shape} != expected {want}")
            self._quant[(part, expert)] = tensor
        elif part == "gate_up":  # HF's fused [E, 2I, H]
            copy_weight(self.gate_up_proj.data, tensor, name)
            self._received["gate"].add(None)
            self._received["up"].add(None)
            return
        else:
            copy_weight(self._float_target(part, expert), tensor, name)
        self._received[part].add(expert)

    def missing(self) -> list[str]:
        """The parts that did not receive every expert."""
        full = set(range(self.num_experts))
        return [p for p in PARTS if None not in self._received[p] and not full <= self._received[p]]

    def _quant_bank(self, part: str) -> tuple[torch.Tensor, int] | None:
        """``(uint8 [E, rows, bytes], qtype)`` of a part loaded entirely as GGUF blocks, or None
        (a part with float pieces: its quantized pieces are dequantized into the float weight)."""
        pieces = {k[1]: v for k, v in self._quant.items() if k[0] == part}
        e = self.num_experts
        if None in pieces:
            t = pieces[None]
            return t.data.view(e, t.rows // e, -1), t.qtype
        if len(pieces) == e and len({t.qtype for t in pieces.values()}) == 1:
            return torch.stack([pieces[i].data for i in range(e)]), pieces[0].qtype
        for expert, t in pieces.items():  # some pieces float: these join them as float
            target = self._float_target(part, expert)
            target.copy_(gguf_kernels.dequantize(t.data, t.qtype, t.cols).view_as(target))
        return None

    def finalize(self) -> None:
        """Build the banks from what was loaded (GGUF blocks where a whole part came as blocks)."""
        gate, up, down = (self._quant_bank(p) for p in PARTS)
        self._quant = {}
        i, h = self.intermediate_size, self.hidden_size
        if gate is not None and up is not None and gate[1] == up[1]:
            self.register_buffer("qgate_up", torch.cat([gate[0], up[0]], dim=1), persistent=False)
            self.gate_up = [_Bank(self.qgate_up, gate[1], h)]
        elif gate is not None and up is not None:
            self.gate_up = [_Bank(gate[0].contiguous(), gate[1], h), _Bank(up[0].contiguous(), up[1], h)]
        else:
            if gate is not None or up is not None:  # one part blocks, the other float
                for part, q in (("gate", gate), ("up", up)):
                    if q is not None:
                        flat = gguf_kernels.dequantize(q[0].reshape(-1, q[0].shape[-1]), q[1], h)
                        self._float_target(part, None).copy_(flat.view(-1, i, h))
            self.gate_up = [_Bank(self.gate_up_proj.data, F32_TYPE, h)]
        if down is not None:
            self.register_buffer("qdown", down[0].contiguous(), persistent=False)
            self.down = _Bank(self.qdown, down[1], i)
        else:
            self.down = _Bank(self.down_proj.data, F32_TYPE, i)
        if gate is not None and up is not None:
            self.gate_up_proj = empty_param(0, 2 * i, h, dtype=self.gate_up_proj.dtype)
        if down is not None:
            self.down_proj = empty_param(0, h, i, dtype=self.down_proj.dtype)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up [E, 2I, H], down [E, H, I])`` as float32 (tests, the reference path)."""
        if self.down is None:
            return self.gate_up_proj.data.float(), self.down_proj.data.float()
        gate_up = torch.cat([b.dequantize() for b in self.gate_up], dim=1)
        return gate_up, self.down.dequantize()

    # ------------------------------------------------------------------ compute
    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on rows ``x [n, H]`` -> ``[n, H]``."""
        rows = self.int8_max_rows
        if len(self.gate_up) == 1:
            h = self.gate_up[0].linear(e, x, rows)
        else:
            h = torch.cat([b.linear(e, x, rows) for b in self.gate_up], dim=-1)
        a = self.act_fn(h)
        return self.down.linear(
            e, a if self.token_quant is None else fake_quant_rows(a, self.token_quant), rows
        )

    def use_int8_activations(self, max_rows: int) -> None:
        """From now on, expert matmuls of at most ``max_rows`` rows quantize x to int8 per block of
        32 (``gguf_linear_q8a``, as ``QuantizedWeight.use_int8_activations``), when every bank is
        GGUF blocks of a type that kernel runs."""
        q8a = gguf_kernels.q8a_qtypes()
        if self.down is not None and all(b.qtype in q8a for b in (*self.gate_up, self.down)):
            self.int8_max_rows = max_rows

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Grouped by expert (module docstring): x ``[T, H]``, top-k ``weights``/``ids`` ``[T, k]``."""
        if self.down is None:  # dummy weights: filled in place, never loaded
            self.finalize()
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return dense_moe_reference(x, self.gate_up_proj, self.down_proj, weights, ids, self.token_quant)
        native = not x.is_cuda and x.dtype == torch.float32 and self.token_quant is None
        banks = self.native_banks() if native else None
        if banks is not None and x.is_contiguous():
            return torch.ops.srt_cpu.moe_experts(x, weights, ids, *banks, self.int8_max_rows)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k
        xs = x.index_select(0, tokens)
        if self.token_quant is not None:  # per row (token): the same as quantizing x first
            xs = fake_quant_rows(xs, self.token_quant)
        ys = torch.empty(xs.shape[0], self.hidden_size, dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys[start : start + n] = self.expert(e, xs[start : start + n])
                start += n
        ys.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1).to(ys.dtype))
        out = torch.zeros(x.shape[0], self.hidden_size, dtype=x.dtype, device=x.device)
        return out.index_add_(0, tokens, ys)

    def native_banks(self) -> tuple[list[torch.Tensor], list[int], torch.Tensor, int] | None:
        """``(gate_up banks, their qtypes, down bank, its qtype)`` as ``moe_experts``
        (srt/kernels/cpu/moe.cpp) takes them, or None when the op is not built or a bank is
        neither float32 nor GGUF blocks of a native type (then ``forward`` runs op by op)."""
        if self.down is None or not gguf_kernels.moe_available():
            return None
        native = gguf_kernels.native_qtypes()
        banks = [*self.gate_up, self.down]
        for b in banks:
            if b.qtype == F32_TYPE and (b.data.dtype != torch.float32 or b.data.is_cuda):
                return None
            if b.qtype != F32_TYPE and b.qtype not in native:
                return None
        return (
            [b.data for b in self.gate_up],
            [b.qtype for b in self.gate_up],
            self.down.data,
            self.down.qtype,
        )

    def extra_repr(self) -> str:
        kinds = "float" if self.down is None or self.down.qtype == F32_TYPE else "gguf"
        return f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, {kinds}"


class GatedMLP(nn.Module):
    """``down(silu(gate x) * up x)`` with gate/up as one matmul: Qwen2-MoE's shared expert, and the
    dense MLP of layers without experts."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        linear_backend: LinearBackend | None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(
            hidden_size, [intermediate_size] * 2, False, dtype, linear_backend
        )
        self.down_proj = Linear(intermediate_size, hidden_size, False, dtype, linear_backend)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router + experts (+ an optional sigmoid-gated shared expert); ``forward(x [T, H]) -> [T, H]``.

    ``checkpoint_alias``: a second checkpoint module name of the block besides ``mlp`` whose
    experts are named ``w1`` (gate) / ``w3`` (up) / ``w2`` (down): Mixtral's ``block_sparse_moe``."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        dtype: torch.dtype,
        linear_backend: LinearBackend | None = None,
        shared_intermediate_size: int = 0,
        checkpoint_alias: str | None = None,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top-k {top_k} must be in 1..{num_experts} (the number of experts)")
        self.top_k, self.renormalize = top_k, renormalize
        self.checkpoint_alias = checkpoint_alias
        self.gate = Linear(hidden_size, num_experts, False, dtype, linear_backend)
        self.experts = MoEExperts(num_experts, hidden_size, intermediate_size, dtype)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, dtype, linear_backend)
            self.shared_expert_gate = Linear(hidden_size, 1, False, dtype, linear_backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` with the experts run densely (``dense_moe_reference``; tests)."""
        weights, ids = route_topk(self.gate(x), self.top_k, self.renormalize)
        gate_up, down = self.experts.dequantized()
        out = dense_moe_reference(x.float(), gate_up, down, weights, ids).to(x.dtype)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def checkpoint_expert_modules(self, prefix: str) -> list[tuple[str, str, int]]:
        """``(checkpoint module name, part, dim cut under TP)`` of every expert tensor name this
        block (at srt module ``prefix``, e.g. ``model.layers.3.mlp``) may be loaded from: per
        expert ``<prefix>.experts.<e>.gate_proj``, merged ``<prefix>.experts.gate_proj`` (GGUF),
        and the ``checkpoint_alias`` names."""
        namings = [(f"{prefix}.experts", ("gate_proj", "up_proj", "down_proj"))]
        if self.checkpoint_alias:
            layer = prefix.rsplit(".", 1)[0]
            namings.append((f"{layer}.{self.checkpoint_alias}.experts", ("w1", "w3", "w2")))
        out = []
        for base, names in namings:
            for part, name in zip(PARTS, names, strict=True):
                dim = 1 if part == "down" else 0
                out.append((f"{base}.{name}", part, dim))
                out += [(f"{base}.{e}.{name}", part, dim) for e in range(self.experts.num_experts)]
        return out

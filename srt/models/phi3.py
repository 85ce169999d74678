"""Phi-3 / Phi-3.5 / Phi-4-mini (``Phi3ForCausalLM``): the Llama decoder, with

* checkpoints that store q/k/v fused (``self_attn.qkv_proj``, rows q | k | v) and gate/up fused
  (``mlp.gate_up_proj``, rows gate | up); ``load_weights`` cuts them into their parts by the
  layer's part sizes and loads those like Llama's separate tensors. Under tensor parallelism
  the reader has already kept the rank's rows of each part (``ShardPlan.fused_rows``), so the
  same cut by the rank's (local) part sizes holds;
* partial rotary (``partial_rotary_factor``, Phi-4-mini: 0.75) and longrope (``rope_scaling``
  type ``longrope`` / ``su``), both handled by the rope (``srt/layers/rope_scaling.py``);
* an optional sliding window in every layer (``sliding_window``, e.g. 2047 in Phi-3-mini-4k).

No biases anywhere; SiLU-gated MLP; RMSNorm.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from srt.layers.linear import MergedColumnLinear
from srt.layers.quantized_weight import BlockScaledCodes, GGUFTensor, ScaledRows
from srt.models.llama import AttentionOptions, LlamaForCausalLM, window_left_of
from srt.utils.errors import WeightLoadError

Part = (
    torch.Tensor | GGUFTensor | ScaledRows | BlockScaledCodes
)  # a checkpoint matrix as load_weights takes it

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# fused checkpoint module -> its parts' module names, in row order
_FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def split_rows(tensor: Part, start: int, rows: int) -> Part:
    """Rows ``[start, start + rows)`` of a float tensor, of a matrix kept as GGUF blocks, or of an
    FP8 one (its codes and their scales; block-scaled rows that do not start a block of rows come as
    their float32 values)."""
    if isinstance(tensor, GGUFTensor):
        return GGUFTensor(tensor.qtype, rows, tensor.cols, tensor.data.narrow(0, start, rows))
    if isinstance(tensor, ScaledRows):
        return ScaledRows(tensor.codes.narrow(0, start, rows), tensor.scale.narrow(0, start, rows))
    if isinstance(tensor, BlockScaledCodes):
        bn = tensor.block[0]
        if start % bn:
            return tensor.value().narrow(0, start, rows)
        scale = tensor.scale.narrow(0, start // bn, -(-rows // bn))
        return BlockScaledCodes(tensor.codes.narrow(0, start, rows), scale, tensor.block)
    return tensor.narrow(0, start, rows)


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(window_left=window_left_of(config))

    def _split_fused(self, weights: Iterable[tuple[str, Part]]) -> Iterator[tuple[str, Part]]:
        """Each fused checkpoint tensor as its parts, named like Llama's separate ones."""
        modules = dict(self.named_modules())
        for name, tensor in weights:
            module_path, _, param = name.rpartition(".")
            fused = module_path.rpartition(".")[2]
            if fused not in _FUSED_PARTS:
                yield name, tensor
                continue
            module = modules.get(module_path)
            if not isinstance(module, MergedColumnLinear):
                yield name, tensor  # no such layer: load_weights reports it
                continue
            if tensor.shape[0] != sum(module.output_sizes):
                raise WeightLoadError(
                    f"{name}: {tensor.shape[0]} rows; the fused parts have {module.output_sizes}"
                )
            start = 0
            for part, rows in zip(_FUSED_PARTS[fused], module.output_sizes, strict=True):
                yield f"{module_path.rpartition('.')[0]}.{part}.{param}", split_rows(tensor, start, rows)
                start += rows

    def load_weights(self, weights: Iterable[tuple[str, Part]]) -> None:
        """``LlamaForCausalLM.load_weights`` of the checkpoint with its fused tensors cut into
        their parts (module docstring); separate q/k/v or gate/up tensors load as they are."""
        super().load_weights(self._split_fused(weights))

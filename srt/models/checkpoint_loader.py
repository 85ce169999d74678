"""``CheckpointLoader``: how HF-named checkpoint tensors reach srt's fused layers (q/k/v into
``qkv_proj``, gate/up into ``gate_up_proj``: ``STACKED_PARAMS``), with the checks that no tensor
is left over and no parameter left without weights. The Llama family's models (and Gemma's) are
``CheckpointLoader``s; LoRA adapters and quantized checkpoints route by the same table."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from srt.layers.linear import MergedColumnLinear
from srt.layers.parameter import copy_weight
from srt.layers.quantized_weight import BlockScaledCodes, GGUFTensor, ScaledRows
from srt.utils.errors import WeightLoadError

# (fused module name, checkpoint module name, shard id)
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)
_SHARDS_PER_FUSED = {".qkv_proj.": 3, ".gate_up_proj.": 2}
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class CheckpointLoader:
    """``load_weights`` of HF-named checkpoints for an ``nn.Module`` model whose projections are
    srt's fused ``Linear`` layers (q/k/v and gate/up routed by ``STACKED_PARAMS``) and which says
    whether its LM head is tied (``tie_word_embeddings``)."""

    tie_word_embeddings: bool = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the (fused) parameters, one at a time; a
        ``GGUFTensor`` (a matrix kept as GGUF blocks) goes to its layer's ``load_quantized`` /
        ``load_shard``. Subclasses route tensors of their own (``load_special``) and add what
        they check (``missing_weights``).

        Raises ``WeightLoadError`` on a shape mismatch, on a tensor no parameter takes (serving
        without it could serve the checkpoint wrong; only ``_SKIPPED_SUFFIXES``, rotary caches,
        are known to be unused) or when a parameter (or a shard of a fused one) received no
        weight."""
        params = dict(self.named_parameters())
        loaded: dict[str, set[str | int | None]] = {}  # param name -> shards received
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith(_SKIPPED_SUFFIXES) or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if not (self.load_special(name, tensor) or self._load_tensor(params, name, tensor, loaded)):
                unexpected.append(name)
            del tensor
        if unexpected:
            raise WeightLoadError(
                f"the checkpoint has {len(unexpected)} tensors that no parameter of "
                f"{type(self).__name__} takes: {unexpected[:8]}"
            )
        missing = self.missing_weights(params, loaded)
        if missing:
            raise WeightLoadError(
                f"the checkpoint has no weights for {len(missing)} parameters: {missing[:8]}"
            )

    def load_special(self, name: str, tensor: torch.Tensor | GGUFTensor) -> bool:
        """Load a checkpoint tensor the generic routing does not cover; False: not one of those."""
        return False

    def missing_weights(self, params: dict[str, nn.Parameter], loaded: dict[str, set]) -> list[str]:
        """The parameters (or fused ones short of a shard) that received no weight."""
        missing = []
        for pname in params:
            need = next((n for key, n in _SHARDS_PER_FUSED.items() if key in pname), 1)
            if len(loaded.get(pname, ())) < need:
                missing.append(pname)
        return missing

    def _load_tensor(
        self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor | GGUFTensor, loaded: dict
    ) -> bool:
        """One tensor into its (fused) parameter; False when no parameter takes it."""
        target, shard_id = name, None
        for fused, part, shard in STACKED_PARAMS:
            if part in name:
                target, shard_id = name.replace(part, fused), shard
                break
        if target not in params:
            return False
        module_path, param_name = target.rsplit(".", 1)
        if shard_id is not None:
            module = self.get_submodule(module_path)
            assert isinstance(module, MergedColumnLinear)
            module.load_shard(param_name, tensor, shard_id)
        elif isinstance(tensor, (ScaledRows, BlockScaledCodes)) and not hasattr(
            self.get_submodule(module_path), "load_quantized"
        ):
            copy_weight(params[target], tensor.value(), name)  # an FP8 matrix of a layer that is not a Linear
        elif isinstance(tensor, (GGUFTensor, ScaledRows, BlockScaledCodes)):
            module = self.get_submodule(module_path)
            if param_name != "weight" or not hasattr(module, "load_quantized"):
                raise WeightLoadError(f"{name}: a quantized tensor for a parameter that must be float")
            module.load_quantized(tensor, name)
        else:
            copy_weight(params[target], tensor, name)
        loaded.setdefault(target, set()).add(shard_id)
        return True

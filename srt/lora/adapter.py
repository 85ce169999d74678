"""A PEFT adapter read from its folder and laid onto srt's (fused, possibly sharded) layers.

PEFT saves, per adapted module ``<path>`` (HF's module names under ``base_model.model.``), two
matrices: ``<path>.lora_A.weight`` ``[r, in]`` and ``<path>.lora_B.weight`` ``[out, r]``, and the
module's output gains ``scaling * x @ A.T @ B.T``. srt fuses q/k/v and gate/up into one ``Linear``
(``STACKED_PARAMS``), so the adapters of the parts of one srt layer are stacked: ``A`` rows of the
parts one after the other, ``B`` placed block by block at each part's output rows (zero elsewhere),
so one pair of matmuls gives the update of every part::

    qkv_proj, adapter on q and v:   A = [A_q; A_v]  [2r, in]
                                    B = [[B_q, 0], [0, 0], [0, B_v]]  [q + k + v, 2r]

``scaling`` is folded into B. Under tensor parallelism each rank keeps its slice, as the base
layer does (``ShardPlan``): a column-parallel part keeps its rows of B, a row-parallel layer its
columns of A (its partial update is summed by the layer's all-reduce with the base output).

A vision-language model takes adapters of its decoder only: the decoder's names as transformers 5
writes them (``model.language_model.layers...``) map to srt's (``model.layers...``), and an
adapter of the vision tower or projector is refused by name (the tower runs once per image,
outside the per-token adapter batching).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from srt.layers.linear import Linear, MergedColumnLinear
from srt.lora.config import LoRAConfig
from srt.models.checkpoint_loader import STACKED_PARAMS
from srt.utils.errors import LoRAError

_PREFIX = "base_model.model."
_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class LinearLoRAWeights:
    """One srt Linear's update: ``out += (x @ A.T) @ B.T``; A ``[R, in]``, B ``[out, R]`` (scaled)."""

    A: torch.Tensor
    B: torch.Tensor


@dataclass
class LoRAAdapter:
    name: str
    path: str
    config: LoRAConfig
    weights: dict[str, LinearLoRAWeights]  # srt Linear module name -> its update

    @property
    def nbytes(self) -> int:
        return sum(w.A.nbytes + w.B.nbytes for w in self.weights.values())

    def to(self, device: torch.device | str) -> LoRAAdapter:
        moved = {k: LinearLoRAWeights(w.A.to(device), w.B.to(device)) for k, w in self.weights.items()}
        return LoRAAdapter(self.name, self.path, self.config, moved)


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors (``adapter_model.safetensors``, else ``adapter_model.bin``)."""
    for fname in _FILES:
        file = os.path.join(path, fname)
        if not os.path.isfile(file):
            continue
        try:
            if fname.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(file)
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file
            raise LoRAError(f"{file}: cannot read the adapter weights ({e})") from None
    raise LoRAError(f"LoRA adapter {path!r} has no {' or '.join(_FILES)}")


def _pairs(tensors: dict[str, torch.Tensor], where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module name -> (A, B); any other tensor is refused by name."""
    a_mats: dict[str, torch.Tensor] = {}
    b_mats: dict[str, torch.Tensor] = {}
    other: list[str] = []
    for key, t in tensors.items():
        name = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        for suffix, into in ((".lora_A.weight", a_mats), (".lora_B.weight", b_mats)):
            if name.endswith(suffix):
                into[name[: -len(suffix)]] = t
                break
        else:
            other.append(key)
    if other:
        raise LoRAError(f"{where}: tensors srt does not serve (not lora_A / lora_B of a linear): {other[:6]}")
    unpaired = sorted(set(a_mats) ^ set(b_mats))
    if unpaired:
        raise LoRAError(f"{where}: modules with lora_A or lora_B alone: {unpaired[:6]}")
    if not a_mats:
        raise LoRAError(f"{where}: the adapter has no lora_A / lora_B tensors")
    return {m: (a_mats[m], b_mats[m]) for m in a_mats}


def _decoder_module(model: nn.Module, module: str, name: str) -> str:
    """A VLM's HF module name as srt names it (its ``decoder_name``, as its checkpoint loader
    does; module docstring); others as they are."""
    decoder_name = getattr(model, "decoder_name", None)
    renamed = module if decoder_name is None else decoder_name(module)
    if renamed is None:
        raise LoRAError(
            f"LoRA adapter {name!r} targets {module}, on the image side of the model; srt applies "
            "adapters to the language model's layers only"
        )
    return renamed


def _srt_target(module: str) -> tuple[str, str | int | None]:
    """HF module name -> (srt module name, part of a fused layer or None)."""
    dotted = f".{module}."
    for fused, part, shard in STACKED_PARAMS:
        if part in dotted:
            return dotted.replace(part, fused)[1:-1], shard
    return module, None


def _local_slice(plan, module: str, srt_module: str, A: torch.Tensor, B: torch.Tensor):
    """This rank's part of (A, B) under tensor parallelism (``plan``: the model's ShardPlan)."""
    if plan is None:
        return A, B
    cut = plan.lookup(f"{module}.weight")
    if cut is not None and cut.dim == 0:
        return A, B.narrow(0, cut.start, cut.size)
    if cut is not None and cut.dim == 1:
        return A.narrow(1, cut.start, cut.size), B
    rows = plan.fused_rows(f"{srt_module}.weight")
    if rows is not None:  # a checkpoint-fused layer (Phi-3's qkv_proj / gate_up_proj)
        return A, torch.cat([B.narrow(0, start, n) for start, n in rows])
    return A, B


def _part_rows(layer: Linear, shard: str | int | None) -> tuple[int, int]:
    """(offset, rows) of a part in the layer's output."""
    if shard is None:
        return 0, layer.out_features
    assert isinstance(layer, MergedColumnLinear)
    idx = layer._shard_index(shard)
    return layer.offsets[idx], layer.output_sizes[idx]


def build_adapter(
    name: str,
    path: str,
    model: nn.Module,
    max_rank: int,
    allowed_targets: set[str] | None,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """Read the adapter at ``path`` and lay it onto ``model``'s layers (see the module docstring).
    Raises `LoRAError` naming what does not fit."""
    config = LoRAConfig.from_dir(path)
    if config.rank > max_rank:
        raise LoRAError(f"LoRA adapter {name!r}: rank {config.rank} is above --max-lora-rank {max_rank}")
    pairs = _pairs(read_tensors(path), path)
    plan = getattr(model, "shard_plan", None)
    parts: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for module, (A, B) in sorted(pairs.items()):
        short = module.rsplit(".", 1)[-1]
        if allowed_targets is not None and short not in allowed_targets:
            raise LoRAError(f"LoRA adapter {name!r} targets {short}, not in --lora-target-modules")
        module = _decoder_module(model, module, name)
        srt_module, shard = _srt_target(module)
        try:
            layer = model.get_submodule(srt_module)
        except AttributeError:
            layer = None
        if not isinstance(layer, Linear):
            raise LoRAError(
                f"LoRA adapter {name!r} targets {module}, which this model has no linear layer for"
            )
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1] or A.shape[0] != config.rank:
            raise LoRAError(
                f"LoRA adapter {name!r}: {module} has lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)}, "
                f"not [r, in] and [out, r] with r = {config.rank}"
            )
        A, B = _local_slice(plan, module, srt_module, A, B)
        offset, rows = _part_rows(layer, shard)
        if A.shape[1] != layer.in_features or B.shape[0] != rows:
            raise LoRAError(
                f"LoRA adapter {name!r}: {module} maps {A.shape[1]} -> {B.shape[0]} features, the base "
                f"model's layer {layer.in_features} -> {rows} (an adapter of another base model?)"
            )
        parts.setdefault(srt_module, []).append((offset, rows, A, B * config.scaling))
    weights = {m: _stack(model.get_submodule(m), p, dtype) for m, p in parts.items()}
    return LoRAAdapter(name, path, config, weights)


def _stack(
    layer: Linear, parts: list[tuple[int, int, torch.Tensor, torch.Tensor]], dtype
) -> LinearLoRAWeights:
    """The parts of one srt layer as one (A, B) pair (block placement: module docstring)."""
    parts = sorted(parts, key=lambda p: p[0])
    A = torch.cat([a for _, _, a, _ in parts]).to(dtype).contiguous()
    if len(parts) == 1 and parts[0][1] == layer.out_features:
        return LinearLoRAWeights(A, parts[0][3].to(dtype).contiguous())
    B = torch.zeros(layer.out_features, A.shape[0], dtype=dtype)
    col = 0
    for offset, rows, a, b in parts:
        B[offset : offset + rows, col : col + a.shape[0]] = b
        col += a.shape[0]
    return LinearLoRAWeights(A, B)

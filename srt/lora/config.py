"""A PEFT adapter's ``adapter_config.json``: what srt serves of it, and refusals by name.

Served: ``peft_type`` LORA, ``r``, ``lora_alpha``, ``use_rslora`` (scaling ``alpha / sqrt(r)``
instead of ``alpha / r``), ``target_modules`` (a list of module names, or PEFT's regular expression
matched against the full module names), ``bias`` "none". Refused with a `LoRAError` naming the
key: ``modules_to_save`` (whole modules replaced), ``use_dora``, per-module ``rank_pattern`` /
``alpha_pattern``, ``layers_to_transform``, ``fan_in_fan_out`` (GPT-2's Conv1D layout), biases
trained by the adapter, and other PEFT types (prefix tuning, IA3 ...).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

from srt.utils.errors import LoRAError

CONFIG_NAME = "adapter_config.json"


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float
    use_rslora: bool
    # module names (``q_proj``) or a regular expression over full module names (PEFT's str form)
    target_modules: tuple[str, ...] | str
    base_model: str | None = None

    @property
    def scaling(self) -> float:
        """What PEFT multiplies ``B @ A`` by."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def targets(self, module_name: str) -> bool:
        """Whether PEFT would wrap the module ``module_name`` (full dotted name, HF's naming)."""
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module_name) is not None
        # a list entry names the module or a dotted suffix of its name (``self_attn.q_proj``)
        return any(module_name == t or module_name.endswith(f".{t}") for t in self.target_modules)

    @classmethod
    def from_dir(cls, path: str) -> LoRAConfig:
        file = os.path.join(path, CONFIG_NAME)
        if not os.path.isdir(path):
            raise LoRAError(f"LoRA adapter path {path!r} is not a directory")
        if not os.path.isfile(file):
            raise LoRAError(f"LoRA adapter {path!r} has no {CONFIG_NAME} (not a PEFT adapter folder)")
        try:
            with open(file) as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise LoRAError(f"{file}: cannot read it ({e})") from None
        if not isinstance(raw, dict):
            raise LoRAError(f"{file}: not a JSON object")
        return cls.from_dict(raw, file)

    @classmethod
    def from_dict(cls, raw: dict, where: str = CONFIG_NAME) -> LoRAConfig:
        _refuse_unsupported(raw, where)
        rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise LoRAError(f"{where}: r must be a positive integer, got {rank!r}")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise LoRAError(f"{where}: lora_alpha must be a number, got {alpha!r}")
        targets = raw.get("target_modules")
        if isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
            target_modules: tuple[str, ...] | str = tuple(targets)
        elif isinstance(targets, str) and targets:
            target_modules = targets
        else:
            raise LoRAError(f"{where}: target_modules must be a non-empty list of names or a regex")
        base = raw.get("base_model_name_or_path")
        return cls(rank, float(alpha), bool(raw.get("use_rslora", False)), target_modules, base)


def _refuse_unsupported(raw: dict, where: str) -> None:
    kind = raw.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoRAError(f"{where}: peft_type {kind!r} is not served (only LORA)")
    refused = {
        "modules_to_save": "whole modules saved with the adapter",
        "use_dora": "DoRA",
        "rank_pattern": "per-module ranks",
        "alpha_pattern": "per-module alphas",
        "layers_to_transform": "adapters on some layers only",
        "fan_in_fan_out": "Conv1D (fan_in_fan_out) layouts",
        "layer_replication": "layer replication",
        "alora_invocation_tokens": "activated LoRA (an update from invocation tokens on)",
        "target_parameters": "adapters on parameters (MoE experts) rather than modules",
    }
    for key, what in refused.items():
        if raw.get(key):
            raise LoRAError(f"{where}: {key} ({what}) is not supported by srt: {raw[key]!r}")
    if raw.get("bias", "none") not in ("none", None):
        raise LoRAError(f"{where}: bias {raw['bias']!r} (biases trained by the adapter) is not supported")

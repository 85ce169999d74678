"""PEFT adapters for the LoRA tests, written by ``peft`` itself over a transformers base model,
and the transformers + peft reference of a base with one adapter.

Adapters get random non-zero A and B (``init_lora_weights=False``; B then scaled so the update
changes greedy tokens of the tiny and the default models alike)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_peft_adapter(
    load_base: Callable[[], torch.nn.Module],
    path: str | os.PathLike,
    targets: list[str],
    rank: int,
    seed: int,
    b_scale: float = 3.0,
    **lora_kw,
) -> str:
    """Write a PEFT LoRA adapter of ``rank`` on ``targets`` over the model ``load_base()`` returns."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **lora_kw
    )
    model = get_peft_model(load_base(), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(b_scale)
    model.save_pretrained(str(path))
    return str(path)


def peft_reference_model(load_base: Callable[[], torch.nn.Module], adapter: str | None):
    """The base with ``adapter`` applied by peft (the base alone for None), eval mode."""
    model = load_base()
    if adapter is None:
        return model.eval()
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter).eval()


def rewrite_adapter(src: str, dst: str | os.PathLike, config_edits: dict | None = None, rename=None) -> str:
    """A copy of adapter ``src`` at ``dst`` with ``config_edits`` merged into its config and each
    tensor name passed through ``rename`` (for the refusal tests)."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg.update(config_edits or {})
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    if rename is not None:
        tensors = {rename(k): v for k, v in tensors.items()}
    save_file(tensors, os.path.join(dst, "adapter_model.safetensors"))
    return str(dst)

"""The LoRA fields of ``ServerArgs`` (SGLang's flags) and how ``resolve()`` checks them.

``--lora-paths`` takes SGLang's three forms, each item one adapter:

    name=/path/to/peft_dir           the adapter ``name``
    /path/to/peft_dir                named by its path
    {"lora_name": "a", "lora_path": "/p", "pinned": true}   JSON (pinned: never evicted from a slot)

and resolves to a list of ``{"lora_name", "lora_path", "pinned"}`` dicts (``Engine(lora_paths=...)``
also takes a ``{name: path}`` dict). Giving adapters turns ``--enable-lora`` on.

This module is configuration: it imports nothing of srt but srt.utils.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from srt.utils.errors import ConfigError


def arg_field(default: Any, help: str, choices: list[str] | None = None, nargs: str | None = None):
    """A ``ServerArgs`` field: its default, its --help text, its choices and argparse's nargs."""
    return field(default=default, metadata={"help": help, "choices": choices, "nargs": nargs})


# the projections an adapter may target (PEFT's module names; Phi-3 names its fused ones), and
# SGLang's "all"
LORA_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)


@dataclass
class LoRAArgs:
    enable_lora: bool = arg_field(
        False,
        "Serve LoRA adapters over the base model: requests name one (/generate's lora_path, OpenAI's "
        'model "<served>:<adapter>" or "<adapter>"); a batch mixes adapters and the base model. On '
        "by itself with --lora-paths.",
    )
    lora_paths: Any = arg_field(
        None,
        "PEFT adapters loaded at start-up: name=path, a path (named by itself), or SGLang's JSON "
        '{"lora_name": ..., "lora_path": ..., "pinned": ...}; several separated by spaces.',
        nargs="*",
    )
    max_loras_per_batch: int = arg_field(
        8,
        "Adapter slots: the most distinct adapters one batch runs. A request whose adapter finds no free "
        "slot waits; slots of adapters no running request uses are reused, least recently used first.",
    )
    max_lora_rank: int | None = arg_field(
        None,
        "The highest adapter rank accepted (start-up or /load_lora_adapter); default the highest rank of "
        "--lora-paths, 64 without them.",
    )
    lora_target_modules: list[str] | None = arg_field(
        None,
        "The projections adapters may target (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, "
        "Phi-3's qkv_proj gate_up_proj, or all); an adapter targeting others is refused. Default: all.",
        nargs="*",
    )
    max_loaded_loras: int | None = arg_field(
        None,
        "The most adapters held in memory (loaded at start-up or at run time); a load past it is refused. "
        "Default: no limit.",
    )


def parse_lora_path(item: Any) -> dict[str, Any]:
    """One ``--lora-paths`` item -> ``{"lora_name", "lora_path", "pinned"}``."""
    if isinstance(item, dict):
        ref = item
    elif isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            ref = json.loads(item)
        except ValueError as e:
            raise ConfigError(f"--lora-paths: {item!r} is not valid JSON ({e})") from None
    elif isinstance(item, str) and "=" in item:
        name, path = item.split("=", 1)
        ref = {"lora_name": name, "lora_path": path}
    elif isinstance(item, str):
        ref = {"lora_name": item, "lora_path": item}
    else:
        raise ConfigError(f"--lora-paths: {item!r} is neither name=path, a path nor a JSON object")
    if not isinstance(ref, dict) or set(ref) - {"lora_name", "lora_path", "pinned"}:
        raise ConfigError(f"--lora-paths: {item!r}: the keys are lora_name, lora_path and pinned")
    name, path = ref.get("lora_name"), ref.get("lora_path")
    if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path:
        raise ConfigError(f"--lora-paths: {item!r} needs a non-empty lora_name and lora_path")
    return {"lora_name": name.strip(), "lora_path": path, "pinned": bool(ref.get("pinned", False))}


def resolve_lora_args(a: Any) -> None:
    """Normalize ``lora_paths`` and check the LoRA flags against each other and the rest."""
    items = a.lora_paths or []
    if isinstance(items, dict):
        items = [{"lora_name": k, "lora_path": v} for k, v in items.items()]
    elif isinstance(items, str):
        items = [items]
    refs = [parse_lora_path(item) for item in items]
    names = [r["lora_name"] for r in refs]
    if len(set(names)) != len(names):
        raise ConfigError(f"--lora-paths: an adapter name appears twice: {names}")
    a.lora_paths = refs
    a.enable_lora = bool(a.enable_lora or refs)
    if a.max_loras_per_batch < 1:
        raise ConfigError("--max-loras-per-batch must be at least 1")
    if a.max_lora_rank is not None and a.max_lora_rank < 1:
        raise ConfigError("--max-lora-rank must be at least 1")
    if a.max_loaded_loras is not None and a.max_loaded_loras < len(refs):
        raise ConfigError(f"--max-loaded-loras {a.max_loaded_loras} is below the {len(refs)} --lora-paths")
    if sum(r["pinned"] for r in refs) >= a.max_loras_per_batch:
        raise ConfigError("pinned adapters must leave at least one of --max-loras-per-batch slots free")
    targets = a.lora_target_modules
    if targets:
        unknown = sorted(set(targets) - set(LORA_TARGET_MODULES) - {"all"})
        if unknown:
            raise ConfigError(f"--lora-target-modules: unknown {unknown}; known: {list(LORA_TARGET_MODULES)}")
        a.lora_target_modules = list(LORA_TARGET_MODULES) if "all" in targets else list(targets)
    if a.enable_lora and a.speculative_algorithm:
        raise ConfigError("--enable-lora does not run with --speculative-algorithm")
    if a.enable_lora and a.is_embedding:
        raise ConfigError("--enable-lora serves generation models (not with --is-embedding)")

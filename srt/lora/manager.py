"""The runner's LoRA part: the loaded adapters, the slots a batch runs, and each step's rows.

    LoRAManager(model, settings)     attaches nothing yet; ``load_startup`` reads --lora-paths
    build(name, path)                read and lay out an adapter (no state touched: may run on a
                                     thread beside the forwards); ``add`` then makes it loadable
    activate(slot, name)             the adapter's updates into every layer's table at ``slot``
                                     (copied to the device where the model lives)
    unload(name)                     forget it (the scheduler checked no request uses it)
    prepare(forward_batch)           the step's ``LoRABatch`` from ``forward_batch.lora_slots``
    rebind(model)                    the same adapters and slots on a new model (weight update)

Slots are chosen by the scheduler (srt/managers/scheduler/lora_slots.py), which admits a request
only once its adapter holds one; here a slot is a table entry per layer, so activating an adapter
never copies on CPU and copies its weights once on CUDA.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch
from torch import nn

from srt.layers.forward_batch import ForwardBatch
from srt.layers.linear import Linear
from srt.lora.adapter import LoRAAdapter, build_adapter
from srt.lora.config import LoRAConfig
from srt.lora.layer import LinearLoRA, LoRABatch, LoRAState
from srt.utils.errors import LoRAError

logger = logging.getLogger(__name__)

DEFAULT_MAX_RANK = 64


@dataclass(frozen=True)
class LoRASettings:
    """The LoRA flags, resolved (``ServerArgs``: --max-lora-rank, --lora-target-modules,
    --max-loaded-loras, --max-loras-per-batch; ``startup``: --lora-paths)."""

    max_rank: int
    target_modules: frozenset[str] | None
    max_loaded: int | None
    num_slots: int
    startup: tuple[dict, ...]

    @classmethod
    def from_server_args(cls, a) -> LoRASettings:
        refs = tuple(a.lora_paths or ())
        rank = a.max_lora_rank
        if rank is None:
            ranks = [LoRAConfig.from_dir(r["lora_path"]).rank for r in refs]
            rank = max(ranks) if ranks else DEFAULT_MAX_RANK
        targets = frozenset(a.lora_target_modules) if a.lora_target_modules else None
        return cls(rank, targets, a.max_loaded_loras, a.max_loras_per_batch, refs)


class LoRAManager:
    def __init__(self, model: nn.Module, settings: LoRASettings, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.settings = settings
        self.dtype = dtype
        self.device = device
        self.state = LoRAState()
        self.layers: dict[str, LinearLoRA] = {}  # module name -> the update table of a Linear adapted
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slot_of: dict[str, int] = {}
        self.version = 0  # bumped by every change of the slot tables (caches of them key on it)
        self._lock = threading.Lock()  # adapters/slot tables: loads finish on another thread

    def load_startup(self) -> None:
        for ref in self.settings.startup:
            self.add(self.build(ref["lora_name"], ref["lora_path"]))

    @property
    def loaded(self) -> dict[str, str]:
        return {name: a.path for name, a in self.adapters.items()}

    def build(self, name: str, path: str) -> LoRAAdapter:
        s = self.settings
        return build_adapter(name, path, self.model, s.max_rank, s.target_modules, self.dtype)

    def add(self, adapter: LoRAAdapter) -> None:
        with self._lock:
            if adapter.name in self.adapters:
                raise LoRAError(f"a LoRA adapter named {adapter.name!r} is loaded already")
            limit = self.settings.max_loaded
            if limit is not None and len(self.adapters) >= limit:
                raise LoRAError(f"{limit} adapters are loaded (--max-loaded-loras); unload one first")
            self.adapters[adapter.name] = adapter
        logger.info(
            "LoRA adapter %r loaded from %s: rank %d, %d linear layers, %.1f MiB",
            adapter.name,
            adapter.path,
            adapter.config.rank,
            len(adapter.weights),
            adapter.nbytes / (1 << 20),
        )

    def unload(self, name: str) -> None:
        with self._lock:
            if name not in self.adapters:
                raise LoRAError(f"no LoRA adapter named {name!r} is loaded")
            slot = self.slot_of.pop(name, None)
            if slot is not None:
                self._clear_slot(slot)
            del self.adapters[name]
            self.version += 1

    def activate(self, slot: int, name: str) -> None:
        """Put adapter ``name`` into ``slot`` (whatever held the slot leaves it)."""
        with self._lock:
            adapter = self.adapters[name]
            for other, s in list(self.slot_of.items()):
                if s == slot:
                    del self.slot_of[other]
            self._clear_slot(slot)
            on_device = adapter if self.device.type == "cpu" else adapter.to(self.device)
            for module, w in on_device.weights.items():
                self._layer_lora(module).slots[slot] = w
            self.slot_of[name] = slot
            self.version += 1

    def _clear_slot(self, slot: int) -> None:
        for lora in self.layers.values():
            lora.slots.pop(slot, None)

    def _layer_lora(self, module: str) -> LinearLoRA:
        lora = self.layers.get(module)
        if lora is None:
            layer = self.model.get_submodule(module)
            assert isinstance(layer, Linear)
            lora = self.layers[module] = layer.lora = LinearLoRA(self.state)
        return lora

    def prepare(self, forward_batch: ForwardBatch) -> None:
        """The step's rows per slot (``forward_batch.lora``; None when no row runs an adapter)."""
        slots = forward_batch.lora_slots
        batch = None
        if slots is not None:
            rows = forward_batch.extend_seq_lens_cpu
            batch = LoRABatch.build(slots, rows, forward_batch.input_ids.device, self.version)
        forward_batch.lora = batch
        self.state.batch = batch

    def rebind(self, model: nn.Module) -> None:
        """Serve the same adapters and slots on ``model`` (new weights of the same shapes)."""
        self.model = model
        self.state = LoRAState()
        self.layers = {}
        for name, slot in list(self.slot_of.items()):
            self.activate(slot, name)


def create_lora_manager(model: nn.Module, server_args, dtype: torch.dtype, device) -> LoRAManager | None:
    """The runner's LoRA part with the --lora-paths adapters loaded, or None without --enable-lora."""
    if not server_args.enable_lora:
        return None
    manager = LoRAManager(model, LoRASettings.from_server_args(server_args), dtype, torch.device(device))
    manager.load_startup()
    return manager

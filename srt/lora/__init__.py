"""LoRA adapters over a base model: PEFT adapters read and mapped onto srt's layers
(``config``, ``adapter``), the per-step batched low-rank update (``layer``), and the runner's
part that owns the loaded adapters and the slots a batch runs (``manager``). The scheduler's side
(which request holds which slot) is srt/managers/scheduler/lora_slots.py."""

"""Qwen2: the Llama decoder with biases on the q/k/v projections (none on o_proj).

Qwen2's optional sliding window (``use_sliding_window``) is not implemented; released Qwen2
and Qwen2.5 checkpoints ship with it disabled.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from srt.models.llama import AttentionOptions, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        if getattr(config, "use_sliding_window", False):
            logger.warning("Qwen2: use_sliding_window is ignored (full attention in every layer).")
        return AttentionOptions(qkv_bias=True, o_bias=False)

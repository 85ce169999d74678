"""Fields of a native generation request that srt does not take, and the check that names them.

SGLang's ``GenerateReqInput`` has fields for features srt does not implement (multimodal inputs,
LoRA adapters by id (``lora_id``; ``lora_path``, by name, is srt's), sessions, disaggregated
prefill, custom logit processors, hidden states ...).
A request that sets one of them to anything but its off value (null, or SGLang's default) gets a
`RequestError` naming it, so that nothing a client asked for is silently dropped; a field that
neither srt nor SGLang knows is refused too (a typo such as ``max_tokens`` at the top level would
otherwise be ignored). Used by POST /generate (`GenerateReqInput.from_json`) and by
``Engine.generate`` / ``async_generate`` (extra keyword arguments).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from srt.utils.errors import RequestError

# SGLang's GenerateReqInput fields srt cannot honour -> the values that mean "off" (accepted)
UNSUPPORTED_GENERATE_FIELDS: dict[str, tuple[Any, ...]] = {
    "input_embeds": (None,),
    "video_data": (None, []),
    "audio_data": (None, []),
    "use_audio_in_video": (None, False),
    "modalities": (None, []),
    "token_ids_logprob": (None, []),
    "return_hidden_states": (None, False),
    "return_routed_experts": (None, False),
    "return_indexer_topk": (None, False),
    "routed_experts_start_len": (None, 0),
    "return_entropy": (None, False),
    "return_bytes": (None, False),
    "log_metrics": (None, True),
    "session_params": (None,),
    "lora_id": (None,),
    "custom_logit_processor": (None,),
    "positional_embed_overrides": (None,),
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
    "bootstrap_pair_key": (None,),
    "decode_tp_size": (None,),
    "require_reasoning": (None, False),
    "routed_dp_rank": (None,),
    "disagg_prefill_dp_rank": (None,),
    "data_parallel_rank": (None,),
    "background": (None, False),
    "conversation_id": (None,),
    "extra_key": (None,),
    "routing_key": (None,),
    "no_logs": (None, False),
    "custom_labels": (None, {}),
    "external_trace_header": (None,),
    "received_time": (None,),
    "need_wait_for_mm_inputs": (None, False),
    "num_items_assigned": (None,),
    "max_dynamic_patch": (None,),
    "min_dynamic_patch": (None,),
    "image_max_dynamic_patch": (None,),
    "video_max_dynamic_patch": (None,),
    "multi_item_delimiter_indices": (None,),
    "model": (None,),  # SGLang's router sends "model": null with every /generate it forwards
}


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    # bool is an int: 0 must not accept False nor True stand for 1
    return any(type(value) is type(o) and value == o for o in off)


def check_extra_fields(extra: Mapping[str, Any], known: Iterable[str]) -> None:
    """`RequestError` for the first of ``extra`` (fields beyond srt's own, ``known``) that is
    not SGLang's off value for a field srt cannot honour, naming every offending field."""
    bad: list[str] = []
    unknown: list[str] = []
    for name, value in extra.items():
        off = UNSUPPORTED_GENERATE_FIELDS.get(name)
        if off is None:
            unknown.append(name)
        elif not _is_off(value, off):
            bad.append(name)
    if bad:
        raise RequestError(
            f"{', '.join(sorted(bad))}: not supported by this server (only null or the off value "
            "is accepted)",
            param=sorted(bad)[0],
            code="unsupported_field",
        )
    if unknown:
        raise RequestError(
            f"unknown field(s) {', '.join(sorted(unknown))}; the request takes {', '.join(sorted(known))}",
            param=sorted(unknown)[0],
            code="unknown_field",
        )

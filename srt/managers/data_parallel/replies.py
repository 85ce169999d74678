"""Merging the scheduler groups' replies to a control request into one (pure, no I/O).

The data-parallel controller sends every control request (flush_cache, get_internal_state,
profile, update weights, load / unload a LoRA adapter) to all N groups. Each group answers each
request type in order, so the k-th reply of a type from group g belongs to the k-th request of
that type: `ReplyMerger` keeps, per reply type, a FIFO of requests waiting for replies, fills each
with one reply per group and releases merged replies in request order. The tokenizer manager then
sees exactly one reply per request, as with a single scheduler.

Merged shapes:
    FlushCacheReqOutput / ProfileReqOutput / UpdateWeightsFromDiskReqOutput
        success = every group succeeded; message (and trace_path) the groups' joined, "dp<r>: ..."
    LoRAAdapterReqOutput
        success and message as above; loaded_adapters = the adapters every group holds (a
        request may be routed to any group), with group 0's paths
    GetInternalStateReqOutput
        state = `merge_internal_states`: counts summed over the groups, other values group 0's,
        plus ``dp_states`` (each group's own state, index = dp rank)
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from srt.managers.io_struct import (
    REPLY_TYPE,
    ControlReply,
    GetInternalStateReqOutput,
    LoRAAdapterReqOutput,
    ProfileReqOutput,
)

__all__ = ["REPLY_TYPE", "ReplyMerger", "merge_internal_states", "merge_replies", "split_dp_state"]

# float figures of a scheduler state that add up over groups (other floats: group 0's value)
_SUMMED_FLOATS = frozenset({"gen_throughput"})


def merge_internal_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One state for N groups: integer counts (requests, KV slots, counters) summed,
    ``gen_throughput`` summed, ``token_usage`` over the summed pools, everything else taken from
    group 0; ``dp_states`` holds the groups' own states."""
    merged: dict[str, Any] = dict(states[0])
    for key, v in states[0].items():
        values = [s.get(key) for s in states]
        if isinstance(v, bool) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in values
        ):
            continue
        if isinstance(v, int) or key in _SUMMED_FLOATS:
            merged[key] = sum(values)
    total = sum(int(s.get("max_total_num_tokens", 0)) for s in states)
    if total > 0 and all(isinstance(s.get("token_usage"), (int, float)) for s in states):
        used = sum(s["token_usage"] * s.get("max_total_num_tokens", 0) for s in states)
        merged["token_usage"] = used / total
    merged["dp_states"] = list(states)
    return merged


def merge_replies(replies: Sequence[ControlReply]) -> ControlReply:
    """One reply from every group's reply to the same request (index = dp rank)."""
    first = replies[0]
    if isinstance(first, GetInternalStateReqOutput):
        return GetInternalStateReqOutput(state=merge_internal_states([r.state for r in replies]))
    success = all(r.success for r in replies)
    message = _join([r.message for r in replies])
    if isinstance(first, ProfileReqOutput):
        paths = ",".join(r.trace_path for r in replies if r.trace_path)
        return ProfileReqOutput(success=success, message=message, trace_path=paths)
    if isinstance(first, LoRAAdapterReqOutput):
        held = [r.loaded_adapters for r in replies]
        common = {name: path for name, path in held[0].items() if all(name in h for h in held[1:])}
        return LoRAAdapterReqOutput(success=success, message=message, loaded_adapters=common)
    return type(first)(success=success, message=message)


def _join(messages: list[str]) -> str:
    if all(m == messages[0] for m in messages):
        return messages[0]
    return "; ".join(f"dp{r}: {m}" for r, m in enumerate(messages))


class ReplyMerger:
    """Collects the N groups' replies per request; see the module docstring."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self._pending: dict[type, collections.deque[dict[int, ControlReply]]] = {
            t: collections.deque() for t in REPLY_TYPE.values()
        }

    def expect(self, request: Any) -> None:
        """A control request was sent to every group: wait for its N replies."""
        self._pending[REPLY_TYPE[type(request)]].append({})

    def add(self, dp_rank: int, reply: ControlReply) -> list[ControlReply]:
        """Record group ``dp_rank``'s reply; returns the merged replies now complete, in request
        order (a reply nobody waits for is dropped)."""
        queue = self._pending.get(type(reply))
        if queue is None:
            return []
        for slot in queue:
            if dp_rank not in slot:
                slot[dp_rank] = reply
                break
        out: list[ControlReply] = []
        while queue and len(queue[0]) == self.num_groups:
            slot = queue.popleft()
            out.append(merge_replies([slot[r] for r in range(self.num_groups)]))
        return out

    def num_pending(self) -> int:
        return sum(len(q) for q in self._pending.values())


def split_dp_state(state: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """``(one state per group, the controller's state)`` of a (maybe merged) internal state: a
    single scheduler's state is ``([state], None)``."""
    groups = state.get("dp_states")
    if not groups:
        return [state], None
    return list(groups), state.get("dp_controller")

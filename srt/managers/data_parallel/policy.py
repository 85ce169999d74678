"""Routing of the data-parallel controller: which scheduler group gets a request (pure, no I/O).

The controller (``controller.py``) owns one `DpRouter` and calls it for every
message it forwards; nothing here touches a socket or a clock, so the policies are tested by
driving the router with messages and load reports.

Per group the router keeps:

    reported   the group's last `DpLoadReport` figures (queued + running tokens, num_received)
    unseen     the requests routed to the group that its last report did not include yet, as
               ``(seq, tokens)``: every message forwarded to a group takes the group's next seq
               (`forwarded`), so a report with ``num_received = k`` covers the seqs below k
    load       reported queued + running tokens + the tokens of the unseen requests
    owners     rid -> group of every routed request not yet reported finished (aborts and stop
               strings go to the owner; finishes arrive in the reports' ``finished_rids``; an
               aborted rid is forgotten once its abort is forwarded)

Policies (``--load-balance-method``):

    minimum_tokens  the least loaded group; ties: fewer live requests, then a rotating start
                    (so that an idle server alternates instead of filling group 0 first)
    round_robin     groups in turn
    prefix_aware    among the groups whose load is within ``prefix_margin`` of the least
                    (``max(margin_tokens, margin_fraction * least)``), the one whose
                    `PrefixIndex` holds the longest prefix of the prompt (at least one block);
                    no match: minimum_tokens
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from srt.server_args import LOAD_BALANCE_METHODS


class PrefixIndex:
    """An approximate, bounded record of the prompts routed to each group.

    A prompt is cut into blocks of ``block_size`` tokens; block k is keyed by a hash chained over
    blocks 0..k, so a key stands for a whole prefix. Each group keeps at most
    ``max_blocks_per_group`` keys, least recently used evicted first. A hash collision or an
    eviction inside the group's radix cache only makes the preference wrong, never a result."""

    def __init__(self, num_groups: int, block_size: int = 16, max_blocks_per_group: int = 65536) -> None:
        if block_size < 1 or max_blocks_per_group < 1:
            raise ValueError("block_size and max_blocks_per_group must be >= 1")
        self.block_size = block_size
        self.capacity = max_blocks_per_group
        self._groups: list[collections.OrderedDict[int, None]] = [
            collections.OrderedDict() for _ in range(num_groups)
        ]

    def keys(self, input_ids: Sequence[int]) -> list[int]:
        """The chained block keys of ``input_ids`` (whole blocks only)."""
        keys: list[int] = []
        h = 0
        bs = self.block_size
        for start in range(0, len(input_ids) - bs + 1, bs):
            h = hash((h, *input_ids[start : start + bs]))
            keys.append(h)
        return keys

    def match_len(self, group: int, keys: Sequence[int]) -> int:
        """Tokens of the longest recorded prefix of the prompt with these ``keys`` in ``group``."""
        blocks = self._groups[group]
        n = 0
        for k in keys:
            if k not in blocks:
                break
            n += 1
        return n * self.block_size

    def insert(self, group: int, keys: Iterable[int]) -> None:
        blocks = self._groups[group]
        for k in keys:
            blocks[k] = None
            blocks.move_to_end(k)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def size(self, group: int) -> int:
        return len(self._groups[group])


@dataclass(slots=True)
class GroupLoad:
    """What the router knows of one group (see the module docstring)."""

    next_seq: int = 0
    num_received: int = 0
    queued_tokens: int = 0
    running_tokens: int = 0
    num_queued_reqs: int = 0
    num_running_reqs: int = 0
    idle: bool = True
    num_routed: int = 0
    num_live: int = 0
    unseen: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)
    unseen_tokens: int = 0

    @property
    def load(self) -> int:
        return self.queued_tokens + self.running_tokens + self.unseen_tokens


class DpRouter:
    """Picks a group per request and tracks the groups' load and the owners of live rids."""

    def __init__(
        self,
        num_groups: int,
        method: str = "minimum_tokens",
        margin_tokens: int = 256,
        margin_fraction: float = 0.1,
        prefix_index: PrefixIndex | None = None,
    ) -> None:
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"unknown load balance method {method!r}")
        self.method = method
        self.groups = [GroupLoad() for _ in range(num_groups)]
        self.owners: dict[str, int] = {}
        self.margin_tokens = margin_tokens
        self.margin_fraction = margin_fraction
        self.prefix = prefix_index or (PrefixIndex(num_groups) if method == "prefix_aware" else None)
        self.num_prefix_routed = 0  # prefix_aware: requests sent to a group for its prefix
        self._next = 0  # round robin / tie-break rotation

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    # ------------------------------------------------------------------ decisions
    def route(self, rid: str, input_ids: Sequence[int]) -> int:
        """The group for a new request; records it as routed there (owner, unseen load)."""
        if self.method == "round_robin":
            g = self._next % self.num_groups
            self._next += 1
        elif self.method == "prefix_aware":
            g = self._pick_prefix_aware(input_ids)
        else:
            g = self._least_loaded(range(self.num_groups))
        seq = self.forwarded(g)
        grp = self.groups[g]
        tokens = max(1, len(input_ids))
        grp.unseen.append((seq, tokens))
        grp.unseen_tokens += tokens
        grp.num_routed += 1
        if rid in self.owners:  # a duplicate live rid: the group drops it; keep the first owner
            return g
        self.owners[rid] = g
        grp.num_live += 1
        return g

    def _least_loaded(self, candidates: Iterable[int]) -> int:
        n = self.num_groups
        start = self._next % n
        self._next += 1
        order = sorted(
            candidates, key=lambda g: (self.groups[g].load, self.groups[g].num_live, (g - start) % n)
        )
        return order[0]

    def _pick_prefix_aware(self, input_ids: Sequence[int]) -> int:
        assert self.prefix is not None
        least = min(grp.load for grp in self.groups)
        margin = max(self.margin_tokens, int(self.margin_fraction * least))
        close = [g for g, grp in enumerate(self.groups) if grp.load <= least + margin]
        keys = self.prefix.keys(input_ids)
        best, best_len = -1, 0
        for g in close:
            m = self.prefix.match_len(g, keys)
            if m > best_len or (m == best_len and m > 0 and self.groups[g].load < self.groups[best].load):
                best, best_len = g, m
        if best >= 0:
            self.num_prefix_routed += 1
        else:
            best = self._least_loaded(close)
        self.prefix.insert(best, keys)
        return best

    def owner(self, rid: str) -> int | None:
        """The group of a live request (None: unknown or reported finished)."""
        return self.owners.get(rid)

    def release(self, rid: str) -> None:
        """Forget ``rid``'s owner (it was aborted: nothing else is routed by it, and a request
        dropped before it ran would never be reported finished)."""
        g = self.owners.pop(rid, None)
        if g is not None:
            self.groups[g].num_live -= 1

    def release_all(self) -> None:
        """Forget every owner (abort-all)."""
        self.owners.clear()
        for grp in self.groups:
            grp.num_live = 0

    # ------------------------------------------------------------------ bookkeeping
    def forwarded(self, group: int) -> int:
        """Count one message forwarded to ``group`` (any type); returns its seq there."""
        grp = self.groups[group]
        seq = grp.next_seq
        grp.next_seq += 1
        return seq

    def on_report(
        self,
        group: int,
        num_received: int,
        queued_tokens: int,
        running_tokens: int,
        num_queued_reqs: int = 0,
        num_running_reqs: int = 0,
        idle: bool = False,
        finished_rids: Iterable[str] = (),
    ) -> None:
        """Apply a group's load report: its figures replace the old ones, the routed requests it
        covers leave ``unseen``, its finished requests leave ``owners``."""
        grp = self.groups[group]
        grp.num_received = max(grp.num_received, num_received)
        grp.queued_tokens, grp.running_tokens = queued_tokens, running_tokens
        grp.num_queued_reqs, grp.num_running_reqs, grp.idle = num_queued_reqs, num_running_reqs, idle
        while grp.unseen and grp.unseen[0][0] < grp.num_received:
            grp.unseen_tokens -= grp.unseen.popleft()[1]
        for rid in finished_rids:
            if self.owners.get(rid) == group:
                del self.owners[rid]
                grp.num_live -= 1

    def state(self) -> dict[str, Any]:
        """Per-group lists (index = dp rank) for /get_server_info and /metrics."""
        gs = self.groups
        out: dict[str, Any] = {
            "load_balance_method": self.method,
            "dp_size": self.num_groups,
            "num_routed_reqs": [g.num_routed for g in gs],
            "num_live_reqs": [g.num_live for g in gs],
            "load_tokens": [g.load for g in gs],
            "reported_queued_tokens": [g.queued_tokens for g in gs],
            "reported_running_tokens": [g.running_tokens for g in gs],
            "reported_queued_reqs": [g.num_queued_reqs for g in gs],
            "reported_running_reqs": [g.num_running_reqs for g in gs],
            "unseen_routed_reqs": [len(g.unseen) for g in gs],
        }
        if self.prefix is not None:
            out["num_prefix_routed_reqs"] = self.num_prefix_routed
            out["prefix_index_blocks"] = [self.prefix.size(i) for i in range(self.num_groups)]
        return out

"""RadixCache: a radix tree of token-id sequences -> KV slots, with LRU eviction.

The slot-ownership contract and the request fields used are in ``base_prefix_cache.py``.
With ``--disable-radix-cache`` the scheduler uses ``ChunkCache`` instead (no sharing).

Tree shape. Each non-root node holds an edge: ``key`` (token ids, a multiple of page_size P
long, never empty) and ``value`` (int64 tensor of the KV slots of those tokens, whole pages).
A node's children are keyed by the first page of their key (the token id itself when
P == 1, a tuple of P ids otherwise), so siblings never share a first page. Splits happen
only on page boundaries. A path from the root spells a cached prefix; its slots are the
concatenation of the values on the path.

Namespaces. KV depends on the weights that computed it, so requests running a LoRA adapter share
prefixes only with requests of the same adapter: each namespace (``req.lora_name``; "" the base
model) has a root of its own (``match_prefix(key, namespace)``), and the trees never meet.
``drop_namespace`` frees a namespace's tree (an adapter unloaded: a later one of the same name
must not find its KV). Roots have no parent; every other node has one.

Locking. ``inc_lock_ref(node)`` adds 1 to ``lock_ref`` of node and of every ancestor (the
root excluded), so ``lock_ref`` of a node >= the sum over its children. A node with
``lock_ref > 0`` is *protected*, otherwise *evictable*; ``evictable_size()`` and
``protected_size()`` are kept as counters, updated in O(depth) by lock changes.

Eviction. Only evictable leaves are evicted, oldest ``last_access_time`` first (a logical
clock that ticks once per match/insert; every node on the touched path gets the tick).
Evictable leaves live in a binary heap with lazy deletion: each push stamps the node with a
fresh sequence number, and an entry is live only while its number is the node's current one
and the node is still an unlocked leaf. A node is pushed whenever it becomes an unlocked leaf
(created, unlocked, or its last child evicted) or is touched while being one. So evicting a
page costs O(log heap) and never scans the tree; stale entries are dropped when popped, and
the heap is compacted when stale entries outnumber live ones (amortized O(1) per push).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np
import torch

from srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult, PrefixCacheReq
from srt.mem_cache.radix_tree import TreeNode, format_tree, require, tree_nodes
from srt.utils.pages import page_floor

if TYPE_CHECKING:
    from srt.mem_cache.allocator import TokenToKVPoolAllocator
    from srt.mem_cache.memory_pool import ReqToTokenPool


class RadixCache(BasePrefixCache):
    """Prefix cache sharing KV slots between requests with equal token prefixes.

    Args:
        req_to_token_pool: ``req_to_token[req_pool_idx, pos]`` = KV slot of token ``pos``.
        token_to_kv_pool_allocator: where evicted and duplicate slots go back.
        page_size: P; keys and values are stored in whole pages.

    Instrumentation: ``evict_heap_pops`` counts heap entries examined by ``evict`` (the
    per-page eviction work, which must not grow with the size of the tree).
    """

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
    ):
        if page_size != token_to_kv_pool_allocator.page_size:
            raise ValueError("RadixCache page_size differs from the allocator's")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.device = token_to_kv_pool_allocator.device
        self._matched_tokens = 0
        self._looked_up_tokens = 0
        self.evict_heap_pops = 0
        self._init_tree()

    def _init_tree(self) -> None:
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self.root = TreeNode([], self._empty, None, 0)
        self._roots: dict[str, TreeNode] = {"": self.root}  # namespace -> its root
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._heap_seq = 0
        self._heap_live_at_compaction = 0

    # ------------------------------------------------------------------ key helpers
    def _child_key(self, key: list[int], pos: int) -> int | tuple[int, ...]:
        return key[pos] if self.page_size == 1 else tuple(key[pos : pos + self.page_size])

    def _match_len(self, node_key: list[int], key: list[int], pos: int, end: int) -> int:
        """Length of the common prefix of node_key and key[pos:end], rounded down to pages."""
        n = min(len(node_key), end - pos)
        if n == len(node_key):
            if node_key == key[pos : pos + n]:
                return n
        elif node_key[:n] == key[pos : pos + n]:
            return page_floor(n, self.page_size)
        m = next((i for i, (a, b) in enumerate(zip(node_key, key[pos : pos + n])) if a != b), n)
        return page_floor(m, self.page_size)

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after its first m tokens; return the new upper node.

        The original object keeps the lower part (so locks and heap entries held on it stay
        valid); the upper part inherits its lock count and access time."""
        parent = child.parent
        upper = TreeNode(child.key[:m], child.value[:m], parent, child.last_access_time)
        upper.lock_ref = child.lock_ref
        parent.children[self._child_key(child.key, 0)] = upper
        child.key = child.key[m:]
        child.value = child.value[m:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        return upper

    # ------------------------------------------------------------------ heap of evictable leaves
    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return node.lock_ref == 0 and not node.children and node.parent is not None

    def _push(self, node: TreeNode) -> None:
        self._heap_seq += 1
        node.heap_seq = self._heap_seq
        heapq.heappush(self._heap, (node.last_access_time, self._heap_seq, node))
        if len(self._heap) > 2 * self._heap_live_at_compaction + 1024:
            self._heap = [e for e in self._heap if e[1] == e[2].heap_seq and self._is_evictable_leaf(e[2])]
            heapq.heapify(self._heap)
            self._heap_live_at_compaction = len(self._heap)

    def _touch_leaf(self, node: TreeNode) -> None:
        if self._is_evictable_leaf(node):
            self._push(node)

    # ------------------------------------------------------------------ match / insert
    def _root_of(self, namespace: str) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode([], self._empty, None, 0)
        return root

    def _walk(self, key: list[int], end: int, namespace: str) -> tuple[list[torch.Tensor], TreeNode, int]:
        """The one tree walk of match and insert: tick the clock and follow key[:end] (end
        page-aligned) from the namespace's root, splitting the node where the match ends inside it
        and stamping every node on the path. Returns (values on the path, deepest node, matched length)."""
        self._clock += 1
        node, pos = self._root_of(namespace), 0
        values: list[torch.Tensor] = []
        while pos < end:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            m = self._match_len(child.key, key, pos, end)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access_time = self._clock
            values.append(child.value)
            node, pos = child, pos + m
        return values, node, pos

    def match_prefix(self, key: list[int], namespace: str = "") -> MatchResult:
        """Longest cached prefix of ``key`` (see BasePrefixCache.match_prefix).

        Returns ``MatchResult(device_indices [m] int64, last_node)`` with m a multiple of
        page_size; last_node is the root when nothing matches. The caller must keep at least
        one token of a prompt to compute (match ``ids[:-1]``): logits need a forward."""
        key = key if isinstance(key, list) else list(key)
        end = page_floor(len(key), self.page_size)
        values, node, _ = self._walk(key, end, namespace)
        self._touch_leaf(node)
        value = torch.cat(values) if values else self._empty
        self._looked_up_tokens += len(key)
        self._matched_tokens += len(value)
        return MatchResult(value, node)

    def _insert(
        self, key: list[int], value: torch.Tensor, namespace: str = ""
    ) -> tuple[int, TreeNode, list[torch.Tensor]]:
        """Insert; return (already-cached length, node ending at len(key), values on the path)."""
        key = key if isinstance(key, list) else list(key)
        n = len(key)
        require(n == len(value) and n % self.page_size == 0, "insert: key/value not page-aligned")
        values, node, pos = self._walk(key, n, namespace)
        prefix_len = pos
        if pos < n:
            new = TreeNode(list(key[pos:]), value[pos:].to(torch.int64).clone(), node, self._clock)
            node.children[self._child_key(key, pos)] = new
            self._evictable += n - pos
            values.append(new.value)
            node = new
        self._touch_leaf(node)
        return prefix_len, node, values

    def insert(self, key: list[int], value: torch.Tensor, namespace: str = "") -> int:
        """Insert key -> value (see BasePrefixCache.insert); returns the already-cached length."""
        return self._insert(key, value, namespace)[0]

    # ------------------------------------------------------------------ requests
    def cache_finished_req(self, req: PrefixCacheReq) -> None:
        """Insert the req's computed, page-aligned tokens, free its duplicate and tail slots,
        unlock ``req.last_node`` and free its req_to_token row (see BasePrefixCache)."""
        require(req.req_pool_idx is not None, "cache_finished_req: req has no req_pool_idx")
        P = self.page_size
        committed, allocated = req.kv_committed_len, req.kv_allocated_len
        tree_len = page_floor(len(req.prefix_indices), P)
        aligned = page_floor(committed, P)
        require(tree_len <= aligned <= committed <= allocated, "cache_finished_req: inconsistent lengths")
        kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, :allocated]
        token_ids = (req.origin_input_ids + req.output_ids)[:aligned]
        require(len(token_ids) == aligned, "cache_finished_req: kv_committed_len exceeds the token ids")
        new_prefix_len, _, _ = self._insert(token_ids, kv[:aligned], req.lora_name)
        # kv[tree_len:new_prefix_len]: the tree already had these tokens (another request
        # inserted them meanwhile) -> duplicates; kv[aligned:]: the unaligned tail and any
        # slots allocated past the computed tokens.
        to_free = torch.cat([kv[tree_len:new_prefix_len], kv[aligned:]]).clone()
        self.allocator.free(to_free)
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None

    def cache_unfinished_req(self, req: PrefixCacheReq) -> None:
        """Insert ``req.fill_ids`` (page-aligned part) so others can share it now; move the
        req's lock to the new last node; rewrite its req_to_token row with the tree's slots;
        set ``req.prefix_indices`` to the slots of all of fill_ids (tree part + tail)."""
        P = self.page_size
        n = len(req.fill_ids)
        aligned = page_floor(n, P)
        tree_len = page_floor(len(req.prefix_indices), P)
        require(tree_len <= aligned, "cache_unfinished_req: fill_ids shorter than the prefix")
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        new_prefix_len, new_last, values = self._insert(req.fill_ids[:aligned], row[:aligned], req.lora_name)
        if new_prefix_len > tree_len:
            self.allocator.free(row[tree_len:new_prefix_len].clone())
        tree_slots = torch.cat(values) if values else self._empty
        row[tree_len:aligned] = tree_slots[tree_len:].to(row.device)
        self.inc_lock_ref(new_last)
        self.dec_lock_ref(req.last_node)
        req.last_node = new_last
        req.prefix_indices = torch.cat([tree_slots, row[aligned:n].to(tree_slots.device)])

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: TreeNode | None) -> None:
        """Protect node and its ancestors from eviction (O(depth))."""
        if node is None:
            return
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        """Undo one inc_lock_ref(node) (O(depth))."""
        if node is None:
            return
        deepest = node
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise AssertionError(f"dec_lock_ref below zero on {node}")
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            node = node.parent
        self._touch_leaf(deepest)

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots (whole leaves, LRU first) unless nothing evictable
        is left; stops as soon as the goal is reached. Returns the number of slots freed."""
        freed = 0
        to_free: list[torch.Tensor] = []
        while freed < num_tokens and self._heap:
            _, seq, node = heapq.heappop(self._heap)
            self.evict_heap_pops += 1
            if seq != node.heap_seq or not self._is_evictable_leaf(node):
                continue
            parent = node.parent
            del parent.children[self._child_key(node.key, 0)]
            node.parent = None
            node.heap_seq = -1
            to_free.append(node.value)
            freed += len(node.key)
            self._evictable -= len(node.key)
            self._touch_leaf(parent)
        if to_free:
            self.allocator.free(torch.cat(to_free))
        return freed

    def drop_namespace(self, namespace: str) -> int:
        """Free the whole tree of ``namespace`` (none of it may be locked); returns the slots freed."""
        root = self._roots.pop(namespace, None) if namespace else None
        if root is None:
            return 0
        nodes = tree_nodes(root)
        if any(n.lock_ref for n in nodes):
            self._roots[namespace] = root
            raise RuntimeError(f"drop_namespace({namespace!r}) while requests hold its prefixes")
        freed = sum(len(n.key) for n in nodes)
        if nodes:
            self.allocator.free(torch.cat([n.value for n in nodes]))
        for n in nodes:
            n.parent = None  # stale heap entries are no evictable leaves any more
        self._evictable -= freed
        return freed

    # ------------------------------------------------------------------ sizes / stats
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        """Slots held by the tree (evictable + protected)."""
        return self.evictable_size() + self.protected_size()

    def hit_stats(self) -> tuple[int, int]:
        """(matched tokens, looked-up tokens) over all match_prefix calls since construction."""
        return (self._matched_tokens, self._looked_up_tokens)

    def reset(self) -> None:
        """Free every cached slot and drop the tree. Only valid with no locks held."""
        if self._protected:
            raise RuntimeError(f"reset() while {self._protected} cached slots are locked by requests")
        values = [n.value for root in self._roots.values() for n in tree_nodes(root)]
        if values:
            self.allocator.free(torch.cat(values))
        self._init_tree()

    # ------------------------------------------------------------------ debugging
    def check_integrity(self, owned_by_requests: int = 0) -> None:
        """Raise AssertionError unless the slot accounting and every tree invariant hold.

        ``owned_by_requests``: slots held by running requests outside the tree, counted in
        whole pages: for each req, ``ceil(kv_allocated_len / P) * P`` minus its tree part
        ``len(prefix_indices) // P * P``. O(tree size + pool size): a debug check."""
        P = self.page_size
        total = self.allocator.size
        evictable = protected = 0
        values: list[torch.Tensor] = []
        live = {e[2].id for e in self._heap if e[1] == e[2].heap_seq}
        for node in (n for root in self._roots.values() for n in tree_nodes(root)):
            n, parent = len(node.key), node.parent
            if parent is None or parent.children.get(self._child_key(node.key, 0)) is not node:
                raise AssertionError(f"{node}: not reachable under its first-page key")
            if n == 0 or n % P or node.value.shape[0] != n:
                raise AssertionError(f"{node}: key/value not whole pages")
            if node.lock_ref < sum(c.lock_ref for c in node.children.values()) or node.lock_ref < 0:
                raise AssertionError(f"{node}: lock_ref below its children's sum (or negative)")
            if parent.parent is not None and node.last_access_time > parent.last_access_time:
                raise AssertionError(f"{node}: accessed later than its parent")
            if node.lock_ref:
                protected += n
            else:
                evictable += n
                if not node.children and node.id not in live:
                    raise AssertionError(f"{node}: evictable leaf missing from the eviction heap")
            values.append(node.value)
        require(evictable == self._evictable, f"evictable counter {self._evictable} != {evictable}")
        require(protected == self._protected, f"protected counter {self._protected} != {protected}")
        if values:
            # node values are whole pages, so the concatenation splits into rows of one page each
            slots = torch.cat(values).cpu().numpy()
            pages = slots.reshape(-1, P)
            require(
                bool((pages[:, 0] % P == 0).all() and (pages - pages[:, :1] == np.arange(P)).all()),
                "a node's value is not made of whole pages",
            )
            require(len(np.unique(slots)) == len(slots), "a slot appears twice in the tree")
            require(bool(((slots >= P) & (slots < total + P)).all()), "slot out of the pool's range")
            require(
                not np.intersect1d(pages[:, 0] // P, self.allocator.free_page_ids()).size,
                "cached slot is free",
            )
        free = self.allocator.available_size()
        require(
            free + evictable + protected + owned_by_requests == total,
            f"free {free} + evictable {evictable} + protected {protected} + owned {owned_by_requests} != {total}",
        )

    def pretty_print(self, max_tokens: int = 8) -> str:
        """The tree as indented text, one node per line (first max_tokens ids of each key)."""
        head = f"root (evictable={self._evictable}, protected={self._protected})"
        trees = [format_tree(self.root, head, max_tokens)]
        trees += [format_tree(r, f"namespace {ns!r}", max_tokens) for ns, r in self._roots.items() if ns]
        return "\n".join(trees)

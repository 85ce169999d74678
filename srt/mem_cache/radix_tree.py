"""The nodes of RadixCache's tree (shape and invariants in radix_cache.py) and the helpers that
read a whole tree: every node, and the tree as text."""

from __future__ import annotations

import itertools

import torch

_node_ids = itertools.count()


class TreeNode:
    """One edge of the radix tree (the root has an empty key and value)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time", "heap_seq", "id")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None, time: int):
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = time
        self.heap_seq = -1  # sequence number of the node's live heap entry (-1: none)
        self.id = next(_node_ids)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def tree_nodes(root: TreeNode) -> list[TreeNode]:
    """Every node below ``root`` (depth-first, root excluded)."""
    out: list[TreeNode] = []
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def format_tree(root: TreeNode, header: str, max_tokens: int) -> str:
    """``header`` then the tree as indented text, one node per line (first max_tokens ids of each key)."""
    lines = [header]
    stack = [(c, 1) for c in reversed(root.children.values())]
    while stack:
        node, depth = stack.pop()
        ids = node.key[:max_tokens]
        more = "..." if len(node.key) > max_tokens else ""
        lines.append(
            f"{'  ' * depth}{ids}{more} len={len(node.key)} lock={node.lock_ref} t={node.last_access_time}"
        )
        stack.extend((c, depth + 1) for c in reversed(node.children.values()))
    return "\n".join(lines)

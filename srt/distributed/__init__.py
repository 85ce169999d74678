"""Tensor parallelism's process-group side: ``TPInfo`` and its collectives, and the pure rules
that split heads, rows and the vocabulary across ranks (``partition``)."""

from srt.distributed.communication import TPInfo
from srt.distributed.partition import HeadShard, head_shard, split_range

__all__ = ["HeadShard", "TPInfo", "head_shard", "split_range"]

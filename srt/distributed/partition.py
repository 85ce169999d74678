"""How tensor parallelism splits a model across ``tp`` ranks: pure arithmetic, no torch.

Contiguous ranges, as even as possible, the first ranks taking the extra units::

    split_range(10, 4, r)           -> (0, 3) (3, 3) (6, 2) (8, 2)      (start, size) per rank
    split_range(1536, 2, r, 256)    -> (0, 768) (768, 768)              whole units of 256

Attention heads (``head_shard``), H query heads in Hkv groups of g = H / Hkv:

* Hkv >= tp: the KV heads split into tp contiguous groups (``split_range``; uneven allowed,
  3 KV heads at tp=2 -> 2 and 1) and each rank owns the g query heads of each of its KV heads.
* Hkv < tp: KV heads are replicated; rank r uses KV head ``r * Hkv // tp`` and the ranks that
  share a KV head split its g query heads between them (``split_range`` again), so g must be at
  least the number of ranks sharing it.

Row-parallel layers (o_proj, down_proj) take the matching columns: o_proj the rank's query
heads, down_proj the rank's slice of the intermediate size (the same slice gate/up produce).
"""

from __future__ import annotations

from dataclasses import dataclass

from srt.utils.errors import ConfigError

# GGUF block sizes (K-quants 256, the rest 32): splitting in whole units of these keeps the
# row-parallel shard boundaries block-aligned, so quantized blocks are sliced, not re-encoded
ALIGN_UNITS = (256, 32)


def split_range(n: int, tp: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """``(start, size)`` of rank ``rank``'s part of ``n`` items cut in whole ``unit``s (``n``
    must be a multiple of ``unit``); sizes differ by at most one unit, larger first."""
    if n % unit:
        raise ValueError(f"{n} is not a multiple of the unit {unit}")
    units = n // unit
    base, extra = divmod(units, tp)
    start = rank * base + min(rank, extra)
    return start * unit, (base + (rank < extra)) * unit


def aligned_unit(n: int, tp: int) -> int:
    """The largest of ``ALIGN_UNITS`` that divides ``n`` into at least ``tp`` units, else 1."""
    return next((u for u in ALIGN_UNITS if n % u == 0 and n // u >= tp), 1)


@dataclass(frozen=True, slots=True)
class HeadShard:
    """A rank's query heads ``[q_start, q_start + q_count)`` and KV heads
    ``[kv_start, kv_start + kv_count)`` (indices into the full model's heads)."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_shard(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadShard:
    """Rank ``rank``'s heads (see the module docstring). Raises ``ConfigError`` when a rank
    would get no query head."""
    if num_heads % num_kv_heads:
        raise ConfigError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp:
        kv_start, kv_count = split_range(num_kv_heads, tp, rank)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    kv = rank * num_kv_heads // tp
    sharing = [r for r in range(tp) if r * num_kv_heads // tp == kv]
    if group < len(sharing):
        raise ConfigError(
            f"--tp-size {tp}: KV head {kv} is shared by {len(sharing)} ranks but has only {group} query "
            f"heads ({num_heads} query / {num_kv_heads} KV heads); use a tp size of at most {num_heads}."
        )
    q_off, q_count = split_range(group, len(sharing), sharing.index(rank))
    return HeadShard(kv * group + q_off, q_count, kv, 1)

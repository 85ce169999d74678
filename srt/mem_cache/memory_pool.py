"""KV memory pools: request -> token slot map, and the per-layer K/V buffers.

Two-level indirection (the same as SGLang's):

    req_to_token_pool.req_to_token[req_pool_idx, pos]  -> KV slot of token ``pos`` of that request
    token_to_kv_pool.k_buffer[layer][slot]             -> [head_num, head_dim] key of that token
    token_to_kv_pool.v_buffer[layer][slot]             -> [head_num, head_dim] value of that token

Slot layout of the KV pool (``P`` = page size, ``N`` = usable size in tokens):

    slot 0 .. P-1        reserved padding page: never handed out, zeroed at start. Attention
                         backends point padded gather positions at slot 0, so a padded read is
                         finite (masked out of the softmax) and never NaN garbage; the padded rows
                         of a replayed CUDA graph write finite throwaway K/V there.
    slot P .. N+P-1      handed out page by page by ``TokenToKVPoolAllocator``

Nothing here decides *which* slots a request gets; that is the allocator's job
(``srt/mem_cache/allocator.py``). These classes own memory and simple free lists only.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """Rows of KV slot indices, one row per running request.

    ``req_to_token``: ``int64 [size, max_context_len]``; row ``r`` holds the KV slots of the
    request that owns row ``r`` at positions ``0 .. seq_len-1`` (later positions are stale).
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device) -> None:
        if size < 1 or max_context_len < 1:
            raise ValueError(
                f"ReqToTokenPool needs size >= 1 and max_context_len >= 1, got {size}, {max_context_len}"
            )
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=self.device)
        self._free: list[int] = list(range(size))
        self._in_use = bytearray(size)

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int = 1) -> list[int] | None:
        """Hand out ``n`` free rows (lowest indices first), or None when fewer than ``n`` are free."""
        if n > len(self._free):
            return None
        rows = self._free[:n]
        del self._free[:n]
        for r in rows:
            self._in_use[r] = 1
        return rows

    def free(self, idx: int | list[int]) -> None:
        """Return rows to the pool. Freeing a row that is not in use raises ``ValueError``."""
        rows = [idx] if isinstance(idx, int) else list(idx)
        bad = [r for r in rows if not 0 <= r < self.size or not self._in_use[r]]
        if bad or len(set(rows)) != len(rows):
            raise ValueError(f"ReqToTokenPool.free: rows {bad or rows} are not allocated (or repeated)")
        for r in rows:
            self._in_use[r] = 0
        self._free.extend(rows)

    def write(self, idx: int, start: int, slots: torch.Tensor) -> None:
        """``req_to_token[idx, start:start+len(slots)] = slots``."""
        self.req_to_token[idx, start : start + slots.numel()] = slots

    def clear(self) -> None:
        self._free = list(range(self.size))
        self._in_use = bytearray(self.size)


class MHATokenToKVPool:
    """Per-layer K and V buffers of shape ``[size + page_size, head_num, head_dim]``.

    ``size`` is the number of usable token slots (a multiple of ``page_size`` is expected; the
    allocator hands out slots ``page_size .. size + page_size - 1``). Slots ``0 .. page_size-1``
    form the zero padding page.

    On CPU the buffers are allocated with ``torch.empty`` (pages are committed by the OS on first
    write, so a large pool costs resident memory only as it fills) and only the padding page is
    zeroed: every usable slot is written by an attention backend before any read of it. On other
    devices the whole buffer is zeroed.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device,
    ) -> None:
        if size < 1 or page_size < 1:
            raise ValueError(f"MHATokenToKVPool needs size >= 1 and page_size >= 1, got {size}, {page_size}")
        self.size, self.page_size, self.dtype = size, page_size, dtype
        self.head_num, self.head_dim, self.layer_num = head_num, head_dim, layer_num
        self.device = torch.device(device)
        # one tensor per layer holds its keys ([0]) and values ([1]), so a layer's new K and V,
        # adjacent in the fused qkv output, are stored by one indexed copy (set_kv_buffer)
        shape = (2, size + page_size, head_num, head_dim)
        self.kv_buffer: list[torch.Tensor] = [self._new_buffer(shape) for _ in range(layer_num)]
        self.k_buffer: list[torch.Tensor] = [kv[0] for kv in self.kv_buffer]
        self.v_buffer: list[torch.Tensor] = [kv[1] for kv in self.kv_buffer]

    def _new_buffer(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":
            buf = torch.empty(shape, dtype=self.dtype, device=self.device)
            buf[:, : self.page_size].zero_()
            return buf
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ---- accessors ----
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of one layer, each ``[size + page_size, head_num, head_dim]``."""
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values of ``n`` tokens at slots ``loc`` (``int64 [n]``).

        ``k``/``v``: ``[n, head_num, head_dim]`` or ``[n, head_num * head_dim]``; cast to the pool dtype.
        """
        n = loc.numel()
        pair = self._adjacent_pair(k, v, n)
        if pair is not None:  # K and V side by side in one tensor (the qkv output): one copy
            self.kv_buffer[layer_id][:, loc] = pair
            return
        self.k_buffer[layer_id][loc] = k.reshape(n, self.head_num, self.head_dim).to(self.dtype)
        self.v_buffer[layer_id][loc] = v.reshape(n, self.head_num, self.head_dim).to(self.dtype)

    def _adjacent_pair(self, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor | None:
        """``[2, n, H, D]``, a view of k and v, when v's rows start where k's end in the same
        storage (k and v split from one tensor), both 2-D in the pool's dtype; else None."""
        width = self.head_num * self.head_dim
        if k.dim() != 2 or v.dim() != 2 or k.shape != (n, width) or v.shape != (n, width):
            return None
        if k.dtype != self.dtype or v.dtype != self.dtype or k.stride(1) != 1 or v.stride(1) != 1:
            return None
        if n > 1 and k.stride(0) != v.stride(0):  # a single row's stride is arbitrary
            return None
        if k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr() or k.device != v.device:
            return None
        if v.storage_offset() != k.storage_offset() + width:
            return None
        both = k.as_strided((n, 2, width), (k.stride(0), width, 1))
        return both.view(n, 2, self.head_num, self.head_dim).transpose(0, 1)

    # ---- sizes ----
    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layer_num * self.head_num * self.head_dim * self.dtype.itemsize

    def mem_bytes(self) -> int:
        """Bytes of all K and V buffers (padding page included)."""
        return (self.size + self.page_size) * self.bytes_per_token


KVPool = MHATokenToKVPool
"""The KV pool type the rest of the engine names (only MHA layouts exist so far)."""

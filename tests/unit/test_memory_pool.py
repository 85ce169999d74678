"""ReqToTokenPool and MHATokenToKVPool: shapes, padding page, free lists, KV writes."""

from __future__ import annotations

import pytest
import torch

from srt.mem_cache.memory_pool import KVPool, MHATokenToKVPool, ReqToTokenPool


def test_req_to_token_pool_alloc_free_clear():
    pool = ReqToTokenPool(4, 32, "cpu")
    assert pool.req_to_token.shape == (4, 32) and pool.req_to_token.dtype == torch.int64
    a = pool.alloc(3)
    assert a is not None and len(set(a)) == 3 and all(0 <= r < 4 for r in a)
    assert pool.available_size() == 1
    assert pool.alloc(2) is None  # all-or-nothing
    assert pool.available_size() == 1
    b = pool.alloc(1)
    assert b is not None and not set(b) & set(a)
    pool.free(a[0])
    pool.free(a[1:])
    assert pool.available_size() == 3
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(a[0])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([b[0], b[0]])
    assert pool.available_size() == 3  # a failed free changes nothing
    pool.clear()
    assert pool.available_size() == 4
    assert sorted(pool.alloc(4)) == [0, 1, 2, 3]


def test_req_to_token_pool_write():
    pool = ReqToTokenPool(2, 16, "cpu")
    (r,) = pool.alloc(1)
    pool.write(r, 3, torch.tensor([7, 8, 9]))
    assert pool.req_to_token[r, 3:6].tolist() == [7, 8, 9]


@pytest.mark.parametrize("page_size", [1, 16])
def test_kv_pool_layout_and_padding_page(page_size):
    pool = MHATokenToKVPool(64, page_size, torch.float32, head_num=3, head_dim=8, layer_num=2, device="cpu")
    assert KVPool is MHATokenToKVPool
    assert len(pool.k_buffer) == len(pool.v_buffer) == 2
    for buf in pool.k_buffer + pool.v_buffer:
        assert buf.shape == (64 + page_size, 3, 8)
        assert torch.all(buf[:page_size] == 0)
    k, v = pool.get_kv_buffer(1)
    assert k is pool.k_buffer[1] and v is pool.v_buffer[1]
    assert pool.bytes_per_token == 2 * 2 * 3 * 8 * 4
    assert pool.mem_bytes() == (64 + page_size) * pool.bytes_per_token


def test_set_kv_buffer_flat_and_3d_and_casts():
    pool = MHATokenToKVPool(32, 1, torch.bfloat16, head_num=2, head_dim=4, layer_num=3, device="cpu")
    loc = torch.tensor([5, 1, 30])
    k = torch.randn(3, 8)
    v = torch.randn(3, 2, 4)
    pool.set_kv_buffer(2, loc, k, v)
    torch.testing.assert_close(pool.k_buffer[2][loc], k.view(3, 2, 4).bfloat16())
    torch.testing.assert_close(pool.v_buffer[2][loc], v.bfloat16())
    assert pool.k_buffer[2].dtype == torch.bfloat16
    # other layers untouched
    assert torch.all(pool.k_buffer[1][:1] == 0)


def test_invalid_sizes_raise():
    with pytest.raises(ValueError):
        ReqToTokenPool(0, 8, "cpu")
    with pytest.raises(ValueError):
        MHATokenToKVPool(0, 1, torch.float32, 1, 1, 1, "cpu")


def _split_qkv(t: int, heads: int, kv_heads: int, d: int, dtype=torch.float32):
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d).to(dtype)
    return qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)


@pytest.mark.parametrize("tokens", [1, 5])
def test_keys_and_values_side_by_side_are_stored_in_one_copy(tokens):
    """k and v split from the fused qkv output: one indexed copy into the layer's K/V tensor."""
    from benchmarks.gpu.census import LaunchCensus

    pool = MHATokenToKVPool(32, 1, torch.float32, 2, 8, 2, "cpu")
    _, k, v = _split_qkv(tokens, 4, 2, 8)
    loc = torch.tensor([7, 3, 20, 11, 30][:tokens])
    with LaunchCensus() as census:
        pool.set_kv_buffer(1, loc, k, v)
    assert [name for _, name in census.kernels] == ["index_put_"]
    assert torch.equal(pool.k_buffer[1][loc], k.reshape(tokens, 2, 8))
    assert torch.equal(pool.v_buffer[1][loc], v.reshape(tokens, 2, 8))
    assert pool.k_buffer[1].is_contiguous() and pool.v_buffer[1].is_contiguous()
    assert pool.k_buffer[1].data_ptr() == pool.kv_buffer[1].data_ptr()


@pytest.mark.parametrize("case", ["apart", "swapped", "other dtype", "k normed apart"])
def test_keys_and_values_not_side_by_side_are_stored_apart(case):
    pool = MHATokenToKVPool(32, 1, torch.bfloat16, 2, 8, 1, "cpu")
    _, k, v = _split_qkv(3, 4, 2, 8, torch.bfloat16)
    if case == "apart":
        k, v = k.clone(), v.clone()
    elif case == "swapped":
        k, v = v, k  # adjacent, in the wrong order
    elif case == "other dtype":
        k, v = k.float(), v.float()
    else:
        k = k.clone() * 2
    loc = torch.tensor([4, 9, 2])
    pool.set_kv_buffer(0, loc, k, v)
    assert torch.equal(pool.k_buffer[0][loc], k.reshape(3, 2, 8).to(torch.bfloat16))
    assert torch.equal(pool.v_buffer[0][loc], v.reshape(3, 2, 8).to(torch.bfloat16))

"""KV pool sizing arithmetic (srt/mem_cache/pool_size.py)."""

from __future__ import annotations

import pytest

from srt.mem_cache import pool_size as ps

GIB = 1 << 30


def test_kv_bytes_per_token_smollm2():
    # 30 layers, 3 kv heads, head_dim 64, float32: 2 * 30 * 3 * 64 * 4
    assert ps.kv_bytes_per_token(30, 3, 64, 4) == 46080
    assert ps.kv_bytes_per_token(30, 3, 64, 2) == 23040


def test_profile_max_num_tokens_budget():
    bpt = 1000
    got = ps.profile_max_num_tokens(
        available_bytes=10_000_000,
        mem_fraction_static=0.5,
        weight_bytes=1_000_000,
        activation_peak_bytes=500_000,
        bytes_per_token=bpt,
        page_size=1,
    )
    assert got == (5_000_000 - 1_000_000 - 500_000) // bpt == 3500


def test_cpu_auto_takes_half_of_what_is_free_once_the_model_is_in():
    """22.5 GiB usable, 6.6 GiB of weights (a 1.5B float32 model held once), 0.4 GiB of activations:
    half of the 15.5 GiB left (no fixed fraction of the total that a big model could exceed)."""
    bpt, usable, weights, act = 28672, int(22.5 * GIB), int(6.6 * GIB), int(0.4 * GIB)
    got = ps.cpu_auto_max_num_tokens(usable, weights, act, bpt, page_size=16, context_len=32768)
    free = usable - weights - act
    assert got == int(free * ps.CPU_KV_SHARE) // bpt // 16 * 16
    # little left free: at least one full-context request (65536 tokens, 1.75 GiB) ...
    full = ps.cpu_auto_max_num_tokens(usable, usable - 3 * GIB, 0, bpt, page_size=16, context_len=65536)
    assert full == 65536 and 65536 * bpt > 1.5 * GIB
    # ... as long as 1 GiB stays free
    tight = ps.cpu_auto_max_num_tokens(
        usable, usable - int(2.5 * GIB), 0, bpt, page_size=16, context_len=65536
    )
    assert tight == int(1.5 * GIB) // bpt // 16 * 16
    assert ps.cpu_auto_max_num_tokens(usable, usable, 1, bpt, 16, 4096) == 0  # nothing free
    with pytest.raises(ValueError):
        ps.cpu_auto_max_num_tokens(usable, 0, 0, 0, 16, 4096)


def test_profile_max_num_tokens_rounds_down_to_pages():
    got = ps.profile_max_num_tokens(10_000_000, 0.5, 1_000_000, 500_000, 1000, page_size=16)
    assert got == 3500 // 16 * 16 == 3488
    assert got % 16 == 0


def test_profile_max_num_tokens_nothing_left():
    assert ps.profile_max_num_tokens(GIB, 0.3, GIB // 4, GIB // 10, 46080, 1) == 0
    with pytest.raises(ValueError):
        ps.profile_max_num_tokens(GIB, 0.3, 0, 0, 0, 1)


def test_cpu_process_memory_counts_rss_and_respects_cgroup():
    assert ps.cpu_process_memory(10 * GIB, 2 * GIB, None, None) == 12 * GIB
    # a cgroup of 8 GiB with 5 GiB used (2 by us): room 3 GiB + our 2 GiB
    assert ps.cpu_process_memory(10 * GIB, 2 * GIB, 8 * GIB, 5 * GIB) == 5 * GIB
    # a generous cgroup does not raise the figure above what the host has
    assert ps.cpu_process_memory(10 * GIB, 2 * GIB, 100 * GIB, 2 * GIB) == 12 * GIB
    # usage unknown: assume only us
    assert ps.cpu_process_memory(10 * GIB, 2 * GIB, 4 * GIB, None) == 4 * GIB


def test_default_max_running_requests():
    assert ps.default_max_running_requests(100_000, "cuda") == 4096
    assert ps.default_max_running_requests(1000, "cuda") == 500
    assert ps.default_max_running_requests(100_000, "cpu") == 256
    assert ps.default_max_running_requests(100, "cpu") == 50
    assert ps.default_max_running_requests(1, "cpu") == 1
    assert ps.req_to_token_pool_size(256) > 256


def test_profile_prefill_tokens():
    assert ps.profile_prefill_tokens(16384, 2048) == 2048
    assert ps.profile_prefill_tokens(1024, 2048) == 1024
    assert ps.profile_prefill_tokens(16384, -1) == 16384
    assert ps.profile_prefill_tokens(16384, None) == 16384


def test_split_into_sequences():
    assert ps.split_into_sequences(2048, 8192) == [2048]
    assert ps.split_into_sequences(5000, 2048) == [2048, 2048, 904]
    assert ps.split_into_sequences(4096, 2048) == [2048, 2048]
    assert ps.split_into_sequences(0, 2048) == []


def test_format_kv_cache_line():
    line = ps.format_kv_cache_line(150_000, 150_000 * 46080, 16, 2048)
    assert line == "KV cache: 150000 tokens, 6.44 GiB, page size 16, max prefill tokens 2048"


def test_read_cgroup_memory_shape():
    limit, usage = ps.read_cgroup_memory()
    assert limit is None or limit > 0
    assert usage is None or usage >= 0


def test_peak_rss_meter_sees_a_large_temporary():
    # In a fresh process: inside a long pytest run, freed memory may still be resident and be
    # reused by the allocation below without any RSS growth.
    import subprocess
    import sys

    code = (
        "import torch; from srt.mem_cache import pool_size as ps; m = ps.PeakRSSMeter(); m.start(); "
        "x = torch.ones(64 << 20, dtype=torch.uint8); del x; print(m.peak_growth())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) >= 48 << 20

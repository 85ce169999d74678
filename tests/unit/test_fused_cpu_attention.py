"""FusedCPUAttnBackend (native paged decode kernel) against the naive reference and against
TorchNativeAttnBackend, its oracle and fallback, on the random paged layouts of
test_torch_native_attention (shuffled pages, NaN in every slot the backend must not read)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from srt.kernels import cpu as cpu_kernels
from srt.layers.attention.fused_cpu import FusedCPUAttnBackend
from srt.layers.attention.registry import create_attention_backend
from srt.layers.forward_batch import ForwardMode
from tests.unit.test_torch_native_attention import Case, make_case, reference, run_backend


@pytest.fixture(scope="module")
def native():
    if not cpu_kernels.load(build_if_missing=True):
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.kernel_status()}")
    return True


def run_fused(case: Case) -> torch.Tensor:
    backend = FusedCPUAttnBackend(None)
    case.fb.attn_backend = backend
    backend.init_forward_metadata(case.fb)
    return backend.forward(case.q, case.k, case.v, case.layer, case.fb)


CASES = [
    (ForwardMode.DECODE, [1, 30, 0, 17, 64, 300], [1] * 6),
    (ForwardMode.DECODE, [12, 12, 12], [1, 1, 1]),
    (ForwardMode.MIXED, [0, 20, 8, 31, 0], [13, 5, 1, 1, 1]),
    (ForwardMode.EXTEND, [5, 0, 40], [9, 12, 1]),
]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode,prefixes,extends", CASES)
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (8, 8), (8, 1)])
def test_fused_matches_reference_and_torch_native(
    native, page_size, mode, prefixes, extends, heads, kv_heads
):
    make = lambda: make_case(mode, prefixes, extends, page_size, heads=heads, kv_heads=kv_heads, seed=11)  # noqa: E731
    case = make()
    out = run_fused(case)
    assert out.shape == case.q.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(case), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, run_backend(make()), rtol=1e-5, atol=1e-5)
    # the new tokens' K/V went into the pool at out_cache_loc, as with the torch-native backend
    kv = case.layer.num_kv_heads, case.layer.head_dim
    pool, loc = case.fb.token_to_kv_pool, case.fb.out_cache_loc
    torch.testing.assert_close(pool.k_buffer[case.layer.layer_id][loc], case.k.view(-1, *kv))


def test_fallback_is_exactly_torch_native(monkeypatch, caplog):
    """Without the native op the backend runs torch-native's decode path, bit for bit, and says so."""
    monkeypatch.setattr(cpu_kernels, "native_available", lambda: False)
    monkeypatch.setattr(cpu_kernels, "kernel_status", lambda: "fallback: pure-torch reference (test)")
    with caplog.at_level(logging.INFO, logger="srt.attention"):
        backend = FusedCPUAttnBackend(None)
    assert not backend.native
    assert any("fallback" in r.getMessage() for r in caplog.records)
    for mode, prefixes, extends in CASES[:3]:
        case, twin = (make_case(mode, prefixes, extends, 16, seed=3) for _ in range(2))
        case.fb.attn_backend = backend
        backend.init_forward_metadata(case.fb)
        out = backend.forward(case.q, case.k, case.v, case.layer, case.fb)
        assert torch.equal(out, run_backend(twin))


def test_registry_builds_fused_cpu():
    assert isinstance(create_attention_backend("fused_cpu", None), FusedCPUAttnBackend)


def test_backends_are_composed_and_graph_hooks_are_explicit():
    """fused_cpu is built from torch_native's functions, not a subclass of it; only a backend that
    offers a native decode stack answers native_decode_args, and a backend without CUDA-graph
    support says so instead of capturing nothing."""
    from srt.layers.attention.torch_native import TorchNativeAttnBackend

    assert not issubclass(FusedCPUAttnBackend, TorchNativeAttnBackend)
    torch_native = TorchNativeAttnBackend()
    assert torch_native.native_decode_args() is None
    for backend in (torch_native, FusedCPUAttnBackend(None)):
        assert not backend.supports_cuda_graph
        with pytest.raises(NotImplementedError, match="does not support CUDA graphs"):
            backend.init_cuda_graph_state(8, 128)
        with pytest.raises(NotImplementedError, match="does not support CUDA graphs"):
            backend.init_forward_metadata_replay_cuda_graph(
                1, torch.zeros(1, 4), torch.zeros(1), [1], ForwardMode.DECODE
            )


def test_native_decode_args_follow_the_batch(native):
    """After a DECODE batch the args name its decode rows; after an EXTEND batch there are none
    (a stale decode batch's args must never reach the native decode stack)."""
    backend = FusedCPUAttnBackend(None)
    decode = make_case(ForwardMode.DECODE, [4, 16, 32], [1, 1, 1], page_size=16, seed=3)
    backend.init_forward_metadata(decode.fb)
    args = backend.native_decode_args()
    assert args is not None and args[1].tolist() == decode.fb.req_pool_indices.tolist()
    assert args[2].tolist() == decode.fb.seq_lens.tolist()
    extend = make_case(ForwardMode.EXTEND, [0, 4], [9, 3], page_size=16, seed=4)
    backend.init_forward_metadata(extend.fb)
    assert backend.native_decode_args() is None


def bf16_case(mode, prefixes, extends, seed):
    """A case of make_case with bf16 activations and a bf16 KV pool (NaN slots kept)."""
    case = make_case(mode, prefixes, extends, 4, heads=8, kv_heads=2, head_dim=64, seed=seed)
    pool = case.fb.token_to_kv_pool
    pool.k_buffer = [b.bfloat16() for b in pool.k_buffer]
    pool.v_buffer = [b.bfloat16() for b in pool.v_buffer]
    pool.dtype = torch.bfloat16
    case.q, case.k, case.v = case.q.bfloat16(), case.k.bfloat16(), case.v.bfloat16()
    return case


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("mode,prefixes,extends", CASES[2:])
def test_bf16_extends_take_sdpa_exactly_where_amx_tiles_run(native, amx, mode, prefixes, extends):
    """bf16 extends go to torch's SDPA on AMX CPUs (bit for bit torch-native's), to the native
    float32 kernel elsewhere (within bf16 rounding of it); the choice follows the CPU."""
    from srt.configs.bf16_probe import ISA_ENV
    from srt.configs.cpu_features import cpu_bf16_units

    want = cpu_bf16_units() == "amx" and not os.environ.get(ISA_ENV)
    assert FusedCPUAttnBackend(None)._bf16_sdpa == want
    backend = FusedCPUAttnBackend(None)
    backend._bf16_sdpa = amx
    case, twin = bf16_case(mode, prefixes, extends, 5), bf16_case(mode, prefixes, extends, 5)
    case.fb.attn_backend = backend
    backend.init_forward_metadata(case.fb)
    out = backend.forward(case.q, case.k, case.v, case.layer, case.fb)
    oracle = run_backend(twin)
    assert torch.isfinite(out).all()
    if amx:
        ne = sum(e for e in extends if e > 1) if mode == ForwardMode.MIXED else out.shape[0]
        assert torch.equal(out[:ne], oracle[:ne])
    torch.testing.assert_close(out.float(), oracle.float(), rtol=2e-2, atol=2e-2)

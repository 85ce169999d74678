"""FlashInferAttnBackend with the REAL FlashInfer kernels on a CUDA device, against the
torch-native backend on the CPU (float32) on the random paged layouts of
test_torch_native_attention: shuffled pages, NaN in every slot the kernels must not read
(including the unused rows of partial last pages).

Skipped without CUDA or flashinfer. The first run JIT-compiles each kernel variant (about half a
minute each): point ``FLASHINFER_WORKSPACE_BASE`` at a cache inside the run and set
``FLASHINFER_CUDA_ARCH_LIST`` to the device's arch (``9.0a`` on H100/H200) to build one arch.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from srt.layers.attention.flashinfer_backend import PLAIN, AttentionGeometry, FlashInferAttnBackend
from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from tests.unit.test_attention_window_cap import BATCHES as WINDOW_BATCHES
from tests.unit.test_attention_window_cap import WindowCapLayer
from tests.unit.test_attention_window_cap import make as window_cap_case
from tests.unit.test_flashinfer_backend import BATCHES, FakeRunner, capture_decode, pad_for_graph
from tests.unit.test_torch_native_attention import Case, make_case, run_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python"),
]
DTYPE = torch.bfloat16


def to_cuda(case: Case, dtype: torch.dtype = DTYPE) -> Case:
    """The same batch with its pools, indices and q/k/v on the GPU in ``dtype``."""
    fb, src = case.fb, case.fb.token_to_kv_pool
    pool = MHATokenToKVPool(src.size, src.page_size, dtype, src.head_num, src.head_dim, src.layer_num, "cuda")
    for dst, buf in zip(pool.k_buffer + pool.v_buffer, src.k_buffer + src.v_buffer):
        dst.copy_(buf)
    r2t_src = fb.req_to_token_pool.req_to_token
    r2t = ReqToTokenPool(r2t_src.shape[0], r2t_src.shape[1], "cuda")
    r2t.req_to_token.copy_(r2t_src)
    names = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")
    names += ("extend_seq_lens", "extend_prefix_lens", "extend_start_loc")
    moved = dataclasses.replace(fb, **{n: getattr(fb, n).cuda() for n in names})
    moved.req_to_token_pool, moved.token_to_kv_pool = r2t, pool
    q, k, v = (t.to("cuda", dtype) for t in (case.q, case.k, case.v))
    return Case(moved, q, k, v, case.full_k, case.full_v, case.layer)


def gpu_backend(case: Case) -> FlashInferAttnBackend:
    runner = FakeRunner(case.fb.token_to_kv_pool.page_size, torch.device("cuda"), DTYPE, DTYPE)
    return FlashInferAttnBackend(runner, geometry=AttentionGeometry.of(case.layer))


def _cpu_twin(case: Case) -> Case:
    """The oracle's input: the bf16-rounded q/k/v and cached K/V, in float32 on the CPU."""
    r = lambda t: t.to(DTYPE).float()  # noqa: E731
    for bufs in (case.fb.token_to_kv_pool.k_buffer, case.fb.token_to_kv_pool.v_buffer):
        for b in bufs:
            b.copy_(r(b))
    return Case(case.fb, r(case.q), r(case.k), r(case.v), case.full_k, case.full_v, case.layer)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_real_kernels_match_torch_native(batch, heads, kv_heads, head_dim, page_size):
    mode, prefixes, extends = BATCHES[batch]
    make = lambda: make_case(mode, prefixes, extends, page_size, heads, kv_heads, head_dim, seed=5)  # noqa: E731
    gpu = to_cuda(make())
    backend = gpu_backend(gpu)
    gpu.fb.attn_backend = backend
    backend.init_forward_metadata(gpu.fb)
    out = backend.forward(gpu.q, gpu.k, gpu.v, gpu.layer, gpu.fb)
    assert torch.isfinite(out).all()
    expected = run_backend(_cpu_twin(make()))
    torch.testing.assert_close(out.float().cpu(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_decode_replays_a_new_batch(page_size):
    cpu = make_case(ForwardMode.DECODE, [30, 3, 17], [1, 1, 1], page_size, 8, 2, 128, seed=9)
    padded = pad_for_graph(cpu, 4)  # the runner's padding: row 0, slot 0, seq_len 1
    gpu = to_cuda(padded)
    backend = gpu_backend(gpu)
    backend.init_cuda_graph_state(max_bs=4, max_context_len=64)
    capture_decode(backend, gpu, 4)  # plan with a dummy batch, outside the graph
    static = [t.clone() for t in (gpu.q, gpu.k, gpu.v)]
    fb = gpu.fb
    backend.forward_decode(*static, gpu.layer, fb)  # warm up (JIT, allocations) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward_decode(*static, gpu.layer, fb)
    r2t = fb.req_to_token_pool.req_to_token
    backend.init_forward_metadata_replay_cuda_graph(
        4, r2t, fb.req_pool_indices, fb.seq_lens_cpu, ForwardMode.DECODE
    )
    graph.replay()
    torch.cuda.synchronize()
    twin = _cpu_twin(make_case(ForwardMode.DECODE, [30, 3, 17], [1, 1, 1], page_size, 8, 2, 128, seed=9))
    torch.testing.assert_close(out[:3].float().cpu(), run_backend(twin), rtol=2e-2, atol=2e-2)


def test_forward_batch_build_on_cuda_drives_the_backend():
    """A batch built directly on the device (no CPU round trip of the indices)."""
    case = to_cuda(make_case(ForwardMode.EXTEND, [0, 16], [5, 3], 16, 6, 2, 64, seed=1))
    fb = ForwardBatch.build(
        ForwardMode.EXTEND,
        [0] * 8,
        case.fb.req_pool_indices.tolist(),
        [0, 16],
        [5, 3],
        case.fb.out_cache_loc,
        "cuda",
    )
    fb.req_to_token_pool, fb.token_to_kv_pool = case.fb.req_to_token_pool, case.fb.token_to_kv_pool
    backend = gpu_backend(case)
    backend.init_forward_metadata(fb)
    assert backend.forward_metadata.table.kv_indices.is_cuda
    assert not backend.forward_metadata.table.kv_indptr.is_cuda
    out = backend.forward(case.q, case.k, case.v, case.layer, fb)
    assert out.shape == case.q.shape and torch.isfinite(out).all()


# ------------------------------------------------------------------ sliding window and soft-cap
def _window_cap_twin(case: Case) -> torch.Tensor:
    """FlashInfer's result on the CPU: the recording fake planned alike, computing with
    ``paged_reference`` on the bf16-rounded inputs."""
    from tests.unit.test_flashinfer_backend import run_flashinfer

    return run_flashinfer(_cpu_twin(case))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window,cap", [(0, 0.0), (5, 0.0), (40, 30.0), (-1, 10.0)])
@pytest.mark.parametrize("batch", list(WINDOW_BATCHES))
def test_real_kernels_window_and_cap_match_paged_reference(batch, window, cap, page_size):
    make = lambda: window_cap_case(batch, window, cap, page_size, 8, 2, 128)  # noqa: E731
    gpu = to_cuda(make())
    backend = gpu_backend(gpu)
    gpu.fb.attn_backend = backend
    backend.init_forward_metadata(gpu.fb)
    out = backend.forward(gpu.q, gpu.k, gpu.v, gpu.layer, gpu.fb)
    assert torch.isfinite(out).all()
    assert list(backend.forward_metadata.wrappers) == [PLAIN, (window, cap)]
    torch.testing.assert_close(out.float().cpu(), _window_cap_twin(make()), rtol=2e-2, atol=2e-2)


def test_cuda_graph_decode_with_two_attention_groups():
    """Gemma-like layers (windowed + global, soft-capped) in one captured decode graph: one
    wrapper per group over the shared fixed buffers, both re-planned before the replay."""
    groups = [(3, 20.0), (-1, 20.0)]

    def make(group) -> Case:
        case = make_case(ForwardMode.DECODE, [30, 3, 17], [1, 1, 1], 16, 8, 2, 128, seed=9)
        case.layer = WindowCapLayer(
            **dataclasses.asdict(case.layer), sliding_window_size=group[0], logit_cap=group[1]
        )
        return case

    padded = pad_for_graph(make(groups[0]), 4)
    gpu = to_cuda(padded)
    runner = FakeRunner(16, torch.device("cuda"), DTYPE, DTYPE)
    backend = FlashInferAttnBackend(runner, geometry=AttentionGeometry.of(gpu.layer), groups=groups)
    backend.init_cuda_graph_state(max_bs=4, max_context_len=64)
    capture_decode(backend, gpu, 4)
    layers = [dataclasses.replace(gpu.layer, sliding_window_size=w, logit_cap=c) for w, c in groups]
    static = [t.clone() for t in (gpu.q, gpu.k, gpu.v)]
    fb = gpu.fb
    for layer in layers:  # warm up (JIT, allocations) before capture
        backend.forward_decode(*static, layer, fb)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [backend.forward_decode(*static, layer, fb) for layer in layers]
    r2t = fb.req_to_token_pool.req_to_token
    backend.init_forward_metadata_replay_cuda_graph(
        4, r2t, fb.req_pool_indices, fb.seq_lens_cpu, ForwardMode.DECODE
    )
    graph.replay()
    torch.cuda.synchronize()
    for out, group in zip(outs, groups):
        expected = _window_cap_twin(make(group))
        torch.testing.assert_close(out[:3].float().cpu(), expected, rtol=2e-2, atol=2e-2)

"""FlashInferAttnBackend on CPU: a recording fake stands in for FlashInfer's wrappers, and its
``run`` computes with srt's torch reference of FlashInfer's paged attention from exactly the
arrays the backend planned. The outputs must equal the torch-native backend's (the oracle) on the
random paged layouts of test_torch_native_attention (shuffled pages, NaN in every slot the
backend must not read).

Also home of the fakes the other test_flashinfer_* files import (``RecordingFactory``,
``FakeRunner``) and of the ``real_flashinfer`` fixture (skips without flashinfer, and takes its
modules out of ``sys.modules`` afterwards so the suite's "never imports flashinfer" checks hold).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from srt.layers.attention.flashinfer_backend import PLAIN, AttentionGeometry, FlashInferAttnBackend
from srt.layers.attention.paged_reference import paged_attention_reference, paged_decode_reference
from srt.layers.forward_batch import ForwardBatch, ForwardMode
from tests.unit.test_torch_native_attention import Case, make_case, reference, run_backend


@pytest.fixture(scope="module")
def real_flashinfer():
    """The installed flashinfer package, or a skip saying how to get it."""
    before = set(sys.modules)
    try:
        import flashinfer
    except ImportError as e:
        pytest.skip(f"flashinfer-python is not importable here ({e}); `make setup` installs it (--no-deps)")
    yield flashinfer
    for name in set(sys.modules) - before:
        if name == "flashinfer" or name.startswith("flashinfer."):
            del sys.modules[name]


@dataclass
class FakeRunner:
    """The ``AttentionBackendContext`` a ModelRunner gives the backend."""

    page_size: int
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    kv_cache_dtype: torch.dtype = torch.float32


@dataclass
class Call:
    method: str
    args: tuple
    kwargs: dict


DECODE_PLAN = ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size")
PREFILL_PLAN = ("qo_indptr",) + DECODE_PLAN[:6] + ("page_size",)


@dataclass
class RecordingWrapper:
    """Records every call; ``plan`` keeps the arrays (copied into the fixed buffers when built with
    ``use_cuda_graph``, as FlashInfer does), ``run`` computes with ``paged_reference``."""

    kind: str
    workspace: torch.Tensor
    ctor_kwargs: dict
    calls: list[Call] = field(default_factory=list)
    planned: dict[str, Any] = field(default_factory=dict)

    def plan(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(Call("plan", args, kwargs))
        names = DECODE_PLAN if self.kind == "decode" else PREFILL_PLAN
        self.planned = dict(zip(names, args)) | kwargs
        if self.ctor_kwargs.get("use_cuda_graph"):
            self._copy_into_graph_buffers()

    def _copy_into_graph_buffers(self) -> None:
        p, c = self.planned, self.ctor_kwargs
        indptr, indices, last = (
            c["paged_kv_indptr_buffer"],
            c["paged_kv_indices_buffer"],
            c["paged_kv_last_page_len_buffer"],
        )
        if p["last_page_len"].numel() != last.numel() or p["indices"].numel() > indices.numel():
            raise ValueError("batch size or page count does not fit the CUDA-graph buffers")
        indptr.copy_(p["indptr"])
        last.copy_(p["last_page_len"])
        indices[: p["indices"].numel()].copy_(p["indices"])
        # what the captured kernels read from now on
        p["indptr"], p["indices"], p["last_page_len"] = indptr, indices, last

    def run(self, q: torch.Tensor, paged_kv_cache: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.append(Call("run", (q, paged_kv_cache), kwargs))
        p = self.planned
        k_cache, v_cache = paged_kv_cache
        assert q.dtype == p["q_data_type"] and k_cache.dtype == p["kv_data_type"]
        assert q.shape[1:] == (p["num_qo_heads"], p["head_dim"])
        assert k_cache.shape[1:] == (p["page_size"], p["num_kv_heads"], p["head_dim"])
        kw = {
            "sm_scale": p["sm_scale"],
            "window_left": p.get("window_left", -1),
            "logits_soft_cap": p.get("logits_soft_cap") or 0.0,
        }
        if self.kind == "decode":
            out, _ = paged_decode_reference(
                q, k_cache, v_cache, p["indptr"], p["indices"], p["last_page_len"], **kw
            )
        else:
            args = (p["qo_indptr"], p["indptr"], p["indices"], p["last_page_len"])
            out, _ = paged_attention_reference(q, k_cache, v_cache, *args, causal=p["causal"], **kw)
        return out.to(p["o_data_type"])

    def count(self, method: str) -> int:
        return sum(c.method == method for c in self.calls)


@dataclass
class RecordingFactory:
    wrappers: list[RecordingWrapper] = field(default_factory=list)

    def __call__(self, kind: str, workspace: torch.Tensor, **ctor_kwargs: Any) -> RecordingWrapper:
        wrapper = RecordingWrapper(kind, workspace, ctor_kwargs)
        self.wrappers.append(wrapper)
        return wrapper


def make_backend(case: Case, factory: RecordingFactory, known_geometry: bool = True) -> FlashInferAttnBackend:
    geometry = AttentionGeometry.of(case.layer) if known_geometry else None
    runner = FakeRunner(case.fb.token_to_kv_pool.page_size)
    return FlashInferAttnBackend(runner, wrapper_factory=factory, geometry=geometry)


def run_flashinfer(case: Case, factory: RecordingFactory | None = None, **kw: Any) -> torch.Tensor:
    backend = make_backend(case, factory or RecordingFactory(), **kw)
    case.fb.attn_backend = backend
    backend.init_forward_metadata(case.fb)
    return backend.forward(case.q, case.k, case.v, case.layer, case.fb)


BATCHES = {
    "decode": (ForwardMode.DECODE, [1, 30, 0, 17, 64, 15], [1] * 6),
    "extend": (ForwardMode.EXTEND, [0, 0, 0], [7, 33, 16]),
    "extend_prefix": (ForwardMode.EXTEND, [5, 0, 40, 16, 3], [9, 12, 1, 17, 30]),
    "mixed": (ForwardMode.MIXED, [0, 20, 8, 31, 0], [13, 5, 1, 1, 1]),
}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])  # GQA ratios 1, 3, 8
@pytest.mark.parametrize("batch", list(BATCHES))
def test_matches_torch_native(batch, heads, kv_heads, head_dim, page_size):
    mode, prefixes, extends = BATCHES[batch]

    def make() -> Case:
        return make_case(mode, prefixes, extends, page_size, heads, kv_heads, head_dim, seed=heads + head_dim)

    case, factory = make(), RecordingFactory()
    out = run_flashinfer(case, factory)
    assert out.shape == case.q.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out, run_backend(make()), rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(out, reference(case), rtol=1e-4, atol=1e-5)
    (wrapper,) = factory.wrappers
    assert wrapper.kind == ("decode" if mode.is_decode() else "prefill")
    # the new tokens' K/V went into the pool at out_cache_loc before the kernel read it
    pool, loc = case.fb.token_to_kv_pool, case.fb.out_cache_loc
    kv = case.layer.num_kv_heads, case.layer.head_dim
    torch.testing.assert_close(pool.k_buffer[case.layer.layer_id][loc], case.k.view(-1, *kv))
    torch.testing.assert_close(pool.v_buffer[case.layer.layer_id][loc], case.v.view(-1, *kv))


@pytest.mark.parametrize("batch", list(BATCHES))
def test_plan_once_per_forward_in_init_forward_metadata(batch):
    mode, prefixes, extends = BATCHES[batch]
    case, factory = make_case(mode, prefixes, extends, 16, seed=3), RecordingFactory()
    backend = make_backend(case, factory)
    for _ in range(2):  # two forwards of three layers each
        backend.init_forward_metadata(case.fb)
        (wrapper,) = factory.wrappers  # built once, reused across forwards
        assert wrapper.calls[-1].method == "plan"  # planned before any layer ran
        for layer_id in range(3):
            case.layer.layer_id = layer_id
            backend.forward(case.q, case.k, case.v, case.layer, case.fb)
    assert (wrapper.count("plan"), wrapper.count("run")) == (2, 6)
    assert wrapper.ctor_kwargs["kv_layout"] == "NHD"
    assert backend.workspace.numel() == 1 << 20 and not backend.workspace.any()


def test_geometry_learnt_from_first_layer():
    case, factory = make_case(ForwardMode.DECODE, [3, 9], [1, 1], 16, heads=8, kv_heads=2), RecordingFactory()
    out = run_flashinfer(case, factory, known_geometry=False)
    torch.testing.assert_close(out, reference(case), rtol=1e-4, atol=1e-5)
    (wrapper,) = factory.wrappers
    assert [c.method for c in wrapper.calls] == ["plan", "run"]  # planned at the first layer
    assert wrapper.ctor_kwargs["use_tensor_cores"]  # GQA 4
    backend = case.fb.attn_backend
    assert backend.geometry == AttentionGeometry(8, 2, 16, case.layer.scaling)
    backend.init_forward_metadata(case.fb)  # later forwards plan up front
    assert wrapper.calls[-1].method == "plan"
    case.layer.scaling *= 2  # a layer of another geometry cannot share the plan
    with pytest.raises(ValueError, match="geometry"):
        backend.forward(case.q, case.k, case.v, case.layer, case.fb)


def test_decode_without_gqa_skips_tensor_cores():
    factory = RecordingFactory()
    run_flashinfer(make_case(ForwardMode.DECODE, [3], [1], 1, heads=4, kv_heads=4), factory)
    assert factory.wrappers[0].ctor_kwargs["use_tensor_cores"] is False


def test_forward_without_metadata_or_idle_raises():
    case = make_case(ForwardMode.DECODE, [3], [1], 1)
    backend = make_backend(case, RecordingFactory())
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        backend.forward(case.q, case.k, case.v, case.layer, case.fb)
    case.fb.forward_mode = ForwardMode.IDLE
    backend.init_forward_metadata(case.fb)
    assert backend.forward_metadata is None


# ------------------------------------------------------------------ CUDA-graph hooks (decode)
def pad_for_graph(case: Case, bs: int) -> Case:
    """``case`` (a DECODE batch) padded to ``bs`` rows the way a graph runner pads: request row 0
    whose first slot is 0 (the zero padding page), sequence length 1, zero q/k/v."""
    fb, n = case.fb, case.fb.batch_size
    fb.req_to_token_pool.req_to_token[0, 0] = 0
    pad = bs - n
    padded = ForwardBatch.build(
        ForwardMode.DECODE,
        [0] * bs,
        fb.req_pool_indices.tolist() + [0] * pad,
        fb.extend_prefix_lens_cpu + [0] * pad,
        [1] * bs,
        torch.cat([fb.out_cache_loc, torch.zeros(pad, dtype=torch.int64)]),
    )
    padded.req_to_token_pool, padded.token_to_kv_pool = fb.req_to_token_pool, fb.token_to_kv_pool
    z = lambda t: torch.cat([t, t.new_zeros(pad, t.shape[1])])  # noqa: E731
    return Case(padded, z(case.q), z(case.k), z(case.v), case.full_k, case.full_v, case.layer)


def capture_decode(backend: FlashInferAttnBackend, case: Case, bs: int) -> None:
    rows = torch.zeros(bs, dtype=torch.int64)  # dummy batch: every row at the padding page
    r2t = case.fb.req_to_token_pool.req_to_token
    backend.init_forward_metadata_capture_cuda_graph(bs, r2t, rows, [1] * bs, ForwardMode.DECODE)


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_capture_and_replay(page_size):
    prefixes = [30, 3, 17]
    case, twin = (
        make_case(ForwardMode.DECODE, prefixes, [1, 1, 1], page_size, 8, 2, 64, seed=9) for _ in range(2)
    )
    factory = RecordingFactory()
    backend = make_backend(case, factory)
    backend.init_cuda_graph_state(max_bs=8, max_context_len=64)
    state = backend.graph_state
    assert state.kv_indices.numel() == 8 * (64 // page_size) and state.kv_indptr.dtype == torch.int32
    for bs in (4, 8):
        capture_decode(backend, case, bs)
    assert [w.ctor_kwargs["use_cuda_graph"] for w in factory.wrappers] == [True, True]
    w4 = factory.wrappers[0]
    assert w4.ctor_kwargs["paged_kv_indptr_buffer"].data_ptr() == state.kv_indptr.data_ptr()
    assert w4.ctor_kwargs["paged_kv_last_page_len_buffer"].numel() == 4

    padded = pad_for_graph(case, 4)
    r2t = padded.fb.req_to_token_pool.req_to_token
    backend.init_forward_metadata_replay_cuda_graph(
        4, r2t, padded.fb.req_pool_indices, padded.fb.seq_lens_cpu, ForwardMode.DECODE
    )
    assert w4.count("plan") == 2 and backend.forward_metadata.wrappers == {PLAIN: w4}
    assert state.kv_last_page_len[:4].tolist() == [(s - 1) % page_size + 1 for s in padded.fb.seq_lens_cpu]
    out = backend.forward(padded.q, padded.k, padded.v, padded.layer, padded.fb)
    torch.testing.assert_close(out[:3], run_backend(twin), rtol=1e-5, atol=2e-6)
    assert not out[3:].any()  # the padded row read the zero padding page


def test_cuda_graph_hooks_refuse_what_they_cannot_do():
    case = make_case(ForwardMode.DECODE, [40, 2], [1, 1], 1, seed=4)
    backend = make_backend(case, RecordingFactory())
    r2t, rows = case.fb.req_to_token_pool.req_to_token, case.fb.req_pool_indices
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        capture_decode(backend, case, 2)
    backend.init_cuda_graph_state(max_bs=2, max_context_len=16)
    with pytest.raises(NotImplementedError, match="DECODE"):
        backend.init_forward_metadata_capture_cuda_graph(2, r2t, rows, [41, 3], ForwardMode.EXTEND)
    with pytest.raises(ValueError, match="outside"):
        capture_decode(backend, case, 3)
    capture_decode(backend, case, 2)
    with pytest.raises(ValueError, match="no CUDA graph"):
        backend.init_forward_metadata_replay_cuda_graph(1, r2t, rows[:1], [41], ForwardMode.DECODE)
    with pytest.raises(ValueError, match="exceed the graph buffer"):  # 44 pages > 2 * 16
        backend.init_forward_metadata_replay_cuda_graph(2, r2t, rows, [41, 3], ForwardMode.DECODE)


def test_importing_and_building_the_backend_never_imports_flashinfer():
    code = (
        "import sys, torch\n"
        "from srt.layers.attention.registry import create_attention_backend\n"
        "from tests.unit.test_flashinfer_backend import FakeRunner\n"
        "b = create_attention_backend('flashinfer', FakeRunner(16))\n"
        "assert type(b).__name__ == 'FlashInferAttnBackend', b\n"
        "assert 'flashinfer' not in sys.modules, 'flashinfer imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr

"""The call contract between srt and FlashInfer's wrappers, checked on CPU: every constructor,
``plan()`` and ``run()`` call the recording fake saw is bound with ``inspect.signature(...).bind``
against the REAL flashinfer classes (so a renamed, reordered or keyword-only parameter fails
here, not on the GPU), and the bound arguments have the dtypes and devices FlashInfer expects
(int32 indices; indptr and last_page_len on the CPU, where ``plan`` reads them)."""

from __future__ import annotations

import inspect

import pytest
import torch

from srt.layers.forward_batch import ForwardMode
from tests.unit.test_flashinfer_backend import (  # noqa: F401 (real_flashinfer is a fixture)
    BATCHES,
    RecordingFactory,
    RecordingWrapper,
    capture_decode,
    make_backend,
    pad_for_graph,
    real_flashinfer,
    run_flashinfer,
)
from tests.unit.test_torch_native_attention import make_case


def _classes(flashinfer) -> dict[str, type]:
    return {
        "decode": flashinfer.BatchDecodeWithPagedKVCacheWrapper,
        "prefill": flashinfer.BatchPrefillWithPagedKVCacheWrapper,
    }


def _bind(cls: type, name: str, *args, **kwargs) -> inspect.BoundArguments:
    """Bind ``(self, *args, **kwargs)`` to the real ``cls.<name>``. Where that method takes
    ``*args/**kwargs`` (decode's ``plan`` keeps a deprecated positional path and forwards to
    ``_plan_impl``), nothing may land in its ``*args`` and the call must bind to the method it
    forwards to."""
    sig = inspect.signature(getattr(cls, name))
    bound = sig.bind(None, *args, **kwargs)
    for pname, param in sig.parameters.items():
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            assert not bound.arguments.get(pname), f"positional arguments past {pname!r}: deprecated path"
        if param.kind is inspect.Parameter.VAR_KEYWORD and hasattr(cls, f"_{name}_impl"):
            return inspect.signature(getattr(cls, f"_{name}_impl")).bind(None, *args, **kwargs)
    return bound


def _check_plan(cls: type, wrapper: RecordingWrapper, page_size: int) -> None:
    for call in (c for c in wrapper.calls if c.method == "plan"):
        a = _bind(cls, "plan", *call.args, **call.kwargs).arguments
        if wrapper.kind == "decode":
            indptr, indices, last = a["indptr"], a["indices"], a["last_page_len"]
            assert a["head_dim"] == wrapper.planned["head_dim"]
        else:
            indptr, indices, last = a["paged_kv_indptr"], a["paged_kv_indices"], a["paged_kv_last_page_len"]
            assert a["causal"] is True and a["head_dim_qk"] == wrapper.planned["head_dim"]
            assert a["qo_indptr"].dtype == torch.int32 and a["qo_indptr"].device.type == "cpu"
            assert int(a["qo_indptr"][-1]) == sum(
                c.args[0].shape[0] for c in wrapper.calls if c.method == "run"
            )
        for t in (indptr, indices, last):
            assert t.dtype == torch.int32 and t.is_contiguous()
        assert indptr.device.type == "cpu" and last.device.type == "cpu"
        assert indptr.numel() == last.numel() + 1 and int(indptr[-1]) == indices.numel()
        assert a["page_size"] == page_size
        assert a["q_data_type"] == torch.float32 and a["kv_data_type"] == torch.float32
        assert a["o_data_type"] == torch.float32 and a["sm_scale"] == wrapper.planned["sm_scale"]


def _check_run(cls: type, wrapper: RecordingWrapper, pool_k: torch.Tensor) -> None:
    for call in (c for c in wrapper.calls if c.method == "run"):
        a = _bind(cls, "run", *call.args, **call.kwargs).arguments
        k_pages, v_pages = a["paged_kv_cache"]
        p = wrapper.planned
        assert a["q"].shape[1:] == (p["num_qo_heads"], p["head_dim"])
        # NHD [pages, P, H_kv, D]: a zero-copy view of the pool's buffer
        assert k_pages.shape[1:] == (p["page_size"], p["num_kv_heads"], p["head_dim"])
        assert k_pages.data_ptr() == pool_k.data_ptr() and v_pages.shape == k_pages.shape


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_eager_calls_bind_to_the_real_wrappers(real_flashinfer, batch, page_size):  # noqa: F811
    mode, prefixes, extends = BATCHES[batch]
    case, factory = make_case(mode, prefixes, extends, page_size, 8, 2, 64, seed=1), RecordingFactory()
    run_flashinfer(case, factory)
    (wrapper,) = factory.wrappers
    cls = _classes(real_flashinfer)[wrapper.kind]
    ctor = _bind(cls, "__init__", wrapper.workspace, **wrapper.ctor_kwargs).arguments
    assert ctor["kv_layout"] == "NHD" and ctor["float_workspace_buffer"].dtype == torch.uint8
    if wrapper.kind == "decode":
        assert ctor["use_tensor_cores"] is True  # GQA 4
    _check_plan(cls, wrapper, page_size)
    _check_run(cls, wrapper, case.fb.token_to_kv_pool.k_buffer[case.layer.layer_id])


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_calls_bind_to_the_real_decode_wrapper(real_flashinfer, page_size):  # noqa: F811
    case = make_case(ForwardMode.DECODE, [30, 3, 17], [1, 1, 1], page_size, 8, 2, 64, seed=9)
    factory = RecordingFactory()
    backend = make_backend(case, factory)
    backend.init_cuda_graph_state(max_bs=4, max_context_len=64)
    capture_decode(backend, case, 4)
    padded = pad_for_graph(case, 4)
    fb = padded.fb
    backend.init_forward_metadata_replay_cuda_graph(
        4, fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens_cpu, ForwardMode.DECODE
    )
    backend.forward(padded.q, padded.k, padded.v, padded.layer, fb)
    (wrapper,) = factory.wrappers
    cls = real_flashinfer.BatchDecodeWithPagedKVCacheWrapper
    ctor = _bind(cls, "__init__", wrapper.workspace, **wrapper.ctor_kwargs).arguments
    assert ctor["use_cuda_graph"] is True
    state = backend.graph_state
    # the fixed buffers live on the device the kernels run on, int32, sized for the batch
    assert ctor["paged_kv_indptr_buffer"].numel() == 5 and ctor["paged_kv_last_page_len_buffer"].numel() == 4
    assert ctor["paged_kv_indices_buffer"].data_ptr() == state.kv_indices.data_ptr()
    for name in ("paged_kv_indptr_buffer", "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer"):
        assert ctor[name].dtype == torch.int32 and ctor[name].device == backend.device
    assert wrapper.count("plan") == 2  # capture, then replay: both outside any graph
    _check_plan(cls, wrapper, page_size)
    _check_run(cls, wrapper, fb.token_to_kv_pool.k_buffer[padded.layer.layer_id])


def test_the_real_wrappers_cannot_be_built_on_cpu(real_flashinfer):  # noqa: F811
    """Why the CPU tests use a fake: the constructor pins host memory (needs an accelerator)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: tests/gpu covers the real wrappers")
    with pytest.raises(RuntimeError):
        real_flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 20, dtype=torch.uint8))

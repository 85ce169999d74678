"""FlashInferAttnBackend with sliding windows and logit soft-capping, on CPU.

The recording fake of test_flashinfer_backend stands in for FlashInfer's wrappers and runs
``paged_reference`` with exactly the ``window_left`` / ``logits_soft_cap`` each wrapper was planned
with; the outputs must equal the per-query loop of test_attention_window_cap. Layers of different
(window, cap) groups (Gemma 2/3 alternate windowed and global layers) get one wrapper each,
planned once per batch, eagerly and under CUDA graphs; the plan calls bind to the real
flashinfer signatures.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from srt.layers.attention.flashinfer_backend import PLAIN, AttentionGeometry, FlashInferAttnBackend, group_of
from srt.layers.forward_batch import ForwardMode
from tests.unit.test_attention_window_cap import BATCHES, WINDOWS_CAPS, WindowCapLayer, make, naive
from tests.unit.test_flashinfer_backend import (  # noqa: F401 (real_flashinfer is a fixture)
    FakeRunner,
    RecordingFactory,
    capture_decode,
    pad_for_graph,
    real_flashinfer,
    run_flashinfer,
)
from tests.unit.test_flashinfer_contract import _bind, _check_plan, _classes
from tests.unit.test_torch_native_attention import make_case

GEMMA_LIKE = [(3, 2.0), (-1, 2.0)]  # alternating windowed and global layers, all soft-capped


def with_group(layer: WindowCapLayer, group: tuple[int, float]) -> WindowCapLayer:
    return dataclasses.replace(layer, sliding_window_size=group[0], logit_cap=group[1])


def backend_for(case, factory: RecordingFactory, known_geometry: bool = False) -> FlashInferAttnBackend:
    geometry = AttentionGeometry.of(case.layer) if known_geometry else None
    backend = FlashInferAttnBackend(
        FakeRunner(case.fb.token_to_kv_pool.page_size), wrapper_factory=factory, geometry=geometry
    )
    case.fb.attn_backend = backend
    return backend


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window,cap", WINDOWS_CAPS)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_planned_window_and_cap_give_the_per_query_loop(batch, window, cap, page_size):
    case, factory = make(batch, window, cap, page_size, 8, 2, 64), RecordingFactory()
    out = run_flashinfer(case, factory)
    torch.testing.assert_close(out, naive(case), rtol=1e-4, atol=2e-5)
    wrappers = [w for w in factory.wrappers if w.count("run")]
    assert len(wrappers) == 1 and wrappers[0].planned["window_left"] == window
    assert wrappers[0].planned["logits_soft_cap"] == cap


@pytest.mark.parametrize("batch", list(BATCHES))
def test_one_plan_per_group_per_batch(batch):
    """Four layers alternating two groups, two forwards: the first learns the groups (and plans
    each at its first layer), the second plans both up front; each layer runs its group's wrapper."""
    case, factory = make(batch, -1, 0.0, 16, 8, 2, 64), RecordingFactory()
    layers = [with_group(case.layer, GEMMA_LIKE[i % 2]) for i in range(4)]
    backend = backend_for(case, factory)
    for step in range(2):
        backend.init_forward_metadata(case.fb)
        if step:
            assert [w.calls[-1].method for w in factory.wrappers] == ["plan", "plan"]  # before any layer
        for layer in layers:
            out = backend.forward(case.q, case.k, case.v, layer, case.fb)
            case.layer = layer
            torch.testing.assert_close(out, naive(case), rtol=1e-4, atol=2e-5)
    assert list(backend.groups) == GEMMA_LIKE
    assert len(factory.wrappers) == 2  # one per group, reused across batches
    for wrapper, group in zip(factory.wrappers, GEMMA_LIKE):
        assert (wrapper.count("plan"), wrapper.count("run")) == (2, 4)
        assert (wrapper.planned["window_left"], wrapper.planned["logits_soft_cap"]) == group


def test_groups_given_up_front_and_the_plain_default():
    case, factory = make("decode", -1, 0.0, 16, 8, 2, 64), RecordingFactory()
    runner, geometry = FakeRunner(16), AttentionGeometry.of(case.layer)
    assert list(FlashInferAttnBackend(runner, geometry=geometry).groups) == [PLAIN]
    assert list(FlashInferAttnBackend(runner).groups) == []  # learnt from the layers
    backend = FlashInferAttnBackend(runner, wrapper_factory=factory, geometry=geometry, groups=GEMMA_LIKE)
    backend.init_forward_metadata(case.fb)
    assert set(backend.forward_metadata.wrappers) == set(GEMMA_LIKE) and len(factory.wrappers) == 2
    assert group_of(case.layer) == PLAIN and group_of(with_group(case.layer, (4, 1.0))) == (4, 1.0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_plans_every_group(page_size):
    case = make_case(ForwardMode.DECODE, [30, 3, 17], [1, 1, 1], page_size, 8, 2, 64, seed=9)
    case.layer = WindowCapLayer(**dataclasses.asdict(case.layer))
    factory = RecordingFactory()
    backend = backend_for(case, factory)
    backend.init_forward_metadata(case.fb)  # the eager warm-up forward teaches the groups
    layers = [with_group(case.layer, g) for g in GEMMA_LIKE]
    for layer in layers:
        backend.forward(case.q, case.k, case.v, layer, case.fb)
    backend.init_cuda_graph_state(max_bs=4, max_context_len=64)
    capture_decode(backend, case, 4)
    graph_wrappers = factory.wrappers[2:]
    assert [w.ctor_kwargs.get("use_cuda_graph") for w in graph_wrappers] == [True, True]
    assert backend.graph_state.wrappers[4] == dict(zip(GEMMA_LIKE, graph_wrappers))
    padded = pad_for_graph(case, 4)
    fb = padded.fb
    backend.init_forward_metadata_replay_cuda_graph(
        4, fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens_cpu, ForwardMode.DECODE
    )
    assert [w.count("plan") for w in graph_wrappers] == [2, 2]  # capture and replay, both groups
    for layer in layers:
        out = backend.forward(padded.q, padded.k, padded.v, layer, fb)
        case.layer = layer
        torch.testing.assert_close(out[:3], naive(case), rtol=1e-4, atol=2e-5)
    with pytest.raises(RuntimeError, match="was not known when the CUDA graph"):
        backend.forward(padded.q, padded.k, padded.v, with_group(case.layer, (9, 0.0)), fb)


@pytest.mark.parametrize("batch", ["decode", "extend_prefix"])
def test_window_and_cap_bind_to_the_real_plan(real_flashinfer, batch):  # noqa: F811
    case, factory = make(batch, -1, 0.0, 16, 8, 2, 64), RecordingFactory()
    backend = backend_for(case, factory)
    backend.init_forward_metadata(case.fb)
    for group in GEMMA_LIKE + [PLAIN]:
        backend.forward(case.q, case.k, case.v, with_group(case.layer, group), case.fb)
    for wrapper, group in zip(factory.wrappers, GEMMA_LIKE + [PLAIN], strict=True):
        cls = _classes(real_flashinfer)[wrapper.kind]
        _check_plan(cls, wrapper, 16)
        (plan,) = [c for c in wrapper.calls if c.method == "plan"]
        a = _bind(cls, "plan", *plan.args, **plan.kwargs).arguments
        assert (a["window_left"], a["logits_soft_cap"]) == group

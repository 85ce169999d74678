"""CudaGraphRunner on CPU, with the fake graph and the graph-capable torch-native backend of
tests/helpers/cuda_graphs.py (the fake replays the recorded ops on the recorded tensors, as
a CUDA graph replays kernels on addresses), and with the FlashInfer backend driven through a
recording wrapper whose graph decode reads only its fixed buffers.

The model is the tiny random-weight Llama of tests/helpers/tiny_models.py, run in float32 with
``F.linear`` (every op visible to the recorder).
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.nn.functional as F

from srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
from srt.layers.attention.torch_native import TorchNativeAttnBackend
from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.mem_cache import pool_size
from srt.model_executor import model_runner as model_runner_module
from srt.model_executor.cuda_graph_runner import (
    PER_GRAPH_BYTES,
    CudaGraphRunner,
    capture_batch_sizes,
    cuda_graph_off_reason,
    estimate_graph_pool_bytes,
    padded_batch_size,
)
from srt.model_executor.model_runner import ModelRunner
from tests.helpers.cuda_graphs import (
    FAKE,
    GraphTorchNative,
    RecordingGraph,
    decode_batch,
    eager_logits,
    make_runner,
    recording_graph,
)
from tests.helpers.tiny_models import save_tiny_model
from tests.unit.test_flashinfer_backend import Call, RecordingFactory, RecordingWrapper


def test_fake_graph_replays_the_captured_tensors_not_new_ones():
    x, w = torch.arange(4.0), torch.full((4,), 2.0)
    out = torch.zeros(4)
    graph = RecordingGraph()
    with recording_graph(graph):
        out.copy_(x * w + 1)
    x.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0]))  # copied into the captured tensor: seen
    graph.replay()
    assert out.tolist() == [11.0, 13.0, 15.0, 17.0]
    x = torch.zeros(4)  # a new tensor bound to the name: the graph still reads the old one
    graph.replay()
    assert out.tolist() == [11.0, 13.0, 15.0, 17.0]
    with pytest.raises(RuntimeError, match="synchronises"), recording_graph(RecordingGraph()):
        w.sum().item()


# ---------------------------------------------------------------------- runners and batches
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-graphs"), seed=0)


@pytest.fixture(scope="module")
def graphed(tiny_path):
    """A runner whose graph runner captured 1, 2, 4, 8, 16, 20 (max_bs 20)."""
    runner = make_runner(tiny_path)
    graphs = CudaGraphRunner(runner, 20, **FAKE)
    graphs.capture(runner.max_running_requests)
    return runner, graphs


def new_kv(runner: ModelRunner, fb: ForwardBatch) -> list[torch.Tensor]:
    return [buf[fb.out_cache_loc].clone() for buf in runner.token_to_kv_pool.k_buffer]


def poison_new_kv(runner: ModelRunner, fb: ForwardBatch) -> None:
    for buf in runner.token_to_kv_pool.k_buffer + runner.token_to_kv_pool.v_buffer:
        buf[fb.out_cache_loc] = float("nan")


# ---------------------------------------------------------------------- pure parts
def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(6) == [1, 2, 4, 6]
    assert capture_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and len(sizes) == 35
    assert all(b % 8 == 0 for b in sizes[4:])
    with pytest.raises(ValueError, match=">= 1"):
        capture_batch_sizes(0)


def test_padded_batch_size_is_the_next_captured_size():
    sizes = capture_batch_sizes(40)  # 1 2 4 8 16 24 32 40
    expected = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 17: 24, 24: 24, 25: 32, 39: 40, 40: 40}
    assert {raw: padded_batch_size(sizes, raw) for raw in expected} == expected
    for raw in range(1, 41):
        bs = padded_batch_size(sizes, raw)
        assert bs >= raw and not any(raw <= b < bs for b in sizes)
    assert padded_batch_size(sizes, 41) is None


def test_graph_pool_estimate():
    # 1 MiB per 1024 profiled tokens -> 1 KiB per token; logits in bfloat16 (2) and float32 (4)
    assert estimate_graph_pool_bytes(8, 1 << 20, 1024, 100, 2) == 8 * 1024 + 8 * 100 * 6
    assert estimate_graph_pool_bytes(8, 0, 1024, 100, 4) == 8 * 100 * 8


class _Backend:
    def __init__(self, supports: bool) -> None:
        self.supports_cuda_graph = supports


@pytest.mark.parametrize(
    "device, disable, supports, tp, needle",
    [
        ("cuda", False, True, False, None),
        ("cuda", True, True, False, "--disable-cuda-graph"),
        ("cpu", False, True, False, "device cpu"),
        ("cpu", True, True, False, "--disable-cuda-graph"),
        ("cuda", False, False, False, "no CUDA-graph hooks"),
        ("cuda", False, True, True, "tensor parallelism"),
    ],
)
def test_when_graphs_are_off(device, disable, supports, tp, needle):
    why = cuda_graph_off_reason(torch.device(device), disable, _Backend(supports), tp)
    assert why is None if needle is None else needle in why


def test_cpu_runner_never_builds_graphs(tiny_path, monkeypatch):
    # even with a backend that has the hooks, and with graphs not disabled
    monkeypatch.setattr(
        model_runner_module, "create_attention_backend", lambda name, ctx: GraphTorchNative(ctx)
    )
    runner = make_runner(tiny_path)
    assert runner.attn_backend.supports_cuda_graph and not runner.server_args.disable_cuda_graph
    assert runner.cuda_graph_runner is None and runner.cuda_graph_reserve_bytes == 0
    assert runner.server_args.cuda_graph_max_bs == 48  # auto: --max-running-requests, smaller than 256
    runner = make_runner(tiny_path, disable_cuda_graph=True, max_total_tokens=None, mem_fraction_static=0.01)
    assert runner.cuda_graph_runner is None and runner.cuda_graph_reserve_bytes == 0


def test_runner_refuses_a_backend_without_hooks(tiny_path):
    runner = make_runner(tiny_path)
    runner.attn_backend = TorchNativeAttnBackend(runner)
    with pytest.raises(ValueError, match="does not support CUDA graphs"):
        CudaGraphRunner(runner, 4, **FAKE)


# ---------------------------------------------------------------------- capture and replay
def test_capture_builds_one_graph_per_size(graphed, tiny_path):
    runner, graphs = graphed
    backend = runner.attn_backend
    assert graphs.capture_bs == [1, 2, 4, 8, 16, 20] and sorted(graphs.graphs) == graphs.capture_bs
    assert ("state", 20, [runner.model_config.context_len]) in backend.hook_calls
    captures = [(bs, lens) for hook, bs, lens in backend.hook_calls if hook == "capture"]
    assert captures == [(bs, [1] * bs) for bs in (20, 16, 8, 4, 2, 1)]  # largest first, dummy lengths
    assert all(g.ops for g in graphs.graphs.values())
    first = graphs.graphs[20]  # the others share its pool
    assert first.captured_in_pool is None
    assert all(graphs.graphs[bs].captured_in_pool == first.pool() for bs in (16, 8, 4, 2, 1))
    limited = CudaGraphRunner(make_runner(tiny_path), 20, **FAKE)
    limited.capture(limit=5)
    assert limited.capture_bs == [1, 2, 4]


@pytest.mark.parametrize("seed", range(6))
def test_replay_equals_eager_on_random_decode_batches(graphed, seed):
    runner, graphs = graphed
    rng = random.Random(seed)
    raw_bs = rng.choice([1, 2, 3, 5, 7, 8, 11, 16, 19, 20])
    fb = decode_batch(runner, [rng.randrange(0, 300) for _ in range(raw_bs)], seed)
    expected, expected_kv = eager_logits(runner, fb), new_kv(runner, fb)
    poison_new_kv(runner, fb)  # the replay must write this step's K/V itself
    kv_before = [buf.clone() for buf in runner.token_to_kv_pool.k_buffer]
    out = graphs.replay(fb).next_token_logits
    assert out.shape == (raw_bs, runner.model_config.vocab_size)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(new_kv(runner, fb), expected_kv)
    # besides the batch's own slots only the padding page was written (by padded rows)
    page, locs = runner.page_size, set(fb.out_cache_loc.tolist())
    for before, after in zip(kv_before, runner.token_to_kv_pool.k_buffer):
        changed = ((before != after) & ~(before.isnan() & after.isnan())).flatten(1).any(1)
        assert set(changed.nonzero().flatten().tolist()) <= locs | set(range(page))


def test_padding_rows_and_hook_arguments(graphed):
    runner, graphs = graphed
    fb = decode_batch(runner, [40, 3, 17, 90, 1], seed=11)  # 5 -> bucket 8
    graphs.replay(fb)
    assert graphs.seq_lens[:8].tolist() == [41, 4, 18, 91, 2, 1, 1, 1]
    assert graphs.out_cache_loc[5:8].tolist() == [0, 0, 0] and graphs.req_pool_indices[5:8].tolist() == [
        0,
        0,
        0,
    ]
    assert graphs.input_ids[5:8].tolist() == [0, 0, 0] and graphs.positions[:5].tolist() == [40, 3, 17, 90, 1]
    assert runner.attn_backend.hook_calls[-1] == ("replay", 8, [41, 4, 18, 91, 2, 1, 1, 1])


def test_replay_reads_each_new_batch(graphed):
    """Three batches through the same graph (bucket 8): each matches its own eager logits, so the
    graph read the inputs copied in, not those of capture or of the batch before; a smaller
    batch after a larger one gets its padding back."""
    runner, graphs = graphed
    graph = graphs.graphs[8]
    outs = []
    for seed, lens in (
        (1, [5, 60, 7, 200, 33, 9, 120]),
        (2, [14, 2, 77, 31, 150]),
        (3, [300, 0, 45, 8, 62, 19]),
    ):
        fb = decode_batch(runner, lens, seed)
        expected = eager_logits(runner, fb)
        replays = graph.replays
        out = graphs.replay(fb).next_token_logits.clone()
        assert graph.replays == replays + 1
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        outs.append(out)
    assert not torch.allclose(outs[0][:5], outs[1])


def test_model_runner_forward_replays_or_falls_back(graphed):
    runner, graphs = graphed
    runner.cuda_graph_runner = graphs
    try:
        fb = decode_batch(runner, [10, 20, 30], seed=5)
        expected = eager_logits(runner, fb)
        replays = graphs.graphs[4].replays
        out = runner.forward(fb).next_token_logits
        assert graphs.graphs[4].replays == replays + 1
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)

        big = decode_batch(runner, list(range(1, 22)), seed=6)  # 21 > 20: eager
        before = {bs: g.replays for bs, g in graphs.graphs.items()}
        assert not graphs.can_run(big)
        torch.testing.assert_close(runner.forward(big).next_token_logits, eager_logits(runner, big))
        assert {bs: g.replays for bs, g in graphs.graphs.items()} == before

        ext = ForwardBatch.build(
            ForwardMode.EXTEND, [3, 4], [fb.req_pool_indices[0].item()], [0], [2], [16, 17]
        )
        assert not graphs.can_run(ext)
        with pytest.raises(ValueError, match="no captured graph"):
            graphs.replay(big)
    finally:
        runner.cuda_graph_runner = None


def test_weight_update_recaptures(tiny_path, tmp_path):
    runner = make_runner(tiny_path, max_running_requests=8)
    runner.cuda_graph_runner = CudaGraphRunner(runner, 4, **FAKE)
    runner.cuda_graph_runner.capture(runner.max_running_requests)
    fb = decode_batch(runner, [12, 40], seed=8)
    old = runner.forward(fb).next_token_logits.clone()
    ok, message = runner.update_weights_from_disk(save_tiny_model("llama", tmp_path / "other", seed=1))
    assert ok, message
    new = runner.forward(fb).next_token_logits.clone()  # replays a graph of the new weights
    torch.testing.assert_close(new, eager_logits(runner, fb), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(new, old)


def test_reserve_counts_fixed_buffers_pool_and_graphs(graphed):
    runner, graphs = graphed
    vocab = runner.model_config.vocab_size
    assert graphs.fixed_bytes >= 20 * vocab * 4 + 5 * 20 * 8  # logits buffer + static inputs
    reserve = graphs.reserve_bytes(activation_peak_bytes=1 << 20, profiled_tokens=1024)
    pool = estimate_graph_pool_bytes(20, 1 << 20, 1024, vocab, 4)
    assert reserve == graphs.fixed_bytes + pool + 6 * PER_GRAPH_BYTES == graphs.reserved_bytes


# ---------------------------------------------------------------------- the flashinfer backend's hooks
class FixedShapeDecodeWrapper(RecordingWrapper):
    """A recording FlashInfer wrapper whose ``use_cuda_graph`` decode ``run`` reads only its fixed
    buffers, with shapes fixed by ``max_pages`` (pages per sequence), as a captured kernel does:
    sequence i attends to slots ``indices[indptr[i] + t // P] * P + t % P`` for ``t < kv_len_i``."""

    max_pages: int = 0

    def run(self, q, paged_kv_cache, **kwargs):
        if not self.ctor_kwargs.get("use_cuda_graph"):
            return super().run(q, paged_kv_cache, **kwargs)
        self.calls.append(Call("run", (q, paged_kv_cache), kwargs))
        p, (k_cache, v_cache) = self.planned, paged_kv_cache
        page, h, h_kv = k_cache.shape[1], q.shape[1], k_cache.shape[2]
        indptr, indices, last = (p[name].long() for name in ("indptr", "indices", "last_page_len"))
        t = torch.arange(self.max_pages * page)
        kv_len = (indptr[1:] - indptr[:-1] - 1) * page + last
        valid = t[None, :] < kv_len[:, None]
        at = (indptr[:-1, None] + t[None, :] // page).clamp(max=indices.numel() - 1)
        slots = (indices[at] * page + t % page).masked_fill(~valid, 0)
        k, v = (cache.flatten(0, 1)[slots].transpose(1, 2) for cache in (k_cache, v_cache))
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=valid[:, None, None, :], scale=p["sm_scale"], enable_gqa=h != h_kv
        )
        return out.squeeze(2).to(p["o_data_type"])


class FixedShapeFactory(RecordingFactory):
    def __init__(self, max_pages: int) -> None:
        super().__init__()
        self.max_pages = max_pages

    def __call__(self, kind, workspace, **ctor_kwargs):
        wrapper = FixedShapeDecodeWrapper(kind, workspace, ctor_kwargs)
        wrapper.max_pages = self.max_pages
        self.wrappers.append(wrapper)
        return wrapper


def test_flashinfer_backend_through_the_graph_runner(tiny_path):
    runner = make_runner(tiny_path, max_running_requests=8)
    pages = -(-runner.model_config.context_len // runner.page_size)
    factory = FixedShapeFactory(pages)
    runner.attn_backend = FlashInferAttnBackend(runner, wrapper_factory=factory)  # geometry learnt at warm-up
    graphs = CudaGraphRunner(runner, 8, **FAKE)
    graphs.capture(runner.max_running_requests)
    state = runner.attn_backend.graph_state
    assert state.max_bs == 8 and state.kv_indices.numel() == 8 * pages
    graph_wrappers = {w.ctor_kwargs["paged_kv_last_page_len_buffer"].numel(): w for w in factory.wrappers[1:]}
    assert sorted(graph_wrappers) == [1, 2, 4, 8] and factory.wrappers[0].kind == "decode"
    layers = runner.model_config.num_hidden_layers
    for w in graph_wrappers.values():  # planned once, outside the capture; warm-up run, captured run
        assert [c.method for c in w.calls] == ["plan"] + ["run"] * (2 * layers)

    for seed, lens in ((1, [37, 5, 180]), (2, [0, 64, 15, 300, 2, 99, 47])):
        fb = decode_batch(runner, lens, seed)
        expected = eager_logits(runner, fb)  # the eager FlashInfer path (paged reference)
        bs = padded_batch_size(graphs.capture_bs, len(lens))
        wrapper, calls = graph_wrappers[bs], len(graph_wrappers[bs].calls)
        out = graphs.replay(fb).next_token_logits
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        assert [c.method for c in wrapper.calls[calls:]] == ["plan"]  # replay runs no Python
        padded = [s + 1 for s in lens] + [1] * (bs - len(lens))
        assert wrapper.planned["last_page_len"].tolist() == [(s - 1) % runner.page_size + 1 for s in padded]


def test_model_runner_start_up_reserves_and_captures(tiny_path, monkeypatch):
    """The CUDA start-up path on CPU: graphs forced on (fake graph classes), the pool profiled."""
    total = 16 << 30
    monkeypatch.setattr(pool_size, "available_cpu_memory", lambda: total)
    monkeypatch.setattr(
        model_runner_module, "create_attention_backend", lambda name, ctx: GraphTorchNative(ctx)
    )
    monkeypatch.setattr(model_runner_module, "cuda_graph_off_reason", lambda *a: None)
    monkeypatch.setattr(model_runner_module, "CudaGraphRunner", functools.partial(CudaGraphRunner, **FAKE))
    runner = make_runner(
        tiny_path, False, max_total_tokens=None, mem_fraction_static=0.01, max_running_requests=12
    )
    graphs = runner.cuda_graph_runner
    assert graphs.max_bs == 12 and graphs.capture_bs == [1, 2, 4, 8, 12]
    reserve = runner.cuda_graph_reserve_bytes
    assert reserve == graphs.reserved_bytes >= graphs.fixed_bytes + 5 * PER_GRAPH_BYTES
    static = runner.weight_bytes + pool_size.req_to_token_pool_size(12) * runner.context_len * 8
    sizes = [
        pool_size.profile_max_num_tokens(
            total, 0.01, static + r, runner.activation_peak_bytes, runner.bytes_per_token, runner.page_size
        )
        for r in (reserve, 0)
    ]
    assert runner.max_total_num_tokens == sizes[0] < sizes[1]

    fb = decode_batch(runner, [9, 70, 3], seed=4)
    expected = eager_logits(runner, fb)
    torch.testing.assert_close(runner.forward(fb).next_token_logits, expected, rtol=1e-4, atol=1e-4)
    assert graphs.graphs[4].replays == 1

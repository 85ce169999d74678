"""Fakes and builders for CUDA-graph tests on CPU (tests/unit/test_cuda_graph_runner.py).

``RecordingGraph`` / ``recording_graph`` stand in for ``torch.cuda.CUDAGraph`` /
``torch.cuda.graph`` and behave as a CUDA graph does where it matters: capture records every
aten op the captured code runs together with the very tensors it read and wrote (a CUDA graph
records kernels and their addresses), and replay re-runs those ops on those tensors, writing
each result into the tensor recorded at capture. Python between the ops does not run again, so
code that took its inputs from anywhere but fixed buffers (or from a Python value computed at
capture) replays stale inputs here as it would on a GPU; a host sync inside a capture raises.
``FAKE`` is the keyword arguments that hand them (and a null stream) to ``CudaGraphRunner``.

``GraphTorchNative`` is the torch-native attention backend plus the CUDA-graph hooks: in graph
mode its decode attends over fixed ``[max_bs, max_context_len]`` slot and mask buffers that the
capture and replay hooks rewrite (padded positions -> slot 0, masked), so the captured ops have
fixed shapes; eager batches take the torch-native path unchanged.

``make_runner`` builds a CPU ModelRunner of a tiny model whose every op the recorder sees;
``decode_batch`` (``benchmarks/gpu/census.py``) a DECODE batch of fresh requests with random cached K/V.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from benchmarks.gpu.census import census_runner, decode_batch  # noqa: F401 (decode_batch: for the tests)
from srt.layers.attention.base import save_and_read_kv
from srt.layers.attention.torch_native import TorchNativeAttnBackend
from srt.layers.forward_batch import ForwardBatch
from srt.model_executor.model_runner import ModelRunner

aten = torch.ops.aten
HOST_SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default}


# ---------------------------------------------------------------------- the fake graph
class RecordingGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` (see the module docstring); counts its replays."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []  # (func, args, kwargs, outputs)
        self.replays = 0
        self.captured_in_pool: object = None  # the pool argument of its capture

    def pool(self) -> object:
        return ("pool", id(self))

    def replay(self) -> None:
        self.replays += 1
        with torch.inference_mode():
            for func, args, kwargs, outputs in self.ops:
                fresh, _ = tree_flatten(func(*args, **kwargs))
                recorded, _ = tree_flatten(outputs)
                for new, old in zip(fresh, recorded):
                    if isinstance(old, torch.Tensor) and new is not old and new.data_ptr() != old.data_ptr():
                        old.copy_(new)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: RecordingGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_SYNC_OPS:
            raise RuntimeError(f"{func} synchronises with the host inside a graph capture")
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.graph.ops.append((func, args, kwargs, out))
        return out


@contextmanager
def recording_graph(graph: RecordingGraph, pool=None, stream=None):
    """Stands in for ``torch.cuda.graph(graph, pool=, stream=)``."""
    graph.captured_in_pool = pool
    with _Recorder(graph):
        yield


FAKE = dict(graph_cls=RecordingGraph, graph_context=recording_graph, stream_cls=lambda: None)


class GraphTorchNative(TorchNativeAttnBackend):
    """Torch-native attention plus the CUDA-graph hooks (see the module docstring); records the
    hook calls as ``(hook, bs, seq_lens_cpu)``."""

    supports_cuda_graph = True

    def __init__(self, model_runner=None) -> None:
        super().__init__(model_runner)
        self.graph_bs: int | None = None  # set by the hooks, cleared by init_forward_metadata
        self.slots: torch.Tensor | None = None  # int64 [max_bs, max_context_len]
        self.valid: torch.Tensor | None = None  # bool [max_bs, max_context_len]
        self.hook_calls: list[tuple[str, int, list[int]]] = []

    def init_cuda_graph_state(self, max_bs, max_context_len):
        self.hook_calls.append(("state", max_bs, [max_context_len]))
        self.slots = torch.zeros(max_bs, max_context_len, dtype=torch.int64)
        self.valid = torch.zeros(max_bs, max_context_len, dtype=torch.bool)

    def init_forward_metadata(self, forward_batch):
        self.graph_bs = None
        super().init_forward_metadata(forward_batch)

    def init_forward_metadata_capture_cuda_graph(
        self, bs, req_to_token, req_pool_indices, seq_lens_cpu, mode
    ):
        self._fill("capture", bs, req_to_token, req_pool_indices, seq_lens_cpu)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_to_token, req_pool_indices, seq_lens_cpu, mode):
        self._fill("replay", bs, req_to_token, req_pool_indices, seq_lens_cpu)

    def _fill(self, hook, bs, req_to_token, req_pool_indices, seq_lens_cpu) -> None:
        self.hook_calls.append((hook, bs, list(seq_lens_cpu)))
        width = self.slots.shape[1]
        valid = torch.arange(width)[None, :] < torch.tensor(seq_lens_cpu)[:, None]
        self.valid[:bs].copy_(valid)
        self.slots[:bs].copy_(req_to_token[req_pool_indices, :width].masked_fill(~valid, 0))
        self.graph_bs = bs

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if self.graph_bs is None:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        k_buf, v_buf = save_and_read_kv(k, v, layer, forward_batch, save_kv_cache)
        bs, width = self.graph_bs, self.slots.shape[1]
        h, h_kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        slots = self.slots[:bs].reshape(-1)
        kd = k_buf[slots].view(bs, width, h_kv, d).transpose(1, 2)
        vd = v_buf[slots].view(bs, width, h_kv, d).transpose(1, 2)
        mask = self.valid[:bs][:, None, None, :]
        o = F.scaled_dot_product_attention(
            q.view(bs, h, 1, d), kd, vd, attn_mask=mask, scale=layer.scaling, enable_gqa=h != h_kv
        )
        return o.reshape(bs, h * d)


def make_runner(path: str, graph_backend: bool = True, **kw) -> ModelRunner:
    """A CPU runner of the tiny model (F.linear, torch-native attention, no native decode layers);
    its attention backend is then replaced by a ``GraphTorchNative`` unless ``graph_backend`` is False."""
    kw = {"max_total_tokens": 8192, "max_running_requests": 48} | kw
    runner = census_runner(path, kw.pop("dtype", "float32"), **kw)
    if graph_backend:
        runner.attn_backend = GraphTorchNative(runner)
    return runner


def eager_logits(runner: ModelRunner, fb: ForwardBatch) -> torch.Tensor:
    return runner._run_model(fb).next_token_logits.clone()

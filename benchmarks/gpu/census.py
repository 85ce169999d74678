"""Launch census: the kernels one decode step of srt's CUDA code path launches, counted on CPU.

The model runs on the CPU with the choices it makes on CUDA: ``F.linear`` (one cuBLAS GEMM per
projection), the FlashInfer attention backend and the fused kernels (``srt/layers/fused_kernels``),
with FlashInfer stood in by torch references that record one kernel per call. A
``TorchDispatchMode`` sees every aten op below autograd and counts those that touch tensor data;
views, reshapes, splits and allocations launch nothing and are skipped. Each op is attributed to
the decoder layer running it (hooks on the model's ``layers``) or to ``step`` (embedding, plan,
final norm, LM head, sampling inputs). A host sync (``.item()``, ``.tolist()`` of a device
tensor) is recorded apart.

    python -m benchmarks.gpu.census --model PATH [--batch-size 1] [--json]

prints the kernels per layer and the ops of one layer; ``make gpu-check`` sets the CUDA
profiler's count beside it. tests/unit/test_launch_census.py holds the budgets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
from srt.layers.attention.paged_reference import paged_attention_reference, paged_decode_reference
from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.layers.fused_kernels import FusedKernels, bind_fused_kernels
from srt.layers.fused_reference import reference_ops

aten = torch.ops.aten
# ops that allocate or only read metadata: no kernel
NO_LAUNCH = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default})
# reads of a value back to the host: no kernel (the sync is recorded by the method called)
HOST_READS = frozenset({aten._local_scalar_dense.default, aten.item.default, aten.equal.default})
# Tensor methods and functions that read a value back to the host (on CUDA: wait for the stream)
SYNC_METHODS = frozenset(
    {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "equal"}
)
STEP = "step"


def launches(func: Any) -> bool:
    """Whether aten op ``func`` launches a kernel: it writes a tensor or returns new data (an op
    whose outputs all alias its inputs without writing them is a view)."""
    if func in NO_LAUNCH:
        return False
    schema = func._schema
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    if not writes and not any("Tensor" in str(r.type) for r in schema.returns):
        return False  # a host-side query (an op's build flags): no tensor in or out
    views = bool(schema.returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )
    return writes or not views


class LaunchCensus(TorchDispatchMode):
    """Records ``(where, kernel name)`` for every launching op; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.where = STEP
        self.kernels: list[tuple[str, str]] = []
        self.syncs: list[tuple[str, str]] = []
        self._paused = 0
        self._watch = _SyncWatch(self)

    def __enter__(self):
        self._watch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._watch.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused:
            if func not in HOST_READS and launches(func):
                self.kernels.append((self.where, str(func.overloadpacket.__name__)))
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops inside are a stand-in's arithmetic: not counted."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def kernel(self, name: str) -> None:
        """Record one kernel of a stand-in (a FlashInfer op)."""
        if not self._paused:
            self.kernels.append((self.where, name))

    def recorded(self, name: str, fn: Callable) -> Callable:
        """``fn`` counted as the one kernel ``name``, its own ops not counted."""

        def call(*args: Any, **kwargs: Any) -> Any:
            self.kernel(name)
            with self.paused():
                return fn(*args, **kwargs)

        return call

    # ------------------------------------------------------------------ results
    def per_layer(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for where, name in self.kernels:
            out.setdefault(where, []).append(name)
        return out

    def layer_counts(self) -> dict[str, int]:
        return {where: len(names) for where, names in self.per_layer().items()}


class _SyncWatch(TorchFunctionMode):
    """Records the Tensor methods that read values back to the host (``SYNC_METHODS``)."""

    def __init__(self, census: LaunchCensus) -> None:
        super().__init__()
        self.census = census

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS and not self.census._paused:
            self.census.syncs.append((self.census.where, name))
        return func(*args, **(kwargs or {}))


@dataclass
class CensusWrapper:
    """A FlashInfer paged wrapper: ``plan`` keeps the arrays, ``run`` is one kernel computed by
    srt's paged reference."""

    census: LaunchCensus
    kind: str
    planned: dict[str, Any] = field(default_factory=dict)

    def plan(self, *args: Any, **kwargs: Any) -> None:
        names = ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim")
        if self.kind == "prefill":
            names = ("qo_indptr", *names)
        self.planned = dict(zip(names, args)) | kwargs

    def run(self, q: torch.Tensor, paged_kv_cache: Any, **kwargs: Any) -> torch.Tensor:
        self.census.kernel(f"flashinfer.{self.kind}.run")
        p = self.planned
        kw = {
            "sm_scale": p["sm_scale"],
            "window_left": p["window_left"],
            "logits_soft_cap": p["logits_soft_cap"] or 0.0,
        }
        with self.census.paused():
            k, v = paged_kv_cache
            if self.kind == "decode":
                out, _ = paged_decode_reference(q, k, v, p["indptr"], p["indices"], p["last_page_len"], **kw)
            else:
                arrays = (p["qo_indptr"], p["indptr"], p["indices"], p["last_page_len"])
                out, _ = paged_attention_reference(q, k, v, *arrays, causal=True, **kw)
            return out.to(q.dtype)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: its first ``ModuleList`` named ``layers``."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(module, nn.ModuleList):
            return module
    raise ValueError(f"{type(model).__name__} has no ModuleList named 'layers'")


def use_cuda_path(runner: Any, census: LaunchCensus) -> None:
    """Give ``runner`` (a CPU ModelRunner) the CUDA path's attention backend and fused kernels,
    their FlashInfer calls recorded by ``census``."""
    runner.attn_backend = FlashInferAttnBackend(
        runner, wrapper_factory=lambda kind, workspace, **kw: CensusWrapper(census, kind)
    )
    ops = {name: census.recorded(f"flashinfer.{name}", fn) for name, fn in reference_ops().items()}
    bind_fused_kernels(runner.model, FusedKernels(ops))


def decode_batch(runner: Any, prefix_lens: list[int], seed: int = 0) -> ForwardBatch:
    """A DECODE batch of fresh sequences with ``prefix_lens`` random cached tokens (the pools are
    emptied first) and random next tokens."""
    gen = torch.Generator().manual_seed(seed)
    pool, alloc, kv = runner.req_to_token_pool, runner.token_to_kv_pool_allocator, runner.token_to_kv_pool
    pool.clear()
    alloc.clear()
    rows = pool.alloc(len(prefix_lens))
    locs = []
    for row, p in zip(rows, prefix_lens):
        slots = alloc.alloc_extend([0], [p + 1], [-1])
        pool.write(row, 0, slots)
        for buf in kv.k_buffer + kv.v_buffer:
            buf[slots[:p]] = torch.randn(p, *buf.shape[1:], generator=gen).to(buf.dtype)
        locs.append(int(slots[p]))
    ids = torch.randint(0, runner.model_config.vocab_size, (len(rows),), generator=gen).tolist()
    fb = ForwardBatch.build(ForwardMode.DECODE, ids, rows, prefix_lens, [1] * len(rows), locs)
    fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = pool, kv, runner.attn_backend
    return fb


def census_decode_step(runner: Any, batch_size: int = 1, prefix_len: int = 16) -> LaunchCensus:
    """One decode step of ``runner``'s model through the CUDA path (``use_cuda_path``), counted."""
    census = LaunchCensus()
    use_cuda_path(runner, census)
    fb = decode_batch(runner, [prefix_len] * batch_size)
    hooks = []
    for i, layer in enumerate(decoder_layers(runner.model)):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(census, "where", f"layer{i}")))
        hooks.append(layer.register_forward_hook(lambda m, a, o: setattr(census, "where", STEP)))
    try:
        with torch.inference_mode(), census:
            runner._run_model(fb)
    finally:
        for h in hooks:
            h.remove()
    return census


def census_runner(model_path: str, dtype: str = "bfloat16", **server_kw: Any) -> Any:
    """A CPU ModelRunner of ``model_path`` making the CUDA path's other choices: ``F.linear``,
    no native decode layers, torch-native attention until a backend is put in (``load_format``,
    pool sizes etc. in ``server_kw``)."""
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs

    args = dict(
        model_path=model_path,
        device="cpu",
        dtype=dtype,
        attention_backend="torch_native",
        linear_backend="torch",
        disable_native_decode_layers=True,
        max_total_tokens=4096,
        max_running_requests=64,
    )
    args.update(server_kw)
    return ModelRunner(ServerArgs(**args).resolve())


def summary(census: LaunchCensus) -> dict[str, Any]:
    per_layer = census.per_layer()
    layers = {k: v for k, v in per_layer.items() if k != STEP}
    counts = sorted({len(v) for v in layers.values()})
    typical = Counter(len(v) for v in layers.values()).most_common(1)[0][0] if layers else 0
    ops = next((v for v in layers.values() if len(v) == typical), [])
    return {
        "kernels_per_layer": typical,
        "kernels_per_layer_range": [counts[0], counts[-1]] if counts else [],
        "layer_ops": ops,
        "step_kernels": len(per_layer.get(STEP, [])),
        "total_kernels": len(census.kernels),
        "host_syncs": [f"{w}:{n}" for w, n in census.syncs],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF model folder (weights: --load-format)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--model-override-args", default=None, help="JSON, e.g. to shrink a shape")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    kw: dict[str, Any] = {"load_format": a.load_format}
    if a.model_override_args:
        kw["json_model_override_args"] = a.model_override_args
    result = summary(census_decode_step(census_runner(a.model, a.dtype, **kw), a.batch_size))
    if a.json:
        print(json.dumps(result))
    else:
        print(f"kernels per decode layer: {result['kernels_per_layer']} ({' '.join(result['layer_ops'])})")
        print(f"outside the layers: {result['step_kernels']}; host syncs: {result['host_syncs'] or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

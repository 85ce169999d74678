"""The call contract between srt's fused-kernel dispatch and FlashInfer, checked on CPU: every
call ``FusedKernels`` makes is bound with ``inspect.signature(...).bind`` against the REAL
function of the installed flashinfer (``fused_kernels.FLASHINFER_OPS``; the pinned 0.6.18.post1),
so a renamed, reordered or keyword-only parameter fails here and not on the GPU; and the
arguments meet the kernels' preconditions that CPU tensors can show (bf16 data with its last
dimension contiguous, a float32 contiguous cos/sin table, integer positions, the weight in the
input's dtype)."""

from __future__ import annotations

import importlib
import inspect

import torch

from srt.layers.fused_kernels import FLASHINFER_OPS, FusedKernels
from srt.layers.fused_reference import reference_ops
from tests.unit.test_flashinfer_backend import real_flashinfer  # noqa: F401 (a fixture)

BF16 = torch.bfloat16


def _calls() -> list[tuple[str, tuple, dict]]:
    """One call of every op, as FusedKernels makes it (inputs shaped like a decode layer's)."""
    seen: list[tuple[str, tuple, dict]] = []

    def recording(name, fn):
        def call(*args, **kwargs):
            seen.append((name, args, kwargs))
            return fn(*args, **kwargs)

        return call

    k = FusedKernels({n: recording(n, f) for n, f in reference_ops().items()})
    x, res, w = torch.randn(3, 64).to(BF16), torch.randn(3, 64).to(BF16), torch.ones(64, dtype=BF16)
    qkv = torch.randn(3, 4 * 64).to(BF16)
    assert k.norm(x, w, 1e-6) is not None and k.norm(x, w, 1e-6, gemma=True) is not None
    assert k.norm(qkv[:, :128].view(3, 2, 64), w, 1e-6, in_place=True) is not None
    assert k.add_norm_(x, res, w, 1e-6) is not None and k.add_norm_(x, res, w, 1e-6, gemma=True) is not None
    assert k.act_and_mul(torch.randn(3, 128).to(BF16), "silu") is not None
    assert k.act_and_mul(torch.randn(3, 128).to(BF16), "gelu_tanh") is not None
    table = torch.randn(32, 64)
    assert k.rope_(torch.arange(3), qkv[:, :128], qkv[:, 128:192], 64, table) is not None
    return seen


def test_every_call_binds_to_the_real_function(real_flashinfer):  # noqa: F811
    assert real_flashinfer.__version__ == "0.6.18.post1"
    seen = _calls()
    assert {name for name, _, _ in seen} == set(FLASHINFER_OPS)
    for name, args, kwargs in seen:
        module, func = FLASHINFER_OPS[name]
        real = getattr(importlib.import_module(module), func)
        bound = inspect.signature(real).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        data = a.get("input", a.get("query"))
        assert data.dtype == BF16 and data.stride(-1) == 1, name
        if "weight" in a:
            assert a["weight"].dtype == data.dtype and a["weight"].is_contiguous(), name
        if name == "rope":
            assert a["cos_sin_cache"].dtype == torch.float32 and a["cos_sin_cache"].is_contiguous()
            assert a["positions"].dtype in (torch.int32, torch.int64) and a["is_neox"] is True
            assert a["key"].shape[1] % a["head_size"] == 0 and a["query"].shape[1] % a["head_size"] == 0

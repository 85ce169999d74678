"""Device capability checks (bf16 compute, oneDNN's linear) and dtype resolution.

bfloat16 on CPU goes through oneDNN, which picks its kernels from the ISA the CPU
*advertises*. On some virtual machines AMX is advertised but traps (SIGILL), so the first
bf16 matmul kills the process. ``probe_bf16`` therefore runs a tiny bf16 matmul in a child
process: a trap kills the child, never us. When the native probe fails, a second probe caps
oneDNN at ``AVX512_CORE_BF16`` through ``ONEDNN_MAX_CPU_ISA``; if that one succeeds, the same
cap is set in this process (oneDNN reads it lazily, at its first primitive, so this works as
long as no oneDNN kernel has run here yet; ``ModelRunner`` resolves the dtype before loading
the model). If both fail, ``resolve_dtype`` falls back to float32 with a warning.

    resolve_dtype("auto", "cpu")      -> torch.float32 (no checkpoint in sight: the server
                                         resolves ``--dtype auto`` on CPU before, from the
                                         checkpoint, in srt.configs.cpu_dtype)
    resolve_dtype("auto", "cuda")     -> torch.bfloat16 (float16 if the GPU lacks bf16)
    resolve_dtype("bfloat16", "cpu")  -> torch.bfloat16 if probe_bf16("cpu") else torch.float32

``onednn_linear_available`` checks, once per process and in-process (float32 kernels only, none
of the bf16/AMX ones that make the bf16 probe use a child), that oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``) is present and agrees with
``F.linear``; ``srt.configs.backends.resolve_linear_backend`` uses it for ``--linear-backend``.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from srt.configs.bf16_probe import cpu_bf16_usable
from srt.utils.errors import DtypeError

logger = logging.getLogger(__name__)

_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def probe_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether bfloat16 compute is safe on ``device`` (cached per process).

    CPU: a child process runs a bf16 matmul (see module docstring); when only the
    ISA-capped run works, ``ONEDNN_MAX_CPU_ISA`` is set in ``os.environ`` here as a side
    effect. CUDA: ``torch.cuda.is_bf16_supported()``. Other devices: True.
    """
    return _probe_bf16_cached(torch.device(device).type)


@functools.cache
def _probe_bf16_cached(device_type: str) -> bool:
    if device_type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device_type != "cpu":
        return True
    return cpu_bf16_usable()


def resolve_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """Turn a ``--dtype`` value into a torch dtype that is safe on ``device``.

    ``auto`` is float32 on CPU and bfloat16 (or float16 without bf16 support) on CUDA. This is
    the fallback for a caller with no checkpoint to follow: ``ServerArgs`` turns ``--dtype auto``
    on CPU into the checkpoint's dtype where the CPU computes it well
    (``srt.configs.cpu_dtype.resolve_cpu_dtype``) before a ``ModelConfig`` sees it.
    A bfloat16 request on a device where ``probe_bf16`` fails falls back to float32 with a
    warning instead of crashing later. Raises ``DtypeError`` for unknown names.
    """
    dev = torch.device(device)
    if isinstance(name, torch.dtype):
        dtype = name
    elif name == "auto":
        if dev.type == "cpu":
            return torch.float32
        dtype = torch.bfloat16
        if dev.type == "cuda" and not probe_bf16(dev):
            return torch.float16
        return dtype
    elif name in _NAMES:
        dtype = _NAMES[name]
    else:
        raise DtypeError(f"unknown dtype {name!r}; use one of auto, {', '.join(sorted(_NAMES))}.")
    if dtype == torch.bfloat16 and not probe_bf16(dev):
        logger.warning(
            "bfloat16 is not usable on %s (the probe matmul failed); falling back to float32.", dev
        )
        return torch.float32
    return dtype


@functools.cache
def onednn_linear_available() -> bool:
    """oneDNN's linear is present here and matches ``F.linear`` up to rounding, with the weight
    as it is and prepacked (probed once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(5, 64, generator=gen)
        w = torch.randn(24, 64, generator=gen)
        b = torch.randn(24, generator=gen)
        want = F.linear(x, w, b)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
        for weight in (w, packed):
            got = torch.ops.mkldnn._linear_pointwise(x, weight, b, "none", [], "")
            if got.shape != (5, 24) or not torch.allclose(got, want, rtol=1e-5, atol=1e-4):
                return False
        return torch.equal(packed.to_dense(), w)
    except Exception:  # noqa: BLE001 - any failure means "use F.linear"
        return False

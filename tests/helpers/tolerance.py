"""Float32 tolerances derived from the numerics, for comparisons whose two sides compute the same
function in a different order: srt against transformers, srt's native kernels against torch's
GEMMs, one ISA branch against another, a batch against its sequences run alone.

Why a bound of this form. Two float32 evaluations of the same dot product of length ``k`` that
differ only in summation order (another GEMM kernel, another vector width, another blocking)
differ by rounding noise: each partial sum is rounded with a relative error of at most ``EPS32``,
and the roundings are unbiased, so the difference grows like ``sqrt(k)`` roundings of the
result's magnitude, not like ``k`` (the worst case, which never happens with random-sign terms).
A forward pass composes a few dozen such reductions (projections, attention, norms, the head), and
each carries its predecessors' noise forward at about the magnitude of the values it produces. So
the difference between two implementations of a whole model, measured on its output ``ref``, is

    |got - ref| <= C * EPS32 * max|ref| * sqrt(k)

with ``k`` the longest reduction in the model (``reduction_len``) and ``C`` a constant that absorbs
the depth and the worst of the noise. ``C`` is measured, not guessed: ``benchmarks/tolerance_margins.py``
runs the model-level comparisons under every ``SRT_CPU_ISA`` the CPU has and reports the largest
``|got - ref| / (EPS32 * max|ref| * sqrt(k))`` it sees (the "unit error"); ``REORDER_C`` is at
least 10x that, and the same script shows that a real defect (one dequantization scale broken)
gives an error over 100x the tolerance, so the tests keep their power
(``test_a_broken_dequantization_scale_fails_the_logit_tolerance`` keeps that checked).

An absolute tolerance that does not scale with ``max|ref|`` passes or fails by luck on values that
are not O(1): at logits of 260 an ``atol`` of 1e-4 is a few float32 ulps, and a CPU whose GEMM
sums in another order (an Intel CPU's MKL kernels against an AMD's) fails it.

Bit-identity (``torch.equal``, or ``rtol=0, atol=0``) is asserted only where srt promises it by
construction: two of srt's own paths that run the same kernels on the same rows in the same order
(a batch's row against the row alone on the row-independent kernels, MIXED against EXTEND plus
DECODE on the same backend, the native decode stack against the Python path, every ISA branch of
a kernel whose sums run in one order), dequantization against gguf.quants (integer codes times
fp16 scales, exact in float32), a copy of a tensor. Never against transformers or torch's GEMMs.

Set ``SRT_TOLERANCE_LOG=<file>`` to append one JSON line per comparison (test, error, unit, ratio):
that is how the margins are measured.
"""

from __future__ import annotations

import json
import math
import os

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2**-23, float32's machine epsilon
# The constant of the bound above, for float32 against float32 in another order: srt's float32
# weights or GGUF blocks multiplied by srt's native kernels (dequantized in registers) against
# transformers on the dequantized weights; srt's oneDNN, packed and block kernels against torch's
# GEMMs. Measured with benchmarks/tolerance_margins.py (docs/testing.md has the figures): the
# largest unit error over every SRT_CPU_ISA run is under 1, so 16 is over 10x it, and one fp16
# block scale of the default model doubled gives 40-3400x the tolerance.
REORDER_C = 16.0
LOG_ENV = "SRT_TOLERANCE_LOG"


def reduction_len(config) -> int:
    """The longest dot product of a transformer block: the hidden size, the MLP's (or an expert's)
    intermediate size, whichever is larger."""
    sizes = [config.hidden_size]
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            sizes.append(v)
    return max(sizes)


def unit(ref: torch.Tensor, k: int) -> float:
    """One unit of the bound: ``EPS32 * max|ref| * sqrt(k)``."""
    return EPS32 * float(ref.detach().double().abs().max()) * math.sqrt(k)


def reorder_atol(ref: torch.Tensor, k: int, c: float = REORDER_C) -> float:
    """The absolute tolerance for ``ref`` computed in another summation order (module docstring)."""
    return c * unit(ref, k)


def assert_reordered_close(
    got: torch.Tensor,
    ref: torch.Tensor,
    k: int,
    *,
    c: float = REORDER_C,
    scale_ref: torch.Tensor | None = None,
    what: str = "",
) -> None:
    """``|got - ref| <= c * EPS32 * max|scale_ref| * sqrt(k)`` elementwise (``scale_ref`` defaults
    to ``ref``: pass the logits when comparing values derived from them, such as logprobs, whose
    error is the logits' error)."""
    got = torch.as_tensor(got)
    ref = torch.as_tensor(ref)
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    u = unit(ref if scale_ref is None else scale_ref, k)
    err = float((got.double() - ref.double()).abs().max()) if got.numel() else 0.0
    _log(what, err, u, c)
    assert math.isfinite(err) and err <= c * u, (
        f"{what + ': ' if what else ''}max |got - ref| = {err:.3g} > {c:g} units of "
        f"{u:.3g} (EPS32 * max|ref| * sqrt({k})): {err / u:.3g} units"
    )


def _log(what: str, err: float, u: float, c: float) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    row = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
        "what": what,
        "isa": os.environ.get("SRT_CPU_ISA", ""),
        "err": err,
        "unit": u,
        "units": err / u if u else 0.0,
        "c": c,
    }
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")

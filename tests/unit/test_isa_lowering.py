"""The kernel tests again with the ops' ISA lowered (``SRT_CPU_ISA=avx2`` and ``scalar``), so every
ISA branch below the CPU's own runs in CI on any CPU: the AVX2 and scalar kernels, the default
panel width of 24, the scalar GGUF row functions, and the "not available on this CPU" errors.

Each run is a child pytest (the ISA is read once per process) whose report must show the branches
of its ISA passed and the wider ones skipped with the reason; the report's closing section lists
each run (tests/conftest.py). The runs start when collection ends, at low priority, on the cores
the rest of the suite leaves idle (tests/helpers/early_runs.py).
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

import pytest

from srt.configs.cpu_features import CPU_ISA_ENV
from tests.helpers import early_runs
from tests.helpers.isa import ISA_RUNS, ISAS, cpu_isa, hardware_isa

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNEL_TESTS = [
    f"tests/unit/{name}.py"
    for name in (
        "test_cpu_isa",
        "test_bf16_linear",
        "test_fp8_linear",
        "test_cpu_decode_attention",
        "test_cpu_extend_attention",
        "test_cpu_elementwise",
        "test_layers",
        "test_gguf_kernels",
        "test_gguf_a24_kernels",
        "test_gguf_x8_a24_kernels",
        "test_gguf_kquant_kernels",
        "test_gguf_q8a_kernels",
        "test_quantized_weights",
        "test_native_decode_layers",
        "test_fused_cpu_attention",
        "test_models_forward",
    )
]
OPS = ("paged_decode_attention", "extend_attention", "packed_linear")
# Whole-model checks left out of the scalar run, where they take half a minute: the main run and
# the AVX2 one run them, and the scalar kernels they call are checked at every tail by the kernel
# tests; the scalar run keeps the default model's other checks (logits against transformers and
# float32, the native decode stack).
SCALAR_DESELECT = (
    "tests/unit/test_quantized_weights.py::test_default_model_int8_activations_stay_close",
    "tests/unit/test_quantized_weights.py::test_default_model_keeps_float32_copies_within_the_budget",
    "tests/unit/test_models_forward.py::test_a_broken_dequantization_scale_fails_the_logit_tolerance",
)


# the CPU flag each lowering needs above it (vec.h's detect_isa asks for more: this only spares the
# queue a run whose test would skip)
_ABOVE = {"avx2": "avx512f", "scalar": "avx2"}


def lowered_run(isa: str, check_cpu: bool = True) -> early_runs.Command | None:
    """The child pytest of the kernel tests under ``SRT_CPU_ISA=isa`` (None: the main run is itself
    lowered, or, by /proc/cpuinfo's flags, the CPU has nothing above ``isa``)."""
    if os.environ.get(CPU_ISA_ENV):
        return None
    cpuinfo = Path("/proc/cpuinfo")
    if check_cpu and cpuinfo.exists() and _ABOVE[isa] not in cpuinfo.read_text().split():
        return None
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *KERNEL_TESTS]
    if isa == "scalar":
        cmd += [f"--deselect={test}" for test in SCALAR_DESELECT]
    return early_runs.Command(cmd, env=dict(os.environ, **{CPU_ISA_ENV: isa}), cwd=REPO_ROOT, timeout=900)


def _lowering(isa: str):
    return pytest.param(
        isa, marks=pytest.mark.early_run(f"isa-lowered-{isa}", functools.partial(lowered_run, isa))
    )


@pytest.mark.parametrize("isa", [_lowering("avx2"), _lowering("scalar")])
def test_kernel_tests_pass_with_the_isa_lowered(isa, request):
    if os.environ.get(CPU_ISA_ENV):
        pytest.skip(f"this run is itself lowered ({CPU_ISA_ENV}={os.environ[CPU_ISA_ENV]})")
    if cpu_isa() is None:
        pytest.skip("native CPU kernels unavailable")
    if ISAS.index(isa) >= ISAS.index(hardware_isa()):
        pytest.skip(f"not a lowering on this CPU ({hardware_isa()}): the main run covers {isa}")
    res = early_runs.result(f"isa-lowered-{isa}", lowered_run(isa, check_cpu=False))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    summary = out.strip().splitlines()[-1]
    passed = set(re.findall(r"^PASSED (\S+)", out, re.M))
    skipped = "\n".join(re.findall(r"^SKIPPED .*$", out, re.M))
    assert f"this run: ops ran {isa} (CPU: {hardware_isa()})" in out
    for op in OPS:  # the ISA's own branch ran; asking for a wider one was refused in the one wording
        assert f"tests/unit/test_cpu_isa.py::test_each_op_runs_each_isa_the_cpu_has[{isa}-{op}]" in passed
        for wider in ISAS[ISAS.index(isa) + 1 :]:
            assert (
                f"tests/unit/test_cpu_isa.py::test_an_isa_above_the_cpu_is_refused_in_one_wording[{wider}-{op}]"
                in passed
            )
    for wider in ISAS[ISAS.index(isa) + 1 :]:  # the wider expectations were skipped, not passed
        assert f"this CPU runs up to {isa} (hardware {hardware_isa()}), not {wider}" in skipped
    assert "tests/unit/test_layers.py::test_packed_linear_weight_layout" in passed  # 24-wide panels
    request.config.stash[ISA_RUNS].append(f"{CPU_ISA_ENV}={isa}: {summary.strip('= ')}")

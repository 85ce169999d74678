"""The CPU's ISA as srt's native ops see it: one place (``detect_isa()`` in vec.h, lowered by
``SRT_CPU_ISA``), one wording for an ISA the CPU does not run, and the choices that follow it.

On an AVX-512 CPU the "not available" cases have nothing to ask for here: they run in the lowered
runs (test_isa_lowering.py), which repeat this file under ``SRT_CPU_ISA=avx2`` and ``scalar``.
"""

from __future__ import annotations

import pytest
import torch

from srt.configs.cpu_features import CPU_ISA_ENV, CPU_ISAS, cpu_has_avx2_fma, cpu_isa_cap
from srt.kernels import cpu as cpu_kernels
from srt.server_args import ServerArgs
from srt.utils.errors import ConfigError
from tests.helpers.isa import ISAS, cpu_isa, hardware_isa, isa_available, isa_params

pytestmark = pytest.mark.skipif(cpu_isa() is None, reason="native CPU kernels unavailable")


def _decode_attention(isa: str) -> torch.Tensor:
    q, kv = torch.randn(1, 2, 64), torch.randn(4, 1, 64)
    table, idx, lens = torch.arange(4).view(1, 4), torch.tensor([0]), torch.tensor([4])
    return torch.ops.srt_cpu.paged_decode_attention(q, kv, kv, table, idx, lens, 0.125, 0, isa)


def _extend_attention(isa: str) -> torch.Tensor:
    q, kv = torch.randn(3, 2, 64), torch.randn(3, 1, 64)
    desc = (torch.tensor([0]), torch.tensor([0]), torch.tensor([3]), torch.tensor([3]))
    return torch.ops.srt_cpu.extend_attention(q, kv, kv, *desc, 0.125, isa)


def _packed_linear(isa: str) -> torch.Tensor:
    packed = torch.ops.srt_cpu.pack_linear_weight(torch.randn(30, 16), 48)
    return torch.ops.srt_cpu.packed_linear(torch.randn(3, 16), packed, 30, None, isa)


OPS_WITH_ISA = {
    "paged_decode_attention": _decode_attention,
    "extend_attention": _extend_attention,
    "packed_linear": _packed_linear,
}


def test_the_python_and_cpp_lists_agree():
    assert CPU_ISAS == ISAS
    assert ISAS.index(cpu_isa()) <= ISAS.index(hardware_isa())
    cap = cpu_isa_cap()
    if cap is None:
        assert cpu_isa() == hardware_isa()
    else:
        assert cpu_isa() == min(cap, hardware_isa(), key=ISAS.index)


def test_kernel_status_names_the_isa():
    status = cpu_kernels.kernel_status()
    assert f"({cpu_isa()}" in status
    assert ("lowered from" in status) == (cpu_isa() != hardware_isa())


@pytest.mark.parametrize("op", OPS_WITH_ISA)
@pytest.mark.parametrize("isa", ISAS[1:])
def test_an_isa_above_the_cpu_is_refused_in_one_wording(op, isa):
    if isa_available(isa):
        pytest.skip(f"this CPU runs {isa}: nothing to refuse here (the lowered runs refuse it)")
    want = f"{op}: isa '{isa}' is not available on this CPU (it runs up to '{cpu_isa()}')"
    with pytest.raises(RuntimeError) as info:
        OPS_WITH_ISA[op](isa)
    assert want in str(info.value)


@pytest.mark.parametrize("op", OPS_WITH_ISA)
@pytest.mark.parametrize("isa", isa_params())
def test_each_op_runs_each_isa_the_cpu_has(op, isa):
    """Same inputs through ``isa`` and the scalar path; "" runs exactly ``cpu_isa()``'s path."""

    def run(name: str) -> torch.Tensor:
        torch.manual_seed(0)
        return OPS_WITH_ISA[op](name)

    torch.testing.assert_close(run(isa), run("scalar"), rtol=1e-5, atol=1e-5)
    assert torch.equal(run(""), run(cpu_isa()))


@pytest.mark.parametrize("op", OPS_WITH_ISA)
def test_an_unknown_isa_name_is_refused(op):
    # (extend_attention also names its bf16 kernel, 'avx512_bf16')
    names = (
        "'', 'scalar', 'avx2', 'avx512' or 'avx512_bf16'"
        if op == "extend_attention"
        else "'', 'scalar', 'avx2' or 'avx512'"
    )
    with pytest.raises(RuntimeError, match=f"{op}: isa must be {names}, got 'neon'"):
        OPS_WITH_ISA[op]("neon")


def test_the_env_knob_is_validated(monkeypatch):
    monkeypatch.setenv(CPU_ISA_ENV, "sse4")
    with pytest.raises(ConfigError, match="SRT_CPU_ISA must be one of scalar, avx2, avx512"):
        cpu_isa_cap()
    with pytest.raises(ConfigError):
        cpu_kernels.load()
    with pytest.raises(ConfigError, match="SRT_CPU_ISA"):
        ServerArgs(device="cpu").resolve()
    monkeypatch.setenv(CPU_ISA_ENV, "")
    assert cpu_isa_cap() is None
    monkeypatch.setenv(CPU_ISA_ENV, "scalar")
    assert cpu_isa_cap() == "scalar" and not cpu_has_avx2_fma()  # `auto` then skips the native linear

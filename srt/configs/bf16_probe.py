"""Whether bf16 arithmetic runs on this CPU, asked of a child process (no torch in this one).

Some virtual machines advertise AMX and trap on the first tile instruction, which kills the
process that runs it; oneDNN picks its bf16 kernels from the ISA the CPU advertises. The probe runs
the op families a bf16 forward uses (linear, bmm, SDPA; srt's own bf16 linear when the native
kernels are built) in a fresh interpreter and checks them against float32: exit status 0 means
bf16 is usable. When only a run with oneDNN capped below AMX (``ONEDNN_MAX_CPU_ISA``) passes, that
cap is set in ``os.environ`` (inherited by the processes started after it) and bf16 stays on.
Cached per process.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys

logger = logging.getLogger(__name__)

# oneDNN ISA cap that keeps bf16 on AVX512-BF16 kernels (no AMX).
SAFE_BF16_ISA = "AVX512_CORE_BF16"
ISA_ENV = "ONEDNN_MAX_CPU_ISA"
PROBE_TIMEOUT_S = 120.0

PROBE_SCRIPT = """
import torch
torch.manual_seed(0)
a = torch.randn(37, 256)
w = torch.randn(384, 256)
ref = a @ w.t()
out = torch.nn.functional.linear(a.bfloat16(), w.bfloat16()).float()
err = (out - ref).abs().max().item() / ref.abs().max().item()
q = torch.randn(1, 4, 9, 32, dtype=torch.bfloat16)
torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
torch.bmm(q[0], q[0].transpose(1, 2))
try:
    from srt.kernels import cpu as cpu_kernels
    native = cpu_kernels.load() and hasattr(torch.ops.srt_cpu, "bf16_linear")
except Exception:
    native = False
if native:
    packed = torch.ops.srt_cpu.pack_bf16_weight(w.bfloat16())
    for m in (1, 37):
        got = torch.ops.srt_cpu.bf16_linear(a[:m].bfloat16(), packed, 384, None, "").float()
        err = max(err, (got - ref[:m]).abs().max().item() / ref.abs().max().item())
raise SystemExit(0 if err < 0.05 else 3)
"""


def run_probe(extra_env: dict[str, str] | None = None) -> bool:
    """Run the bf16 probe in a fresh interpreter; True when it exits 0 (no trap, sane result)."""
    env = dict(os.environ)
    env.update(extra_env or {})
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", PROBE_SCRIPT],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning("bf16 probe could not run: %s", e)
        return False
    if proc.returncode != 0:
        logger.info(
            "bf16 probe (env %s) failed with status %d: %s",
            extra_env or {},
            proc.returncode,
            proc.stderr.decode(errors="replace").strip()[-300:],
        )
    return proc.returncode == 0


@functools.cache
def cpu_bf16_usable() -> bool:
    """The probe passed here (as it is, or with oneDNN capped below AMX, which is then set)."""
    if run_probe():
        return True
    if os.environ.get(ISA_ENV):
        return False  # the user already capped the ISA and bf16 still fails: nothing else to try
    if run_probe({ISA_ENV: SAFE_BF16_ISA}):
        logger.warning(
            "bf16 kernels trap on this CPU at the advertised ISA; capping oneDNN with %s=%s.",
            ISA_ENV,
            SAFE_BF16_ISA,
        )
        os.environ[ISA_ENV] = SAFE_BF16_ISA
        return True
    return False

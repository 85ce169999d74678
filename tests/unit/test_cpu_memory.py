"""The CPU scheduler's allocator settings (srt/utils/cpu_memory.py): big freed blocks go back to
the OS, torch puts big tensors on transparent huge pages, small models keep the defaults, the
user's own settings win, and the scheduler child applies them before anything else."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

import srt.entrypoints.launch as launch
from srt.server_args import PortArgs, ServerArgs
from tests.helpers.tiny_models import save_tiny_model

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc and /proc")

# A big model's prefill in miniature: one large block freed first (glibc then raises its mmap
# threshold to that size), then 8 MiB activations with smaller live blocks between them, then
# the activations freed. Prints the resident growth that stays, in MiB.
RETAINED = r"""
import ctypes, json, os, sys
from srt.utils.cpu_memory import configure_cpu_allocator
msg = configure_cpu_allocator(int(sys.argv[2])) if sys.argv[1] == "on" else ""
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
first = libc.malloc(30 << 20); ctypes.memset(first, 1, 30 << 20); libc.free(first)
base = rss_mib()
big, small = [], []
for _ in range(24):
    b = libc.malloc(8 << 20); ctypes.memset(b, 1, 8 << 20); big.append(b)
    small.append(libc.malloc(200 << 10))  # live and in the heap: no hole that small holds it
for b in big:
    libc.free(b)
retained = rss_mib() - base
import torch
t = torch.ones(16 << 20)  # 64 MiB
with open("/proc/self/smaps") as f:
    huge = sum(int(l.split()[1]) for l in f if l.startswith("AnonHugePages:")) / 1024
print(json.dumps({"retained_mib": retained, "huge_mib": huge, "msg": msg,
                  "thp": os.environ.get("THP_MEM_ALLOC_ENABLE")}))
"""


def _thp_possible() -> bool:
    """Whether this kernel gives huge pages to a mapping that asks (madvise or always mode)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _run(mode: str, env: dict | None = None, hidden_size: int = 4096) -> dict:
    import os

    full_env = {
        k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "THP_MEM_ALLOC_ENABLE")
    }
    full_env.update(env or {})
    out = subprocess.run(
        [sys.executable, "-c", RETAINED, mode, str(hidden_size)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_activations_go_back_to_the_os_and_big_tensors_sit_on_huge_pages():
    off, on = _run("off"), _run("on")
    # glibc's own behaviour, which the settings exist for: the freed blocks stay resident
    assert off["retained_mib"] > 100, off
    assert on["retained_mib"] < 16, on
    assert on["msg"] == "allocator: mmap threshold 4 MiB; huge pages for tensors of 2 MiB or more"
    # torch read THP_MEM_ALLOC_ENABLE at its first allocation: a 64 MiB tensor sits on huge pages
    assert on["thp"] == "1"
    if _thp_possible():
        assert on["huge_mib"] >= 32, on


def test_small_models_keep_the_defaults():
    """A small model's prefill does little arithmetic per byte of activations: fresh mappings
    would show there, so its allocator is left alone."""
    got = _run("on", hidden_size=576)
    assert got["msg"] == "allocator: glibc's and torch's defaults (hidden size 576 < 4096)"
    assert got["retained_mib"] > 100 and got["thp"] is None and got["huge_mib"] == 0, got


def test_the_users_own_settings_are_kept():
    got = _run("on", {"MALLOC_MMAP_THRESHOLD_": "65536", "THP_MEM_ALLOC_ENABLE": "0"})
    assert got["msg"] == (
        "allocator: mmap threshold from MALLOC_MMAP_THRESHOLD_=65536; THP_MEM_ALLOC_ENABLE=0 (as set)"
    )
    assert got["thp"] == "0"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_scheduler_child_sets_the_allocator_up_first_on_cpu(monkeypatch, tmp_path, device):
    calls: list[str] = []
    fake = types.ModuleType("srt.managers.scheduler.process")
    fake.run_scheduler_process = lambda *a: calls.append("scheduler")
    monkeypatch.setitem(sys.modules, "srt.managers.scheduler.process", fake)
    sizes: list = []
    monkeypatch.setattr(
        launch,
        "configure_cpu_allocator",
        lambda h: sizes.append(h) or calls.append("allocator") or "allocator: x",
    )
    args = ServerArgs(model_path=save_tiny_model("llama", tmp_path), device=device)
    launch.run_scheduler(args, PortArgs.__new__(PortArgs), None)
    assert calls == (["allocator", "scheduler"] if device == "cpu" else ["scheduler"])
    # the model's hidden size, read from its config without torch
    assert sizes == (
        [json.loads((tmp_path / "config.json").read_text())["hidden_size"]] if device == "cpu" else []
    )

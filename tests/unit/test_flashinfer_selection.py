"""``auto`` picks flashinfer only on CUDA with the flashinfer package importable, never on CPU;
now that srt/layers/attention/flashinfer_backend.py exists, its module is always importable.

Pure cases pass ``importable`` explicitly, so they hold whether or not flashinfer is installed
here; the ServerArgs cases pretend CUDA is present and flashinfer is (or is not) installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from srt.configs import server_args_resolve
from srt.configs.backends import (
    ATTENTION_BACKENDS,
    AUTO_ATTENTION_ORDER,
    module_importable,
    resolve_attention_backend,
    select_attention_backend,
)
from srt.server_args import ConfigError, ServerArgs

FLASHINFER_MODULE = ATTENTION_BACKENDS["flashinfer"].module


def only(*names: str):
    """``importable`` of an install holding srt's own modules plus the packages in ``names``."""
    return lambda name: (name.startswith("srt.") and module_importable(name)) or name in names


def test_the_backend_module_exists_and_is_first_in_auto():
    assert module_importable(FLASHINFER_MODULE)
    assert AUTO_ATTENTION_ORDER[0] == "flashinfer"
    assert ATTENTION_BACKENDS["flashinfer"].devices == ("cuda",)
    assert ATTENTION_BACKENDS["flashinfer"].requires == ("flashinfer",)


def test_auto_on_cuda_picks_flashinfer_only_when_the_package_is_importable():
    assert select_attention_backend("cuda", only("flashinfer")) == "flashinfer"
    assert select_attention_backend("cuda", only()) == "torch_native"


def test_auto_on_cpu_never_picks_flashinfer():
    assert select_attention_backend("cpu", only("flashinfer")) == "fused_cpu"
    assert select_attention_backend("cpu", only()) == "fused_cpu"
    # and with whatever is really installed on this machine
    assert select_attention_backend("cpu") != "flashinfer"


def test_explicit_flashinfer():
    assert resolve_attention_backend("flashinfer", "cuda", only("flashinfer")) == "flashinfer"
    with pytest.raises(ConfigError, match="flashinfer, which is not installed"):
        resolve_attention_backend("flashinfer", "cuda", only())
    with pytest.raises(ConfigError, match="runs on cuda, not cpu"):
        resolve_attention_backend("flashinfer", "cpu", only("flashinfer"))


@pytest.fixture(params=[True, False], ids=["flashinfer", "no_flashinfer"])
def fake_cuda(request, monkeypatch):
    """Pretend a CUDA device is present, and flashinfer installed (or not); returns which."""
    installed = request.param
    real_find_spec = importlib.util.find_spec

    def find_spec(name, package=None):
        if name == "flashinfer":
            return importlib.util.spec_from_loader("flashinfer", loader=None) if installed else None
        return real_find_spec(name, package)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(server_args_resolve, "nvidia_driver_present", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return installed


def test_server_args_auto_on_cuda(fake_cuda):
    resolved = ServerArgs(device="auto").resolve()
    assert resolved.device == "cuda"
    assert resolved.attention_backend == ("flashinfer" if fake_cuda else "torch_native")


def test_without_an_nvidia_driver_auto_is_the_cpu_and_torch_is_not_asked(monkeypatch):
    """No driver: no CUDA device is visible to anything, so ``auto`` resolves to the CPU without
    importing torch (the main process stays free of it)."""
    monkeypatch.setattr(server_args_resolve, "nvidia_driver_present", lambda: False)

    def asked():
        raise AssertionError("torch.cuda.is_available() was called")

    monkeypatch.setattr(torch.cuda, "is_available", asked)
    assert ServerArgs(device="auto").resolve().device == "cpu"


def test_server_args_on_cpu_never_picks_flashinfer(fake_cuda):
    assert ServerArgs(device="cpu").resolve().attention_backend != "flashinfer"

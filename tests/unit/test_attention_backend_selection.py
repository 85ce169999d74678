"""Which attention backend ``ServerArgs.resolve`` picks: only one whose module exists.

The bug this guards: with CUDA present and flashinfer installed, ``auto`` chose ``flashinfer``,
whose backend module (srt/layers/attention/flashinfer_backend.py) does not exist yet, and the
server died at start-up with an ImportError.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from srt.configs.backends import (
    ATTENTION_BACKENDS,
    module_importable,
    resolve_attention_backend,
    select_attention_backend,
)
from srt.server_args import ConfigError, ServerArgs

FLASHINFER_MODULE = ATTENTION_BACKENDS["flashinfer"].module


def installed(*extra: str):
    """``importable`` for an install where the modules in ``extra`` exist besides the real ones."""
    return lambda name: name in extra or module_importable(name)


def test_flashinfer_backend_module_is_missing_in_this_version():
    # the premise of the tests below; when the module lands, auto on CUDA picks it (last test)
    assert not module_importable(FLASHINFER_MODULE)
    assert module_importable(ATTENTION_BACKENDS["torch_native"].module)


def test_cuda_with_flashinfer_installed_but_no_backend_module_selects_torch_native():
    assert select_attention_backend("cuda", installed("flashinfer")) == "torch_native"


def test_selection_without_flashinfer_is_torch_native_on_cuda_and_fused_cpu_on_cpu():
    assert select_attention_backend("cuda", installed()) == "torch_native"
    # fused_cpu runs torch-native's decode path itself when its native kernel is not built
    assert select_attention_backend("cpu", installed("flashinfer", FLASHINFER_MODULE)) == "fused_cpu"


def test_selection_picks_flashinfer_once_its_module_exists():
    assert select_attention_backend("cuda", installed("flashinfer", FLASHINFER_MODULE)) == "flashinfer"
    # the module alone is not enough: the package it wraps must be installed too
    assert select_attention_backend("cuda", installed(FLASHINFER_MODULE)) == "torch_native"


def test_explicit_backend_that_cannot_run_is_a_config_error():
    with pytest.raises(ConfigError, match="flashinfer_backend"):
        resolve_attention_backend("flashinfer", "cuda", installed("flashinfer"))
    with pytest.raises(ConfigError, match="not installed"):
        resolve_attention_backend("flashinfer", "cuda", installed(FLASHINFER_MODULE))
    with pytest.raises(ConfigError, match="runs on cuda"):
        resolve_attention_backend("flashinfer", "cpu", installed("flashinfer", FLASHINFER_MODULE))
    with pytest.raises(ConfigError, match="unknown attention backend"):
        resolve_attention_backend("triton", "cuda", installed())
    assert resolve_attention_backend("torch_native", "cuda", installed()) == "torch_native"
    assert resolve_attention_backend(None, "cpu", installed()) == "fused_cpu"
    assert resolve_attention_backend("torch_native", "cpu", installed()) == "torch_native"
    with pytest.raises(ConfigError, match="runs on cpu"):
        resolve_attention_backend("fused_cpu", "cuda", installed())


@pytest.fixture
def cuda_with_flashinfer(monkeypatch):
    """Pretend CUDA is present and the flashinfer package is installed (nothing else changes)."""
    real_find_spec = importlib.util.find_spec

    def find_spec(name, package=None):
        if name == "flashinfer":
            return importlib.util.spec_from_loader("flashinfer", loader=None)
        return real_find_spec(name, package)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_server_args_resolve_on_cuda_with_flashinfer_starts_on_torch_native(cuda_with_flashinfer):
    resolved = ServerArgs(device="auto").resolve()
    assert resolved.device == "cuda"
    assert resolved.attention_backend == "torch_native"


def test_server_args_explicit_flashinfer_without_its_module_is_a_config_error(cuda_with_flashinfer):
    with pytest.raises(ConfigError, match="--attention-backend flashinfer"):
        ServerArgs(device="cuda", attention_backend="flashinfer").resolve()


def test_cli_choices_are_the_registered_backends():
    from srt.layers.attention.registry import available_attention_backends

    field = ServerArgs.__dataclass_fields__["attention_backend"]
    assert field.metadata["choices"] == ["torch_native", "fused_cpu", "flashinfer"]
    assert sorted(field.metadata["choices"]) == available_attention_backends()

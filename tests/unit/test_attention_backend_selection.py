"""Which attention backend ``ServerArgs.resolve`` picks: only one whose module exists and whose
packages are installed (flashinfer's own cases: test_flashinfer_selection.py).

The bug this guards: with CUDA present and flashinfer installed, ``auto`` once chose a backend
whose module did not exist, and the server died at start-up with an ImportError. Each case passes
``importable`` for an explicit install, so it holds whatever this machine has.
"""

from __future__ import annotations

import pytest

from srt.configs.backends import ATTENTION_BACKENDS, resolve_attention_backend, select_attention_backend
from srt.server_args import ConfigError, ServerArgs

FLASHINFER_MODULE = ATTENTION_BACKENDS["flashinfer"].module
SRT_MODULES = {spec.module for name, spec in ATTENTION_BACKENDS.items() if name != "flashinfer"}


def installed(*extra: str):
    """``importable`` of an install holding srt's backend modules but flashinfer's, plus ``extra``."""
    present = SRT_MODULES | set(extra)
    return lambda name: name in present


def test_a_backend_module_that_is_missing_is_never_selected():
    assert select_attention_backend("cuda", installed("flashinfer")) == "torch_native"


def test_selection_without_flashinfer_is_torch_native_on_cuda_and_fused_cpu_on_cpu():
    assert select_attention_backend("cuda", installed()) == "torch_native"
    # fused_cpu runs torch-native's decode path itself when its native kernel is not built
    assert select_attention_backend("cpu", installed("flashinfer", FLASHINFER_MODULE)) == "fused_cpu"


def test_selection_picks_flashinfer_when_its_module_and_package_exist():
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


def test_cli_choices_are_the_registered_backends():
    from srt.layers.attention.registry import available_attention_backends

    field = ServerArgs.__dataclass_fields__["attention_backend"]
    assert field.metadata["choices"] == ["torch_native", "fused_cpu", "flashinfer"]
    assert sorted(field.metadata["choices"]) == available_attention_backends()

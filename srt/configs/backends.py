"""The backends srt knows by name, and how ``auto`` picks one (resolved once by ``ServerArgs.resolve``).

Attention backends: ``ATTENTION_BACKENDS`` maps each ``--attention-backend`` name to where its
class lives; ``srt.layers.attention.registry`` imports that module only when the backend is
built. This table is configuration (plain strings, no torch import), so ``ServerArgs`` can
decide which backend is usable without importing ``srt.layers``. A backend is *usable* when
the device is one it runs on, its module exists and every package it needs is installed::

    auto:     the first usable of AUTO_ATTENTION_ORDER        (torch_native is always usable)
    explicit: the name itself, or ConfigError saying what is missing

To add a backend: its module under ``srt/layers/attention/`` (a subclass of
``AttentionBackend`` constructed as ``Class(model_runner)``), one entry here, and its place in
``AUTO_ATTENTION_ORDER``.

Linear backends (``--linear-backend``): ``auto`` is, on CPU float32 or bfloat16, ``native`` (srt's
packed kernels) where the CPU has AVX2 + FMA, else ``onednn`` when oneDNN's linear is present
and passes its self-check (``srt.configs.device.onednn_linear_available``); ``torch``
(``F.linear``) everywhere else.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from srt.utils.errors import ConfigError


@dataclass(frozen=True, slots=True)
class AttentionBackendSpec:
    module: str  # import path of the backend's module
    class_name: str  # the class in that module, constructed as Class(model_runner)
    devices: tuple[str, ...]  # device types it runs on
    requires: tuple[str, ...] = ()  # third-party packages its module imports


ATTENTION_BACKENDS: dict[str, AttentionBackendSpec] = {
    "torch_native": AttentionBackendSpec(
        "srt.layers.attention.torch_native", "TorchNativeAttnBackend", ("cpu", "cuda")
    ),
    # decode through the native paged kernel of srt/kernels/cpu (torch-native's path without it)
    "fused_cpu": AttentionBackendSpec("srt.layers.attention.fused_cpu", "FusedCPUAttnBackend", ("cpu",)),
    "flashinfer": AttentionBackendSpec(
        "srt.layers.attention.flashinfer_backend", "FlashInferAttnBackend", ("cuda",), ("flashinfer",)
    ),
}
# what ``auto`` tries, best first; the last entry must be usable everywhere
AUTO_ATTENTION_ORDER: tuple[str, ...] = ("flashinfer", "fused_cpu", "torch_native")

LINEAR_BACKENDS: tuple[str, ...] = ("auto", "native", "onednn", "torch")

# ``importable(module_name) -> bool``: whether a module could be imported here
Importable = Callable[[str], bool]


def module_importable(name: str) -> bool:
    """Whether ``name`` can be imported here, found without importing it (``find_spec``; a
    dotted name imports its parent packages, which must not fail)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def attention_backend_problem(
    name: str, device: str, importable: Importable = module_importable
) -> str | None:
    """Why backend ``name`` cannot run on ``device`` here, or None when it can."""
    spec = ATTENTION_BACKENDS.get(name)
    if spec is None:
        return f"unknown attention backend {name!r}; choose one of {sorted(ATTENTION_BACKENDS)}"
    if device not in spec.devices:
        return f"attention backend {name!r} runs on {', '.join(spec.devices)}, not {device}"
    if not importable(spec.module):
        return f"attention backend {name!r} is not implemented in this version (no module {spec.module})"
    missing = [pkg for pkg in spec.requires if not importable(pkg)]
    if missing:
        return f"attention backend {name!r} needs {', '.join(missing)}, which is not installed"
    return None


def select_attention_backend(device: str, importable: Importable = module_importable) -> str:
    """The backend ``auto`` means on ``device``: the first of ``AUTO_ATTENTION_ORDER`` whose
    module exists and whose packages are installed (pure given ``importable``)."""
    for name in AUTO_ATTENTION_ORDER:
        if attention_backend_problem(name, device, importable) is None:
            return name
    raise ConfigError(f"no attention backend can run on device {device!r}")


def resolve_attention_backend(
    requested: str | None, device: str, importable: Importable = module_importable
) -> str:
    """``--attention-backend`` resolved: None (auto) -> ``select_attention_backend``; an explicit
    name must be usable, else ``ConfigError`` saying why and what to use instead."""
    if requested is None or requested == "auto":
        return select_attention_backend(device, importable)
    problem = attention_backend_problem(requested, device, importable)
    if problem is not None:
        raise ConfigError(
            f"--attention-backend {requested}: {problem}; use --attention-backend torch_native."
        )
    return requested


def resolve_linear_backend(requested: str, device: str, dtype: str) -> str:
    """``auto`` -> on CPU float32 or bfloat16: ``native`` where the CPU has AVX2 + FMA (srt's packed
    kernels, AVX2 or AVX-512, measured faster than oneDNN there; bf16 weights in VNNI pairs), else ``onednn`` when oneDNN passes its
    self-check; everywhere else ``torch``. An unknown name, or an explicit ``native`` / ``onednn`` that cannot
    run here, raises ``ValueError`` (``ServerArgs.resolve`` turns it into a ``ConfigError``)."""
    if requested not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend {requested!r}; expected one of {LINEAR_BACKENDS}")
    if requested == "torch":
        return requested
    from srt.configs.cpu_features import cpu_has_avx2_fma

    cpu_f32 = device == "cpu" and dtype == "float32"
    cpu_native = device == "cpu" and dtype in ("float32", "bfloat16")
    if requested == "native":
        if not cpu_native:
            raise ValueError("--linear-backend native needs --device cpu and --dtype float32 or bfloat16")
        return requested
    if requested == "auto" and cpu_native and cpu_has_avx2_fma():
        return "native"
    from srt.configs.device import onednn_linear_available  # imports torch

    usable = cpu_f32 and onednn_linear_available()
    if requested == "auto":
        return "onednn" if usable else "torch"
    if not usable:
        raise ValueError(
            "--linear-backend onednn needs --device cpu, --dtype float32 and a working oneDNN "
            "(torch.backends.mkldnn); use --linear-backend torch"
        )
    return requested


# Grammar backends (``--grammar-backend``, constrained decoding): the package each imports.
# auto = the first installed of GRAMMAR_BACKENDS' order; none turns constrained decoding off.
GRAMMAR_BACKENDS: dict[str, str] = {"llguidance": "llguidance", "xgrammar": "xgrammar"}


def resolve_grammar_backend(requested: str, importable: Importable = module_importable) -> str:
    """``auto`` -> the first installed backend (``none`` if neither is); an explicit name must
    be installed (ConfigError saying how to install it)."""
    if requested == "none":
        return "none"
    if requested == "auto":
        return next((n for n, pkg in GRAMMAR_BACKENDS.items() if importable(pkg)), "none")
    pkg = GRAMMAR_BACKENDS.get(requested)
    if pkg is None:
        raise ConfigError(
            f"unknown --grammar-backend {requested!r}; choose auto, none or one of {', '.join(GRAMMAR_BACKENDS)}"
        )
    if not importable(pkg):
        raise ConfigError(f"--grammar-backend {requested} needs the {pkg} package: pip install {pkg}")
    return requested

"""Linear layers with weights in F.linear's layout (``weight [out, in]``, contiguous).

Fused projections run as one matmul: ``QKVLinear`` stacks q/k/v and ``MergedColumnLinear``
stacks e.g. gate/up along the output dimension. Checkpoints store the parts separately;
``load_shard`` copies one part into its row block:

    QKVLinear rows:          [0, H*D) q | [H*D, (H+Hkv)*D) k | [(H+Hkv)*D, (H+2Hkv)*D) v
    MergedColumnLinear rows: output_sizes[0] rows of shard 0, then shard 1, ...

Parameters are created uninitialized (``torch.empty``, no init kernels, pages untouched
until loading writes them) with ``requires_grad=False``.

``linear(x, weight, bias)`` is the matmul every layer (and the LM head) uses. Its CPU float32
backend is process-wide, chosen by ``ServerArgs.linear_backend`` (``--linear-backend``) and set
by the ModelRunner through ``set_linear_backend``:

* ``onednn`` (what ``auto`` picks on CPU float32 when oneDNN is present and passes a one-time
  self-check): oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``). About 2x MKL's sgemm
  on AMD CPUs, where MKL does not take its AVX-512 path (prefill 512 tokens 824 -> 485 ms on the
  2-core dev VM), and it also streams weights faster at one row (decode at batch 1, where the
  step is bound by reading the weights: 45 -> 27 ms). Its float32 accumulation order differs
  from MKL's, so logits move by ~1e-4 (SmolLM2-135M, 30 layers) against a reference computed
  with MKL (e.g. transformers on the same machine); greedy tokens stay equal except at
  near-ties.
* ``torch``: ``F.linear`` everywhere (MKL sgemm on CPU): outputs bitwise those of a plain
  PyTorch model on the same machine. The default of a process that never calls
  ``set_linear_backend`` (a model used outside the ModelRunner), and always the choice on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.model_loader.weight_utils import WeightLoadError, copy_weight

LINEAR_BACKENDS = ("auto", "onednn", "torch")
_use_onednn = False  # the process-wide choice (see the module docstring)
_onednn_probe: bool | None = None  # None = not probed yet


def onednn_linear_available() -> bool:
    """oneDNN's linear is present here and matches ``F.linear`` up to rounding (probed once)."""
    global _onednn_probe
    if _onednn_probe is None:
        ok = torch.backends.mkldnn.is_available()
        if ok:
            try:
                gen = torch.Generator().manual_seed(0)
                x = torch.randn(5, 64, generator=gen)
                w = torch.randn(24, 64, generator=gen)
                b = torch.randn(24, generator=gen)
                got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
                ok = got.shape == (5, 24) and torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
            except Exception:  # noqa: BLE001 - any failure means "use F.linear"
                ok = False
        _onednn_probe = ok
    return _onednn_probe


def resolve_linear_backend(requested: str, device: str, dtype: str) -> str:
    """``auto`` -> ``onednn`` on CPU float32 when available, else ``torch``. An explicit
    ``onednn`` that cannot run here raises ``ValueError`` (the caller turns it into a config
    error)."""
    if requested not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend {requested!r}; expected one of {LINEAR_BACKENDS}")
    usable = device == "cpu" and dtype == "float32" and onednn_linear_available()
    if requested == "auto":
        return "onednn" if usable else "torch"
    if requested == "onednn" and not usable:
        raise ValueError(
            "--linear-backend onednn needs --device cpu, --dtype float32 and a working oneDNN "
            "(torch.backends.mkldnn); use --linear-backend torch"
        )
    return requested


def set_linear_backend(name: str) -> None:
    """Make ``linear`` use ``name`` (``onednn`` or ``torch``) in this process."""
    global _use_onednn
    if name not in ("onednn", "torch"):
        raise ValueError(f"set_linear_backend takes 'onednn' or 'torch', got {name!r}")
    _use_onednn = name == "onednn" and onednn_linear_available()


def get_linear_backend() -> str:
    return "onednn" if _use_onednn else "torch"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x ``[..., in]``, weight ``[out, in]`` -> ``[..., out]``,
    through the process's backend (see the module docstring)."""
    if (
        _use_onednn
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.dtype == torch.float32
        and x.numel() > 0
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def empty_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An uninitialized, non-trainable parameter."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ weight.T + bias``; x ``[..., in_features]`` -> ``[..., out_features]``."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = empty_param(out_features, in_features, dtype=dtype)
        self.bias = empty_param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class MergedColumnLinear(Linear):
    """Several projections of the same input, stacked along the output dim (one matmul)."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, sum(output_sizes), bias, dtype)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def _shard_index(self, shard_id: int | str) -> int:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise WeightLoadError(f"{type(self).__name__}: unknown shard {shard_id!r}")
        return shard_id

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard_id: int | str) -> None:
        """Copy one checkpoint part (``weight [size, in]`` or ``bias [size]``) into its rows."""
        idx = self._shard_index(shard_id)
        param = getattr(self, param_name, None)
        if param is None:
            raise WeightLoadError(f"{type(self).__name__} has no parameter {param_name!r}")
        rows = param.narrow(0, self.offsets[idx], self.output_sizes[idx])
        copy_weight(rows, loaded, f"{param_name}[shard {shard_id}]")

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of the parts of an output ``[..., sum(output_sizes)]``."""
        return out.split(self.output_sizes, dim=-1)


class QKVLinear(MergedColumnLinear):
    """Fused q/k/v projection; shards ``"q"``, ``"k"``, ``"v"``."""

    _SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, dtype)
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.q_size = q_size
        self.kv_size = kv_size

    def _shard_index(self, shard_id: int | str) -> int:
        if shard_id not in self._SHARDS:
            raise WeightLoadError(f"QKVLinear: unknown shard {shard_id!r} (expected q, k or v)")
        return self._SHARDS[shard_id]

"""Weight iterators (safetensors, dummy) and loading helpers.

The checked copy every ``load_weights`` uses lives with the layers
(``srt.layers.parameter.copy_weight``), so that models need nothing from the loader.

Every iterator yields ``(hf_name, tensor)`` one tensor at a time and keeps no reference to
what it yielded, so loading never holds more than the model's parameters plus one
checkpoint tensor in memory. Safetensors are read with plain file reads into a fresh
buffer rather than through an mmap: mapped checkpoint pages would count in the resident
set next to the parameters (a second full copy).

Safetensors layout: ``u64 little-endian header size N | JSON header (N bytes) | data``;
the header maps each name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` with
offsets relative to the start of the data.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import zlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from srt.utils.errors import WeightLoadError

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint files of an HF directory: the index's files if there is an index,
    else every ``*.safetensors`` (the original-format ``consolidated*`` copies excluded when
    HF-format files exist)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    hf_files = [p for p in files if not os.path.basename(p).startswith("consolidated")]
    files = hf_files or files
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {model_dir}")
    return files


def readinto_exact(f, view: memoryview, error: type[Exception] = WeightLoadError, where: str = "") -> None:
    """Fill ``view`` from the binary file ``f`` at its current position (``readinto`` until full);
    ``error`` naming the file (and ``where``) when the file ends first."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise error(f"{f.name}: unexpected end of file{where}")
        got += n


def safetensors_weights_iterator(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the directory's safetensors files, in file
    order, each in its stored dtype and freshly allocated (owned by the caller)."""
    for path in safetensors_files(model_dir):
        with open(path, "rb", buffering=0) as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            base = 8 + header_len
            entries = sorted(
                (info["data_offsets"][0], info["data_offsets"][1], name, info)
                for name, info in header.items()
                if name != "__metadata__"
            )
            for begin, end, name, info in entries:
                dtype = _ST_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise WeightLoadError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
                buf = torch.empty(end - begin, dtype=torch.uint8)
                f.seek(base + begin)
                readinto_exact(f, memoryview(buf.numpy()))
                yield name, buf.view(dtype).reshape(info["shape"])


def _param_seed(seed: int, name: str) -> int:
    # torch's CPU generator (mt19937) keeps 32 bits of a seed: mix seed and name into 32 bits
    return zlib.crc32(f"{seed}:{name}".encode())


def init_dummy_weights(
    model: nn.Module,
    seed: int = 0,
    std: float = 0.02,
    views: dict | None = None,
    before_write: Callable[[str, int], None] | None = None,
) -> None:
    """Seeded random weights in place: norm weights 1, every other tensor ``N(0, std)``.

    Each parameter draws from its own generator seeded by ``(seed, parameter name)``, so the
    values depend only on the seed, the name and the shape (not on parameter order), and are
    drawn in float32 on the CPU then copied (identical across dtypes up to rounding). On a CUDA
    device they are drawn there by the device's own generator, seeded the same way: as
    reproducible, but not the CPU's values (drawing 8 billion values on the CPU takes a minute).
    ``views`` (tensor parallelism: parameter name -> ``sharding.ParamView``): such a
    parameter draws its whole-model shape and keeps its ranges, so a rank's weights are exactly
    its part of the single-rank model's. ``before_write(name, nbytes)`` is called before each
    parameter is written (``LoadMemoryGuard.check``)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if before_write is not None:
                before_write(name, param.nbytes)
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            param_seed = _param_seed(seed, name)
            view = (views or {}).get(name)
            if view is None and param.device.type == "cuda":
                gen = torch.Generator(device=param.device).manual_seed(param_seed)
                param.normal_(0.0, std, generator=gen)
                continue
            gen = torch.Generator().manual_seed(param_seed)
            if view is not None:
                full = torch.empty(view.full_shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
                param.copy_(torch.cat([full.narrow(view.dim, a, n) for a, n in view.ranges], dim=view.dim))
                del full
                continue
            if param.dtype == torch.float32 and param.device.type == "cpu":
                param.normal_(0.0, std, generator=gen)
                continue
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            param.copy_(values)
            del values


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage counted once (tied weights);
    a prepacked (``torch._mkldnn``) weight counts its elements, a released one (``meta``) none."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_meta:
            continue
        if t.is_mkldnn:  # opaque, no storage to share
            key, nbytes = id(t), t.numel() * t.element_size()
        else:
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in seen:
            continue
        seen.add(key)
        total += nbytes
    return total


__all__ = [
    "WeightLoadError",
    "init_dummy_weights",
    "safetensors_files",
    "safetensors_weights_iterator",
    "weight_bytes",
]

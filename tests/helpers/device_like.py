"""CPU tensors that refuse what a CUDA tensor refuses, so CPU tests catch host-side code that
only works while the pools live on the CPU.

A CUDA tensor cannot become a numpy array (``np.asarray``, ``.numpy()``) without an explicit
copy to the host; a CPU tensor silently can. ``DeviceLikeTensor`` is a CPU tensor (native
kernels see plain storage) whose results stay ``DeviceLikeTensor`` through torch operations and
which raises on an implicit numpy conversion. ``.cpu()`` / ``.to("cpu")`` return plain tensors,
as the copy to the host does on a GPU. ``device_like_pools`` wraps every ``ReqToTokenPool``'s
table, which is where the scheduler meets the device."""

from __future__ import annotations

import torch

from srt.mem_cache import memory_pool


class DeviceLikeTensor(torch.Tensor):
    """A CPU tensor that behaves like a device tensor at the host boundary."""

    @classmethod
    def wrap(cls, t: torch.Tensor) -> DeviceLikeTensor:
        return t.as_subclass(cls)

    def __array__(self, dtype=None, copy=None):
        raise TypeError("can't convert a device tensor to numpy: copy it to the host first (simulated CUDA)")

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert a device tensor to numpy: copy it to the host first (simulated CUDA)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func in (torch.Tensor.cpu, torch.Tensor.to) and _to_host(func, args, kwargs or {}):
            return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out
        return out


def _to_host(func, args, kwargs) -> bool:
    if func is torch.Tensor.cpu:
        return True
    targets = list(args[1:]) + [kwargs.get("device")]
    return any(
        (isinstance(a, str) and a.startswith("cpu")) or (isinstance(a, torch.device) and a.type == "cpu")
        for a in targets
    )


def device_like_pools(monkeypatch) -> None:
    """Make every ReqToTokenPool built from now on hold a ``DeviceLikeTensor`` table."""
    init = memory_pool.ReqToTokenPool.__init__

    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.req_to_token = DeviceLikeTensor.wrap(self.req_to_token)

    monkeypatch.setattr(memory_pool.ReqToTokenPool, "__init__", wrapped)

"""Checks shared by the tests of the integer-dot paths on 24-bit activations (gguf_a24.cpp,
gguf_x8_a24.cpp): activations with the blocks that stress the split, and the error bound a float32
sum allows."""

from __future__ import annotations

import torch

from srt.kernels.cpu import gguf


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian rows, an outlier column (50x, as LLM activations have), an all-zero block, a tiny
    block (below 1e-30: counted as zeros) and a huge one."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 5] *= 50.0
    x[0, 32:64] = 0.0
    x[-1, 64:96] = 1e-35
    x[-1, 96:128] *= 3e4
    return x


def check_24_bit_error(y: torch.Tensor, x: torch.Tensor, data: torch.Tensor, qtype: int, bias=None) -> None:
    """Each output within eight float32 units of sum_j |w_j| max|x over j's block| of the float64
    product of the dequantized weights (``data``: GGUF rows of ``qtype``)."""
    k = x.shape[1]
    w = gguf.dequantize_ref(data, qtype, k).double()
    ref = x.double() @ w.T
    block_max = x.double().abs().reshape(x.shape[0], k // 32, 32).amax(-1).repeat_interleave(32, dim=1)
    bound = block_max @ w.abs().T
    if bias is not None:
        ref = ref + bias.double()
        bound = bound + bias.double().abs()
    err = (y.double() - ref).abs()
    # 2^-21: eight float32 units of the block's largest term; one byte of V lost would be 2^-16
    assert bool((err <= 2.0**-21 * bound + 1e-30).all()), f"max error / bound {(err / bound).max():.3g}"


def check_taken_below(
    default, a24_path, x: torch.Tensor, data: torch.Tensor, qtype: int, below, above
) -> None:
    """The dispatching op ``default(x_rows)`` takes the 24-bit ``a24_path(x_rows)``: the same bits at
    each row count of ``below``; other sums at each of ``above`` (the path's row limit on), both
    within the 24-bit error bound."""
    for m in below:
        assert torch.equal(default(x[:m]), a24_path(x[:m]))
    for m in above:
        y, a = default(x[:m]), a24_path(x[:m])
        assert not torch.equal(y, a)
        check_24_bit_error(y, x[:m], data, qtype)
        check_24_bit_error(a, x[:m], data, qtype)

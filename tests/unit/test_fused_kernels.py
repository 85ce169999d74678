"""The fused CUDA kernels' dispatch, on CPU: srt's layers hand a call to ``FusedKernels`` when one
is bound and the kernel takes the inputs, and run their torch code otherwise.

FlashInfer is stood in by the torch references of ``srt/layers/fused_reference.py`` (the same
signatures, recorded): a layer's fused output must be the reference's on the layer's own inputs,
must agree with the layer's torch code up to bf16 rounding, and every input a kernel cannot take
must reach the torch code unchanged (bitwise the unbound layer's output, no op called). The
model-level check runs a tiny Llama and Gemma in bf16 through the model runner with and without
the fused ops: same greedy tokens except at near-ties, logits within bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

from srt.layers.activation import GeluTanhAndMul, SiluAndMul
from srt.layers.fused_kernels import FusedKernels, bind_fused_kernels, fused_kernels_off_reason, fused_layers
from srt.layers.fused_reference import reference_ops
from srt.layers.layernorm import RMSNorm
from srt.layers.rope_scaling import RopeSpec
from srt.layers.rotary_embedding import RotaryEmbedding
from srt.models.gemma2 import GemmaRMSNorm

BF16 = torch.bfloat16


class Recorder:
    """``reference_ops()`` that record each call's name."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.ops = {name: self._wrap(name, fn) for name, fn in reference_ops().items()}

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)

        return call

    def kernels(self) -> FusedKernels:
        return FusedKernels(self.ops)


def _bound(module, rec: Recorder):
    module.fused = rec.kernels()
    return module


def _norm(cls, hidden: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    m = cls(hidden, 1e-5, BF16)
    m.weight.data = (torch.randn(hidden, generator=gen) * 0.5 + 1.0).to(BF16)
    return m


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to bf16 rounding (the kernel rounds once, the torch code where HF does)."""
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("cls,op", [(RMSNorm, "rmsnorm"), (GemmaRMSNorm, "gemma_rmsnorm")])
def test_norm_takes_the_fused_kernel_and_agrees_with_the_torch_code(cls, op):
    x = torch.randn(5, 96).to(BF16)
    torch_out = _norm(cls, 96, 0)(x)
    rec = Recorder()
    out = _bound(_norm(cls, 96, 0), rec)(x)
    assert rec.calls == [op]
    assert torch.equal(out, reference_ops()[op](x, _norm(cls, 96, 0).weight, 1e-5))
    _close(out, torch_out)


@pytest.mark.parametrize(
    "cls,op", [(RMSNorm, "fused_add_rmsnorm"), (GemmaRMSNorm, "gemma_fused_add_rmsnorm")]
)
def test_add_norm_updates_residual_in_place(cls, op):
    gen = torch.Generator().manual_seed(1)
    x, res = (torch.randn(4, 64, generator=gen).to(BF16) for _ in range(2))
    want_norm, want_res = _norm(cls, 64, 2).forward_with_residual(x.clone(), res.clone())
    rec = Recorder()
    xs, rs = x.clone(), res.clone()
    out, new_res = _bound(_norm(cls, 64, 2), rec).forward_with_residual(xs, rs)
    assert rec.calls == [op]
    assert out is xs and new_res is rs  # FlashInfer's in-place contract
    torch.testing.assert_close(new_res, want_res, rtol=0, atol=0)  # the add rounds once either way
    _close(out, want_norm)


@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
def test_norm_heads_writes_into_the_qkv_output(cls):
    qkv = torch.randn(3, 8 * 64).to(BF16)
    q = qkv[:, : 4 * 64].view(3, 4, 64)
    want = _norm(cls, 64, 3)(q.clone())
    rec = Recorder()
    out = _bound(_norm(cls, 64, 3), rec).norm_heads(q)
    assert out.data_ptr() == qkv.data_ptr()  # still a view of qkv: K and V stay adjacent
    _close(qkv[:, : 4 * 64].view(3, 4, 64), want)


@pytest.mark.parametrize("cls,act", [(SiluAndMul, "silu_and_mul"), (GeluTanhAndMul, "gelu_tanh_and_mul")])
def test_act_and_mul(cls, act):
    x = torch.randn(2, 3, 128).to(BF16)
    rec = Recorder()
    out = _bound(cls(), rec)(x)
    assert rec.calls == [act] and out.shape == (2, 3, 64)
    _close(out, cls()(x))


def _rope(head_dim: int, rotary_dim: int, rope_type: str = "default", scaling=None) -> RotaryEmbedding:
    spec = RopeSpec(10000.0, head_dim, rotary_dim, rope_type, dict(scaling or {}), 256)
    return RotaryEmbedding(head_dim, 256, 10000.0, spec=spec)


ROPES = {
    "default": (128, 128, "default", None),
    "partial": (128, 96, "default", None),  # Phi-4-mini's 0.75
    "llama3": (
        64,
        64,
        "llama3",
        {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "yarn": (64, 64, "yarn", {"factor": 4.0, "original_max_position_embeddings": 64}),
    "longrope": (
        64,
        64,
        "longrope",
        {"short_factor": [1.0] * 32, "long_factor": [2.0] * 32, "original_max_position_embeddings": 64},
    ),
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_rotates_views_of_qkv_in_place(kind):
    head_dim, rotary_dim, rope_type, scaling = ROPES[kind]
    heads, kv_heads, t = 4, 2, 6
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim).to(BF16)
    positions = torch.tensor([0, 1, 5, 63, 64, 200])
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    want_q, want_k = _rope(head_dim, rotary_dim, rope_type, scaling)(positions, q.clone(), k.clone())
    rec = Recorder()
    out_q, out_k = _bound(_rope(head_dim, rotary_dim, rope_type, scaling), rec)(positions, q, k)
    assert rec.calls == ["rope"]
    assert out_q.data_ptr() == qkv.data_ptr()  # rotated in place
    _close(out_q, want_q)
    _close(out_k, want_k)


def _refused_cases():
    qkv = torch.randn(3, 4 * 96).to(BF16)
    return {
        "norm float32": (lambda: _norm(RMSNorm, 64, 0).float(), lambda m: m(torch.randn(3, 64))),
        "norm weight dtype": (
            lambda: _norm(RMSNorm, 64, 0).float(),
            lambda m: m(torch.randn(3, 64).to(BF16)),
        ),
        "act strided": (SiluAndMul, lambda m: m(torch.randn(4, 256).to(BF16)[:, :128])),
        "act float32": (SiluAndMul, lambda m: m(torch.randn(4, 128))),
        "act odd width": (SiluAndMul, lambda m: m(torch.randn(4, 12).to(BF16))),  # 6 bf16: not 16 bytes
        "rope head 96": (
            lambda: _rope(96, 96),
            lambda m: m(torch.arange(3), *(t.clone() for t in qkv.split([192, 192], dim=1))),
        ),
        "rope rotary 40": (
            lambda: _rope(64, 40),
            lambda m: m(torch.arange(3), torch.randn(3, 128).to(BF16), torch.randn(3, 64).to(BF16)),
        ),
        "rope 3-D": (
            lambda: _rope(64, 64),
            lambda m: m(torch.arange(3), torch.randn(3, 2, 64).to(BF16), torch.randn(3, 1, 64).to(BF16)),
        ),
    }


@pytest.mark.parametrize("case", list(_refused_cases()))
def test_inputs_a_kernel_cannot_take_run_the_torch_code(case):
    make, call = _refused_cases()[case]
    torch.manual_seed(0)
    plain = call(make())
    rec = Recorder()
    torch.manual_seed(0)
    fused = call(_bound(make(), rec))
    assert rec.calls == []
    for a, b in zip(
        plain if isinstance(plain, tuple) else (plain,), fused if isinstance(fused, tuple) else (fused,)
    ):
        assert torch.equal(a, b)


def test_off_reasons():
    cuda = torch.device("cuda")
    assert "CUDA only" in fused_kernels_off_reason(torch.device("cpu"), BF16, False)
    assert "--disable-fused-kernels" in fused_kernels_off_reason(cuda, BF16, True)
    assert "float32" in fused_kernels_off_reason(cuda, torch.float32, False)


# ---------------------------------------------------------------------- whole models
@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    from tests.helpers.tiny_gemma import save_tiny_gemma
    from tests.helpers.tiny_models import save_tiny_model

    root = tmp_path_factory.mktemp("fused")
    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return {
        "llama": save_tiny_model("llama", root / "llama", seed=4, **shape),
        "qwen3": save_tiny_model("qwen3", root / "qwen3", seed=5, **shape),
        "gemma3": save_tiny_gemma("gemma3", root / "gemma3", seed=6, **shape),
    }


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_model_with_fused_kernels_matches_its_torch_code(tiny_paths, kind):
    """Logits of a decode step (4 sequences over 24 cached random tokens) of a bf16 model on the
    CUDA code path's choices, with the fused ops (references) against without: within bf16
    rounding, same greedy tokens except where the top two logits are within that rounding."""
    from benchmarks.gpu.census import census_runner, decode_batch

    runs = {}
    for fused in (False, True):
        runner = census_runner(tiny_paths[kind])
        if fused:
            rec = Recorder()
            assert bind_fused_kernels(runner.model, rec.kernels()) == len(fused_layers(runner.model))
        fb = decode_batch(runner, [24] * 4, seed=7)
        with torch.inference_mode():
            runs[fused] = runner._run_model(fb).next_token_logits.float()
        if fused:
            assert {"rmsnorm", "rope"} <= set(rec.calls) or {"gemma_rmsnorm", "rope"} <= set(rec.calls)
    plain, fused = runs[False], runs[True]
    scale = plain.abs().max()
    assert (fused - plain).abs().max() <= 0.03 * scale  # measured: at most 0.011
    top2 = plain.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05 * scale
    assert torch.equal(plain.argmax(-1)[clear], fused.argmax(-1)[clear])


def test_model_runner_binds_nothing_on_cpu(tiny_paths):
    from benchmarks.gpu.census import census_runner

    runner = census_runner(tiny_paths["llama"])
    layers = fused_layers(runner.model)
    assert layers and all(m.fused is None for m in layers)
    kinds = {type(m).__name__ for m in layers}
    assert {"RMSNorm", "SiluAndMul", "RotaryEmbedding"} <= kinds

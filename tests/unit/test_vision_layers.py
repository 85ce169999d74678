"""srt's vision-tower layers (srt/models/vision_layers.py) against the transformers modules they
replace: the patch convolution as a matmul, quick-GELU in one pass, Qwen2-VL's rope attention, and
whole tiny towers (Qwen2-VL, Qwen2.5-VL with windows, CLIP, SigLIP) swapped as srt builds them,
same weights, same outputs, in float32 and bf16."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from srt.kernels import cpu as cpu_kernels
from srt.layers.linear_backend import create_linear_backend
from srt.layers.onednn_linear import onednn_bf16_available
from srt.models import qwen2_vl
from srt.models import vision_layers as vl
from srt.models.vision_common import srt_tower, use_srt_linears
from tests.helpers.tiny_vlm import build_tiny_vlm

BF16_EPS = 2.0**-7


@pytest.fixture(scope="module", params=["native", "fallback"])
def kernels(request):
    """Each test runs on the native kernels and on the pure-torch fallback of the same ops."""
    if request.param == "native":
        if not cpu_kernels.load(build_if_missing=True):
            pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.kernel_status()}")
        yield "native"
        return
    mp = pytest.MonkeyPatch()
    mp.setattr("srt.kernels.cpu.elementwise.native_available", lambda: False)
    yield "fallback"
    mp.undo()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "conv,shape",
    [
        (nn.Conv2d(3, 24, 14, stride=14, bias=True), (2, 3, 30, 44)),  # remainders dropped
        (nn.Conv2d(3, 16, 8, stride=8, bias=False), (1, 3, 64, 64)),
        (nn.Conv3d(3, 40, (2, 14, 14), stride=(2, 14, 14), bias=False), (5, 3, 2, 14, 14)),  # Qwen2-VL
        (nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4), bias=True), (2, 3, 5, 9, 12)),
    ],
)
def test_patch_conv_is_the_convolution(conv, shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    patch = vl.PatchConv(conv)
    assert vl.PatchConv.takes(conv)
    assert dict(patch.named_parameters()).keys() == dict(conv.named_parameters()).keys()
    with torch.no_grad():
        want, got = conv(x), patch(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        conv16, x16 = conv.bfloat16(), x.bfloat16()
        got16 = vl.PatchConv(conv16)(x16)
        assert got16.dtype == torch.bfloat16
        torch.testing.assert_close(got16.float(), conv16(x16).float(), atol=0.05, rtol=2 * BF16_EPS)


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(3, 8, 4, stride=2),
        nn.Conv2d(3, 8, 4, stride=4, padding=1),
        nn.Conv2d(4, 8, 4, stride=4, groups=2),
        nn.Conv2d(3, 8, 4, stride=4, dilation=2),
        nn.Conv1d(3, 8, 4, stride=4),
    ],
)
def test_patch_conv_refuses_other_convolutions(conv):
    assert not vl.PatchConv.takes(conv)


def test_quick_gelu_module_is_transformers(kernels):
    from transformers.activations import QuickGELUActivation

    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(7, 3, 45, generator=_gen(3)) * 5).to(dtype)
        want = QuickGELUActivation()(x)
        got = vl.QuickGelu()(x)
        assert got.shape == want.shape and got.dtype == dtype
        ulp = BF16_EPS if dtype == torch.bfloat16 else 1e-6
        assert bool(((got.double() - want.double()).abs() <= 2 * ulp * want.double().abs() + 1e-6).all())


def _hf_visual(kind: str, dtype: torch.dtype) -> tuple[nn.Module, object]:
    model = build_tiny_vlm(kind, seed=3)
    tower = model.model.visual if hasattr(model.model, "visual") else model.model.vision_tower
    return tower.to(dtype).eval(), model.config


def _srt_visual(kind: str, hf_tower: nn.Module, config, dtype: torch.dtype) -> nn.Module:
    if kind.startswith("qwen"):
        tower = qwen2_vl._tower(config.vision_config, config.model_type)
    else:
        tower = type(hf_tower)._from_config(config.vision_config)
    tower = srt_tower(tower.to(dtype), dtype, create_linear_backend("torch", dtype))
    tower.load_state_dict(hf_tower.state_dict(), strict=True)
    return tower


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    else:  # bf16 through a few layers: a flipped rounding or two grows by the layers' gains
        scale = want.float().abs().max()
        assert float((got.float() - want.float()).abs().max()) <= 4 * BF16_EPS * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_tower_swapped_gives_transformers_outputs(kernels, kind, dtype):
    hf, config = _hf_visual(kind, dtype)
    ours = _srt_visual(kind, hf, config, dtype)
    assert sum(isinstance(m, vl.RopeVisionAttention) for m in ours.modules()) == config.vision_config.depth
    assert sum(isinstance(m, vl.PatchConv) for m in ours.modules()) == 1
    if kind == "qwen2_vl":  # its MLP's activation is quick_gelu
        assert any(isinstance(m, vl.QuickGelu) for m in ours.modules())
    grid = torch.tensor([[1, 4, 6], [1, 6, 8], [1, 2, 2]])  # three images in one call
    n = int(grid.prod(-1).sum())
    patch = config.vision_config.patch_size
    pixels = torch.randn(n, 3 * 2 * patch * patch, generator=_gen(5)).to(dtype)
    with torch.no_grad():
        want = hf(pixels, grid_thw=grid)
        got = ours(pixels, grid_thw=grid)
    _check(got.last_hidden_state, want.last_hidden_state, dtype)
    _check(got.pooler_output, want.pooler_output, dtype)


def test_rope_attention_falls_back_to_transformers_for_another_table(kernels, monkeypatch):
    """cos/sin whose halves differ are no ``cat(freqs, freqs)`` rope: the module hands them to
    transformers' own function rather than rotating by a table that is not theirs."""
    hf, config = _hf_visual("qwen2_vl", torch.float32)
    ours = _srt_visual("qwen2_vl", hf, config, torch.float32)
    attn = next(m for m in ours.modules() if isinstance(m, vl.RopeVisionAttention))
    hf_attn = next(m for m in hf.modules() if type(m).__name__ == "VisionAttention")
    t, d = 12, attn.head_dim
    x = torch.randn(t, attn.qkv.in_features, generator=_gen(8))
    cos, sin = torch.randn(t, d, generator=_gen(9)), torch.randn(t, d, generator=_gen(10))
    assert vl._rope_table(cos, sin, d) is None
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with torch.no_grad():
        want = hf_attn(x, cu_seqlens=cu, position_embeddings=(cos, sin))
        got = attn(x, cu_seqlens=cu, position_embeddings=(cos, sin))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llava", "gemma3"])
def test_clip_and_siglip_towers_swapped_give_transformers_outputs(kernels, kind, dtype):
    hf, config = _hf_visual(kind, dtype)
    ours = _srt_visual(kind, hf, config, dtype)
    assert sum(isinstance(m, vl.PatchConv) for m in ours.modules()) == 1
    if kind == "llava":  # CLIP's activation is quick_gelu
        assert any(isinstance(m, vl.QuickGelu) for m in ours.modules())
    side = config.vision_config.image_size
    pixels = torch.randn(2, 3, side, side, generator=_gen(6)).to(dtype)
    with torch.no_grad():
        want = hf(pixels, output_hidden_states=True)
        got = ours(pixels, output_hidden_states=True)
    _check(got.last_hidden_state, want.last_hidden_state, dtype)
    _check(got.hidden_states[-2], want.hidden_states[-2], dtype)


def test_tower_linears_take_the_backend_for_many_rows():
    """bf16 towers on a CPU with AMX tiles run their linear layers on oneDNN's matmul over its
    blocked layout (``ONEDNN_BF16``: faster than srt's brgemm path at a tower's row counts);
    float32 towers, and bf16 ones without AMX, on srt's packed kernels. A child with the brgemm
    path off (``SRT_BF16_BRGEMM_M=0``) is the no-AMX case on any CPU."""
    if not cpu_kernels.load(build_if_missing=True):
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.kernel_status()}")
    from srt.layers.linear import Linear
    from srt.layers.linear_backend import TORCH_LINEAR, NativeLinear, amx_bf16_tiles
    from srt.layers.onednn_linear import ONEDNN_BF16

    native = create_linear_backend("native", torch.bfloat16)
    assert isinstance(native, NativeLinear)
    amx = amx_bf16_tiles() and torch.backends.mkldnn.is_available()
    assert native.for_many_rows(torch.float32) is native
    assert native.for_many_rows(torch.bfloat16) is (ONEDNN_BF16 if amx else native)
    assert TORCH_LINEAR.for_many_rows(torch.bfloat16) is TORCH_LINEAR
    hf, config = _hf_visual("qwen2_vl", torch.bfloat16)
    tower = srt_tower(qwen2_vl._tower(config.vision_config, config.model_type), torch.bfloat16, native)
    backends = {type(m.linear_backend) for m in tower.modules() if isinstance(m, Linear)}
    assert backends == {type(native.for_many_rows(torch.bfloat16))}
    code = (
        "import torch; from srt.kernels import cpu; cpu.load();"
        "from srt.layers.linear_backend import create_linear_backend as c;"
        "b = c('native', torch.bfloat16); print(b.for_many_rows(torch.bfloat16) is b)"
    )
    env = {**os.environ, "SRT_BF16_BRGEMM_M": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]


def test_rope_attention_takes_the_angles_alone(kernels):
    """A block that passes ``rotary_pos_emb`` (the angles) instead of ``position_embeddings``
    (transformers 4's) gets the same result as with their cos and sin."""
    hf, config = _hf_visual("qwen2_vl", torch.float32)
    ours = _srt_visual("qwen2_vl", hf, config, torch.float32)
    attn = next(m for m in ours.modules() if isinstance(m, vl.RopeVisionAttention))
    t = 10
    x = torch.randn(t, attn.qkv.in_features, generator=_gen(11))
    freqs = torch.randn(t, attn.head_dim // 2, generator=_gen(12))
    emb = torch.cat((freqs, freqs), dim=-1)
    cu = torch.tensor([0, t], dtype=torch.int32)
    with torch.no_grad():
        want = attn(x, cu_seqlens=cu, position_embeddings=(emb.cos(), emb.sin()))
        got = attn(x, cu_seqlens=cu, rotary_pos_emb=freqs)
    assert torch.equal(got, want)
    assert vl.use_rope_vision_attention(hf, None, None) is hf  # an unknown class: left alone


@pytest.mark.parametrize("kind", ["qwen2_vl", "llava"])
def test_towers_on_onednn_bf16_give_transformers_outputs(kind):
    """The backend bf16 towers take on AMX CPUs, on any CPU whose oneDNN runs bf16: each linear weight held in
    oneDNN's blocked layout alone (the plain one released), the tower's outputs transformers'."""
    if not onednn_bf16_available():
        pytest.skip("torch's oneDNN has no bf16 matmul on this CPU (it needs AVX-512 or AVX-NE-CONVERT)")
    from srt.layers.linear import Linear
    from srt.layers.onednn_linear import ONEDNN_BF16

    hf, config = _hf_visual(kind, torch.bfloat16)
    tower = qwen2_vl._tower(config.vision_config, config.model_type) if kind.startswith("qwen") else None
    tower = tower if tower is not None else type(hf)._from_config(config.vision_config)
    tower = vl.use_fast_tower_layers(use_srt_linears(tower.to(torch.bfloat16), torch.bfloat16, ONEDNN_BF16))
    tower = tower.eval()
    tower.load_state_dict(hf.state_dict(), strict=True)
    linears = [m for m in tower.modules() if isinstance(m, Linear)]
    for m in linears:
        m.prepare_weights()
    assert linears and all(m.weight.is_meta and m.packed_weight.is_mkldnn for m in linears)
    with torch.no_grad():
        if kind == "qwen2_vl":
            grid = torch.tensor([[1, 4, 6], [1, 2, 2]])
            patch = config.vision_config.patch_size
            n = int(grid.prod(-1).sum())
            pixels = torch.randn(n, 3 * 2 * patch * patch, generator=_gen(11)).bfloat16()
            want, got = hf(pixels, grid_thw=grid), tower(pixels, grid_thw=grid)
        else:
            side = config.vision_config.image_size
            pixels = torch.randn(2, 3, side, side, generator=_gen(12)).bfloat16()
            want, got = hf(pixels), tower(pixels)
    _check(got.last_hidden_state, want.last_hidden_state, torch.bfloat16)


def test_onednn_bf16_backend_other_inputs():
    """Weights it does not pack stay plain (F.linear); a float32 input of a packed layer gets the
    weight's values in float32; autograd through a released weight is refused."""
    if not onednn_bf16_available():
        pytest.skip("torch's oneDNN has no bf16 matmul on this CPU (it needs AVX-512 or AVX-NE-CONVERT)")
    from srt.layers.onednn_linear import ONEDNN_BF16

    w = torch.randn(40, 64, generator=_gen(13)).bfloat16()
    assert ONEDNN_BF16.pack_weight(w.float()) is None
    packed = ONEDNN_BF16.pack_weight(w)
    x = torch.randn(300, 64, generator=_gen(14))
    want = torch.nn.functional.linear(x, w.float())
    torch.testing.assert_close(ONEDNN_BF16.apply(x, w, None, packed), want)
    got = ONEDNN_BF16.apply(x.bfloat16(), w, None, packed).float()
    assert float((got - want).abs().max()) <= 4 * BF16_EPS * float(want.abs().max())
    with pytest.raises(RuntimeError, match="CPU inference only"):
        ONEDNN_BF16.apply(x.bfloat16().requires_grad_(), w, None, packed)

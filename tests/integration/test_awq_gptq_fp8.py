"""AWQ (AutoAWQ's GEMM layout), GPTQ (4- and 8-bit, symmetric and with zero points, activation
order) and fine-grained FP8 (blocks) checkpoints served with default flags through the real Engine:
AWQ / GPTQ layers kept as GGUF blocks on srt's kernels holding the checkpoint's values, FP8 codes
and block scales kept in bf16 serving (dequantized to float32 with float32 activations); greedy
tokens equal to the reference's up to the near-tie rule.

References: for AWQ and GPTQ the float32 model holding the exact values of the codes, computed in
tests/helpers/awq_gptq_models.py before packing (transformers needs AutoAWQ / GPTQModel to load
these formats, which are not test dependencies); for FP8 transformers' own load of the folder (on
a CPU it dequantizes the blocks itself).
"""

from __future__ import annotations

import pytest
import torch

from srt.configs.cpu_features import cpu_bf16_units
from srt.configs.quant_config import UnsupportedQuantizationError
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs
from tests.helpers.awq_gptq_models import save_block_fp8, save_quantized
from tests.helpers.hf_reference import make_prompts
from tests.helpers.quantized_serving import serve_and_match
from tests.helpers.tiny_models import build_tiny_hf_model

KEPT = {  # scheme -> (served --quantization, ggml type id of the blocks)
    "awq": ("awq", 3),
    "gptq": ("gptq", 2),
    "gptq_asym": ("gptq", 3),
    "gptq_int8": ("gptq", 8),
}
PROJECTIONS = (  # module, srt's fused projection, the checkpoint's layers in it
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", "o_proj", ("o_proj",)),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp", "down_proj", ("down_proj",)),
)
BATCH = make_prompts([4, 11, 37], seed=1, vocab_size=320)


def _model():
    return build_tiny_hf_model("llama", seed=7)


@pytest.mark.parametrize("scheme", sorted(KEPT))
def test_awq_and_gptq_layers_are_kept_as_blocks_and_serve_the_references_tokens(tmp_path, scheme):
    path, ref = save_quantized(_model(), tmp_path / scheme, scheme)
    served_as, qtype = KEPT[scheme]
    runner = ModelRunner(ServerArgs(model_path=path, max_total_tokens=512, gguf_float32_rows=0).resolve())
    layer = runner.model.model.layers[1]
    for owner, fused, parts in PROJECTIONS:
        proj = getattr(getattr(layer, owner), fused)
        q = proj.qweight
        assert q is not None and {s[2] for s in q.segments} == {qtype}, fused
        # the blocks hold the checkpoint's values (Q4_1's offsets rounded to float16: 2^-11 of them)
        want = torch.cat([ref.get_submodule(f"model.layers.1.{owner}.{p}").weight for p in parts])
        with torch.no_grad():
            got = proj(torch.eye(q.in_features)).t()
            want = want.detach()
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * float(want.abs().max()))
    del runner
    serve_and_match(path, BATCH, lambda: ref, served_as)


def test_gptq_in_activation_order_is_refused_kept_and_served_dequantized(tmp_path):
    path, ref = save_quantized(_model(), tmp_path / "actorder", "gptq_actorder")
    with pytest.raises(UnsupportedQuantizationError, match="desc_act.*--quantization none"):
        ServerArgs(model_path=path, device="cpu").resolve()
    serve_and_match(path, BATCH, lambda: ref, None, quantization="none")


def test_awq_with_groups_of_128_on_a_wider_model(tmp_path):
    model = build_tiny_hf_model("llama", seed=3, hidden_size=128, intermediate_size=256)
    path, ref = save_quantized(model, tmp_path / "awq128", "awq", group=128)
    serve_and_match(path, make_prompts([6, 20], seed=4, vocab_size=320), lambda: ref, "awq")


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_block_fp8_serves_the_weights_transformers_dequantizes_to(tmp_path, dtype):
    """``--dtype auto``: the checkpoint's bf16 where the CPU computes in bf16, the codes and block
    scales kept as they are (one byte a code where the CPU widens them on vectors,
    srt/kernels/cpu/fp8_linear.cpp; each weight widens to bf16(code x scale), what transformers
    dequantizes a bf16 model to) against transformers in bf16; ``--dtype float32``: dequantized to
    float32 at load, against transformers in float32."""
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints through accelerate")
    from transformers import AutoModelForCausalLM

    served = "bfloat16" if dtype == "auto" and cpu_bf16_units() else "float32"
    path = save_block_fp8(_model(), tmp_path / "fp8", block=(32, 32))
    if served == "bfloat16":
        runner = ModelRunner(ServerArgs(model_path=path, max_total_tokens=512).resolve())
        proj = runner.model.model.layers[0].self_attn.qkv_proj
        kept = bool(torch.ops.srt_cpu.fp8_fast_blocks())
        assert (proj.fp8_block == (32, 32)) == kept, proj.fp8_block
        assert proj.packed_weight.dtype == (torch.uint8 if kept else torch.bfloat16)
        del runner

    def load_ref():
        return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, served)).eval()

    kw = {} if dtype == "auto" else {"dtype": "float32"}
    serve_and_match(path, BATCH, load_ref, "none", served, served, **kw)

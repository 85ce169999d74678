"""Rope types, partial rotary and the start-up checks of rope settings, against transformers'
``ROPE_INIT_FUNCTIONS`` on the same configs.

The reference cos/sin rows are transformers' own formula: ``cat(cos(p * inv_freq), sin(p *
inv_freq)) * attention factor`` for the ``(inv_freq, attention factor)`` its init function returns.
For the per-position types (longrope, dynamic NTK) rows below the original context are compared
with transformers' short / unscaled choice and rows beyond with its long / scaled one.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

from srt.kernels import cpu as cpu_kernels
from srt.layers.rope_scaling import cos_sin_table, parse_rope
from srt.layers.rotary_embedding import RotaryEmbedding, get_rope
from srt.utils.errors import ConfigError, UnsupportedModelError
from tests.helpers.tolerance import assert_reordered_close

HEAD_DIM = 32
MAX_POS = 256  # the config's max_position_embeddings
ORIG = 64
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIG}  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG}


def _config(scaling: dict | None, partial: float = 1.0, **kw) -> LlamaConfig:
    fields = dict(hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=HEAD_DIM, max_position_embeddings=MAX_POS, rope_theta=10000.0,
                  rope_scaling=None if scaling is None else dict(scaling))  # fmt: skip
    if partial != 1.0:
        fields["partial_rotary_factor"] = partial
    fields.update(kw)
    return LlamaConfig(**fields)


def _hf_rows(inv_freq: torch.Tensor, attn: float, positions: torch.Tensor) -> torch.Tensor:
    freqs = torch.outer(positions.float(), inv_freq.float())
    return torch.cat((freqs.cos() * attn, freqs.sin() * attn), dim=-1)


def _factors(n: int, lo: float, hi: float) -> list[float]:
    return torch.linspace(lo, hi, n).tolist()


STATIC = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": LLAMA3,
    "yarn": YARN,
    "yarn_no_truncate": {**YARN, "truncate": False, "beta_fast": 16, "beta_slow": 2},
    "yarn_mscale": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn_attention_factor": {**YARN, "attention_factor": 1.3},
}


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("kind", list(STATIC))
def test_static_types_match_transformers(kind, partial):
    config = _config(STATIC[kind], partial)
    spec = parse_rope(config, HEAD_DIM)
    assert spec.rotary_dim == int(HEAD_DIM * partial)
    if kind == "default":
        inv, attn = ROPE_INIT_FUNCTIONS["linear"](_config({"rope_type": "linear", "factor": 1.0}, partial))
    else:
        inv, attn = ROPE_INIT_FUNCTIONS[STATIC[kind]["rope_type"]](config, "cpu")
    if kind.startswith("yarn"):
        assert attn != 1.0  # the attention factor is exercised
    positions = torch.arange(MAX_POS)
    ours = cos_sin_table(spec, MAX_POS)
    torch.testing.assert_close(ours, _hf_rows(inv, attn, positions), atol=1e-6, rtol=0)


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_short_rows_then_long_rows(partial):
    half = int(HEAD_DIM * partial) // 2
    scaling = {"rope_type": "longrope", "short_factor": _factors(half, 1.0, 2.0),
               "long_factor": _factors(half, 1.0, 16.0), "original_max_position_embeddings": ORIG}  # fmt: skip
    config = _config(scaling, partial)
    ours = cos_sin_table(parse_rope(config, HEAD_DIM), MAX_POS)
    short, attn = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=ORIG)
    long, attn_long = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=ORIG + 1)
    assert attn == attn_long > 1.0 and not torch.equal(short, long)
    positions = torch.arange(MAX_POS)
    torch.testing.assert_close(ours[:ORIG], _hf_rows(short, attn, positions[:ORIG]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[ORIG:], _hf_rows(long, attn, positions[ORIG:]), atol=1e-6, rtol=0)


def test_longrope_attention_factor_from_config():
    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
               "original_max_position_embeddings": ORIG, "attention_factor": 1.25}  # fmt: skip
    config = _config(scaling)
    ours = cos_sin_table(parse_rope(config, HEAD_DIM), 8)
    inv, attn = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    assert attn == 1.25
    torch.testing.assert_close(ours, _hf_rows(inv, attn, torch.arange(8)), atol=1e-6, rtol=0)


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_dynamic_ntk_unscaled_within_context_scaled_beyond(partial):
    config = _config({"rope_type": "dynamic", "factor": 2.0}, partial)
    table_len = 4 * MAX_POS  # a table past the config's context: its length is the NTK length
    ours = cos_sin_table(parse_rope(config, HEAD_DIM), table_len)
    plain, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu")
    scaled, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=table_len)
    positions = torch.arange(table_len)
    torch.testing.assert_close(ours[:MAX_POS], _hf_rows(plain, 1.0, positions[:MAX_POS]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[MAX_POS:], _hf_rows(scaled, 1.0, positions[MAX_POS:]), atol=1e-5, rtol=0)
    # within the config's context the built rope is transformers' plain one
    torch.testing.assert_close(get_rope(HEAD_DIM, config).cos_sin_cache, ours[:MAX_POS])


# ---------------------------------------------------------------- start-up errors
def test_unknown_rope_type_is_a_startup_error():
    config = _config(None)
    config.rope_parameters = {"rope_type": "mrope", "rope_theta": 10000.0, "mrope_section": [4, 4, 8]}
    with pytest.raises(UnsupportedModelError, match="mrope"):
        get_rope(HEAD_DIM, config)


@pytest.mark.parametrize(
    "scaling,key",
    [
        ({**YARN, "extrapolation_mode": "x"}, "extrapolation_mode"),
        ({"rope_type": "linear", "factor": 2.0, "mrope_section": [4, 4]}, "mrope_section"),
    ],  # fmt: skip
)
def test_unsupported_rope_key_is_a_startup_error(scaling, key):
    config = _config(None)
    config.rope_parameters = {**scaling, "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match=key):
        get_rope(HEAD_DIM, config)


def test_malformed_rope_values_are_config_errors():
    config = _config(None)
    config.rope_parameters = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}
    with pytest.raises(ConfigError, match="low_freq_factor"):
        get_rope(HEAD_DIM, config)
    config.rope_parameters = {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3,
                              "original_max_position_embeddings": ORIG, "rope_theta": 1e4}  # fmt: skip
    with pytest.raises(ConfigError, match="short_factor"):
        get_rope(HEAD_DIM, config)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        get_rope(HEAD_DIM, config)


# ---------------------------------------------------------------- applying the rope
def _qk(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, 8 * HEAD_DIM, generator=gen)
    q, k, _ = qkv.split([4 * HEAD_DIM, 2 * HEAD_DIM, 2 * HEAD_DIM], dim=-1)  # strided views
    return q, k


@pytest.mark.parametrize("partial", [0.75, 0.5])
def test_partial_rotary_matches_transformers_apply(partial):
    config = _config(None, partial)
    rope = get_rope(HEAD_DIM, config)
    positions = torch.tensor([0, 3, 17, 63, 64, 200, 5])
    q, k = _qk(len(positions), 1)
    q_out, k_out = rope(positions, q, k)
    rows = rope.cos_sin_cache[positions]
    cos, sin = rows.chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
    q_ref, k_ref = apply_rotary_pos_emb(
        q.reshape(1, -1, 4, HEAD_DIM).transpose(1, 2), k.reshape(1, -1, 2, HEAD_DIM).transpose(1, 2), cos, sin
    )
    # a rotation is a sum of two products per element (a reduction of length 2)
    assert_reordered_close(q_out.view(-1, 4, HEAD_DIM), q_ref[0].transpose(0, 1), 2)
    assert_reordered_close(k_out.view(-1, 2, HEAD_DIM), k_ref[0].transpose(0, 1), 2)
    rot = rope.rotary_dim
    assert torch.equal(q_out.view(-1, 4, HEAD_DIM)[..., rot:], q.reshape(-1, 4, HEAD_DIM)[..., rot:])


def test_full_rotary_float32_keeps_the_native_in_place_path():
    if not cpu_kernels.load(build_if_missing=True):
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.kernel_status()}")
    rope = get_rope(HEAD_DIM, _config(YARN))  # attention factor baked into the table
    positions = torch.tensor([0, 1, 100, 255])
    q, k = _qk(4, 2)
    q_ref, k_ref = rope(positions, q.reshape(4, 4, HEAD_DIM), k.reshape(4, 2, HEAD_DIM))  # 3-D: torch path
    q_out, k_out = rope(positions, q, k)
    assert q_out is q and k_out is k  # rotated in place
    assert_reordered_close(q_out, q_ref.view(4, -1), 2)  # native kernel (FMA) against torch's ops
    assert_reordered_close(k_out, k_ref.view(4, -1), 2)


def test_rope_of_a_position_does_not_depend_on_the_batch():
    rope = RotaryEmbedding(HEAD_DIM, 512, 10000.0)
    long = parse_rope(_config({"rope_type": "longrope", "short_factor": [1.0] * 16,
                     "long_factor": [4.0] * 16, "original_max_position_embeddings": ORIG}), HEAD_DIM)  # fmt: skip
    for r in (rope, RotaryEmbedding(HEAD_DIM, MAX_POS, long.base, spec=long)):
        q, k = _qk(3, 3)
        alone = r(torch.tensor([0, 1, 2]), q.clone(), k.clone())
        q2, k2 = _qk(6, 3)
        batched = r(torch.tensor([0, 1, 2, 100, 150, 200]), q2.clone(), k2.clone())
        torch.testing.assert_close(batched[0][:3], alone[0], atol=0, rtol=0)
        torch.testing.assert_close(batched[1][:3], alone[1], atol=0, rtol=0)

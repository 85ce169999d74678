"""Rope parameters of a transformers config, checked, and the cos/sin table they give.

``parse_rope(config, head_dim)`` reads ``rope_theta``, ``partial_rotary_factor`` and the scaling
dict (v5 ``rope_parameters`` or v4 ``rope_theta`` + ``rope_scaling``) into a ``RopeSpec``; an
unknown rope type, or a key srt does not implement for that type, raises
``UnsupportedModelError`` naming it (a malformed value: ``ConfigError``).

``cos_sin_table(spec, max_position)`` is ``[max_position, rotary_dim]`` float32: for position p
and inverse frequencies ``inv_freq [rotary_dim/2]``, ``[cos(p*inv_freq) | sin(p*inv_freq)] * attention
factor``. Per rope type (same formulas as transformers' ``ROPE_INIT_FUNCTIONS``):

    default   inv_freq[i] = base^(-2i/rotary_dim)
    linear    default / factor
    llama3    low frequencies / factor, high ones kept, a smooth blend in between
    yarn      interpolation (/ factor) and extrapolation blended by a linear ramp between the
              correction dims of beta_fast / beta_slow (floored / ceiled unless truncate=False);
              attention factor ``attention_factor`` or 0.1*mscale*ln(factor) + 1 (mscale ratio)
    longrope  base^(-2i/rotary_dim) / ext_factor[i], ext_factor = short_factor or long_factor;
              attention factor ``attention_factor`` or sqrt(1 + ln(factor) / ln(original))
    dynamic   NTK: base * (factor * L / M - (factor - 1))^(d/(d-2)) for sequence length L > M

transformers chooses longrope's factor set and dynamic NTK's base once per forward from the
longest position in the batch, so a sequence's result would depend on what it is batched with.
srt chooses per position instead, the same for every sequence under any batching:

    position < original context (``original_max_position_embeddings``; dynamic: M =
    ``max_position_embeddings``):  short factors / the unscaled base (what transformers uses
                                    for a sequence that fits the original context)
    position >= original context:  long factors / the NTK base of L = the table's length

so a sequence within the original context gets exactly transformers' rope, and positions beyond
get the long-context frequencies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from srt.utils.errors import ConfigError, UnsupportedModelError

# keys every rope dict may carry, then per rope type: (required keys, optional keys)
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
_TYPE_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "default": (frozenset(), frozenset()),
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor"}), frozenset()),
    "llama3": (
        frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
        frozenset(),
    ),
    "yarn": (
        frozenset({"factor", "original_max_position_embeddings"}),
        frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    ),
    "longrope": (
        frozenset({"short_factor", "long_factor", "original_max_position_embeddings"}),
        frozenset({"factor", "attention_factor"}),
    ),
}
_ALIASES = {"su": "longrope"}  # Phi-3's early name for longrope
SUPPORTED_ROPE_TYPES = tuple(_TYPE_KEYS)


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """A model's rope: ``rotary_dim`` (<= head_dim) dims of each head rotate, the rest pass."""

    base: float
    head_dim: int
    rotary_dim: int
    rope_type: str = "default"
    scaling: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 2048


def _rope_dict(config) -> tuple[float, dict[str, Any]]:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and "rope_theta" in params:
        return float(params["rope_theta"]), dict(params)
    theta = float(getattr(config, "rope_theta", None) or 10000.0)
    return theta, dict(getattr(config, "rope_scaling", None) or {})


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return _ALIASES.get(rope_type, rope_type)


def check_rope_keys(scaling: dict[str, Any], rope_type: str) -> None:
    """``UnsupportedModelError`` for an unknown type or a key srt does not implement; ``ConfigError``
    for a missing required key."""
    if rope_type not in _TYPE_KEYS:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    required, optional = _TYPE_KEYS[rope_type]
    unknown = sorted(set(scaling) - _COMMON_KEYS - required - optional)
    if unknown:
        raise UnsupportedModelError(
            f"rope parameter(s) {', '.join(map(repr, unknown))} of rope type {rope_type!r} are not "
            "supported by srt"
        )
    missing = sorted(required - set(scaling))
    if missing:
        raise ConfigError(f"rope type {rope_type!r} needs {', '.join(map(repr, missing))} in rope_scaling")


def parse_rope(config, head_dim: int) -> RopeSpec:
    """The checked ``RopeSpec`` of a transformers config (module docstring)."""
    base, scaling = _rope_dict(config)
    rope_type = rope_type_of(scaling)
    if rope_type in ("llama3", "yarn", "longrope") and "original_max_position_embeddings" not in scaling:
        orig = getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings
        scaling["original_max_position_embeddings"] = orig  # transformers' default
    check_rope_keys(scaling, rope_type)
    factor = scaling.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    rotary_dim = int(head_dim * float(factor)) if factor is not None else head_dim
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ConfigError(
            f"partial_rotary_factor {factor} gives {rotary_dim} rotary dims of head_dim {head_dim}; "
            "it must be even and in (0, head_dim]"
        )
    max_pos = int(getattr(config, "max_position_embeddings", None) or 2048)
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != rotary_dim // 2:
                raise ConfigError(
                    f"rope {key} has {len(scaling[key])} entries; {rotary_dim // 2} expected (rotary_dim / 2)"
                )
    kept = {k: v for k, v in scaling.items() if k not in _COMMON_KEYS}
    return RopeSpec(base, head_dim, rotary_dim, rope_type, kept, max_pos)


# ---------------------------------------------------------------- inverse frequencies
def default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def llama3_inv_freq(dim: int, base: float, s: dict[str, Any]) -> torch.Tensor:
    inv_freq = default_inv_freq(dim, base)
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_context_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context_len / low, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context_len / high) & (wavelen <= old_context_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN's ``(inv_freq, attention factor)``."""
    orig = s["original_max_position_embeddings"]
    factor = s["factor"] if s.get("factor") is not None else max_pos / orig
    attn = s.get("attention_factor")
    if attn is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all:
            attn = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attn = _yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn)


def longrope_inv_freq(dim: int, base: float, ext_factors: list[float]) -> torch.Tensor:
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * base**shape)


def longrope_attention_factor(s: dict[str, Any], max_pos: int) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    orig = s["original_max_position_embeddings"]
    factor = s["factor"] if s.get("factor") is not None else max_pos / orig
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


def dynamic_inv_freq(dim: int, base: float, factor: float, seq_len: int, max_pos: int) -> torch.Tensor:
    """Dynamic NTK's inverse frequencies for a sequence of ``seq_len`` (unscaled up to ``max_pos``)."""
    seq_len = max(seq_len, max_pos)
    scaled = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return default_inv_freq(dim, scaled)


def static_inv_freq(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention factor)`` of the types whose frequencies do not depend on position."""
    dim, base, s = spec.rotary_dim, spec.base, spec.scaling
    if spec.rope_type == "default":
        return default_inv_freq(dim, base), 1.0
    if spec.rope_type == "linear":
        return default_inv_freq(dim, base) / float(s["factor"]), 1.0
    if spec.rope_type == "llama3":
        return llama3_inv_freq(dim, base, s), 1.0
    if spec.rope_type == "yarn":
        return yarn_inv_freq(dim, base, s, spec.max_position_embeddings)
    raise UnsupportedModelError(f"rope type {spec.rope_type!r} has position-dependent frequencies")


# ---------------------------------------------------------------- the table
def _rows(start: int, end: int, inv_freq: torch.Tensor, attention_factor: float) -> torch.Tensor:
    freqs = torch.outer(torch.arange(start, end, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat((cos, sin), dim=-1)


def cos_sin_table(spec: RopeSpec, max_position: int) -> torch.Tensor:
    """float32 ``[max_position, rotary_dim]``: ``[cos | sin]`` per position (module docstring)."""
    dim, s = spec.rotary_dim, spec.scaling
    if spec.rope_type == "longrope":
        orig = int(s["original_max_position_embeddings"])
        attn = longrope_attention_factor(s, spec.max_position_embeddings)
        split = min(orig, max_position)
        short = _rows(0, split, longrope_inv_freq(dim, spec.base, s["short_factor"]), attn)
        long = _rows(split, max_position, longrope_inv_freq(dim, spec.base, s["long_factor"]), attn)
        return torch.cat((short, long))
    if spec.rope_type == "dynamic":
        orig = spec.max_position_embeddings
        split = min(orig, max_position)
        plain = _rows(0, split, default_inv_freq(dim, spec.base), 1.0)
        inv = dynamic_inv_freq(dim, spec.base, float(s["factor"]), max_position, orig)
        return torch.cat((plain, _rows(split, max_position, inv, 1.0)))
    inv_freq, attn = static_inv_freq(spec)
    return _rows(0, max_position, inv_freq, attn)

"""Random-weight Llama GGUF files of any shape and quantization type, for tests and benchmarks.

``write_llama_gguf(path, hidden=..., intermediate=..., layers=..., heads=..., kv_heads=..., vocab=...)``
writes a Llama-architecture GGUF the way llama.cpp's converter lays one out (same metadata
conventions as ``tiny_models.save_tiny_gguf``: ``llama.*`` hyper-parameters, q/k rows in
llama.cpp's rope order, norms F32, untied ``output.weight``), so srt (and llama.cpp) can load
big model shapes without downloading a model. Tensors are generated and written one at a time
(``GGUFWriter.add_tensor_info`` for the table, then ``write_tensor_data`` per tensor), so the
process never holds more than the largest tensor.

Quantization (``qtype_scheme``):

    "Q4_K_M"  llama.cpp's Q4_K_M mix: attn_q/k/output, ffn_gate/up and token_embd Q4_K;
              output.weight Q6_K; attn_v and ffn_down Q6_K in the layers llama.cpp gives "more
              bits" (the first and last eighth of the layers and every third layer in between,
              ``more_bits_layer``), Q4_K in the others
    a type    "F32", "F16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K" or "Q6_K" for every matrix

A matrix whose row length is not a multiple of its type's block falls back to Q8_0 (rows of a
multiple of 32), else F32 (as llama.cpp falls back for K-quants). Norm weights are always F32.

Weights: with ``fast_random=False`` float32 N(0, ``weight_std``) matrices (norms 1 + N(0, 0.1))
are quantized: Q4_0/Q4_1/Q8_0/F16 by ``gguf.quants.quantize``, Q4_K/Q5_K/Q6_K by this module's
reference encoder ``quantize_kquant``. With ``fast_random=True`` the blocks are drawn directly:
random code bytes with finite fp16 scale fields (and 6-bit sub-block scales) chosen so the
dequantized weights have mean ~0 and std ~``weight_std``; this writes a 7B-shape Q4_K_M file
(~4 GB) in a few seconds per GB with memory bounded by one tensor.

Tokenizer: ``tokenizer_from=<a GGUF>`` copies every ``tokenizer.*`` metadata key of that file
(the vocabulary size then is that tokenizer's), so srt's server/Engine can tokenize; without
it the file has bos=1 / eos=2 ids and no tokenizer (use input_ids / ``skip_tokenizer_init``).

K-quant encoders (``quantize_kquant``), simple and not optimal, but every value within half a
quantization step of its input:

    Q4_K / Q5_K  super-block of 256 = 8 sub-blocks of 32, w = d*sc*q - dmin*m, q in 0..15 / 0..31.
                 Per sub-block: offset = -min(min(x), 0) and range max(x) + offset; dmin and d
                 (fp16) are the largest offset / 63 and range / (63*qmax), rounded up to the
                 next fp16; m = ceil(offset/dmin) and sc = ceil(range/(qmax*d)) (6 bits), so
                 the grid [-dmin*m, -dmin*m + qmax*d*sc] covers the sub-block; q = round.
    Q6_K         super-block of 256 = 16 sub-blocks of 16, w = d*sc*q, q in -32..31, sc int8:
                 sub-block scale max|x|/31, d = largest / 127 rounded up, sc = ceil(scale/d).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

SHAPES: dict[str, dict[str, int]] = {
    "1b": dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8),
    "7b": dict(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32),
}

QK_K = 256
MOE_ARCH = "qwen3moe"  # the GGUF architecture of files written with experts
SCHEMES = ("Q4_K_M", "F32", "F16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
KQUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")

# llama.cpp's general.file_type (LLAMA_FTYPE_*) of each scheme
_FILE_TYPES = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q4_K": 14,  # "mostly Q4_K_S"
    "Q4_K_M": 15,
    "Q5_K": 16,  # "mostly Q5_K_S"
    "Q6_K": 18,
}


def _qtype(qtype: Any):
    """``gguf.GGMLQuantizationType`` of a name ("Q4_K"), an int or the enum itself."""
    from gguf import GGMLQuantizationType

    if isinstance(qtype, str):
        return GGMLQuantizationType[qtype.upper()]
    return GGMLQuantizationType(int(qtype))


# ---------------------------------------------------------------------------------- encoders
def _f16_ceil(x: np.ndarray) -> np.ndarray:
    """The smallest fp16 >= x (x >= 0 float32), as float16."""
    h = np.minimum(x, np.float32(65504.0)).astype(np.float16)
    low = h.astype(np.float32) < x
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def _div_or_zero(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1), 0).astype(np.float32)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """12 bytes per super-block holding 8 six-bit scales ``sc`` and 8 six-bit mins ``m``
    (uint8 [n, 8] each) in the Q4_K/Q5_K layout: bytes 0-3 = sc[0:4] (low 6 bits) with bits
    4-5 of sc[4:8] on top; bytes 4-7 likewise for m; bytes 8-11 = low nibbles of sc[4:8] and
    (high nibble) of m[4:8]."""
    sc = sc.astype(np.uint8)
    m = m.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return out


def _pack_nibbles_32(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] 4-bit values -> [n, 128]: byte 32*i + l = q[2i][l] | q[2i+1][l] << 4."""
    q = q.astype(np.uint8).reshape(q.shape[0], 4, 2, 32)
    return (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(q.shape[0], 128)


def _encode_q45k(x: np.ndarray, qmax: int) -> tuple[np.ndarray, ...]:
    """Q4_K (qmax 15) / Q5_K (qmax 31) parameters of blocks ``x`` [n, 256]:
    (d f16 [n], dmin f16 [n], sc [n, 8], m [n, 8], q [n, 8, 32]) (module docstring)."""
    x = x.reshape(-1, 8, 32)
    offset = -np.minimum(x.min(axis=-1), 0)  # >= 0
    dmin = _f16_ceil(offset.max(axis=-1) / np.float32(63))
    dmin32 = dmin.astype(np.float32)[:, None]
    m = np.clip(np.ceil(_div_or_zero(offset, dmin32)), 0, 63)
    lo = -(dmin32 * m.astype(np.float32))  # what the decoder subtracts (float32)
    span = np.maximum(x.max(axis=-1) - lo, 0)
    d = _f16_ceil(span.max(axis=-1) / np.float32(63 * qmax))
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.ceil(_div_or_zero(span, np.float32(qmax) * d32)), 0, 63)
    step = (d32 * sc.astype(np.float32))[..., None]
    q = np.clip(np.rint(_div_or_zero(x - lo[..., None], step)), 0, qmax)
    return d, dmin, sc, m, q


def _q4k_blocks(d, dmin, sc, m, q) -> np.ndarray:
    n = q.shape[0]
    return np.concatenate(
        [
            d.reshape(n, 1).view(np.uint8),
            dmin.reshape(n, 1).view(np.uint8),
            _pack_k_scales(sc, m),
            _pack_nibbles_32(q),
        ],
        axis=1,
    )


def _q5k_blocks(d, dmin, sc, m, q) -> np.ndarray:
    n = q.shape[0]
    q = q.astype(np.uint8).reshape(n, 8, 32)
    high = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    qh = np.bitwise_or.reduce(high, axis=1)  # [n, 32]: bit j of byte l = bit 4 of q[j][l]
    return np.concatenate(
        [
            d.reshape(n, 1).view(np.uint8),
            dmin.reshape(n, 1).view(np.uint8),
            _pack_k_scales(sc, m),
            qh,
            _pack_nibbles_32(q & 0x0F),
        ],
        axis=1,
    )


def _encode_q6k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(d f16 [n], sc int8 [n, 16], q int [n, 16, 16] in -32..31) of blocks ``x`` [n, 256]."""
    x = x.reshape(-1, 16, 16)
    scale = np.abs(x).max(axis=-1) / np.float32(31)
    d = _f16_ceil(scale.max(axis=-1) / np.float32(127))
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.ceil(_div_or_zero(scale, d32)), 0, 127)
    step = (d32 * sc.astype(np.float32))[..., None]
    q = np.clip(np.rint(_div_or_zero(x, step)), -32, 31)
    return d, sc.astype(np.int8), q


def _q6k_blocks(d, sc, q) -> np.ndarray:
    """Q6_K layout: ql (128) | qh (64) | scales (16 int8) | d (fp16). Element e = 128*h + r of
    the block (h = half): its low nibble sits in ql[64*h + r % 64] (low nibble for r < 64, high
    for r >= 64), its top 2 bits in qh[32*h + r % 32] at bit 2*(r // 32)."""
    n = q.shape[0]
    u = (q.reshape(n, 256).astype(np.int16) + 32).astype(np.uint8)
    low = (u & 0x0F).reshape(n, 2, 2, 64)
    ql = (low[:, :, 0, :] | (low[:, :, 1, :] << 4)).reshape(n, 128)
    top = ((u >> 4) & 0x03).reshape(n, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    qh = np.bitwise_or.reduce(top, axis=2).reshape(n, 64)
    return np.concatenate([ql, qh, sc.reshape(n, 16).view(np.uint8), d.reshape(n, 1).view(np.uint8)], axis=1)


def quantize_kquant(w: np.ndarray, qtype: Any) -> np.ndarray:
    """Encode float32 ``w`` [rows, cols] (cols a multiple of 256) as Q4_K, Q5_K or Q6_K blocks:
    uint8 [rows, cols / 256 * type_size] in the layout ``gguf.quants.dequantize`` reads (module
    docstring for the method); every value decodes to within half a step of its input."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qt = _qtype(qtype)
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % QK_K:
        raise ValueError(f"quantize_kquant needs [rows, cols] with cols % {QK_K} == 0, got {w.shape}")
    rows, cols = w.shape
    if not np.isfinite(w).all():
        raise ValueError("quantize_kquant: non-finite input")
    blocks = w.reshape(-1, QK_K)
    if qt == GGMLQuantizationType.Q4_K:
        out = _q4k_blocks(*_encode_q45k(blocks, 15))
    elif qt == GGMLQuantizationType.Q5_K:
        out = _q5k_blocks(*_encode_q45k(blocks, 31))
    elif qt == GGMLQuantizationType.Q6_K:
        out = _q6k_blocks(*_encode_q6k(blocks))
    else:
        raise ValueError(f"quantize_kquant encodes Q4_K, Q5_K and Q6_K, not {qt.name}")
    type_size = GGML_QUANT_SIZES[qt][1]
    assert out.shape[1] == type_size
    return out.reshape(rows, cols // QK_K * type_size)


def quantize(w: np.ndarray, qtype: Any) -> np.ndarray:
    """``w`` float32 [rows, cols] in ``qtype``: K-quants by ``quantize_kquant``, others by
    ``gguf.quants.quantize`` (F32 / F16 as arrays of that dtype)."""
    from gguf import quants

    qt = _qtype(qtype)
    if qt.name in KQUANT_TYPES:
        return quantize_kquant(w, qt)
    return quants.quantize(np.asarray(w, dtype=np.float32), qt)


# ------------------------------------------------------------------------- random blocks
_UNIFORM_STD = {16: math.sqrt((16**2 - 1) / 12), 32: math.sqrt((32**2 - 1) / 12)}
_INT8_STD = math.sqrt((256**2 - 1) / 12)
_Q6_STD = math.sqrt((64**2 - 1) / 12)


def random_blocks(
    rows: int, cols: int, qtype: Any, rng: np.random.Generator, std: float = 0.02
) -> np.ndarray:
    """Random ``qtype`` data for a [rows, cols] matrix without a float original: uniform
    random code bytes, fp16 scale fields finite and chosen (with the 6-bit sub-block scales and
    mins of K-quants) so the decoded weights have mean ~0 and std ~``std``. Returns what
    ``quantize`` would (uint8 [rows, bytes per row]; F32/F16 arrays for those types)."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    qt = _qtype(qtype)
    if qt in (T.F32, T.F16):
        w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)
        return w if qt == T.F32 else w.astype(np.float16)
    block, type_size = GGML_QUANT_SIZES[qt]
    if cols % block:
        raise ValueError(f"{qt.name} needs a row length multiple of {block}, got {cols}")
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)

    def jitter() -> np.ndarray:  # per-block scale factor in [0.5, 1.5)
        return rng.random(n, dtype=np.float32) + np.float32(0.5)

    def put_f16(col: int, value: np.ndarray) -> None:
        raw[:, col : col + 2] = value.astype(np.float16).reshape(n, 1).view(np.uint8)

    if qt == T.Q4_0:  # w = d * (q - 8)
        put_f16(0, std / _UNIFORM_STD[16] * jitter())
    elif qt == T.Q4_1:  # w = d * q + m
        d = (std / _UNIFORM_STD[16] * jitter()).astype(np.float16).astype(np.float32)
        put_f16(0, d)
        put_f16(2, -7.5 * d)
    elif qt == T.Q8_0:  # w = d * q, q int8
        put_f16(0, std / _INT8_STD * jitter())
    elif qt in (T.Q4_K, T.Q5_K):  # w = d*sc*q - dmin*m; m = sc, dmin = d * mid: d*sc*(q - mid)
        levels = 16 if qt == T.Q4_K else 32
        sc = rng.integers(32, 64, size=(n, 8), dtype=np.uint8)
        d = std / (_UNIFORM_STD[levels] * 47.5) * jitter()
        put_f16(0, d)
        put_f16(2, d * ((levels - 1) / 2))
        raw[:, 4:16] = _pack_k_scales(sc, sc)
    elif qt == T.Q6_K:  # w = d * sc * q, sc int8 (either sign), q in -32..31
        sc = rng.integers(32, 128, size=(n, 16), dtype=np.int16) * rng.choice(
            np.array([-1, 1], dtype=np.int16), size=(n, 16)
        )
        raw[:, 192:208] = sc.astype(np.int8).view(np.uint8)
        put_f16(208, std / (_Q6_STD * 79.5) * jitter())
    else:
        raise ValueError(f"random_blocks: no generator for {qt.name}")
    return raw.reshape(rows, cols // block * type_size)


# --------------------------------------------------------------------------- the model
@dataclass(frozen=True, slots=True)
class TensorPlan:
    name: str  # GGUF tensor name
    shape: tuple[int, ...]  # numpy order: [rows, cols] or [n]
    qtype: Any  # gguf.GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        from gguf import GGML_QUANT_SIZES

        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * type_size


def more_bits_layer(i: int, n_layers: int) -> bool:
    """Whether llama.cpp's Q4_K_M gives layer ``i``'s attn_v / ffn_down Q6_K: the first and
    last eighth of the layers, and every third layer in between."""
    eighth = n_layers // 8
    return i < eighth or i >= 7 * n_layers // 8 or (i - eighth) % 3 == 2


def _fit(qtype, cols: int):
    """``qtype`` if rows of ``cols`` fit its blocks, else Q8_0, else F32 (module docstring)."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    for t in (qtype, T.Q8_0, T.F32):
        if cols % GGML_QUANT_SIZES[t][0] == 0:
            return t
    return T.F32


def decode_read_tensors(plan: list[TensorPlan]) -> list[TensorPlan]:
    """The tensors of ``plan`` a decode step reads (whole, or for 3-D expert tensors the active
    experts' share: ``decode_read_bytes``): every block tensor, the final norm and the LM head
    (``output.weight``); of the embedding only one row, left out."""
    return [p for p in plan if p.name.startswith("blk.") or p.name in ("output.weight", "output_norm.weight")]


def decode_read_bytes(plan: list[TensorPlan], experts_used: int = 0) -> int:
    """Bytes one single-sequence decode step reads: ``decode_read_tensors``, of each 3-D expert
    tensor only ``experts_used`` of its experts."""
    total = 0
    for p in decode_read_tensors(plan):
        total += p.nbytes * experts_used // p.shape[0] if len(p.shape) == 3 else p.nbytes
    return total


def tensor_plan(
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    qtype_scheme: str,
    head_dim: int | None = None,
    experts: int = 0,
    experts_used: int = 0,
    moe_intermediate: int = 0,
) -> list[TensorPlan]:
    """Every tensor of the file in llama.cpp's order (token_embd, blocks, output_norm, output)
    with its shape and type under ``qtype_scheme`` (module docstring). With ``experts`` (a
    Qwen3-MoE decoder, ``MOE_ARCH``): q/k RMSNorms, a float32 router ``ffn_gate_inp`` [E, hidden]
    and the experts as 3-D tensors ``ffn_{gate,up,down}_exps`` [E, rows, cols] instead of the
    dense MLP; ``head_dim`` may differ from hidden / heads."""
    from gguf import GGMLQuantizationType as T

    scheme = qtype_scheme.upper()
    if scheme not in SCHEMES:
        raise ValueError(f"unknown qtype_scheme {qtype_scheme!r}; use one of {', '.join(SCHEMES)}")
    if heads % kv_heads or (head_dim is None and hidden % heads):
        raise ValueError(f"hidden {hidden} / heads {heads} / kv_heads {kv_heads} do not divide")
    if experts and not (0 < experts_used <= experts and moe_intermediate > 0):
        raise ValueError("a MoE plan needs 0 < experts_used <= experts and moe_intermediate")
    head_dim = head_dim or hidden // heads
    if head_dim % 2:
        raise ValueError("head_dim must be even (rope)")
    mix = scheme == "Q4_K_M"
    base = T.Q4_K if mix else T[scheme]

    def mat(name: str, rows: int, cols: int, qt=None) -> TensorPlan:
        return TensorPlan(name, (rows, cols), _fit(base if qt is None else qt, cols))

    def experts_mat(name: str, rows: int, cols: int, qt=None) -> TensorPlan:
        return TensorPlan(name, (experts, rows, cols), _fit(base if qt is None else qt, cols))

    q, kv = heads * head_dim, kv_heads * head_dim
    plan = [mat("token_embd.weight", vocab, hidden)]
    for i in range(layers):
        extra = T.Q6_K if mix and more_bits_layer(i, layers) else None
        p = f"blk.{i}."
        plan += [
            TensorPlan(p + "attn_norm.weight", (hidden,), T.F32),
            mat(p + "attn_q.weight", q, hidden),
            mat(p + "attn_k.weight", kv, hidden),
            mat(p + "attn_v.weight", kv, hidden, extra),
            mat(p + "attn_output.weight", hidden, q),
        ]
        if experts:
            plan += [
                TensorPlan(p + "attn_q_norm.weight", (head_dim,), T.F32),
                TensorPlan(p + "attn_k_norm.weight", (head_dim,), T.F32),
                TensorPlan(p + "ffn_norm.weight", (hidden,), T.F32),
                TensorPlan(p + "ffn_gate_inp.weight", (experts, hidden), T.F32),
                experts_mat(p + "ffn_gate_exps.weight", moe_intermediate, hidden),
                experts_mat(p + "ffn_up_exps.weight", moe_intermediate, hidden),
                experts_mat(p + "ffn_down_exps.weight", hidden, moe_intermediate, extra),
            ]
            continue
        plan += [
            TensorPlan(p + "ffn_norm.weight", (hidden,), T.F32),
            mat(p + "ffn_gate.weight", intermediate, hidden),
            mat(p + "ffn_up.weight", intermediate, hidden),
            mat(p + "ffn_down.weight", hidden, intermediate, extra),
        ]
    plan.append(TensorPlan("output_norm.weight", (hidden,), T.F32))
    plan.append(mat("output.weight", vocab, hidden, T.Q6_K if mix else None))
    return plan


def _tensor_data(info: TensorPlan, rng: np.random.Generator, fast_random: bool, std: float) -> np.ndarray:
    from gguf import GGMLQuantizationType as T

    if len(info.shape) == 1:  # norm weights
        return (1.0 + 0.1 * rng.standard_normal(info.shape, dtype=np.float32)).astype(np.float32)
    if len(info.shape) == 3:  # experts: [E, rows, cols] = E matrices, row after row
        flat = TensorPlan(info.name, (info.shape[0] * info.shape[1], info.shape[2]), info.qtype)
        return _tensor_data(flat, rng, fast_random, std)
    rows, cols = info.shape
    if info.qtype == T.F32 and info.name.endswith("ffn_gate_inp.weight"):  # router: O(1) logits
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(cols**-0.5 * 4)
    if fast_random:
        return random_blocks(rows, cols, info.qtype, rng, std)
    w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)
    if info.qtype == T.F32:
        return w
    return quantize(w, info.qtype)


# ------------------------------------------------------------------- tokenizer metadata
def read_typed_metadata(path: str | os.PathLike, prefix: str = "") -> list[tuple[str, Any, Any, Any]]:
    """``(key, value, GGUFValueType, array element type or None)`` of every metadata key of the
    GGUF at ``path`` starting with ``prefix`` (header only; typed so it can be written back)."""
    from gguf import GGUFValueType as V

    scalar = {
        V.UINT8: "<B",
        V.INT8: "<b",
        V.UINT16: "<H",
        V.INT16: "<h",
        V.UINT32: "<I",
        V.INT32: "<i",
        V.FLOAT32: "<f",
        V.BOOL: "<?",
        V.UINT64: "<Q",
        V.INT64: "<q",
        V.FLOAT64: "<d",
    }
    out = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = 0

        def take(fmt: str) -> Any:
            nonlocal pos
            (v,) = struct.unpack_from(fmt, mm, pos)
            pos += struct.calcsize(fmt)
            return v

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            s = mm[pos : pos + n].decode("utf-8")
            pos += n
            return s

        def value(vt) -> Any:
            if vt == V.STRING:
                return string()
            return take(scalar[vt])

        if mm[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        pos = 4
        take("<I")
        take("<Q")
        n_kv = take("<Q")
        for _ in range(n_kv):
            key = string()
            vt = V(take("<I"))
            if vt == V.ARRAY:
                et = V(take("<I"))
                count = take("<Q")
                if et in scalar:
                    fmt = scalar[et]
                    items = list(struct.unpack_from(f"<{count}{fmt[1]}", mm, pos))
                    pos += struct.calcsize(fmt) * count
                else:
                    items = [value(et) for _ in range(count)]
                val, sub = items, et
            else:
                val, sub = value(vt), None
            if key.startswith(prefix):
                out.append((key, val, vt, sub))
    return out


def gguf_vocab_size(path: str | os.PathLike) -> int:
    """The number of tokens of the tokenizer stored in the GGUF at ``path``."""
    for key, val, _, _ in read_typed_metadata(path, "tokenizer.ggml.tokens"):
        if key == "tokenizer.ggml.tokens":
            return len(val)
    raise ValueError(f"{path} has no tokenizer.ggml.tokens")


# ------------------------------------------------------------------------------ writing
def write_llama_gguf(
    path: str | os.PathLike,
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int | None = None,
    ctx: int = 4096,
    qtype_scheme: str = "Q4_K_M",
    seed: int = 0,
    tokenizer_from: str | os.PathLike | None = None,
    fast_random: bool = False,
    weight_std: float = 0.02,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-5,
    name: str | None = None,
    head_dim: int | None = None,
    experts: int = 0,
    experts_used: int = 0,
    moe_intermediate: int = 0,
) -> dict[str, Any]:
    """Write a random-weight Llama GGUF to ``path`` (module docstring). ``vocab`` may be left
    out with ``tokenizer_from`` (it must equal that tokenizer's size when given). Returns a
    summary: ``path``, ``vocab``, ``file_bytes``, ``weight_bytes`` (tensor data),
    ``linear_bytes`` (the layers' matrices + output: what one decode step streams, the
    embedding row aside), ``params``, ``qtypes`` ({type name: tensor count}). With ``experts`` the file
    is a Qwen3-MoE decoder (``MOE_ARCH``; see ``tensor_plan``); ``linear_bytes`` counts all experts."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFValueType as V

    tok_meta = []
    if tokenizer_from is not None:
        tok_meta = read_typed_metadata(tokenizer_from, "tokenizer.")
        n_tok = next((len(v) for k, v, _, _ in tok_meta if k == "tokenizer.ggml.tokens"), None)
        if n_tok is None:
            raise ValueError(f"{tokenizer_from} has no tokenizer.ggml.tokens")
        if vocab is not None and vocab != n_tok:
            raise ValueError(f"vocab {vocab} differs from the {n_tok} tokens of {tokenizer_from}")
        vocab = n_tok
    if vocab is None:
        raise ValueError("give vocab or tokenizer_from")
    plan = tensor_plan(
        hidden=hidden,
        intermediate=intermediate,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        qtype_scheme=qtype_scheme,
        head_dim=head_dim,
        experts=experts,
        experts_used=experts_used,
        moe_intermediate=moe_intermediate,
    )
    scheme = qtype_scheme.upper()
    path = os.fspath(path)
    arch = MOE_ARCH if experts else "llama"
    head_dim = head_dim or hidden // heads
    writer = gguf.GGUFWriter(path, arch)
    try:
        writer.add_name(name or f"random-{arch}-{hidden}x{layers}-{scheme}")
        writer.add_block_count(layers)
        writer.add_context_length(ctx)
        writer.add_embedding_length(hidden)
        writer.add_feed_forward_length(intermediate)
        writer.add_head_count(heads)
        writer.add_head_count_kv(kv_heads)
        writer.add_layer_norm_rms_eps(rms_norm_eps)
        writer.add_rope_freq_base(rope_theta)
        writer.add_rope_dimension_count(head_dim)
        if experts:
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
            writer.add_expert_count(experts)
            writer.add_expert_used_count(experts_used)
            writer.add_expert_feed_forward_length(moe_intermediate)
        writer.add_vocab_size(vocab)
        writer.add_file_type(_FILE_TYPES[scheme])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        if tok_meta:
            for key, val, vt, sub in tok_meta:
                writer.add_key_value(key, val, vt, sub_type=sub)
        else:
            writer.add_key_value("tokenizer.ggml.bos_token_id", 1, V.UINT32)
            writer.add_key_value("tokenizer.ggml.eos_token_id", 2, V.UINT32)
        for info in plan:
            if info.qtype in (T.F32, T.F16):
                dtype = np.float32 if info.qtype == T.F32 else np.float16
                writer.add_tensor_info(info.name, info.shape, np.dtype(dtype), info.nbytes)
            else:
                rows = math.prod(info.shape[:-1])
                byte_shape = (*info.shape[:-1], info.nbytes // rows)
                writer.add_tensor_info(info.name, byte_shape, np.dtype(np.uint8), info.nbytes, info.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for k, info in enumerate(plan):
            rng = np.random.default_rng([seed, k])
            data = _tensor_data(info, rng, fast_random, weight_std)
            assert data.nbytes == info.nbytes, (info.name, data.nbytes, info.nbytes)
            writer.write_tensor_data(data)
            del data
    finally:
        writer.close()
    qtypes: dict[str, int] = {}
    for info in plan:
        qtypes[info.qtype.name] = qtypes.get(info.qtype.name, 0) + 1
    return {
        "path": path,
        "vocab": vocab,
        "file_bytes": os.path.getsize(path),
        "weight_bytes": sum(i.nbytes for i in plan),
        "linear_bytes": sum(i.nbytes for i in plan if i.name.startswith("blk.") or i.name == "output.weight"),
        "params": sum(math.prod(i.shape) for i in plan),
        "qtypes": qtypes,
    }


def write_preset_gguf(path: str | os.PathLike, shape: str, **kwargs: Any) -> dict[str, Any]:
    """``write_llama_gguf`` with one of ``SHAPES`` ("1b", "7b")."""
    return write_llama_gguf(path, **SHAPES[shape], **kwargs)


# byte offsets of the fp16 scale fields of a block, per ggml type (kernel tests and benchmarks)
SCALE_FIELDS = {2: (0,), 3: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_code_blocks(n: int, k: int, qtype: int, seed: int = 0):
    """uint8 torch tensor [n, k / bs * ts]: every code byte random, the fp16 scale fields finite and
    uniform in +-[1e-3, 1e-1] (unlike ``random_blocks``, no limit on the K-quant sub-block scales:
    what kernel tests want)."""
    import torch
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // bs, ts), dtype=np.uint8)
    for off in SCALE_FIELDS[qtype]:
        s = rng.uniform(1e-3, 1e-1, size=(n, k // bs)) * rng.choice([-1.0, 1.0], size=(n, k // bs))
        raw[:, :, off : off + 2] = s.astype(np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def break_one_scale(
    src: str | os.PathLike, dst: str | os.PathLike, tensor: str, block: int, factor: float
) -> None:
    """Copy the GGUF file ``src`` to ``dst`` with the fp16 scale ``d`` of one block of ``tensor``
    (a Q4_0 / Q4_1 / Q8_0 tensor, whose blocks begin with ``d``) multiplied by ``factor``: the
    defect a dequantization bug that reads one wrong scale gives, for checking that a tolerance
    still catches it."""
    import shutil

    import gguf

    info = next(t for t in gguf.GGUFReader(src).tensors if t.name == tensor)
    if info.tensor_type.name not in ("Q4_0", "Q4_1", "Q8_0"):
        raise ValueError(f"{tensor}: {info.tensor_type.name} blocks do not begin with one fp16 scale")
    offset = int(info.data_offset) + block * gguf.GGML_QUANT_SIZES[info.tensor_type][1]
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        f.seek(offset)
        d = np.frombuffer(f.read(2), dtype=np.float16)[0]
        f.seek(offset)
        f.write(np.float16(float(d) * factor).tobytes())

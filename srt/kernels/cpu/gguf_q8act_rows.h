// GGUF matmuls on int8-quantized activations: the row functions (scalar and AVX2) behind
// gguf_q8act.cpp's gguf_linear_q8a op.
//
// Activations. Each row of x [M, K] is cut into blocks of 32 values; per block
//   amax = max |x|,  d = amax / 127 (float32),  q = rne(x / d) clamped to [-127, 127]
//   (an all-zero block, or one whose d rounds to 0: d = 0 and q = 0),
//   s = the float32 sum of the 32 original x in a fixed order: p[l] = ((x[l] + x[l + 8]) +
//   x[l + 16]) + x[l + 24] for l < 8, h[l] = p[l] + p[l + 4] for l < 4, s = (h[0] + h[2]) + (h[1] +
//   h[3]) (what an 8-lane vector sum and its horizontal reduction give).
// x / d is a correctly rounded float32 division and rne rounds half to even, so the scalar and
// AVX2 functions and gguf.py's quantize_activations_ref agree bit for bit. Non-finite x are not
// supported (the block's codes are then unspecified).
//
// Dot products. A weight row is dotted with an activation row block by block: integer sums of
// code products (exact: int16 pairs cannot saturate, every |code| <= 127 except Q8_0's -128,
// which the sign trick below handles), each scaled in float32 and summed in float32:
//   Q8_0  (w = dw q)              (dw * dx) * sum(q qx)
//   Q4_0  (w = dw (q - 8))        (dw * dx) * (sum(q qx) - 8 sum(qx))
//   Q4_1  (w = dw q + m)          (dw * dx) * sum(q qx) + m * s
//   Q4_K, Q5_K per sub-block of 32 (the x block it lines up with; w = (d sc) q - (dmin m)):
//                                 ((d sc) * dx) * sum(q qx) - (dmin m) * s
//   Q6_K per group g of 16 in x block b (w = (d sc_g)(q - 32), q in 0..63):
//                                 ((d sc_g) * dx_b) * (sum16(q qx) - 32 sum16(qx))
// The scalar functions add these terms one by one in block order (the documented reference);
// the AVX2 ones keep 8 integer lane sums per block (_mm256_maddubs_epi16: unsigned codes x
// signed activation codes -> int16 pairs, _mm256_madd_epi16 -> int32), convert them to float and
// FMA them with the block's scale into 8 float lanes, reduced once at the end: the same terms up
// to float32 summation order. Q8_0 weights are signed, so the u8 operand is |q| and the signed one
// x with q's sign (|-128| = 128 fits the unsigned operand; -x never overflows). Q4_0 and Q6_K
// subtract 8 (32) times the activation pair sums from the int16 pairs. Q4_1's m * s products
// gather in a vector of their own; the K-quant minimums, one per sub-block, fill the 8 lanes of
// one FMA per super-block.
//
// Tiles: one call handles R <= 4 weight rows and MX <= 2 activation rows, so each activation
// block is loaded once for 4 weight rows and each weight block is decoded once for 2 activation
// rows (M = 1 decode: 4 weight rows per pass over x, whose codes stay in L1). Per block, the
// simple types convert the 4 rows' fp16 fields with one instruction. The time goes to the
// per-(weight row, activation row) block work (maddubs, madd, convert, scale, FMA): about the same
// per block and row pair for every tile shape tried (1x4, 2x4, 4x4, 4x2, 2x2, 4x1).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "gguf_kquant_rows.h"
#include "gguf_quant.h"
#include "gguf_simple_rows.h"
#include "vec.h"

namespace srt_cpu {
namespace q8act {

constexpr int kXBlock = 32;  // activation block (every weight type's blocks are multiples of it)
constexpr int kMaxWRows = 4;  // weight rows per dot call
constexpr int kMaxXRows = 2;  // activation rows per dot call

// M rows of quantized activations: q [M, K] codes, d and s [M, K / 32] (scale, float sum), and
// the same d and s interleaved, ds [M, 2 K / 32] (d0 s0 d1 s1 ...: one 8-byte load per block)
struct Acts {
  const int8_t* q;
  const float* d;
  const float* s;
  const float* ds;
  int64_t k;   // codes per row (the row stride of q)
  int64_t nb;  // K / 32 (the row stride of d and s)
};

// one row: x [k] -> q [k], d [k / 32], s [k / 32]
using QuantizeRowFn = void (*)(const float* x, int64_t k, int8_t* q, float* d, float* s);
// out[i * ldo + r] = dot(weight row r at w + r * ldw, activation row i0 + i), r < rows <= 4,
// i < mx <= 2; the row length is a.k
using Q8DotFn = void (*)(const uint8_t* w, int64_t ldw, int64_t rows, const Acts& a, int64_t i0, int64_t mx,
                         float* out, int64_t ldo);

struct Q8aOps {
  int block_size;  // weights per weight block
  int type_size;   // bytes per weight block
  Q8DotFn dot;
  int x_rows = kMaxXRows;  // activation rows per dot call (mx <= x_rows)
  Q8DotFn gemm = nullptr;  // many activation rows: rows <= gemm_rows weight rows, any mx (or none)
  int gemm_rows = 0;
  int gemm_beats_float = 0;  // from this many activation rows on the GEMM is faster than float32's
};

// ---------------------------------------------------------------- scalar (reference, fallback)
namespace scalar {

inline void quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < k / kXBlock; ++b) {
    const float* xb = x + b * kXBlock;
    int8_t* qb = q + b * kXBlock;
    float amax = 0.f;
    for (int j = 0; j < kXBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float db = amax / 127.f;
    for (int j = 0; j < kXBlock; ++j) {
      const float v = db == 0.f ? 0.f : std::nearbyint(xb[j] / db);  // the default mode: half to even
      qb[j] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
    }
    float p[8], h[4];
    for (int l = 0; l < 8; ++l) p[l] = ((xb[l] + xb[l + 8]) + xb[l + 16]) + xb[l + 24];
    for (int l = 0; l < 4; ++l) h[l] = p[l] + p[l + 4];
    d[b] = db;
    s[b] = (h[0] + h[2]) + (h[1] + h[3]);
  }
}

// Each Block type adds the terms of one weight block (block_size weights) against the matching
// activation codes xq, scales dx and sums xs (one per 32) to acc, in order.
struct BlockQ4_0 {
  static constexpr int kBlock = 32, kSize = gguf_simple::kSizeQ4_0;
  static void add(const uint8_t* blk, const int8_t* xq, const float* dx, const float* /*xs*/, float& acc) {
    const float dw = gguf_simple::half_at(blk);
    const uint8_t* qs = blk + 2;
    int32_t isum = 0, xsum = 0;
    for (int j = 0; j < 16; ++j) {
      isum += (qs[j] & 0x0F) * xq[j] + (qs[j] >> 4) * xq[j + 16];
      xsum += xq[j] + xq[j + 16];
    }
    acc += (dw * dx[0]) * static_cast<float>(isum - 8 * xsum);
  }
};

struct BlockQ4_1 {
  static constexpr int kBlock = 32, kSize = gguf_simple::kSizeQ4_1;
  static void add(const uint8_t* blk, const int8_t* xq, const float* dx, const float* xs, float& acc) {
    const float dw = gguf_simple::half_at(blk), m = gguf_simple::half_at(blk + 2);
    const uint8_t* qs = blk + 4;
    int32_t isum = 0;
    for (int j = 0; j < 16; ++j) isum += (qs[j] & 0x0F) * xq[j] + (qs[j] >> 4) * xq[j + 16];
    acc += (dw * dx[0]) * static_cast<float>(isum) + m * xs[0];
  }
};

struct BlockQ8_0 {
  static constexpr int kBlock = 32, kSize = gguf_simple::kSizeQ8_0;
  static void add(const uint8_t* blk, const int8_t* xq, const float* dx, const float* /*xs*/, float& acc) {
    const float dw = gguf_simple::half_at(blk);
    const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
    int32_t isum = 0;
    for (int j = 0; j < 32; ++j) isum += qs[j] * xq[j];
    acc += (dw * dx[0]) * static_cast<float>(isum);
  }
};

// Q4_K (kHigh = false) / Q5_K (kHigh = true): 8 sub-blocks of 32
template <bool kHigh>
struct BlockQ45K {
  static constexpr int kBlock = kquant::kQK, kSize = kHigh ? kquant::kQ5KBytes : kquant::kQ4KBytes;
  static void add(const uint8_t* blk, const int8_t* xq, const float* dx, const float* xs, float& acc) {
    const float d = kquant::fp16_at(blk), dmin = kquant::fp16_at(blk + 2);
    const kquant::ScaleMin sm = kquant::unpack_scale_min(blk + 4);
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + (kHigh ? 48 : 16);
    for (int s = 0; s < 8; ++s) {
      const int sc = kquant::byte_of(s < 4 ? sm.sc_lo : sm.sc_hi, s & 3);
      const int m = kquant::byte_of(s < 4 ? sm.m_lo : sm.m_hi, s & 3);
      const uint8_t* q = qs + 32 * (s / 2);
      const int shift = 4 * (s & 1);
      int32_t isum = 0;
      for (int i = 0; i < 32; ++i) {
        int v = (q[i] >> shift) & 0x0F;
        if (kHigh) v |= ((qh[i] >> s) & 1) << 4;
        isum += v * xq[32 * s + i];
      }
      const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(m);
      acc += (ds * dx[s]) * static_cast<float>(isum) - dm * xs[s];
    }
  }
};

// Q6_K: 16 groups of 16, two per activation block
struct BlockQ6K {
  static constexpr int kBlock = kquant::kQK, kSize = kquant::kQ6KBytes;
  static void add(const uint8_t* blk, const int8_t* xq, const float* dx, const float* /*xs*/, float& acc) {
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = kquant::fp16_at(blk + 208);
    for (int g = 0; g < 16; ++g) {
      int32_t isum = 0, xsum = 0;
      for (int i = 0; i < 16; ++i) {
        const int e = 16 * g + i, h = e / 128, p = e % 128;
        const int lo = (ql[64 * h + p % 64] >> (4 * (p / 64))) & 0x0F;
        const int hi = (qh[32 * h + p % 32] >> (2 * (p / 32))) & 3;
        isum += (lo | (hi << 4)) * xq[e];
        xsum += xq[e];
      }
      const float dl = d * static_cast<float>(sc[g]);
      acc += (dl * dx[g / 2]) * static_cast<float>(isum - 32 * xsum);
    }
  }
};

template <class B>
void dot(const uint8_t* w, int64_t ldw, int64_t rows, const Acts& a, int64_t i0, int64_t mx, float* out,
         int64_t ldo) {
  constexpr int kPerX = B::kBlock / kXBlock;  // activation blocks per weight block
  for (int64_t i = 0; i < mx; ++i) {
    const int8_t* xq = a.q + (i0 + i) * a.k;
    const float* dx = a.d + (i0 + i) * a.nb;
    const float* xs = a.s + (i0 + i) * a.nb;
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* row = w + r * ldw;
      float acc = 0.f;
      for (int64_t b = 0; b < a.k / B::kBlock; ++b) {
        B::add(row + b * B::kSize, xq + b * B::kBlock, dx + b * kPerX, xs + b * kPerX, acc);
      }
      out[i * ldo + r] = acc;
    }
  }
}

}  // namespace scalar

#if SRT_CPU_X86
// ---------------------------------------------------------------- AVX2 (+FMA, F16C)
namespace avx2 {

SRT_INLINE_AVX2 __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// 8 int32 lane sums of the int16 pairs, as floats
SRT_INLINE_AVX2 __m256 lanes_ps(__m256i pairs) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// the int16 pair sums of 32 signed codes, times 2^shift (8 = 2^3 for Q4_0, 32 = 2^5 for Q6_K)
template <int kShift>
SRT_INLINE_AVX2 __m256i pair_sums(__m256i xq) {
  return _mm256_slli_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), xq), kShift);
}

SRT_TARGET_AVX2 inline void quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* s) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (int64_t b = 0; b < k / kXBlock; ++b) {
    const float* xb = x + b * kXBlock;
    __m256 v[4];
    for (int t = 0; t < 4; ++t) v[t] = _mm256_loadu_ps(xb + 8 * t);
    const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                   _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
    const float db = VecAvx2::hmax(a) / 127.f;
    d[b] = db;
    // the lane sums p[l] in the documented order; hsum adds (p[l] + p[l + 4]) then pairs
    s[b] = VecAvx2::hsum(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), v[2]), v[3]));
    __m256i out = _mm256_setzero_si256();
    if (db != 0.f) {
      const __m256 dv = _mm256_set1_ps(db);
      __m256i c[4];
      for (int t = 0; t < 4; ++t) {
        const __m256 r = _mm256_round_ps(_mm256_div_ps(v[t], dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c[t] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
      }
      // the packs work per 128-bit lane: bytes come out as dwords c0[0..3] c1[0..3] c2[0..3]
      // c3[0..3] c0[4..7] ..., which the permutation puts back in order
      const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
      out = _mm256_permutevar8x32_epi32(p16, order);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kXBlock), out);
  }
}

// ---- simple types: one 32-weight block per activation block ----

// 16 bytes of 4-bit codes -> 32 bytes: weight j < 16 the low nibble of byte j, j >= 16 the high
// nibble of byte j - 16 (both 128-bit halves hold the 16 bytes; the upper one shifted right by 4
// within each dword, and the mask drops what came over from the next byte)
SRT_INLINE_AVX2 __m256i nibbles32(const uint8_t* p) {
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                          _mm256_set1_epi8(0x0F));
}

SRT_INLINE_AVX2 int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// the first 4 bytes of block b of R weight rows (fp16 d, and m for Q4_1; every block is longer)
// as floats: lanes 2r, 2r + 1 from row r
template <int R, int TS>
SRT_INLINE_AVX2 __m256 block_heads(const uint8_t* w, int64_t ldw, int64_t b) {
  __m128i h = _mm_cvtsi32_si128(load_i32(w + b * TS));
  if constexpr (R > 1) h = _mm_insert_epi32(h, load_i32(w + ldw + b * TS), 1);
  if constexpr (R > 2) h = _mm_insert_epi32(h, load_i32(w + 2 * ldw + b * TS), 2);
  if constexpr (R > 3) h = _mm_insert_epi32(h, load_i32(w + 3 * ldw + b * TS), 3);
  return _mm256_cvtph_ps(h);
}

// Software prefetch: the R rows of a call are contiguous and so are the calls (the op walks the
// 4-row groups in order), so while a call reads R blocks it prefetches as many bytes of the group
// kPrefetchGroups ahead. Without it the R interleaved short streams come from DRAM at about
// half the bandwidth of one sequential stream (the hardware prefetchers do not follow them);
// 2 groups ahead measured best (1 to 8 tried). Prefetches past the end of the data are harmless.
constexpr int kPrefetchGroups = 2;

// prefetch the BYTES bytes from p on
template <int BYTES>
SRT_INLINE_AVX2 void prefetch_ahead(const uint8_t* p) {
  for (int off = 0; off < BYTES; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p + BYTES - 1), _MM_HINT_T0);
}

enum class Simple { kQ4_0, kQ4_1, kQ8_0 };

// R weight rows x MX activation rows. Per block, the R rows' (dw, m) pairs are converted at
// once and multiplied by (dx, s) of each activation row: lane 2r holds dw_r dx (broadcast from
// there), lane 2r + 1 m_r s, which Q4_1 accumulates in a separate vector (mins)
template <Simple T, int MX, int R>
SRT_TARGET_AVX2 void dot_simple(const uint8_t* w, int64_t ldw, const Acts& a, int64_t i0, float* out, int64_t ldo) {
  constexpr int TS = T == Simple::kQ4_0 ? gguf_simple::kSizeQ4_0
                                        : (T == Simple::kQ4_1 ? gguf_simple::kSizeQ4_1 : gguf_simple::kSizeQ8_0);
  __m256 acc[R][MX], mins[MX];
  for (int i = 0; i < MX; ++i) {
    mins[i] = _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][i] = _mm256_setzero_ps();
  }
  const int8_t* xq[MX];
  const double* xds[MX];  // (d, s) pairs, one 8-byte broadcast each
  for (int i = 0; i < MX; ++i) {
    xq[i] = a.q + (i0 + i) * a.k;
    xds[i] = reinterpret_cast<const double*>(a.ds + (i0 + i) * 2 * a.nb);
  }
  for (int64_t b = 0; b < a.nb; ++b) {
    prefetch_ahead<R * TS>(w + kPrefetchGroups * R * ldw + b * (R * TS));
    const __m256 heads = block_heads<R, TS>(w, ldw, b);
    __m256i xv[MX], c8[MX];
    __m256 sc[MX];
    for (int i = 0; i < MX; ++i) {
      xv[i] = load256(xq[i] + b * kXBlock);
      sc[i] = _mm256_mul_ps(heads, _mm256_castpd_ps(_mm256_broadcast_sd(xds[i] + b)));
      if constexpr (T == Simple::kQ4_0) c8[i] = pair_sums<3>(xv[i]);
      if constexpr (T == Simple::kQ4_1) mins[i] = _mm256_add_ps(mins[i], sc[i]);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * ldw + b * TS;
      __m256i wq;
      if constexpr (T == Simple::kQ8_0) {
        wq = load256(blk + 2);
      } else {
        wq = nibbles32(blk + (T == Simple::kQ4_0 ? 2 : 4));
      }
      const __m256i wu = T == Simple::kQ8_0 ? _mm256_abs_epi8(wq) : wq;  // the u8 operand
      const __m256i lane = _mm256_set1_epi32(2 * r);
      for (int i = 0; i < MX; ++i) {
        __m256i p;
        if constexpr (T == Simple::kQ8_0) {
          p = _mm256_maddubs_epi16(wu, _mm256_sign_epi8(xv[i], wq));
        } else {
          p = _mm256_maddubs_epi16(wu, xv[i]);
          if constexpr (T == Simple::kQ4_0) p = _mm256_sub_epi16(p, c8[i]);
        }
        acc[r][i] = _mm256_fmadd_ps(lanes_ps(p), _mm256_permutevar8x32_ps(sc[i], lane), acc[r][i]);
      }
    }
  }
  for (int i = 0; i < MX; ++i) {
    alignas(32) float m[8];
    _mm256_store_ps(m, mins[i]);
    for (int r = 0; r < R; ++r) {
      const float v = VecAvx2::hsum(acc[r][i]);
      out[i * ldo + r] = T == Simple::kQ4_1 ? v + m[2 * r + 1] : v;
    }
  }
}

// ---- K-quants: super-blocks of 256 = 8 activation blocks ----

// bit s of every qh byte, moved to bit 4 (the fifth code bit of Q5_K sub-block s); the 16-bit
// shifts pull bits over from the neighbouring byte, the mask keeps only each byte's own bit s
template <int S>
SRT_INLINE_AVX2 __m256i high_bit(__m256i qh) {
  const __m256i b4 = _mm256_set1_epi8(0x10);
  if constexpr (S <= 4) return _mm256_and_si256(_mm256_slli_epi16(qh, 4 - S), b4);
  return _mm256_and_si256(_mm256_srli_epi16(qh, S - 4), b4);
}

// the codes of sub-blocks 2J (low nibbles) and 2J + 1 (high nibbles) of a Q4_K / Q5_K block
template <bool kHigh, int J>
SRT_INLINE_AVX2 void codes_q45k(const uint8_t* blk, __m256i* lo, __m256i* hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i v = load256(blk + (kHigh ? 48 : 16) + 32 * J);
  *lo = _mm256_and_si256(v, m4);
  *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  if constexpr (kHigh) {
    const __m256i qh = load256(blk + 16);
    *lo = _mm256_or_si256(*lo, high_bit<2 * J>(qh));
    *hi = _mm256_or_si256(*hi, high_bit<2 * J + 1>(qh));
  }
}

template <bool kHigh, int MX, int R, int J>
SRT_INLINE_AVX2 void q45k_pair(const uint8_t* const* blk, const int8_t* const* xq, const float (*scl)[MX][8],
                               __m256 (*acc)[MX]) {
  for (int r = 0; r < R; ++r) {
    __m256i lo, hi;
    codes_q45k<kHigh, J>(blk[r], &lo, &hi);
    for (int i = 0; i < MX; ++i) {
      acc[r][i] = _mm256_fmadd_ps(lanes_ps(_mm256_maddubs_epi16(lo, load256(xq[i] + 64 * J))),
                                  _mm256_broadcast_ss(&scl[r][i][2 * J]), acc[r][i]);
      acc[r][i] = _mm256_fmadd_ps(lanes_ps(_mm256_maddubs_epi16(hi, load256(xq[i] + 64 * J + 32))),
                                  _mm256_broadcast_ss(&scl[r][i][2 * J + 1]), acc[r][i]);
    }
  }
}

template <bool kHigh, int MX, int R>
SRT_TARGET_AVX2 void dot_q45k(const uint8_t* w, int64_t ldw, const Acts& a, int64_t i0, float* out, int64_t ldo) {
  constexpr int TS = kHigh ? kquant::kQ5KBytes : kquant::kQ4KBytes;
  __m256 acc[R][MX];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MX; ++i) acc[r][i] = _mm256_setzero_ps();
  alignas(32) float scl[R][MX][8];  // (d sc[s]) * dx[s] of the super-block
  for (int64_t sb = 0; sb < a.k / kquant::kQK; ++sb) {
    prefetch_ahead<R * TS>(w + kPrefetchGroups * R * ldw + sb * (R * TS));
    const uint8_t* blk[R];
    for (int r = 0; r < R; ++r) blk[r] = w + r * ldw + sb * TS;
    const int8_t* xq[MX];  // the super-block's activation codes
    for (int i = 0; i < MX; ++i) xq[i] = a.q + (i0 + i) * a.k + sb * kquant::kQK;
    for (int r = 0; r < R; ++r) {
      __m256 vds, vdm;  // d * sc[s], dmin * m[s]
      kquant::avx2::scales_q45k(blk[r], &vds, &vdm);
      for (int i = 0; i < MX; ++i) {
        const int64_t x0 = (i0 + i) * a.nb + sb * 8;
        _mm256_store_ps(scl[r][i], _mm256_mul_ps(vds, _mm256_loadu_ps(a.d + x0)));
        acc[r][i] = _mm256_fnmadd_ps(vdm, _mm256_loadu_ps(a.s + x0), acc[r][i]);  // - (dmin m[s]) s[s]
      }
    }
    q45k_pair<kHigh, MX, R, 0>(blk, xq, scl, acc);
    q45k_pair<kHigh, MX, R, 1>(blk, xq, scl, acc);
    q45k_pair<kHigh, MX, R, 2>(blk, xq, scl, acc);
    q45k_pair<kHigh, MX, R, 3>(blk, xq, scl, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MX; ++i) out[i * ldo + r] = VecAvx2::hsum(acc[r][i]);
}

// the 32 codes (0..63) of activation block T of a Q6_K super-block: in half h = T / 4 of 128
// weights, block T % 4 takes the low (T % 4 < 2) or high nibbles of ql[64 h + 32 (T % 2) ..] and
// bits 2 (T % 4) .. + 1 of qh[32 h ..] as bits 4-5
template <int T>
SRT_INLINE_AVX2 __m256i codes_q6k(const uint8_t* blk) {
  constexpr int H = T / 4, P = T % 4;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  const __m256i l = load256(blk + 64 * H + 32 * (P % 2));
  const __m256i qh = load256(blk + 128 + 32 * H);
  const __m256i low = P < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
  __m256i top;  // bits 2P, 2P + 1 of qh at bits 4, 5
  if constexpr (P < 2) {
    top = _mm256_slli_epi16(qh, 4 - 2 * P);
  } else if constexpr (P == 2) {
    top = qh;
  } else {
    top = _mm256_srli_epi16(qh, 2);
  }
  return _mm256_or_si256(low, _mm256_and_si256(top, m30));
}

template <int MX, int R, int T>
SRT_INLINE_AVX2 void q6k_block(const uint8_t* const* blk, const __m256* dsc, const Acts& a, int64_t i0, int64_t sb,
                               __m256 (*acc)[MX]) {
  // lanes 0-3 of a block's madd result are group 2T (its first 16 codes), lanes 4-7 group 2T + 1
  const __m256i gsel = _mm256_setr_epi32(2 * (T % 4), 2 * (T % 4), 2 * (T % 4), 2 * (T % 4), 2 * (T % 4) + 1,
                                         2 * (T % 4) + 1, 2 * (T % 4) + 1, 2 * (T % 4) + 1);
  __m256i xv[MX], c32[MX];
  __m256 dx[MX];
  for (int i = 0; i < MX; ++i) {
    xv[i] = load256(a.q + (i0 + i) * a.k + sb * kquant::kQK + 32 * T);
    c32[i] = pair_sums<5>(xv[i]);
    dx[i] = _mm256_broadcast_ss(a.d + (i0 + i) * a.nb + sb * 8 + T);
  }
  for (int r = 0; r < R; ++r) {
    const __m256i q = codes_q6k<T>(blk[r]);
    const __m256 gs = _mm256_permutevar8x32_ps(dsc[2 * r + T / 4], gsel);  // d sc of the two groups
    for (int i = 0; i < MX; ++i) {
      const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(q, xv[i]), c32[i]);
      acc[r][i] = _mm256_fmadd_ps(lanes_ps(p), _mm256_mul_ps(gs, dx[i]), acc[r][i]);
    }
  }
}

template <int MX, int R>
SRT_TARGET_AVX2 void dot_q6k(const uint8_t* w, int64_t ldw, const Acts& a, int64_t i0, float* out, int64_t ldo) {
  __m256 acc[R][MX];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MX; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < a.k / kquant::kQK; ++sb) {
    prefetch_ahead<R * kquant::kQ6KBytes>(w + kPrefetchGroups * R * ldw + sb * (R * kquant::kQ6KBytes));
    const uint8_t* blk[R];
    __m256 dsc[2 * R];  // d * sc[0..7], d * sc[8..15] per weight row
    for (int r = 0; r < R; ++r) {
      blk[r] = w + r * ldw + sb * kquant::kQ6KBytes;
      const __m256 d = kquant::avx2::fp16_bcast(blk[r] + 208);
      dsc[2 * r] = _mm256_mul_ps(d, kquant::avx2::widen8_s8_ps(blk[r] + 192));
      dsc[2 * r + 1] = _mm256_mul_ps(d, kquant::avx2::widen8_s8_ps(blk[r] + 200));
    }
    q6k_block<MX, R, 0>(blk, dsc, a, i0, sb, acc);
    q6k_block<MX, R, 1>(blk, dsc, a, i0, sb, acc);
    q6k_block<MX, R, 2>(blk, dsc, a, i0, sb, acc);
    q6k_block<MX, R, 3>(blk, dsc, a, i0, sb, acc);
    q6k_block<MX, R, 4>(blk, dsc, a, i0, sb, acc);
    q6k_block<MX, R, 5>(blk, dsc, a, i0, sb, acc);
    q6k_block<MX, R, 6>(blk, dsc, a, i0, sb, acc);
    q6k_block<MX, R, 7>(blk, dsc, a, i0, sb, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MX; ++i) out[i * ldo + r] = VecAvx2::hsum(acc[r][i]);
}

// a tile function for every (MX, R) the dispatcher uses: R = 4, or 1 for the last rows of N
template <template <int, int> class K>
SRT_TARGET_AVX2 void dot_tiles(const uint8_t* w, int64_t ldw, int64_t rows, const Acts& a, int64_t i0, int64_t mx,
                               float* out, int64_t ldo) {
  if (rows == kMaxWRows) {
    if (mx == 2) {
      K<2, 4>::run(w, ldw, a, i0, out, ldo);
    } else {
      K<1, 4>::run(w, ldw, a, i0, out, ldo);
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (mx == 2) {
      K<2, 1>::run(w + r * ldw, ldw, a, i0, out + r, ldo);
    } else {
      K<1, 1>::run(w + r * ldw, ldw, a, i0, out + r, ldo);
    }
  }
}

template <Simple T>
struct SimpleTile {
  template <int MX, int R>
  struct K {
    static SRT_INLINE_AVX2 void run(const uint8_t* w, int64_t ldw, const Acts& a, int64_t i0, float* out,
                                    int64_t ldo) {
      dot_simple<T, MX, R>(w, ldw, a, i0, out, ldo);
    }
  };
};

template <bool kHigh>
struct Q45KTile {
  template <int MX, int R>
  struct K {
    static SRT_INLINE_AVX2 void run(const uint8_t* w, int64_t ldw, const Acts& a, int64_t i0, float* out,
                                    int64_t ldo) {
      dot_q45k<kHigh, MX, R>(w, ldw, a, i0, out, ldo);
    }
  };
};

template <int MX, int R>
struct Q6KTile {
  static SRT_INLINE_AVX2 void run(const uint8_t* w, int64_t ldw, const Acts& a, int64_t i0, float* out,
                                  int64_t ldo) {
    dot_q6k<MX, R>(w, ldw, a, i0, out, ldo);
  }
};

}  // namespace avx2
#endif  // SRT_CPU_X86

}  // namespace q8act
}  // namespace srt_cpu

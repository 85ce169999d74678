// Row functions of the GGUF K-quants Q4_K, Q5_K, Q6_K (super-blocks of 256 weights), scalar,
// AVX2 (+FMA, F16C) and AVX-512 (dot_rows only); gguf_kquant.cpp turns them into QuantRowOps
// (interface: gguf_quant.h).
//
// Block layouts (byte offsets; fp16 little-endian; the reference is gguf.quants' numpy code):
//   Q4_K (144)  0 d, 2 dmin, 4 scales[12], 16 qs[128]
//   Q5_K (176)  0 d, 2 dmin, 4 scales[12], 16 qh[32], 48 qs[128]
//   Q6_K (210)  0 ql[128], 128 qh[64], 192 scales[16] (int8), 208 d
// Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scale sc[s] and minimum m[s] packed in the 12 scale
// bytes (bytes 0-3: sc[0..3] in bits 0-5, the top 2 bits of sc[4..7]; bytes 4-7 the same for m;
// bytes 8-11: low nibble the low 4 bits of sc[4..7], high nibble those of m[4..7]). Sub-block
// 2j + h takes nibble h (0 low, 1 high) of qs[32 j .. 32 j + 31]; Q5_K adds bit s of qh[i] as
// bit 4. Weight = (d * sc) * q - (dmin * m), each product rounded to float32 (no FMA).
// Q6_K: 16 groups of 16 with int8 scale sc[g]; in each half h of 128 weights, element p takes
// nibble p / 64 of ql[64 h + p % 64] and bits 2 (p / 32) .. +1 of qh[32 h + p % 32] as bits 4-5;
// weight = (d * sc[g]) * (q - 32).
//
// dequant_row mirrors that float order exactly (bit-exact with gguf.quants). dot_rows needs no
// bit-exactness: Q4_K / Q5_K sum x * q per sub-block, scale the sum by d * sc and subtract
// (dmin * m) * (sum of x over the sub-block, from the caller's xsum16); Q6_K subtracts 32 from the
// codes as bytes and scales per group of 16.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "gguf_quant.h"
#include "vec.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gguf_kquant_rows.h assumes a little-endian CPU (GGUF blocks are little-endian)"
#endif

namespace srt_cpu {
namespace kquant {

constexpr int kQK = 256;
constexpr int kQ4KBytes = 144;
constexpr int kQ5KBytes = 176;
constexpr int kQ6KBytes = 210;

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return c10::detail::fp16_ieee_to_fp32_value(h);  // exact
}

// An optimization barrier on a float: keeps the compiler from contracting the product that
// produced v and a following add / sub into one FMA (gguf.quants rounds the product first; g++
// contracts intrinsics too under its default -ffp-contract=fast). With an fp16 d the product
// (d * sc) * q of Q4_K / Q5_K has at most 11 + 6 + 5 significant bits and is exact, so a fused
// form would round the same; the barrier keeps the order explicit at no cost.
inline float no_contract(float v) {
#if SRT_CPU_X86
  __asm__("" : "+x"(v));
#elif defined(__aarch64__)
  __asm__("" : "+w"(v));
#endif
  return v;
}

// The 6-bit scales and minimums of a Q4_K / Q5_K super-block, as 4 bytes per 32-bit word
// (byte i of sc_lo is sc[i], of sc_hi sc[4 + i]; likewise m).
struct ScaleMin {
  uint32_t sc_lo, sc_hi, m_lo, m_hi;
};

inline ScaleMin unpack_scale_min(const uint8_t* s) {
  const uint32_t a = load_u32(s), b = load_u32(s + 4), c = load_u32(s + 8);
  constexpr uint32_t kLow6 = 0x3F3F3F3Fu, kLow4 = 0x0F0F0F0Fu, kBits45 = 0x30303030u;
  // the word shifts move bits between bytes, but the masks keep only each byte's own bits
  return {a & kLow6, (c & kLow4) | ((a >> 2) & kBits45), b & kLow6, ((c >> 4) & kLow4) | ((b >> 2) & kBits45)};
}

inline int byte_of(uint32_t w, int i) { return static_cast<int>((w >> (8 * i)) & 0xFF); }

namespace scalar {

// ---- one super-block -> 256 floats, in gguf.quants' float order ----

inline void dequant_block_q45k(const uint8_t* blk, const uint8_t* qh, const uint8_t* qs, float* o) {
  const float d = fp16_at(blk), dmin = fp16_at(blk + 2);
  const ScaleMin sm = unpack_scale_min(blk + 4);
  for (int s = 0; s < 8; ++s) {
    const int sc = byte_of(s < 4 ? sm.sc_lo : sm.sc_hi, s & 3);
    const int m = byte_of(s < 4 ? sm.m_lo : sm.m_hi, s & 3);
    const float ds = d * static_cast<float>(sc);
    const float dm = dmin * static_cast<float>(m);
    const uint8_t* q = qs + 32 * (s / 2);
    const int shift = 4 * (s & 1);
    for (int i = 0; i < 32; ++i) {
      int v = (q[i] >> shift) & 0xF;
      if (qh != nullptr) v |= ((qh[i] >> s) & 1) << 4;
      o[32 * s + i] = no_contract(ds * static_cast<float>(v)) - dm;
    }
  }
}

inline void dequant_block_q4k(const uint8_t* blk, float* o) { dequant_block_q45k(blk, nullptr, blk + 16, o); }
inline void dequant_block_q5k(const uint8_t* blk, float* o) { dequant_block_q45k(blk, blk + 16, blk + 48, o); }

inline void dequant_block_q6k(const uint8_t* blk, float* o) {
  const uint8_t* ql = blk;
  const uint8_t* qh = blk + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  const float d = fp16_at(blk + 208);
  for (int g = 0; g < 16; ++g) {
    const float dl = d * static_cast<float>(sc[g]);
    for (int i = 0; i < 16; ++i) {
      const int e = 16 * g + i, h = e / 128, p = e % 128;
      const int lo = (ql[64 * h + p % 64] >> (4 * (p / 64))) & 0xF;
      const int hi = (qh[32 * h + p % 32] >> (2 * (p / 32))) & 3;
      o[e] = dl * static_cast<float>((lo | (hi << 4)) - 32);
    }
  }
}

}  // namespace scalar

#if SRT_CPU_X86
namespace avx2 {

// see no_contract: the product stays a separate rounding step
SRT_INLINE_AVX2 __m256 opaque(__m256 v) {
  __asm__("" : "+x"(v));
  return v;
}

SRT_INLINE_AVX2 __m256i widen8_u8(const uint8_t* p) {  // 8 bytes -> 8 int32 lanes (zero-extended)
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

SRT_INLINE_AVX2 __m256 widen8_s8_ps(const uint8_t* p) {  // 8 int8 -> 8 float lanes
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

SRT_INLINE_AVX2 __m256 fp16_bcast(const uint8_t* p) {  // the fp16 at p, in all 8 lanes (exact)
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

// d * sc[0..7] and dmin * m[0..7] of a Q4_K / Q5_K super-block (float32 products, as gguf.quants)
SRT_INLINE_AVX2 void scales_q45k(const uint8_t* blk, __m256* dsc, __m256* dmm) {
  const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32(blk))));  // [d, dmin, 0, 0]
  const ScaleMin s = unpack_scale_min(blk + 4);
  const __m128i bytes = _mm_setr_epi32(static_cast<int>(s.sc_lo), static_cast<int>(s.sc_hi),
                                       static_cast<int>(s.m_lo), static_cast<int>(s.m_hi));
  const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  const __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes)));
  *dsc = _mm256_mul_ps(_mm256_broadcastss_ps(dd), scf);
  *dmm = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), mf);
}

// ---- the codes of a super-block as 256 bytes (Q5_K: q in 0..31; Q6_K: q - 32 as int8) ----

SRT_INLINE_AVX2 void codes_q5k(const uint8_t* blk, uint8_t* qb) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
  const uint8_t* qs = blk + 48;
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    // h holds bits 2j, 2j + 1 of every qh byte in bits 0, 1 (the 16-bit shifts only pull
    // higher bits in from the neighbouring byte, and the masks drop them)
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
    const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), b4));
    const __m256i hi =
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_and_si256(_mm256_slli_epi16(h, 3), b4));
    _mm256_store_si256(reinterpret_cast<__m256i*>(qb + 64 * j), lo);
    _mm256_store_si256(reinterpret_cast<__m256i*>(qb + 64 * j + 32), hi);
    h = _mm256_srli_epi16(h, 2);
  }
  // the callers widen the codes 8 at a time from memory: without this barrier the compiler
  // forwards the stores and widens from registers with extra shuffles (slower)
  __asm__ volatile("" : : "r"(qb) : "memory");
}

SRT_INLINE_AVX2 void codes_q6k(const uint8_t* blk, uint8_t* qb) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30), k32 = _mm256_set1_epi8(32);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
    const __m256i hh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    // groups of 32: low nibbles of l0, l1, high nibbles of l0, l1; qh bits 0-1, 2-3, 4-5, 6-7
    const __m256i g0 = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hh, 4), m30));
    const __m256i g1 = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hh, 2), m30));
    const __m256i g2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hh, m30));
    const __m256i g3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                       _mm256_and_si256(_mm256_srli_epi16(hh, 2), m30));
    uint8_t* q = qb + 128 * h;
    _mm256_store_si256(reinterpret_cast<__m256i*>(q), _mm256_sub_epi8(g0, k32));
    _mm256_store_si256(reinterpret_cast<__m256i*>(q + 32), _mm256_sub_epi8(g1, k32));
    _mm256_store_si256(reinterpret_cast<__m256i*>(q + 64), _mm256_sub_epi8(g2, k32));
    _mm256_store_si256(reinterpret_cast<__m256i*>(q + 96), _mm256_sub_epi8(g3, k32));
  }
  __asm__ volatile("" : : "r"(qb) : "memory");  // as in codes_q5k
}

// ---- dequant_row ----

template <bool kHigh>
SRT_TARGET_AVX2 void dequant_row_q45k(const uint8_t* row, float* out, int64_t k) {
  constexpr int TS = kHigh ? kQ5KBytes : kQ4KBytes;
  const __m256i m4 = _mm256_set1_epi32(0xF);
  alignas(32) float ds[8], dm[8];
  alignas(32) uint8_t qb[kHigh ? kQK : 1];
  for (int64_t b = 0; b < k / kQK; ++b) {
    const uint8_t* blk = row + b * TS;
    float* o = out + b * kQK;
    __m256 vds, vdm;
    scales_q45k(blk, &vds, &vdm);
    _mm256_store_ps(ds, vds);
    _mm256_store_ps(dm, vdm);
    if (kHigh) codes_q5k(blk, qb);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256 dl = _mm256_broadcast_ss(ds + 2 * j), ml = _mm256_broadcast_ss(dm + 2 * j);
      const __m256 dh = _mm256_broadcast_ss(ds + 2 * j + 1), mh = _mm256_broadcast_ss(dm + 2 * j + 1);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m256i ql, qh;
        if (kHigh) {
          ql = widen8_u8(qb + 64 * j + 8 * c);
          qh = widen8_u8(qb + 64 * j + 32 + 8 * c);
        } else {
          const __m256i v = widen8_u8(blk + 16 + 32 * j + 8 * c);
          ql = _mm256_and_si256(v, m4);
          qh = _mm256_srli_epi32(v, 4);
        }
        // (d * sc) * q, rounded, then - (dmin * m): gguf.quants' order
        _mm256_storeu_ps(o + 64 * j + 8 * c, _mm256_sub_ps(opaque(_mm256_mul_ps(dl, _mm256_cvtepi32_ps(ql))), ml));
        _mm256_storeu_ps(o + 64 * j + 32 + 8 * c,
                         _mm256_sub_ps(opaque(_mm256_mul_ps(dh, _mm256_cvtepi32_ps(qh))), mh));
      }
    }
  }
}

SRT_TARGET_AVX2 inline void dequant_row_q6k(const uint8_t* row, float* out, int64_t k) {
  alignas(32) float ds[16];
  alignas(32) uint8_t qb[kQK];
  for (int64_t b = 0; b < k / kQK; ++b) {
    const uint8_t* blk = row + b * kQ6KBytes;
    const __m256 d = fp16_bcast(blk + 208);
    _mm256_store_ps(ds, _mm256_mul_ps(d, widen8_s8_ps(blk + 192)));
    _mm256_store_ps(ds + 8, _mm256_mul_ps(d, widen8_s8_ps(blk + 200)));
    codes_q6k(blk, qb);
    float* o = out + b * kQK;
#pragma GCC unroll 16
    for (int g = 0; g < 16; ++g) {
      const __m256 dl = _mm256_broadcast_ss(ds + g);
      _mm256_storeu_ps(o + 16 * g, _mm256_mul_ps(dl, widen8_s8_ps(qb + 16 * g)));
      _mm256_storeu_ps(o + 16 * g + 8, _mm256_mul_ps(dl, widen8_s8_ps(qb + 16 * g + 8)));
    }
  }
}

// ---- dot_rows ----
//
// Q4_K / Q5_K, M activation rows: for each pair of sub-blocks (2j: low nibbles, 2j + 1: high
// nibbles of the same 32 bytes) sum x * q in float32 lanes, then scale by d * sc into the
// running totals; the minimums go in once per super-block as -(dmin * m) . (sum of x per
// sub-block). At M <= 2 two sets of totals halve the dependency chain of the scale FMAs.
//
// kHigh = false (Q4_K): the codes are widened straight from the block (one widening per 16
// weights). kHigh = true (Q5_K): the 5-bit codes are first assembled as bytes in a 256-byte
// buffer (32 at a time), then widened from there.
template <bool kHigh, int M>
SRT_TARGET_AVX2 void dot_q45k(const uint8_t* row, int64_t nb, const float* x, int64_t ldx, const float* xsum16,
                              int64_t ldxs, float* out, int64_t ldo) {
  constexpr int TS = kHigh ? kQ5KBytes : kQ4KBytes;
  constexpr int T = M <= 2 ? 2 : 1;
  __m256 tot[T][M];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < M; ++r) tot[t][r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi32(0xF);
  alignas(32) float ds[8];
  alignas(32) uint8_t qb[kHigh ? kQK : 1];
  const float* xp[M];  // the activation rows at super-block b
  for (int r = 0; r < M; ++r) xp[r] = x + r * ldx;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * TS;
    __m256 vds, vdm;
    scales_q45k(blk, &vds, &vdm);
    _mm256_store_ps(ds, vds);
    // hadd of the 16 group sums gives the sub-block sums in the order 0 1 4 5 2 3 6 7: put the
    // minimums in that order instead
    const __m256 dmp = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(vdm), 0xD8));
    for (int r = 0; r < M; ++r) {
      const float* xs = xsum16 + r * ldxs + 16 * b;
      const __m256 x32 = _mm256_hadd_ps(_mm256_loadu_ps(xs), _mm256_loadu_ps(xs + 8));
      tot[0][r] = _mm256_fnmadd_ps(dmp, x32, tot[0][r]);
    }
    const uint8_t* qs = blk + 16;
    if (kHigh) codes_q5k(blk, qb);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m256 lo[M], hi[M];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m256 fl, fh;
        if (kHigh) {
          fl = _mm256_cvtepi32_ps(widen8_u8(qb + 64 * j + 8 * c));
          fh = _mm256_cvtepi32_ps(widen8_u8(qb + 64 * j + 32 + 8 * c));
        } else {
          const __m256i v = widen8_u8(qs + 32 * j + 8 * c);
          fl = _mm256_cvtepi32_ps(_mm256_and_si256(v, m4));
          fh = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        }
        for (int r = 0; r < M; ++r) {
          const float* xr = xp[r] + 64 * j + 8 * c;
          if (c == 0) {
            lo[r] = _mm256_mul_ps(fl, _mm256_loadu_ps(xr));
            hi[r] = _mm256_mul_ps(fh, _mm256_loadu_ps(xr + 32));
          } else {
            lo[r] = _mm256_fmadd_ps(fl, _mm256_loadu_ps(xr), lo[r]);
            hi[r] = _mm256_fmadd_ps(fh, _mm256_loadu_ps(xr + 32), hi[r]);
          }
        }
      }
      const __m256 sl = _mm256_broadcast_ss(ds + 2 * j), sh = _mm256_broadcast_ss(ds + 2 * j + 1);
      for (int r = 0; r < M; ++r) {
        tot[0][r] = _mm256_fmadd_ps(sl, lo[r], tot[0][r]);
        tot[T - 1][r] = _mm256_fmadd_ps(sh, hi[r], tot[T - 1][r]);
      }
    }
    for (int r = 0; r < M; ++r) xp[r] += kQK;
  }
  for (int r = 0; r < M; ++r) {
    __m256 t = tot[0][r];
    if (T == 2) t = _mm256_add_ps(t, tot[T - 1][r]);
    out[r * ldo] = VecAvx2::hsum(t);
  }
}

// Q6_K: the codes minus 32 are assembled as int8 in a 256-byte buffer, then widened 8 at a time.
// M = 1: per group of 16, sum x * q and scale the sum by d * sc (4 running totals); M > 1:
// scale the codes once (w = (d * sc) * q, the dequantized weights) and FMA them into every row.
template <int M>
SRT_TARGET_AVX2 void dot_q6k(const uint8_t* row, int64_t nb, const float* x, int64_t ldx, float* out, int64_t ldo) {
  constexpr int NA = M == 1 ? 4 : (M == 2 ? 4 : 2);  // accumulators per row
  __m256 acc[NA][M];
  for (int a = 0; a < NA; ++a)
    for (int r = 0; r < M; ++r) acc[a][r] = _mm256_setzero_ps();
  alignas(32) float ds[16];
  alignas(32) uint8_t qb[kQK];
  const float* xp[M];  // the activation rows at super-block b
  for (int r = 0; r < M; ++r) xp[r] = x + r * ldx;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kQ6KBytes;
    const __m256 d = fp16_bcast(blk + 208);
    _mm256_store_ps(ds, _mm256_mul_ps(d, widen8_s8_ps(blk + 192)));
    _mm256_store_ps(ds + 8, _mm256_mul_ps(d, widen8_s8_ps(blk + 200)));
    codes_q6k(blk, qb);
    if constexpr (M == 1) {
      const float* xb = xp[0];
#pragma GCC unroll 16
      for (int g = 0; g < 16; ++g) {
        __m256 s = _mm256_mul_ps(widen8_s8_ps(qb + 16 * g), _mm256_loadu_ps(xb + 16 * g));
        s = _mm256_fmadd_ps(widen8_s8_ps(qb + 16 * g + 8), _mm256_loadu_ps(xb + 16 * g + 8), s);
        acc[g % NA][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(ds + g), s, acc[g % NA][0]);
      }
    } else {
#pragma GCC unroll 32
      for (int c = 0; c < 32; ++c) {
        const __m256 w = _mm256_mul_ps(_mm256_broadcast_ss(ds + c / 2), widen8_s8_ps(qb + 8 * c));
        for (int r = 0; r < M; ++r)
          acc[c % NA][r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xp[r] + 8 * c), acc[c % NA][r]);
      }
    }
    for (int r = 0; r < M; ++r) xp[r] += kQK;
  }
  for (int r = 0; r < M; ++r) {
    __m256 t = acc[0][r];
    for (int a = 1; a < NA; ++a) t = _mm256_add_ps(t, acc[a][r]);
    out[r * ldo] = VecAvx2::hsum(t);
  }
}

template <bool kHigh>
SRT_TARGET_AVX2 void dot_rows_q45k(const uint8_t* row, int64_t k, const float* x, int64_t ldx, const float* xsum16,
                                   int64_t ldxs, int64_t m, float* out, int64_t ldo) {
  const int64_t nb = k / kQK;
  switch (m) {
    case 1: dot_q45k<kHigh, 1>(row, nb, x, ldx, xsum16, ldxs, out, ldo); break;
    case 2: dot_q45k<kHigh, 2>(row, nb, x, ldx, xsum16, ldxs, out, ldo); break;
    case 3: dot_q45k<kHigh, 3>(row, nb, x, ldx, xsum16, ldxs, out, ldo); break;
    case 4: dot_q45k<kHigh, 4>(row, nb, x, ldx, xsum16, ldxs, out, ldo); break;
    default: break;
  }
}

SRT_TARGET_AVX2 inline void dot_rows_q6k(const uint8_t* row, int64_t k, const float* x, int64_t ldx,
                                         const float* /*xsum16*/, int64_t /*ldxs*/, int64_t m, float* out,
                                         int64_t ldo) {
  const int64_t nb = k / kQK;
  switch (m) {
    case 1: dot_q6k<1>(row, nb, x, ldx, out, ldo); break;
    case 2: dot_q6k<2>(row, nb, x, ldx, out, ldo); break;
    case 3: dot_q6k<3>(row, nb, x, ldx, out, ldo); break;
    case 4: dot_q6k<4>(row, nb, x, ldx, out, ldo); break;
    default: break;
  }
}

}  // namespace avx2

// AVX-512 dot_rows: the AVX2 functions' arithmetic 16 lanes at a time (the scales, the codes and
// the minimum terms through the AVX2 helpers above). Sums are grouped differently, so the results
// differ from the AVX2 ones by float rounding (dot_rows needs no bit-exactness); dequant_row does
// the AVX2 one's lane-wise arithmetic on 16 lanes, so it is bit-exact too.
namespace avx512 {

SRT_INLINE_AVX512 __m512i widen16_u8(const uint8_t* p) {  // 16 bytes -> 16 int32 lanes (zero-extended)
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

SRT_INLINE_AVX512 __m512 widen16_s8_ps(const uint8_t* p) {  // 16 int8 -> 16 float lanes
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// ---- dequant_row: the AVX2 functions' arithmetic 16 lanes at a time (bit-exact as well) ----

SRT_INLINE_AVX512 __m512 opaque(__m512 v) {  // as avx2::opaque: the product stays a rounding step
  __asm__("" : "+v"(v));
  return v;
}

template <bool kHigh>
SRT_TARGET_AVX512 void dequant_row_q45k(const uint8_t* row, float* out, int64_t k) {
  constexpr int TS = kHigh ? kQ5KBytes : kQ4KBytes;
  const __m512i m4 = _mm512_set1_epi32(0xF);
  alignas(32) float ds[8], dm[8];
  alignas(64) uint8_t qb[kHigh ? kQK : 1];
  for (int64_t b = 0; b < k / kQK; ++b) {
    const uint8_t* blk = row + b * TS;
    float* o = out + b * kQK;
    __m256 vds, vdm;
    avx2::scales_q45k(blk, &vds, &vdm);
    _mm256_store_ps(ds, vds);
    _mm256_store_ps(dm, vdm);
    if (kHigh) avx2::codes_q5k(blk, qb);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512 dl = _mm512_set1_ps(ds[2 * j]), ml = _mm512_set1_ps(dm[2 * j]);
      const __m512 dh = _mm512_set1_ps(ds[2 * j + 1]), mh = _mm512_set1_ps(dm[2 * j + 1]);
#pragma GCC unroll 2
      for (int c = 0; c < 2; ++c) {
        __m512i ql, qh;
        if (kHigh) {
          ql = widen16_u8(qb + 64 * j + 16 * c);
          qh = widen16_u8(qb + 64 * j + 32 + 16 * c);
        } else {
          const __m512i v = widen16_u8(blk + 16 + 32 * j + 16 * c);
          ql = _mm512_and_si512(v, m4);
          qh = _mm512_srli_epi32(v, 4);
        }
        _mm512_storeu_ps(o + 64 * j + 16 * c, _mm512_sub_ps(opaque(_mm512_mul_ps(dl, _mm512_cvtepi32_ps(ql))), ml));
        _mm512_storeu_ps(o + 64 * j + 32 + 16 * c,
                         _mm512_sub_ps(opaque(_mm512_mul_ps(dh, _mm512_cvtepi32_ps(qh))), mh));
      }
    }
  }
}

SRT_TARGET_AVX512 inline void dequant_row_q6k(const uint8_t* row, float* out, int64_t k) {
  alignas(32) float ds[16];
  alignas(64) uint8_t qb[kQK];
  for (int64_t b = 0; b < k / kQK; ++b) {
    const uint8_t* blk = row + b * kQ6KBytes;
    const __m256 d = avx2::fp16_bcast(blk + 208);
    _mm256_store_ps(ds, _mm256_mul_ps(d, avx2::widen8_s8_ps(blk + 192)));
    _mm256_store_ps(ds + 8, _mm256_mul_ps(d, avx2::widen8_s8_ps(blk + 200)));
    avx2::codes_q6k(blk, qb);
    float* o = out + b * kQK;
#pragma GCC unroll 16
    for (int g = 0; g < 16; ++g) _mm512_storeu_ps(o + 16 * g, _mm512_mul_ps(_mm512_set1_ps(ds[g]), widen16_s8_ps(qb + 16 * g)));
  }
}

template <bool kHigh, int M>
SRT_TARGET_AVX512 void dot_q45k(const uint8_t* row, int64_t nb, const float* x, int64_t ldx, const float* xsum16,
                                int64_t ldxs, float* out, int64_t ldo) {
  constexpr int TS = kHigh ? kQ5KBytes : kQ4KBytes;
  constexpr int T = M <= 2 ? 2 : 1;
  __m512 tot[T][M];
  __m256 mins[M];  // -(dmin * m) . (sub-block sums of x), 8 lanes as in the AVX2 code
  for (int r = 0; r < M; ++r) {
    for (int t = 0; t < T; ++t) tot[t][r] = _mm512_setzero_ps();
    mins[r] = _mm256_setzero_ps();
  }
  const __m512i m4 = _mm512_set1_epi32(0xF);
  alignas(32) float ds[8];
  alignas(64) uint8_t qb[kHigh ? kQK : 1];
  const float* xp[M];
  for (int r = 0; r < M; ++r) xp[r] = x + r * ldx;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * TS;
    __m256 vds, vdm;
    avx2::scales_q45k(blk, &vds, &vdm);
    _mm256_store_ps(ds, vds);
    const __m256 dmp = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(vdm), 0xD8));
    for (int r = 0; r < M; ++r) {
      const float* xs = xsum16 + r * ldxs + 16 * b;
      const __m256 x32 = _mm256_hadd_ps(_mm256_loadu_ps(xs), _mm256_loadu_ps(xs + 8));
      mins[r] = _mm256_fnmadd_ps(dmp, x32, mins[r]);
    }
    const uint8_t* qs = blk + 16;
    if (kHigh) avx2::codes_q5k(blk, qb);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512 lo[M], hi[M];
#pragma GCC unroll 2
      for (int c = 0; c < 2; ++c) {
        __m512 fl, fh;
        if (kHigh) {
          fl = _mm512_cvtepi32_ps(widen16_u8(qb + 64 * j + 16 * c));
          fh = _mm512_cvtepi32_ps(widen16_u8(qb + 64 * j + 32 + 16 * c));
        } else {
          const __m512i v = widen16_u8(qs + 32 * j + 16 * c);
          fl = _mm512_cvtepi32_ps(_mm512_and_si512(v, m4));
          fh = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        }
        for (int r = 0; r < M; ++r) {
          const float* xr = xp[r] + 64 * j + 16 * c;
          if (c == 0) {
            lo[r] = _mm512_mul_ps(fl, _mm512_loadu_ps(xr));
            hi[r] = _mm512_mul_ps(fh, _mm512_loadu_ps(xr + 32));
          } else {
            lo[r] = _mm512_fmadd_ps(fl, _mm512_loadu_ps(xr), lo[r]);
            hi[r] = _mm512_fmadd_ps(fh, _mm512_loadu_ps(xr + 32), hi[r]);
          }
        }
      }
      const __m512 sl = _mm512_set1_ps(ds[2 * j]), sh = _mm512_set1_ps(ds[2 * j + 1]);
      for (int r = 0; r < M; ++r) {
        tot[0][r] = _mm512_fmadd_ps(sl, lo[r], tot[0][r]);
        tot[T - 1][r] = _mm512_fmadd_ps(sh, hi[r], tot[T - 1][r]);
      }
    }
    for (int r = 0; r < M; ++r) xp[r] += kQK;
  }
  for (int r = 0; r < M; ++r) {
    __m512 t = tot[0][r];
    if (T == 2) t = _mm512_add_ps(t, tot[T - 1][r]);
    out[r * ldo] = _mm512_reduce_add_ps(t) + VecAvx2::hsum(mins[r]);
  }
}

template <int M>
SRT_TARGET_AVX512 void dot_q6k(const uint8_t* row, int64_t nb, const float* x, int64_t ldx, float* out, int64_t ldo) {
  constexpr int NA = M <= 2 ? 4 : 2;  // accumulators per row
  __m512 acc[NA][M];
  for (int a = 0; a < NA; ++a)
    for (int r = 0; r < M; ++r) acc[a][r] = _mm512_setzero_ps();
  alignas(32) float ds[16];
  alignas(64) uint8_t qb[kQK];
  const float* xp[M];
  for (int r = 0; r < M; ++r) xp[r] = x + r * ldx;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kQ6KBytes;
    const __m256 d = avx2::fp16_bcast(blk + 208);
    _mm256_store_ps(ds, _mm256_mul_ps(d, avx2::widen8_s8_ps(blk + 192)));
    _mm256_store_ps(ds + 8, _mm256_mul_ps(d, avx2::widen8_s8_ps(blk + 200)));
    avx2::codes_q6k(blk, qb);
    if constexpr (M == 1) {
      const float* xb = xp[0];
#pragma GCC unroll 16
      for (int g = 0; g < 16; ++g) {
        const __m512 s = _mm512_mul_ps(widen16_s8_ps(qb + 16 * g), _mm512_loadu_ps(xb + 16 * g));
        acc[g % NA][0] = _mm512_fmadd_ps(_mm512_set1_ps(ds[g]), s, acc[g % NA][0]);
      }
    } else {
#pragma GCC unroll 16
      for (int g = 0; g < 16; ++g) {
        const __m512 w = _mm512_mul_ps(_mm512_set1_ps(ds[g]), widen16_s8_ps(qb + 16 * g));
        for (int r = 0; r < M; ++r)
          acc[g % NA][r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xp[r] + 16 * g), acc[g % NA][r]);
      }
    }
    for (int r = 0; r < M; ++r) xp[r] += kQK;
  }
  for (int r = 0; r < M; ++r) {
    __m512 t = acc[0][r];
    for (int a = 1; a < NA; ++a) t = _mm512_add_ps(t, acc[a][r]);
    out[r * ldo] = _mm512_reduce_add_ps(t);
  }
}

// ---- dot_tile: up to 3 weight rows x up to 8 input rows, the weights dequantized in registers ----
// gguf_linear's path from 3 rows to its GEMM (gguf_linear.cpp, tile_rows_float). Each (input row,
// weight row) pair accumulates 16 lanes of w * x over the whole row in column order and is reduced
// at the end with VecAvx512::reduce_tile's tree, so a row's sums depend neither on the tile's
// shape nor on the other rows of the call. Q4_K: each weight is a lookup in its sub-block's table
// of the 16 values (d sc) q - (dmin m) (vpermps reads the low 4 bits of each index lane); Q6_K:
// dequant_row_q6k's arithmetic 16 weights at a time. Both give dequant_row's values exactly.
//
// Why this shape: on Zen 5 the 512-bit pipes issue about 2.5 vector instructions per cycle in all
// and one 512-bit load, so the work per weight outside the FMAs has to be small and shared by many
// input rows. 8 rows x 3 weight rows keep 24 accumulators (no room to keep a table: it is rebuilt
// for each 16 columns), and each load of x feeds 3 FMAs; about 74% of the FMA peak in the L1.
template <int MX, int R>
SRT_INLINE_AVX512 void tile_sums(__m512 (&acc)[MX * R], float* sums) {
  constexpr int n = MX * R;
  for (int i0 = 0; i0 < n; i0 += 16) {
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = i0 + i < n ? acc[i0 + i] : _mm512_setzero_ps();
    alignas(64) float all[16];
    _mm512_store_ps(all, VecAvx512::reduce_tile(a));
    for (int i = 0; i < 16 && i0 + i < n; ++i) sums[i0 + i] = all[i];
  }
}

// x packed for the tiles: xp[(k / 16) * MX * 16 + m * 16 + k % 16] = x[m][k] (the MX vectors of a
// 16-column step are adjacent: one stream instead of MX rows a page apart). One load of x feeds R
// FMAs (the barrier keeps the compiler from folding it into each of them).
SRT_INLINE_AVX512 __m512 load_x(const float* p) {
  __m512 v = _mm512_loadu_ps(p);
  __asm__("" : "+v"(v));
  return v;
}

// the lines of block b of R rows from pf on (the rows a later tile reads)
template <int R, int TS>
SRT_INLINE_AVX512 void prefetch_blocks(const uint8_t* pf, int64_t ldw, int64_t b) {
  for (int r = 0; r < R; ++r) {
    const char* p = reinterpret_cast<const char*>(pf + r * ldw + b * TS);
    for (int o = 0; o < TS; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
    _mm_prefetch(p + TS - 1, _MM_HINT_T0);
  }
}

template <int MX, int R>
SRT_TARGET_AVX512 void tile_q4k(const uint8_t* w, int64_t ldw, int64_t nb, const float* xp, const uint8_t* pf,
                                float* sums) {
  __m512 acc[MX * R];
  for (int i = 0; i < MX * R; ++i) acc[i] = _mm512_setzero_ps();
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t b = 0; b < nb; ++b) {
    alignas(32) float ds[R][8], dm[R][8];
    const uint8_t* qs[R];
    prefetch_blocks<R, kQ4KBytes>(pf, ldw, b);
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * ldw + b * kQ4KBytes;
      __m256 vds, vdm;
      avx2::scales_q45k(blk, &vds, &vdm);
      _mm256_store_ps(ds[r], vds);
      _mm256_store_ps(dm[r], vdm);
      qs[r] = blk + 16;
    }
    const float* xb = xp + b * kQK * MX;
#pragma GCC unroll 4
    for (int c = 0; c < 16; ++c) {  // columns 16 c ..: sub-block s = c / 2, nibble s % 2 of qs[32 (s / 2) + 16 (c % 2) ..]
      // each weight row's 16 columns as a lookup in its sub-block's table, (d sc) q - (dmin m) for
      // q = 0..15 (the permute reads the low 4 bits of each lane), computed in the register it
      // becomes (no register is left to keep it for the sub-block's other 16 columns). The product
      // is exact (at most 11 + 6 + 4 significant bits), so the fused form rounds as dequant_row's
      // product and difference do.
      const int s = c / 2;
      __m512 wv[R];
      for (int r = 0; r < R; ++r) {
        const __m512 t = _mm512_fmsub_ps(_mm512_set1_ps(ds[r][s]), iota, _mm512_set1_ps(dm[r][s]));
        __m512i q = widen16_u8(qs[r] + 32 * (s / 2) + 16 * (c % 2));
        if (s % 2 == 1) q = _mm512_srli_epi32(q, 4);
        wv[r] = _mm512_permutexvar_ps(q, t);
      }
      const float* xs = xb + c * 16 * MX;
      for (int m = 0; m < MX; ++m) {
        const __m512 xv = load_x(xs + 16 * m);
        for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_fmadd_ps(wv[r], xv, acc[m * R + r]);
      }
    }
  }
  tile_sums<MX, R>(acc, sums);
}

template <int MX, int R>
SRT_TARGET_AVX512 void tile_q6k(const uint8_t* w, int64_t ldw, int64_t nb, const float* xp, const uint8_t* pf,
                                float* sums) {
  __m512 acc[MX * R];
  for (int i = 0; i < MX * R; ++i) acc[i] = _mm512_setzero_ps();
  alignas(32) float ds[R][16];
  alignas(64) uint8_t qb[R][kQK];
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_blocks<R, kQ6KBytes>(pf, ldw, b);
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * ldw + b * kQ6KBytes;
      const __m256 d = avx2::fp16_bcast(blk + 208);
      _mm256_store_ps(ds[r], _mm256_mul_ps(d, avx2::widen8_s8_ps(blk + 192)));
      _mm256_store_ps(ds[r] + 8, _mm256_mul_ps(d, avx2::widen8_s8_ps(blk + 200)));
      avx2::codes_q6k(blk, qb[r]);
    }
    const float* xb = xp + b * kQK * MX;
#pragma GCC unroll 1
    for (int g = 0; g < 16; ++g) {
      __m512 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = _mm512_mul_ps(_mm512_set1_ps(ds[r][g]), widen16_s8_ps(qb[r] + 16 * g));
      const float* xs = xb + g * 16 * MX;
      for (int m = 0; m < MX; ++m) {
        const __m512 xv = load_x(xs + 16 * m);
        for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_fmadd_ps(wv[r], xv, acc[m * R + r]);
      }
    }
  }
  tile_sums<MX, R>(acc, sums);
}

// sums[i * rows + r] = sum over the k columns of dequant(w + r * ldw) . x[i] for i < m <= 8 and
// r < rows <= 3, x packed as the tiles read it (width m)
#define SRT_TILE_FNS(NAME, R)                                                                              \
  {&NAME<1, R>, &NAME<2, R>, &NAME<3, R>, &NAME<4, R>, &NAME<5, R>, &NAME<6, R>, &NAME<7, R>, &NAME<8, R>}

using TileFn = void (*)(const uint8_t*, int64_t, int64_t, const float*, const uint8_t*, float*);

SRT_TARGET_AVX512 inline void dot_tile_q4k(const uint8_t* w, int64_t ldw, int64_t rows, int64_t k, const float* xp,
                                           int64_t m, const uint8_t* pf, float* sums) {
  static constexpr TileFn kFns[3][8] = {SRT_TILE_FNS(tile_q4k, 1), SRT_TILE_FNS(tile_q4k, 2), SRT_TILE_FNS(tile_q4k, 3)};
  kFns[rows - 1][m - 1](w, ldw, k / kQK, xp, pf, sums);
}

SRT_TARGET_AVX512 inline void dot_tile_q6k(const uint8_t* w, int64_t ldw, int64_t rows, int64_t k, const float* xp,
                                           int64_t m, const uint8_t* pf, float* sums) {
  static constexpr TileFn kFns[3][8] = {SRT_TILE_FNS(tile_q6k, 1), SRT_TILE_FNS(tile_q6k, 2), SRT_TILE_FNS(tile_q6k, 3)};
  kFns[rows - 1][m - 1](w, ldw, k / kQK, xp, pf, sums);
}
#undef SRT_TILE_FNS

template <bool kHigh>
SRT_TARGET_AVX512 void dot_rows_q45k(const uint8_t* row, int64_t k, const float* x, int64_t ldx,
                                     const float* xsum16, int64_t ldxs, int64_t m, float* out, int64_t ldo) {
  const int64_t nb = k / kQK;
  switch (m) {
    case 1: dot_q45k<kHigh, 1>(row, nb, x, ldx, xsum16, ldxs, out, ldo); break;
    case 2: dot_q45k<kHigh, 2>(row, nb, x, ldx, xsum16, ldxs, out, ldo); break;
    case 3: dot_q45k<kHigh, 3>(row, nb, x, ldx, xsum16, ldxs, out, ldo); break;
    case 4: dot_q45k<kHigh, 4>(row, nb, x, ldx, xsum16, ldxs, out, ldo); break;
    default: break;
  }
}

SRT_TARGET_AVX512 inline void dot_rows_q6k(const uint8_t* row, int64_t k, const float* x, int64_t ldx,
                                           const float* /*xsum16*/, int64_t /*ldxs*/, int64_t m, float* out,
                                           int64_t ldo) {
  const int64_t nb = k / kQK;
  switch (m) {
    case 1: dot_q6k<1>(row, nb, x, ldx, out, ldo); break;
    case 2: dot_q6k<2>(row, nb, x, ldx, out, ldo); break;
    case 3: dot_q6k<3>(row, nb, x, ldx, out, ldo); break;
    case 4: dot_q6k<4>(row, nb, x, ldx, out, ldo); break;
    default: break;
  }
}

}  // namespace avx512
#endif  // SRT_CPU_X86

}  // namespace kquant
}  // namespace srt_cpu

// Row functions of the simple GGUF types (blocks of 32 weights, one fp16 scale each), scalar and
// AVX2; gguf_simple.cpp puts them in QuantRowOps tables (the interface is gguf_quant.h).
//
//   Q4_0  18 bytes: d (fp16), 16 bytes of 4-bit codes        w = d * (q - 8)
//   Q4_1  20 bytes: d, m (fp16), 16 bytes of 4-bit codes     w = d * q + m
//   Q8_0  34 bytes: d (fp16), 32 int8                        w = q * d
//
// Weight j < 16 of a block is the low nibble of code byte j, weight j >= 16 the high nibble of
// byte j - 16. dequant_row computes exactly gguf.quants' float32 operations in its order (the
// fp16 -> fp32 conversions are exact): the product is kept out of an FMA with an empty asm
// barrier, since g++ contracts a * b + c even when written as two intrinsics. The dot products
// dequantize each block in registers and fold the scale (and minimum) in once per block:
// Q4_1 is d * sum(x q) + m * sum(x), sum(x) from the caller's 16-element sums.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "gguf_quant.h"
#include "vec.h"

namespace srt_cpu {
namespace gguf_simple {

constexpr int kBlock = 32;
constexpr int kSizeQ4_0 = 18, kSizeQ4_1 = 20, kSizeQ8_0 = 34;

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// keeps the compiler from fusing the rounding product into a following add (FMA contraction)
inline void no_contract(float& v) {
#if SRT_CPU_X86
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#else
  volatile float t = v;
  v = t;
#endif
}

// ---------------------------------------------------------------- scalar (reference, fallback)
namespace scalar {

inline void dequant_block_q4_0(const uint8_t* b, float* out) {
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    out[j] = d * static_cast<float>(static_cast<int>(qs[j] & 0x0F) - 8);
    out[j + 16] = d * static_cast<float>(static_cast<int>(qs[j] >> 4) - 8);
  }
}

inline void dequant_block_q4_1(const uint8_t* b, float* out) {
  const float d = half_at(b), m = half_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    float lo = d * static_cast<float>(qs[j] & 0x0F), hi = d * static_cast<float>(qs[j] >> 4);
    no_contract(lo);
    no_contract(hi);
    out[j] = lo + m;
    out[j + 16] = hi + m;
  }
}

inline void dequant_block_q8_0(const uint8_t* b, float* out) {
  const float d = half_at(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < kBlock; ++j) out[j] = static_cast<float>(qs[j]) * d;
}

}  // namespace scalar

#if SRT_CPU_X86
// ---------------------------------------------------------------- AVX2 (+FMA, F16C)
namespace avx2 {

SRT_INLINE_AVX2 void no_contract(__m256& v) { asm("" : "+x"(v)); }

// d (and m) of a block: lanes 0 (and 1)
SRT_INLINE_AVX2 __m128 scales(const uint8_t* b) {
  int32_t v;
  std::memcpy(&v, b, sizeof v);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(v));
}

// the 32 codes of a 4-bit block as int32 lanes: q[t] holds weights 8 t .. 8 t + 7 (bytes
// 0..7 give weights 0..7 and 16..23, bytes 8..15 weights 8..15 and 24..31)
SRT_INLINE_AVX2 void nibbles_i32(const uint8_t* qs, __m256i q[4]) {
  const __m256i mask = _mm256_set1_epi32(0x0F);
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
  const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
  q[0] = _mm256_and_si256(b0, mask);
  q[1] = _mm256_and_si256(b1, mask);
  q[2] = _mm256_srli_epi32(b0, 4);
  q[3] = _mm256_srli_epi32(b1, 4);
}

// a block's codes as floats (Q4_0: q - 8), its minimum (Q4_1: m, folded into the dot products
// as m * sum(x)) and its dequantization in gguf.quants' exact order
struct BlockQ4_0 {
  static constexpr int kSize = kSizeQ4_0;
  static constexpr bool kHasMin = false;
  static SRT_INLINE_AVX2 void codes(const uint8_t* b, __m256 q[4]) {  // q - 8
    __m256i qi[4];
    nibbles_i32(b + 2, qi);
    for (int t = 0; t < 4; ++t) q[t] = _mm256_cvtepi32_ps(_mm256_sub_epi32(qi[t], _mm256_set1_epi32(8)));
  }
  static SRT_INLINE_AVX2 float min_of(__m128) { return 0.f; }
  static SRT_INLINE_AVX2 void dequant(const uint8_t* b, float* out);
};

struct BlockQ4_1 {
  static constexpr int kSize = kSizeQ4_1;
  static constexpr bool kHasMin = true;
  static SRT_INLINE_AVX2 void codes(const uint8_t* b, __m256 q[4]) {
    __m256i qi[4];
    nibbles_i32(b + 4, qi);
    for (int t = 0; t < 4; ++t) q[t] = _mm256_cvtepi32_ps(qi[t]);
  }
  static SRT_INLINE_AVX2 float min_of(__m128 dm) { return _mm_cvtss_f32(_mm_movehdup_ps(dm)); }
  static SRT_INLINE_AVX2 void dequant(const uint8_t* b, float* out);
};

struct BlockQ8_0 {
  static constexpr int kSize = kSizeQ8_0;
  static constexpr bool kHasMin = false;
  static SRT_INLINE_AVX2 void codes(const uint8_t* b, __m256 q[4]) {
    for (int t = 0; t < 4; ++t) {
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * t));
      q[t] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    }
  }
  static SRT_INLINE_AVX2 float min_of(__m128) { return 0.f; }
  static SRT_INLINE_AVX2 void dequant(const uint8_t* b, float* out);
};

SRT_INLINE_AVX2 void BlockQ4_0::dequant(const uint8_t* b, float* out) {  // d * (q - 8)
  __m256 q[4];
  codes(b, q);
  const __m256 d = _mm256_broadcastss_ps(scales(b));
  for (int t = 0; t < 4; ++t) _mm256_storeu_ps(out + 8 * t, _mm256_mul_ps(d, q[t]));
}

SRT_INLINE_AVX2 void BlockQ4_1::dequant(const uint8_t* b, float* out) {  // d * q + m, rounded twice
  __m256 q[4];
  codes(b, q);
  const __m128 dm = scales(b);
  const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
  for (int t = 0; t < 4; ++t) {
    __m256 p = _mm256_mul_ps(d, q[t]);
    no_contract(p);
    _mm256_storeu_ps(out + 8 * t, _mm256_add_ps(p, m));
  }
}

SRT_INLINE_AVX2 void BlockQ8_0::dequant(const uint8_t* b, float* out) {  // q * d
  __m256 q[4];
  codes(b, q);
  const __m256 d = _mm256_broadcastss_ps(scales(b));
  for (int t = 0; t < 4; ++t) _mm256_storeu_ps(out + 8 * t, _mm256_mul_ps(q[t], d));
}

template <class B>
SRT_TARGET_AVX2 void dequant_row(const uint8_t* row, float* out, int64_t k) {
  for (int64_t b = 0; b < k / kBlock; ++b) B::dequant(row + b * B::kSize, out + b * kBlock);
}

// one block for MR input rows: acc[i] += d * sum(x q), mins[i] += min * sum(x)
template <class B, int MR>
SRT_INLINE_AVX2 void dot_block(const uint8_t* blk, int64_t b, const float* x, int64_t ldx, const float* xs,
                               int64_t ldxs, __m256* acc, float* mins) {
  __m256 q[4];
  B::codes(blk, q);
  const __m128 dm = scales(blk);
  const __m256 d = _mm256_broadcastss_ps(dm);
  for (int i = 0; i < MR; ++i) {
    const float* xb = x + i * ldx + b * kBlock;
    __m256 s = _mm256_mul_ps(_mm256_loadu_ps(xb), q[0]);
    s = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), q[1], s);
    s = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), q[2], s);
    s = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q[3], s);
    acc[i] = _mm256_fmadd_ps(d, s, acc[i]);
  }
  if constexpr (B::kHasMin) {
    const float m = B::min_of(dm);
    for (int i = 0; i < MR; ++i) mins[i] += m * (xs[i * ldxs + 2 * b] + xs[i * ldxs + 2 * b + 1]);
  }
}

template <class B, int MR>
SRT_TARGET_AVX2 void dot_rows_m(const uint8_t* row, int64_t k, const float* x, int64_t ldx, const float* xs,
                                int64_t ldxs, float* out, int64_t ldo) {
  // even and odd blocks accumulate apart: two dependency chains each
  __m256 acc0[MR], acc1[MR];
  float mins0[MR], mins1[MR];
  for (int i = 0; i < MR; ++i) {
    acc0[i] = acc1[i] = _mm256_setzero_ps();
    mins0[i] = mins1[i] = 0.f;
  }
  const int64_t nb = k / kBlock;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    dot_block<B, MR>(row + b * B::kSize, b, x, ldx, xs, ldxs, acc0, mins0);
    dot_block<B, MR>(row + (b + 1) * B::kSize, b + 1, x, ldx, xs, ldxs, acc1, mins1);
  }
  if (b < nb) dot_block<B, MR>(row + b * B::kSize, b, x, ldx, xs, ldxs, acc0, mins0);
  for (int i = 0; i < MR; ++i) {
    out[i * ldo] = VecAvx2::hsum(_mm256_add_ps(acc0[i], acc1[i])) + (mins0[i] + mins1[i]);
  }
}

template <class B>
SRT_TARGET_AVX2 void dot_rows(const uint8_t* row, int64_t k, const float* x, int64_t ldx, const float* xs,
                              int64_t ldxs, int64_t m, float* out, int64_t ldo) {
  switch (m) {
    case 1: dot_rows_m<B, 1>(row, k, x, ldx, xs, ldxs, out, ldo); break;
    case 2: dot_rows_m<B, 2>(row, k, x, ldx, xs, ldxs, out, ldo); break;
    case 3: dot_rows_m<B, 3>(row, k, x, ldx, xs, ldxs, out, ldo); break;
    case 4: dot_rows_m<B, 4>(row, k, x, ldx, xs, ldxs, out, ldo); break;
    default: break;
  }
}

}  // namespace avx2
#endif  // SRT_CPU_X86

}  // namespace gguf_simple
}  // namespace srt_cpu

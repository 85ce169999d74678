// Activations as 24-bit block fixed point, the operand of the integer-dot paths on float32
// activations (gguf_a24.cpp: Q4_K and Q6_K rows; gguf_x8_a24.cpp: Q4_0 and Q4_1 in the x8 layout).
// The numerics are gguf_a24.cpp's: per block of 32, u = max |x| / (127 * 2^16) and V = rint(x / u)
// split exactly into three signed bytes, V = 2^16 hi + 2^8 mid + lo, stored as three planes.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gguf_q8act_vnni.h"

namespace srt_cpu {
namespace a24 {

constexpr int64_t kBlock = 32;          // activations per scale u
constexpr float kVmax = 127.f * 65536;  // |V| bound: the top byte stays in [-127, 127]

// what a kernel needs besides the planes, and in which order the planes hold the blocks
enum class Split {
  kQ4K,  // blocks of each 128 reordered 0, 2, 1, 3 (plane_offset_q4k)
  kQ6K,  // natural order; n32: -32 (sum of V over each 4 consecutive)
  kX8,   // natural order; vsum: the sum of V over each block
};

// M activation rows in 24-bit block fixed point
struct A24 {
  std::vector<int8_t> q;      // [M][3][K]: the planes hi, mid, lo of V
  std::vector<float> u;       // [M][K / 32]: x ~ u V
  std::vector<float> s;       // [M][K / 32]: float sum of x (the minimum / offset terms)
  std::vector<int32_t> n32;   // [M][K / 4]: Split::kQ6K only
  std::vector<int32_t> vsum;  // [M][K / 32]: Split::kX8 only
  int64_t k = 0, nb = 0;
  int64_t ld = 0;  // bytes from one plane to the next: K plus a cache line, so that the planes of a
                   // tile do not all map to the same L1 sets when K is a multiple of 4 KiB
  const int8_t* plane(int64_t i, int p) const { return q.data() + (3 * i + p) * ld; }
};

#if SRT_CPU_X86
// Q4_K's planes put the blocks of each 128 activations in the order 0, 2, 1, 3: one 64-byte load of
// a super-block's codes gives the low nibbles of 64 bytes (sub-blocks 4k and 4k + 2) and, shifted,
// the high ones (4k + 1 and 4k + 3), so each code vector meets 64 consecutive plane bytes
inline int64_t plane_offset_q4k(int64_t b) {
  constexpr int64_t kOrder[4] = {0, 2, 1, 3};
  return (b - b % 4 + kOrder[b % 4]) * kBlock;
}

// row i of x -> its planes, scales and sums, and the mode's extra sums
SRT_TARGET_VNNI inline void split_row(const float* x, Split mode, A24& a, int64_t i) {
  const int64_t K = a.k;
  int8_t* hi = a.q.data() + 3 * i * a.ld;
  int8_t* mid = hi + a.ld;
  int8_t* lo = hi + 2 * a.ld;
  float* u = a.u.data() + i * a.nb;
  float* s = a.s.data() + i * a.nb;
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512i vmax = _mm512_set1_epi32(static_cast<int>(kVmax)), vmin = _mm512_set1_epi32(-static_cast<int>(kVmax));
  const __m512i c128 = _mm512_set1_epi32(128), m255 = _mm512_set1_epi32(255);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, abs_mask), _mm512_and_ps(v1, abs_mask)));
    s[b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    const bool nan = (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) != 0;
    float ub = 0.f, inv = 0.f;
    if (nan || !(amax <= 3.4e38f)) {
      ub = std::numeric_limits<float>::quiet_NaN();  // inf or NaN in the block: the sums are NaN
    } else if (amax >= 1e-30f) {
      ub = amax / kVmax;
      inv = kVmax / amax;
    }
    u[b] = ub;
    const __m512 vi = _mm512_set1_ps(inv);
    __m512i vtotal = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      __m512i V = _mm512_cvtps_epi32(_mm512_mul_ps(h == 0 ? v0 : v1, vi));  // round to nearest
      V = _mm512_min_epi32(_mm512_max_epi32(V, vmin), vmax);
      vtotal = _mm512_add_epi32(vtotal, V);
      // balanced base-256 digits: lo, mid in [-128, 127]; the shifts are exact (multiples of 256)
      const __m512i l = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(V, c128), m255), c128);
      const __m512i t = _mm512_srai_epi32(_mm512_sub_epi32(V, l), 8);
      const __m512i m = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(t, c128), m255), c128);
      const __m512i H = _mm512_srai_epi32(_mm512_sub_epi32(t, m), 8);
      const int64_t o = b * kBlock + 16 * h;
      const int64_t po = mode == Split::kQ4K ? plane_offset_q4k(b) + 16 * h : o;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + po), _mm512_cvtepi32_epi8(H));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(mid + po), _mm512_cvtepi32_epi8(m));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + po), _mm512_cvtepi32_epi8(l));
      if (mode == Split::kQ6K) {
        alignas(64) int32_t vs[16];
        _mm512_store_si512(vs, V);
        int32_t* n32 = a.n32.data() + i * K / 4;
        for (int g = 0; g < 4; ++g) n32[o / 4 + g] = -32 * (vs[4 * g] + vs[4 * g + 1] + vs[4 * g + 2] + vs[4 * g + 3]);
      }
    }
    if (mode == Split::kX8) a.vsum[i * a.nb + b] = _mm512_reduce_add_epi32(vtotal);  // |sum| <= 32 * 127 * 2^16
  }
}

// x [M, K] (row stride ldx, K a multiple of 32) in 24-bit block fixed point
inline A24 split_x(const float* x, int64_t ldx, int64_t M, int64_t K, Split mode) {
  A24 a;
  a.k = K;
  a.ld = K + 64;
  a.nb = K / kBlock;
  a.q.resize(static_cast<size_t>(3 * M * a.ld));
  a.u.resize(static_cast<size_t>(M * a.nb));
  a.s.resize(static_cast<size_t>(M * a.nb));
  if (mode == Split::kQ6K) a.n32.resize(static_cast<size_t>(M * K / 4));
  if (mode == Split::kX8) a.vsum.resize(static_cast<size_t>(M * a.nb));
  for (int64_t i = 0; i < M; ++i) split_row(x + i * ldx, mode, a, i);
  return a;
}
#endif  // SRT_CPU_X86

}  // namespace a24
}  // namespace srt_cpu

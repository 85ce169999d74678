// W8A8's activation codes: each row of x (float32, or bf16 widened exactly) quantized to int8 with
// one float32 scale (the scheme's per-token quantization), and the rows of outputs written back in
// x's dtype; shared by the int8 kernels of w8a8_linear.cpp (VNNI groups) and w8a8_amx.cpp (AMX
// panels).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_simple_rows.h"
#include "vec.h"

#if SRT_CPU_X86
#include <immintrin.h>
#define SRT_TARGET_W8A8_CODES __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#endif

namespace srt_cpu {
namespace w8a8 {

// x's rows quantized per row: codes [M, ldq] (ldq: K rounded up to 64, zero past K), scales [M], 128 * sum of codes [M]
struct TokenCodes {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> offset;
  int64_t ldq = 0;
};

// one row's scale (float32 division, as torch's) and codes (rint in the default rounding mode:
// half to even, as torch.round), returning 128 * the codes' sum; a bf16 row gives the codes of its
// float32 widening (exact)
template <typename T>
inline int32_t quantize_row(const T* row, int64_t K, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(row[k])));
  float s = amax / 127.5f;
  if (s == 0.f) s = FLT_EPSILON;
  int32_t sum = 0;
  for (int64_t k = 0; k < K; ++k) {
    q[k] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, std::nearbyint(static_cast<float>(row[k]) / s))));
    sum += q[k];
  }
  *scale = s;
  return 128 * sum;
}

#if SRT_CPU_X86
// 16 lanes of a float32 or bf16 row, as float32
SRT_TARGET_W8A8_CODES inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
SRT_TARGET_W8A8_CODES inline __m512 load16(const at::BFloat16* p) {
  return VecAvx512::load_bf16(reinterpret_cast<const uint16_t*>(p));
}

// the same in 16 lanes (division and round-to-nearest-even are exact operations: the same codes)
template <typename T>
SRT_TARGET_W8A8_CODES inline int32_t quantize_row_avx512(const T* row, int64_t K, int8_t* q, float* scale) {
  __m512 m = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load16(row + k)));
  float s = _mm512_reduce_max_ps(m) / 127.5f;
  if (s == 0.f) s = FLT_EPSILON;
  const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(row + k), sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i c = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, v)));
    sum = _mm512_add_epi32(sum, c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(c));
  }
  *scale = s;
  return 128 * _mm512_reduce_add_epi32(sum);
}
#endif

template <typename T>
inline TokenCodes quantize_rows(const T* x, int64_t ldx, int64_t M, int64_t K, bool vec) {
  TokenCodes t;
  t.ldq = (K + 63) / 64 * 64;
  t.q.assign(static_cast<size_t>(M * t.ldq), 0);
  t.scale.resize(static_cast<size_t>(M));
  t.offset.resize(static_cast<size_t>(M));
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      int8_t* q = t.q.data() + i * t.ldq;
#if SRT_CPU_X86
      if (vec) {
        t.offset[i] = quantize_row_avx512(x + i * ldx, K, q, &t.scale[i]);
        continue;
      }
#endif
      (void)vec;
      t.offset[i] = quantize_row(x + i * ldx, K, q, &t.scale[i]);
    }
  });
  return t;
}

constexpr int64_t kMaxRowOut = 64;  // outputs of a row store_scaled writes at once

// outputs j < cols (at most kMaxRowOut) of one activation row: y[j] = float(dots[j]) * (sa * dw[j]) +
// bias[j] (bias null: + 0) in float32, then in y's dtype (vec.h's store_row): a bf16 output is the
// float32 output rounded
template <typename OT>
inline void store_scaled(const int32_t* dots, float sa, const float* dw, const float* bias, int64_t cols, OT* y) {
  float row[kMaxRowOut];
  float* f = row;
  if constexpr (std::is_same_v<OT, float>) f = y;
  for (int64_t j = 0; j < cols; ++j) f[j] = static_cast<float>(dots[j]) * (sa * dw[j]) + (bias != nullptr ? bias[j] : 0.f);
  if constexpr (!std::is_same_v<OT, float>) store_row(row, nullptr, cols, y);
}

// Q8_0 rows [N, K / 32 * 34] of one scale each regrouped once at load into blocks of R rows, `bytes`
// each (the last padded with zeros): a block starts with its rows' scales as float32, and row r's
// codes k .. k + Run - 1 (k a multiple of Run, which divides 32) go to the consecutive bytes from
// place(r, k) of its block, xor `flip`
template <int64_t Run, typename Place>
at::Tensor regroup_rows(const at::Tensor& data, int64_t R, int64_t bytes, uint8_t flip, Place place) {
  constexpr int64_t kBlock = 32, kBlockBytes = gguf_simple::kSizeQ8_0;
  static_assert(kBlock % Run == 0, "a run of codes lies in one Q8_0 block");
  const int64_t N = data.size(0), bpr = data.size(1), K = bpr / kBlockBytes * kBlock;
  at::Tensor packed = at::zeros({(N + R - 1) / R, bytes}, data.options());
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      uint8_t* out = dst + g * bytes;
      for (int64_t r = 0; r < R && g * R + r < N; ++r) {
        const uint8_t* row = src + (g * R + r) * bpr;
        const float scale = gguf_simple::half_at(row);
        std::memcpy(out + r * sizeof(float), &scale, sizeof(float));
        for (int64_t k = 0; k < K; k += Run) {
          uint8_t* to = out + place(r, k);
          const uint8_t* from = row + k / kBlock * kBlockBytes + 2 + k % kBlock;
          for (int64_t j = 0; j < Run; ++j) to[j] = from[j] ^ flip;
        }
      }
    }
  });
  return packed;
}

}  // namespace w8a8
}  // namespace srt_cpu

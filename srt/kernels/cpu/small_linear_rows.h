// Row loops of small_linear.cpp for one instruction set (compiled once per ISA through
// isa_instances.h, like elementwise_rows.h).
//
// out[m, n] = dot(x[m, :], w[n, :]) (+ bias[n]) for output rows n in [n0, n1): each weight row is
// read from memory once and multiplied with every input row, R weight rows by up to 4 input
// rows at a time so that the R * 4 accumulators hide the FMA latency.
#include <cstdint>

#include "vec.h"

namespace srt_cpu {
namespace SRT_ISA_NS {

using V = SRT_ISA_VEC;

template <int M, int R>
SRT_ISA_TARGET inline void dot_block(const float* x, int64_t xs, const float* w, int64_t K, float* out, int64_t os,
                                     const float* bias, int64_t n) {
  typename V::reg acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = V::zero();
  int64_t k = 0;
  for (; k + V::W <= K; k += V::W) {
    typename V::reg xv[M];
    for (int m = 0; m < M; ++m) xv[m] = V::load(x + m * xs + k);
    for (int r = 0; r < R; ++r) {
      const typename V::reg wv = V::load(w + (n + r) * K + k);
      for (int m = 0; m < M; ++m) acc[r][m] = V::fmadd(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) {
      float s = V::hsum(acc[r][m]);
      for (int64_t kk = k; kk < K; ++kk) s += w[(n + r) * K + kk] * x[m * xs + kk];
      out[m * os + n + r] = s + (bias ? bias[n + r] : 0.f);
    }
  }
}

// rows [n0, n1) for all M input rows: R weight rows at a time, each block applied to the input
// rows in groups of 4 while it sits in L1, so the weights stream from memory once for any M
template <int R>
SRT_ISA_TARGET void small_linear_rows_r(int64_t M, const float* x, int64_t xs, const float* w, int64_t K, float* out,
                                        int64_t os, const float* bias, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) dot_block<4, R>(x + m * xs, xs, w, K, out + m * os, os, bias, n);
    switch (M - m) {
      case 3: dot_block<3, R>(x + m * xs, xs, w, K, out + m * os, os, bias, n); break;
      case 2: dot_block<2, R>(x + m * xs, xs, w, K, out + m * os, os, bias, n); break;
      case 1: dot_block<1, R>(x + m * xs, xs, w, K, out + m * os, os, bias, n); break;
      default: break;
    }
  }
  for (; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) dot_block<1, 1>(x + m * xs, xs, w, K, out + m * os, os, bias, n);
  }
}

SRT_ISA_TARGET void small_linear_rows(int64_t M, const float* x, int64_t xs, const float* w, int64_t K, float* out,
                                      int64_t os, const float* bias, int64_t n0, int64_t n1) {
  if (M <= 2) {
    small_linear_rows_r<4>(M, x, xs, w, K, out, os, bias, n0, n1);
  } else {
    small_linear_rows_r<2>(M, x, xs, w, K, out, os, bias, n0, n1);
  }
}

}  // namespace SRT_ISA_NS
}  // namespace srt_cpu

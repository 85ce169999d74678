// W8A8 matmuls: int8 weights with one scale a row (a compressed-tensors W8A8 checkpoint's layers,
// kept as Q8_0 blocks whose scales are all the row's) times activations quantized to int8 per row
// (token), as the scheme says; integer dot products, one float scaling per output.
//
//   gguf_linear_w8a8(x [M, K] f32, data [N, K / 32 * 34] u8, bias?, isa) -> [M, N] f32
//       Each row of x: scale sa = max|x| / 127.5 (float32; a row of zeros: float32's epsilon),
//       codes q = clamp(round-half-even(x / sa), -128, 127): the codes and scale of srt/layers/
//       linear.py's fake_quant_rows, bit for bit. Then out[m, n] = float(sum_k q[m, k] w[n, k]) *
//       (sa[m] * dw[n]) + bias[n], with w the weight's int8 codes and dw its first block's float16
//       scale (the caller guarantees every block of a row has it: QuantizedWeight.use_token_int8).
//       The integer sums are exact (|sum| < 2^31 for K <= 65536), so against the float reference
//       (codes * scales multiplied in float32) only that reference's own rounding differs.
//   gguf_w8a8_fast() -> whether this CPU has the vector path (AVX-512 VNNI, and detect_isa() not
//       lowered below AVX-512); elsewhere the op runs scalar loops (tests, and isa "scalar" /
//       "avx2"), and srt keeps the float32 path instead.
//
// The vector path: _mm512_dpbusd_epi32 multiplies 64 unsigned bytes by 64 signed ones, adding each
// 4 consecutive products into one of 16 int32 lanes. The weights are the unsigned operand, their
// sign bit flipped (w + 128), the activation codes the signed one, so both keep the full int8
// range: sum (w + 128) q = sum w q + 128 sum q, and 128 sum q is one number per activation row.
// Two Q8_0 blocks (32 codes each, 34 bytes apart) fill one 512-bit register. Tiles of 4 weight rows
// by up to 4 activation rows; threads take groups of 4 weight rows, activation rows in chunks of
// 64 so that a chunk's codes stay in cache while every weight group passes over them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_ops.h"
#include "gguf_simple_rows.h"

#if SRT_CPU_X86
#include <immintrin.h>
#define SRT_TARGET_W8A8 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#endif

namespace srt_cpu {
namespace {

constexpr int64_t kBlock = 32, kBlockBytes = gguf_simple::kSizeQ8_0;
constexpr int kWRows = 4, kXRows = 4;
constexpr int64_t kXChunk = 64;  // activation rows per pass of the weights
constexpr int64_t kMaxK = 65536;

bool vnni_available() {
#if SRT_CPU_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }();
  return ok;
#else
  return false;
#endif
}

// x's rows quantized per row: codes [M, K], scales [M], 128 * sum of each row's codes [M]
struct TokenCodes {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> offset;
};

TokenCodes quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K) {
  TokenCodes t;
  t.q.resize(static_cast<size_t>(M * K));
  t.scale.resize(static_cast<size_t>(M));
  t.offset.resize(static_cast<size_t>(M));
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* row = x + i * ldx;
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
      float s = amax / 127.5f;
      if (s == 0.f) s = FLT_EPSILON;
      int8_t* q = t.q.data() + i * K;
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) {
        const float v = std::min(127.f, std::max(-128.f, std::nearbyint(row[k] / s)));
        q[k] = static_cast<int8_t>(v);
        sum += q[k];
      }
      t.scale[i] = s;
      t.offset[i] = 128 * sum;
    }
  });
  return t;
}

// out[i * ldo + r] = sum_k q[i][k] w_r[k] for `rows` weight rows from w and activation rows
// i0 .. i1 (integer sums, plain loops)
void dots_scalar(const uint8_t* w, int64_t bpr, int64_t rows, const TokenCodes& t, int64_t K, int64_t i0,
                 int64_t i1, int32_t* out, int64_t ldo) {
  for (int64_t i = i0; i < i1; ++i) {
    const int8_t* q = t.q.data() + i * K;
    for (int64_t r = 0; r < rows; ++r) {
      int32_t sum = 0;
      for (int64_t b = 0; b < K / kBlock; ++b) {
        const int8_t* codes = reinterpret_cast<const int8_t*>(w + r * bpr + b * kBlockBytes + 2);
        for (int64_t j = 0; j < kBlock; ++j) sum += static_cast<int32_t>(codes[j]) * q[b * kBlock + j];
      }
      out[(i - i0) * ldo + r] = sum;
    }
  }
}

#if SRT_CPU_X86
// two blocks' codes (b, b + 1; only b's when `one`), sign bits flipped: the unsigned operand
SRT_TARGET_W8A8 inline __m512i weight_pair(const uint8_t* row, int64_t b, bool one) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlockBytes + 2));
  const __m256i hi =
      one ? _mm256_setzero_si256() : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (b + 1) * kBlockBytes + 2));
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  return _mm512_xor_si512(both, _mm512_set1_epi8(static_cast<char>(0x80)));
}

template <int R, int MX>
SRT_TARGET_W8A8 void tile_vnni(const uint8_t* w, int64_t bpr, const int8_t* q, int64_t K, int32_t* out, int64_t ldo,
                               const int32_t* offset) {
  __m512i acc[R][MX];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MX; ++i) acc[r][i] = _mm512_setzero_si512();
  const int64_t nb = K / kBlock;
  for (int64_t b = 0; b < nb; b += 2) {
    const bool one = b + 1 == nb;
    __m512i xv[MX];
    for (int i = 0; i < MX; ++i) {
      const int8_t* p = q + i * K + b * kBlock;
      xv[i] = one ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
                  : _mm512_loadu_si512(p);
      if (one) xv[i] = _mm512_inserti64x4(xv[i], _mm256_setzero_si256(), 1);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i wv = weight_pair(w + r * bpr, b, one);
      for (int i = 0; i < MX; ++i) acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], wv, xv[i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MX; ++i) out[i * ldo + r] = _mm512_reduce_add_epi32(acc[r][i]) - offset[i];
}

template <int R>
void tiles_vnni(const uint8_t* w, int64_t bpr, const TokenCodes& t, int64_t K, int64_t i0, int64_t i1, int32_t* out,
                int64_t ldo) {
  for (int64_t i = i0; i < i1; i += kXRows) {
    const int8_t* q = t.q.data() + i * K;
    const int32_t* off = t.offset.data() + i;
    int32_t* o = out + (i - i0) * ldo;
    switch (std::min<int64_t>(kXRows, i1 - i)) {
      case 1: tile_vnni<R, 1>(w, bpr, q, K, o, ldo, off); break;
      case 2: tile_vnni<R, 2>(w, bpr, q, K, o, ldo, off); break;
      case 3: tile_vnni<R, 3>(w, bpr, q, K, o, ldo, off); break;
      default: tile_vnni<R, 4>(w, bpr, q, K, o, ldo, off); break;
    }
  }
}

void dots_vnni(const uint8_t* w, int64_t bpr, int64_t rows, const TokenCodes& t, int64_t K, int64_t i0, int64_t i1,
               int32_t* out, int64_t ldo) {
  switch (rows) {
    case 1: tiles_vnni<1>(w, bpr, t, K, i0, i1, out, ldo); break;
    case 2: tiles_vnni<2>(w, bpr, t, K, i0, i1, out, ldo); break;
    case 3: tiles_vnni<3>(w, bpr, t, K, i0, i1, out, ldo); break;
    default: tiles_vnni<4>(w, bpr, t, K, i0, i1, out, ldo); break;
  }
}
#endif

}  // namespace

bool gguf_w8a8_fast() { return detect_isa() == CpuIsa::kAvx512 && vnni_available(); }

at::Tensor gguf_linear_w8a8(const at::Tensor& x, const at::Tensor& data, const c10::optional<at::Tensor>& bias,
                            c10::string_view isa) {
  const char* op = "gguf_linear_w8a8";
  check_activations(op, x);
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous(),
              op, ": data must be contiguous uint8 Q8_0 rows [N, bytes per row]");
  const int64_t M = x.size(0), K = x.size(1), N = data.size(0), bpr = data.size(1);
  TORCH_CHECK(K > 0 && K % kBlock == 0 && K <= kMaxK, op, ": the row length ", K,
              " must be a positive multiple of 32 up to ", kMaxK);
  TORCH_CHECK(bpr == K / kBlock * kBlockBytes, op, ": Q8_0 rows of ", K, " weights take ", K / kBlock * kBlockBytes,
              " bytes, data rows have ", bpr);
  const bool scalar = requested_isa(op, isa) != CpuIsa::kAvx512 || !vnni_available();
  const float* bp = checked_bias(op, bias, N);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const TokenCodes t = quantize_rows(x.data_ptr<float>(), x.stride(0), M, K);
  const uint8_t* w = data.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  const int64_t groups = (N + kWRows - 1) / kWRows;
  for (int64_t c0 = 0; c0 < M; c0 += kXChunk) {
    const int64_t c1 = std::min(M, c0 + kXChunk);
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      int32_t dots[kXChunk * kWRows];
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t n = g * kWRows, rows = std::min<int64_t>(kWRows, N - n);
        const uint8_t* wg = w + n * bpr;
#if SRT_CPU_X86
        if (!scalar) {
          dots_vnni(wg, bpr, rows, t, K, c0, c1, dots, kWRows);
        } else {
          dots_scalar(wg, bpr, rows, t, K, c0, c1, dots, kWRows);
        }
#else
        dots_scalar(wg, bpr, rows, t, K, c0, c1, dots, kWRows);
#endif
        for (int64_t r = 0; r < rows; ++r) {
          const float dw = gguf_simple::half_at(wg + r * bpr);
          for (int64_t i = c0; i < c1; ++i) {
            float v = static_cast<float>(dots[(i - c0) * kWRows + r]) * (t.scale[i] * dw);
            if (bp != nullptr) v += bp[n + r];
            y[i * N + n + r] = v;
          }
        }
      }
    });
  }
  return out;
}

namespace {
bool gguf_w8a8_fast_op() { return gguf_w8a8_fast(); }
}  // namespace

}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("gguf_linear_w8a8(Tensor x, Tensor data, Tensor? bias=None, str isa=\"\") -> Tensor");
  m.def("gguf_w8a8_fast() -> bool", &srt_cpu::gguf_w8a8_fast_op);
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) { m.impl("gguf_linear_w8a8", &srt_cpu::gguf_linear_w8a8); }

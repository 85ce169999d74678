// Linear layers on GGUF-quantized weights, and their dequantization (layout and per-type row
// functions: gguf_quant.h):
//
//   gguf_linear(x [M, K] f32, data [N, K / bs * ts] u8, qtype, bias?) -> [M, N] f32
//   gguf_dequantize(data [R, bpr] u8 (or one row [bpr]), qtype, cols) -> [R, cols] f32
//   gguf_qtypes() -> the types with row functions on this CPU
//   gguf_float32_panels(data, qtype, rows, cols, x8, nr) -> pack_linear_weight's panels [P, cols, nr]
//
// gguf_linear takes one of these paths by the number of input rows M (threads always take
// contiguous ranges of weight rows, so the quantized weights stream from memory once per call):
//   M <= 2        Q4_K and Q6_K on CPUs with AVX-512 VNNI: gguf_linear_a24 (x as 24-bit fixed
//                 point per block of 32, integer dot products: gguf_a24.cpp);
//   M <= 12       Q4_0 and Q4_1 in the x8 layout (gguf_linear_x8) on CPUs with AVX-512 VNNI and
//                 VBMI: the same numerics (gguf_x8_a24.cpp);
//   M <= 3 (4)    dot_rows: each block dequantized in registers and applied to all rows (decode:
//                 bound by reading the weights, about 1/6 of float32's bytes for 4-bit types);
//   2 <= M <= 27  types with register tiles (AVX-512: Q4_K, Q6_K; from 3 rows where the 24-bit
//                 path runs): x packed once, weights dequantized in registers 3 rows at a time
//                 against up to 8 rows of x (tile_rows_float);
//   4 (5) <= M <= 12  the other types: 8 weight rows at a time dequantized into an L1 buffer,
//                 float dot tiles (the bounds in brackets: CPUs without AVX-512);
//   M >= 13 (28)  a GEMM on dequantized tiles against x packed once per call (prefill, big
//                 decode batches): at float32 GEMM speed, plus the dequantization.
// Each output's sum runs in a fixed order that depends on M and K only, not on the thread count
// (on the register tiles not on M either: a row's sums are the same in any batch).
// The per-type row functions are AVX2 (also used on AVX-512 CPUs) or scalar (other CPUs, or
// SRT_CPU_ISA=scalar); the buffered and GEMM paths need AVX2, the scalar build uses dot_rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu_ops.h"
#include "gguf_quant.h"
#include "gguf_x8.h"

namespace srt_cpu {
namespace {

// from small_m_limit() input rows on, weight rows dequantized into a buffer; from gemm_m_limit()
// on, the dequantized-tile GEMM (SRT_GGUF_SMALL_M / SRT_GGUF_GEMM_M override them, for tuning)
int64_t small_m_limit() {
  static const int64_t limit = [] {
    const char* env = std::getenv("SRT_GGUF_SMALL_M");
    // AVX-512's buffered tiles beat dot_rows from 4 rows (an 11008 x 4096 Q4_K weight on Zen 5:
    // 2.17 vs 3.14 ms); AVX2's from 5
    return env != nullptr ? std::max<int64_t>(1, std::atoll(env)) : int64_t{detect_isa() == CpuIsa::kAvx512 ? 4 : 5};
  }();
  return limit;
}

// below this many input rows the register tiles (gguf_tile_ops) run instead of the GEMM, from 2 rows
// on (from gguf_a24_rows() on where the 24-bit path runs); SRT_GGUF_TILE_M overrides it. An
// 11008 x 4096 weight on Zen 5, ms, tiles vs the GEMM: Q4_K 24 rows 5.9 vs 8.0, 28 rows 7.28 vs
// 7.28, 32 rows 7.9 vs 7.3
int64_t tile_m_limit() {
  static const int64_t limit = [] {
    const char* env = std::getenv("SRT_GGUF_TILE_M");
    return env != nullptr ? std::max<int64_t>(0, std::atoll(env)) : int64_t{28};
  }();
  return limit;
}

int64_t gemm_m_limit() {
  static const int64_t limit = [] {
    const char* env = std::getenv("SRT_GGUF_GEMM_M");
    return env != nullptr ? std::max<int64_t>(1, std::atoll(env)) : int64_t{13};
  }();
  return limit;
}

// rows of x per pass of the dequantized-tile GEMM: x's rows are re-read for every block of weight
// rows, so a pass takes at most SRT_GGUF_GEMM_X_MIB (default 8) MiB of them, a multiple of 32
// rows, at least 64 (a Llama-3.1-8B down projection, K = 14336, 730 rows on Zen 5: 272 ms in one
// pass over 42 MB of x, 203 ms in groups of 128 rows)
int64_t gemm_group_rows(int64_t K) {
  static const int64_t budget = [] {
    const char* env = std::getenv("SRT_GGUF_GEMM_X_MIB");
    return (env != nullptr ? std::max<int64_t>(1, std::atoll(env)) : int64_t{8}) << 20;
  }();
  return std::max<int64_t>(64, budget / (K * 4) / 32 * 32);
}

// whether the vector paths run: AVX2 where detect_isa() has AVX2 or AVX-512 (find_ops picks each
// type's row functions, AVX-512 ones where a type has them), scalar otherwise (SRT_CPU_ISA=scalar
// tests that path on any CPU)
CpuIsa gguf_isa() { return detect_isa() == CpuIsa::kScalar ? CpuIsa::kScalar : CpuIsa::kAvx2; }

const QuantRowOps* find_ops(int64_t qtype) {
  const int q = static_cast<int>(qtype);
  for (CpuIsa i : {detect_isa(), CpuIsa::kScalar}) {  // AVX-512: the K-quants' own dot_rows
    if (const QuantRowOps* ops = simple_quant_ops(q, i)) return ops;
    if (const QuantRowOps* ops = kquant_ops(q, i)) return ops;
  }
  return nullptr;
}

const QuantRowOps& ops_or_throw(const char* op, int64_t qtype) {
  const QuantRowOps* ops = find_ops(qtype);
  TORCH_CHECK(ops != nullptr, op, ": ggml type ", qtype, " has no native kernel (supported: see gguf_qtypes())");
  return *ops;
}

// the quantized rows: uint8 [R, bpr] (or one row [bpr]), contiguous
void check_data(const char* op, const at::Tensor& data, const QuantRowOps& ops, int64_t cols) {
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte,
              op, ": data must be a uint8 CPU tensor, got ", data.scalar_type());
  TORCH_CHECK(data.dim() == 1 || data.dim() == 2, op, ": data must be [rows, bytes_per_row], got ", data.dim(),
              " dims");
  TORCH_CHECK(data.is_contiguous(), op, ": data must be contiguous");
  TORCH_CHECK(cols > 0 && cols % ops.block_size == 0, op, ": the row length ", cols,
              " must be a positive multiple of the block size ", ops.block_size);
  const int64_t bpr = cols / ops.block_size * ops.type_size;
  TORCH_CHECK(data.size(-1) == bpr, op, ": rows of ", cols, " weights take ", bpr, " bytes, data rows have ",
              data.size(-1));
}

at::Tensor gguf_dequantize(const at::Tensor& data, int64_t qtype, int64_t cols) {
  const QuantRowOps& ops = ops_or_throw("gguf_dequantize", qtype);
  check_data("gguf_dequantize", data, ops, cols);
  const int64_t rows = data.dim() == 1 ? 1 : data.size(0);
  at::Tensor out = data.dim() == 1 ? at::empty({cols}, data.options().dtype(at::kFloat))
                                   : at::empty({rows, cols}, data.options().dtype(at::kFloat));
  const uint8_t* dp = data.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t bpr = data.size(-1);
  const int64_t grain = std::max<int64_t>(1, 16384 / cols);
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) ops.dequant_row(dp + r * bpr, op + r * cols, cols);
  });
  return out;
}

// xsum16[i, b] = sum of x[i, 16 b .. 16 b + 15]
void row_sums16(const float* x, int64_t ldx, int64_t M, int64_t K, float* xs) {
  const int64_t G = K / 16;
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const float* p = x + i * ldx + g * 16;
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += p[j];
      xs[i * G + g] = s;
    }
  }
}

// ---------------------------------------------------------------- small batch: in-register dots
// weight rows [n0, n1): each row read once and applied to every input row, kMaxDotRows at a time
// (dot_rows dequantizes each block in registers)
void linear_rows_dot(const QuantRowOps& ops, const uint8_t* w, int64_t bpr, int64_t K, const float* x, int64_t ldx,
                     const float* xs, int64_t M, const float* bias, float* out, int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / 16;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * bpr;
    for (int64_t i = 0; i < M; i += kMaxDotRows) {
      const int64_t m = std::min<int64_t>(kMaxDotRows, M - i);
      ops.dot_rows(row, K, x + i * ldx, ldx, xs + i * G, G, m, out + i * N + n, N);
    }
    if (bias != nullptr) {
      for (int64_t i = 0; i < M; ++i) out[i * N + n] += bias[n];
    }
  }
}

#if SRT_CPU_X86
// column chunk of the buffered and GEMM paths: K split into equal multiples of the block size,
// at most `target` columns each
int64_t column_chunk(int64_t K, int64_t bs, int64_t target) {
  const int64_t chunks = (K + target - 1) / target;
  const int64_t per = (K + chunks - 1) / chunks;
  return std::min(K, (per + bs - 1) / bs * bs);
}

// ---------------------------------------------------------------- medium batch: dequantized rows
// kRb weight rows at a time are dequantized into a buffer, at most 512 columns at a time (16 KiB,
// L1), and multiplied with every input row by float dot products: a tile of MX input rows x 4
// weight rows keeps 4 MX accumulators (AVX2: MX <= 3 in ymm; AVX-512: MX <= 4 in zmm, twice the
// columns per FMA); those rows of x stay in L1 while the buffer passes.
constexpr int64_t kRb = 8;

// a tile's write-back: out[m * ldo + r] = (out's value if accumulate) + sums[m * R + r] (+ bias[r])
template <int MX, int R>
inline void store_tile(const float* sums, float* out, int64_t ldo, bool accumulate, const float* bias_or_null) {
  for (int m = 0; m < MX; ++m) {
    for (int r = 0; r < R; ++r) {
      float v = sums[m * R + r];
      if (accumulate) v = out[m * ldo + r] + v;
      if (bias_or_null != nullptr) v += bias_or_null[r];
      out[m * ldo + r] = v;
    }
  }
}

template <int MX, int R>
SRT_TARGET_AVX2 void dot_tile(int64_t kc, const float* x, int64_t ldx, const float* w, int64_t ldw, float* out,
                              int64_t ldo, bool accumulate, const float* bias_or_null) {
  __m256 acc[MX * R];
  for (int i = 0; i < MX * R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; k += 8) {
    __m256 xv[MX];
    for (int m = 0; m < MX; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_loadu_ps(w + r * ldw + k);
      for (int m = 0; m < MX; ++m) acc[m * R + r] = _mm256_fmadd_ps(wv, xv[m], acc[m * R + r]);
    }
  }
  float sums[MX * R];
  if constexpr (MX * R == 8) {
    _mm256_storeu_ps(sums, VecAvx2::reduce_tile(acc));
  } else {
    for (int i = 0; i < MX * R; ++i) sums[i] = VecAvx2::hsum(acc[i]);
  }
  store_tile<MX, R>(sums, out, ldo, accumulate, bias_or_null);
}

// mx (<= 3) input rows against R weight rows
template <int R>
SRT_TARGET_AVX2 void dot_tiles(int64_t mx, int64_t kc, const float* x, int64_t ldx, const float* w, int64_t ldw,
                               float* out, int64_t ldo, bool accumulate, const float* bias_or_null) {
  switch (mx) {
    case 3: dot_tile<3, R>(kc, x, ldx, w, ldw, out, ldo, accumulate, bias_or_null); break;
    case 2: dot_tile<2, R>(kc, x, ldx, w, ldw, out, ldo, accumulate, bias_or_null); break;
    case 1: dot_tile<1, R>(kc, x, ldx, w, ldw, out, ldo, accumulate, bias_or_null); break;
    default: break;
  }
}

// The AVX-512 tile: MX <= 4 input rows x R weight rows, 16 columns per step (kc a multiple of 16:
// every block size is); 16 accumulators at MX = R = 4, reduced together at the end of the chunk.
template <int MX, int R>
SRT_TARGET_AVX512 void dot_tile16(int64_t kc, const float* x, int64_t ldx, const float* w, int64_t ldw, float* out,
                                  int64_t ldo, bool accumulate, const float* bias_or_null) {
  __m512 acc[MX * R];
  for (int i = 0; i < MX * R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; k += 16) {
    __m512 xv[MX];
    for (int m = 0; m < MX; ++m) xv[m] = _mm512_loadu_ps(x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_loadu_ps(w + r * ldw + k);
      for (int m = 0; m < MX; ++m) acc[m * R + r] = _mm512_fmadd_ps(wv, xv[m], acc[m * R + r]);
    }
  }
  alignas(64) float sums[16];
  if constexpr (MX * R == 16) {
    _mm512_store_ps(sums, VecAvx512::reduce_tile(acc));
  } else {
    for (int i = 0; i < MX * R; ++i) sums[i] = _mm512_reduce_add_ps(acc[i]);
  }
  store_tile<MX, R>(sums, out, ldo, accumulate, bias_or_null);
}

// mx (<= 4) input rows against R weight rows, AVX-512
template <int R>
SRT_TARGET_AVX512 void dot_tiles16(int64_t mx, int64_t kc, const float* x, int64_t ldx, const float* w, int64_t ldw,
                                   float* out, int64_t ldo, bool accumulate, const float* bias_or_null) {
  switch (mx) {
    case 4: dot_tile16<4, R>(kc, x, ldx, w, ldw, out, ldo, accumulate, bias_or_null); break;
    case 3: dot_tile16<3, R>(kc, x, ldx, w, ldw, out, ldo, accumulate, bias_or_null); break;
    case 2: dot_tile16<2, R>(kc, x, ldx, w, ldw, out, ldo, accumulate, bias_or_null); break;
    case 1: dot_tile16<1, R>(kc, x, ldx, w, ldw, out, ldo, accumulate, bias_or_null); break;
    default: break;
  }
}

// The 8 rows' chunks are 8 short streams, which the hardware prefetchers follow poorly: the same
// chunk of the group kPrefetchAhead groups on is prefetched while this one is dequantized (an
// 8-row decode step of the 8B Q4_K_M shape on Zen 5: 536-541 ms with it, 558-578 without).
constexpr int64_t kPrefetchAhead = 2;

void prefetch_chunk(const uint8_t* w, int64_t bpr, int64_t boff, int64_t bytes, int64_t n, int64_t n1) {
  for (int64_t j = 0; j < kRb && n + j < n1; ++j) {
    const char* p = reinterpret_cast<const char*>(w + (n + j) * bpr + boff);
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
  }
}

// weight rows [n0, n1) for all M input rows
void linear_rows_buffered(const QuantRowOps& ops, const uint8_t* w, int64_t bpr, int64_t K, const float* x,
                          int64_t ldx, int64_t M, const float* bias, float* out, int64_t N, int64_t n0, int64_t n1) {
  const int64_t bs = ops.block_size;
  const int64_t kcc = column_chunk(K, bs, std::max<int64_t>(bs, 512));
  std::vector<float> buf(static_cast<size_t>(kRb * kcc));
  const bool wide = detect_isa() == CpuIsa::kAvx512;  // 4 x rows per pass in zmm tiles, else 3 in ymm
  const int64_t mstep = wide ? 4 : 3;
  const auto tiles4 = wide ? &dot_tiles16<4> : &dot_tiles<4>;
  const auto tiles1 = wide ? &dot_tiles16<1> : &dot_tiles<1>;
  // rows outer, columns inner: the weights stream row group by row group, x (M x K) stays in L2
  for (int64_t n = n0; n < n1; n += kRb) {
    const int64_t rows = std::min(kRb, n1 - n);
    for (int64_t k0 = 0; k0 < K; k0 += kcc) {
      const int64_t kc = std::min(kcc, K - k0);
      const int64_t boff = k0 / bs * ops.type_size;
      const bool accumulate = k0 > 0, last = k0 + kc >= K;
      prefetch_chunk(w, bpr, boff, kc / bs * ops.type_size, n + kPrefetchAhead * kRb, n1);
      for (int64_t j = 0; j < rows; ++j) ops.dequant_row(w + (n + j) * bpr + boff, buf.data() + j * kc, kc);
      for (int64_t m0 = 0; m0 < M; m0 += mstep) {  // these rows of x stay in L1 while the buffer passes
        const int64_t mx = std::min<int64_t>(mstep, M - m0);
        const float* xm = x + m0 * ldx + k0;
        float* om = out + m0 * N + n;
        int64_t j = 0;
        for (; j + 4 <= rows; j += 4) {
          const float* bp = last && bias != nullptr ? bias + n + j : nullptr;
          tiles4(mx, kc, xm, ldx, buf.data() + j * kc, kc, om + j, N, accumulate, bp);
        }
        for (; j < rows; ++j) {
          const float* bp = last && bias != nullptr ? bias + n + j : nullptr;
          tiles1(mx, kc, xm, ldx, buf.data() + j * kc, kc, om + j, N, accumulate, bp);
        }
      }
    }
  }
}
// ---------------------------------------------------------------- large batch: dequantized tiles
// x is packed once per call into panels of 16 rows (8 for a short last panel), column-major
// within the panel: xp[k][i] = x[m0 + i, k], zero past M. Each task takes blocks of kNc weight
// rows; per column chunk (at most 256 columns, a multiple of the block) the block's rows are
// dequantized (dequant_row) into a row buffer, and a register tile of 6 weight rows x 16 x rows
// (12 x 8 for an 8-row panel) accumulates sum_k w[n, k] xp[k][i]: per column one broadcast of
// each weight and one or two loads of packed x. The tiles' sums carry over the column chunks in
// a small buffer and go to out (transposed, plus the bias) after the last chunk. Each output's
// sum runs over k in order whatever the thread count.
constexpr int64_t kNc = 48;  // weight rows per block: a multiple of every tile height (6 and 12)

struct PackedX {
  std::vector<float> data;
  std::vector<int64_t> m0, width, offset;  // per panel: first row of x, 8 or 16, start in data
};

PackedX pack_x(const float* x, int64_t ldx, int64_t M, int64_t K) {
  PackedX px;
  int64_t off = 0;
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t width = M - m0 <= 8 ? 8 : 16;
    px.m0.push_back(m0);
    px.width.push_back(width);
    px.offset.push_back(off);
    off += width * K;
  }
  px.data.assign(static_cast<size_t>(off), 0.f);
  const auto panels = static_cast<int64_t>(px.m0.size());
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t width = px.width[p], rows = std::min(width, M - px.m0[p]);
      float* dst = px.data.data() + px.offset[p];
      for (int64_t i = 0; i < rows; ++i) {
        const float* src = x + (px.m0[p] + i) * ldx;
        for (int64_t k = 0; k < K; ++k) dst[k * width + i] = src[k];
      }
    }
  });
  return px;
}

// c[r][0..15] += sum_k w[r * ldw + k] * xp[k][0..15] for r < 6 (c: 6 x 16 floats)
SRT_TARGET_AVX2 void tile_6x16(int64_t kc, const float* w, int64_t ldw, const float* xp, float* c) {
#define SRT_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define SRT_LOAD(r) __m256 c##r##0 = _mm256_loadu_ps(c + r * 16), c##r##1 = _mm256_loadu_ps(c + r * 16 + 8);
  SRT_ROWS(SRT_LOAD)
#undef SRT_LOAD
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 x0 = _mm256_loadu_ps(xp + k * 16), x1 = _mm256_loadu_ps(xp + k * 16 + 8);
#define SRT_FMA(r)                                           \
  {                                                          \
    const __m256 a = _mm256_broadcast_ss(w + r * ldw + k);   \
    c##r##0 = _mm256_fmadd_ps(a, x0, c##r##0);               \
    c##r##1 = _mm256_fmadd_ps(a, x1, c##r##1);               \
  }
    SRT_ROWS(SRT_FMA)
#undef SRT_FMA
  }
#define SRT_STORE(r)                        \
  _mm256_storeu_ps(c + r * 16, c##r##0);    \
  _mm256_storeu_ps(c + r * 16 + 8, c##r##1);
  SRT_ROWS(SRT_STORE)
#undef SRT_STORE
#undef SRT_ROWS
}

// c[r][0..7] += sum_k w[r * ldw + k] * xp[k][0..7] for r < 12 (c: 12 x 8 floats)
SRT_TARGET_AVX2 void tile_12x8(int64_t kc, const float* w, int64_t ldw, const float* xp, float* c) {
#define SRT_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define SRT_LOAD(r) __m256 c##r = _mm256_loadu_ps(c + r * 8);
  SRT_ROWS(SRT_LOAD)
#undef SRT_LOAD
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 x0 = _mm256_loadu_ps(xp + k * 8);
#define SRT_FMA(r) c##r = _mm256_fmadd_ps(_mm256_broadcast_ss(w + r * ldw + k), x0, c##r);
    SRT_ROWS(SRT_FMA)
#undef SRT_FMA
  }
#define SRT_STORE(r) _mm256_storeu_ps(c + r * 8, c##r);
  SRT_ROWS(SRT_STORE)
#undef SRT_STORE
#undef SRT_ROWS
}

// c[r][0..15] += sum_k w[r * ldw + k] * xp[k][0..15] for r < 12 (c: 12 x 16 floats): the 16-row
// panel in one zmm per weight row. Every sum runs over k in the same order with the same FMAs as
// tile_6x16's, so the two tiles give the same bits; this one issues half the FMA instructions.
SRT_TARGET_AVX512 void tile_12x16(int64_t kc, const float* w, int64_t ldw, const float* xp, float* c) {
#define SRT_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define SRT_LOAD(r) __m512 c##r = _mm512_loadu_ps(c + r * 16);
  SRT_ROWS(SRT_LOAD)
#undef SRT_LOAD
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 x0 = _mm512_loadu_ps(xp + k * 16);
#define SRT_FMA(r) c##r = _mm512_fmadd_ps(_mm512_set1_ps(w[r * ldw + k]), x0, c##r);
    SRT_ROWS(SRT_FMA)
#undef SRT_FMA
  }
#define SRT_STORE(r) _mm512_storeu_ps(c + r * 16, c##r);
  SRT_ROWS(SRT_STORE)
#undef SRT_STORE
#undef SRT_ROWS
}

// tile_12x16 on two 16-row panels at once (x from xa and xb, sums in ca and cb): each weight
// broadcast feeds two FMAs instead of one (24 accumulators), and every sum is the one
// tile_12x16 computes, bit for bit.
SRT_TARGET_AVX512 void tile_12x16x2(int64_t kc, const float* w, int64_t ldw, const float* xa, const float* xb,
                                    float* ca, float* cb) {
#define SRT_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define SRT_LOAD(r) __m512 a##r = _mm512_loadu_ps(ca + r * 16), b##r = _mm512_loadu_ps(cb + r * 16);
  SRT_ROWS(SRT_LOAD)
#undef SRT_LOAD
#pragma GCC unroll 2
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 x0 = _mm512_loadu_ps(xa + k * 16), x1 = _mm512_loadu_ps(xb + k * 16);
#define SRT_FMA(r)                                      \
  {                                                     \
    const __m512 v = _mm512_set1_ps(w[r * ldw + k]);    \
    a##r = _mm512_fmadd_ps(v, x0, a##r);                \
    b##r = _mm512_fmadd_ps(v, x1, b##r);                \
  }
    SRT_ROWS(SRT_FMA)
#undef SRT_FMA
  }
#define SRT_STORE(r)                    \
  _mm512_storeu_ps(ca + r * 16, a##r);  \
  _mm512_storeu_ps(cb + r * 16, b##r);
  SRT_ROWS(SRT_STORE)
#undef SRT_STORE
#undef SRT_ROWS
}

// weight rows [n0, n1) (n0 a multiple of kNc) for all M input rows; 16-row panels take the
// AVX-512 tile where detect_isa() allows it (SRT_CPU_ISA=avx2 keeps the AVX2 one)
void linear_rows_gemm(const QuantRowOps& ops, const uint8_t* w, int64_t bpr, int64_t K, const PackedX& px, int64_t M,
                      const float* bias, float* out, int64_t N, int64_t n0, int64_t n1) {
  const int64_t bs = ops.block_size;
  const int64_t kcc = column_chunk(K, bs, std::max<int64_t>(bs, 256));
  const auto panels = static_cast<int64_t>(px.m0.size());
  std::vector<float> rows(static_cast<size_t>(kNc * kcc));
  std::vector<float> acc(static_cast<size_t>(panels * kNc * 16));  // per panel: kNc x width sums
  const bool wide = detect_isa() == CpuIsa::kAvx512;
  for (int64_t nb = n0; nb < n1; nb += kNc) {
    const int64_t nrows = std::min(kNc, n1 - nb);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t k0 = 0; k0 < K; k0 += kcc) {
      const int64_t kc = std::min(kcc, K - k0);
      const int64_t boff = k0 / bs * ops.type_size;
      for (int64_t j = 0; j < kNc; ++j) {
        float* dst = rows.data() + j * kc;
        if (j < nrows) {
          ops.dequant_row(w + (nb + j) * bpr + boff, dst, kc);
        } else {
          std::fill(dst, dst + kc, 0.f);
        }
      }
      for (int64_t p = 0; p < panels; ++p) {
        const float* xp = px.data.data() + px.offset[p] + k0 * px.width[p];
        float* c = acc.data() + p * kNc * 16;
        if (wide && p + 1 < panels && px.width[p] == 16 && px.width[p + 1] == 16) {  // two panels
          const float* xq = px.data.data() + px.offset[p + 1] + k0 * 16;
          float* cq = c + kNc * 16;
          for (int64_t t = 0; t < kNc; t += 12) tile_12x16x2(kc, rows.data() + t * kc, kc, xp, xq, c + t * 16, cq + t * 16);
          ++p;
        } else if (px.width[p] == 16 && wide) {
          for (int64_t t = 0; t < kNc; t += 12) tile_12x16(kc, rows.data() + t * kc, kc, xp, c + t * 16);
        } else if (px.width[p] == 16) {
          for (int64_t t = 0; t < kNc; t += 6) tile_6x16(kc, rows.data() + t * kc, kc, xp, c + t * 16);
        } else {
          for (int64_t t = 0; t < kNc; t += 12) tile_12x8(kc, rows.data() + t * kc, kc, xp, c + t * 8);
        }
      }
    }
    for (int64_t p = 0; p < panels; ++p) {  // acc[p][j][i] -> out[m0 + i, nb + j]
      const int64_t width = px.width[p], mrows = std::min(width, M - px.m0[p]);
      const float* c = acc.data() + p * kNc * 16;
      for (int64_t i = 0; i < mrows; ++i) {
        float* o = out + (px.m0[p] + i) * N + nb;
        for (int64_t j = 0; j < nrows; ++j) o[j] = c[j * width + i] + (bias != nullptr ? bias[nb + j] : 0.f);
      }
    }
  }
}

#endif  // SRT_CPU_X86

}  // namespace

// ---------------------------------------------------------------- medium batch: register tiles
// (declared in cpu_ops.h: moe_experts_a24 runs them too)

const QuantRowOps* gguf_tile_ops(int64_t qtype) {
  static const bool on = [] {
    const char* env = std::getenv("SRT_GGUF_TILES");
    return !(env != nullptr && std::strcmp(env, "0") == 0);
  }();
  const QuantRowOps* ops = on ? find_ops(qtype) : nullptr;
  return ops != nullptr && ops->dot_tile != nullptr ? ops : nullptr;
}

TileX pack_tiles(const float* x, int64_t ldx, int64_t M, int64_t K) {
  TileX t;
  t.k = K;
  const int64_t groups = (M + kDotTileRows - 1) / kDotTileRows;
  t.data.resize(static_cast<size_t>(M * K));
  for (int64_t g = 0, m0 = 0; g < groups; ++g) {
    const int64_t width = (M - m0) / (groups - g);
    t.m0.push_back(m0);
    t.width.push_back(width);
    float* dst = t.data.data() + m0 * K;
    for (int64_t i = 0; i < width; ++i) {
      const float* src = x + (m0 + i) * ldx;
      for (int64_t k0 = 0; k0 < K; k0 += 16) std::memcpy(dst + k0 * width + 16 * i, src + k0, 16 * sizeof(float));
    }
    m0 += width;
  }
  return t;
}

void tile_rows_float(const QuantRowOps& ops, const uint8_t* w, int64_t bpr, int64_t rows, const TileX& xt,
                     const float* bias, float* out, int64_t ldo) {
  float sums[kDotTileRows * kDotTileWeightRows];
  for (int64_t n = 0; n < rows; n += kDotTileWeightRows) {
    const int64_t r3 = std::min(kDotTileWeightRows, rows - n);
    // the first group's pass prefetches the next weight rows (the last tile re-reads its own)
    const uint8_t* pf = w + std::min(n + kDotTileWeightRows, rows - r3) * bpr;
    for (size_t g = 0; g < xt.m0.size(); ++g) {
      const int64_t m0 = xt.m0[g], mx = xt.width[g];
      ops.dot_tile(w + n * bpr, bpr, r3, xt.k, xt.data.data() + m0 * xt.k, mx, g == 0 ? pf : w + n * bpr, sums);
      for (int64_t i = 0; i < mx; ++i) {
        float* o = out + (m0 + i) * ldo + n;
        for (int64_t r = 0; r < r3; ++r) o[r] = sums[i * r3 + r] + (bias != nullptr ? bias[n + r] : 0.f);
      }
    }
  }
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& data, int64_t qtype,
                       const c10::optional<at::Tensor>& bias) {
  const QuantRowOps& ops = ops_or_throw("gguf_linear", qtype);
  check_activations("gguf_linear", x);
  TORCH_CHECK(data.dim() == 2, "gguf_linear: data must be [N, bytes_per_row], got ", data.dim(), " dims");
  const int64_t M = x.size(0), K = x.size(1), N = data.size(0);
  check_data("gguf_linear", data, ops, K);
  const float* bp = checked_bias("gguf_linear", bias, N);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const uint8_t* wp = data.data_ptr<uint8_t>();
  const int64_t bpr = data.size(1);
  float* op = out.data_ptr<float>();

#if SRT_CPU_X86
  if (M < gguf_a24_rows() && gguf_a24_takes(qtype)) return gguf_linear_a24(x, data, qtype, bias);
  if (M >= 2 && M < tile_m_limit()) {
    if (const QuantRowOps* tops = gguf_tile_ops(qtype)) {
      const TileX xt = pack_tiles(xp, ldx, M, K);
      const int64_t only = 0;  // one matrix: a bank of one
      for_expert_row_groups<kDotTileWeightRows * 4>(wp, N, bpr, &only, 1, [&](int64_t, int64_t n, int64_t rows, const uint8_t* w) {
        tile_rows_float(*tops, w, bpr, rows, xt, bp == nullptr ? nullptr : bp + n, op + n, N);
      });
      return out;
    }
  }
  if (M >= small_m_limit() && M < gemm_m_limit() && gguf_isa() != CpuIsa::kScalar) {
    const int64_t grain = std::max<int64_t>(kRb, 64 * 1024 / bpr / kRb * kRb);
    at::parallel_for(0, (N + kRb - 1) / kRb, std::max<int64_t>(1, grain / kRb), [&](int64_t g0, int64_t g1) {
      linear_rows_buffered(ops, wp, bpr, K, xp, ldx, M, bp, op, N, g0 * kRb, std::min(N, g1 * kRb));
    });
    return out;
  }
  if (M >= gemm_m_limit() && gguf_isa() != CpuIsa::kScalar) {
    // groups of x's rows small enough to stay in the last-level cache while every weight block
    // passes (each group dequantizes the weights again; the sums do not change)
    const int64_t group = gemm_group_rows(K), blocks = (N + kNc - 1) / kNc;
    for (int64_t m0 = 0; m0 < M; m0 += group) {
      const int64_t gm = std::min(group, M - m0);
      const PackedX px = pack_x(xp + m0 * ldx, ldx, gm, K);
      at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
        linear_rows_gemm(ops, wp, bpr, K, px, gm, bp, op + m0 * N, N, b0 * kNc, std::min(N, b1 * kNc));
      });
    }
    return out;
  }
#endif
  std::vector<float> xs(static_cast<size_t>(M * (K / 16)));
  row_sums16(xp, ldx, M, K, xs.data());
  // about 64 KiB of weights per task
  const int64_t grain = std::max<int64_t>(4, 64 * 1024 / bpr);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    linear_rows_dot(ops, wp, bpr, K, xp, ldx, xs.data(), M, bp, op, N, n0, n1);
  });
  return out;
}

namespace {

// ---------------------------------------------------------------- the x8 layout (gguf_x8.h)
const x8::Layout& x8_layout_or_throw(const char* op, int64_t qtype) {
  const x8::Layout* layout = x8::layout(qtype);
  TORCH_CHECK(layout != nullptr, op, ": ggml type ", qtype, " has no x8 layout (Q4_0, Q4_1 and Q8_0 do)");
  return *layout;
}

// packed: uint8 [ceil(rows / 8), 8 * bpr] for `rows` rows of `cols` weights
int64_t check_packed(const char* op, const at::Tensor& packed, int64_t qtype, int64_t rows, int64_t cols) {
  const x8::Layout& layout = x8_layout_or_throw(op, qtype);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2 &&
                  packed.is_contiguous(),
              op, ": packed must be a contiguous uint8 CPU tensor [groups, bytes]");
  TORCH_CHECK(cols > 0 && cols % x8::kBlock == 0, op, ": the row length ", cols, " must be a positive multiple of 32");
  const int64_t bpr = cols / x8::kBlock * layout.type_size();
  TORCH_CHECK(rows >= 0 && packed.size(0) == (rows + x8::kRows - 1) / x8::kRows && packed.size(1) == x8::kRows * bpr,
              op, ": ", rows, " rows of ", cols, " weights pack into [", (rows + x8::kRows - 1) / x8::kRows, ", ",
              x8::kRows * bpr, "], got ", packed.sizes());
  return bpr;
}

at::Tensor gguf_pack_x8(const at::Tensor& data, int64_t qtype) {
  const x8::Layout& layout = x8_layout_or_throw("gguf_pack_x8", qtype);
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous(),
              "gguf_pack_x8: data must be a contiguous uint8 CPU tensor [rows, bytes_per_row]");
  const int64_t rows = data.size(0), bpr = data.size(1);
  TORCH_CHECK(bpr > 0 && bpr % layout.type_size() == 0, "gguf_pack_x8: rows of ", bpr,
              " bytes are not whole blocks of ", layout.type_size());
  const int64_t groups = (rows + x8::kRows - 1) / x8::kRows;
  at::Tensor out = at::empty({groups, x8::kRows * bpr}, data.options());
  const uint8_t* dp = data.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t count = std::min(x8::kRows, rows - g * x8::kRows);
      x8::pack_group(layout, dp + g * x8::kRows * bpr, count, bpr, op + g * x8::kRows * bpr);
    }
  });
  return out;
}

// rows `ids` (int64 [R]; all rows when undefined) of an x8-packed weight, in GGUF layout [R, bpr]
at::Tensor gguf_unpack_x8(const at::Tensor& packed, int64_t qtype, int64_t rows, int64_t cols,
                          const c10::optional<at::Tensor>& ids) {
  const int64_t bpr = check_packed("gguf_unpack_x8", packed, qtype, rows, cols);
  const x8::Layout& layout = *x8::layout(qtype);
  at::Tensor idx = ids.has_value() && ids->defined() ? ids->to(at::kLong).contiguous().view(-1)
                                                     : at::arange(rows, packed.options().dtype(at::kLong));
  const int64_t R = idx.numel();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "gguf_unpack_x8: row ", ip[i], " outside [0, ", rows, ")");
  }
  at::Tensor out = at::empty({R, bpr}, packed.options());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, R, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = ip[i] / x8::kRows;
      x8::unpack_rows(layout, pp + g * x8::kRows * bpr, bpr, ip[i] % x8::kRows, 1, op + i * bpr);
    }
  });
  return out;
}

}  // namespace

at::Tensor gguf_linear_x8(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t rows,
                          const c10::optional<at::Tensor>& bias) {
  const QuantRowOps& ops = ops_or_throw("gguf_linear_x8", qtype);
  check_activations("gguf_linear_x8", x);
  const int64_t M = x.size(0), K = x.size(1), N = rows;
  const int64_t bpr = check_packed("gguf_linear_x8", packed, qtype, rows, K);
  const x8::Layout& layout = *x8::layout(qtype);
  const float* bp = checked_bias("gguf_linear_x8", bias, N);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t groups = packed.size(0), gbytes = x8::kRows * bpr, nb = K / x8::kBlock;

  if (M < x8_a24_rows() && x8_a24_takes(qtype)) {  // decode on 24-bit activations (gguf_x8_a24.cpp)
    x8_linear_a24(xp, ldx, M, K, pp, groups, qtype, bp, op, N);
    return out;
  }
#if SRT_CPU_X86
  if (gguf_isa() != CpuIsa::kScalar) {
    if (M < gemm_m_limit()) {  // decode: 8 rows per lane set, straight from the packed bytes
      std::vector<float> xs(static_cast<size_t>(M * nb));
      x8::block_sums(xp, ldx, M, nb, xs.data());
      const x8::DotGroupFn dot = x8::dot_group_fn(qtype);
      // AVX-512: two groups per 16 lanes (the same sums), the last odd group alone
      const x8::DotPairFn dot2 = detect_isa() == CpuIsa::kAvx512 ? x8::dot_pair_fn(qtype) : nullptr;
      const int64_t span = dot2 != nullptr ? 2 : 1, units = (groups + span - 1) / span;
      at::parallel_for(0, units, std::max<int64_t>(1, 64 * 1024 / (span * gbytes)), [&](int64_t u0, int64_t u1) {
        for (int64_t u = u0; u < u1; ++u) {
          const int64_t g = span * u, n = g * x8::kRows;
          const bool pair = dot2 != nullptr && g + 1 < groups;
          const int64_t valid = std::min<int64_t>((pair ? 2 : 1) * x8::kRows, N - n);
          const float* bn = bp != nullptr ? bp + n : nullptr;
          for (int64_t i = 0; i < M; i += kMaxDotRows) {
            const int64_t m = std::min(kMaxDotRows, M - i);
            if (pair) {
              dot2(pp + g * gbytes, pp + (g + 1) * gbytes, nb, xp + i * ldx, ldx, xs.data() + i * nb, m,
                   op + i * N + n, N, bn, valid);
            } else {
              dot(pp + g * gbytes, nb, xp + i * ldx, ldx, xs.data() + i * nb, m, op + i * N + n, N, bn, valid);
            }
          }
        }
      });
      return out;
    }
    // prefill, big batches: pairs of groups dequantized (lane = row) and multiplied with all of x
    const x8::GemmPairsFn gemm = x8::gemm_pairs_fn(qtype);
    at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
      gemm(pp, gbytes, groups, nb, xp, ldx, M, bp, op, N, p0, p1);
    });
    return out;
  }
#endif
  std::vector<float> xs(static_cast<size_t>(M * (K / 16)));
  row_sums16(xp, ldx, M, K, xs.data());
  // scalar CPUs: each group unpacked to the GGUF layout, then the row dot products
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> rows_buf(static_cast<size_t>(x8::kRows * bpr));
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = g * x8::kRows, count = std::min(x8::kRows, N - n);
      x8::unpack_rows(layout, pp + g * gbytes, bpr, 0, count, rows_buf.data());
      linear_rows_dot(ops, rows_buf.data(), bpr, K, xp, ldx, xs.data(), M, bp != nullptr ? bp + n : nullptr, op + n,
                      N, 0, count);
    }
  });
  return out;
}

// gguf_linear_x8's path on 24-bit activations (gguf_x8_a24.cpp) at any row count: for tests and
// measurements (gguf_linear_x8 takes it below x8_a24_rows() rows)
at::Tensor gguf_linear_x8_a24(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t rows,
                              const c10::optional<at::Tensor>& bias) {
  constexpr const char* op = "gguf_linear_x8_a24";
  check_activations(op, x);
  check_packed(op, packed, qtype, rows, x.size(1));
  TORCH_CHECK(x8_a24_takes(qtype), op, ": ggml type ", qtype,
              " needs Q4_0 or Q4_1 and an x86-64 CPU with AVX-512 VNNI and VBMI (and SRT_GGUF_A24 not 0)");
  const float* bp = checked_bias(op, bias, rows);
  at::Tensor out = at::empty({x.size(0), rows}, x.options());
  if (x.size(0) == 0 || rows == 0) return out;
  x8_linear_a24(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1), packed.data_ptr<uint8_t>(), packed.size(0),
                qtype, bp, out.data_ptr<float>(), rows);
  return out;
}

namespace {

std::vector<int64_t> gguf_x8_a24_qtypes() {
  std::vector<int64_t> out;
  for (int q : {kGgmlQ4_0, kGgmlQ4_1}) {
    if (x8_a24_takes(q)) out.push_back(q);
  }
  return out;
}

// float32 panels of a GGUF weight of `rows` x `cols` (its rows [rows, bpr], or their x8 groups
// when x8), equal to pack_linear_weight(gguf_dequantize(rows), nr): each panel's rows dequantized
// into it in one pass, without the whole float32 weight in between
at::Tensor gguf_float32_panels(const at::Tensor& data, int64_t qtype, int64_t rows, int64_t cols, bool x8,
                               int64_t nr) {
  const char* op = "gguf_float32_panels";
  const QuantRowOps& ops = ops_or_throw(op, qtype);
  if (nr == 0) nr = default_panel_width();
  TORCH_CHECK(nr == 24 || nr == 48, op, ": panel width must be 24 or 48 (0: this CPU's), got ", nr);
  int64_t bpr = 0;
  if (x8) {
    bpr = check_packed(op, data, qtype, rows, cols);
  } else {
    check_data(op, data, ops, cols);
    TORCH_CHECK(data.dim() == 2 && data.size(0) == rows, op, ": expected ", rows, " rows, got ", data.sizes());
    bpr = data.size(1);
  }
  const int64_t P = (rows + nr - 1) / nr, K = cols;
  at::Tensor out = at::empty({P, K, nr}, data.options().dtype(at::kFloat));
  if (P == 0) return out;
  const uint8_t* dp = data.data_ptr<uint8_t>();
  float* outp = out.data_ptr<float>();
  const x8::Layout* layout = x8 ? x8::layout(qtype) : nullptr;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint8_t> packed_row(x8 ? bpr : 0);
    std::vector<float> values(K);
    for (int64_t p = p0; p < p1; ++p) {
      float* panel = outp + p * K * nr;
      for (int64_t j = 0; j < nr; ++j) {
        const int64_t r = p * nr + j;
        if (r >= rows) {  // the last panel's columns past the weight: zeros, as pack_linear_weight's
          for (int64_t k = 0; k < K; ++k) panel[k * nr + j] = 0.f;
          continue;
        }
        const uint8_t* row = dp + r * bpr;
        if (x8) {
          x8::unpack_rows(*layout, dp + r / x8::kRows * x8::kRows * bpr, bpr, r % x8::kRows, 1, packed_row.data());
          row = packed_row.data();
        }
        ops.dequant_row(row, values.data(), K);
        for (int64_t k = 0; k < K; ++k) panel[k * nr + j] = values[k];
      }
    }
  });
  return out;
}

std::vector<int64_t> gguf_qtypes() {
  std::vector<int64_t> out;
  for (int q : {kGgmlQ4_0, kGgmlQ4_1, kGgmlQ8_0, kGgmlQ4_K, kGgmlQ5_K, kGgmlQ6_K}) {
    if (find_ops(q) != nullptr) out.push_back(q);
  }
  return out;
}

}  // namespace
}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("gguf_dequantize(Tensor data, int qtype, int cols) -> Tensor");
  m.def("gguf_linear(Tensor x, Tensor data, int qtype, Tensor? bias=None) -> Tensor");
  m.def("gguf_qtypes() -> int[]", &srt_cpu::gguf_qtypes);
  m.def("gguf_pack_x8(Tensor data, int qtype) -> Tensor");
  m.def("gguf_float32_panels(Tensor data, int qtype, int rows, int cols, bool x8, int nr=0) -> Tensor");
  m.def("gguf_unpack_x8(Tensor packed, int qtype, int rows, int cols, Tensor? ids=None) -> Tensor");
  m.def("gguf_linear_x8(Tensor x, Tensor packed, int qtype, int rows, Tensor? bias=None) -> Tensor");
  m.def("gguf_linear_x8_a24(Tensor x, Tensor packed, int qtype, int rows, Tensor? bias=None) -> Tensor");
  m.def("gguf_x8_a24_qtypes() -> int[]", &srt_cpu::gguf_x8_a24_qtypes);
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) {
  m.impl("gguf_dequantize", &srt_cpu::gguf_dequantize);
  m.impl("gguf_linear", &srt_cpu::gguf_linear);
  m.impl("gguf_pack_x8", &srt_cpu::gguf_pack_x8);
  m.impl("gguf_float32_panels", &srt_cpu::gguf_float32_panels);
  m.impl("gguf_unpack_x8", &srt_cpu::gguf_unpack_x8);
  m.impl("gguf_linear_x8", &srt_cpu::gguf_linear_x8);
  m.impl("gguf_linear_x8_a24", &srt_cpu::gguf_linear_x8_a24);
}

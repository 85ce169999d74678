// Float32 linear layers on weights packed once at load: out [M, N] = x [M, K] @ w[N, K]^T (+ bias).
//
//   pack_linear_weight(w [N, K]) -> packed [P, K, NR]   P = ceil(N / NR), NR = 24: panel p holds
//       output columns p*NR .. p*NR+NR-1, one row of NR weights per k (zeros past N), so a panel
//       is one sequential stream and its k-th row is three AVX2 registers
//   packed_linear(x [M, K], packed, N, bias [N]?) -> out [M, N]
//
// Threads take whole panels (at::parallel_for over P). Within a panel, K goes in blocks of KC
// (a KC x NR slice of the panel stays in L1 while every row block of x passes over it) and x in
// blocks of MR = 4 rows: a 4 x 24 register tile (12 accumulators, 3 weight loads and 4 broadcasts
// per k) that stays in registers across the K block. While the row blocks pass over one slice they
// prefetch the next one into L1, a share each, spread over their k loops: without it the first row
// block of every slice waits on DRAM with nothing to overlap (10-20% of a decode batch's time).
// KC is 96 / 128 at M = 5..16 / 17..32 so the slice in use and the one being prefetched fit in L1
// together, 256 otherwise; a batch of 1 to 4 rows streams the weights once (bandwidth-bound, like a
// matrix-vector product) and leaves the prefetching to the hardware.
// One kernel for every batch size: at M = 8..64 (decode batches) it beats oneDNN's packed GEMM on
// the CPUs measured, at prefill sizes it is on par (docs/benchmarks.md has the figures).
//
// Each output is the sum over k in order 0 .. K-1 (one FMA chain, seeded with the bias), whatever M,
// the row block, the thread count or the batch the row came in: results are batch-invariant.
// The AVX2 + FMA kernel runs where the CPU has them; a scalar loop with the same order elsewhere.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cpu_ops.h"
#include "vec.h"

namespace srt_cpu {
namespace {

constexpr int64_t NR = 24;  // output columns per panel
constexpr int MR = 4;       // rows of x per register tile
constexpr int64_t kLine = 64;

// k per block for an M-row x: see the header (a slice is KC * 96 bytes).
int64_t k_block(int64_t M) { return M <= MR ? 256 : M <= 16 ? 96 : M <= 32 ? 128 : 256; }

// One tile: c[i][0..NR) (+)= sum_k a[i][k] * b[k][0..NR), i < R. `first`: start from bias (or 0).
// It also prefetches the `npf` cache lines from `pf` on (no effect on the result).
using TileFn = void (*)(int R, const float* a, int64_t lda, const float* b, int64_t kc, float* c, int64_t ldc,
                        const float* bias, bool first, const char* pf, int64_t npf);

void tile_scalar(int R, const float* a, int64_t lda, const float* b, int64_t kc, float* c, int64_t ldc,
                 const float* bias, bool first, const char*, int64_t) {
  for (int i = 0; i < R; ++i) {
    float acc[NR];
    for (int64_t j = 0; j < NR; ++j) acc[j] = first ? (bias ? bias[j] : 0.f) : c[i * ldc + j];
    for (int64_t k = 0; k < kc; ++k) {
      const float ai = a[i * lda + k];
      for (int64_t j = 0; j < NR; ++j) acc[j] = std::fma(ai, b[k * NR + j], acc[j]);
    }
    for (int64_t j = 0; j < NR; ++j) c[i * ldc + j] = acc[j];
  }
}

#if SRT_CPU_X86
// R rows (R <= 4) x 24 columns; the accumulators are named registers (an array would be spilled).
template <int R>
SRT_TARGET_AVX2 inline void tile_avx2_r(const float* a, int64_t lda, const float* b, int64_t kc, float* c,
                                        int64_t ldc, const float* bias, bool first, const char* pf, int64_t npf) {
  __m256 c00, c01, c02, c10, c11, c12, c20, c21, c22, c30, c31, c32;
  const __m256 z = _mm256_setzero_ps();
  const __m256 i0 = bias ? _mm256_loadu_ps(bias) : z, i1 = bias ? _mm256_loadu_ps(bias + 8) : z,
               i2 = bias ? _mm256_loadu_ps(bias + 16) : z;
#define SRT_PL_LOAD(i, r0, r1, r2)                                                             \
  if (R > i) {                                                                                 \
    if (first) {                                                                               \
      r0 = i0, r1 = i1, r2 = i2;                                                               \
    } else {                                                                                   \
      r0 = _mm256_loadu_ps(c + i * ldc), r1 = _mm256_loadu_ps(c + i * ldc + 8);                \
      r2 = _mm256_loadu_ps(c + i * ldc + 16);                                                  \
    }                                                                                          \
  }
  SRT_PL_LOAD(0, c00, c01, c02) SRT_PL_LOAD(1, c10, c11, c12) SRT_PL_LOAD(2, c20, c21, c22)
  SRT_PL_LOAD(3, c30, c31, c32)
#undef SRT_PL_LOAD
  for (int64_t k = 0; k < kc; ++k) {
    if (k < npf) _mm_prefetch(pf + kLine * k, _MM_HINT_T0);
    const __m256 b0 = _mm256_loadu_ps(b + k * NR), b1 = _mm256_loadu_ps(b + k * NR + 8),
                 b2 = _mm256_loadu_ps(b + k * NR + 16);
#define SRT_PL_FMA(i, r0, r1, r2)                                                              \
  if (R > i) {                                                                                 \
    const __m256 ai = _mm256_broadcast_ss(a + i * lda + k);                                    \
    r0 = _mm256_fmadd_ps(ai, b0, r0), r1 = _mm256_fmadd_ps(ai, b1, r1);                        \
    r2 = _mm256_fmadd_ps(ai, b2, r2);                                                          \
  }
    SRT_PL_FMA(0, c00, c01, c02) SRT_PL_FMA(1, c10, c11, c12) SRT_PL_FMA(2, c20, c21, c22)
    SRT_PL_FMA(3, c30, c31, c32)
#undef SRT_PL_FMA
  }
#define SRT_PL_STORE(i, r0, r1, r2)                                                            \
  if (R > i) {                                                                                 \
    _mm256_storeu_ps(c + i * ldc, r0), _mm256_storeu_ps(c + i * ldc + 8, r1);                  \
    _mm256_storeu_ps(c + i * ldc + 16, r2);                                                    \
  }
  SRT_PL_STORE(0, c00, c01, c02) SRT_PL_STORE(1, c10, c11, c12) SRT_PL_STORE(2, c20, c21, c22)
  SRT_PL_STORE(3, c30, c31, c32)
#undef SRT_PL_STORE
  for (int64_t k = kc; k < npf; ++k) _mm_prefetch(pf + kLine * k, _MM_HINT_T0);
}

void tile_avx2(int R, const float* a, int64_t lda, const float* b, int64_t kc, float* c, int64_t ldc,
               const float* bias, bool first, const char* pf, int64_t npf) {
  switch (R) {
    case 4: return tile_avx2_r<4>(a, lda, b, kc, c, ldc, bias, first, pf, npf);
    case 3: return tile_avx2_r<3>(a, lda, b, kc, c, ldc, bias, first, pf, npf);
    case 2: return tile_avx2_r<2>(a, lda, b, kc, c, ldc, bias, first, pf, npf);
    default: return tile_avx2_r<1>(a, lda, b, kc, c, ldc, bias, first, pf, npf);
  }
}
#endif

TileFn pick_tile(c10::string_view isa) {
  const CpuIsa best = detect_isa();
  if (isa == "scalar") return &tile_scalar;
  TORCH_CHECK(isa.empty() || isa == "avx2", "packed_linear: isa must be '', 'scalar' or 'avx2', got '",
              std::string(isa), "'");
#if SRT_CPU_X86
  if (best >= CpuIsa::kAvx2) return &tile_avx2;
#endif
  TORCH_CHECK(isa.empty(), "packed_linear: this CPU has no AVX2");
  return &tile_scalar;
}

at::Tensor pack_linear_weight(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2 && !w.is_mkldnn(),
              "pack_linear_weight: weight must be a float32 CPU tensor [N, K]");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), P = (N + NR - 1) / NR;
  at::Tensor out = at::zeros({P, K, NR}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min(NR, N - p * NR);
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t j = 0; j < cols; ++j) dst[(p * K + k) * NR + j] = src[(p * NR + j) * K + k];
      }
    }
  });
  return out;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                         c10::string_view isa) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "packed_linear: x must be a float32 CPU tensor [M, K]");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kFloat && packed.dim() == 3 &&
                  packed.size(2) == NR && packed.is_contiguous(),
              "packed_linear: packed must come from pack_linear_weight ([P, K, ", NR, "] float32), got ",
              packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "packed_linear: x has ", K, " columns, the packed weight ", packed.size(1));
  TORCH_CHECK(N > (P - 1) * NR && N <= P * NR, "packed_linear: N = ", N, " does not match ", P, " panels");
  const at::Tensor xc = (K <= 1 || x.stride(1) == 1) ? x : x.contiguous();
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "packed_linear: bias must be float32 contiguous [", N, "]");
    bp = bias->data_ptr<float>();
  }
  const TileFn tile = pick_tile(isa);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return bp ? out.copy_(bias->view({1, N}).expand({M, N})) : out.zero_();
  const float* a = xc.data_ptr<float>();
  const int64_t lda = xc.stride(0);
  const float* w = packed.data_ptr<float>();
  float* c = out.data_ptr<float>();
  const int64_t KC = k_block(M), row_tiles = (M + MR - 1) / MR;
  const int64_t slice_lines = KC * NR * static_cast<int64_t>(sizeof(float)) / kLine;
  const int64_t lines_per_tile = row_tiles < 2 ? 0 : (slice_lines + row_tiles - 1) / row_tiles;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    float edge[MR * NR];  // the last panel's tile when N is not a multiple of NR
    float bias_edge[NR];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min(NR, N - p * NR);
      const float* pb = bp ? bp + p * NR : nullptr;
      if (pb && cols < NR) {
        std::fill(bias_edge, bias_edge + NR, 0.f);
        std::copy(pb, pb + cols, bias_edge);
        pb = bias_edge;
      }
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        const float* b = w + (p * K + k0) * NR;
        // the next slice follows this one in memory (the next panel's first one after the last)
        const char* next = reinterpret_cast<const char*>(b + kc * NR);
        for (int64_t m = 0; m < M; m += MR) {
          const int R = static_cast<int>(std::min<int64_t>(MR, M - m));
          const int64_t l0 = std::min(slice_lines, m / MR * lines_per_tile);
          const int64_t npf = std::min(slice_lines, l0 + lines_per_tile) - l0;
          const char* pf = next + kLine * l0;
          float* cm = c + m * N + p * NR;
          if (cols == NR) {
            tile(R, a + m * lda + k0, lda, b, kc, cm, N, pb, k0 == 0, pf, npf);
            continue;
          }
          for (int i = 0; i < R; ++i) std::copy(cm + i * N, cm + i * N + cols, edge + i * NR);
          tile(R, a + m * lda + k0, lda, b, kc, edge, NR, pb, k0 == 0, pf, npf);
          for (int i = 0; i < R; ++i) std::copy(edge + i * NR, edge + i * NR + cols, cm + i * N);
        }
      }
    }
  });
  return out;
}

at::Tensor packed_linear_meta(const at::Tensor& x, const at::Tensor&, int64_t N, const c10::optional<at::Tensor>&,
                              c10::string_view) {
  return at::empty({x.size(0), N}, x.options());
}

}  // namespace
}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias=None, str isa=\"\") -> Tensor");
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) {
  m.impl("pack_linear_weight", &srt_cpu::pack_linear_weight);
  m.impl("packed_linear", &srt_cpu::packed_linear);
}

TORCH_LIBRARY_IMPL(srt_cpu, Meta, m) { m.impl("packed_linear", &srt_cpu::packed_linear_meta); }

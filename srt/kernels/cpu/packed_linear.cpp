// Float32 linear layers on weights packed once at load: out [M, N] = x [M, K] @ w[N, K]^T (+ bias).
//
//   pack_linear_weight(w [N, K], nr = 0) -> packed [P, K, nr]   P = ceil(N / nr): panel p holds
//       output columns p*nr .. p*nr+nr-1, one row of nr weights per k (zeros past N), so a panel
//       is one sequential stream. nr is 24 (three AVX2 registers a row) or 48 (three AVX-512
//       registers); 0 picks the one for this CPU's best kernel
//   packed_linear(x [M, K], packed, N, bias [N]?, isa = "") -> out [M, N]
//
// Threads take whole panels (at::parallel_for over P). A prefill-sized x (more than 256 rows) goes
// in blocks of 128 rows, each passed over by all of the thread's panels while it sits in L2.
// Within a panel, K goes in blocks of KC (a KC x nr slice of the panel stays in L1 while every row
// block of x passes over it) and x in blocks of MR rows: a register tile that stays in registers
// across the K block. AVX2: 4 rows x 24 columns (12 accumulators, 3 weight loads and 4 broadcasts
// per k). AVX-512: 8 rows x 48 columns (24 accumulators, 3 weight loads, 8 broadcasts folded into
// the FMAs). The AVX2 tile also runs a 48-wide panel, in two halves, so a packed weight runs on any
// CPU.
// While the row blocks pass over one slice they prefetch the next one into L1, a share each,
// spread over their k loops: without it the first row block of every slice waits on DRAM with
// nothing to overlap (10-20% of a decode batch's time). KC keeps the slice in use and the one
// being prefetched in L1 together (see k_block). A batch that fits one row tile streams the weights
// once (bandwidth-bound, like a matrix-vector product): the AVX2 kernel leaves that to the hardware
// prefetcher (measured best on Zen 3), the AVX-512 kernel prefetches the next slice itself from 2
// rows on (on Emerald Rapids, 1.3x at 4-8 rows).
// One kernel family for every batch size: at decode batches (M = 4..64) it beats oneDNN's packed
// GEMM on the CPUs measured, at prefill sizes it is on par (docs/benchmarks.md has the figures).
//
// Each output is the sum over k in order 0 .. K-1 (one FMA chain, seeded with the bias), whatever M,
// the row block, the kernel, the thread count or the batch the row came in: results are
// batch-invariant and the same on every ISA. A scalar loop with the same order runs where the CPU
// has neither AVX2 + FMA nor AVX-512.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cpu_ops.h"
#include "vec.h"

namespace srt_cpu {
// The panel width pack_linear_weight uses by default: 48 (the AVX-512 tile's) where the CPU has
// AVX-512, else 24 (the AVX2 tile's). Either width runs on every kernel (the AVX2 tile takes a
// 48-wide panel in two halves), so a packed weight is never tied to the CPU.
int64_t default_panel_width() { return detect_isa() == CpuIsa::kAvx512 ? 48 : 24; }

namespace {

constexpr int64_t kLine = 64;
// x goes in blocks of kRowBlock rows when it has more than kMaxRowBlock (see packed_linear)
constexpr int64_t kRowBlock = 128;
constexpr int64_t kMaxRowBlock = 256;
constexpr int kMaxMR = 8;
constexpr int64_t kMaxNR = 48;

// One tile: c[i][0..tw) (+)= sum_k a[i][k] * b[k * ldb + 0..tw), i < R, tw = the kernel's width.
// `first`: start from bias (or 0). It also prefetches the `npf` cache lines from `pf` on (no effect
// on the result).
using TileFn = void (*)(int R, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t kc, float* c,
                        int64_t ldc, const float* bias, bool first, const char* pf, int64_t npf);

// A kernel: its tile, the tile's width (a divisor of the panel width) and height (rows of x), and
// whether a single row tile (M <= rows, M > 1) prefetches the next slice itself.
struct Kernel {
  TileFn tile;
  int64_t width;
  int rows;
  bool prefetch_alone;
};

template <int64_t TW>
void tile_scalar(int R, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t kc, float* c, int64_t ldc,
                 const float* bias, bool first, const char*, int64_t) {
  for (int i = 0; i < R; ++i) {
    float acc[TW];
    for (int64_t j = 0; j < TW; ++j) acc[j] = first ? (bias ? bias[j] : 0.f) : c[i * ldc + j];
    for (int64_t k = 0; k < kc; ++k) {
      const float ai = a[i * lda + k];
      for (int64_t j = 0; j < TW; ++j) acc[j] = std::fma(ai, b[k * ldb + j], acc[j]);
    }
    for (int64_t j = 0; j < TW; ++j) c[i * ldc + j] = acc[j];
  }
}

#if SRT_CPU_X86
// R rows (R <= 4) x 24 columns; the accumulators are named registers (an array would be spilled).
template <int R>
SRT_TARGET_AVX2 inline void tile_avx2_r(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t kc, float* c,
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
    const __m256 b0 = _mm256_loadu_ps(b + k * ldb), b1 = _mm256_loadu_ps(b + k * ldb + 8),
                 b2 = _mm256_loadu_ps(b + k * ldb + 16);
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

void tile_avx2(int R, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t kc, float* c, int64_t ldc,
               const float* bias, bool first, const char* pf, int64_t npf) {
  switch (R) {
    case 4: return tile_avx2_r<4>(a, lda, b, ldb, kc, c, ldc, bias, first, pf, npf);
    case 3: return tile_avx2_r<3>(a, lda, b, ldb, kc, c, ldc, bias, first, pf, npf);
    case 2: return tile_avx2_r<2>(a, lda, b, ldb, kc, c, ldc, bias, first, pf, npf);
    default: return tile_avx2_r<1>(a, lda, b, ldb, kc, c, ldc, bias, first, pf, npf);
  }
}

// R rows (R <= 8) x 48 columns: 24 accumulators, 3 weight registers, the row's value broadcast
// from memory into each FMA (32 registers in all).
template <int R>
SRT_TARGET_AVX512 inline void tile_avx512_r(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t kc,
                                            float* c, int64_t ldc, const float* bias, bool first, const char* pf,
                                            int64_t npf) {
  __m512 c00, c01, c02, c10, c11, c12, c20, c21, c22, c30, c31, c32;
  __m512 c40, c41, c42, c50, c51, c52, c60, c61, c62, c70, c71, c72;
  const __m512 z = _mm512_setzero_ps();
  const __m512 i0 = bias ? _mm512_loadu_ps(bias) : z, i1 = bias ? _mm512_loadu_ps(bias + 16) : z,
               i2 = bias ? _mm512_loadu_ps(bias + 32) : z;
#define SRT_PL_LOAD(i, r0, r1, r2)                                                             \
  if (R > i) {                                                                                 \
    if (first) {                                                                               \
      r0 = i0, r1 = i1, r2 = i2;                                                               \
    } else {                                                                                   \
      r0 = _mm512_loadu_ps(c + i * ldc), r1 = _mm512_loadu_ps(c + i * ldc + 16);               \
      r2 = _mm512_loadu_ps(c + i * ldc + 32);                                                  \
    }                                                                                          \
  }
  SRT_PL_LOAD(0, c00, c01, c02) SRT_PL_LOAD(1, c10, c11, c12) SRT_PL_LOAD(2, c20, c21, c22)
  SRT_PL_LOAD(3, c30, c31, c32) SRT_PL_LOAD(4, c40, c41, c42) SRT_PL_LOAD(5, c50, c51, c52)
  SRT_PL_LOAD(6, c60, c61, c62) SRT_PL_LOAD(7, c70, c71, c72)
#undef SRT_PL_LOAD
  for (int64_t k = 0; k < kc; ++k) {
    if (k < npf) _mm_prefetch(pf + kLine * k, _MM_HINT_T0);
    const __m512 b0 = _mm512_loadu_ps(b + k * ldb), b1 = _mm512_loadu_ps(b + k * ldb + 16),
                 b2 = _mm512_loadu_ps(b + k * ldb + 32);
#define SRT_PL_FMA(i, r0, r1, r2)                                                              \
  if (R > i) {                                                                                 \
    const __m512 ai = _mm512_set1_ps(a[i * lda + k]);                                          \
    r0 = _mm512_fmadd_ps(ai, b0, r0), r1 = _mm512_fmadd_ps(ai, b1, r1);                        \
    r2 = _mm512_fmadd_ps(ai, b2, r2);                                                          \
  }
    SRT_PL_FMA(0, c00, c01, c02) SRT_PL_FMA(1, c10, c11, c12) SRT_PL_FMA(2, c20, c21, c22)
    SRT_PL_FMA(3, c30, c31, c32) SRT_PL_FMA(4, c40, c41, c42) SRT_PL_FMA(5, c50, c51, c52)
    SRT_PL_FMA(6, c60, c61, c62) SRT_PL_FMA(7, c70, c71, c72)
#undef SRT_PL_FMA
  }
#define SRT_PL_STORE(i, r0, r1, r2)                                                            \
  if (R > i) {                                                                                 \
    _mm512_storeu_ps(c + i * ldc, r0), _mm512_storeu_ps(c + i * ldc + 16, r1);                 \
    _mm512_storeu_ps(c + i * ldc + 32, r2);                                                    \
  }
  SRT_PL_STORE(0, c00, c01, c02) SRT_PL_STORE(1, c10, c11, c12) SRT_PL_STORE(2, c20, c21, c22)
  SRT_PL_STORE(3, c30, c31, c32) SRT_PL_STORE(4, c40, c41, c42) SRT_PL_STORE(5, c50, c51, c52)
  SRT_PL_STORE(6, c60, c61, c62) SRT_PL_STORE(7, c70, c71, c72)
#undef SRT_PL_STORE
  for (int64_t k = kc; k < npf; ++k) _mm_prefetch(pf + kLine * k, _MM_HINT_T0);
}

void tile_avx512(int R, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t kc, float* c, int64_t ldc,
                 const float* bias, bool first, const char* pf, int64_t npf) {
  switch (R) {
    case 8: return tile_avx512_r<8>(a, lda, b, ldb, kc, c, ldc, bias, first, pf, npf);
    case 7: return tile_avx512_r<7>(a, lda, b, ldb, kc, c, ldc, bias, first, pf, npf);
    case 6: return tile_avx512_r<6>(a, lda, b, ldb, kc, c, ldc, bias, first, pf, npf);
    case 5: return tile_avx512_r<5>(a, lda, b, ldb, kc, c, ldc, bias, first, pf, npf);
    case 4: return tile_avx512_r<4>(a, lda, b, ldb, kc, c, ldc, bias, first, pf, npf);
    case 3: return tile_avx512_r<3>(a, lda, b, ldb, kc, c, ldc, bias, first, pf, npf);
    case 2: return tile_avx512_r<2>(a, lda, b, ldb, kc, c, ldc, bias, first, pf, npf);
    default: return tile_avx512_r<1>(a, lda, b, ldb, kc, c, ldc, bias, first, pf, npf);
  }
}
#endif

Kernel scalar_kernel(int64_t nr) {
  return nr == 48 ? Kernel{&tile_scalar<48>, 48, 4, false} : Kernel{&tile_scalar<24>, 24, 4, false};
}

// The kernel for `isa` ("": the best this CPU has for panels of `nr` columns).
Kernel pick_kernel(c10::string_view isa, int64_t nr) {
  const CpuIsa want = requested_isa("packed_linear", isa);
#if SRT_CPU_X86
  if (want == CpuIsa::kAvx512) {  // "" on an AVX-512 CPU: panels of 24 take the AVX2 tile
    TORCH_CHECK(nr == 48 || isa.empty(), "packed_linear: the avx512 kernel needs panels of 48, got ", nr);
    if (nr == 48) return Kernel{&tile_avx512, 48, 8, true};
  }
  if (want >= CpuIsa::kAvx2) return Kernel{&tile_avx2, 24, 4, false};
#endif
  return scalar_kernel(nr);
}

// k per block for an M-row x and panels of nr columns (a slice is KC * nr * 4 bytes): see the
// header.
int64_t k_block(int64_t M, int64_t nr) {
  if (nr == 48) return M <= 8 ? 128 : M <= 32 ? 64 : 192;
  return M <= 4 ? 256 : M <= 16 ? 96 : M <= 32 ? 128 : 256;
}

at::Tensor pack_linear_weight(const at::Tensor& w, int64_t nr) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2 && !w.is_mkldnn(),
              "pack_linear_weight: weight must be a float32 CPU tensor [N, K]");
  if (nr == 0) nr = default_panel_width();
  TORCH_CHECK(nr == 24 || nr == 48, "pack_linear_weight: panel width must be 24 or 48 (0: this CPU's), got ", nr);
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), P = (N + nr - 1) / nr;
  at::Tensor out = at::zeros({P, K, nr}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min(nr, N - p * nr);
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t j = 0; j < cols; ++j) dst[(p * K + k) * nr + j] = src[(p * nr + j) * K + k];
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                         c10::string_view isa) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "packed_linear: x must be a float32 CPU tensor [M, K]");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kFloat && packed.dim() == 3 &&
                  (packed.size(2) == 24 || packed.size(2) == 48) && packed.is_contiguous(),
              "packed_linear: packed must come from pack_linear_weight ([P, K, 24 or 48] float32), got ",
              packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), NR = packed.size(2);
  TORCH_CHECK(packed.size(1) == K, "packed_linear: x has ", K, " columns, the packed weight ", packed.size(1));
  TORCH_CHECK(N > (P - 1) * NR && N <= P * NR, "packed_linear: N = ", N, " does not match ", P, " panels of ", NR);
  const at::Tensor xc = (K <= 1 || x.stride(1) == 1) ? x : x.contiguous();
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "packed_linear: bias must be float32 contiguous [", N, "]");
    bp = bias->data_ptr<float>();
  }
  const Kernel kern = pick_kernel(isa, NR);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return bp ? out.copy_(bias->view({1, N}).expand({M, N})) : out.zero_();
  const float* a = xc.data_ptr<float>();
  const int64_t lda = xc.stride(0);
  const float* w = packed.data_ptr<float>();
  float* c = out.data_ptr<float>();
  const int MR = kern.rows;
  const int64_t TW = kern.width;
  // x in blocks of MC rows (all of it up to kMaxRowBlock rows): a block's rows stay in L2 while
  // every panel of the thread passes over them (at 2048 rows, 1.2x over one block of all rows)
  const int64_t MC = M <= kMaxRowBlock ? M : kRowBlock;
  const int64_t KC = k_block(MC, NR), row_tiles = (MC + MR - 1) / MR;
  const int64_t slice_lines = KC * NR * static_cast<int64_t>(sizeof(float)) / kLine;
  const bool prefetch = row_tiles > 1 || (kern.prefetch_alone && MC > 1);
  const int64_t lines_per_tile = prefetch ? (slice_lines + row_tiles - 1) / row_tiles : 0;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    float edge[kMaxMR * kMaxNR];  // the last panel's tile when N is not a multiple of NR
    float bias_edge[kMaxNR];
    for (int64_t mb = 0; mb < M; mb += MC) {
      const int64_t me = std::min(M, mb + MC);
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
          for (int64_t m = mb; m < me; m += MR) {
            const int R = static_cast<int>(std::min<int64_t>(MR, me - m));
            const int64_t l0 = std::min(slice_lines, (m - mb) / MR * lines_per_tile);
            const int64_t npf = std::min(slice_lines, l0 + lines_per_tile) - l0;
            const char* pf = next + kLine * l0;
            float* cm = c + m * N + p * NR;
            float* ct = cm;
            int64_t ldc = N;
            if (cols < NR) {  // through the edge buffer
              for (int i = 0; i < R; ++i) std::copy(cm + i * N, cm + i * N + cols, edge + i * NR);
              ct = edge, ldc = NR;
            }
            for (int64_t j = 0; j < NR; j += TW) {  // the prefetch share goes with the first part
              kern.tile(R, a + m * lda + k0, lda, b + j, NR, kc, ct + j, ldc, pb ? pb + j : nullptr, k0 == 0,
                        pf, j == 0 ? npf : 0);
            }
            if (cols < NR) {
              for (int i = 0; i < R; ++i) std::copy(edge + i * NR, edge + i * NR + cols, cm + i * N);
            }
          }
        }
      }
    }
  });
  return out;
}

namespace {

at::Tensor packed_linear_meta(const at::Tensor& x, const at::Tensor&, int64_t N, const c10::optional<at::Tensor>&,
                              c10::string_view) {
  return at::empty({x.size(0), N}, x.options());
}

}  // namespace
}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("pack_linear_weight(Tensor weight, int nr=0) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias=None, str isa=\"\") -> Tensor");
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) {
  m.impl("pack_linear_weight", &srt_cpu::pack_linear_weight);
  m.impl("packed_linear", &srt_cpu::packed_linear);
}

TORCH_LIBRARY_IMPL(srt_cpu, Meta, m) { m.impl("packed_linear", &srt_cpu::packed_linear_meta); }

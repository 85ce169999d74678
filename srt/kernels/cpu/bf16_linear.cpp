// bf16 linear layers on weights packed once at load: out [M, N] = x [M, K] @ w[N, K]^T (+ bias),
// float32 accumulation.
//
//   pack_bf16_weight(w [N, K] bf16 or float32, K even) -> packed [P, K/2, 32, 2] bf16
//       P = ceil(N / 32): panel p holds output columns 32p .. 32p+31, one row of 32 (k, k+1) pairs
//       per pair of k (VNNI pairs: the layout vdpbf16ps, AMX tiles and oneDNN's brgemm read), zeros
//       past N. A float32 weight is rounded to bf16 (exact for a bf16 checkpoint). An odd K (no
//       model has one) is refused: x's K must then equal the weight's exactly.
//   bf16_linear(x [M, K] bf16 or float32, packed, N, bias [N]?, isa = "") -> out [M, N], x's dtype
//
// The paths (`isa`: "" picks, or one named to test it):
//   "brgemm"       x bf16, at least bf16_brgemm_rows() rows, a CPU with AMX-BF16 (16 rows; never
//                  without AMX, where the tiles below beat it; SRT_BF16_BRGEMM_M overrides): ATen's
//                  CPUBlas brgemm on each panel (oneDNN's ukernel takes AMX tiles).
//   "avx512_bf16"  x bf16: vdpbf16ps, register tiles of up to 8 rows x 32 columns (1-2 rows: 4
//                  panels at once, 3-4 rows: 2, so enough chains hide the loads' latency), the
//                  weights streamed once per tile and prefetched (at 1-8 rows a matrix-vector
//                  product, bound by read bandwidth).
//   "avx512", "avx2", "scalar"   any x (CPUs without bf16 arithmetic, float32 activations): each
//                  weight pair widened to float32 in registers (a 16-bit shift) and two FMAs.
// Every path sums each output over k in pair order in float32; the products of bf16 values are
// exact in float32, so the paths differ only by float32 rounding of the sums (and by how the
// brgemm's ukernel orders them). A float32 x is never rounded to bf16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "vec.h"

#if SRT_CPU_X86
#include <cpuid.h>
#endif

namespace srt_cpu {
namespace {

constexpr int64_t kNR = 32;     // output columns a panel
constexpr int kMR512 = 8;       // rows a tile, AVX-512 paths
constexpr int kMR2 = 4;         // rows a tile, AVX2 and scalar
constexpr int64_t kBrgemmMB = 64;  // rows a brgemm call

enum class Bf16Path { kScalar, kAvx2, kAvx512, kAvx512Bf16, kBrgemm };

const char* path_name(Bf16Path p) {
  switch (p) {
    case Bf16Path::kBrgemm: return "brgemm";
    case Bf16Path::kAvx512Bf16: return "avx512_bf16";
    case Bf16Path::kAvx512: return "avx512";
    case Bf16Path::kAvx2: return "avx2";
    default: return "scalar";
  }
}

bool cpu_has_avx512_bf16() {
#if SRT_CPU_X86
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  }();
  return has && detect_isa() == CpuIsa::kAvx512;
#else
  return false;
#endif
}

// One tile: c[i][0..32) = bias + sum over pairs kh of x[i] . w-pair, i < R; the result in float32,
// rows ldc apart. `xa` points at row 0 of x (bf16 or float32 elements, row stride lda), `w` at the
// panel. Every path sums each output over kh in order, one chain, whatever R and the panels beside.
// `more`: the sums go on from c's values (a later block of k) instead of starting at the bias, so a
// product split into blocks of k sums in the same order as in one call.
template <typename XT>
void tile_scalar(int R, const XT* xa, int64_t lda, int64_t K, const uint16_t* w, const float* bias, float* c,
                 int64_t ldc, bool more) {
  const int64_t Kh = K / 2;
  for (int i = 0; i < R; ++i) {
    float acc[kNR];
    for (int64_t j = 0; j < kNR; ++j) acc[j] = more ? c[i * ldc + j] : bias ? bias[j] : 0.f;
    const XT* x = xa + i * lda;
    for (int64_t kh = 0; kh < Kh; ++kh) {
      const float x0 = static_cast<float>(x[2 * kh]), x1 = static_cast<float>(x[2 * kh + 1]);
      const uint16_t* wp = w + kh * kNR * 2;
      for (int64_t j = 0; j < kNR; ++j) {
        acc[j] = std::fma(x0, bf16_bits_to_float(wp[2 * j]), acc[j]);
        acc[j] = std::fma(x1, bf16_bits_to_float(wp[2 * j + 1]), acc[j]);
      }
    }
    std::memcpy(c + i * ldc, acc, sizeof acc);
  }
}

// x[i][2kh], x[i][2kh+1] as float32
template <typename XT>
inline void x_pair(const XT* x, int64_t kh, float* x0, float* x1) {
  *x0 = static_cast<float>(x[2 * kh]);
  *x1 = static_cast<float>(x[2 * kh + 1]);
}

#if SRT_CPU_X86
// AVX2: the panel in two halves of 16 columns; per half and pair of k, 2 loads of 8 pairs, each
// widened into the even (k) and odd (k+1) weights, 2 FMAs each.
template <typename XT, int R>
SRT_TARGET_AVX2 void tile_avx2_r(const XT* xa, int64_t lda, int64_t K, const uint16_t* w, const float* bias,
                                 float* c, int64_t ldc, bool more) {
  const int64_t Kh = K / 2;
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R][2];
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < 2; ++v)
        acc[i][v] = more   ? _mm256_loadu_ps(c + i * ldc + half * 16 + v * 8)
                    : bias ? _mm256_loadu_ps(bias + half * 16 + v * 8)
                           : _mm256_setzero_ps();
    for (int64_t kh = 0; kh < Kh; ++kh) {
      const uint16_t* wp = w + (kh * kNR + half * 16) * 2;
      const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
      const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16));
      const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(p0, 16));
      const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(p0, hi));
      const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(p1, 16));
      const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(p1, hi));
      for (int i = 0; i < R; ++i) {
        float f0, f1;
        x_pair(xa + i * lda, kh, &f0, &f1);
        const __m256 x0 = _mm256_set1_ps(f0), x1 = _mm256_set1_ps(f1);
        acc[i][0] = _mm256_fmadd_ps(x1, o0, _mm256_fmadd_ps(x0, e0, acc[i][0]));
        acc[i][1] = _mm256_fmadd_ps(x1, o1, _mm256_fmadd_ps(x0, e1, acc[i][1]));
      }
    }
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < 2; ++v) _mm256_storeu_ps(c + i * ldc + half * 16 + v * 8, acc[i][v]);
  }
}

// The accumulators of an AVX-512 tile: c's values (more), the bias, or zeros
template <int R, int NP>
SRT_TARGET_AVX512 inline void init_acc512(__m512 (&acc)[R][NP][2], const float* bias, const float* c, int64_t ldc,
                                          bool more) {
  for (int i = 0; i < R; ++i)
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < 2; ++v)
        acc[i][p][v] = more   ? _mm512_loadu_ps(c + i * ldc + p * kNR + v * 16)
                       : bias ? _mm512_loadu_ps(bias + p * kNR + v * 16)
                              : _mm512_setzero_ps();
}

// AVX-512 without bf16 arithmetic: the same widening, 16 pairs a load, NP panels at once (NP
// independent streams and 2 NP chains a row: a few rows are bound by the loads' latency otherwise).
template <typename XT, int R, int NP>
SRT_TARGET_AVX512 void tile_avx512_r(const XT* xa, int64_t lda, int64_t K, const uint16_t* w, int64_t pstride,
                                     const float* bias, float* c, int64_t ldc, bool more) {
  const int64_t Kh = K / 2;
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[R][NP][2];
  init_acc512<R, NP>(acc, bias, c, ldc, more);
  for (int64_t kh = 0; kh < Kh; ++kh) {
    float f0[R], f1[R];
    for (int i = 0; i < R; ++i) x_pair(xa + i * lda, kh, &f0[i], &f1[i]);
    for (int p = 0; p < NP; ++p) {
      const uint16_t* wp = w + p * pstride + kh * kNR * 2;
      const __m512i p0 = _mm512_loadu_si512(wp);
      const __m512i p1 = _mm512_loadu_si512(wp + 32);
      const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(p0, 16));
      const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(p0, hi));
      const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(p1, 16));
      const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(p1, hi));
      for (int i = 0; i < R; ++i) {
        const __m512 x0 = _mm512_set1_ps(f0[i]), x1 = _mm512_set1_ps(f1[i]);
        acc[i][p][0] = _mm512_fmadd_ps(x1, o0, _mm512_fmadd_ps(x0, e0, acc[i][p][0]));
        acc[i][p][1] = _mm512_fmadd_ps(x1, o1, _mm512_fmadd_ps(x0, e1, acc[i][p][1]));
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < 2; ++v) _mm512_storeu_ps(c + i * ldc + p * kNR + v * 16, acc[i][p][v]);
}

#define SRT_TARGET_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

// AVX512-BF16: x's (k, k+1) pair broadcast as one 32-bit lane, vdpbf16ps against 16 columns' pairs;
// NP panels at once (see tile_avx512_r), each stream prefetched kPrefetch pairs of k ahead.
constexpr int64_t kPrefetch = 16;
template <int R, int NP>
SRT_TARGET_AVX512_BF16 void tile_bf16dot_r(const uint16_t* xa, int64_t lda, int64_t K, const uint16_t* w,
                                           int64_t pstride, const float* bias, float* c, int64_t ldc, bool more,
                                           const uint16_t* pf, int64_t pf_lines) {
  const int64_t Kh = K / 2;
  __m512 acc[R][NP][2];
  init_acc512<R, NP>(acc, bias, c, ldc, more);
  for (int64_t kh = 0; kh < Kh; ++kh) {
    __m512bh xp[R];
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, xa + i * lda + 2 * kh, sizeof pair);
      xp[i] = (__m512bh)_mm512_set1_epi32(pair);
    }
    if (pf != nullptr && kh < pf_lines) _mm_prefetch(reinterpret_cast<const char*>(pf + kh * 32), _MM_HINT_T0);
    for (int p = 0; p < NP; ++p) {
      const uint16_t* wp = w + p * pstride + kh * kNR * 2;
      if (pf == nullptr && kh + kPrefetch < Kh) {
        _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetch * kNR * 2), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetch * kNR * 2 + 32), _MM_HINT_T0);
      }
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
      for (int i = 0; i < R; ++i) {
        acc[i][p][0] = _mm512_dpbf16_ps(acc[i][p][0], xp[i], w0);
        acc[i][p][1] = _mm512_dpbf16_ps(acc[i][p][1], xp[i], w1);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < 2; ++v) _mm512_storeu_ps(c + i * ldc + p * kNR + v * 16, acc[i][p][v]);
}
#endif  // SRT_CPU_X86

// f(std::integral_constant<int, R>) for R in 1 .. MAXR: the tiles' row counts are template arguments
template <int MAXR, typename F>
void with_rows(int R, F&& f) {
  switch (R) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: break;
  }
  if constexpr (MAXR <= 4) {
    return f(std::integral_constant<int, 4>{});
  } else {
    switch (R) {
      case 4: return f(std::integral_constant<int, 4>{});
      case 5: return f(std::integral_constant<int, 5>{});
      case 6: return f(std::integral_constant<int, 6>{});
      case 7: return f(std::integral_constant<int, 7>{});
      default: return f(std::integral_constant<int, 8>{});
    }
  }
}

// f(std::integral_constant<int, NP>) for NP in {1, 2, 4}
template <typename F>
void with_panels(int np, F&& f) {
  switch (np) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}

// Panels a tile of R rows takes at once on the AVX-512 paths: enough chains to hide the loads'
// latency at a few rows, within the 32 vector registers.
inline int panels_at_once(Bf16Path path, int R) {
  if (path != Bf16Path::kAvx512 && path != Bf16Path::kAvx512Bf16) return 1;
  return R <= 2 ? 4 : R <= 4 ? 2 : 1;
}

// R rows x np panels (pstride elements apart): c[i][p * 32 + j], rows ldc apart. `pf`: the bf16 dot
// tiles prefetch pf_lines cache lines from pf (one a pair of k) instead of their own stream ahead
// (blocks of k: the next block, while this one is in cache)
template <typename XT>
void run_tile(Bf16Path path, int R, int np, const XT* xa, int64_t lda, int64_t K, const uint16_t* w, int64_t pstride,
              const float* bias, float* c, int64_t ldc, bool more, const uint16_t* pf = nullptr,
              int64_t pf_lines = 0) {
#if SRT_CPU_X86
  if constexpr (std::is_same_v<XT, c10::BFloat16>) {
    if (path == Bf16Path::kAvx512Bf16) {
      const uint16_t* xu = reinterpret_cast<const uint16_t*>(xa);
      return with_rows<kMR512>(R, [&](auto r) {
        with_panels(np, [&](auto n) {
          tile_bf16dot_r<decltype(r)::value, decltype(n)::value>(xu, lda, K, w, pstride, bias, c, ldc, more, pf,
                                                                      pf_lines);
        });
      });
    }
  }
  if (path == Bf16Path::kAvx512 || path == Bf16Path::kAvx512Bf16) {
    return with_rows<kMR512>(R, [&](auto r) {
      with_panels(np, [&](auto n) {
        tile_avx512_r<XT, decltype(r)::value, decltype(n)::value>(xa, lda, K, w, pstride, bias, c, ldc, more);
      });
    });
  }
#endif
  for (int p = 0; p < np; ++p) {
    const uint16_t* wp = w + p * pstride;
    const float* bp = bias ? bias + p * kNR : nullptr;
#if SRT_CPU_X86
    if (path == Bf16Path::kAvx2) {
      with_rows<kMR2>(R, [&](auto r) { tile_avx2_r<XT, decltype(r)::value>(xa, lda, K, wp, bp, c + p * kNR, ldc, more); });
      continue;
    }
#endif
    tile_scalar<XT>(R, xa, lda, K, wp, bp, c + p * kNR, ldc, more);
  }
}

int tile_rows(Bf16Path path) {
  return (path == Bf16Path::kAvx512 || path == Bf16Path::kAvx512Bf16) ? kMR512 : kMR2;
}

// AMX-BF16 tiles (CPUID leaf 7, EDX bit 22): oneDNN's brgemm runs on them (it asks the kernel for
// the tile state itself, and falls back to AVX512-BF16 where it may not use them)
bool cpu_has_amx_bf16() {
#if SRT_CPU_X86
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1u);
  }();
  return has;
#else
  return false;
#endif
}

// Without AMX, srt's vdpbf16ps tiles beat the brgemm at every row count measured (1-256 rows, 1.5x
// from 16 rows on an AMD Zen 5): brgemm only where the CPU has AMX, from kAmxBrgemmRows rows, unless
// SRT_BF16_BRGEMM_M says otherwise (0: never).
constexpr int64_t kAmxBrgemmRows = 16;
constexpr int64_t kNever = INT64_MAX;

int64_t brgemm_rows_from_env() {
  const char* env = std::getenv("SRT_BF16_BRGEMM_M");
  if (env == nullptr || env[0] == '\0') return cpu_has_amx_bf16() ? kAmxBrgemmRows : kNever;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  TORCH_CHECK(end != env && *end == '\0' && v >= 0, "SRT_BF16_BRGEMM_M must be an integer >= 0, got '", env, "'");
  return v == 0 ? kNever : v;
}

Bf16Path pick_path(c10::string_view requested, bool x_bf16, int64_t M) {
  const CpuIsa isa = detect_isa();
  const bool dot = cpu_has_avx512_bf16();
  const Bf16Path widened =
      isa == CpuIsa::kAvx512 ? Bf16Path::kAvx512 : isa == CpuIsa::kAvx2 ? Bf16Path::kAvx2 : Bf16Path::kScalar;
  if (requested.empty()) {
    if (x_bf16 && dot) return M >= bf16_brgemm_rows() ? Bf16Path::kBrgemm : Bf16Path::kAvx512Bf16;
    return widened;
  }
  const std::string name(requested);
  for (Bf16Path p : {Bf16Path::kScalar, Bf16Path::kAvx2, Bf16Path::kAvx512, Bf16Path::kAvx512Bf16,
                     Bf16Path::kBrgemm}) {
    if (name != path_name(p)) continue;
    const Bf16Path best = dot ? Bf16Path::kBrgemm : widened;  // the paths run in this enum's order
    TORCH_CHECK(p <= best, "bf16_linear: isa '", name, "' is not available on this CPU (it runs up to '",
                path_name(best), "')");
    TORCH_CHECK(p < Bf16Path::kAvx512Bf16 || x_bf16, "bf16_linear: isa '", name, "' takes a bf16 x");
    return p;
  }
  TORCH_CHECK(false, "bf16_linear: isa must be '', 'scalar', 'avx2', 'avx512', 'avx512_bf16' or 'brgemm', got '",
              name, "'");
}

// c [R, ldc] float32 -> out rows (columns < cols), in out's dtype
template <typename OT>
inline void store_tile(int R, const float* c, int64_t cols, int64_t ldc, OT* out, int64_t ldo) {
  for (int i = 0; i < R; ++i)
    for (int64_t j = 0; j < cols; ++j) out[i * ldo + j] = static_cast<OT>(c[i * ldc + j]);
}

constexpr int kMaxNP = 4;
// k a block when several tiles of rows share a panel (the vdpbf16ps path): one panel's block (32
// columns x kBlockK bf16, 64 KiB) stays in cache while every tile of rows takes it, and the tiles
// prefetch the next block meanwhile, so the weights stream from memory once and behind the
// arithmetic. On a Zen 5, Qwen2.5-1.5B's layers at 16 / 32 rows: 1.24x / 1.22x the unblocked rate
// (blocks of 256 / 512 / 1024 / 2048 k measured; 1024 best, 2048 equal).
constexpr int64_t kBlockK = 1024;

template <typename XT>
void run_panels(Bf16Path path, const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias,
                at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), Kh = packed.size(1);
  const XT* xa = x.data_ptr<XT>();
  const int64_t lda = x.stride(0);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t pstride = Kh * kNR * 2;
  XT* o = out.data_ptr<XT>();
  const int MR = tile_rows(path);
  constexpr int64_t ldc = kMaxNP * kNR;
  const bool blocked = path == Bf16Path::kAvx512Bf16 && M > MR;
  const int64_t tiles = (M + MR - 1) / MR;
  // lines of the next block of k each tile prefetches: a block is kBlockK lines (32 columns x 2 k x
  // 2 bytes a pair of k), shared among the tiles of rows, one line per pair of k of a tile at most
  const int64_t share = std::min<int64_t>((kBlockK + tiles - 1) / tiles, kBlockK / 2);
  // threads take groups of kMaxNP panels
  at::parallel_for(0, (P + kMaxNP - 1) / kMaxNP, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float c[kMR512 * ldc];
    alignas(64) float bias_group[ldc];
    std::vector<float> rows_c(blocked ? M * ldc : 0);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * kMaxNP, np = std::min<int64_t>(kMaxNP, P - p0);
      const int64_t cols = std::min(np * kNR, N - p0 * kNR);
      if (bias) {
        std::fill(bias_group, bias_group + ldc, 0.f);
        std::copy(bias + p0 * kNR, bias + p0 * kNR + cols, bias_group);
      }
      if (blocked) {  // several tiles of rows: each block of k of a panel serves them all from cache,
        // and each tile prefetches its share of the next block (the panels are consecutive in memory)
        for (int64_t p = 0; p < np; ++p)
          for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
            const int64_t kc = std::min(kBlockK, K - k0);
            const uint16_t* wk = w + (p0 + p) * pstride + k0 * kNR;
            const uint16_t* next = wk + kc * kNR;
            for (int64_t m = 0, t = 0; m < M; m += MR, ++t)
              run_tile<XT>(path, static_cast<int>(std::min<int64_t>(MR, M - m)), 1, xa + m * lda + k0, lda, kc,
                           wk, pstride, bias ? bias_group + p * kNR : nullptr, rows_c.data() + m * ldc + p * kNR,
                           ldc, k0 > 0, next + t * share * 32, share);
          }
        for (int64_t m = 0; m < M; m += MR)
          store_tile<XT>(static_cast<int>(std::min<int64_t>(MR, M - m)), rows_c.data() + m * ldc, cols, ldc,
                         o + m * N + p0 * kNR, N);
        continue;
      }
      for (int64_t m = 0; m < M; m += MR) {
        const int R = static_cast<int>(std::min<int64_t>(MR, M - m));
        const int at_once = panels_at_once(path, R);
        for (int64_t p = 0; p < np;) {  // sub-groups of at_once panels, single ones at the tail
          const int n = p + at_once <= np ? at_once : 1;
          run_tile<XT>(path, R, n, xa + m * lda, lda, K, w + (p0 + p) * pstride, pstride,
                       bias ? bias_group + p * kNR : nullptr, c + p * kNR, ldc, false);
          p += n;
        }
        store_tile<XT>(R, c, cols, ldc, o + m * N + p0 * kNR, N);
      }
    }
  });
}

// x bf16, K even: one brgemm per (panel, block of kBrgemmMB rows), float32 into a buffer, then bias
// and the rounding to bf16.
void run_brgemm(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), Kh = packed.size(1);
  const at::BFloat16* xa = x.data_ptr<at::BFloat16>();
  const int64_t lda = x.stride(0);
  const at::BFloat16* w = packed.data_ptr<at::BFloat16>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const int64_t MB = (M + kBrgemmMB - 1) / kBrgemmMB;
  at::parallel_for(0, P * MB, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float c[kBrgemmMB * kNR];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = t / MB, m0 = (t % MB) * kBrgemmMB;
      const int64_t rows = std::min(kBrgemmMB, M - m0), cols = std::min(kNR, N - p * kNR);
      at::native::cpublas::brgemm(rows, kNR, K, lda, kNR, kNR, false, xa + m0 * lda, w + p * Kh * kNR * 2, c,
                                  true);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j)
          o[(m0 + i) * N + p * kNR + j] = static_cast<at::BFloat16>(c[i * kNR + j] + (bias ? bias[p * kNR + j] : 0.f));
    }
    at::native::cpublas::brgemm_release(true);
  });
}

}  // namespace

int64_t bf16_brgemm_rows() {
  static const int64_t rows = brgemm_rows_from_env();
  return rows;
}

at::Tensor pack_bf16_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
              "pack_bf16_weight: weight must be a bf16 or float32 CPU tensor [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "pack_bf16_weight: K must be even (pairs of k), got ", K);
  const int64_t P = (N + kNR - 1) / kNR, Kh = K / 2;
  // [P*32, K] zero-padded, then (p, j, kh, t) -> (p, kh, j, t)
  at::Tensor padded = at::zeros({P * kNR, K}, weight.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, kNR, Kh, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                       c10::string_view isa) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "bf16_linear: x must be a bf16 or float32 CPU tensor [M, K]");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(2) == kNR && packed.size(3) == 2 && packed.is_contiguous(),
              "bf16_linear: packed must come from pack_bf16_weight ([P, K/2, 32, 2] bf16), got ", packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(K == 2 * packed.size(1), "bf16_linear: x has ", K, " columns, the packed weight ", 2 * packed.size(1));
  TORCH_CHECK(N > (P - 1) * kNR && N <= P * kNR, "bf16_linear: N = ", N, " does not match ", P, " panels of ", kNR);
  at::Tensor b32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bf16_linear: bias must have ", N, " elements, got ", bias->numel());
    b32 = bias->to(at::kFloat).contiguous();
  }
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  const Bf16Path path = pick_path(isa, x_bf16, M);
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return b32.defined() ? out.copy_(b32.view({1, N}).expand({M, N})) : out.zero_();
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  if (path == Bf16Path::kBrgemm) {
    run_brgemm(xc, packed, N, bp, out);
  } else if (x_bf16) {
    run_panels<at::BFloat16>(path, xc, packed, N, bp, out);
  } else {
    run_panels<float>(path, xc, packed, N, bp, out);
  }
  return out;
}

std::string bf16_linear_path(int64_t M, bool x_bf16) {
  return path_name(pick_path("", x_bf16, M));
}

namespace {
at::Tensor bf16_linear_meta(const at::Tensor& x, const at::Tensor&, int64_t N, const c10::optional<at::Tensor>&,
                            c10::string_view) {
  return at::empty({x.size(0), N}, x.options());
}
}  // namespace
}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("pack_bf16_weight(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int n, Tensor? bias=None, str isa=\"\") -> Tensor");
  m.def("bf16_linear_path(int m, bool x_bf16) -> str", &srt_cpu::bf16_linear_path);
  m.def("bf16_brgemm_rows() -> int", &srt_cpu::bf16_brgemm_rows);
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) {
  m.impl("pack_bf16_weight", &srt_cpu::pack_bf16_weight);
  m.impl("bf16_linear", &srt_cpu::bf16_linear);
}

TORCH_LIBRARY_IMPL(srt_cpu, Meta, m) { m.impl("bf16_linear", &srt_cpu::bf16_linear_meta); }

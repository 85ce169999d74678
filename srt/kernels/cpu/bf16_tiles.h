// The register tiles of srt's bf16 linear (bf16_linear.cpp) and of the linears whose weights widen
// to bf16 panels on the way (fp8_linear.cpp): a panel is 32 output columns of VNNI (k, k+1) pairs,
// [K/2, 32, 2] bf16; a tile is up to 8 rows of x against 1, 2 or 4 panels, summed in float32, each
// output over k in pair order, one chain (see run_tile).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "cpu_ops.h"
#include "vec.h"

namespace srt_cpu {
namespace {
constexpr int64_t kNR = 32;     // output columns a panel
constexpr int kMR512 = 8;       // rows a tile, AVX-512 paths
constexpr int kMR2 = 4;         // rows a tile, AVX2 and scalar

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

// Whether a bf16 x takes the vdpbf16ps tiles by default. AMD's cores (Zen 4, Zen 5) issue vdpbf16ps
// at the float32 FMA's rate or better, each one two products a lane; Intel's issue it at half the
// FMA's rate (an Intel Xeon with AVX512-BF16 and no AMX, 16 independent chains on one core: 84
// against 172 GFLOP/s), no faster than widening each weight pair to float32 for two FMAs.
bool cpu_bf16_dot_fast() {
#if SRT_CPU_X86
  static const bool fast = [] {
    __builtin_cpu_init();
    return cpu_has_avx512_bf16() && !__builtin_cpu_is("intel");
  }();
  return fast;
#else
  return false;
#endif
}
// Where vdpbf16ps is slow (cpu_bf16_dot_fast), a bf16 x of at least kSlowDotRows rows takes the
// weights widened to float32 (its rows as a float32 copy, broadcast from memory): on an Intel Xeon
// with AVX512-BF16 and no AMX (2 cores), Qwen2.5-1.5B's layers ran 1.10x the vdpbf16ps tiles at 8
// rows, 1.33x at 16, 1.40x at 32-64, equal at 1-6 (read-bound).
constexpr int64_t kSlowDotRows = 8;

#if SRT_CPU_X86
// Pairs of k a block of an AVX2 tile taking its panel in parts (3-4 rows): one part over a block
// and then the other read it from L1, where whole passes over the panel each streamed it from
// memory with every other cache line skipped. Qwen2.5-1.5B's layers on an AMD Zen 3 (2 cores),
// alternated in one process: 4 rows 128 ms against 183, 8 rows 212 against 263, 16 / 32 rows 1.05x
// (blocks of 32 / 64 / 128: 64 best). Over whole panels then; bf16_linear.cpp's run_avx2_blocks now
// gives these tiles blocks of 2,048 k (the AVX-512 tiles' blocked path, blocks of 1,024 k and tiles
// of even heights, was 1.05-1.16x slower than whole panels).
constexpr int64_t kAvx2PartBlock = 64;
// Pairs of k ahead an AVX2 tile of 2 rows prefetches its panel when it reads it from memory (`stream`:
// a call of 2 rows, or the first two rows of run_avx2_blocks in bf16_linear.cpp). Qwen2.5-1.5B's
// layers on an AMD Zen 3 (2 cores), alternated in one process, medians of 11 paired rounds: 2 rows
// 1.14-1.15x (16 / 32 / 64 pairs ahead: 32 best or within 0.05). Not for one row (read-bound:
// 0.99x), 4 rows (0.87x) or a tile after another over the same panel (a 2-row tail after a 4-row
// tile, reading the panel from L2: 0.87x): there the two prefetches a pair of k cost more than they
// hide.
constexpr int64_t kAvx2Prefetch = 32;
// AVX2: NP panels at once, each in passes of V vectors of 8 columns (V = 4: the whole panel; 2: a
// half, where R x NP x 4 accumulators would not fit the 16 registers); per vector and pair of k, one
// load of 8 pairs widened into the even (k) and odd (k+1) weights, 2 FMAs a row. One row takes 2
// whole panels at once, 2 rows one whole panel (8 chains of 2 FMAs a pair of k each), 3-4 rows half
// a panel at a time. Qwen2.5-1.5B's layers (2.65 GB of panels) on an AMD Zen 3 (2 cores), three
// rounds of alternated processes: one row 77-86 ms against 155-180 with half a panel at a time (as
// 3-4 rows run), 2 rows 97-113 against 168-183 (and 139-155 with 2 panels of half width).
template <typename XT, int R, int NP, bool PF>
SRT_TARGET_AVX2 void tile_avx2_r(const XT* xa, int64_t lda, int64_t K, const uint16_t* w, int64_t pstride,
                                 const float* bias, float* c, int64_t ldc, bool more) {
  constexpr int V = R * NP * 4 <= 8 ? 4 : 2;
  const int64_t Kh = K / 2;
  // a panel taken in parts goes in blocks of k, each part in turn over the block (the sums kept in c
  // between blocks), so the later parts read the block from L1 and memory sees one stream
  const int64_t block = V == 4 ? std::max<int64_t>(Kh, 1) : kAvx2PartBlock;
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t kb = 0; kb == 0 || kb < Kh; kb += block)
  for (int part = 0; part < 4 / V; ++part) {
    const int64_t col0 = part * V * 8, ke = std::min(Kh, kb + block);
    __m256 acc[R][NP][V];
    for (int i = 0; i < R; ++i)
      for (int p = 0; p < NP; ++p)
        for (int v = 0; v < V; ++v) {
          const int64_t j = p * kNR + col0 + v * 8;
          acc[i][p][v] = more || kb > 0 ? _mm256_loadu_ps(c + i * ldc + j)
                         : bias         ? _mm256_loadu_ps(bias + j)
                                        : _mm256_setzero_ps();
        }
    for (int64_t kh = kb; kh < ke; ++kh) {
      if constexpr (PF) {
        if (part == 0) {
          // past the panel's end: the next panel's, or an address never read (a prefetch never faults)
          const char* ahead = reinterpret_cast<const char*>(w + (kh + kAvx2Prefetch) * kNR * 2);
          _mm_prefetch(ahead, _MM_HINT_T0);
          _mm_prefetch(ahead + 64, _MM_HINT_T0);
        }
      }
      if constexpr (R <= 2) {  // x's broadcasts held across the panels (2R + 8 accumulators + 3)
        __m256 x0[R], x1[R];
        for (int i = 0; i < R; ++i) {
          float f0, f1;
          x_pair(xa + i * lda, kh, &f0, &f1);
          x0[i] = _mm256_set1_ps(f0);
          x1[i] = _mm256_set1_ps(f1);
        }
        for (int p = 0; p < NP; ++p) {
          const uint16_t* wp = w + p * pstride + (kh * kNR + col0) * 2;
          for (int v = 0; v < V; ++v) {
            const __m256i pr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + v * 16));
            const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(pr, 16));
            const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(pr, hi));
            for (int i = 0; i < R; ++i)
              acc[i][p][v] = _mm256_fmadd_ps(x1[i], o, _mm256_fmadd_ps(x0[i], e, acc[i][p][v]));
          }
        }
      } else {  // the weights widened first, each row's broadcasts then (2V + 2RV accumulators + 2)
        for (int p = 0; p < NP; ++p) {
          const uint16_t* wp = w + p * pstride + (kh * kNR + col0) * 2;
          __m256 e[V], o[V];
          for (int v = 0; v < V; ++v) {
            const __m256i pr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + v * 16));
            e[v] = _mm256_castsi256_ps(_mm256_slli_epi32(pr, 16));
            o[v] = _mm256_castsi256_ps(_mm256_and_si256(pr, hi));
          }
          for (int i = 0; i < R; ++i) {
            float f0, f1;
            x_pair(xa + i * lda, kh, &f0, &f1);
            const __m256 x0 = _mm256_set1_ps(f0), x1 = _mm256_set1_ps(f1);
            for (int v = 0; v < V; ++v) acc[i][p][v] = _mm256_fmadd_ps(x1, o[v], _mm256_fmadd_ps(x0, e[v], acc[i][p][v]));
          }
        }
      }
    }
    for (int i = 0; i < R; ++i)
      for (int p = 0; p < NP; ++p)
        for (int v = 0; v < V; ++v) _mm256_storeu_ps(c + i * ldc + p * kNR + col0 + v * 8, acc[i][p][v]);
  }
}

constexpr int64_t kPrefetch = 16;  // pairs of k an AVX-512 tile prefetches its panels' streams ahead

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
                                     const float* bias, float* c, int64_t ldc, bool more, const uint16_t* pf,
                                     int64_t pf_lines) {
  const int64_t Kh = K / 2;
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[R][NP][2];
  init_acc512<R, NP>(acc, bias, c, ldc, more);
  const int64_t own_until = pf == nullptr ? Kh - kPrefetch : 0;
  for (int64_t kh = 0; kh < Kh; ++kh) {
    if (kh < pf_lines) _mm_prefetch(reinterpret_cast<const char*>(pf + kh * 32), _MM_HINT_T0);
    if (kh < own_until)
      for (int p = 0; p < NP; ++p) {
        const uint16_t* wp = w + p * pstride + (kh + kPrefetch) * kNR * 2;
        _mm_prefetch(reinterpret_cast<const char*>(wp), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wp + 32), _MM_HINT_T0);
      }
    // a float32 x is broadcast straight from memory (a load, folded into the FMA); a bf16 one is
    // widened in a general register first, each broadcast then a shuffle (the port the FMAs share on
    // Intel cores): bf16_linear hands this path a float32 copy of a bf16 x
    [[maybe_unused]] float f0[R], f1[R];
    if constexpr (!std::is_same_v<XT, float>)
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
        __m512 x0, x1;
        if constexpr (std::is_same_v<XT, float>) {
          x0 = _mm512_set1_ps(xa[i * lda + 2 * kh]);
          x1 = _mm512_set1_ps(xa[i * lda + 2 * kh + 1]);
        } else {
          x0 = _mm512_set1_ps(f0[i]);
          x1 = _mm512_set1_ps(f1[i]);
        }
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
// NP panels at once (see tile_avx512_r), each stream prefetched kPrefetch pairs of k ahead. The
// prefetches of the next block of k (`pf`) and a stream of several panels (1-4 rows) go to L2
// (prefetcht1), where those to L1 held the L1's few miss buffers for a whole trip to memory and
// stalled the tile: on an AMD Zen 4 (2 cores, 32 KiB of L1), Qwen2.5-1.5B's layers, alternated
// processes, 10 / 16 / 32 rows 1.22x / 1.08-1.15x / 1.11x, 1-4 rows 1.03-1.09x, 256 rows equal; a
// stream of one panel (5-8 rows) was slower to L2 and keeps L1.
template <int R, int NP>
SRT_TARGET_AVX512_BF16 void tile_bf16dot_r(const uint16_t* xa, int64_t lda, int64_t K, const uint16_t* w,
                                           int64_t pstride, const float* bias, float* c, int64_t ldc, bool more,
                                           const uint16_t* pf, int64_t pf_lines) {
  const int64_t Kh = K / 2;
  constexpr _mm_hint kOwnHint = NP > 1 ? _MM_HINT_T1 : _MM_HINT_T0;
  __m512 acc[R][NP][2];
  init_acc512<R, NP>(acc, bias, c, ldc, more);
  for (int64_t kh = 0; kh < Kh; ++kh) {
    __m512bh xp[R];
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, xa + i * lda + 2 * kh, sizeof pair);
      xp[i] = (__m512bh)_mm512_set1_epi32(pair);
    }
    if (pf != nullptr && kh < pf_lines) _mm_prefetch(reinterpret_cast<const char*>(pf + kh * 32), _MM_HINT_T1);
    for (int p = 0; p < NP; ++p) {
      const uint16_t* wp = w + p * pstride + kh * kNR * 2;
      if (pf == nullptr && kh + kPrefetch < Kh) {
        _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetch * kNR * 2), kOwnHint);
        _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetch * kNR * 2 + 32), kOwnHint);
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

// Panels a tile of R rows takes at once: enough chains to hide the loads' and the FMAs' latency at a
// few rows, within the vector registers (32 on the AVX-512 paths, 16 on AVX2).
inline int panels_at_once(Bf16Path path, int R) {
  if (path == Bf16Path::kAvx2) return R == 1 ? 2 : 1;  // 8 accumulators (tile_avx2_r)
  if (path != Bf16Path::kAvx512 && path != Bf16Path::kAvx512Bf16) return 1;
  return R <= 2 ? 4 : R <= 4 ? 2 : 1;
}

// R rows x np panels (pstride elements apart): c[i][p * 32 + j], rows ldc apart. `pf`: the bf16 dot
// tiles prefetch pf_lines cache lines from pf (one a pair of k) instead of their own stream ahead
// (blocks of k: the next block, while this one is in cache). `stream`: the tile is the first over its
// panels, so it reads them from memory (an AVX2 tile of 2 rows prefetches ahead then: kAvx2Prefetch)
template <typename XT>
void run_tile(Bf16Path path, int R, int np, const XT* xa, int64_t lda, int64_t K, const uint16_t* w, int64_t pstride,
              const float* bias, float* c, int64_t ldc, bool more, const uint16_t* pf = nullptr,
              int64_t pf_lines = 0, bool stream = false) {
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
        tile_avx512_r<XT, decltype(r)::value, decltype(n)::value>(xa, lda, K, w, pstride, bias, c, ldc, more, pf,
                                                                   pf_lines);
      });
    });
  }
#endif
#if SRT_CPU_X86
  if (path == Bf16Path::kAvx2) {
    return with_rows<kMR2>(R, [&](auto r) {
      with_panels(np, [&](auto n) {
        constexpr int RR = decltype(r)::value, NN = decltype(n)::value;
        if constexpr (NN == 1 && RR == 2) {
          if (stream) return tile_avx2_r<XT, RR, NN, true>(xa, lda, K, w, pstride, bias, c, ldc, more);
        }
        tile_avx2_r<XT, RR, NN, false>(xa, lda, K, w, pstride, bias, c, ldc, more);
      });
    });
  }
#endif
  for (int p = 0; p < np; ++p)
    tile_scalar<XT>(R, xa, lda, K, w + p * pstride, bias ? bias + p * kNR : nullptr, c + p * kNR, ldc, more);
}

int tile_rows(Bf16Path path) {
  return (path == Bf16Path::kAvx512 || path == Bf16Path::kAvx512Bf16) ? kMR512 : kMR2;
}

// The path of an op (`op` names it in errors) for `requested` ("" picks: the bf16 dot products for a
// bf16 x where the CPU has them, brgemm from `brgemm_rows` rows, the widened weights from
// kSlowDotRows rows where the dot products are slow; else the weights widened to float32 on the
// best ISA); the paths above `best` (brgemm where allowed, else avx512_bf16) refused.
inline Bf16Path pick_path(const char* op, c10::string_view requested, bool x_bf16, int64_t M, int64_t brgemm_rows,
                          bool brgemm_allowed) {
  const CpuIsa isa = detect_isa();
  const bool dot = cpu_has_avx512_bf16();
  const Bf16Path widened =
      isa == CpuIsa::kAvx512 ? Bf16Path::kAvx512 : isa == CpuIsa::kAvx2 ? Bf16Path::kAvx2 : Bf16Path::kScalar;
  if (requested.empty()) {
    if (!x_bf16 || !dot) return widened;
    if (brgemm_allowed && M >= brgemm_rows) return Bf16Path::kBrgemm;
    return !cpu_bf16_dot_fast() && M >= kSlowDotRows ? widened : Bf16Path::kAvx512Bf16;
  }
  const std::string name(requested);
  const Bf16Path top = brgemm_allowed ? Bf16Path::kBrgemm : Bf16Path::kAvx512Bf16;
  for (Bf16Path p : {Bf16Path::kScalar, Bf16Path::kAvx2, Bf16Path::kAvx512, Bf16Path::kAvx512Bf16,
                     Bf16Path::kBrgemm}) {
    if (name != path_name(p) || p > top) continue;
    const Bf16Path best = dot ? top : widened;  // the paths run in this enum's order
    TORCH_CHECK(p <= best, op, ": isa '", name, "' is not available on this CPU (it runs up to '",
                path_name(best), "')");
    TORCH_CHECK(p < Bf16Path::kAvx512Bf16 || x_bf16, op, ": isa '", name, "' takes a bf16 x");
    return p;
  }
  TORCH_CHECK(false, op, ": isa must be '', 'scalar', 'avx2', 'avx512', 'avx512_bf16'",
              brgemm_allowed ? " or 'brgemm'" : "", ", got '", name, "'");
}

// c [R, ldc] float32 -> out rows (columns < cols), in out's dtype
template <typename OT>
inline void store_tile(int R, const float* c, int64_t cols, int64_t ldc, OT* out, int64_t ldo) {
  if constexpr (std::is_same_v<OT, at::BFloat16>) {
    for (int i = 0; i < R; ++i) store_row(c + i * ldc, nullptr, cols, out + i * ldo);
    return;
  }
  for (int i = 0; i < R; ++i)
    for (int64_t j = 0; j < cols; ++j) out[i * ldo + j] = static_cast<OT>(c[i * ldc + j]);
}

}  // namespace
}  // namespace srt_cpu

// Q4_0 and Q4_1 weights in the x8 layout (gguf_x8.h) against float32 activations through integer
// dot products: gguf_linear_x8's path for decode batches (below x8_a24_rows() input rows, up to its
// GEMM) on CPUs with AVX-512 VNNI and VBMI (Ice Lake, Sapphire Rapids on; Zen 4 on). These are the
// types of W4A16 checkpoints (quantized_checkpoint.py) and of the default model.
//
// Numerics: those of gguf_a24.cpp. Each block of 32 activations is V u with V in 24-bit fixed
// point as three signed byte planes (gguf_a24_split.h). For a weight row's block (nibbles n, scale
// d; Q4_1 also m) the integer sum
//
//   S = sum (n - 8) V = 2^16 dot(n, hi) + 2^8 dot(n, mid) + dot(n, lo) - 8 sum V
//
// is exact in int32 (|S| <= 32 * 8 * 127 * 2^16 < 2^31; the shifted partial sums may wrap, which
// cancels in two's complement), converted once and scaled in float32:
//   Q4_0 (w = d (n - 8)):  acc += float(S) * (d u)
//   Q4_1 (w = d n + m = d (n - 8) + (8 d + m)):  acc += float(S) * (d u) + (8 d + m) * sum(x)
// with sum(x) the block's float sum. Against dot_pair (codes widened to floats, one FMA a weight)
// the error is of the same size, a few 2^-24 of the block's largest product; the float32 sums run
// in another order, so the bits differ.
//
// Layout at work: two x8 groups (16 weight rows) per 16 int32 lanes, lane = row. For each quarter
// t of a block, the 32 code bytes of each group (bytes 8 j + r for j = 4t .. 4t + 3) are loaded
// side by side and one byte permutation (vpermb, AVX-512 VBMI) gives each lane its row's 4 bytes;
// low nibbles are weights 4t .. 4t + 3, high ones 4t + 16 .. 4t + 19, so each of the 8 code
// vectors of a block meets one broadcast quad of each activation plane: 24 vpdpbusd per block,
// 16 rows and activation row, instead of dot_pair's 32 conversions and 32 FMAs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>

#include "cpu_ops.h"
#include "gguf_a24_split.h"
#include "gguf_x8.h"

namespace srt_cpu {
namespace {

#if SRT_CPU_X86
#define SRT_TARGET_X8A24 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")))

constexpr int kMaxRows = 4;  // activation rows per call of the tile

bool cpu_has_path() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return q8act::vnni::supported() && __builtin_cpu_supports("avx512vbmi");
  }();
  return ok;
}

// vpermb's indices: lane L (row L % 8 of group L / 8) takes bytes c = 0 .. 3 (j = 4t + c) of its row
constexpr std::array<uint8_t, 64> kRowQuads = [] {
  std::array<uint8_t, 64> idx{};
  for (int lane = 0; lane < 16; ++lane)
    for (int c = 0; c < 4; ++c) idx[4 * lane + c] = static_cast<uint8_t>(32 * (lane / 8) + 8 * c + lane % 8);
  return idx;
}();

SRT_TARGET_X8A24 inline __m512i quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// out[i * ldo + r] (+ bias[r]) for r < valid, activation rows i0 .. i0 + MR - 1, the 16 rows of
// groups g0 (lanes 0-7) and g1 (8-15)
template <int QTYPE, int MR>
SRT_TARGET_X8A24 void dot_pair_a24(const uint8_t* g0, const uint8_t* g1, const a24::A24& a, int64_t i0, float* out,
                                   int64_t ldo, const float* bias, int64_t valid) {
  constexpr bool kMin = QTYPE == kGgmlQ4_1;
  constexpr int kHeader = kMin ? 4 : 2, kRec = 8 * (kHeader + 16);
  const __m512i perm = _mm512_loadu_si512(kRowQuads.data());
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MR];
  const int8_t* xp[MR];
  for (int i = 0; i < MR; ++i) {
    acc[i] = _mm512_setzero_ps();
    xp[i] = a.plane(i0 + i, 0);
  }
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* r0 = g0 + b * kRec;
    const uint8_t* r1 = g1 + b * kRec;
    const __m512 d = x8::half16(r0, r1);
    __m512i lo[4], hi[4];
    for (int t = 0; t < 4; ++t) {
      const __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 8 * kHeader + 32 * t));
      const __m256i c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + 8 * kHeader + 32 * t));
      const __m512i v = _mm512_permutexvar_epi8(perm, _mm512_inserti64x4(_mm512_castsi256_si512(c0), c1, 1));
      lo[t] = _mm512_and_si512(v, m4);
      hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    __m512 offset = _mm512_setzero_ps();  // Q4_1: 8 d + m
    if constexpr (kMin) offset = _mm512_fmadd_ps(d, _mm512_set1_ps(8.f), x8::half16(r0 + 16, r1 + 16));
    for (int i = 0; i < MR; ++i) {
      __m512i plane[3];
      for (int p = 0; p < 3; ++p) {
        const int8_t* q = xp[i] + p * a.ld + b * a24::kBlock;
        __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
        for (int t = 0; t < 4; ++t) {
          even = _mm512_dpbusd_epi32(even, lo[t], quad(q + 4 * t));
          odd = _mm512_dpbusd_epi32(odd, hi[t], quad(q + 16 + 4 * t));
        }
        plane[p] = _mm512_add_epi32(even, odd);
      }
      const int64_t xb = (i0 + i) * a.nb + b;
      __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(_mm512_slli_epi32(plane[0], 8), plane[1]), 8),
                                   plane[2]);
      s = _mm512_sub_epi32(s, _mm512_set1_epi32(8 * a.vsum[xb]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(a.u[xb])), acc[i]);
      if constexpr (kMin) acc[i] = _mm512_fmadd_ps(offset, _mm512_set1_ps(a.s[xb]), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc[i]);
    for (int64_t r = 0; r < valid; ++r) out[i * ldo + r] = lanes[r] + (bias != nullptr ? bias[r] : 0.f);
  }
}

using PairFn = void (*)(const uint8_t*, const uint8_t*, const a24::A24&, int64_t, float*, int64_t, const float*,
                        int64_t);

template <int QTYPE>
constexpr std::array<PairFn, kMaxRows> kPairs = {&dot_pair_a24<QTYPE, 1>, &dot_pair_a24<QTYPE, 2>,
                                                 &dot_pair_a24<QTYPE, 3>, &dot_pair_a24<QTYPE, 4>};
#endif  // SRT_CPU_X86

}  // namespace

// below this many input rows gguf_linear_x8 takes this path where it runs (SRT_GGUF_X8_A24_M
// overrides it). On an Intel Xeon with AMX (2 cores), weights from DRAM, ms, this path vs the float32
// lanes (dot_pair): 11008 x 4096 Q4_0 1 row 1.27 vs 2.01, 2 rows 1.47 vs 2.92, 4 rows 1.75 vs 3.38,
// 8 rows 3.44 vs 4.18, 12 rows 4.65 vs 5.72; 4096 x 4096 Q4_1 8 rows 1.34 vs 1.36. From 13 rows the
// GEMM on dequantized tiles runs either way.
int64_t x8_a24_rows() {
  static const int64_t limit = [] {
    const char* env = std::getenv("SRT_GGUF_X8_A24_M");
    return env != nullptr ? std::max<int64_t>(0, std::atoll(env)) : int64_t{13};
  }();
  return limit;
}

bool x8_a24_takes(int64_t qtype) {
#if SRT_CPU_X86
  if (qtype != kGgmlQ4_0 && qtype != kGgmlQ4_1) return false;
  static const bool enabled = [] {
    const char* env = std::getenv("SRT_GGUF_A24");
    return detect_isa() == CpuIsa::kAvx512 && cpu_has_path() && !(env != nullptr && std::strcmp(env, "0") == 0);
  }();
  return enabled;
#else
  (void)qtype;
  return false;
#endif
}

void x8_linear_a24(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* packed, int64_t groups,
                   int64_t qtype, const float* bias, float* out, int64_t N) {
#if SRT_CPU_X86
  TORCH_CHECK(x8_a24_takes(qtype), "x8_linear_a24: not on this CPU or for ggml type ", qtype);
  const a24::A24 a = a24::split_x(x, ldx, M, K, a24::Split::kX8);
  const int64_t gbytes = x8::kRows * (K / x8::kBlock) * x8::layout(qtype)->type_size();
  const std::array<PairFn, kMaxRows>& fns = qtype == kGgmlQ4_0 ? kPairs<kGgmlQ4_0> : kPairs<kGgmlQ4_1>;
  const int64_t pairs = (groups + 1) / 2;
  at::parallel_for(0, pairs, std::max<int64_t>(1, 64 * 1024 / (2 * gbytes)), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t g = 2 * p, n = g * x8::kRows;
      // an odd last group is its own pair partner; only its 8 rows are stored
      const uint8_t* g0 = packed + g * gbytes;
      const uint8_t* g1 = g + 1 < groups ? g0 + gbytes : g0;
      const int64_t valid = std::min<int64_t>(2 * x8::kRows, N - n);
      for (int64_t i = 0; i < M; i += kMaxRows) {
        const int64_t m = std::min<int64_t>(kMaxRows, M - i);
        fns[m - 1](g0, g1, a, i, out + i * N + n, N, bias != nullptr ? bias + n : nullptr, valid);
      }
    }
  });
#else
  (void)x, (void)ldx, (void)M, (void)K, (void)packed, (void)groups, (void)qtype, (void)bias, (void)out, (void)N;
  TORCH_CHECK(false, "x8_linear_a24: needs an x86-64 CPU");
#endif
}

}  // namespace srt_cpu

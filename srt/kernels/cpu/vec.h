// Vector types for the CPU kernels: one struct per instruction set, same interface.
//
//   reg       register type (W float32 lanes)
//   zero / set1 / load / store / add / sub / mul / div / max / fmadd     lane-wise float32
//   load_f16 / load_bf16    W KV-cache elements (raw 16-bit storage) -> W float32 lanes
//   round_bf16              each lane rounded to bf16 (nearest even, NaN a quiet NaN), as float32
//   store_bf16              W lanes rounded to bf16, as raw 16-bit storage (torch's conversion)
//   hsum / hmax             horizontal reductions
//   reduce_tile(a[W])       one register of the W sums: lane t = hsum(a[t])
//   reduce_store_tq(a[TQ], out)   out[t] = hsum(a[t]) for the TQ-token tiles of several queries
//   exp                     lane-wise e^x, exactly 0 for x < -88 (so -inf -> 0)
//
// Every member of VecAvx2 / VecAvx512 carries a function-level target attribute: this file
// compiles for any x86-64 (no -mavx2 / -march flags), and the caller selects a struct at run
// time (detect_isa() below), so no instruction the CPU lacks ever runs.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#define SRT_CPU_X86 1
#else
#define SRT_CPU_X86 0
#endif

namespace srt_cpu {

// The vector paths, narrowest first. Every AVX-512F CPU also has AVX2, FMA and F16C, and so does
// every AVX2 CPU that has FMA.
enum class CpuIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

inline const char* isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

// "scalar" / "avx2" / "avx512" -> that ISA; false for anything else
inline bool parse_isa(const char* name, CpuIsa* out) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (std::strcmp(name, isa_name(isa)) == 0) {
      *out = isa;
      return true;
    }
  }
  return false;
}

// The widest vector path this CPU (and OS) supports, detected once.
inline CpuIsa hardware_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  static const CpuIsa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return CpuIsa::kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuIsa::kAvx2;
    return CpuIsa::kScalar;
  }();
  return isa;
#else
  return CpuIsa::kScalar;
#endif
}

// AMX features as CPUID leaf 7 reports them in EDX (AMX-BF16 bit 22, AMX-TILE 24, AMX-INT8 25),
// read once: true when the CPU has every one of `features`. What the CPU reports only; whether the
// OS lets this process use the tiles is checked where they are used (oneDNN asks the kernel for
// the tile state, and the Python side probes the tiles in a child process).
enum AmxFeature : unsigned { kAmxBf16 = 1u << 22, kAmxTile = 1u << 24, kAmxInt8 = 1u << 25 };

inline bool cpu_has_amx(unsigned features) {
#if SRT_CPU_X86
  static const unsigned edx = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) ? d : 0u;
  }();
  return (edx & features) == features;
#else
  (void)features;
  return false;
#endif
}

// The environment variable that lowers the ISA every op runs (tests use it to run the AVX2 and
// scalar paths on any CPU); it never raises it above hardware_isa().
#define SRT_CPU_ISA_ENV "SRT_CPU_ISA"

// The ISA every native op runs: hardware_isa(), capped by SRT_CPU_ISA ("scalar", "avx2" or
// "avx512"; unset or empty: no cap). Read once, at the first call; the Python loader makes that
// call at load time (and rejects a bad value there first), so an invalid value is reported
// before any op runs. THE one place an op learns the CPU's ISA from.
inline CpuIsa detect_isa() {
  static const CpuIsa isa = [] {
    const CpuIsa hw = hardware_isa();
    const char* env = std::getenv(SRT_CPU_ISA_ENV);
    if (env == nullptr || env[0] == '\0') return hw;
    CpuIsa cap = hw;
    TORCH_CHECK(parse_isa(env, &cap), SRT_CPU_ISA_ENV " must be 'scalar', 'avx2' or 'avx512' (or unset), got '", env,
                "'");
    return static_cast<int>(cap) < static_cast<int>(hw) ? cap : hw;
  }();
  return isa;
}

inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float32 -> bf16 bits, rounded to nearest even; NaN -> 0x7FC0 (c10::BFloat16's conversion)
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct VecScalar {
  using reg = float;
  static inline reg round_bf16(reg v) { return bf16_bits_to_float(float_to_bf16_bits(v)); }
  static inline void store_bf16(uint16_t* p, reg v) { *p = float_to_bf16_bits(v); }
  static constexpr int W = 1;
  static inline reg zero() { return 0.f; }
  static inline reg set1(float x) { return x; }
  static inline reg load(const float* p) { return *p; }
  static inline reg load_f16(const uint16_t* p) { return c10::detail::fp16_ieee_to_fp32_value(*p); }
  static inline reg load_bf16(const uint16_t* p) { return bf16_bits_to_float(*p); }
  static inline void store(float* p, reg v) { *p = v; }
  static inline reg add(reg a, reg b) { return a + b; }
  static inline reg sub(reg a, reg b) { return a - b; }
  static inline reg div(reg a, reg b) { return a / b; }
  static inline reg mul(reg a, reg b) { return a * b; }
  static inline reg max(reg a, reg b) { return a > b ? a : b; }
  static inline reg fmadd(reg a, reg b, reg c) { return a * b + c; }
  static inline float hsum(reg v) { return v; }
  static inline float hmax(reg v) { return v; }
  static inline reg reduce_tile(const reg* a) { return a[0]; }
  static constexpr int TQ = 4;
  static inline void reduce_store_tq(const reg* a, float* out) {
    for (int t = 0; t < TQ; ++t) out[t] = a[t];
  }
  static inline reg exp(reg x) { return x < -88.f ? 0.f : std::exp(x); }  // NaN -> NaN
};

#if SRT_CPU_X86

#define SRT_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
// every AVX-512F CPU also has AVX2, FMA and F16C (the 256-bit helpers below use them)
#define SRT_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define SRT_INLINE_AVX2 SRT_TARGET_AVX2 __attribute__((always_inline)) inline
#define SRT_INLINE_AVX512 SRT_TARGET_AVX512 __attribute__((always_inline)) inline

// exp: Cephes-style range reduction x = n ln2 + r, |r| <= ln2 / 2, degree-5 polynomial for
// e^r, 2^n through the exponent bits. Relative error about 1e-7 over [-88, 88].
#define SRT_EXP_CONSTANTS                                   \
  constexpr float kExpHi = 88.3762626647949f;               \
  constexpr float kExpLo = -88.0f;                          \
  constexpr float kLog2e = 1.44269504088896341f;            \
  constexpr float kLn2Hi = 0.693359375f;                    \
  constexpr float kLn2Lo = -2.12194440e-4f;                 \
  constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f; \
  constexpr float kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

struct VecAvx2 {
  using reg = __m256;
  static constexpr int W = 8;
  static SRT_INLINE_AVX2 reg zero() { return _mm256_setzero_ps(); }
  static SRT_INLINE_AVX2 reg set1(float x) { return _mm256_set1_ps(x); }
  static SRT_INLINE_AVX2 reg load(const float* p) { return _mm256_loadu_ps(p); }
  static SRT_INLINE_AVX2 reg load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static SRT_INLINE_AVX2 reg load_bf16(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static SRT_INLINE_AVX2 void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static SRT_INLINE_AVX2 reg round_bf16(reg v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
  }
  static SRT_INLINE_AVX2 void store_bf16(uint16_t* p, reg v) {
    const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
  static SRT_INLINE_AVX2 reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static SRT_INLINE_AVX2 reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static SRT_INLINE_AVX2 reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  static SRT_INLINE_AVX2 reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static SRT_INLINE_AVX2 reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static SRT_INLINE_AVX2 reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static SRT_INLINE_AVX2 float hsum(reg v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static SRT_INLINE_AVX2 float hmax(reg v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static SRT_INLINE_AVX2 reg reduce_tile(const reg* a) {
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    // s0 = [a0..a3 partial (low 128) | a0..a3 partial (high 128)], likewise s1 for a4..a7
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
  }
  static constexpr int TQ = 4;
  static SRT_INLINE_AVX2 void reduce_store_tq(const reg* a, float* out) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
  }
  static SRT_INLINE_AVX2 reg exp(reg x0) {
    SRT_EXP_CONSTANTS
    __m256 x = _mm256_max_ps(_mm256_min_ps(x0, _mm256_set1_ps(kExpHi)), _mm256_set1_ps(kExpLo));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), x);
    __m256 y = _mm256_set1_ps(kP0);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP1));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP2));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP3));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP4));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP5));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    // x0 < kExpLo (-inf included) -> exactly 0; NaN stays NaN
    y = _mm256_andnot_ps(_mm256_cmp_ps(x0, _mm256_set1_ps(kExpLo), _CMP_LT_OQ), y);
    return _mm256_or_ps(y, _mm256_cmp_ps(x0, x0, _CMP_UNORD_Q));
  }
};

struct VecAvx512 {
  using reg = __m512;
  static constexpr int W = 16;
  static SRT_INLINE_AVX512 reg zero() { return _mm512_setzero_ps(); }
  static SRT_INLINE_AVX512 reg set1(float x) { return _mm512_set1_ps(x); }
  static SRT_INLINE_AVX512 reg load(const float* p) { return _mm512_loadu_ps(p); }
  static SRT_INLINE_AVX512 reg load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static SRT_INLINE_AVX512 reg load_bf16(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static SRT_INLINE_AVX512 void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static SRT_INLINE_AVX512 reg round_bf16(reg v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
    return _mm512_castsi512_ps(r);
  }
  static SRT_INLINE_AVX512 void store_bf16(uint16_t* p, reg v) {
    const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static SRT_INLINE_AVX512 reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static SRT_INLINE_AVX512 reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static SRT_INLINE_AVX512 reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  static SRT_INLINE_AVX512 reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static SRT_INLINE_AVX512 reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static SRT_INLINE_AVX512 reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static SRT_INLINE_AVX512 float hsum(reg v) { return _mm512_reduce_add_ps(v); }
  static SRT_INLINE_AVX512 float hmax(reg v) { return _mm512_reduce_max_ps(v); }
  static SRT_INLINE_AVX512 reg reduce_tile(const reg* a) {
    __m256 h[16];
    for (int t = 0; t < 16; ++t) {
      h[t] = _mm256_add_ps(_mm512_castps512_ps256(a[t]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[t]), 1)));
    }
    const __m256 lo = VecAvx2::reduce_tile(h), hi = VecAvx2::reduce_tile(h + 8);
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
  }
  static constexpr int TQ = 8;
  static SRT_INLINE_AVX512 void reduce_store_tq(const reg* a, float* out) {
    __m256 h[8];
    for (int t = 0; t < 8; ++t) {
      h[t] = _mm256_add_ps(_mm512_castps512_ps256(a[t]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[t]), 1)));
    }
    _mm256_storeu_ps(out, VecAvx2::reduce_tile(h));
  }
  static SRT_INLINE_AVX512 reg exp(reg x0) {
    SRT_EXP_CONSTANTS
    __m512 x = _mm512_max_ps(_mm512_min_ps(x0, _mm512_set1_ps(kExpHi)), _mm512_set1_ps(kExpLo));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), x);
    __m512 y = _mm512_set1_ps(kP0);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP1));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP2));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP3));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP4));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP5));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
    // x0 < kExpLo (-inf included) -> exactly 0; NaN stays NaN
    y = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x0, _mm512_set1_ps(kExpLo), _CMP_NLT_UQ), y);
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q), x0);
  }
};

// one row of float32 values (plus bias where there is one) rounded to bf16 16 at a time, torch's
// rounding (nearest even, NaN a quiet NaN): the scalar conversion had cost a brgemm of 512 rows
// about a fifth of its time
SRT_TARGET_AVX512 inline void store_row_bf16_avx512(const float* c, const float* bias, int64_t cols,
                                                     c10::BFloat16* out) {
  int64_t j = 0;
  for (; j + 16 <= cols; j += 16) {
    __m512 v = _mm512_loadu_ps(c + j);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
    VecAvx512::store_bf16(reinterpret_cast<uint16_t*>(out + j), v);
  }
  for (; j < cols; ++j) out[j] = static_cast<c10::BFloat16>(bias != nullptr ? c[j] + bias[j] : c[j]);
}

#endif  // SRT_CPU_X86

// one row: out[j] = c[j] (+ bias[j] where bias is given) for j < cols, in out's dtype (float32, or
// bf16 rounded as torch rounds)
template <typename OT>
inline void store_row(const float* c, const float* bias, int64_t cols, OT* out) {
#if SRT_CPU_X86
  if constexpr (std::is_same_v<OT, c10::BFloat16>) {
    if (detect_isa() == CpuIsa::kAvx512) return store_row_bf16_avx512(c, bias, cols, out);
  }
#endif
  for (int64_t j = 0; j < cols; ++j) out[j] = static_cast<OT>(bias != nullptr ? c[j] + bias[j] : c[j]);
}

}  // namespace srt_cpu

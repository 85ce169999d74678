// GGUF matmuls on int8-quantized activations, AVX-512 VNNI row functions for the K-quants Q4_K and
// Q6_K (the types of llama.cpp's Q4_K_M mix). Same numerics and contract as the AVX2 functions of
// gguf_q8act_rows.h (the activation blocks of 32, the terms of each sum, float32 scaling), only
// the integer products and the float32 summation order differ in how they are grouped:
//
//   _mm512_dpbusd_epi32 multiplies 64 unsigned weight codes by 64 signed activation codes and adds
//   each 4 consecutive products into one of 16 int32 lanes (exact: no saturation, |sum| < 2^31).
//   Q4_K: 64 codes = two sub-blocks of 32 (lanes 0-7 the low nibbles of qs[32 j ..], sub-block
//   2j; lanes 8-15 the high nibbles, sub-block 2j + 1), which line up with activation blocks 2j
//   and 2j + 1 (64 consecutive activation codes); each lane's int32 sum is converted and FMA'd
//   with its sub-block's ((d sc) dx); the minimum terms -(dmin m) s fill lanes 0-7 once per
//   super-block.
//   Q6_K: 64 codes = four groups of 16 (4 lanes each); codes in 0..63, and 32 times the
//   activation sums (one dpbusd of 32s per activation row and chunk, shared by the weight rows)
//   start each lane's sum negative; the scale of group g is ((d sc_g) dx_{g / 2}).
//
// Tiles of R <= 4 weight rows and MX <= 4 activation rows (the AVX2 functions take 2): each weight
// row's codes and scales are decoded once for all MX activation rows, the activation codes read
// from L1 by the dot instructions themselves. About half the instructions of the AVX2 tiles per
// weight and activation row.
#pragma once

#include <cstring>
#include <vector>

#include "gguf_q8act_rows.h"

#if SRT_CPU_X86

#define SRT_TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))
#define SRT_INLINE_VNNI SRT_TARGET_VNNI __attribute__((always_inline)) inline

namespace srt_cpu {
namespace q8act {
namespace vnni {

constexpr int kXRows = 4;  // activation rows per tile

// Whether this CPU runs these functions (AVX-512 with VNNI and BW); detected once.
inline bool supported() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }();
  return ok;
}

// lanes 0-7 take element A of v, lanes 8-15 element B
SRT_INLINE_VNNI __m512 pair_bcast(__m512 v, int a, int b) {
  const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(a)), _mm256_set1_epi32(b), 1);
  return _mm512_permutexvar_ps(idx, v);
}

// 8 floats in lanes 0-7, zeros above
SRT_INLINE_VNNI __m512 low8(__m256 v) { return _mm512_insertf32x8(_mm512_setzero_ps(), v, 0); }

// a tile's R x MX float accumulators: zeroed, and at the end each one's lane sum to out[i * ldo + r]
template <int R, int MX>
struct TileSums {
  __m512 acc[R][MX];
  SRT_INLINE_VNNI TileSums() {
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < MX; ++i) acc[r][i] = _mm512_setzero_ps();
  }
  SRT_INLINE_VNNI void store(float* out, int64_t ldo) const {
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < MX; ++i) out[i * ldo + r] = _mm512_reduce_add_ps(acc[r][i]);
  }
};

template <int MX, int R>
SRT_TARGET_VNNI void dot_q4k(const uint8_t* w, int64_t ldw, const Acts& a, int64_t i0, float* out, int64_t ldo) {
  constexpr int TS = kquant::kQ4KBytes;
  TileSums<R, MX> sums;
  auto& acc = sums.acc;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int64_t sb = 0; sb < a.k / kquant::kQK; ++sb) {
    avx2::prefetch_ahead<R * TS>(w + avx2::kPrefetchGroups * R * ldw + sb * (R * TS));
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * ldw + sb * TS;
      __m256 vds, vdm;  // d * sc[s], dmin * m[s]
      kquant::avx2::scales_q45k(blk, &vds, &vdm);
      __m512i codes[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * j)));
        codes[j] = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4), m4);
      }
      for (int i = 0; i < MX; ++i) {
        const int64_t x0 = (i0 + i) * a.nb + sb * 8;
        const int8_t* xq = a.q + (i0 + i) * a.k + sb * kquant::kQK;
        const __m512 scl = low8(_mm256_mul_ps(vds, _mm256_loadu_ps(a.d + x0)));  // (d sc[s]) dx[s]
        acc[r][i] = _mm512_fnmadd_ps(low8(vdm), low8(_mm256_loadu_ps(a.s + x0)), acc[r][i]);
        for (int j = 0; j < 4; ++j) {
          const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[j], _mm512_loadu_si512(xq + 64 * j));
          acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), pair_bcast(scl, 2 * j, 2 * j + 1), acc[r][i]);
        }
      }
    }
  }
  sums.store(out, ldo);
}

// the 64 codes (0..63) of chunk C (weights 64 C .. 64 C + 63) of a Q6_K block
template <int C>
SRT_INLINE_VNNI __m512i codes_q6k(const uint8_t* blk) {
  constexpr int H = C / 2;  // the half of 128 weights
  const __m512i ql = _mm512_loadu_si512(blk + 64 * H);
  __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * H)));
  // weights 0-31 of the chunk take qh bits (4 (C % 2)) + 0..1, weights 32-63 bits + 2..3
  if constexpr (C % 2) qh = _mm512_srli_epi16(qh, 4);
  qh = _mm512_and_si512(_mm512_mask_srli_epi16(qh, 0xFFFF0000u, qh, 2), _mm512_set1_epi8(0x03));
  const __m512i lo = C % 2 ? _mm512_srli_epi16(ql, 4) : ql;
  return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi8(0x0F)), _mm512_slli_epi16(qh, 4));
}

// d * sc_g of a Q6_K block's 16 groups
SRT_INLINE_VNNI __m512 q6k_scales(const uint8_t* blk) {
  return _mm512_mul_ps(
      _mm512_set1_ps(kquant::fp16_at(blk + 208)),
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)))));
}

// lanes 4q .. 4q + 3 take element 4 C + q of v
template <int C>
SRT_INLINE_VNNI __m512 quad_bcast(__m512 v) {
  const __m512i idx = _mm512_setr_epi32(4 * C, 4 * C, 4 * C, 4 * C, 4 * C + 1, 4 * C + 1, 4 * C + 1, 4 * C + 1,
                                        4 * C + 2, 4 * C + 2, 4 * C + 2, 4 * C + 2, 4 * C + 3, 4 * C + 3, 4 * C + 3,
                                        4 * C + 3);
  return _mm512_permutexvar_ps(idx, v);
}

template <int MX, int R, int C>
SRT_INLINE_VNNI void q6k_chunk(const uint8_t* blk, const int8_t* const* xq, const __m512i (*neg32)[4],
                               const __m512* gscale, __m512* acc) {
  const __m512i q = codes_q6k<C>(blk);
  for (int i = 0; i < MX; ++i) {
    const __m512i p = _mm512_dpbusd_epi32(neg32[i][C], q, _mm512_loadu_si512(xq[i] + 64 * C));
    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), quad_bcast<C>(gscale[i]), acc[i]);
  }
}

template <int MX, int R>
SRT_TARGET_VNNI void dot_q6k(const uint8_t* w, int64_t ldw, const Acts& a, int64_t i0, float* out, int64_t ldo) {
  constexpr int TS = kquant::kQ6KBytes;
  TileSums<R, MX> sums;
  auto& acc = sums.acc;
  const __m512i k32 = _mm512_set1_epi8(32);
  // group g of 16 codes lies in activation block g / 2
  const __m512i half = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  for (int64_t sb = 0; sb < a.k / kquant::kQK; ++sb) {
    avx2::prefetch_ahead<R * TS>(w + avx2::kPrefetchGroups * R * ldw + sb * (R * TS));
    const int8_t* xq[MX];
    __m512i neg32[MX][4];
    __m512 dx[MX];
    for (int i = 0; i < MX; ++i) {
      xq[i] = a.q + (i0 + i) * a.k + sb * kquant::kQK;
      for (int c = 0; c < 4; ++c) {
        const __m512i x = _mm512_loadu_si512(xq[i] + 64 * c);
        neg32[i][c] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), k32, x));
      }
      dx[i] = _mm512_permutexvar_ps(half, low8(_mm256_loadu_ps(a.d + (i0 + i) * a.nb + sb * 8)));
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * ldw + sb * TS;
      const __m512 dsc = q6k_scales(blk);
      __m512 gscale[MX];
      for (int i = 0; i < MX; ++i) gscale[i] = _mm512_mul_ps(dsc, dx[i]);  // (d sc_g) dx_{g / 2}
      q6k_chunk<MX, R, 0>(blk, xq, neg32, gscale, acc[r]);
      q6k_chunk<MX, R, 1>(blk, xq, neg32, gscale, acc[r]);
      q6k_chunk<MX, R, 2>(blk, xq, neg32, gscale, acc[r]);
      q6k_chunk<MX, R, 3>(blk, xq, neg32, gscale, acc[r]);
    }
  }
  sums.store(out, ldo);
}

// ---- many activation rows (prefill): 16 Q4_K weight rows per vector ----
//
// Lane l of every vector is weight row l of a 16-row group: a gather takes the same 4 code bytes
// of the 16 rows (8 gathers per pair of sub-blocks), and each dpbusd adds 4 products of every row
// with 4 codes of one activation row (broadcast from memory), so after 8 of them each lane holds
// one row's whole sub-block sum: one conversion and FMA per sub-block and 16 rows instead of one
// per 4 products. The scales (d sc, dmin m) of the 16 rows are transposed once per super-block
// and group through a small buffer and shared by the XR activation rows of a call. Same terms
// as the other functions (float32 summation order aside).
constexpr int kGemmRows = 16;  // weight rows per call

// The 16 weight rows of a GEMM call (lanes past `rows` read row 0 and are never stored) and the
// activation rows' running sums, [mx][16] floats
struct GemmRows16 {
  alignas(64) int32_t offs[16];
  __m512i vofs;
  std::vector<float>& sums;

  SRT_INLINE_VNNI GemmRows16(int64_t ldw, int64_t rows, int64_t mx) : sums(buffer()) {
    for (int l = 0; l < 16; ++l) offs[l] = static_cast<int32_t>((l < rows ? l : 0) * ldw);
    vofs = _mm512_load_si512(offs);
    sums.assign(static_cast<size_t>(mx * 16), 0.f);
  }
  static std::vector<float>& buffer() {
    thread_local std::vector<float> b;
    return b;
  }
  float* row(int64_t i) { return sums.data() + 16 * i; }  // activation row i's 16 lane sums
  void store(int64_t rows, int64_t mx, float* out, int64_t ldo) const {
    for (int64_t i = 0; i < mx; ++i)
      for (int64_t r = 0; r < rows; ++r) out[i * ldo + r] = sums[16 * i + r];
  }
};

// one activation row's share of a super-block: 4 pairs of sub-blocks, the minimum terms
SRT_INLINE_VNNI __m512 q4k_gemm_row(const __m512i* codes, const float (*dsc)[16], const float (*dmn)[16],
                                    const int8_t* xq, const float* dx, const float* xs, __m512 acc) {
  for (int j = 0; j < 4; ++j) {
    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
    for (int t = 0; t < 8; ++t) {
      int32_t xl, xh;
      std::memcpy(&xl, xq + 64 * j + 4 * t, 4);
      std::memcpy(&xh, xq + 64 * j + 32 + 4 * t, 4);
      lo = _mm512_dpbusd_epi32(lo, _mm512_load_si512(codes + 16 * j + t), _mm512_set1_epi32(xl));
      hi = _mm512_dpbusd_epi32(hi, _mm512_load_si512(codes + 16 * j + 8 + t), _mm512_set1_epi32(xh));
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(_mm512_load_ps(dsc[2 * j]), _mm512_set1_ps(dx[2 * j])),
                          acc);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi),
                          _mm512_mul_ps(_mm512_load_ps(dsc[2 * j + 1]), _mm512_set1_ps(dx[2 * j + 1])), acc);
  }
  for (int s = 0; s < 8; ++s) acc = _mm512_fnmadd_ps(_mm512_load_ps(dmn[s]), _mm512_set1_ps(xs[s]), acc);
  return acc;
}

// out[i * ldo + r] for r < rows <= 16 weight rows (at w, stride ldw) and i < mx activation rows:
// per super-block the 16 rows' codes are gathered and their scales transposed once, into
// buffers, for all mx activation rows (whose sums wait in a buffer of mx x 16 floats)
SRT_TARGET_VNNI inline void q4k_gemm_rows(const uint8_t* w, int64_t ldw, int64_t rows, const Acts& a, int64_t i0,
                                          int64_t mx, float* out, int64_t ldo) {
  GemmRows16 g16(ldw, rows, mx);
  const int32_t* offs = g16.offs;
  const __m512i vofs = g16.vofs;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i tr = _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120);
  alignas(64) float sc_rows[16][8], mn_rows[16][8];  // per row: d sc[s], dmin m[s]
  alignas(64) float dsc[8][16], dmn[8][16];          // the same, per sub-block across the rows
  alignas(64) __m512i codes[64];                     // pair j: 8 low-nibble vectors, 8 high
  for (int64_t sb = 0; sb < a.k / kquant::kQK; ++sb) {
    const uint8_t* base = w + sb * kquant::kQ4KBytes;
    for (int l = 0; l < 16; ++l) {
      __m256 vds, vdm;
      kquant::avx2::scales_q45k(base + offs[l], &vds, &vdm);
      _mm256_store_ps(sc_rows[l], vds);
      _mm256_store_ps(mn_rows[l], vdm);
    }
    for (int s = 0; s < 8; ++s) {
      const __m512i idx = _mm512_add_epi32(tr, _mm512_set1_epi32(s));
      _mm512_store_ps(dsc[s], _mm512_i32gather_ps(idx, &sc_rows[0][0], 4));
      _mm512_store_ps(dmn[s], _mm512_i32gather_ps(idx, &mn_rows[0][0], 4));
    }
    for (int j = 0; j < 4; ++j) {
      for (int t = 0; t < 8; ++t) {
        const __m512i g = _mm512_i32gather_epi32(vofs, base + 16 + 32 * j + 4 * t, 1);
        codes[16 * j + t] = _mm512_and_si512(g, m4);
        codes[16 * j + 8 + t] = _mm512_and_si512(_mm512_srli_epi16(g, 4), m4);
      }
    }
    for (int64_t i = 0; i < mx; ++i) {
      const int64_t row = i0 + i;
      float* acc = g16.row(i);
      _mm512_storeu_ps(acc, q4k_gemm_row(codes, dsc, dmn, a.q + row * a.k + sb * kquant::kQK,
                                         a.d + row * a.nb + sb * 8, a.s + row * a.nb + sb * 8, _mm512_loadu_ps(acc)));
    }
  }
  g16.store(rows, mx, out, ldo);
}

// Q6_K the same way: lane l is weight row l; the codes (q - 32, signed) of 4 weights of the 16
// rows per vector, 64 vectors per super-block; the activation codes go in as the unsigned
// operand, x + 128 (each 4-byte broadcast XORed with 0x80808080), and 128 times each group's
// sum of weight codes, computed once per super-block and group, is taken back off.
SRT_INLINE_VNNI __m512 q6k_gemm_row(const __m512i* codes, const __m512i* wsum128, const float (*dsc)[16],
                                    const int8_t* xq, const float* dx, __m512 acc) {
  for (int g = 0; g < 16; ++g) {
    __m512i p = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      int32_t xv;
      std::memcpy(&xv, xq + 16 * g + 4 * t, 4);
      p = _mm512_dpbusd_epi32(p, _mm512_set1_epi32(xv ^ static_cast<int32_t>(0x80808080u)),
                              _mm512_load_si512(codes + 4 * g + t));
    }
    p = _mm512_sub_epi32(p, _mm512_load_si512(wsum128 + g));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(_mm512_load_ps(dsc[g]), _mm512_set1_ps(dx[g / 2])),
                          acc);
  }
  return acc;
}

SRT_TARGET_VNNI inline void q6k_gemm_rows(const uint8_t* w, int64_t ldw, int64_t rows, const Acts& a, int64_t i0,
                                          int64_t mx, float* out, int64_t ldo) {
  GemmRows16 g16(ldw, rows, mx);
  const int32_t* offs = g16.offs;
  const __m512i vofs = g16.vofs;
  const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03), k32 = _mm512_set1_epi8(32);
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i tr = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  alignas(64) float sc_rows[16][16];  // per row: d sc[g]
  alignas(64) float dsc[16][16];      // per group across the rows
  alignas(64) __m512i codes[64];      // weights 4 v .. 4 v + 3 of the 16 rows: codes[v]
  alignas(64) __m512i wsum128[16];    // 128 * (sum of the group's codes), per row
  for (int64_t sb = 0; sb < a.k / kquant::kQK; ++sb) {
    const uint8_t* base = w + sb * kquant::kQ6KBytes;
    for (int l = 0; l < 16; ++l) {
      const uint8_t* blk = base + offs[l];
      const __m512 d = _mm512_set1_ps(kquant::fp16_at(blk + 208));
      _mm512_store_ps(sc_rows[l], _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192))))));
    }
    for (int g = 0; g < 16; ++g)
      _mm512_store_ps(dsc[g], _mm512_i32gather_ps(_mm512_add_epi32(tr, _mm512_set1_epi32(g)), &sc_rows[0][0], 4));
    for (int h = 0; h < 2; ++h) {
      __m512i qh[8];
      for (int v = 0; v < 8; ++v) qh[v] = _mm512_i32gather_epi32(vofs, base + 128 + 32 * h + 4 * v, 1);
      for (int u = 0; u < 16; ++u) {
        const __m512i ql = _mm512_i32gather_epi32(vofs, base + 64 * h + 4 * u, 1);
        for (int n = 0; n < 2; ++n) {  // nibble n: weights 64 n + 4 u .. of the half
          const int pl = 64 * n + 4 * u;  // position in the half
          const __m512i lo = n ? _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4) : _mm512_and_si512(ql, m4);
          const __m512i hb = _mm512_and_si512(_mm512_srli_epi16(qh[(pl % 32) / 4], 2 * (pl / 32)), m2);
          const __m512i q = _mm512_or_si512(lo, _mm512_slli_epi16(hb, 4));
          codes[(128 * h + pl) / 4] = _mm512_sub_epi8(q, k32);
        }
      }
    }
    for (int g = 0; g < 16; ++g) {  // 128 * sum(q - 32) = sum over 4 vectors of dpbusd(128s, codes)
      __m512i t = _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v) t = _mm512_dpbusd_epi32(t, ones, codes[4 * g + v]);
      wsum128[g] = _mm512_slli_epi32(t, 7);
    }
    for (int64_t i = 0; i < mx; ++i) {
      const int64_t row = i0 + i;
      float* acc = g16.row(i);
      _mm512_storeu_ps(acc, q6k_gemm_row(codes, wsum128, dsc, a.q + row * a.k + sb * kquant::kQK,
                                         a.d + row * a.nb + sb * 8, _mm512_loadu_ps(acc)));
    }
  }
  g16.store(rows, mx, out, ldo);
}

struct Q4KTile {
  template <int MX, int R>
  struct K {
    static SRT_INLINE_VNNI void run(const uint8_t* w, int64_t ldw, const Acts& a, int64_t i0, float* out,
                                    int64_t ldo) {
      dot_q4k<MX, R>(w, ldw, a, i0, out, ldo);
    }
  };
};

struct Q6KTile {
  template <int MX, int R>
  struct K {
    static SRT_INLINE_VNNI void run(const uint8_t* w, int64_t ldw, const Acts& a, int64_t i0, float* out,
                                    int64_t ldo) {
      dot_q6k<MX, R>(w, ldw, a, i0, out, ldo);
    }
  };
};

// the dispatcher of gguf_q8act.cpp: R = 4, or 1 for the last rows of N; MX = 1 .. kXRows
template <class Tile, int R>
SRT_INLINE_VNNI void dot_mx(const uint8_t* w, int64_t ldw, const Acts& a, int64_t i0, int64_t mx, float* out,
                            int64_t ldo) {
  switch (mx) {
    case 4: Tile::template K<4, R>::run(w, ldw, a, i0, out, ldo); break;
    case 3: Tile::template K<3, R>::run(w, ldw, a, i0, out, ldo); break;
    case 2: Tile::template K<2, R>::run(w, ldw, a, i0, out, ldo); break;
    default: Tile::template K<1, R>::run(w, ldw, a, i0, out, ldo); break;
  }
}

template <class Tile>
SRT_TARGET_VNNI void dot_tiles(const uint8_t* w, int64_t ldw, int64_t rows, const Acts& a, int64_t i0, int64_t mx,
                               float* out, int64_t ldo) {
  if (rows == kMaxWRows) {
    dot_mx<Tile, 4>(w, ldw, a, i0, mx, out, ldo);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) dot_mx<Tile, 1>(w + r * ldw, ldw, a, i0, mx, out + r, ldo);
}

}  // namespace vnni
}  // namespace q8act
}  // namespace srt_cpu

#endif  // SRT_CPU_X86

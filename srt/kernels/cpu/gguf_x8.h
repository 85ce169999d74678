// The "x8" layout of the simple GGUF types (Q4_0, Q4_1, Q8_0): the same bytes per weight as the
// file, regrouped once at load so that a decode matmul computes 8 weight rows per vector lane set.
//
// Rows are taken 8 at a time (group g = rows 8g .. 8g + 7; the last group is padded with zero
// rows). For each block b (32 weights) of a group there is one record of 8 x type_size bytes:
//
//   header: for each 2-byte field f of the block header (Q4_0 / Q8_0: d; Q4_1: d, m), the 8 rows'
//           fields side by side: bytes 16 f + 2 r .. 16 f + 2 r + 1 are row r's field f
//   codes:  code byte j of row r at 8 * header_bytes + 8 j + r (Q4_0 / Q4_1: 16 bytes of nibbles
//           per row, byte j holding weights j and j + 16; Q8_0: 32 int8 per row)
//
// A group's records follow each other (block 0, 1, ...), and group g starts at byte g * 8 * bpr
// (bpr = the GGUF row's bytes), so a group streams as one contiguous range. Loading 8 code bytes
// gives one byte per row: one vector of 8 lanes = 8 rows, so a dot product needs no horizontal
// sums, and the scales of 8 rows are one fp16 vector.
//
// dot_group<Type, MR> computes out[i][r] = sum_k w[8g + r][k] * x[i][k] for MR <= 4 input rows:
// per block, sum(q x) per row in float32 FMAs on the codes, then d * that, plus m * sum(x) (Q4_1)
// or minus 8 d * sum(x) (Q4_0), with sum(x) over the block from the caller (xs32).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_quant.h"
#include "vec.h"

namespace srt_cpu {
namespace x8 {

constexpr int64_t kRows = 8;
constexpr int64_t kBlock = 32;

struct Layout {
  int header;  // bytes of 2-byte header fields per block
  int codes;   // code bytes per block
  int type_size() const { return header + codes; }
};

inline const Layout* layout(int64_t qtype) {
  static constexpr Layout kQ4_0{2, 16}, kQ4_1{4, 16}, kQ8_0{2, 32};
  switch (qtype) {
    case kGgmlQ4_0: return &kQ4_0;
    case kGgmlQ4_1: return &kQ4_1;
    case kGgmlQ8_0: return &kQ8_0;
    default: return nullptr;
  }
}

// rows (GGUF layout, `count` <= 8 of them, bpr bytes each) -> one group (8 * bpr bytes)
inline void pack_group(const Layout& L, const uint8_t* rows, int64_t count, int64_t bpr, uint8_t* group) {
  const int ts = L.type_size();
  const int64_t nb = bpr / ts;
  std::memset(group, 0, static_cast<size_t>(kRows * bpr));
  for (int64_t r = 0; r < count; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = rows + r * bpr + b * ts;
      uint8_t* rec = group + b * kRows * ts;
      for (int f = 0; f < L.header / 2; ++f) std::memcpy(rec + 16 * f + 2 * r, blk + 2 * f, 2);
      uint8_t* codes = rec + kRows * L.header + r;
      for (int j = 0; j < L.codes; ++j) codes[kRows * j] = blk[L.header + j];
    }
  }
}

// rows r0 .. r0 + count - 1 of a group -> GGUF layout (count rows of bpr bytes)
inline void unpack_rows(const Layout& L, const uint8_t* group, int64_t bpr, int64_t r0, int64_t count, uint8_t* rows) {
  const int ts = L.type_size();
  const int64_t nb = bpr / ts;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t r = r0 + i;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* rec = group + b * kRows * ts;
      uint8_t* blk = rows + i * bpr + b * ts;
      for (int f = 0; f < L.header / 2; ++f) std::memcpy(blk + 2 * f, rec + 16 * f + 2 * r, 2);
      const uint8_t* codes = rec + kRows * L.header + r;
      for (int j = 0; j < L.codes; ++j) blk[L.header + j] = codes[kRows * j];
    }
  }
}

// sums of x over blocks of 32: xs[i * nb + b] = sum x[i * ldx + 32 b ..]
inline void block_sums(const float* x, int64_t ldx, int64_t M, int64_t nb, float* xs) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* p = x + i * ldx + b * kBlock;
      float s = 0.f;
      for (int j = 0; j < kBlock; ++j) s += p[j];
      xs[i * nb + b] = s;
    }
  }
}

#if SRT_CPU_X86
// out[i * ldo + r] = sum over the group's row r for r < valid (+ bias[r]), i < MR
template <int QTYPE, int MR>
SRT_TARGET_AVX2 void dot_group(const uint8_t* group, int64_t nb, const float* x, int64_t ldx, const float* xs,
                               float* out, int64_t ldo, const float* bias, int64_t valid) {
  static_assert(MR >= 1 && MR <= 4, "1 to 4 input rows");
  constexpr bool kQ8 = QTYPE == kGgmlQ8_0, kMin = QTYPE == kGgmlQ4_1;
  constexpr int kHeader = kMin ? 4 : 2, kCodes = kQ8 ? 32 : 16, kRec = 8 * (kHeader + kCodes);
  constexpr int C = MR == 1 ? 4 : 2;  // independent FMA chains per input row
  const __m256i mask = _mm256_set1_epi32(0x0F);
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = group + b * kRec;
    const uint8_t* codes = rec + 8 * kHeader;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec)));
    __m256 s[MR][C];
    for (int i = 0; i < MR; ++i) {
      for (int c = 0; c < C; ++c) s[i][c] = _mm256_setzero_ps();
    }
    const float* xb = x + b * kBlock;
    if constexpr (kQ8) {
#pragma GCC unroll 32
      for (int k = 0; k < 32; ++k) {
        const __m256 w = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * k))));
        for (int i = 0; i < MR; ++i) s[i][k % C] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(xb + i * ldx + k), s[i][k % C]);
      }
    } else {
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        const __m256i v =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * j)));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        constexpr int kPairs = C / 2;
        const int c = 2 * (j % kPairs);
        for (int i = 0; i < MR; ++i) {
          s[i][c] = _mm256_fmadd_ps(lo, _mm256_broadcast_ss(xb + i * ldx + j), s[i][c]);
          s[i][c + 1] = _mm256_fmadd_ps(hi, _mm256_broadcast_ss(xb + i * ldx + j + 16), s[i][c + 1]);
        }
      }
    }
    for (int i = 0; i < MR; ++i) {
      __m256 t = s[i][0];
      for (int c = 1; c < C; ++c) t = _mm256_add_ps(t, s[i][c]);
      acc[i] = _mm256_fmadd_ps(d, t, acc[i]);
    }
    if constexpr (kMin) {  // + m * sum(x)
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16)));
      for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs + i * nb + b), acc[i]);
    } else if constexpr (!kQ8) {  // Q4_0: codes are q + 8, so - 8 d * sum(x)
      const __m256 d8 = _mm256_mul_ps(d, _mm256_set1_ps(8.f));
      for (int i = 0; i < MR; ++i) acc[i] = _mm256_fnmadd_ps(d8, _mm256_broadcast_ss(xs + i * nb + b), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[i]);
    for (int64_t r = 0; r < valid; ++r) out[i * ldo + r] = lanes[r] + (bias != nullptr ? bias[r] : 0.f);
  }
}

// 8 bytes of each of two records side by side: one byte per lane of 16
SRT_INLINE_AVX512 __m128i bytes16(const uint8_t* a, const uint8_t* b) {
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
}

// the 8 fp16 fields at a and the 8 at b as 16 floats
SRT_INLINE_AVX512 __m512 half16(const uint8_t* a, const uint8_t* b) {
  const __m256i h = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_cvtph_ps(h);
}

// 16 lanes: group g0 in lanes 0-7 and group g1 in lanes 8-15 (AVX-512). Per lane the very
// operations of dot_group<QTYPE, MR> (the same chains, in the same order), so the sums are bit for
// bit dot_group's; half the instructions per weight row, and x is broadcast once for 16 rows.
// out[i * ldo + r] for r < valid (<= 16; rows of g1 from r = 8).
template <int QTYPE, int MR>
SRT_TARGET_AVX512 void dot_pair(const uint8_t* g0, const uint8_t* g1, int64_t nb, const float* x, int64_t ldx,
                                const float* xs, float* out, int64_t ldo, const float* bias, int64_t valid) {
  static_assert(MR >= 1 && MR <= 4, "1 to 4 input rows");
  constexpr bool kQ8 = QTYPE == kGgmlQ8_0, kMin = QTYPE == kGgmlQ4_1;
  constexpr int kHeader = kMin ? 4 : 2, kCodes = kQ8 ? 32 : 16, kRec = 8 * (kHeader + kCodes);
  constexpr int C = MR == 1 ? 4 : 2;
  const __m512i mask = _mm512_set1_epi32(0x0F);
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* r0 = g0 + b * kRec;
    const uint8_t* r1 = g1 + b * kRec;
    const uint8_t* c0 = r0 + 8 * kHeader;
    const uint8_t* c1 = r1 + 8 * kHeader;
    const __m512 d = half16(r0, r1);
    __m512 s[MR][C];
    for (int i = 0; i < MR; ++i) {
      for (int c = 0; c < C; ++c) s[i][c] = _mm512_setzero_ps();
    }
    const float* xb = x + b * kBlock;
    if constexpr (kQ8) {
#pragma GCC unroll 32
      for (int k = 0; k < 32; ++k) {
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16(c0 + 8 * k, c1 + 8 * k)));
        for (int i = 0; i < MR; ++i) s[i][k % C] = _mm512_fmadd_ps(w, _mm512_set1_ps(xb[i * ldx + k]), s[i][k % C]);
      }
    } else {
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        const __m512i v = _mm512_cvtepu8_epi32(bytes16(c0 + 8 * j, c1 + 8 * j));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, mask));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        constexpr int kPairs = C / 2;
        const int c = 2 * (j % kPairs);
        for (int i = 0; i < MR; ++i) {
          s[i][c] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xb[i * ldx + j]), s[i][c]);
          s[i][c + 1] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xb[i * ldx + j + 16]), s[i][c + 1]);
        }
      }
    }
    for (int i = 0; i < MR; ++i) {
      __m512 t = s[i][0];
      for (int c = 1; c < C; ++c) t = _mm512_add_ps(t, s[i][c]);
      acc[i] = _mm512_fmadd_ps(d, t, acc[i]);
    }
    if constexpr (kMin) {
      const __m512 m = half16(r0 + 16, r1 + 16);
      for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[i * nb + b]), acc[i]);
    } else if constexpr (!kQ8) {
      const __m512 d8 = _mm512_mul_ps(d, _mm512_set1_ps(8.f));
      for (int i = 0; i < MR; ++i) acc[i] = _mm512_fnmadd_ps(d8, _mm512_set1_ps(xs[i * nb + b]), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc[i]);
    for (int64_t r = 0; r < valid; ++r) out[i * ldo + r] = lanes[r] + (bias != nullptr ? bias[r] : 0.f);
  }
}

// The float32 weights of blocks [b0, b0 + nblk) of one group, bit for bit gguf.quants' values
// (d * q, d * (q - 8), or d * q rounded then + m, never fused), lane = row:
// D[(32 (b - b0) + k) * ldd + r] for k < 32, r < 8
template <int QTYPE>
SRT_TARGET_AVX2 void dequant_group(const uint8_t* group, int64_t b0, int64_t nblk, float* D, int64_t ldd) {
  constexpr bool kQ8 = QTYPE == kGgmlQ8_0, kMin = QTYPE == kGgmlQ4_1;
  constexpr int kHeader = kMin ? 4 : 2, kCodes = kQ8 ? 32 : 16, kRec = 8 * (kHeader + kCodes);
  const __m256i mask = _mm256_set1_epi32(0x0F);
  for (int64_t b = 0; b < nblk; ++b) {
    const uint8_t* rec = group + (b0 + b) * kRec;
    const uint8_t* codes = rec + 8 * kHeader;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec)));
    float* out = D + 32 * b * ldd;
    if constexpr (kQ8) {
      for (int k = 0; k < 32; ++k) {
        const __m256 q = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * k))));
        _mm256_storeu_ps(out + k * ldd, _mm256_mul_ps(q, d));
      }
    } else {
      __m256 m = _mm256_setzero_ps();
      if constexpr (kMin) m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16)));
      for (int j = 0; j < 16; ++j) {
        const __m256i v =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * j)));
        __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_srli_epi32(v, 4);
        if constexpr (!kMin) {
          lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(8));
          hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(8));
        }
        __m256 wl = _mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)), wh = _mm256_mul_ps(d, _mm256_cvtepi32_ps(hi));
        if constexpr (kMin) {
          asm("" : "+x"(wl), "+x"(wh));  // round d * q before adding m, as gguf.quants does
          wl = _mm256_add_ps(wl, m);
          wh = _mm256_add_ps(wh, m);
        }
        _mm256_storeu_ps(out + j * ldd, wl);
        _mm256_storeu_ps(out + (j + 16) * ldd, wh);
      }
    }
  }
}

// c[i][0..15] += sum_k D[k * 16 + 0..15] * x[i * ldx + k] for the R rows i of ROWS (c: R x 16
// floats); written out per R with macros so that the 2 R accumulators stay in registers
#define SRT_X8_TILE(NAME, ROWS)                                                                        \
  SRT_TARGET_AVX2 inline void NAME(int64_t kc, const float* D, const float* x, int64_t ldx, float* c) { \
    ROWS(SRT_X8_LOAD)                                                                                  \
    _Pragma("GCC unroll 4") for (int64_t k = 0; k < kc; ++k) {                                         \
      const __m256 w0 = _mm256_loadu_ps(D + 16 * k), w1 = _mm256_loadu_ps(D + 16 * k + 8);             \
      ROWS(SRT_X8_FMA)                                                                                 \
    }                                                                                                  \
    ROWS(SRT_X8_STORE)                                                                                 \
  }
#define SRT_X8_LOAD(i) __m256 c##i##0 = _mm256_loadu_ps(c + i * 16), c##i##1 = _mm256_loadu_ps(c + i * 16 + 8);
#define SRT_X8_FMA(i)                                      \
  {                                                        \
    const __m256 a = _mm256_broadcast_ss(x + i * ldx + k); \
    c##i##0 = _mm256_fmadd_ps(w0, a, c##i##0);             \
    c##i##1 = _mm256_fmadd_ps(w1, a, c##i##1);             \
  }
#define SRT_X8_STORE(i)                   \
  _mm256_storeu_ps(c + i * 16, c##i##0);  \
  _mm256_storeu_ps(c + i * 16 + 8, c##i##1);
#define SRT_X8_ROWS6(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define SRT_X8_ROWS4(X) X(0) X(1) X(2) X(3)
#define SRT_X8_ROWS2(X) X(0) X(1)
#define SRT_X8_ROWS1(X) X(0)
SRT_X8_TILE(tile_16x6, SRT_X8_ROWS6)
SRT_X8_TILE(tile_16x4, SRT_X8_ROWS4)
SRT_X8_TILE(tile_16x2, SRT_X8_ROWS2)
SRT_X8_TILE(tile_16x1, SRT_X8_ROWS1)
#undef SRT_X8_TILE
#undef SRT_X8_LOAD
#undef SRT_X8_FMA
#undef SRT_X8_STORE
#undef SRT_X8_ROWS6
#undef SRT_X8_ROWS4
#undef SRT_X8_ROWS2
#undef SRT_X8_ROWS1

// rows [0, r) of x, r <= 6: one 6-row tile, or 4 + 2 + 1 as needed
SRT_TARGET_AVX2 inline void tile_16(int64_t r, int64_t kc, const float* D, const float* x, int64_t ldx, float* c) {
  if (r == 6) {
    tile_16x6(kc, D, x, ldx, c);
    return;
  }
  int64_t i = 0;
  if (r - i >= 4) {
    tile_16x4(kc, D, x, ldx, c);
    i += 4;
  }
  if (r - i >= 2) {
    tile_16x2(kc, D, x + i * ldx, ldx, c + i * 16);
    i += 2;
  }
  if (r - i >= 1) tile_16x1(kc, D, x + i * ldx, ldx, c + i * 16);
}

// The AVX-512 tiles: the same sums with one 16-lane register per row of x (the pair's 16 weight
// rows), up to 12 rows per tile; per lane the very FMAs of the tiles above, so the same bits.
#define SRT_X8W_TILE(NAME, ROWS)                                                                         \
  SRT_TARGET_AVX512 inline void NAME(int64_t kc, const float* D, const float* x, int64_t ldx, float* c) { \
    ROWS(SRT_X8W_LOAD)                                                                                   \
    _Pragma("GCC unroll 4") for (int64_t k = 0; k < kc; ++k) {                                           \
      const __m512 w = _mm512_loadu_ps(D + 16 * k);                                                      \
      ROWS(SRT_X8W_FMA)                                                                                  \
    }                                                                                                    \
    ROWS(SRT_X8W_STORE)                                                                                  \
  }
#define SRT_X8W_LOAD(i) __m512 c##i = _mm512_loadu_ps(c + i * 16);
#define SRT_X8W_FMA(i) c##i = _mm512_fmadd_ps(w, _mm512_set1_ps(x[i * ldx + k]), c##i);
#define SRT_X8W_STORE(i) _mm512_storeu_ps(c + i * 16, c##i);
#define SRT_X8W_ROWS12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define SRT_X8W_ROWS8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define SRT_X8W_ROWS4(X) X(0) X(1) X(2) X(3)
#define SRT_X8W_ROWS2(X) X(0) X(1)
#define SRT_X8W_ROWS1(X) X(0)
SRT_X8W_TILE(wide_tile_16x12, SRT_X8W_ROWS12)
SRT_X8W_TILE(wide_tile_16x8, SRT_X8W_ROWS8)
SRT_X8W_TILE(wide_tile_16x4, SRT_X8W_ROWS4)
SRT_X8W_TILE(wide_tile_16x2, SRT_X8W_ROWS2)
SRT_X8W_TILE(wide_tile_16x1, SRT_X8W_ROWS1)
#undef SRT_X8W_TILE
#undef SRT_X8W_LOAD
#undef SRT_X8W_FMA
#undef SRT_X8W_STORE
#undef SRT_X8W_ROWS12
#undef SRT_X8W_ROWS8
#undef SRT_X8W_ROWS4
#undef SRT_X8W_ROWS2
#undef SRT_X8W_ROWS1

// rows [0, r) of x, r <= 12: one 12-row tile, or 8 + 4 + 2 + 1 as needed (AVX-512)
SRT_TARGET_AVX512 inline void wide_tile_16(int64_t r, int64_t kc, const float* D, const float* x, int64_t ldx,
                                           float* c) {
  if (r == 12) {
    wide_tile_16x12(kc, D, x, ldx, c);
    return;
  }
  int64_t i = 0;
  if (r - i >= 8) {
    wide_tile_16x8(kc, D, x, ldx, c);
    i += 8;
  }
  if (r - i >= 4) {
    wide_tile_16x4(kc, D, x + i * ldx, ldx, c + i * 16);
    i += 4;
  }
  if (r - i >= 2) {
    wide_tile_16x2(kc, D, x + i * ldx, ldx, c + i * 16);
    i += 2;
  }
  if (r - i >= 1) wide_tile_16x1(kc, D, x + i * ldx, ldx, c + i * 16);
}

// Large M: weight rows [16 p, 16 p + 16) for p in [p0, p1) (pairs of groups; the last may be a single
// group) against all M rows of x. Per column chunk of kc (<= 256) columns the pair is dequantized
// into D [kc][16] (lane = row); x runs over it 6 rows at a time (the last 1 to 5 in one smaller
// tile; 12 at a time in AVX-512 tiles where the CPU has them), accumulating in c [M][16]. Each sum runs over k in order, in one accumulator.
template <int QTYPE>
SRT_TARGET_AVX2 void gemm_pairs(const uint8_t* packed, int64_t gbytes, int64_t groups, int64_t nb, const float* x,
                                int64_t ldx, int64_t M, const float* bias, float* out, int64_t N, int64_t p0,
                                int64_t p1) {
  constexpr int64_t kChunk = 8;  // blocks per column chunk: 256 columns, D = 16 KiB
  std::vector<float> D(static_cast<size_t>(kChunk * kBlock * 16));
  std::vector<float> c(static_cast<size_t>(M * 16));
  const bool wide = detect_isa() == CpuIsa::kAvx512;  // 12-row AVX-512 tiles, the same sums
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t g0 = 2 * p, ng = std::min<int64_t>(2, groups - g0);
    std::fill(c.begin(), c.end(), 0.f);
    for (int64_t b0 = 0; b0 < nb; b0 += kChunk) {
      const int64_t nblk = std::min(kChunk, nb - b0), kc = nblk * kBlock;
      for (int64_t h = 0; h < 2; ++h) {
        if (h < ng) {
          dequant_group<QTYPE>(packed + (g0 + h) * gbytes, b0, nblk, D.data() + 8 * h, 16);
        } else {
          for (int64_t k = 0; k < kc; ++k) std::fill_n(D.data() + 16 * k + 8, 8, 0.f);
        }
      }
      if (wide) {
        for (int64_t m0 = 0; m0 < M; m0 += 12) {
          wide_tile_16(std::min<int64_t>(12, M - m0), kc, D.data(), x + m0 * ldx + b0 * kBlock, ldx,
                       c.data() + m0 * 16);
        }
      } else {
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
          tile_16(std::min<int64_t>(6, M - m0), kc, D.data(), x + m0 * ldx + b0 * kBlock, ldx, c.data() + m0 * 16);
        }
      }
    }
    const int64_t n0 = 16 * p, valid = std::min<int64_t>(16, N - n0);
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t r = 0; r < valid; ++r) {
        out[i * N + n0 + r] = c[i * 16 + r] + (bias != nullptr ? bias[n0 + r] : 0.f);
      }
    }
  }
}

using GemmPairsFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t, const float*,
                             float*, int64_t, int64_t, int64_t);

inline GemmPairsFn gemm_pairs_fn(int64_t qtype) {
  switch (qtype) {
    case kGgmlQ4_0: return &gemm_pairs<kGgmlQ4_0>;
    case kGgmlQ4_1: return &gemm_pairs<kGgmlQ4_1>;
    case kGgmlQ8_0: return &gemm_pairs<kGgmlQ8_0>;
    default: return nullptr;
  }
}

template <int QTYPE>
SRT_TARGET_AVX2 void dot_group_rows(const uint8_t* group, int64_t nb, const float* x, int64_t ldx, const float* xs,
                                    int64_t m, float* out, int64_t ldo, const float* bias, int64_t valid) {
  switch (m) {
    case 1: dot_group<QTYPE, 1>(group, nb, x, ldx, xs, out, ldo, bias, valid); break;
    case 2: dot_group<QTYPE, 2>(group, nb, x, ldx, xs, out, ldo, bias, valid); break;
    case 3: dot_group<QTYPE, 3>(group, nb, x, ldx, xs, out, ldo, bias, valid); break;
    case 4: dot_group<QTYPE, 4>(group, nb, x, ldx, xs, out, ldo, bias, valid); break;
    default: break;
  }
}

template <int QTYPE>
SRT_TARGET_AVX512 void dot_pair_rows(const uint8_t* g0, const uint8_t* g1, int64_t nb, const float* x, int64_t ldx,
                                     const float* xs, int64_t m, float* out, int64_t ldo, const float* bias,
                                     int64_t valid) {
  switch (m) {
    case 1: dot_pair<QTYPE, 1>(g0, g1, nb, x, ldx, xs, out, ldo, bias, valid); break;
    case 2: dot_pair<QTYPE, 2>(g0, g1, nb, x, ldx, xs, out, ldo, bias, valid); break;
    case 3: dot_pair<QTYPE, 3>(g0, g1, nb, x, ldx, xs, out, ldo, bias, valid); break;
    case 4: dot_pair<QTYPE, 4>(g0, g1, nb, x, ldx, xs, out, ldo, bias, valid); break;
    default: break;
  }
}

using DotPairFn = void (*)(const uint8_t*, const uint8_t*, int64_t, const float*, int64_t, const float*, int64_t,
                           float*, int64_t, const float*, int64_t);

inline DotPairFn dot_pair_fn(int64_t qtype) {
  switch (qtype) {
    case kGgmlQ4_0: return &dot_pair_rows<kGgmlQ4_0>;
    case kGgmlQ4_1: return &dot_pair_rows<kGgmlQ4_1>;
    case kGgmlQ8_0: return &dot_pair_rows<kGgmlQ8_0>;
    default: return nullptr;
  }
}

using DotGroupFn = void (*)(const uint8_t*, int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t,
                            const float*, int64_t);

inline DotGroupFn dot_group_fn(int64_t qtype) {
  switch (qtype) {
    case kGgmlQ4_0: return &dot_group_rows<kGgmlQ4_0>;
    case kGgmlQ4_1: return &dot_group_rows<kGgmlQ4_1>;
    case kGgmlQ8_0: return &dot_group_rows<kGgmlQ8_0>;
    default: return nullptr;
  }
}
#endif  // SRT_CPU_X86

}  // namespace x8
}  // namespace srt_cpu

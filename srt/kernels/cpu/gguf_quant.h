// GGUF quantized weights: the per-type row functions every quantized kernel is built from.
//
// A quantized weight [N, K] is stored as GGUF stores it: N rows of K / block_size blocks, each
// type_size bytes (uint8 [N, K / block_size * type_size], row-major). For each supported ggml
// type and instruction set there is one QuantRowOps:
//
//   dequant_row(row, out, k)   out[j] = weight j of the row, bit for bit what gguf.quants'
//                              numpy dequantize gives (k a multiple of block_size)
//   dot_rows(row, k, x, ldx, xsum16, ldxs, m, out, ldo)
//                              out[i * ldo] = sum_j dequant(row)[j] * x[i * ldx + j] for i < m,
//                              m <= kMaxDotRows; xsum16[i * ldxs + b] is the caller's sum of
//                              x[i * ldx + 16 b .. 16 b + 15] (for types with a block minimum)
//
// gguf_simple.cpp provides Q4_0, Q4_1, Q8_0 (simple_quant_ops) and gguf_kquant.cpp provides
// Q4_K, Q5_K, Q6_K (kquant_ops); each returns nullptr for a type (or ISA) it does not handle.
// gguf_linear.cpp builds the torch ops on top of them.
#pragma once

#include <cstdint>

#include "vec.h"

namespace srt_cpu {

// ggml type ids (gguf.constants.GGMLQuantizationType)
enum GgmlType : int { kGgmlQ4_0 = 2, kGgmlQ4_1 = 3, kGgmlQ8_0 = 8, kGgmlQ4_K = 12, kGgmlQ5_K = 13, kGgmlQ6_K = 14 };

constexpr int64_t kMaxDotRows = 4;

using DequantRowFn = void (*)(const uint8_t* row, float* out, int64_t k);
using DotRowsFn = void (*)(const uint8_t* row, int64_t k, const float* x, int64_t ldx, const float* xsum16,
                           int64_t ldxs, int64_t m, float* out, int64_t ldo);
// dot_tile(w, ldw, rows, k, xp, m, prefetch, sums): sums[i * rows + r] = dequant(w + r * ldw) . x[i]
// over k columns, for rows <= kDotTileWeightRows weight rows and m <= kDotTileRows rows of x packed
// as the tiles read them (gguf_linear.cpp's pack_tiles); the same rows from `prefetch` on are
// prefetched as the tile goes (the rows a later tile reads)
constexpr int64_t kDotTileWeightRows = 3, kDotTileRows = 8;
using DotTileFn = void (*)(const uint8_t* w, int64_t ldw, int64_t rows, int64_t k, const float* xp, int64_t m,
                           const uint8_t* prefetch, float* sums);

struct QuantRowOps {
  int block_size;  // weights per block
  int type_size;   // bytes per block
  DequantRowFn dequant_row;
  DotRowsFn dot_rows;
  DotTileFn dot_tile = nullptr;  // where a type has one (AVX-512 Q4_K, Q6_K)
};

const QuantRowOps* simple_quant_ops(int qtype, CpuIsa isa);  // gguf_simple.cpp
const QuantRowOps* kquant_ops(int qtype, CpuIsa isa);        // gguf_kquant.cpp

// The portable row functions of a type, from its block decoder Block(block bytes, BS floats out)
// (TS bytes per block): the scalar QuantRowOps and the reference the vector paths are tested
// against. dot_rows dequantizes each block once and dots it with every input row (no xsum16).
template <void (*Block)(const uint8_t*, float*), int BS, int TS>
void scalar_dequant_row(const uint8_t* row, float* out, int64_t k) {
  for (int64_t b = 0; b < k / BS; ++b) Block(row + b * TS, out + b * BS);
}

template <void (*Block)(const uint8_t*, float*), int BS, int TS>
void scalar_dot_rows(const uint8_t* row, int64_t k, const float* x, int64_t ldx, const float* /*xsum16*/,
                     int64_t /*ldxs*/, int64_t m, float* out, int64_t ldo) {
  float acc[kMaxDotRows] = {};
  float w[BS];
  for (int64_t b = 0; b < k / BS; ++b) {
    Block(row + b * TS, w);
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * ldx + b * BS;
      float s = 0.f;
      for (int i = 0; i < BS; ++i) s += w[i] * xr[i];
      acc[r] += s;
    }
  }
  for (int64_t r = 0; r < m; ++r) out[r * ldo] = acc[r];
}

template <void (*Block)(const uint8_t*, float*), int BS, int TS>
constexpr QuantRowOps scalar_row_ops() {
  return {BS, TS, &scalar_dequant_row<Block, BS, TS>, &scalar_dot_rows<Block, BS, TS>};
}

}  // namespace srt_cpu

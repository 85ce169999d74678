// The per-ISA body of the causal extend-attention kernel (extend_attention.cpp compiles it once
// per instruction set through isa_instances.h; see decode_attention_kernel.h for the macros).
//
// rows() runs one work item: up to QB query rows of one sequence and one query head against the
// keys they see, in blocks of KB keys, with an online softmax, in sub-tiles of RT rows:
//   S [R, KB]  = q_rows @ Kt[:, t0 .. t0 + KB)    a register tile (R rows x NV vectors): each
//                                                 q value broadcast, Kt rows (D of them, KB keys
//                                                 wide) streamed from L1
//   scaled, soft-capped (cap > 0: cap * tanh(s / cap)), masked (key t visible to row r iff
//   lo_r <= t <= lim_r, lo_r = lim_r - window_left with a window, else 0), online softmax per row
//   O [R, D]  += P [R, kb] @ V[t0 .. t0 + kb)    the same tile, V's rows streamed, D in KB chunks
// Kt is the sequence's K for one KV head transposed to blocks of kKeyBlock keys, [D][kKeyBlock]
// each (zero past the last key), built once per call by the caller, so both products are plain
// register-tiled GEMMs. Blocks wholly before the first row's window are skipped, not masked.

namespace srt_cpu {
namespace SRT_ISA_NS {

using Vec = SRT_ISA_VEC;
using reg = Vec::reg;
constexpr int W = Vec::W;
constexpr int NV = 4;                                      // vectors per tile row
constexpr int KB = NV * W;                                 // keys per block (and D per PV pass)
constexpr int RT = W == 16 ? 6 : (W == 8 ? 3 : 4);         // rows per tile (R x NV accumulators)
constexpr int QB = 8 * RT;                                 // rows per work item (8 sub-tiles)
constexpr int64_t kKeyBlock = 64;                          // keys a block of the transposed K
static_assert(kKeyBlock % KB == 0, "a key block holds whole blocks of the tile");

// c[r][0 .. KB) = (acc ? c : 0) + sum_{k < kc} a[r * lda + k] * b[k * ldb + 0 .. KB), r < R
template <int R>
SRT_ISA_TARGET inline void tile_r(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t kc, float* c,
                                  int64_t ldc, bool acc) {
  reg r[R][NV];
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < NV; ++j) r[i][j] = acc ? Vec::load(c + i * ldc + j * W) : Vec::zero();
  }
  for (int64_t k = 0; k < kc; ++k) {
    reg bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = Vec::load(b + k * ldb + j * W);
    for (int i = 0; i < R; ++i) {
      const reg ai = Vec::set1(a[i * lda + k]);
      for (int j = 0; j < NV; ++j) r[i][j] = Vec::fmadd(ai, bv[j], r[i][j]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < NV; ++j) Vec::store(c + i * ldc + j * W, r[i][j]);
  }
}

SRT_ISA_TARGET inline void tile(int R, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t kc, float* c,
                                int64_t ldc, bool acc) {
  switch (R) {
    case 6: if constexpr (RT >= 6) return tile_r<6>(a, lda, b, ldb, kc, c, ldc, acc); break;
    case 5: if constexpr (RT >= 5) return tile_r<5>(a, lda, b, ldb, kc, c, ldc, acc); break;
    case 4: if constexpr (RT >= 4) return tile_r<4>(a, lda, b, ldb, kc, c, ldc, acc); break;
    case 3: return tile_r<3>(a, lda, b, ldb, kc, c, ldc, acc);
    case 2: return tile_r<2>(a, lda, b, ldb, kc, c, ldc, acc);
    default: break;
  }
  return tile_r<1>(a, lda, b, ldb, kc, c, ldc, acc);
}

#include "online_softmax.h"  // scale_row, cap_scores, softmax_step

// The scores s [n][KB] of a sub-tile's n rows against one key block, scaled (sc), soft-capped (cap >
// 0), masked and taken into each row's online softmax (o [n][D], m [n], l [n]); s becomes the
// block's unnormalized probabilities (0 where masked). Row r sees the block's keys lo_r .. valid_r
// - 1: valid_r = min(kb_t, lim + r + 1), lo_r = lim + r - window (with a window, else 0), lim the
// sub-tile's row 0's last key less the block's first.
SRT_ISA_TARGET inline void block_softmax(int n, float* s, int64_t kb_t, int64_t lim, int64_t window, reg sc, float cap,
                                         float* o, float* m, float* l, int64_t D) {
  for (int r = 0; r < n; ++r) {
    float* sr = s + r * KB;
    const int64_t valid = std::min<int64_t>(kb_t, lim + r + 1);
    const int64_t lo = window >= 0 ? std::max<int64_t>(0, lim + r - window) : 0;
    if (valid <= lo) {  // nothing to see here (a later row's key, or before this row's window): p = 0
      std::fill(sr, sr + KB, 0.f);
      continue;
    }
    for (int j = 0; j < KB; j += W) Vec::store(sr + j, Vec::mul(Vec::load(sr + j), sc));
    if (cap > 0.f) cap_scores(sr, KB, cap);
    for (int64_t t = 0; t < lo; ++t) sr[t] = -INFINITY;
    for (int64_t t = valid; t < KB; ++t) sr[t] = -INFINITY;
    softmax_step(sr, KB, o + r * D, m[r], l[r], D);
  }
}

// A work item's running maxima (m), sums (l) and weighted values (o [R][D]) before its first block
SRT_ISA_TARGET inline void start_rows(int R, int64_t D, float* m, float* l, float* o) {
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  std::fill(o, o + R * D, 0.f);
}

// out row r (row stride out_stride) = o[r] / l[r], r < R
SRT_ISA_TARGET inline void finish_rows(int R, int64_t D, const float* l, const float* o, float* out,
                                       int64_t out_stride) {
  for (int r = 0; r < R; ++r) {
    const reg inv = Vec::set1(1.f / l[r]);
    for (int64_t d = 0; d < D; d += W) Vec::store(out + r * out_stride + d, Vec::mul(Vec::load(o + r * D + d), inv));
  }
}

// One work item (see the top): R <= QB query rows of one head, in sub-tiles of RT rows that each
// take every key block they see while it is in cache (a key block's K and V serve all the item's
// sub-tiles before the next block is read, rather than one sub-tile's rows). Each row's sums run
// over the same blocks in the same order whatever the item's size. q: the first row's query (row
// stride q_stride); kt: the item's KV head's K as blocks of kKeyBlock keys, each [D][kKeyBlock] (a
// block's rows contiguous: in one long [D][keys] they lie a whole sequence's row apart, in few L1
// sets); v: key 0's V row of that head (row stride v_stride); lim0: the last key row 0 sees (rows r
// see keys 0 .. lim0 + r; with window >= 0, lim0 + r - window .. lim0 + r); cap: the soft-cap (0:
// none); out: row stride out_stride. Scratch: s [RT * KB], o [QB * D].
SRT_ISA_TARGET void rows(int R, const float* q, int64_t q_stride, const float* kt, const float* v,
                         int64_t v_stride, int64_t D, int64_t lim0, int64_t window, float scale, float cap, float* out,
                         int64_t out_stride, float* s, float* o) {
  float m[QB], l[QB];
  start_rows(R, D, m, l, o);
  const reg sc = Vec::set1(scale);
  const int64_t n_keys = lim0 + R;
  const int64_t first = window >= 0 ? std::max<int64_t>(0, lim0 - window) / KB * KB : 0;  // row 0's first block
  for (int64_t t0 = first; t0 < n_keys; t0 += KB) {
    const int64_t kb = std::min<int64_t>(KB, n_keys - t0);
    const float* kblock = kt + t0 / kKeyBlock * D * kKeyBlock + t0 % kKeyBlock;
    for (int r0 = 0; r0 < R; r0 += RT) {  // the sub-tiles that see keys of this block
      const int n = std::min(RT, R - r0);
      const int64_t lim = lim0 + r0;  // the sub-tile's row 0's last key
      if (t0 > lim + n - 1) continue;  // past the sub-tile's last row's keys (a later one's)
      if (window >= 0 && t0 + KB <= std::max<int64_t>(0, lim - window) / KB * KB) continue;
      tile(n, q + r0 * q_stride, q_stride, kblock, kKeyBlock, D, s, KB, false);
      const int64_t kb_t = std::min<int64_t>(kb, lim + n - t0);  // keys of the block the sub-tile's rows see
      block_softmax(n, s, kb_t, lim - t0, window, sc, cap, o + r0 * D, m + r0, l + r0, D);
      for (int64_t d0 = 0; d0 < D; d0 += KB)
        tile(n, s, KB, v + t0 * v_stride + d0, v_stride, kb_t, o + r0 * D + d0, D, true);
    }
  }
  finish_rows(R, D, l, o, out, out_stride);
}

#if SRT_ISA_BF16_DOT
// The AVX512-BF16 copy (extend_attention.cpp compiles this body a fourth time for it): bf16 q, K and
// V, both products on vdpbf16ps, each lane two exact products a step summed in float32. A block of
// kKeyBlock keys of K is [D/2][kKeyBlock][2] (key t's (d, d+1) at [d/2][t]), of V [kKeyBlock/2][D][2]
// (keys (t, t+1)'s value d at [t/2][d]), zeros past the last key. The probabilities are rounded to
// bf16 for P @ V (what torch's flash attention and transformers' eager attention do with bf16
// activations); the softmax's sums and the scores stay float32.
static_assert(KB == kKeyBlock, "one tile block a block of the packed K and V");

// c[r][0 .. KB) = (acc ? c : 0) + sum over steps k < n of a_r(2k, 2k+1) . b[k * ldb .. + 2 KB), r < R:
// a's rows (bf16, lda apart) taken a pair at a time, b's KB bf16 pairs a step, c float32 (ldc apart).
// q K^T: a = q, b = a K block ([D/2][KB][2]); P V: a = P in bf16, b = a V block ([KB/2][D][2]).
template <int R>
SRT_ISA_TARGET inline void tile_dot(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t n, float* c,
                                    int64_t ldc, bool acc) {
  __m512 r[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) r[i][j] = acc ? _mm512_loadu_ps(c + i * ldc + j * W) : _mm512_setzero_ps();
  for (int64_t k = 0; k < n; ++k) {
    __m512bh bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + k * ldb + j * W * 2);
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * k, sizeof pair);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NV; ++j) r[i][j] = _mm512_dpbf16_ps(r[i][j], av, bv[j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(c + i * ldc + j * W, r[i][j]);
}

// One sub-tile of NR rows against one key block: scores, softmax (block_softmax), P rounded to bf16
// (nearest even) into pb, P @ V into o (see rows_bf16; np: pairs of keys, an odd key's partner has
// p = 0).
template <int NR>
SRT_ISA_TARGET inline void sub_tile_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* kblock,
                                         const uint16_t* vblock, int64_t D, int64_t kb_t, int64_t lim, int64_t window,
                                         reg sc, float cap, float* o, float* m, float* l, float* s, uint16_t* pb) {
  tile_dot<NR>(q, q_stride, kblock, kKeyBlock * 2, D / 2, s, KB, false);
  block_softmax(NR, s, kb_t, lim, window, sc, cap, o, m, l, D);
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < KB; j += 2 * W)
      _mm512_storeu_si512(pb + r * KB + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + r * KB + j + W),
                                                                        _mm512_loadu_ps(s + r * KB + j)));
  const int64_t np = (kb_t + 1) / 2;
  for (int64_t d0 = 0; d0 < D; d0 += KB) tile_dot<NR>(pb, KB, vblock + d0 * 2, D * 2, np, o + d0, D, true);
}
using SubTileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t,
                          int64_t, reg, float, float*, float*, float*, float*, uint16_t*);
constexpr SubTileFn kSubTiles[] = {nullptr,           &sub_tile_bf16<1>, &sub_tile_bf16<2>, &sub_tile_bf16<3>,
                                   &sub_tile_bf16<4>, &sub_tile_bf16<5>, &sub_tile_bf16<6>};
static_assert(RT + 1 == sizeof kSubTiles / sizeof kSubTiles[0], "a sub-tile function for each height 1 .. RT");

// rows() on the packed bf16 K and V (see above): kp, vp the item's KV head's blocks; q bf16 (row
// stride q_stride). Scratch: s [RT * KB] float, pb [RT * KB] bf16, o [QB * D] float.
SRT_ISA_TARGET void rows_bf16(int R, const uint16_t* q, int64_t q_stride, const uint16_t* kp, const uint16_t* vp,
                              int64_t D, int64_t lim0, int64_t window, float scale, float cap, float* out,
                              int64_t out_stride, float* s, uint16_t* pb, float* o) {
  float m[QB], l[QB];
  start_rows(R, D, m, l, o);
  const reg sc = Vec::set1(scale);
  const int64_t n_keys = lim0 + R;
  const int64_t first = window >= 0 ? std::max<int64_t>(0, lim0 - window) / KB * KB : 0;  // row 0's first block
  for (int64_t t0 = first; t0 < n_keys; t0 += KB) {
    const int64_t kb = std::min<int64_t>(KB, n_keys - t0);
    const uint16_t* kblock = kp + t0 * D;  // blocks of kKeyBlock x D elements, K's and V's alike
    const uint16_t* vblock = vp + t0 * D;
    for (int r0 = 0; r0 < R; r0 += RT) {
      const int n = std::min(RT, R - r0);
      const int64_t lim = lim0 + r0;
      if (t0 > lim + n - 1) continue;
      if (window >= 0 && t0 + KB <= std::max<int64_t>(0, lim - window) / KB * KB) continue;
      const int64_t kb_t = std::min<int64_t>(kb, lim + n - t0);
      const uint16_t* qr = q + r0 * q_stride;
      float *orow = o + r0 * D, *mr = m + r0, *lr = l + r0;
      kSubTiles[n](qr, q_stride, kblock, vblock, D, kb_t, lim - t0, window, sc, cap, orow, mr, lr, s, pb);
    }
  }
  finish_rows(R, D, l, o, out, out_stride);
}
#endif  // SRT_ISA_BF16_DOT

}  // namespace SRT_ISA_NS
}  // namespace srt_cpu

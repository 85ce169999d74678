// The per-ISA body of the paged decode-attention kernel. No include guard: decode_attention.cpp
// compiles it once per instruction set through isa_instances.h, which defines
//   SRT_ISA_NS      the namespace of this copy (scalar, avx2, avx512)
//   SRT_ISA_VEC     its vector struct from vec.h (VecScalar, VecAvx2, VecAvx512)
//   SRT_ISA_TARGET  the function attribute every function here carries (empty for scalar)
//
// attend<KT>() runs one work item: NH consecutive KV heads (each with its G = H / H_kv query
// heads) over one range of one sequence's tokens, with an online softmax. Tokens go in blocks of
// kBlock; a block's K/V rows for all NH heads are adjacent in memory (one range per slot), and
// for each head in turn (float16 / bfloat16 elements are converted to float32 as they load):
//   s[g][j]  = q_g . K_j           3 queries x TQ tokens at a time, one accumulator per (query,
//                                  token), reduced together at the end (no per-dot horizontal
//                                  sum); each K row comes from memory once
//   m_g'     = max(m_g, max_j s[g][j]);  acc_g, l_g *= e^(m_g - m_g')
//   p[g][j]  = e^(s[g][j] - m_g');  l_g += sum_j p[g][j]
//   acc_g   += sum_j p[g][j] V_j   up to 4 query heads x DC column chunks of acc in registers
//                                  across the block (GT * DC ~ 8 independent FMA chains)
// The AVX512-BF16 copy, for a bf16 KV cache and queries that are bf16 values (a bf16 model's),
// takes s and acc on vdpbf16ps instead (scores_block_dot, accumulate_v_heads_dot: p rounded to
// bf16 for the second).
// With soft-capping (cap > 0) each block's scores become cap * tanh(s / cap) before the softmax.
// A short last block is padded to kBlock with copies of its first row's pointers and p = 0, so
// every inner loop has a fixed trip count. The K and V ranges of the next block (the page table
// gives their slots ahead) are prefetched a few lines at a time between tiles (Prefetcher).
// Output: unnormalized acc [NH][G][D] with its running max m [NH][G] and sum l [NH][G]; the
// caller divides, or combines a sequence's splits.

namespace srt_cpu {
namespace SRT_ISA_NS {

using Vec = SRT_ISA_VEC;
using reg = Vec::reg;
constexpr int W = Vec::W;
static_assert(kBlock % W == 0 && kBlock % Vec::TQ == 0, "a block must be a whole number of tiles");

// Software prefetch of the next block's K/V, spread over the current block's work: pump() is
// called between tiles and passes and issues a few cache lines each time, so the memory system
// streams while the core computes (one burst per block would stall the core on full miss
// buffers, and for slots on random pages the hardware prefetcher cannot help). The lines go to
// L2 (locality 2), not L1: prefetches into L1 are capped by the core's few L1 fill buffers, which
// held a step at 1.44-1.51x its bandwidth bound on Emerald Rapids; into L2, 1.21-1.29x (float16
// KV: 1.73-1.84x -> 1.43-1.52x). The demand loads then hit L2.
struct Prefetcher {
  const char* start[2 * kBlock];  // the next block's per-slot K and V ranges
  int n = 0;
  int64_t bytes = 0;   // bytes per range
  int r = 0;           // next range to prefetch ...
  int64_t off = 0;     // ... from this offset
  int64_t per = 1;     // lines per pump()
  int64_t calls = 0;   // pump() calls in the current block (sizes `per` for the next one)

  SRT_ISA_TARGET __attribute__((always_inline)) inline void issue(int64_t lines) {
    for (int64_t i = 0; i < lines && r < n; ++i) {
      __builtin_prefetch(start[r] + off, 0, 2);
      off += 64;
      if (off >= bytes) {
        off = 0;
        ++r;
      }
    }
  }
  SRT_ISA_TARGET __attribute__((always_inline)) inline void pump() {
    ++calls;
    issue(per);
  }
  // Finish the current ranges, then queue the next block's (n ranges); `per` spreads them over
  // as many pump() calls as the block just done made.
  SRT_ISA_TARGET inline void restart(int new_n, int64_t estimated_calls) {
    issue(INT64_MAX);
    const int64_t lines = new_n * ((bytes + 63) / 64);
    const int64_t c = calls > 0 ? calls : estimated_calls;
    per = (lines + c - 1) / c;
    n = new_n;
    r = 0;
    off = 0;
    calls = 0;
  }
};

// W elements of a K/V row -> float32 lanes (float16 / bfloat16 converted in registers)
template <class KT>
SRT_ISA_TARGET __attribute__((always_inline)) inline reg load_kv(const KT* p) {
  if constexpr (std::is_same_v<KT, float>) {
    return Vec::load(p);
  } else if constexpr (std::is_same_v<KT, c10::Half>) {
    return Vec::load_f16(reinterpret_cast<const uint16_t*>(p));
  } else {
    return Vec::load_bf16(reinterpret_cast<const uint16_t*>(p));
  }
}

// out[t] = q . kr[t], t < W: one query, W tokens
template <class KT>
SRT_ISA_TARGET inline void scores_tile(const float* q, const KT* const* kr, int64_t D, float* out) {
  reg acc[W];
  for (int t = 0; t < W; ++t) acc[t] = Vec::zero();
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    const reg qv = Vec::load(q + d);
    for (int t = 0; t < W; ++t) acc[t] = Vec::fmadd(qv, load_kv(kr[t] + d), acc[t]);
  }
  Vec::store(out, Vec::reduce_tile(acc));
  for (int64_t e = d; e < D; ++e) {
    for (int t = 0; t < W; ++t) out[t] += q[e] * static_cast<float>(kr[t][e]);
  }
}

// out[g * kBlock + t] = q_g . kr[t], g < GQ, t < TQ: GQ queries share each K load
template <int GQ, class KT>
SRT_ISA_TARGET inline void scores_tile_multi(const float* q, const KT* const* kr, int64_t D, float* out) {
  constexpr int TQ = Vec::TQ;
  reg acc[GQ][TQ];
  for (int g = 0; g < GQ; ++g) {
    for (int t = 0; t < TQ; ++t) acc[g][t] = Vec::zero();
  }
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    reg qv[GQ];
    for (int g = 0; g < GQ; ++g) qv[g] = Vec::load(q + g * D + d);
    for (int t = 0; t < TQ; ++t) {
      const reg kv = load_kv(kr[t] + d);
      for (int g = 0; g < GQ; ++g) acc[g][t] = Vec::fmadd(qv[g], kv, acc[g][t]);
    }
  }
  for (int g = 0; g < GQ; ++g) Vec::reduce_store_tq(acc[g], out + g * kBlock);
  for (int64_t e = d; e < D; ++e) {
    for (int g = 0; g < GQ; ++g) {
      for (int t = 0; t < TQ; ++t) out[g * kBlock + t] += q[g * D + e] * static_cast<float>(kr[t][e]);
    }
  }
}

// s[g][j] = q_g . kr[j] for one KV head's G queries over a block: queries in groups of 3 (2)
// sharing each K load, a lone query with W-token tiles.
template <class KT>
SRT_ISA_TARGET inline void scores_block(const float* q, const KT* const* kr, int64_t G, int64_t D, float* s,
                                        Prefetcher& pf) {
  int64_t g = 0;
  for (; g + 3 <= G; g += 3) {
    for (int j = 0; j < kBlock; j += Vec::TQ) {
      scores_tile_multi<3>(q + g * D, kr + j, D, s + g * kBlock + j);
      pf.pump();
    }
  }
  if (G - g == 2) {
    for (int j = 0; j < kBlock; j += Vec::TQ) {
      scores_tile_multi<2>(q + g * D, kr + j, D, s + g * kBlock + j);
      pf.pump();
    }
  } else if (G - g == 1) {
    for (int j = 0; j < kBlock; j += W) {
      scores_tile(q + g * D, kr + j, D, s + g * kBlock + j);
      pf.pump();
    }
  }
}

#if SRT_ISA_BF16_DOT
// The AVX512-BF16 copy (decode_attention.cpp compiles this body a fourth time for it): a bf16 K
// takes its scores on vdpbf16ps, 32 elements (16 pairs of d) a load, where the item's unscaled
// queries are bf16 values (a.qb: a bf16 model's; a float32 q is never rounded, a.qb null), the
// products exact in float32 and summed in float32; s = scale x the sum. D a multiple of 32 (the
// caller's choice).
// s[g * kBlock + t] = scale * (q_g . kr[t]), g < GQ, t < TQ
template <int GQ>
SRT_ISA_TARGET inline void scores_tile_dot(const uint16_t* qb, const c10::BFloat16* const* kr, int64_t D, float scale,
                                           float* out) {
  constexpr int TQ = Vec::TQ;
  reg acc[GQ][TQ];
  for (int g = 0; g < GQ; ++g) {
    for (int t = 0; t < TQ; ++t) acc[g][t] = Vec::zero();
  }
  for (int64_t d = 0; d < D; d += 32) {
    __m512bh qv[GQ];
    for (int g = 0; g < GQ; ++g) qv[g] = (__m512bh)_mm512_loadu_si512(qb + g * D + d);
    for (int t = 0; t < TQ; ++t) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const uint16_t*>(kr[t]) + d);
      for (int g = 0; g < GQ; ++g) acc[g][t] = _mm512_dpbf16_ps(acc[g][t], qv[g], kv);
    }
  }
  for (int g = 0; g < GQ; ++g) {
    Vec::reduce_store_tq(acc[g], out + g * kBlock);
    for (int t = 0; t < TQ; ++t) out[g * kBlock + t] *= scale;
  }
}

// scores_block on vdpbf16ps: queries in groups of 3 (then 2 or 1) sharing each K load
SRT_ISA_TARGET inline void scores_block_dot(const uint16_t* qb, const c10::BFloat16* const* kr, int64_t G, int64_t D,
                                            float scale, float* s, Prefetcher& pf) {
  int64_t g = 0;
  for (; g + 3 <= G; g += 3) {
    for (int j = 0; j < kBlock; j += Vec::TQ) {
      scores_tile_dot<3>(qb + g * D, kr + j, D, scale, s + g * kBlock + j);
      pf.pump();
    }
  }
  for (int j = 0; j < kBlock && G - g > 0; j += Vec::TQ) {
    if (G - g == 2) {
      scores_tile_dot<2>(qb + g * D, kr + j, D, scale, s + g * kBlock + j);
    } else {
      scores_tile_dot<1>(qb + g * D, kr + j, D, scale, s + g * kBlock + j);
    }
    pf.pump();
  }
}
#endif

#include "online_softmax.h"  // scale_row, cap_scores, softmax_step

// acc[g][d] += sum_j p[g][j] vr[j][d] for g < GT, columns d0 .. : DC column chunks per pass,
// then narrower passes for the rest, then a scalar tail.
template <int GT, int DC, class KT>
SRT_ISA_TARGET __attribute__((always_inline)) inline void accumulate_v(float* acc, const float* p,
                                                                       const KT* const* vr, int64_t D,
                                                                       int64_t d, Prefetcher& pf) {
  for (; d + DC * W <= D; d += DC * W) {
    reg r[GT][DC];
    for (int g = 0; g < GT; ++g) {
      for (int c = 0; c < DC; ++c) r[g][c] = Vec::load(acc + g * D + d + c * W);
    }
    for (int j = 0; j < kBlock; ++j) {
      for (int c = 0; c < DC; ++c) {
        const reg v = load_kv(vr[j] + d + c * W);
        for (int g = 0; g < GT; ++g) r[g][c] = Vec::fmadd(Vec::set1(p[g * kBlock + j]), v, r[g][c]);
      }
    }
    for (int g = 0; g < GT; ++g) {
      for (int c = 0; c < DC; ++c) Vec::store(acc + g * D + d + c * W, r[g][c]);
    }
    pf.pump();
  }
  if constexpr (DC > 1) {
    accumulate_v<GT, DC / 2, KT>(acc, p, vr, D, d, pf);
  } else {
    for (; d < D; ++d) {
      for (int g = 0; g < GT; ++g) {
        float r = acc[g * D + d];
        for (int j = 0; j < kBlock; ++j) r += p[g * kBlock + j] * static_cast<float>(vr[j][d]);
        acc[g * D + d] = r;
      }
    }
  }
}

#if SRT_ISA_BF16_DOT
// P @ V on vdpbf16ps (the AVX512-BF16 copy, a bf16 V where the queries are bf16 values: a bf16
// model's). P is rounded to bf16, as transformers' eager attention and torch's flash attention
// round it before P @ V (l, the softmax sum, stays the float32 one); one dot product adds the
// pair of tokens (2i, 2i + 1). Their V rows, 32 columns at a time, are interleaved in registers
// (vpunpcklwd / vpunpckhwd work within 128-bit lanes): the "lo" sums hold columns 0-3, 8-11,
// 16-19, 24-27 of the 32, the "hi" sums 4-7, 12-15, 20-23, 28-31, so acc is loaded into that
// order and stored back out of it. D a multiple of 32 (the caller's choice); kBlock == W.
static_assert(kBlock == W, "one probability vector per query head and block");

// acc[g][d0 .. d0 + 32) += sum_j p[g][j] vr[j][d0 ..], g < GT; pp [GT][kBlock / 2]: p as bf16 pairs
template <int GT>
SRT_ISA_TARGET inline void accumulate_v_dot(float* acc, const uint32_t* pp, const c10::BFloat16* const* vr,
                                            int64_t D, Prefetcher& pf) {
  const __m512i to_x0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i to_x1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t d = 0; d < D; d += 32) {
    reg lo[GT], hi[GT];
    for (int g = 0; g < GT; ++g) {
      const reg x0 = Vec::load(acc + g * D + d), x1 = Vec::load(acc + g * D + d + 16);
      lo[g] = _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0));
      hi[g] = _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1));
    }
    for (int i = 0; i < kBlock / 2; ++i) {
      const __m512i a = _mm512_loadu_si512(reinterpret_cast<const uint16_t*>(vr[2 * i]) + d);
      const __m512i b = _mm512_loadu_si512(reinterpret_cast<const uint16_t*>(vr[2 * i + 1]) + d);
      const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(a, b), vhi = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int g = 0; g < GT; ++g) {
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[g * (kBlock / 2) + i]));
        lo[g] = _mm512_dpbf16_ps(lo[g], pv, vlo);
        hi[g] = _mm512_dpbf16_ps(hi[g], pv, vhi);
      }
    }
    for (int g = 0; g < GT; ++g) {
      Vec::store(acc + g * D + d, _mm512_permutex2var_ps(lo[g], to_x0, hi[g]));
      Vec::store(acc + g * D + d + 16, _mm512_permutex2var_ps(lo[g], to_x1, hi[g]));
    }
    pf.pump();
  }
}

// All G query heads, in tiles of up to 8 (each V load shared by a tile's heads); p [G][kBlock]
// float32, pp [G][kBlock / 2] scratch for its bf16 pairs.
SRT_ISA_TARGET inline void accumulate_v_heads_dot(float* acc, const float* p, uint32_t* pp,
                                                  const c10::BFloat16* const* vr, int64_t G, int64_t D,
                                                  Prefetcher& pf) {
  for (int64_t g = 0; g < G; ++g) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + g * (kBlock / 2)),
                        (__m256i)_mm512_cvtneps_pbh(Vec::load(p + g * kBlock)));
  }
  for (int64_t g = 0; g < G; g += 8) {
    float* a = acc + g * D;
    const uint32_t* q = pp + g * (kBlock / 2);
    switch (std::min<int64_t>(G - g, 8)) {
      case 8: accumulate_v_dot<8>(a, q, vr, D, pf); break;
      case 7: accumulate_v_dot<7>(a, q, vr, D, pf); break;
      case 6: accumulate_v_dot<6>(a, q, vr, D, pf); break;
      case 5: accumulate_v_dot<5>(a, q, vr, D, pf); break;
      case 4: accumulate_v_dot<4>(a, q, vr, D, pf); break;
      case 3: accumulate_v_dot<3>(a, q, vr, D, pf); break;
      case 2: accumulate_v_dot<2>(a, q, vr, D, pf); break;
      default: accumulate_v_dot<1>(a, q, vr, D, pf); break;
    }
  }
}
#endif

// All G query heads, in tiles of up to 4 heads.
template <class KT>
SRT_ISA_TARGET inline void accumulate_v_heads(float* acc, const float* p, const KT* const* vr, int64_t G,
                                              int64_t D, Prefetcher& pf) {
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) accumulate_v<4, 2, KT>(acc + g * D, p + g * kBlock, vr, D, 0, pf);
  switch (G - g) {
    case 3: accumulate_v<3, 2, KT>(acc + g * D, p + g * kBlock, vr, D, 0, pf); break;
    case 2: accumulate_v<2, 4, KT>(acc + g * D, p + g * kBlock, vr, D, 0, pf); break;
    case 1: accumulate_v<1, 8, KT>(acc + g * D, p + g * kBlock, vr, D, 0, pf); break;
    default: break;
  }
}

template <class KT>
SRT_ISA_TARGET void attend(const AttendArgs& a) {
  const KT* k = static_cast<const KT*>(a.k);
  const KT* v = static_cast<const KT*>(a.v);
  const int64_t D = a.D, G = a.G, n = a.n, NH = a.NH;
  const int64_t* slots = a.slots;
  const KT* kb[kBlock];  // the block's slots, at the item's first head
  const KT* vb[kBlock];
  const KT* kr[kBlock];  // one head's rows
  const KT* vr[kBlock];
  Prefetcher pf;
  // one slot's K (or V) rows for the item's heads: one range
  pf.bytes = ((NH - 1) * std::max(a.k_head_stride, a.v_head_stride) + D) * static_cast<int64_t>(sizeof(KT));
  for (int64_t t0 = 0; t0 < n; t0 += kBlock) {
    const int nb = static_cast<int>(std::min<int64_t>(kBlock, n - t0));
    for (int j = 0; j < nb; ++j) {
      kb[j] = k + slots[t0 + j] * a.k_stride;
      vb[j] = v + slots[t0 + j] * a.v_stride;
    }
    const int nn = static_cast<int>(std::clamp<int64_t>(n - t0 - kBlock, 0, kBlock));  // next block's tokens
    for (int j = 0; j < nn; ++j) {
      pf.start[j] = reinterpret_cast<const char*>(k + slots[t0 + kBlock + j] * a.k_stride);
      pf.start[nn + j] = reinterpret_cast<const char*>(v + slots[t0 + kBlock + j] * a.v_stride);
    }
    pf.restart(2 * nn, 8 * NH);
    for (int64_t h = 0; h < NH; ++h) {
      for (int j = 0; j < nb; ++j) {
        kr[j] = kb[j] + h * a.k_head_stride;
        vr[j] = vb[j] + h * a.v_head_stride;
      }
      for (int j = nb; j < kBlock; ++j) {
        kr[j] = kr[0];
        vr[j] = vr[0];
      }
      const float* q = a.q + h * G * D;
      float* acc = a.acc + h * G * D;
      bool dot = false;  // a bf16 model over a bf16 KV cache: both products on vdpbf16ps
#if SRT_ISA_BF16_DOT
      if constexpr (std::is_same_v<KT, c10::BFloat16>) dot = a.qb != nullptr;
#endif
      if (!dot) scores_block(q, kr, G, D, a.s, pf);
#if SRT_ISA_BF16_DOT
      if constexpr (std::is_same_v<KT, c10::BFloat16>) {
        if (dot) scores_block_dot(a.qb + h * G * D, kr, G, D, a.qk_scale, a.s, pf);
      }
#endif
      for (int64_t g = 0; g < G; ++g) {
        float* s = a.s + g * kBlock;
        if (a.cap > 0.f) cap_scores(s, kBlock, a.cap);
        for (int j = nb; j < kBlock; ++j) s[j] = -INFINITY;
        softmax_step(s, kBlock, acc + g * D, a.m[h * G + g], a.l[h * G + g], D);
      }
#if SRT_ISA_BF16_DOT
      if constexpr (std::is_same_v<KT, c10::BFloat16>) {
        if (dot) {
          accumulate_v_heads_dot(acc, a.s, a.pp, vr, G, D, pf);
          continue;
        }
      }
#endif
      accumulate_v_heads(acc, a.s, vr, G, D, pf);
    }
  }
}

}  // namespace SRT_ISA_NS
}  // namespace srt_cpu

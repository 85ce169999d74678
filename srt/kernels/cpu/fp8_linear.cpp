// FP8 (e4m3) linear layers on weights kept in one byte: out [M, N] = x [M, K] @ codes[N, K]^T (+ bias),
// float32 accumulation. The codes are an FP8 checkpoint's (its scales multiply the outputs outside,
// Linear.output_scale); each is exact in bf16, so the codes widen to bf16 panels block by block on the
// way, in cache, and bf16_linear's register tiles (bf16_tiles.h) take them.
//
//   pack_fp8_weight(codes [N, K] float8_e4m3fn, K even) -> packed uint8 [P, K/2, 64]
//       P = ceil(N / 32): panel p, pair of k kh: the 64 codes of pack_bf16_weight's [32, 2] pair row
//       (column j's k and k+1 at 2j, 2j+1), stored in the order the widening below reads them:
//       natural index i = 32 h + 8 l + t at byte 16 l + 8 h + t. Zeros past N. A NaN code is refused.
//   pack_fp8_weight(codes, block_scale [ceil(N/bn), ceil(K/bk)] float32, bn, bk) -> packed uint8
//       [P, K/2 * 64 + trailer]: a block-scaled checkpoint's codes (transformers' fine-grained FP8),
//       each panel's codes as above, then int32 bk and its row block's scales (bn a multiple of 32,
//       so a panel lies in one row block; bk even, so a pair of k in one column block), the trailer
//       4 + 4 ceil(K/bk) bytes rounded up to 64 (every panel's codes start a cache line).
//   fp8_linear(x [M, K] bf16 or float32, packed, N, bias [N]?, isa = "") -> out [M, N], x's dtype:
//       plain codes: the same bits as bf16_linear(x, pack_bf16_weight(codes in bf16), N, bias, isa)
//       on the same path (the tiles sum each output over k in pair order, one chain, whatever the
//       blocks). Block-scaled: each weight widens to bf16(code x its block's scale) (the product in
//       float32, rounded to nearest even: transformers' bf16 dequantization), the same bits as
//       bf16_linear on those weights. isa "" picks as bf16_linear does (pick_path), brgemm apart: a
//       bf16 x takes the vdpbf16ps tiles, or from kSlowDotRows rows on Intel's cores the weights
//       widened to float32 (a float32 copy of x); a float32 x the widened weights.
//   fp8_fast() -> bool: the widening runs on vectors here (AVX512-VBMI byte lookups, detect_isa()
//       AVX-512); where it does not, srt keeps an FP8 layer's codes in bf16 instead (two bytes a
//       weight, bf16_linear) rather than widen byte by byte. fp8_fast_blocks(): the scaled widening
//       too (AVX512-VBMI and AVX512-BF16's rounding); elsewhere block-scaled codes are dequantized.
//
// The widening (AVX512-VBMI): 64 codes a load; two 128-entry byte lookups (vpermi2b) give each
// code's bf16 low and high byte from its 7 magnitude bits, the sign bit XORed into the high byte, and
// an interleave (vpunpck{l,h}bw) writes 64 bf16 in the natural order. Elsewhere a 128-entry table,
// one code at a time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "bf16_tiles.h"
#include "cpu_ops.h"
#include "vec.h"

namespace srt_cpu {
namespace {

constexpr int64_t kPairBytes = 2 * kNR;  // the codes of one pair of k of a panel
// pairs of k widened at a time, over the panels a tile takes at once: one tile of rows 64 (8 KiB of
// bf16), several 256 of one panel (32 KiB; the tiles' accumulators go to memory and back once a
// block); in L1 while every tile of rows takes them
constexpr int64_t kWidenedPairsOneTile = 64;
constexpr int64_t kWidenedPairs = 256;
// bytes of codes ahead the widening prefetches (the blocks of a panel follow each other in memory)
constexpr int64_t kPfDist = 2048;
constexpr int kMaxNP = 4;

// bf16 bits of every e4m3 magnitude (the sign apart): [0, 128) low bytes, then [128, 256) high bytes
// and their float32 values (`values`, the scaled tables' products start from them)
struct Fp8Table {
  alignas(64) std::array<uint8_t, 256> bytes{};
  alignas(64) std::array<float, 128> values{};
  Fp8Table() {
    for (int m = 0; m < 128; ++m) {
      const float v = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(m), c10::Float8_e4m3fn::from_bits()));
      values[m] = v;
      uint32_t u;
      std::memcpy(&u, &v, sizeof u);
      const uint16_t b = static_cast<uint16_t>(u >> 16);  // exact: 3 mantissa bits, no rounding
      bytes[m] = static_cast<uint8_t>(b & 0xFF);
      bytes[128 + m] = static_cast<uint8_t>(b >> 8);
    }
  }
};

const Fp8Table& fp8_table() {
  static const Fp8Table t;
  return t;
}

// natural index i (0 .. 63) of a pair row -> its byte in the stored order
inline int stored_byte(int i) { return 16 * ((i % 32) / 8) + 8 * (i / 32) + i % 8; }

bool cpu_has_vbmi() {
#if SRT_CPU_X86
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bw");
  }();
  return has && detect_isa() == CpuIsa::kAvx512;
#else
  return false;
#endif
}

// The scale of each pair row of a block-scaled panel: scales[k / block_k] for its k (pairs of k never
// straddle two blocks: block_k is even); none for plain codes (their scales are on the outputs).
struct BlockScales {
  const float* scales = nullptr;  // this panel's row of the scale grid, or null
  int64_t k0 = 0;                 // k of the first pair row widened
  int64_t block_k = 0;
  float at(int64_t r) const { return scales[(k0 + 2 * r) / block_k]; }
};

// `pairs` pair rows of codes (stored order) -> bf16 bits, natural order: the codes themselves, or
// round-to-nearest-even bf16 of code x its block's scale (the products in float32)
void widen_scalar(const uint8_t* src, int64_t pairs, uint16_t* dst, const BlockScales& bs) {
  const Fp8Table& t = fp8_table();
  for (int64_t r = 0; r < pairs; ++r, src += kPairBytes, dst += kPairBytes)
    for (int i = 0; i < kPairBytes; ++i) {
      const uint8_t c = src[stored_byte(i)], m = c & 0x7F;
      uint16_t b = static_cast<uint16_t>(t.bytes[m] | ((t.bytes[128 + m] | (c & 0x80)) << 8));
      if (bs.scales != nullptr) b = c10::BFloat16(bf16_bits_to_float(b) * bs.at(r)).x;  // sign in the product
      dst[i] = b;
    }
}

// A thread's tables of the last scale (a tile's panels share their row block's scales, so
// consecutive calls of one block of k find them built)
struct ScaledTables {
  float s = std::numeric_limits<float>::quiet_NaN();
  alignas(64) uint8_t bytes[256];
};

#if SRT_CPU_X86
#define SRT_TARGET_AVX512_VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi,avx2,fma,f16c")))
#define SRT_TARGET_AVX512_VBMI_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")))

// 64 codes -> *w0 (natural 0 .. 31), *w1 (32 .. 63) as bf16 bits
#define SRT_WIDEN64(src, w0, w1)                                                                         \
  do {                                                                                                   \
    _mm_prefetch(reinterpret_cast<const char*>((src) + kPfDist), _MM_HINT_T0);                           \
    const __m512i c_ = _mm512_loadu_si512(src);                                                          \
    const __m512i lo_ = _mm512_permutex2var_epi8(lo0, c_, lo1); /* index bit 6 picks the table */       \
    const __m512i hi_ = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, c_, hi1), c_, sign, 0x78); \
    w0 = _mm512_unpacklo_epi8(lo_, hi_);                                                                 \
    w1 = _mm512_unpackhi_epi8(lo_, hi_);                                                                 \
  } while (0)

#define SRT_WIDEN_TABLES                                                                  \
  const uint8_t* t = fp8_table().bytes.data();                                            \
  const __m512i lo0 = _mm512_load_si512(t), lo1 = _mm512_load_si512(t + 64);              \
  const __m512i hi0 = _mm512_load_si512(t + 128), hi1 = _mm512_load_si512(t + 192);       \
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80))

SRT_TARGET_AVX512_VBMI void widen_vbmi(const uint8_t* src, int64_t pairs, uint16_t* dst) {
  SRT_WIDEN_TABLES;
  for (int64_t r = 0; r < pairs; ++r, src += kPairBytes, dst += kPairBytes) {
    __m512i w0, w1;
    SRT_WIDEN64(src, w0, w1);
    _mm512_storeu_si512(dst, w0);
    _mm512_storeu_si512(dst + 32, w1);
  }
}

// 64 bytes: a's 32 words' low (shift 0) or high (shift 8) bytes, then b's
SRT_TARGET_AVX512_VBMI_BF16 inline __m512i word_bytes(__m512i a, __m512i b, int shift) {
  const __m256i la = _mm512_cvtepi16_epi8(_mm512_srli_epi16(a, shift));
  const __m256i lb = _mm512_cvtepi16_epi8(_mm512_srli_epi16(b, shift));
  return _mm512_inserti64x4(_mm512_castsi256_si512(la), lb, 1);
}

// The lookup tables of a block's scale s: bf16(value(m) x s) for the 128 magnitudes m, the product
// in float32 and rounded to nearest even (vcvtne2ps2bf16, as c10::BFloat16); the code's sign bit is
// XORed into the high byte (a negative s's sign is in the table). Built again when s changes (once a
// block of k), so a scaled code costs the same lookups as a plain one.
SRT_TARGET_AVX512_VBMI_BF16 void scaled_tables(float s, __m512i* lo0, __m512i* lo1, __m512i* hi0, __m512i* hi1) {
  const float* v = fp8_table().values.data();
  const __m512 sv = _mm512_set1_ps(s);
  __m512i w[4];  // magnitudes 32j .. 32j + 31
  for (int j = 0; j < 4; ++j)
    w[j] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_load_ps(v + 32 * j + 16), sv),
                                        _mm512_mul_ps(_mm512_load_ps(v + 32 * j), sv));
  *lo0 = word_bytes(w[0], w[1], 0);
  *lo1 = word_bytes(w[2], w[3], 0);
  *hi0 = word_bytes(w[0], w[1], 8);
  *hi1 = word_bytes(w[2], w[3], 8);
}

SRT_TARGET_AVX512_VBMI_BF16 void widen_vbmi_scaled(const uint8_t* src, int64_t pairs, uint16_t* dst,
                                                   const BlockScales& bs, ScaledTables& cache) {
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i lo0, lo1, hi0, hi1;
  int64_t blk = bs.k0 / bs.block_k;
  float s = bs.scales[blk];
  const bool cached = s == cache.s;
  if (cached) {
    lo0 = _mm512_load_si512(cache.bytes);
    lo1 = _mm512_load_si512(cache.bytes + 64);
    hi0 = _mm512_load_si512(cache.bytes + 128);
    hi1 = _mm512_load_si512(cache.bytes + 192);
  } else {
    scaled_tables(s, &lo0, &lo1, &hi0, &hi1);
  }
  bool built = !cached;
  for (int64_t r = 0; r < pairs; ++blk) {  // runs of pair rows in one block of k (bs.k0 and block_k even)
    if (bs.scales[blk] != s) {
      scaled_tables(s = bs.scales[blk], &lo0, &lo1, &hi0, &hi1);
      built = true;
    }
    const int64_t end = std::min(pairs, ((blk + 1) * bs.block_k - bs.k0) / 2);
    for (; r < end; ++r, src += kPairBytes, dst += kPairBytes) {
      __m512i w0, w1;
      SRT_WIDEN64(src, w0, w1);
      _mm512_storeu_si512(dst, w0);
      _mm512_storeu_si512(dst + 32, w1);
    }
  }
  if (built) {  // the last scale's tables, for the next call
    cache.s = s;
    _mm512_store_si512(cache.bytes, lo0);
    _mm512_store_si512(cache.bytes + 64, lo1);
    _mm512_store_si512(cache.bytes + 128, hi0);
    _mm512_store_si512(cache.bytes + 192, hi1);
  }
}
#undef SRT_WIDEN64
#undef SRT_WIDEN_TABLES
#endif

// vbmi: the byte lookups; their scaled form also needs the CPU's bf16 conversion (vbmi_bf16)
void widen(bool vbmi, bool vbmi_bf16, const uint8_t* src, int64_t pairs, uint16_t* dst, const BlockScales& bs,
           ScaledTables& cache) {
#if SRT_CPU_X86
  if (vbmi && bs.scales == nullptr) return widen_vbmi(src, pairs, dst);
  if (vbmi_bf16 && bs.scales != nullptr) return widen_vbmi_scaled(src, pairs, dst, bs, cache);
#endif
  widen_scalar(src, pairs, dst, bs);
}

// bytes after a block-scaled panel's codes: block_k, Kb scales, up to a multiple of 64
inline int64_t trailer_bytes(int64_t Kb) { return (4 + 4 * Kb + 63) / 64 * 64; }

// A packed weight: P panels pstride bytes apart, each K/2 pair rows of codes, then (block-scaled)
// an int32 block_k and the float32 scales of the panel's row block, one a block of k.
struct Fp8Layout {
  const uint8_t* w;
  int64_t P, Kh, pstride;
  int64_t block_k = 0;  // 0: plain codes (their scales on the outputs, outside)

  const uint8_t* codes(int64_t p, int64_t k0) const { return w + p * pstride + k0 / 2 * kPairBytes; }
  BlockScales scales(int64_t p, int64_t k0) const {
    if (block_k == 0) return {};
    return {reinterpret_cast<const float*>(w + p * pstride + Kh * kPairBytes + 4), k0, block_k};
  }
};

// Threads take groups of kMaxNP panels. One tile of rows (M <= the tile's rows) takes a few panels at
// once, as bf16_linear does; more rows take one panel at a time (bf16_linear's blocked path). Per
// block of k those panels' codes widen into `wbuf` (16 KiB, in L1) and every tile of rows sums that
// block on into its rows' float32 accumulators (rows_c).
// x of XT (bf16 or float32), out of OT (x's dtype, or bf16 for a float32 copy of a bf16 x)
template <typename XT, typename OT>
void run_fp8(Bf16Path path, bool vbmi, bool vbmi_bf16, const at::Tensor& x, const Fp8Layout& lay, int64_t N,
             const float* bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), P = lay.P;
  const XT* xa = x.data_ptr<XT>();
  const int64_t lda = x.stride(0);
  OT* o = out.data_ptr<OT>();
  const int MR = tile_rows(path);
  const int at_once = M <= MR ? panels_at_once(path, static_cast<int>(M)) : 1;
  const int64_t kb = (M <= MR ? kWidenedPairsOneTile : kWidenedPairs) * 2 / at_once;  // k a block
  constexpr int64_t ldc = kMaxNP * kNR;
  at::parallel_for(0, (P + kMaxNP - 1) / kMaxNP, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float bias_group[ldc];
    std::vector<float> rows_c(M * ldc);
    alignas(64) uint16_t wbuf[kWidenedPairs * kPairBytes];
    ScaledTables tables;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * kMaxNP, np = std::min<int64_t>(kMaxNP, P - p0);
      const int64_t cols = std::min(np * kNR, N - p0 * kNR);
      if (bias) {
        std::fill(bias_group, bias_group + ldc, 0.f);
        std::copy(bias + p0 * kNR, bias + p0 * kNR + cols, bias_group);
      }
      for (int64_t p = 0; p < np;) {  // sub-groups of at_once panels, single ones at the tail
        const int n = p + at_once <= np ? at_once : 1;
        for (int64_t k0 = 0; k0 < K; k0 += kb) {
          const int64_t kc = std::min(kb, K - k0), bstride = kc / 2 * kPairBytes;
          for (int q = 0; q < n; ++q)
            widen(vbmi, vbmi_bf16, lay.codes(p0 + p + q, k0), kc / 2, wbuf + q * bstride, lay.scales(p0 + p + q, k0),
                  tables);
          for (int64_t m = 0; m < M; m += MR)
            run_tile<XT>(path, static_cast<int>(std::min<int64_t>(MR, M - m)), n, xa + m * lda + k0, lda, kc, wbuf,
                         bstride, bias ? bias_group + p * kNR : nullptr, rows_c.data() + m * ldc + p * kNR, ldc,
                         k0 > 0);
        }
        p += n;
      }
      for (int64_t m = 0; m < M; m += MR)
        store_tile<OT>(static_cast<int>(std::min<int64_t>(MR, M - m)), rows_c.data() + m * ldc, cols, ldc,
                       o + m * N + p0 * kNR, N);
    }
  });
}

// The layout of `packed` for an x of K columns, checked
Fp8Layout layout_of(const at::Tensor& packed, int64_t K) {
  const char* shape = "fp8_linear: packed must come from pack_fp8_weight ([P, K/2, 64] uint8, or [P, bytes] with "
                      "block scales)";
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  (packed.dim() == 2 || (packed.dim() == 3 && packed.size(2) == kPairBytes)),
              shape, ", got ", packed.sizes());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t P = packed.size(0);
  if (packed.dim() == 3) {
    TORCH_CHECK(K == 2 * packed.size(1), "fp8_linear: x has ", K, " columns, the packed weight ", 2 * packed.size(1));
    return {w, P, packed.size(1), packed.size(1) * kPairBytes};
  }
  const int64_t Kh = K / 2, bytes = packed.size(1), trailer = bytes - Kh * kPairBytes;
  int32_t block_k = 0;
  if (P > 0 && trailer >= 4) std::memcpy(&block_k, w + Kh * kPairBytes, sizeof block_k);
  TORCH_CHECK(K % 2 == 0 && block_k > 0 && trailer == trailer_bytes((K + block_k - 1) / block_k), "fp8_linear: x has ",
              K, " columns, which does not match the block-scaled packed weight (", bytes, " bytes a panel)");
  return {w, P, Kh, bytes, block_k};
}

}  // namespace

bool fp8_fast() { return cpu_has_vbmi(); }

bool fp8_fast_blocks() { return cpu_has_vbmi() && cpu_has_avx512_bf16(); }

at::Tensor pack_fp8_weight(const at::Tensor& codes, const c10::optional<at::Tensor>& block_scale, int64_t block_n,
                           int64_t block_k) {
  TORCH_CHECK(codes.device().is_cpu() && codes.dim() == 2 && codes.scalar_type() == at::kFloat8_e4m3fn,
              "pack_fp8_weight: codes must be a float8_e4m3fn CPU tensor [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(K % 2 == 0, "pack_fp8_weight: K must be even (pairs of k), got ", K);
  const at::Tensor bytes = codes.contiguous().view(at::kByte);
  TORCH_CHECK(!bytes.bitwise_and(0x7F).eq(0x7F).any().item<bool>(), "pack_fp8_weight: the codes hold a NaN");
  const int64_t P = (N + kNR - 1) / kNR, Kh = K / 2;
  at::Tensor padded = at::zeros({P * kNR, K}, bytes.options());
  padded.narrow(0, 0, N).copy_(bytes);
  // (p, j, kh, t) -> (p, kh, j, t): natural pair rows; then i = 32 h + 8 l + t -> 16 l + 8 h + t
  at::Tensor packed = padded.view({P, kNR, Kh, 2})
                          .permute({0, 2, 1, 3})
                          .reshape({P, Kh, 2, 4, 8})
                          .permute({0, 1, 3, 2, 4})
                          .contiguous()
                          .view({P, Kh, kPairBytes});
  if (!block_scale.has_value() || !block_scale->defined()) return packed;
  // block scales: each panel's codes, block_k, its row block's scales
  TORCH_CHECK(block_n > 0 && block_n % kNR == 0 && block_k > 0 && block_k % 2 == 0,
              "pack_fp8_weight: blocks must be a multiple of 32 rows and an even number of columns, got ", block_n,
              " x ", block_k);
  const int64_t Nb = (N + block_n - 1) / block_n, Kb = (K + block_k - 1) / block_k;
  TORCH_CHECK(block_scale->scalar_type() == at::kFloat && block_scale->dim() == 2 && block_scale->size(0) == Nb &&
                  block_scale->size(1) == Kb,
              "pack_fp8_weight: block_scale must be float32 [", Nb, ", ", Kb, "], got ", block_scale->sizes());
  at::Tensor out = at::zeros({P, Kh * kPairBytes + trailer_bytes(Kb)}, packed.options());
  out.narrow(1, 0, Kh * kPairBytes).copy_(packed.view({P, Kh * kPairBytes}));
  const at::Tensor sc = block_scale->contiguous();
  const int32_t bk = static_cast<int32_t>(block_k);
  for (int64_t p = 0; p < P; ++p) {
    uint8_t* t = out.data_ptr<uint8_t>() + p * out.size(1) + Kh * kPairBytes;
    std::memcpy(t, &bk, 4);
    std::memcpy(t + 4, sc.data_ptr<float>() + p * kNR / block_n * Kb, 4 * Kb);
  }
  return out;
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                      c10::string_view isa) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "fp8_linear: x must be a bf16 or float32 CPU tensor [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  const Fp8Layout lay = layout_of(packed, K);
  const int64_t P = lay.P;
  TORCH_CHECK(N > (P - 1) * kNR && N <= P * kNR, "fp8_linear: N = ", N, " does not match ", P, " panels of ", kNR);
  const at::Tensor b32 = float32_bias("fp8_linear", bias, N);
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  const Bf16Path path = pick_path("fp8_linear", isa, x_bf16, M, 0, false);
  const bool vbmi = cpu_has_vbmi() && path >= Bf16Path::kAvx512;
  const bool vbmi_bf16 = vbmi && cpu_has_avx512_bf16();
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return b32.defined() ? out.copy_(b32.view({1, N}).expand({M, N})) : out.zero_();
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  if (x_bf16 && path == Bf16Path::kAvx512Bf16) {
    run_fp8<at::BFloat16, at::BFloat16>(path, vbmi, vbmi_bf16, xc, lay, N, bp, out);
  } else if (x_bf16) {  // the widened paths take a float32 copy of x (exact), out in bf16
    run_fp8<float, at::BFloat16>(path, vbmi, vbmi_bf16, xc.to(at::kFloat), lay, N, bp, out);
  } else {
    run_fp8<float, float>(path, vbmi, vbmi_bf16, xc, lay, N, bp, out);
  }
  return out;
}

namespace {
at::Tensor fp8_linear_meta(const at::Tensor& x, const at::Tensor&, int64_t N, const c10::optional<at::Tensor>&,
                           c10::string_view) {
  return at::empty({x.size(0), N}, x.options());
}
bool fp8_fast_op() { return fp8_fast(); }
bool fp8_fast_blocks_op() { return fp8_fast_blocks(); }
}  // namespace
}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("pack_fp8_weight(Tensor codes, Tensor? block_scale=None, int block_n=0, int block_k=0) -> Tensor");
  m.def("fp8_linear(Tensor x, Tensor packed, int n, Tensor? bias=None, str isa=\"\") -> Tensor");
  m.def("fp8_fast() -> bool", &srt_cpu::fp8_fast_op);
  m.def("fp8_fast_blocks() -> bool", &srt_cpu::fp8_fast_blocks_op);
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) {
  m.impl("pack_fp8_weight", &srt_cpu::pack_fp8_weight);
  m.impl("fp8_linear", &srt_cpu::fp8_linear);
}

TORCH_LIBRARY_IMPL(srt_cpu, Meta, m) { m.impl("fp8_linear", &srt_cpu::fp8_linear_meta); }

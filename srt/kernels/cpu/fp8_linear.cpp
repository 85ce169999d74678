// FP8 (e4m3) linear layers on weights kept in one byte: out [M, N] = x [M, K] @ codes[N, K]^T (+ bias),
// float32 accumulation. The codes are an FP8 checkpoint's (its scales multiply the outputs outside,
// Linear.output_scale); each is exact in bf16, so the codes widen to bf16 panels block by block on the
// way, in cache, and bf16_linear's register tiles (bf16_tiles.h) take them.
//
//   pack_fp8_weight(codes [N, K] float8_e4m3fn, K even) -> packed uint8 [P, K/2, 64]
//       P = ceil(N / 32): panel p, pair of k kh: the 64 codes of pack_bf16_weight's [32, 2] pair row
//       (column j's k and k+1 at 2j, 2j+1), stored in the order the widening below reads them:
//       natural index i = 32 h + 8 l + t at byte 16 l + 8 h + t. Zeros past N. A NaN code is refused.
//   fp8_linear(x [M, K] bf16 or float32, packed, N, bias [N]?, isa = "") -> out [M, N], x's dtype:
//       the same bits as bf16_linear(x, pack_bf16_weight(codes in bf16), N, bias, isa) on the same
//       path (the tiles sum each output over k in pair order, one chain, whatever the blocks).
//   fp8_fast() -> bool: the widening runs on vectors here (AVX512-VBMI byte lookups, detect_isa()
//       AVX-512); where it does not, srt keeps an FP8 layer's codes in bf16 instead (two bytes a
//       weight, bf16_linear) rather than widen byte by byte.
//
// The widening (AVX512-VBMI): 64 codes a load; two 128-entry byte lookups (vpermi2b) give each
// code's bf16 low and high byte from its 7 magnitude bits, the sign bit ORed into the high byte, and
// an interleave (vpunpck{l,h}bw) writes 64 bf16 in the natural order. Elsewhere a 128-entry table,
// one code at a time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
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
struct Fp8Table {
  alignas(64) std::array<uint8_t, 256> bytes{};
  Fp8Table() {
    for (int m = 0; m < 128; ++m) {
      const float v = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(m), c10::Float8_e4m3fn::from_bits()));
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

// `pairs` pair rows of codes (stored order) -> bf16 bits, natural order
void widen_scalar(const uint8_t* src, int64_t pairs, uint16_t* dst) {
  const Fp8Table& t = fp8_table();
  for (int64_t r = 0; r < pairs; ++r, src += kPairBytes, dst += kPairBytes)
    for (int i = 0; i < kPairBytes; ++i) {
      const uint8_t c = src[stored_byte(i)], m = c & 0x7F;
      dst[i] = static_cast<uint16_t>(t.bytes[m] | ((t.bytes[128 + m] | (c & 0x80)) << 8));
    }
}

#if SRT_CPU_X86
#define SRT_TARGET_AVX512_VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi,avx2,fma,f16c")))
SRT_TARGET_AVX512_VBMI void widen_vbmi(const uint8_t* src, int64_t pairs, uint16_t* dst) {
  const uint8_t* t = fp8_table().bytes.data();
  const __m512i lo0 = _mm512_load_si512(t), lo1 = _mm512_load_si512(t + 64);
  const __m512i hi0 = _mm512_load_si512(t + 128), hi1 = _mm512_load_si512(t + 192);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t r = 0; r < pairs; ++r, src += kPairBytes, dst += kPairBytes) {
    _mm_prefetch(reinterpret_cast<const char*>(src + kPfDist), _MM_HINT_T0);
    const __m512i c = _mm512_loadu_si512(src);
    const __m512i lo = _mm512_permutex2var_epi8(lo0, c, lo1);  // index bit 6 picks the table, bit 7 unused
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, c, hi1), c, sign, 0xF8);  // a|(b&c)
    _mm512_storeu_si512(dst, _mm512_unpacklo_epi8(lo, hi));
    _mm512_storeu_si512(dst + 32, _mm512_unpackhi_epi8(lo, hi));
  }
}
#endif

void widen(bool vbmi, const uint8_t* src, int64_t pairs, uint16_t* dst) {
#if SRT_CPU_X86
  if (vbmi) return widen_vbmi(src, pairs, dst);
#endif
  widen_scalar(src, pairs, dst);
}

// Threads take groups of kMaxNP panels. One tile of rows (M <= the tile's rows) takes a few panels at
// once, as bf16_linear does; more rows take one panel at a time (bf16_linear's blocked path). Per
// block of k those panels' codes widen into `wbuf` (16 KiB, in L1) and every tile of rows sums that
// block on into its rows' float32 accumulators (rows_c).
template <typename XT>
void run_fp8(Bf16Path path, bool vbmi, const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias,
             at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), Kh = packed.size(1);
  const XT* xa = x.data_ptr<XT>();
  const int64_t lda = x.stride(0);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  XT* o = out.data_ptr<XT>();
  const int MR = tile_rows(path);
  const int at_once = M <= MR ? panels_at_once(path, static_cast<int>(M)) : 1;
  const int64_t kb = (M <= MR ? kWidenedPairsOneTile : kWidenedPairs) * 2 / at_once;  // k a block
  constexpr int64_t ldc = kMaxNP * kNR;
  at::parallel_for(0, (P + kMaxNP - 1) / kMaxNP, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float bias_group[ldc];
    std::vector<float> rows_c(M * ldc);
    alignas(64) uint16_t wbuf[kWidenedPairs * kPairBytes];
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
            widen(vbmi, w + ((p0 + p + q) * Kh + k0 / 2) * kPairBytes, kc / 2, wbuf + q * bstride);
          for (int64_t m = 0; m < M; m += MR)
            run_tile<XT>(path, static_cast<int>(std::min<int64_t>(MR, M - m)), n, xa + m * lda + k0, lda, kc, wbuf,
                         bstride, bias ? bias_group + p * kNR : nullptr, rows_c.data() + m * ldc + p * kNR, ldc,
                         k0 > 0);
        }
        p += n;
      }
      for (int64_t m = 0; m < M; m += MR)
        store_tile<XT>(static_cast<int>(std::min<int64_t>(MR, M - m)), rows_c.data() + m * ldc, cols, ldc,
                       o + m * N + p0 * kNR, N);
    }
  });
}

}  // namespace

bool fp8_fast() { return cpu_has_vbmi(); }

at::Tensor pack_fp8_weight(const at::Tensor& codes) {
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
  return padded.view({P, kNR, Kh, 2})
      .permute({0, 2, 1, 3})
      .reshape({P, Kh, 2, 4, 8})
      .permute({0, 1, 3, 2, 4})
      .contiguous()
      .view({P, Kh, kPairBytes});
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                      c10::string_view isa) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "fp8_linear: x must be a bf16 or float32 CPU tensor [M, K]");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  packed.size(2) == kPairBytes && packed.is_contiguous(),
              "fp8_linear: packed must come from pack_fp8_weight ([P, K/2, 64] uint8), got ", packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(K == 2 * packed.size(1), "fp8_linear: x has ", K, " columns, the packed weight ", 2 * packed.size(1));
  TORCH_CHECK(N > (P - 1) * kNR && N <= P * kNR, "fp8_linear: N = ", N, " does not match ", P, " panels of ", kNR);
  at::Tensor b32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "fp8_linear: bias must have ", N, " elements, got ", bias->numel());
    b32 = bias->to(at::kFloat).contiguous();
  }
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  const Bf16Path path = pick_path("fp8_linear", isa, x_bf16, M, 0, false);
  const bool vbmi = cpu_has_vbmi() && path >= Bf16Path::kAvx512;
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return b32.defined() ? out.copy_(b32.view({1, N}).expand({M, N})) : out.zero_();
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  if (x_bf16) {
    run_fp8<at::BFloat16>(path, vbmi, xc, packed, N, bp, out);
  } else {
    run_fp8<float>(path, vbmi, xc, packed, N, bp, out);
  }
  return out;
}

namespace {
at::Tensor fp8_linear_meta(const at::Tensor& x, const at::Tensor&, int64_t N, const c10::optional<at::Tensor>&,
                           c10::string_view) {
  return at::empty({x.size(0), N}, x.options());
}
bool fp8_fast_op() { return fp8_fast(); }
}  // namespace
}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("pack_fp8_weight(Tensor codes) -> Tensor");
  m.def("fp8_linear(Tensor x, Tensor packed, int n, Tensor? bias=None, str isa=\"\") -> Tensor");
  m.def("fp8_fast() -> bool", &srt_cpu::fp8_fast_op);
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) {
  m.impl("pack_fp8_weight", &srt_cpu::pack_fp8_weight);
  m.impl("fp8_linear", &srt_cpu::fp8_linear);
}

TORCH_LIBRARY_IMPL(srt_cpu, Meta, m) { m.impl("fp8_linear", &srt_cpu::fp8_linear_meta); }

// W8A8 matmuls: int8 weights with one scale a row (a compressed-tensors W8A8 checkpoint's layers)
// times activations quantized to int8 per row (token), as the scheme says; integer dot products,
// one float scaling per output.
//
//   gguf_pack_w8a8(data [N, K / 32 * 34] u8) -> packed [G, 16 + P * 256] u8
//       Q8_0 rows whose blocks all carry the row's scale (QuantizedWeight.use_token_int8 checks)
//       regrouped once at load, G = ceil(N / 4) groups of 4 rows (the last padded with zero rows),
//       P = ceil(K / 64) pairs of blocks (the last padded with zero codes): each group starts with
//       its 4 rows' scales as float32, then for each pair p the 4 rows' 64 codes of columns
//       64p .. 64p + 63, sign bit flipped (code + 128, as unsigned bytes; padding 0). The same
//       bytes as the checkpoint's codes and scales (N K + 4 N), one contiguous stream per group.
//   gguf_linear_w8a8(x [M, K] f32 or bf16, packed, N, bias?, isa) -> [M, N] in x's dtype
//       Each row of x (a bf16 one widened to float32, exactly): scale sa = max|x| / 127.5
//       (float32; a row of zeros: float32's epsilon), codes q = clamp(round-half-even(x / sa), -128, 127): the codes and scale of srt/layers/
//       linear.py's fake_quant_rows, bit for bit. Then out[m, n] = float(sum_k q[m, k] w[n, k]) *
//       (sa[m] * dw[n]) + bias[n]. The integer sums are exact (|sum| < 2^31 for K <= 65536), so a
//       row's outputs do not depend on the batch, the tiles or the threads, and against the float
//       reference (codes * scales multiplied in float32) only that reference's rounding differs.
//       A bf16 x (a W8A8 checkpoint served in bf16) gets the float32 outputs of its widening
//       rounded to bf16; the bias may be either dtype (taken as float32).
//   gguf_w8a8_fast() -> whether this CPU has the vector path (AVX-512 VNNI, and detect_isa() not
//       lowered below AVX-512); elsewhere the op runs scalar loops (tests, and isa "scalar" /
//       "avx2"), and srt keeps the float32 path instead.
//
// The vector path: _mm512_dpbusd_epi32 multiplies 64 unsigned bytes by 64 signed ones, adding each
// 4 consecutive products into one of 16 int32 lanes. The flipped weights are the unsigned operand,
// the activation codes the signed one, so both keep the full int8 range: sum (w + 128) q =
// sum w q + 128 sum q, and 128 sum q is one number per activation row. A tile is one group (4
// weight rows, one 64-byte load each per pair) by up to 4 activation rows: 16 accumulators, the
// group's codes read again from L1 for each 4 activation rows: K is taken in blocks of kPairBlock
// pairs (a group's 16 KiB and a tile's activations as much), so a long row (the down projection's
// 14336) does not stream a group from L2 once per 4 activation rows.
// Threads take blocks of 16 groups (a row's 64 outputs written together); activation rows go in
// chunks whose codes fit about 512 KiB (at most 128 rows), which stay in cache while every group
// passes over them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_ops.h"
#include "gguf_simple_rows.h"
#include "w8a8_codes.h"

#if SRT_CPU_X86
#include <immintrin.h>
#define SRT_TARGET_W8A8 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#endif

namespace srt_cpu {
namespace {

using w8a8::TokenCodes;
using w8a8::quantize_rows;

constexpr int64_t kBlock = 32, kBlockBytes = gguf_simple::kSizeQ8_0;
constexpr int64_t kRows = 4, kPair = 64, kHeader = 16;  // a group: 4 rows, 4 float32 scales first
constexpr int64_t kXRows = 4;     // activation rows a tile (6 made GCC spill accumulators)
constexpr int64_t kXChunk = 128;                         // at most this many activation rows a pass
constexpr int64_t kBlockGroups = 16;  // groups per task: 64 outputs of a row written together
constexpr int64_t kMaxK = 65536;
constexpr int64_t kPairBlock = 64;  // pairs of a K block (measured on Zen 5: K = 14336 from 0.95 to 1.5 TOP/s)
// while a tile reads a pair it prefetches as many bytes of the group this far ahead (the groups are
// in order; measured on Zen 5: without it the stream ran at about 60% of the read bandwidth)
constexpr int64_t kPrefetchGroups = 2;

bool vnni_available() {
#if SRT_CPU_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }();
  return ok;
#else
  return false;
#endif
}

int64_t pairs_of(int64_t K) { return (K + kPair - 1) / kPair; }
int64_t group_bytes(int64_t K) { return kHeader + pairs_of(K) * kRows * kPair; }

// dots[(i - i0) * ldd + r] = sum_k q[i][k] w_r[k] for the group at g and activation rows i0 .. i1
void dots_scalar(const uint8_t* g, int64_t P, const TokenCodes& t, int64_t i0, int64_t i1, int32_t* dots,
                 int64_t ldd) {
  const uint8_t* codes = g + kHeader;
  for (int64_t i = i0; i < i1; ++i) {
    const int8_t* q = t.q.data() + i * t.ldq;
    for (int64_t r = 0; r < kRows; ++r) {
      int32_t sum = 0;
      for (int64_t p = 0; p < P; ++p) {
        const uint8_t* w = codes + (p * kRows + r) * kPair;
        for (int64_t j = 0; j < kPair; ++j) sum += static_cast<int32_t>(w[j]) * q[p * kPair + j];
      }
      dots[(i - i0) * ldd + r] = sum - t.offset[i];
    }
  }
}

#if SRT_CPU_X86
// 4 accumulators of one activation row against the group's 4 weight rows
#define SRT_W8A8_ROW(acc, x)                       \
  acc##0 = _mm512_dpbusd_epi32(acc##0, w0, x);      \
  acc##1 = _mm512_dpbusd_epi32(acc##1, w1, x);      \
  acc##2 = _mm512_dpbusd_epi32(acc##2, w2, x);      \
  acc##3 = _mm512_dpbusd_epi32(acc##3, w3, x)
#define SRT_W8A8_STORE(acc, i)                                                   \
  if (first) {                                                                   \
    dots[(i) * ldd] = _mm512_reduce_add_epi32(acc##0) - offset[i];               \
    dots[(i) * ldd + 1] = _mm512_reduce_add_epi32(acc##1) - offset[i];           \
    dots[(i) * ldd + 2] = _mm512_reduce_add_epi32(acc##2) - offset[i];           \
    dots[(i) * ldd + 3] = _mm512_reduce_add_epi32(acc##3) - offset[i];           \
  } else {                                                                       \
    dots[(i) * ldd] += _mm512_reduce_add_epi32(acc##0);                          \
    dots[(i) * ldd + 1] += _mm512_reduce_add_epi32(acc##1);                      \
    dots[(i) * ldd + 2] += _mm512_reduce_add_epi32(acc##2);                      \
    dots[(i) * ldd + 3] += _mm512_reduce_add_epi32(acc##3);                      \
  }

// one group's pairs p0 .. p1 by MX (1 to 4) activation rows, 4 MX named accumulators (an array of
// them made GCC store every one to memory after each dot instruction), written to dots (``first``:
// the first K block) or added to them; PF: the K block's first tile, which prefetches the group
// kPrefetchGroups ahead (the others find the block's codes in L1)
template <int MX, bool PF>
SRT_TARGET_W8A8 void tile_vnni(const uint8_t* g, int64_t p0, int64_t p1, int64_t gbytes, const int8_t* q,
                               int64_t ldq, const int32_t* offset, int32_t* dots, int64_t ldd, bool first) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  __m512i c0 = a0, c1 = a0, c2 = a0, c3 = a0, d0 = a0, d1 = a0, d2 = a0, d3 = a0;
  const uint8_t* codes = g + kHeader;
  const uint8_t* ahead = codes + kPrefetchGroups * gbytes;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* wp = codes + p * kRows * kPair;
    if constexpr (PF) {
      for (int64_t off = 0; off < kRows * kPair; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + p * kRows * kPair + off), _MM_HINT_T0);
    }
    const __m512i w0 = _mm512_loadu_si512(wp), w1 = _mm512_loadu_si512(wp + kPair);
    const __m512i w2 = _mm512_loadu_si512(wp + 2 * kPair), w3 = _mm512_loadu_si512(wp + 3 * kPair);
    const int8_t* qp = q + p * kPair;
    const __m512i x0 = _mm512_loadu_si512(qp);
    SRT_W8A8_ROW(a, x0);
    if constexpr (MX > 1) {
      const __m512i x1 = _mm512_loadu_si512(qp + ldq);
      SRT_W8A8_ROW(b, x1);
    }
    if constexpr (MX > 2) {
      const __m512i x2 = _mm512_loadu_si512(qp + 2 * ldq);
      SRT_W8A8_ROW(c, x2);
    }
    if constexpr (MX > 3) {
      const __m512i x3 = _mm512_loadu_si512(qp + 3 * ldq);
      SRT_W8A8_ROW(d, x3);
    }
  }
  SRT_W8A8_STORE(a, 0);
  if constexpr (MX > 1) { SRT_W8A8_STORE(b, 1); }
  if constexpr (MX > 2) { SRT_W8A8_STORE(c, 2); }
  if constexpr (MX > 3) { SRT_W8A8_STORE(d, 3); }
}
#undef SRT_W8A8_ROW
#undef SRT_W8A8_STORE

template <bool PF>
void tile_rows(int64_t mx, const uint8_t* g, int64_t p0, int64_t p1, int64_t gbytes, const int8_t* q,
               int64_t ldq, const int32_t* off, int32_t* d, int64_t ldd, bool first) {
  switch (mx) {
    case 1: tile_vnni<1, PF>(g, p0, p1, gbytes, q, ldq, off, d, ldd, first); break;
    case 2: tile_vnni<2, PF>(g, p0, p1, gbytes, q, ldq, off, d, ldd, first); break;
    case 3: tile_vnni<3, PF>(g, p0, p1, gbytes, q, ldq, off, d, ldd, first); break;
    default: tile_vnni<4, PF>(g, p0, p1, gbytes, q, ldq, off, d, ldd, first); break;
  }
}

// the group's pairs p0 .. p1 against activation rows i0 .. i1 (written when p0 is 0, else added)
void dots_vnni(const uint8_t* g, int64_t p0, int64_t p1, int64_t gbytes, const TokenCodes& t, int64_t i0,
               int64_t i1, int32_t* dots, int64_t ldd) {
  for (int64_t i = i0; i < i1; i += kXRows) {
    const int64_t mx = std::min<int64_t>(kXRows, i1 - i);
    const int8_t* q = t.q.data() + i * t.ldq;
    int32_t* d = dots + (i - i0) * ldd;
    if (i == i0) {
      tile_rows<true>(mx, g, p0, p1, gbytes, q, t.ldq, t.offset.data() + i, d, ldd, p0 == 0);
    } else {
      tile_rows<false>(mx, g, p0, p1, gbytes, q, t.ldq, t.offset.data() + i, d, ldd, p0 == 0);
    }
  }
}
#endif

}  // namespace

bool gguf_w8a8_fast() { return detect_isa() == CpuIsa::kAvx512 && vnni_available(); }

at::Tensor gguf_pack_w8a8(const at::Tensor& data, c10::string_view layout) {
  const char* op = "gguf_pack_w8a8";
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous(),
              op, ": data must be contiguous uint8 Q8_0 rows [N, bytes per row]");
  const int64_t bpr = data.size(1);
  TORCH_CHECK(bpr > 0 && bpr % kBlockBytes == 0, op, ": Q8_0 rows take a multiple of 34 bytes, got ", bpr);
  TORCH_CHECK(layout == "groups" || layout == "amx", op, ": layout must be 'groups' or 'amx', got '", layout, "'");
  if (layout == "amx") return w8a8_pack_panels(data);
  const int64_t K = bpr / kBlockBytes * kBlock;
  return w8a8::regroup_rows<kBlock>(data, kRows, group_bytes(K), 0x80, [](int64_t r, int64_t k) {
    const int64_t b = k / kBlock;
    return kHeader + (b / 2 * kRows + r) * kPair + b % 2 * kBlock;
  });
}

namespace {

// the groups' kernel; T: x's and the output's element type (float or at::BFloat16)
template <typename T>
void run_groups(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bp, bool scalar,
                at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), G = (N + kRows - 1) / kRows, P = pairs_of(K);
  const TokenCodes t = quantize_rows(x.data_ptr<T>(), x.stride(0), M, K, !scalar);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t gbytes = group_bytes(K);
  T* y = out.data_ptr<T>();
  const int64_t blocks = (G + kBlockGroups - 1) / kBlockGroups;
  // activation rows per pass: a K block of their codes in about 512 KiB (a core's L2 share), 16 to
  // kXChunk; a pass over more than one tile of rows takes K block by block, every group of a
  // task's 16 for each block (one tile streams each group whole: the weights in order from DRAM)
  const int64_t chunk = std::clamp<int64_t>((512 << 10) / std::min(t.ldq, kPairBlock * kPair), 16, kXChunk);
  for (int64_t c0 = 0; c0 < M; c0 += chunk) {
    const int64_t c1 = std::min(M, c0 + chunk);
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      constexpr int64_t ldd = kBlockGroups * kRows;  // one block's outputs of an activation row
      static_assert(ldd <= w8a8::kMaxRowOut, "a block's outputs of a row are stored at once");
      int32_t dots[kXChunk * ldd];
      float dw[ldd];
      const int64_t kstep = !scalar && c1 - c0 > kXRows ? kPairBlock : P;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t ga = b * kBlockGroups, gz = std::min(G, ga + kBlockGroups);
        for (int64_t g = ga; g < gz; ++g) std::memcpy(dw + (g - ga) * kRows, w + g * gbytes, kRows * sizeof(float));
        for (int64_t p0 = 0; p0 < P; p0 += kstep) {
          for (int64_t g = ga; g < gz; ++g) {
            const uint8_t* grp = w + g * gbytes;
#if SRT_CPU_X86
            if (!scalar) {
              dots_vnni(grp, p0, std::min(P, p0 + kstep), gbytes, t, c0, c1, dots + (g - ga) * kRows, ldd);
            } else {
              dots_scalar(grp, P, t, c0, c1, dots + (g - ga) * kRows, ldd);
            }
#else
            dots_scalar(grp, P, t, c0, c1, dots + (g - ga) * kRows, ldd);
#endif
          }
        }
        const int64_t n0 = ga * kRows, cols = std::min(N, gz * kRows) - n0;
        for (int64_t i = c0; i < c1; ++i) {
          w8a8::store_scaled(dots + (i - c0) * ldd, t.scale[i], dw, bp != nullptr ? bp + n0 : nullptr, cols,
                             y + i * N + n0);
        }
      }
    });
  }
}

}  // namespace

at::Tensor gguf_linear_w8a8(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                            const c10::optional<at::Tensor>& bias, c10::string_view isa) {
  const char* op = "gguf_linear_w8a8";
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2,
              op, ": x must be a float32 or bf16 CPU tensor [M, K], got ", x.scalar_type(), " with ", x.dim(),
              " dims");
  TORCH_CHECK(x.size(1) <= 1 || x.stride(1) == 1, op, ": x's last dim must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), G = (N + kRows - 1) / kRows;
  TORCH_CHECK(K > 0 && K % kBlock == 0 && K <= kMaxK, op, ": the row length ", K,
              " must be a positive multiple of 32 up to ", kMaxK);
  const bool panels = w8a8_is_panels(packed, N, K);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.dim() == 2 && (panels || (packed.size(0) == G && packed.size(1) == group_bytes(K))),
              op, ": packed must be gguf_pack_w8a8's [", G, ", ", group_bytes(K), "] (groups) or its AMX panels, uint8, for ",
              N, " rows of ", K);
  const bool avx512 = requested_isa(op, isa) == CpuIsa::kAvx512;
  const at::Tensor b32 = float32_bias(op, bias, N);
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  if (panels) return w8a8_linear_panels(x, packed, N, bp, avx512 && w8a8_amx_available());
  const bool scalar = !avx512 || !vnni_available();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (x.scalar_type() == at::kBFloat16) {
    run_groups<at::BFloat16>(x, packed, N, bp, scalar, out);
  } else {
    run_groups<float>(x, packed, N, bp, scalar, out);
  }
  return out;
}

namespace {
bool gguf_w8a8_fast_op() { return gguf_w8a8_fast(); }
bool gguf_w8a8_amx_op() { return w8a8_amx_available(); }
}  // namespace

}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("gguf_pack_w8a8(Tensor data, str layout=\"groups\") -> Tensor");
  m.def("gguf_linear_w8a8(Tensor x, Tensor packed, int n, Tensor? bias=None, str isa=\"\") -> Tensor");
  m.def("gguf_w8a8_fast() -> bool", &srt_cpu::gguf_w8a8_fast_op);
  m.def("gguf_w8a8_amx() -> bool", &srt_cpu::gguf_w8a8_amx_op);
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) {
  m.impl("gguf_pack_w8a8", &srt_cpu::gguf_pack_w8a8);
  m.impl("gguf_linear_w8a8", &srt_cpu::gguf_linear_w8a8);
}

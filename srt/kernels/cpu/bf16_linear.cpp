// bf16 linear layers on weights packed once at load: out [M, N] = x [M, K] @ w[N, K]^T (+ bias),
// float32 accumulation.
//
//   pack_bf16_weight(w [N, K] bf16 or float32, K even) -> packed [P, K/2, 32, 2] bf16
//       P = ceil(N / 32): panel p holds output columns 32p .. 32p+31, one row of 32 (k, k+1) pairs
//       per pair of k (VNNI pairs: the layout vdpbf16ps, AMX tiles and oneDNN's brgemm read), zeros
//       past N. A float32 weight is rounded to bf16 (exact for a bf16 checkpoint). An odd K (no
//       model has one) is refused: x's K must then equal the weight's exactly.
//   bf16_linear(x [M, K] bf16 or float32, packed, N, bias [N]?, isa = "") -> out [M, N], x's dtype
//   bf16_linear_silu_mul(x, packed, N, bias?) -> [M, N / 2]: silu_and_mul of bf16_linear's output (a
//       gate/up weight, gate rows first), the same bits; on the brgemm path with N / 2 a multiple of
//       32 in one pass (each gate panel with its up panel, the activation applied as the sums are
//       stored), else the two ops one after the other.
//
// The paths (`isa`: "" picks, or one named to test it):
//   "brgemm"       x bf16, at least bf16_brgemm_rows() rows, a CPU with AMX-BF16 (6 rows; never
//                  without AMX, where the tiles below beat it; SRT_BF16_BRGEMM_M overrides): ATen's
//                  CPUBlas brgemm on each panel (oneDNN's ukernel takes AMX tiles).
//   "avx512_bf16"  x bf16: vdpbf16ps, register tiles of up to 8 rows x 32 columns (1-2 rows: 4
//                  panels at once, 3-4 rows: 2, so enough chains hide the loads' latency), the
//                  weights streamed once per tile and prefetched (at 1-8 rows a matrix-vector
//                  product, bound by read bandwidth).
//   "avx512", "avx2", "scalar"   any x (CPUs without bf16 arithmetic, float32 activations; and a
//                  bf16 x of 8 rows or more on Intel cores without AMX, where vdpbf16ps issues at
//                  half the FMA's rate: kSlowDotRows): each weight pair widened to float32 in
//                  registers (a 16-bit shift) and two FMAs (AVX2: one row takes 2 panels at
//                  once; from 3 rows, blocks of k: run_avx2_blocks); a bf16 x goes as a float32
//                  copy.
// Every path sums each output over k in pair order in float32; the products of bf16 values are
// exact in float32, so the paths differ only by float32 rounding of the sums (and by how the
// brgemm's ukernel orders them). A float32 x is never rounded to bf16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "bf16_tiles.h"
#include "cpu_ops.h"
#include "vec.h"

namespace srt_cpu {
namespace {

constexpr int64_t kBrgemmMB = 64;  // rows a brgemm call

// Without AMX, srt's vdpbf16ps tiles beat the brgemm at every row count measured (1-256 rows, 1.5x
// from 16 rows on an AMD Zen 5): brgemm only where the CPU has AMX, from kAmxBrgemmRows rows, unless
// SRT_BF16_BRGEMM_M says otherwise (0: never). On an Intel Xeon with AMX (2 cores) brgemm on the
// tiles was 0.87x the vdpbf16ps tiles at 4 rows, equal at 5, 1.08x at 6, 2.2x at 16, 7.8x at 256.
constexpr int64_t kAmxBrgemmRows = 6;
constexpr int64_t kNever = INT64_MAX;

int64_t brgemm_rows_from_env() {
  const char* env = std::getenv("SRT_BF16_BRGEMM_M");
  if (env == nullptr || env[0] == '\0') return cpu_has_amx(kAmxBf16) ? kAmxBrgemmRows : kNever;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  TORCH_CHECK(end != env && *end == '\0' && v >= 0, "SRT_BF16_BRGEMM_M must be an integer >= 0, got '", env, "'");
  return v == 0 ? kNever : v;
}

constexpr int kMaxNP = 4;
// k a block when several tiles of rows share a panel (the vdpbf16ps path): one panel's block (32
// columns x kBlockK bf16, 64 KiB) stays in cache while every tile of rows takes it, and the tiles
// prefetch the next block meanwhile, so the weights stream from memory once and behind the
// arithmetic. On a Zen 5, Qwen2.5-1.5B's layers at 16 / 32 rows: 1.24x / 1.22x the unblocked rate
// (blocks of 256 / 512 / 1024 / 2048 k measured; 1024 best, 2048 equal).
constexpr int64_t kBlockK = 1024;

// Rows a chunk of the blocked path: a chunk's block of k of x (kChunkRows x kBlockK bf16, 512 KiB)
// stays in L2 while the group's panels take it in turn, so x is read from beyond L2 once per group of
// panels and block of k, whatever M. On a Zen 5 (1 MiB of L2 a core), Qwen2.5-1.5B's layers at 1,536
// rows: 661 against 625 GFLOP/s with each panel taking every row (medians of 5 alternated runs;
// equal at 256 rows).
constexpr int64_t kChunkRows = 256;

// The blocked path of one group of np panels (w at its first): per chunk of rows, per block of k,
// per panel, every tile of the chunk's rows; each tile prefetches its share of the block taken next
// (the next panel's, else the first panel's of the next block of k or chunk). Each output sums its
// blocks of k in order. rows_c holds a chunk's sums (chunk rows x kMaxNP * kNR floats).
template <typename XT, typename OT>
void run_blocked(Bf16Path path, int64_t M, int64_t K, int MR, const XT* xa, int64_t lda, const uint16_t* w,
                 int64_t np, int64_t pstride, const float* bias_group, float* rows_c, int64_t cols, OT* o,
                 int64_t N) {
  constexpr int64_t ldc = kMaxNP * kNR;
  for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
    const int64_t mc = std::min(kChunkRows, M - m0);
    // the fewest tiles of at most MR rows, of even heights (17 rows: 6 + 6 + 5, not 8 + 8 + 1: a
    // tile of few rows has too few accumulator chains to hide vdpbf16ps' latency and costs about
    // what a full one does). Qwen2.5-1.5B's layers on a Zen 5, alternated in one process: 1.04x /
    // 1.11x / 1.07x / 1.07x at 9 / 17 / 18 / 25 rows.
    const int64_t tiles = (mc + MR - 1) / MR, TR = (mc + tiles - 1) / tiles;
    // lines of the next block each tile prefetches: a block is kBlockK lines (32 columns x 2 k x 2
    // bytes a pair of k), shared among the tiles, one line per pair of k of a tile at most
    const int64_t share = std::min<int64_t>((kBlockK + tiles - 1) / tiles, kBlockK / 2);
    for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
      const int64_t kc = std::min(kBlockK, K - k0);
      for (int64_t p = 0; p < np; ++p) {
        const uint16_t* wk = w + p * pstride + k0 * kNR;
        const uint16_t* next = p + 1 < np ? wk + pstride : k0 + kBlockK < K ? w + (k0 + kBlockK) * kNR : w;
        for (int64_t m = m0, t = 0; m < m0 + mc; m += TR, ++t)
          run_tile<XT>(path, static_cast<int>(std::min<int64_t>(TR, m0 + mc - m)), 1, xa + m * lda + k0, lda, kc,
                       wk, pstride, bias_group ? bias_group + p * kNR : nullptr, rows_c + (m - m0) * ldc + p * kNR,
                       ldc, k0 > 0, next + t * share * 32, share);
      }
    }
    for (int64_t m = m0; m < m0 + mc; m += TR)
      store_tile<OT>(static_cast<int>(std::min<int64_t>(TR, m0 + mc - m)), rows_c + (m - m0) * ldc, cols, ldc,
                     o + m * N, N);
  }
}

// AVX2, 3 rows or more: each panel of the group in blocks of kAvx2BlockK k; over each block the first
// two rows (a tile of 2 rows takes the whole panel, 8 chains) read it from memory with their
// prefetch (`stream`), then the other rows in tiles of 4 (half a panel at a time) read it from cache.
// A tile of rows over a whole panel would read it from beyond L2 where the panel outgrows L2: on an
// AMD Zen 3 (512 KiB of L2 a core) the down projection's (k 8,960: 573 KiB). `c` holds the sums of
// the group's M rows (the blocks of k summed on in order). Qwen2.5-1.5B's four kinds of layer on an
// AMD Zen 3 (2 cores), medians of 5-9 paired rounds in one process against 4-row tiles over whole
// panels: 1.12x at 5 rows, 1.15x at 8, 1.06-1.08x at 12-24, 1.04x at 32, 1.01-1.02x at 64-1,024
// (all rows in pairs: 1.09x at 5, 1.11x at 8, 0.99-1.02x at 16-32; tiles of 3 after the pair
// slower; blocks of 256 / 512 / 1,024 / whole k slower than 2,048 or within 0.03).
constexpr int64_t kAvx2BlockK = 2048;

template <typename XT, typename OT>
void run_avx2_blocks(int64_t M, int64_t K, const XT* xa, int64_t lda, const uint16_t* w, int64_t np,
                     int64_t pstride, const float* bias_group, float* c, int64_t cols, OT* o, int64_t N) {
  constexpr int64_t ldc = kMaxNP * kNR;
  for (int64_t p = 0; p < np; ++p)
    for (int64_t k0 = 0; k0 < K; k0 += kAvx2BlockK) {
      const int64_t kc = std::min(kAvx2BlockK, K - k0);
      const uint16_t* wp = w + p * pstride + k0 * kNR;
      for (int64_t m = 0; m < M;) {
        const int R = static_cast<int>(std::min<int64_t>(m == 0 ? 2 : kMR2, M - m));
        run_tile<XT>(Bf16Path::kAvx2, R, 1, xa + m * lda + k0, lda, kc, wp, pstride,
                     bias_group ? bias_group + p * kNR : nullptr, c + m * ldc + p * kNR, ldc, k0 > 0, nullptr, 0,
                     m == 0);
        m += R;
      }
    }
  for (int64_t m = 0; m < M; m += kMR2)
    store_tile<OT>(static_cast<int>(std::min<int64_t>(kMR2, M - m)), c + m * ldc, cols, ldc, o + m * N, N);
}

// x of XT (bf16 or float32), out of OT (x's dtype, or bf16 for a float32 copy of a bf16 x)
template <typename XT, typename OT>
void run_panels(Bf16Path path, const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias,
                at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), Kh = packed.size(1);
  const XT* xa = x.data_ptr<XT>();
  const int64_t lda = x.stride(0);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t pstride = Kh * kNR * 2;
  OT* o = out.data_ptr<OT>();
  const int MR = tile_rows(path);
  constexpr int64_t ldc = kMaxNP * kNR;
  const bool blocked = path == Bf16Path::kAvx512Bf16 && M > MR;
  const bool avx2_blocks = path == Bf16Path::kAvx2 && M > 2;
  // threads take groups of kMaxNP panels
  at::parallel_for(0, (P + kMaxNP - 1) / kMaxNP, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float c[kMR512 * ldc];
    alignas(64) float bias_group[ldc];
    std::vector<float> rows_c(blocked ? std::min(M, kChunkRows) * ldc : avx2_blocks ? M * ldc : 0);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * kMaxNP, np = std::min<int64_t>(kMaxNP, P - p0);
      const int64_t cols = std::min(np * kNR, N - p0 * kNR);
      if (bias) {
        std::fill(bias_group, bias_group + ldc, 0.f);
        std::copy(bias + p0 * kNR, bias + p0 * kNR + cols, bias_group);
      }
      if (blocked) {  // several tiles of rows (run_blocked)
        run_blocked<XT, OT>(path, M, K, MR, xa, lda, w + p0 * pstride, np, pstride, bias ? bias_group : nullptr,
                            rows_c.data(), cols, o + p0 * kNR, N);
        continue;
      }
      if (avx2_blocks) {  // blocks of k (run_avx2_blocks)
        run_avx2_blocks<XT, OT>(M, K, xa, lda, w + p0 * pstride, np, pstride, bias ? bias_group : nullptr,
                                rows_c.data(), cols, o + p0 * kNR, N);
        continue;
      }
      for (int64_t m = 0; m < M; m += MR) {
        const int R = static_cast<int>(std::min<int64_t>(MR, M - m));
        const int at_once = panels_at_once(path, R);
        for (int64_t p = 0; p < np;) {  // sub-groups of at_once panels, single ones at the tail
          const int n = p + at_once <= np ? at_once : 1;
          run_tile<XT>(path, R, n, xa + m * lda, lda, K, w + (p0 + p) * pstride, pstride,
                       bias ? bias_group + p * kNR : nullptr, c + p * kNR, ldc, false, nullptr, 0, R == M);
          p += n;
        }
        store_tile<OT>(R, c, cols, ldc, o + m * N + p0 * kNR, N);
      }
    }
  });
}

// Blocking of the brgemm path (AMX CPUs, whose cores have 2 MiB of L2): a chunk of rows of x whose
// block of k fits kBrgemmXBytes stays in L2 while every panel passes over it, so x is read from
// memory once per chunk rather than once per panel; k is split (the float32 sums accumulated in a
// buffer) where a chunk of kBrgemmMinChunk rows of the whole k would not fit, so the weights are
// re-read once per chunk of at least that many rows. A task is kBrgemmGroup panels x kBrgemmMB
// rows. Qwen2.5-1.5B's layers on an Intel Xeon with AMX (2 cores), against one brgemm per panel
// over all rows: 1.2x at 2,048 rows (the down projection, k 8,960: 1.1x), equal at 256-512.
constexpr int64_t kBrgemmXBytes = 1600 << 10;
constexpr int64_t kBrgemmMinChunk = 256;
constexpr int64_t kBrgemmGroup = 4;

// x bf16, K even: one brgemm per (panel, block of kBrgemmMB rows, block of k), float32 into a
// buffer, then bias and the rounding to bf16. silu_mul (a gate/up weight, gate rows first, d = N / 2
// a multiple of kNR): a task's unit is gate panel p with up panel p + P / 2, and the output, [M, d],
// silu_and_mul of the two (silu_mul_f32_bf16), so the gate/up output never goes to memory.
void run_brgemm(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias, at::Tensor& out,
                bool silu_mul = false) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), Kh = packed.size(1);
  const int64_t units = silu_mul ? P / 2 : P, group = silu_mul ? kBrgemmGroup / 2 : kBrgemmGroup;
  const int64_t ldo = out.size(1);
  const at::BFloat16* xa = x.data_ptr<at::BFloat16>();
  const int64_t lda = x.stride(0);
  const at::BFloat16* w = packed.data_ptr<at::BFloat16>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const int64_t kb =
      std::min(K, std::max<int64_t>(64, kBrgemmXBytes / (2 * std::min(M, kBrgemmMinChunk)) / 64 * 64));
  const int64_t Mc = std::min(M, std::max(kBrgemmMB, kBrgemmXBytes / (2 * kb) / kBrgemmMB * kBrgemmMB));
  const bool split = kb < K;  // the sums of a chunk live in `acc` across the blocks of k
  std::vector<float> acc(split ? Mc * P * kNR : 0);
  const int64_t groups = (units + group - 1) / group;
  for (int64_t c0 = 0; c0 < M; c0 += Mc) {
    const int64_t mc = std::min(Mc, M - c0), MB = (mc + kBrgemmMB - 1) / kBrgemmMB;
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
      const int64_t kc = std::min(kb, K - k0);
      const bool last = k0 + kc == K;
      at::parallel_for(0, groups * MB, 1, [&](int64_t t0, int64_t t1) {
        alignas(64) float cbuf[2][kBrgemmMB * kNR];
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t mi = (t % MB) * kBrgemmMB, m0 = c0 + mi, rows = std::min(kBrgemmMB, mc - mi);
          const int64_t u0 = (t / MB) * group, u1 = std::min(units, u0 + group);
          for (int64_t u = u0; u < u1; ++u) {
            float* c[2];
            for (int h = 0; h < 1 + silu_mul; ++h) {  // the unit's panels: p, and p + units (its up panel)
              const int64_t p = u + h * units;
              c[h] = split ? acc.data() + (p * Mc + mi) * kNR : cbuf[h];
              at::native::cpublas::brgemm(rows, kNR, kc, lda, kNR, kNR, k0 > 0, xa + m0 * lda + k0,
                                          w + p * Kh * kNR * 2 + k0 * kNR, c[h], true);
            }
            if (!last) continue;
            const int64_t cols = std::min(kNR, ldo - u * kNR);
            at::BFloat16* orow = o + m0 * ldo + u * kNR;
            if (!silu_mul) {
              for (int64_t i = 0; i < rows; ++i)
                store_row(c[0] + i * kNR, bias != nullptr ? bias + u * kNR : nullptr, cols, orow + i * ldo);
              continue;
            }
            for (int64_t i = 0; i < rows; ++i) {
              float* g = c[0] + i * kNR;
              float* up = c[1] + i * kNR;
              if (bias != nullptr) {
                for (int64_t j = 0; j < kNR; ++j) {
                  g[j] += bias[u * kNR + j];
                  up[j] += bias[(u + units) * kNR + j];
                }
              }
              silu_mul_f32_bf16(g, up, orow + i * ldo, kNR);
            }
          }
        }
        at::native::cpublas::brgemm_release(true);
      });
    }
  }
}

}  // namespace

int64_t bf16_brgemm_rows() {
  static const int64_t rows = brgemm_rows_from_env();
  return rows;
}

at::Tensor pack_bf16_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
              "pack_bf16_weight: weight must be a bf16 or float32 CPU tensor [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "pack_bf16_weight: K must be even (pairs of k), got ", K);
  const int64_t P = (N + kNR - 1) / kNR, Kh = K / 2;
  // [P*32, K] zero-padded, then (p, j, kh, t) -> (p, kh, j, t)
  at::Tensor padded = at::zeros({P * kNR, K}, weight.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, kNR, Kh, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                       c10::string_view isa) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "bf16_linear: x must be a bf16 or float32 CPU tensor [M, K]");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(2) == kNR && packed.size(3) == 2 && packed.is_contiguous(),
              "bf16_linear: packed must come from pack_bf16_weight ([P, K/2, 32, 2] bf16), got ", packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(K == 2 * packed.size(1), "bf16_linear: x has ", K, " columns, the packed weight ", 2 * packed.size(1));
  TORCH_CHECK(N > (P - 1) * kNR && N <= P * kNR, "bf16_linear: N = ", N, " does not match ", P, " panels of ", kNR);
  const at::Tensor b32 = float32_bias("bf16_linear", bias, N);
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  const Bf16Path path = pick_path("bf16_linear", isa, x_bf16, M, bf16_brgemm_rows(), true);
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return b32.defined() ? out.copy_(b32.view({1, N}).expand({M, N})) : out.zero_();
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  if (path == Bf16Path::kBrgemm) {
    run_brgemm(xc, packed, N, bp, out);
  } else if (x_bf16 && path == Bf16Path::kAvx512Bf16) {
    run_panels<at::BFloat16, at::BFloat16>(path, xc, packed, N, bp, out);
  } else if (x_bf16) {  // the widened paths take a float32 copy of x (exact), out in bf16
    run_panels<float, at::BFloat16>(path, xc.to(at::kFloat), packed, N, bp, out);
  } else {
    run_panels<float, float>(path, xc, packed, N, bp, out);
  }
  return out;
}

at::Tensor bf16_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                                const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(N % 2 == 0, "bf16_linear_silu_mul: N (gate and up rows) must be even, got ", N);
  const bool fused = x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
                     (N / 2) % kNR == 0 && packed.dim() == 4 && packed.size(0) * kNR == N &&
                     pick_path("bf16_linear", "", true, x.size(0), bf16_brgemm_rows(), true) == Bf16Path::kBrgemm;
  if (!fused || x.size(0) == 0 || x.size(1) == 0) return silu_and_mul(bf16_linear(x, packed, N, bias, ""));
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.size(2) == kNR &&
                  x.size(1) == 2 * packed.size(1),
              "bf16_linear_silu_mul: packed must come from pack_bf16_weight for x's ", x.size(1), " columns");
  const at::Tensor b32 = float32_bias("bf16_linear_silu_mul", bias, N);
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({x.size(0), N / 2}, x.options());
  run_brgemm(xc, packed, N, b32.defined() ? b32.data_ptr<float>() : nullptr, out, true);
  return out;
}

std::string bf16_linear_path(int64_t M, bool x_bf16) {
  return path_name(pick_path("bf16_linear", "", x_bf16, M, bf16_brgemm_rows(), true));
}

namespace {
at::Tensor bf16_linear_meta(const at::Tensor& x, const at::Tensor&, int64_t N, const c10::optional<at::Tensor>&,
                            c10::string_view) {
  return at::empty({x.size(0), N}, x.options());
}
at::Tensor bf16_linear_silu_mul_meta(const at::Tensor& x, const at::Tensor&, int64_t N,
                                     const c10::optional<at::Tensor>&) {
  return at::empty({x.size(0), N / 2}, x.options());
}
}  // namespace
}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("pack_bf16_weight(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int n, Tensor? bias=None, str isa=\"\") -> Tensor");
  m.def("bf16_linear_silu_mul(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor");
  m.def("bf16_linear_path(int m, bool x_bf16) -> str", &srt_cpu::bf16_linear_path);
  m.def("bf16_brgemm_rows() -> int", &srt_cpu::bf16_brgemm_rows);
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) {
  m.impl("pack_bf16_weight", &srt_cpu::pack_bf16_weight);
  m.impl("bf16_linear", &srt_cpu::bf16_linear);
  m.impl("bf16_linear_silu_mul", &srt_cpu::bf16_linear_silu_mul);
}

TORCH_LIBRARY_IMPL(srt_cpu, Meta, m) {
  m.impl("bf16_linear", &srt_cpu::bf16_linear_meta);
  m.impl("bf16_linear_silu_mul", &srt_cpu::bf16_linear_silu_mul_meta);
}

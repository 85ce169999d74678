// GGUF matmuls on float32 activations through integer dot products (AVX-512 VNNI, Q4_K and Q6_K):
// gguf_linear's path for 1-2 input rows (gguf_a24_rows()) on CPUs that have it, and moe_experts'
// for experts of up to 7 rows (moe_experts_a24, all experts in one parallel loop, each through the
// path gguf_linear takes for its rows: this one or the register tiles).
//
//   gguf_linear_a24(x [M, K] f32, data [N, K / 256 * ts] u8, qtype, bias?) -> [M, N] f32
//   gguf_a24_qtypes() -> the types this CPU runs it for (empty without AVX-512 VNNI)
//
// Numerics (the split itself: gguf_a24_split.h, shared with gguf_x8_a24.cpp). Each block of 32
// activations is written as 24-bit fixed point: with a = max |x| of
// the block, u = a / (127 * 2^16) and V_j = rint(x_j / u) (|V_j| <= 127 * 2^16), so that
// |x_j - u V_j| <= about 0.75 u + 2^-24 |x_j|, that is a few 2^-24 of a: the size of the float32
// rounding of any sum that holds the block's largest product. (It is not int8 quantization: the
// 8-bit path, --enable-int8-activations, keeps 8 of those 24 bits.) V splits exactly into three
// signed bytes, V = 2^16 hi + 2^8 mid + lo (mid, lo in [-128, 127]), and a weight row's sum over
// 4 codes q is
//
//   sum q V = ((dot(q, hi) << 8) + dot(q, mid)) << 8 + dot(q, lo)
//
// three _mm512_dpbusd_epi32 (64 unsigned codes x 64 signed bytes into 16 int32 lanes of 4 products
// each) joined by two shifts: exact in int32 (|sum q V| < 2^31; intermediate wrap-around cancels
// in two's complement). Each lane is then converted once and scaled in float32 like the other
// paths: Q4_K (d sc[s]) u[s] per sub-block minus (dmin m[s]) times the float sum of x over the
// sub-block; Q6_K (d sc[g]) u[g / 2] per group of 16, the codes' offset 32 entering as -32 sum V
// per lane (computed once per call). Float32 summation order differs from dot_rows' (which needs
// no bit-exactness either). Blocks with a non-finite value give NaN (u = NaN); blocks whose largest
// |x| is below 1e-30 count as zeros.
//
// Against dot_rows (float32 FMAs on codes widened to floats, compute-bound on AVX-512 at about
// 36 GB/s of weights on Zen 5), a weight row's 64 codes take 3 dot instructions instead of 8
// conversions and FMAs. Tiles and threading as gguf_linear_q8a's (gguf_q8act_vnni.h): 4 weight
// rows x up to 4 activation rows, threads over contiguous ranges of 4-row weight groups. Layout of
// the planes: per activation row hi, mid, lo, each K bytes and a cache line apart; Q4_K's in the
// block order of its code vectors (plane_offset_q4k).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_ops.h"
#include "gguf_a24_split.h"
#include "gguf_q8act_vnni.h"

namespace srt_cpu {
namespace {

constexpr int kMaxXTile = 4;  // activation rows per tile

// bytes of a Q4_K / Q6_K row of `cols` weights
int64_t row_bytes(int64_t qtype, int64_t cols) {
  return cols / kquant::kQK * (qtype == kGgmlQ4_K ? kquant::kQ4KBytes : kquant::kQ6KBytes);
}

#if SRT_CPU_X86
namespace qv = q8act::vnni;
using a24::A24;
using a24::Split;
using a24::split_x;

// the split each type's tiles read
inline Split split_mode(int64_t qtype) { return qtype == kGgmlQ4_K ? Split::kQ4K : Split::kQ6K; }

// sum over 64 codes x V, 4 products per int32 lane
SRT_INLINE_VNNI __m512i dot24(__m512i codes, const int8_t* hi, const int8_t* mid, const int8_t* lo) {
  __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(hi));
  p = _mm512_dpbusd_epi32(_mm512_slli_epi32(p, 8), codes, _mm512_loadu_si512(mid));
  return _mm512_dpbusd_epi32(_mm512_slli_epi32(p, 8), codes, _mm512_loadu_si512(lo));
}

template <int MX, int R>
SRT_TARGET_VNNI void dot_q4k(const uint8_t* w, int64_t ldw, const A24& a, int64_t i0, float* out, int64_t ldo) {
  constexpr int TS = kquant::kQ4KBytes;
  qv::TileSums<R, MX> sums;
  auto& acc = sums.acc;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const int8_t* hp[MX];
  for (int i = 0; i < MX; ++i) hp[i] = a.plane(i0 + i, 0);
  const int64_t K = a.k;
  for (int64_t sb = 0; sb < K / kquant::kQK; ++sb) {
    q8act::avx2::prefetch_ahead<R * TS>(w + q8act::avx2::kPrefetchGroups * R * ldw + sb * (R * TS));
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * ldw + sb * TS;
      __m256 vds, vdm;  // d * sc[s], dmin * m[s]
      kquant::avx2::scales_q45k(blk, &vds, &vdm);
      __m512i codes[4];  // codes[2h + n]: nibble n of qs[64 h .. 64 h + 63], sub-blocks 4h + n (lanes 0-7), 4h + n + 2
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(blk + 16 + 64 * h);
        codes[2 * h] = _mm512_and_si512(v, m4);
        codes[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      }
      for (int i = 0; i < MX; ++i) {
        const int64_t x0 = (i0 + i) * a.nb + sb * 8;
        const __m512 scl = qv::low8(_mm256_mul_ps(vds, _mm256_loadu_ps(a.u.data() + x0)));  // (d sc[s]) u[s]
        acc[r][i] = _mm512_fnmadd_ps(qv::low8(vdm), qv::low8(_mm256_loadu_ps(a.s.data() + x0)), acc[r][i]);
        const int8_t* xh = hp[i] + sb * kquant::kQK;
        for (int j = 0; j < 4; ++j) {
          const __m512i p = dot24(codes[j], xh + 64 * j, xh + a.ld + 64 * j, xh + 2 * a.ld + 64 * j);
          const int sub = 4 * (j / 2) + j % 2;  // lanes 0-7: sub-block sub, 8-15: sub + 2
          acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), qv::pair_bcast(scl, sub, sub + 2), acc[r][i]);
        }
      }
    }
  }
  sums.store(out, ldo);
}

template <int MX, int R, int C>
SRT_INLINE_VNNI void q6k_chunk(const uint8_t* blk, const int8_t* const* xh, int64_t ld, const __m512i (*n32)[4],
                               const __m512* gscale, __m512* acc) {
  const __m512i q = qv::codes_q6k<C>(blk);
  for (int i = 0; i < MX; ++i) {
    const int8_t* p0 = xh[i] + 64 * C;
    const __m512i p = _mm512_add_epi32(dot24(q, p0, p0 + ld, p0 + 2 * ld), n32[i][C]);
    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), qv::quad_bcast<C>(gscale[i]), acc[i]);
  }
}

template <int MX, int R>
SRT_TARGET_VNNI void dot_q6k(const uint8_t* w, int64_t ldw, const A24& a, int64_t i0, float* out, int64_t ldo) {
  constexpr int TS = kquant::kQ6KBytes;
  qv::TileSums<R, MX> sums;
  auto& acc = sums.acc;
  const __m512i half = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);  // group g: block g / 2
  const int64_t K = a.k;
  for (int64_t sb = 0; sb < K / kquant::kQK; ++sb) {
    q8act::avx2::prefetch_ahead<R * TS>(w + q8act::avx2::kPrefetchGroups * R * ldw + sb * (R * TS));
    const int8_t* xh[MX];
    __m512i n32[MX][4];
    __m512 ux[MX];
    for (int i = 0; i < MX; ++i) {
      xh[i] = a.plane(i0 + i, 0) + sb * kquant::kQK;
      const int32_t* np = a.n32.data() + (i0 + i) * (K / 4) + sb * 64;
      for (int c = 0; c < 4; ++c) n32[i][c] = _mm512_loadu_si512(np + 16 * c);
      ux[i] = _mm512_permutexvar_ps(half, qv::low8(_mm256_loadu_ps(a.u.data() + (i0 + i) * a.nb + sb * 8)));
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * ldw + sb * TS;
      const __m512 dsc = qv::q6k_scales(blk);
      __m512 gscale[MX];
      for (int i = 0; i < MX; ++i) gscale[i] = _mm512_mul_ps(dsc, ux[i]);  // (d sc_g) u_{g / 2}
      q6k_chunk<MX, R, 0>(blk, xh, a.ld, n32, gscale, acc[r]);
      q6k_chunk<MX, R, 1>(blk, xh, a.ld, n32, gscale, acc[r]);
      q6k_chunk<MX, R, 2>(blk, xh, a.ld, n32, gscale, acc[r]);
      q6k_chunk<MX, R, 3>(blk, xh, a.ld, n32, gscale, acc[r]);
    }
  }
  sums.store(out, ldo);
}

using TileFn = void (*)(const uint8_t*, int64_t, const A24&, int64_t, float*, int64_t);

// [R == 4 ? 1 : 0][MX - 1]
constexpr TileFn kQ4KTiles[2][kMaxXTile] = {
    {&dot_q4k<1, 1>, &dot_q4k<2, 1>, &dot_q4k<3, 1>, &dot_q4k<4, 1>},
    {&dot_q4k<1, 4>, &dot_q4k<2, 4>, &dot_q4k<3, 4>, &dot_q4k<4, 4>},
};
constexpr TileFn kQ6KTiles[2][kMaxXTile] = {
    {&dot_q6k<1, 1>, &dot_q6k<2, 1>, &dot_q6k<3, 1>, &dot_q6k<4, 1>},
    {&dot_q6k<1, 4>, &dot_q6k<2, 4>, &dot_q6k<3, 4>, &dot_q6k<4, 4>},
};

const TileFn (*tiles_for(int64_t qtype))[kMaxXTile] {
  static const bool enabled = [] {
    const char* env = std::getenv("SRT_GGUF_A24");
    return detect_isa() == CpuIsa::kAvx512 && q8act::vnni::supported() && !(env != nullptr && std::strcmp(env, "0") == 0);
  }();
  if (!enabled) return nullptr;
  switch (qtype) {
    case kGgmlQ4_K: return kQ4KTiles;
    case kGgmlQ6_K: return kQ6KTiles;
    default: return nullptr;
  }
}

// the weight rows w .. w + rows - 1 (rows <= 4) against activation rows i0 .. i1 - 1, tiles of up to
// 4 of them: out[(i - i0) * ldo + r] for weight row r and activation row i
void tile_rows(const TileFn (*tiles)[kMaxXTile], const uint8_t* w, int64_t bpr, int64_t rows, const A24& a,
               int64_t i0, int64_t i1, float* out, int64_t ldo) {
  for (int64_t i = i0; i < i1; i += kMaxXTile) {
    const int64_t mx = std::min<int64_t>(kMaxXTile, i1 - i);
    float* o = out + (i - i0) * ldo;
    if (rows == 4) {
      tiles[1][mx - 1](w, bpr, a, i, o, ldo);
    } else {
      for (int64_t r = 0; r < rows; ++r) tiles[0][mx - 1](w + r * bpr, bpr, a, i, o + r, ldo);
    }
  }
}
#else
const void* tiles_for(int64_t) { return nullptr; }
#endif  // SRT_CPU_X86

}  // namespace

bool gguf_a24_takes(int64_t qtype) { return tiles_for(qtype) != nullptr; }

// below this many input rows gguf_linear (and moe_experts_a24, expert by expert) takes this path
// for Q4_K and Q6_K where the CPU has it (AVX-512 VNNI; SRT_GGUF_A24_M overrides it, SRT_GGUF_A24=0
// turns it off); from there on the register tiles (gguf_tile_ops). On Zen 5, ms, this path vs the
// tiles: 11008 x 4096 Q4_K 1 row 0.49 vs 0.82, 2 rows 0.75 vs 0.92, 4 rows 1.62 vs 1.33; 14336 x
// 4096 Q4_K 2 rows 0.94 vs 1.38, 3 rows 1.45 vs 1.52; 4096 x 14336 Q6_K 2 rows 1.33 vs 1.69, 3 rows
// 2.00 vs 1.84. A decode step of the Llama-3.1-8B Q4_K_M shape at batch 3 takes as long either way.
int64_t gguf_a24_rows() {
  static const int64_t limit = [] {
    const char* env = std::getenv("SRT_GGUF_A24_M");
    return env != nullptr ? std::max<int64_t>(0, std::atoll(env)) : int64_t{3};
  }();
  return limit;
}

at::Tensor gguf_linear_a24(const at::Tensor& x, const at::Tensor& data, int64_t qtype,
                           const c10::optional<at::Tensor>& bias) {
  constexpr const char* op = "gguf_linear_a24";
  TORCH_CHECK(qtype == kGgmlQ4_K || qtype == kGgmlQ6_K, op, ": ggml type ", qtype,
              " has no 24-bit activation path (Q4_K = 12 and Q6_K = 14 have)");
  TORCH_CHECK(gguf_a24_takes(qtype), op, ": needs an x86-64 CPU with AVX-512 VNNI (and SRT_GGUF_A24 not 0)");
  check_activations(op, x);
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous(),
              op, ": data must be a contiguous uint8 CPU tensor [N, bytes_per_row]");
  const int64_t M = x.size(0), K = x.size(1), N = data.size(0);
  TORCH_CHECK(K > 0 && K % kquant::kQK == 0, op, ": the row length ", K, " must be a positive multiple of 256");
  const int64_t bpr = row_bytes(qtype, K);
  TORCH_CHECK(data.size(1) == bpr, op, ": rows of ", K, " weights take ", bpr, " bytes, data rows have ",
              data.size(1));
  const float* bp = checked_bias(op, bias, N);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#if SRT_CPU_X86
  const auto tiles = tiles_for(qtype);
  const A24 a = split_x(x.data_ptr<float>(), x.stride(0), M, K, split_mode(qtype));
  float* op_out = out.data_ptr<float>();
  const auto group = [&](int64_t, int64_t n, int64_t rows, const uint8_t* w) {
    tile_rows(tiles, w, bpr, rows, a, 0, M, op_out + n, N);
    if (bp != nullptr) {
      for (int64_t i = 0; i < M; ++i)
        for (int64_t r = 0; r < rows; ++r) op_out[i * N + n + r] += bp[n + r];
    }
  };
  const int64_t only = 0;  // one matrix: a bank of one
  for_expert_row_groups<4>(data.data_ptr<uint8_t>(), N, bpr, &only, 1, group);
#endif
  return out;
}

namespace {

#if SRT_CPU_X86
// one projection of the active experts: out[p, col0 + n] = (row p of x) . (row n of expert e's
// matrix in `bank`) for the pairs p of each expert e (rows starts[e] .. starts[e + 1]); all the
// experts' 4-row weight groups in one parallel loop, each through the path gguf_linear takes for
// the expert's row count (a: x's 24-bit planes, xt[e]: expert e's rows packed for the tiles)
void experts_small(int64_t qtype, const at::Tensor& bank, const std::vector<int64_t>& active,
                   const std::vector<int64_t>& starts, const A24& a, const std::vector<TileX>& xt, float* out,
                   int64_t ldo, int64_t col0) {
  const TileFn (*tiles)[kMaxXTile] = tiles_for(qtype);
  const QuantRowOps* fops = gguf_tile_ops(qtype);
  const int64_t bpr = bank.size(2), a24_rows = gguf_a24_rows();
  for_expert_row_groups<4>(bank.data_ptr<uint8_t>(), bank.size(1), bpr, active.data(),
                           static_cast<int64_t>(active.size()), [&](int64_t e, int64_t n, int64_t rows, const uint8_t* w) {
    float* o = out + starts[e] * ldo + col0 + n;
    if (starts[e + 1] - starts[e] < a24_rows) {
      tile_rows(tiles, w, bpr, rows, a, starts[e], starts[e + 1], o, ldo);
    } else {
      tile_rows_float(*fops, w, bpr, rows, xt[e], nullptr, o, ldo);
    }
  });
}

// x's rows of each active expert that takes the register tiles, packed for them (empty for the others)
std::vector<TileX> pack_experts(const float* x, int64_t ldx, int64_t K, const std::vector<int64_t>& active,
                                const std::vector<int64_t>& starts) {
  std::vector<TileX> xt(starts.size() - 1);
  for (int64_t e : active) {
    const int64_t rows = starts[e + 1] - starts[e];
    if (rows >= gguf_a24_rows()) xt[e] = pack_tiles(x + starts[e] * ldx, ldx, rows, K);
  }
  return xt;
}

// whether `bank` [E, rows, bytes] holds rows of `cols` weights of a type this CPU runs here for
// experts of up to `most` rows (past the 24-bit path's rows the register tiles, absent with
// SRT_GGUF_TILES=0)
bool bank_fits(const at::Tensor& bank, int64_t qtype, int64_t cols, int64_t most) {
  if (tiles_for(qtype) == nullptr || cols <= 0 || cols % kquant::kQK != 0) return false;
  if (most >= gguf_a24_rows() && gguf_tile_ops(qtype) == nullptr) return false;
  return bank.scalar_type() == at::kByte && bank.dim() == 3 && bank.is_contiguous() && bank.size(2) == row_bytes(qtype, cols);
}
#endif

}  // namespace

at::Tensor moe_experts_a24(const at::Tensor& xs, const std::vector<int64_t>& starts,
                           const std::vector<at::Tensor>& gate_up, const std::vector<int64_t>& gate_up_qtypes,
                           const at::Tensor& down, int64_t down_qtype) {
#if SRT_CPU_X86
  const int64_t P = xs.size(0), H = xs.size(1), E = down.size(0);
  const int64_t I = gate_up.size() == 1 ? gate_up[0].size(1) / 2 : gate_up[0].size(1);
  std::vector<int64_t> active;
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (starts[e + 1] > starts[e]) active.push_back(e);
    most = std::max(most, starts[e + 1] - starts[e]);
  }
  for (size_t b = 0; b < gate_up.size(); ++b)
    if (!bank_fits(gate_up[b], gate_up_qtypes[b], H, most)) return {};
  if (!bank_fits(down, down_qtype, I, most)) return {};
  const at::Tensor xc = xs.contiguous();
  int64_t width = 0;
  for (const at::Tensor& b : gate_up) width += b.size(1);
  at::Tensor h = at::empty({P, width}, xs.options());
  // the activations once per layout (Q4_K's block order differs from Q6_K's), and packed for the tiles
  A24 split[2];
  bool have[2] = {false, false};
  const std::vector<TileX> xt = pack_experts(xc.data_ptr<float>(), H, H, active, starts);
  int64_t col = 0;
  for (size_t b = 0; b < gate_up.size(); ++b) {
    const int q4k = gate_up_qtypes[b] == kGgmlQ4_K ? 1 : 0;
    if (!have[q4k]) {
      split[q4k] = split_x(xc.data_ptr<float>(), H, P, H, split_mode(gate_up_qtypes[b]));
      have[q4k] = true;
    }
    experts_small(gate_up_qtypes[b], gate_up[b], active, starts, split[q4k], xt, h.data_ptr<float>(), width, col);
    col += gate_up[b].size(1);
  }
  const at::Tensor act = silu_and_mul(h);
  TORCH_CHECK(act.size(1) == I, "moe_experts: gate_up's width ", width, " is not twice down's columns ", I);
  const A24 sa = split_x(act.data_ptr<float>(), I, P, I, split_mode(down_qtype));
  const std::vector<TileX> at = pack_experts(act.data_ptr<float>(), I, I, active, starts);
  at::Tensor y = at::empty({P, H}, xs.options());
  experts_small(down_qtype, down, active, starts, sa, at, y.data_ptr<float>(), H, 0);
  return y;
#else
  return {};
#endif
}

namespace {

std::vector<int64_t> gguf_a24_qtypes() {
  std::vector<int64_t> out;
  for (int q : {kGgmlQ4_K, kGgmlQ6_K}) {
    if (gguf_a24_takes(q)) out.push_back(q);
  }
  return out;
}

}  // namespace
}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("gguf_linear_a24(Tensor x, Tensor data, int qtype, Tensor? bias=None) -> Tensor");
  m.def("gguf_a24_qtypes() -> int[]", &srt_cpu::gguf_a24_qtypes);
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) { m.impl("gguf_linear_a24", &srt_cpu::gguf_linear_a24); }

// W8A8 matmuls on AMX-INT8 tiles: the same contract as gguf_linear_w8a8 (w8a8_linear.cpp: x
// quantized to int8 per row, integer dot products, one float scaling per output), on weights packed
// in the layout oneDNN's brgemm reads.
//
//   w8a8_pack_panels(data [N, K / 32 * 34] u8) -> packed [ceil(N / 64), 256 + 64 K] u8
//       Q8_0 rows whose blocks all carry the row's scale, in panels of 64 rows (the last padded
//       with zero rows): each panel starts with its rows' 64 scales as float32, then the codes as
//       signed bytes in VNNI quads: byte (k / 4, r, k % 4) of the panel is row r's code k. The
//       checkpoint's bytes (N K + 4 N), held once.
//   w8a8_linear_panels(x [M, K] f32 or bf16, packed, N, bias?, vector) -> [M, N] in x's dtype
//       Each x row's codes and scale as w8a8_codes.h makes them; per (panel, block of up to 32
//       rows) one brgemm of signed x signed bytes into int32 (ATen's CPUBlas; oneDNN's ukernel runs
//       it on AMX tiles), then out = float(dot) * (scale of x row * scale of w row) + bias: the
//       integer sums are exact, so the outputs equal the VNNI groups' bit for bit. Without
//       `vector` (tests, SRT_CPU_ISA below avx512) the dots are scalar loops over the same bytes.
//
// AMX is used only where CPUID says AMX-TILE and AMX-INT8, SRT_CPU_ISA does not lower the ops, and
// oneDNN is not capped below AMX (ONEDNN_MAX_CPU_ISA, which srt/configs/bf16_probe.py sets where
// tiles trap); the loader also asks the bf16 probe, which runs AMX tiles in a child process.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "cpu_ops.h"
#include "gguf_simple_rows.h"
#include "w8a8_codes.h"

namespace srt_cpu {
namespace {

constexpr int64_t kBlock = 32, kBlockBytes = gguf_simple::kSizeQ8_0;
constexpr int64_t kNB = 64;       // rows (outputs) a panel
constexpr int64_t kHead = kNB * 4;  // a panel's scales: 64 float32
constexpr int64_t kMB = 32;       // activation rows a brgemm call

int64_t panel_bytes(int64_t K) { return kHead + kNB * K; }

// below how many activation rows the VNNI loop replaces brgemm (SRT_W8A8_AMX_M, for measuring; on an
// Intel Xeon with AMX, 2 cores: 5-10% faster than brgemm at 1-3 rows, where both read the weights
// at about the read bandwidth; from 4 rows brgemm is faster)
int64_t few_rows() {
  static const int64_t rows = [] {
    const char* env = std::getenv("SRT_W8A8_AMX_M");
    return env != nullptr && env[0] != '\0' ? std::atoll(env) : int64_t{4};
  }();
  return rows;
}

// int32 dots of activation rows i0 .. i0 + rows against one panel's codes: c [rows, kNB]
void dots_scalar(const int8_t* codes, int64_t K, const int8_t* q, int64_t ldq, int64_t rows, int32_t* c) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t r = 0; r < kNB; ++r) {
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += static_cast<int32_t>(codes[(k / 4 * kNB + r) * 4 + k % 4]) * q[i * ldq + k];
      c[i * kNB + r] = sum;
    }
  }
}

#if SRT_CPU_X86
// The same for a few rows on AVX-512 VNNI (brgemm's tiles of 16 rows would idle): per quad of k
// the panel's 256 bytes are 4 registers of 16 rows x 4 codes, flipped to unsigned (w + 128), and
// each activation row's 4 codes broadcast: vpdpbusd adds the 4 products into the row's lane, so
// no horizontal sums; 128 * the row's code sum (offset) is taken off at the end.
template <int MX>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void dots_vnni(
    const int8_t* codes, int64_t K, const int8_t* q, int64_t ldq, const int32_t* offset, int32_t* c) {
  __m512i acc[MX][4];
  for (int i = 0; i < MX; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t k = 0; k < K; k += 4) {
    const int8_t* wk = codes + k * kNB;
    _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * kNB * 4), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * kNB * 4 + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * kNB * 4 + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * kNB * 4 + 192), _MM_HINT_T0);
    __m512i w[4];
    for (int j = 0; j < 4; ++j) w[j] = _mm512_xor_si512(_mm512_loadu_si512(wk + 64 * j), flip);
    for (int i = 0; i < MX; ++i) {
      int32_t quad;
      std::memcpy(&quad, q + i * ldq + k, sizeof(quad));
      const __m512i xi = _mm512_set1_epi32(quad);
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], w[j], xi);
    }
  }
  for (int i = 0; i < MX; ++i) {
    const __m512i off = _mm512_set1_epi32(offset[i]);
    for (int j = 0; j < 4; ++j) _mm512_storeu_si512(c + i * kNB + 16 * j, _mm512_sub_epi32(acc[i][j], off));
  }
}

void dots_few(int64_t rows, const int8_t* codes, int64_t K, const int8_t* q, int64_t ldq, const int32_t* off,
              int32_t* c) {
  for (int64_t i = 0; i < rows; i += 4) {
    const int64_t n = std::min<int64_t>(4, rows - i);
    int32_t* ci = c + i * kNB;
    const int8_t* qi = q + i * ldq;
    switch (n) {
      case 1: dots_vnni<1>(codes, K, qi, ldq, off + i, ci); break;
      case 2: dots_vnni<2>(codes, K, qi, ldq, off + i, ci); break;
      case 3: dots_vnni<3>(codes, K, qi, ldq, off + i, ci); break;
      default: dots_vnni<4>(codes, K, qi, ldq, off + i, ci); break;
    }
  }
}
#endif

}  // namespace

bool w8a8_amx_available() {
#if SRT_CPU_X86
  const bool tiles = cpu_has_amx(kAmxTile | kAmxInt8);
  // read each time: the bf16 probe sets the cap in this process when the tiles trap
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  const bool capped = cap != nullptr && cap[0] != '\0' && std::strstr(cap, "AMX") == nullptr &&
                      std::strcmp(cap, "ALL") != 0 && std::strcmp(cap, "DEFAULT") != 0;
  return tiles && !capped && detect_isa() == CpuIsa::kAvx512;
#else
  return false;
#endif
}

bool w8a8_is_panels(const at::Tensor& packed, int64_t N, int64_t K) {
  return packed.dim() == 2 && packed.size(0) == (N + kNB - 1) / kNB && packed.size(1) == panel_bytes(K);
}

at::Tensor w8a8_pack_panels(const at::Tensor& data) {
  const int64_t K = data.size(1) / kBlockBytes * kBlock;
  TORCH_CHECK(K > 0, "gguf_pack_w8a8: empty rows");
  return w8a8::regroup_rows<4>(data, kNB, panel_bytes(K), 0,
                               [](int64_t r, int64_t k) { return kHead + (k / 4 * kNB + r) * 4; });
}

namespace {

// T: x's and the output's element type (float or at::BFloat16)
template <typename T>
void run_panels(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias, bool vector,
                at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), MB = (M + kMB - 1) / kMB;
  const w8a8::TokenCodes t = w8a8::quantize_rows(x.data_ptr<T>(), x.stride(0), M, K, vector);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  T* y = out.data_ptr<T>();
  // tasks panel by panel, the row blocks of a panel consecutive (its codes stay in L2 meanwhile)
  at::parallel_for(0, P * MB, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) int32_t c[kMB * kNB];
    bool used_tiles = false;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t p = task / MB, m0 = (task % MB) * kMB, rows = std::min(kMB, M - m0);
      const uint8_t* panel = w + p * panel_bytes(K);
      const int8_t* codes = reinterpret_cast<const int8_t*>(panel + kHead);
      const int8_t* q = t.q.data() + m0 * t.ldq;
      if (vector && M < few_rows()) {
#if SRT_CPU_X86
        dots_few(rows, codes, K, q, t.ldq, t.offset.data() + m0, c);
#endif
      } else if (vector) {
        used_tiles = true;
        at::native::cpublas::brgemm(rows, kNB, K, t.ldq, kNB, kNB, false, q, codes, c, true);
      } else {
        dots_scalar(codes, K, q, t.ldq, rows, c);
      }
      float dw[kNB];
      std::memcpy(dw, panel, sizeof(dw));
      const int64_t n0 = p * kNB, cols = std::min(kNB, N - n0);
      static_assert(kNB <= w8a8::kMaxRowOut, "a panel's outputs of a row are stored at once");
      for (int64_t i = 0; i < rows; ++i) {
        w8a8::store_scaled(c + i * kNB, t.scale[m0 + i], dw, bias != nullptr ? bias + n0 : nullptr, cols,
                           y + (m0 + i) * N + n0);
      }
    }
    if (used_tiles) at::native::cpublas::brgemm_release(true);
  });
}

}  // namespace

at::Tensor w8a8_linear_panels(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias,
                              bool vector) {
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return out;
  if (x.scalar_type() == at::kBFloat16) {
    run_panels<at::BFloat16>(x, packed, N, bias, vector, out);
  } else {
    run_panels<float>(x, packed, N, bias, vector, out);
  }
  return out;
}

}  // namespace srt_cpu

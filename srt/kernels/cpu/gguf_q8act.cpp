// Linear layers on GGUF-quantized weights with int8-quantized activations (numerics and row
// functions: gguf_q8act_rows.h):
//
//   gguf_linear_q8a(x [M, K] f32, data [N, K / bs * ts] u8, qtype, bias?) -> [M, N] f32
//       x quantized once per call to int8 blocks of 32 (scale d, float sum s per block), then
//       every output a sum of integer block dot products scaled in float32; the same contract
//       as gguf_linear otherwise. A type without an int8 path takes gguf_linear (float32).
//   gguf_q8a_qtypes() -> the types with an int8 path
//   gguf_q8a_gemm_rows(qtype) -> from how many activation rows on the type takes an int8 GEMM
//       faster than the float32 one (0: none on this CPU; on AVX-512 VNNI CPUs Q4_K 16, Q6_K 128)
//   gguf_q8a_debug(x, data, qtype, scalar) -> (q [M, K] i8, d [M, K / 32], s [M, K / 32], y [M, N])
//       test hook: the quantized activations and x @ W^T through the scalar (scalar = true) or
//       this CPU's row functions (AVX2 where detect_isa() has AVX2 or AVX-512).
//
// On AVX-512 CPUs with VNNI, Q4_K and Q6_K take the row functions of gguf_q8act_vnni.h, the
// other types (and every type under SRT_CPU_ISA=avx2) the AVX2 ones.
//
// Below q8a_gemm_m() rows (or without a GEMM for the type), threads take contiguous ranges of
// 4-row weight groups (so the weights stream from memory once per call) and each group passes over
// every activation row, 2 at a time; from q8a_gemm_m() rows on, each task is one group of the
// GEMM's gemm_rows weight rows against all the activation rows. Every output's sum runs
// in an order fixed by K alone (not by M, N or the thread count). The row functions follow
// detect_isa() (SRT_CPU_ISA=scalar selects the scalar ones), as for gguf_linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <vector>

#include "cpu_ops.h"
#include "gguf_q8act_rows.h"
#include "gguf_q8act_vnni.h"

namespace srt_cpu {
namespace {

namespace q8 = q8act;

struct Q8aKernels {
  q8::QuantizeRowFn quantize;
  q8::Q8aOps ops;
};

// the row functions of a type for the scalar or the vector instruction set; nullptr when the
// type has no int8 path
const Q8aKernels* find_kernels(int64_t qtype, bool scalar) {
  namespace qs = q8::scalar;
  static const Q8aKernels kScalar[] = {
      {&qs::quantize_row, {32, gguf_simple::kSizeQ4_0, &qs::dot<qs::BlockQ4_0>}},
      {&qs::quantize_row, {32, gguf_simple::kSizeQ4_1, &qs::dot<qs::BlockQ4_1>}},
      {&qs::quantize_row, {32, gguf_simple::kSizeQ8_0, &qs::dot<qs::BlockQ8_0>}},
      {&qs::quantize_row, {kquant::kQK, kquant::kQ4KBytes, &qs::dot<qs::BlockQ45K<false>>}},
      {&qs::quantize_row, {kquant::kQK, kquant::kQ5KBytes, &qs::dot<qs::BlockQ45K<true>>}},
      {&qs::quantize_row, {kquant::kQK, kquant::kQ6KBytes, &qs::dot<qs::BlockQ6K>}},
  };
  int i = -1;
  switch (qtype) {
    case kGgmlQ4_0: i = 0; break;
    case kGgmlQ4_1: i = 1; break;
    case kGgmlQ8_0: i = 2; break;
    case kGgmlQ4_K: i = 3; break;
    case kGgmlQ5_K: i = 4; break;
    case kGgmlQ6_K: i = 5; break;
    default: return nullptr;
  }
#if SRT_CPU_X86
  if (!scalar && detect_isa() == CpuIsa::kAvx512 && q8::vnni::supported() && (i == 3 || i == 5)) {
    namespace qv = q8::vnni;  // Q4_K and Q6_K; the other types run the AVX2 functions
    // Q6_K's GEMM unpacks the 6-bit codes on every call: against the float32 GEMM (11008 x 4096 on
    // Zen 5) 8.7 vs 5.2 ms at 16 rows, 26.4 vs 26.3 at 128, 46.9 vs 50.6 at 256; Q4_K's leads from 16
    static const Q8aKernels kVnni[] = {
        {&q8::avx2::quantize_row,
         {kquant::kQK, kquant::kQ4KBytes, &qv::dot_tiles<qv::Q4KTile>, qv::kXRows, &qv::q4k_gemm_rows, qv::kGemmRows,
          16}},
        {&q8::avx2::quantize_row,
         {kquant::kQK, kquant::kQ6KBytes, &qv::dot_tiles<qv::Q6KTile>, qv::kXRows, &qv::q6k_gemm_rows, qv::kGemmRows,
          128}},
    };
    return &kVnni[i == 3 ? 0 : 1];
  }
  if (!scalar && detect_isa() != CpuIsa::kScalar) {
    namespace qa = q8::avx2;
    using S = qa::Simple;
    static const Q8aKernels kAvx2[] = {
        {&qa::quantize_row, {32, gguf_simple::kSizeQ4_0, &qa::dot_tiles<qa::SimpleTile<S::kQ4_0>::K>}},
        {&qa::quantize_row, {32, gguf_simple::kSizeQ4_1, &qa::dot_tiles<qa::SimpleTile<S::kQ4_1>::K>}},
        {&qa::quantize_row, {32, gguf_simple::kSizeQ8_0, &qa::dot_tiles<qa::SimpleTile<S::kQ8_0>::K>}},
        {&qa::quantize_row, {kquant::kQK, kquant::kQ4KBytes, &qa::dot_tiles<qa::Q45KTile<false>::K>}},
        {&qa::quantize_row, {kquant::kQK, kquant::kQ5KBytes, &qa::dot_tiles<qa::Q45KTile<true>::K>}},
        {&qa::quantize_row, {kquant::kQK, kquant::kQ6KBytes, &qa::dot_tiles<qa::Q6KTile>}},
    };
    return &kAvx2[i];
  }
#endif
  (void)scalar;
  return &kScalar[i];
}

// the activations of one call, quantized (Acts points into the vectors)
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> d, s, ds;
  q8::Acts acts;
};

QuantizedX quantize_x(q8::QuantizeRowFn quantize, const float* x, int64_t ldx, int64_t M, int64_t K) {
  QuantizedX qx;
  const int64_t nb = K / q8::kXBlock;
  qx.q.resize(static_cast<size_t>(M * K));
  qx.d.resize(static_cast<size_t>(M * nb));
  qx.s.resize(static_cast<size_t>(M * nb));
  qx.ds.resize(static_cast<size_t>(2 * M * nb));
  // rows are independent: about 16K values per task
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float* d = qx.d.data() + i * nb;
      float* s = qx.s.data() + i * nb;
      quantize(x + i * ldx, K, qx.q.data() + i * K, d, s);
      float* ds = qx.ds.data() + 2 * i * nb;
      for (int64_t b = 0; b < nb; ++b) {
        ds[2 * b] = d[b];
        ds[2 * b + 1] = s[b];
      }
    }
  });
  qx.acts = {qx.q.data(), qx.d.data(), qx.s.data(), qx.ds.data(), K, nb};
  return qx;
}

// out [M, N] = acts @ W^T (+ bias): weight rows in groups of 4 over the threads
// from this many activation rows on, a type with a GEMM function takes it (SRT_Q8A_GEMM_M overrides)
int64_t q8a_gemm_m() {
  static const int64_t limit = [] {
    const char* env = std::getenv("SRT_Q8A_GEMM_M");
    return env != nullptr ? std::max<int64_t>(1, std::atoll(env)) : int64_t{16};
  }();
  return limit;
}

void linear_q8a(const q8::Q8aOps& ops, const uint8_t* w, int64_t bpr, int64_t N, const q8::Acts& a, int64_t M,
                const float* bias, float* out) {
  if (ops.gemm != nullptr && M >= q8a_gemm_m()) {
    const int64_t G = ops.gemm_rows, groups = (N + G - 1) / G;
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t n = g * G, rows = std::min(G, N - n);
        ops.gemm(w + n * bpr, bpr, rows, a, 0, M, out + n, N);
        if (bias != nullptr) {
          for (int64_t i = 0; i < M; ++i)
            for (int64_t r = 0; r < rows; ++r) out[i * N + n + r] += bias[n + r];
        }
      }
    });
    return;
  }
  constexpr int64_t G = q8::kMaxWRows;
  const int64_t groups = (N + G - 1) / G;
  const int64_t grain = std::max<int64_t>(1, 64 * 1024 / (G * bpr));  // about 64 KiB of weights per task
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = g * G, rows = std::min(G, N - n);
      for (int64_t i = 0; i < M; i += ops.x_rows) {
        const int64_t mx = std::min<int64_t>(ops.x_rows, M - i);
        ops.dot(w + n * bpr, bpr, rows, a, i, mx, out + i * N + n, N);
      }
      if (bias != nullptr) {
        for (int64_t i = 0; i < M; ++i)
          for (int64_t r = 0; r < rows; ++r) out[i * N + n + r] += bias[n + r];
      }
    }
  });
}

void check_args(const char* op, const at::Tensor& x, const at::Tensor& data, const q8::Q8aOps& ops) {
  check_activations(op, x);
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte, op,
              ": data must be a uint8 CPU tensor, got ", data.scalar_type());
  TORCH_CHECK(data.dim() == 2, op, ": data must be [N, bytes_per_row], got ", data.dim(), " dims");
  TORCH_CHECK(data.is_contiguous(), op, ": data must be contiguous");
  const int64_t K = x.size(1);
  TORCH_CHECK(K > 0 && K % ops.block_size == 0, op, ": the row length ", K,
              " must be a positive multiple of the block size ", ops.block_size);
  const int64_t bpr = K / ops.block_size * ops.type_size;
  TORCH_CHECK(data.size(1) == bpr, op, ": rows of ", K, " weights take ", bpr, " bytes, data rows have ",
              data.size(1));
}

}  // namespace

at::Tensor gguf_linear_q8a(const at::Tensor& x, const at::Tensor& data, int64_t qtype,
                           const c10::optional<at::Tensor>& bias) {
  const Q8aKernels* k = find_kernels(qtype, false);
  if (k == nullptr) return gguf_linear(x, data, qtype, bias);  // no int8 path: float32
  check_args("gguf_linear_q8a", x, data, k->ops);
  const int64_t M = x.size(0), K = x.size(1), N = data.size(0);
  const float* bp = checked_bias("gguf_linear_q8a", bias, N);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const QuantizedX qx = quantize_x(k->quantize, x.data_ptr<float>(), x.stride(0), M, K);
  linear_q8a(k->ops, data.data_ptr<uint8_t>(), data.size(1), N, qx.acts, M, bp, out.data_ptr<float>());
  return out;
}

namespace {

// one projection of the active experts: out[p, col0 + n] = (acts row p) . (row n of expert e's
// matrix in `bank`) for the pairs p of each expert e (rows starts[e] .. starts[e + 1]); all the
// experts' 4-row weight groups in one parallel loop
void experts_q8a(const q8::Q8aOps& ops, const at::Tensor& bank, const std::vector<int64_t>& active,
                 const std::vector<int64_t>& starts, const q8::Acts& acts, float* out, int64_t ldo, int64_t col0) {
  const int64_t bpr = bank.size(2);
  for_expert_row_groups<q8::kMaxWRows>(bank.data_ptr<uint8_t>(), bank.size(1), bpr, active.data(),
                                       static_cast<int64_t>(active.size()), [&](int64_t e, int64_t n, int64_t rows, const uint8_t* w) {
    for (int64_t i = starts[e]; i < starts[e + 1]; i += ops.x_rows) {
      const int64_t mx = std::min<int64_t>(ops.x_rows, starts[e + 1] - i);
      ops.dot(w, bpr, rows, acts, i, mx, out + i * ldo + col0 + n, ldo);
    }
  });
}

}  // namespace

int64_t gguf_q8a_gemm_rows(int64_t qtype) {
  const Q8aKernels* k = find_kernels(qtype, false);
  if (k == nullptr || k->ops.gemm == nullptr) return 0;
  return std::max<int64_t>(q8a_gemm_m(), k->ops.gemm_beats_float);
}

bool q8a_takes(int64_t qtype, int64_t rows, int64_t int8_max_rows) {
  if (int8_max_rows <= 0) return false;
  if (rows <= int8_max_rows) return true;
  const int64_t from = gguf_q8a_gemm_rows(qtype);
  return from > 0 && rows >= from;
}

at::Tensor moe_experts_q8a(const at::Tensor& xs, const std::vector<int64_t>& starts,
                           const std::vector<at::Tensor>& gate_up, const std::vector<int64_t>& gate_up_qtypes,
                           const at::Tensor& down, int64_t down_qtype) {
  std::vector<const Q8aKernels*> gk;
  for (int64_t q : gate_up_qtypes) gk.push_back(find_kernels(q, false));
  const Q8aKernels* dk = find_kernels(down_qtype, false);
  if (dk == nullptr || std::find(gk.begin(), gk.end(), nullptr) != gk.end()) return {};
  const int64_t P = xs.size(0), H = xs.size(1), E = down.size(0);
  int64_t width = 0;
  for (const at::Tensor& b : gate_up) width += b.size(1);
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (starts[e + 1] > starts[e]) active.push_back(e);
  const at::Tensor xc = xs.contiguous();
  const QuantizedX qx = quantize_x(gk[0]->quantize, xc.data_ptr<float>(), H, P, H);
  at::Tensor h = at::empty({P, width}, xs.options());
  int64_t col = 0;
  for (size_t b = 0; b < gate_up.size(); ++b) {
    check_args("moe_experts", xc, gate_up[b].select(0, 0), gk[b]->ops);
    experts_q8a(gk[b]->ops, gate_up[b], active, starts, qx.acts, h.data_ptr<float>(), width, col);
    col += gate_up[b].size(1);
  }
  const at::Tensor a = silu_and_mul(h);
  const int64_t I = a.size(1);
  check_args("moe_experts", a, down.select(0, 0), dk->ops);
  const QuantizedX qa = quantize_x(dk->quantize, a.data_ptr<float>(), I, P, I);
  at::Tensor y = at::empty({P, H}, xs.options());
  experts_q8a(dk->ops, down, active, starts, qa.acts, y.data_ptr<float>(), H, 0);
  return y;
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gguf_q8a_debug(const at::Tensor& x, const at::Tensor& data,
                                                                          int64_t qtype, bool scalar) {
  const Q8aKernels* k = find_kernels(qtype, scalar);
  TORCH_CHECK(k != nullptr, "gguf_q8a_debug: ggml type ", qtype, " has no int8 path");
  check_args("gguf_q8a_debug", x, data, k->ops);
  const int64_t M = x.size(0), K = x.size(1), N = data.size(0), nb = K / q8::kXBlock;
  const QuantizedX qx = quantize_x(k->quantize, x.data_ptr<float>(), x.stride(0), M, K);
  at::Tensor y = at::zeros({M, N}, x.options());
  if (M > 0 && N > 0) {
    linear_q8a(k->ops, data.data_ptr<uint8_t>(), data.size(1), N, qx.acts, M, nullptr, y.data_ptr<float>());
  }
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, nb}, x.options());
  at::Tensor s = at::empty({M, nb}, x.options());
  std::memcpy(q.data_ptr<int8_t>(), qx.q.data(), qx.q.size());
  std::memcpy(d.data_ptr<float>(), qx.d.data(), qx.d.size() * sizeof(float));
  std::memcpy(s.data_ptr<float>(), qx.s.data(), qx.s.size() * sizeof(float));
  return {q, d, s, y};
}

int64_t gguf_q8a_gemm_rows_op(int64_t qtype) { return gguf_q8a_gemm_rows(qtype); }

std::vector<int64_t> gguf_q8a_qtypes() {
  std::vector<int64_t> out;
  for (int q : {kGgmlQ4_0, kGgmlQ4_1, kGgmlQ8_0, kGgmlQ4_K, kGgmlQ5_K, kGgmlQ6_K}) {
    if (find_kernels(q, false) != nullptr) out.push_back(q);
  }
  return out;
}

}  // namespace
}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("gguf_linear_q8a(Tensor x, Tensor data, int qtype, Tensor? bias=None) -> Tensor");
  m.def("gguf_q8a_debug(Tensor x, Tensor data, int qtype, bool scalar) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("gguf_q8a_qtypes() -> int[]", &srt_cpu::gguf_q8a_qtypes);
  m.def("gguf_q8a_gemm_rows(int qtype) -> int", &srt_cpu::gguf_q8a_gemm_rows_op);
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) {
  m.impl("gguf_linear_q8a", &srt_cpu::gguf_linear_q8a);
  m.impl("gguf_q8a_debug", &srt_cpu::gguf_q8a_debug);
}

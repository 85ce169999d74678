// The K-quant row functions (Q4_K, Q5_K, Q6_K; code in gguf_kquant_rows.h) as QuantRowOps, and a
// test hook that runs one ISA's row functions directly:
//
//   gguf_kquant_debug(data [N, bpr] u8, qtype, x [M, K] f32, scalar) -> (w [N, K] f32, y [M, N] f32)
//     w = dequant_row of every row, y = x @ w^T through dot_rows (4 input rows at a time); with
//     scalar = true the portable functions, else this CPU's (SRT_CPU_ISA lowers it).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "gguf_kquant_rows.h"

namespace srt_cpu {
namespace {

namespace ks = kquant::scalar;

const QuantRowOps kScalarOps[3] = {
    scalar_row_ops<&ks::dequant_block_q4k, kquant::kQK, kquant::kQ4KBytes>(),
    scalar_row_ops<&ks::dequant_block_q5k, kquant::kQK, kquant::kQ5KBytes>(),
    scalar_row_ops<&ks::dequant_block_q6k, kquant::kQK, kquant::kQ6KBytes>(),
};

#if SRT_CPU_X86
namespace ka = kquant::avx2;
const QuantRowOps kAvx2Ops[3] = {
    {kquant::kQK, kquant::kQ4KBytes, &ka::dequant_row_q45k<false>, &ka::dot_rows_q45k<false>},
    {kquant::kQK, kquant::kQ5KBytes, &ka::dequant_row_q45k<true>, &ka::dot_rows_q45k<true>},
    {kquant::kQK, kquant::kQ6KBytes, &ka::dequant_row_q6k, &ka::dot_rows_q6k},
};
namespace kw = kquant::avx512;
const QuantRowOps kAvx512Ops[3] = {
    {kquant::kQK, kquant::kQ4KBytes, &kw::dequant_row_q45k<false>, &kw::dot_rows_q45k<false>, &kw::dot_tile_q4k},
    {kquant::kQK, kquant::kQ5KBytes, &kw::dequant_row_q45k<true>, &kw::dot_rows_q45k<true>},
    {kquant::kQK, kquant::kQ6KBytes, &kw::dequant_row_q6k, &kw::dot_rows_q6k, &kw::dot_tile_q6k},
};
#endif

std::tuple<at::Tensor, at::Tensor> gguf_kquant_debug(const at::Tensor& data, int64_t qtype, const at::Tensor& x,
                                                     bool scalar) {
  const QuantRowOps* ops = kquant_ops(static_cast<int>(qtype), scalar ? CpuIsa::kScalar : detect_isa());
  TORCH_CHECK(ops != nullptr, "gguf_kquant_debug: not a K-quant type: ", qtype);
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous(),
              "gguf_kquant_debug: data must be contiguous uint8 [N, bytes_per_row]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "gguf_kquant_debug: x must be float32 [M, K]");
  const at::Tensor xc = x.contiguous();
  const int64_t N = data.size(0), M = xc.size(0), K = xc.size(1);
  TORCH_CHECK(K % ops->block_size == 0 && data.size(1) == K / ops->block_size * ops->type_size,
              "gguf_kquant_debug: data rows do not hold ", K, " weights");
  at::Tensor w = at::empty({N, K}, xc.options());
  at::Tensor y = at::empty({M, N}, xc.options());
  const uint8_t* dp = data.data_ptr<uint8_t>();
  const int64_t bpr = data.size(1), G = K / 16;
  std::vector<float> xs(static_cast<size_t>(std::max<int64_t>(M * G, 1)));
  const float* xp = xc.data_ptr<float>();
  for (int64_t i = 0; i < M; ++i)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int t = 0; t < 16; ++t) s += xp[i * K + 16 * g + t];
      xs[i * G + g] = s;
    }
  float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      ops->dequant_row(dp + n * bpr, wp + n * K, K);
      for (int64_t i = 0; i < M; i += kMaxDotRows) {
        ops->dot_rows(dp + n * bpr, K, xp + i * K, K, xs.data() + i * G, G, std::min(kMaxDotRows, M - i),
                      yp + i * N + n, N);
      }
    }
  });
  return {w, y};
}

}  // namespace

const QuantRowOps* kquant_ops(int qtype, CpuIsa isa) {
  const int i = qtype - kGgmlQ4_K;
  if (i < 0 || i > 2) return nullptr;
#if SRT_CPU_X86
  // AVX-512: its own dot_rows and dequant_row
  if (isa == CpuIsa::kAvx512) return &kAvx512Ops[i];
  if (isa == CpuIsa::kAvx2) return &kAvx2Ops[i];
#endif
  (void)isa;
  return &kScalarOps[i];
}

}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("gguf_kquant_debug(Tensor data, int qtype, Tensor x, bool scalar) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) { m.impl("gguf_kquant_debug", &srt_cpu::gguf_kquant_debug); }

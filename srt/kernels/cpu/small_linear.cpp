// Linear layers at small batch (decode with a few sequences): out [M, N] = x [M, K] @ w[N, K]^T
// (+ bias), float32, plain row-major weights.
//
// At M <= 4 a linear layer is a matrix-vector product bound by reading the weights: this kernel
// streams each weight row once (threads take contiguous ranges of output rows, so every thread
// reads one sequential stream) and applies it to all M input rows while it is in L1 (callers use
// it for small M, where it beats a blocked GEMM). The reduction order is
// fixed per output (vector lanes, then the K tail), so results do not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#define SRT_ISA_BODY "small_linear_rows.h"
#include "isa_instances.h"
#undef SRT_ISA_BODY

namespace srt_cpu {
namespace {

using RowsFn = decltype(&scalar::small_linear_rows);

RowsFn pick_rows_fn() {
#if SRT_CPU_X86
  if (detect_isa() == CpuIsa::kAvx512) return &avx512::small_linear_rows;
  if (detect_isa() == CpuIsa::kAvx2) return &avx2::small_linear_rows;
#endif
  return &scalar::small_linear_rows;
}

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "small_batch_linear: x must be a float32 CPU tensor [M, K]");
  TORCH_CHECK(x.size(1) <= 1 || x.stride(1) == 1, "small_batch_linear: x's last dim must be contiguous");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  weight.is_contiguous() && !weight.is_mkldnn(),
              "small_batch_linear: weight must be a contiguous float32 CPU tensor [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "small_batch_linear: x has ", K, " columns, weight ", weight.size(1));
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "small_batch_linear: bias must be float32 contiguous [", N, "]");
    bp = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  static const RowsFn rows_fn = pick_rows_fn();
  // about 64 KiB of weights per task: big enough to stream, small enough to balance threads
  const int64_t grain = std::max<int64_t>(8, (64 * 1024 / 4) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { rows_fn(M, xp, xs, wp, K, op, N, bp, n0, n1); });
  return out;
}

}  // namespace
}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) { m.def("small_batch_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor"); }

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) { m.impl("small_batch_linear", &srt_cpu::small_batch_linear); }

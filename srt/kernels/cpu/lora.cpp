// The LoRA update of one linear layer over rows grouped by adapter (srt/lora/layer.py):
//   out[starts[g] : ends[g]] += (x[starts[g] : ends[g]] @ a[g].T) @ b[g].T   for every group g
// in place, in the very ATen ops of the Python path (the same bits), from one call: a decode step
// of many adapters makes one call per layer rather than a few Python ops per adapter.
#include <torch/library.h>

#include <ATen/ATen.h>

#include <vector>

namespace srt_cpu {

void lora_segments_(at::Tensor out, const at::Tensor& x, const std::vector<at::Tensor>& a,
                    const std::vector<at::Tensor>& b, const std::vector<int64_t>& starts,
                    const std::vector<int64_t>& ends) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && out.size(0) == x.size(0) && out.is_contiguous(),
              "lora_segments_: out [T, N] (contiguous) and x [T, K] with the same rows");
  TORCH_CHECK(a.size() == b.size() && starts.size() == a.size() && ends.size() == a.size(),
              "lora_segments_: one A, one B, one start and one end per group");
  for (size_t g = 0; g < a.size(); ++g) {
    const int64_t start = starts[g], n = ends[g] - start;
    TORCH_CHECK(start >= 0 && n >= 0 && start + n <= x.size(0), "lora_segments_: rows out of the batch");
    if (n == 0) continue;
    at::Tensor rows = out.narrow(0, start, n);
    rows.addmm_(at::mm(x.narrow(0, start, n), a[g].t()), b[g].t());
  }
}

}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("lora_segments_(Tensor(a!) out, Tensor x, Tensor[] a, Tensor[] b, int[] starts, int[] ends) -> ()");
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) { m.impl("lora_segments_", &srt_cpu::lora_segments_); }

// Mixture-of-experts blocks: the experts of one sparse MLP for a batch, grouped by expert.
//
//   moe_experts(x [T, H] f32, weights [T, k] f32, ids [T, k] i64, gate_up banks, gate_up qtypes,
//               down bank, down qtype, int8_max_rows) -> [T, H] f32
//
// A bank holds the E matrices of one projection: GGUF blocks uint8 [E, rows, bytes per row] of a
// native type, or float32 [E, rows, cols] (qtype 0). gate_up is one bank [E, 2I, *] (gate rows
// then up rows of each expert) or two banks (gate, up) of different types; down is [E, H, *].
//
// The T*k (token, slot) pairs are ordered by expert id, stable (pair p = t * k + j keeps its
// order within an expert: a counting sort), the pairs' rows of x gathered. When no expert has more
// than int8_max_rows rows and every bank has an int8 path (decode), moe_experts_q8a
// (gguf_q8act.cpp) runs every expert's gate_up in one parallel loop, silu_and_mul, then every
// expert's down in another, on int8 activations quantized once per projection. Otherwise, per
// expert with rows, one gate_up matmul over all of them (gguf_linear, or gguf_linear_q8a when
// q8a_takes: at most int8_max_rows rows, or a type with an int8 GEMM; at::linear for float banks), silu_and_mul, one down matmul. Each
// row is then scaled by its routing weight and the rows added to their tokens with index_add_ in
// that order. The two int8 ways give the same bits (the same row functions on the same quantized
// rows). Without int8 activations (int8_max_rows 0), when no expert has more than kMoeSmallRows
// (7) rows and the banks are Q4_K / Q6_K on AVX-512 VNNI CPUs, moe_experts_a24 (gguf_a24.cpp) runs
// the experts in one loop per projection the same way, each through the path gguf_linear takes
// for its rows (24-bit or register tiles): the same bits as one gguf_linear per expert. This is
// srt/layers/moe.py's MoEExperts.forward as one call: the Python path calls this op when the
// extension is built and runs the same steps op by op otherwise, and the native decode stack
// (decode_layers.cpp) calls moe_forward below.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu_ops.h"

namespace srt_cpu {

namespace {

constexpr int64_t kF32 = 0;  // ggml's F32: a float bank

at::Tensor bank_linear(const at::Tensor& x, const at::Tensor& bank, int64_t qtype, int64_t e, int64_t int8_max_rows) {
  const at::Tensor w = bank.select(0, e);
  if (qtype == kF32) return at::linear(x, w);
  if (q8a_takes(qtype, x.size(0), int8_max_rows)) return gguf_linear_q8a(x, w, qtype, c10::nullopt);
  return gguf_linear(x, w, qtype, c10::nullopt);
}

void check_bank(const at::Tensor& bank, int64_t qtype, int64_t E, const char* name) {
  TORCH_CHECK(bank.device().is_cpu() && bank.dim() == 3 && bank.size(0) == E && bank.is_contiguous(),
              "moe_experts: the ", name, " bank must be a contiguous CPU tensor [", E, ", rows, *]");
  TORCH_CHECK(qtype == kF32 ? bank.scalar_type() == at::kFloat : bank.scalar_type() == at::kByte,
              "moe_experts: the ", name, " bank must be float32 for qtype 0 and uint8 blocks otherwise");
}

// the experts one at a time (float banks, or more rows than the int8 path takes)
at::Tensor experts_one_by_one(const at::Tensor& xs, const std::vector<int64_t>& counts,
                              const std::vector<int64_t>& starts, const std::vector<at::Tensor>& gate_up,
                              const std::vector<int64_t>& gate_up_qtypes, const at::Tensor& down,
                              int64_t down_qtype, int64_t int8_max_rows) {
  const int64_t E = down.size(0), P = xs.size(0), H = xs.size(1);
  at::Tensor ys = at::empty({P, H}, xs.options());
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = counts[e];
    if (n == 0) continue;
    const at::Tensor xe = xs.narrow(0, starts[e], n);
    at::Tensor h = gate_up.size() == 1
                       ? bank_linear(xe, gate_up[0], gate_up_qtypes[0], e, int8_max_rows)
                       : at::cat({bank_linear(xe, gate_up[0], gate_up_qtypes[0], e, int8_max_rows),
                                  bank_linear(xe, gate_up[1], gate_up_qtypes[1], e, int8_max_rows)},
                                 -1);
    ys.narrow(0, starts[e], n).copy_(bank_linear(silu_and_mul(h), down, down_qtype, e, int8_max_rows));
  }
  return ys;
}

}  // namespace

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                       const std::vector<at::Tensor>& gate_up, const std::vector<int64_t>& gate_up_qtypes,
                       const at::Tensor& down, int64_t down_qtype, int64_t int8_max_rows) {
  check_activations("moe_experts", x);
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == T,
              "moe_experts: ids must be int64 [T, k] with T = x's rows");
  TORCH_CHECK(weights.sizes() == ids.sizes(), "moe_experts: weights and ids differ in shape");
  TORCH_CHECK((gate_up.size() == 1 || gate_up.size() == 2) && gate_up.size() == gate_up_qtypes.size(),
              "moe_experts: one gate_up bank or two (gate, up), with a qtype each");
  const int64_t E = down.size(0), k = ids.size(1), P = T * k;
  for (size_t b = 0; b < gate_up.size(); ++b) check_bank(gate_up[b], gate_up_qtypes[b], E, "gate_up");
  check_bank(down, down_qtype, E, "down");
  TORCH_CHECK(down.size(1) == H, "moe_experts: down's rows (", down.size(1), ") differ from x's width ", H);

  // counting sort of the pairs by expert (stable)
  const at::Tensor flat = ids.reshape({P}).contiguous();
  const int64_t* id = flat.data_ptr<int64_t>();
  std::vector<int64_t> counts(E, 0), starts(E + 1, 0);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < E, "moe_experts: expert id ", id[p], " outside [0, ", E, ")");
    ++counts[id[p]];
  }
  for (int64_t e = 0; e < E; ++e) starts[e + 1] = starts[e] + counts[e];
  at::Tensor order = at::empty({P}, at::kLong);
  int64_t* op = order.data_ptr<int64_t>();
  std::vector<int64_t> fill(starts.begin(), starts.end() - 1);
  for (int64_t p = 0; p < P; ++p) op[fill[id[p]]++] = p;
  const at::Tensor tokens = at::div(order, k, "floor");

  const at::Tensor xs = x.index_select(0, tokens);
  at::Tensor ys;
  const bool float_bank = down_qtype == kF32 || std::find(gate_up_qtypes.begin(), gate_up_qtypes.end(), kF32) !=
                                                    gate_up_qtypes.end();
  if (!float_bank && *std::max_element(counts.begin(), counts.end()) <= int8_max_rows) {
    ys = moe_experts_q8a(xs, starts, gate_up, gate_up_qtypes, down, down_qtype);
  }
  if (!ys.defined() && !float_bank && int8_max_rows <= 0 &&
      *std::max_element(counts.begin(), counts.end()) <= kMoeSmallRows) {
    ys = moe_experts_a24(xs, starts, gate_up, gate_up_qtypes, down, down_qtype);
  }
  if (!ys.defined()) ys = experts_one_by_one(xs, counts, starts, gate_up, gate_up_qtypes, down, down_qtype, int8_max_rows);
  ys.mul_(weights.reshape({P}).index_select(0, order).unsqueeze(1).to(ys.scalar_type()));
  return at::zeros({T, H}, x.options()).index_add_(0, tokens, ys);
}


std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& router_logits, int64_t top_k, bool renormalize) {
  const at::Tensor probs = at::softmax(router_logits, -1, at::kFloat);
  auto [w, ids] = at::topk(probs, top_k, -1);
  if (renormalize) w = w / w.sum(-1, /*keepdim=*/true);
  return {w, ids};
}

}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def(
      "moe_experts(Tensor x, Tensor weights, Tensor ids, Tensor[] gate_up, int[] gate_up_qtypes, Tensor down, "
      "int down_qtype, int int8_max_rows=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) { m.impl("moe_experts", &srt_cpu::moe_experts); }

// torch.ops.srt_cpu.extend_attention: causal attention of prefill (extend) tokens on CPU, the
// prefix-aligned mask SGLang's extend uses, float32:
//
//   q           [T, H, D]      the batch's new tokens (last dim contiguous)
//   k, v        [N, H_kv, D]   every sequence's keys / values in order, cached prefix first, then
//                              the new tokens (last dim contiguous; other strides free)
//   q_starts, kv_starts, extend_lens, seq_lens   int64 [B]: sequence b's queries are rows
//               q_starts[b] .. + extend_lens[b] of q, its keys rows kv_starts[b] .. + seq_lens[b]
//               of k / v
//   scale       softmax scale;  isa: "scalar" / "avx2" / "avx512" ("": the best the CPU has)
//   window_left sliding window (-1: none);  logit_cap  soft-cap of the scaled scores (0: none)
//   -> out      [T, H, D] float32, contiguous
//
//   query j of sequence b (head h) sees keys 0 .. prefix_b + j, prefix_b = seq_lens[b] -
//   extend_lens[b], of KV head h / (H / H_kv); with a window only keys >= prefix_b + j -
//   window_left of them; with a cap, scores s -> logit_cap * tanh(s / logit_cap) before the softmax.
//   Keys no query of a sequence sees (before its first query's window) are never transposed or read.
//
// D must be a multiple of 64 (every ISA's key block; the Python caller falls back to SDPA
// otherwise). Per call, each (sequence, KV head)'s K is transposed once to blocks of 64 keys, each
// [D][64] (contiguous, so a block's rows never share L1 sets as a long [D][keys]'s do); then work
// items of up to QB query rows of one head (extend_attention_kernel.h) run on torch's threads,
// taken longest first from a shared counter (the causal mask makes late rows the costly ones).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "cpu_ops.h"
#include "vec.h"

#define SRT_ISA_BODY "extend_attention_kernel.h"
#include "isa_instances.h"
#undef SRT_ISA_BODY

namespace srt_cpu {
namespace {

using RowsFn = void (*)(int, const float*, int64_t, const float*, const float*, int64_t, int64_t, int64_t,
                        int64_t, float, float, float*, int64_t, float*, float*);

struct Impl {
  RowsFn rows;
  int rt;  // rows per register tile
  int qb;  // rows per item
};

Impl pick(c10::string_view isa) {
  const CpuIsa want = requested_isa("extend_attention", isa);
  switch (want) {
#if SRT_CPU_X86
    case CpuIsa::kAvx512: return {&avx512::rows, avx512::RT, avx512::QB};
    case CpuIsa::kAvx2: return {&avx2::rows, avx2::RT, avx2::QB};
#endif
    default: return {&scalar::rows, scalar::RT, scalar::QB};
  }
}

std::vector<int64_t> to_vector(const at::Tensor& t, int64_t B, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == B,
              "extend_attention: ", name, " must be an int64 CPU tensor [", B, "]");
  const at::Tensor c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + B);
}

void check_float3(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 3 && t.stride(2) == 1, "extend_attention: ",
              name, " must be a float32 CPU tensor [rows, heads, D] with a contiguous last dim");
}

struct Item {
  int64_t seq, head, j0, cost;
};

}  // namespace

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_starts,
                            const at::Tensor& kv_starts, const at::Tensor& extend_lens, const at::Tensor& seq_lens,
                            double scale, c10::string_view isa, int64_t window_left, double logit_cap) {
  check_float3(q, "q");
  check_float3(k, "k");
  check_float3(v, "v");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), N = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(v.size(0) == N && v.size(1) == Hkv && k.size(2) == D && v.size(2) == D,
              "extend_attention: k and v must both be [N, H_kv, ", D, "]");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "extend_attention: ", H, " query heads for ", Hkv, " KV heads");
  TORCH_CHECK(D % 64 == 0, "extend_attention: head dim must be a multiple of 64, got ", D);
  TORCH_CHECK(window_left >= -1, "extend_attention: window_left must be >= -1 (-1: no window), got ", window_left);
  TORCH_CHECK(std::isfinite(logit_cap) && logit_cap >= 0, "extend_attention: logit_cap must be >= 0 (0: off), got ",
              logit_cap);
  const int64_t B = q_starts.numel();
  const std::vector<int64_t> qs = to_vector(q_starts, B, "q_starts"), ks = to_vector(kv_starts, B, "kv_starts"),
                             es = to_vector(extend_lens, B, "extend_lens"), ss = to_vector(seq_lens, B, "seq_lens");
  const Impl impl = pick(isa);
  constexpr int64_t kPad = scalar::kKeyBlock;  // keys: the transposed K's block, every ISA's
  std::vector<int64_t> kt_off(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(es[b] >= 0 && es[b] <= ss[b] && qs[b] >= 0 && qs[b] + es[b] <= T && ks[b] >= 0 && ks[b] + ss[b] <= N,
                "extend_attention: sequence ", b, " (q rows ", qs[b], "+", es[b], ", kv rows ", ks[b], "+", ss[b],
                ") is outside q [", T, "] / k [", N, "]");
    kt_off[b + 1] = kt_off[b] + Hkv * D * ((ss[b] + kPad - 1) / kPad * kPad);
  }
  at::Tensor out = at::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0 || D == 0) return out;
  // every sequence's K, per KV head, as blocks of kPad keys [D][kPad] (zeros past the last key)
  // (in chunks of kPad keys: enough pieces to share among the threads)
  std::vector<float> kt(static_cast<size_t>(kt_off[B]));  // every slot written below
  // the first key sequence b's queries see (its first query's window), rounded down to a chunk
  const auto first_chunk = [&](int64_t b) -> int64_t {
    return window_left < 0 ? 0 : std::max<int64_t>(0, ss[b] - es[b] - window_left) / kPad * kPad;
  };
  std::vector<std::array<int64_t, 3>> chunks;  // (sequence, KV head, first key)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      for (int64_t t0 = first_chunk(b); t0 < ss[b]; t0 += kPad) chunks.push_back({b, hk, t0});
    }
  }
  const float* kp = k.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 4, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const auto [b, hk, t0] = chunks[i];
      const int64_t pad = (ss[b] + kPad - 1) / kPad * kPad, n = std::min(kPad, ss[b] - t0);
      float* dst = kt.data() + kt_off[b] + hk * D * pad + t0 * D;  // block t0 / kPad
      for (int64_t d = 0; d < D; ++d) std::fill(dst + d * kPad + n, dst + (d + 1) * kPad, 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const float* src = kp + (ks[b] + t0 + t) * k.stride(0) + hk * k.stride(1);
        for (int64_t d = 0; d < D; ++d) dst[d * kPad + t] = src[d];
      }
    }
  });
  // work items: up to QB query rows of one sequence and head, the costliest (most keys) first
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t prefix = ss[b] - es[b];
    for (int64_t j0 = 0; j0 < es[b]; j0 += impl.qb) {
      int64_t cost = prefix + std::min<int64_t>(es[b], j0 + impl.qb);  // keys of the item's last row
      if (window_left >= 0) cost = std::min<int64_t>(cost, window_left + impl.qb);
      for (int64_t h = 0; h < H; ++h) items.push_back({b, h, j0, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const float* qp = q.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t G = H / Hkv, n_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_items), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(static_cast<size_t>(impl.rt * kPad + impl.qb * D));
    for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
      const Item& it = items[w];
      const int64_t b = it.seq, h = it.head, hk = h / G, prefix = ss[b] - es[b];
      const int R = static_cast<int>(std::min<int64_t>(impl.qb, es[b] - it.j0));
      const int64_t pad = (ss[b] + kPad - 1) / kPad * kPad;
      impl.rows(R, qp + (qs[b] + it.j0) * q.stride(0) + h * q.stride(1), q.stride(0),
                kt.data() + kt_off[b] + hk * D * pad, vp + ks[b] * v.stride(0) + hk * v.stride(1), v.stride(0), D,
                prefix + it.j0, window_left, static_cast<float>(scale), static_cast<float>(logit_cap),
                op + ((qs[b] + it.j0) * H + h) * D, H * D, scratch.data(), scratch.data() + impl.rt * kPad);
    }
  });
  return out;
}

}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def(
      "extend_attention(Tensor q, Tensor k, Tensor v, Tensor q_starts, Tensor kv_starts, Tensor extend_lens, "
      "Tensor seq_lens, float scale, str isa=\"\", int window_left=-1, float logit_cap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) { m.impl("extend_attention", &srt_cpu::extend_attention); }

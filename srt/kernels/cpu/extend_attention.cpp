// torch.ops.srt_cpu.extend_attention: causal attention of prefill (extend) tokens on CPU, the
// prefix-aligned mask SGLang's extend uses:
//
//   q           [T, H, D]      the batch's new tokens (last dim contiguous); q, k and v float32,
//                              bf16 or fp16
//   k, v        [N, H_kv, D]   every sequence's keys / values in order, cached prefix first, then
//                              the new tokens (last dim contiguous; other strides free)
//   q_starts, kv_starts, extend_lens, seq_lens   int64 [B]: sequence b's queries are rows
//               q_starts[b] .. + extend_lens[b] of q, its keys rows kv_starts[b] .. + seq_lens[b]
//               of k / v
//   scale       softmax scale;  isa: "scalar" / "avx2" / "avx512" (the float32 kernel, 16-bit
//               inputs widened to float32 first), "avx512_bf16" (bf16 q, k and v on vdpbf16ps;
//               AVX512-BF16 CPUs), "" (avx512_bf16 for bf16 inputs where vdpbf16ps is fast, else the
//               best float32 kernel the CPU runs)
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
// taken longest first from a shared counter (the causal mask makes late rows the costly ones). The
// bf16 kernel packs K as blocks [D/2][64][2] and V as [32][D][2] instead (pairs for vdpbf16ps).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "bf16_tiles.h"  // cpu_has_avx512_bf16, cpu_bf16_dot_fast
#include "cpu_ops.h"
#include "vec.h"

#define SRT_ISA_BODY "extend_attention_kernel.h"
#include "isa_instances.h"
// a fourth copy for bf16 q, K and V on CPUs with AVX512-BF16: both products on vdpbf16ps
#include "isa_instance_bf16.h"
#undef SRT_ISA_BODY

namespace srt_cpu {
namespace {

using RowsFn = void (*)(int, const float*, int64_t, const float*, const float*, int64_t, int64_t, int64_t,
                        int64_t, float, float, float*, int64_t, float*, float*);

struct Impl {
  RowsFn rows;  // the float32 kernel (null: the bf16 one)
  int rt;       // rows per register tile
  int qb;       // rows per item
};

// The kernel for `isa` ("" picks): the AVX512-BF16 copy for bf16 q, K and V where the CPU's
// vdpbf16ps is fast (cpu_bf16_dot_fast: AMD's cores; Intel's issue it at half the FMA's rate, no
// faster than the widened float32 kernel) or where "avx512_bf16" asks for it; else the float32
// kernel of the ISA, any 16-bit input widened to float32 first.
Impl pick(c10::string_view isa, bool all_bf16) {
  const std::string name(isa);
#if SRT_CPU_X86
  const Impl dot{nullptr, avx512_bf16::RT, avx512_bf16::QB};
  if (name == "avx512_bf16") {
    TORCH_CHECK(cpu_has_avx512_bf16(), "extend_attention: isa 'avx512_bf16' is not available on this CPU (it runs up "
                "to '", isa_name(detect_isa()), "')");
    TORCH_CHECK(all_bf16, "extend_attention: isa 'avx512_bf16' takes bf16 q, k and v");
    return dot;
  }
  if (name.empty() && all_bf16 && cpu_bf16_dot_fast()) return dot;
#endif
  TORCH_CHECK(name != "avx512_bf16", "extend_attention: isa 'avx512_bf16' is not available on this CPU");
  CpuIsa want = CpuIsa::kScalar;
  TORCH_CHECK(name.empty() || parse_isa(name.c_str(), &want), "extend_attention: isa must be '', 'scalar', 'avx2', "
              "'avx512' or 'avx512_bf16', got '", name, "'");
  switch (requested_isa("extend_attention", isa)) {
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

void check3(const at::Tensor& t, const char* name) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(t.device().is_cpu() && (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) && t.dim() == 3 &&
                  t.stride(2) == 1,
              "extend_attention: ", name,
              " must be a float32, bf16 or fp16 CPU tensor [rows, heads, D] with a contiguous last dim");
}

struct Item {
  int64_t seq, head, j0, cost;
};

constexpr int64_t kPad = scalar::kKeyBlock;  // keys: the packed K's (and V's) block, every ISA's

// What both kernels share of a call: the sequences, where each (sequence, KV head)'s packed K
// starts (kt_off: elements, Hkv x D x keys rounded up to kPad a sequence), the chunks of kPad keys to
// pack (sequence, KV head, first key: those some query sees) and the work items, costliest first.
struct Plan {
  int64_t H, D, Hkv;
  std::vector<int64_t> qs, ks, es, ss, kt_off;
  std::vector<std::array<int64_t, 3>> chunks;
  std::vector<Item> items;

  int64_t pad(int64_t b) const { return (ss[b] + kPad - 1) / kPad * kPad; }
  // sequence b's KV head hk's packed blocks
  int64_t base(int64_t b, int64_t hk) const { return kt_off[b] + hk * D * pad(b); }
};

Plan make_plan(int64_t T, int64_t N, int64_t H, int64_t D, int64_t Hkv, const at::Tensor& q_starts,
               const at::Tensor& kv_starts, const at::Tensor& extend_lens, const at::Tensor& seq_lens,
               int64_t window_left, int qb) {
  Plan p;
  p.H = H, p.D = D, p.Hkv = Hkv;
  const int64_t B = q_starts.numel();
  p.qs = to_vector(q_starts, B, "q_starts"), p.ks = to_vector(kv_starts, B, "kv_starts");
  p.es = to_vector(extend_lens, B, "extend_lens"), p.ss = to_vector(seq_lens, B, "seq_lens");
  const auto &qs = p.qs, &ks = p.ks, &es = p.es, &ss = p.ss;
  p.kt_off.assign(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(es[b] >= 0 && es[b] <= ss[b] && qs[b] >= 0 && qs[b] + es[b] <= T && ks[b] >= 0 && ks[b] + ss[b] <= N,
                "extend_attention: sequence ", b, " (q rows ", qs[b], "+", es[b], ", kv rows ", ks[b], "+", ss[b],
                ") is outside q [", T, "] / k [", N, "]");
    p.kt_off[b + 1] = p.kt_off[b] + Hkv * D * p.pad(b);
  }
  for (int64_t b = 0; b < B; ++b) {
    // the first key sequence b's queries see (its first query's window), rounded down to a chunk
    const int64_t first = window_left < 0 ? 0 : std::max<int64_t>(0, ss[b] - es[b] - window_left) / kPad * kPad;
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      for (int64_t t0 = first; t0 < ss[b]; t0 += kPad) p.chunks.push_back({b, hk, t0});
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t prefix = ss[b] - es[b];
    for (int64_t j0 = 0; j0 < es[b]; j0 += qb) {
      int64_t cost = prefix + std::min<int64_t>(es[b], j0 + qb);  // keys of the item's last row
      if (window_left >= 0) cost = std::min<int64_t>(cost, window_left + qb);
      for (int64_t h = 0; h < H; ++h) p.items.push_back({b, h, j0, cost});
    }
  }
  std::stable_sort(p.items.begin(), p.items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return p;
}

// pack(b, hk, t0) for every chunk, on torch's threads
template <typename F>
void for_chunks(const Plan& p, F&& pack) {
  at::parallel_for(0, static_cast<int64_t>(p.chunks.size()), 4, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) pack(p.chunks[i][0], p.chunks[i][1], p.chunks[i][2]);
  });
}

// Each of torch's threads makes a worker (make(): its scratch and the call) and runs items taken
// from a shared counter, costliest first (the causal mask makes late rows the costly ones).
template <typename Make>
void for_items(const Plan& p, Make&& make) {
  const int64_t n_items = static_cast<int64_t>(p.items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_items), 1, [&](int64_t, int64_t) {
    auto work = make();
    for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) work(p.items[w]);
  });
}

// The float32 kernel: K per (sequence, KV head) as blocks of kPad keys [D][kPad] (zeros past the
// last key); V read in place.
void run_float(const Plan& p, const Impl& impl, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               float scale, int64_t window_left, float cap, at::Tensor& out) {
  const int64_t D = p.D, H = p.H, G = p.H / p.Hkv;
  std::vector<float> kt(static_cast<size_t>(p.kt_off.back()));  // every slot some query reads is written
  const float* kp = k.data_ptr<float>();
  for_chunks(p, [&](int64_t b, int64_t hk, int64_t t0) {
    const int64_t n = std::min(kPad, p.ss[b] - t0);
    float* dst = kt.data() + p.base(b, hk) + t0 * D;  // block t0 / kPad
    for (int64_t d = 0; d < D; ++d) std::fill(dst + d * kPad + n, dst + (d + 1) * kPad, 0.f);
    for (int64_t t = 0; t < n; ++t) {
      const float* src = kp + (p.ks[b] + t0 + t) * k.stride(0) + hk * k.stride(1);
      for (int64_t d = 0; d < D; ++d) dst[d * kPad + t] = src[d];
    }
  });
  const float* qp = q.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_items(p, [&] {
    return [&, scratch = std::vector<float>(static_cast<size_t>(impl.rt * kPad + impl.qb * D))](const Item& it) mutable {
      const int64_t b = it.seq, h = it.head, hk = h / G, prefix = p.ss[b] - p.es[b];
      const int R = static_cast<int>(std::min<int64_t>(impl.qb, p.es[b] - it.j0));
      impl.rows(R, qp + (p.qs[b] + it.j0) * q.stride(0) + h * q.stride(1), q.stride(0), kt.data() + p.base(b, hk),
                vp + p.ks[b] * v.stride(0) + hk * v.stride(1), v.stride(0), D, prefix + it.j0, window_left, scale, cap,
                op + ((p.qs[b] + it.j0) * H + h) * D, H * D, scratch.data(), scratch.data() + impl.rt * kPad);
    };
  });
}

#if SRT_CPU_X86
// The AVX512-BF16 kernel (extend_attention_kernel.h): per (sequence, KV head), K as blocks of kPad
// keys [D/2][kPad][2] and V as [kPad/2][D][2], zeros past the last key.
void run_bf16(const Plan& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale,
              int64_t window_left, float cap, at::Tensor& out) {
  const int64_t D = p.D, H = p.H, G = p.H / p.Hkv;
  std::vector<uint16_t> kpk(static_cast<size_t>(p.kt_off.back())), vpk(kpk.size());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  for_chunks(p, [&](int64_t b, int64_t hk, int64_t t0) {
    const int64_t n = std::min(kPad, p.ss[b] - t0), off = p.base(b, hk) + t0 * D;
    // K: key t's pair (2dp, 2dp + 1) as one 32-bit word at [dp][t]
    auto* kd = reinterpret_cast<uint32_t*>(kpk.data() + off);
    for (int64_t t = 0; t < kPad; ++t) {
      const uint16_t* src = kp + (p.ks[b] + t0 + t) * k.stride(0) + hk * k.stride(1);
      for (int64_t dp = 0; dp < D / 2; ++dp) {
        uint32_t w = 0;
        if (t < n) std::memcpy(&w, src + 2 * dp, sizeof w);
        kd[dp * kPad + t] = w;
      }
    }
    // V: keys (2tp, 2tp + 1)'s value d at [tp][d]
    uint16_t* vd = vpk.data() + off;
    for (int64_t tp = 0; tp < kPad / 2; ++tp) {
      for (int64_t e = 0; e < 2; ++e) {
        const int64_t t = 2 * tp + e;
        const uint16_t* src = vp + (p.ks[b] + t0 + t) * v.stride(0) + hk * v.stride(1);
        for (int64_t d = 0; d < D; ++d) vd[(tp * D + d) * 2 + e] = t < n ? src[d] : 0;
      }
    }
  });
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  constexpr int RT = avx512_bf16::RT, QB = avx512_bf16::QB;
  for_items(p, [&] {
    return [&, s = std::vector<float>(RT * kPad + QB * D), pb = std::vector<uint16_t>(RT * kPad)](const Item& it) mutable {
      const int64_t b = it.seq, h = it.head, hk = h / G, prefix = p.ss[b] - p.es[b];
      const int R = static_cast<int>(std::min<int64_t>(QB, p.es[b] - it.j0));
      avx512_bf16::rows_bf16(R, qp + (p.qs[b] + it.j0) * q.stride(0) + h * q.stride(1), q.stride(0),
                             kpk.data() + p.base(b, hk), vpk.data() + p.base(b, hk), D, prefix + it.j0, window_left,
                             scale, cap, op + ((p.qs[b] + it.j0) * H + h) * D, H * D, s.data(), pb.data(),
                             s.data() + RT * kPad);
    };
  });
}
#endif

}  // namespace

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_starts,
                            const at::Tensor& kv_starts, const at::Tensor& extend_lens, const at::Tensor& seq_lens,
                            double scale, c10::string_view isa, int64_t window_left, double logit_cap) {
  check3(q, "q");
  check3(k, "k");
  check3(v, "v");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), N = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(v.size(0) == N && v.size(1) == Hkv && k.size(2) == D && v.size(2) == D,
              "extend_attention: k and v must both be [N, H_kv, ", D, "]");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "extend_attention: ", H, " query heads for ", Hkv, " KV heads");
  TORCH_CHECK(D % 64 == 0, "extend_attention: head dim must be a multiple of 64, got ", D);
  TORCH_CHECK(window_left >= -1, "extend_attention: window_left must be >= -1 (-1: no window), got ", window_left);
  TORCH_CHECK(std::isfinite(logit_cap) && logit_cap >= 0, "extend_attention: logit_cap must be >= 0 (0: off), got ",
              logit_cap);
  const bool all_bf16 =
      q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16;
  const Impl impl = pick(isa, all_bf16);
  const Plan plan = make_plan(T, N, H, D, Hkv, q_starts, kv_starts, extend_lens, seq_lens, window_left, impl.qb);
  at::Tensor out = at::empty({T, H, D}, q.options().dtype(at::kFloat).memory_format(at::MemoryFormat::Contiguous));
  if (T == 0 || D == 0) return out;
  const float sc = static_cast<float>(scale), cap = static_cast<float>(logit_cap);
#if SRT_CPU_X86
  if (impl.rows == nullptr) {
    run_bf16(plan, q, k, v, sc, window_left, cap, out);
    return out;
  }
#endif
  run_float(plan, impl, q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), sc, window_left, cap, out);
  return out;
}

}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def(
      "extend_attention(Tensor q, Tensor k, Tensor v, Tensor q_starts, Tensor kv_starts, Tensor extend_lens, "
      "Tensor seq_lens, float scale, str isa=\"\", int window_left=-1, float logit_cap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) { m.impl("extend_attention", &srt_cpu::extend_attention); }

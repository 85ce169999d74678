// torch.ops.srt_cpu.paged_decode_attention: fused paged decode attention on CPU, one query
// token per sequence, reading K/V in place through the page table (no gather).
//
//   q                [bs, H, D]     float32 (last dim contiguous; other strides free)
//   k_buffer         [S, H_kv, D]   float32 / float16 / bfloat16 (last dim contiguous)
//   v_buffer         [S, H_kv, D]   same dtype and shape as k_buffer
//   req_to_token     [R, max_ctx]   int64 or int32: the KV slot of each token of a request row
//   req_pool_indices [bs]           int64 or int32: the request row of sequence i
//   seq_lens         [bs]           int64 or int32: the tokens of sequence i (0 .. max_ctx)
//   scale            float          softmax scale
//   split_len        int = 0        tokens per KV split (0: chosen from the batch and threads)
//   isa              str = ""       "scalar" / "avx2" / "avx512" ("": the best the CPU has)
//   window_left      int = -1       sliding window: the query (at position seq_lens[i] - 1) sees
//                                   keys t >= seq_lens[i] - 1 - window_left only (-1: all)
//   logit_cap        float = 0      soft-capping: scores -> cap * tanh(scores / cap) (0: off)
//   -> out           [bs, H, D]     float32, contiguous
//
//   out[i, h] = softmax_t(c(scale q[i, h] . K[slot(i, t), h / G])) @ V[slot(i, t), h / G]
//   slot(i, t) = req_to_token[req_pool_indices[i], t], first_i <= t < seq_lens[i], G = H / H_kv
//   first_i = max(0, seq_lens[i] - 1 - window_left) (0 without a window), c = the soft-cap or none
//   (a sequence of length 0 gives zeros; K/V are converted to float32 in registers). Keys before
//   first_i are never read: a long context under a small window costs the window only. A bf16
//   KV cache on a CPU with AVX512-BF16 (the avx512 path, D a multiple of 32), for queries that
//   are bf16 values (a bf16 model's), takes both products on vdpbf16ps: the scores exact products
//   with float32 sums, P rounded to bf16 for P @ V (as torch's flash attention and transformers'
//   eager attention round it), the softmax sums float32; other queries keep the FMAs. Batch 32 x
//   2,048 tokens of Qwen2.5-1.5B's attention (28 layers) on an AMD Zen 4, alternated against the
//   scores alone on vdpbf16ps: pages of 16 tokens 1.15-1.20x, in order 1.13-1.17x, permuted
//   slots 1.16-1.29x.
//
// Work items are (sequence, KV-head group, token range); each loads a K/V row once for the G
// query heads of its KV head (decode_attention_kernel.h). Items run on torch's intra-op threads
// (at::parallel_for; torch.set_num_threads applies), taken longest first from a shared counter.
// With enough sequences an item holds all H_kv heads (a slot's K rows for all heads are one
// contiguous range: streams the hardware prefetcher follows); a sequence is cut into ranges of
// split_len tokens, and the heads into groups, only when the batch alone gives too few items.
// A cut sequence's ranges leave partials (acc, max, sum) per head that a second pass combines
// with the log-sum-exp. The result is deterministic for given inputs and thread count (the
// split points depend on the thread count; which thread runs an item does not matter).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"

#include "vec.h"

namespace srt_cpu {

constexpr int kBlock = 16;             // tokens per softmax block (a multiple of every W)
constexpr int64_t kMinSplit = 256;     // shortest automatic split: the combine stays < 1% of it
constexpr int64_t kItemsPerThread = 8; // enough items for the dynamic schedule to balance
constexpr int64_t kSerialWork = 512;   // token x KV-head rows below which one thread does it all

// One work item for attend(): NH consecutive KV heads (G query heads each) over n tokens.
struct AttendArgs {
  const float* q;         // [NH][G][D] the item's queries, pre-multiplied by scale
  const void* k;          // k_buffer data at the item's first KV head h0: the row of slot x and
                          // head h0 + h starts at k + x * k_stride + h * k_head_stride (elements)
  const void* v;          // likewise for v_buffer
  int64_t k_stride;
  int64_t v_stride;
  int64_t k_head_stride;
  int64_t v_head_stride;
  const int64_t* slots;   // [n] KV slots of the tokens
  int64_t n;
  int64_t NH;
  int64_t G;
  int64_t D;
  float* acc;             // [NH][G][D] in: zeros; out: unnormalized sum_t p_t V_t
  float* m;               // [NH][G] in: -inf; out: running max of the scores
  float* l;               // [NH][G] in: 0; out: sum_t p_t
  float* s;               // [G][kBlock] scratch: scores, then probabilities
  uint32_t* pp;           // [G][kBlock / 2] scratch: the probabilities as bf16 pairs (with qb)
  float cap;              // soft-cap of the (scaled) scores, 0: none
  const uint16_t* qb;     // the AVX512-BF16 copy with a bf16 K: [NH][G][D] the queries unscaled, as
  float qk_scale;         // bf16 (its scores are qk_scale x qb . K), or null: q as float32
};

using AttendFn = void (*)(const AttendArgs&);

}  // namespace srt_cpu

#define SRT_ISA_BODY "decode_attention_kernel.h"
#include "isa_instances.h"

// a fourth copy for a bf16 KV cache on CPUs with AVX512-BF16: bf16 queries' scores and P @ V on vdpbf16ps
#include "isa_instance_bf16.h"
#undef SRT_ISA_BODY

namespace srt_cpu {
namespace {

using Isa = CpuIsa;

template <class KT>
AttendFn pick_attend(Isa isa) {
  switch (isa) {
#if SRT_CPU_X86
    case Isa::kAvx512: return &avx512::attend<KT>;
    case Isa::kAvx2: return &avx2::attend<KT>;
#endif
    default: return &scalar::attend<KT>;
  }
}

// Whether a bf16 KV cache takes the AVX512-BF16 copy: the AVX-512 path on a CPU with bf16 dot
// products, a head dim of whole 32-element loads.
bool bf16_dot_copy(at::ScalarType kv_dtype, Isa isa, int64_t D) {
#if SRT_CPU_X86
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  }();
  return has && kv_dtype == at::kBFloat16 && isa == Isa::kAvx512 && D % 32 == 0;
#else
  (void)kv_dtype, (void)isa, (void)D;
  return false;
#endif
}

AttendFn pick_attend(at::ScalarType kv_dtype, Isa isa, bool dot) {
  switch (kv_dtype) {
    case at::kHalf: return pick_attend<c10::Half>(isa);
#if SRT_CPU_X86
    case at::kBFloat16: return dot ? &avx512_bf16::attend<c10::BFloat16> : pick_attend<c10::BFloat16>(isa);
#else
    case at::kBFloat16: return pick_attend<c10::BFloat16>(isa);
#endif
    default: return pick_attend<float>(isa);
  }
}

bool is_index_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kLong || t.scalar_type() == at::kInt;
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  std::vector<int64_t> out(t.numel());
  if (t.scalar_type() == at::kLong) {
    auto a = t.accessor<int64_t, 1>();
    for (int64_t i = 0; i < t.numel(); ++i) out[i] = a[i];
  } else {
    auto a = t.accessor<int32_t, 1>();
    for (int64_t i = 0; i < t.numel(); ++i) out[i] = a[i];
  }
  return out;
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& r2t,
                  const at::Tensor& rows, const at::Tensor& lens, double scale, int64_t split_len,
                  int64_t window_left, double logit_cap) {
  const char* fn = "paged_decode_attention: ";
  for (const at::Tensor* t : {&q, &k, &v, &r2t, &rows, &lens}) {
    TORCH_CHECK(t->device().is_cpu(), fn, "all tensors must be on the CPU, got one on ", t->device());
  }
  TORCH_CHECK(q.dim() == 3, fn, "q must be [bs, H, D], got shape ", q.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat, fn, "q must be float32, got ", q.scalar_type());
  TORCH_CHECK(k.dim() == 3, fn, "k_buffer must be [S, H_kv, D], got shape ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), fn, "v_buffer shape ", v.sizes(), " != k_buffer shape ", k.sizes());
  const auto kv_dtype = k.scalar_type();
  TORCH_CHECK(kv_dtype == at::kFloat || kv_dtype == at::kHalf || kv_dtype == at::kBFloat16, fn,
              "k_buffer must be float32, float16 or bfloat16, got ", kv_dtype);
  TORCH_CHECK(v.scalar_type() == kv_dtype, fn, "v_buffer dtype ", v.scalar_type(), " != k_buffer dtype ",
              kv_dtype);
  TORCH_CHECK(k.size(2) == q.size(2), fn, "head dim mismatch: q has D = ", q.size(2), ", k_buffer has ",
              k.size(2));
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, fn, "q's heads (", q.size(1),
              ") must be a multiple of k_buffer's heads (", k.size(1), ")");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, fn, "k_buffer and v_buffer need a contiguous last dim");
  TORCH_CHECK(r2t.dim() == 2 && is_index_dtype(r2t), fn, "req_to_token must be int64/int32 [R, max_ctx], got ",
              r2t.scalar_type(), " ", r2t.sizes());
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == q.size(0) && is_index_dtype(rows), fn,
              "req_pool_indices must be int64/int32 [bs] with bs = ", q.size(0), ", got ", rows.scalar_type(), " ",
              rows.sizes());
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == q.size(0) && is_index_dtype(lens), fn,
              "seq_lens must be int64/int32 [bs] with bs = ", q.size(0), ", got ", lens.scalar_type(), " ",
              lens.sizes());
  TORCH_CHECK(std::isfinite(scale), fn, "scale must be finite, got ", scale);
  TORCH_CHECK(split_len >= 0, fn, "split_len must be >= 0 (0: automatic), got ", split_len);
  TORCH_CHECK(window_left >= -1, fn, "window_left must be >= -1 (-1: no window), got ", window_left);
  TORCH_CHECK(std::isfinite(logit_cap) && logit_cap >= 0, fn, "logit_cap must be >= 0 (0: off), got ", logit_cap);
}

// Tokens per split: about kItemsPerThread items per thread, never fewer than kMinSplit tokens;
// a sequence no longer than the result is not split.
int64_t auto_split_len(int64_t total_tokens, int64_t nthreads) {
  if (nthreads <= 1) return INT64_MAX;
  const int64_t per_item = (total_tokens + kItemsPerThread * nthreads - 1) / (kItemsPerThread * nthreads);
  return std::max(kMinSplit, (per_item + kBlock - 1) / kBlock * kBlock);
}

// KV heads per item: all of them when the (sequence, range) units alone give enough items.
int64_t heads_per_item(int64_t n_units, int64_t h_kv, int64_t nthreads) {
  if (nthreads <= 1) return h_kv;
  const int64_t groups = std::min(h_kv, (kItemsPerThread * nthreads + n_units - 1) / n_units);
  return (h_kv + groups - 1) / groups;
}

// A range of one sequence's tokens; its items are (unit, head group).
struct Unit {
  int64_t seq;
  int64_t t0;
  int64_t t1;
  int64_t part;  // -1: the whole sequence (write out); else partials part + h, h < H_kv
};

// The work of one call: units longest first, items = units x head groups of nh heads.
struct Plan {
  std::vector<Unit> units;
  std::vector<int64_t> split_seqs;  // sequences cut into more than one unit
  std::vector<int64_t> first_part;  // [bs] first partial of a cut sequence (-1: not cut)
  int64_t split_len = 0;
  int64_t n_parts = 0;              // partials (cut units x H_kv)
  int64_t max_unit = 0;             // tokens of the longest unit
  int64_t nh = 0;                   // KV heads per item
  int64_t n_groups = 0;             // head groups per unit
};

Plan make_plan(const std::vector<int64_t>& lens, int64_t total, int64_t h_kv, int64_t split_len,
               int64_t nthreads) {
  Plan p;
  p.split_len = split_len > 0 ? split_len : auto_split_len(total, nthreads);
  p.first_part.assign(lens.size(), -1);
  for (int64_t i = 0; i < static_cast<int64_t>(lens.size()); ++i) {
    if (lens[i] <= p.split_len) {
      p.units.push_back({i, 0, lens[i], -1});
      p.max_unit = std::max(p.max_unit, lens[i]);
      continue;
    }
    p.split_seqs.push_back(i);
    p.first_part[i] = p.n_parts;
    for (int64_t t0 = 0; t0 < lens[i]; t0 += p.split_len) {
      p.units.push_back({i, t0, std::min(lens[i], t0 + p.split_len), p.n_parts});
      p.n_parts += h_kv;
    }
    p.max_unit = std::max(p.max_unit, p.split_len);
  }
  std::stable_sort(p.units.begin(), p.units.end(),
                   [](const Unit& a, const Unit& b) { return a.t1 - a.t0 > b.t1 - b.t0; });
  p.nh = heads_per_item(static_cast<int64_t>(p.units.size()), h_kv, nthreads);
  p.n_groups = (h_kv + p.nh - 1) / p.nh;
  return p;
}

// Reads the slots of tokens t0 .. t0 + n - 1 of one req_to_token row; false if one is outside
// [0, num_slots).
bool read_slots(const at::Tensor& r2t, int64_t row, int64_t t0, int64_t n, int64_t num_slots, int64_t* out) {
  const int64_t s1 = r2t.stride(1);
  bool ok = true;
  if (r2t.scalar_type() == at::kLong) {
    const int64_t* p = r2t.data_ptr<int64_t>() + row * r2t.stride(0) + t0 * s1;
    for (int64_t t = 0; t < n; ++t) {
      out[t] = p[t * s1];
      ok &= out[t] >= 0 && out[t] < num_slots;
    }
  } else {
    const int32_t* p = r2t.data_ptr<int32_t>() + row * r2t.stride(0) + t0 * s1;
    for (int64_t t = 0; t < n; ++t) {
      out[t] = p[t * s1];
      ok &= out[t] >= 0 && out[t] < num_slots;
    }
  }
  return ok;
}

// out[seq, h*G + g] from the partials of a split sequence: log-sum-exp weights e^(m_s - M).
void combine_splits(const float* acc, const float* m, const float* l, int64_t first_part, int64_t n_splits,
                    int64_t h, int64_t h_kv, int64_t G, int64_t D, float* out_heads) {
  for (int64_t g = 0; g < G; ++g) {
    float mx = -INFINITY;
    for (int64_t s = 0; s < n_splits; ++s) mx = std::max(mx, m[(first_part + s * h_kv + h) * G + g]);
    float* o = out_heads + (h * G + g) * D;
    std::fill(o, o + D, 0.f);
    float den = 0.f;
    for (int64_t s = 0; s < n_splits; ++s) {
      const int64_t p = first_part + s * h_kv + h;
      const float w = std::exp(m[p * G + g] - mx);
      den += w * l[p * G + g];
      const float* a = acc + (p * G + g) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                  const at::Tensor& seq_lens, double scale, int64_t split_len,
                                  c10::string_view isa_request, int64_t window_left, double logit_cap) {
  check_inputs(q_in, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale, split_len, window_left,
               logit_cap);
  const Isa isa = requested_isa("paged_decode_attention", isa_request);
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const int64_t bs = q.size(0), H = q.size(1), D = q.size(2);
  const bool dot = bf16_dot_copy(k_buffer.scalar_type(), isa, D);
  const AttendFn attend = pick_attend(k_buffer.scalar_type(), isa, dot);
  const int64_t S = k_buffer.size(0), h_kv = k_buffer.size(1), G = H / h_kv;
  const int64_t R = req_to_token.size(0), max_ctx = req_to_token.size(1);
  at::Tensor out = at::empty({bs, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (bs == 0 || D == 0) return out;

  const std::vector<int64_t> lens = to_vector(seq_lens);
  const std::vector<int64_t> rows = to_vector(req_pool_indices);
  // the keys each query sees: tokens first[i] .. lens[i] - 1 (span[i] of them)
  std::vector<int64_t> first(bs, 0), span(lens);
  int64_t total = 0;
  for (int64_t i = 0; i < bs; ++i) {
    TORCH_CHECK(lens[i] >= 0 && lens[i] <= max_ctx, "paged_decode_attention: seq_lens[", i, "] = ", lens[i],
                " is outside [0, ", max_ctx, "] (req_to_token's columns)");
    TORCH_CHECK(rows[i] >= 0 && rows[i] < R, "paged_decode_attention: req_pool_indices[", i, "] = ", rows[i],
                " is outside [0, ", R, ") (req_to_token's rows)");
    if (window_left >= 0) first[i] = std::max<int64_t>(0, lens[i] - 1 - window_left);
    span[i] = lens[i] - first[i];
    total += span[i];
  }
  const int64_t nthreads = at::get_num_threads();
  const Plan plan = make_plan(span, total, h_kv, split_len, nthreads);
  const std::vector<Unit>& units = plan.units;
  const int64_t nh = plan.nh, n_groups = plan.n_groups, n_parts = plan.n_parts;

  std::vector<float> part_acc(n_parts * G * D), part_m(n_parts * G), part_l(n_parts * G);
  const float* q_ptr = q.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t n_items = static_cast<int64_t>(units.size()) * n_groups;
  const int64_t kv_elem = k_buffer.element_size();
  const char* k_base = static_cast<const char*>(k_buffer.data_ptr());
  const char* v_base = static_cast<const char*>(v_buffer.data_ptr());
  std::atomic<int64_t> next{0};
  std::atomic<bool> bad_slot{false};
  const int64_t workers = total * h_kv < kSerialWork ? 1 : std::min(nthreads, n_items);

  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const int64_t hgd = nh * G * D;
    std::vector<float> buf(2 * hgd + 2 * nh * G + G * kBlock);
    std::vector<int64_t> slots(std::max<int64_t>(plan.max_unit, 1));
    std::vector<uint16_t> qb(dot ? hgd : 0);
    std::vector<uint32_t> pp(dot ? G * kBlock / 2 : 0);
    float* qs = buf.data();
    float* acc = qs + hgd;
    float* m = acc + hgd;
    float* l = m + nh * G;
    float* s = l + nh * G;
    for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
      const Unit& u = units[w / n_groups];
      const int64_t h0 = (w % n_groups) * nh, nhi = std::min(nh, h_kv - h0), n = u.t1 - u.t0;
      if (!read_slots(req_to_token, rows[u.seq], first[u.seq] + u.t0, n, S, slots.data())) {
        bad_slot.store(true, std::memory_order_relaxed);
        continue;
      }
      // query heads (h0 + hh) * G + g of this sequence, hh < nhi: contiguous in q's head dim; with
      // `dot`, their bf16 copy if every value is one (q_bf16)
      bool q_bf16 = dot;
      for (int64_t r = 0; r < nhi * G; ++r) {
        const float* src = q_ptr + u.seq * q.stride(0) + (h0 * G + r) * q.stride(1);
        for (int64_t d = 0; d < D; ++d) qs[r * D + d] = src[d] * static_cast<float>(scale);
        for (int64_t d = 0; dot && d < D; ++d) {
          const c10::BFloat16 b(src[d]);
          q_bf16 &= static_cast<float>(b) == src[d];
          qb[r * D + d] = b.x;
        }
      }
      std::fill(acc, acc + nhi * G * D, 0.f);
      std::fill(m, m + nhi * G, -INFINITY);
      std::fill(l, l + nhi * G, 0.f);
      const AttendArgs args{qs,
                            k_base + h0 * k_buffer.stride(1) * kv_elem,
                            v_base + h0 * v_buffer.stride(1) * kv_elem,
                            k_buffer.stride(0),
                            v_buffer.stride(0),
                            k_buffer.stride(1),
                            v_buffer.stride(1),
                            slots.data(),
                            n,
                            nhi,
                            G,
                            D,
                            acc,
                            m,
                            l,
                            s,
                            pp.data(),
                            static_cast<float>(logit_cap),
                            q_bf16 ? qb.data() : nullptr,
                            static_cast<float>(scale)};
      attend(args);
      if (u.part < 0) {
        float* o = out_ptr + (u.seq * H + h0 * G) * D;
        for (int64_t r = 0; r < nhi * G; ++r) {
          const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
          for (int64_t d = 0; d < D; ++d) o[r * D + d] = acc[r * D + d] * inv;
        }
      } else {
        const int64_t p = u.part + h0;  // partials p .. p + nhi - 1: [G][D], [G], [G] each
        std::copy(acc, acc + nhi * G * D, part_acc.data() + p * G * D);
        std::copy(m, m + nhi * G, part_m.data() + p * G);
        std::copy(l, l + nhi * G, part_l.data() + p * G);
      }
    }
  });
  TORCH_CHECK(!bad_slot.load(), "paged_decode_attention: req_to_token holds a slot outside [0, ", S,
              ") (k_buffer's rows) for a token below its sequence's seq_len");

  const int64_t n_combine = static_cast<int64_t>(plan.split_seqs.size()) * h_kv;
  at::parallel_for(0, n_combine, 16, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t i = plan.split_seqs[c / h_kv], h = c % h_kv;
      const int64_t n_splits = (span[i] + plan.split_len - 1) / plan.split_len;
      combine_splits(part_acc.data(), part_m.data(), part_l.data(), plan.first_part[i], n_splits, h, h_kv, G, D,
                     out_ptr + i * H * D);
    }
  });
  return out;
}

namespace {

at::Tensor paged_decode_attention_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const at::Tensor&, const at::Tensor&, double, int64_t, c10::string_view,
                                       int64_t, double) {
  return at::empty(q.sizes(), q.options().dtype(at::kFloat));
}

// the ISA the ops run (SRT_CPU_ISA may lower it) and the one the CPU has
std::string cpu_isa() { return isa_name(detect_isa()); }
std::string cpu_hardware_isa() { return isa_name(hardware_isa()); }

}  // namespace
}  // namespace srt_cpu

TORCH_LIBRARY(srt_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, "
      "Tensor req_pool_indices, Tensor seq_lens, float scale, int split_len=0, str isa=\"\", int window_left=-1, "
      "float logit_cap=0.0) -> Tensor");
  m.def("cpu_isa() -> str", &srt_cpu::cpu_isa);
  m.def("cpu_hardware_isa() -> str", &srt_cpu::cpu_hardware_isa);
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) {
  m.impl("paged_decode_attention", &srt_cpu::paged_decode_attention);
}

TORCH_LIBRARY_IMPL(srt_cpu, Meta, m) {
  m.impl("paged_decode_attention", &srt_cpu::paged_decode_attention_meta);
}

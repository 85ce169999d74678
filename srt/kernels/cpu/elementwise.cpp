// Fused element-wise ops of a decoder layer, float32 or bf16, one pass over memory each:
//
//   silu_and_mul(x [T, 2d]) -> [T, d]             silu(x[:, :d]) * x[:, d:]
//   quick_gelu(x [T, n]) -> [T, n]                x * sigmoid(1.702 x) (CLIP's, Qwen2-VL's towers)
//   add_rms_norm_(x [T, h], residual [T, h], w [h], eps) -> [T, h]
//       residual += x (in place), then residual * rsqrt(mean(residual^2) + eps) * w
//   rotary_neox_(q [T, Hq*D], k [T, Hk*D], positions [T], cos_sin [P, D]) (in place)
//       per head: [x1 | x2] -> [x1*cos - x2*sin | x2*cos + x1*sin], cos/sin = cos_sin[pos] halves;
//       bf16 q, k take a bf16 table (a bf16 decoder's rounding) or a float32 one (float32 math,
//       each result rounded once: a vision tower's rope, as transformers computes it)
//   apply_token_bitmask_(logits [B, V], rows [n], bitmask [n, W] int32) (in place)
//       logits[rows[i], t] = -inf where bit t % 32 of bitmask[i][t / 32] is 0, and for t >= 32 W
//       (constrained decoding; whole words of 0 / of 1 bits are filled / skipped at once)
//
// bf16 tensors (all of a call's, weights and cos_sin included) compute in float32 and round to
// bf16 where torch's separate bf16 ops would (elementwise_rows.h): what a bf16 model's Python
// layers compute, and transformers' bf16 modules.
//
// Rows may have any stride (views of a fused projection's output); the last dim must be
// contiguous. Work is split over rows (at::parallel_for, a grain of about 16k elements so small
// batches stay on one thread). The AVX2 / AVX-512 paths carry their own target attributes and
// are chosen at run time, as in decode_attention.cpp. Rounding differs from torch's separate
// ops by float32 reassociation only (a vector sum of squares; fused multiply-adds).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu_ops.h"

#define SRT_ISA_BODY "elementwise_rows.h"
#include "isa_instances.h"
#undef SRT_ISA_BODY

namespace srt_cpu {
namespace {

int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

// The row functions of the widest instruction set this CPU has.
struct RowFns {
  decltype(&scalar::silu_and_mul_rows) silu_and_mul;
  decltype(&scalar::add_rms_norm_rows) add_rms_norm;
  decltype(&scalar::rotary_rows<float>) rotary;
  decltype(&scalar::silu_and_mul_rows_bf16) silu_and_mul_bf16;
  decltype(&scalar::add_rms_norm_rows_bf16) add_rms_norm_bf16;
  decltype(&scalar::rotary_rows_bf16) rotary_bf16;
  decltype(&scalar::silu_mul_f32_bf16) silu_mul_f32_bf16;
  decltype(&scalar::quick_gelu_rows) quick_gelu;
  decltype(&scalar::quick_gelu_rows_bf16) quick_gelu_bf16;
  decltype(&scalar::rotary_rows<uint16_t>) rotary_bf16_f32;
};

#define SRT_ROW_FNS(ns)                                                                                   \
  RowFns {                                                                                                \
    &ns::silu_and_mul_rows, &ns::add_rms_norm_rows, &ns::rotary_rows<float>, &ns::silu_and_mul_rows_bf16, \
        &ns::add_rms_norm_rows_bf16, &ns::rotary_rows_bf16, &ns::silu_mul_f32_bf16, &ns::quick_gelu_rows, \
        &ns::quick_gelu_rows_bf16, &ns::rotary_rows<uint16_t>                                             \
  }

const RowFns& row_fns() {
  static const RowFns fns = [] {
#if SRT_CPU_X86
    if (detect_isa() == CpuIsa::kAvx512) return SRT_ROW_FNS(avx512);
    if (detect_isa() == CpuIsa::kAvx2) return SRT_ROW_FNS(avx2);
#endif
    return SRT_ROW_FNS(scalar);
  }();
  return fns;
}

// a float32 or bf16 CPU tensor [T, n] with a contiguous last dim, of `dtype` when one is given
void check_rows(const at::Tensor& t, const char* name, const char* op,
                c10::optional<at::ScalarType> dtype = c10::nullopt) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16), op, ": ",
              name, " must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(!dtype.has_value() || t.scalar_type() == *dtype, op, ": ", name, " is ", t.scalar_type(), ", not ",
              *dtype, " as the other inputs");
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D [T, n], got ", t.dim(), "-D");
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, op, ": ", name, "'s last dim must be contiguous");
}

template <typename T>
T* raw(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

}  // namespace

void silu_mul_f32_bf16(const float* g, const float* u, at::BFloat16* out, int64_t n) {
  row_fns().silu_mul_f32_bf16(g, u, reinterpret_cast<uint16_t*>(out), n);
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x", "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: x's last dim must be even, got ", x.size(1));
  const int64_t T = x.size(0), d = x.size(1) / 2;
  at::Tensor out = at::empty({T, d}, x.options());
  if (T == 0 || d == 0) return out;
  const int64_t grain = row_grain(2 * d);
  if (x.scalar_type() == at::kBFloat16) {
    const uint16_t* xp = raw<const uint16_t>(x);
    uint16_t* op = raw<uint16_t>(out);
    const auto fn = row_fns().silu_and_mul_bf16;
    at::parallel_for(0, T, grain, [&](int64_t b, int64_t e) { fn(xp, x.stride(0), op, d, b, e); });
    return out;
  }
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const auto fn = row_fns().silu_and_mul;
  at::parallel_for(0, T, grain, [&](int64_t b, int64_t e) { fn(xp, xs, op, d, b, e); });
  return out;
}

at::Tensor quick_gelu(const at::Tensor& x) {
  check_rows(x, "x", "quick_gelu");
  const int64_t T = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({T, n}, x.options());
  if (T == 0 || n == 0) return out;
  const int64_t grain = row_grain(n), xs = x.stride(0);
  if (x.scalar_type() == at::kBFloat16) {
    const uint16_t* xp = raw<const uint16_t>(x);
    uint16_t* op = raw<uint16_t>(out);
    const auto fn = row_fns().quick_gelu_bf16;
    at::parallel_for(0, T, grain, [&](int64_t b, int64_t e) { fn(xp, xs, op, n, b, e); });
    return out;
  }
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto fn = row_fns().quick_gelu;
  at::parallel_for(0, T, grain, [&](int64_t b, int64_t e) { fn(xp, xs, op, n, b, e); });
  return out;
}

at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x", "add_rms_norm_");
  check_rows(residual, "residual", "add_rms_norm_", x.scalar_type());
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm_: residual ", residual.sizes(), " != x ", x.sizes());
  const int64_t T = x.size(0), h = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(),
              "add_rms_norm_: weight must be contiguous [", h, "] of x's dtype (", x.scalar_type(), ")");
  at::Tensor out = at::empty({T, h}, x.options());
  if (T == 0 || h == 0) return out;
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kBFloat16) {
    const uint16_t* xp = raw<const uint16_t>(x);
    uint16_t* rp = raw<uint16_t>(residual);
    const uint16_t* wp = raw<const uint16_t>(weight);
    uint16_t* op = raw<uint16_t>(out);
    const int64_t xs = x.stride(0), rs = residual.stride(0);
    const auto fn = row_fns().add_rms_norm_bf16;
    at::parallel_for(0, T, row_grain(h), [&](int64_t b, int64_t end) { fn(xp, xs, rp, rs, wp, op, h, e, b, end); });
    return out;
  }
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  const auto fn = row_fns().add_rms_norm;
  at::parallel_for(0, T, row_grain(h), [&](int64_t b, int64_t end) { fn(xp, xs, rp, rs, wp, op, h, e, b, end); });
  return out;
}

void rotary_neox_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos_sin, int64_t head_dim) {
  check_rows(q, "q", "rotary_neox_");
  check_rows(k, "k", "rotary_neox_", q.scalar_type());
  const int64_t T = q.size(0), D = head_dim;
  TORCH_CHECK(D > 0 && D % 2 == 0, "rotary_neox_: head_dim must be even and positive, got ", D);
  TORCH_CHECK(k.size(0) == T && q.size(1) % D == 0 && k.size(1) % D == 0,
              "rotary_neox_: q/k must be [T, heads * head_dim]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "rotary_neox_: positions must be int64 contiguous [T]");
  const bool f32_table = q.scalar_type() == at::kBFloat16 && cos_sin.scalar_type() == at::kFloat;
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.size(1) == D &&
                  (cos_sin.scalar_type() == q.scalar_type() || f32_table) && cos_sin.stride(1) == 1,
              "rotary_neox_: cos_sin must be [max_position, head_dim] of q's dtype (", q.scalar_type(),
              ") or, with bf16 q, float32");
  if (T == 0) return;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t P = cos_sin.size(0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "rotary_neox_: position ", pos[t], " outside [0, ", P, ")");
  }
  const int64_t hq = q.size(1) / D, hk = k.size(1) / D;
  const int64_t qs = q.stride(0), ks = k.stride(0), css = cos_sin.stride(0);
  const int64_t grain = row_grain((hq + hk) * D);
  if (f32_table) {
    uint16_t* qp = raw<uint16_t>(q);
    uint16_t* kp = raw<uint16_t>(k);
    const float* cs = cos_sin.data_ptr<float>();
    const auto fn = row_fns().rotary_bf16_f32;
    at::parallel_for(0, T, grain, [&](int64_t b, int64_t e) { fn(qp, qs, hq, kp, ks, hk, pos, cs, css, D, b, e); });
    return;
  }
  if (q.scalar_type() == at::kBFloat16) {
    uint16_t* qp = raw<uint16_t>(q);
    uint16_t* kp = raw<uint16_t>(k);
    const uint16_t* cs = raw<const uint16_t>(cos_sin);
    const auto fn = row_fns().rotary_bf16;
    at::parallel_for(0, T, grain, [&](int64_t b, int64_t e) { fn(qp, qs, hq, kp, ks, hk, pos, cs, css, D, b, e); });
    return;
  }
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* cs = cos_sin.data_ptr<float>();
  const auto fn = row_fns().rotary;
  at::parallel_for(0, T, grain, [&](int64_t b, int64_t e) { fn(qp, qs, hq, kp, ks, hk, pos, cs, css, D, b, e); });
}

void apply_token_bitmask_(at::Tensor logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_token_bitmask_: logits must be float32 [B, V] with contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "apply_token_bitmask_: rows must be int64 contiguous [n]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
                  bitmask.size(0) == rows.size(0),
              "apply_token_bitmask_: bitmask must be int32 contiguous [n, W] with one row per rows entry");
  const int64_t n = rows.size(0), V = logits.size(1), W = bitmask.size(1), B = logits.size(0);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < B, "apply_token_bitmask_: row ", r[i], " outside [0, ", B, ")");
  }
  float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const auto* words = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float* row = base + r[i] * stride;
      const uint32_t* w = words + i * W;
      const int64_t covered = std::min(V, 32 * W);
      for (int64_t k = 0; 32 * k < covered; ++k) {
        const uint32_t word = w[k];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t lo = 32 * k, hi = std::min(lo + 32, covered);
        if (word == 0) {
          std::fill(row + lo, row + hi, kNegInf);
        } else if (hi - lo == 32) {  // fixed trip count, a select per token: no branches
          float* p = row + lo;
          for (int j = 0; j < 32; ++j) p[j] = ((word >> j) & 1u) ? p[j] : kNegInf;
        } else {
          for (int64_t t = lo; t < hi; ++t) row[t] = ((word >> (t - lo)) & 1u) ? row[t] : kNegInf;
        }
      }
      std::fill(row + covered, row + V, kNegInf);
    }
  });
}

}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor rows, Tensor bitmask) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("quick_gelu(Tensor x) -> Tensor");
  m.def("add_rms_norm_(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_neox_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_sin, int head_dim) -> ()");
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) {
  m.impl("silu_and_mul", &srt_cpu::silu_and_mul);
  m.impl("quick_gelu", &srt_cpu::quick_gelu);
  m.impl("add_rms_norm_", &srt_cpu::add_rms_norm_);
  m.impl("rotary_neox_", &srt_cpu::rotary_neox_);
  m.impl("apply_token_bitmask_", &srt_cpu::apply_token_bitmask_);
}

// Row loops of elementwise.cpp for one instruction set (compiled once per ISA through
// isa_instances.h, which defines SRT_ISA_NS, SRT_ISA_VEC and SRT_ISA_TARGET; the scalar
// path has no target attribute). Each function handles
// rows [b, e) of its op; the caller splits rows over threads.
#include <cmath>
#include <cstdint>

#include "vec.h"

namespace srt_cpu {
namespace SRT_ISA_NS {

using V = SRT_ISA_VEC;

// silu(g) * u = g * u / (1 + e^-g); o [T, d] contiguous
SRT_ISA_TARGET void silu_and_mul_rows(const float* x, int64_t xs, float* o, int64_t d, int64_t b, int64_t e) {
  const V::reg one = V::set1(1.f), neg = V::set1(-1.f);
  for (int64_t t = b; t < e; ++t) {
    const float* g = x + t * xs;
    const float* u = g + d;
    float* out = o + t * d;
    int64_t j = 0;
    for (; j + V::W <= d; j += V::W) {
      const V::reg gv = V::load(g + j);
      const V::reg den = V::add(one, V::exp(V::mul(gv, neg)));
      V::store(out + j, V::div(V::mul(gv, V::load(u + j)), den));
    }
    for (; j < d; ++j) out[j] = g[j] * u[j] / (1.f + std::exp(-g[j]));
  }
}

// x * sigmoid(1.702 x) (CLIP's and Qwen2-VL's "quick_gelu"); o [T, n] contiguous
SRT_ISA_TARGET void quick_gelu_rows(const float* x, int64_t xs, float* o, int64_t n, int64_t b, int64_t e) {
  const V::reg one = V::set1(1.f), k = V::set1(-1.702f);
  for (int64_t t = b; t < e; ++t) {
    const float* xr = x + t * xs;
    float* out = o + t * n;
    int64_t j = 0;
    for (; j + V::W <= n; j += V::W) {
      const V::reg xv = V::load(xr + j);
      V::store(out + j, V::div(xv, V::add(one, V::exp(V::mul(xv, k)))));
    }
    for (; j < n; ++j) out[j] = xr[j] / (1.f + std::exp(-1.702f * xr[j]));
  }
}

// r += x; o = r * rsqrt(mean(r^2) + eps) * w; o [T, h] contiguous
SRT_ISA_TARGET void add_rms_norm_rows(const float* x, int64_t xs, float* r, int64_t rs, const float* w, float* o,
                                      int64_t h, float eps, int64_t b, int64_t e) {
  for (int64_t t = b; t < e; ++t) {
    const float* xr = x + t * xs;
    float* rr = r + t * rs;
    float* out = o + t * h;
    V::reg acc = V::zero();
    int64_t j = 0;
    for (; j + V::W <= h; j += V::W) {
      const V::reg s = V::add(V::load(rr + j), V::load(xr + j));
      V::store(rr + j, s);
      acc = V::fmadd(s, s, acc);
    }
    float ss = V::hsum(acc);
    for (; j < h; ++j) {
      rr[j] += xr[j];
      ss += rr[j] * rr[j];
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
    const V::reg iv = V::set1(inv);
    for (j = 0; j + V::W <= h; j += V::W) V::store(out + j, V::mul(V::mul(V::load(rr + j), iv), V::load(w + j)));
    for (; j < h; ++j) out[j] = rr[j] * inv * w[j];
  }
}

// x rows of float32 or bf16 (raw bits), through float32 lanes
SRT_ISA_TARGET inline V::reg load_lanes(const float* p) { return V::load(p); }
SRT_ISA_TARGET inline V::reg load_lanes(const uint16_t* p) { return V::load_bf16(p); }
SRT_ISA_TARGET inline void store_lanes(float* p, V::reg v) { V::store(p, v); }
SRT_ISA_TARGET inline void store_lanes(uint16_t* p, V::reg v) { V::store_bf16(p, v); }
inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return bf16_bits_to_float(v); }
inline void narrow(float* p, float v) { *p = v; }
inline void narrow(uint16_t* p, float v) { *p = float_to_bf16_bits(v); }

// float32 math on a float32 table: the float32 rope, and on bf16 rows (each result rounded once)
// a vision tower's, which transformers computes in float32 on the widened rows
template <typename T>
SRT_ISA_TARGET inline void rotate_heads(T* x, int64_t n_heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t hh = 0; hh < n_heads; ++hh) {
    T* x1 = x + hh * D;
    T* x2 = x1 + half;
    int64_t j = 0;
    for (; j + V::W <= half; j += V::W) {
      const V::reg a = load_lanes(x1 + j), bb = load_lanes(x2 + j);
      const V::reg c = V::load(cos + j), s = V::load(sin + j);
      store_lanes(x1 + j, V::sub(V::mul(a, c), V::mul(bb, s)));
      store_lanes(x2 + j, V::add(V::mul(bb, c), V::mul(a, s)));
    }
    for (; j < half; ++j) {
      const float a = widen(x1[j]), bb = widen(x2[j]);
      narrow(x1 + j, a * cos[j] - bb * sin[j]);
      narrow(x2 + j, bb * cos[j] + a * sin[j]);
    }
  }
}

// rotate every head of q [T, hq*D] and k [T, hk*D] in place by cos_sin[pos[t]] = [cos | sin]
template <typename T>
SRT_ISA_TARGET void rotary_rows(T* q, int64_t qs, int64_t hq, T* k, int64_t ks, int64_t hk, const int64_t* pos,
                                const float* cs, int64_t cs_stride, int64_t D, int64_t b, int64_t e) {
  for (int64_t t = b; t < e; ++t) {
    const float* c = cs + pos[t] * cs_stride;
    rotate_heads(q + t * qs, hq, D, c, c + D / 2);
    rotate_heads(k + t * ks, hk, D, c, c + D / 2);
  }
}

// bf16 rows (raw bits), float32 math rounded to bf16 where torch's separate bf16 ops round, so a
// bf16 model computes what transformers' bf16 modules do (HF's numerics): silu(g) rounded, then
// times u; the residual sum rounded, normalised in float32, rounded, then times the weight; each
// rope product rounded, then their sum or difference.

// silu(g) * u; o [T, d] contiguous
SRT_ISA_TARGET void silu_and_mul_rows_bf16(const uint16_t* x, int64_t xs, uint16_t* o, int64_t d, int64_t b,
                                           int64_t e) {
  const V::reg one = V::set1(1.f), neg = V::set1(-1.f);
  for (int64_t t = b; t < e; ++t) {
    const uint16_t* g = x + t * xs;
    const uint16_t* u = g + d;
    uint16_t* out = o + t * d;
    int64_t j = 0;
    for (; j + V::W <= d; j += V::W) {
      const V::reg gv = V::load_bf16(g + j);
      const V::reg s = V::round_bf16(V::div(gv, V::add(one, V::exp(V::mul(gv, neg)))));
      V::store_bf16(out + j, V::mul(s, V::load_bf16(u + j)));
    }
    for (; j < d; ++j) {
      const float gj = bf16_bits_to_float(g[j]);
      const float s = VecScalar::round_bf16(gj / (1.f + std::exp(-gj)));
      out[j] = float_to_bf16_bits(s * bf16_bits_to_float(u[j]));
    }
  }
}

// o[j] = silu_and_mul_rows_bf16's value for the gate g[j] and up u[j] rounded to bf16 first (a fused
// gate/up projection's float32 sums, bf16_linear_silu_mul): the same bits as rounding them, then that
SRT_ISA_TARGET void silu_mul_f32_bf16(const float* g, const float* u, uint16_t* o, int64_t n) {
  const V::reg one = V::set1(1.f), neg = V::set1(-1.f);
  int64_t j = 0;
  for (; j + V::W <= n; j += V::W) {
    const V::reg gv = V::round_bf16(V::load(g + j));
    const V::reg s = V::round_bf16(V::div(gv, V::add(one, V::exp(V::mul(gv, neg)))));
    V::store_bf16(o + j, V::mul(s, V::round_bf16(V::load(u + j))));
  }
  for (; j < n; ++j) {
    const float gj = VecScalar::round_bf16(g[j]);
    const float s = VecScalar::round_bf16(gj / (1.f + std::exp(-gj)));
    o[j] = float_to_bf16_bits(s * VecScalar::round_bf16(u[j]));
  }
}

// x * sigmoid(1.702 x) as transformers' bf16 module computes it: 1.702 x rounded, its sigmoid
// rounded, then the product
SRT_ISA_TARGET void quick_gelu_rows_bf16(const uint16_t* x, int64_t xs, uint16_t* o, int64_t n, int64_t b, int64_t e) {
  const V::reg one = V::set1(1.f), k = V::set1(1.702f), neg = V::set1(-1.f);
  for (int64_t t = b; t < e; ++t) {
    const uint16_t* xr = x + t * xs;
    uint16_t* out = o + t * n;
    int64_t j = 0;
    for (; j + V::W <= n; j += V::W) {
      const V::reg xv = V::load_bf16(xr + j);
      const V::reg a = V::round_bf16(V::mul(xv, k));
      const V::reg s = V::round_bf16(V::div(one, V::add(one, V::exp(V::mul(a, neg)))));
      V::store_bf16(out + j, V::mul(xv, s));
    }
    for (; j < n; ++j) {
      const float xj = bf16_bits_to_float(xr[j]);
      const float a = VecScalar::round_bf16(xj * 1.702f);
      const float s = VecScalar::round_bf16(1.f / (1.f + std::exp(-a)));
      out[j] = float_to_bf16_bits(xj * s);
    }
  }
}

// r += x (rounded; x null: r as it is, not written), then
// o = round(round(r * rsqrt(mean(r^2) + eps)) * w); o [T, h] contiguous
SRT_ISA_TARGET void add_rms_norm_rows_bf16(const uint16_t* x, int64_t xs, uint16_t* r, int64_t rs, const uint16_t* w,
                                           uint16_t* o, int64_t h, float eps, int64_t b, int64_t e) {
  for (int64_t t = b; t < e; ++t) {
    uint16_t* rr = r + t * rs;
    uint16_t* out = o + t * h;
    V::reg acc = V::zero();
    int64_t j = 0;
    for (; j + V::W <= h; j += V::W) {
      V::reg s = V::load_bf16(rr + j);
      if (x != nullptr) {
        s = V::round_bf16(V::add(s, V::load_bf16(x + t * xs + j)));
        V::store_bf16(rr + j, s);
      }
      acc = V::fmadd(s, s, acc);
    }
    float ss = V::hsum(acc);
    for (; j < h; ++j) {
      float s = bf16_bits_to_float(rr[j]);
      if (x != nullptr) {
        s = VecScalar::round_bf16(s + bf16_bits_to_float(x[t * xs + j]));
        rr[j] = float_to_bf16_bits(s);
      }
      ss += s * s;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
    const V::reg iv = V::set1(inv);
    for (j = 0; j + V::W <= h; j += V::W)
      V::store_bf16(out + j, V::mul(V::round_bf16(V::mul(V::load_bf16(rr + j), iv)), V::load_bf16(w + j)));
    for (; j < h; ++j)
      out[j] = float_to_bf16_bits(VecScalar::round_bf16(bf16_bits_to_float(rr[j]) * inv) * bf16_bits_to_float(w[j]));
  }
}

SRT_ISA_TARGET inline void rotate_heads_bf16(uint16_t* x, int64_t n_heads, int64_t D, const uint16_t* cos,
                                             const uint16_t* sin) {
  const int64_t half = D / 2;
  for (int64_t hh = 0; hh < n_heads; ++hh) {
    uint16_t* x1 = x + hh * D;
    uint16_t* x2 = x1 + half;
    int64_t j = 0;
    for (; j + V::W <= half; j += V::W) {
      const V::reg a = V::load_bf16(x1 + j), bb = V::load_bf16(x2 + j);
      const V::reg c = V::load_bf16(cos + j), s = V::load_bf16(sin + j);
      V::store_bf16(x1 + j, V::sub(V::round_bf16(V::mul(a, c)), V::round_bf16(V::mul(bb, s))));
      V::store_bf16(x2 + j, V::add(V::round_bf16(V::mul(bb, c)), V::round_bf16(V::mul(a, s))));
    }
    for (; j < half; ++j) {
      const float a = bf16_bits_to_float(x1[j]), bb = bf16_bits_to_float(x2[j]);
      const float c = bf16_bits_to_float(cos[j]), s = bf16_bits_to_float(sin[j]);
      x1[j] = float_to_bf16_bits(VecScalar::round_bf16(a * c) - VecScalar::round_bf16(bb * s));
      x2[j] = float_to_bf16_bits(VecScalar::round_bf16(bb * c) + VecScalar::round_bf16(a * s));
    }
  }
}

// rotary_rows on bf16 q, k and a bf16 cos_sin table
SRT_ISA_TARGET void rotary_rows_bf16(uint16_t* q, int64_t qs, int64_t hq, uint16_t* k, int64_t ks, int64_t hk,
                                     const int64_t* pos, const uint16_t* cs, int64_t cs_stride, int64_t D, int64_t b,
                                     int64_t e) {
  for (int64_t t = b; t < e; ++t) {
    const uint16_t* c = cs + pos[t] * cs_stride;
    rotate_heads_bf16(q + t * qs, hq, D, c, c + D / 2);
    rotate_heads_bf16(k + t * ks, hk, D, c, c + D / 2);
  }
}

}  // namespace SRT_ISA_NS
}  // namespace srt_cpu

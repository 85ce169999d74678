// torch.classes.srt_cpu.DecodeLayers: the decoder layers of a Llama-family model for one DECODE
// step, as one native call, so that a single-stream step does not pay Python and dispatcher
// overhead on each of the dozen ops of every layer (about 5 ms of a 15 ms step for the default
// model, 30 layers).
//
// The object holds the layers' weights (GGUF blocks kept as loaded, float32 weights packed by
// pack_linear_weight, or bf16 ones by pack_bf16_weight; norms, biases) once; each step passes the activations and the attention
// metadata:
//
//   forward(hidden [B, h] f32 or bf16, positions [B] i64, k_buffers, v_buffers (one [S, H_kv, D] per
//           layer), out_cache_loc [B] i64, req_to_token, req_pool_indices [B], seq_lens [B])
//       -> (mlp output of the last layer [B, h], residual stream [B, h])
//
// which is what srt/models/llama.py's LlamaModel computes layer by layer (the caller adds the two
// in the final norm). Per layer, in the Python path's order and through the very same kernels
// (cpu_ops.h), so the result is bit for bit the Python path's:
//
//   norm (+ residual) -> qkv (gguf_linear / packed_linear) -> [q/k RMSNorm per head] ->
//   rotary_neox_ -> k/v stored at out_cache_loc (cast to the pool's dtype) ->
//   paged_decode_attention (the layer's sliding window and soft-cap, if any) -> o ->
//   norm + residual -> gate_up -> silu_and_mul -> down
//
// or, for a mixture-of-experts layer (set_moe), in place of gate_up / down: the router's logits
// -> moe_route (softmax, top-k, renormalised) -> moe_experts (moe.cpp: the experts grouped by
// expert) [+ sigmoid(shared gate) * the shared expert] -- srt/layers/moe.py's SparseMoeBlock.
//
// The first layer's input norm has no residual to add (residual = the embedding output).
//
// Activations are float32, or bf16 for a bf16 model (its norms' weights and rope table bf16, its
// projections bf16 panels, FP8 codes or W8A8 int8 rows, whose kernels take and return bf16): the
// same kernels on bf16 rows (float32 math, rounded to bf16 where the Python path's bf16 ops round),
// its norms without a residual through the Python path's very ATen ops, attention on float32
// queries as the Python path's fused_cpu backend takes them.
#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"

namespace srt_cpu {
namespace {

// qtypes of a float32 weight packed by pack_linear_weight, and of a bf16 one packed by
// pack_bf16_weight (VNNI pairs; the float32 activations widen it in registers) (not ggml types)
constexpr int64_t kPackedF32 = -1;
constexpr int64_t kPackedBF16 = -2;
// a W8A8 layer's int8 rows (gguf_pack_w8a8's groups or AMX panels; x8_rows holds N) on gguf_linear_w8a8, which
// quantizes x per token itself (QuantizedWeight.token_int8; not a ggml type)
constexpr int64_t kW8A8 = -3;
// an FP8 layer's codes kept in one byte (pack_fp8_weight; x8_rows holds N) on fp8_linear
constexpr int64_t kPackedFP8 = -4;

// One row range of a projection's weight, of one type.
struct Segment {
  at::Tensor data;  // uint8 [rows, bytes per row], x8 groups (gguf_x8.h) when x8_rows > 0, float32
                    // panels [P, K, nr] (qtype kPackedF32) or bf16 ones [P, K/2, 32, 2] (kPackedBF16)
  int64_t qtype;
  int64_t x8_rows;  // rows of an x8-packed weight or N of a packed float32 one, 0 for GGUF rows

  // int8_max_rows: inputs of at most that many rows, or of a type with an int8 GEMM enough rows
  // (q8a_takes), take the int8-activation kernel (as the Python path's QuantizedWeight.linear
  // does; never for float32 weights)
  at::Tensor apply(const at::Tensor& x, int64_t int8_max_rows, const c10::optional<at::Tensor>& bias) const {
    if (qtype == kPackedF32) return packed_linear(x, data, x8_rows, bias, "");
    if (qtype == kPackedBF16) return bf16_linear(x, data, x8_rows, bias, "");
    if (qtype == kW8A8) return gguf_linear_w8a8(x, data, x8_rows, bias, "");
    if (qtype == kPackedFP8) return fp8_linear(x, data, x8_rows, bias, "");
    if (q8a_takes(qtype, x.size(0), int8_max_rows)) return gguf_linear_q8a(x, data, qtype, bias);
    return x8_rows > 0 ? gguf_linear_x8(x, data, qtype, x8_rows, bias) : gguf_linear(x, data, qtype, bias);
  }
};

// Linear.token_quant's quantization of a layer's inputs (srt/layers/linear.py's fake_quant_rows) in
// the very same ATen ops, so the same bits. kInt8: codes = clamp(round(x / scale), -128, 127),
// scale = max|row| / 127.5; kFp8: codes = float8_e4m3(clamp(x / scale, -448, 448)), scale =
// max|row| / 448 (a row of zeros: float32's eps); returns codes * scale.
constexpr int64_t kInt8 = 1, kFp8 = 2;

at::Tensor fake_quant_rows(const at::Tensor& x, int64_t kind) {
  const double qmax = kind == kInt8 ? 127.5 : 448.0;
  at::Tensor scale = x.abs().amax({-1}, true) / qmax;
  scale = at::where(scale == 0, std::numeric_limits<float>::epsilon(), scale);
  if (kind == kInt8) return at::round(x / scale).clamp_(-128, 127) * scale;
  return (x / scale).clamp_(-448, 448).to(at::kFloat8_e4m3fn).to(x.scalar_type()) * scale;
}

// A projection: its row segments in order (a Q4_K_M file stores a layer's q/k as Q4_K and v as
// Q6_K), each computed by its own kernel and concatenated, then the bias, as QuantizedWeight.linear.
struct QuantLinear {
  std::vector<Segment> segments;
  c10::optional<at::Tensor> bias;
  int64_t token_quant = 0;  // 0, kInt8 (W8A8) or kFp8 (FP8_DYNAMIC): set_token_quant
  // an FP8 layer's scale of each output row (its weight holds the float8 codes): Linear.output_scale
  c10::optional<at::Tensor> out_scale;

  at::Tensor apply(const at::Tensor& x_in, int64_t int8_max_rows) const {
    const at::Tensor x = token_quant != 0 ? fake_quant_rows(x_in, token_quant) : x_in;
    if (out_scale.has_value()) {  // as Linear.forward, the same ATen ops: (x @ codes.T) * scale + bias
      const at::Tensor out = apply_segments(x, int8_max_rows, c10::nullopt);
      at::Tensor scaled = out * *out_scale;
      if (bias.has_value()) scaled = scaled + *bias;
      return scaled.to(out.scalar_type());
    }
    return apply_segments(x, int8_max_rows, bias);
  }

  at::Tensor apply_segments(const at::Tensor& x, int64_t int8_max_rows, const c10::optional<at::Tensor>& bias) const {
    if (segments.size() == 1) return segments[0].apply(x, int8_max_rows, bias);
    std::vector<at::Tensor> parts;
    parts.reserve(segments.size());
    for (const Segment& seg : segments) parts.push_back(seg.apply(x, int8_max_rows, c10::nullopt));
    at::Tensor out = at::cat(parts, 1);
    if (bias.has_value()) out.add_(*bias);
    return out;
  }
};

// allow_empty: no segments at all is a projection left out (a MoE layer's dense gate_up / down)
QuantLinear make_linear(const std::vector<at::Tensor>& data, const std::vector<int64_t>& qtypes,
                        const std::vector<int64_t>& x8_rows, c10::optional<at::Tensor> bias,
                        bool allow_empty = false) {
  TORCH_CHECK((!data.empty() || allow_empty) && data.size() == qtypes.size() && data.size() == x8_rows.size(),
              "DecodeLayers: a projection needs one qtype and one x8 count per segment (got ", data.size(), ", ",
              qtypes.size(), ", ", x8_rows.size(), ")");
  QuantLinear lin{{}, std::move(bias)};
  for (size_t i = 0; i < data.size(); ++i) lin.segments.push_back(Segment{data[i], qtypes[i], x8_rows[i]});
  return lin;
}

// A sparse MLP: router, top-k, experts banks (moe.cpp's layout), an optional gated shared expert.
struct MoE {
  QuantLinear router;
  int64_t top_k;
  bool renormalize;
  std::vector<at::Tensor> gate_up;
  std::vector<int64_t> gate_up_qtypes;
  at::Tensor down;
  int64_t down_qtype;
  int64_t int8_max_rows;  // the experts' choice (MoEExperts.int8_max_rows)
  QuantLinear shared_gate_up, shared_down, shared_gate;  // no segments: no shared expert
  int64_t dense_int8_rows;  // the router's and the shared expert's int8-activation choice

  at::Tensor apply(const at::Tensor& x) const {
    auto [w, ids] = moe_route(router.apply(x, dense_int8_rows), top_k, renormalize);
    at::Tensor out = moe_experts(x, w, ids, gate_up, gate_up_qtypes, down, down_qtype, int8_max_rows);
    if (shared_gate.segments.empty()) return out;
    const at::Tensor gate = at::sigmoid(shared_gate.apply(x, dense_int8_rows));
    const at::Tensor shared =
        shared_down.apply(silu_and_mul(shared_gate_up.apply(x, dense_int8_rows)), dense_int8_rows);
    return out + gate * shared;
  }
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;
  QuantLinear qkv, o, gate_up, down;
  c10::optional<at::Tensor> q_norm, k_norm;
  int64_t window_left;  // paged_decode_attention's window (-1: none) and soft-cap (0: none)
  double logit_cap;
  std::shared_ptr<MoE> moe;  // set: the MLP is this sparse block (gate_up / down are empty)
};

template <class S, class T>
void store_rows(const S* src, int64_t src_stride, int64_t B, const int64_t* loc, int64_t heads, int64_t D, T* dst,
                int64_t s0, int64_t s1) {
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const S* in = src + b * src_stride + h * D;
      T* out = dst + loc[b] * s0 + h * s1;
      if constexpr (std::is_same_v<T, S>) {
        std::memcpy(out, in, D * sizeof(T));
      } else {  // round to nearest even, as .to()
        for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(static_cast<float>(in[d]));
      }
    }
  }
}

template <class S>
void store_rows_as(const S* src, int64_t ss, int64_t B, const int64_t* lp, int64_t heads, int64_t D,
                   const at::Tensor& buffer) {
  const int64_t s0 = buffer.stride(0), s1 = buffer.stride(1);
  switch (buffer.scalar_type()) {
    case at::kFloat: store_rows(src, ss, B, lp, heads, D, buffer.data_ptr<float>(), s0, s1); break;
    case at::kHalf: store_rows(src, ss, B, lp, heads, D, buffer.data_ptr<at::Half>(), s0, s1); break;
    case at::kBFloat16: store_rows(src, ss, B, lp, heads, D, buffer.data_ptr<at::BFloat16>(), s0, s1); break;
    default: TORCH_CHECK(false, "DecodeLayers: KV buffers must be float32, float16 or bfloat16, got ", buffer.scalar_type());
  }
}

// RMSNorm.forward of a bf16 model (srt/layers/layernorm.py) in the same ATen ops, so the same bits:
// normalised in float32, rounded, times the weight
at::Tensor rms_norm_like_python(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  xf = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps);
  return weight * xf.to(x.scalar_type());
}

// buffer[loc[b]] = rows[b] (rows [B, heads * D] float32 or bf16, any row stride; buffer [S, heads, D])
void store_kv(const at::Tensor& rows, const at::Tensor& buffer, const at::Tensor& loc) {
  const int64_t B = rows.size(0), heads = buffer.size(1), D = buffer.size(2), S = buffer.size(0);
  TORCH_CHECK(rows.size(1) == heads * D, "DecodeLayers: k/v rows of ", rows.size(1), " values for a pool of ", heads,
              " x ", D);
  TORCH_CHECK(buffer.stride(2) == 1, "DecodeLayers: the KV buffers need a contiguous last dim");
  const int64_t* lp = loc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] < S, "DecodeLayers: out_cache_loc[", b, "] = ", lp[b], " outside [0, ", S, ")");
  }
  if (rows.scalar_type() == at::kBFloat16) {
    store_rows_as(rows.data_ptr<at::BFloat16>(), rows.stride(0), B, lp, heads, D, buffer);
  } else {
    store_rows_as(rows.data_ptr<float>(), rows.stride(0), B, lp, heads, D, buffer);
  }
}

void check_index(const at::Tensor& t, int64_t B, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == B &&
                  t.is_contiguous(),
              "DecodeLayers: ", name, " must be a contiguous int64 CPU tensor [", B, "]");
}

}  // namespace

class DecodeLayers : public torch::CustomClassHolder {
 public:
  DecodeLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scaling,
               at::Tensor cos_sin, int64_t int8_max_rows)
      : H_(num_heads),
        Hkv_(num_kv_heads),
        D_(head_dim),
        int8_max_rows_(int8_max_rows),
        eps_(eps),
        scaling_(scaling),
        cos_sin_(std::move(cos_sin)) {
    TORCH_CHECK(H_ > 0 && Hkv_ > 0 && H_ % Hkv_ == 0 && D_ > 0, "DecodeLayers: bad head shape ", H_, "/", Hkv_,
                " x ", D_);
  }

  // each projection: its segments' (data, qtype, x8 rows / N or 0) as three lists, and its bias;
  // see Segment and QuantLinear; then the layer's attention window (-1: none) and soft-cap (0: none)
  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, std::vector<at::Tensor> qkv,
                 std::vector<int64_t> qkv_type, std::vector<int64_t> qkv_x8, c10::optional<at::Tensor> qkv_bias,
                 std::vector<at::Tensor> o, std::vector<int64_t> o_type, std::vector<int64_t> o_x8,
                 c10::optional<at::Tensor> o_bias, std::vector<at::Tensor> gate_up, std::vector<int64_t> gate_up_type,
                 std::vector<int64_t> gate_up_x8, c10::optional<at::Tensor> gate_up_bias,
                 std::vector<at::Tensor> down, std::vector<int64_t> down_type, std::vector<int64_t> down_x8,
                 c10::optional<at::Tensor> down_bias, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, int64_t window_left, double logit_cap) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecodeLayers: q_norm and k_norm come together");
    TORCH_CHECK(window_left >= -1 && logit_cap >= 0, "DecodeLayers: bad window_left ", window_left,
                " or logit_cap ", logit_cap);
    layers_.push_back(Layer{std::move(input_norm),
                            std::move(post_attention_norm),
                            make_linear(qkv, qkv_type, qkv_x8, std::move(qkv_bias)),
                            make_linear(o, o_type, o_x8, std::move(o_bias)),
                            make_linear(gate_up, gate_up_type, gate_up_x8, std::move(gate_up_bias), true),
                            make_linear(down, down_type, down_x8, std::move(down_bias), true),
                            std::move(q_norm),
                            std::move(k_norm),
                            window_left,
                            logit_cap,
                            nullptr});
  }

  // The last added layer's MLP is a sparse MoE block (see MoE): the router's segments, top-k,
  // renormalise, the experts' banks and int8 choice, and the shared expert's gate_up / down / gate
  // segments (all three empty: none), and the int8-activation choice of the router and shared expert.
  void set_moe(std::vector<at::Tensor> router, std::vector<int64_t> router_type, std::vector<int64_t> router_x8,
               int64_t top_k, bool renormalize, std::vector<at::Tensor> gate_up, std::vector<int64_t> gate_up_qtypes,
               at::Tensor down, int64_t down_qtype, int64_t int8_max_rows, std::vector<at::Tensor> shared_gate_up,
               std::vector<int64_t> shared_gate_up_type, std::vector<int64_t> shared_gate_up_x8,
               std::vector<at::Tensor> shared_down, std::vector<int64_t> shared_down_type,
               std::vector<int64_t> shared_down_x8, std::vector<at::Tensor> shared_gate,
               std::vector<int64_t> shared_gate_type, std::vector<int64_t> shared_gate_x8,
               int64_t dense_int8_rows) {
    TORCH_CHECK(!layers_.empty(), "DecodeLayers: set_moe before any add_layer");
    TORCH_CHECK(top_k > 0 && top_k <= down.size(0), "DecodeLayers: top_k ", top_k, " outside 1..", down.size(0));
    TORCH_CHECK(shared_gate_up.empty() == shared_down.empty() && shared_down.empty() == shared_gate.empty(),
                "DecodeLayers: a shared expert needs gate_up, down and gate");
    auto moe = std::make_shared<MoE>(MoE{make_linear(router, router_type, router_x8, c10::nullopt),
                                         top_k,
                                         renormalize,
                                         std::move(gate_up),
                                         std::move(gate_up_qtypes),
                                         std::move(down),
                                         down_qtype,
                                         int8_max_rows,
                                         make_linear(shared_gate_up, shared_gate_up_type, shared_gate_up_x8,
                                                     c10::nullopt, true),
                                         make_linear(shared_down, shared_down_type, shared_down_x8, c10::nullopt, true),
                                         make_linear(shared_gate, shared_gate_type, shared_gate_x8, c10::nullopt, true),
                                         dense_int8_rows});
    layers_.back().moe = std::move(moe);
  }

  // How the last added layer's projections (qkv, o, gate_up, down) quantize their inputs per token
  // first: 0 not, 1 int8 (W8A8), 2 float8 (FP8_DYNAMIC) (Linear.token_quant).
  void set_token_quant(std::vector<int64_t> kinds) {
    TORCH_CHECK(!layers_.empty() && kinds.size() == 4, "DecodeLayers: set_token_quant takes 4 kinds after add_layer");
    for (int64_t k : kinds) TORCH_CHECK(k >= 0 && k <= kFp8, "DecodeLayers: token quantization kind ", k, " unknown");
    Layer& l = layers_.back();
    l.qkv.token_quant = kinds[0];
    l.o.token_quant = kinds[1];
    l.gate_up.token_quant = kinds[2];
    l.down.token_quant = kinds[3];
  }

  // The last added layer's projections' output scales (qkv, o, gate_up, down; None: none), an FP8
  // checkpoint's (Linear.output_scale).
  void set_output_scales(std::vector<c10::optional<at::Tensor>> scales) {
    TORCH_CHECK(!layers_.empty() && scales.size() == 4, "DecodeLayers: set_output_scales takes 4 after add_layer");
    Layer& l = layers_.back();
    QuantLinear* projections[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    for (int i = 0; i < 4; ++i) {
      if (scales[i].has_value()) {
        TORCH_CHECK(scales[i]->scalar_type() == at::kFloat && scales[i]->is_contiguous() && scales[i]->dim() == 1,
                    "DecodeLayers: an output scale is a contiguous float32 vector");
      }
      projections[i]->out_scale = scales[i];
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // lora_ab: the LoRA adapters' updates (srt/lora/layer.py), empty without: for layer i, projection p
  // (qkv, o, gate_up, down) and row group g (rows lora_starts[g] .. lora_ends[g] - 1 run one adapter),
  // A at lora_ab[((i * 4 + p) * G + g) * 2] and B after it, both of zero elements where that
  // projection has no update for the group's adapter; out += (x @ A.T) @ B.T, as lora_segments_.
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& hidden, const at::Tensor& positions,
                                             const std::vector<at::Tensor>& k_buffers,
                                             const std::vector<at::Tensor>& v_buffers, const at::Tensor& out_cache_loc,
                                             const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                             const at::Tensor& seq_lens, const std::vector<at::Tensor>& lora_ab,
                                             const std::vector<int64_t>& lora_starts,
                                             const std::vector<int64_t>& lora_ends) const {
    const int64_t L = num_layers();
    TORCH_CHECK(L > 0, "DecodeLayers: no layers");
    const at::ScalarType act = layers_[0].input_norm.scalar_type();
    TORCH_CHECK(hidden.device().is_cpu() && hidden.scalar_type() == act && hidden.dim() == 2 &&
                    hidden.is_contiguous(),
                "DecodeLayers: hidden must be a contiguous CPU tensor [B, hidden] of the norms' dtype (", act,
                "), got ", hidden.scalar_type());
    const bool bf16 = act == at::kBFloat16;
    TORCH_CHECK(static_cast<int64_t>(k_buffers.size()) == L && static_cast<int64_t>(v_buffers.size()) == L,
                "DecodeLayers: one K and one V buffer per layer (", L, "), got ", k_buffers.size(), " and ",
                v_buffers.size());
    const int64_t B = hidden.size(0), h = hidden.size(1);
    check_index(positions, B, "positions");
    check_index(out_cache_loc, B, "out_cache_loc");
    const int64_t q_size = H_ * D_, kv_size = Hkv_ * D_;
    const int64_t G = static_cast<int64_t>(lora_starts.size());
    TORCH_CHECK(lora_ends.size() == lora_starts.size() &&
                    static_cast<int64_t>(lora_ab.size()) == (G > 0 ? L * 4 * G * 2 : 0),
                "DecodeLayers: lora_ab holds A and B per layer, projection and row group");
    // out += the adapters' update of projection p of layer i on input x
    auto lora = [&](at::Tensor& out, const at::Tensor& x_in, int64_t i, int64_t p) {
      for (int64_t g = 0; g < G; ++g) {
        const at::Tensor& A = lora_ab[((i * 4 + p) * G + g) * 2];
        if (A.numel() == 0) continue;
        const int64_t start = lora_starts[g], n = lora_ends[g] - start;
        out.narrow(0, start, n).addmm_(at::mm(x_in.narrow(0, start, n), A.t()), lora_ab[((i * 4 + p) * G + g) * 2 + 1].t());
      }
    };

    at::Tensor residual = hidden;
    at::Tensor x = bf16 ? rms_norm_like_python(hidden, layers_[0].input_norm, eps_)
                        : at::rms_norm(hidden, {h}, layers_[0].input_norm, eps_);
    at::Tensor mlp_out;
    for (int64_t i = 0; i < L; ++i) {
      const Layer& layer = layers_[i];
      if (i > 0) x = add_rms_norm_(mlp_out, residual, layer.input_norm, eps_);
      at::Tensor qkv = layer.qkv.apply(x, int8_max_rows_);
      if (G > 0) lora(qkv, x, i, 0);
      at::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
      if (layer.q_norm.has_value() && bf16) {
        q = rms_norm_like_python(q.view({B, H_, D_}), *layer.q_norm, eps_).view({B, q_size});
        k = rms_norm_like_python(k.view({B, Hkv_, D_}), *layer.k_norm, eps_).view({B, kv_size});
      } else if (layer.q_norm.has_value()) {
        q = at::rms_norm(q.view({B, H_, D_}), {D_}, *layer.q_norm, eps_).view({B, q_size});
        k = at::rms_norm(k.view({B, Hkv_, D_}), {D_}, *layer.k_norm, eps_).view({B, kv_size});
      }
      rotary_neox_(q, k, positions, cos_sin_, D_);
      store_kv(k, k_buffers[i], out_cache_loc);
      store_kv(v, v_buffers[i], out_cache_loc);
      at::Tensor attn = paged_decode_attention(q.view({B, H_, D_}).to(at::kFloat), k_buffers[i], v_buffers[i],
                                               req_to_token, req_pool_indices, seq_lens, scaling_, 0, "",
                                               layer.window_left, layer.logit_cap);
      if (bf16) attn = attn.to(act);
      const at::Tensor attn_rows = attn.view({B, q_size});
      at::Tensor o = layer.o.apply(attn_rows, int8_max_rows_);
      if (G > 0) lora(o, attn_rows, i, 1);
      x = add_rms_norm_(o, residual, layer.post_attention_norm, eps_);
      if (layer.moe) {
        mlp_out = layer.moe->apply(x);
      } else {
        TORCH_CHECK(!layer.gate_up.segments.empty(), "DecodeLayers: layer ", i, " has neither an MLP nor set_moe");
        at::Tensor gate_up = layer.gate_up.apply(x, int8_max_rows_);
        if (G > 0) lora(gate_up, x, i, 2);
        const at::Tensor act_rows = silu_and_mul(gate_up);
        mlp_out = layer.down.apply(act_rows, int8_max_rows_);
        if (G > 0) lora(mlp_out, act_rows, i, 3);
      }
    }
    return {mlp_out, residual};
  }

 private:
  int64_t H_, Hkv_, D_, int8_max_rows_;
  double eps_, scaling_;
  at::Tensor cos_sin_;
  std::vector<Layer> layers_;
};

}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.class_<srt_cpu::DecodeLayers>("DecodeLayers")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor, int64_t>())
      .def("add_layer", &srt_cpu::DecodeLayers::add_layer)
      .def("set_moe", &srt_cpu::DecodeLayers::set_moe)
      .def("set_token_quant", &srt_cpu::DecodeLayers::set_token_quant)
      .def("set_output_scales", &srt_cpu::DecodeLayers::set_output_scales)
      .def("num_layers", &srt_cpu::DecodeLayers::num_layers)
      .def("forward", &srt_cpu::DecodeLayers::forward);
}

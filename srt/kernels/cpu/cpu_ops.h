// The extension's op entry points as C++ functions, for code that composes them without going
// through the dispatcher (decode_layers.cpp). Each is documented where it is defined; the torch
// ops of the same names call exactly these.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "gguf_quant.h"
#include "vec.h"

namespace srt_cpu {

// The instruction set an op's `isa` argument asks for: "" -> detect_isa() (the best this CPU
// runs); "scalar", "avx2" or "avx512" -> that one. Anything else is an error naming `op`, and so is
// an ISA above detect_isa(), in the one wording every op uses:
//   "<op>: isa '<isa>' is not available on this CPU (it runs up to '<best>')"
inline CpuIsa requested_isa(const char* op, c10::string_view requested) {
  const CpuIsa best = detect_isa();
  if (requested.empty()) return best;
  const std::string name(requested);
  CpuIsa want = CpuIsa::kScalar;
  TORCH_CHECK(parse_isa(name.c_str(), &want), op, ": isa must be '', 'scalar', 'avx2' or 'avx512', got '", name, "'");
  TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best), op, ": isa '", name,
              "' is not available on this CPU (it runs up to '", isa_name(best), "')");
  return want;
}

// bf16_linear.cpp: bf16 weights packed in VNNI pairs ([P, K/2, 32, 2]); x bf16 or float32
at::Tensor pack_bf16_weight(const at::Tensor& weight);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                       c10::string_view isa);
// bf16_linear.cpp: silu(x @ gate^T) * (x @ up^T) for a gate/up weight packed as one [2d, K], gate rows
// first: the same bits as silu_and_mul(bf16_linear(x, packed, N, bias)), fused where it can be
at::Tensor bf16_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                                const c10::optional<at::Tensor>& bias);
// bf16_linear.cpp: from how many rows a bf16 x goes through brgemm (SRT_BF16_BRGEMM_M, default 16)
int64_t bf16_brgemm_rows();
// fp8_linear.cpp: FP8 (e4m3) codes kept in one byte ([P, K/2, 64] uint8), widened to bf16 panels in
// cache on the way; the same bits as bf16_linear on the codes in bf16
at::Tensor pack_fp8_weight(const at::Tensor& codes, const c10::optional<at::Tensor>& block_scale, int64_t block_n,
                           int64_t block_k);
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                      c10::string_view isa);
bool fp8_fast();
bool fp8_fast_blocks();

// decode_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                  const at::Tensor& seq_lens, double scale, int64_t split_len,
                                  c10::string_view isa_request, int64_t window_left = -1, double logit_cap = 0.0);

// elementwise.cpp
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor quick_gelu(const at::Tensor& x);
// out[j] = silu_and_mul's bf16 value for gate g[j] and up u[j] each rounded to bf16 first, j < n
void silu_mul_f32_bf16(const float* g, const float* u, at::BFloat16* out, int64_t n);
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps);
void rotary_neox_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos_sin,
                  int64_t head_dim);

// gguf_linear.cpp
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& data, int64_t qtype,
                       const c10::optional<at::Tensor>& bias);
// gguf_a24.cpp: x as 24-bit fixed point per block of 32, integer dot products (AVX-512 VNNI;
// Q4_K, Q6_K); gguf_a24_takes: whether this CPU runs it for the type
at::Tensor gguf_linear_a24(const at::Tensor& x, const at::Tensor& data, int64_t qtype,
                           const c10::optional<at::Tensor>& bias);
bool gguf_a24_takes(int64_t qtype);
// gguf_a24.cpp: below how many rows gguf_linear takes gguf_linear_a24 where it runs
// (SRT_GGUF_A24_M, default 3)
int64_t gguf_a24_rows();
// gguf_x8_a24.cpp: the same numerics for Q4_0 and Q4_1 weights in the x8 layout (AVX-512 VNNI and
// VBMI): out [M, N] = x [M, K] times the `groups` x8 groups at `packed` (+ bias); x8_a24_takes:
// whether this CPU runs it for the type (SRT_GGUF_A24=0 turns it off, as gguf_linear_a24);
// gguf_linear_x8 takes it below x8_a24_rows() rows (SRT_GGUF_X8_A24_M, default 13: every decode
// batch up to its GEMM)
bool x8_a24_takes(int64_t qtype);
int64_t x8_a24_rows();
void x8_linear_a24(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* packed, int64_t groups,
                   int64_t qtype, const float* bias, float* out, int64_t N);
// gguf_linear.cpp: the register tiles (QuantRowOps::dot_tile) that gguf_linear runs for 2 rows
// up to its GEMM (from gguf_a24_rows on where that runs): gguf_tile_ops, the type's row functions
// where it has tiles on this CPU (SRT_GGUF_TILES=0: none); pack_tiles, x [M, K] (rows ldx apart)
// packed for them; tile_rows_float, out[i * ldo + r] = dequant(w + r * bpr) . x[i] (+ bias[r]) for
// the `rows` weight rows from w and every row of the packed x
struct TileX {
  std::vector<float> data;         // group g at data + m0[g] * k: [k / 16][width[g]][16]
  std::vector<int64_t> m0, width;  // per group of at most kDotTileRows rows: first row, rows
  int64_t k = 0;
};
const QuantRowOps* gguf_tile_ops(int64_t qtype);
TileX pack_tiles(const float* x, int64_t ldx, int64_t M, int64_t K);
void tile_rows_float(const QuantRowOps& ops, const uint8_t* w, int64_t bpr, int64_t rows, const TileX& xt,
                     const float* bias, float* out, int64_t ldo);
// gguf_a24.cpp: the experts of a sparse MLP of at most kMoeSmallRows rows each through the paths
// gguf_linear takes for them (gguf_linear_a24's tiles below gguf_a24_rows, else the register
// tiles), every expert's rows in one parallel loop per projection (as moe_experts_q8a); undefined
// when a bank's type or shape has no such path on this CPU
constexpr int64_t kMoeSmallRows = 7;
at::Tensor moe_experts_a24(const at::Tensor& xs, const std::vector<int64_t>& starts,
                           const std::vector<at::Tensor>& gate_up, const std::vector<int64_t>& gate_up_qtypes,
                           const at::Tensor& down, int64_t down_qtype);
// gguf_q8act.cpp: x quantized to int8 per block of 32 first (numerics in gguf.py)
at::Tensor gguf_linear_q8a(const at::Tensor& x, const at::Tensor& data, int64_t qtype,
                           const c10::optional<at::Tensor>& bias);
// gguf_q8act.cpp: from how many rows a type takes the int8 GEMM (0: never); whether a matmul of
// `rows` rows with int8 activations enabled (int8_max_rows > 0) quantizes its input: at most
// int8_max_rows rows, or a type with an int8 GEMM from its row count on
int64_t gguf_q8a_gemm_rows(int64_t qtype);
bool q8a_takes(int64_t qtype, int64_t rows, int64_t int8_max_rows);

// gguf_q8act.cpp: the experts of a sparse MLP on int8 activations, every expert's rows in one
// parallel loop per projection: xs [P, H] (the pairs' rows, grouped by expert: expert e's are
// starts[e] .. starts[e + 1]) -> [P, H] (before the routing weights); undefined when a bank's
// type has no int8 path
at::Tensor moe_experts_q8a(const at::Tensor& xs, const std::vector<int64_t>& starts,
                           const std::vector<at::Tensor>& gate_up, const std::vector<int64_t>& gate_up_qtypes,
                           const at::Tensor& down, int64_t down_qtype);
at::Tensor gguf_linear_x8(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t rows,
                          const c10::optional<at::Tensor>& bias);
// w8a8_linear.cpp: N int8 rows of one scale each (gguf_pack_w8a8's groups) times x quantized to
// int8 per row (W8A8); whether this CPU has its vector path
at::Tensor gguf_linear_w8a8(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                            const c10::optional<at::Tensor>& bias, c10::string_view isa);
bool gguf_w8a8_fast();
// w8a8_amx.cpp: the same on AMX-INT8 tiles, the weights in panels of 64 rows (brgemm's VNNI quads);
// whether this CPU may run them; whether packed is such panels; the panels of Q8_0 rows; the matmul
// (vector: brgemm, else scalar loops over the same bytes)
bool w8a8_amx_available();
bool w8a8_is_panels(const at::Tensor& packed, int64_t N, int64_t K);
at::Tensor w8a8_pack_panels(const at::Tensor& data);
at::Tensor w8a8_linear_panels(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias,
                              bool vector);

// moe.cpp: the experts of a sparse MLP grouped by expert; the router's softmax / top-k
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                       const std::vector<at::Tensor>& gate_up, const std::vector<int64_t>& gate_up_qtypes,
                       const at::Tensor& down, int64_t down_qtype, int64_t int8_max_rows);
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& router_logits, int64_t top_k, bool renormalize);

// packed_linear.cpp: float32 x @ W^T on a weight from pack_linear_weight (N: W's rows); the
// panel width pack_linear_weight takes by default on this CPU (24 or 48)
int64_t default_panel_width();
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                         c10::string_view isa);

// One projection of a sparse block's active experts in one parallel loop: `base` holds E matrices
// of N GGUF rows of bpr bytes (a uint8 bank [E, N, bpr]); fn(e, n, rows, w) runs once for each group
// of G weight rows of each expert e in active[0 .. count) (rows n .. n + rows - 1, w pointing at
// the first), about 64 KiB of weights per task. A dense matmul is the bank of one matrix, active {0}.
template <int64_t G, class Fn>
void for_expert_row_groups(const uint8_t* base, int64_t N, int64_t bpr, const int64_t* active, int64_t count, Fn fn) {
  const int64_t groups = (N + G - 1) / G;
  at::parallel_for(0, count * groups, std::max<int64_t>(1, 64 * 1024 / (G * bpr)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = active[t / groups], n = t % groups * G;
      fn(e, n, std::min(G, N - n), base + (e * N + n) * bpr);
    }
  });
}

// Argument checks the GGUF matmul ops share (`op` names the op in the message).
// x: a float32 CPU tensor [M, K] with a contiguous last dim
inline void check_activations(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, op,
              ": x must be a float32 CPU tensor [M, K], got ", x.scalar_type(), " with ", x.dim(), " dims");
  TORCH_CHECK(x.size(1) <= 1 || x.stride(1) == 1, op, ": x's last dim must be contiguous");
}

// the bias' data (nullptr when absent), checked to be n contiguous float32 values
inline const float* checked_bias(const char* op, const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                  bias->numel() == n,
              op, ": bias must be a contiguous float32 tensor of ", n, " elements");
  return bias->data_ptr<float>();
}

// the bias as n contiguous float32 values, whatever its float dtype (undefined when absent)
inline at::Tensor float32_bias(const char* op, const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->numel() == n, op, ": bias must have ", n, " elements, got ", bias->numel());
  return bias->to(at::kFloat).contiguous();
}

}  // namespace srt_cpu

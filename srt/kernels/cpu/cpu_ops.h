// The extension's op entry points as C++ functions, for code that composes them without going
// through the dispatcher (decode_layers.cpp). Each is documented where it is defined; the torch
// ops of the same names call exactly these.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <cstdint>

namespace srt_cpu {

// decode_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                  const at::Tensor& seq_lens, double scale, int64_t split_len,
                                  c10::string_view isa_request);

// elementwise.cpp
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps);
void rotary_neox_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos_sin,
                  int64_t head_dim);

// gguf_linear.cpp
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& data, int64_t qtype,
                       const c10::optional<at::Tensor>& bias);
// gguf_q8act.cpp: x quantized to int8 per block of 32 first (numerics in gguf.py)
at::Tensor gguf_linear_q8a(const at::Tensor& x, const at::Tensor& data, int64_t qtype,
                           const c10::optional<at::Tensor>& bias);
at::Tensor gguf_linear_x8(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t rows,
                          const c10::optional<at::Tensor>& bias);

}  // namespace srt_cpu

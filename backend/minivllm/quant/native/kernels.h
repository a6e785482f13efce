// The kernels one native file calls in another (decode_step.cpp runs whole decoder layers through them).
#pragma once

#include <ATen/ATen.h>

namespace minivllm_native {

// x [rows, K] fp32 @ a 4-bit weight (q8_matmul.cpp's packed rows)^T, activations quantized per block of 32
// to int8 (or int8x2: `split`).
at::Tensor q4_int8_linear(const at::Tensor& x, const at::Tensor& w, bool split);

// x [rows, K] fp32 @ a 4-bit weight^T with fp32 activations, the weights dequantized in registers (f32_matmul.cpp).
at::Tensor q4_fp32_linear(const at::Tensor& x, const at::Tensor& w);

// x [rows, K] fp32 @ an fp32 weight [N, K]^T, each row summed in one fixed order (f32_matmul.cpp).
at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& w);

// One query token per sequence against its context in the paged pool (paged_attention.cpp).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale);

}  // namespace minivllm_native

// The kernels one native file calls in another (decode_step.cpp runs whole decoder layers through them). They
// write into the caller's output (contiguous fp32 of the product's shape): a decode step reuses its buffers
// across layers instead of allocating ~10 tensors a layer.
#pragma once

#include <ATen/ATen.h>

namespace minivllm_native {

// x [rows, K] fp32 @ a 4-bit weight (q8_matmul.cpp's packed rows)^T, activations quantized per block of 32
// to int8 (or int8x2: `split`).
void q4_int8_linear_into(const at::Tensor& x, const at::Tensor& w, bool split, at::Tensor& out);

// x [rows, K] fp32 @ a 4-bit weight^T with fp32 activations, the weights dequantized in registers (f32_matmul.cpp).
void q4_fp32_linear_into(const at::Tensor& x, const at::Tensor& w, at::Tensor& out);

// x [rows, K] fp32 @ an int8 weight [N, K]^T with fp32 scales per row [N] or per block of 32 [N, K/32] (GGUF's
// Q8_0): activations quantized per block to int8 (or int8x2: `split`), or fp32 (f32_matmul.cpp).
void i8_int8_linear_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale, bool split,
                         at::Tensor& out);
void i8_fp32_linear_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale, at::Tensor& out);

// x [rows, K] fp32 @ a K-quant weight^T (kquant_matmul.cpp): `w` a uint8 header (the parts' GGUF types and rows)
// and then each part's super-blocks; `acts` 0 int8, 1 int8x2, 2 fp32. `kquant_rows`: its output rows.
void kquant_linear_into(const at::Tensor& x, const at::Tensor& w, int64_t acts, at::Tensor& out);
int64_t kquant_rows(const at::Tensor& w);

// Whether the integer-activation kernels run their AVX512-VNNI loops now (q8_matmul.cpp's `use_vnni`).
bool vnni_kernels_on();

// x [rows, K] fp32 @ an fp32 weight [N, K]^T, each row summed in one fixed order (f32_matmul.cpp).
void fp32_linear_into(const at::Tensor& x, const at::Tensor& w, at::Tensor& out);

// One query token per sequence against its context in the paged pool (paged_attention.cpp): the inputs
// checked (block ids and context lengths against the pool), then the attention, which trusts them.
void check_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& block_tables, const at::Tensor& context_lens);
// `softcap` above 0: every score capped at +-softcap through tanh before the softmax (Gemma 2); `window` above 0:
// each sequence attends to its last `window` keys, read from the block the window starts in (Mistral).
void paged_decode_attention_into(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                 const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                 at::Tensor& out, double softcap = 0.0, int64_t window = 0);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale);

// Tensor parallelism on one machine (shm_collectives.cpp): `n` floats at `data` summed over the `world` ranks
// in place, through the shared segment `shm` every rank maps; every rank gets the same bits.
void shm_all_reduce_into(float* data, int64_t n, const at::Tensor& shm, int64_t rank, int64_t world);

}  // namespace minivllm_native

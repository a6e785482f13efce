// Weight-only quantized matmuls with activations quantized to int8 per block of 32 (AVX2).
//
// Why: torch's CPU 4-bit kernel converts every weight to bf16/fp32 and multiplies in floating
// point; on an AVX2-only CPU that is compute-bound at a third of the memory bandwidth. Quantizing
// the activation row to int8 per 32-block (as llama.cpp does) lets one AVX2 instruction
// (`vpmaddubsw`) multiply-add 32 weight/activation pairs, so a decode step becomes memory-bound.
//
// int8x2 (`split`, the default's): each activation also keeps its rounding remainder as a second int8,
// ~15 bits per block, for two integer products instead of one (quantize_rows).
//
// Every output row is computed from its own activation row only (quantization is per row and per
// block), so a request gets the same bits alone and in any batch.
//
// Weight formats (packed by minivllm/quant/native.py):
//   q4: per output row, fp16 d[K/32], fp16 m[K/32], then 16 bytes of nibbles per block of 32: element
//       j of a block is the low nibble of its byte j (j < 16) or the high nibble of byte j-16; w = d*q + m
//       (GGUF Q4_1's arithmetic; scales first so one row's d and m convert in a few vector loads).
//   i8: int8 [N, K] in input order, fp32 scales per output row or per block of 32 (GGUF Q8_0): w = scale * q.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "common.h"

namespace {

using namespace minivllm_native;


// Activations quantized per block of 32 to int8. The 4-bit kernel reads them in the pair layout: per 64
// inputs, 32 bytes [block0 0..15, block1 0..15] then 32 bytes [block0 16..31, block1 16..31] (the order
// in which one load of 32 nibble bytes unpacks; a dot product only needs both sides in one order). The
// int8 kernel reads them in input order, like its weights (shared with the embedding table).
struct QuantizedActivations {
  const int8_t* q_ptr = nullptr;            // int8 [M, K]
  const int8_t* r_ptr = nullptr;            // split only: int8 [M, K], the remainder, in q's layout
  const float* block_scale_ptr = nullptr;   // fp32 [M, K/32]: x ~= scale * q
  const float* pair_scale_ptr = nullptr;    // pair layout only: fp32 [M, K/64, 8], block0's scale x4, block1's x4
  const float* sum_ptr = nullptr;           // fp32 [M, sum_stride]: scale * sum(q), a Q4_1 minimum's partner
  int64_t sum_stride = 0;                   // blocks rounded up to 8, zeros after
};

inline int64_t round_up8(int64_t n) { return (n + 7) / 8 * 8; }

// Pair-layout position of input j (0..63) of a pair.
inline int64_t pair_position(int64_t j) {
  const int64_t block = j / kBlock, i = j % kBlock;
  return (i < 16 ? 0 : kBlock) + block * 16 + i % 16;
}

// The quantized rows live in a per-thread scratch buffer, reused across calls: five small tensor
// allocations cost about as much as a small layer's whole product at one row.
//
// `split`: each value also keeps its rounding remainder, x = (d / 128) * (128 * q + r) with r in int8
// too (|r| <= 64 + a rounding step): about 15 bits per block instead of 8, for two integer products
// instead of one; the scales then hold d / 128 (a power of two: exact).
QuantizedActivations quantize_rows(const at::Tensor& x, bool pair_layout, bool split) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock, sum_stride = round_up8(blocks);
  const int64_t q_floats = (rows * k + 63) / 64 * 16;  // int8 values, in 64-byte units of floats
  const int64_t r_floats = split ? q_floats : 0;
  const int64_t pair_floats = pair_layout ? rows * (blocks / 2) * 8 : 0;
  static thread_local std::vector<float> scratch;
  float* base = aligned_scratch(scratch, q_floats + r_floats + rows * blocks + pair_floats + rows * sum_stride);
  int8_t* q = reinterpret_cast<int8_t*>(base);
  int8_t* remainder = split ? reinterpret_cast<int8_t*>(base + q_floats) : nullptr;
  float* block_scale = base + q_floats + r_floats;
  float* pair_scale = block_scale + rows * blocks;
  float* sum = pair_scale + pair_floats;
  for (int64_t r = 0; r < rows; ++r) std::fill(sum + r * sum_stride + blocks, sum + (r + 1) * sum_stride, 0.f);
  QuantizedActivations a{q, remainder, block_scale, pair_scale, sum, sum_stride};
  const float* src = x.data_ptr<float>();
  const int32_t unit = split ? 128 : 1;  // the combined integer's weight of q
  at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // i: a block of one row (blocks never straddle rows)
      const float* v = src + i * kBlock;
      float amax = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      const int64_t pair_start = (i / 2) * kPair, first = (i % 2) * kBlock;
      int32_t total = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        const float scaled = v[j] * inv;
        const int32_t r = static_cast<int32_t>(std::nearbyint(scaled));
        const int64_t at = pair_layout ? pair_start + pair_position(first + j) : i * kBlock + j;
        q[at] = static_cast<int8_t>(r);
        total += unit * r;
        if (split) {
          const int32_t rest = std::clamp(static_cast<int32_t>(std::nearbyint((scaled - r) * 128.f)), -127, 127);
          remainder[at] = static_cast<int8_t>(rest);
          total += rest;
        }
      }
      const float d_unit = d / static_cast<float>(unit);
      block_scale[i] = d_unit;
      if (pair_layout)
        for (int64_t lane = 0; lane < 4; ++lane) pair_scale[(i / 2) * 8 + (i % 2) * 4 + lane] = d_unit;
      sum[(i / blocks) * sum_stride + i % blocks] = d_unit * static_cast<float>(total);
    }
  });
  return a;
}

namespace avx2 {
#include "q8_features.inc"
}  // namespace avx2

// The same loops for AVX512-VNNI CPUs, compiled for them only here; chosen at run time (never on others).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#define MINIVLLM_VNNI 1
namespace vnni {
#include "q8_features.inc"
}  // namespace vnni
#undef MINIVLLM_VNNI
#pragma GCC pop_options

std::atomic<bool> use_vnni_kernels{false};

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw");
}

// Turns the VNNI loops on or off (they give the same bits as the AVX2 ones); returns whether they run.
bool use_vnni(bool enable) {
  static const bool supported = cpu_has_vnni();
  use_vnni_kernels = enable && supported;
  return use_vnni_kernels;
}

template <bool SPLIT>
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& w) {
  check_activations(x, kPair);
  const int64_t rows = x.size(0), blocks = x.size(1) / kBlock, n = w.size(0);
  check_q4_weight(w, blocks);
  const QuantizedActivations a = quantize_rows(x, /*pair_layout=*/true, SPLIT);
  at::Tensor out = at::empty({rows, n}, x.options());
  const uint8_t* weights = w.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const bool vnni_on = use_vnni_kernels;
  at::parallel_for(0, n, kFeatureGrain, [&](int64_t begin, int64_t end) {
    (vnni_on ? vnni::q4_features<SPLIT> : avx2::q4_features<SPLIT>)(weights, blocks, a, rows, o, n, begin, end);
  });
  return out;
}

template <bool SPLIT>
at::Tensor i8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale) {
  check_activations(x, kBlock);
  const int64_t rows = x.size(0), blocks = x.size(1) / kBlock, n = w.size(0);
  const bool grouped = check_i8_weight(w, w_scale, x.size(1));
  const QuantizedActivations a = quantize_rows(x, /*pair_layout=*/false, SPLIT);
  at::Tensor out = at::empty({rows, n}, x.options());
  const int8_t* weights = w.data_ptr<int8_t>();
  const float* scales = w_scale.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const bool vnni_on = use_vnni_kernels;
  at::parallel_for(0, n, kFeatureGrain, [&](int64_t begin, int64_t end) {
    auto features = grouped ? (vnni_on ? vnni::i8_features<true, SPLIT> : avx2::i8_features<true, SPLIT>)
                            : (vnni_on ? vnni::i8_features<false, SPLIT> : avx2::i8_features<false, SPLIT>);
    features(weights, scales, blocks, a, rows, o, n, begin, end);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(minivllm_native, m) {  // the fp32-activation kernels add to it (f32_matmul.cpp)
  m.def("q4_q8_linear(Tensor x, Tensor w) -> Tensor");
  m.def("i8_q8_linear(Tensor x, Tensor w, Tensor w_scale) -> Tensor");
  m.def("q4_q8x2_linear(Tensor x, Tensor w) -> Tensor");
  m.def("i8_q8x2_linear(Tensor x, Tensor w, Tensor w_scale) -> Tensor");
  m.def("use_vnni(bool enable) -> bool", &use_vnni);
}

TORCH_LIBRARY_IMPL(minivllm_native, CPU, m) {
  m.impl("q4_q8_linear", &q4_linear<false>);
  m.impl("i8_q8_linear", &i8_linear<false>);
  m.impl("q4_q8x2_linear", &q4_linear<true>);
  m.impl("i8_q8x2_linear", &i8_linear<true>);
}

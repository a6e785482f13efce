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
#include "kernels.h"

namespace {

using namespace minivllm_native;


// Activations quantized per block of 32 to int8, in the pair layout both kernels read: per 64 inputs, 32
// bytes [block0 0..15, block1 0..15] then 32 bytes [block0 16..31, block1 16..31] (the order in which one
// load of 32 4-bit nibble bytes unpacks; int8 weights are brought into it by a lane shuffle shared by the
// row tile; a dot product only needs both sides in one order). Each row starts on a pair boundary; an odd
// block count ends in a pair whose second block is zeros (codes and scales), so it adds exactly nothing.
struct QuantizedActivations {
  const int8_t* q_ptr = nullptr;            // int8 [M, row_bytes]
  const int8_t* r_ptr = nullptr;            // split only: int8 [M, row_bytes], the remainder, in q's layout
  const float* pair_scale_ptr = nullptr;    // int8 weights: fp32 [M, pairs, 8]: x ~= scale * q; block0's scale x4,
                                            // block1's x4
  const float* sum_ptr = nullptr;           // 4-bit weights: fp32 [M, sum_stride]: scale * sum(q), a Q4_1 minimum's partner
  const int32_t* offset_ptr = nullptr;      // int8 weights, on request: int32 [M, pairs, 8], 128 * the sum of each product lane's
                                            // 8 codes (as combined: 128 q + r when split), in the pair scales' lanes
  int64_t row_bytes = 0;                    // pairs * 64
  int64_t pair_scale_stride = 0;            // pairs * 8 (also the offsets')
  int64_t sum_stride = 0;                   // blocks rounded up to 8, zeros after
  const float* block_scale_ptr = nullptr;   // 4-bit weights: fp32 [M, sum_stride]: x ~= scale * q per block, zeros
                                            // after (the 4-bit loop multiplies eight at a time by d)
  const int16_t* wide_ptr = nullptr;        // `wide` instead of q and r: int16 [M, row_bytes], each value's whole code
                                            // (128 q + r when split) in input order; the pair scales then in the
                                            // wide loop's lanes (wide_lanes)
};

inline int64_t round_up8(int64_t n) { return (n + 7) / 8 * 8; }

constexpr int32_t kSplitUnit = 128;  // int8x2: x = d / 128 * (128 * q + r); the loops' `<< 7` is this weight of q

struct BlockCodes {
  __m256i q, rest;     // int8 codes in input order (rest: split only)
  __m256i wide[2];     // `wide` only: int16 codes in input order, 128 q + rest (split) or q
  float amax;
  int32_t total;       // sum of unit * q + rest (split) or of q
  __m128i lane_total;  // `lanes` only: the same per product lane of the pair layout (elements 4j..4j+3, 16+4j..16+4j+3)
};

// Per product lane j of the pair layout, the sum of elements 4j..4j+3 and 16+4j..16+4j+3 of a block whose
// 32 values are v[0..3] (8 lanes each, in input order).
inline __m128i lane_totals(const __m256i (&v)[4]) {
  // [g0 x4, g1 x4] and [g2 x4, g3 x4], g the lane's group; two horizontal adds leave [g0 g2 g0 g2 | g1 g3 g1 g3]
  const __m256i halves = _mm256_hadd_epi32(_mm256_add_epi32(v[0], v[2]), _mm256_add_epi32(v[1], v[3]));
  const __m256i sums = _mm256_hadd_epi32(halves, halves);
  return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(sums, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0)));
}

// One block of 32 activations: x ~= amax / 127 * q (+ rest / 128). Vectorized (one scalar pass cost 4 ns a
// value, ~10% of a 32-row step), with the scalar arithmetic's exact results: max is exact, the products
// round alike, and cvtps2dq rounds to nearest even as nearbyint does in the default rounding mode.
inline BlockCodes quantize_block(const float* v, bool split, bool lanes, bool wide) {
  __m256 x[4];
  for (int j = 0; j < 4; ++j) x[j] = _mm256_loadu_ps(v + 8 * j);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 magnitude = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x[0]), _mm256_andnot_ps(sign, x[1])),
                                         _mm256_max_ps(_mm256_andnot_ps(sign, x[2]), _mm256_andnot_ps(sign, x[3])));
  const float amax = hmax(magnitude);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i q[4], rest[4];
  __m256i q_total = _mm256_setzero_si256(), rest_total = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256 scaled = _mm256_mul_ps(x[j], inv);
    q[j] = _mm256_cvtps_epi32(scaled);
    q_total = _mm256_add_epi32(q_total, q[j]);
    if (split) {
      const __m256 left = _mm256_mul_ps(_mm256_sub_ps(scaled, _mm256_cvtepi32_ps(q[j])), _mm256_set1_ps(kSplitUnit));
      rest[j] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(left), _mm256_set1_epi32(-127)),
                                 _mm256_set1_epi32(127));
      rest_total = _mm256_add_epi32(rest_total, rest[j]);
    }
  }
  BlockCodes codes{pack_bytes(q), _mm256_setzero_si256(), {}, amax, hsum_epi32(q_total),
                   lanes ? lane_totals(q) : _mm_setzero_si128()};
  if (wide)
    for (int h = 0; h < 2; ++h) {  // whole codes within int16 (|128 q + r| < 2^14); packs interleave 128-bit halves
      const __m256i c0 = split ? _mm256_add_epi32(_mm256_slli_epi32(q[2 * h], 7), rest[2 * h]) : q[2 * h];
      const __m256i c1 = split ? _mm256_add_epi32(_mm256_slli_epi32(q[2 * h + 1], 7), rest[2 * h + 1]) : q[2 * h + 1];
      codes.wide[h] = _mm256_permute4x64_epi64(_mm256_packs_epi32(c0, c1), 0xD8);
    }
  if (split) {
    codes.rest = pack_bytes(rest), codes.total = kSplitUnit * codes.total + hsum_epi32(rest_total);
    if (lanes) codes.lane_total = _mm_add_epi32(_mm_slli_epi32(codes.lane_total, 7), lane_totals(rest));
  }
  return codes;
}

// The quantized rows live in a per-thread scratch buffer, reused across calls: five small tensor
// allocations cost about as much as a small layer's whole product at one row.
//
// `split`: each value also keeps its rounding remainder, x = (d / 128) * (128 * q + r) with r in int8
// too (|r| <= 64 + a rounding step): about 15 bits per block instead of 8, for two integer products
// instead of one; the scales then hold d / 128 (a power of two: exact).
//
// `int8_weights`: the scales as the int8 kernel reads them (each pair's lanes), else as the 4-bit one does
// (per block: the scale, and scale x the codes' sum for Q4_1's minimum); each kernel's only.
// `offsets` (int8 weights): also each lane's code sum x 128, what the int8 kernel's unsigned weights
// (w + 128) add (VNNI).
// `wide` (int8 weights): int16 whole codes instead of q and r, for the AVX2 loop that multiplies int16 pairs.
QuantizedActivations quantize_rows(const at::Tensor& x, bool split, bool int8_weights, bool offsets, bool wide = false) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock, pairs = (blocks + 1) / 2;
  const int64_t row_bytes = pairs * kPair, sum_stride = round_up8(blocks);
  wide = wide && int8_weights;
  const int64_t q_floats = rows * row_bytes / 4 * (wide ? 2 : 1);  // whole 64-byte lines: every row starts on one
  const int64_t r_floats = split && !wide ? q_floats : 0;
  static thread_local std::vector<float> scratch;
  const int64_t lanes = int8_weights ? rows * pairs * 8 : 0, per_block = int8_weights ? 0 : rows * sum_stride;
  offsets = offsets && int8_weights;
  float* base = aligned_scratch(scratch, q_floats + r_floats + lanes * (offsets ? 2 : 1) + 2 * per_block);
  int8_t* q = wide ? nullptr : reinterpret_cast<int8_t*>(base);
  int8_t* remainder = r_floats ? reinterpret_cast<int8_t*>(base + q_floats) : nullptr;
  int16_t* whole = wide ? reinterpret_cast<int16_t*>(base) : nullptr;
  float* scales = base + q_floats + r_floats;
  float* pair_scale = int8_weights ? scales : nullptr;
  float* sum = int8_weights ? nullptr : scales;
  float* block_scale = int8_weights ? nullptr : scales + per_block;
  int32_t* offset = offsets ? reinterpret_cast<int32_t*>(scales + lanes) : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    if (sum)
      for (float* per : {sum, block_scale}) std::fill(per + r * sum_stride + blocks, per + (r + 1) * sum_stride, 0.f);
    if (blocks % 2) {  // the last pair's missing second block: zero codes, zero scales
      if (whole) std::fill_n(whole + (r + 1) * row_bytes - kBlock, kBlock, 0);
      for (int8_t* part : {q, remainder})
        if (part) for (int half = 0; half < 2; ++half) std::fill_n(part + (r + 1) * row_bytes - kPair + 16 + half * kBlock, 16, 0);
      // the whole pair's lanes (the wide layout interleaves the blocks'); block 0 writes its own after this
      if (pair_scale) std::fill_n(pair_scale + (r + 1) * pairs * 8 - 8, 8, 0.f);
      if (offset) std::fill_n(offset + (r + 1) * pairs * 8 - 8, 8, 0);
    }
  }
  const float* src = x.data_ptr<float>();
  const int32_t unit = split ? kSplitUnit : 1;  // the combined integer's weight of q
  at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // i: block b of row `row`
      const int64_t row = i / blocks, b = i % blocks;
      const BlockCodes codes = quantize_block(src + i * kBlock, split, offset != nullptr, wide);
      const int64_t low = row * row_bytes + (b / 2) * kPair + (b % 2) * 16;  // elements 0..15; 16..31 a half-pair on
      if (wide) {
        for (int h = 0; h < 2; ++h)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(whole + row * row_bytes + b * kBlock + 16 * h), codes.wide[h]);
      } else {
        store_halves(q + low, codes.q);
        if (split) store_halves(remainder + low, codes.rest);
      }
      const float d_unit = codes.amax / 127.f / static_cast<float>(unit);
      const int64_t lane = row * pairs * 8 + (b / 2) * 8;
      if (wide) {
        for (int j : {0, 1, 4, 5}) pair_scale[lane + j + 2 * (b % 2)] = d_unit;
      } else if (pair_scale) {
        std::fill_n(pair_scale + lane + (b % 2) * 4, 4, d_unit);
      } else {
        sum[row * sum_stride + b] = d_unit * static_cast<float>(codes.total);
        block_scale[row * sum_stride + b] = d_unit;
      }
      if (offset)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(offset + lane + (b % 2) * 4), _mm_slli_epi32(codes.lane_total, 7));
    }
  });
  return QuantizedActivations{q, remainder, pair_scale, sum, offset, row_bytes, pairs * 8, sum_stride, block_scale, whole};
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

// x @ w^T into out, the inputs already checked (check_q4).
template <bool SPLIT>
void q4_run(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const int64_t rows = x.size(0), blocks = x.size(1) / kBlock, n = w.size(0);
  const QuantizedActivations a = quantize_rows(x, SPLIT, /*int8_weights=*/false, /*offsets=*/false);
  const uint8_t* weights = w.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const bool vnni_on = use_vnni_kernels;
  at::parallel_for(0, n, kFeatureGrain, [&](int64_t begin, int64_t end) {
    (vnni_on ? vnni::q4_features<SPLIT> : avx2::q4_features<SPLIT>)(weights, blocks, a, rows, o, n, begin, end);
  });
}

void check_q4(const at::Tensor& x, const at::Tensor& w) {
  check_activations(x, kPair);
  check_q4_weight(w, x.size(1) / kBlock);
}

template <bool SPLIT>
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& w) {
  check_q4(x, w);
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  q4_run<SPLIT>(x, w, out);
  return out;
}

// x @ w^T into out (checked here).
template <bool SPLIT>
void i8_run(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale, at::Tensor& out) {
  check_activations(x, kBlock);
  const int64_t rows = x.size(0), blocks = x.size(1) / kBlock, n = w.size(0);
  const bool grouped = check_i8_weight(w, w_scale, x.size(1));
  check_output(out, rows, n);
  const bool vnni_on = use_vnni_kernels;
  const QuantizedActivations a = quantize_rows(x, SPLIT, /*int8_weights=*/true, /*offsets=*/vnni_on, /*wide=*/!vnni_on);
  const int8_t* weights = w.data_ptr<int8_t>();
  float* o = out.data_ptr<float>();
  with_i8_scales(w_scale, grouped, [&](auto per_block, const auto* scales) {
    constexpr bool kGrouped = decltype(per_block)::value;
    using S = std::remove_cv_t<std::remove_pointer_t<decltype(scales)>>;
    auto features = vnni_on ? vnni::i8_features<kGrouped, SPLIT, false, S> : avx2::i8_features<kGrouped, SPLIT, true, S>;
    at::parallel_for(0, n, kFeatureGrain, [&](int64_t begin, int64_t end) {
      features(weights, scales, blocks, a, rows, o, n, begin, end);
    });
  });
}

template <bool SPLIT>
at::Tensor i8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale) {
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  i8_run<SPLIT>(x, w, w_scale, out);
  return out;
}

}  // namespace

bool minivllm_native::vnni_kernels_on() { return use_vnni_kernels; }

void minivllm_native::q4_int8_linear_into(const at::Tensor& x, const at::Tensor& w, bool split, at::Tensor& out) {
  check_q4(x, w);
  check_output(out, x.size(0), w.size(0));
  split ? q4_run<true>(x, w, out) : q4_run<false>(x, w, out);
}

void minivllm_native::i8_int8_linear_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                                          bool split, at::Tensor& out) {
  split ? i8_run<true>(x, w, w_scale, out) : i8_run<false>(x, w, w_scale, out);
}

TORCH_LIBRARY(minivllm_native, m) {  // the fp32-activation kernels add to it (f32_matmul.cpp)
  m.def("q4_q8_linear(Tensor x, Tensor w) -> Tensor");
  m.def("i8_q8_linear(Tensor x, Tensor w, Tensor w_scale) -> Tensor");
  m.def("q4_q8x2_linear(Tensor x, Tensor w) -> Tensor");
  m.def("i8_q8x2_linear(Tensor x, Tensor w, Tensor w_scale) -> Tensor");
  m.def("use_vnni(bool enable) -> bool", &use_vnni);
  m.def("vnni_running() -> bool", []() -> bool { return use_vnni_kernels; });
}

TORCH_LIBRARY_IMPL(minivllm_native, CPU, m) {
  m.impl("q4_q8_linear", &q4_linear<false>);
  m.impl("i8_q8_linear", &i8_linear<false>);
  m.impl("q4_q8x2_linear", &q4_linear<true>);
  m.impl("i8_q8x2_linear", &i8_linear<true>);
}

// Weight-only quantized matmuls with fp32 activations (AVX2): the output is x @ dequant(W)^T up to the
// order of fp32 summation, the precision the fp32-dequantized model (the HF parity reference) has.
//
// Why: on AVX2 integer products are not cheaper per multiply than fp32 FMAs once their bookkeeping is
// counted (q8_matmul.cpp spends vpmaddubsw, vpmaddwd, a conversion and a scale FMA per 32 products; four
// FMAs do the same here), so keeping activations in fp32 costs about the same time and gives up nothing.
// The weights are dequantized in registers, one block of 32 at a time, and shared by a tile of rows.
//
// Every output row is summed in one fixed order (two accumulator chains per row: a block's vectors 0 and
// 2 in one, 1 and 3 in the other), whatever the tile, so a row gets the same bits alone and in any batch.
// The weights are the packed tensors q8_matmul.cpp reads (common.h), so both kernels can share them.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace {

using namespace minivllm_native;

constexpr int kRowTile = 4;       // rows sharing one dequantized weight block
constexpr int64_t kFeatureRun = 4;  // features whose scales are converted together, then reused by every row tile

// A 4-bit weight (fp16 d[K/32], fp16 m[K/32], nibbles) whose scales for a run of features are converted
// to fp32 once (`prepare`, into the thread's scratch given by `bind`), then read by broadcast loads in the
// inner loop.
struct Q4Rows {
  static constexpr bool kStreams = false;  // dequantizing is compute: features in tiles share activation loads
  static constexpr int64_t kSpan = 0;  // one running sum per chain (tile)
  const uint8_t* base;
  int64_t blocks;
  float* d = nullptr;  // [kFeatureRun][blocks], the current run's
  float* m = nullptr;

  int64_t scratch_floats() const { return 2 * kFeatureRun * blocks; }
  void bind(float* scratch) { d = scratch, m = scratch + kFeatureRun * blocks; }

  void prepare(int64_t first, int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
      const uint16_t* halves = reinterpret_cast<const uint16_t*>(row(first + i));
      for (int64_t b = 0; b < blocks; b += 8) {
        const int64_t n = std::min<int64_t>(8, blocks - b);
        float d8[8], m8[8];
        _mm256_storeu_ps(d8, halves8(halves + b, n));
        _mm256_storeu_ps(m8, halves8(halves + blocks + b, n));
        std::copy(d8, d8 + n, d + i * blocks + b);
        std::copy(m8, m8 + n, m + i * blocks + b);
      }
    }
  }
  const uint8_t* row(int64_t feature) const { return base + feature * blocks * kQ4BlockBytes; }
  // Vector v (inputs 8v..8v+7) of block b: low nibbles of bytes 0-7 / 8-15, then their high nibbles.
  __m256 vec(const uint8_t* w, int64_t, int64_t local, int64_t b, int v) const {
    const __m256i bytes = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 4 * blocks + b * 16 + (v & 1) * 8)));
    const __m256i q = v < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(bytes, 4);
    const int64_t s = local * blocks + b;
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_broadcast_ss(d + s), _mm256_broadcast_ss(m + s));
  }
  float finish(int64_t, float sum) const { return sum; }
};

// An int8 weight in input order: w = scale * q, the scale one per row (applied to the sum) or, GROUPED,
// one per block of 32 (GGUF's Q8_0; applied to the weights, exactly: an fp16 scale times an int8 fits fp32).
template <bool GROUPED, typename S>
struct I8Rows {
  static constexpr bool kStreams = false;
  static constexpr int64_t kSpan = 0;
  const int8_t* base;
  int64_t blocks;
  const S* scale;  // fp32, or (GROUPED) fp16

  int64_t scratch_floats() const { return 0; }
  void bind(float*) {}
  void prepare(int64_t, int64_t) {}
  const int8_t* row(int64_t feature) const { return base + feature * blocks * kBlock; }
  __m256 vec(const int8_t* w, int64_t feature, int64_t, int64_t b, int v) const {
    const __m256 q = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + b * kBlock + v * 8))));
    if constexpr (!GROUPED) return q;
    return _mm256_mul_ps(q, _mm256_set1_ps(scale_at(scale + feature * blocks + b)));
  }
  float finish(int64_t feature, float sum) const { return GROUPED ? sum : scale_at(scale + feature) * sum; }
};

// A plain fp32 weight [N, K] (the fp32 model's linears where this kernel beats MKL: model/packed_linear.py).
// MKL's sgemv streams a third of the bandwidth on AMD CPUs (measured: 10.5 GB/s at one row, 5.6 at two, of
// 28 GB/s); this reads one weight row at a time, front to back, and reaches ~27.
struct F32Rows {
  static constexpr bool kStreams = true;  // memory-bound: one feature row at a time, read front to back
  // Spans of 4 blocks summed apart before joining the total (two levels, as a blocked GEMM sums): closer
  // to the exact sums than one running sum a row (embedded model, worst hidden-state entry against HF:
  // 0.0156 -> 0.0127 at a ~1e4 residual activation).
  static constexpr int64_t kSpan = 4;
  const float* base;
  int64_t blocks;

  int64_t scratch_floats() const { return 0; }
  void bind(float*) {}
  void prepare(int64_t, int64_t) {}
  const float* row(int64_t feature) const { return base + feature * blocks * kBlock; }
  __m256 vec(const float* w, int64_t, int64_t, int64_t b, int v) const { return _mm256_loadu_ps(w + b * kBlock + v * 8); }
  float finish(int64_t, float sum) const { return sum; }
};

// FT features x RT rows: each weight vector is dequantized once for RT rows, each activation vector
// loaded once for FT features.
template <int FT, int RT, typename W>
void tile(const W& weights, int64_t first, int64_t local, const float* x, int64_t row, float* out, int64_t n) {
  const int64_t blocks = weights.blocks, k = blocks * kBlock;
  decltype(weights.row(0)) w[FT];
  _Pragma("GCC unroll 8") for (int f = 0; f < FT; ++f) w[f] = weights.row(first + f);
  __m256 acc[FT][RT][2], total[FT][RT];
  _Pragma("GCC unroll 8") for (int f = 0; f < FT; ++f)
    _Pragma("GCC unroll 8") for (int t = 0; t < RT; ++t) acc[f][t][0] = acc[f][t][1] = total[f][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    _Pragma("GCC unroll 8") for (int v = 0; v < 4; ++v) {
      _Pragma("GCC unroll 8") for (int f = 0; f < FT; ++f) {
        const __m256 wv = weights.vec(w[f], first + f, local + f, b, v);
        _Pragma("GCC unroll 8") for (int t = 0; t < RT; ++t) {
          const __m256 xv = _mm256_loadu_ps(x + (row + t) * k + b * kBlock + v * 8);
          acc[f][t][v & 1] = _mm256_fmadd_ps(wv, xv, acc[f][t][v & 1]);
        }
      }
    }
    if constexpr (W::kSpan > 0)
      if ((b + 1) % W::kSpan == 0 || b + 1 == blocks)  // a span's partial sums join the total
        _Pragma("GCC unroll 8") for (int f = 0; f < FT; ++f)
          _Pragma("GCC unroll 8") for (int t = 0; t < RT; ++t) {
            total[f][t] = _mm256_add_ps(total[f][t], _mm256_add_ps(acc[f][t][0], acc[f][t][1]));
            acc[f][t][0] = acc[f][t][1] = _mm256_setzero_ps();
          }
  }
  _Pragma("GCC unroll 8") for (int f = 0; f < FT; ++f)
    _Pragma("GCC unroll 8") for (int t = 0; t < RT; ++t) {
      const __m256 sum = W::kSpan > 0 ? total[f][t] : _mm256_add_ps(acc[f][t][0], acc[f][t][1]);
      out[(row + t) * n + first + f] = weights.finish(first + f, hsum(sum));
    }
}

// A run of features against every row: about eight accumulator chains per tile hide FMA latency.
template <int RT, typename W>
void run_rows(const W& weights, int64_t first, int64_t count, const float* x, int64_t row, float* out, int64_t n) {
  constexpr int FT = W::kStreams ? 1 : RT == 1 ? 4 : RT == 2 ? 2 : 1;
  int64_t f = 0;
  for (; f + FT <= count; f += FT) tile<FT, RT>(weights, first + f, f, x, row, out, n);
  for (; f < count; ++f) tile<1, RT>(weights, first + f, f, x, row, out, n);
}

template <typename W>
void linear_into(const at::Tensor& x, W weights, int64_t n, at::Tensor& out) {
  const int64_t rows = x.size(0);
  check_output(out, rows, n);
  const float* xp = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, kFeatureGrain, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> scratch;
    scratch.resize(std::max<size_t>(scratch.size(), weights.scratch_floats()));
    W local = weights;
    local.bind(scratch.data());
    for (int64_t first = begin; first < end; first += kFeatureRun) {
      const int64_t count = std::min(kFeatureRun, end - first);
      local.prepare(first, count);
      over_row_tiles<kRowTile>(0, rows, [&](auto rt, int64_t row) {
        run_rows<decltype(rt)::value>(local, first, count, xp, row, o, n);
      });
    }
  });
}

template <typename W>
at::Tensor linear(const at::Tensor& x, W weights, int64_t n) {
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  linear_into(x, weights, n, out);
  return out;
}

// A 4-bit weight's rows for x, the inputs checked.
Q4Rows q4_rows(const at::Tensor& x, const at::Tensor& w) {
  check_activations(x, kPair);  // the scales convert eight blocks at a time, in pairs
  const int64_t blocks = x.size(1) / kBlock;
  check_q4_weight(w, blocks);
  return Q4Rows{w.data_ptr<uint8_t>(), blocks};
}

at::Tensor q4_f32_linear(const at::Tensor& x, const at::Tensor& w) {
  const Q4Rows rows = q4_rows(x, w);  // checked before w's size is read
  return linear(x, rows, w.size(0));
}

void i8_f32_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale, at::Tensor& out) {
  check_activations(x, kBlock);
  const int64_t blocks = x.size(1) / kBlock;
  with_i8_scales(w_scale, check_i8_weight(w, w_scale, x.size(1)), [&](auto per_block, const auto* scales) {
    using S = std::remove_cv_t<std::remove_pointer_t<decltype(scales)>>;
    linear_into(x, I8Rows<decltype(per_block)::value, S>{w.data_ptr<int8_t>(), blocks, scales}, w.size(0), out);
  });
}

at::Tensor i8_f32_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale) {
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  i8_f32_into(x, w, w_scale, out);
  return out;
}

// An fp32 weight's rows for x, the inputs checked.
F32Rows f32_rows(const at::Tensor& x, const at::Tensor& w) {
  check_activations(x, kBlock);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 2 && w.size(1) == x.size(1),
              "expected a contiguous fp32 weight [N, ", x.size(1), "], got ", w.sizes(), " ", w.scalar_type());
  return F32Rows{w.data_ptr<float>(), x.size(1) / kBlock};
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w) {
  const F32Rows rows = f32_rows(x, w);
  return linear(x, rows, w.size(0));
}

}  // namespace

void minivllm_native::q4_fp32_linear_into(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const Q4Rows rows = q4_rows(x, w);
  linear_into(x, rows, w.size(0), out);
}

void minivllm_native::i8_fp32_linear_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                                          at::Tensor& out) {
  i8_f32_into(x, w, w_scale, out);
}

void minivllm_native::fp32_linear_into(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const F32Rows rows = f32_rows(x, w);
  linear_into(x, rows, w.size(0), out);
}

TORCH_LIBRARY_FRAGMENT(minivllm_native, m) {
  m.def("q4_f32_linear(Tensor x, Tensor w) -> Tensor");
  m.def("i8_f32_linear(Tensor x, Tensor w, Tensor w_scale) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm_native, CPU, m) {
  m.impl("q4_f32_linear", &q4_f32_linear);
  m.impl("i8_f32_linear", &i8_f32_linear);
  m.impl("f32_linear", &f32_linear);
}

// Weight-only quantized matmuls with activations quantized to int8 per block of 32 (AVX2).
//
// Why: torch's CPU 4-bit kernel converts every weight to bf16/fp32 and multiplies in floating
// point; on an AVX2-only CPU that is compute-bound at a third of the memory bandwidth. Quantizing
// the activation row to int8 per 32-block (as llama.cpp does) lets one AVX2 instruction
// (`vpmaddubsw`) multiply-add 32 weight/activation pairs, so a decode step becomes memory-bound.
//
// Every output row is computed from its own activation row only (quantization is per row and per
// block), so a request gets the same bits alone and in any batch.
//
// Weight formats (packed by minivllm/quant/native.py):
//   q4: per output row, fp16 d[K/32], fp16 m[K/32], then 16 bytes of nibbles per block of 32: element
//       j of a block is the low nibble of its byte j (j < 16) or the high nibble of byte j-16; w = d*q + m
//       (GGUF Q4_1's arithmetic; scales first so one row's d and m convert in a few vector loads).
//   i8: int8 [N, K] in input order, one fp32 scale per output row: w = scale * q.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPair = 2 * kBlock;   // kernels consume two blocks per step: one 32-byte load of nibbles
constexpr int64_t kRowTile = 4;         // activation rows sharing one unpacked weight pair
constexpr int64_t kQ4BlockBytes = 20;   // a 4-bit weight block: fp16 d, fp16 m, 16 bytes of nibbles
constexpr int64_t kFeatureGrain = 64;   // output features per parallel task: amortises a task, still balances

// Activations quantized per block of 32 to int8. The 4-bit kernel reads them in the pair layout: per 64
// inputs, 32 bytes [block0 0..15, block1 0..15] then 32 bytes [block0 16..31, block1 16..31] (the order
// in which one load of 32 nibble bytes unpacks; a dot product only needs both sides in one order). The
// int8 kernel reads them in input order, like its weights (shared with the embedding table).
struct QuantizedActivations {
  const int8_t* q_ptr = nullptr;            // int8 [M, K]
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
QuantizedActivations quantize_rows(const at::Tensor& x, bool pair_layout) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock, sum_stride = round_up8(blocks);
  const int64_t q_floats = (rows * k + 31) / 32 * 8;  // int8 values, in 32-byte units of floats
  const int64_t pair_floats = pair_layout ? rows * (blocks / 2) * 8 : 0;
  static thread_local std::vector<float> scratch;
  scratch.resize(std::max<size_t>(scratch.size(), q_floats + rows * blocks + pair_floats + rows * sum_stride));
  int8_t* q = reinterpret_cast<int8_t*>(scratch.data());
  float* block_scale = scratch.data() + q_floats;
  float* pair_scale = block_scale + rows * blocks;
  float* sum = pair_scale + pair_floats;
  for (int64_t r = 0; r < rows; ++r) std::fill(sum + r * sum_stride + blocks, sum + (r + 1) * sum_stride, 0.f);
  QuantizedActivations a{q, block_scale, pair_scale, sum, sum_stride};
  const float* src = x.data_ptr<float>();
  at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // i: a block of one row (blocks never straddle rows)
      const float* v = src + i * kBlock;
      float amax = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      const int64_t pair_start = (i / 2) * kPair, first = (i % 2) * kBlock;
      int32_t total = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        const int32_t r = static_cast<int32_t>(std::nearbyint(v[j] * inv));
        q[pair_layout ? pair_start + pair_position(first + j) : i * kBlock + j] = static_cast<int8_t>(r);
        total += r;
      }
      block_scale[i] = d;
      if (pair_layout)
        for (int64_t lane = 0; lane < 4; ++lane) pair_scale[(i / 2) * 8 + (i % 2) * 4 + lane] = d;
      sum[(i / blocks) * sum_stride + i % blocks] = d * static_cast<float>(total);
    }
  });
  return a;
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Eight fp16 values as floats; a short tail (n = 2, 4 or 6: blocks come in pairs) is zero-padded by a
// masked load (copying it into a buffer first would stall on store-to-load forwarding every row).
inline __m256 halves8(const uint16_t* h, int64_t n) {
  if (n == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  const __m128i lanes = _mm_setr_epi32(0, 1, 2, 3);
  const __m128i mask = _mm_cmplt_epi32(lanes, _mm_set1_epi32(static_cast<int>(n / 2)));
  return _mm256_cvtph_ps(_mm_maskload_epi32(reinterpret_cast<const int*>(h), mask));
}

// Lanes [2i x4, 2i+1 x4] of eight per-block values: one pair's scales, lined up with its products.
inline __m256 pair_lanes(__m256 v, int i) {
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(2 * i, 2 * i, 2 * i, 2 * i, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1));
}

// One 4-bit weight row (d[blocks] fp16, m[blocks] fp16, nibbles[blocks*16]) against TILE activation
// rows: w = d*q + m, so w.x = sum_b d_b * x_scale_b * (q_b . xq_b) + m_b * x_sum_b. Eight blocks (four
// pairs) share one conversion of their d and m: no per-row scratch pass.
template <int TILE>
void q4_feature(const uint8_t* w, int64_t blocks, const QuantizedActivations& a, int64_t row, float* out,
                int64_t out_stride) {
  const uint16_t* d16 = reinterpret_cast<const uint16_t*>(w);
  const uint16_t* m16 = d16 + blocks;
  const uint8_t* nibbles = w + 4 * blocks;
  const int64_t k = blocks * kBlock, pairs = blocks / 2;
  const int8_t* xq = a.q_ptr + row * k;
  const float* xs = a.pair_scale_ptr + row * pairs * 8;
  const float* xsum = a.sum_ptr + row * a.sum_stride;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[TILE][2], minimum[TILE];
  for (int t = 0; t < TILE; ++t) acc[t][0] = acc[t][1] = minimum[t] = _mm256_setzero_ps();
  auto step = [&](int64_t p, __m256 dpair, int parity) {
    const __m256i packed = load32(nibbles + p * 32);
    const __m256i lo = _mm256_and_si256(packed, low4), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    for (int t = 0; t < TILE; ++t) {
      const int8_t* x = xq + t * k + p * kPair;
      // 2 * 15 * 127 per maddubs lane: two of them still fit int16
      const __m256i sums = _mm256_add_epi16(_mm256_maddubs_epi16(lo, load32(x)), _mm256_maddubs_epi16(hi, load32(x + 32)));
      const __m256 products = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums, ones));
      const __m256 scale = _mm256_mul_ps(dpair, _mm256_loadu_ps(xs + (t * pairs + p) * 8));
      acc[t][parity] = _mm256_fmadd_ps(scale, products, acc[t][parity]);  // two chains: FMA latency
    }
  };
  for (int64_t g = 0; g < blocks; g += 8) {
    const int64_t n = std::min<int64_t>(8, blocks - g);
    const __m256 d = halves8(d16 + g, n), m = halves8(m16 + g, n);
    for (int t = 0; t < TILE; ++t)
      minimum[t] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xsum + t * a.sum_stride + g), minimum[t]);
    const int64_t p = g / 2;
    if (n == 8) {
      step(p, pair_lanes(d, 0), 0), step(p + 1, pair_lanes(d, 1), 1);
      step(p + 2, pair_lanes(d, 2), 0), step(p + 3, pair_lanes(d, 3), 1);
    } else {
      for (int i = 0; i < n / 2; ++i) step(p + i, pair_lanes(d, i), 0);
    }
  }
  for (int t = 0; t < TILE; ++t)
    out[t * out_stride] = hsum(_mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), minimum[t]));
}

// One int8 weight row (input order) against TILE activation rows: w.x = w_scale * sum_b x_scale_b * (q_b . xq_b).
template <int TILE>
void i8_feature(const int8_t* w, int64_t blocks, const QuantizedActivations& a, int64_t row, float w_scale,
                float* out, int64_t out_stride) {
  const int64_t k = blocks * kBlock;
  const int8_t* xq = a.q_ptr + row * k;
  const float* xs = a.block_scale_ptr + row * blocks;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[TILE][2];
  for (int t = 0; t < TILE; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  auto step = [&](int64_t b, int parity) {
    const __m256i wq = load32(w + b * kBlock);
    const __m256i magnitude = _mm256_sign_epi8(wq, wq);  // vpmaddubsw wants one unsigned side: w*x == |w| * (x with w's sign)
    for (int t = 0; t < TILE; ++t) {
      const __m256i x = _mm256_sign_epi8(load32(xq + t * k + b * kBlock), wq);
      const __m256 products = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x), ones));
      acc[t][parity] = _mm256_fmadd_ps(_mm256_set1_ps(xs[t * blocks + b]), products, acc[t][parity]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) step(b, 0), step(b + 1, 1);  // two chains: FMA latency
  if (b < blocks) step(b, 0);
  for (int t = 0; t < TILE; ++t) out[t * out_stride] = w_scale * hsum(_mm256_add_ps(acc[t][0], acc[t][1]));
}

// Runs f(tile, row) over all rows in tiles of kRowTile, then the remainder.
template <typename F>
void over_row_tiles(int64_t rows, F&& f) {
  int64_t row = 0;
  for (; row + kRowTile <= rows; row += kRowTile) f(std::integral_constant<int, kRowTile>{}, row);
  switch (rows - row) {
    case 3: f(std::integral_constant<int, 3>{}, row); break;
    case 2: f(std::integral_constant<int, 2>{}, row); break;
    case 1: f(std::integral_constant<int, 1>{}, row); break;
    default: break;
  }
}

void check_activations(const at::Tensor& x, int64_t multiple) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "expected contiguous fp32 activations [rows, K], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) % multiple == 0, "K=", x.size(1), " must be a multiple of ", multiple);
}

at::Tensor q4_q8_linear(const at::Tensor& x, const at::Tensor& w) {
  check_activations(x, kPair);
  const int64_t rows = x.size(0), blocks = x.size(1) / kBlock, n = w.size(0);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == blocks * kQ4BlockBytes,
              "q4 weight must be uint8 [N, K/32*20], got ", w.sizes());
  const QuantizedActivations a = quantize_rows(x, /*pair_layout=*/true);
  at::Tensor out = at::empty({rows, n}, x.options());
  const uint8_t* weights = w.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, kFeatureGrain, [&](int64_t begin, int64_t end) {
    for (int64_t f = begin; f < end; ++f) {
      const uint8_t* row_w = weights + f * blocks * kQ4BlockBytes;
      over_row_tiles(rows, [&](auto tile, int64_t row) {
        q4_feature<decltype(tile)::value>(row_w, blocks, a, row, o + row * n + f, n);
      });
    }
  });
  return out;
}

at::Tensor i8_q8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale) {
  check_activations(x, kBlock);
  const int64_t rows = x.size(0), blocks = x.size(1) / kBlock, n = w.size(0);
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous() && w.size(1) == x.size(1),
              "i8 weight must be int8 [N, K], got ", w.sizes());
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() == n,
              "one contiguous fp32 scale per output row");
  const QuantizedActivations a = quantize_rows(x, /*pair_layout=*/false);
  at::Tensor out = at::empty({rows, n}, x.options());
  const int8_t* weights = w.data_ptr<int8_t>();
  const float* scales = w_scale.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, kFeatureGrain, [&](int64_t begin, int64_t end) {
    for (int64_t f = begin; f < end; ++f) {
      const int8_t* row_w = weights + f * blocks * kBlock;
      over_row_tiles(rows, [&](auto tile, int64_t row) {
        i8_feature<decltype(tile)::value>(row_w, blocks, a, row, scales[f], o + row * n + f, n);
      });
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(minivllm_native, m) {
  m.def("q4_q8_linear(Tensor x, Tensor w) -> Tensor");
  m.def("i8_q8_linear(Tensor x, Tensor w, Tensor w_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm_native, CPU, m) {
  m.impl("q4_q8_linear", &q4_q8_linear);
  m.impl("i8_q8_linear", &i8_q8_linear);
}

// A decode step's decoder layers in one call (AVX2 + FMA + F16C): for each layer RMSNorm, the fused QKV
// product, rotary on Q and K, the K/V write into the paged pool, decode attention from the pool, the
// output product and residual, RMSNorm, the fused gate/up product, SiLU x up, the down product and residual.
// A family's pieces are optional arguments, absent where empty (`Piece`): a QKV and an O bias (Qwen2),
// per-head Q/K RMSNorms before rotary (Qwen3, Gemma 3), norms on the attention's and MLP's outputs, GeGLU
// and a second rope table for the local layers (Gemma), soft-capped attention scores (Gemma 2), a sliding
// window (Mistral), rotary over a head's leading dims (Phi-3), and mixture-of-experts MLPs (Qwen3-MoE, Mixtral:
// router, top-k, each chosen expert's products once on the rows that chose it). Under tensor parallelism a rank runs its slice of every layer and sums the O and down products over the ranks
// through shared memory (shm_collectives.cpp), still in this one call.
//
// Why: at one sequence the weight products of a 4-bit step take ~4 ms, and everything around them took
// another ~2.5 ms: inductor's wrapper calling ~12 kernels a layer from Python, each call's dispatch,
// guards and allocations. Here the products are the same kernels (4-bit, int8, GGUF K-quant or fp32 weights:
// q8_matmul.cpp, kquant_matmul.cpp, f32_matmul.cpp; attention: paged_attention.cpp) and the small operations
// are a few vector loops each, called from C++: one Python call a step.
//
// Only steps whose every row is one sequence's single token (decode); each row is computed from its own
// values only, so a sequence gets the same bits alone and in any batch. The products' results are bit for
// bit the kernels'; norm, rotary and SiLU differ from torch's in the last bits (summation order, a
// polynomial exp), which the int8x2 activation rounding that follows them makes immaterial.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace {

using namespace minivllm_native;

constexpr int64_t kWeightsPerLayer = 6;  // input norm, QKV, O, post-attention norm, gate/up, down
constexpr int64_t kProductsPerLayer = 4;
// A layer's optional pieces, in this order in `pieces` (an empty tensor: the layer has none); the last four are
// the scales of its four products' weights where those are int8 (the kernels take the two tensors).
enum Piece : int64_t {
  kQkvBias, kOBias, kQNorm, kKNorm, kAttnOutNorm, kMlpOutNorm, kFirstScale, kPiecesPerLayer = kFirstScale + kProductsPerLayer
};
// How a product runs (the kernel plan's choice at the step's row count; model/native_products.py numbers them alike).
enum ProductKind : int64_t {
  kQ4Int8 = 0, kQ4Int8x2 = 1, kQ4Fp32 = 2, kFp32 = 3, kKQuantInt8 = 4, kKQuantInt8x2 = 5, kKQuantFp32 = 6,
  kI8Int8 = 7, kI8Int8x2 = 8, kI8Fp32 = 9
};

bool takes_scales(int64_t kind) { return kind >= kI8Int8; }

// x @ w^T into `out` [rows, N]; `scale`: an int8 weight's scales (takes_scales).
void product(const at::Tensor& x, const at::Tensor& w, int64_t kind, at::Tensor& out, const at::Tensor* scale = nullptr) {
  TORCH_CHECK(!takes_scales(kind) || scale, "an int8 weight's product needs its scales");
  switch (kind) {
    case kQ4Int8: return q4_int8_linear_into(x, w, false, out);
    case kQ4Int8x2: return q4_int8_linear_into(x, w, true, out);
    case kQ4Fp32: return q4_fp32_linear_into(x, w, out);
    case kFp32: return fp32_linear_into(x, w, out);
    case kKQuantInt8: case kKQuantInt8x2: case kKQuantFp32: return kquant_linear_into(x, w, kind - kKQuantInt8, out);
    case kI8Int8: case kI8Int8x2: return i8_int8_linear_into(x, w, *scale, kind == kI8Int8x2, out);
    case kI8Fp32: return i8_fp32_linear_into(x, w, *scale, out);
    default: TORCH_CHECK(false, "unknown product kind ", kind);
  }
}

void check_kind(int64_t kind) { TORCH_CHECK(kind >= kQ4Int8 && kind <= kI8Fp32, "unknown product kind ", kind); }

// A product weight's output rows: a K-quant weight's from its header (one flat tensor), else its first dimension.
int64_t product_rows(const at::Tensor& w, int64_t kind) {
  if (kind >= kKQuantInt8 && kind <= kKQuantFp32) return kquant_rows(w);
  return w.dim() == 2 ? w.size(0) : -1;
}

float sum_of_squares(const float* x, int64_t n) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 2; ++j) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
      acc[j] = _mm256_fmadd_ps(v, v, acc[j]);
    }
  float sum = hsum(_mm256_add_ps(acc[0], acc[1]));
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

// x / sqrt(mean(x^2) + eps) * weight, per row, into `out` (x's shape).
void rms_norm(const at::Tensor& x, const float* w, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  over_rows(rows, n, [&](int64_t r) {
    const float* row = src + r * n;
    const float inv = 1.0f / std::sqrt(sum_of_squares(row, n) / static_cast<float>(n) + static_cast<float>(eps));
    for (int64_t i = 0; i < n; ++i) dst[r * n + i] = row[i] * inv * w[i];
  });
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  rms_norm(x, weight.data_ptr<float>(), eps, out);
}

// The leading `rot` dims of each head of `heads` (dim floats apart) rotated in place: x * cos +
// swap_halves(x) * signed_sin, the sign of rotate_half folded into the table (model/rope.py); rot < dim is
// partial rotary. Both halves of a lane are read before either is written, so no copy is needed; eight
// lanes at a time where the half is a multiple of 8.
void rotate(float* x, int64_t heads, int64_t dim, int64_t rot, const float* cos, const float* signed_sin) {
  const int64_t half = rot / 2, wide = half % 8 == 0 ? half : 0;
  for (int64_t h = 0; h < heads; ++h, x += dim) {
    for (int64_t d = 0; d < wide; d += 8) {
      const __m256 a = _mm256_loadu_ps(x + d), b = _mm256_loadu_ps(x + d + half);
      _mm256_storeu_ps(x + d, _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(cos + d)),
                                            _mm256_mul_ps(b, _mm256_loadu_ps(signed_sin + d))));
      _mm256_storeu_ps(x + d + half, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(cos + d + half)),
                                                   _mm256_mul_ps(a, _mm256_loadu_ps(signed_sin + d + half))));
    }
    for (int64_t d = wide; d < half; ++d) {
      const float a = x[d], b = x[d + half];
      x[d] = a * cos[d] + b * signed_sin[d];
      x[d + half] = b * cos[d + half] + a * signed_sin[d + half];
    }
  }
}

// n floats into the pool's precision (round to nearest even, as torch's conversions).
template <typename T>
void store(T* dst, const float* src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
  } else if constexpr (std::is_same_v<T, at::Half>) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; ++i) dst[i] = static_cast<at::Half>(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

// x [dim] times the orthonormal Walsh-Hadamard matrix in blocks of the largest power of two dividing dim, in
// place (model/kv_quant.py `rotate`: the same butterflies in the same order, the same bits).
void hadamard(float* x, int64_t dim) {
  const int64_t n = dim & -dim;
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (float* block = x; block < x + dim; block += n) {
    for (int64_t h = 1; h < n; h *= 2)
      for (int64_t i = 0; i < n; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          const float a = block[j], b = block[j + h];
          block[j] = a + b;
          block[j + h] = a - b;
        }
    for (int64_t i = 0; i < n; ++i) block[i] *= norm;
  }
}

// Each of `rows` rows' `heads` heads (dim floats each, rows `row_stride` floats apart) rotated in place: an int8
// pool holds rotated K/V, so attention over it takes rotated queries and gives the rotated output.
void hadamard_heads(float* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t dim) {
  over_rows(rows, heads * dim, [&](int64_t r) {
    for (int64_t h = 0; h < heads; ++h) hadamard(x + r * row_stride + h * dim, dim);
  });
}

// One head's `dim` floats, rotated, as an int8 row and its fp16 scale after them (model/kv_quant.py `quantize`,
// the same bits: the absmax / 127 rounded to fp16, each value divided by that, rounded half to even, clamped).
constexpr int64_t kMaxQuantizedDim = 512;
void store_quantized(int8_t* dst, const float* head, int64_t dim) {
  float src[kMaxQuantizedDim];  // check_step: dim fits
  std::copy(head, head + dim, src);
  hadamard(src, dim);
  float top = 0.0f;
  for (int64_t i = 0; i < dim; ++i) top = std::max(top, std::fabs(src[i]));
  const at::Half scale(std::clamp(top / 127.0f, 0x1p-24f, 65504.0f));
  const float s = static_cast<float>(scale);
  for (int64_t i = 0; i < dim; ++i) dst[i] = static_cast<int8_t>(std::clamp(std::nearbyint(src[i] / s), -127.0f, 127.0f));
  std::memcpy(dst + dim, &scale, sizeof(scale));
}

// A row's KV heads (`dim` floats each) into the pool at `dst`: int8 head by head with their scales, else at once.
template <typename T>
void store_heads(T* dst, const float* src, int64_t kv_heads, int64_t dim) {
  if constexpr (std::is_same_v<T, int8_t>) {
    for (int64_t h = 0; h < kv_heads; ++h) store_quantized(dst + h * (dim + kScaleBytes), src + h * dim, dim);
  } else {
    store(dst, src, kv_heads * dim);
  }
}

struct Shape {
  int64_t rows, heads, kv_heads, dim;
  int64_t width() const { return (heads + 2 * kv_heads) * dim; }  // a QKV row
};

// A tensor's floats, or nullptr where it is empty (an absent piece).
const float* optional_floats(const at::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

// Each of `heads` heads (dim floats apart) through RMSNorm in place: x / sqrt(mean(x^2) + eps) * weight.
void norm_heads(float* x, int64_t heads, int64_t dim, const float* weight, float eps) {
  for (int64_t h = 0; h < heads; ++h, x += dim) {
    const float inv = 1.0f / std::sqrt(sum_of_squares(x, dim) / static_cast<float>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) x[i] = x[i] * inv * weight[i];
  }
}

// What happens to a QKV row before its K and V are stored: its bias, the Q and K heads' norms, the rotary
// tables (cos, signed_sin [positions, rot]; rot < dim: partial rotary). Null pointers: the piece is absent.
struct QkvPrep {
  const float *bias, *q_norm, *k_norm, *cos, *signed_sin;
  int64_t rot;
  float eps;
};

// Every row's QKV prepared in place in `qkv` (QkvPrep, at the row's position), then K and V into the pool at
// the row's slot.
template <typename T>
void prepare_and_store(at::Tensor& qkv, const QkvPrep& p, at::Tensor& k_pool, at::Tensor& v_pool,
                       const int64_t* positions, const int64_t* slots, const Shape& s) {
  float* base = qkv.data_ptr<float>();
  T* k = k_pool.data_ptr<T>();
  T* v = v_pool.data_ptr<T>();
  const int64_t kv_row = s.kv_heads * k_pool.size(3);  // a token's heads in the pool (int8: with their scales)
  over_rows(s.rows, s.width(), [&](int64_t r) {
    float* row = base + r * s.width();
    if (p.bias)
      for (int64_t i = 0; i < s.width(); ++i) row[i] += p.bias[i];
    if (p.q_norm) norm_heads(row, s.heads, s.dim, p.q_norm, p.eps);
    if (p.k_norm) norm_heads(row + s.heads * s.dim, s.kv_heads, s.dim, p.k_norm, p.eps);
    rotate(row, s.heads + s.kv_heads, s.dim, p.rot, p.cos + positions[r] * p.rot, p.signed_sin + positions[r] * p.rot);
    store_heads(k + slots[r] * kv_row, row + s.heads * s.dim, s.kv_heads, s.dim);
    store_heads(v + slots[r] * kv_row, row + (s.heads + s.kv_heads) * s.dim, s.kv_heads, s.dim);
  });
}

void prepare_and_store(at::Tensor& qkv, const QkvPrep& p, at::Tensor k_pool, at::Tensor v_pool,
                       const int64_t* positions, const int64_t* slots, const Shape& s) {
  with_pool_type(k_pool, [&](auto element) {
    prepare_and_store<decltype(element)>(qkv, p, k_pool, v_pool, positions, slots, s);
  });
}

// silu(g) = g / (1 + e^-g), from e^-|g| <= 1 on both sides (exp8 takes x <= 0): g e^g / (1 + e^g) below 0.
inline __m256 silu8(__m256 g) {
  const __m256 e = exp8(_mm256_or_ps(g, _mm256_set1_ps(-0.f)));  // e^-|g|
  const __m256 numerator = _mm256_blendv_ps(_mm256_mul_ps(g, e), g, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
  return _mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// [rows, 2I] gate|up -> `out` [rows, I]: act(gate) * up, eight lanes at a time (`act8`), the tail by `act`.
template <typename Act8, typename Act>
void act_times_up(const at::Tensor& gate_up, at::Tensor& out, Act8 act8, Act act) {
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  over_rows(rows, n, [&](int64_t r) {
    const float* gate = src + r * 2 * n;
    const float* up = gate + n;
    float* o = dst + r * n;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(o + i, _mm256_mul_ps(act8(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
    for (; i < n; ++i) o[i] = act(gate[i]) * up[i];
  });
}

// SwiGLU: silu(gate) * up.
void silu_times_up(const at::Tensor& gate_up, at::Tensor& out) {
  act_times_up(gate_up, out, [](__m256 g) { return silu8(g); }, [](float g) { return g / (1.0f + std::exp(-g)); });
}

// gelu_tanh(g) = g / 2 (1 + tanh(u)) = g sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3); the sigmoid from
// e^-|2u| <= 1 on both sides, as silu8 (exp8 takes x <= 0).
inline __m256 gelu8(__m256 g) {
  const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 two_u = _mm256_mul_ps(_mm256_set1_ps(1.5957691216f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
  const __m256 e = exp8(_mm256_or_ps(two_u, _mm256_set1_ps(-0.f)));  // e^-|2u|
  const __m256 numerator = _mm256_blendv_ps(_mm256_mul_ps(g, e), g, _mm256_cmp_ps(two_u, _mm256_setzero_ps(), _CMP_GE_OQ));
  return _mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// GeGLU: gelu_tanh(gate) * up.
void gelu_times_up(const at::Tensor& gate_up, at::Tensor& out) {
  act_times_up(gate_up, out, [](__m256 g) { return gelu8(g); }, [](float g) {
    return 0.5f * g * (1.0f + std::tanh(0.7978845608f * (g + 0.044715f * g * g * g)));
  });
}

// bias [n] added to every row of x [rows, n].
void add_bias(at::Tensor& x, const float* bias) {
  float* dst = x.data_ptr<float>();
  const int64_t n = x.size(1);
  over_rows(x.size(0), n, [&](int64_t r) {
    for (int64_t i = 0; i < n; ++i) dst[r * n + i] += bias[i];
  });
}

void add_into(at::Tensor& x, const at::Tensor& y) {
  float* dst = x.data_ptr<float>();
  const float* src = y.data_ptr<float>();
  const int64_t n = x.size(1);
  over_rows(x.size(0), n, [&](int64_t r) {
    for (int64_t i = 0; i < n; ++i) dst[r * n + i] += src[r * n + i];
  });
}

void check_norm(const at::Tensor& norm, int64_t hidden, const char* which) {
  TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() && norm.numel() == hidden,
              which, " norm weights must be contiguous fp32 [", hidden, "], got ", norm.sizes(), " ", norm.scalar_type());
}

// A layer's products' output sizes (a weight's first dimension in every kernel's format): QKV the fused heads'
// width, O and down the hidden size, gate/up `gate_up` (even, shared by every dense layer). Their input sizes are
// the kernels' own checks. A MoE layer's MLP products are its experts' (check_moe).
void check_product_rows(at::TensorList weights, at::IntArrayRef kinds, int64_t layer, int64_t hidden,
                        int64_t qkv_width, int64_t gate_up, bool moe) {
  const at::Tensor* w = &weights[kWeightsPerLayer * layer];
  const int64_t* kind = &kinds[kProductsPerLayer * layer];
  const std::pair<int64_t, int64_t> expected[] = {{1, qkv_width}, {2, hidden}, {4, gate_up}, {5, hidden}};
  for (size_t i = 0; i < (moe ? 2 : 4); ++i) {
    const auto [index, rows] = expected[i];
    TORCH_CHECK(product_rows(w[index], kind[i]) == rows && rows > 0 && (index != 4 || rows % 2 == 0),
                "layer ", layer, ": product weight ", index, " must have ", rows, " output rows, got ",
                w[index].sizes());
  }
}

// A [rows] contiguous int64 tensor whose every value lies in [0, limit): positions in the rotary tables, slots in
// the pool (a wrong one must be an error, not an access outside them).
void check_indices(const at::Tensor& t, int64_t rows, int64_t limit, const char* what, const char* within,
                   const char* unit) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == rows && t.scalar_type() == at::kLong && t.is_contiguous(),
              what, "s must be contiguous int64 [rows], got ", t.sizes(), " ", t.scalar_type());
  const int64_t* v = t.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(v[r] >= 0 && v[r] < limit, "row ", r, ": ", what, " ", v[r], " outside the ", within, " ", limit, " ",
                unit);
}

// Rotary tables: contiguous fp32 [positions, rot] of one shape, rot even and at most the head dim.
void check_tables(const at::Tensor& cos, const at::Tensor& signed_sin, int64_t dim, const char* which) {
  for (const at::Tensor* t : {&cos, &signed_sin})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(1) <= dim &&
                    t->size(1) % 2 == 0 && t->size(1) > 0 && t->sizes() == cos.sizes(),
                which, " rotary tables must be contiguous fp32 [positions, rot] of one shape with rot even and at most ",
                "the head dim ", dim, ", got ", t->sizes(), " and ", cos.sizes());
}

// The optional pieces: none, or per layer kPiecesPerLayer tensors, each empty or contiguous fp32 of its size (the
// scales: check_scales); the local layers' indices, with the local tables (of the global ones' shape) where any
// layer is local.
void check_pieces(at::TensorList pieces, at::TensorList local_rope, at::IntArrayRef local_layers, int64_t layers,
                  const at::Tensor& cos, int64_t hidden, const Shape& s) {
  TORCH_CHECK(pieces.empty() || static_cast<int64_t>(pieces.size()) == kPiecesPerLayer * layers,
              "pieces: none or ", kPiecesPerLayer, " per layer (empty tensors where absent), got ", pieces.size());
  const int64_t sizes[kFirstScale] = {s.width(), hidden, s.dim, s.dim, hidden, hidden};
  for (size_t i = 0; i < pieces.size(); ++i) {
    const at::Tensor& t = pieces[i];
    if (i % kPiecesPerLayer >= kFirstScale) continue;
    TORCH_CHECK(t.numel() == 0 || (t.scalar_type() == at::kFloat && t.is_contiguous() &&
                                   t.numel() == sizes[i % kPiecesPerLayer]),
                "layer ", i / kPiecesPerLayer, ": piece ", i % kPiecesPerLayer, " must be empty or contiguous fp32 [",
                sizes[i % kPiecesPerLayer], "], got ", t.sizes(), " ", t.scalar_type());
  }
  for (int64_t l : local_layers) TORCH_CHECK(l >= 0 && l < layers, "local layer ", l, " outside the ", layers, " layers");
  TORCH_CHECK(local_layers.empty() || local_rope.size() == 2, "local layers need the local cos and signed sin tables");
  if (local_rope.size() == 2) {
    check_tables(local_rope[0], local_rope[1], s.dim, "local");
    TORCH_CHECK(local_rope[0].sizes() == cos.sizes(), "the local rotary tables must be the global ones' shape ",
                cos.sizes(), ", got ", local_rope[0].sizes());
  }
}

// The mixture-of-experts layers (none in a dense model): their indices, ascending; every MoE layer's experts'
// weights in `experts`, E gate/up weights then E down weights, layer after layer; each row's top_k experts,
// their weights renormalised to sum to 1 where asked. A MoE layer's weight slot 4 holds its router (fp32
// [E, hidden], run on our fp32 kernel), slot 5 nothing, and its kinds 2 and 3 are its experts' gate/up and down.
// `expert_scales`: none, or one per expert weight in the same order, empty where that product's weight is not
// int8 (takes_scales).
// One MoE layer's experts: `count` gate/up weights and as many down weights, their products' kinds, and their
// int8 scales (null: none given).
struct MoeExperts {
  const at::Tensor* gate_ups;
  const at::Tensor* downs;
  int64_t count, gate_up_kind, down_kind;
  const at::Tensor* gate_up_scales = nullptr;
  const at::Tensor* down_scales = nullptr;
};

struct Moe {
  at::IntArrayRef layers;
  at::TensorList experts, expert_scales;
  int64_t top_k;
  bool renormalize;

  int64_t per_layer() const { return layers.empty() ? 0 : static_cast<int64_t>(experts.size() / (2 * layers.size())); }
  int64_t index_of(int64_t layer) const {
    const auto at = std::find(layers.begin(), layers.end(), layer);
    return at == layers.end() ? -1 : at - layers.begin();
  }
  // the experts of the `index`th MoE layer, whose kinds are `kind` (its four products' kinds)
  MoeExperts of(int64_t index, const int64_t* kind) const {
    const int64_t first = 2 * per_layer() * index;
    const at::Tensor* scales = expert_scales.empty() ? nullptr : &expert_scales[first];
    return {&experts[first], &experts[first + per_layer()], per_layer(), kind[2], kind[3], scales,
            scales ? scales + per_layer() : nullptr};
  }
};

// The dense layers' gate/up output rows (the first dense layer's; 0 where every layer is MoE).
int64_t dense_gate_up_rows(at::TensorList weights, at::IntArrayRef kinds, const Moe& moe) {
  for (int64_t l = 0; l < static_cast<int64_t>(weights.size()) / kWeightsPerLayer; ++l)
    if (moe.index_of(l) < 0) return product_rows(weights[kWeightsPerLayer * l + 4], kinds[kProductsPerLayer * l + 2]);
  return 0;
}

// The experts' gate/up output rows (2I, shared by every expert of every MoE layer).
int64_t expert_gate_up_rows(const MoeExperts& e) { return product_rows(e.gate_ups[0], e.gate_up_kind); }

// The same for a step's MoE layers (their first one's: check_moe holds the others to it).
int64_t expert_gate_up_rows(const Moe& moe, at::IntArrayRef kinds) {
  return expert_gate_up_rows(moe.of(0, &kinds[kProductsPerLayer * moe.layers[0]]));
}

// An expert product's int8 scales: given (non-empty) exactly where its kind takes them, and then its weight's.
void check_expert_scales(const at::Tensor* scales, const at::Tensor& weight, int64_t kind, int64_t inputs,
                         int64_t layer, int64_t expert, const char* which) {
  const bool given = scales && scales->numel() > 0;
  TORCH_CHECK(given == takes_scales(kind), "layer ", layer, ", expert ", expert, ": ", which,
              given ? " has scales but not an int8 weight" : "'s int8 weight needs its scales");
  if (given) check_i8_weight(weight, *scales, inputs);
}

// A MoE layer's router (contiguous fp32 [E, hidden]) and experts: every gate/up `gate_up` rows (even), every down
// `hidden`, int8 weights with their scales, and top_k within the E experts.
void check_moe_layer(const at::Tensor& router, const MoeExperts& e, int64_t hidden, int64_t gate_up, int64_t top_k,
                     int64_t layer) {
  TORCH_CHECK(e.count >= 1 && top_k >= 1 && top_k <= e.count, "top_k must be within 1..", e.count, ", got ", top_k);
  TORCH_CHECK(gate_up > 0 && gate_up % 2 == 0, "an expert's gate/up must have an even number of output rows");
  TORCH_CHECK(router.dim() == 2 && router.size(0) == e.count && router.size(1) == hidden &&
                  router.scalar_type() == at::kFloat && router.is_contiguous(),
              "layer ", layer, ": the router must be contiguous fp32 [", e.count, ", ", hidden, "], got ",
              router.sizes());
  for (int64_t i = 0; i < e.count; ++i) {
    TORCH_CHECK(product_rows(e.gate_ups[i], e.gate_up_kind) == gate_up && product_rows(e.downs[i], e.down_kind) == hidden,
                "layer ", layer, ", expert ", i, ": gate/up must have ", gate_up, " output rows and down ", hidden);
    check_expert_scales(e.gate_up_scales ? &e.gate_up_scales[i] : nullptr, e.gate_ups[i], e.gate_up_kind, hidden,
                        layer, i, "gate/up");
    check_expert_scales(e.down_scales ? &e.down_scales[i] : nullptr, e.downs[i], e.down_kind, gate_up / 2, layer, i,
                        "down");
  }
}

// The MoE layers: their experts' count and order, and each layer's router and experts (one gate/up size for all:
// the buffers are shared).
void check_moe(at::TensorList weights, at::IntArrayRef kinds, const Moe& moe, int64_t layers, int64_t hidden) {
  TORCH_CHECK(!moe.layers.empty() || moe.experts.empty(), "experts given without MoE layers");
  if (moe.layers.empty()) return;
  const int64_t count = moe.per_layer();
  TORCH_CHECK(count >= 1 && static_cast<int64_t>(moe.experts.size()) == 2 * count * static_cast<int64_t>(moe.layers.size()),
              "experts: 2 x E weights per MoE layer, got ", moe.experts.size(), " for ", moe.layers.size(), " layers");
  TORCH_CHECK(moe.expert_scales.empty() || moe.expert_scales.size() == moe.experts.size(),
              "expert scales: none or one per expert weight (", moe.experts.size(), "), got ", moe.expert_scales.size());
  const int64_t gate_up = expert_gate_up_rows(moe, kinds);
  for (size_t i = 0; i < moe.layers.size(); ++i) {
    const int64_t l = moe.layers[i];
    TORCH_CHECK(l >= 0 && l < layers && (i == 0 || l > moe.layers[i - 1]), "MoE layers must ascend within the ",
                layers, " layers, got ", l);
    check_moe_layer(weights[kWeightsPerLayer * l + 4], moe.of(static_cast<int64_t>(i), &kinds[kProductsPerLayer * l]),
                    hidden, gate_up, moe.top_k, l);
  }
}

// Each product of an int8 weight (takes_scales) has its scales among the pieces, per row or per block of its
// input size (check_i8_weight); every other product has none. A MoE layer's MLP products are its experts', whose
// scales come apart (check_moe_layer).
void check_scales(at::TensorList weights, at::IntArrayRef kinds, at::TensorList pieces, const Moe& moe, int64_t layers,
                  int64_t hidden, const Shape& s, int64_t gate_up) {
  const int64_t slots[kProductsPerLayer] = {1, 2, 4, 5}, inputs[kProductsPerLayer] = {hidden, s.heads * s.dim, hidden, gate_up / 2};
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t i = 0; i < (moe.index_of(l) >= 0 ? 2 : kProductsPerLayer); ++i) {
      const at::Tensor* scale = pieces.empty() ? nullptr : &pieces[kPiecesPerLayer * l + kFirstScale + i];
      const bool given = scale && scale->numel() > 0;
      TORCH_CHECK(given == takes_scales(kinds[kProductsPerLayer * l + i]), "layer ", l, ": product ", i,
                  given ? " has scales but not an int8 weight" : "'s int8 weight needs its scales among the pieces");
      if (given) check_i8_weight(weights[kWeightsPerLayer * l + slots[i]], *scale, inputs[i]);
    }
}

void check_step(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& signed_sin,
                at::TensorList weights, at::TensorList k_pools, at::TensorList v_pools, const at::Tensor& slots,
                at::IntArrayRef kinds, int64_t heads, const std::optional<at::Tensor>& final_norm, const Moe& moe) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "expected contiguous fp32 hidden states [rows, hidden], got ", x.sizes(), " ", x.scalar_type());
  const int64_t layers = static_cast<int64_t>(k_pools.size()), rows = x.size(0);
  TORCH_CHECK(layers >= 1 && v_pools.size() == k_pools.size() &&
              static_cast<int64_t>(weights.size()) == kWeightsPerLayer * layers &&
              static_cast<int64_t>(kinds.size()) == kProductsPerLayer * layers,
              "per layer: a K and a V pool, ", kWeightsPerLayer, " weights and ", kProductsPerLayer,
              " product kinds; got ", k_pools.size(), " / ", v_pools.size(), " / ", weights.size(), " / ",
              kinds.size());
  const at::Tensor& pool = k_pools[0];
  TORCH_CHECK(pool.dim() == 4 && heads % pool.size(2) == 0 && pool_head_dim(pool) % 2 == 0,
              "pools must be [blocks, block_size, kv_heads, dim] with ", heads,
              " query heads a multiple of the KV heads and an even head dim, got ", pool.sizes());
  TORCH_CHECK(pool.scalar_type() != at::kChar || pool_head_dim(pool) <= kMaxQuantizedDim,
              "an int8 KV pool's head dim must be at most ", kMaxQuantizedDim, ", got ", pool_head_dim(pool));
  for (int64_t kind : kinds) check_kind(kind);
  check_tables(cos, signed_sin, pool_head_dim(pool), "the");
  check_indices(positions, rows, cos.size(0), "position", "rotary tables'", "positions");
  check_indices(slots, rows, pool.size(0) * pool.size(1), "slot", "pool's", "slots");
  const int64_t gate_up = dense_gate_up_rows(weights, kinds, moe);
  for (int64_t l = 0; l < layers; ++l) {
    TORCH_CHECK(k_pools[l].sizes() == pool.sizes() && v_pools[l].sizes() == pool.sizes() &&
                k_pools[l].scalar_type() == pool.scalar_type() && v_pools[l].scalar_type() == pool.scalar_type() &&
                k_pools[l].is_contiguous() && v_pools[l].is_contiguous(),
                "layer ", l, ": every K and V pool must be contiguous and of one shape and dtype");
    for (int64_t i : {0, 3}) check_norm(weights[kWeightsPerLayer * l + i], x.size(1), "a layer's");
    check_product_rows(weights, kinds, l, x.size(1), (heads + 2 * pool.size(2)) * pool_head_dim(pool), gate_up,
                       moe.index_of(l) >= 0);
  }
  check_moe(weights, kinds, moe, layers, x.size(1));
  if (final_norm) check_norm(*final_norm, x.size(1), "the final");
}

// Where the call's time goes, on request (`bench profile`): wall time around each part of every layer, summed
// over calls until read (`decode_part_times`). Off, a part costs a relaxed load and a branch. The engine calls
// the step from one thread, which alone adds to the sums.
enum Part : int { kProducts, kAttention, kRotaryStore, kNormsResiduals, kSiluUp, kAllReduce, kWholeCall, kParts };
std::atomic<bool> timing_parts{false};
double part_seconds[kParts] = {};
int64_t timed_calls = 0;

template <typename F>
void timed(Part part, F&& f) {
  if (!timing_parts.load(std::memory_order_relaxed)) return f();
  const auto start = std::chrono::steady_clock::now();
  f();
  part_seconds[part] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void decode_part_timing(bool on) { timing_parts = on; }

// Seconds per part (Part's order, the whole call last) and the timed calls since the last read; then zeros.
std::vector<double> decode_part_times() {
  std::vector<double> times(part_seconds, part_seconds + kParts);
  times.push_back(static_cast<double>(timed_calls));
  std::fill(part_seconds, part_seconds + kParts, 0.0);
  timed_calls = 0;
  return times;
}

// One step's intermediate values, allocated once a call and reused by every layer (allocating them per
// layer was ~10 tensors a layer, ~300 a step: ~0.3-0.5 us each, and as many views).
struct Buffers {
  at::Tensor normed, qkv, queries, attention, attention_rows, projected, gate_up, activated;

  Buffers(const at::Tensor& x, const Shape& s, int64_t intermediate)
      : normed(at::empty_like(x)),
        qkv(at::empty({s.rows, s.width()}, x.options())),
        queries(qkv.view({s.rows, s.heads + 2 * s.kv_heads, s.dim}).narrow(1, 0, s.heads)),
        attention(at::empty({s.rows, s.heads, s.dim}, x.options())),
        attention_rows(attention.view({s.rows, s.heads * s.dim})),
        projected(at::empty_like(x)),
        gate_up(at::empty({s.rows, 2 * intermediate}, x.options())),
        activated(at::empty({s.rows, intermediate}, x.options())) {}
};

// A MoE layer's working rows: router logits, then per (row, slot) choice, grouped by expert, the row an expert
// runs on, its gate/up, activation and output (each expert its own rows, so experts may run at once).
struct MoeBuffers {
  at::Tensor logits, rows, gate_up, activated, out;

  MoeBuffers(const at::Tensor& x, int64_t experts, int64_t gate_up_rows, int64_t top_k)
      : logits(at::empty({x.size(0), experts}, x.options())),
        rows(at::empty({x.size(0) * top_k, x.size(1)}, x.options())),
        gate_up(at::empty({x.size(0) * top_k, gate_up_rows}, x.options())),
        activated(at::empty({x.size(0) * top_k, gate_up_rows / 2}, x.options())),
        out(at::empty({x.size(0) * top_k, x.size(1)}, x.options())) {}
};

// Each row's top-k experts (`chosen`) and weights from its router logits: a softmax over all experts in fp32, the
// k largest (the lower expert first among equals), renormalised to sum to 1 where asked (model/moe.py's `route`).
void route_rows(const at::Tensor& logits, int64_t top_k, bool renormalize, std::vector<int64_t>& chosen,
                std::vector<float>& weight) {
  const int64_t rows = logits.size(0), experts = logits.size(1);
  const float* src = logits.data_ptr<float>();
  chosen.resize(rows * top_k), weight.resize(rows * top_k);
  std::vector<float> probs(experts);
  std::vector<int64_t> order(experts);
  for (int64_t r = 0; r < rows; ++r) {
    const float* l = src + r * experts;
    const float peak = *std::max_element(l, l + experts);
    float sum = 0.f;
    for (int64_t e = 0; e < experts; ++e) sum += probs[e] = std::exp(l[e] - peak);
    for (int64_t e = 0; e < experts; ++e) probs[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
    float total = 0.f;
    for (int64_t j = 0; j < top_k; ++j) total += probs[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      chosen[r * top_k + j] = order[j];
      weight[r * top_k + j] = renormalize ? probs[order[j]] / total : probs[order[j]];
    }
  }
}

// Expert `e`'s int8 scales among `scales` (none: null, or empty where its weight is not int8).
const at::Tensor* scale_of(const at::Tensor* scales, int64_t e) {
  return scales && scales[e].numel() > 0 ? &scales[e] : nullptr;
}

// Expert `e`'s gated MLP on its `n` rows, which start at row `first` of the buffers' (b.rows -> b.out).
void run_expert(const MoeExperts& experts, int64_t e, int64_t first, int64_t n, bool gelu, MoeBuffers& b) {
  at::Tensor rows = b.rows.narrow(0, first, n), gate_up = b.gate_up.narrow(0, first, n);
  at::Tensor activated = b.activated.narrow(0, first, n), expert_out = b.out.narrow(0, first, n);
  product(rows, experts.gate_ups[e], experts.gate_up_kind, gate_up, scale_of(experts.gate_up_scales, e));
  gelu ? gelu_times_up(gate_up, activated) : silu_times_up(gate_up, activated);
  product(activated, experts.downs[e], experts.down_kind, expert_out, scale_of(experts.down_scales, e));
}

// The chosen experts' MLPs (`active`; `starts`: where each expert's rows begin). Where there are at least two
// experts a thread, each thread takes whole experts, the next one free (the kernels' own loops then run on that
// thread alone), against 16 small products each split over the threads and joined for a lone decode row's 8
// experts (paired A/B, Qwen3-30B-A3B's experts in Q4_K_M, 2 threads: 0.77-0.95x the time at 1 row, 0.82-0.91x at
// 8, 0.82x at 32). Else expert by expert, each product over every thread. The bits are the same either way: each
// output is one thread's whole sum.
void run_experts(const MoeExperts& experts, const std::vector<int64_t>& active, const std::vector<int64_t>& starts,
                 bool gelu, MoeBuffers& b) {
  const int64_t count = static_cast<int64_t>(active.size()), threads = at::get_num_threads();
  const auto one = [&](int64_t i) {
    const int64_t e = active[i];
    run_expert(experts, e, starts[e], starts[e + 1] - starts[e], gelu, b);
  };
  if (threads == 1 || count < 2 * threads || at::in_parallel_region()) {
    for (int64_t i = 0; i < count; ++i) one(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t i = next++; i < count; i = next++) one(i);
  });
}

// The MoE MLP of `normed` into `out`: per row the weighted sum of its chosen experts' gated MLPs. Each chosen
// expert runs its two products once, on every row that chose it (its weights read once a step), and the results
// are added experts in order and rows in order within one, as model/moe.py's grouped product adds them. Returns
// the experts that ran. Part timing counts the experts' SiLU with their products (they may run at once).
int64_t moe_mlp(const at::Tensor& normed, const at::Tensor& router, const MoeExperts& experts, int64_t top_k,
                bool renormalize, bool gelu, MoeBuffers& b, at::Tensor& out) {
  const int64_t hidden = normed.size(1);
  timed(kProducts, [&] { fp32_linear_into(normed, router, b.logits); });
  static thread_local std::vector<int64_t> chosen, starts, next, slots;
  static thread_local std::vector<float> weight;
  route_rows(b.logits, top_k, renormalize, chosen, weight);
  // the (row, slot) choices grouped by expert, rows ascending within one: a counting sort
  starts.assign(experts.count + 1, 0);
  for (int64_t e : chosen) ++starts[e + 1];
  std::partial_sum(starts.begin(), starts.end(), starts.begin());
  next.assign(starts.begin(), starts.end() - 1);
  slots.resize(chosen.size());
  for (size_t i = 0; i < chosen.size(); ++i) slots[next[chosen[i]]++] = static_cast<int64_t>(i);
  const float* x = normed.data_ptr<float>();
  float* rows = b.rows.data_ptr<float>();
  for (size_t i = 0; i < slots.size(); ++i) std::memcpy(rows + i * hidden, x + slots[i] / top_k * hidden, hidden * 4);
  static thread_local std::vector<int64_t> active;
  active.clear();
  for (int64_t e = 0; e < experts.count; ++e)
    if (starts[e + 1] > starts[e]) active.push_back(e);
  timed(kProducts, [&] { run_experts(experts, active, starts, gelu, b); });
  out.zero_();
  float* o = out.data_ptr<float>();
  const float* y = b.out.data_ptr<float>();
  for (size_t i = 0; i < slots.size(); ++i)  // slots: grouped by expert, experts in order
    for (int64_t j = 0; j < hidden; ++j) o[slots[i] / top_k * hidden + j] += y[i * hidden + j] * weight[slots[i]];
  return static_cast<int64_t>(active.size());
}

// A layer's family pieces (Piece's order; null: absent), its rotary tables and the MLP's activation.
struct LayerPieces {
  const float* piece[kFirstScale] = {};
  const at::Tensor* scale[kProductsPerLayer] = {};  // the products' int8 scales (null: not int8)
  QkvPrep prep;
  bool gelu;
};

LayerPieces layer_pieces(at::TensorList pieces, int64_t layer, const at::Tensor& cos, const at::Tensor& signed_sin,
                         float eps, bool gelu) {
  LayerPieces p{};
  if (!pieces.empty()) {
    const at::Tensor* own = &pieces[kPiecesPerLayer * layer];
    for (int64_t i = 0; i < kFirstScale; ++i) p.piece[i] = optional_floats(own[i]);
    for (int64_t i = 0; i < kProductsPerLayer; ++i) p.scale[i] = own[kFirstScale + i].numel() ? &own[kFirstScale + i] : nullptr;
  }
  p.prep = {p.piece[kQkvBias], p.piece[kQNorm], p.piece[kKNorm], cos.data_ptr<float>(), signed_sin.data_ptr<float>(),
            cos.size(1), eps};
  p.gelu = gelu;
  return p;
}

// Tensor parallelism: the ranks' shared segment (shm_collectives.cpp) and this rank's place; none: one rank.
struct TPRanks {
  const std::optional<at::Tensor>& shm;
  int64_t rank, world;

  // A row-parallel product's partial sums, summed over the ranks in place.
  void all_reduce(at::Tensor& partial) const {
    if (shm) timed(kAllReduce, [&] { shm_all_reduce_into(partial.data_ptr<float>(), partial.numel(), *shm, rank, world); });
  }
};

// `out` = x through RMSNorm where the norm is given (a sandwich norm), else x itself.
const at::Tensor& maybe_norm(const at::Tensor& x, const float* norm, float eps, at::Tensor& out) {
  if (!norm) return x;
  rms_norm(x, norm, eps, out);
  return out;
}

// The decoder layers of a decode step: x [rows, hidden] (one token per sequence) -> x after every layer,
// then through `final_norm` where given (its weight; the layers' eps).
// weights: per layer [input norm, QKV, O, post-attention norm, gate/up, down], the products' weights as
// their kernels take them; kinds: per layer and product, its ProductKind.
// cos / signed_sin: the model's whole rotary tables [positions, rot], read at each row's position (a
// lookup in Python was two indexing calls a step); local_rope: the `local_layers`' own pair, or none.
// pieces: none, or per layer its Piece tensors (empty where absent; int8 weights' scales among them); gelu: GeGLU, not SwiGLU; softcap: attention
// scores capped through tanh (Gemma 2; 0: none); window: sliding-window attention over that many keys (0: none).
// moe: the mixture-of-experts layers (Moe: their router in weight slot 4); touched: where given, each MoE layer's
// count of experts that ran. tp: under tensor parallelism the O and down products' outputs are all-reduced before their bias and norm.
at::Tensor run_layers(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& signed_sin, at::TensorList weights, at::TensorList k_pools,
                      at::TensorList v_pools, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, at::IntArrayRef kinds, int64_t heads, double eps,
                      double scale, const std::optional<at::Tensor>& final_norm, at::TensorList pieces,
                      at::TensorList local_rope, at::IntArrayRef local_layers, bool gelu, double softcap,
                      int64_t window, const Moe& moe, const std::optional<at::Tensor>& touched, const TPRanks& tp) {
  check_step(x, positions, cos, signed_sin, weights, k_pools, v_pools, slot_mapping, kinds, heads, final_norm, moe);
  TORCH_CHECK(!touched || (touched->scalar_type() == at::kLong && touched->is_contiguous() &&
                           touched->numel() == static_cast<int64_t>(moe.layers.size())),
              "touched must be contiguous int64 [MoE layers], got ", touched ? touched->sizes() : at::IntArrayRef{});
  const Shape s{x.size(0), heads, k_pools[0].size(2), pool_head_dim(k_pools[0])};
  check_pieces(pieces, local_rope, local_layers, static_cast<int64_t>(k_pools.size()), cos, x.size(1), s);
  check_scales(weights, kinds, pieces, moe, static_cast<int64_t>(k_pools.size()), x.size(1), s,
               dense_gate_up_rows(weights, kinds, moe));
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t* position = positions.data_ptr<int64_t>();
  Buffers b(x, s, dense_gate_up_rows(weights, kinds, moe) / 2);  // gate/up: 2I rows (check_step)
  std::optional<MoeBuffers> moe_buffers;
  if (!moe.layers.empty()) moe_buffers.emplace(x, moe.per_layer(), expert_gate_up_rows(moe, kinds), moe.top_k);
  // every layer's pools have one shape (check_step): the tables and lengths are checked against them once
  check_decode_attention(b.queries, k_pools[0], v_pools[0], block_tables, context_lens);
  at::Tensor hidden = x.clone();  // the residual stream, updated in place
  const bool quantized = k_pools[0].scalar_type() == at::kChar;  // rotated rows (hadamard_heads)
  for (size_t l = 0; l < k_pools.size(); ++l) {
    const at::Tensor* w = &weights[kWeightsPerLayer * l];
    const int64_t* kind = &kinds[kProductsPerLayer * l];
    const bool local = std::find(local_layers.begin(), local_layers.end(), static_cast<int64_t>(l)) != local_layers.end();
    const LayerPieces p = layer_pieces(pieces, static_cast<int64_t>(l), local ? local_rope[0] : cos,
                                       local ? local_rope[1] : signed_sin, static_cast<float>(eps), gelu);
    timed(kNormsResiduals, [&] { rms_norm(hidden, w[0], eps, b.normed); });
    timed(kProducts, [&] { product(b.normed, w[1], kind[0], b.qkv, p.scale[0]); });
    timed(kRotaryStore, [&] { prepare_and_store(b.qkv, p.prep, k_pools[l], v_pools[l], position, slots, s); });
    timed(kAttention, [&] {
      if (quantized) hadamard_heads(b.qkv.data_ptr<float>(), s.rows, s.width(), s.heads, s.dim);
      paged_decode_attention_into(b.queries, k_pools[l], v_pools[l], block_tables, context_lens, scale, b.attention,
                                  softcap, window);
      if (quantized) hadamard_heads(b.attention.data_ptr<float>(), s.rows, s.heads * s.dim, s.heads, s.dim);
    });
    timed(kProducts, [&] { product(b.attention_rows, w[2], kind[1], b.projected, p.scale[1]); });
    tp.all_reduce(b.projected);
    timed(kNormsResiduals, [&] {
      if (p.piece[kOBias]) add_bias(b.projected, p.piece[kOBias]);
      add_into(hidden, maybe_norm(b.projected, p.piece[kAttnOutNorm], eps, b.normed));
      rms_norm(hidden, w[3], eps, b.normed);
    });
    const int64_t moe_index = moe.index_of(static_cast<int64_t>(l));
    if (moe_index >= 0) {
      const int64_t ran = moe_mlp(b.normed, w[4], moe.of(moe_index, kind), moe.top_k, moe.renormalize, p.gelu,
                                  *moe_buffers, b.projected);
      if (touched) touched->data_ptr<int64_t>()[moe_index] = ran;
    } else {
      timed(kProducts, [&] { product(b.normed, w[4], kind[2], b.gate_up, p.scale[2]); });
      timed(kSiluUp, [&] { p.gelu ? gelu_times_up(b.gate_up, b.activated) : silu_times_up(b.gate_up, b.activated); });
      timed(kProducts, [&] { product(b.activated, w[5], kind[3], b.projected, p.scale[3]); });
    }
    tp.all_reduce(b.projected);
    timed(kNormsResiduals, [&] { add_into(hidden, maybe_norm(b.projected, p.piece[kMlpOutNorm], eps, b.normed)); });
  }
  if (!final_norm) return hidden;
  // the model's final norm here too: eagerly, alone, it took ~0.2 ms of a one-sequence step
  rms_norm(hidden, *final_norm, eps, b.normed);
  return b.normed;
}

// The operator: run_layers, timed as a whole call when part timing is on.
at::Tensor decode_layers(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& signed_sin, at::TensorList weights, at::TensorList k_pools,
                         at::TensorList v_pools, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, at::IntArrayRef kinds, int64_t heads, double eps,
                         double scale, const std::optional<at::Tensor>& final_norm, at::TensorList pieces,
                         at::TensorList local_rope, at::IntArrayRef local_layers, bool gelu, double softcap,
                         int64_t window, at::TensorList experts, at::TensorList expert_scales,
                         at::IntArrayRef moe_layers, int64_t top_k,
                         bool renormalize, const std::optional<at::Tensor>& touched,
                         const std::optional<at::Tensor>& tp_shm, int64_t tp_rank, int64_t tp_world) {
  at::Tensor out;
  timed(kWholeCall, [&] {
    out = run_layers(x, positions, cos, signed_sin, weights, k_pools, v_pools, slot_mapping, block_tables,
                     context_lens, kinds, heads, eps, scale, final_norm, pieces, local_rope, local_layers, gelu,
                     softcap, window, Moe{moe_layers, experts, expert_scales, top_k, renormalize}, touched,
                     TPRanks{tp_shm, tp_rank, tp_world});
  });
  if (timing_parts.load(std::memory_order_relaxed)) ++timed_calls;
  return out;
}

// A MoE layer's MLP alone (model/moe.py's eager layers, prefill chunks included): x [rows, hidden] ->
// (the weighted sum of each row's chosen experts, how many experts ran); the experts' products of kinds
// `kinds` (gate/up, down: ProductKind), their int8 scales (none, or one per weight: empty where not int8), the
// router on our fp32 kernel.
std::tuple<at::Tensor, int64_t> moe_experts(const at::Tensor& x, const at::Tensor& router, at::TensorList gate_ups,
                                            at::TensorList downs, at::TensorList gate_up_scales,
                                            at::TensorList down_scales, at::IntArrayRef kinds, int64_t top_k,
                                            bool renormalize, bool gelu) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(0) > 0,
              "expected contiguous fp32 rows [rows, hidden], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(kinds.size() == 2 && !gate_ups.empty() && gate_ups.size() == downs.size(),
              "kinds: gate/up and down; one down per gate/up");
  for (int64_t kind : kinds) check_kind(kind);
  for (const at::TensorList& scales : {gate_up_scales, down_scales})
    TORCH_CHECK(scales.empty() || scales.size() == gate_ups.size(), "expert scales: none or one per expert (",
                gate_ups.size(), "), got ", scales.size());
  const MoeExperts experts{gate_ups.data(), downs.data(), static_cast<int64_t>(gate_ups.size()), kinds[0], kinds[1],
                           gate_up_scales.empty() ? nullptr : gate_up_scales.data(),
                           down_scales.empty() ? nullptr : down_scales.data()};
  const int64_t gate_up = expert_gate_up_rows(experts);
  check_moe_layer(router, experts, x.size(1), gate_up, top_k, 0);
  MoeBuffers b(x, experts.count, gate_up, top_k);
  at::Tensor out = at::empty_like(x);
  const int64_t ran = moe_mlp(x, router, experts, top_k, renormalize, gelu, b, out);
  return {out, ran};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_native, m) {
  m.def("moe_experts(Tensor x, Tensor router, Tensor[] gate_ups, Tensor[] downs, Tensor[] gate_up_scales, "
        "Tensor[] down_scales, int[] kinds, int top_k, bool renormalize, bool gelu) -> (Tensor, int)");
  m.def("decode_layers(Tensor x, Tensor positions, Tensor cos, Tensor signed_sin, Tensor[] weights, Tensor[] k_pools, "
        "Tensor[] v_pools, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, int[] kinds, "
        "int heads, float eps, float scale, Tensor? final_norm, Tensor[] pieces, Tensor[] local_rope, "
        "int[] local_layers, bool gelu, float softcap, int window, Tensor[] experts, Tensor[] expert_scales, "
        "int[] moe_layers, int top_k, "
        "bool renormalize, Tensor(a!)? touched, Tensor? tp_shm, int tp_rank, int tp_world) -> Tensor");
  m.def("decode_part_timing(bool on) -> ()", &decode_part_timing);
  m.def("decode_part_times() -> float[]", &decode_part_times);
}

TORCH_LIBRARY_IMPL(minivllm_native, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("moe_experts", &moe_experts);
}

// Helpers shared by the native kernels (q8_matmul.cpp, f32_matmul.cpp, paged_attention.cpp, logits_reduce.cpp):
// AVX2 + FMA + F16C.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include <type_traits>

namespace minivllm_native {

constexpr int64_t kBlock = 32;
constexpr int64_t kPair = 2 * kBlock;   // 4-bit weights are stepped two blocks at a time
constexpr int64_t kQ4BlockBytes = 20;   // a 4-bit weight block: fp16 d, fp16 m, 16 bytes of nibbles
constexpr int64_t kFeatureGrain = 64;   // output features per parallel task: amortises a task, still balances
constexpr int64_t kElementGrain = 16384;  // elements per parallel task: below that a thread hand-off costs more

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// e^x for x <= 0 (scores minus their maximum), ~1 ulp: e^x = 2^n e^r with |r| <= ln2/2 and a degree-6
// polynomial for e^r (Cephes' expf). Below -87 the result is clamped to ~1e-38: a weight of nothing.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts: r stays exact
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
}

inline int64_t round_up16(int64_t n) { return (n + 15) / 16 * 16; }  // floats: whole 64-byte lines

// `buffer` grown to hold `floats` from a 64-byte boundary, which it returns. Vector loads from a
// buffer that malloc aligned to 16 bytes straddle cache lines half the time (measured: up to 1.2x).
inline float* aligned_scratch(std::vector<float>& buffer, size_t floats) {
  constexpr size_t kLine = 64 / sizeof(float);
  buffer.resize(std::max(buffer.size(), floats + kLine));
  const auto address = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((kLine - address / sizeof(float) % kLine) % kLine);
}

// A lone row's product streams each thread's share of the weight once, front to back: requesting the
// lines `kPrefetchAhead` bytes ahead keeps more of them in flight than the hardware prefetcher alone
// (AVX-512 box, 1 sequence, in-process A/B: 0.91-0.95x the whole step at 8-512 tokens of context;
// 3 to 6 KiB alike, and a non-temporal hint no different). Rows of several activations compute long
// enough per line that it did not pay there (0.97-1.01x at 8).
constexpr int64_t kPrefetchAhead = 4096;

// Requests the lines of [p + ahead, p + ahead + bytes) that lie before `stop` (the end of the thread's
// share). Successive rows' calls tile their stream, so each line is requested once.
inline void prefetch_ahead(const void* p, int64_t bytes, int64_t ahead, const void* stop) {
  const auto from = reinterpret_cast<uintptr_t>(p) + ahead;
  const auto end = std::min(from + bytes, reinterpret_cast<uintptr_t>(stop));
  for (uintptr_t line = from; line < end; line += 64) _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

// 32 int32 lanes already within int8 range (four vectors, in order) as 32 bytes in the same order.
inline __m256i pack_bytes(const __m256i (&v)[4]) {
  // the packs work per 128-bit half: dwords come out as [v0 lo, v1 lo, v2 lo, v3 lo, v0 hi, ...]
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Bytes 0..15 of a block's codes at p, bytes 16..31 one half-pair (32 bytes) further: the pair layout of the
// integer activations (q8_matmul.cpp, kquant_matmul.cpp).
inline void store_halves(int8_t* p, __m256i codes) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(codes));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + kBlock), _mm256_extracti128_si256(codes, 1));
}

// Runs f(row) for every row, in parallel only when the rows hold enough elements to pay for it.
template <typename F>
void over_rows(int64_t rows, int64_t row_elements, F&& f) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kElementGrain / std::max<int64_t>(1, row_elements)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t r = begin; r < end; ++r) f(r);
                   });
}

// at::parallel_for over tasks [0, cost.size()), but each thread's run f(begin, end) of contiguous tasks has
// about equal total cost, not an equal count (a lone sequence's 9 attention parts, the last partial, went 5
// full parts against 3 and a bit). Contiguous, not pulled one by one: a thread reads its parts front to back
// and its prefetches reach its next part (interleaved parts measured 1.09-1.34x the one-sequence step at
// 512-1,500 tokens). A task's result must not depend on which thread runs it.
template <typename F>
void over_balanced_runs(const std::vector<int64_t>& cost, F&& f) {
  const int64_t tasks = static_cast<int64_t>(cost.size()), threads = std::min<int64_t>(tasks, at::get_num_threads());
  std::vector<int64_t> before(tasks + 1, 0);  // before[i]: the cost of tasks [0, i)
  for (int64_t i = 0; i < tasks; ++i) before[i + 1] = before[i] + cost[i];
  auto run_start = [&](int64_t j) {  // thread j's first task: where the cost before it is nearest j / threads of all
    if (j == threads) return tasks;
    const double target = static_cast<double>(before[tasks]) * static_cast<double>(j) / static_cast<double>(threads);
    int64_t i = std::lower_bound(before.begin(), before.end(), target) - before.begin();
    if (i > 0 && target - static_cast<double>(before[i - 1]) < static_cast<double>(before[i]) - target) --i;
    return i;
  };
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      if (const int64_t first = run_start(j), stop = run_start(j + 1); first < stop) f(first, stop);
  });
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

// Eight floats; a short tail (n < 8) zero-padded by a masked load.
inline __m256 floats8(const float* f, int64_t n) {
  if (n == 8) return _mm256_loadu_ps(f);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_maskload_ps(f, mask);
}

// Runs f(tile, row) over rows [begin, end) in tiles of ROW_TILE, then the remainder (ROW_TILE <= 4).
template <int ROW_TILE, typename F>
void over_row_tiles(int64_t begin, int64_t end, F&& f) {
  int64_t row = begin;
  for (; row + ROW_TILE <= end; row += ROW_TILE) f(std::integral_constant<int, ROW_TILE>{}, row);
  switch (end - row) {
    case 3: f(std::integral_constant<int, 3>{}, row); break;
    case 2: f(std::integral_constant<int, 2>{}, row); break;
    case 1: f(std::integral_constant<int, 1>{}, row); break;
    default: break;
  }
}

// f(T{}) with T the KV pool's element type: fp32, fp16 or bf16, the types the native kernels read and write.
template <typename F>
void with_pool_type(const at::Tensor& pool, F&& f) {
  switch (pool.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(at::Half{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kChar: f(int8_t{}); break;
    default: TORCH_CHECK(false, "KV pool dtype ", pool.scalar_type(), " is not float32, float16, bfloat16 or int8");
  }
}

// An int8 pool's head rows hold head_dim values, then their fp16 scale (model/kv_quant.py): its last
// dimension is this many elements longer than the head size.
constexpr int64_t kScaleBytes = 2;
inline int64_t pool_head_dim(const at::Tensor& pool) {
  return pool.size(3) - (pool.scalar_type() == at::kChar ? kScaleBytes : 0);
}

inline void check_activations(const at::Tensor& x, int64_t multiple) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "expected contiguous fp32 activations [rows, K], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) % multiple == 0, "K=", x.size(1), " must be a multiple of ", multiple);
}

// A product's output [rows, n]: contiguous fp32 (a caller's buffer, or one just allocated).
inline void check_output(const at::Tensor& out, int64_t rows, int64_t n) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == rows &&
              out.size(1) == n, "expected a contiguous fp32 output [", rows, ", ", n, "], got ", out.sizes());
}

inline void check_q4_weight(const at::Tensor& w, int64_t blocks) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == blocks * kQ4BlockBytes,
              "q4 weight must be uint8 [N, K/32*20], got ", w.sizes());
}

// An int8 weight [N, K] with scales [N] (per row, fp32) or [N, K/32] (per block of 32, fp32 or fp16: GGUF's Q8_0
// holds fp16). Returns whether the scales are per block.
inline bool check_i8_weight(const at::Tensor& w, const at::Tensor& w_scale, int64_t k) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous() && w.size(1) == k,
              "i8 weight must be int8 [N, K], got ", w.sizes());
  const int64_t n = w.size(0), blocks = k / kBlock;
  const bool half = w_scale.scalar_type() == at::kHalf;
  TORCH_CHECK((half || w_scale.scalar_type() == at::kFloat) && w_scale.is_contiguous() &&
              ((!half && w_scale.numel() == n) || w_scale.numel() == n * blocks),
              "contiguous scales, one per output row (fp32) or one per block of 32 (fp32 or fp16), got ",
              w_scale.sizes(), " ", w_scale.scalar_type());
  return half || (w_scale.numel() == n * blocks && blocks != 1);
}

// f(grouped, scales) for an int8 weight's scales (check_i8_weight): per row (fp32), or per block in fp32 or fp16.
template <typename F>
void with_i8_scales(const at::Tensor& w_scale, bool grouped, F&& f) {
  if (!grouped) return f(std::false_type{}, w_scale.data_ptr<float>());
  if (w_scale.scalar_type() == at::kHalf) return f(std::true_type{}, w_scale.data_ptr<at::Half>());
  f(std::true_type{}, w_scale.data_ptr<float>());
}

inline float scale_at(const float* s) { return *s; }
inline float scale_at(const at::Half* s) { return static_cast<float>(*s); }

// Eight per-block scales as floats; a short tail (n < 8) zero-padded.
inline __m256 scales8(const float* s, int64_t n) { return floats8(s, n); }
inline __m256 scales8(const at::Half* s, int64_t n) {
  if (n == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  alignas(16) uint16_t tail[8] = {};  // a row's last group only
  std::memcpy(tail, s, n * sizeof(uint16_t));
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
}

}  // namespace minivllm_native

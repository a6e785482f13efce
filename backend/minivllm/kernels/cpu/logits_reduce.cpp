// Each logits row's argmax and log-sum-exp in two passes over the row: a greedy step's whole pick, and
// the chosen token's log-prob (logit - log-sum-exp), where torch takes five passes (argmax, then
// logsumexp's max, subtract, exp and sum).
//
// Why: at 32 sequences those passes over 32 x 49,152 logits cost ~3.5 ms a step. The results follow
// torch's: the first index of the maximum, a NaN counting as the maximum (the first NaN, and a NaN
// log-sum-exp), a row of -inf giving index 0 and -inf, a +inf maximum giving +inf. Each row is summed
// in one fixed order, alone or in any batch.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "common.h"

namespace {

using namespace minivllm_native;

constexpr float kInf = std::numeric_limits<float>::infinity();

struct Peak {
  int64_t index;
  float value;  // NaN when the row holds one
};

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    if (std::isnan(x[j])) return j;
  return -1;
}

// The first index of the row's maximum: each lane keeps its first maximum (strictly greater replaces),
// then the lanes' largest value at its smallest index, then the tail (later indices, strictly greater).
Peak first_max(const float* x, int64_t n) {
  __m256 best = _mm256_set1_ps(-kInf), unordered = _mm256_setzero_ps();
  __m256i best_at = _mm256_setzero_si256(), at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8, at = _mm256_add_epi32(at, _mm256_set1_epi32(8))) {
    const __m256 v = _mm256_loadu_ps(x + j);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, greater);
    best_at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_at), _mm256_castsi256_ps(at), greater));
  }
  if (_mm256_movemask_ps(unordered)) return {first_nan(x, n), std::numeric_limits<float>::quiet_NaN()};
  alignas(32) float top[8];
  alignas(32) int32_t top_at[8];
  _mm256_store_ps(top, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(top_at), best_at);
  Peak peak{0, -kInf};
  for (int lane = 0; lane < 8; ++lane)
    if (top[lane] > peak.value || (top[lane] == peak.value && top_at[lane] < peak.index))
      peak = {top_at[lane], top[lane]};
  for (; j < n; ++j) {
    if (std::isnan(x[j])) return {first_nan(x, n), x[j]};
    if (x[j] > peak.value) peak = {j, x[j]};
  }
  return peak;
}

// log(sum(exp(x))) given the row's maximum.
float log_sum_exp(const float* x, int64_t n, float top) {
  if (std::isnan(top) || std::isinf(top)) return top;  // NaN; a row of -inf; a +inf logit
  const __m256 shift = _mm256_set1_ps(top);
  __m256 sums[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // two chains: add latency
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int c = 0; c < 2; ++c)
      sums[c] = _mm256_add_ps(sums[c], exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8 * c), shift)));
  float sum = hsum(_mm256_add_ps(sums[0], sums[1]));
  for (; j < n; ++j) sum += std::exp(x[j] - top);
  return top + std::log(sum);
}

// Also the argmax's log-prob (its logit minus the log-sum-exp): a greedy pick's reported log-prob, as torch's
// gather-and-subtract gives it (NaN where the row's maximum or sum is NaN or infinite, as there).
std::tuple<at::Tensor, at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.size(1) > 0 &&
                  logits.size(1) < std::numeric_limits<int32_t>::max(),
              "expected contiguous fp32 logits [rows, vocab], got ", logits.sizes(), " ", logits.scalar_type());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor index = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor lse = at::empty({rows}, logits.options());
  at::Tensor peak_logprob = at::empty({rows}, logits.options());
  const float* x = logits.data_ptr<float>();
  int64_t* index_out = index.data_ptr<int64_t>();
  float* lse_out = lse.data_ptr<float>();
  float* logprob_out = peak_logprob.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Peak peak = first_max(x + r * vocab, vocab);
      index_out[r] = peak.index;
      lse_out[r] = log_sum_exp(x + r * vocab, vocab, peak.value);
      logprob_out[r] = x[r * vocab + peak.index] - lse_out[r];
    }
  });
  return {index, lse, peak_logprob};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_native, m) { m.def("argmax_logsumexp(Tensor logits) -> (Tensor, Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(minivllm_native, CPU, m) { m.impl("argmax_logsumexp", &argmax_logsumexp); }

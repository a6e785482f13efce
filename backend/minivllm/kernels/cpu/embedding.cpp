// Token embeddings looked up in an int8 table: each id's row of int8 values times its group scales, in one
// call. The bits are torch's: one fp32 product of the value and its scale per element.
//
// Why: the torch form (index the values, convert, view, index the scales, convert, multiply) is six small
// operators, ~125 us of a one-sequence decode step on a box where the step's 94 MiB of weights have just
// evicted everything they touch; one call is a few microseconds.

#include <torch/library.h>

#include "common.h"

namespace {

using namespace minivllm_native;

// n int8 values times one scale, into floats.
void scale_row(const int8_t* q, float scale, float* out, int64_t n) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), s));
  }
  for (; i < n; ++i) out[i] = static_cast<float>(q[i]) * scale;
}

// ids (int64, any shape) -> fp32 [*ids.shape, hidden]; q int8 [vocab, hidden], scale fp32 or fp16 [vocab, groups]
// (groups dividing hidden: one scale per row, or per group of hidden / groups values).
at::Tensor int8_embedding(const at::Tensor& ids, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(ids.scalar_type() == at::kLong, "token ids must be int64, got ", ids.scalar_type());
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(),
              "the table must be contiguous int8 [vocab, hidden], got ", q.sizes(), " ", q.scalar_type());
  const int64_t vocab = q.size(0), hidden = q.size(1);
  TORCH_CHECK(scale.dim() == 2 && (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf) &&
                  scale.is_contiguous() && scale.size(0) == vocab && scale.size(1) > 0 && hidden % scale.size(1) == 0,
              "scales must be contiguous fp32 or fp16 [", vocab, ", groups dividing ", hidden, "], got ", scale.sizes(),
              " ", scale.scalar_type());
  const at::Tensor flat = ids.contiguous().view(-1);
  const int64_t* id = flat.data_ptr<int64_t>();
  const int64_t count = flat.numel(), groups = scale.size(1), group = hidden / groups;
  for (int64_t t = 0; t < count; ++t)  // an id outside the table must be an error, not a read past it
    TORCH_CHECK(id[t] >= 0 && id[t] < vocab, "token id ", id[t], " is outside the embedding table's ", vocab, " rows");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(hidden);
  at::Tensor out = at::empty(shape, q.options().dtype(at::kFloat));
  const int8_t* values = q.data_ptr<int8_t>();
  float* dst = out.data_ptr<float>();
  auto look_up = [&](const auto* scales) {
    over_rows(count, hidden, [&](int64_t t) {
      for (int64_t g = 0; g < groups; ++g)
        scale_row(values + id[t] * hidden + g * group, scale_at(scales + id[t] * groups + g), dst + t * hidden + g * group,
                  group);
    });
  };
  scale.scalar_type() == at::kHalf ? look_up(scale.data_ptr<at::Half>()) : look_up(scale.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_native, m) { m.def("int8_embedding(Tensor ids, Tensor q, Tensor scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(minivllm_native, CPU, m) { m.impl("int8_embedding", &int8_embedding); }

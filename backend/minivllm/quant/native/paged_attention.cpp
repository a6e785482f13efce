// Decode attention read straight from the paged KV pool (AVX2 + FMA + F16C): one query token per
// sequence, its keys and values found through the sequence's block table.
//
// Why: the portable path gathers every sequence's K and V into contiguous copies before two products
// (model/attention.py), so each step writes and reads the whole context a second time; at 32 sequences
// of ~200 tokens that was ~0.6 ms a layer, about a fifth of the step. Here each K/V row is read once,
// from the pool, in the pool's own precision (fp32, fp16 or bf16; converted in registers).
//
// One task is one sequence (or, with few sequences, one of its KV heads): each KV head's query heads
// (the GQA group) share every K/V row it loads. Two passes: scores for the whole context into the
// thread's scratch (eight tokens at a time against each query head), a softmax over them, then the
// weighted sums of V, block by block, in register accumulators. Summation order is fixed per task, so a sequence gets the same bits alone and in any
// batch.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace {

using namespace minivllm_native;

template <typename T>
__m256 load8(const T* p);
template <>
inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 load8<at::Half>(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <>
inline __m256 load8<at::BFloat16>(const at::BFloat16* p) {  // bf16 is the top half of an fp32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

struct Geometry {
  int64_t block_size, kv_heads, dim, group, max_blocks;
};

// Softmax of scores[0, len) in place, returned unnormalised; the result is the reciprocal of the sum.
inline float exp_shifted(float* scores, int64_t len) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < len; ++t) top = std::max(top, scores[t]);
  const __m256 shift = _mm256_set1_ps(top);
  __m256 sums = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift));
    _mm256_storeu_ps(scores + t, e);
    sums = _mm256_add_ps(sums, e);
  }
  float sum = hsum(sums);
  for (; t < len; ++t) sum += scores[t] = std::exp(scores[t] - top);
  return 1.0f / sum;
}

// Calls f(first, rows, n) for each block's run of n <= block_size tokens [first, first + n), `rows`
// pointing at the first one's K or V row (all its heads; consecutive tokens are kv_heads * dim apart).
template <typename T, typename F>
inline void over_blocks(const T* pool, const int64_t* table, int64_t len, const Geometry& g, F&& f) {
  const int64_t token_stride = g.kv_heads * g.dim, block_bytes = g.block_size * token_stride * sizeof(T);
  for (int64_t first = 0, b = 0; first < len; first += g.block_size, ++b) {
    if (first + g.block_size < len) {  // the next block into L2 while this one computes: blocks are scattered
      const char* next = reinterpret_cast<const char*>(pool + table[b + 1] * g.block_size * token_stride);
      for (int64_t line = 0; line < block_bytes; line += 64) _mm_prefetch(next + line, _MM_HINT_T1);
    }
    f(first, pool + table[b] * g.block_size * token_stride, std::min(g.block_size, len - first));
  }
}

// [sum(a[0]), ..., sum(a[7])]: eight dot products' accumulators reduced and transposed at once.
inline __m256 sums8(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Scores of n consecutive tokens (rows `stride` apart) against every query head of the group. Eight
// tokens at a time share each query load and one reduction; the block's last few go one by one.
template <typename T>
void score_rows(const float* q, const T* rows, int64_t n, int64_t stride, const Geometry& g, float* out, int64_t len) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    for (int64_t h = 0; h < g.group; ++h) {
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < g.dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + h * g.dim + d);
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, load8(rows + (j + i) * stride + d), acc[i]);
      }
      _mm256_storeu_ps(out + h * len + j, sums8(acc));
    }
  }
  for (; j < n; ++j) {
    for (int64_t h = 0; h < g.group; ++h) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < g.dim; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * g.dim + d), load8(rows + j * stride + d), acc);
      out[h * len + j] = hsum(acc);
    }
  }
}

// o[0, 8N) += sum over a block's n tokens of p[j] * V[j][d0, d0 + 8N), N accumulators in registers
// across the block (loaded from and stored back to `o`, which stays in L1).
template <int N, typename T>
inline void weigh_block(const float* p, const T* rows, int64_t n, int64_t stride, int64_t d0, float* o) {
  __m256 acc[N];
  for (int i = 0; i < N; ++i) acc[i] = _mm256_loadu_ps(o + 8 * i);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 weight = _mm256_set1_ps(p[j]);
    for (int i = 0; i < N; ++i) acc[i] = _mm256_fmadd_ps(weight, load8(rows + j * stride + d0 + 8 * i), acc[i]);
  }
  for (int i = 0; i < N; ++i) _mm256_storeu_ps(o + 8 * i, acc[i]);
}

template <typename T>
void weigh_row(const float* p, const T* rows, int64_t n, int64_t stride, const Geometry& g, float* o) {
  for (int64_t d0 = 0; d0 < g.dim; d0 += 64) {  // dim % 8 == 0: chunks of 8 vectors, then the rest
    switch (std::min<int64_t>(8, (g.dim - d0) / 8)) {
      case 8: weigh_block<8>(p, rows, n, stride, d0, o + d0); break;
      case 7: weigh_block<7>(p, rows, n, stride, d0, o + d0); break;
      case 6: weigh_block<6>(p, rows, n, stride, d0, o + d0); break;
      case 5: weigh_block<5>(p, rows, n, stride, d0, o + d0); break;
      case 4: weigh_block<4>(p, rows, n, stride, d0, o + d0); break;
      case 3: weigh_block<3>(p, rows, n, stride, d0, o + d0); break;
      case 2: weigh_block<2>(p, rows, n, stride, d0, o + d0); break;
      default: weigh_block<1>(p, rows, n, stride, d0, o + d0); break;
    }
  }
}

// One sequence's KV heads [h0, h1): q holds their query heads ((h1 - h0) * group of them, in order),
// already scaled; out likewise. K and V are read block by block, every KV head of the range while the
// block is in L1: a token's row holds all its heads side by side, so a task that takes every head
// reads its blocks front to back.
// Each output sums its tokens in order, whatever the range: the same bits however heads are split.
template <typename T>
void attend(const float* q, const T* k_pool, const T* v_pool, const int64_t* table, int64_t len, int64_t h0,
            int64_t h1, const Geometry& g, float* scores, float* norm, float* out) {
  const int64_t stride = g.kv_heads * g.dim, heads = (h1 - h0) * g.group;  // scores: [query head][token]
  over_blocks(k_pool, table, len, g, [&](int64_t first, const T* rows, int64_t n) {
    for (int64_t kv = h0; kv < h1; ++kv)
      score_rows(q + (kv - h0) * g.group * g.dim, rows + kv * g.dim, n, stride, g,
                 scores + (kv - h0) * g.group * len + first, len);
  });
  for (int64_t i = 0; i < heads; ++i) norm[i] = exp_shifted(scores + i * len, len);
  std::fill(out, out + heads * g.dim, 0.0f);
  over_blocks(v_pool, table, len, g, [&](int64_t first, const T* rows, int64_t n) {
    for (int64_t i = 0; i < heads; ++i)  // query head i reads KV head h0 + i / group
      weigh_row(scores + i * len + first, rows + (h0 + i / g.group) * g.dim, n, stride, g, out + i * g.dim);
  });
  for (int64_t i = 0; i < heads; ++i)
    for (int64_t d = 0; d < g.dim; ++d) out[i * g.dim + d] *= norm[i];
}

void check_inputs(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                  const at::Tensor& block_tables, const at::Tensor& context_lens) {
  // any strides: the queries are a view of the fused QKV projection's rows
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "expected fp32 queries [seqs, heads, dim], got ",
              q.sizes(), " ", q.scalar_type());
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.scalar_type() == v_pool.scalar_type() &&
              k_pool.is_contiguous() && v_pool.is_contiguous(),
              "K and V pools must be contiguous [blocks, block_size, kv_heads, dim] of one dtype, got ",
              k_pool.sizes(), " and ", v_pool.sizes());
  const int64_t seqs = q.size(0), dim = q.size(2), kv_heads = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == dim && dim % 8 == 0, "head dim ", dim, " must match the pool's and be a multiple of 8");
  TORCH_CHECK(q.size(1) % kv_heads == 0, q.size(1), " query heads are not a multiple of ", kv_heads, " KV heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == seqs && block_tables.scalar_type() == at::kLong &&
              block_tables.is_contiguous(), "block tables must be contiguous int64 [seqs, blocks], got ",
              block_tables.sizes());
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == seqs && context_lens.scalar_type() == at::kLong &&
              context_lens.is_contiguous(), "context lengths must be contiguous int64 [seqs], got ", context_lens.sizes());
  // Bounds are checked here, not trusted: a wrong table must be an error, not a read out of the pool.
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1), block_size = k_pool.size(1), blocks = k_pool.size(0);
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= width * block_size, "sequence ", s, ": context length ", lens[s],
                " outside 1..", width * block_size, " (its block table's capacity)");
    for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[s * width + b] >= 0 && tables[s * width + b] < blocks, "sequence ", s, ": block id ",
                  tables[s * width + b], " outside the pool's ", blocks, " blocks");
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& block_tables,
         const at::Tensor& context_lens, float scale, at::Tensor& out) {
  const Geometry g{k_pool.size(1), k_pool.size(2), q.size(2), q.size(1) / k_pool.size(2), block_tables.size(1)};
  const int64_t seqs = q.size(0), max_len = g.max_blocks * g.block_size;
  // A task takes every KV head of a sequence (sequential reads) once there are sequences enough to
  // keep the threads busy; with fewer, one head each, so a lone long sequence still uses every thread.
  const int64_t heads_per_task = seqs >= 2 * at::get_num_threads() ? g.kv_heads : 1;
  const int64_t splits = g.kv_heads / heads_per_task;
  const float* qp = q.data_ptr<float>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t q_seq = q.stride(0), q_head = q.stride(1), q_dim = q.stride(2);
  at::parallel_for(0, seqs * splits, 1, [&](int64_t begin, int64_t end) {
    const int64_t heads = heads_per_task * g.group;
    const int64_t score_floats = round_up16(heads * max_len), scaled_floats = round_up16(heads * g.dim);
    // the thread's, kept across calls (a fresh one was allocated and zeroed every layer): scores, the
    // scaled query heads, norms, 64-byte aligned each
    static thread_local std::vector<float> scratch;
    float* scores = aligned_scratch(scratch, score_floats + scaled_floats + heads);
    float* scaled = scores + score_floats;
    float* norm = scaled + scaled_floats;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / splits, h0 = task % splits * heads_per_task;
      for (int64_t i = 0; i < heads; ++i) {  // this task's query heads, scaled, packed
        const float* src = qp + seq * q_seq + (h0 * g.group + i) * q_head;
        for (int64_t d = 0; d < g.dim; ++d) scaled[i * g.dim + d] = src[d * q_dim] * scale;
      }
      attend(scaled, kp, vp, tables + seq * g.max_blocks, lens[seq], h0, h0 + heads_per_task, g,
             scores, norm, op + (seq * g.kv_heads + h0) * g.group * g.dim);
    }
  });
}

}  // namespace

at::Tensor minivllm_native::paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool,
                                                   const at::Tensor& v_pool, const at::Tensor& block_tables,
                                                   const at::Tensor& context_lens, double scale) {
  check_inputs(q, k_pool, v_pool, block_tables, context_lens);
  at::Tensor out = at::empty(q.sizes(), q.options());  // contiguous, whatever q's strides
  switch (k_pool.scalar_type()) {
    case at::kFloat: run<float>(q, k_pool, v_pool, block_tables, context_lens, scale, out); break;
    case at::kHalf: run<at::Half>(q, k_pool, v_pool, block_tables, context_lens, scale, out); break;
    case at::kBFloat16: run<at::BFloat16>(q, k_pool, v_pool, block_tables, context_lens, scale, out); break;
    default: TORCH_CHECK(false, "KV pool dtype ", k_pool.scalar_type(), " is not float32, float16 or bfloat16");
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(minivllm_native, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm_native, CPU, m) { m.impl("paged_decode_attention", &minivllm_native::paged_decode_attention); }

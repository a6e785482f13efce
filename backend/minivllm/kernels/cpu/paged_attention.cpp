// Decode attention read straight from the paged KV pool (AVX2 + FMA + F16C): one query token per
// sequence, its keys and values found through the sequence's block table.
//
// Why: the portable path gathers every sequence's K and V into contiguous copies before two products
// (model/attention.py), so each step writes and reads the whole context a second time; at 32 sequences
// of ~200 tokens that was ~0.6 ms a layer, about a fifth of the step. Here each K/V row is read once,
// from the pool, in the pool's own precision (fp32, fp16 or bf16; converted in registers), or int8 rows
// with a scale each (model/kv_quant.py): the scale multiplies a K row's score and a V row's weight.
//
// One task is one sequence (or, with few sequences, one part of one: contexts are attended in parts of
// 64 tokens, merged by their maxima, so a lone sequence keeps every thread streaming; with fewer parts
// than threads, one KV head of a part): each KV head's query heads (the GQA group) share every K/V row it
// loads, converted once for up to three of them. Two passes: scores into the thread's scratch (four
// tokens at a time against three query heads), a softmax per part, then the weighted sums of V, block by
// block, in register accumulators; blocks are requested a few ahead (they are scattered in the pool).
// Parts are fixed by position and summed in one order per task, so a sequence gets the same bits alone
// and in any batch.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
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
template <>
inline __m256 load8<int8_t>(const int8_t* p) {  // the quantized values; row_scale applies the scale
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <typename T>
constexpr bool kScaled = std::is_same_v<T, int8_t>;

// An int8 head row's fp16 scale, stored after its `dim` values.
template <typename T>
inline float row_scale(const T* row, int64_t dim) {
  return static_cast<float>(*reinterpret_cast<const at::Half*>(row + dim));
}

struct Geometry {
  int64_t block_size, kv_heads, dim, group, max_blocks;
  int64_t row;  // elements of one head's row in the pool: dim, or dim + the scale's bytes (int8)
};

// The largest of scores[0, len) (-inf for none), eight lanes at a time: a scalar running maximum was a chain
// of dependent compares, 3 cycles a score (in-process A/B: 0.97x the whole one-sequence step at 512 and
// 1,500 tokens of context). A maximum is exact in any order: the same bits.
inline float max_score(const float* scores, int64_t len) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(scores + t));
  float top = hmax(best);
  for (; t < len; ++t) top = std::max(top, scores[t]);
  return top;
}

// Softmax numerators of scores[0, len) in place: e^(score - top), top the maximum (returned in `top`);
// returns their sum.
inline float exp_shifted(float* scores, int64_t len, float& top) {
  top = max_score(scores, len);
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
  return sum;
}

// Block b of a sequence's table into L2 (blocks are scattered: the hardware prefetcher cannot guess them).
template <typename T>
inline void prefetch_block(const T* pool, const int64_t* table, int64_t b, const Geometry& g) {
  const int64_t token_stride = g.kv_heads * g.row, block_bytes = g.block_size * token_stride * sizeof(T);
  const char* start = reinterpret_cast<const char*>(pool + table[b] * g.block_size * token_stride);
  for (int64_t line = 0; line < block_bytes; line += 64) _mm_prefetch(start + line, _MM_HINT_T1);
}

// How many blocks ahead of the one being read are requested. One block (6 KiB of K for the embedded
// model) computes in less time than its successor takes to arrive from memory: a lone 2,048-token
// sequence streamed its pool at ~10 GB/s; four ahead took 0.78-0.85x the time (in-process A/B).
constexpr int64_t kPrefetchBlocks = 4;

// Calls f(first, rows, n) for each block's run of n <= block_size tokens [first, first + n) within
// [t0, t1) (t0 on a block boundary), `rows` pointing at the first one's K or V row (all its heads;
// consecutive tokens are kv_heads * dim apart). Blocks are fetched kPrefetchBlocks ahead, past t1 too while
// the sequence has tokens (< `limit`): a thread's next part starts there.
template <typename T, typename F>
inline void over_blocks(const T* pool, const int64_t* table, int64_t t0, int64_t t1, int64_t limit, const Geometry& g,
                        F&& f) {
  const int64_t token_stride = g.kv_heads * g.row;
  for (int64_t first = t0, b = t0 / g.block_size; first < t1; first += g.block_size, ++b) {
    // the first block requests all those ahead of it, each later one the newest
    for (int64_t ahead = first == t0 ? 1 : kPrefetchBlocks;
         ahead <= kPrefetchBlocks && first + ahead * g.block_size < limit; ++ahead)
      prefetch_block(pool, table, b + ahead, g);
    f(first, pool + table[b] * g.block_size * token_stride, std::min(g.block_size, t1 - first));
  }
}

// [sum(a[0]), sum(a[1]), sum(a[2]), sum(a[3])]: four dot products' accumulators reduced at once.
inline __m128 sums4(const __m256* a) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// The query heads of one KV head are taken this many at a time: every K or V row loaded (and converted
// from the pool's precision) serves them all. Three heads x four tokens of accumulators, their three query
// vectors and a K row fit AVX2's sixteen registers when the score loop loads one K row at a time (four K
// rows and a query vector at once were seventeen: GCC kept an accumulator on the stack, a store and a
// reload every FMA of its chain; the kernel alone 0.94-0.98x the time with an fp16 pool, the same bits,
// no change measured in the whole step). (One head at a time converted each fp16 row once per
// head; sharing the rows measured 0.97x the time at 8 and 32 sequences, no change at one: the pool's
// reads, not the arithmetic, bound a lone sequence.)
constexpr int kHeadTile = 3;  // over_row_tiles (common.h) takes the tiles, then the one or two left
constexpr int64_t kTokenTile = 4;

// Scores of n consecutive tokens (rows `stride` apart) against H query heads (q: H x dim, `out`: H rows of
// `len`). Four tokens at a time share each query load and one reduction; the block's last few go one by one.
// Each score sums its products in one order, wherever its token falls in a tile: the same bits in any batch.
template <int H, typename T>
void score_tile(const float* q, const T* rows, int64_t n, int64_t stride, int64_t dim, float* out, int64_t len) {
  int64_t j = 0;
  for (; j + kTokenTile <= n; j += kTokenTile) {
    __m256 acc[H][kTokenTile];
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < kTokenTile; ++t) acc[h][t] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {  // H query vectors, then one K row at a time: 3 x 4 + 3 + 1 registers
      __m256 qv[H];
      for (int h = 0; h < H; ++h) qv[h] = _mm256_loadu_ps(q + h * dim + d);
      for (int t = 0; t < kTokenTile; ++t) {
        const __m256 k = load8(rows + (j + t) * stride + d);
        for (int h = 0; h < H; ++h) acc[h][t] = _mm256_fmadd_ps(qv[h], k, acc[h][t]);
      }
    }
    if constexpr (kScaled<T>) {
      const __m128 scales = _mm_setr_ps(row_scale(rows + j * stride, dim), row_scale(rows + (j + 1) * stride, dim),
                                        row_scale(rows + (j + 2) * stride, dim), row_scale(rows + (j + 3) * stride, dim));
      for (int h = 0; h < H; ++h) _mm_storeu_ps(out + h * len + j, _mm_mul_ps(sums4(acc[h]), scales));
    } else {
      for (int h = 0; h < H; ++h) _mm_storeu_ps(out + h * len + j, sums4(acc[h]));
    }
  }
  for (; j < n; ++j)
    for (int h = 0; h < H; ++h) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < dim; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * dim + d), load8(rows + j * stride + d), acc);
      if constexpr (kScaled<T>) out[h * len + j] = hsum(acc) * row_scale(rows + j * stride, dim);
      else out[h * len + j] = hsum(acc);
    }
}

// Scores of n consecutive tokens against every query head of the group, a few heads at a time.
template <typename T>
void score_rows(const float* q, const T* rows, int64_t n, int64_t stride, const Geometry& g, float* out, int64_t len) {
  over_row_tiles<kHeadTile>(0, g.group, [&](auto heads, int64_t h) {
    score_tile<decltype(heads)::value>(q + h * g.dim, rows, n, stride, g.dim, out + h * len, len);
  });
}

// o_h[0, 8N) += sum over a block's n tokens of p_h[j] * V[j][d0, d0 + 8N), for H query heads sharing each
// V row's load: H x N accumulators in registers across the block (loaded from and stored back to `o`,
// which stays in L1). Each output sums its tokens in order, as one head alone would. An int8 row's scale
// (after its `dim` values) multiplies its weights.
template <int H, int N, typename T>
inline void weigh_block(const float* p, int64_t p_stride, const T* rows, int64_t n, int64_t stride, int64_t d0,
                        int64_t dim, float* o, int64_t o_stride) {
  __m256 acc[H][N];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < N; ++i) acc[h][i] = _mm256_loadu_ps(o + h * o_stride + d0 + 8 * i);
  for (int64_t j = 0; j < n; ++j) {
    __m256 weight[H];
    if constexpr (kScaled<T>) {
      const float scale = row_scale(rows + j * stride, dim);
      for (int h = 0; h < H; ++h) weight[h] = _mm256_set1_ps(p[h * p_stride + j] * scale);
    } else {
      for (int h = 0; h < H; ++h) weight[h] = _mm256_set1_ps(p[h * p_stride + j]);
    }
    for (int i = 0; i < N; ++i) {
      const __m256 v = load8(rows + j * stride + d0 + 8 * i);
      for (int h = 0; h < H; ++h) acc[h][i] = _mm256_fmadd_ps(weight[h], v, acc[h][i]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < N; ++i) _mm256_storeu_ps(o + h * o_stride + d0 + 8 * i, acc[h][i]);
}

// H heads' weighted sums over a block, 32 dims at a time (dim % 8 == 0: then the rest).
template <int H, typename T>
void weigh_heads(const float* p, int64_t p_stride, const T* rows, int64_t n, int64_t stride, int64_t dim, float* o,
                 int64_t o_stride) {
  for (int64_t d0 = 0; d0 < dim; d0 += 32) {
    switch (std::min<int64_t>(4, (dim - d0) / 8)) {
      case 4: weigh_block<H, 4>(p, p_stride, rows, n, stride, d0, dim, o, o_stride); break;
      case 3: weigh_block<H, 3>(p, p_stride, rows, n, stride, d0, dim, o, o_stride); break;
      case 2: weigh_block<H, 2>(p, p_stride, rows, n, stride, d0, dim, o, o_stride); break;
      default: weigh_block<H, 1>(p, p_stride, rows, n, stride, d0, dim, o, o_stride); break;
    }
  }
}

// Every query head of one KV head's group over a block: p the group's first head's weights (heads
// `p_stride` apart), o its first output (heads dim apart).
template <typename T>
void weigh_group(const float* p, int64_t p_stride, const T* rows, int64_t n, int64_t stride, const Geometry& g,
                 float* o) {
  over_row_tiles<kHeadTile>(0, g.group, [&](auto heads, int64_t h) {
    weigh_heads<decltype(heads)::value>(p + h * p_stride, p_stride, rows, n, stride, g.dim, o + h * g.dim, g.dim);
  });
}

// Tokens [t0, t1) of one sequence for its KV heads [h0, h1), in parts of `part_len` tokens from t0 (t0 and
// part_len on block boundaries; `limit` the sequence's length): q holds their query heads ((h1 - h0) *
// group of them, in order), already scaled. Per part and query head, `out` [part][head][dim] gets the
// weighted sum of V, unnormalised, and `top` / `sum` [part][head] its scores' maximum and softmax
// denominator. K, then V, are read block by block front to back, every KV head of the range while the
// block is in L1 (a token's row holds all its heads side by side). Each output sums its part's tokens in
// order, whatever the range or the heads' split: the same bits however a sequence is divided into tasks.
// Tokens before `visible` (a sliding window's first key, inside the first block read) score -inf; a
// `softcap` above 0 caps every score first (Gemma 2).
// Gemma 2's soft cap, in place: s -> cap tanh(s / cap), tanh(x) = sign(x) (1 - e) / (1 + e) with e = e^-2|x| <= 1
// (exp8 takes x <= 0), as the GeGLU's tanh in decode_step.cpp; the tail by std::tanh.
inline void cap_scores(float* s, int64_t n, float cap) {
  const __m256 inverse = _mm256_set1_ps(1.0f / cap), capv = _mm256_set1_ps(cap), sign = _mm256_set1_ps(-0.0f);
  const __m256 one = _mm256_set1_ps(1.0f), minus_two = _mm256_set1_ps(-2.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + i), inverse);
    const __m256 e = exp8(_mm256_mul_ps(minus_two, _mm256_andnot_ps(sign, x)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));  // tanh |x|
    _mm256_storeu_ps(s + i, _mm256_mul_ps(capv, _mm256_or_ps(t, _mm256_and_ps(sign, x))));
  }
  for (; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
}

template <typename T>
void attend(const float* q, const T* k_pool, const T* v_pool, const int64_t* table, int64_t t0, int64_t t1,
            int64_t limit, int64_t part_len, int64_t h0, int64_t h1, const Geometry& g, float* scores, float* top,
            float* sum, float* out, int64_t visible = 0, float softcap = 0.0f) {
  const int64_t stride = g.kv_heads * g.row, heads = (h1 - h0) * g.group, n = t1 - t0;  // scores: [query head][token]
  prefetch_block(v_pool, table, t0 / g.block_size, g);  // the V pass's first block, read after every K block
  over_blocks(k_pool, table, t0, t1, limit, g, [&](int64_t first, const T* rows, int64_t count) {
    for (int64_t kv = h0; kv < h1; ++kv)
      score_rows(q + (kv - h0) * g.group * g.dim, rows + kv * g.row, count, stride, g,
                 scores + (kv - h0) * g.group * n + (first - t0), n);
  });
  if (softcap > 0.0f) cap_scores(scores, heads * n, softcap);
  const int64_t hidden = std::max<int64_t>(0, std::min(visible, t1) - t0);  // the part's tokens before the window
  for (int64_t i = 0; i < heads && hidden; ++i)
    std::fill(scores + i * n, scores + i * n + hidden, -std::numeric_limits<float>::infinity());
  const int64_t parts = (n + part_len - 1) / part_len;
  for (int64_t p = 0; p < parts; ++p)
    for (int64_t i = 0; i < heads; ++i)
      sum[p * heads + i] = exp_shifted(scores + i * n + p * part_len, std::min(part_len, n - p * part_len),
                                       top[p * heads + i]);
  for (int64_t i = 0; i < heads && hidden; ++i)  // exp8 floors at e^-87: weigh them exactly 0 (the sum is >= 1)
    std::fill(scores + i * n, scores + i * n + hidden, 0.0f);
  std::fill(out, out + parts * heads * g.dim, 0.0f);
  over_blocks(v_pool, table, t0, t1, limit, g, [&](int64_t first, const T* rows, int64_t count) {
    float* part_out = out + (first - t0) / part_len * heads * g.dim;  // a block lies in one part
    for (int64_t kv = h0; kv < h1; ++kv) {  // query heads [(kv - h0) * group, +group) read KV head kv
      const int64_t i = (kv - h0) * g.group;
      weigh_group(scores + i * n + (first - t0), n, rows + kv * g.row, count, stride, g, part_out + i * g.dim);
    }
  });
}

}  // namespace

void minivllm_native::check_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                             const at::Tensor& block_tables, const at::Tensor& context_lens) {
  // any strides: the queries are a view of the fused QKV projection's rows
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "expected fp32 queries [seqs, heads, dim], got ",
              q.sizes(), " ", q.scalar_type());
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.scalar_type() == v_pool.scalar_type() &&
              k_pool.is_contiguous() && v_pool.is_contiguous(),
              "K and V pools must be contiguous [blocks, block_size, kv_heads, dim] of one dtype, got ",
              k_pool.sizes(), " and ", v_pool.sizes());
  const int64_t seqs = q.size(0), dim = q.size(2), kv_heads = k_pool.size(2);
  TORCH_CHECK(pool_head_dim(k_pool) == dim && dim % 8 == 0, "head dim ", dim,
              " must match the pool's and be a multiple of 8");
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

namespace {

// A context longer than this is attended in parts of this many tokens (whole blocks), each a task of its
// own, merged afterwards: one long sequence then keeps every thread streaming its own part of the pool. A
// task of one KV head of a whole context streamed the other heads' lines too (a token's row holds them
// all), so splitting one long sequence by heads had each thread read the whole context (measured: 2,048
// tokens, one sequence, 174 us a layer, ~9 GB/s). Parts are fixed by position, never by the batch. 64
// tokens rather than 256: a lone sequence of up to 256 tokens was one part, attended one KV head a task
// (three tasks on two threads, each streaming every head's lines); four parts of every head balance the
// threads (256 tokens: 0.79-0.83x the time, in-process A/B; batches and long contexts unchanged or faster).
constexpr int64_t kPartTokens = 64;

// Each query head of a sequence whose context came in several parts: its parts' weighted sums rescaled
// to the largest maximum and summed in part order, over the parts' summed denominators. One part: its
// sum over its denominator.
void merge_parts(const float* part_out, const float* part_top, const float* part_sum, int64_t parts, int64_t heads,
                 int64_t dim, float* out) {
  for (int64_t h = 0; h < heads; ++h) {
    float* o = out + h * dim;
    if (parts == 1) {
      const float norm = 1.0f / part_sum[h];
      for (int64_t d = 0; d < dim; ++d) o[d] = part_out[h * dim + d] * norm;
      continue;
    }
    float top = -std::numeric_limits<float>::infinity(), sum = 0.0f;
    for (int64_t p = 0; p < parts; ++p) top = std::max(top, part_top[p * heads + h]);
    std::fill(o, o + dim, 0.0f);
    for (int64_t p = 0; p < parts; ++p) {
      const float weight = std::exp(part_top[p * heads + h] - top);
      sum += weight * part_sum[p * heads + h];
      const float* po = part_out + (p * heads + h) * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] += weight * po[d];
    }
    const float norm = 1.0f / sum;
    for (int64_t d = 0; d < dim; ++d) o[d] *= norm;
  }
}

// One call's inputs, and the attention of one sequence's tokens for a range of its KV heads.
template <typename T>
struct Attention {
  Geometry g;
  int64_t part_len, all_heads;
  const float* q;
  int64_t q_seq, q_head, q_dim;
  float scale;
  const T *k, *v;
  const int64_t *tables, *lens;
  int64_t window;  // sliding-window attention over the last `window` keys; 0: the whole context
  float softcap;   // scores capped at +-softcap through tanh (Gemma 2); 0: none

  // A sequence's first key, and the first block's first token: parts count from there (by position).
  int64_t visible(int64_t seq) const { return window > 0 ? std::max<int64_t>(0, lens[seq] - window) : 0; }
  int64_t first(int64_t seq) const { return visible(seq) / g.block_size * g.block_size; }
  int64_t part_count(int64_t seq) const { return (lens[seq] - first(seq) + part_len - 1) / part_len; }
  int64_t part_tokens(int64_t seq, int64_t p) const { return std::min(part_len, lens[seq] - first(seq) - p * part_len); }

  // Parts [p0, p1) of sequence `seq` for KV heads [h0, h0 + kv_count) into o, top, sum (attend's layout).
  // `scaled`: room for the query heads, `scores` for the parts' scores.
  void attend_parts(int64_t seq, int64_t p0, int64_t p1, int64_t h0, int64_t kv_count, float* scaled,
                    float* scores, float* top, float* sum, float* o) const {
    const int64_t heads = kv_count * g.group;
    for (int64_t j = 0; j < heads; ++j) {  // the query heads, scaled, packed
      const float* src = q + seq * q_seq + (h0 * g.group + j) * q_head;
      for (int64_t d = 0; d < g.dim; ++d) scaled[j * g.dim + d] = src[d * q_dim] * scale;
    }
    const int64_t base = first(seq);
    attend(scaled, k, v, tables + seq * g.max_blocks, base + p0 * part_len, std::min(lens[seq], base + p1 * part_len),
           lens[seq], part_len, h0, h0 + kv_count, g, scores, top, sum, o, visible(seq), softcap);
  }
};

// The thread's scratch, kept across calls (a fresh one was allocated and zeroed every layer), 64-byte
// aligned pieces of the given float counts.
template <size_t N>
std::array<float*, N> thread_scratch(const std::array<int64_t, N>& floats) {
  static thread_local std::vector<float> scratch;
  int64_t total = 0;
  for (int64_t f : floats) total += round_up16(f);
  std::array<float*, N> pieces;
  pieces[0] = aligned_scratch(scratch, total);
  for (size_t i = 1; i < N; ++i) pieces[i] = pieces[i - 1] + round_up16(floats[i - 1]);
  return pieces;
}

// Sequences enough to keep the threads busy: one task a sequence, every head, every part (read front to
// back as one stream), merged in the thread's scratch.
template <typename T>
void by_sequence(const Attention<T>& a, int64_t seqs, float* out) {
  const int64_t max_len = a.g.max_blocks * a.g.block_size, most_parts = (max_len + a.part_len - 1) / a.part_len;
  over_balanced_runs(std::vector<int64_t>(a.lens, a.lens + seqs), [&](int64_t begin, int64_t end) {
    const auto [scaled, scores, top, sum, parts_out] = thread_scratch<5>(
        {a.all_heads * a.g.dim, a.all_heads * max_len, most_parts * a.all_heads, most_parts * a.all_heads,
         most_parts * a.all_heads * a.g.dim});
    for (int64_t s = begin; s < end; ++s) {
      a.attend_parts(s, 0, a.part_count(s), 0, a.g.kv_heads, scaled, scores, top, sum, parts_out);
      merge_parts(parts_out, top, sum, a.part_count(s), a.all_heads, a.g.dim, out + s * a.all_heads * a.g.dim);
    }
  });
}

// Fewer sequences: one task per (sequence, part, KV head), so a lone sequence still uses every thread, a
// long one by its parts (each thread streaming its own); a sequence of one part is normalised in its task,
// one of several merged after.
template <typename T>
void by_part(const Attention<T>& a, int64_t seqs, float* out) {
  struct Task { int64_t seq, part, h0; };
  std::vector<int64_t> first_part(seqs, -1);  // where a sequence of several parts keeps them until the merge
  int64_t kept = 0, pieces = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    pieces += a.part_count(s);
    if (a.part_count(s) > 1) first_part[s] = kept, kept += a.part_count(s);
  }
  // every KV head of a part in one task (its blocks read once) where parts are enough for the threads
  const int64_t kv_count = pieces >= 2 * at::get_num_threads() ? a.g.kv_heads : 1, heads = kv_count * a.g.group;
  std::vector<Task> tasks;
  std::vector<int64_t> tokens;  // each task's: its part's tokens (the last part of a sequence is short)
  for (int64_t s = 0; s < seqs; ++s)
    for (int64_t p = 0; p < a.part_count(s); ++p)
      for (int64_t h = 0; h < a.g.kv_heads; h += kv_count) {
        tasks.push_back({s, p, h});
        tokens.push_back(a.part_tokens(s, p));
      }
  std::vector<float> parts_out(kept * a.all_heads * a.g.dim), tops(kept * a.all_heads), sums(kept * a.all_heads);
  over_balanced_runs(tokens, [&](int64_t begin, int64_t end) {
    const auto [scaled, scores, top, sum] = thread_scratch<4>({heads * a.g.dim, heads * a.part_len, heads, heads});
    for (int64_t i = begin; i < end; ++i) {
      const Task& t = tasks[i];
      if (first_part[t.seq] < 0) {  // one part: straight out
        float* o = out + (t.seq * a.all_heads + t.h0 * a.g.group) * a.g.dim;
        a.attend_parts(t.seq, 0, 1, t.h0, kv_count, scaled, scores, top, sum, o);
        merge_parts(o, top, sum, 1, heads, a.g.dim, o);
        continue;
      }
      const int64_t at = (first_part[t.seq] + t.part) * a.all_heads + t.h0 * a.g.group;
      a.attend_parts(t.seq, t.part, t.part + 1, t.h0, kv_count, scaled, scores, tops.data() + at,
                     sums.data() + at, parts_out.data() + at * a.g.dim);
    }
  });
  for (int64_t s = 0; s < seqs; ++s) {
    if (first_part[s] < 0) continue;
    const int64_t at = first_part[s] * a.all_heads;
    merge_parts(parts_out.data() + at * a.g.dim, tops.data() + at, sums.data() + at, a.part_count(s), a.all_heads,
                a.g.dim, out + s * a.all_heads * a.g.dim);
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& block_tables,
         const at::Tensor& context_lens, float scale, at::Tensor& out, int64_t window, float softcap) {
  const Geometry g{k_pool.size(1), k_pool.size(2), q.size(2), q.size(1) / k_pool.size(2), block_tables.size(1),
                   k_pool.size(3)};
  const Attention<T> a{g, (kPartTokens + g.block_size - 1) / g.block_size * g.block_size, g.kv_heads * g.group,
                       q.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2), scale,
                       k_pool.data_ptr<T>(), v_pool.data_ptr<T>(), block_tables.data_ptr<int64_t>(),
                       context_lens.data_ptr<int64_t>(), window, softcap};
  const int64_t seqs = q.size(0);
  if (seqs >= 2 * at::get_num_threads()) by_sequence(a, seqs, out.data_ptr<float>());
  else by_part(a, seqs, out.data_ptr<float>());
}

}  // namespace

void minivllm_native::paged_decode_attention_into(const at::Tensor& q, const at::Tensor& k_pool,
                                                  const at::Tensor& v_pool, const at::Tensor& block_tables,
                                                  const at::Tensor& context_lens, double scale, at::Tensor& out,
                                                  double softcap, int64_t window) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == q.sizes(),
              "expected a contiguous fp32 output ", q.sizes(), ", got ", out.sizes());
  TORCH_CHECK(softcap >= 0.0, "a soft cap must be positive (0: none), got ", softcap);
  TORCH_CHECK(window >= 0, "a sliding window of ", window, " keys: it must be at least 1 (0: none)");
  with_pool_type(k_pool, [&](auto element) {
    run<decltype(element)>(q, k_pool, v_pool, block_tables, context_lens, scale, out, window,
                           static_cast<float>(softcap));
  });
}

// Sliding-window attention (Mistral): each sequence attends to its last `window` keys, read from the block
// the window starts in; the table's slots before it are never read (freed blocks: core/block_manager.py).
static at::Tensor paged_decode_attention_window(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                                const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                                int64_t window) {
  TORCH_CHECK(window >= 1, "a sliding window of ", window, " keys: it must be at least 1");
  minivllm_native::check_decode_attention(q, k_pool, v_pool, block_tables, context_lens);
  at::Tensor out = at::empty(q.sizes(), q.options());
  minivllm_native::paged_decode_attention_into(q, k_pool, v_pool, block_tables, context_lens, scale, out, 0.0, window);
  return out;
}

at::Tensor minivllm_native::paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool,
                                                   const at::Tensor& v_pool, const at::Tensor& block_tables,
                                                   const at::Tensor& context_lens, double scale) {
  check_decode_attention(q, k_pool, v_pool, block_tables, context_lens);
  at::Tensor out = at::empty(q.sizes(), q.options());  // contiguous, whatever q's strides
  paged_decode_attention_into(q, k_pool, v_pool, block_tables, context_lens, scale, out);
  return out;
}

TORCH_LIBRARY_FRAGMENT(minivllm_native, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
  m.def("paged_decode_attention_window(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
        "Tensor context_lens, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm_native, CPU, m) {
  m.impl("paged_decode_attention", &minivllm_native::paged_decode_attention);
  m.impl("paged_decode_attention_window", &paged_decode_attention_window);
}

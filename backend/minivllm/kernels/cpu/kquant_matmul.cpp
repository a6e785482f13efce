// Products with GGUF's K-quant weights (Q4_K, Q5_K, Q6_K) read in their own super-blocks, as the file stores
// them: no re-rounding, no other copy (a Q4_K_M file's tensors dequantized to fp32 held 7x the bytes and ran
// at a fifth of llama.cpp's speed).
//
// Super-blocks of 256 weights, byte layouts as gguf-py's `quants` module reads them:
//   Q4_K (144 B): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of
//                 nibbles (bytes 32i..32i+31: sub-block 2i in the low nibbles, 2i+1 in the high ones);
//                 w = d*sc*q - dmin*m.
//   Q5_K (176 B): as Q4_K with 32 bytes of fifth bits after the scales (bit j of byte l: sub-block j, element l).
//   Q6_K (210 B): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16 weights), fp16 d;
//                 w = d*sc*(q-32).
//
// Activations as the 4-bit kernels take them (q8_matmul.cpp): int8 or int8x2 per block of 32 (here in input
// pair layout), or fp32 with the weights widened in registers (exact up to fp32 summation order).
//
// Q4_K, Q5_K and Q6_K parts whose rows come in eights are regrouped at load (kQ4Kx8, kQ5Kx8, kQ6Kx8; layouts in
// quant/kquant_groups.py): the integer loops then read four codes of eight rows per vector
// (kquant_features.inc). The numbers are the file's.
//
// A weight is one uint8 tensor: a 64-byte header, int32 [magic, parts, type0, rows0, type1, rows1, ...], then each
// part's rows of super-blocks back to back. Parts of different types stack by rows (a fused q|k|v whose v is
// Q6_K under a Q4_K q and k): one call, one output, and one tensor the decode step passes like any weight.
// Every output row is computed from its own activation row in one fixed order, so a row gets the same bits
// alone and in any batch.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace {

using namespace minivllm_native;

constexpr int64_t kSuper = 256;
enum KType { kQ4K = 0, kQ5K = 1, kQ6K = 2, kQ4Kx8 = 3, kQ6Kx8 = 4, kQ5Kx8 = 5 };
constexpr int64_t kSuperBytes[6] = {144, 176, 210, 148, 210, 180};  // per row
constexpr int64_t kGroupRows = 8;                               // grouped types (quant/kquant_groups.py)
constexpr int64_t group_super_bytes(int type) { return kGroupRows * kSuperBytes[type]; }  // a group's super-block
constexpr int64_t kGroupCodesAt = 160;   // kQ4Kx8, kQ5Kx8: after d, dmin, scales and mins
constexpr int64_t kGroupFifthAt = 1184;  // kQ5Kx8: after the nibbles
constexpr int64_t kGroup6CodesAt = 144;  // kQ6Kx8: after d and scales
constexpr int32_t kMagic = 0x4b515731;  // "1WQK": a K-quant weight's header
constexpr int64_t kHeaderBytes = 64;
constexpr int64_t kMaxParts = (kHeaderBytes / 4 - 2) / 2;
constexpr int kRowTile = 4;  // activation rows sharing one unpacked super-block
constexpr int64_t kChunkBytes = 16 * 1024;  // a chunk of activation rows stays in L1 over a task's features

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_K / Q5_K: the eight 6-bit scales and mins of a super-block's 12 bytes (llama.cpp's unpacking), as floats.
__attribute__((always_inline)) inline void scales_mins(const uint8_t* packed, __m256& sc, __m256& m) {
  uint32_t u[3], out[4];
  std::memcpy(u, packed, 12);
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  out[0] = u[0] & k6;                                      // scales 0-3: low 6 bits of bytes 0-3
  out[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);        // scales 4-7: low nibbles of 8-11, top bits of 0-3
  out[2] = u[1] & k6;                                      // mins 0-3: low 6 bits of bytes 4-7
  out[3] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);  // mins 4-7: high nibbles of 8-11, top bits of 4-7
  auto floats8 = [](uint32_t first, uint32_t second) {
    const __m128i bytes = _mm_set_epi32(0, 0, static_cast<int>(second), static_cast<int>(first));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  };
  sc = floats8(out[0], out[1]);
  m = floats8(out[2], out[3]);
}

// Eight unsigned bytes as floats.
__attribute__((always_inline)) inline __m256 bytes8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Q6_K: the sixteen int8 scales as floats (groups 0-7, 8-15).
__attribute__((always_inline)) inline void q6k_scales(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m128i* sc = reinterpret_cast<const __m128i*>(p);
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(sc)));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
}

// The same, and as int16 lanes for the pair layout: vector 2i + h holds group 4i + h's scale in its low 128 bits
// (block 2i's codes h*16..h*16+15) and group 4i + 2 + h's in its high ones (block 2i+1's): the order of
// vpmaddubsw's outputs over a pair's halves.
__attribute__((always_inline)) inline void q6k_pair_scales(const uint8_t* p, __m256& lo, __m256& hi,
                                                           __m256i (&scale16)[8]) {
  q6k_scales(p, lo, hi);
  const int8_t* sc = reinterpret_cast<const int8_t*>(p);
  _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i)
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h)
      scale16[2 * i + h] = _mm256_setr_m128i(_mm_set1_epi16(sc[4 * i + h]), _mm_set1_epi16(sc[4 * i + 2 + h]));
}

// A super-block's 256 codes as eight vectors of 32 unsigned bytes in input order (Q4_K 0..15, Q5_K 0..31,
// Q6_K 0..63, before its -32).
template <int TYPE>
__attribute__((always_inline)) inline void unpack_codes(const uint8_t* sb, __m256i (&u)[8]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (TYPE == kQ6K) {
    const __m256i two = _mm256_set1_epi8(0x30);  // a high pair, in place above the nibble
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load32(sb + 64 * h), l1 = load32(sb + 64 * h + 32), q = load32(sb + 128 + 32 * h);
      u[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(q, 4), two));
      u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(q, 2), two));
      u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(q, two));
      u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                     _mm256_and_si256(_mm256_srli_epi16(q, 2), two));
    }
  } else {
    const uint8_t* qs = sb + (TYPE == kQ5K ? 48 : 16);
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {
      const __m256i v = load32(qs + 32 * i);
      u[2 * i] = _mm256_and_si256(v, low4);
      u[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    if constexpr (TYPE == kQ5K) {
      const __m256i high = load32(sb + 16), one = _mm256_set1_epi8(1);
      _Pragma("GCC unroll 8") for (int b = 0; b < 8; ++b)
        u[b] = _mm256_or_si256(u[b], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, b), one), 4));
    }
  }
}

// Integer activations per row: codes (and int8x2 remainders) in the pair layout of q8_matmul.cpp (per 64 inputs,
// 32 bytes [block0 0..15, block1 0..15] then [block0 16..31, block1 16..31]), per block of 32 its scale and
// scale x code sum, per group of 16 (input order) scale x code sum (Q6_K's -32). Codes combine as 128 * q + r
// when split.
struct KActs {
  const int8_t* q = nullptr;
  const int8_t* r = nullptr;   // split only, else q (never read)
  const float* scale = nullptr;  // [rows, K/32]
  const float* sum32 = nullptr;  // [rows, K/32]
  const float* sum16 = nullptr;  // [rows, K/16]
};

// One block of 32 activations: x ~= amax / 127 * q (+ r / 128), the arithmetic of q8_matmul.cpp's quantize_block;
// q and r point at the block's place in the pair layout.
inline void quantize_block(const float* v, bool split, int8_t* q, int8_t* r, float* scale, float* sum32, float* sum16) {
  __m256 x[4];
  for (int j = 0; j < 4; ++j) x[j] = _mm256_loadu_ps(v + 8 * j);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 magnitude = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x[0]), _mm256_andnot_ps(sign, x[1])),
                                         _mm256_max_ps(_mm256_andnot_ps(sign, x[2]), _mm256_andnot_ps(sign, x[3])));
  const float amax = hmax(magnitude);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i codes[4], rest[4], combined[4];
  for (int j = 0; j < 4; ++j) {
    const __m256 scaled = _mm256_mul_ps(x[j], inv);
    codes[j] = combined[j] = _mm256_cvtps_epi32(scaled);
    if (split) {
      const __m256 left = _mm256_mul_ps(_mm256_sub_ps(scaled, _mm256_cvtepi32_ps(codes[j])), _mm256_set1_ps(128.f));
      rest[j] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(left), _mm256_set1_epi32(-127)),
                                 _mm256_set1_epi32(127));
      combined[j] = _mm256_add_epi32(_mm256_slli_epi32(codes[j], 7), rest[j]);
    }
  }
  store_halves(q, pack_bytes(codes));
  if (split) store_halves(r, pack_bytes(rest));
  const float unit = amax / 127.f / (split ? 128.f : 1.f);
  const int32_t first = hsum_epi32(_mm256_add_epi32(combined[0], combined[1]));
  const int32_t second = hsum_epi32(_mm256_add_epi32(combined[2], combined[3]));
  *scale = unit;
  sum16[0] = unit * static_cast<float>(first), sum16[1] = unit * static_cast<float>(second);
  *sum32 = unit * static_cast<float>(first + second);
}

// The rows quantized into a per-thread scratch buffer reused across calls (as q8_matmul.cpp's quantize_rows).
KActs quantize_rows(const at::Tensor& x, bool split) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock;
  const int64_t code_floats = rows * k / 4;  // K % 256 == 0: every row starts on a 64-byte line
  static thread_local std::vector<float> scratch;
  float* base = aligned_scratch(scratch, code_floats * (split ? 2 : 1) + rows * blocks * 4);
  int8_t* q = reinterpret_cast<int8_t*>(base);
  int8_t* r = split ? reinterpret_cast<int8_t*>(base + code_floats) : q;
  float* scale = base + code_floats * (split ? 2 : 1);
  float* sum32 = scale + rows * blocks;
  float* sum16 = sum32 + rows * blocks;
  const float* src = x.data_ptr<float>();
  at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t at = (i / 2) * 2 * kBlock + (i % 2) * 16;  // K % 64 == 0: pairs never straddle rows
      quantize_block(src + i * kBlock, split, q + at, r + at, scale + i, sum32 + i, sum16 + 2 * i);
    }
  });
  return KActs{q, r, scale, sum32, sum16};
}

int64_t chunk_rows(int64_t k, bool split) {
  const int64_t bytes_per_row = k * (split ? 2 : 1) + k / 2;  // codes (and remainders), then the three float arrays
  return std::max<int64_t>(kRowTile, kChunkBytes / bytes_per_row / kRowTile * kRowTile);
}

namespace avx2 {
#include "kquant_features.inc"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#define MINIVLLM_VNNI 1
namespace vnni {
#include "kquant_features.inc"
}  // namespace vnni
#undef MINIVLLM_VNNI
#pragma GCC pop_options

// ---- fp32 activations: the codes widened to floats in registers, exact up to fp32 summation order ----

// x [rows, K] and, for Q4_K / Q5_K's mins, each block of 32's sum [rows, K/32].
struct FActs {
  const float* x;
  const float* sum32;
};

FActs block_sums(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock;
  static thread_local std::vector<float> scratch;
  float* sums = aligned_scratch(scratch, rows * blocks);
  const float* src = x.data_ptr<float>();
  at::parallel_for(0, rows * blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* v = src + i * kBlock;
      sums[i] = hsum(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(v + 8)),
                                   _mm256_add_ps(_mm256_loadu_ps(v + 16), _mm256_loadu_ps(v + 24))));
    }
  });
  return FActs{src, sums};
}

// 32 codes (unsigned bytes, or signed for Q6_K after its -32) as four float vectors in order.
template <bool SIGNED>
__attribute__((always_inline)) inline void widen(__m256i u, __m256 (&f)[4]) {
  const __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
  auto cvt = [](__m128i v) {
    return _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
  };
  f[0] = cvt(lo), f[1] = cvt(_mm_srli_si128(lo, 8)), f[2] = cvt(hi), f[3] = cvt(_mm_srli_si128(hi, 8));
}

// One K-quant weight row against TILE fp32 activation rows: per block (Q6_K: per group of 16) the codes'
// product with x, times d*sc; Q4_K / Q5_K less dmin*m times the block's sum of x.
template <int TYPE, int TILE>
void kf_feature(const uint8_t* w, int64_t supers, const FActs& a, int64_t row, float* out, int64_t out_stride) {
  const int64_t k = supers * kSuper;
  const float* x[TILE];
  const float* sum32[TILE];
  _Pragma("GCC unroll 8") for (int t = 0; t < TILE; ++t) {
    x[t] = a.x + (row + t) * k;
    sum32[t] = a.sum32 + (row + t) * (k / kBlock);
  }
  __m256 acc[2][TILE];
  _Pragma("GCC unroll 8") for (int t = 0; t < TILE; ++t) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
  alignas(32) float factor[16];  // d*sc per block (Q4_K, Q5_K) or per group of 16 (Q6_K)
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* sb = w + s * kSuperBytes[TYPE];
    __m256i u[8];
    unpack_codes<TYPE>(sb, u);
    if constexpr (TYPE == kQ6K) {
      const __m256 d = _mm256_set1_ps(half_to_float(sb + 208));
      __m256 lo, hi;
      q6k_scales(sb + 192, lo, hi);
      _mm256_store_ps(factor, _mm256_mul_ps(d, lo));
      _mm256_store_ps(factor + 8, _mm256_mul_ps(d, hi));
      _Pragma("GCC unroll 8") for (int b = 0; b < 8; ++b) u[b] = _mm256_sub_epi8(u[b], _mm256_set1_epi8(32));
    } else {
      __m256 sc, m;
      scales_mins(sb + 4, sc, m);
      _mm256_store_ps(factor, _mm256_mul_ps(_mm256_set1_ps(half_to_float(sb)), sc));
      const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(half_to_float(sb + 2)), m);
      _Pragma("GCC unroll 8") for (int t = 0; t < TILE; ++t)
        acc[1][t] = _mm256_fnmadd_ps(dm, _mm256_loadu_ps(sum32[t] + 8 * s), acc[1][t]);
    }
    _Pragma("GCC unroll 2") for (int b = 0; b < 8; ++b) {
      __m256 f[4];
      widen<TYPE == kQ6K>(u[b], f);
      _Pragma("GCC unroll 8") for (int t = 0; t < TILE; ++t) {
        const float* v = x[t] + s * kSuper + b * kBlock;
        const __m256 first = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(v + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(v)));
        const __m256 second =
            _mm256_fmadd_ps(f[3], _mm256_loadu_ps(v + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(v + 16)));
        if constexpr (TYPE == kQ6K) {
          acc[b & 1][t] = _mm256_fmadd_ps(first, _mm256_broadcast_ss(factor + 2 * b), acc[b & 1][t]);
          acc[b & 1][t] = _mm256_fmadd_ps(second, _mm256_broadcast_ss(factor + 2 * b + 1), acc[b & 1][t]);
        } else {
          acc[b & 1][t] = _mm256_fmadd_ps(_mm256_add_ps(first, second), _mm256_broadcast_ss(factor + b), acc[b & 1][t]);
        }
      }
    }
  }
  _Pragma("GCC unroll 8") for (int t = 0; t < TILE; ++t)
    out[t * out_stride] = hsum(_mm256_add_ps(acc[0][t], acc[1][t]));
}

template <int TYPE>
void kf_features(const uint8_t* weights, int64_t supers, const FActs& a, int64_t rows, float* out, int64_t n,
                 int64_t begin, int64_t end) {
  const int64_t row_bytes = supers * kSuperBytes[TYPE];
  if (rows == 1) {
    const uint8_t* stop = weights + end * row_bytes;
    for (int64_t f = begin; f < end; ++f) {
      prefetch_ahead(weights + f * row_bytes, row_bytes, kPrefetchAhead, stop);
      kf_feature<TYPE, 1>(weights + f * row_bytes, supers, a, 0, out + f, n);
    }
    return;
  }
  const int64_t chunk = std::max<int64_t>(kRowTile, kChunkBytes / (supers * kSuper * 4) / kRowTile * kRowTile);
  for (int64_t first = 0; first < rows; first += chunk)
    for (int64_t f = begin; f < end; ++f) {
      const uint8_t* w = weights + f * row_bytes;
      over_row_tiles<kRowTile>(first, std::min(rows, first + chunk), [&](auto tile, int64_t row) {
        kf_feature<TYPE, decltype(tile)::value>(w, supers, a, row, out + row * n + f, n);
      });
    }
}

// A kQ4Kx8 group's eight rows back in the file's Q4_K layout (`rows_out`: 8 rows of supers * 144 bytes): the fp32
// loop reads rows one at a time, and regrouping costs it little next to its float products.
template <int TYPE>
void ungroup(const uint8_t* group, int64_t supers, uint8_t* rows_out) {
  constexpr int kFileType = TYPE == kQ5Kx8 ? kQ5K : kQ4K;
  constexpr int64_t kNibblesAt = TYPE == kQ5Kx8 ? 48 : 16;
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* src = group + s * group_super_bytes(TYPE);
    for (int64_t r = 0; r < kGroupRows; ++r) {
      uint8_t* dst = rows_out + (r * supers + s) * kSuperBytes[kFileType];
      std::memcpy(dst, src + 2 * r, 2);
      std::memcpy(dst + 2, src + 16 + 2 * r, 2);
      const uint8_t* sc = src + 32 + r;  // sub-block j's at sc[8 * j]
      const uint8_t* m = src + 96 + r;
      for (int j = 0; j < 4; ++j) {
        dst[4 + j] = static_cast<uint8_t>(sc[8 * j] | ((sc[8 * (4 + j)] >> 4) << 6));
        dst[8 + j] = static_cast<uint8_t>(m[8 * j] | ((m[8 * (4 + j)] >> 4) << 6));
        dst[12 + j] = static_cast<uint8_t>((sc[8 * (4 + j)] & 0x0F) | ((m[8 * (4 + j)] & 0x0F) << 4));
      }
      for (int64_t chunk = 0; chunk < 32; ++chunk)  // (pair i, four bytes g) = (chunk / 8, chunk % 8)
        std::memcpy(dst + kNibblesAt + 32 * (chunk / 8) + 4 * (chunk % 8), src + kGroupCodesAt + 32 * chunk + 4 * r, 4);
      if constexpr (TYPE == kQ5Kx8)  // fifth bits: the file's bit j of byte l, here bit l / 4 of sub-block j's byte l % 4
        for (int l = 0; l < 32; ++l) {
          uint8_t bits = 0;
          for (int j = 0; j < 8; ++j) bits |= static_cast<uint8_t>(((src[kGroupFifthAt + 32 * j + 4 * r + l % 4] >> (l / 4)) & 1) << j);
          dst[16 + l] = bits;
        }
    }
  }
}

// A kQ6Kx8 group's eight rows back in the file's Q6_K layout.
void ungroup6(const uint8_t* group, int64_t supers, uint8_t* rows_out) {
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* src = group + s * group_super_bytes(kQ6Kx8);
    for (int64_t r = 0; r < kGroupRows; ++r) {
      uint8_t* dst = rows_out + (r * supers + s) * kSuperBytes[kQ6K];
      std::memset(dst, 0, kSuperBytes[kQ6K]);
      std::memcpy(dst + 208, src + 2 * r, 2);
      for (int g = 0; g < 16; ++g) {
        dst[192 + g] = src[16 + 8 * g + r];
        const uint8_t* quad = src + kGroup6CodesAt + 96 * g;
        for (int c = 0; c < 4; ++c)
          for (int k = 0; k < 4; ++k) {
            const uint8_t nibbles = quad[(c / 2) * 32 + 4 * r + k];
            const int code = ((c % 2 ? nibbles >> 4 : nibbles) & 15) | (((quad[64 + 4 * r + k] >> (2 * c)) & 3) << 4);
            const int e = 16 * g + 4 * c + k, half = e / 128, l = e % 128, i = l / 32, ll = l % 32;
            dst[64 * half + (i % 2) * 32 + ll] |= static_cast<uint8_t>((code & 15) << (i / 2 * 4));
            dst[128 + 32 * half + ll] |= static_cast<uint8_t>((code >> 4) << (2 * i));
          }
      }
    }
  }
}

// The inverse of ungroup: eight Q4_K / Q5_K rows in the file's layout (`rows_in`: 8 rows of supers * 144 or
// 176 bytes) as one group (`group`, its super-blocks of 1,184 or 1,440 bytes). Scales and mins unpack as
// llama.cpp's get_scale_min_k4 does.
template <int TYPE>
void group_rows(const uint8_t* rows_in, int64_t supers, uint8_t* group) {
  constexpr int kFileType = TYPE == kQ5Kx8 ? kQ5K : kQ4K;
  constexpr int64_t kNibblesAt = TYPE == kQ5Kx8 ? 48 : 16;
  for (int64_t s = 0; s < supers; ++s) {
    uint8_t* dst = group + s * group_super_bytes(TYPE);
    if constexpr (TYPE == kQ5Kx8) std::memset(dst + kGroupFifthAt, 0, 8 * 32);
    for (int64_t r = 0; r < kGroupRows; ++r) {
      const uint8_t* src = rows_in + (r * supers + s) * kSuperBytes[kFileType];
      std::memcpy(dst + 2 * r, src, 2);
      std::memcpy(dst + 16 + 2 * r, src + 2, 2);
      const uint8_t* p = src + 4;  // 12 bytes of 6-bit scales and mins
      for (int j = 0; j < 4; ++j) {
        dst[32 + 8 * j + r] = p[j] & 63;
        dst[96 + 8 * j + r] = p[j + 4] & 63;
        dst[32 + 8 * (j + 4) + r] = static_cast<uint8_t>((p[j + 8] & 0x0F) | ((p[j] >> 6) << 4));
        dst[96 + 8 * (j + 4) + r] = static_cast<uint8_t>((p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4));
      }
      for (int64_t chunk = 0; chunk < 32; ++chunk)  // (pair i, four bytes g) = (chunk / 8, chunk % 8)
        std::memcpy(dst + kGroupCodesAt + 32 * chunk + 4 * r, src + kNibblesAt + 32 * (chunk / 8) + 4 * (chunk % 8), 4);
      if constexpr (TYPE == kQ5Kx8)  // the file's bit j of byte l to bit l / 4 of sub-block j's byte l % 4
        for (int l = 0; l < 32; ++l)
          for (int j = 0; j < 8; ++j)
            dst[kGroupFifthAt + 32 * j + 4 * r + l % 4] |= static_cast<uint8_t>(((src[16 + l] >> j) & 1) << (l / 4));
    }
  }
}

// The inverse of ungroup6: eight Q6_K rows in the file's layout as one kQ6Kx8 group.
void group6_rows(const uint8_t* rows_in, int64_t supers, uint8_t* group) {
  for (int64_t s = 0; s < supers; ++s) {
    uint8_t* dst = group + s * group_super_bytes(kQ6Kx8);
    std::memset(dst + kGroup6CodesAt, 0, 16 * 96);
    for (int64_t r = 0; r < kGroupRows; ++r) {
      const uint8_t* src = rows_in + (r * supers + s) * kSuperBytes[kQ6K];
      std::memcpy(dst + 2 * r, src + 208, 2);
      for (int g = 0; g < 16; ++g) {
        dst[16 + 8 * g + r] = src[192 + g];
        uint8_t* quad = dst + kGroup6CodesAt + 96 * g;
        for (int c = 0; c < 4; ++c)
          for (int k = 0; k < 4; ++k) {
            const int e = 16 * g + 4 * c + k, half = e / 128, l = e % 128, i = l / 32, ll = l % 32;
            const int low = (src[64 * half + (i % 2) * 32 + ll] >> (i / 2 * 4)) & 15;
            const int high = (src[128 + 32 * half + ll] >> (2 * i)) & 3;
            quad[(c / 2) * 32 + 4 * r + k] |= static_cast<uint8_t>(low << (c % 2 ? 4 : 0));
            quad[64 + 4 * r + k] |= static_cast<uint8_t>(high << (2 * c));
          }
      }
    }
  }
}

// A part's rows in the file's layout ([N, supers * file bytes], N in eights) regrouped into `out` as grouped
// type `type` (kQ4Kx8, kQ6Kx8 or kQ5Kx8), groups in parallel: at load, once per weight.
void kquant_regroup(const at::Tensor& rows, int64_t type, const at::Tensor& out) {
  TORCH_CHECK(type >= kQ4Kx8 && type <= kQ5Kx8, "kquant_regroup makes a grouped type (3, 4 or 5), got ", type);
  const int file_type = type == kQ4Kx8 ? kQ4K : type == kQ5Kx8 ? kQ5K : kQ6K;
  TORCH_CHECK(rows.scalar_type() == at::kByte && rows.dim() == 2 && rows.is_contiguous() &&
                  rows.size(0) % kGroupRows == 0 && rows.size(1) % kSuperBytes[file_type] == 0,
              "kquant_regroup: rows must be contiguous uint8 [N in eights, super-blocks of ", kSuperBytes[file_type],
              " bytes], got ", rows.sizes());
  const int64_t supers = rows.size(1) / kSuperBytes[file_type], groups = rows.size(0) / kGroupRows;
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.numel() == groups * supers * group_super_bytes(type),
              "kquant_regroup: out must be contiguous uint8 of ", groups * supers * group_super_bytes(type), " bytes");
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* in = src + g * kGroupRows * supers * kSuperBytes[file_type];
      uint8_t* group = dst + g * supers * group_super_bytes(type);
      if (type == kQ6Kx8) group6_rows(in, supers, group);
      else if (type == kQ4Kx8) group_rows<kQ4Kx8>(in, supers, group);
      else group_rows<kQ5Kx8>(in, supers, group);
    }
  });
}

template <int TYPE>
void kf_grouped_features(const uint8_t* weights, int64_t supers, const FActs& a, int64_t rows, float* out, int64_t n,
                         int64_t begin, int64_t end) {
  constexpr int kFileType = TYPE == kQ4Kx8 ? kQ4K : TYPE == kQ5Kx8 ? kQ5K : kQ6K;
  static thread_local std::vector<uint8_t> scratch;
  scratch.resize(kGroupRows * supers * kSuperBytes[kFileType]);
  for (int64_t f = begin; f < end; f += kGroupRows) {
    const uint8_t* group = weights + f / kGroupRows * supers * group_super_bytes(TYPE);
    if constexpr (TYPE == kQ6Kx8) ungroup6(group, supers, scratch.data());
    else ungroup<TYPE>(group, supers, scratch.data());
    kf_features<kFileType>(scratch.data(), supers, a, rows, out + f, n, 0, kGroupRows);
  }
}

void kf_part_features(int type, const uint8_t* weights, int64_t supers, const FActs& a, int64_t rows, float* out,
                      int64_t n, int64_t begin, int64_t end) {
  switch (type) {
    case kQ4Kx8: return kf_grouped_features<kQ4Kx8>(weights, supers, a, rows, out, n, begin, end);
    case kQ5Kx8: return kf_grouped_features<kQ5Kx8>(weights, supers, a, rows, out, n, begin, end);
    case kQ6Kx8: return kf_grouped_features<kQ6Kx8>(weights, supers, a, rows, out, n, begin, end);
    case kQ4K: return kf_features<kQ4K>(weights, supers, a, rows, out, n, begin, end);
    case kQ5K: return kf_features<kQ5K>(weights, supers, a, rows, out, n, begin, end);
    default: return kf_features<kQ6K>(weights, supers, a, rows, out, n, begin, end);
  }
}

struct KPart {
  const uint8_t* w;
  int64_t rows, first;  // its rows, and its first row in the whole weight (its output column)
  int type;
};

// Whether every part's rows come in groups of eight: tasks then split the features in whole groups.
bool all_in_groups(const std::vector<KPart>& parts) {
  return std::all_of(parts.begin(), parts.end(), [](const KPart& p) { return p.rows % kGroupRows == 0; });
}

// The weight's parts, read from its header and checked against its size for K inputs.
std::vector<KPart> parts_of(const at::Tensor& w, int64_t k) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 1 && w.numel() >= kHeaderBytes,
              "a K-quant weight must be a contiguous uint8 tensor: a header, then its parts' super-blocks; got ",
              w.sizes(), " ", w.scalar_type());
  const uint8_t* base = w.data_ptr<uint8_t>();
  int32_t header[kHeaderBytes / 4];
  std::memcpy(header, base, kHeaderBytes);
  TORCH_CHECK(header[0] == kMagic && header[1] >= 1 && header[1] <= kMaxParts, "not a K-quant weight's header");
  std::vector<KPart> parts;
  int64_t offset = kHeaderBytes, first = 0;
  for (int32_t i = 0; i < header[1]; ++i) {
    const int32_t type = header[2 + 2 * i], rows = header[3 + 2 * i];
    TORCH_CHECK(type >= kQ4K && type <= kQ5Kx8 && rows > 0, "unknown K-quant type ", type, " (or no rows) in part ", i);
    TORCH_CHECK(type < kQ4Kx8 || (rows % kGroupRows == 0 && first % kGroupRows == 0),
                "a grouped part must start and end on a group of ", kGroupRows, " rows (part ", i, ")");
    parts.push_back(KPart{base + offset, rows, first, type});
    offset += rows * (k / kSuper) * kSuperBytes[type], first += rows;
  }
  TORCH_CHECK(offset == w.numel(), "K-quant weight of ", w.numel(), " bytes; its header and K=", k, " say ", offset);
  // tasks split a weight with grouped parts in whole groups: every part's rows must come in them
  TORCH_CHECK(all_in_groups(parts) || std::none_of(parts.begin(), parts.end(), [](const KPart& p) { return p.type >= kQ4Kx8; }),
              "a weight with grouped parts must have every part's rows in groups of ", kGroupRows);
  return parts;
}

void check_kquant(const at::Tensor& x, int64_t acts) {
  check_activations(x, kSuper);
  TORCH_CHECK(acts >= 0 && acts <= 2, "activation precision must be 0 (int8), 1 (int8x2) or 2 (fp32), got ", acts);
}

at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t acts) {
  check_kquant(x, acts);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  kquant_linear_into(x, w, acts, out);
  return out;
}

}  // namespace

int64_t minivllm_native::kquant_rows(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 1 && w.numel() >= kHeaderBytes, "not a K-quant weight");
  int32_t header[kHeaderBytes / 4];
  std::memcpy(header, w.data_ptr<uint8_t>(), kHeaderBytes);
  TORCH_CHECK(header[0] == kMagic && header[1] >= 1 && header[1] <= kMaxParts, "not a K-quant weight's header");
  int64_t rows = 0;
  for (int32_t i = 0; i < header[1]; ++i) rows += header[3 + 2 * i];
  return rows;
}

void minivllm_native::kquant_linear_into(const at::Tensor& x, const at::Tensor& w, int64_t acts, at::Tensor& out) {
  check_kquant(x, acts);
  const int64_t rows = x.size(0), supers = x.size(1) / kSuper;
  const std::vector<KPart> parts = parts_of(w, x.size(1));
  const int64_t n = parts.back().first + parts.back().rows;
  check_output(out, rows, n);
  float* o = out.data_ptr<float>();
  const bool vnni_on = vnni_kernels_on();
  const FActs f = acts == 2 ? block_sums(x) : FActs{};
  const KActs a = acts == 2 ? KActs{} : quantize_rows(x, acts == 1);
  // Tasks split the features in whole groups of eight where every part has them: a grouped part is never cut.
  const int64_t unit = all_in_groups(parts) ? kGroupRows : 1;
  at::parallel_for(0, n / unit, kFeatureGrain / unit, [&](int64_t first_unit, int64_t last_unit) {
    const int64_t begin = first_unit * unit, end = last_unit * unit;
    for (const KPart& p : parts) {
      const int64_t lo = std::max(begin, p.first), hi = std::min(end, p.first + p.rows);
      if (lo >= hi) continue;
      float* part_out = o + p.first;
      if (acts == 2)
        kf_part_features(p.type, p.w, supers, f, rows, part_out, n, lo - p.first, hi - p.first);
      else if (acts == 1)
        (vnni_on ? vnni::kq_part_features<true> : avx2::kq_part_features<true>)(p.type, p.w, supers, a, rows, part_out,
                                                                               n, lo - p.first, hi - p.first);
      else
        (vnni_on ? vnni::kq_part_features<false> : avx2::kq_part_features<false>)(
            p.type, p.w, supers, a, rows, part_out, n, lo - p.first, hi - p.first);
    }
  });
}

TORCH_LIBRARY_FRAGMENT(minivllm_native, m) {
  m.def("kquant_linear(Tensor x, Tensor w, int n, int acts) -> Tensor");
  m.def("kquant_regroup(Tensor rows, int type, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(minivllm_native, CPU, m) {
  m.impl("kquant_linear", &kquant_linear);
  m.impl("kquant_regroup", &kquant_regroup);
}

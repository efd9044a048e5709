// Paged decode attention on the CPU: one query token per sequence, read straight from the block tables.
//
// The torch path gathers every sequence's K/V into a padded copy per layer and runs a masked SDPA; this kernel
// reads each key and value once, in place, for all the query heads that share it (GQA/MQA), and never
// touches padding. Parallel over (sequence, kv head).
//
//   q, out:            [num_seqs, num_heads, head_dim]
//   k_cache, v_cache:  [num_blocks, block_size, num_kv_heads, head_dim]   (any strides in the first three dims);
//                      int8: [..., head_dim + 4], each row's values q then its float32 scale s, read as s q
//   block_tables:      [num_seqs, max_blocks] int32
//   seq_lens:          [num_seqs] int32, context length including the query token
//   window:            0, or a sliding window: the query (at position seq_len - 1) sees its last `window` keys
//
//   token t of sequence b lives at block_tables[b][t / block_size], offset t % block_size.
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <vector>

namespace pagedllm {
namespace {

// The vector paths below keep key and value rows, and the group's sums, in registers: for a fixed head size and
// group, over a bf16, float or int8 cache. Their vectors: 16 float lanes in a zmm with AVX-512 (32 registers), 8 in
// a ymm with AVX2 and FMA (16 registers). An int8 row's scale s multiplies its score (s q.k for q.(s k)) and its
// value's weight (p s for p times s v): one multiply a row rather than one a value.
#if defined(__AVX512F__)
using vfloat = __m512;
constexpr int64_t kLanes = 16;
constexpr int64_t kMaxAccumulators = 16;  // of a step's sums: half the registers
#elif defined(__AVX2__) && defined(__FMA__)
using vfloat = __m256;
constexpr int64_t kLanes = 8;
constexpr int64_t kMaxAccumulators = 12;  // of 16 registers: the rest hold a row's vector and the weights
#else
constexpr int64_t kLanes = 0;  // no vector path
#endif

template <typename cache_t, int64_t kHeadDim, int64_t kGroup>
constexpr bool kVectorPath = kLanes > 0 && kHeadDim > 0 && kHeadDim % kLanes == 0 && kGroup > 0 &&
                             (std::is_same_v<cache_t, float> || std::is_same_v<cache_t, c10::BFloat16> ||
                              std::is_same_v<cache_t, int8_t>);

// The bytes of one cached row of head_dim values: an int8 row's float32 scale follows its values.
template <typename cache_t>
constexpr int64_t row_bytes_of(int64_t head_dim) {
  return head_dim * static_cast<int64_t>(sizeof(cache_t)) + (std::is_same_v<cache_t, int8_t> ? 4 : 0);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Keys scored together before their sums are reduced: four (one tree of adds per query head) while their
// 4 x kGroup accumulators fit in registers, else one.
constexpr int64_t keys_per_step(int64_t group) { return 4 * group <= kMaxAccumulators ? 4 : 1; }

// Values accumulated per pass over a block: the most vectors of the output row, dividing it, whose kGroup copies
// fit in the accumulators' registers; larger heads or groups take several passes over each value row.
constexpr int64_t vectors_per_pass(int64_t head_dim, int64_t group) {
  int64_t vecs = head_dim / kLanes;
  while (vecs > 1 && (group * vecs > kMaxAccumulators || (head_dim / kLanes) % vecs != 0)) --vecs;
  return vecs;
}
#endif

// Blocks ahead of the reads whose rows are asked for: the block table scatters blocks where no hardware
// prefetcher looks, and a block's rows of one kv head (8 of 128 bytes for SmolLM2, together in the engine's
// head-major pool: pool_view) take a few hundred cycles to use. Towards L2, eight blocks ahead: on the AMX Xeon four ahead ran ~1.07x faster than towards L1 two
// ahead over SmolLM2's 30 layers at 50 sequences (L1's fill buffers are few), two ahead ~1.2x faster than one, six
// or eight no better than four; on a Zen 4, 32 sequences of 350 tokens 10.8 ms against four ahead's 11.8 (medians
// of three), four sequences 1.1-1.2 against 1.3-1.4, sixteen ahead no better.
constexpr int64_t kPrefetchBlocks = 8;

// Ask for the cache lines of n rows of row_bytes, `stride` elements apart (one kv head's rows of a block).
template <typename cache_t>
inline void prefetch_rows(const cache_t* row, int64_t stride, int64_t n, int64_t row_bytes) {
  for (int64_t t = 0; t < n; ++t, row += stride) {
    const char* bytes = reinterpret_cast<const char*>(row);
    for (int64_t offset = 0; offset < row_bytes; offset += 64) prefetch_line<1>(bytes + offset);
  }
}

// Walk kv head h's keys (kValues: its values) at positions [first, len) block by block: body(first row, start, stop)
// for each block's part of them, once the rows kPrefetchBlocks blocks ahead are asked for.
template <bool kValues, typename cache_t, typename Body>
inline void for_each_block(const PagedCache<cache_t>& cache, const int32_t* table, int64_t h, int64_t first,
                           int64_t len, int64_t head_dim, Body&& body) {
  const auto first_row = [&](int64_t pos) { return kValues ? cache.value(table, pos, h) : cache.key(table, pos, h); };
  const int64_t stride = kValues ? cache.v_token : cache.k_token;
  const int64_t row_bytes = row_bytes_of<cache_t>(head_dim), bs = cache.block_size;
  for (int64_t start = first, stop; start < len; start = stop) {
    stop = std::min(len, (start / bs + 1) * bs);
    const int64_t ahead = start + kPrefetchBlocks * bs;
    if (ahead < len) prefetch_rows(first_row(ahead), stride, std::min(len, (ahead / bs + 1) * bs) - ahead, row_bytes);
    body(first_row(start), start, stop);
  }
}

// Ask for the rows of kv head h's keys (kValues: values) in the first kPrefetchBlocks blocks from `first`: what
// for_each_block reads before its own requests ahead have landed.
template <bool kValues, typename cache_t>
inline void prefetch_first_blocks(const PagedCache<cache_t>& cache, const int32_t* table, int64_t h, int64_t first,
                                  int64_t len, int64_t head_dim) {
  const int64_t stride = kValues ? cache.v_token : cache.k_token, bs = cache.block_size;
  const int64_t row_bytes = row_bytes_of<cache_t>(head_dim);
  const int64_t end = std::min(len, (first / bs + kPrefetchBlocks) * bs);
  for (int64_t start = first, stop; start < end; start = stop) {
    stop = std::min(end, (start / bs + 1) * bs);
    prefetch_rows(kValues ? cache.value(table, start, h) : cache.key(table, start, h), stride, stop - start, row_bytes);
  }
}

#if defined(__AVX512F__)
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline float vsum(vfloat v) { return _mm512_reduce_add_ps(v); }
// A vector of cached values as floats: bf16 widened by a shift, int8 sign-extended and converted (unscaled).
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline vfloat vload(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline vfloat vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// The low and high eight lanes added.
inline __m256 halves(vfloat v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline vfloat vload(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline vfloat vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float vsum(vfloat v) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}
#endif

#if defined(__AVX512F__)
// The sums of the lanes of a, b, c and d, in that order: a tree of adds instead of four full reductions. Within
// each 128-bit lane first (unpacks, no hadd), then across the four lanes.
inline __m128 sum4(vfloat a, vfloat b, vfloat c, vfloat d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d ab_pairs = _mm512_castps_pd(ab), cd_pairs = _mm512_castps_pd(cd);
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab_pairs, cd_pairs)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(ab_pairs, cd_pairs)));  // a b c d a lane
  const __m256 half = halves(abcd);
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m128 sum4(vfloat a, vfloat b, vfloat c, vfloat d) {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // lanes: a b c d of the low 128 bits, then of the high ones
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))

// Lane sums of key `key`'s products with each query head of the group: q_g . k in kLanes partial sums. With
// AVX512-BF16 a bf16 key multiplies the bf16 query pairs as they are (vdpbf16ps), else both as floats, one vector
// of the key at a time (the query rows are read from memory, where they stay in L1).
template <typename cache_t, int64_t kHeadDim, int64_t kGroup>
inline void key_products(const cache_t* key, const float* qf, const c10::BFloat16* q, vfloat (&acc)[kGroup]) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<cache_t, c10::BFloat16> && kHeadDim % 32 == 0) {
    __m512bh k[kHeadDim / 32];
#pragma GCC unroll 8
    for (int64_t c = 0; c < kHeadDim / 32; ++c) k[c] = (__m512bh)_mm512_loadu_si512(key + 32 * c);
#pragma GCC unroll 8
    for (int64_t g = 0; g < kGroup; ++g) {
      acc[g] = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int64_t c = 0; c < kHeadDim / 32; ++c) {
        acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)_mm512_loadu_si512(q + g * kHeadDim + 32 * c), k[c]);
      }
    }
    return;
  }
#endif
#pragma GCC unroll 8
  for (int64_t g = 0; g < kGroup; ++g) acc[g] = vzero();
#pragma GCC unroll 16
  for (int64_t c = 0; c < kHeadDim / kLanes; ++c) {
    const vfloat k = vload(key + kLanes * c);
#pragma GCC unroll 8
    for (int64_t g = 0; g < kGroup; ++g) acc[g] = vfma(k, vload(qf + g * kHeadDim + kLanes * c), acc[g]);
  }
}
#endif

// scores[g * len + t] = scale * q_g . k_t for the n keys of one block that start at `key` (`key_stride` apart).
// qf: the group's query rows as floats; q: the same rows as stored (read by the bf16 dot products).
template <typename scalar_t, typename cache_t, int64_t kHeadDim, int64_t kGroup>
inline void block_scores(const cache_t* key, int64_t key_stride, int64_t n, const float* qf, const scalar_t* q,
                         int64_t group, int64_t head_dim, float scale, float* scores, int64_t len) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if constexpr (kVectorPath<cache_t, kHeadDim, kGroup>) {
    const auto* q_bf16 = reinterpret_cast<const c10::BFloat16*>(q);  // read only when cache_t (= scalar_t) is bf16
    int64_t t = 0;
    if constexpr (keys_per_step(kGroup) == 4) {
      const __m128 scale4 = _mm_set1_ps(scale);
      for (; t + 4 <= n; t += 4) {  // four keys, then one tree of adds per query head
        vfloat acc[4][kGroup];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          key_products<cache_t, kHeadDim, kGroup>(key + (t + i) * key_stride, qf, q_bf16, acc[i]);
        }
        __m128 scales = scale4;
        if constexpr (std::is_same_v<cache_t, int8_t>) {  // each key's own scale too
          const auto row_scale_at = [&](int i) { return row_scale(key + (t + i) * key_stride, kHeadDim); };
          scales = _mm_mul_ps(scales, _mm_setr_ps(row_scale_at(0), row_scale_at(1), row_scale_at(2), row_scale_at(3)));
        }
#pragma GCC unroll 8
        for (int64_t g = 0; g < kGroup; ++g) {
          _mm_storeu_ps(scores + g * len + t, _mm_mul_ps(sum4(acc[0][g], acc[1][g], acc[2][g], acc[3][g]), scales));
        }
      }
    }
    for (; t < n; ++t) {
      vfloat acc[kGroup];
      const cache_t* row = key + t * key_stride;
      key_products<cache_t, kHeadDim, kGroup>(row, qf, q_bf16, acc);
      const float row_scaled = scale * row_scale(row, kHeadDim);
#pragma GCC unroll 8
      for (int64_t g = 0; g < kGroup; ++g) scores[g * len + t] = vsum(acc[g]) * row_scaled;
    }
    return;
  }
#endif
  float row[kHeadDim > 0 ? kHeadDim : 1];
  std::vector<float> row_heap(kHeadDim > 0 ? 0 : head_dim);
  float* k = kHeadDim > 0 ? row : row_heap.data();
  for (int64_t t = 0; t < n; ++t, key += key_stride) {
    load_row(key, k, head_dim);
    for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(qf + g * head_dim, k, head_dim) * scale;
  }
}

// exp(s - m) in place over a row of scores, m their max; returns their sum.
inline float exp_and_sum(float* s, int64_t n, float& m) {
  const float max = m = max_of(s, n);  // a local: GCC left the loop over `m`, which s might alias, scalar (a third
#pragma omp simd                       // of the kernel's time on SmolLM2's shapes)
  for (int64_t t = 0; t < n; ++t) s[t] = exp_approx(s[t] - max);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) sum += s[t];
  return sum;
}

// acc[g] = sum over positions [first, len) of p[g * n + t - first] v_t (n = len - first), walking the block table.
template <typename cache_t, int64_t kHeadDim, int64_t kGroup>
inline void weighted_values(const PagedCache<cache_t>& cache, const int32_t* table, int64_t h, int64_t first,
                            int64_t len, const float* p, int64_t group, int64_t head_dim, float* acc) {
  const int64_t n = len - first;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if constexpr (kVectorPath<cache_t, kHeadDim, kGroup>) {
    constexpr int64_t kVecs = vectors_per_pass(kHeadDim, kGroup);
    for (int64_t col = 0; col < kHeadDim; col += kLanes * kVecs) {  // columns [col, col + kLanes kVecs)
      vfloat o[kGroup][kVecs];
#pragma GCC unroll 16
      for (int64_t i = 0; i < kGroup * kVecs; ++i) o[i / kVecs][i % kVecs] = vzero();
      for_each_block<true>(cache, table, h, first, len, head_dim, [&](const cache_t* value, int64_t start, int64_t stop) {
        for (int64_t t = start; t < stop; ++t, value += cache.v_token) {
          vfloat pg[kGroup];  // the group's weights of this value, then its vectors one at a time
          const float s = row_scale(value, kHeadDim);
#pragma GCC unroll 8
          for (int64_t g = 0; g < kGroup; ++g) pg[g] = vset1(p[g * n + t - first] * s);
#pragma GCC unroll 8
          for (int64_t c = 0; c < kVecs; ++c) {
            const vfloat v = vload(value + col + kLanes * c);
#pragma GCC unroll 8
            for (int64_t g = 0; g < kGroup; ++g) o[g][c] = vfma(pg[g], v, o[g][c]);
          }
        }
      });
#pragma GCC unroll 16
      for (int64_t i = 0; i < kGroup * kVecs; ++i) {
        vstore(acc + (i / kVecs) * kHeadDim + col + kLanes * (i % kVecs), o[i / kVecs][i % kVecs]);
      }
    }
    return;
  }
#endif
  float row[kHeadDim > 0 ? kHeadDim : 1];
  std::vector<float> row_heap(kHeadDim > 0 ? 0 : head_dim);
  float* v = kHeadDim > 0 ? row : row_heap.data();
  // With a fixed size the sums live in a local array, which the compiler keeps in registers where they fit
  // (`acc` might alias `p`, so every update to it would go to memory).
  constexpr bool kFixed = kHeadDim > 0 && kGroup > 0;
  float sums_fixed[kFixed ? kGroup * kHeadDim : 1];
  float* sums = kFixed ? sums_fixed : acc;
  std::fill(sums, sums + group * head_dim, 0.f);
  for_each_block<true>(cache, table, h, first, len, head_dim, [&](const cache_t* value, int64_t start, int64_t stop) {
    for (int64_t t = start; t < stop; ++t, value += cache.v_token) {
      load_row(value, v, head_dim);
      for (int64_t g = 0; g < group; ++g) {
        const float pg = p[g * n + t - first];
        float* a = sums + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += pg * v[d];
      }
    }
  });
  if (kFixed) std::copy(sums, sums + group * head_dim, acc);
}

#if defined(__AVX512BF16__)
// weighted_values' pair path, for a bf16 cache whose head size is whole registers of bf16 (32 dims): two keys per
// `vdpbf16ps`, their value rows interleaved word by word against their two weights, rounded to bf16 as the prefill
// kernel rounds p. A quarter of the float path's instructions: no widening shifts, half the multiply-adds.
template <typename cache_t, int64_t kHeadDim, int64_t kGroup>
constexpr bool kValuePairs = std::is_same_v<cache_t, c10::BFloat16> && kHeadDim > 0 && kHeadDim % 32 == 0 &&
                             kGroup > 0 && vectors_per_pass(kHeadDim, kGroup) % 2 == 0;

// o += the weighted values of keys i and i + 1 (offsets from `first`; i even) from rows a and b, or (kAlone) of key
// i alone from a (b = a), its word's other weight cleared. A function, not a lambda: GCC kept a lambda's captured
// sums in memory.
template <int64_t kGroup, int64_t kChunks, bool kAlone>
inline void add_value_pair(const c10::BFloat16* a, const c10::BFloat16* b, const uint32_t* words,
                           int64_t word_stride, int64_t i, __m512 (&o)[kGroup][kChunks][2]) {
  __m512bh w[kGroup];
#pragma GCC unroll 8
  for (int64_t g = 0; g < kGroup; ++g) {
    uint32_t word = words[g * word_stride + i / 2];
    if constexpr (kAlone) word = i % 2 ? word >> 16 : word & 0xFFFFu;
    w[g] = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(word)));
  }
#pragma GCC unroll 8
  for (int64_t c = 0; c < kChunks; ++c) {
    const __m512i va = _mm512_loadu_si512(a + 32 * c), vb = _mm512_loadu_si512(b + 32 * c);
    const __m512bh lo = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(va, vb));
    const __m512bh hi = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(va, vb));
#pragma GCC unroll 8
    for (int64_t g = 0; g < kGroup; ++g) {
      o[g][c][0] = _mm512_dpbf16_ps(o[g][c][0], lo, w[g]);
      o[g][c][1] = _mm512_dpbf16_ps(o[g][c][1], hi, w[g]);
    }
  }
}

// weighted_values with p_bf16 (kGroup rows of bf16 weights, `stride` apart: round_rows_to_bf16). Pairs of keys
// start at even offsets from `first`, so that a pair's weights are one word; a key left alone (a sequence's last,
// or each key with one-token blocks) takes its word with the partner's weight cleared. The interleaved rows put
// dims 8l..8l+3 of each 32 in 128-bit lane l of one sum and dims 8l+4..8l+7 in the other's: put back in order as
// they are stored.
template <int64_t kHeadDim, int64_t kGroup>
inline void weighted_value_pairs(const PagedCache<c10::BFloat16>& cache, const int32_t* table, int64_t h,
                                 int64_t first, int64_t len, const c10::BFloat16* p_bf16, int64_t stride,
                                 float* acc) {
  constexpr int64_t kChunks = vectors_per_pass(kHeadDim, kGroup) / 2;  // of 32 dims a pass
  const auto* words = reinterpret_cast<const uint32_t*>(p_bf16);
  const int64_t word_stride = stride / 2, step = cache.v_token;
  const __m512i in_order_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i in_order_hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t col = 0; col < kHeadDim; col += 32 * kChunks) {
    __m512 o[kGroup][kChunks][2];
#pragma GCC unroll 8
    for (int64_t g = 0; g < kGroup; ++g) {
#pragma GCC unroll 8
      for (int64_t c = 0; c < kChunks; ++c) o[g][c][0] = o[g][c][1] = _mm512_setzero_ps();
    }
    for_each_block<true>(cache, table, h, first, len, kHeadDim,
                         [&](const c10::BFloat16* value, int64_t start, int64_t stop) {
      value += col;
      int64_t t = start;
      if ((t - first) % 2) {  // a block after one of odd length from `first`
        add_value_pair<kGroup, kChunks, true>(value, value, words, word_stride, t - first, o);
        ++t;
        value += step;
      }
      for (; t + 2 <= stop; t += 2, value += 2 * step) {
        add_value_pair<kGroup, kChunks, false>(value, value + step, words, word_stride, t - first, o);
      }
      if (t < stop) add_value_pair<kGroup, kChunks, true>(value, value, words, word_stride, t - first, o);
    });
#pragma GCC unroll 16
    for (int64_t i = 0; i < kGroup * kChunks; ++i) {
      const int64_t g = i / kChunks, c = i % kChunks;
      float* dst = acc + g * kHeadDim + col + 32 * c;
      _mm512_storeu_ps(dst, _mm512_permutex2var_ps(o[g][c][0], in_order_lo, o[g][c][1]));
      _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(o[g][c][0], in_order_hi, o[g][c][1]));
    }
  }
}
#endif

// kHeadDim > 0 and kGroup > 0 fix the head size and the query heads per kv head at compile time, so that the
// per-key loops unroll into straight vector code; 0 takes the value from the tensors. cache_t is scalar_t, or
// int8_t for an int8 cache.
// With a sliding window, sequence b's row reads its keys from max(0, len - window) on.
// With a prefix state (cascade attention), sequence b's row reads only its keys from prefix->prefix_len on, and its
// softmax continues from that state: out = (e^(m' - M) acc' + e^(m - M) acc) / (e^(m' - M) l' + e^(m - M) l), M the
// larger max.
template <typename scalar_t, typename cache_t, int64_t kHeadDim, int64_t kGroup>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                           const float* alibi, const float* sinks, const SoftmaxState* prefix) {
  const PagedCache<cache_t> cache(k_cache, v_cache, block_tables, seq_lens);
  const int64_t num_seqs = q.size(0), num_heads = q.size(1);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : q.size(2);
  const int64_t num_kv_heads = cache.num_kv_heads;
  const int64_t group = kGroup > 0 ? kGroup : num_heads / num_kv_heads;
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t after_prefix = prefix ? prefix->prefix_len : 0;

  // The (sequence, kv head) tasks, dealt by parallel_units: a thread takes its own range's tasks in order (a
  // sequence's kv heads one after another, whose rows share cache lines' neighbours), then the others' from their
  // ends, so that neither thread waits while the other reads longer contexts or runs slower.
  parallel_units(num_seqs * num_kv_heads, at::get_num_threads(), [&](const auto& take) {
    // A row's output: acc * own + (with a prefix) the prefix's acc * prefix_weight.
    std::vector<float> qf(group * head_dim), scores, acc(group * head_dim), own(group), prefix_weight(group);
    std::vector<c10::BFloat16> p_bf16;  // the pair path's weights
    for (int64_t task; (task = take()) >= 0;) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = cache.seq_lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : after_prefix, n = len - first;
      const int32_t* table = cache.table(b);
      const int64_t row = b * num_heads + h * group;  // the group's first row of q, out and the prefix state
      const scalar_t* q_group = q_ptr + row * head_dim;
      load_row(q_group, qf.data(), group * head_dim);
      scores.resize(group * n);
      prefetch_first_blocks<false>(cache, table, h, first, len, head_dim);
      // Scores: [group, n], walking the block table one block at a time.
      for_each_block<false>(cache, table, h, first, len, head_dim,
                            [&](const cache_t* key, int64_t start, int64_t stop) {
        block_scores<scalar_t, cache_t, kHeadDim, kGroup>(key, cache.k_token, stop - start, qf.data(), q_group, group,
                                                          head_dim, static_cast<float>(scale),
                                                          scores.data() + start - first, n);
      });
      prefetch_first_blocks<true>(cache, table, h, first, len, head_dim);
      if (softcap > 0) soft_cap(scores.data(), group * n, static_cast<float>(softcap));
      if (alibi) {  // key first + j sits first + j - (len - 1) after the row
        for (int64_t g = 0; g < group; ++g) {
          const float slope = alibi[h * group + g];
          float* s = scores.data() + g * n;
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) s[j] += slope * static_cast<float>(first + j - (len - 1));
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float m;
        const float sum = exp_and_sum(scores.data() + g * n, n, m);
        if (!prefix) {
          own[g] = 1.f / (sum + sink_term(sinks, h * group + g, m));
          continue;
        }
        const float m_prefix = prefix->max[row + g], m_both = std::max(m, m_prefix);
        const float w_prefix = exp_approx(m_prefix - m_both), w_own = exp_approx(m - m_both);
        const float inv =
            1.f / (prefix->sum[row + g] * w_prefix + sum * w_own + sink_term(sinks, h * group + g, m_both));
        own[g] = w_own * inv;
        prefix_weight[g] = w_prefix * inv;
      }
#if defined(__AVX512BF16__)
      if constexpr (kValuePairs<cache_t, kHeadDim, kGroup>) {
        const int64_t stride = (n + 31) / 32 * 32;
        p_bf16.resize(kGroup * stride);
        round_rows_to_bf16(scores.data(), kGroup, n, stride, p_bf16.data());
        weighted_value_pairs<kHeadDim, kGroup>(cache, table, h, first, len, p_bf16.data(), stride, acc.data());
      } else  // the float path
#endif
      weighted_values<cache_t, kHeadDim, kGroup>(cache, table, h, first, len, scores.data(), group, head_dim,
                                                 acc.data());
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* o = out_ptr + (row + g) * head_dim;
        const float* a = acc.data() + g * head_dim;
        if (prefix) {
          const float* a_prefix = prefix->acc.get() + (row + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) {
            o[d] = static_cast<scalar_t>(a[d] * own[g] + a_prefix[d] * prefix_weight[g]);
          }
        } else {
          for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(a[d] * own[g]);
        }
      }
    }
  });
}

// The group sizes of common GQA models (MHA = 1, SmolLM2 = 3, Llama 3 and Mistral = 4, TinyLlama = 8, ...).
template <typename scalar_t, typename cache_t, int64_t kHeadDim>
void dispatch_group(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                    double scale, int64_t window, double softcap, const float* alibi, const float* sinks,
                    const SoftmaxState* prefix) {
#define PAGEDLLM_GROUP(G) \
  case G: return decode_attention_impl<scalar_t, cache_t, kHeadDim, G>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, alibi, sinks, prefix);
  switch (q.size(1) / k_cache.size(2)) {
    PAGEDLLM_GROUP(1) PAGEDLLM_GROUP(2) PAGEDLLM_GROUP(3) PAGEDLLM_GROUP(4)
    PAGEDLLM_GROUP(6) PAGEDLLM_GROUP(7) PAGEDLLM_GROUP(8)
    default: return decode_attention_impl<scalar_t, cache_t, kHeadDim, 0>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, alibi, sinks, prefix);
  }
#undef PAGEDLLM_GROUP
}

}  // namespace

void decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                      at::Tensor block_tables, at::Tensor seq_lens, double scale, int64_t window, double softcap,
                      const c10::optional<at::Tensor>& alibi_slopes, const c10::optional<at::Tensor>& sinks) {
  decode_attention_after_prefix(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap,
                                head_data(alibi_slopes, q, "ALiBi's slopes"), head_data(sinks, q, "sinks"), nullptr);
}

void decode_attention_after_prefix(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                                   const float* alibi, const float* sinks, const SoftmaxState* prefix) {
  TORCH_CHECK(!(alibi && prefix), "ALiBi never runs with a cascade's prefix");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "q and out must be contiguous");
  TORCH_CHECK(window >= 0 && !(window > 0 && prefix), "a sliding window of ", window,
              " keys (0: none), never with a cascade's prefix");
  TORCH_CHECK(softcap >= 0, "softcap must be 0 (none) or positive, not ", softcap);
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "the head dim of the caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "block_tables and seq_lens must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    dispatch_cache<scalar_t>(q, k_cache, v_cache, [&]<typename cache_t>() {
      switch (q.size(2)) {
        case 64:
          return dispatch_group<scalar_t, cache_t, 64>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window,
                                                       softcap, alibi, sinks, prefix);
        case 128:
          return dispatch_group<scalar_t, cache_t, 128>(out, q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                        window, softcap, alibi, sinks, prefix);
        case 256:  // Gemma's: through the generic path 2.2x the time of 128-wide heads over the same bytes
          return dispatch_group<scalar_t, cache_t, 256>(out, q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                        window, softcap, alibi, sinks, prefix);
        case 576:  // DeepSeek's latent and rotary key (pagedllm.models.mla), in groups of 8 heads: 4x the generic speed
          return dispatch_group<scalar_t, cache_t, 576>(out, q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                        window, softcap, alibi, sinks, prefix);
        default:
          return decode_attention_impl<scalar_t, cache_t, 0, 0>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                                                scale, window, softcap, alibi, sinks, prefix);
      }
    });
  });
}

}  // namespace pagedllm

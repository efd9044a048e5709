// Paged prefill attention on the CPU: causal attention of each sequence's new query tokens over its whole
// context (cached prefix + the new tokens), read through the block tables. Flash-attention style: keys are
// taken 16 at a time with an online softmax, so no [q_len, seq_len] score matrix or mask is ever built.
//
//   q, out:            [num_tokens, num_heads, head_dim]; seq i's queries are rows qsl[i]:qsl[i+1]
//   k_cache, v_cache:  [num_blocks, block_size, num_kv_heads, head_dim]   (any strides in the first three dims);
//                      int8: [..., head_dim + 4], dequantized by pass 1 as it packs them (ops.h, load_row); in a
//                      bf16 model with a head size of 64, 128 or 256 rounded to bf16 (bf16_rows) and packed as a
//                      bf16 cache's, for the bf16 products
//   block_tables:      [num_seqs, max_blocks] int32;  seq_lens: [num_seqs] int32 (context after this step)
//   query_start_loc:   [num_seqs + 1] int32
//   Query j of seq i sits at position seq_len - q_len + j and sees the keys at positions <= its own (with a
//   sliding window of W keys, those past its own position - W too). Not causal (an encoder's bidirectional
//   attention), it sees every key of the context (with a window, those less than W positions from its own).
//
// Two passes:
//   1. per (sequence, kv head): copy the context's keys into tiles of 16, transposed so that one vector
//      instruction scores 16 keys (with AVX512-BF16 for bf16: vdpbf16ps takes (k[2p], k[2p+1]) pairs straight
//      from memory), and the values into float rows;
//   2. per (sequence, kv head, 16 query tokens): every query head of the group scores the keys up to the last
//      query's position, 64 at a time, then an online softmax and the weighted values, in float. The tasks are
//      dealt to the threads by cost.
// With AVX512-BF16, a bf16 cache and a head size of 64, 128 or 256, pass 1 packs the values in pairs of keys instead
// (`vdpbf16ps`'s and `tdpbf16ps`'s B operand) and the chunk's p, rounded to bf16, weighs them a pair of keys per
// product: 1.5-2.2x the float values on a Zen 5, whose outputs differ by about an ulp of bf16 (p's rounding). With
// AMX-BF16 tiles do both products: 16 rows by 16 keys are scored per `tdpbf16ps` and 32 dims, and the values are
// weighed in tiles (1.9-2.2x the AVX512-BF16 path on SmolLM2's shapes, when its values were floats); the softmax
// and the sums stay float.
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDLLM_ATTENTION_AMX 1
#else
#define PAGEDLLM_ATTENTION_AMX 0
#endif

namespace pagedllm {
namespace {

constexpr int64_t kKeyTile = 16;    // keys scored together: one 16-lane float vector (kKeyChunk: ops.h)
constexpr int64_t kQueryTile = 16;  // query tokens per task (x the group's query heads = the rows of a task)

// run.template operator()<R>(r) over `rows` rows in blocks of kMax (R = kMax), then once for the R < kMax left:
// the register-blocked scoring kernels take their row count at compile time.
template <int R, typename Run>
inline void run_rows_left(int64_t left, int64_t r, Run& run) {
  if constexpr (R > 0) {
    if (left == R) return run.template operator()<R>(r);
    run_rows_left<R - 1>(left, r, run);
  }
}

template <int kMax, typename Run>
inline void run_row_blocks(int64_t rows, Run&& run) {
  int64_t r = 0;
  for (; r + kMax <= rows; r += kMax) run.template operator()<kMax>(r);
  run_rows_left<kMax - 1>(rows - r, r, run);
}

// Keys [first, end) of one (sequence, kv head)'s context, packed by pass 1 in tiles of 16 from `first`.
struct Packed {
  int64_t seq, head, first, end, num_tiles;
  int64_t k_offset, v_offset;  // into the shared key / value buffers
};

struct Task {
  int64_t packed, q_begin, q_end;  // query rows [q_begin, q_end) of the flat batch, one token after another
  int64_t first_pos;               // the first token's position: token i of the task sees keys <= first_pos + i
  int64_t cost;
};

// Scores of `rows` float query rows against `tiles` consecutive transposed key tiles (head_dim x 16 floats each):
// s[r * s_stride + 16 t + j] = q[r] . key j of tile t.
#if defined(__AVX512F__)
// R rows x T tiles at once, R x T zmm accumulators: each q value is broadcast once for T FMAs and each key vector
// loaded once for R rows, at most 10 loads for 24 FMAs a d (this core runs two loads and two FMAs a cycle), and 16
// lanes where the AVX2 kernel has 8: 2.2x its rate on an Ice Lake Xeon. Each score is still one chain over d, in
// order: the AVX2 kernel's bits.
template <int R, int T>
inline void score_rows_avx512(const float* q, int64_t head_dim, const float* kt, float* s, int64_t s_stride) {
  __m512 acc[R][T];
#pragma GCC unroll 24
  for (int i = 0; i < R * T; ++i) acc[i / T][i % T] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    __m512 k[T];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) k[t] = _mm512_loadu_ps(kt + (t * head_dim + d) * kKeyTile);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * head_dim + d]);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_fmadd_ps(qv, k[t], acc[r][t]);
    }
  }
#pragma GCC unroll 24
  for (int i = 0; i < R * T; ++i) _mm512_storeu_ps(s + (i / T) * s_stride + (i % T) * kKeyTile, acc[i / T][i % T]);
}

template <int T>
inline void score_tiles_avx512(const float* q, int64_t rows, int64_t head_dim, const float* kt, float* s,
                               int64_t s_stride) {
  run_row_blocks<6>(rows, [&]<int R>(int64_t r) {
    score_rows_avx512<R, T>(q + r * head_dim, head_dim, kt, s + r * s_stride, s_stride);
  });
}

inline void score_chunk_float(const float* q, int64_t rows, int64_t head_dim, const float* kt, int64_t tiles,
                              float* s, int64_t s_stride) {
  switch (tiles) {
    case 4: return score_tiles_avx512<4>(q, rows, head_dim, kt, s, s_stride);
    case 3: return score_tiles_avx512<3>(q, rows, head_dim, kt, s, s_stride);
    case 2: return score_tiles_avx512<2>(q, rows, head_dim, kt, s, s_stride);
    default: return score_tiles_avx512<1>(q, rows, head_dim, kt, s, s_stride);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// Scores of `rows` float query rows against one transposed key tile kt[D][16]: s[r * s_stride + j] = q[r] . k[j].
// R rows at a time, 2 x R ymm accumulators: one row alone is a chain of dependent FMAs (a quarter of the FMA
// units' rate); six rows keep twelve chains in flight, with the two key vectors and a broadcast 15 of the 16 ymm
// registers, and load 8 values for 12 FMAs (four rows: 6 for 8; a Zen 3's prefill of 32 questions after a shared
// 512-token prompt, 1.13x). Each score is still one chain over d, in order: the same bits at any R.
template <int R>
inline void score_rows_avx2(const float* q, int64_t head_dim, const float* kt, float* s, int64_t s_stride) {
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * kKeyTile), k1 = _mm256_loadu_ps(kt + d * kKeyTile + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 qv = _mm256_broadcast_ss(q + r * head_dim + d);
      acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(s + r * s_stride, acc[r][0]);
    _mm256_storeu_ps(s + r * s_stride + 8, acc[r][1]);
  }
}

inline void score_tile_float(const float* q, int64_t rows, int64_t head_dim, const float* kt, float* s,
                             int64_t s_stride) {
  run_row_blocks<6>(rows, [&]<int R>(int64_t r) {
    score_rows_avx2<R>(q + r * head_dim, head_dim, kt, s + r * s_stride, s_stride);
  });
}
#else
inline void score_tile_float(const float* q, int64_t rows, int64_t head_dim, const float* kt, float* s,
                             int64_t s_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kKeyTile] = {};
    const float* qr = q + r * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) {
      const float qv = qr[d];
      const float* k = kt + d * kKeyTile;
#pragma omp simd
      for (int64_t j = 0; j < kKeyTile; ++j) acc[j] += qv * k[j];
    }
    std::copy(acc, acc + kKeyTile, s + r * s_stride);
  }
}
#endif

#if !defined(__AVX512F__)
inline void score_chunk_float(const float* q, int64_t rows, int64_t head_dim, const float* kt, int64_t tiles,
                              float* s, int64_t s_stride) {
  for (int64_t t = 0; t < tiles; ++t) {
    score_tile_float(q, rows, head_dim, kt + t * head_dim * kKeyTile, s + t * kKeyTile, s_stride);
  }
}
#endif

#if defined(__AVX512BF16__)
// AVX512-BF16: R rows x T key tiles in bf16 pairs, R x T zmm accumulators (q[r] holds a row's `pairs` (q[2p],
// q[2p+1]) words, kp tile t's [pairs][16] words, k_tile_words apart): each q pair is broadcast once for T products
// and each key vector loaded once for R rows, and the R x T chains hide `vdpbf16ps`'s latency, where one tile at a
// time (8 chains) left it waiting.
template <int R, int T>
inline void score_rows_bf16(const uint32_t* q, int64_t pairs, const uint32_t* kp, int64_t k_tile_words, float* s,
                            int64_t s_stride) {
  __m512 acc[R][T];
#pragma GCC unroll 24
  for (int i = 0; i < R * T; ++i) acc[i / T][i % T] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh k[T];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) k[t] = (__m512bh)_mm512_loadu_si512(kp + t * k_tile_words + p * kKeyTile);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * pairs + p]));
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], qp, k[t]);
    }
  }
#pragma GCC unroll 24
  for (int i = 0; i < R * T; ++i) _mm512_storeu_ps(s + (i / T) * s_stride + (i % T) * kKeyTile, acc[i / T][i % T]);
}

template <int T>
inline void score_tiles_bf16(const uint32_t* q, int64_t rows, int64_t pairs, const uint32_t* kp, int64_t k_tile_words,
                             float* s, int64_t s_stride) {
  run_row_blocks<6>(rows, [&]<int R>(int64_t r) {
    score_rows_bf16<R, T>(q + r * pairs, pairs, kp, k_tile_words, s + r * s_stride, s_stride);
  });
}

inline void score_chunk_bf16(const uint32_t* q, int64_t rows, int64_t pairs, const uint32_t* kp, int64_t k_tile_words,
                             int64_t tiles, float* s, int64_t s_stride) {
  switch (tiles) {
    case 4: return score_tiles_bf16<4>(q, rows, pairs, kp, k_tile_words, s, s_stride);
    case 3: return score_tiles_bf16<3>(q, rows, pairs, kp, k_tile_words, s, s_stride);
    case 2: return score_tiles_bf16<2>(q, rows, pairs, kp, k_tile_words, s, s_stride);
    default: return score_tiles_bf16<1>(q, rows, pairs, kp, k_tile_words, s, s_stride);
  }
}
#endif

#if PAGEDLLM_ATTENTION_AMX
// The tiles of the AMX path: sums 0-3, operands 4-7, 16 rows of 64 bytes each.
constexpr int kAttentionTiles = 8;

// s[r * s_stride + 16 t + j] = q[r] . key j of tile t, for the rows of whole tiles covering [0, rows) (q: `pairs`
// words a row, finite past `rows`) and `tiles` (<= 4) key tiles (kp: [pairs][16] words each, k_tile_words apart).
inline void score_chunk_amx(const uint32_t* q, int64_t rows, int64_t pairs, const uint32_t* kp, int64_t k_tile_words,
                            int64_t tiles, float* s, int64_t s_stride) {
  const int64_t q_bytes = pairs * sizeof(uint32_t), s_bytes = s_stride * sizeof(float);
  for (int64_t r = 0; r < rows; r += kAmxRows) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t p = 0; p < pairs; p += kAmxRows) {  // 16 pairs (32 dims) a product
      const uint32_t* k = kp + p * kKeyTile;
      _tile_loadd(4, q + r * pairs + p, q_bytes);
      _tile_loadd(5, k, kAmxRowBytes);
      _tile_dpbf16ps(0, 4, 5);
      if (tiles > 1) {
        _tile_loadd(6, k + k_tile_words, kAmxRowBytes);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (tiles > 2) {
        _tile_loadd(7, k + 2 * k_tile_words, kAmxRowBytes);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (tiles > 3) {
        _tile_loadd(5, k + 3 * k_tile_words, kAmxRowBytes);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    float* sr = s + r * s_stride;
    _tile_stored(0, sr, s_bytes);
    if (tiles > 1) _tile_stored(1, sr + kKeyTile, s_bytes);
    if (tiles > 2) _tile_stored(2, sr + 2 * kKeyTile, s_bytes);
    if (tiles > 3) _tile_stored(3, sr + 3 * kKeyTile, s_bytes);
  }
}

// o[r] += p[r] . v over a whole chunk of kKeyChunk keys, for the rows of whole tiles covering [0, rows): p in bf16
// (round_rows_to_bf16), the values as pairs of keys (vp: the chunk's 32 pair rows of head_dim words,
// pack_value_pairs), o [rows][head_dim] in float.
inline void accumulate_chunk_amx(const c10::BFloat16* p_bf16, int64_t rows, const uint32_t* vp, int64_t head_dim,
                                 float* o) {
  const int64_t p_bytes = kKeyChunk * sizeof(c10::BFloat16), o_bytes = head_dim * sizeof(float);
  const int64_t v_bytes = head_dim * sizeof(uint32_t);
  const uint32_t* vp_second = vp + kAmxRows * head_dim;  // keys 32-63
  for (int64_t r = 0; r < rows; r += kAmxRows) {
    _tile_loadd(4, p_bf16 + r * kKeyChunk, p_bytes);
    _tile_loadd(5, p_bf16 + r * kKeyChunk + 32, p_bytes);
    float* o_rows = o + r * head_dim;
    for (int64_t c = 0; c < head_dim; c += 4 * kAmxRows) {  // four tiles of 16 dims
#define PAGEDLLM_PV(sums, first)                                        \
  _tile_loadd(sums, o_rows + c + first, o_bytes);                       \
  _tile_loadd(6, vp + c + first, v_bytes);                              \
  _tile_dpbf16ps(sums, 4, 6);                                           \
  _tile_loadd(7, vp_second + c + first, v_bytes);                       \
  _tile_dpbf16ps(sums, 5, 7);                                           \
  _tile_stored(sums, o_rows + c + first, o_bytes)
      PAGEDLLM_PV(0, 0);
      PAGEDLLM_PV(1, 16);
      PAGEDLLM_PV(2, 32);
      PAGEDLLM_PV(3, 48);
#undef PAGEDLLM_PV
    }
  }
}

#endif

#if defined(__AVX512BF16__)
// o[r] += p[r] . v for R rows over the first `pairs` pairs of keys of a chunk, a pair per `vdpbf16ps`: p in bf16
// (pp: rows of kKeyChunk / 2 pair words), vp the chunk's pair rows of kHeadDim words (pack_value_pairs), o rows of
// kHeadDim floats. Each value vector is loaded once for R rows; half the instructions and half the bytes of float
// values.
template <int R, int64_t kHeadDim>
inline void accumulate_pairs_rows(const uint32_t* pp, int64_t pairs, const uint32_t* vp, float* o) {
  constexpr int kVecs = kHeadDim / 16;
  __m512 acc[R][kVecs];
#pragma GCC unroll 24
  for (int i = 0; i < R * kVecs; ++i) acc[i / kVecs][i % kVecs] = _mm512_loadu_ps(o + (i / kVecs) * kHeadDim + 16 * (i % kVecs));
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh v[kVecs];
#pragma GCC unroll 8
    for (int c = 0; c < kVecs; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + i * kHeadDim + 16 * c);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512bh pw = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r * (kKeyChunk / 2) + i]));
#pragma GCC unroll 8
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pw, v[c]);
    }
  }
#pragma GCC unroll 24
  for (int i = 0; i < R * kVecs; ++i) _mm512_storeu_ps(o + (i / kVecs) * kHeadDim + 16 * (i % kVecs), acc[i / kVecs][i % kVecs]);
}

template <int64_t kHeadDim>
inline void accumulate_pairs(const c10::BFloat16* p_bf16, int64_t rows, int64_t pairs, const uint32_t* vp, float* o) {
  static_assert(kHeadDim % 16 == 0);
  const uint32_t* pp = reinterpret_cast<const uint32_t*>(p_bf16);
  run_row_blocks<std::max<int>(1, 16 / (kHeadDim / 16))>(rows, [&]<int R>(int64_t r) {
    accumulate_pairs_rows<R, kHeadDim>(pp + r * (kKeyChunk / 2), pairs, vp, o + r * kHeadDim);
  });
}

// Keys [first, first + keys) of a kv head's values as `tdpbf16ps`'s B operand: dst[i][d] = (v_t[d], v_t+1[d]) for
// t = first + 2 i (v_t = value(t), a bf16 row), zero from `end` on.
template <typename Rows>
inline void pack_value_pairs(const Rows& value, int64_t first, int64_t end, int64_t keys, int64_t head_dim,
                             uint32_t* dst) {
  alignas(64) static const struct Interleave {
    uint16_t words[32];  // word i: a's i / 2 (even i) or b's (odd i); the second 16 of each are 16 further on
    Interleave() {
      for (int i = 0; i < 32; ++i) words[i] = static_cast<uint16_t>((i % 2) * 32 + i / 2);
    }
  } interleave;
  const __m512i low = _mm512_load_si512(interleave.words), high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t t = first; t < first + keys; t += 2, dst += head_dim) {
    for (int64_t d = 0; d < head_dim; d += 32) {
      const __m512i a = t < end ? _mm512_loadu_si512(value(t) + d) : _mm512_setzero_si512();
      const __m512i b = t + 1 < end ? _mm512_loadu_si512(value(t + 1) + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(a, low, b));
      _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// kv head h's key (kValues: value) rows at positions [first, end) as bf16, a function of the position: a bf16
// cache's in place; an int8 cache's widened (q s) and rounded to bf16 into `scratch`, the rows the torch path reads
// in a bf16 model (its dequantisation to the query's dtype), so that pass 1 packs them as a bf16 cache's.
template <bool kValues, typename cache_t>
inline auto bf16_rows(const PagedCache<cache_t>& cache, const int32_t* table, int64_t h, int64_t first, int64_t end,
                      int64_t head_dim, std::vector<c10::BFloat16>& scratch) {
  const auto row = [&cache, table, h](int64_t pos) {
    return kValues ? cache.value(table, pos, h) : cache.key(table, pos, h);
  };
  if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
    return row;
  } else {
    static_assert(std::is_same_v<cache_t, int8_t>);
    scratch.resize((end - first) * head_dim);
    for (int64_t pos = first; pos < end; ++pos) {
      const int8_t* src = row(pos);
      const __m512 scale = _mm512_set1_ps(row_scale(src, head_dim));
      c10::BFloat16* dst = scratch.data() + (pos - first) * head_dim;
      for (int64_t d = 0; d < head_dim; d += 16) {  // head_dim: 64, 128 or 256
        const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(x, scale))));
      }
    }
    return [data = scratch.data(), first, head_dim](int64_t pos) -> const c10::BFloat16* {
      return data + (pos - first) * head_dim;
    };
  }
}
#endif

// o += p . v over the first `visible` values v[j][D] of a key chunk. With AVX-512 and a fixed head size the
// row's output stays in registers, in two sets (even and odd keys) so that the FMA chains run in parallel.
template <int64_t kHeadDim>
inline void accumulate_values(const float* p, int64_t visible, const float* v, int64_t head_dim, float* o) {
#if defined(__AVX512F__)
  if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {
    constexpr int kVecs = kHeadDim / 16;
    __m512 even[kVecs], odd[kVecs];
#pragma GCC unroll 8
    for (int i = 0; i < kVecs; ++i) {
      even[i] = _mm512_loadu_ps(o + 16 * i);
      odd[i] = _mm512_setzero_ps();
    }
    int64_t j = 0;
    for (; j + 2 <= visible; j += 2) {
      const __m512 p0 = _mm512_set1_ps(p[j]), p1 = _mm512_set1_ps(p[j + 1]);
      const float* v0 = v + j * kHeadDim;
#pragma GCC unroll 8
      for (int i = 0; i < kVecs; ++i) {
        even[i] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * i), even[i]);
        odd[i] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v0 + kHeadDim + 16 * i), odd[i]);
      }
    }
    if (j < visible) {
      const __m512 p0 = _mm512_set1_ps(p[j]);
#pragma GCC unroll 8
      for (int i = 0; i < kVecs; ++i) even[i] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v + j * kHeadDim + 16 * i), even[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < kVecs; ++i) _mm512_storeu_ps(o + 16 * i, _mm512_add_ps(even[i], odd[i]));
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // AVX2 has half the registers: one set, which at up to 8 vectors is already 8 independent FMA chains.
  if constexpr (kHeadDim > 0 && kHeadDim % 8 == 0 && kHeadDim <= 64) {
    constexpr int kVecs = kHeadDim / 8;
    __m256 acc[kVecs];
#pragma GCC unroll 8
    for (int i = 0; i < kVecs; ++i) acc[i] = _mm256_loadu_ps(o + 8 * i);
    for (int64_t j = 0; j < visible; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
#pragma GCC unroll 8
      for (int i = 0; i < kVecs; ++i) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * kHeadDim + 8 * i), acc[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < kVecs; ++i) _mm256_storeu_ps(o + 8 * i, acc[i]);
    return;
  }
#endif
  for (int64_t j = 0; j < visible; ++j) {
    const float pj = p[j];
    const float* vj = v + j * head_dim;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) o[d] += pj * vj[d];
  }
}

// A row's running sum of exp is kept as kSumLanes partial sums, added up once at the row's end: with AVX-512 each
// chunk adds its 16-lane vector of sums lane-wise, where a sum across the lanes in every chunk (a chain of shuffles
// and adds, and the scalar update after it) took ~13% of the AMX path's samples on 4,000-token prompts.
constexpr int64_t kSumLanes = 16;

inline float total_of(const float* l) {
  float total = 0.f;
  for (int64_t i = 0; i < kSumLanes; ++i) total += l[i];
  return total;
}

#if defined(__AVX512F__)
// e^x to ~4e-5 relative, for a p that is rounded to bf16 next (its ulp: 2^-8 relative): a degree-4 Taylor polynomial
// of the reduced argument, and ln 2 in one float, where exp_approx16 keeps float32's accuracy (a degree-7
// polynomial, ln 2 in two parts, -inf clamped). -inf and NaN lanes come out NaN: the caller masks them.
inline __m512 exp_for_bf16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(expf_constants::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147182f), x);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.f / 24), r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

// Online softmax for one query row over scores [hidden, visible) of a key chunk s[kKeyChunk] (0 <= hidden <
// visible; keys before `hidden` are out of a sliding window), each times `scale` and then, with a `softcap`, capped
// (`soft_cap`), and with an ALiBi `slope`, the key at j biased by slope (j + offset), offset being how far the chunk's
// first key lies after the row: s becomes the chunk's p (0 outside them), and o, the row's unnormalised output, is
// rescaled to the new max. m: the row's
// running max; l: its running sum of exp (of scaled scores), as kSumLanes partial sums. kBf16P: p is rounded to
// bf16 next (the paths that weigh the values in bf16 pairs), so that exp_for_bf16 does (1.2-1.3x the chunk loop
// of the AMX path on SmolLM2's shapes, whose exp was its largest part).
template <int64_t kHeadDim, bool kBf16P>
inline void softmax_chunk(float* s, int64_t hidden, int64_t visible, float scale, float softcap, float slope,
                          int64_t offset, int64_t head_dim, float& m, float* l, float* o) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (softcap > 0.f || slope != 0.f) {  // then the scores are scaled here (cap tanh(s / cap) + bias is no multiple of s)
#pragma omp simd
    for (int64_t j = 0; j < kKeyChunk; ++j) s[j] *= scale;
    if (softcap > 0.f) soft_cap(s, kKeyChunk, softcap);
    if (slope != 0.f) {
#pragma omp simd
      for (int64_t j = 0; j < kKeyChunk; ++j) s[j] += slope * static_cast<float>(j + offset);
    }
    scale = 1.f;
  }
#if defined(__AVX512F__)
  // The chunk's 64 scores stay in four registers from load to store: the mask is a lane mask, the scale goes into
  // the max's subtraction (one FMA), and the row keeps its max m while no score passes it by more than kSlack
  // (p <= e^kSlack then; the output is the same ratio of sums whichever m it is taken against), so that most
  // chunks need no max, no correction and no rescaling of o. The loops below took half of the AMX path's time (its
  // tiles do 128 multiply-adds a score, the softmax ~2 instructions); this, ~1.5x less in all.
  static_assert(kKeyChunk == 64);
  constexpr float kSlack = 8.f;
  if (head_dim % 16 == 0) {
    const __m512 vscale = _mm512_set1_ps(scale);
    __m512 x[4], scaled[4];
    __mmask16 seen[4], above = 0;  // seen: the lanes in [hidden, visible)
    const auto before = [](int64_t n) { return static_cast<__mmask16>((1u << std::clamp<int64_t>(n, 0, 16)) - 1); };
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      seen[i] = before(visible - 16 * i) & static_cast<__mmask16>(~before(hidden - 16 * i));
      x[i] = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), seen[i], s + 16 * i);
      scaled[i] = _mm512_fmsub_ps(x[i], vscale, _mm512_set1_ps(m));
      above |= _mm512_cmp_ps_mask(scaled[i], _mm512_set1_ps(kSlack), _CMP_GT_OQ);
    }
    __m512 correction = _mm512_set1_ps(1.f);
    if (above) {  // a new max, further than kSlack (always on the row's first chunk, where m = -inf)
      // scale > 0: the max of the scaled scores is the scaled max.
      const float chunk_max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
      const float m_new = std::max(m, chunk_max * scale);
      correction = _mm512_set1_ps(exp_approx(m - m_new));  // 0 on the first chunk (m = -inf)
      m = m_new;
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) scaled[i] = _mm512_fmsub_ps(x[i], vscale, _mm512_set1_ps(m));
      for (int64_t d = 0; d < head_dim; d += 16) {
        _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), correction));
      }
    }
    __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512 e = kBf16P ? exp_for_bf16(scaled[i]) : exp_approx16(scaled[i]);
      const __m512 p = _mm512_maskz_mov_ps(seen[i], e);  // 0 past the row's keys
      _mm512_storeu_ps(s + 16 * i, p);
      sum = _mm512_add_ps(sum, p);
    }
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), correction, sum));
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // AVX2: the same in two passes over the chunk (its eight vectors and exp_approx8's constants would not fit in
  // sixteen registers together): its max, the lanes outside [hidden, visible) set to -inf by a blend (no masks
  // here) and written back, then its exps, 0 on those lanes. The generic loops below ran five passes over the chunk
  // and a scalar tree for its max.
  static_assert(kKeyChunk == 64);
  constexpr float kSlack = 8.f;
  if (head_dim % 8 == 0) {
    __m256 most = _mm256_set1_ps(kNegInf);
    if (hidden == 0 && visible == kKeyChunk) {
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) most = _mm256_max_ps(most, _mm256_loadu_ps(s + 8 * i));
    } else {
      const __m256i first = _mm256_set1_epi32(static_cast<int>(hidden) - 1);
      const __m256i end = _mm256_set1_epi32(static_cast<int>(visible));
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const __m256i key = _mm256_add_epi32(_mm256_set1_epi32(8 * i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256i seen = _mm256_and_si256(_mm256_cmpgt_epi32(key, first), _mm256_cmpgt_epi32(end, key));
        const __m256 x = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), _mm256_loadu_ps(s + 8 * i),
                                          _mm256_castsi256_ps(seen));
        _mm256_storeu_ps(s + 8 * i, x);
        most = _mm256_max_ps(most, x);
      }
    }
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    half = _mm_max_ss(half, _mm_movehdup_ps(half));
    const float chunk_max = _mm_cvtss_f32(half) * scale;  // scale > 0: the max of the scaled scores
    __m256 correction = _mm256_set1_ps(1.f);
    if (chunk_max > m + kSlack) {  // a new max, further than kSlack (always on the row's first chunk, m = -inf)
      correction = _mm256_set1_ps(exp_approx(m - chunk_max));  // 0 on the first chunk
      m = chunk_max;
      for (int64_t d = 0; d < head_dim; d += 8) {
        _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), correction));
      }
    }
    const __m256 vscale = _mm256_set1_ps(scale), vm = _mm256_set1_ps(m);
    __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m256 p = exp_approx8(_mm256_fmsub_ps(_mm256_loadu_ps(s + 8 * i), vscale, vm));  // 0 where x is -inf
      _mm256_storeu_ps(s + 8 * i, p);
      sum[i % 2] = _mm256_add_ps(sum[i % 2], p);
    }
    _mm256_storeu_ps(l, _mm256_fmadd_ps(_mm256_loadu_ps(l), correction, sum[0]));
    _mm256_storeu_ps(l + 8, _mm256_fmadd_ps(_mm256_loadu_ps(l + 8), correction, sum[1]));
    return;
  }
#endif
#pragma omp simd
  for (int64_t j = 0; j < kKeyChunk; ++j) s[j] *= scale;
  for (int64_t j = visible; j < kKeyChunk; ++j) s[j] = kNegInf;  // keys past the row's position
  for (int64_t j = 0; j < hidden; ++j) s[j] = kNegInf;             // and before its window
  const float m_new = std::max(m, max_of(s, kKeyChunk));
#pragma omp simd
  for (int64_t j = 0; j < kKeyChunk; ++j) s[j] = exp_approx(s[j] - m_new);  // exp(-inf) = 0
  float sum = 0.f;  // in a loop of its own: GCC kept the partial sums of a fused one in memory
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < kKeyChunk; ++j) sum += s[j];
  const float correction = exp_approx(m - m_new);  // 0 on the first tile (m = -inf)
  l[0] = l[0] * correction + sum;  // the other lanes stay 0
  m = m_new;
  if (correction != 1.f) {
    const int64_t n = kHeadDim > 0 ? kHeadDim : head_dim;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) o[d] *= correction;
  }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// o[r] += p[r] . v for R rows and 16 of the kHeadDim columns [c, c + 16) over the first `visible` values of a key
// chunk: 2 x R ymm accumulators, each value pair of vectors loaded once for R rows and each p broadcast once for
// both (8 loads for 12 FMAs at R = 6, where a row at a time loaded 9 for 8). Each output is still one chain over
// the keys in order, from o: the same bits as accumulate_values gives.
template <int R, int64_t kHeadDim>
inline void accumulate_columns_avx2(const float* p, int64_t visible, const float* v, int64_t c, float* o) {
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_loadu_ps(o + r * kHeadDim + c);
    acc[r][1] = _mm256_loadu_ps(o + r * kHeadDim + c + 8);
  }
  for (int64_t j = 0; j < visible; ++j) {
    const __m256 v0 = _mm256_loadu_ps(v + j * kHeadDim + c), v1 = _mm256_loadu_ps(v + j * kHeadDim + c + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 pj = _mm256_broadcast_ss(p + r * kKeyChunk + j);
      acc[r][0] = _mm256_fmadd_ps(pj, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(pj, v1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(o + r * kHeadDim + c, acc[r][0]);
    _mm256_storeu_ps(o + r * kHeadDim + c + 8, acc[r][1]);
  }
}
#endif

// o[r] += p[r] . v for `rows` rows (p rows kKeyChunk apart, o rows head_dim apart) over the first `visible`
// values of a key chunk. With a fixed head size, R rows at a time share each value vector loaded: with AVX-512
// R x kHeadDim / 16 = 16 accumulators; with AVX2 (half the registers) six rows x 16 columns at a time
// (accumulate_columns_avx2). One row at a time loaded every value once per FMA.
template <int64_t kHeadDim>
inline void accumulate_rows(const float* p, int64_t rows, int64_t visible, const float* v, int64_t head_dim,
                            float* o) {
  int64_t r = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {
    run_row_blocks<6>(rows, [&]<int R>(int64_t r0) {
      for (int64_t c = 0; c < kHeadDim; c += 16) {
        accumulate_columns_avx2<R, kHeadDim>(p + r0 * kKeyChunk, visible, v, c, o + r0 * kHeadDim);
      }
    });
    return;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0 && kHeadDim <= 256) {
    constexpr int kVecs = kHeadDim / 16, R = std::max(1, 16 / kVecs);
    for (; r + R <= rows; r += R) {
      __m512 acc[R][kVecs];
#pragma GCC unroll 16
      for (int i = 0; i < R * kVecs; ++i) acc[i / kVecs][i % kVecs] = _mm512_loadu_ps(o + (r + i / kVecs) * kHeadDim + 16 * (i % kVecs));
      for (int64_t j = 0; j < visible; ++j) {
        __m512 vj[kVecs];
#pragma GCC unroll 16
        for (int c = 0; c < kVecs; ++c) vj[c] = _mm512_loadu_ps(v + j * kHeadDim + 16 * c);
#pragma GCC unroll 16
        for (int rr = 0; rr < R; ++rr) {
          const __m512 pj = _mm512_set1_ps(p[(r + rr) * kKeyChunk + j]);
#pragma GCC unroll 16
          for (int c = 0; c < kVecs; ++c) acc[rr][c] = _mm512_fmadd_ps(pj, vj[c], acc[rr][c]);
        }
      }
#pragma GCC unroll 16
      for (int i = 0; i < R * kVecs; ++i) _mm512_storeu_ps(o + (r + i / kVecs) * kHeadDim + 16 * (i % kVecs), acc[i / kVecs][i % kVecs]);
    }
  }
#endif
  for (; r < rows; ++r) accumulate_values<kHeadDim>(p + r * kKeyChunk, visible, v, head_dim, o + r * head_dim);
}

// The work of one call: the contexts to pack, and the query tiles to run over them.
struct Plan {
  std::vector<Packed> packed;
  std::vector<Task> tasks;
  int64_t window = 0;  // 0, or the sliding window every query row sees
  float softcap = 0.f;  // 0, or the soft cap of the scores (Gemma 2's)
  const float* alibi = nullptr;  // nullptr, or ALiBi's slope of each query head
  const float* sinks = nullptr;  // nullptr, or the sink of each query head (sink_term)
  bool causal = true;   // false: a row sees the keys after its own too (within the window either side)

  // Past the last key a query at `pos` sees of a context of `end` keys.
  int64_t key_end(int64_t pos, int64_t end) const {
    return causal ? std::min(end, pos + 1) : window > 0 ? std::min(end, pos + window) : end;
  }
};

// The first key a query at `pos` sees of the keys from `first` on: `first`, or its sliding window's first.
int64_t first_key(int64_t first, int64_t pos, int64_t window) {
  return window > 0 ? std::max(first, pos - window + 1) : first;
}

// Sequences first_seq.. of the batch, each query tile over its keys [first, seq_len): the whole context (first = 0),
// what follows a cascade's prefix, or with a window what its queries' windows cover.
Plan plan_sequences(const int32_t* qsl, const int32_t* lens, int64_t first_seq, int64_t num_seqs,
                    int64_t num_kv_heads, int64_t first, int64_t window, bool causal) {
  Plan plan;
  plan.window = window;
  plan.causal = causal;
  for (int64_t i = first_seq; i < num_seqs; ++i) {
    const int64_t q_len = qsl[i + 1] - qsl[i], seq_len = lens[i];
    if (q_len == 0) continue;
    const int64_t keys_from = first_key(first, seq_len - q_len, window);  // the first query's
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      plan.packed.push_back({i, h, keys_from, seq_len});
      for (int64_t begin = 0; begin < q_len; begin += kQueryTile) {
        const int64_t end = std::min(q_len, begin + kQueryTile), first_pos = seq_len - q_len + begin;
        const int64_t keys = plan.key_end(first_pos + end - begin - 1, seq_len) - first_key(keys_from, first_pos, window);
        plan.tasks.push_back({static_cast<int64_t>(plan.packed.size()) - 1, qsl[i] + begin, qsl[i] + end, first_pos,
                              (end - begin) * keys});
      }
    }
  }
  return plan;
}

// Every query row of the batch over a cascade's prefix, keys [0, prefix_len) of sequence `seq`'s blocks (the same
// blocks in every sequence): each kv head's prefix packed once, its rows taken 16 tokens at a time whatever sequence
// they belong to, all seeing all of it (first_pos = prefix_len).
Plan plan_prefix(int64_t num_tokens, int64_t seq, int64_t num_kv_heads, int64_t prefix_len) {
  Plan plan;
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    plan.packed.push_back({seq, h, 0, prefix_len});
    for (int64_t begin = 0; begin < num_tokens; begin += kQueryTile) {
      const int64_t end = std::min(num_tokens, begin + kQueryTile);
      plan.tasks.push_back({h, begin, end, prefix_len, (end - begin) * prefix_len});
    }
  }
  return plan;
}

// A key tile's rows [kKeyTile][head_dim] as the score kernels read them, [head_dim][kKeyTile]: with AVX2 eight
// rows by eight columns at a time in registers, not a scalar store a value (with the units below, a decode step's
// cascade over a 512-token prefix took 1.05x less time capped to AVX2).
inline void transpose_key_tile(const float* rows, int64_t head_dim, float* dst) {
  int64_t d = 0;
#if defined(__AVX2__)
  for (; d + 8 <= head_dim; d += 8) {
    for (int64_t j0 = 0; j0 < kKeyTile; j0 += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows + (j0 + i) * head_dim + d);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      for (int i = 0; i < 4; ++i) {  // r[i]: column d + i of rows 0-3 and 4-7 in its halves' order
        _mm256_storeu_ps(dst + (d + i) * kKeyTile + j0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (d + i + 4) * kKeyTile + j0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      }
    }
  }
#endif
  for (; d < head_dim; ++d) {
    for (int64_t j = 0; j < kKeyTile; ++j) dst[d * kKeyTile + j] = rows[j * head_dim + d];
  }
}

// Runs a plan: pass 1 packs its contexts, pass 2 its tasks. Each query row (token, query head) starts from `init`'s
// online-softmax state (a cascade's suffix after its prefix) or from no keys, and ends either normalised into `out`
// or, with `keep`, as a state (a cascade's prefix).
template <typename scalar_t, typename cache_t, int64_t kHeadDim>
void run_plan(Plan& plan, at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale_arg,
              const SoftmaxState* init, SoftmaxState* keep) {
#if defined(__AVX512BF16__)
  // bf16 products over a bf16 cache (then scalar_t is bf16 too), or an int8 one in a bf16 model whose head size
  // takes the pair path (its rows rounded to bf16 as pass 1 packs them: bf16_rows).
  constexpr bool kBf16Dot = std::is_same_v<cache_t, c10::BFloat16> ||
                            (std::is_same_v<cache_t, int8_t> && std::is_same_v<scalar_t, c10::BFloat16> &&
                             kHeadDim > 0);
#else
  constexpr bool kBf16Dot = false;
#endif
  const PagedCache<cache_t> cache(k_cache, v_cache, block_tables, seq_lens);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : q.size(2);
  const int64_t pairs = head_dim / 2;
  const int64_t group = num_heads / cache.num_kv_heads;
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const float scale = static_cast<float>(scale_arg);
  // Words per key tile in the key buffer: bf16 pairs [D/2][16] as uint32, or floats [D][16].
  const int64_t k_tile_words = (kBf16Dot ? pairs : head_dim) * kKeyTile;
  // With AVX512-BF16 and a head size of 64, 128 or 256, p (rounded to bf16) weighs the values in pairs of keys: in AMX
  // tiles where Linux grants them, else with `vdpbf16ps`.
  constexpr bool kPairs = kBf16Dot && kHeadDim > 0;
#if PAGEDLLM_ATTENTION_AMX
  const bool amx = kBf16Dot && prefill_attention_in_tiles(q, k_cache);
#else
  constexpr bool amx = false;
#endif
  // The values' pairs cover whole chunks of keys (zero past the context).
  const auto chunk_keys = [](int64_t keys) { return (keys + kKeyChunk - 1) / kKeyChunk * kKeyChunk; };

  int64_t k_words = 0, v_size = 0;  // v_size: floats, or with kPairs words of pairs of keys
  for (Packed& pk : plan.packed) {
    pk.num_tiles = (pk.end - pk.first + kKeyTile - 1) / kKeyTile;
    pk.k_offset = k_words;
    pk.v_offset = v_size;
    k_words += pk.num_tiles * k_tile_words;
    v_size += kPairs ? chunk_keys(pk.end - pk.first) / 2 * head_dim : pk.num_tiles * kKeyTile * head_dim;
  }
  // Left uninitialised: pass 1 writes every word of them, zeros past each context.
  const std::unique_ptr<uint32_t[]> k_bits(new uint32_t[kBf16Dot ? k_words : 0]);
  const std::unique_ptr<float[]> k_floats(new float[kBf16Dot ? 0 : k_words]), values(new float[kPairs ? 0 : v_size]);
  const std::unique_ptr<uint32_t[]> value_pairs(new uint32_t[kPairs ? v_size : 0]);

  // Pass 1: pack keys and values, a chunk of kKeyChunk keys of a context a unit: a decode step's cascade packs its
  // few kv heads' prefixes (three for two threads: one thread packed two of them, the other waited).
  constexpr int64_t kChunkTiles = kKeyChunk / kKeyTile;
  std::vector<std::pair<int64_t, int64_t>> units;  // (packed context, its first tile)
  for (size_t w = 0; w < plan.packed.size(); ++w) {
    for (int64_t tile = 0; tile < plan.packed[w].num_tiles; tile += kChunkTiles) units.emplace_back(w, tile);
  }
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> krows(kBf16Dot ? 0 : kKeyTile * head_dim);  // a float tile's key rows, to transpose
    std::vector<c10::BFloat16> k_scratch, v_scratch;  // an int8 cache's rows in bf16 (bf16_rows)
    for (int64_t u = begin; u < end; ++u) {
      const Packed& pk = plan.packed[units[u].first];
      const int64_t first_tile = units[u].second, last_tile = std::min(pk.num_tiles, first_tile + kChunkTiles);
      const int64_t chunk_first = pk.first + first_tile * kKeyTile;
      const int64_t chunk_end = std::min(pk.end, chunk_first + kKeyChunk);
      const int32_t* table = cache.table(pk.seq);
#if defined(__AVX512BF16__)
      // The values in pairs of keys, and the keys 16 at a time: their bf16 pairs transposed into a tile's rows.
      if constexpr (kPairs) {
        const auto key = bf16_rows<false>(cache, table, pk.head, chunk_first, chunk_end, head_dim, k_scratch);
        const auto value = bf16_rows<true>(cache, table, pk.head, chunk_first, chunk_end, head_dim, v_scratch);
        pack_value_pairs(value, chunk_first, chunk_end, kKeyChunk, head_dim,
                         value_pairs.get() + pk.v_offset + first_tile * kKeyTile / 2 * head_dim);
        alignas(64) static const uint8_t zeros[2 * kHeadDim] = {};
        for (int64_t tile = first_tile; tile < last_tile; ++tile) {
          const uint8_t* rows[kKeyTile];
          for (int64_t j = 0; j < kKeyTile; ++j) {
            const int64_t pos = pk.first + tile * kKeyTile + j;
            rows[j] = pos < pk.end ? reinterpret_cast<const uint8_t*>(key(pos)) : zeros;
          }
          uint8_t* dst = reinterpret_cast<uint8_t*>(k_bits.get() + pk.k_offset + tile * k_tile_words);
          for (int64_t offset = 0; offset < head_dim * 2; offset += 64) transpose_pairs(rows, offset, dst + offset * 16);
        }
        continue;
      }
#endif
      for (int64_t tile = first_tile; tile < last_tile; ++tile) {
        for (int64_t j = 0; j < kKeyTile; ++j) {
          const int64_t i = tile * kKeyTile + j, pos = pk.first + i;
          float* vrow = values.get() + pk.v_offset + i * head_dim;
          if (pos >= pk.end) {  // the last tile's tail: zeros, never visible
            std::fill(vrow, vrow + head_dim, 0.f);
            if constexpr (kBf16Dot) {
              for (int64_t p = 0; p < pairs; ++p) k_bits[pk.k_offset + tile * k_tile_words + p * kKeyTile + j] = 0;
            } else {
              std::fill_n(krows.data() + j * head_dim, head_dim, 0.f);
            }
            continue;
          }
          const cache_t* key = cache.key(table, pos, pk.head);
          load_row(cache.value(table, pos, pk.head), vrow, head_dim);
          if constexpr (kBf16Dot) {
            uint32_t* kdst = k_bits.get() + pk.k_offset + tile * k_tile_words + j;
            const uint16_t* kw = reinterpret_cast<const uint16_t*>(key);
            for (int64_t p = 0; p < pairs; ++p) {
              kdst[p * kKeyTile] = static_cast<uint32_t>(kw[2 * p]) | (static_cast<uint32_t>(kw[2 * p + 1]) << 16);
            }
          } else {
            load_row(key, krows.data() + j * head_dim, head_dim);
          }
        }
        if constexpr (!kBf16Dot) {
          transpose_key_tile(krows.data(), head_dim, k_floats.get() + pk.k_offset + tile * k_tile_words);
        }
      }
    }
  });

  // The tasks, most expensive first, each taken by the next thread free (at::parallel_for would hand out
  // contiguous ranges, and the last query tiles of a long sequence cost the most; a fixed deal would leave a thread
  // that runs slower, as these shared cores sometimes do, last to finish).
  const std::vector<Task>& tasks = plan.tasks;
  const int64_t num_threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  std::vector<int64_t> order(tasks.size());
  for (size_t t = 0; t < order.size(); ++t) order[t] = static_cast<int64_t>(t);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return tasks[a].cost > tasks[b].cost; });
  std::atomic<size_t> next_task{0};

  // Pass 2: attention per task.
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    const int64_t max_rows = kQueryTile * group;
    std::vector<float> q_rows(max_rows * head_dim), scores(max_rows * kKeyChunk), acc(max_rows * head_dim);
    std::vector<uint32_t> q_pairs(kBf16Dot ? max_rows * pairs : 0);
    std::vector<float> row_max(max_rows), row_sum(max_rows * kSumLanes);
    std::vector<c10::BFloat16> p_bf16(kPairs ? max_rows * kKeyChunk : 0);
#if PAGEDLLM_ATTENTION_AMX
    if (amx) configure_tiles(kAttentionTiles);
#endif
    for (size_t n; (n = next_task.fetch_add(1, std::memory_order_relaxed)) < order.size();) {
      const Task& task = tasks[order[n]];
      const Packed& pk = plan.packed[task.packed];
      const int64_t first_pos = task.first_pos;
      const int64_t tokens = task.q_end - task.q_begin, rows = tokens * group;
      // Rows: token-major, then the group's query heads; `row` is a row's index in the batch's [tokens, heads].
      const auto row = [&](int64_t r) { return (task.q_begin + r / group) * num_heads + pk.head * group + r % group; };
      for (int64_t r = 0; r < rows; ++r) {
        const scalar_t* src = q_ptr + row(r) * head_dim;
        if constexpr (kBf16Dot) {
          std::memcpy(q_pairs.data() + r * pairs, src, head_dim * sizeof(scalar_t));
        } else {
          for (int64_t d = 0; d < head_dim; ++d) q_rows[r * head_dim + d] = to_float(src[d]);
        }
      }
      if (init) {
        for (int64_t r = 0; r < rows; ++r) {
          row_max[r] = init->max[row(r)];
          std::fill_n(row_sum.data() + r * kSumLanes, kSumLanes, 0.f);
          row_sum[r * kSumLanes] = init->sum[row(r)];
          std::copy_n(init->acc.get() + row(r) * head_dim, head_dim, acc.data() + r * head_dim);
        }
      } else {
        std::fill(row_max.begin(), row_max.begin() + rows, -std::numeric_limits<float>::infinity());
        std::fill(row_sum.begin(), row_sum.begin() + rows * kSumLanes, 0.f);
        std::fill(acc.begin(), acc.begin() + rows * head_dim, 0.f);
      }
      const int64_t key_end = plan.key_end(first_pos + tokens - 1, pk.end);  // past the last key any row sees
      // chunks from the one holding the first key the first row sees
      const int64_t skipped = first_key(pk.first, first_pos, plan.window) - pk.first;
      const int64_t key_begin = pk.first + skipped / kKeyChunk * kKeyChunk;
      for (int64_t chunk_start = key_begin; chunk_start < key_end; chunk_start += kKeyChunk) {
        const int64_t first_tile = (chunk_start - pk.first) / kKeyTile;
        const int64_t tiles = std::min(kKeyChunk / kKeyTile, (key_end - chunk_start + kKeyTile - 1) / kKeyTile);
        // The chunk's online softmax for rows [begin, end) of the task.
        const auto softmax_rows = [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            float* s = scores.data() + r * kKeyChunk;
            const int64_t pos = first_pos + r / group;
            const int64_t visible = std::min(tiles * kKeyTile, plan.key_end(pos, pk.end) - chunk_start);
            const int64_t hidden = first_key(chunk_start, pos, plan.window) - chunk_start;
            if (hidden >= visible) {  // the chunk is past this row's position, or before its window: it adds nothing
              std::fill(s, s + kKeyChunk, 0.f);
              continue;
            }
            const float slope = plan.alibi ? plan.alibi[pk.head * group + r % group] : 0.f;
            softmax_chunk<kHeadDim, kPairs>(s, hidden, visible, scale, plan.softcap, slope, chunk_start - pos,
                                            head_dim, row_max[r], row_sum.data() + r * kSumLanes,
                                            acc.data() + r * head_dim);
          }
        };
#if defined(__AVX512BF16__)
        const uint32_t* vp = kPairs ? value_pairs.get() + pk.v_offset + (chunk_start - pk.first) / 2 * head_dim
                                    : nullptr;
#endif
#if PAGEDLLM_ATTENTION_AMX
        if (amx) {
          // Every row tile's scores, then a row tile (16 rows) at a time its softmax and its values' products: the
          // AMX unit runs one tile's products while the vector units run the next tile's softmax, where with every
          // softmax before every product the two took turns (1.07x on 2,048 queries over 2,048-4,096 keys).
          const uint32_t* kp = k_bits.get() + pk.k_offset + first_tile * k_tile_words;
          const auto score_tile = [&](int64_t begin) {
            score_chunk_amx(q_pairs.data() + begin * pairs, kAmxRows, pairs, kp, k_tile_words, tiles,
                            scores.data() + begin * kKeyChunk, kKeyChunk);
          };
          for (int64_t begin = 0; begin < rows; begin += kAmxRows) score_tile(begin);
          for (int64_t begin = 0; begin < rows; begin += kAmxRows) {
            const int64_t end = std::min(rows, begin + kAmxRows);
            softmax_rows(begin, end);
            round_rows_to_bf16(scores.data() + begin * kKeyChunk, end - begin, kKeyChunk, kKeyChunk,
                               p_bf16.data() + begin * kKeyChunk);
            accumulate_chunk_amx(p_bf16.data() + begin * kKeyChunk, end - begin, vp, head_dim,
                                 acc.data() + begin * head_dim);
          }
          continue;
        }
#endif
        if constexpr (kBf16Dot) {
#if defined(__AVX512BF16__)
          score_chunk_bf16(q_pairs.data(), rows, pairs, k_bits.get() + pk.k_offset + first_tile * k_tile_words,
                           k_tile_words, tiles, scores.data(), kKeyChunk);
#endif
        } else {
          score_chunk_float(q_rows.data(), rows, head_dim, k_floats.get() + pk.k_offset + first_tile * k_tile_words,
                            tiles, scores.data(), kKeyChunk);
        }
        softmax_rows(0, rows);
        // Every row's p is 0 past its last key, so all rows take the last row's keys (the most any sees).
        const int64_t visible = std::min(tiles * kKeyTile, plan.key_end(first_pos + (rows - 1) / group, pk.end) -
                                                               chunk_start);
#if defined(__AVX512BF16__)
        if constexpr (kPairs) {
          round_rows_to_bf16(scores.data(), rows, kKeyChunk, kKeyChunk, p_bf16.data());
          accumulate_pairs<kHeadDim>(p_bf16.data(), rows, (visible + 1) / 2, vp, acc.data());
          continue;
        }
#endif
        accumulate_rows<kHeadDim>(scores.data(), rows, visible,
                                  values.get() + pk.v_offset + (chunk_start - pk.first) * head_dim, head_dim,
                                  acc.data());
      }
      for (int64_t r = 0; r < rows; ++r) {
        if (keep) {
          keep->max[row(r)] = row_max[r];
          keep->sum[row(r)] = total_of(row_sum.data() + r * kSumLanes);
          std::copy_n(acc.data() + r * head_dim, head_dim, keep->acc.get() + row(r) * head_dim);
          continue;
        }
        scalar_t* dst = out.data_ptr<scalar_t>() + row(r) * head_dim;
        const float inv = 1.f / (total_of(row_sum.data() + r * kSumLanes) +
                                 sink_term(plan.sinks, pk.head * group + r % group, row_max[r]));
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = from_float<scalar_t>(acc[r * head_dim + d] * inv);
      }
    }
#if PAGEDLLM_ATTENTION_AMX
    if (amx) _tile_release();  // the tile registers' state goes with the thread on every switch while configured
#endif
  });
}

// run_plan<scalar_t, cache_t, kHeadDim> for q's dtype, the cache's and the head size (64, 128 and Gemma's 256
// unrolled; 256 through the generic path ran Gemma 3 1B's prefill attention ~12x slower than 128 at equal FLOPs).
template <typename Run>
void dispatch_plan(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, Run&& run) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention", [&] {
    dispatch_cache<scalar_t>(q, k_cache, v_cache, [&]<typename cache_t>() {
      switch (q.size(2)) {
        case 64: return run.template operator()<scalar_t, cache_t, 64>();
        case 128: return run.template operator()<scalar_t, cache_t, 128>();
        case 256: return run.template operator()<scalar_t, cache_t, 256>();
        default: return run.template operator()<scalar_t, cache_t, 0>();
      }
    });
  });
}

void check_prefill_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc) {
  TORCH_CHECK(q.is_contiguous(), "q must be contiguous");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "the head dim of the caches must be contiguous");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "block tables, lengths and starts must be int32");
  }
  TORCH_CHECK(query_start_loc.numel() == seq_lens.numel() + 1, "query_start_loc must have num_seqs + 1 entries");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.size(2) % 2 == 0, "head_dim must be even");
}

}  // namespace

bool prefill_attention_in_tiles(const at::Tensor& q, const at::Tensor& k_cache) {
#if PAGEDLLM_ATTENTION_AMX
  return q.scalar_type() == at::kBFloat16 &&
         (k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kChar) &&
         (q.size(2) == 64 || q.size(2) == 128 || q.size(2) == 256) && amx_granted();
#else
  return false;
#endif
}

void prefill_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                       at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_start_loc, int64_t first_seq,
                       double scale, int64_t window, double softcap, bool causal,
                       const c10::optional<at::Tensor>& alibi_slopes, const c10::optional<at::Tensor>& sinks) {
  prefill_attention_after_prefix(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, first_seq, scale,
                                 window, softcap, head_data(alibi_slopes, q, "ALiBi's slopes"),
                                 head_data(sinks, q, "sinks"), nullptr, causal);
}

void prefill_attention_after_prefix(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache, const at::Tensor& block_tables,
                                    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t first_seq,
                                    double scale, int64_t window, double softcap, const float* alibi,
                                    const float* sinks, const SoftmaxState* prefix, bool causal) {
  check_prefill_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous and of q's shape");
  TORCH_CHECK(window >= 0 && !(window > 0 && prefix), "a sliding window of ", window,
              " keys (0: none), never with a cascade's prefix");
  TORCH_CHECK(softcap >= 0, "softcap must be 0 (none) or positive, not ", softcap);
  TORCH_CHECK(causal || !prefix, "a cascade's rows are causal");
  TORCH_CHECK(!(alibi && (prefix || !causal)), "ALiBi biases a causal layer's scores, never with a cascade's prefix");
  Plan plan = plan_sequences(query_start_loc.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), first_seq,
                             seq_lens.size(0), k_cache.size(2), prefix ? prefix->prefix_len : 0, window, causal);
  plan.softcap = static_cast<float>(softcap);
  plan.alibi = alibi;
  plan.sinks = sinks;
  dispatch_plan(q, k_cache, v_cache, [&]<typename scalar_t, typename cache_t, int64_t kHeadDim>() {
    run_plan<scalar_t, cache_t, kHeadDim>(plan, out, q, k_cache, v_cache, block_tables, seq_lens, scale, prefix,
                                          nullptr);
  });
}

SoftmaxState prefix_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& query_start_loc, int64_t prefix_len, double scale, double softcap) {
  check_prefill_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc);
  TORCH_CHECK(prefix_len > 0 && prefix_len % kKeyChunk == 0, "a cascade's prefix is whole chunks of ", kKeyChunk,
              " keys, not ", prefix_len);
  SoftmaxState state(q.size(0), q.size(1), q.size(2), prefix_len);
  Plan plan = plan_prefix(q.size(0), 0, k_cache.size(2), prefix_len);
  plan.softcap = static_cast<float>(softcap);
  at::Tensor unused;
  dispatch_plan(q, k_cache, v_cache, [&]<typename scalar_t, typename cache_t, int64_t kHeadDim>() {
    run_plan<scalar_t, cache_t, kHeadDim>(plan, unused, q, k_cache, v_cache, block_tables, seq_lens, scale, nullptr,
                                          &state);
  });
  return state;
}

}  // namespace pagedllm

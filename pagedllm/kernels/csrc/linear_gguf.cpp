// GGUF's blocks kept packed (quantization="gguf"): Q8_0, Q4_0, Q4_1 and MXFP4 weights, which also run Q4_K, AWQ and
// GPTQ weights (pagedllm.layers.gguf repacks them as Q4_1) and gpt-oss's MXFP4 experts, times activations quantized
// to 16 bits carried as two int8 halves. x's rows are quantized in each call, one scale per group of 32 k's (a GGUF
// block), and each group's products are summed exactly in int32:
//
//    v = x[m, k] / s (clamped to [-127, 127]) with s = max |x[m, group g]| / 127 (1 for a zero group),
//    hi = round(v), lo = round(256 (v - hi)) clamped to [-127, 127], qx[m, k] = 256 hi + lo, s_x[m, g] = s / 256,
//    sm[m, g] = s_x[m, g] * float(sum_{k in g} qx[m, k])
//    W[n, k] = d[n, g] q[n, k] (+ m[n, g])   Q8_0: q int8, no m; Q4_0: q in 0..15, m = -8 d; Q4_1: q in 0..15;
//                                            MXFP4: q = kMxfp4Values[nibble] in 0..24, m = -12 d (linear_gguf.h)
//    acc[m, n] = sum over groups g, in order, of  (float(sum_{k in g} qx q) * d[n, g]) * s_x[m, g]
//                                              (+ m[n, g] * sm[m, g])
//    out[m, n] = acc[m, n] (+ bias[n]), rounded once to out's dtype
//
// each float32 operation rounded, in that order (never fused into an FMA: `rounded`), so every ISA path gives the
// bits of the torch reference, pagedllm.layers.linear.gguf_reference, at any M: a row's result does not depend on
// the batch it runs in. The min term uses the quantized x's sum, as llama.cpp does: the error is then that of
// quantizing x against W itself (roughly centred), not against d q (all of one sign).
//
// Why 16 bits: llama.cpp quantizes x to 8 bits (hi alone), an error of up to s / 2 a value, which on SmolLM2's
// Q4_1 file moves a logit by tenths of a nat and flips near ties that the file itself (dequantised) does not: its
// answer to "What is the capital of France?" turns into French nonsense. lo takes that error to s / 512 (s / 256
// where it clamps). The weights' bytes are read once either way, but lo doubles the multiply-adds: the Q4 matmuls
// take ~1.45x as long (docs/benchmarks.md). activation_bits = 8 keeps hi alone (s_x = s, qx = hi): llama.cpp's
// arithmetic and speed, for a user who accepts its flips (PAGEDLLM_GGUF_ACTIVATION_BITS=8).
//
// Packed layout (pagedllm.layers.gguf.pack_gguf_weight): [ceil(N / 16), K / 32, group bytes], for each 16 output
// rows and 32 k's the rows' float32 d[16] (and Q4_1's m[16]), then the values in 64-byte rows whose 32-bit lane j
// is column j:
//
//    Q8_0: 8 quads of 4 k's:   byte 4 j + t of quad i = column j's k 4 i + t (int8)             576 bytes a group
//    Q4_x: 4 octets of 8 k's:  byte 4 j + t of octet o = column j's k 8 o + t in its low nibble,  320 (Q4_0, MXFP4)
//                              k 8 o + 4 + t in its high one                                      or 384 (Q4_1)
//
// so that one 64-byte row (an octet masked by 0x0F, or shifted by 4 first) is a zmm of 16 lanes of 4 k's, the operand
// vpdpbusd multiplies by a row's 4 bytes of hi (or lo) broadcast to every lane. Each half's products are summed
// apart, each |sum| <= 32 x 128 x 127 < 2^19, and joined as 256 sum_hi + sum_lo (< 2^28). Paths:
// - AVX512-VNNI: vpdpbusd multiplies unsigned bytes by signed ones. Q4: the nibbles (MXFP4's looked up by vpshufb)
//   are the unsigned operand, hi or lo the signed one. Q8_0: each half is stored + 128 (unsigned) and the weight is
//   the signed operand; the 128 x the group's column sums this adds is taken off, the column sums counted by
//   vpdpbusd of 1s with the weight (shared by the tile's rows).
// - AVX2, Q4: vpmaddubsw (unsigned x signed bytes, pairs summed in saturating int16) of the nibbles by a half,
//   |pair| <= 2 x 15 x 127, the 8 of a group added in int16 (|sum| <= 16 x 15 x 127 = 30480 < 2^15, so never
//   saturating), then vpmaddwd by 256 (hi) or 1 (lo) into int32; MXFP4's values (up to 24, looked up by vpshufb)
//   widened every two octets (|sum| <= 8 x 24 x 127 = 24384). Q8_0: x's values are stored whole, as int16 (256 hi
//   + lo), and vpmaddwd multiplies them by the weight widened to int16: a multiply-add per 16 products, where
//   vpmaddubsw's pairs of a byte by a half (up to 2 x 128 x 127) would each need widening on their own. Each half
//   of a block's columns (8, a ymm) runs over all its groups in turn, its float32 sums in registers.
// - plain C++: int32 loops over qx.
//
// Loops as linear_int8.cpp's: x is quantized once per call into buffers the threads share; the threads split the
// column blocks (and the row tiles when there are fewer blocks than threads); each walks its blocks in panels that
// fit in L2, and every tile of rows (its quantized x stays in L1) streams over a panel's blocks, so the weight is
// read from memory once per call whatever M is.
//
// activation_bits = 0 is another arithmetic, x in bf16 for a bf16 model with AVX512-BF16: linear_gguf_bf16.cpp.
#include "linear_gguf.h"

#include <c10/util/Half.h>

#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedllm {
namespace {

// x values quantized per task, a quarter of kConvertGrain's widened ones: a call of 32 rows x 1536 k's by one column
// block, whose quantization ran on one thread at kConvertGrain, took 128 us, 82 us on two (capped to AVX2).
constexpr int64_t kQuantizeGrain = kConvertGrain / 4;

// Groups ahead of the one a tile reads whose lines are asked for, towards L2. The weight streams from memory once per
// call, and at a few rows a tile a group's multiply-adds take less time than memory takes to deliver the next: with
// the hardware prefetcher alone, 4-16 rows over SmolLM2's 30 layers of weights ran up to 1.8x slower (Zen 5).
constexpr int64_t kPrefetchGroups = 8;
template <int64_t type>
inline void prefetch_group_ahead(const uint8_t* group) {
  const uint8_t* ahead = group + kPrefetchGroups * group_bytes(type);
#pragma GCC unroll 16
  for (int64_t line = 0; line < group_bytes(type); line += 64) prefetch_line<1>(ahead + line);
}

// A tile's quantized x in `halves` int8 halves (2: 16 bits, hi and lo; 1: 8 bits, hi alone, llama.cpp's): rows of
// K groups of 32 (`stride` bytes each), each group's 32 his then its 32 los (store_x's encoding), or, where the ISA's
// path takes them so (`whole_values`), its 32 values as int16 (256 hi + lo, or hi); and per row and group s_x and
// sm (`groups` apart).
template <int halves>
struct QxRows {
  const uint8_t* q;
  int64_t stride;  // bytes of a row's group
  const float* scale;
  const float* scaled_sum;
  int64_t groups;

  const uint8_t* hi(int r, int64_t g) const { return q + (r * groups + g) * stride; }
  const int16_t* values(int r, int64_t g) const { return reinterpret_cast<const int16_t*>(hi(r, g)); }
  const uint8_t* lo(int r, int64_t g) const { return hi(r, g) + kGroupK; }
  float s(int r, int64_t g) const { return scale[r * groups + g]; }
  float sm(int r, int64_t g) const { return scaled_sum[r * groups + g]; }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

constexpr int kTileRows = 8;  // 8 rows x (2 int32 + 1 float32 accumulators): 24 of the 32 zmm registers

// A half of a quantized x value as stored: Q8_0's + 128, vpdpbusd's unsigned operand.
inline uint8_t store_x(int8_t q, int64_t type) { return static_cast<uint8_t>(type == kQ8_0 ? q + 128 : q); }
constexpr bool whole_values(int64_t) { return false; }

inline __m512i broadcast_4_bytes(const uint8_t* p) { return _mm512_set1_epi32(load_4_bytes(p)); }

// c[r] = one group's int32 sums of row r's products: 256 sum_hi + sum_lo (with x's hi alone, sum_hi and sum_lo
// hold parts of its sum).
template <int rows, int64_t type, int halves>
inline void group_sums(const QxRows<halves>& x, int64_t g, const uint8_t* values, __m512i (&c)[rows]) {
  __m512i sum_hi[rows], sum_lo[rows];
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) sum_hi[r] = sum_lo[r] = _mm512_setzero_si512();
  if constexpr (type == kQ8_0) {
    __m512i col_sums = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int64_t i = 0; i < kGroupK / 4; ++i) {
      const __m512i w = _mm512_loadu_si512(values + i * kRowBytes);
      col_sums = _mm512_dpbusd_epi32(col_sums, _mm512_set1_epi8(1), w);
#pragma GCC unroll 8
      for (int r = 0; r < rows; ++r) {
        if constexpr (halves == 2) {
          sum_hi[r] = _mm512_dpbusd_epi32(sum_hi[r], broadcast_4_bytes(x.hi(r, g) + 4 * i), w);
          sum_lo[r] = _mm512_dpbusd_epi32(sum_lo[r], broadcast_4_bytes(x.lo(r, g) + 4 * i), w);
        } else {  // the two accumulators in turn: two independent chains
          __m512i& sum = i % 2 ? sum_lo[r] : sum_hi[r];
          sum = _mm512_dpbusd_epi32(sum, broadcast_4_bytes(x.hi(r, g) + 4 * i), w);
        }
      }
    }
    const __m512i offset = _mm512_slli_epi32(col_sums, 7);  // sum (half + 128) q - sum half q
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) {
      sum_hi[r] = _mm512_sub_epi32(sum_hi[r], offset);
      if constexpr (halves == 2) sum_lo[r] = _mm512_sub_epi32(sum_lo[r], offset);
    }
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
#pragma GCC unroll 4
    for (int64_t o = 0; o < kGroupK / 8; ++o) {
      const __m512i w = _mm512_loadu_si512(values + o * kRowBytes);
      __m512i lo = _mm512_and_si512(w, low4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
      if constexpr (type == kMXFP4) {
        lo = _mm512_shuffle_epi8(table, lo);
        hi = _mm512_shuffle_epi8(table, hi);
      }
#pragma GCC unroll 8
      for (int r = 0; r < rows; ++r) {
        if constexpr (halves == 2) {
          sum_hi[r] = _mm512_dpbusd_epi32(sum_hi[r], lo, broadcast_4_bytes(x.hi(r, g) + 8 * o));
          sum_hi[r] = _mm512_dpbusd_epi32(sum_hi[r], hi, broadcast_4_bytes(x.hi(r, g) + 8 * o + 4));
          sum_lo[r] = _mm512_dpbusd_epi32(sum_lo[r], lo, broadcast_4_bytes(x.lo(r, g) + 8 * o));
          sum_lo[r] = _mm512_dpbusd_epi32(sum_lo[r], hi, broadcast_4_bytes(x.lo(r, g) + 8 * o + 4));
        } else {  // one accumulator per nibble: two independent chains
          sum_hi[r] = _mm512_dpbusd_epi32(sum_hi[r], lo, broadcast_4_bytes(x.hi(r, g) + 8 * o));
          sum_lo[r] = _mm512_dpbusd_epi32(sum_lo[r], hi, broadcast_4_bytes(x.hi(r, g) + 8 * o + 4));
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) {
    c[r] = halves == 2 ? _mm512_add_epi32(_mm512_slli_epi32(sum_hi[r], 8), sum_lo[r])
                       : _mm512_add_epi32(sum_hi[r], sum_lo[r]);  // the two chains of hi's products
  }
}

// acc[rows][16] = x[rows] times a block's `groups` groups.
template <int rows, int64_t type, int halves>
void dot_tile(const QxRows<halves>& x, const uint8_t* block, int64_t groups, float* acc) {
  __m512 f[rows];
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) f[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = block + g * group_bytes(type);
    prefetch_group_ahead<type>(group);
    __m512i c[rows];
    group_sums<rows, type, halves>(x, g, group + header_bytes(type), c);
    const float* header = reinterpret_cast<const float*>(group);
    const __m512 d = _mm512_loadu_ps(header);
    // Q4_1 stores m, Q4_0 has m = -8 d, MXFP4 -12 d; Q8_0 has none (unused below).
    const __m512 m =
        type == kQ4_1 ? _mm512_loadu_ps(header + kBlock) : _mm512_mul_ps(d, _mm512_set1_ps(min_per_d(type)));
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) {
      const __m512 sum = _mm512_cvtepi32_ps(c[r]);
      f[r] = _mm512_add_ps(f[r], rounded(_mm512_mul_ps(_mm512_mul_ps(sum, d), _mm512_set1_ps(x.s(r, g)))));
      if (type != kQ8_0) f[r] = _mm512_add_ps(f[r], rounded(_mm512_mul_ps(m, _mm512_set1_ps(x.sm(r, g)))));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) _mm512_storeu_ps(acc + r * kBlock, f[r]);
}

#elif defined(__AVX2__)

constexpr int kTileRows = 4;  // 4 rows x (2 integer + 1 float32 accumulators), the weight's vectors: 16 ymm

inline uint8_t store_x(int8_t q, int64_t) { return static_cast<uint8_t>(q); }
// Q8_0 multiplies x's 16-bit values whole (vpmaddwd), the Q4 types its int8 halves (vpmaddubsw).
constexpr bool whole_values(int64_t type) { return type == kQ8_0; }

// The 4 (or 8) bytes at p in every lane. In asm, so that each is loaded where it is used: GCC would otherwise hoist
// the broadcasts of a tile's rows out of the loop over the column halves, which does not change them, and spill
// them (the Q4 calls ran ~1.3x slower so).
inline __m256i broadcast_4_bytes(const uint8_t* p) {
  __m256i v;
  asm volatile("vpbroadcastd %1, %0" : "=x"(v) : "m"(*reinterpret_cast<const int32_t*>(p)));
  return v;
}
inline __m256i broadcast_8_bytes(const int16_t* p) {
  __m256i v;
  asm volatile("vpbroadcastq %1, %0" : "=x"(v) : "m"(*reinterpret_cast<const int64_t*>(p)));
  return v;
}

// c[rows] = one group's int32 sums of products over 8 columns (the 32-byte half of each 64-byte row at `values`).
template <int rows, int64_t type, int halves>
inline void half_sums(const QxRows<halves>& x, int64_t g, const uint8_t* values, __m256i (&c)[rows]) {
  if constexpr (type == kQ8_0) {
    // Each 4 k's of 4 columns widened to int16 (vpmovsxbw) times the row's 4 values (broadcast): vpmaddwd sums the
    // products in pairs, two int32 lanes a column, |sum| <= 32 x 128 x 32639 < 2^28; vphaddd joins each column's
    // two lanes, in the order (0, 1, 4, 5 | 2, 3, 6, 7) that vpermq puts right.
    __m256i first4[rows], last4[rows];
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) first4[r] = last4[r] = _mm256_setzero_si256();
#pragma GCC unroll 2  // all 8: GCC sums the quads' products in trees and spills them (the LM head ran 1.18x slower)
    for (int64_t i = 0; i < kGroupK / 4; ++i) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + i * kRowBytes));
      const __m256i w_first = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
      const __m256i w_last = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
#pragma GCC unroll 8
      for (int r = 0; r < rows; ++r) {
        const __m256i xs = broadcast_8_bytes(x.values(r, g) + 4 * i);
        first4[r] = _mm256_add_epi32(first4[r], _mm256_madd_epi16(w_first, xs));
        last4[r] = _mm256_add_epi32(last4[r], _mm256_madd_epi16(w_last, xs));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) c[r] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(first4[r], last4[r]), 0xD8);
  } else {
    // 256 sum_hi + sum_lo: the int16 pair sums of the his widened by vpmaddwd with 256s, the los' with 1s (with x's
    // hi alone, its sums widened with 1s), every 4 octets (MXFP4: 2).
    constexpr int64_t kOctetsPerWidening = type == kMXFP4 ? 2 : 4;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), times256 = _mm256_set1_epi16(256);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) c[r] = _mm256_setzero_si256();
    for (int64_t o0 = 0; o0 < kGroupK / 8; o0 += kOctetsPerWidening) {
      __m256i pairs_hi[rows], pairs_lo[rows];  // int16 pair sums
#pragma GCC unroll 8
      for (int r = 0; r < rows; ++r) pairs_hi[r] = pairs_lo[r] = _mm256_setzero_si256();
      for (int64_t o = o0; o < o0 + kOctetsPerWidening; ++o) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + o * kRowBytes));
        __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
        if constexpr (type == kMXFP4) {
          lo = _mm256_shuffle_epi8(table, lo);
          hi = _mm256_shuffle_epi8(table, hi);
        }
#pragma GCC unroll 8
        for (int r = 0; r < rows; ++r) {
          const uint8_t *xh = x.hi(r, g) + 8 * o, *xl = x.lo(r, g) + 8 * o;
          pairs_hi[r] = _mm256_add_epi16(pairs_hi[r], _mm256_add_epi16(
              _mm256_maddubs_epi16(lo, broadcast_4_bytes(xh)), _mm256_maddubs_epi16(hi, broadcast_4_bytes(xh + 4))));
          if constexpr (halves == 2) {
            pairs_lo[r] = _mm256_add_epi16(pairs_lo[r], _mm256_add_epi16(
                _mm256_maddubs_epi16(lo, broadcast_4_bytes(xl)), _mm256_maddubs_epi16(hi, broadcast_4_bytes(xl + 4))));
          }
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < rows; ++r) {
        c[r] = _mm256_add_epi32(c[r], halves == 2 ? _mm256_add_epi32(_mm256_madd_epi16(pairs_hi[r], times256),
                                                                    _mm256_madd_epi16(pairs_lo[r], ones))
                                                  : _mm256_madd_epi16(pairs_hi[r], ones));
      }
    }
  }
}

// One half of the block's columns at a time over all its groups, so that the half's float32 accumulators stay in
// registers.
template <int rows, int64_t type, int halves>
void dot_tile(const QxRows<halves>& x, const uint8_t* block, int64_t groups, float* acc) {
  for (int h = 0; h < 2; ++h) {
    __m256 f[rows];
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) f[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* group = block + g * group_bytes(type);
      if (h == 0) prefetch_group_ahead<type>(group);  // the second half finds the block in cache
      __m256i c[rows];
      half_sums<rows, type, halves>(x, g, group + header_bytes(type) + 32 * h, c);
      const float* header = reinterpret_cast<const float*>(group) + 8 * h;
      const __m256 d = _mm256_loadu_ps(header);
      // Q4_1 stores m, Q4_0 has m = -8 d, MXFP4 -12 d; Q8_0 has none (unused below).
      const __m256 m =
          type == kQ4_1 ? _mm256_loadu_ps(header + kBlock) : _mm256_mul_ps(d, _mm256_set1_ps(min_per_d(type)));
#pragma GCC unroll 8
      for (int r = 0; r < rows; ++r) {
        const __m256 sum = _mm256_cvtepi32_ps(c[r]);
        f[r] = _mm256_add_ps(f[r], rounded(_mm256_mul_ps(_mm256_mul_ps(sum, d), _mm256_set1_ps(x.s(r, g)))));
        if (type != kQ8_0) f[r] = _mm256_add_ps(f[r], rounded(_mm256_mul_ps(m, _mm256_set1_ps(x.sm(r, g)))));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) _mm256_storeu_ps(acc + r * kBlock + 8 * h, f[r]);
  }
}

#else  // plain C++: any CPU, vectorised by the compiler as far as it can

constexpr int kTileRows = 4;

inline uint8_t store_x(int8_t q, int64_t) { return static_cast<uint8_t>(q); }
constexpr bool whole_values(int64_t) { return false; }

// Value t (0..3) of lane j of row i of a group's values.
template <int64_t type>
inline int weight_value(const uint8_t* values, int64_t i, int j, int t) {
  if constexpr (type == kQ8_0) return static_cast<int8_t>(values[i * kRowBytes + 4 * j + t]);
  const uint8_t byte = values[(i / 2) * kRowBytes + 4 * j + t];
  const int nibble = i % 2 ? byte >> 4 : byte & 0x0F;  // Q4: row i's k's are octet i / 2's low (even i) or high nibbles
  return type == kMXFP4 ? kMxfp4Values[nibble] : nibble;
}

template <int rows, int64_t type, int halves>
void dot_tile(const QxRows<halves>& x, const uint8_t* block, int64_t groups, float* acc) {
  std::fill(acc, acc + rows * kBlock, 0.f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = block + g * group_bytes(type);
    const uint8_t* values = group + header_bytes(type);
    int32_t c[rows][kBlock] = {};
    for (int64_t i = 0; i < kGroupK / 4; ++i) {  // 4 k's at a time: k = 4 i + t
      for (int r = 0; r < rows; ++r) {
        const int8_t* xh = reinterpret_cast<const int8_t*>(x.hi(r, g)) + 4 * i;
        const int8_t* xl = reinterpret_cast<const int8_t*>(x.lo(r, g)) + 4 * i;
        for (int j = 0; j < kBlock; ++j) {
          for (int t = 0; t < 4; ++t) {
            c[r][j] += weight_value<type>(values, i, j, t) * (halves == 2 ? 256 * xh[t] + xl[t] : xh[t]);
          }
        }
      }
    }
    const float* d = reinterpret_cast<const float*>(group);
    float scaled[rows][kBlock], mins[rows][kBlock];
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < kBlock; ++j) {
        scaled[r][j] = static_cast<float>(c[r][j]) * d[j] * x.s(r, g);
        mins[r][j] = (type == kQ4_1 ? d[kBlock + j] : d[j] * min_per_d(type)) * x.sm(r, g);
      }
    }
    rounding_barrier(scaled);
    rounding_barrier(mins);
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < kBlock; ++j) {
        acc[r * kBlock + j] += scaled[r][j];
        if (type != kQ8_0) acc[r * kBlock + j] += mins[r][j];
      }
    }
  }
}

#endif

// dot_tile for a tile of `rows` <= kTileRows rows.
template <int64_t type, int max_rows = kTileRows, int halves>
void run_dot_tile(int rows, const QxRows<halves>& x, const uint8_t* block, int64_t groups, float* acc) {
  if constexpr (max_rows > 1) {
    if (rows < max_rows) return run_dot_tile<type, max_rows - 1>(rows, x, block, groups, acc);
  }
  dot_tile<max_rows, type>(x, block, groups, acc);
}

template <typename T, int64_t type, int halves>
struct GgufProblem {
  QxRows<halves> x;  // all m rows
  const uint8_t* packed;
  const T* bias;  // nullptr: no bias
  T* out;
  int64_t m, n, groups, out_stride;

  void run_tile(int64_t m0, int rows, int64_t b) const {
    alignas(64) float acc[kTileRows * kBlock];
    const QxRows<halves> tile{x.q + m0 * groups * x.stride, x.stride, x.scale + m0 * groups,
                              x.scaled_sum + m0 * groups, groups};
    run_dot_tile<type>(rows, tile, packed + b * groups * group_bytes(type), groups, acc);
    store_rows(out, out_stride, n, bias, static_cast<const float*>(nullptr), acc, m0, rows, b);
  }

  // Column blocks [b0, b1) times row tiles [t0, t1), panel by panel.
  void run(int64_t b0, int64_t b1, int64_t t0, int64_t t1) const {
    const int64_t panel_blocks = std::max<int64_t>(1, kPanelBytes / (groups * group_bytes(type)));
    for (int64_t p0 = b0; p0 < b1; p0 += panel_blocks) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t m0 = t * kTileRows;
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - m0));
        for (int64_t b = p0; b < std::min(p0 + panel_blocks, b1); ++b) run_tile(m0, rows, b);
      }
    }
  }
};

// Bytes of a row's group of quantized x (QxRows).
constexpr int64_t x_group_bytes(int64_t type, int halves) {
  return (whole_values(type) ? int64_t{sizeof(int16_t)} : halves) * kGroupK;
}

// One group of a row: its 32 v's (quantize_spans) as stored halves, his then los (the 16-bit encoding at the top),
// or as int16 values, s turned into s_x, and sm = s_x * the sum of the group's qx (unused by Q8_0, which has no min
// term).
template <int64_t type, int halves>
void store_group(const float* v, uint8_t* stored, float& s, float& sm) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // The loop below in two zmm of 16 values, the same operations on the same floats: GCC compiles that loop to ymm
  // and mask juggling, 4-5% of the mixed workload on a Zen 5. round_half_even in registers.
  const __m512 round = _mm512_set1_ps(kRoundToInt);
  const __m512i offset = _mm512_set1_epi32(type == kQ8_0 ? 128 : 0);  // store_x
  __m512i sum = _mm512_setzero_si512();
  for (int i = 0; i < 2; ++i) {
    const __m512 x = _mm512_loadu_ps(v + 16 * i);
    const __m512 hi = _mm512_sub_ps(_mm512_add_ps(x, round), round);
    __m512i value = _mm512_cvtps_epi32(hi);  // an integer already: exact
    _mm_storeu_si128(reinterpret_cast<__m128i*>(stored + 16 * i), _mm512_cvtepi32_epi8(_mm512_add_epi32(value, offset)));
    if constexpr (halves == 2) {
      const __m512 r = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(x, hi), _mm512_set1_ps(256.f)),
                                                   _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
      const __m512i lo = _mm512_cvtps_epi32(_mm512_sub_ps(_mm512_add_ps(r, round), round));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(stored + kGroupK + 16 * i),
                       _mm512_cvtepi32_epi8(_mm512_add_epi32(lo, offset)));
      value = _mm512_add_epi32(_mm512_slli_epi32(value, 8), lo);
    }
    sum = _mm512_add_epi32(sum, value);
  }
  if constexpr (halves == 2) s = s / 256.f;
  sm = s * static_cast<float>(_mm512_reduce_add_epi32(sum));
#else
  int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < kGroupK; ++j) {
    const int8_t hi = quantized(v[j]);
    // v - hi is exact
    const int8_t lo = halves == 2 ? quantized(std::min(std::max((v[j] - hi) * 256.f, -127.f), 127.f)) : 0;
    const int16_t value = static_cast<int16_t>(halves == 2 ? 256 * hi + lo : hi);
    if constexpr (whole_values(type)) {
      reinterpret_cast<int16_t*>(stored)[j] = value;
    } else {
      stored[j] = store_x(hi, type);
      if constexpr (halves == 2) stored[kGroupK + j] = store_x(lo, type);
    }
    sum += value;
  }
  if constexpr (halves == 2) s = s / 256.f;
  sm = s * static_cast<float>(sum);
#endif
}

// Rows [begin, end) of x (`ld` apart) quantized into `scratch` (sized for all of x's rows), with `v` (k floats) to
// work in.
template <typename T, int64_t type, int halves>
void quantize_rows(const T* x, int64_t ld, int64_t begin, int64_t end, int64_t k, GgufScratch& scratch, float* v) {
  const int64_t groups = k / kGroupK;
  constexpr int64_t stride = x_group_bytes(type, halves);
  for (int64_t r = begin; r < end; ++r) {
    quantize_spans(x + r * ld, k, kGroupK, scratch.scale.data() + r * groups, v);
    for (int64_t g = 0; g < groups; ++g) {
      store_group<type, halves>(v + g * kGroupK, scratch.quantized_x.data() + (r * groups + g) * stride,
                                scratch.scale[r * groups + g], scratch.scaled_sum[r * groups + g]);
    }
  }
}

// out [m, n] (rows `out_stride` apart) = x [m, k] (rows `ld` apart) times the packed blocks, plus bias: x quantized by
// the threads together (or on this one, `on_thread`) into `scratch`, then the column blocks and row tiles split.
template <typename T, int64_t type, int halves>
void run_gguf(T* out, int64_t out_stride, int64_t n, const T* x, int64_t ld, int64_t m, int64_t k,
              const uint8_t* packed, const T* bias, GgufScratch& scratch, bool on_thread) {
  const int64_t groups = k / kGroupK;
  constexpr int64_t stride = x_group_bytes(type, halves);
  scratch.quantized_x.resize(m * groups * stride);
  scratch.scale.resize(m * groups);
  scratch.scaled_sum.resize(m * groups);
  if (on_thread) {
    scratch.v.resize(k);
    quantize_rows<T, type, halves>(x, ld, 0, m, k, scratch, scratch.v.data());
  } else {
    at::parallel_for(0, m, std::max<int64_t>(1, kQuantizeGrain / std::max<int64_t>(1, k)),
                     [&](int64_t begin, int64_t end) {
                       std::vector<float> v(k);
                       quantize_rows<T, type, halves>(x, ld, begin, end, k, scratch, v.data());
                     });
  }
  const GgufProblem<T, type, halves> problem{
      {scratch.quantized_x.data(), stride, scratch.scale.data(), scratch.scaled_sum.data(), groups},
      packed, bias, out, m, n, groups, out_stride};
  const int64_t blocks = (n + kBlock - 1) / kBlock, tiles = (m + kTileRows - 1) / kTileRows;
  if (on_thread) return problem.run(0, blocks, 0, tiles);
  split_blocks_and_tiles(blocks, tiles, m * n * k,
                         [&](int64_t b0, int64_t b1, int64_t t0, int64_t t1) { problem.run(b0, b1, t0, t1); });
}

template <typename T, int halves>
void run_gguf_type(T* out, int64_t out_stride, int64_t n, const T* x, int64_t ld, int64_t m, int64_t k,
                   const uint8_t* packed, int64_t type, const T* bias, GgufScratch& scratch, bool on_thread) {
  switch (type) {
    case kQ4_0: return run_gguf<T, kQ4_0, halves>(out, out_stride, n, x, ld, m, k, packed, bias, scratch, on_thread);
    case kQ4_1: return run_gguf<T, kQ4_1, halves>(out, out_stride, n, x, ld, m, k, packed, bias, scratch, on_thread);
    case kMXFP4: return run_gguf<T, kMXFP4, halves>(out, out_stride, n, x, ld, m, k, packed, bias, scratch, on_thread);
    default: return run_gguf<T, kQ8_0, halves>(out, out_stride, n, x, ld, m, k, packed, bias, scratch, on_thread);
  }
}

template <typename T>
void run_gguf_bits(T* out, int64_t out_stride, int64_t n, const T* x, int64_t ld, int64_t m, int64_t k,
                   const uint8_t* packed, int64_t type, const T* bias, int64_t activation_bits, GgufScratch& scratch,
                   bool on_thread) {
  if (activation_bits == 8) {
    return run_gguf_type<T, 1>(out, out_stride, n, x, ld, m, k, packed, type, bias, scratch, on_thread);
  }
  run_gguf_type<T, 2>(out, out_stride, n, x, ld, m, k, packed, type, bias, scratch, on_thread);
}

template <typename T>
void linear_gguf_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t type,
                      const c10::optional<at::Tensor>& bias, int64_t activation_bits) {
  GgufScratch scratch;
  run_gguf_bits<T>(out.data_ptr<T>(), out.stride(0), out.size(1), x.data_ptr<T>(), x.stride(0), x.size(0), x.size(1),
                   packed.data_ptr<uint8_t>(), type, bias ? bias->data_ptr<T>() : nullptr, activation_bits, scratch,
                   false);
}

}  // namespace

template <typename T>
void linear_gguf_on_thread(T* out, int64_t out_stride, int64_t n, const T* x, int64_t m, int64_t k,
                           const uint8_t* packed, int64_t ggml_type, int64_t activation_bits, GgufScratch& scratch) {
  run_gguf_bits<T>(out, out_stride, n, x, k, m, k, packed, ggml_type, nullptr, activation_bits, scratch, true);
}
template void linear_gguf_on_thread(float*, int64_t, int64_t, const float*, int64_t, int64_t, const uint8_t*, int64_t,
                                    int64_t, GgufScratch&);
template void linear_gguf_on_thread(c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*, int64_t, int64_t,
                                    const uint8_t*, int64_t, int64_t, GgufScratch&);

void linear_gguf(at::Tensor out, at::Tensor x, at::Tensor packed, int64_t ggml_type,
                 c10::optional<at::Tensor> bias, int64_t activation_bits) {
  check_gguf_packed(x, out, packed, ggml_type);
  TORCH_CHECK(activation_bits == 8 || activation_bits == 16 || activation_bits == 0,
              "activation_bits must be 16, 8 or 0 (x in bf16), got ", activation_bits);
  check_operands(out, x, packed.size(0), packed.size(1) * kGroupK, bias);
  if (activation_bits == 0) return linear_gguf_bf16(out, x, packed, ggml_type, bias);
  if (out.numel() == 0) return;
  if (x.scalar_type() == at::kBFloat16) {
    return linear_gguf_impl<c10::BFloat16>(out, x, packed, ggml_type, bias, activation_bits);
  }
  linear_gguf_impl<float>(out, x, packed, ggml_type, bias, activation_bits);
}

// pagedllm.layers.gguf.pack_gguf_weight_reference in one pass over the rows (its torch ops make ~8 passes, 0.3-0.4 s
// of SmolLM2's load): each (16 rows, group) unit written whole by one thread, its missing rows left zero.
at::Tensor pack_gguf_weight(at::Tensor rows, int64_t ggml_type) {
  TORCH_CHECK(is_gguf_type(ggml_type), "ggml_type must be Q4_0 (2), Q4_1 (3), Q8_0 (8) or MXFP4 (39), got ",
              ggml_type);
  const int64_t scales = ggml_type == kQ4_1 ? 2 : 1;  // f16 d (and m) at the start of a GGUF block, or MXFP4's e
  const int64_t head = ggml_type == kMXFP4 ? 1 : 2 * scales;
  const int64_t block_bytes = head + (ggml_type == kQ8_0 ? kGroupK : kGroupK / 2);
  TORCH_CHECK(rows.device().is_cpu() && rows.dim() == 2 && rows.scalar_type() == at::kByte && rows.is_contiguous()
                  && rows.size(1) % block_bytes == 0,
              "rows must be a contiguous uint8 [N, K/32 * ", block_bytes, "] of GGUF blocks, got ", rows.sizes());
  const int64_t n = rows.size(0), groups = rows.size(1) / block_bytes, unit_bytes = group_bytes(ggml_type);
  const int64_t value_rows = ggml_type == kQ8_0 ? kGroupK / 4 : kGroupK / 8;  // 64-byte rows: quads, or octets
  at::Tensor packed = at::zeros({(n + kBlock - 1) / kBlock, groups, unit_bytes}, rows.options());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, packed.size(0) * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / groups, g = unit % groups;
      float* header = reinterpret_cast<float*>(dst + unit * unit_bytes);  // d[16] (, m[16])
      uint8_t* values = dst + unit * unit_bytes + header_bytes(ggml_type);
      for (int64_t j = 0; j < kBlock && b * kBlock + j < n; ++j) {
        const uint8_t* block = src + (b * kBlock + j) * rows.size(1) + g * block_bytes;
        for (int64_t i = 0; i < scales; ++i) {
          if (ggml_type == kMXFP4) {  // 2^(e - 128): float32's bits of exponent e - 1 (subnormal for e < 2)
            const uint32_t bits = block[0] < 2 ? 0x00200000u << block[0] : static_cast<uint32_t>(block[0] - 1) << 23;
            std::memcpy(header + j, &bits, sizeof(bits));
            continue;
          }
          uint16_t bits;
          std::memcpy(&bits, block + 2 * i, sizeof(bits));
          header[i * kBlock + j] = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
        }
        const uint8_t* q = block + head;
        for (int64_t row = 0; row < value_rows; ++row) {
          for (int64_t t = 0; t < 4; ++t) {  // byte t of lane j of 64-byte row `row`
            // Q8_0: quad `row`'s k 4 row + t. Q4: octet `row`'s k 8 row + t (low nibble) and 8 row + 4 + t (high),
            // value k in byte k % 16 of the block, its low nibble for k < 16.
            const auto nibble = [&](int64_t k) { return k < 16 ? q[k] & 0x0F : q[k - 16] >> 4; };
            values[row * kRowBytes + 4 * j + t] = ggml_type == kQ8_0
                ? q[4 * row + t]
                : static_cast<uint8_t>(nibble(8 * row + t) | nibble(8 * row + 4 + t) << 4);
          }
        }
      }
    }
  });
  return packed;
}

}  // namespace pagedllm

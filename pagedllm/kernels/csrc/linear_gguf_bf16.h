// GGUF's blocks times x in bf16 (activation_bits = 0): what the two ways of multiplying them share, the AMX-BF16
// tiles (linear_gguf_amx.cpp) and the AVX512-BF16 vectors (linear_gguf_bf16.cpp): the blocks dequantised to bf16
// pairs, and the stores of the float32 sums.
#pragma once

#include "linear_gguf.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGEDLLM_GGUF_BF16 1
#else
#define PAGEDLLM_GGUF_BF16 0
#endif

#if PAGEDLLM_GGUF_BF16
#include <immintrin.h>

#include <type_traits>
#endif

namespace pagedllm {

// Runs x W^T (+ bias) in AMX-BF16 tiles, or, with `gated`, linear_gguf_silu_and_mul's gate_up: false where this
// build or this process has no tiles (linear_gguf_amx.cpp).
bool run_gguf_bf16_tiles(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t type,
                         const c10::optional<at::Tensor>& bias, bool gated);

#if PAGEDLLM_GGUF_BF16
namespace gguf_bf16 {

constexpr int64_t kPairRowBytes = 64;                    // a row of 16 columns' bf16 pairs: one zmm
constexpr int64_t kGroupBytes = kGroupK / 2 * kPairRowBytes;  // one dequantised group of a block: 16 rows

// Block b of a call as it reads them: a gated call (linear_gguf_silu_and_mul, half_blocks > 0) takes gate block j
// and up block half_blocks + j as blocks 2 j and 2 j + 1, whose sums make out's columns 16 j ...; others in order.
inline int64_t physical_block(int64_t b, int64_t half_blocks) {
  return half_blocks == 0 ? b : b / 2 + b % 2 * half_blocks;
}

// Rows [r0, r1) of x (rows `stride` values apart) rounded to bf16 into dst, k values a row: x's copy that both ways
// multiply where x is float32 (and the tiles, for a last partial tile of bf16 rows).
template <typename T>
void stage_rows_in_bf16(const T* x, int64_t stride, int64_t r0, int64_t r1, int64_t k, c10::BFloat16* dst) {
  const int64_t grain = std::max<int64_t>(1, kConvertGrain / std::max<int64_t>(1, k));
  at::parallel_for(r0, r1, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      c10::BFloat16* row = dst + (r - r0) * k;
#pragma omp simd
      for (int64_t i = 0; i < k; ++i) row[i] = from_float<c10::BFloat16>(to_float(x[r * stride + i]));
    }
  });
}

// Writes one dequantised group of a block: W's pairs of k's as `tdpbf16ps` and `vdpbf16ps` take them.
template <int64_t type>
struct GroupDequantizer {
  __m512 d, m;
  __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                   5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);  // lane j of two vectors -> pair j
  uint8_t* tile;

  GroupDequantizer(const uint8_t* group, uint8_t* tile) : tile(tile) {
    const float* header = reinterpret_cast<const float*>(group);
    d = _mm512_loadu_ps(header);
    m = type == kQ4_1 ? _mm512_loadu_ps(header + kBlock)
        : type == kQ8_0 ? _mm512_setzero_ps() : _mm512_mul_ps(d, _mm512_set1_ps(min_per_d(type)));
  }

  // (MXFP4's nibbles looked up in kMxfp4Values)
  __m512 weight(__m512i q) const {
    if constexpr (type == kMXFP4) {
      const __m512 table =
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values))));
      return _mm512_fmadd_ps(d, _mm512_permutexvar_ps(q, table), m);
    }
    return _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q), m);
  }

  // Tile row `row`: column j's k's (even, odd) from lane j of the two vectors of values.
  void store(int row, __m512i even, __m512i odd) const {
    const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(weight(odd), weight(even)));
    _mm512_store_si512(tile + row * kPairRowBytes, _mm512_permutexvar_epi16(pairs, both));
  }
};

template <int shift>  // the 4-bit value at bit `shift` of each lane
inline __m512i nibble(__m512i v) {
  if constexpr (shift == 28) return _mm512_srli_epi32(v, 28);
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  if constexpr (shift == 0) return _mm512_and_si512(v, low4);
  return _mm512_and_si512(_mm512_srli_epi32(v, shift), low4);
}

template <int t>  // the signed byte t of each lane
inline __m512i signed_byte(__m512i v) {
  if constexpr (t == 3) return _mm512_srai_epi32(v, 24);
  return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * t), 24);
}

// One group (its packed bytes at `group`, linear_gguf.cpp's layout) into the 16 x 64 bytes at `tile`: row i holds
// each column's k's 2 i and 2 i + 1 (a tile's B operand, and what one `vdpbf16ps` multiplies).
template <int64_t type>
[[gnu::always_inline]] inline void dequantize_group(const uint8_t* group, uint8_t* tile) {
  const GroupDequantizer<type> w(group, tile);
  const uint8_t* values = group + header_bytes(type);
  if constexpr (type == kQ8_0) {  // quad i: byte t of lane j is k 4 i + t
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m512i v = _mm512_loadu_si512(values + i * kRowBytes);
      w.store(2 * i, signed_byte<0>(v), signed_byte<1>(v));
      w.store(2 * i + 1, signed_byte<2>(v), signed_byte<3>(v));
    }
  } else {  // octet o: byte t of lane j is k 8 o + t in its low nibble, 8 o + 4 + t in its high one
#pragma GCC unroll 4
    for (int o = 0; o < 4; ++o) {
      const __m512i v = _mm512_loadu_si512(values + o * kRowBytes);
      w.store(4 * o, nibble<0>(v), nibble<8>(v));
      w.store(4 * o + 1, nibble<16>(v), nibble<24>(v));
      w.store(4 * o + 2, nibble<4>(v), nibble<12>(v));
      w.store(4 * o + 3, nibble<20>(v), nibble<28>(v));
    }
  }
}

// from_float<bf16>'s bits of 16 floats, in the low half of each 32-bit lane: to nearest even on the bits, a NaN
// kept a NaN.
inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i top = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(top, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// 16 of T's values as floats: a bias's (or its zeros past `mask`), round_to<T>'s of 16 floats.
template <typename T>
inline __m512 load16(const T* p, __mmask16 mask) {
  if constexpr (std::is_same_v<T, float>) return _mm512_maskz_loadu_ps(mask, p);
  else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}
// dst[j] = from_float<T>(v[j]) for the lanes of mask.
template <typename T>
inline void store16(T* dst, __m512 v, __mmask16 mask) {
  if constexpr (std::is_same_v<T, float>) _mm512_mask_storeu_ps(dst, mask, v);
  else _mm256_mask_storeu_epi16(dst, mask, _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// out[m0 + r, n0 + j] = acc[r][j] (+ bias[n0 + j]) for r < rows, j < cols, rounded once to T as from_float rounds.
template <typename T>
void store_tile(T* out, int64_t out_stride, const T* bias, const float* acc, int64_t m0, int rows, int64_t n0,
                int cols) {
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b = bias ? load16(bias + n0, mask) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    store16(out + (m0 + r) * out_stride + n0, _mm512_add_ps(_mm512_load_ps(acc + r * kBlock), b), mask);
  }
}

// out[m0 + r, n0 + j] = silu(g) * u for r < rows, j < 16, with g = gate[r][j] + bias[n0 + j] and u = up[r][j] +
// bias[up_offset + n0 + j] each rounded once to T: linear_gguf's store of gate and up, then silu_and_mul, in one
// (the same bits: silu_times's steps, 16 lanes at a time, where GCC vectorised its loop 8 wide).
template <typename T>
void store_silu_tile(T* out, int64_t out_stride, const T* bias, int64_t up_offset, const float* gate, const float* up,
                     int64_t m0, int rows, int64_t n0) {
  constexpr __mmask16 kAll = 0xFFFF;
  const __m512 gate_bias = bias ? load16(bias + n0, kAll) : _mm512_setzero_ps();
  const __m512 up_bias = bias ? load16(bias + up_offset + n0, kAll) : _mm512_setzero_ps();
  const __m512 one = _mm512_set1_ps(1.f), highest = _mm512_set1_ps(expf_constants::kHighest);
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (int r = 0; r < rows; ++r) {
    const __m512 g = round16<T>(_mm512_add_ps(_mm512_load_ps(gate + r * kBlock), gate_bias));
    const __m512 u = round16<T>(_mm512_add_ps(_mm512_load_ps(up + r * kBlock), up_bias));
    // exp_approx(-g): exp_approx16 clamps below as exp_approx does (1 + its denormal or 0 is 1), not above.
    const __m512 minus_g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign));
    const __m512 e = exp_approx16(_mm512_min_ps(minus_g, highest));
    store16(out + (m0 + r) * out_stride + n0, _mm512_mul_ps(round16<T>(_mm512_div_ps(g, _mm512_add_ps(one, e))), u),
            kAll);
  }
}

}  // namespace gguf_bf16
#endif

}  // namespace pagedllm

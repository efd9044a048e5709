// 4-bit weights times 8-bit activations (W4A8): the GGUF Q4_0 and Q4_1 kernel of linear_gguf, which also runs
// Q4_K, AWQ and GPTQ weights (pagedllm.layers.gguf repacks them as Q4_1). As llama.cpp multiplies Q4 blocks by
// Q8_1 activations, x's rows are quantized in each call, one scale per group of 32 k's, and each group's products
// are summed exactly in int32:
//
//    s_x[m, g] = max |x[m, group g]| / 127 (1 for a zero group), qx[m, k] = round(x[m, k] / s_x[m, g]),
//    sm[m, g] = s_x[m, g] * float(sum_{k in g} qx[m, k])
//    W[n, k] = d[n, g] q[n, k] + m[n, g]   (q in 0..15; Q4_0: m = -8 d)
//    acc[m, n] = sum over groups g, in order, of  (float(sum_{k in g} qx q) * d[n, g]) * s_x[m, g]
//                                              +  m[n, g] * sm[m, g]
//    out[m, n] = acc[m, n] (+ bias[n]), rounded once to out's dtype
//
// each float32 operation rounded, in that order (never fused into an FMA: `rounded`), so every ISA path gives the
// bits of the torch reference, pagedllm.layers.linear.w4a8_reference, at any M: a row's result does not depend on
// the batch it runs in. The min term uses the quantized x's sum, as llama.cpp does: the error is then that of
// quantizing x against W itself (roughly centred), not against d q (all of one sign).
//
// Packed layout (pagedllm.layers.gguf.pack_gguf_weight): [ceil(N / 16), K / 32, group bytes], for each 16 output
// rows and 32 k's the rows' float32 d[16] (and Q4_1's m[16]), then 4 octets of 8 k's, 64 bytes each, byte 4 j + t
// of octet o holding column j's k = 8 o + t in its low nibble and k = 8 o + 4 + t in its high one:
//
//    octet o, 64 bytes:  | col 0: k 8o..8o+3 | col 1: .. | .. | col 15: .. |  low nibbles
//                        | col 0: k 8o+4..+7 | col 1: .. | .. | col 15: .. |  high nibbles
//
// so that one octet masked by 0x0F is one zmm whose 32-bit lane j is column j's 4 k's (shifted by 4 first: the next
// 4 k's), the operand vpdpbusd multiplies by a row's 4 bytes of qx broadcast to every lane. Paths:
// - AVX512-VNNI: vpdpbusd (unsigned nibbles x signed qx, 4 a lane, summed into int32). Two instructions an octet.
// - AVX2: vpmaddubsw (the same operands, pairs summed into int16: |pair| <= 2 x 15 x 127), the 8 of a group added in
//   int16 (|sum| <= 16 x 15 x 127 = 30480 < 2^15, so never saturating), then vpmaddwd by ones into int32.
// - plain C++: int32 loops.
//
// Loops as linear_int8.cpp's: x is quantized once per call into buffers the threads share; the threads split the
// column blocks (and the row tiles when there are fewer blocks than threads); each walks its blocks in panels that
// fit in L2, and every tile of rows (its quantized x stays in L1) streams over a panel's blocks, so the weight is
// read from memory once per call whatever M is.
#include "linear_common.h"

#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedllm {
namespace {

constexpr int64_t kGroupK = 32;               // k's per group: one d (and m) per column, one x scale per row
constexpr int64_t kOctets = kGroupK / 8;      // 64-byte octets of a group's nibbles
constexpr int64_t kValueBytes = kGroupK * kBlock / 2;

// A tile's quantized x: rows of K int8 (`ld` apart), and per row and group s_x and sm (`groups` apart).
struct Q8Rows {
  const int8_t* q;
  int64_t ld;
  const float* scale;
  const float* scaled_sum;
  int64_t groups;
};

// One group's header: d and m of its 16 columns (Q4_0: m = -8 d, computed).
template <bool has_min>
inline const uint8_t* group_values(const uint8_t* group) {
  return group + (has_min ? 2 : 1) * kBlock * sizeof(float);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

constexpr int kTileRows = 8;  // 8 rows x (2 int32 + 1 float32 accumulators): 24 of the 32 zmm registers

// acc[rows][16] = x[rows] times a block's `groups` groups.
template <int rows, bool has_min>
void dot_tile(const Q8Rows& x, const uint8_t* block, int64_t groups, int64_t group_bytes, float* acc) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 f[rows];
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) f[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = block + g * group_bytes;
    const uint8_t* values = group_values<has_min>(group);
    __m512i c[rows][2];
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) c[r][0] = c[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int64_t o = 0; o < kOctets; ++o) {
      const __m512i w = _mm512_loadu_si512(values + o * 64);
      const __m512i lo = _mm512_and_si512(w, low4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
#pragma GCC unroll 8
      for (int r = 0; r < rows; ++r) {
        const int8_t* xq = x.q + r * x.ld + g * kGroupK + o * 8;
        c[r][0] = _mm512_dpbusd_epi32(c[r][0], lo, _mm512_set1_epi32(load_4_bytes(xq)));
        c[r][1] = _mm512_dpbusd_epi32(c[r][1], hi, _mm512_set1_epi32(load_4_bytes(xq + 4)));
      }
    }
    const float* header = reinterpret_cast<const float*>(group);
    const __m512 d = _mm512_loadu_ps(header);
    const __m512 m = has_min ? _mm512_loadu_ps(header + kBlock) : _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(c[r][0], c[r][1]));
      const __m512 scaled = _mm512_mul_ps(_mm512_mul_ps(sum, d), _mm512_set1_ps(x.scale[r * x.groups + g]));
      f[r] = _mm512_add_ps(f[r], rounded(scaled));
      f[r] = _mm512_add_ps(f[r], rounded(_mm512_mul_ps(m, _mm512_set1_ps(x.scaled_sum[r * x.groups + g]))));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) _mm512_storeu_ps(acc + r * kBlock, f[r]);
}

#elif defined(__AVX2__)

constexpr int kTileRows = 4;  // 4 rows x 2 int16 accumulators, 4 weight nibble vectors, broadcasts: 16 ymm

// The float32 accumulators live in `acc` (L1): in registers they would spill the integer ones.
template <int rows, bool has_min>
void dot_tile(const Q8Rows& x, const uint8_t* block, int64_t groups, int64_t group_bytes, float* acc) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  std::fill(acc, acc + rows * kBlock, 0.f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = block + g * group_bytes;
    const uint8_t* values = group_values<has_min>(group);
    __m256i c[rows][2];  // int16 pair sums, columns 0..7 and 8..15
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) c[r][0] = c[r][1] = _mm256_setzero_si256();
    for (int64_t o = 0; o < kOctets; ++o) {
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + o * 64 + h * 32));
        const __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
#pragma GCC unroll 8
        for (int r = 0; r < rows; ++r) {
          const int8_t* xq = x.q + r * x.ld + g * kGroupK + o * 8;
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_4_bytes(xq))),
                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_4_bytes(xq + 4))));
          c[r][h] = _mm256_add_epi16(c[r][h], pairs);
        }
      }
    }
    const float* header = reinterpret_cast<const float*>(group);
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) {
      const __m256 s = _mm256_set1_ps(x.scale[r * x.groups + g]), sm = _mm256_set1_ps(x.scaled_sum[r * x.groups + g]);
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_loadu_ps(header + 8 * h);
        const __m256 m = has_min ? _mm256_loadu_ps(header + kBlock + 8 * h) : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
        const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(c[r][h], ones));
        float* a = acc + r * kBlock + 8 * h;
        __m256 f = _mm256_add_ps(_mm256_loadu_ps(a), rounded(_mm256_mul_ps(_mm256_mul_ps(sum, d), s)));
        f = _mm256_add_ps(f, rounded(_mm256_mul_ps(m, sm)));
        _mm256_storeu_ps(a, f);
      }
    }
  }
}

#else  // plain C++: any CPU, vectorised by the compiler as far as it can

constexpr int kTileRows = 4;

template <int rows, bool has_min>
void dot_tile(const Q8Rows& x, const uint8_t* block, int64_t groups, int64_t group_bytes, float* acc) {
  std::fill(acc, acc + rows * kBlock, 0.f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = block + g * group_bytes;
    const uint8_t* values = group_values<has_min>(group);
    int32_t c[rows][kBlock] = {};
    for (int64_t o = 0; o < kOctets; ++o) {
      const uint8_t* w = values + o * 64;
      for (int r = 0; r < rows; ++r) {
        const int8_t* xq = x.q + r * x.ld + g * kGroupK + o * 8;
        for (int j = 0; j < kBlock; ++j) {
          for (int t = 0; t < 4; ++t) c[r][j] += (w[4 * j + t] & 0x0F) * xq[t] + (w[4 * j + t] >> 4) * xq[4 + t];
        }
      }
    }
    const float* d = reinterpret_cast<const float*>(group);
    float scaled[rows][kBlock], mins[rows][kBlock];
    for (int r = 0; r < rows; ++r) {
      const float s = x.scale[r * x.groups + g], sm = x.scaled_sum[r * x.groups + g];
      for (int j = 0; j < kBlock; ++j) {
        const float m = has_min ? d[kBlock + j] : d[j] * -8.f;
        scaled[r][j] = static_cast<float>(c[r][j]) * d[j] * s;
        mins[r][j] = m * sm;
      }
    }
    rounding_barrier(scaled);
    rounding_barrier(mins);
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < kBlock; ++j) {
        acc[r * kBlock + j] += scaled[r][j];
        acc[r * kBlock + j] += mins[r][j];
      }
    }
  }
}

#endif

// dot_tile for a tile of `rows` <= kTileRows rows.
template <bool has_min, int max_rows = kTileRows>
void run_dot_tile(int rows, const Q8Rows& x, const uint8_t* block, int64_t groups, int64_t group_bytes,
                  float* acc) {
  if constexpr (max_rows > 1) {
    if (rows < max_rows) return run_dot_tile<has_min, max_rows - 1>(rows, x, block, groups, group_bytes, acc);
  }
  dot_tile<max_rows, has_min>(x, block, groups, group_bytes, acc);
}

template <typename T, bool has_min>
struct W4A8Problem {
  Q8Rows x;             // all m rows
  const uint8_t* packed;
  const T* bias;        // nullptr: no bias
  T* out;
  int64_t m, n, groups, out_stride;

  int64_t group_bytes() const { return (has_min ? 2 : 1) * kBlock * int64_t{sizeof(float)} + kValueBytes; }

  void run_tile(int64_t m0, int rows, int64_t b) const {
    alignas(64) float acc[kTileRows * kBlock];
    const Q8Rows tile{x.q + m0 * x.ld, x.ld, x.scale + m0 * groups, x.scaled_sum + m0 * groups, groups};
    run_dot_tile<has_min>(rows, tile, packed + b * groups * group_bytes(), groups, group_bytes(), acc);
    store_rows(out, out_stride, n, bias, static_cast<const float*>(nullptr), acc, m0, rows, b);
  }

  // Column blocks [b0, b1) times row tiles [t0, t1), panel by panel.
  void run(int64_t b0, int64_t b1, int64_t t0, int64_t t1) const {
    const int64_t panel_blocks = std::max<int64_t>(1, kPanelBytes / (groups * group_bytes()));
    for (int64_t p0 = b0; p0 < b1; p0 += panel_blocks) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t m0 = t * kTileRows;
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - m0));
        for (int64_t b = p0; b < std::min(p0 + panel_blocks, b1); ++b) run_tile(m0, rows, b);
      }
    }
  }
};

template <typename T, bool has_min>
void run_w4a8(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroupK;
  std::vector<int8_t> quantized(m * k);
  std::vector<float> scale(m * groups), scaled_sum(m * groups);
  const T* src = x.data_ptr<T>();
  at::parallel_for(0, m, std::max<int64_t>(1, kConvertGrain / std::max<int64_t>(1, k)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int8_t* row = quantized.data() + r * k;
      quantize_spans(src + r * x.stride(0), k, kGroupK, scale.data() + r * groups,
                     [&](int64_t i, int8_t q) { row[i] = q; });
      for (int64_t g = 0; g < groups; ++g) {
        int32_t sum = 0;
        for (int64_t i = g * kGroupK; i < (g + 1) * kGroupK; ++i) sum += row[i];
        scaled_sum[r * groups + g] = scale[r * groups + g] * static_cast<float>(sum);
      }
    }
  });
  const W4A8Problem<T, has_min> problem{{quantized.data(), k, scale.data(), scaled_sum.data(), groups},
                                        packed.data_ptr<uint8_t>(), bias ? bias->data_ptr<T>() : nullptr,
                                        out.data_ptr<T>(), m, out.size(1), groups, out.stride(0)};
  split_blocks_and_tiles(packed.size(0), (m + kTileRows - 1) / kTileRows, m * out.size(1) * k,
                         [&](int64_t b0, int64_t b1, int64_t t0, int64_t t1) { problem.run(b0, b1, t0, t1); });
}

}  // namespace

void linear_w4a8(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, bool has_min,
                 const c10::optional<at::Tensor>& bias) {
  if (x.scalar_type() == at::kBFloat16) {
    return has_min ? run_w4a8<c10::BFloat16, true>(out, x, packed, bias)
                   : run_w4a8<c10::BFloat16, false>(out, x, packed, bias);
  }
  has_min ? run_w4a8<float, true>(out, x, packed, bias) : run_w4a8<float, false>(out, x, packed, bias);
}

}  // namespace pagedllm

// Linear layers in int8 x int8 (W8A8, quantization="w8a8"): out = x W^T + b with W[n, k] = s_w[n] q[n, k],
// quantized at load (pagedllm.layers.linear.quantize_int8), and x's rows quantized in each call in spans of 64 k's
// (k in [64 t, 64 t + 64)), each span with its own scale, as llama.cpp quantizes activations (Q8_0, 32 k's):
//
//    s_x[m, t] = max |x[m, span t]| / 127 (1 for a zero span),  qx[m, k] = round(x[m, k] / s_x[m, t]) in [-127, 127]
//    acc[m, n] = sum over spans t, in order, of float(sum_{k in span t} qx[m, k] q[n, k]) * s_x[m, t]
//    out[m, n] = acc[m, n] * s_w[n]  (+ bias[n]), rounded once to out's dtype
//
// One scale per row made the whole row as coarse as its largest value allows: SmolLM2-135M's perplexity rose 3.9%
// over float32 (int8 weights alone: 0.1%); with a scale per 64 k's, 0.9% (per 32: 0.8%, per 192: 1.8%), for one
// convert, multiply and add per row and span beside the span's 16 int8 dot-product instructions.
//
// Each span's sum is exact in int32, and the float32 operations after it are each rounded, in that order (never
// fused into an FMA: `rounded`), so every ISA path gives the bits of the torch reference,
// pagedllm.layers.linear.w8a8_reference. Against the int8 weight-only kernel, the products are int8 x int8 (64 per
// instruction with VNNI, against 8 float32 FMAs per ymm) and the weight is read as before: a quarter of float32's
// bytes.
//
// Packed layout: [ceil(N / 16), ceil(K / 4), 64] int8: output rows in blocks of 16 and k in groups of 4, both
// zero-padded; a group holds its block's 16 columns, column j's 4 consecutive k's at bytes [4 j, 4 j + 4), so that
// one group is one zmm whose 32-bit lane j is column j:
//
//       q [N, K]                          packed [N/16, K/4, 64]
//    row n0  : q0,0 q0,1 .. q0,K      block 0: group 0: q0,0 q0,1 q0,2 q0,3 | q1,0 .. q1,3 | .. | q15,0 .. q15,3
//    row n1  : q1,0 q1,1 .. q1,K               group 1: q0,4 .. q0,7         | q1,4 .. q1,7 | .. | q15,4 .. q15,7
//     ...                                       ...
//    row n15 : ...                     block 1: rows 16..31, the same way; missing rows and k's are 0
//
// with each block's 16 column sums per span, sum_{k in span t} q[n, k], beside it ([ceil(N / 16), ceil(K / 64), 16]
// int32) for the VNNI path.
//
// Paths, for a group (16 columns x 4 k's) and one row of x, whose 4 bytes are broadcast to every lane:
// - AVX512-VNNI: vpdpbusd multiplies unsigned bytes by signed ones, 4 a lane, summed into the lane's int32. x is
//   stored as qx + 128 (0..254) and q stays signed: a span's sum gains 128 x its column sum, taken off by starting
//   each accumulator at -128 x that column sum. One instruction.
// - AVX2: no VNNI. vpmaddubsw (unsigned x signed bytes, pairs summed in saturating int16) on |qx| and on q with
//   qx's sign moved onto it (vpsignb), llama.cpp's trick: a pair sums to at most 2 x 127 x 127 = 32258, so it
//   never saturates (which needs q != -128, hence [-127, 127]); vpmaddwd by ones adds the pairs into int32. Two ymm
//   (8 columns each) a group, four instructions on each.
// - plain C++: int32 loops.
// - AMX-INT8 (Sapphire Rapids and later, where Linux grants the tiles), for 12 rows or more: one `tdpbusd` a span
//   for 16 rows x 16 columns, on x as the VNNI path stores it and the packed weight as it is (below).
// Each span's int32 sums then go into the float32 accumulators (in zmm/ymm registers, or in memory for plain C++).
//
// Loops as linear.cpp's: x is quantized once per call into a buffer the threads share; the threads split the
// column blocks (and the row tiles when there are fewer blocks than threads); each walks its blocks in panels that
// fit in L2, and every tile of rows (its quantized x, a few KiB, stays in L1) streams over a panel's blocks, asking
// for them kPrefetchBytes ahead, so the weight is read from memory once per call whatever M is. No K chunks: int8
// rows are a quarter of linear.cpp's.
#include "linear_common.h"

#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// AMX (Sapphire Rapids and later): tile registers multiply 16 rows by a block over a whole span at once.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDLLM_W8A8_AMX 1
#else
#define PAGEDLLM_W8A8_AMX 0
#endif

namespace pagedllm {
namespace {

constexpr int64_t kGroupK = 4;                  // k's per group
constexpr int64_t kGroupBytes = kBlock * kGroupK;
constexpr int64_t kSpanK = 64;                  // k's per activation scale
constexpr int64_t kSpanGroups = kSpanK / kGroupK;

// Where a tile's x lives: its quantized rows (`ld` bytes apart, store_x's planes) and their span scales (`spans`
// apart).
struct XTile {
  const uint8_t* q;
  int64_t ld;
  const float* scale;
  int64_t spans;
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

constexpr int kTileRows = 8;  // 8 rows x 2 accumulators: 16 of the 32 zmm registers
constexpr int kXPlanes = 1;   // x's row: qx + 128

inline void store_x(int8_t q, uint8_t* row, int64_t i, int64_t) { row[i] = static_cast<uint8_t>(q + 128); }

// c[rows][h] += x[rows] (at byte `g4` of rows `ld` apart) . one group, each row's 4 bytes broadcast.
template <int rows>
inline void dot_group(const uint8_t* x, int64_t ld, int64_t g4, const int8_t* group, __m512i (&c)[rows][2], int h) {
  const __m512i w = _mm512_loadu_si512(group);
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) {
    c[r][h] = _mm512_dpbusd_epi32(c[r][h], _mm512_set1_epi32(load_4_bytes(x + r * ld + g4)), w);
  }
}

// A span's int32 sums start at -128 x its 16 column sums: x is stored + 128, which adds that much.
inline __m512i start_of_span(const int32_t* col_sums) {
  return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(_mm512_loadu_si512(col_sums), 7));
}

// acc[rows][16] = x[rows] times a block's `groups` groups, span by span. Two int32 accumulators per row, for the
// even and the odd groups, so that even one row keeps two vpdpbusd in flight; one float32 accumulator per row.
template <int rows>
void dot_tile(const XTile& x, const int8_t* block, int64_t groups, const int32_t* col_sums, float* acc) {
  __m512 f[rows];
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) f[r] = _mm512_setzero_ps();
  for (int64_t t = 0; t * kSpanGroups < groups; ++t) {
    const int64_t g1 = std::min(groups, (t + 1) * kSpanGroups);
    const __m512i offset = start_of_span(col_sums + t * kBlock);
    __m512i c[rows][2];
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) {
      c[r][0] = offset;
      c[r][1] = _mm512_setzero_si512();
    }
    int64_t g = t * kSpanGroups;
    for (; g + 2 <= g1; g += 2) {
      prefetch_line<1>(block + g * kGroupBytes + kPrefetchBytes);  // a group is a line
      prefetch_line<1>(block + (g + 1) * kGroupBytes + kPrefetchBytes);
      dot_group(x.q, x.ld, g * kGroupK, block + g * kGroupBytes, c, 0);
      dot_group(x.q, x.ld, (g + 1) * kGroupK, block + (g + 1) * kGroupBytes, c, 1);
    }
    if (g < g1) dot_group(x.q, x.ld, g * kGroupK, block + g * kGroupBytes, c, 0);
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(c[r][0], c[r][1]));
      f[r] = _mm512_add_ps(f[r], rounded(_mm512_mul_ps(sum, _mm512_set1_ps(x.scale[r * x.spans + t]))));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) _mm512_storeu_ps(acc + r * kBlock, f[r]);
}

#elif defined(__AVX2__)

constexpr int kTileRows = 4;  // 4 rows x 2 accumulators, 2 weight halves, 2 broadcasts, ones, temporaries: 16 ymm
constexpr int kXPlanes = 2;   // x's row: |qx|, then qx (its signs)

inline void store_x(int8_t q, uint8_t* row, int64_t i, int64_t k_padded) {
  row[i] = static_cast<uint8_t>(q < 0 ? -q : q);
  row[k_padded + i] = static_cast<uint8_t>(q);
}

// acc[rows][8 x 2] += |qx| . (q with qx's signs) over one group's 8 columns, for each row.
template <int rows>
inline void dot_half(const __m256i (&ax)[rows], const __m256i (&sx)[rows], __m256i w, __m256i (&c)[rows][2],
                     int half) {
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) {
    const __m256i pairs = _mm256_maddubs_epi16(ax[r], _mm256_sign_epi8(w, sx[r]));
    c[r][half] = _mm256_add_epi32(c[r][half], _mm256_madd_epi16(pairs, ones));
  }
}

// The float32 accumulators live in `acc` (L1): in registers they would spill the int32 ones.
template <int rows>
void dot_tile(const XTile& x, const int8_t* block, int64_t groups, const int32_t*, float* acc) {
  const int64_t signs = groups * kGroupK;  // the qx plane follows the |qx| plane
  std::fill(acc, acc + rows * kBlock, 0.f);
  for (int64_t t = 0; t * kSpanGroups < groups; ++t) {
    __m256i c[rows][2];
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) c[r][0] = c[r][1] = _mm256_setzero_si256();
    for (int64_t g = t * kSpanGroups; g < std::min(groups, (t + 1) * kSpanGroups); ++g) {
      __m256i ax[rows], sx[rows];
#pragma GCC unroll 8
      for (int r = 0; r < rows; ++r) {
        ax[r] = _mm256_set1_epi32(load_4_bytes(x.q + r * x.ld + g * kGroupK));
        sx[r] = _mm256_set1_epi32(load_4_bytes(x.q + r * x.ld + signs + g * kGroupK));
      }
      prefetch_line<1>(block + g * kGroupBytes + kPrefetchBytes);  // a group is a line
      const __m256i* w = reinterpret_cast<const __m256i*>(block + g * kGroupBytes);
      dot_half(ax, sx, _mm256_loadu_si256(w), c, 0);
      dot_half(ax, sx, _mm256_loadu_si256(w + 1), c, 1);
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) {
      const __m256 s = _mm256_set1_ps(x.scale[r * x.spans + t]);
      for (int h = 0; h < 2; ++h) {
        float* a = acc + r * kBlock + 8 * h;
        _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), rounded(_mm256_mul_ps(_mm256_cvtepi32_ps(c[r][h]), s))));
      }
    }
  }
}

#else  // plain C++: any CPU, vectorised by the compiler as far as it can

constexpr int kTileRows = 4;
constexpr int kXPlanes = 1;  // x's row: qx

inline void store_x(int8_t q, uint8_t* row, int64_t i, int64_t) { row[i] = static_cast<uint8_t>(q); }

template <int rows>
void dot_tile(const XTile& x, const int8_t* block, int64_t groups, const int32_t*, float* acc) {
  std::fill(acc, acc + rows * kBlock, 0.f);
  for (int64_t t = 0; t * kSpanGroups < groups; ++t) {
    int32_t c[rows][kBlock] = {};
    for (int64_t g = t * kSpanGroups; g < std::min(groups, (t + 1) * kSpanGroups); ++g) {
      const int8_t* w = block + g * kGroupBytes;
      for (int r = 0; r < rows; ++r) {
        const int8_t* xg = reinterpret_cast<const int8_t*>(x.q + r * x.ld + g * kGroupK);
#pragma omp simd
        for (int j = 0; j < kBlock; ++j) {
          c[r][j] += xg[0] * w[4 * j] + xg[1] * w[4 * j + 1] + xg[2] * w[4 * j + 2] + xg[3] * w[4 * j + 3];
        }
      }
    }
    float products[rows][kBlock];
    for (int r = 0; r < rows; ++r) {
      const float s = x.scale[r * x.spans + t];
#pragma omp simd
      for (int j = 0; j < kBlock; ++j) products[r][j] = static_cast<float>(c[r][j]) * s;
    }
    rounding_barrier(products);
    for (int r = 0; r < rows; ++r) {
#pragma omp simd
      for (int j = 0; j < kBlock; ++j) acc[r * kBlock + j] += products[r][j];
    }
  }
}

#endif

#if PAGEDLLM_W8A8_AMX

// AMX-INT8: `tdpbusd` multiplies a tile of 16 rows of x (64 bytes each: a span) by a tile of the block's 16 groups
// of that span (16 rows of 64 bytes, as packed: vpdpbusd's layout is the tile's) into 16 x 16 int32 sums, the sums
// dot_tile forms with 256 vpdpbusd: integers, so the same sums, and the float32 steps after them are dot_tile's, so
// the same bits. x is stored as qx + 128, as for vpdpbusd, and each sum starts from the same -128 x column sum.
// Fewer rows take the VNNI tiles, whose cost falls with the rows where a tile's does not: SmolLM2's layers on two
// threads, VNNI against tiles, 2.7 against 2.9 ms at 8 rows, 3.8 against 3.2 at 12 (docs/benchmarks.md).
constexpr int64_t kAmxMinRows = 12;

// The tile registers (macros: the tile intrinsics paste their operand into the instruction's text). Two sets of
// sums, x and weight tiles, taken in turn: a tile's sums reach the vector registers through a store and loads that
// wait for it, so the tiles of span t + 1 run while span t's sums are turned into floats.
#define TILE_SUMS_EVEN 0
#define TILE_X_EVEN 1
#define TILE_W_EVEN 2
#define TILE_SUMS_ODD 3
#define TILE_X_ODD 4
#define TILE_W_ODD 5

// Span t's sums of x's 16 rows (from `x`, `ld` bytes apart) by the weight's 16 groups at `w`, into `sums`.
#define AMX_SPAN_SUMS(sum, x_tile, w_tile, x, ld, w, sums) \
  do {                                                     \
    _tile_loadd(w_tile, w, kGroupBytes);                   \
    _tile_loadd(x_tile, x, ld);                            \
    _tile_zero(sum);                                       \
    _tile_dpbusd(sum, x_tile, w_tile);                     \
    _tile_stored(sum, sums, kBlock * sizeof(int32_t));     \
  } while (0)

// acc[16][16] = x's 16 rows (padded past m, each to whole spans) times a block's spans, as dot_tile computes it;
// `block` holds whole spans (a partial last one zero-padded by run_amx).
void amx_dot_tile(const XTile& x, const int8_t* block, int64_t spans, const int32_t* col_sums, float* acc) {
  alignas(64) int32_t sums[2][kAmxRows][kBlock];
  __m512 f[kAmxRows];
#pragma GCC unroll 16
  for (int r = 0; r < kAmxRows; ++r) f[r] = _mm512_setzero_ps();
  const auto span_x = [&](int64_t t) { return x.q + t * kSpanK; };
  const auto span_w = [&](int64_t t) { return block + t * kSpanGroups * kGroupBytes; };
  AMX_SPAN_SUMS(TILE_SUMS_EVEN, TILE_X_EVEN, TILE_W_EVEN, span_x(0), x.ld, span_w(0), sums[0]);
  for (int64_t t = 0; t < spans; ++t) {
    if (t + 1 < spans) {
      if (t % 2) {
        AMX_SPAN_SUMS(TILE_SUMS_EVEN, TILE_X_EVEN, TILE_W_EVEN, span_x(t + 1), x.ld, span_w(t + 1), sums[0]);
      } else {
        AMX_SPAN_SUMS(TILE_SUMS_ODD, TILE_X_ODD, TILE_W_ODD, span_x(t + 1), x.ld, span_w(t + 1), sums[1]);
      }
    }
    const __m512i offset = start_of_span(col_sums + t * kBlock);
#pragma GCC unroll 16
    for (int r = 0; r < kAmxRows; ++r) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(offset, _mm512_load_si512(sums[t % 2][r])));
      f[r] = _mm512_add_ps(f[r], rounded(_mm512_mul_ps(sum, _mm512_set1_ps(x.scale[r * x.spans + t]))));
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < kAmxRows; ++r) _mm512_storeu_ps(acc + r * kBlock, f[r]);
}

#undef AMX_SPAN_SUMS

#else

#if !defined(__AMX_TILE__)  // else linear_common.h's
constexpr int kAmxRows = kTileRows;
inline bool amx_granted() { return false; }
#endif
constexpr int64_t kAmxMinRows = std::numeric_limits<int64_t>::max();

#endif

// dot_tile for a tile of `rows` <= kTileRows rows.
template <int max_rows = kTileRows>
void run_dot_tile(int rows, const XTile& x, const int8_t* block, int64_t groups, const int32_t* col_sums,
                  float* acc) {
  if constexpr (max_rows > 1) {
    if (rows < max_rows) return run_dot_tile<max_rows - 1>(rows, x, block, groups, col_sums, acc);
  }
  dot_tile<max_rows>(x, block, groups, col_sums, acc);
}

// One row of x quantized into `row` (store_x's planes of k_padded bytes; the padding k's are 0), span by span, and
// the spans' scales; v: k floats of scratch.
template <typename T>
void quantize_row(const T* x, int64_t k, int64_t k_padded, uint8_t* row, float* scales, float* v) {
  quantize_spans(x, k, kSpanK, scales, v);
  for (int64_t i = 0; i < k; ++i) store_x(quantized(v[i]), row, i, k_padded);
  for (int64_t i = k; i < k_padded; ++i) store_x(0, row, i, k_padded);
}

template <typename T>
struct W8A8Problem {
  const uint8_t* x;         // [m][kXPlanes][ld / kXPlanes]: quantized rows (store_x), padded to whole tiles
  const float* x_scale;     // [m][spans]
  const int8_t* packed;     // [blocks][groups][64]
  const int32_t* col_sums;  // [blocks][spans][16]
  const float* w_scale;     // [n]
  const T* bias;            // nullptr: no bias
  T* out;
  int64_t m, n, groups, spans, ld, out_stride;
  bool amx;  // AMX tiles of kAmxRows rows (x's rows padded to whole spans), else the ISA's tiles of kTileRows

  const int8_t* block(int64_t b) const { return packed + b * groups * kGroupBytes; }

  // out[m0 .. m0 + rows, block b] = acc (the spans' sums, in the reference's float32 operations) times w_scale.
  void store(const float* acc, int64_t m0, int rows, int64_t b) const {
    alignas(64) float scaled[kAmxRows * kBlock];
    const int64_t n0 = b * kBlock, cols = std::min(kBlock, n - n0);
    for (int r = 0; r < rows; ++r) {
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) scaled[r * kBlock + j] = acc[r * kBlock + j] * w_scale[n0 + j];
    }
    rounding_barrier(scaled);
    store_rows(out, out_stride, n, bias, nullptr, scaled, m0, rows, b);
  }

  // Column blocks [b0, b1) times row tiles [t0, t1), panel by panel.
  void run(int64_t b0, int64_t b1, int64_t t0, int64_t t1) const {
#if PAGEDLLM_W8A8_AMX
    if (amx) return run_amx(b0, b1, t0, t1);
#endif
    const int64_t panel_blocks = std::max<int64_t>(1, kPanelBytes / (groups * kGroupBytes));
    for (int64_t p0 = b0; p0 < b1; p0 += panel_blocks) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t m0 = t * kTileRows;
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - m0));
        for (int64_t b = p0; b < std::min(p0 + panel_blocks, b1); ++b) {
          alignas(64) float acc[kTileRows * kBlock];
          const XTile tile{x + m0 * ld, ld, x_scale + m0 * spans, spans};
          run_dot_tile(rows, tile, block(b), groups, col_sums + b * spans * kBlock, acc);
          store(acc, m0, rows, b);
        }
      }
    }
  }

#if PAGEDLLM_W8A8_AMX
  // As run, in AMX tiles. A weight whose K is not whole spans has its panels copied, zero-padded, for the tiles.
  void run_amx(int64_t b0, int64_t b1, int64_t t0, int64_t t1) const {
    const int64_t padded_groups = spans * kSpanGroups, block_bytes = padded_groups * kGroupBytes;
    const int64_t panel_blocks = std::max<int64_t>(1, kPanelBytes / block_bytes);
    const bool copy = padded_groups != groups;
    const AlignedFloats buffer = aligned_floats(copy ? std::min(panel_blocks, b1 - b0) * block_bytes / 4 : 0);
    int8_t* padded = reinterpret_cast<int8_t*>(buffer.get());
    configure_tiles(6);
    for (int64_t p0 = b0; p0 < b1; p0 += panel_blocks) {
      const int64_t p1 = std::min(p0 + panel_blocks, b1);
      if (copy) {
        std::fill(padded, padded + (p1 - p0) * block_bytes, int8_t{0});
        for (int64_t b = p0; b < p1; ++b) {
          std::copy(block(b), block(b) + groups * kGroupBytes, padded + (b - p0) * block_bytes);
        }
      }
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t m0 = t * kAmxRows;
        const XTile tile{x + m0 * ld, ld, x_scale + m0 * spans, spans};
        for (int64_t b = p0; b < p1; ++b) {
          alignas(64) float acc[kAmxRows * kBlock];
          amx_dot_tile(tile, copy ? padded + (b - p0) * block_bytes : block(b), spans,
                       col_sums + b * spans * kBlock, acc);
          store(acc, m0, static_cast<int>(std::min<int64_t>(kAmxRows, m - m0)), b);
        }
      }
    }
    _tile_release();  // the tile registers' state goes with the thread on every switch while configured
  }
#endif
};

// out [m, n] (rows `out_stride` apart) = x [m, k] (rows `x_stride` apart) times the packed weight, plus bias: x
// quantized by the threads together (or on this one, `on_thread`) into `scratch`, then the column blocks and row
// tiles split.
template <typename T>
void run_w8a8(T* out, int64_t out_stride, int64_t n, const T* x, int64_t x_stride, int64_t m, int64_t k,
              const int8_t* packed, const int32_t* col_sums, const float* w_scale, const T* bias,
              W8A8Scratch& scratch, bool on_thread) {
  const int64_t groups = (k + kGroupK - 1) / kGroupK, spans = (k + kSpanK - 1) / kSpanK;
  const bool amx = m >= kAmxMinRows && amx_granted();
  // x's rows: whole groups, or whole spans for the tiles; whole tiles of rows (an AMX tile loads all 16).
  const int64_t k_padded = amx ? spans * kSpanK : groups * kGroupK, ld = kXPlanes * k_padded;
  const int64_t tile_rows = amx ? kAmxRows : kTileRows, tiles = (m + tile_rows - 1) / tile_rows;
  scratch.quantized.assign(tiles * tile_rows * ld, 0);
  scratch.x_scale.assign(tiles * tile_rows * spans, 0.f);
  const auto quantize = [&](int64_t begin, int64_t end, float* v) {
    for (int64_t r = begin; r < end; ++r) {
      quantize_row(x + r * x_stride, k, k_padded, scratch.quantized.data() + r * ld,
                   scratch.x_scale.data() + r * spans, v);
    }
  };
  if (on_thread) {
    scratch.v.resize(k);
    quantize(0, m, scratch.v.data());
  } else {
    at::parallel_for(0, m, std::max<int64_t>(1, kConvertGrain / std::max<int64_t>(1, k)),
                     [&](int64_t begin, int64_t end) {
                       std::vector<float> v(k);
                       quantize(begin, end, v.data());
                     });
  }
  const W8A8Problem<T> problem{scratch.quantized.data(), scratch.x_scale.data(), packed, col_sums, w_scale, bias,
                               out, m, n, groups, spans, ld, out_stride, amx};
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  if (on_thread) return problem.run(0, blocks, 0, tiles);
  split_blocks_and_tiles(blocks, tiles, m * n * k,
                         [&](int64_t b0, int64_t b1, int64_t t0, int64_t t1) { problem.run(b0, b1, t0, t1); });
}

template <typename T>
void linear_w8a8_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& col_sums,
                      const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias) {
  W8A8Scratch scratch;
  run_w8a8<T>(out.data_ptr<T>(), out.stride(0), out.size(1), x.data_ptr<T>(), x.stride(0), x.size(0), x.size(1),
              packed.data_ptr<int8_t>(), col_sums.data_ptr<int32_t>(), w_scale.data_ptr<float>(),
              bias ? bias->data_ptr<T>() : nullptr, scratch, false);
}

}  // namespace

template <typename T>
void linear_w8a8_on_thread(T* out, int64_t out_stride, int64_t n, const T* x, int64_t m, int64_t k,
                           const int8_t* packed, const int32_t* col_sums, const float* w_scale, W8A8Scratch& scratch) {
  run_w8a8<T>(out, out_stride, n, x, k, m, k, packed, col_sums, w_scale, nullptr, scratch, true);
}
template void linear_w8a8_on_thread(float*, int64_t, int64_t, const float*, int64_t, int64_t, const int8_t*,
                                    const int32_t*, const float*, W8A8Scratch&);
template void linear_w8a8_on_thread(c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*, int64_t, int64_t,
                                    const int8_t*, const int32_t*, const float*, W8A8Scratch&);

std::tuple<at::Tensor, at::Tensor> pack_w8a8_weight(at::Tensor q) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar,
              "q must be a contiguous [N, K] int8 CPU tensor");
  TORCH_CHECK(q.numel() == 0 || q.min().item<int8_t>() > -128,
              "q must be in [-127, 127] (the AVX2 path negates it by x's signs)");
  const int64_t n = q.size(0), k = q.size(1), blocks = (n + kBlock - 1) / kBlock;
  const int64_t groups = (k + kGroupK - 1) / kGroupK, spans = (k + kSpanK - 1) / kSpanK;
  at::Tensor packed = at::zeros({blocks, groups, kGroupBytes}, q.options());
  at::Tensor col_sums = at::zeros({blocks, spans, kBlock}, q.options().dtype(at::kInt));
  const int8_t* src = q.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* sums = col_sums.data_ptr<int32_t>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      int8_t* column = dst + (row / kBlock) * groups * kGroupBytes + (row % kBlock) * kGroupK;
      int32_t* column_sums = sums + (row / kBlock) * spans * kBlock + row % kBlock;
      for (int64_t i = 0; i < k; ++i) {
        column[(i / kGroupK) * kGroupBytes + i % kGroupK] = src[row * k + i];
        column_sums[(i / kSpanK) * kBlock] += src[row * k + i];
      }
    }
  });
  return {packed, col_sums};
}

void linear_w8a8(at::Tensor out, at::Tensor x, at::Tensor packed, at::Tensor col_sums, at::Tensor w_scale,
                 c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu() && packed.device().is_cpu(), "tensors must be on the CPU");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kGroupBytes && packed.is_contiguous()
                  && packed.scalar_type() == at::kChar,
              "packed must come from pack_w8a8_weight: a contiguous int8 [ceil(N/16), ceil(K/4), 64]");
  TORCH_CHECK(x.dim() == 2 && (x.size(1) + kGroupK - 1) / kGroupK == packed.size(1), "x has K=", x.size(1),
              " but the packed weight holds ", packed.size(1), " groups of 4 k's");
  check_operands(out, x, packed.size(0), x.size(1), bias);
  TORCH_CHECK(col_sums.device().is_cpu() && col_sums.is_contiguous() && col_sums.scalar_type() == at::kInt
                  && col_sums.dim() == 3 && col_sums.size(0) == packed.size(0)
                  && col_sums.size(1) == (x.size(1) + kSpanK - 1) / kSpanK && col_sums.size(2) == kBlock,
              "col_sums must be the contiguous int32 [ceil(N/16), ceil(K/64), 16] that pack_w8a8_weight returns");
  TORCH_CHECK(w_scale.device().is_cpu() && w_scale.is_contiguous() && w_scale.scalar_type() == at::kFloat
                  && w_scale.numel() == out.size(1),
              "w_scale must be a contiguous [N] float32 CPU tensor");
  if (out.numel() == 0) return;
  if (x.scalar_type() == at::kBFloat16) {
    return linear_w8a8_impl<c10::BFloat16>(out, x, packed, col_sums, w_scale, bias);
  }
  linear_w8a8_impl<float>(out, x, packed, col_sums, w_scale, bias);
}

}  // namespace pagedllm

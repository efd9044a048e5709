// Linear layers, out = x W^T + b, on a weight packed once at load time, in float32 arithmetic whatever the storage.
// The weight is float32, bf16, or int8 with one float32 scale per output row (weight-only quantization:
// W[n, k] = scale[n] * q[n, k]); an int8 weight's sums run over q and each output is scaled once, at the end.
//
// On a CPU without native bf16, `F.linear` in bf16 is emulated and several times slower than float32, while
// float32 weights cost twice the bytes per decode step. Here the weight stays bf16 (or float32) in memory and
// is widened in registers (bf16 -> float32 is exact: a 16-bit shift), so a decode step reads each weight byte
// once, and a prefill runs a register-blocked micro-kernel near the FMA peak.
//
// Packed layout: [ceil(N / 16), K, 16], output rows of W in blocks of 16, zero-padded, each block transposed so
// that one k gives the 16 weights of its 16 columns in one contiguous row.
//
//       W [N, K]                          packed [N/16, K, 16]
//    row n0  : w00 w01 .. w0K     block 0:  k=0: w00 w10 .. w15,0      (float32: columns 0..15 in order)
//    row n1  : w10 w11 .. w1K               k=1: w01 w11 .. w15,1
//     ...                                    ...
//    row n15 : ...                block 1:  rows 16..31, the same way; the last block's missing rows are 0
//
// A bf16 block row pairs column j with column j + 8 in one 32-bit word, so that `word << 16` gives columns 0..7
// and `word & 0xFFFF0000` columns 8..15 as float32, with no shuffle:
//
//    bf16 slot:   0    1    2    3   ..   14   15
//    column:      0    8    1    9   ..    7   15
//
// An int8 block row keeps the 16 columns in order (one 16-byte load, two sign-extensions to 8 x int32).
//
// The layout is the same in every build (AVX-512, AVX2 or plain C++), so one packed tensor serves all of them.
//
// Loops: the caller's threads split the column blocks (and the row tiles when there are few blocks). Each
// thread walks its blocks in panels that fit in L2 (a bf16 or int8 panel widened to float32 first when many tiles
// will read it); every tile of up to 6 rows of x (12 with AVX-512; float32: read in place; bf16: widened once per
// call) streams over a panel's blocks, a chunk of K at a time so that the tile stays in L1: a 6 x 16 tile of out
// is 12 ymm accumulators over a chunk (12 x 16: 12 zmm). So the weight is read from memory once per call,
// whatever M is, and a prefill's FMAs wait on neither memory nor L2.
#include "linear_common.h"

#include <algorithm>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace pagedllm {
namespace {

#if defined(__AVX512F__)
constexpr int kMaxRows = 12;                    // rows per tile: 12 zmm accumulators of the 32, one per row
#else
constexpr int kMaxRows = 6;                     // rows per tile: 6 x 2 accumulators = 12 of the 16 ymm registers
#endif
constexpr int64_t kTileBytes = 16 * 1024;       // x tile per K chunk: half of L1, the other half streams weights

// Row tiles from which a thread widens a bf16 or int8 panel to float32 once for all of them, rather than each tile
// widening its weights in registers as it streams them. An int8 block row takes four instructions to widen: from 3
// tiles on, once is cheaper. A bf16 block row takes two (AVX2: a shift and an AND; AVX-512: a zero-extension and
// a shift) beside 12 FMAs, and the widened panel costs its stores and twice the bytes read back by every tile: on
// the AMX Xeon (its AVX2 and Ice Lake builds) a decode step's matmuls at 18-50 rows ran 5-20% faster streamed, even
// at ~96 rows, and 5% slower at 256. The plain C++ build widens at 3 tiles, as before (level either way).
template <typename W>
constexpr int64_t kWidenTiles =
#if defined(__AVX2__) && defined(__FMA__)
    std::is_same_v<W, c10::BFloat16> ? 96 / kMaxRows :
#endif
    3;

// Whether a tile of `rows` reading the packed weight itself (kStream) asks for it ahead: not one row of float32,
// which streams as fast without (0.92-0.96x with, Zen 5).
template <int rows, bool kStream, typename W>
constexpr bool kPrefetch = kStream && (rows > 1 || !std::is_same_v<W, float>);

// Ask for the line kPrefetchBytes past block row k, once a line (a block row is 64 bytes of float32, 32 of bf16).
template <typename W>
inline void prefetch_ahead(const W* block, int64_t k) {
  constexpr int64_t kRowsPerLine = 64 / (kBlock * static_cast<int64_t>(sizeof(W)));
  if (k % kRowsPerLine == 0) prefetch_line<1>(block + k * kBlock + kPrefetchBytes / static_cast<int64_t>(sizeof(W)));
}

// Where column j of a block lives in a bf16 block row (see the diagram above).
inline int64_t bf16_slot(int64_t j) { return j < 8 ? 2 * j : 2 * (j - 8) + 1; }

// W's rows [16 b, 16 b + rows) into block b, [K][16], zeroed beforehand so that missing rows stay 0.
template <typename W>
void pack_block(const W* w, int64_t rows, int64_t k_size, W* block) {
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t slot = std::is_same_v<W, c10::BFloat16> ? bf16_slot(j) : j;
    for (int64_t k = 0; k < k_size; ++k) block[k * kBlock + slot] = w[j * k_size + k];
  }
}

template <typename W>
void pack_weight(const at::Tensor& weight, at::Tensor& packed) {
  const int64_t n = weight.size(0), k = weight.size(1);
  const W* w = weight.data_ptr<W>();
  W* dst = packed.data_ptr<W>();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      pack_block(w + b * kBlock * k, std::min(kBlock, n - b * kBlock), k, dst + b * k * kBlock);
    }
  });
}

#if defined(__AVX512F__)

// AVX-512: one zmm per block row. A bf16 block row widens in two instructions (zero-extend, shift) into slot
// order (columns 0, 8, 1, 9, ...), so a tile's accumulators run in slot order and are permuted into column order
// once per chunk, when they are loaded and stored. Each output is still one chain of FMAs in k order: the same
// bits as the AVX2 path.
inline __m512 load_block_row(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load_block_row(const c10::BFloat16* p) {
  const __m256i slots = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(slots), 16));
}

inline __m512 load_block_row(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// A W block row's 16 values as load_block_row gives them, from column order, and back: bf16's in slot order (lane
// i holds column 0, 8, 1, 9, ...; column j is in lane bf16_slot(j)), the others' in column order already.
template <typename W>
inline __m512 columns_to_lanes(__m512 v) {
  if constexpr (!std::is_same_v<W, c10::BFloat16>) return v;
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15), v);
}

template <typename W>
inline __m512 lanes_to_columns(__m512 v) {
  if constexpr (!std::is_same_v<W, c10::BFloat16>) return v;
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15), v);
}

// acc[rows][16] += x[rows][k_size] (float32 rows `ld` apart) times a chunk of one packed block ([k_size][16]).
template <int rows, bool kStream, typename W>
void tile_kernel(const float* x, int64_t ld, const W* block, int64_t k_size, float* acc) {
  __m512 c[rows];
#pragma GCC unroll 12
  for (int r = 0; r < rows; ++r) c[r] = columns_to_lanes<W>(_mm512_loadu_ps(acc + r * kBlock));
#pragma GCC unroll 4
  for (int64_t k = 0; k < k_size; ++k) {
    if constexpr (kPrefetch<rows, kStream, W>) prefetch_ahead(block, k);
    const __m512 w = load_block_row(block + k * kBlock);
#pragma GCC unroll 12
    for (int r = 0; r < rows; ++r) c[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ld + k]), w, c[r]);
  }
#pragma GCC unroll 12
  for (int r = 0; r < rows; ++r) _mm512_storeu_ps(acc + r * kBlock, lanes_to_columns<W>(c[r]));
}

// tile_kernel over two blocks at once (`block_stride` and `acc_stride` apart): each x value is broadcast once into a
// register for two FMAs. One block at a time, the FMAs take x from memory with an embedded broadcast, 13 loads for
// 12 FMAs a k, and an Ice Lake Xeon ran them at one a cycle (78-89 GFLOP/s a thread); two blocks, 14 loads for 24
// FMAs, ran at 149-151, MKL's rate. Each output is still one chain of FMAs in k order: the same bits.
template <int rows, bool kStream, typename W>
void tile_pair_kernel(const float* x, int64_t ld, const W* block, int64_t block_stride, int64_t k_size, float* acc,
                      int64_t acc_stride) {
  __m512 c[rows], d[rows];
#pragma GCC unroll 12
  for (int r = 0; r < rows; ++r) {
    c[r] = columns_to_lanes<W>(_mm512_loadu_ps(acc + r * kBlock));
    d[r] = columns_to_lanes<W>(_mm512_loadu_ps(acc + acc_stride + r * kBlock));
  }
#pragma GCC unroll 2
  for (int64_t k = 0; k < k_size; ++k) {
    if constexpr (kPrefetch<rows, kStream, W>) {
      prefetch_ahead(block, k);
      prefetch_ahead(block + block_stride, k);
    }
    const __m512 w0 = load_block_row(block + k * kBlock);
    const __m512 w1 = load_block_row(block + block_stride + k * kBlock);
#pragma GCC unroll 12
    for (int r = 0; r < rows; ++r) {
      __m512 xv;  // loaded where used: GCC would hoist a broadcast intrinsic out of the unrolled loop and spill it
      asm("vbroadcastss %1, %0" : "=v"(xv) : "m"(x[r * ld + k]));
      c[r] = _mm512_fmadd_ps(xv, w0, c[r]);
      d[r] = _mm512_fmadd_ps(xv, w1, d[r]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < rows; ++r) {
    _mm512_storeu_ps(acc + r * kBlock, lanes_to_columns<W>(c[r]));
    _mm512_storeu_ps(acc + acc_stride + r * kBlock, lanes_to_columns<W>(d[r]));
  }
}

// `n` block rows of a bf16 or int8 block as float32 block rows, columns in order.
template <typename W>
void widen_block_rows(const W* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) {
    prefetch_ahead(src, i);
    _mm512_storeu_ps(dst + i * kBlock, lanes_to_columns<W>(load_block_row(src + i * kBlock)));
  }
}

#elif defined(__AVX2__) && defined(__FMA__)

inline void load_block_row(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}

inline void load_block_row(const c10::BFloat16* p, __m256& lo, __m256& hi) {
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline void load_block_row(const int8_t* p, __m256& lo, __m256& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes, bytes)));
}

// c[rows][2] += x[rows][k] times row k of a block: the 16 weights widened, each row's x broadcast.
template <int rows, typename W>
inline void fma_step(const float* x, int64_t ld, const W* block_row, __m256 (&c)[rows][2]) {
  __m256 lo, hi;
  load_block_row(block_row, lo, hi);
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) {
    const __m256 xv = _mm256_broadcast_ss(x + r * ld);
    c[r][0] = _mm256_fmadd_ps(xv, lo, c[r][0]);
    c[r][1] = _mm256_fmadd_ps(xv, hi, c[r][1]);
  }
}

// acc[rows][16] += x[rows][k_size] (float32 rows `ld` apart) times a chunk of one packed block ([k_size][16]).
// Every output is one chain of FMAs in k order, whatever the tile's row count: a row gets the same bits in any
// batch (splitting k over more accumulators would keep the FMA units busier for 1-3 rows, but a decode step that
// small is bound by memory, and batch-invariant results are worth more).
template <int rows, bool kStream, typename W>
void tile_kernel(const float* x, int64_t ld, const W* block, int64_t k_size, float* acc) {
  __m256 c[rows][2];
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) {
    c[r][0] = _mm256_loadu_ps(acc + r * kBlock);
    c[r][1] = _mm256_loadu_ps(acc + r * kBlock + 8);
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < k_size; ++k) {
    if constexpr (kPrefetch<rows, kStream, W>) prefetch_ahead(block, k);
    fma_step(x + k, ld, block + k * kBlock, c);
  }
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) {
    _mm256_storeu_ps(acc + r * kBlock, c[r][0]);
    _mm256_storeu_ps(acc + r * kBlock + 8, c[r][1]);
  }
}

template <typename W>
void widen_block_rows(const W* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) {
    __m256 lo, hi;
    prefetch_ahead(src, i);
    load_block_row(src + i * kBlock, lo, hi);
    _mm256_storeu_ps(dst + i * kBlock, lo);
    _mm256_storeu_ps(dst + i * kBlock + 8, hi);
  }
}

#else  // plain C++: any CPU, vectorised by the compiler as far as it can

inline void load_block_row(const float* p, float* w) { std::copy(p, p + kBlock, w); }

inline void load_block_row(const c10::BFloat16* p, float* w) {
  for (int j = 0; j < 8; ++j) {
    w[j] = to_float(p[2 * j]);
    w[j + 8] = to_float(p[2 * j + 1]);
  }
}

inline void load_block_row(const int8_t* p, float* w) { std::copy(p, p + kBlock, w); }

template <int rows, bool kStream, typename W>
void tile_kernel(const float* x, int64_t ld, const W* block, int64_t k_size, float* acc) {
  float c[rows][kBlock];  // acc may alias x as far as the compiler knows: summing into it reloads both every k
  std::copy(acc, acc + rows * kBlock, &c[0][0]);
  for (int64_t k = 0; k < k_size; ++k) {
    if constexpr (kPrefetch<rows, kStream, W>) prefetch_ahead(block, k);
    float w[kBlock];
    load_block_row(block + k * kBlock, w);
    for (int r = 0; r < rows; ++r) {
      const float xv = x[r * ld + k];
#pragma omp simd
      for (int j = 0; j < kBlock; ++j) c[r][j] += xv * w[j];
    }
  }
  std::copy(&c[0][0], &c[0][0] + rows * kBlock, acc);
}

template <typename W>
void widen_block_rows(const W* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) {
    prefetch_ahead(src, i);
    load_block_row(src + i * kBlock, dst + i * kBlock);
  }
}

#endif

// tile_kernel<rows> for rows = 1 .. kMaxRows, chosen at run time.
template <bool kStream, typename W, int rows = kMaxRows>
void run_tile(int n_rows, const float* x, int64_t ld, const W* block, int64_t k_size, float* acc) {
  if constexpr (rows > 1) {
    if (n_rows < rows) return run_tile<kStream, W, rows - 1>(n_rows, x, ld, block, k_size, acc);
  }
  tile_kernel<rows, kStream>(x, ld, block, k_size, acc);
}

#if defined(__AVX512F__)
// tile_pair_kernel<rows> for rows = 1 .. kMaxRows, chosen at run time.
template <bool kStream, typename W, int rows = kMaxRows>
void run_tile_pair(int n_rows, const float* x, int64_t ld, const W* block, int64_t block_stride, int64_t k_size,
                   float* acc, int64_t acc_stride) {
  if constexpr (rows > 1) {
    if (n_rows < rows) {
      return run_tile_pair<kStream, W, rows - 1>(n_rows, x, ld, block, block_stride, k_size, acc, acc_stride);
    }
  }
  tile_pair_kernel<rows, kStream>(x, ld, block, block_stride, k_size, acc, acc_stride);
}
#endif

// One call's operands as raw pointers: float32 rows of x (`ld` apart), the packed weight (and an int8 weight's
// row scales), and out's rows (contiguous, `out_stride` apart) of type T.
template <typename T, typename W>
struct LinearProblem {
  const float* x;
  int64_t ld;
  const W* packed;
  const float* scale;  // [N] for an int8 weight; nullptr otherwise
  const T* bias;  // nullptr: no bias
  T* out;
  int64_t m, n, k, out_stride;

  // K in equal chunks of at most kTileBytes of x tile (one chunk for a few rows: the weight streams best whole).
  int64_t chunk_size() const {
    const int64_t tile_bytes = std::min<int64_t>(kMaxRows, m) * k * sizeof(float);
    const int64_t chunks = std::max<int64_t>(1, (tile_bytes + kTileBytes - 1) / kTileBytes);
    return (k + chunks - 1) / chunks;
  }

  // M's rows in tiles of at most kMaxRows, as even as they go (32 rows with AVX2: 6 6 5 5 5 5, not 6 6 6 6 6 2): a
  // tile's FMAs run at the units' full rate from 4 rows up, and a tile of fewer waits on its FMAs' latency.
  int64_t num_tiles() const { return (m + kMaxRows - 1) / kMaxRows; }
  int64_t tile_start(int64_t t) const { return t * (m / num_tiles()) + std::min(t, m % num_tiles()); }
  int tile_rows(int64_t t) const { return static_cast<int>(tile_start(t + 1) - tile_start(t)); }

  // x[tile t, k0 .. k0 + len] into L2, a chunk ahead of the kernel: x comes back from L3 for every panel, and
  // six short rows are too many streams for the hardware prefetcher to catch in time.
  void prefetch_x(int64_t t, int64_t k0, int64_t len) const {
    if (t >= num_tiles()) return;
    const float* rows = x + tile_start(t) * ld + k0;
    for (int r = 0; r < tile_rows(t); ++r) {
      for (int64_t i = 0; i < len; i += 64 / sizeof(float)) __builtin_prefetch(rows + r * ld + i, 0, 2);
    }
  }

  // Tile t of rows over the panel's blocks [p0, p1), whose weights start at `panel` (W, or float32 once
  // widened): acc holds [p1 - p0][kMaxRows][16] floats.
  template <typename P>
  void run_panel_tile(const P* panel, int64_t p0, int64_t p1, int64_t t, float* acc) const {
    constexpr bool kStream = std::is_same_v<P, W>;  // the packed weight itself, from memory; not a widened panel
    const int64_t m0 = tile_start(t), chunk = chunk_size();
    const int rows = tile_rows(t);
    std::fill(acc, acc + (p1 - p0) * kMaxRows * kBlock, 0.f);
    for (int64_t k0 = 0; k0 < k; k0 += chunk) {
      const int64_t k_size = std::min(chunk, k - k0);
      if (k0 + chunk < k) {
        prefetch_x(t, k0 + chunk, std::min(chunk, k - k0 - chunk));
      } else {
        prefetch_x(t + 1, 0, std::min(chunk, k));
      }
      int64_t b = p0;
#if defined(__AVX512F__)
      for (; b + 1 < p1; b += 2) {
        run_tile_pair<kStream>(rows, x + m0 * ld + k0, ld, panel + ((b - p0) * k + k0) * kBlock, k * kBlock, k_size,
                      acc + (b - p0) * kMaxRows * kBlock, kMaxRows * kBlock);
      }
#endif
      for (; b < p1; ++b) {
        run_tile<kStream>(rows, x + m0 * ld + k0, ld, panel + ((b - p0) * k + k0) * kBlock, k_size,
                 acc + (b - p0) * kMaxRows * kBlock);
      }
    }
    for (int64_t b = p0; b < p1; ++b) {
      store_rows(out, out_stride, n, bias, scale, acc + (b - p0) * kMaxRows * kBlock, m0, rows, b);
    }
  }

  // Column blocks [b0, b1) times row tiles [t0, t1), panel by panel. With kWidenTiles tiles or more, a bf16 or
  // int8 panel is first widened to float32 (exact), once for all of them: the tiles then spend no instruction on
  // widening (two to four for every 12 FMAs otherwise), and every output gets the same bits either way.
  void run(int64_t b0, int64_t b1, int64_t t0, int64_t t1) const {
    const bool widen = !std::is_same_v<W, float> && t1 - t0 >= kWidenTiles<W>;
    const int64_t panel_bytes = k * kBlock * (widen ? sizeof(float) : sizeof(W));
    const int64_t panel_blocks =
        std::min(b1 - b0, std::max<int64_t>(1, kPanelBytes / std::max<int64_t>(1, panel_bytes)));
    const AlignedFloats acc = aligned_floats(panel_blocks * kMaxRows * kBlock);
    const AlignedFloats wide = aligned_floats(widen ? panel_blocks * k * kBlock : 0);
    for (int64_t p0 = b0; p0 < b1; p0 += panel_blocks) {
      const int64_t p1 = std::min(p0 + panel_blocks, b1);
      const W* panel = packed + p0 * k * kBlock;
      if (widen) widen_block_rows(panel, (p1 - p0) * k, wide.get());
      for (int64_t t = t0; t < t1; ++t) {
        if (widen) {
          run_panel_tile(wide.get(), p0, p1, t, acc.get());
        } else {
          run_panel_tile(panel, p0, p1, t, acc.get());
        }
      }
    }
  }

  void run_parallel() const {
    split_blocks_and_tiles((n + kBlock - 1) / kBlock, num_tiles(), m * n * k,
                           [&](int64_t b0, int64_t b1, int64_t t0, int64_t t1) { run(b0, b1, t0, t1); });
  }
};

// x's rows as float32: x itself, or a widened copy of a bf16 x.
at::Tensor float_rows(const at::Tensor& x) {
  if (x.scalar_type() == at::kFloat) return x;
  at::Tensor wide = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const int64_t k = x.size(1), x_stride = x.stride(0);
  const c10::BFloat16* src = x.data_ptr<c10::BFloat16>();
  float* dst = wide.data_ptr<float>();
  at::parallel_for(0, x.size(0), std::max<int64_t>(1, kConvertGrain / std::max<int64_t>(1, k)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#pragma omp simd
      for (int64_t i = 0; i < k; ++i) dst[r * k + i] = to_float(src[r * x_stride + i]);
    }
  });
  return wide;
}

template <typename T, typename W>
void linear_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                 const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& scale) {
  const at::Tensor x32 = float_rows(x);
  const LinearProblem<T, W> problem{x32.data_ptr<float>(), x32.stride(0), packed.data_ptr<W>(),
                                    scale ? scale->data_ptr<float>() : nullptr,
                                    bias ? bias->data_ptr<T>() : nullptr, out.data_ptr<T>(),
                                    x.size(0), out.size(1), x.size(1), out.stride(0)};
  problem.run_parallel();
}

// The four kernels of an x dtype T: weights in float32, bf16 or int8.
template <typename T>
void linear_for_weight(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& scale) {
  switch (packed.scalar_type()) {
    case at::kBFloat16: return linear_impl<T, c10::BFloat16>(out, x, packed, bias, scale);
    case at::kChar: return linear_impl<T, int8_t>(out, x, packed, bias, scale);
    default: return linear_impl<T, float>(out, x, packed, bias, scale);
  }
}

bool is_weight_dtype(const at::Tensor& t) { return is_float_or_bf16(t) || t.scalar_type() == at::kChar; }

template <typename T>
void packed_on_thread(T* out, int64_t out_stride, int64_t n, const float* x, int64_t ld, int64_t m, int64_t k,
                      const at::Tensor& packed, const float* scale) {
  const int64_t blocks = (n + kBlock - 1) / kBlock, tiles = (m + kMaxRows - 1) / kMaxRows;
  switch (packed.scalar_type()) {
    case at::kBFloat16:
      return LinearProblem<T, c10::BFloat16>{x, ld, packed.data_ptr<c10::BFloat16>(), scale, nullptr, out, m, n, k,
                                             out_stride}.run(0, blocks, 0, tiles);
    case at::kChar:
      return LinearProblem<T, int8_t>{x, ld, packed.data_ptr<int8_t>(), scale, nullptr, out, m, n, k, out_stride}
          .run(0, blocks, 0, tiles);
    default:
      return LinearProblem<T, float>{x, ld, packed.data_ptr<float>(), scale, nullptr, out, m, n, k, out_stride}
          .run(0, blocks, 0, tiles);
  }
}

}  // namespace

void linear_packed_on_thread(c10::BFloat16* out, int64_t out_stride, int64_t n, const float* x, int64_t ld,
                             int64_t m, int64_t k, const at::Tensor& packed, const float* scale) {
  packed_on_thread(out, out_stride, n, x, ld, m, k, packed, scale);
}

void linear_packed_on_thread(float* out, int64_t out_stride, int64_t n, const float* x, int64_t ld, int64_t m,
                             int64_t k, const at::Tensor& packed, const float* scale) {
  packed_on_thread(out, out_stride, n, x, ld, m, k, packed, scale);
}

at::Tensor pack_linear_weight(at::Tensor weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be a contiguous [N, K] CPU tensor");
  TORCH_CHECK(is_weight_dtype(weight), "weight must be float32, bfloat16 or int8, got ", weight.scalar_type());
  const int64_t blocks = (weight.size(0) + kBlock - 1) / kBlock;
  at::Tensor packed = at::zeros({blocks, weight.size(1), kBlock}, weight.options());
  switch (weight.scalar_type()) {
    case at::kBFloat16: pack_weight<c10::BFloat16>(weight, packed); break;
    case at::kChar: pack_weight<int8_t>(weight, packed); break;
    default: pack_weight<float>(weight, packed);
  }
  return packed;
}

void linear_packed(at::Tensor out, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias,
                   c10::optional<at::Tensor> scale) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu() && packed.device().is_cpu(), "tensors must be on the CPU");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && packed.is_contiguous() && is_weight_dtype(packed),
              "packed must come from pack_linear_weight: a contiguous float32, bfloat16 or int8 [ceil(N/16), K, 16]");
  check_operands(out, x, packed.size(0), packed.size(1), bias);
  TORCH_CHECK((packed.scalar_type() == at::kChar) == scale.has_value(),
              "an int8 weight needs its [N] float32 row scales, and only an int8 weight takes them");
  TORCH_CHECK(!scale || (scale->is_contiguous() && scale->numel() == out.size(1)
                         && scale->scalar_type() == at::kFloat && scale->device().is_cpu()),
              "scale must be a contiguous [N] float32 CPU tensor");
  if (out.numel() == 0) return;
  if (x.scalar_type() == at::kBFloat16) return linear_for_weight<c10::BFloat16>(out, x, packed, bias, scale);
  linear_for_weight<float>(out, x, packed, bias, scale);
}

}  // namespace pagedllm

// GGUF's blocks in AMX-BF16 tiles (activation_bits = 0; the default for GGUF blocks on a CPU with AMX): each call
// dequantises the weight's blocks to bf16 in the layout of a tile, and `tdpbf16ps` multiplies x, rounded to bf16,
// by them:
//
//    W[n, k] = bf16(fma(d[n, g], q[n, k], m[n, g]))    (Q8_0: m = 0; Q4_0: m = -8 d)
//    out[m, n] = sum over groups g, in order, of tdpbf16ps(x[m, group g], W[n, group g]) (+ bias[n]), rounded once
//
// For a GGUF file's blocks (d and m from float16) d q is exact, so W is the file's weight rounded once to bf16, the
// weight a bf16 model dequantised from it holds. The float32 sums are the tiles': each output starts at zero and
// takes its groups in order, whatever the batch, so a row's result does not depend on the rows it runs with (oneDNN's
// bf16 matmul gives the same bits at some M, but not at every M: it changes kernels with the shape).
//
// Why: where tiles multiply, a call's cost is the dequantisation, once per weight and call, not the products. A
// decode step's batch reads a third of bf16's bytes (Q4_1: 0.625 bytes a weight, from L3 where bf16 comes from
// memory), and a prefill chunk runs as fast as oneDNN's bf16 tiles (docs/benchmarks.md). Without tiles the same
// arithmetic runs in AVX512-BF16 vectors (linear_gguf_bf16.cpp); the integer arithmetic (linear_gguf.cpp) is the
// default without either, and the faster one for a batch of one to four rows here.
//
// Tiles: a group (32 k's) of a block's 16 columns is one tile, and so are 16 rows of x over that group. A
// `tdpbf16ps` sum is symmetric: x as the A operand (16 rows of 32 k's) and W as B (16 rows of pairs, row i holding
// each column's k 2 i and 2 i + 1), or W as A and x as B, give the same bits (checked over 76,800 sums), so the
// kernel takes whichever costs less to build:
// - a few tiles of rows (a decode step): W as A, dequantised a pair of blocks at a time into L1 by tables: a 4-bit
//   column's 16 possible weights are one table, bf16(fma(d, q, m)) for q = 0..15, and `vpermw` looks its 32 nibbles
//   up at once, k in order (~7 instructions a column and group where the pairs take ~12; the blocks read a few groups
//   ahead; the next pair dequantised while the tiles multiply this one); x's tiles transposed to pairs once per
//   call; the 16 x 16 sums transposed back as they are stored.
// - more rows (a prefill chunk), and Q8_0's blocks: W as B, dequantised in pairs (each is read by many rows, so its
//   cost does not matter), a panel of blocks at a time (at most kPanelBytes of bf16, in L2), then chunks of rows
//   that stay in L2 run over it; x's tiles read where x lies (bf16 rows) or from a copy rounded to bf16 (a float32
//   x, and a last partial tile, padded with zero rows).
// A gate_up projection's call (linear_gguf_silu_and_mul) takes its blocks in pairs, gate block j and up block j, and
// stores silu(gate) * up from the two tiles of sums, rounded where linear_gguf then silu_and_mul round (the same
// bits): the [M, 2 I] product is never written nor read back (a 2,048-row prefill of SmolLM2's gate_up and SiLU
// 1.08-1.14x; decode batches level, 0.97-1.04x).
// Four tiles of sums hold 32 rows by 32 columns, so that each tile loaded serves two products. The threads take
// units of work as parallel_units deals them (ops.h): pairs of blocks for a few rows, (panel, chunk of rows) for
// many, so that a thread the hypervisor slows down gets fewer (a static split of the blocks left the other waiting:
// 1.05-1.3x on SmolLM2's 30 layers at 16-2,048 rows when the two cores ran at different speeds, level when they
// did not). Each weight is dequantised once per call, or twice where two threads take units of one panel.
#include "linear_gguf_bf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && PAGEDLLM_GGUF_BF16
#define PAGEDLLM_GGUF_AMX 1
#else
#define PAGEDLLM_GGUF_AMX 0
#endif

#include <vector>

namespace pagedllm {
namespace {

#if PAGEDLLM_GGUF_AMX
using namespace gguf_bf16;

constexpr int64_t kTileBytes = kAmxRows * kAmxRowBytes;  // one dequantised group of a block
constexpr int64_t kChunkTiles = 8;  // row tiles per chunk of a large batch: 128 rows of K bf16, in L2
// Batches of more row tiles than this dequantise a panel of blocks at a time (kPanelBytes), else a pair.
constexpr int64_t kPairedTiles = kChunkTiles / 2;
// Groups read ahead of the one dequantised: a few rows' calls wait on memory otherwise (SmolLM2's layers at one
// row took 9.3-10.3 ms without, 7.3 with 4 groups ahead, 7.7 with 8).
constexpr int64_t kPrefetchGroups = 4;

// One 4-bit group (its packed bytes at `group`) into the 16 x 64 bytes at `rows`: row j is column j's 32 weights,
// k in order (the A operand of `tdpbf16ps`). A column's 16 possible weights are one table, bf16(fma(d, q, m)) for
// q = 0..15 (MXFP4's kMxfp4Values) (one FMA and one conversion), and `vpermw` looks its 32 nibbles up in it at once.
template <int64_t type>
void dequantize_rows(const uint8_t* group, uint8_t* rows) {
  static_assert(type != kQ8_0);
  const float* d = reinterpret_cast<const float*>(group);
  const uint8_t* values = group + header_bytes(type);
  // Octet o's lane j holds column j's k 8 o + t (low nibble of byte t) and 8 o + 4 + t (high): a 4 x 16 transpose
  // of the lanes gives lane l of c[r] column 4 l + r's 16 bytes, octet by octet.
  const __m512i o0 = _mm512_loadu_si512(values), o1 = _mm512_loadu_si512(values + kRowBytes);
  const __m512i o2 = _mm512_loadu_si512(values + 2 * kRowBytes), o3 = _mm512_loadu_si512(values + 3 * kRowBytes);
  const __m512i lo01 = _mm512_unpacklo_epi32(o0, o1), hi01 = _mm512_unpackhi_epi32(o0, o1);
  const __m512i lo23 = _mm512_unpacklo_epi32(o2, o3), hi23 = _mm512_unpackhi_epi32(o2, o3);
  const __m512i c[4] = {_mm512_unpacklo_epi64(lo01, lo23), _mm512_unpackhi_epi64(lo01, lo23),
                        _mm512_unpacklo_epi64(hi01, hi23), _mm512_unpackhi_epi64(hi01, hi23)};
  // Word k of lane l's column: byte 4 (k / 8) + k % 4 of the lane, shifted right by 4 where k % 8 >= 4.
  alignas(64) static const struct Index {
    uint8_t bytes[4][64];
    uint16_t shifts[32];
    Index() : bytes{}, shifts{} {
      for (int l = 0; l < 4; ++l) {
        for (int k = 0; k < 32; ++k) bytes[l][2 * k] = static_cast<uint8_t>(16 * l + 4 * (k / 8) + k % 4);
      }
      for (int k = 0; k < 32; ++k) shifts[k] = k % 8 >= 4 ? 4 : 0;
    }
  } index;
  const __m512i shifts = _mm512_load_si512(index.shifts), low4 = _mm512_set1_epi16(0x0F);
  const __m512 q = type == kMXFP4 ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values))))
                                  : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  constexpr __mmask64 kEvenBytes = 0x5555555555555555ull;
#pragma GCC unroll 16
  for (int j = 0; j < kBlock; ++j) {
    const __m512 dj = _mm512_set1_ps(d[j]);
    const __m512 mj =
        type == kQ4_1 ? _mm512_set1_ps(d[kBlock + j]) : _mm512_mul_ps(dj, _mm512_set1_ps(min_per_d(type)));
    const __m256bh weights = _mm512_cvtneps_pbh(_mm512_fmadd_ps(dj, q, mj));
    const __m512i table = _mm512_castsi256_si512(reinterpret_cast<__m256i>(weights));
    const __m512i bytes = _mm512_maskz_permutexvar_epi8(kEvenBytes, _mm512_load_si512(index.bytes[j / 4]), c[j % 4]);
    const __m512i nibbles = _mm512_and_si512(_mm512_srlv_epi16(bytes, shifts), low4);
    _mm512_store_si512(rows + j * kAmxRowBytes, _mm512_permutexvar_epi16(nibbles, table));
  }
}

// The tile registers: sums 0-3 (row tile r by block c in 2 r + c), x 4-5, weight 6-7.
constexpr int kTiles = 8;

// Where x's row tiles are: tile t's group g at x + t * tile + g * group, its 16 rows ld bytes apart.
struct XTiles {
  const uint8_t* x;
  int64_t ld, group, tile;
  const uint8_t* at(int64_t t, int64_t g) const { return x + t * tile + g * group; }
};

// acc[2 r + c] = x's row tile r (of R) times dequantised block c (of C, `groups` tiles apart from `w`), group by
// group, between(g) called after group g's products. With w_is_a the blocks are the A operand (dequantize_rows'
// rows) and x's tiles the B one (pairs), and acc holds [column][row] sums: the same bits as the other way round.
template <int R, int C, bool w_is_a, typename Between>
void tile_sums(const XTiles& x, const uint8_t* w, int64_t groups, float* acc, const Between& between) {
#define PAGEDLLM_DP(sums, x_tile, w_tile)                         \
  if constexpr (w_is_a) _tile_dpbf16ps(sums, w_tile, x_tile);    \
  else _tile_dpbf16ps(sums, x_tile, w_tile)
  _tile_zero(0);
  if constexpr (C > 1) _tile_zero(1);
  if constexpr (R > 1) _tile_zero(2);
  if constexpr (R > 1 && C > 1) _tile_zero(3);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(6, w + g * kTileBytes, kAmxRowBytes);
    if constexpr (C > 1) _tile_loadd(7, w + (groups + g) * kTileBytes, kAmxRowBytes);
    _tile_loadd(4, x.at(0, g), x.ld);
    PAGEDLLM_DP(0, 4, 6);
    if constexpr (C > 1) { PAGEDLLM_DP(1, 4, 7); }
    if constexpr (R > 1) {
      _tile_loadd(5, x.at(1, g), x.ld);
      PAGEDLLM_DP(2, 5, 6);
      if constexpr (C > 1) { PAGEDLLM_DP(3, 5, 7); }
    }
    between(g);
  }
#undef PAGEDLLM_DP
  constexpr int64_t stride = kBlock * sizeof(float), tile = kAmxRows * kBlock;
  _tile_stored(0, acc, stride);
  if constexpr (C > 1) _tile_stored(1, acc + tile, stride);
  if constexpr (R > 1) _tile_stored(2, acc + 2 * tile, stride);
  if constexpr (R > 1 && C > 1) _tile_stored(3, acc + 3 * tile, stride);
}

template <bool w_is_a, typename Between>
void tile_sums(int nr, int nb, const XTiles& x, const uint8_t* w, int64_t groups, float* acc, const Between& between) {
  if (nr == 2 && nb == 2) return tile_sums<2, 2, w_is_a>(x, w, groups, acc, between);
  if (nr == 2) return tile_sums<2, 1, w_is_a>(x, w, groups, acc, between);
  if (nb == 2) return tile_sums<1, 2, w_is_a>(x, w, groups, acc, between);
  tile_sums<1, 1, w_is_a>(x, w, groups, acc, between);
}

template <typename T>
struct Bf16TileProblem {
  const uint8_t* x;       // x's bf16 rows, ld bytes apart: row tiles [0, in_place)
  int64_t ld, in_place;
  const uint8_t* staged;  // row tiles [in_place, ...): bf16 rows of k, zero-padded to a whole tile
  const uint8_t* x_pairs;  // or x's row tiles as B operands, `groups` tiles each (transpose_pairs)
  const uint8_t* packed;
  const T* bias;
  T* out;
  int64_t type, groups, m, n, out_stride;
  int64_t half_blocks;  // 0, or a gated call's half of the blocks (physical_block)

  int64_t physical(int64_t b) const { return physical_block(b, half_blocks); }

  // Groups [g0, g1) of blocks [b0, b1) dequantised into dst, `groups` tiles a block: as A operands
  // (dequantize_rows, 4-bit types) or as B ones (dequantize_group), each block's groups read kPrefetchGroups ahead.
  template <int64_t type_, bool as_rows>
  void dequantize(int64_t b0, int64_t b1, int64_t g0, int64_t g1, uint8_t* dst) const {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* group = packed + (physical(b) * groups + g) * group_bytes(type_);
        prefetch_ahead(b, g);
        uint8_t* tile = dst + ((b - b0) * groups + g) * kTileBytes;
        if constexpr (as_rows) dequantize_rows<type_>(group, tile);
        else dequantize_group<type_>(group, tile);
      }
    }
  }
  template <bool as_rows>
  void dequantize(int64_t b0, int64_t b1, int64_t g0, int64_t g1, uint8_t* dst) const {
    switch (type) {
      case kQ4_0: return dequantize<kQ4_0, as_rows>(b0, b1, g0, g1, dst);
      case kQ4_1: return dequantize<kQ4_1, as_rows>(b0, b1, g0, g1, dst);
      case kMXFP4: return dequantize<kMXFP4, as_rows>(b0, b1, g0, g1, dst);
      default:
        if constexpr (!as_rows) dequantize<kQ8_0, false>(b0, b1, g0, g1, dst);  // Q8_0 has no tables: never x_pairs
    }
  }

  // The group kPrefetchGroups after block b's group g (the next block's where the block ends), towards L1.
  void prefetch_ahead(int64_t b, int64_t g) const {
    const int64_t ahead_g = g + kPrefetchGroups, ahead_b = b + ahead_g / groups;
    const uint8_t* ahead = packed + (physical(ahead_b) * groups + ahead_g % groups) * group_bytes(type);
    for (int64_t i = 0; i < group_bytes(type); i += 64) prefetch_line<0>(ahead + i);
  }

  // Row tiles [t0, t1), two at a time where both lie in one place, times blocks p, p + 1 (nb of them) at `w`: as
  // the A operand with x_pairs, else the B one. between(call, calls, g) after group g's products in each of the
  // calls of tile_sums (x_pairs': (t1 - t0 + 1) / 2 of them, two row tiles each).
  template <typename Between>
  void multiply(int64_t t0, int64_t t1, const uint8_t* w, int64_t p, int nb, const Between& between) const {
    alignas(64) float acc[4 * kAmxRows * kBlock], by_row[2][kAmxRows * kBlock];
    for (int64_t t = t0; t < t1;) {
      const int nr = t + 1 < t1 && (x_pairs || t + 1 < in_place || t >= in_place) ? 2 : 1;
      const auto during = [&](int64_t g) { between((t - t0) / 2, (t1 - t0 + 1) / 2, g); };
      if (x_pairs) {
        tile_sums<true>(nr, nb, {x_pairs + t * groups * kTileBytes, kAmxRowBytes, kTileBytes, groups * kTileBytes},
                        w, groups, acc, during);
      } else if (t < in_place) {
        tile_sums<false>(nr, nb, {x + t * kAmxRows * ld, ld, kAmxRowBytes, kAmxRows * ld}, w, groups, acc, during);
      } else {
        const int64_t staged_ld = groups * kAmxRowBytes;
        tile_sums<false>(nr, nb, {staged + (t - in_place) * kAmxRows * staged_ld, staged_ld, kAmxRowBytes,
                                  kAmxRows * staged_ld}, w, groups, acc, during);
      }
      for (int r = 0; r < nr; ++r) {
        const int64_t m0 = (t + r) * kAmxRows;
        const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, m - m0));
        const float* sums[2];
        for (int c = 0; c < nb; ++c) {
          sums[c] = acc + (2 * r + c) * kAmxRows * kBlock;
          if (x_pairs) {  // [column][row]
            const uint8_t* columns[kAmxRows];
            for (int j = 0; j < kAmxRows; ++j) columns[j] = reinterpret_cast<const uint8_t*>(sums[c] + j * kAmxRows);
            transpose_pairs(columns, 0, reinterpret_cast<uint8_t*>(by_row[c]));
            sums[c] = by_row[c];
          }
        }
        if (half_blocks) {
          store_silu_tile(out, out_stride, bias, half_blocks * kBlock, sums[0], sums[1], m0, rows, p / 2 * kBlock);
          continue;
        }
        for (int c = 0; c < nb; ++c) {
          const int64_t n0 = (p + c) * kBlock;
          store_tile(out, out_stride, bias, sums[c], m0, rows, n0, static_cast<int>(std::min<int64_t>(kBlock, n - n0)));
        }
      }
      t += nr;
    }
  }

  // A few row tiles: units of a pair of column blocks, each thread taking its own pairs first, then the others'
  // from their ends (parallel_units). With x_pairs, the thread's next pair is dequantised group by group while the
  // tiles multiply this one (its vector instructions run while a `tdpbf16ps` does; 1.10-1.17x at 32-64 rows), into
  // the other half of the buffer, its blocks spread over the pair's calls of two row tiles (all in the first call:
  // 0.94-0.95x at 33-64 rows). Q8_0's pairs are dequantised before their products: the same overlap measured slower
  // for the LM head at 1-16 rows (1.76 against 1.51 ms).
  void run_pairs(int64_t blocks, int64_t tiles, int64_t threads) const {
    const int64_t pair_bytes = 2 * groups * kTileBytes;
    const auto pair_end = [&](int64_t u) { return std::min(2 * u + 2, blocks); };
    parallel_units((blocks + 1) / 2, threads, [&](const auto& take) {
      const AlignedFloats buffer = aligned_floats(2 * pair_bytes / sizeof(float));  // two pairs: a double buffer
      uint8_t* w = reinterpret_cast<uint8_t*>(buffer.get());
      configure_tiles(kTiles);
      if (x_pairs) {
        int64_t u = take();
        if (u >= 0) dequantize<true>(2 * u, pair_end(u), 0, groups, w);
        for (int64_t half = 0; u >= 0; half = 1 - half) {
          const int64_t next = take(), n0 = next >= 0 ? 2 * next : 0, n1 = next >= 0 ? pair_end(next) : 0;
          uint8_t* ahead = w + (1 - half) * pair_bytes;
          multiply(0, tiles, w + half * pair_bytes, 2 * u, static_cast<int>(pair_end(u) - 2 * u),
                   [&](int64_t call, int64_t calls, int64_t g) {
                     for (int64_t b = n0 + call; b < n1; b += calls) {
                       dequantize<true>(b, b + 1, g, g + 1, ahead + (b - n0) * groups * kTileBytes);
                     }
                   });
          u = next;
        }
      } else {
        for (int64_t u; (u = take()) >= 0;) {
          dequantize<false>(2 * u, pair_end(u), 0, groups, w);
          multiply(0, tiles, w, 2 * u, static_cast<int>(pair_end(u) - 2 * u), [](int64_t, int64_t, int64_t) {});
        }
      }
      _tile_release();  // the tile registers' state goes with the thread on every switch while configured
    });
  }

  // Many row tiles: units of (panel of column blocks, chunk of row tiles), panel by panel, each thread taking its
  // own units first, then the others' from their ends (parallel_units).
  void run_units(int64_t blocks, int64_t tiles, int64_t threads) const {
    const int64_t chunks = (tiles + kChunkTiles - 1) / kChunkTiles;
    const int64_t max_panel = std::max<int64_t>(2, kPanelBytes / (groups * kTileBytes) / 2 * 2);
    const int64_t want_panels = (kUnitsPerThread * threads + chunks - 1) / chunks;
    const int64_t panel =
        std::min(max_panel, std::max<int64_t>(2, ((blocks + want_panels - 1) / want_panels + 1) / 2 * 2));
    parallel_units((blocks + panel - 1) / panel * chunks, threads, [&](const auto& take) {
      const AlignedFloats buffer = aligned_floats(std::min(panel, blocks) * groups * kTileBytes / sizeof(float));
      uint8_t* w = reinterpret_cast<uint8_t*>(buffer.get());
      configure_tiles(kTiles);
      for (int64_t u, held = -1; (u = take()) >= 0;) {
        const int64_t s0 = u / chunks * panel, s1 = std::min(s0 + panel, blocks), c0 = u % chunks * kChunkTiles;
        if (u / chunks != held) dequantize<false>(s0, s1, 0, groups, w), held = u / chunks;
        for (int64_t p = s0; p < s1; p += 2) {
          multiply(c0, std::min(c0 + kChunkTiles, tiles), w + (p - s0) * groups * kTileBytes, p,
                   static_cast<int>(std::min<int64_t>(2, s1 - p)), [](int64_t, int64_t, int64_t) {});
        }
      }
      _tile_release();
    });
  }
};

template <typename T>
void run_bf16_tiles(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t type,
                    const c10::optional<at::Tensor>& bias, bool gated) {
  const int64_t m = x.size(0), k = x.size(1), tiles = (m + kAmxRows - 1) / kAmxRows;
  const int64_t in_place = std::is_same_v<T, c10::BFloat16> ? m / kAmxRows : 0;
  std::vector<c10::BFloat16> staged((tiles - in_place) * kAmxRows * k, c10::BFloat16(0.f));
  const T* src = x.data_ptr<T>();
  const int64_t x_stride = x.stride(0);
  stage_rows_in_bf16(src, x_stride, in_place * kAmxRows, m, k, staged.data());
  // A few row tiles of 4-bit blocks: x's tiles as B operands, each group's 16 rows by 16 pairs transposed.
  const int64_t groups = packed.size(1);
  const bool x_as_b = tiles <= kPairedTiles && type != kQ8_0;
  AlignedFloats pairs = aligned_floats(x_as_b ? tiles * groups * kTileBytes / sizeof(float) : 0);
  if (x_as_b) {
    for (int64_t t = 0; t < tiles; ++t) {
      const uint8_t* rows[kAmxRows];
      for (int r = 0; r < kAmxRows; ++r) {
        const int64_t row = t * kAmxRows + r;
        rows[r] = row < in_place * kAmxRows
                      ? reinterpret_cast<const uint8_t*>(src + row * x_stride)
                      : reinterpret_cast<const uint8_t*>(staged.data() + (row - in_place * kAmxRows) * k);
      }
      for (int64_t g = 0; g < groups; ++g) {
        transpose_pairs(rows, g * kAmxRowBytes,
                        reinterpret_cast<uint8_t*>(pairs.get()) + (t * groups + g) * kTileBytes);
      }
    }
  }
  const Bf16TileProblem<T> problem{reinterpret_cast<const uint8_t*>(src), x_stride * int64_t{sizeof(T)}, in_place,
                                   reinterpret_cast<const uint8_t*>(staged.data()),
                                   x_as_b ? reinterpret_cast<const uint8_t*>(pairs.get()) : nullptr,
                                   packed.data_ptr<uint8_t>(), bias ? bias->data_ptr<T>() : nullptr,
                                   out.data_ptr<T>(), type, groups, m, out.size(1), out.stride(0),
                                   gated ? packed.size(0) / 2 : 0};
  const int64_t threads = threads_for(m * packed.size(0) * kBlock * k);
  if (tiles > kPairedTiles) return problem.run_units(packed.size(0), tiles, threads);
  problem.run_pairs(packed.size(0), tiles, threads);
}

#endif

}  // namespace

bool run_gguf_bf16_tiles(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t type,
                         const c10::optional<at::Tensor>& bias, bool gated) {
#if PAGEDLLM_GGUF_AMX
  if (!amx_granted()) return false;
  if (out.numel() == 0) return true;
  if (x.scalar_type() == at::kBFloat16) run_bf16_tiles<c10::BFloat16>(out, x, packed, type, bias, gated);
  else run_bf16_tiles<float>(out, x, packed, type, bias, gated);
  return true;
#else
  return false;
#endif
}

bool gguf_bf16_tiles_available() {
#if PAGEDLLM_GGUF_AMX
  return amx_granted();
#else
  return false;
#endif
}

}  // namespace pagedllm

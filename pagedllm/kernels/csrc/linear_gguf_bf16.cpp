// GGUF's blocks times x in bf16 (activation_bits = 0) in AVX512-BF16 vectors, where there are no AMX tiles (the
// default on Zen 4 and Zen 5; pagedllm.layers.linear.gguf_activation_bits says where else): each call dequantises
// the weight's blocks to bf16 pairs (dequantize_group, the tiles' B operand), and `vdpbf16ps` multiplies x, rounded
// to bf16, by them, 16 columns a vector:
//
//    W[n, k] = bf16(fma(d[n, g], q[n, k], m[n, g]))    (Q8_0: m = 0; Q4_0: m = -8 d)
//    even[m, n], odd[m, n] = the float32 sums of x's pairs of k's (2 p, 2 p + 1) times W's, p even and p odd, each
//                            taking its pairs in order, as `vdpbf16ps` adds a pair's two products to a lane
//    out[m, n] = (even + odd) (+ bias[n]), rounded once
//
// the same arithmetic as the tiles (linear_gguf_amx.cpp) but not their float32 bits, whose order inside a tile the
// hardware fixes. Each output's order depends on K alone, so a row's result does not depend on the rows it runs
// with. Two sums an output so that a few rows keep two chains of `vdpbf16ps` apiece going (one row took 1.5x as long
// with one).
//
// Why: 32 products a `vdpbf16ps` and no per-group scaling of the sums, where the 16-bit integer path
// (linear_gguf.cpp) takes two `vpdpbusd`s per 64 products and three float multiplies per group: a 2,048-row prefill of
// SmolLM2's layers ran 1.47x faster on a Zen 5 (docs/benchmarks.md), a batch of 17 rows level to 1.1x. Its cost is
// the dequantisation, once per weight and call: a batch of one to six rows takes 1.1-1.2x as long as the integer
// path, eight 1.2x. On the mixed workload the run took 1.12x less time, one stream 0.9x the tokens a second; like the
// tiles it is the default for a bf16 model (pagedllm.layers.linear.gguf_activation_bits).
//
// Loops: the threads take panels of column blocks (parallel_units). Past kRows rows each panel is dequantised whole
// into this thread's buffer (at most kPanelBytes of bf16, in L2), and every tile of kRows rows runs over the panel's
// blocks two at a time; up to kRows rows, the one tile streams the panel's blocks, two at a time, a group of each
// dequantised into L1 and multiplied before the next. A gated call (linear_gguf_silu_and_mul) pairs gate block j with
// up block j and stores silu(gate) * up.
#include "linear_gguf_bf16.h"

#include <vector>

namespace pagedllm {
namespace {

#if PAGEDLLM_GGUF_BF16
using namespace gguf_bf16;

constexpr int kRows = 6;  // rows of a tile: 6 rows x 2 blocks x 2 sums = 24 of the 32 zmm registers
// Groups ahead of the one dequantised whose lines are asked for, towards L2 (one row's calls over 30 layers of
// weights: 3.8 ms with 8, 2.9 with 16, the integer path 1.8-2.1).
constexpr int64_t kPrefetchGroups = 16;

// A tile's float32 sums: R rows of x times C blocks, the even pairs' and the odd pairs' sums of each output apart.
template <int R, int C>
struct TileSums {
  __m512 acc[R][C][2];

  TileSums() {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm512_setzero_ps();
    }
  }

  // Adds x's R rows (bf16, `ld` bytes apart, each from the pair of k's at x) times `pairs` rows of pairs of each
  // block c (at w + c * stride * kPairRowBytes), an even number of them.
  void add(const uint8_t* x, int64_t ld, const uint8_t* w, int64_t stride, int64_t pairs) {
    for (int64_t p = 0; p < pairs; p += 2) {
#pragma GCC unroll 2
      for (int s = 0; s < 2; ++s) {
        __m512bh weights[C];
#pragma GCC unroll 2
        for (int c = 0; c < C; ++c) {
          weights[c] = reinterpret_cast<__m512bh>(_mm512_load_si512(w + (c * stride + p + s) * kPairRowBytes));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512bh xs = reinterpret_cast<__m512bh>(_mm512_set1_epi32(load_4_bytes(x + r * ld + 4 * (p + s))));
#pragma GCC unroll 2
          for (int c = 0; c < C; ++c) acc[r][c][s] = _mm512_dpbf16_ps(acc[r][c][s], xs, weights[c]);
        }
      }
    }
  }

  // sums[c][r] (16 floats each, kRows rows apart) = the even sum plus the odd one.
  void store(float* sums) const {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) {
        _mm512_store_ps(sums + (c * kRows + r) * kBlock, _mm512_add_ps(acc[r][c][0], acc[r][c][1]));
      }
    }
  }
};

// f(std::integral_constant<int, rows>()), rows from 1 to kRows: a tile's rows as a constant.
template <int R = kRows, typename F>
void with_rows(int rows, F&& f) {
  if constexpr (R > 1) {
    if (rows < R) return with_rows<R - 1>(rows, f);
  }
  f(std::integral_constant<int, R>());
}

// This thread's buffer of at least `bytes`, kept from call to call (a panel is up to kPanelBytes: allocated in each
// call, it would be mapped, and its pages faulted in, again and again).
uint8_t* thread_buffer(int64_t bytes) {
  thread_local AlignedFloats buffer(nullptr, &std::free);
  thread_local int64_t size = 0;
  if (size < bytes) buffer = aligned_floats(bytes / int64_t{sizeof(float)}), size = bytes;
  return reinterpret_cast<uint8_t*>(buffer.get());
}

template <typename T>
struct Bf16VectorProblem {
  const uint8_t* x;  // x's rows in bf16, ld bytes apart
  int64_t ld;
  const uint8_t* packed;
  const T* bias;
  T* out;
  int64_t type, groups, m, n, out_stride;
  int64_t half_blocks;  // 0, or a gated call's half of the blocks (physical_block)

  int64_t physical(int64_t b) const { return physical_block(b, half_blocks); }

  // Asks for the lines of block b's group g towards L2, `ahead` groups of this block further on: in the next
  // `step` blocks' where this block ends (the next panel's, or a stream's next pair).
  template <int64_t type_>
  void prefetch_ahead(int64_t b, int64_t g, int64_t ahead, int64_t step) const {
    const int64_t ahead_g = g + ahead, ahead_b = b + step * (ahead_g / groups);
    const uint8_t* group = packed + (physical(ahead_b) * groups + ahead_g % groups) * group_bytes(type_);
#pragma GCC unroll 16
    for (int64_t line = 0; line < group_bytes(type_); line += 64) prefetch_line<1>(group + line);
  }

  // Block b's group g, packed.
  template <int64_t type_>
  const uint8_t* group_of(int64_t b, int64_t g) const {
    return packed + (physical(b) * groups + g) * group_bytes(type_);
  }

  // Blocks [b0, b1) dequantised into dst, a block's groups one after another.
  template <int64_t type_>
  void dequantize(int64_t b0, int64_t b1, uint8_t* dst) const {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t g = 0; g < groups; ++g) {
        prefetch_ahead<type_>(b, g, kPrefetchGroups, 1);
        dequantize_group<type_>(group_of<type_>(b, g), dst + ((b - b0) * groups + g) * kGroupBytes);
      }
    }
  }

  // Rows [m0, m0 + rows) of out from sums[c][r] (store's): blocks [b, b + nb) of this call.
  void store(const float* sums, int64_t m0, int rows, int64_t b, int nb) const {
    if (half_blocks) {
      return store_silu_tile(out, out_stride, bias, half_blocks * kBlock, sums, sums + kRows * kBlock, m0, rows,
                             b / 2 * kBlock);
    }
    for (int c = 0; c < nb; ++c) {
      const int64_t n0 = (b + c) * kBlock;
      store_tile(out, out_stride, bias, sums + c * kRows * kBlock, m0, rows, n0,
                 static_cast<int>(std::min<int64_t>(kBlock, n - n0)));
    }
  }

  // Every row times the panel's blocks [p0, p1), dequantised at w, C at a time (C = 1: p1 - p0 is 1).
  template <int C>
  void multiply(int64_t p0, int64_t p1, const uint8_t* w) const {
    alignas(64) float sums[2 * kRows * kBlock];
    const int64_t pairs = groups * kGroupK / 2;
    for (int64_t m0 = 0; m0 < m; m0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, m - m0));
      for (int64_t b = p0; b + C <= p1; b += 2) {
        with_rows(rows, [&](auto r) {
          TileSums<r, C> tile;
          tile.add(x + m0 * ld, ld, w + (b - p0) * groups * kGroupBytes, pairs, pairs);
          tile.store(sums);
        });
        store(sums, m0, rows, b, C);
      }
    }
  }

  // Every row (at most kRows) times blocks [p0, p1), C at a time, group by group: a group of each block dequantised
  // into L1 and multiplied before the next, the sums of multiply's order without the panel's round trip through L2
  // (one row over SmolLM2's 30 layers: 1.4-1.6x the integer path's time with the panel, 1.1-1.2x streamed; one
  // stream of tokens 1.2x faster).
  template <int64_t type_, int C>
  void stream(int64_t p0, int64_t p1) const {
    alignas(64) uint8_t w[2 * kGroupBytes];
    alignas(64) float sums[2 * kRows * kBlock];
    for (int64_t b = p0; b + C <= p1; b += 2) {
      with_rows(static_cast<int>(m), [&](auto r) {
        TileSums<r, C> tile;
        for (int64_t g = 0; g < groups; ++g) {
#pragma GCC unroll 2
          for (int c = 0; c < C; ++c) {
            prefetch_ahead<type_>(b + c, g, kPrefetchGroups, 2);
            dequantize_group<type_>(group_of<type_>(b + c, g), w + c * kGroupBytes);
          }
          tile.add(x + g * kGroupK * int64_t{sizeof(c10::BFloat16)}, ld, w, kGroupK / 2, kGroupK / 2);
        }
        tile.store(sums);
      });
      store(sums, 0, static_cast<int>(m), b, C);
    }
  }

  // Blocks [p0, p1) times every row: streamed to a few rows, else dequantised whole into this thread's buffer w.
  template <int64_t type_>
  void run_panel(int64_t p0, int64_t p1, uint8_t* w) const {
    if (m <= kRows) {
      stream<type_, 2>(p0, p1);
      if ((p1 - p0) % 2) stream<type_, 1>(p1 - 1, p1);
      return;
    }
    dequantize<type_>(p0, p1, w);
    multiply<2>(p0, p1, w);
    if ((p1 - p0) % 2) multiply<1>(p1 - 1, p1, w + (p1 - 1 - p0) * groups * kGroupBytes);
  }
  void run_panel(int64_t p0, int64_t p1, uint8_t* w) const {
    switch (type) {
      case kQ4_0: return run_panel<kQ4_0>(p0, p1, w);
      case kQ4_1: return run_panel<kQ4_1>(p0, p1, w);
      case kMXFP4: return run_panel<kMXFP4>(p0, p1, w);
      default: return run_panel<kQ8_0>(p0, p1, w);
    }
  }

  // Panels of blocks, an even number of them (a gated call's pairs), at most kPanelBytes dequantised, and at least
  // kUnitsPerThread a thread where the blocks allow.
  void run(int64_t blocks, int64_t threads) const {
    const int64_t block_bytes = groups * kGroupBytes;
    const int64_t max_panel = std::max<int64_t>(2, kPanelBytes / block_bytes / 2 * 2);
    const int64_t want = (blocks + kUnitsPerThread * threads - 1) / (kUnitsPerThread * threads);
    const int64_t panel = std::min(max_panel, std::max<int64_t>(2, (want + 1) / 2 * 2));
    parallel_units((blocks + panel - 1) / panel, threads, [&](const auto& take) {
      uint8_t* w = m <= kRows ? nullptr : thread_buffer(std::min(panel, blocks) * block_bytes);
      for (int64_t u; (u = take()) >= 0;) run_panel(u * panel, std::min(u * panel + panel, blocks), w);
    });
  }
};

template <typename T>
void run_bf16_vectors(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t type,
                      const c10::optional<at::Tensor>& bias, bool gated) {
  const int64_t m = x.size(0), k = x.size(1);
  // x's rows where they lie when they are bf16, else a copy rounded to bf16.
  std::vector<c10::BFloat16> staged;
  const uint8_t* rows = reinterpret_cast<const uint8_t*>(x.data_ptr());
  int64_t ld = x.stride(0) * int64_t{sizeof(T)};
  if constexpr (!std::is_same_v<T, c10::BFloat16>) {
    staged.resize(m * k);
    stage_rows_in_bf16(x.data_ptr<T>(), x.stride(0), 0, m, k, staged.data());
    rows = reinterpret_cast<const uint8_t*>(staged.data()), ld = k * int64_t{sizeof(c10::BFloat16)};
  }
  const Bf16VectorProblem<T> problem{rows, ld, packed.data_ptr<uint8_t>(), bias ? bias->data_ptr<T>() : nullptr,
                                     out.data_ptr<T>(), type, packed.size(1), m, out.size(1), out.stride(0),
                                     gated ? packed.size(0) / 2 : 0};
  problem.run(packed.size(0), threads_for(m * packed.size(0) * kBlock * k));
}
#endif

// x W^T (+ bias), or with `gated` linear_gguf_silu_and_mul's silu(gate) * up: in AMX tiles where this process has
// them, else in vectors.
void run_bf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t type,
              const c10::optional<at::Tensor>& bias, bool gated) {
  if (run_gguf_bf16_tiles(out, x, packed, type, bias, gated)) return;
#if PAGEDLLM_GGUF_BF16
  if (out.numel() == 0) return;
  if (x.scalar_type() == at::kBFloat16) return run_bf16_vectors<c10::BFloat16>(out, x, packed, type, bias, gated);
  run_bf16_vectors<float>(out, x, packed, type, bias, gated);
#endif
}

}  // namespace

bool gguf_bf16_available() { return PAGEDLLM_GGUF_BF16 || gguf_bf16_tiles_available(); }

void linear_gguf_bf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t ggml_type,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(gguf_bf16_available(),
              "activation_bits=0 multiplies x in bf16 by GGUF blocks dequantised to bf16 with AVX512-BF16, which this "
              "build of the kernels (or this CPU) does not have: use 16 or 8");
  run_bf16(out, x, packed, ggml_type, bias, false);
}

void linear_gguf_silu_and_mul(at::Tensor out, at::Tensor x, at::Tensor packed, int64_t ggml_type,
                              c10::optional<at::Tensor> bias) {
  check_gguf_packed(x, out, packed, ggml_type);
  const int64_t half = out.size(1);
  TORCH_CHECK(packed.size(0) * kBlock == 2 * half && half % kBlock == 0,
              "linear_gguf_silu_and_mul: packed must hold 2 N columns (gate, then up) for out's N, a multiple of 16; "
              "got N=", half, " and ", packed.size(0) * kBlock, " packed columns");
  check_operands(out, x, packed.size(0) / 2, packed.size(1) * kGroupK, c10::nullopt);
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == 2 * half && bias->scalar_type() == x.scalar_type()
                        && bias->device().is_cpu()),
              "bias must be a contiguous [2 N] CPU tensor of x's dtype (gate's, then up's)");
  TORCH_CHECK(gguf_bf16_available(),
              "linear_gguf_silu_and_mul multiplies x in bf16 by GGUF blocks dequantised to bf16 with AVX512-BF16, "
              "which this build of the kernels (or this CPU) does not have");
  run_bf16(out, x, packed, ggml_type, bias, true);
}

}  // namespace pagedllm

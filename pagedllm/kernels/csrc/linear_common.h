// What the linear kernels share (linear.cpp: float32, bf16 and int8 weights; linear_int8.cpp: W8A8;
// linear_gguf.cpp: GGUF's blocks times 16-bit activations in two int8 halves): output columns in blocks of 16, the
// threads' split of the work, the store of a tile of results, the quantization of activations, and the checks of
// x, out and bias.
#pragma once

#include "ops.h"

#include <ATen/Parallel.h>

#include <cstdlib>
#include <limits>
#include <memory>

namespace pagedllm {

constexpr int64_t kBlock = 16;                  // output columns per packed block: one zmm, or two ymm, of float32
constexpr int64_t kPanelBytes = 512 * 1024;     // weight panel kept in L2 (half of a 1 MiB L2) while tiles stream
constexpr int64_t kInlineMacs = 1 << 18;        // below this many multiply-adds, a fork costs more than it saves
constexpr int64_t kConvertGrain = 1 << 16;      // x values widened or quantized per task: fewer are not worth a fork

// The weight's bytes ahead of a tile's reads whose lines are asked for, towards L2, where a tile streams the packed
// weight itself (linear.cpp's kStream tiles, linear_int8.cpp's): at a few rows a block row's multiply-adds take less
// time than memory takes to deliver the next rows, and the hardware prefetcher alone left the kernels waiting (on a
// Zen 5 over 30 layers' weights: linear.cpp up to 1.6x slower at 4-32 rows, up to 1.4x capped to AVX2; W8A8 1.1-1.3x
// at 4-16 rows, at both levels; docs/benchmarks.md).
constexpr int64_t kPrefetchBytes = 2048;

// out[m0 .. m0 + rows, 16 b ..] = acc (times the row scale, if any) + bias, rounded once to T; the padded
// columns of the last block dropped.
template <typename T>
void store_rows(T* out, int64_t out_stride, int64_t n, const T* bias, const float* scale, const float* acc,
                int64_t m0, int rows, int64_t b) {
  const int64_t n0 = b * kBlock, cols = std::min(kBlock, n - n0);
  for (int r = 0; r < rows; ++r) {
    T* dst = out + (m0 + r) * out_stride + n0;
    for (int64_t j = 0; j < cols; ++j) {
      const float sum = scale ? acc[r * kBlock + j] * scale[n0 + j] : acc[r * kBlock + j];
      dst[j] = from_float<T>(bias ? sum + to_float(bias[n0 + j]) : sum);
    }
  }
}

// A buffer of n floats starting on a cache line. A float32 block row is 64 bytes: at malloc's 16-byte alignment,
// most AVX-512 loads and stores of one would straddle two lines.
using AlignedFloats = std::unique_ptr<float[], decltype(&std::free)>;
inline AlignedFloats aligned_floats(int64_t n) {
  const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float) + 63) / 64 * 64;
  AlignedFloats buffer(static_cast<float*>(std::aligned_alloc(64, bytes)), &std::free);
  TORCH_CHECK(buffer, "out of memory allocating ", bytes, " bytes");
  return buffer;
}

// Threads split the column blocks (and the row tiles, when there are fewer blocks than threads) into units,
// kUnitsPerThread a thread, taken as parallel_units deals them: a thread that runs slower gets fewer.
// run(b0, b1, t0, t1) computes column blocks [b0, b1) of row tiles [t0, t1); `macs` is the call's work.
constexpr int64_t kUnitsPerThread = 4;

// The threads a call of `macs` multiply-adds runs on: one below kInlineMacs, where a fork costs more than it saves.
inline int64_t threads_for(int64_t macs) { return macs < kInlineMacs ? 1 : at::get_num_threads(); }

template <typename Run>
void split_blocks_and_tiles(int64_t blocks, int64_t tiles, int64_t macs, const Run& run) {
  const int64_t threads = threads_for(macs);
  const int64_t n_parts = threads == 1 ? 1 : std::min(blocks, kUnitsPerThread * threads);
  const int64_t m_parts = std::min(tiles, (threads + n_parts - 1) / n_parts);
  parallel_units(n_parts * m_parts, threads, [&](const auto& take) {
    for (int64_t unit; (unit = take()) >= 0;) {
      const int64_t np = unit % n_parts, mp = unit / n_parts;
      run(np * blocks / n_parts, (np + 1) * blocks / n_parts, mp * tiles / m_parts, (mp + 1) * tiles / m_parts);
    }
  });
}

// GCC contracts `a * b + c` into one FMA wherever it sees both (intrinsics included), rounding once where torch
// rounds twice. A product passed through `rounded` is opaque to it (an empty asm that may have changed the
// register), so it is added as rounded. `rounding_barrier` does the same for values stored in memory: they are
// reloaded after it, as the compiler must assume the asm changed them.
template <typename V>
inline V rounded(V v) {
  asm("" : "+x"(v));
  return v;
}
inline void rounding_barrier(const void* stored) { asm volatile("" : : "r"(stored) : "memory"); }

inline int32_t load_4_bytes(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A row of k values of x scaled for int8 span by span, `span` k's to a scale, as
// pagedllm.layers.linear.quantize_int8 quantizes a row: s = max |x| / 127 over the span (1 for a zero span),
// v = x / s clamped to [-127, 127], whose q = round(v) (`quantized`) is the int8 value. scales[t] gets span t's s,
// v[i] each value's v: callers then convert them in loops of their own, which vectorise (a store callback per value
// kept the GGUF kernel's loop scalar: ~3 ns a value, 40-60% of a call at 1536 k's). A span holding a NaN or an
// infinity gets s NaN or infinite and every v 0, so that its products come out NaN, as float32 ones would (rather
// than a NaN cast to int8, which is undefined).
template <typename T>
void quantize_spans(const T* x, int64_t k, int64_t span, float* scales, float* v) {
  for (int64_t start = 0; start < k; start += span) {
    const int64_t end = std::min(k, start + span);
    float amax = 0.f;
    int nan = 0;  // std::max drops a NaN
#pragma omp simd reduction(max : amax) reduction(| : nan)
    for (int64_t i = start; i < end; ++i) {
      const float a = std::abs(to_float(x[i]));
      amax = std::max(amax, a);
      nan |= std::isnan(a);
    }
    const float s = nan ? std::numeric_limits<float>::quiet_NaN() : (amax / 127.f > 0.f ? amax / 127.f : 1.f);
    scales[start / span] = s;
    if (!std::isfinite(s)) {
      std::fill(v + start, v + end, 0.f);
      continue;
    }
#pragma omp simd
    for (int64_t i = start; i < end; ++i) {
      // Clamped before rounding, which gives the same integer (the bounds are integers) and keeps |v| < 2^22.
      v[i] = std::min(std::max(to_float(x[i]) / s, -127.f), 127.f);
    }
  }
}

inline int8_t quantized(float v) { return static_cast<int8_t>(round_half_even(v)); }

inline bool is_float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

// The checks every linear kernel makes of x, out and bias, for a packed weight of `blocks` column blocks and `k` k's.
inline void check_operands(const at::Tensor& out, const at::Tensor& x, int64_t blocks, int64_t k,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1,
              "x and out must be 2-D with contiguous rows");
  TORCH_CHECK(is_float_or_bf16(x) && out.scalar_type() == x.scalar_type(),
              "x must be float32 or bfloat16 and out of x's dtype, got x ", x.scalar_type(), ", out ",
              out.scalar_type());
  TORCH_CHECK(x.size(1) == k, "x has K=", x.size(1), " but the packed weight K=", k);
  TORCH_CHECK(out.size(0) == x.size(0) && (out.size(1) + kBlock - 1) / kBlock == blocks,
              "out must be [M, N] with M=", x.size(0), " and N in (", 16 * (blocks - 1), ", ", 16 * blocks,
              "], got ", out.sizes());
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == out.size(1) && bias->scalar_type() == x.scalar_type()
                        && bias->device().is_cpu()),
              "bias must be a contiguous [N] CPU tensor of x's dtype");
}

}  // namespace pagedllm

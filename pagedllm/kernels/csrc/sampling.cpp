// The sampler's kernels: each greedy row's token, the first index of its largest logit (torch.argmax's answer); and
// a random row's token drawn from softmax(logits / temperature) by inverse CDF, in one pass over the row.
//
// torch's CPU argmax is a scalar loop (~1.1 ms for [32, 49152] float32 rows), and the amax-then-argmax workaround
// it replaced took ~0.4 ms in a decode step of 32 rows, after the LM head's bf16 logits had been widened to float32
// for it. Here each chunk of a row takes a vectorised max, the first chunk holding the row's max is searched for
// its first index, and bf16 logits are read as they are (widening is exact, so the answer is the float32 one).
#include "ops.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace pagedllm {
namespace {

constexpr int64_t kChunk = 256;         // values whose max is taken at once, before the chunks are compared
constexpr int64_t kValuesGrain = 1 << 16;  // values a task: fewer rows than this run on the calling thread

// The first index of row x's largest value, or of its first NaN (torch counts NaN as the largest).
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_start = 0;
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t end = std::min(n, start + kChunk);
    float chunk_max = -std::numeric_limits<float>::infinity();
    int nan = 0;  // std::max drops a NaN
#pragma omp simd reduction(max : chunk_max) reduction(| : nan)
    for (int64_t i = start; i < end; ++i) {
      const float v = to_float(x[i]);
      chunk_max = std::max(chunk_max, v);
      nan |= std::isnan(v);
    }
    if (nan) {
      for (int64_t i = start;; ++i) {
        if (std::isnan(to_float(x[i]))) return i;
      }
    }
    if (chunk_max > best) best = chunk_max, best_start = start;  // a later chunk only where strictly larger
  }
  for (int64_t i = best_start;; ++i) {  // (a row of -inf: its first index)
    if (to_float(x[i]) == best) return i;
  }
}

void check_rows(const char* name, const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1, name,
              ": x must be [N, V] on the CPU with V > 0 and unit stride along V, got ", x.sizes(), " with strides ",
              x.strides());
}

// out [N] int64 = pick(row r, V, r, scratch) for each row of x [N, V] (check_rows'), float32, bf16 or float16, rows
// split between the threads, each with its own Scratch.
template <typename Scratch, typename Pick>
at::Tensor for_each_row(const char* name, const at::Tensor& x, const Pick& pick) {
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* result = out.data_ptr<int64_t>();
  const auto run = [&](const auto* data) {
    at::parallel_for(0, rows, std::max<int64_t>(1, kValuesGrain / n), [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t r = begin; r < end; ++r) result[r] = pick(data + r * stride, n, r, scratch);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(x.data_ptr<float>()); break;
    case at::kBFloat16: run(x.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: run(x.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, name, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
  return out;
}

struct NoScratch {};

// The first index at which row x's cumulative exp((x - max) / temperature) passes u times its total: the token
// pagedllm.sample.ops.inverse_cdf_sample draws from the row's softmax with the uniform u, summed in chunks instead
// of torch's cumsum (their sums agree to float rounding, so a draw can differ only where u falls within that of a
// boundary). Tokens at -inf (filtered, masked) have exp 0 and are never drawn.
// A thread's buffers for sample_row, kept from row to row: each value's exp, each chunk's sum.
struct DrawScratch {
  std::vector<float> e, chunk_sums;
};

template <typename T>
int64_t sample_row(const T* x, int64_t n, float temperature, float u, DrawScratch& scratch) {
  float most = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : most)
  for (int64_t i = 0; i < n; ++i) most = std::max(most, to_float(x[i]));
  const float inv_t = 1.f / temperature;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<float>& e = scratch.e;
  std::vector<float>& chunk_sums = scratch.chunk_sums;
  e.resize(n);
  chunk_sums.resize(chunks);
  float total = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) {
      e[i] = exp_approx((to_float(x[i]) - most) * inv_t);
      sum += e[i];
    }
    chunk_sums[c] = sum;
    total += sum;
  }
  const float target = u * total;
  float before = 0.f;  // the cumulative sum before chunk c, in total's order
  for (int64_t c = 0; c < chunks; ++c) {
    if (before + chunk_sums[c] <= target && c + 1 < chunks) {
      before += chunk_sums[c];
      continue;
    }
    int64_t last = -1;  // the chunk's last token of non-zero weight, where rounding leaves the scan short
    for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) {
      if (e[i] > 0.f) last = i, before += e[i];
      if (before > target && e[i] > 0.f) return i;
    }
    if (last >= 0) return last;
  }
  return n - 1;  // a row of NaN: inverse_cdf_sample's clamp
}

}  // namespace

at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& temperature, const at::Tensor& uniform) {
  check_rows("sample_rows", x);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && uniform.scalar_type() == at::kFloat
                  && temperature.is_contiguous() && uniform.is_contiguous() && temperature.numel() == x.size(0)
                  && uniform.numel() == x.size(0),
              "sample_rows: temperature and uniform must be contiguous float32 [N] for x's N rows");
  const float* t = temperature.data_ptr<float>();
  const float* u = uniform.data_ptr<float>();
  return for_each_row<DrawScratch>("sample_rows", x,
                                   [&](const auto* row, int64_t n, int64_t r, DrawScratch& scratch) {
                                     return sample_row(row, n, t[r], u[r], scratch);
                                   });
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows("argmax_rows", x);
  return for_each_row<NoScratch>("argmax_rows", x,
                                 [](const auto* row, int64_t n, int64_t, NoScratch&) { return argmax_row(row, n); });
}

}  // namespace pagedllm

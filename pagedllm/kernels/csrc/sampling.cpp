// The sampler's kernels: each greedy row's token, the first index of its largest logit (torch.argmax's answer); a
// random row's token drawn from softmax(logits / temperature), after its top-k, top-p and min-p, by inverse CDF; a
// row's raw logprobs (its token's, with its rank, and its top ones); a structured-output row's bitmask; and the
// repetition, frequency and presence penalties.
//
// torch's CPU argmax is a scalar loop (~1.1 ms for [32, 49152] float32 rows), and the amax-then-argmax workaround
// it replaced took ~0.4 ms in a decode step of 32 rows, after the LM head's bf16 logits had been widened to float32
// for it. Here each chunk of a row takes a vectorised max, the first chunk holding the row's max is searched for
// its first index, and bf16 logits are read as they are (widening is exact, so the answer is the float32 one).
//
// A draw weighs each token exp((x - max) / temperature) in one vectorised pass. Its filters come down to one least
// weight a token must have (ties kept together): found among the few tokens that can reach it (a bound from the
// chunks' maxima or from p rules out the rest), top-p sorting only the bucket of weights where its sum crosses p.
// torch's top-p sorted the whole vocabulary or took a top-1024 (~16 ms for 32 rows of SmolLM2's 49,152 logits).
// A speculative draft's verdict weighs and filters its row the same way, then takes the draft's share and draws from
// the rest (torch's [R, V] probabilities, one-hot for greedy rows, took ~45 ms for 32 requests' 3 drafts a step).
//
// The logprobs take a row's logsumexp and its token's rank in two vectorised passes, and its top values from the
// chunks whose maximum reaches the num-th largest chunk maximum (torch's log_softmax, comparison and topk: ~10 ms for
// 32 rows).
//
// A structured-output row's bitmask sets the tokens it refuses to -inf straight from its bits (torch's path unpacked
// them into an [R, V] bool tensor and masked a copy of the rows: ~6.5 ms for 32 rows).
//
// The penalties visit each row's own prompt and output ids, where torch's ops took five passes over [N, V] and two
// [N, V] tables built a step (~11 ms a decode step of 32 rows).
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <tuple>
#include <utility>
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

// check_rows' for logits changed in place, which must be float32.
void check_float_rows(const char* name, const at::Tensor& logits) {
  check_rows(name, logits);
  TORCH_CHECK(logits.scalar_type() == at::kFloat, name, ": logits must be float32, got ", logits.scalar_type());
}

// visit(row r's V values, V, r, scratch) for each row of x [N, V] (check_rows'), float32, bf16 or float16, rows
// split between the threads, each with its own Scratch.
template <typename Scratch, typename Visit>
void for_each_row(const char* name, const at::Tensor& x, const Visit& visit) {
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  const auto run = [&](const auto* data) {
    at::parallel_for(0, rows, std::max<int64_t>(1, kValuesGrain / n), [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t r = begin; r < end; ++r) visit(data + r * stride, n, r, scratch);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(x.data_ptr<float>()); break;
    case at::kBFloat16: run(x.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: run(x.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, name, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

// out [N] int64 = pick(row r, V, r, scratch) for each row of x, as for_each_row visits them.
template <typename Scratch, typename Pick>
at::Tensor pick_rows(const char* name, const at::Tensor& x, const Pick& pick) {
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  int64_t* result = out.data_ptr<int64_t>();
  for_each_row<Scratch>(name, x, [&](const auto* row, int64_t n, int64_t r, Scratch& scratch) {
    result[r] = pick(row, n, r, scratch);
  });
  return out;
}

// Each 256-value chunk's largest of row x, into `maxima`; returns the row's largest. (NaN: dropped.)
template <typename T>
float chunk_maxima(const T* x, int64_t n, std::vector<float>& maxima) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  maxima.resize(chunks);
  float most = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < chunks; ++c) {
    float largest = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : largest)
    for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) largest = std::max(largest, to_float(x[i]));
    maxima[c] = largest;
    most = std::max(most, largest);
  }
  return most;
}

// The k-th largest of `values` (k >= 1), found in `work`, a copy.
float kth_largest(const std::vector<float>& values, int64_t k, std::vector<float>& work) {
  work = values;
  std::nth_element(work.begin(), work.begin() + (k - 1), work.end(), std::greater<float>());
  return work[k - 1];
}

struct NoScratch {};

// A row's filters, each off at its neutral value: top-k (k >= V), top-p (p >= 1), min-p (min_p <= 0).
struct Filters {
  int64_t k;
  float p, min_p;
};

// A thread's buffers for sample_row, kept from row to row: each token's weight exp((x - max) / temperature), each
// chunk's sum and largest logit (then weight), the weights a filter may keep, and those of one bucket of them.
struct DrawScratch {
  std::vector<float> e, chunk_sums, chunk_max, candidates, bucket;
};

// Top-p's buckets of weights: 8 a halving of the weight, from 1 (the row's largest) down to 2^-32; the lighter ones
// share the last. A weight's bucket is read from its float's exponent and three leading mantissa bits.
constexpr int kBuckets = 256;

int bucket_of(float w) {
  int32_t bits;
  std::memcpy(&bits, &w, sizeof(bits));
  return static_cast<int>(std::min<int32_t>(kBuckets - 1, std::max<int32_t>(0, (0x3F800000 - bits) >> 20)));
}

// The least weight top-p keeps among `weights` (each > 0; every token of the row outside them is dropped whatever
// its rank): the lightest w whose heavier weights sum to less than target. Only the bucket where those sums cross
// target is sorted.
float top_p_threshold(const std::vector<float>& weights, float target, std::vector<float>& bucket) {
  std::array<float, kBuckets> mass{};
  float lightest = std::numeric_limits<float>::infinity();
  for (const float w : weights) mass[bucket_of(w)] += w, lightest = std::min(lightest, w);
  float heavier = 0.f;  // the weights of the buckets before b
  int b = 0;
  for (; b + 1 < kBuckets && heavier + mass[b] < target; ++b) heavier += mass[b];
  bucket.clear();
  for (const float w : weights) {
    if (bucket_of(w) == b) bucket.push_back(w);
  }
  std::sort(bucket.begin(), bucket.end(), std::greater<float>());
  float threshold = lightest;  // (every weight, where b is the last bucket and holds none)
  for (size_t i = 0; i < bucket.size() && heavier < target;) {  // equal weights: all kept or all dropped
    threshold = bucket[i];
    for (; i < bucket.size() && bucket[i] == threshold; ++i) heavier += bucket[i];
  }
  return threshold;
}

// The least weight a token keeps under the row's filters, as pagedllm.sample.ops.filtered_probs applies them:
// top-k (the k largest weights), then top-p of those (the fewest heaviest whose sum reaches p of theirs), then min-p
// (min_p of the largest weight, 1). Ties are kept together. e: the n weights, `total` their sum; the scratch's
// chunk_max: each chunk's largest weight.
float keep_threshold(const float* e, int64_t n, float total, const Filters& filters, DrawScratch& scratch) {
  const int64_t k = filters.k;
  const std::vector<float>& chunk_max = scratch.chunk_max;
  const int64_t chunks = static_cast<int64_t>(chunk_max.size());
  if (k >= n && filters.p >= 1.f) return filters.min_p;
  // A weight below which no token is kept, so that only the others are collected: the k-th largest chunk maximum
  // (k chunks hold a weight at least that); for top-p without top-k, (1 - p) total / n (all the tokens lighter than
  // that weigh less than 1 - p of the total, so each has p of it before it) or min-p's, the larger.
  float least = 0.f;
  if (k < n && k <= chunks) {
    least = kth_largest(chunk_max, k, scratch.bucket);
  } else if (k >= n) {
    least = std::max((1.f - filters.p) * total / static_cast<float>(n), filters.min_p);
  }
  std::vector<float>& candidates = scratch.candidates;
  candidates.clear();
  for (int64_t c = 0; c < chunks; ++c) {
    if (chunk_max[c] < least) continue;
    for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) {
      if (e[i] >= least && e[i] > 0.f) candidates.push_back(e[i]);
    }
  }
  float kept_k = 0.f, mass = total;
  if (k < n) {
    if (static_cast<int64_t>(candidates.size()) >= k) {  // (fewer: least is 0, every token is kept)
      std::nth_element(candidates.begin(), candidates.begin() + (k - 1), candidates.end(), std::greater<float>());
      kept_k = candidates[k - 1];
      candidates.erase(std::partition(candidates.begin() + k, candidates.end(),
                                      [&](float w) { return w >= kept_k; }),  // the k-th weight's ties
                       candidates.end());
    }
    mass = std::accumulate(candidates.begin(), candidates.end(), 0.f);
  }
  const float kept_p = filters.p < 1.f ? top_p_threshold(candidates, filters.p * mass, scratch.bucket) : 0.f;
  return std::max({kept_k, kept_p, filters.min_p});
}

// Each token's weight exp((x - max) / temperature) into the scratch's e, 0 where the filters drop it, with each
// chunk's sum into its chunk_sums; returns their total.
template <typename T>
float filtered_weights(const T* x, int64_t n, float temperature, const Filters& filters, DrawScratch& scratch) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<float>& e = scratch.e;
  std::vector<float>& chunk_sums = scratch.chunk_sums;
  std::vector<float>& chunk_max = scratch.chunk_max;
  e.resize(n);
  chunk_sums.resize(chunks);
  const float most = chunk_maxima(x, n, chunk_max);
  const float inv_t = 1.f / temperature;
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
  if (filters.k < n || filters.p < 1.f || filters.min_p > 0.f) {
    for (float& heaviest : chunk_max) heaviest = exp_approx((heaviest - most) * inv_t);  // its token's weight
    const float threshold = keep_threshold(e.data(), n, total, filters, scratch);
    total = 0.f;
    for (int64_t c = 0; c < chunks; ++c) {  // the dropped tokens' weights to 0
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) {
        e[i] = e[i] >= threshold ? e[i] : 0.f;
        sum += e[i];
      }
      chunk_sums[c] = sum;
      total += sum;
    }
  }
  return total;
}

// The first index at which the cumulative weight of the scratch's e (filtered_weights') passes target, summed chunk
// by chunk (n - 1 where it never does: a row of NaN, inverse_cdf_sample's clamp). Tokens of weight 0 are never drawn.
int64_t draw_weighted(const DrawScratch& scratch, int64_t n, float target) {
  const std::vector<float>& e = scratch.e;
  const std::vector<float>& chunk_sums = scratch.chunk_sums;
  const int64_t chunks = static_cast<int64_t>(chunk_sums.size());
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
  return n - 1;
}

// The token drawn from softmax(x / temperature), after the filters, with the uniform u: the first index at which
// the cumulative weight of the kept tokens passes u times their total, as pagedllm.sample.ops.inverse_cdf_sample
// draws from filtered_probs. The weights are summed in chunks instead of torch's cumsum (their sums agree to float
// rounding, so a draw can differ only where u falls within that of a boundary, or a filter's sum within that of
// p). Tokens at -inf (filtered, masked) have weight 0 and are never drawn.
template <typename T>
int64_t sample_row(const T* x, int64_t n, float temperature, float u, const Filters& filters,
                   DrawScratch& scratch) {
  const float total = filtered_weights(x, n, temperature, filters, scratch);
  return draw_weighted(scratch, n, u * total);
}

// A draft token's verdict against the distribution sample_row draws from, p: accepted where u_accept < p(draft),
// and the token to emit if the run stops here, drawn with u_draw from p without the draft (its residual), or from p
// itself where there is no draft (draft < 0, a bonus row), as pagedllm.sample.ops.rejection_sample decides on
// filtered_probs. A draft that held all of p has no residual: it is accepted, and stands as its own draw.
template <typename T>
std::pair<bool, int64_t> verify_row(const T* x, int64_t n, float temperature, float u_accept, float u_draw,
                                    int64_t draft, const Filters& filters, DrawScratch& scratch) {
  float total = filtered_weights(x, n, temperature, filters, scratch);
  if (draft < 0) return {false, draw_weighted(scratch, n, u_draw * total)};
  const float weight = scratch.e[draft];
  const bool accepted = u_accept < weight / total;
  if (weight <= 0.f) return {accepted, draw_weighted(scratch, n, u_draw * total)};
  scratch.e[draft] = 0.f;
  const int64_t c = draft / kChunk;
  float sum = 0.f;
  for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) sum += scratch.e[i];
  scratch.chunk_sums[c] = sum;
  total = std::accumulate(scratch.chunk_sums.begin(), scratch.chunk_sums.end(), 0.f);
  return {accepted, total > 0.f ? draw_weighted(scratch, n, u_draw * total) : draft};
}

// The sum of n floats, in one order whatever called it: a row's logsumexp is the same bits for bf16 logits as for
// their float32 widening (a sum inlined in each dtype's loop may be vectorised with other partial sums).
__attribute__((noinline)) float sum_of(const float* v, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += v[i];
  return sum;
}

// A thread's buffers for logprobs_row: each chunk's largest value, the values that may be among a row's largest
// (with their indices), and a copy to select in.
struct TopScratch {
  std::vector<float> chunk_max, work;
  std::vector<std::pair<float, int64_t>> top;
};

// Row x's log-softmax (its values less their logsumexp; the values themselves where !normalize) at `token` and at its
// `num` largest values (the largest first, equal ones by index), into ids[0..num] and values[0..num], the token
// first; and its rank, 1 + the number of larger values. The largest are collected where they can be: at least the
// num-th largest chunk maximum.
template <typename T>
void logprobs_row(const T* x, int64_t n, int64_t token, int64_t num, bool normalize, TopScratch& scratch,
                  int64_t* ids, float* values, int64_t* rank) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const float most = chunk_maxima(x, n, scratch.chunk_max);
  float sum = 0.f;
  float exps[kChunk];
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t count = std::min(kChunk, n - start);
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) exps[i] = exp_approx(to_float(x[start + i]) - most);
    sum += sum_of(exps, count);
  }
  const float lse = normalize ? most + std::log(sum) : 0.f;
  const float chosen = to_float(x[token]);
  int64_t larger = 0;
#pragma omp simd reduction(+ : larger)
  for (int64_t i = 0; i < n; ++i) larger += to_float(x[i]) > chosen ? 1 : 0;
  ids[0] = token, values[0] = chosen - lse, *rank = larger + 1;
  if (num == 0) return;
  const float least = num <= chunks ? kth_largest(scratch.chunk_max, num, scratch.work)
                                    : -std::numeric_limits<float>::infinity();
  auto& top = scratch.top;
  top.clear();
  for (int64_t c = 0; c < chunks; ++c) {
    if (scratch.chunk_max[c] < least) continue;
    for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) {
      if (to_float(x[i]) >= least) top.emplace_back(to_float(x[i]), i);
    }
  }
  const int64_t found = std::min<int64_t>(num, static_cast<int64_t>(top.size()));  // (fewer: a row of NaN)
  std::partial_sort(top.begin(), top.begin() + found, top.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  for (int64_t j = 0; j < num; ++j) {
    ids[1 + j] = j < found ? top[j].second : 0;
    values[1 + j] = j < found ? top[j].first - lse : std::numeric_limits<float>::quiet_NaN();
  }
}

// A per-row parameter's values: nullptr for none, else checked to be contiguous [rows] of `dtype` on the CPU (the
// error names op's `field`; joined only when the check fails).
template <typename T>
const T* row_values(const c10::optional<at::Tensor>& values, int64_t rows, at::ScalarType dtype, const char* op,
                    const char* field) {
  if (!values) return nullptr;
  TORCH_CHECK(values->scalar_type() == dtype && values->is_contiguous() && values->numel() == rows
                  && values->device().is_cpu(),
              op, ": ", field, " must be contiguous ", dtype, " [", rows, "] on the CPU, got ", values->scalar_type(),
              " ", values->sizes());
  return values->data_ptr<T>();
}

// A batch's top-k, top-p and min-p, each [rows] or left out (off for every row), checked once for op `name`.
struct BatchFilters {
  const int64_t* k;
  const float *p, *min_p;

  BatchFilters(const char* name, int64_t rows, const c10::optional<at::Tensor>& top_k,
               const c10::optional<at::Tensor>& top_p, const c10::optional<at::Tensor>& min_p_)
      : k(row_values<int64_t>(top_k, rows, at::kLong, name, "top_k")),
        p(row_values<float>(top_p, rows, at::kFloat, name, "top_p")),
        min_p(row_values<float>(min_p_, rows, at::kFloat, name, "min_p")) {}

  // Row r's filters over its n values.
  Filters row(int64_t r, int64_t n) const {
    return {k ? std::max<int64_t>(1, k[r]) : n, p ? p[r] : 1.f, min_p ? min_p[r] : 0.f};
  }
};

}  // namespace

at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& temperature, const at::Tensor& uniform,
                       const c10::optional<at::Tensor>& top_k, const c10::optional<at::Tensor>& top_p,
                       const c10::optional<at::Tensor>& min_p) {
  check_rows("sample_rows", x);
  const int64_t rows = x.size(0);
  const float* t = row_values<float>(temperature, rows, at::kFloat, "sample_rows", "temperature");
  const float* u = row_values<float>(uniform, rows, at::kFloat, "sample_rows", "uniform");
  const BatchFilters filters("sample_rows", rows, top_k, top_p, min_p);
  return pick_rows<DrawScratch>("sample_rows", x, [&](const auto* row, int64_t n, int64_t r, DrawScratch& scratch) {
    return sample_row(row, n, t[r], u[r], filters.row(r, n), scratch);
  });
}

std::tuple<at::Tensor, at::Tensor> verify_rows(const at::Tensor& x, const at::Tensor& temperature,
                                               const at::Tensor& uniform, const at::Tensor& draft_ids,
                                               const c10::optional<at::Tensor>& top_k,
                                               const c10::optional<at::Tensor>& top_p,
                                               const c10::optional<at::Tensor>& min_p) {
  check_rows("verify_rows", x);
  const int64_t rows = x.size(0);
  const float* t = row_values<float>(temperature, rows, at::kFloat, "verify_rows", "temperature");
  TORCH_CHECK(uniform.scalar_type() == at::kFloat && uniform.is_contiguous() && uniform.dim() == 2
                  && uniform.size(0) == rows && uniform.size(1) == 2 && uniform.device().is_cpu(),
              "verify_rows: uniform must be contiguous float32 [", rows, ", 2] on the CPU, got ",
              uniform.scalar_type(), " ", uniform.sizes());
  const float* u = uniform.data_ptr<float>();
  const int64_t* drafts = row_values<int64_t>(draft_ids, rows, at::kLong, "verify_rows", "draft_ids");
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(drafts[r] < x.size(1), "verify_rows: draft id ", drafts[r], " of row ", r, " is past the ",
                x.size(1), " tokens");
  }
  const BatchFilters filters("verify_rows", rows, top_k, top_p, min_p);
  at::Tensor accepted = at::empty({rows}, x.options().dtype(at::kBool));
  at::Tensor recovered = at::empty({rows}, x.options().dtype(at::kLong));
  bool* accepted_out = accepted.data_ptr<bool>();
  int64_t* recovered_out = recovered.data_ptr<int64_t>();
  for_each_row<DrawScratch>("verify_rows", x, [&](const auto* row, int64_t n, int64_t r, DrawScratch& scratch) {
    std::tie(accepted_out[r], recovered_out[r]) =
        verify_row(row, n, t[r], u[2 * r], u[2 * r + 1], drafts[r], filters.row(r, n), scratch);
  });
  return {accepted, recovered};
}

void apply_token_bitmask(at::Tensor logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  check_float_rows("apply_token_bitmask", logits);
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous()
                  && bitmask.device().is_cpu() && bitmask.size(0) == rows.numel(),
              "apply_token_bitmask: bitmask must be contiguous int32 [R, W] on the CPU, a row each of rows' R, got ",
              bitmask.scalar_type(), " ", bitmask.sizes());
  const int64_t n = logits.size(1), words = bitmask.size(1);
  const int64_t* row = row_values<int64_t>(rows, rows.numel(), at::kLong, "apply_token_bitmask", "rows");
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t covered = std::min(n, 32 * words);  // tokens past the mask's words are not allowed
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < logits.size(0), "apply_token_bitmask: row ", row[i], " is outside [0, ",
                logits.size(0), ")");
  }
  at::parallel_for(0, rows.numel(), std::max<int64_t>(1, kValuesGrain / n), [&](int64_t begin, int64_t end) {
    constexpr float kOff = -std::numeric_limits<float>::infinity();
    for (int64_t i = begin; i < end; ++i) {
      float* x = logits.data_ptr<float>() + row[i] * logits.stride(0);
      const uint32_t* mask = bits + i * words;
#pragma omp simd
      for (int64_t t = 0; t < covered; ++t) x[t] = (mask[t >> 5] >> (t & 31)) & 1u ? x[t] : kOff;
      for (int64_t t = covered; t < n; ++t) x[t] = kOff;
    }
  });
}

void apply_penalties(at::Tensor logits, const at::Tensor& prompt_ids, const at::Tensor& prompt_starts,
                     const at::Tensor& output_ids, const at::Tensor& output_starts, const at::Tensor& repetition,
                     const at::Tensor& frequency, const at::Tensor& presence) {
  check_float_rows("apply_penalties", logits);
  const int64_t rows = logits.size(0), n = logits.size(1);
  const int64_t* prompt =
      row_values<int64_t>(prompt_ids, prompt_ids.numel(), at::kLong, "apply_penalties", "prompt_ids");
  const int64_t* output =
      row_values<int64_t>(output_ids, output_ids.numel(), at::kLong, "apply_penalties", "output_ids");
  const int64_t* prompt_start =
      row_values<int64_t>(prompt_starts, rows + 1, at::kLong, "apply_penalties", "prompt_starts");
  const int64_t* output_start =
      row_values<int64_t>(output_starts, rows + 1, at::kLong, "apply_penalties", "output_starts");
  const float* r = row_values<float>(repetition, rows, at::kFloat, "apply_penalties", "repetition");
  const float* f = row_values<float>(frequency, rows, at::kFloat, "apply_penalties", "frequency");
  const float* p = row_values<float>(presence, rows, at::kFloat, "apply_penalties", "presence");
  TORCH_CHECK(prompt_start[0] == 0 && output_start[0] == 0 && prompt_start[rows] == prompt_ids.numel()
                  && output_start[rows] == output_ids.numel(),
              "apply_penalties: the starts must run from 0 to the number of ids");
  std::vector<int32_t> count(n, 0);  // a row's times each token was generated; -1: penalised already
  for (int64_t row = 0; row < rows; ++row) {
    float* x = logits.data_ptr<float>() + row * logits.stride(0);
    const int64_t* row_output = output + output_start[row];
    const int64_t* row_prompt = prompt + prompt_start[row];
    const int64_t outputs = output_start[row + 1] - output_start[row];
    const int64_t prompts = prompt_start[row + 1] - prompt_start[row];
    TORCH_CHECK(outputs >= 0 && prompts >= 0, "apply_penalties: the starts must not decrease");
    for (int64_t i = 0; i < outputs; ++i) {
      if (row_output[i] >= 0 && row_output[i] < n) ++count[row_output[i]];
    }
    // torch's order, so that each logit gets the same bits: repetition on every token seen, then frequency x
    // count and presence subtracted (a seen token never generated: minus 0 twice)
    const auto penalise = [&](int64_t token) {
      if (token < 0 || token >= n || count[token] < 0) return;
      const float times = static_cast<float>(count[token]);
      float value = x[token] > 0.f ? x[token] / r[row] : x[token] * r[row];
      value = value - f[row] * times;
      x[token] = value - p[row] * (times > 0.f ? 1.f : 0.f);
      count[token] = -1;
    };
    for (int64_t i = 0; i < outputs; ++i) penalise(row_output[i]);
    for (int64_t i = 0; i < prompts; ++i) penalise(row_prompt[i]);
    for (int64_t i = 0; i < outputs; ++i) {
      if (row_output[i] >= 0 && row_output[i] < n) count[row_output[i]] = 0;
    }
    for (int64_t i = 0; i < prompts; ++i) {
      if (row_prompt[i] >= 0 && row_prompt[i] < n) count[row_prompt[i]] = 0;
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> row_logprobs(const at::Tensor& x, const at::Tensor& token_ids,
                                                            int64_t num, bool normalize) {
  check_rows("row_logprobs", x);
  const int64_t rows = x.size(0), n = x.size(1);
  const int64_t* tokens = row_values<int64_t>(token_ids, rows, at::kLong, "row_logprobs", "token_ids");
  TORCH_CHECK(num >= 0 && num <= n, "row_logprobs: num must be in [0, V], got ", num);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(tokens[r] >= 0 && tokens[r] < n, "row_logprobs: token id ", tokens[r], " is outside [0, ", n, ")");
  }
  at::Tensor ids = at::empty({rows, 1 + num}, x.options().dtype(at::kLong));
  at::Tensor values = at::empty({rows, 1 + num}, x.options().dtype(at::kFloat));
  at::Tensor ranks = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* id = ids.data_ptr<int64_t>();
  float* value = values.data_ptr<float>();
  int64_t* rank = ranks.data_ptr<int64_t>();
  for_each_row<TopScratch>("row_logprobs", x, [&](const auto* row, int64_t v, int64_t r, TopScratch& scratch) {
    logprobs_row(row, v, tokens[r], num, normalize, scratch, id + r * (1 + num), value + r * (1 + num), rank + r);
  });
  return {ids, values, ranks};
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows("argmax_rows", x);
  return pick_rows<NoScratch>("argmax_rows", x,
                              [](const auto* row, int64_t n, int64_t, NoScratch&) { return argmax_row(row, n); });
}

}  // namespace pagedllm

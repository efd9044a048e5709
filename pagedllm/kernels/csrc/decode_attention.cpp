// Paged decode attention on the CPU: one query token per sequence, read straight from the block tables.
//
// The torch path gathers every sequence's K/V into a padded copy per layer and runs a masked SDPA; this kernel
// reads each key and value once, in place, for all the query heads that share it (GQA/MQA), and never
// touches padding. Parallel over (sequence, kv head).
//
//   q, out:            [num_seqs, num_heads, head_dim]
//   k_cache, v_cache:  [num_blocks, block_size, num_kv_heads, head_dim]   (any strides in the first three dims);
//                      int8: [..., head_dim + 4], each row dequantized as it is read (ops.h, load_row)
//   block_tables:      [num_seqs, max_blocks] int32
//   seq_lens:          [num_seqs] int32, context length including the query token
//
//   token t of sequence b lives at block_tables[b][t / block_size], offset t % block_size.
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <cmath>
#include <vector>

namespace pagedllm {
namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

#if defined(__AVX512BF16__)
// Scores of `num_keys` consecutive keys of one block against a kv head's query group, with AVX512-BF16 dot
// products: each _mm512_dpbf16_ps multiplies 32 bf16 pairs straight into 16 float lanes, with no widening.
// head_dim must be a multiple of 32.
inline void block_scores_bf16(const c10::BFloat16* key, int64_t key_stride, int64_t num_keys,
                              const c10::BFloat16* q, int64_t group, int64_t head_dim, float scale,
                              float* scores, int64_t len) {
  for (int64_t t = 0; t < num_keys; ++t, key += key_stride) {
    for (int64_t g = 0; g < group; ++g) {
      const c10::BFloat16* qg = q + g * head_dim;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 32) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(key + d);
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qg + d);
        acc = _mm512_dpbf16_ps(acc, qv, k);
      }
      scores[g * len + t] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}
#endif

// exp(s - max) in place over a row of scores; returns their sum.
inline float exp_and_sum(float* s, int64_t n) {
  float m = s[0];
  for (int64_t t = 1; t < n; ++t) m = std::max(m, s[t]);
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) s[t] = exp_approx(s[t] - m);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) sum += s[t];
  return sum;
}

// kHeadDim > 0 and kGroup > 0 fix the head size and the query heads per kv head at compile time, so every
// per-token loop unrolls into straight vector code and the output accumulators stay in registers; 0 takes the
// value from the tensors. cache_t is scalar_t, or int8_t for an int8 cache.
template <typename scalar_t, typename cache_t, int64_t kHeadDim, int64_t kGroup>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale) {
  const PagedCache<cache_t> cache(k_cache, v_cache, block_tables, seq_lens);
  const int64_t num_seqs = q.size(0), num_heads = q.size(1);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : q.size(2);
  const int64_t block_size = cache.block_size, num_kv_heads = cache.num_kv_heads;
  const int64_t group = kGroup > 0 ? kGroup : num_heads / num_kv_heads;
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    constexpr bool kFixed = kHeadDim > 0 && kGroup > 0;
    std::vector<float> qf(group * head_dim), row(head_dim), scores, acc_heap(kFixed ? 0 : group * head_dim);
    float acc_fixed[kFixed ? kGroup * kHeadDim : 1];
    float* acc = kFixed ? acc_fixed : acc_heap.data();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = cache.seq_lens[b];
      const int32_t* table = cache.table(b);
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g) {
        load_row(q_ptr + (b * num_heads + h * group + g) * head_dim, qf.data() + g * head_dim, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] *= static_cast<float>(scale);
      }
      // Scores: [group, len], walking the block table one block at a time.
      for (int64_t start = 0; start < len; start += block_size) {
        const cache_t* key = cache.key(table, start, h);
        const int64_t stop = std::min(len, start + block_size);
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
          if (head_dim % 32 == 0) {
            block_scores_bf16(key, cache.k_token, stop - start, q_ptr + (b * num_heads + h * group) * head_dim, group,
                              head_dim, static_cast<float>(scale), scores.data() + start, len);
            continue;
          }
        }
#endif
        for (int64_t t = start; t < stop; ++t, key += cache.k_token) {
          load_row(key, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            scores[g * len + t] = dot(qf.data() + g * head_dim, row.data(), head_dim);
          }
        }
      }
      std::vector<float> inv_sum(group);
      for (int64_t g = 0; g < group; ++g) inv_sum[g] = 1.f / exp_and_sum(scores.data() + g * len, len);
      // Weighted sum of values.
      std::fill(acc, acc + group * head_dim, 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const cache_t* value = cache.value(table, start, h);
        const int64_t stop = std::min(len, start + block_size);
        for (int64_t t = start; t < stop; ++t, value += cache.v_token) {
          load_row(value, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * len + t];
            float* a = acc + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* o = out_ptr + (b * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(acc[g * head_dim + d] * inv_sum[g]);
      }
    }
  });
}

// The group sizes of common GQA models (MHA = 1, SmolLM2 = 3, Llama 3 and Mistral = 4, TinyLlama = 8, ...).
template <typename scalar_t, typename cache_t, int64_t kHeadDim>
void dispatch_group(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                    double scale) {
#define PAGEDLLM_GROUP(G) \
  case G: return decode_attention_impl<scalar_t, cache_t, kHeadDim, G>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
  switch (q.size(1) / k_cache.size(2)) {
    PAGEDLLM_GROUP(1) PAGEDLLM_GROUP(2) PAGEDLLM_GROUP(3) PAGEDLLM_GROUP(4)
    PAGEDLLM_GROUP(6) PAGEDLLM_GROUP(7) PAGEDLLM_GROUP(8)
    default: return decode_attention_impl<scalar_t, cache_t, kHeadDim, 0>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
  }
#undef PAGEDLLM_GROUP
}

}  // namespace

void decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                      at::Tensor block_tables, at::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "q and out must be contiguous");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "the head dim of the caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "block_tables and seq_lens must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    dispatch_cache<scalar_t>(q, k_cache, v_cache, [&]<typename cache_t>() {
      switch (q.size(2)) {
        case 64: return dispatch_group<scalar_t, cache_t, 64>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
        case 128:
          return dispatch_group<scalar_t, cache_t, 128>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
        default:
          return decode_attention_impl<scalar_t, cache_t, 0, 0>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                                                scale);
      }
    });
  });
}

}  // namespace pagedllm

// Writing a step's new K and V into the paged cache, in one pass per layer: each token's rows go to its slot
// (slot = block * block_size + offset, pagedllm.attention.torch_ref's diagram), copied into a float cache of
// their own dtype or quantized into an int8 cache's rows. torch_ref.write_kv (two index_copy_ calls, and a dozen
// ops per tensor to quantize) is the reference; the bits are the same.
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

namespace pagedllm {
namespace {

constexpr int64_t kTokenGrain = 128;  // tokens per task: a decode step's few rows stay on the calling thread

template <typename scalar_t>
inline void store_row(const scalar_t* x, scalar_t* dst, int64_t n) {
  std::memcpy(dst, x, n * sizeof(scalar_t));
}

// An int8 cache row: q[n] then the float32 scale s = max|x| / 127, q = x / s rounded to nearest even and clamped
// to +-127 (an all-zero row divides by 1), torch_ref.quantize_kv's arithmetic. Rounding adds and takes away
// 1.5 x 2^23 (exact here, |x / s| <= 127), as exp_approx does: std::nearbyint would stay scalar on AVX2.
template <typename scalar_t>
inline void store_row(const scalar_t* x, int8_t* dst, int64_t n) {
  float absmax = 0.f;
#pragma omp simd reduction(max : absmax)
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::fabs(to_float(x[i])));
  const float scale = absmax / 127.f;
  const float divisor = scale > 0.f ? scale : 1.f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float q = round_half_even(to_float(x[i]) / divisor);
    dst[i] = static_cast<int8_t>(std::min(std::max(q, -127.f), 127.f));
  }
  std::memcpy(dst + n, &scale, sizeof(scale));
}

template <typename scalar_t, typename cache_t>
void write_kv_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                   const at::Tensor& slot_mapping) {
  const int64_t tokens = key.size(0), heads = key.size(1), head_dim = key.size(2), block_size = k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const scalar_t* k_src = key.data_ptr<scalar_t>();
  const scalar_t* v_src = value.data_ptr<scalar_t>();
  cache_t* k_dst = k_cache.data_ptr<cache_t>();
  cache_t* v_dst = v_cache.data_ptr<cache_t>();
  at::parallel_for(0, tokens, kTokenGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        store_row(k_src + t * key.stride(0) + h * key.stride(1),
                  k_dst + block * k_cache.stride(0) + offset * k_cache.stride(1) + h * k_cache.stride(2), head_dim);
        store_row(v_src + t * value.stride(0) + h * value.stride(1),
                  v_dst + block * v_cache.stride(0) + offset * v_cache.stride(1) + h * v_cache.stride(2), head_dim);
      }
    }
  });
}

}  // namespace

void write_kv(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && value.scalar_type() == key.scalar_type(),
              "key and value must be [num_tokens, num_kv_heads, head_dim] of one dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "the head dim of key, value and the caches must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == key.size(1),
              "the caches must be [num_blocks, block_size, num_kv_heads, head_dim] alike, with key's heads");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "slot_mapping must be contiguous int64, one slot per token");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " is outside the cache's ", num_slots);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "write_kv", [&] {
    dispatch_cache<scalar_t>(key, k_cache, v_cache, [&]<typename cache_t>() {
      write_kv_impl<scalar_t, cache_t>(key, value, k_cache, v_cache, slot_mapping);
    });
  });
}

}  // namespace pagedllm

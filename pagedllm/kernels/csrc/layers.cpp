// The per-token layers of a decoder, one pass over memory each: RMSNorm (with the residual add fused in),
// SiLU-and-mul and GELU-and-mul, rotary embedding (in place, on the step's fresh q and k); and a BERT encoder's
// LayerNorm (the residual add fused in).
//
// In torch each of these is five to fifteen separate ops (casts, a pow, a mean, an rsqrt, multiplies, a cat),
// each a pass over the activations and ~5 us of dispatch: 30 layers of them cost a decode step more than its
// attention. These loops do the same arithmetic and round to the storage type exactly where torch does, so in
// float32 they match the torch layers (`forward_native`) to float rounding, and in bfloat16 nearly bit for bit.
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <utility>
#include <vector>

namespace pagedllm {
namespace {

// Rows per task: below this a batch runs on the calling thread (a few rows are cheaper than a fork; a decode batch
// of 50 rows splits, its RMSNorm 27 -> 21 us).
constexpr int64_t kRowGrain = 16;

template <typename scalar_t>
void norm_row(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t n, float eps) {
  float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    sum_sq += v * v;
  }
  const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
  // torch: weight * (x32 * rsqrt(var + eps)).to(dtype)
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<scalar_t>(to_float(w[i]) * round_to<scalar_t>(to_float(x[i]) * inv_rms));
}

template <typename scalar_t>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, float eps) {
  const int64_t rows = x.size(0), n = x.size(1), x_stride = x.stride(0), out_stride = out.stride(0);
  const scalar_t* x_ptr = x.data_ptr<scalar_t>();
  const scalar_t* w = weight.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(x_ptr + r * x_stride, w, out_ptr + r * out_stride, n, eps);
  });
}

template <typename scalar_t>
void fused_add_rms_norm_impl(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& x,
                             const at::Tensor& residual, const at::Tensor& weight, float eps) {
  const int64_t rows = x.size(0), n = x.size(1), x_stride = x.stride(0), r_stride = residual.stride(0);
  const int64_t out_stride = out.stride(0), sum_stride = residual_out.stride(0);
  const scalar_t* x_ptr = x.data_ptr<scalar_t>();
  const scalar_t* r_ptr = residual.data_ptr<scalar_t>();
  const scalar_t* w = weight.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  scalar_t* sum_ptr = residual_out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x_ptr + r * x_stride;
      const scalar_t* rr = r_ptr + r * r_stride;
      scalar_t* sum = sum_ptr + r * sum_stride;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) sum[i] = from_float<scalar_t>(to_float(xr[i]) + to_float(rr[i]));
      norm_row(sum, w, out_ptr + r * out_stride, n, eps);
    }
  });
}

// One row of out = act(x[:, :d]) * x[:, d:], `times` one value's act(gate) * up.
template <typename scalar_t, float (*times)(float, float)>
void gated_mul_row(scalar_t* o, const scalar_t* gate, int64_t d) {
  const scalar_t* up = gate + d;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) o[i] = from_float<scalar_t>(times(to_float(gate[i]), to_float(up[i])));
}

template <typename scalar_t, float (*times)(float, float)>
void gated_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), d = out.size(1), x_stride = x.stride(0), out_stride = out.stride(0);
  const scalar_t* x_ptr = x.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      gated_mul_row<scalar_t, times>(out_ptr + r * out_stride, x_ptr + r * x_stride, d);
    }
  });
}

// One row of LayerNorm(x + residual): the sum rounded to the storage type (torch adds before it normalises), its
// mean and variance in float (two passes over the row, kept in float), then (v - mean) * rstd * w + b, rounded once.
template <typename scalar_t>
void add_layer_norm_row(const scalar_t* x, const scalar_t* residual, const scalar_t* w, const scalar_t* b,
                        scalar_t* out, float* v, int64_t n, float eps) {
  float sum = 0.f;
  if (residual == nullptr) {
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += v[i] = to_float(x[i]);
  } else {
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += v[i] = round_to<scalar_t>(to_float(x[i]) + to_float(residual[i]));
  }
  const float mean = sum / static_cast<float>(n);
  float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t i = 0; i < n; ++i) sum_sq += (v[i] - mean) * (v[i] - mean);
  const float rstd = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<scalar_t>((v[i] - mean) * rstd * to_float(w[i]) + to_float(b[i]));
}

template <typename scalar_t>
void add_layer_norm_impl(at::Tensor& out, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                         const at::Tensor& weight, const at::Tensor& bias, float eps) {
  const int64_t rows = x.size(0), n = x.size(1), x_stride = x.stride(0), out_stride = out.stride(0);
  const int64_t r_stride = residual ? residual->stride(0) : 0;
  const scalar_t* x_ptr = x.data_ptr<scalar_t>();
  const scalar_t* r_ptr = residual ? residual->data_ptr<scalar_t>() : nullptr;
  const scalar_t* w = weight.data_ptr<scalar_t>();
  const scalar_t* b = bias.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> v(n);
    for (int64_t r = begin; r < end; ++r) {
      add_layer_norm_row(x_ptr + r * x_stride, r_ptr ? r_ptr + r * r_stride : nullptr, w, b,
                         out_ptr + r * out_stride, v.data(), n, eps);
    }
  });
}

// Neox-style rotation of one head in place: x = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).
// cos and sin are the position's cached rows ([head_dim], both halves equal), already rounded to the storage type.
template <typename scalar_t>
inline void rotate_head(scalar_t* x, const float* cos, const float* sin, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    x[i] = from_float<scalar_t>(round_to<scalar_t>(x1 * cos[i]) - round_to<scalar_t>(x2 * sin[i]));
    x[i + half] = from_float<scalar_t>(round_to<scalar_t>(x2 * cos[i + half]) + round_to<scalar_t>(x1 * sin[i + half]));
  }
}

template <typename scalar_t>
void rotary_embedding_impl(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos_cache,
                           const at::Tensor& sin_cache) {
  // head_dim: the values turned, each head's first (all of them, or Phi-4-mini's 3/4)
  const int64_t tokens = q.size(0), q_heads = q.size(1), k_heads = k.size(1), head_dim = cos_cache.size(1);
  const int64_t half = head_dim / 2;
  const int64_t q_tok = q.stride(0), q_head = q.stride(1), k_tok = k.stride(0), k_head = k.stride(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cos_ptr = cos_cache.data_ptr<float>();
  const float* sin_ptr = sin_cache.data_ptr<float>();
  scalar_t* q_ptr = q.data_ptr<scalar_t>();
  scalar_t* k_ptr = k.data_ptr<scalar_t>();
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> cos(head_dim), sin(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_ptr + pos[t] * head_dim;
      const float* s = sin_ptr + pos[t] * head_dim;
      for (int64_t i = 0; i < head_dim; ++i) {  // torch casts the float32 tables to the activations' dtype
        cos[i] = round_to<scalar_t>(c[i]);
        sin[i] = round_to<scalar_t>(s[i]);
      }
      for (int64_t h = 0; h < q_heads; ++h) rotate_head(q_ptr + t * q_tok + h * q_head, cos.data(), sin.data(), half);
      for (int64_t h = 0; h < k_heads; ++h) rotate_head(k_ptr + t * k_tok + h * k_head, cos.data(), sin.data(), half);
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

}  // namespace

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && out.sizes() == x.sizes(), "shape mismatch");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && x.scalar_type() == out.scalar_type(), "dtype mismatch");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(out, x, weight, static_cast<float>(eps));
  });
}

void fused_add_rms_norm(at::Tensor out, at::Tensor residual_out, at::Tensor x, at::Tensor residual,
                        at::Tensor weight, double eps) {
  for (const auto& [t, name] : {std::pair{&out, "out"}, {&residual_out, "residual_out"}, {&x, "x"},
                                {&residual, "residual"}}) {
    check_rows(*t, name);
    TORCH_CHECK(t->sizes() == x.sizes() && t->scalar_type() == x.scalar_type(), name, ": shape or dtype mismatch");
  }
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [H] of x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    fused_add_rms_norm_impl<scalar_t>(out, residual_out, x, residual, weight, static_cast<float>(eps));
  });
}

namespace {

void check_gated(const at::Tensor& out, const at::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.size(0) == out.size(0) && x.size(1) == 2 * out.size(1), "x must be [T, 2d] and out [T, d]");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "dtype mismatch");
}

}  // namespace

void silu_and_mul(at::Tensor out, at::Tensor x) {
  check_gated(out, x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    gated_mul_impl<scalar_t, silu_times<scalar_t>>(out, x);
  });
}

template <typename T>
void silu_and_mul_rows(T* out, const T* x, int64_t rows, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) gated_mul_row<T, silu_times<T>>(out + r * d, x + r * 2 * d, d);
}
template void silu_and_mul_rows<float>(float*, const float*, int64_t, int64_t);
template void silu_and_mul_rows<c10::BFloat16>(c10::BFloat16*, const c10::BFloat16*, int64_t, int64_t);

void gelu_and_mul(at::Tensor out, at::Tensor x) {
  check_gated(out, x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gelu_and_mul", [&] {
    gated_mul_impl<scalar_t, gelu_tanh_times<scalar_t>>(out, x);
  });
}

void add_layer_norm(at::Tensor out, at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight,
                    at::Tensor bias, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && x.scalar_type() == out.scalar_type(), "out must be x's shape and dtype");
  if (residual) {
    TORCH_CHECK(residual->dim() == 2 && residual->stride(1) == 1 && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type(),
                "residual must be x's shape and dtype, with contiguous rows");
  }
  for (const auto& [t, name] : {std::pair{&weight, "weight"}, {&bias, "bias"}}) {
    TORCH_CHECK(t->is_contiguous() && t->numel() == x.size(1) && t->scalar_type() == x.scalar_type(), name,
                " must be a contiguous [H] of x's dtype");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_layer_norm", [&] {
    add_layer_norm_impl<scalar_t>(out, x, residual, weight, bias, static_cast<float>(eps));
  });
}

void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos_cache, at::Tensor sin_cache) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1,
              "q and k must be [T, heads, head_dim] with contiguous heads");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(2) % 2 == 0 && q.size(0) == k.size(0), "q/k shape mismatch");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k must share a dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0),
              "positions must be a contiguous int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_cache.size(0), "position ", pos[t], " is outside the rotary cache");
  }
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat &&
                  cos_cache.is_contiguous() && sin_cache.is_contiguous() && cos_cache.size(1) <= q.size(2) &&
                  cos_cache.size(1) % 2 == 0 && sin_cache.sizes() == cos_cache.sizes(),
              "cos/sin caches must be contiguous float32 [max_position, rotary_dim], rotary_dim even and at most "
              "head_dim");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_embedding", [&] {
    rotary_embedding_impl<scalar_t>(positions, q, k, cos_cache, sin_cache);
  });
}

}  // namespace pagedllm

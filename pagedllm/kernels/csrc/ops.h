// pagedllm's CPU kernels: the declarations bindings.cpp exposes, and the scalar helpers they share.
//
// Every kernel has a plain torch reference in the Python layer that calls it (the `forward_native` of the layer,
// or pagedllm.attention.torch_ref), and a test comparing the two in float32, bfloat16 and float16.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace pagedllm {

// Attention (attention.cpp).
void decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                      at::Tensor seq_lens, double scale);

// Layers (layers.cpp).
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor out, at::Tensor residual_out, at::Tensor x, at::Tensor residual,
                        at::Tensor weight, double eps);
void silu_and_mul(at::Tensor out, at::Tensor x);
void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos_cache, at::Tensor sin_cache);

// float <-> storage type. bf16 is the top half of a float: widening is a shift, narrowing rounds to nearest
// even as torch does, so a kernel that rounds where torch rounds gives torch's bits. Written on the raw bits so
// that the compiler vectorises loops over them.
inline float to_float(c10::BFloat16 x) {
  const uint32_t wide = static_cast<uint32_t>(x.x) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(float x) { return x; }

template <typename scalar_t>
inline scalar_t from_float(float x) {
  return static_cast<scalar_t>(x);
}
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;  // keep NaN a NaN (rounding could carry it to inf)
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>(nan ? 0x7FC0u : rounded);
  return out;
}

// Round a float to the storage type and back: where torch would store an intermediate result.
template <typename scalar_t>
inline float round_to(float x) {
  return to_float(from_float<scalar_t>(x));
}

}  // namespace pagedllm

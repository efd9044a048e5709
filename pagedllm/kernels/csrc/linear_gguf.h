// The packed layout of GGUF's blocks that linear_gguf.cpp (integer arithmetic) and linear_gguf_amx.cpp (bf16 in AMX
// tiles) read; pagedllm.layers.gguf.pack_gguf_weight writes it (linear_gguf.cpp describes it).
#pragma once

#include "linear_common.h"

#include <vector>

namespace pagedllm {

enum GgufType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kMXFP4 = 39 };  // ggml's type numbers
constexpr int64_t kGroupK = 32;    // k's per group: one d (and m) per column, one x scale per row
constexpr int64_t kRowBytes = 64;  // one row of a group's values: 16 lanes of 4 bytes

// MXFP4 (gpt-oss's experts) runs as a 4-bit type whose nibble n stands for kMxfp4Values[n] = 12 + 2 e2m1(n), 0..24
// (llama.cpp's kvalues_mxfp4, doubled e2m1 values, plus 12), with d = 2^(e - 128) (half its block's power of two)
// and m = -12 d: W = d (value - 12) = 2^(e - 127) e2m1(n), exactly. The kernels look each nibble up (a byte shuffle,
// or a lane permute) where Q4_0 takes it as it is.
constexpr uint8_t kMxfp4Values[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
inline bool is_gguf_type(int64_t type) {
  return type == kQ4_0 || type == kQ4_1 || type == kQ8_0 || type == kMXFP4;
}
// A 4-bit type's m per d where it stores none: Q4_0's -8, MXFP4's -12 (unused for Q4_1 and Q8_0).
constexpr float min_per_d(int64_t type) { return type == kMXFP4 ? -12.f : -8.f; }

constexpr int64_t header_bytes(int64_t type) { return (type == kQ4_1 ? 2 : 1) * kBlock * int64_t{sizeof(float)}; }
constexpr int64_t group_bytes(int64_t type) {
  return header_bytes(type) + kGroupK * kBlock / (type == kQ8_0 ? 1 : 2);
}

// The checks of a packed GGUF weight and the tensors a call reads and writes, shared by the calls on it.
inline void check_gguf_packed(const at::Tensor& x, const at::Tensor& out, const at::Tensor& packed, int64_t type) {
  TORCH_CHECK(is_gguf_type(type), "ggml_type must be Q4_0 (2), Q4_1 (3), Q8_0 (8) or MXFP4 (39), got ", type);
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu() && packed.device().is_cpu(), "tensors must be on the CPU");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous()
                  && packed.size(2) == group_bytes(type),
              "packed must come from pack_gguf_weight: a contiguous uint8 [ceil(N/16), K/32, ", group_bytes(type),
              "] for this type, got ", packed.sizes());
}

// The buffers a call quantizes x into: one thread's own, for linear_gguf_on_thread's calls.
struct GgufScratch {
  std::vector<uint8_t> quantized_x;
  std::vector<float> scale, scaled_sum, v;
};

// linear_gguf's bits in its integer arithmetic (activation_bits 16 or 8) for x [m, k] (contiguous) into out [m, n]
// (rows `out_stride` apart), no bias, all on the calling thread: a mixture of experts' units (moe.cpp), without a
// tensor or a fork a call. T: float or bf16.
template <typename T>
void linear_gguf_on_thread(T* out, int64_t out_stride, int64_t n, const T* x, int64_t m, int64_t k,
                           const uint8_t* packed, int64_t ggml_type, int64_t activation_bits, GgufScratch& scratch);

// out = x W^T + bias with x rounded to bf16 and W's blocks dequantised to bf16 (d q + m, rounded once), in AMX-BF16
// tiles or AVX512-BF16 vectors (linear_gguf_bf16.cpp); the operands checked by linear_gguf, which calls it for
// activation_bits = 0.
void linear_gguf_bf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t ggml_type,
                      const c10::optional<at::Tensor>& bias);

}  // namespace pagedllm

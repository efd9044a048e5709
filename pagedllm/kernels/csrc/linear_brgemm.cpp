// bf16 weights in oneDNN's brgemm blocks, multiplied by bf16 rows through torch's at::native::cpublas::brgemm (the
// micro-kernel oneDNN builds its GEMMs from: AMX tiles, or AVX512-BF16 dot products), where torch has it
// (`brgemm_bf16_available`).
//
// A weight [N, K] is stored as ceil(N / 64) blocks of 64 columns, each [K / 2, 64, 2] (k pairs, brgemm's VNNI
// layout), one contiguous run of K x 64 values a block, the last block zero-padded. A call takes the blocks in
// turns (`parallel_units`), a row tile of x over each, so a block is read once from memory and streamed in order;
// with more rows, panels of blocks that stay in L2 while the row tiles pass. Against oneDNN's linear on a mixture of
// experts' 1024 x 768 weights on the AMX Xeon, one thread: 11.7 against 8.7 GB/s at a row, 437 against 496 us at
// 256 rows; on a dense model's, 1.1-1.5x oneDNN's rate at 1-64 rows (SmolLM2's small weights the most), 0.8-1.0x at
// 2,048 (blocks of 64 columns: of 32, no faster). pagedllm packs bf16 weights
// so where the CPU has AMX (`bf16_kernel`), and a mixture of experts' experts wherever torch packs bf16 for brgemm
// (`small_calls`), whose small calls on one thread each read their weights at the memory's speed.
#include "linear_common.h"

#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <vector>

namespace pagedllm {
namespace {

constexpr int64_t kColumns = 64;  // a block's columns
constexpr int64_t kRows = 64;     // x's rows a brgemm call multiplies
static_assert(kBrgemmAccFloats == kRows * kColumns);

// x's `rows` rows (at most kRows) times the weight's column block `block` into out's columns of that block, each sum
// (+ bias) rounded once to bf16, as from_float rounds: the unit of work of linear_brgemm and of
// linear_brgemm_on_thread.
void brgemm_tile(c10::BFloat16* out, int64_t out_stride, int64_t n, const c10::BFloat16* x, int64_t x_stride,
                 int64_t rows, int64_t k, const c10::BFloat16* packed, int64_t block, const c10::BFloat16* bias,
                 float* acc) {
  const int64_t n0 = block * kColumns, columns = std::min(kColumns, n - n0);
  at::native::cpublas::brgemm(rows, kColumns, k, x_stride, kColumns, kColumns, false, x, packed + block * k * kColumns,
                              acc);
  for (int64_t r = 0; r < rows; ++r) {
    const float* sums = acc + r * kColumns;
    c10::BFloat16* dst = out + r * out_stride + n0;
    if (bias) {
#pragma omp simd
      for (int64_t j = 0; j < columns; ++j) dst[j] = from_float<c10::BFloat16>(sums[j] + to_float(bias[n0 + j]));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < columns; ++j) dst[j] = from_float<c10::BFloat16>(sums[j]);
    }
  }
}

}  // namespace

bool brgemm_bf16_available() { return at::native::cpublas::could_pack(at::kBFloat16); }

at::Tensor pack_brgemm_weight(at::Tensor weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "weight must be a bf16 [N, K] CPU tensor");
  TORCH_CHECK(weight.size(1) % 2 == 0, "brgemm's bf16 blocks take an even K, got ", weight.size(1));
  TORCH_CHECK(brgemm_bf16_available(), "torch's brgemm does not pack bf16 on this CPU");
  const int64_t n = weight.size(0), k = weight.size(1), blocks = (n + kColumns - 1) / kColumns;
  const at::Tensor rows = weight.contiguous();
  at::Tensor packed = at::empty({blocks, k / 2, 2 * kColumns}, weight.options());
  const c10::BFloat16* src = rows.data_ptr<c10::BFloat16>();
  c10::BFloat16* dst = packed.data_ptr<c10::BFloat16>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    // a block's columns of W^T [K, 64], zero past N, transposed here in 64 x 64 tiles that stay in L1 (a strided
    // copy of all of W^T took 3/4 of the packing: 56 of 72 ms for an 11008 x 2048 weight); brgemm's pack lays it out
    std::vector<c10::BFloat16> columns(k * kColumns);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kColumns, width = std::min(kColumns, n - n0);
      if (width < kColumns) std::fill(columns.begin(), columns.end(), c10::BFloat16(0.0f));
      for (int64_t k0 = 0; k0 < k; k0 += kColumns) {
        const int64_t k1 = std::min(k0 + kColumns, k);
        for (int64_t j = 0; j < width; ++j) {
          const c10::BFloat16* row = src + (n0 + j) * k;
          for (int64_t i = k0; i < k1; ++i) columns[i * kColumns + j] = row[i];
        }
      }
      at::native::cpublas::pack(k, kColumns, kColumns, kColumns, at::kBFloat16, at::kBFloat16, columns.data(),
                                dst + b * k * kColumns);
    }
  });
  return packed;
}

void linear_brgemm(at::Tensor out, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu() && packed.device().is_cpu(), "tensors must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  packed.scalar_type() == at::kBFloat16,
              "linear_brgemm multiplies bf16 x by bf16 blocks into bf16 out");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 2 * kColumns && packed.is_contiguous(),
              "packed must come from pack_brgemm_weight");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), blocks = packed.size(0);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && packed.size(1) * 2 == k, "x must be [M, K] with rows contiguous");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.is_contiguous() && (n + kColumns - 1) / kColumns == blocks,
              "out must be a contiguous [M, N]");
  TORCH_CHECK(!bias || (bias->numel() == n && bias->is_contiguous() && bias->scalar_type() == at::kBFloat16),
              "bias must be a contiguous bf16 [N]");
  if (out.numel() == 0) return;
  const c10::BFloat16* a = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* b = packed.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bias_data = bias ? bias->data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* y = out.data_ptr<c10::BFloat16>();
  // The units: a panel of blocks times a tile of kRows rows. With one tile a panel is a block; with several, as
  // many blocks as fill kPanelBytes, so that the panel stays in L2 while the thread takes its tiles one after
  // another, and a tile of x while it runs over the panel's blocks.
  const int64_t tiles = (m + kRows - 1) / kRows;
  const int64_t panel = tiles == 1 ? 1 : std::max<int64_t>(1, kPanelBytes / (k * kColumns * 2));
  const int64_t panels = (blocks + panel - 1) / panel;
  parallel_units(panels * tiles, at::get_num_threads(), [&](const auto& take) {
    std::vector<float> acc(kBrgemmAccFloats);
    for (int64_t unit; (unit = take()) >= 0;) {
      const int64_t m0 = unit % tiles * kRows, rows = std::min(kRows, m - m0);
      for (int64_t block = unit / tiles * panel; block < std::min(blocks, (unit / tiles + 1) * panel); ++block) {
        brgemm_tile(y + m0 * n, n, n, a + m0 * x.stride(0), x.stride(0), rows, k, b, block, bias_data, acc.data());
      }
    }
    // brgemm keeps its tile configuration between calls; pagedllm's own AMX kernels may load theirs in between
    at::native::cpublas::brgemm_release();
  });
}

void linear_brgemm_on_thread(c10::BFloat16* out, int64_t out_stride, int64_t n, const c10::BFloat16* x,
                             int64_t x_stride, int64_t m, int64_t k, const c10::BFloat16* packed, float* acc) {
  for (int64_t m0 = 0; m0 < m; m0 += kRows) {
    for (int64_t block = 0; block < (n + kColumns - 1) / kColumns; ++block) {
      brgemm_tile(out + m0 * out_stride, out_stride, n, x + m0 * x_stride, x_stride, std::min(kRows, m - m0), k,
                  packed, block, nullptr, acc);
    }
  }
}

void brgemm_release() { at::native::cpublas::brgemm_release(); }

}  // namespace pagedllm

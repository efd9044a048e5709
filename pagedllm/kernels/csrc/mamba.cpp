// A Mamba-2 layer's recurrence (pagedllm.models.mamba): a decode step after its in_proj for S sequences of one token
// each, the causal convolution's step, the selective state space recurrence's step and the gated RMSNorm in one pass
// (mamba2_decode); and a prompt's tokens through the recurrence, token by token, each head's state in cache
// (mamba2_scan: `ssd_scan`'s result, which the chunked form reaches by another order of the same sums).
//
// In torch the step is ~30 ops, each a pass over the states: a batch of 16 sequences' [48, 32, 128] states
// (granite-4.0-h-350m's) went through memory ~12 times a layer, read, widened, decayed, added to, narrowed, and
// copied back. Here each sequence's state row is read once from its slot and written once to another (the runner
// commits a step by taking the written slot as the sequence's, so a step that raised leaves the read one as it was),
// in float32 registers between. The arithmetic is the torch path's (`Mamba2Mixer._decode_native`), rounded to the
// storage type where torch stores an intermediate, exp and SiLU by exp_approx: in float32 within float rounding.
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace pagedllm {
namespace {

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's, threshold 20

template <typename scalar_t>
void mamba2_decode_impl(at::Tensor& out, const at::Tensor& xbc, const at::Tensor& dt, const at::Tensor& gate,
                        at::Tensor& conv_pool, at::Tensor& ssm_pool, const at::Tensor& read_slots,
                        const at::Tensor& write_slots, const at::Tensor& conv_weight,
                        const c10::optional<at::Tensor>& conv_bias, const at::Tensor& dt_bias, const at::Tensor& a,
                        const at::Tensor& d, const at::Tensor& norm_weight, float eps, int64_t groups, float dt_min,
                        float dt_max) {
  const int64_t seqs = xbc.size(0), conv_dim = xbc.size(1), taps = conv_weight.size(1), kept = taps - 1;
  const int64_t heads = ssm_pool.size(1), head_dim = ssm_pool.size(2), state = ssm_pool.size(3);
  const int64_t inner = heads * head_dim, per_group = heads / groups, group_size = inner / groups;
  const int64_t* read = read_slots.data_ptr<int64_t>();
  const int64_t* write = write_slots.data_ptr<int64_t>();
  const scalar_t* w = conv_weight.data_ptr<scalar_t>();
  const scalar_t* bias = conv_bias ? conv_bias->data_ptr<scalar_t>() : nullptr;
  scalar_t* conv = conv_pool.data_ptr<scalar_t>();
  scalar_t* ssm = ssm_pool.data_ptr<scalar_t>();
  const int64_t conv_slot = conv_dim * kept, ssm_slot = heads * head_dim * state;
  // 1. the convolution's step and its SiLU: act [S, conv_dim] (x, then each group's B, then its C)
  std::vector<float> act(seqs * conv_dim);
  at::parallel_for(0, seqs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const scalar_t* x = xbc.data_ptr<scalar_t>() + s * xbc.stride(0);
      const scalar_t* before = read[s] < 0 ? nullptr : conv + read[s] * conv_slot;
      scalar_t* after = conv + write[s] * conv_slot;
      for (int64_t ch = 0; ch < conv_dim; ++ch) {
        const scalar_t* wc = w + ch * taps;
        float sum = 0.f;  // torch: (window * weight) in scalar_t, summed in float, rounded
        for (int64_t j = 0; j < kept; ++j) {
          const float v = before == nullptr ? 0.f : to_float(before[ch * kept + j]);
          sum += round_to<scalar_t>(v * to_float(wc[j]));
        }
        sum += round_to<scalar_t>(to_float(x[ch]) * to_float(wc[kept]));
        float value = round_to<scalar_t>(sum);
        if (bias != nullptr) value = round_to<scalar_t>(value + to_float(bias[ch]));
        act[s * conv_dim + ch] = round_to<scalar_t>(value / (1.f + exp_approx(-value)));
        for (int64_t j = 0; j + 1 < kept; ++j) after[ch * kept + j] = before == nullptr ? from_float<scalar_t>(0.f)
                                                                                         : before[ch * kept + j + 1];
        if (kept > 0) after[ch * kept + kept - 1] = x[ch];
      }
    }
  });
  // 2. each head's state row by row: h = exp(dt a) h + dt x B, y = h . C + D x
  std::vector<float> y(seqs * inner);
  const float* a_ptr = a.data_ptr<float>();
  at::parallel_for(0, seqs * heads, 4, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / heads, h = task % heads, g = h / per_group;
      const float* x = act.data() + s * conv_dim + h * head_dim;
      const float* b = act.data() + s * conv_dim + inner + g * state;
      const float* c = b + groups * state;
      const float step = std::min(std::max(softplus(to_float(dt.data_ptr<scalar_t>()[s * dt.stride(0) + h]) +
                                                    to_float(dt_bias.data_ptr<scalar_t>()[h])), dt_min), dt_max);
      const float decay = std::exp(step * a_ptr[h]);
      const float skip = to_float(d.data_ptr<scalar_t>()[h]);
      const scalar_t* before = read[s] < 0 ? nullptr : ssm + read[s] * ssm_slot + h * head_dim * state;
      scalar_t* after = ssm + write[s] * ssm_slot + h * head_dim * state;
      for (int64_t p = 0; p < head_dim; ++p) {
        const float dtx = step * x[p];
        float dot = 0.f;
        scalar_t* row = after + p * state;
        if (before == nullptr) {
#pragma omp simd reduction(+ : dot)
          for (int64_t n = 0; n < state; ++n) {
            const float value = dtx * b[n];
            row[n] = from_float<scalar_t>(value);
            dot += value * c[n];
          }
        } else {
          const scalar_t* old = before + p * state;
#pragma omp simd reduction(+ : dot)
          for (int64_t n = 0; n < state; ++n) {
            const float value = to_float(old[n]) * decay + dtx * b[n];
            row[n] = from_float<scalar_t>(value);
            dot += value * c[n];
          }
        }
        y[s * inner + h * head_dim + p] = dot + skip * x[p];
      }
    }
  });
  // 3. the gated RMSNorm by group: weight * (y silu(z) / rms), the norm in float, rounded before the weight
  const scalar_t* nw = norm_weight.data_ptr<scalar_t>();
  at::parallel_for(0, seqs * groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / groups, g = task % groups;
      const scalar_t* z = gate.data_ptr<scalar_t>() + s * gate.stride(0) + g * group_size;
      float* v = y.data() + s * inner + g * group_size;
      float sum_sq = 0.f;
      for (int64_t i = 0; i < group_size; ++i) {
        const float zi = to_float(z[i]);
        v[i] *= zi / (1.f + exp_approx(-zi));
        sum_sq += v[i] * v[i];
      }
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(group_size) + eps);
      scalar_t* o = out.data_ptr<scalar_t>() + s * out.stride(0) + g * group_size;
      for (int64_t i = 0; i < group_size; ++i)
        o[i] = from_float<scalar_t>(to_float(nw[g * group_size + i]) * round_to<scalar_t>(v[i] * inv_rms));
    }
  });
}

}  // namespace

void mamba2_scan(at::Tensor y, at::Tensor final_state, at::Tensor x, at::Tensor dt, at::Tensor a, at::Tensor b,
                 at::Tensor c, c10::optional<at::Tensor> initial) {
  const int64_t length = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const int64_t groups = b.size(1), state = b.size(2), per_group = heads / groups;
  for (const at::Tensor& t : {y, final_state, x, dt, a, b, c})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "mamba2_scan's tensors: float32, contiguous");
  TORCH_CHECK(x.dim() == 3 && dt.size(0) == length && dt.size(1) == heads && b.sizes() == c.sizes() &&
                  b.size(0) == length && heads % groups == 0 && y.sizes() == x.sizes() &&
                  final_state.size(0) == heads && final_state.size(1) == head_dim && final_state.size(2) == state,
              "x and y [L, H, P], dt [L, H], b and c [L, G, N], final_state [H, P, N]");
  TORCH_CHECK(!initial || (initial->scalar_type() == at::kFloat && initial->is_contiguous() &&
                           initial->sizes() == final_state.sizes()), "initial: float32 [H, P, N]");
  const float* xs = x.data_ptr<float>();
  const float* dts = dt.data_ptr<float>();
  const float* as = a.data_ptr<float>();
  const float* bs = b.data_ptr<float>();
  const float* cs = c.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  float* hs = final_state.data_ptr<float>();
  const float* h0 = initial ? initial->data_ptr<float>() : nullptr;
  // a head a task: its [P, N] state stays in the thread's L1 while the tokens go by
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      float* s = hs + h * head_dim * state;
      if (h0 != nullptr) {
        std::copy(h0 + h * head_dim * state, h0 + (h + 1) * head_dim * state, s);
      } else {
        std::fill(s, s + head_dim * state, 0.f);
      }
      const int64_t g = h / per_group;
      for (int64_t t = 0; t < length; ++t) {
        const float step = dts[t * heads + h];
        const float decay = std::exp(step * as[h]);
        const float* bt = bs + (t * groups + g) * state;
        const float* ct = cs + (t * groups + g) * state;
        const float* xt = xs + (t * heads + h) * head_dim;
        float* yt = ys + (t * heads + h) * head_dim;
        for (int64_t p = 0; p < head_dim; ++p) {
          const float dtx = step * xt[p];
          float* row = s + p * state;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t n = 0; n < state; ++n) {
            row[n] = row[n] * decay + dtx * bt[n];
            dot += row[n] * ct[n];
          }
          yt[p] = dot;
        }
      }
    }
  });
}

void mamba2_decode(at::Tensor out, at::Tensor xbc, at::Tensor dt, at::Tensor gate, at::Tensor conv_pool,
                   at::Tensor ssm_pool, at::Tensor read_slots, at::Tensor write_slots, at::Tensor conv_weight,
                   c10::optional<at::Tensor> conv_bias, at::Tensor dt_bias, at::Tensor a, at::Tensor d,
                   at::Tensor norm_weight, double eps, int64_t groups, double dt_min, double dt_max) {
  TORCH_CHECK(xbc.dim() == 2 && xbc.stride(1) == 1 && dt.stride(1) == 1 && gate.stride(1) == 1 &&
                  out.stride(1) == 1, "xbc [S, conv_dim], dt [S, H], gate and out [S, inner], rows contiguous");
  TORCH_CHECK(conv_pool.is_contiguous() && ssm_pool.is_contiguous() && conv_weight.is_contiguous() &&
                  conv_pool.size(1) == xbc.size(1) && conv_pool.size(2) == conv_weight.size(1) - 1,
              "conv_pool [slots, conv_dim, d_conv - 1] and conv_weight [conv_dim, d_conv], contiguous");
  TORCH_CHECK(ssm_pool.dim() == 4 && ssm_pool.size(1) % groups == 0 &&
                  xbc.size(1) == ssm_pool.size(1) * ssm_pool.size(2) + 2 * groups * ssm_pool.size(3),
              "ssm_pool [slots, H, P, N] and xbc's width H P + 2 G N");
  TORCH_CHECK(read_slots.scalar_type() == at::kLong && write_slots.scalar_type() == at::kLong &&
                  read_slots.numel() == xbc.size(0) && write_slots.numel() == xbc.size(0) &&
                  a.scalar_type() == at::kFloat,
              "read_slots and write_slots int64 [S] (a read slot of -1: zeros), a float32 [H]");
  for (const at::Tensor& t : {xbc, dt, gate, conv_pool, ssm_pool, conv_weight, dt_bias, d, norm_weight, out})
    TORCH_CHECK(t.scalar_type() == xbc.scalar_type(), "the layer's tensors in one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xbc.scalar_type(), "mamba2_decode", [&] {
    mamba2_decode_impl<scalar_t>(out, xbc, dt, gate, conv_pool, ssm_pool, read_slots.contiguous(),
                                 write_slots.contiguous(), conv_weight, conv_bias, dt_bias, a, d, norm_weight,
                                 static_cast<float>(eps), groups, static_cast<float>(dt_min),
                                 static_cast<float>(dt_max));
  });
}

}  // namespace pagedllm

// A Gated DeltaNet layer's decode step (pagedllm.models.deltanet) after its in_proj, for S sequences of one token
// each: the causal convolution's step and its SiLU, q and k L2-normed by key head, the gated delta rule's step over
// each value head's [K, V] state, and the gated norm of each head's output, in one call (gated_delta_decode); and a
// prompt's tokens through the rule, token by token, a head a task, its state in cache (gated_delta_scan:
// `delta_rule_chunked`'s result, which the chunked form reaches by another order of the same sums).
//
// In torch the rule's step is ~10 ops over the batch's states, each a pass over memory (Qwen3.5-0.8B's 16 heads of
// [128, 128] a sequence, 18 layers). Here each head's state is read twice from its slot (once for what it predicts
// for k and gives for q, once to write the new state to the other slot) and written once, in float32 registers
// between: S^T q after the update is decay S^T q + (k . q) delta, so both reads of the first pass come before any
// write. The arithmetic is the torch path's, rounded to the storage type where torch stores an intermediate, exp and
// SiLU by exp_approx: in float32 within float rounding.
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace pagedllm {
namespace {

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's, threshold 20

template <typename scalar_t>
void gated_delta_decode_impl(at::Tensor& out, const at::Tensor& qkv, const at::Tensor& z, const at::Tensor& b,
                             const at::Tensor& a, at::Tensor& conv_pool, at::Tensor& state_pool,
                             const at::Tensor& read_slots, const at::Tensor& write_slots,
                             const at::Tensor& conv_weight, const at::Tensor& dt_bias, const at::Tensor& decay_rate,
                             const at::Tensor& norm_weight, float eps, int64_t key_heads) {
  const int64_t seqs = qkv.size(0), conv_dim = qkv.size(1), taps = conv_weight.size(1), kept = taps - 1;
  const int64_t heads = state_pool.size(1), key_dim = state_pool.size(2), value_dim = state_pool.size(3);
  const int64_t key_size = key_heads * key_dim, per_key = heads / key_heads;
  const int64_t* read = read_slots.data_ptr<int64_t>();
  const int64_t* write = write_slots.data_ptr<int64_t>();
  const scalar_t* w = conv_weight.data_ptr<scalar_t>();
  scalar_t* conv = conv_pool.data_ptr<scalar_t>();
  scalar_t* states = state_pool.data_ptr<scalar_t>();
  const int64_t conv_slot = conv_dim * kept, state_slot = heads * key_dim * value_dim;
  const float scale = 1.f / std::sqrt(static_cast<float>(key_dim));
  // 1. the convolution's step and its SiLU: act [S, conv_dim] (q, k, then v of all heads); q and k normed by head
  std::vector<float> act(seqs * conv_dim);
  at::parallel_for(0, seqs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const scalar_t* x = qkv.data_ptr<scalar_t>() + s * qkv.stride(0);
      const scalar_t* before = read[s] < 0 ? nullptr : conv + read[s] * conv_slot;
      scalar_t* after = conv + write[s] * conv_slot;
      float* row = act.data() + s * conv_dim;
      for (int64_t ch = 0; ch < conv_dim; ++ch) {
        const scalar_t* wc = w + ch * taps;
        float sum = 0.f;  // torch: (window * weight) in scalar_t, summed in float, rounded
        for (int64_t j = 0; j < kept; ++j) {
          const float v = before == nullptr ? 0.f : to_float(before[ch * kept + j]);
          sum += round_to<scalar_t>(v * to_float(wc[j]));
        }
        sum += round_to<scalar_t>(to_float(x[ch]) * to_float(wc[kept]));
        const float value = round_to<scalar_t>(sum);
        row[ch] = round_to<scalar_t>(value / (1.f + exp_approx(-value)));
        for (int64_t j = 0; j + 1 < kept; ++j) after[ch * kept + j] = before == nullptr ? from_float<scalar_t>(0.f)
                                                                                         : before[ch * kept + j + 1];
        if (kept > 0) after[ch * kept + kept - 1] = x[ch];
      }
      for (int64_t head = 0; head < 2 * key_heads; ++head) {  // q's heads (scaled too), then k's
        float* v = row + head * key_dim;
        float sum_sq = 0.f;
        for (int64_t i = 0; i < key_dim; ++i) sum_sq += v[i] * v[i];
        const float inv = 1.f / std::sqrt(sum_sq + 1e-6f) * (head < key_heads ? scale : 1.f);
        for (int64_t i = 0; i < key_dim; ++i) v[i] *= inv;
      }
    }
  });
  // 2. each value head's state: kv = S^T k and sq = S^T q, decayed; delta = beta (v - kv); the new state
  // decay S + k delta^T written to its slot; o = sq + (k . q) delta, normed by head, times the weight and SiLU(z)
  const float* rate = decay_rate.data_ptr<float>();
  const scalar_t* nw = norm_weight.data_ptr<scalar_t>();
  at::parallel_for(0, seqs * heads, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> kv(value_dim), sq(value_dim), delta(value_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / heads, h = task % heads, kh = h / per_key;
      const float* row = act.data() + s * conv_dim;
      const float* q = row + kh * key_dim;
      const float* k = row + key_size + kh * key_dim;
      const float* v = row + 2 * key_size + h * value_dim;
      const float gate_a = to_float(a.data_ptr<scalar_t>()[s * a.stride(0) + h]);
      const float decay = std::exp(rate[h] * softplus(gate_a + to_float(dt_bias.data_ptr<scalar_t>()[h])));
      const float b_value = to_float(b.data_ptr<scalar_t>()[s * b.stride(0) + h]);
      const float beta = round_to<scalar_t>(1.f / (1.f + std::exp(-b_value)));
      const scalar_t* old = read[s] < 0 ? nullptr : states + read[s] * state_slot + h * key_dim * value_dim;
      scalar_t* fresh = states + write[s] * state_slot + h * key_dim * value_dim;
      std::fill(kv.begin(), kv.end(), 0.f);
      std::fill(sq.begin(), sq.end(), 0.f);
      float kq = 0.f;
      for (int64_t i = 0; i < key_dim; ++i) kq += k[i] * q[i];
      if (old != nullptr) {
        for (int64_t i = 0; i < key_dim; ++i) {
          const scalar_t* state_row = old + i * value_dim;
          const float ki = k[i] * decay, qi = q[i] * decay;
          float* kv_p = kv.data();
          float* sq_p = sq.data();
#pragma omp simd
          for (int64_t j = 0; j < value_dim; ++j) {
            const float x = to_float(state_row[j]);
            kv_p[j] += x * ki;
            sq_p[j] += x * qi;
          }
        }
      }
      float* o = sq.data();  // the head's output, in place of sq
      for (int64_t j = 0; j < value_dim; ++j) {
        delta[j] = (v[j] - kv[j]) * beta;
        o[j] += kq * delta[j];
      }
      for (int64_t i = 0; i < key_dim; ++i) {
        scalar_t* new_row = fresh + i * value_dim;
        const float ki = k[i];
        const float* delta_p = delta.data();
        if (old == nullptr) {
#pragma omp simd
          for (int64_t j = 0; j < value_dim; ++j) new_row[j] = from_float<scalar_t>(ki * delta_p[j]);
        } else {
          const scalar_t* state_row = old + i * value_dim;
#pragma omp simd
          for (int64_t j = 0; j < value_dim; ++j)
            new_row[j] = from_float<scalar_t>(to_float(state_row[j]) * decay + ki * delta_p[j]);
        }
      }
      // the gated norm: torch rounds o to the storage type, norms it in float and rounds, times the weight (rounded),
      // times SiLU(z) in float, rounded
      float sum_sq = 0.f;
      for (int64_t j = 0; j < value_dim; ++j) {
        o[j] = round_to<scalar_t>(o[j]);
        sum_sq += o[j] * o[j];
      }
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(value_dim) + eps);
      const scalar_t* zh = z.data_ptr<scalar_t>() + s * z.stride(0) + h * value_dim;
      scalar_t* out_h = out.data_ptr<scalar_t>() + s * out.stride(0) + h * value_dim;
      for (int64_t j = 0; j < value_dim; ++j) {
        const float zj = to_float(zh[j]);
        const float normed = round_to<scalar_t>(to_float(nw[j]) * round_to<scalar_t>(o[j] * inv_rms));
        out_h[j] = from_float<scalar_t>(normed * (zj / (1.f + exp_approx(-zj))));
      }
    }
  });
}

}  // namespace

void gated_delta_scan(at::Tensor out, at::Tensor final_state, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g,
                      at::Tensor beta, c10::optional<at::Tensor> initial) {
  const int64_t length = v.size(0), heads = v.size(1), value_dim = v.size(2);
  const int64_t key_heads = q.size(1), key_dim = q.size(2), per_key = heads / key_heads;
  for (const at::Tensor& t : {out, final_state, q, k, v, g, beta})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "gated_delta_scan's tensors: float32, contiguous");
  TORCH_CHECK(q.dim() == 3 && q.sizes() == k.sizes() && q.size(0) == length && heads % key_heads == 0 &&
                  g.size(0) == length && g.size(1) == heads && beta.sizes() == g.sizes() && out.sizes() == v.sizes() &&
                  final_state.size(0) == heads && final_state.size(1) == key_dim &&
                  final_state.size(2) == value_dim,
              "q and k [L, key heads, K], v and out [L, H, V], g and beta [L, H], final_state [H, K, V]");
  TORCH_CHECK(!initial || (initial->scalar_type() == at::kFloat && initial->is_contiguous() &&
                           initial->sizes() == final_state.sizes()), "initial: float32 [H, K, V]");
  const float* qs = q.data_ptr<float>();
  const float* ks = k.data_ptr<float>();
  const float* vs = v.data_ptr<float>();
  const float* gs = g.data_ptr<float>();
  const float* betas = beta.data_ptr<float>();
  float* outs = out.data_ptr<float>();
  float* finals = final_state.data_ptr<float>();
  const float* h0 = initial ? initial->data_ptr<float>() : nullptr;
  const int64_t size = key_dim * value_dim;
  // a head a task: its [K, V] state stays in the thread's cache while the tokens go by; each token reads it once for
  // S^T k and S^T q and once to update it (S^T q after the update is decay S^T q + (k . q) delta)
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kv(value_dim), delta(value_dim);
    for (int64_t h = begin; h < end; ++h) {
      float* s = finals + h * size;
      if (h0 != nullptr) {
        std::copy(h0 + h * size, h0 + (h + 1) * size, s);
      } else {
        std::fill(s, s + size, 0.f);
      }
      const int64_t kh = h / per_key;
      for (int64_t t = 0; t < length; ++t) {
        const float* qt = qs + (t * key_heads + kh) * key_dim;
        const float* kt = ks + (t * key_heads + kh) * key_dim;
        const float* vt = vs + (t * heads + h) * value_dim;
        float* o = outs + (t * heads + h) * value_dim;
        const float decay = std::exp(gs[t * heads + h]), b = betas[t * heads + h];
        float kq = 0.f;
        for (int64_t i = 0; i < key_dim; ++i) kq += kt[i] * qt[i];
        std::fill(kv.begin(), kv.end(), 0.f);
        std::fill(o, o + value_dim, 0.f);
        float* kv_p = kv.data();
        for (int64_t i = 0; i < key_dim; ++i) {
          const float* row = s + i * value_dim;
          const float ki = kt[i] * decay, qi = qt[i] * decay;
#pragma omp simd
          for (int64_t j = 0; j < value_dim; ++j) {
            kv_p[j] += row[j] * ki;
            o[j] += row[j] * qi;
          }
        }
        float* delta_p = delta.data();
#pragma omp simd
        for (int64_t j = 0; j < value_dim; ++j) {
          delta_p[j] = (vt[j] - kv_p[j]) * b;
          o[j] += kq * delta_p[j];
        }
        for (int64_t i = 0; i < key_dim; ++i) {
          float* row = s + i * value_dim;
          const float ki = kt[i];
#pragma omp simd
          for (int64_t j = 0; j < value_dim; ++j) row[j] = row[j] * decay + ki * delta_p[j];
        }
      }
    }
  });
}

void gated_delta_decode(at::Tensor out, at::Tensor qkv, at::Tensor z, at::Tensor b, at::Tensor a,
                        at::Tensor conv_pool, at::Tensor state_pool, at::Tensor read_slots, at::Tensor write_slots,
                        at::Tensor conv_weight, at::Tensor dt_bias, at::Tensor decay_rate, at::Tensor norm_weight,
                        double eps, int64_t key_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && z.stride(1) == 1 && b.stride(1) == 1 && a.stride(1) == 1 &&
                  out.stride(1) == 1, "qkv [S, conv_dim], z and out [S, H V], b and a [S, H], rows contiguous");
  TORCH_CHECK(conv_pool.is_contiguous() && state_pool.is_contiguous() && conv_weight.is_contiguous() &&
                  conv_pool.size(1) == qkv.size(1) && conv_pool.size(2) == conv_weight.size(1) - 1,
              "conv_pool [slots, conv_dim, kernel - 1] and conv_weight [conv_dim, kernel], contiguous");
  TORCH_CHECK(state_pool.dim() == 4 && state_pool.size(1) % key_heads == 0 &&
                  qkv.size(1) == 2 * key_heads * state_pool.size(2) + state_pool.size(1) * state_pool.size(3) &&
                  z.size(1) == state_pool.size(1) * state_pool.size(3) && norm_weight.numel() == state_pool.size(3),
              "state_pool [slots, H, K, V], qkv's width 2 key_heads K + H V, z's H V, norm_weight [V]");
  TORCH_CHECK(read_slots.scalar_type() == at::kLong && write_slots.scalar_type() == at::kLong &&
                  read_slots.numel() == qkv.size(0) && write_slots.numel() == qkv.size(0) &&
                  decay_rate.scalar_type() == at::kFloat && decay_rate.is_contiguous(),
              "read_slots and write_slots int64 [S] (a read slot of -1: zeros), decay_rate float32 [H]");
  for (const at::Tensor& t : {qkv, z, b, a, conv_pool, state_pool, conv_weight, dt_bias, norm_weight, out})
    TORCH_CHECK(t.scalar_type() == qkv.scalar_type(), "the layer's tensors in one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "gated_delta_decode", [&] {
    gated_delta_decode_impl<scalar_t>(out, qkv, z, b, a, conv_pool, state_pool, read_slots.contiguous(),
                                      write_slots.contiguous(), conv_weight, dt_bias, decay_rate, norm_weight,
                                      static_cast<float>(eps), key_heads);
  });
}

}  // namespace pagedllm

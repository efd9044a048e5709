// A Gated DeltaNet layer (pagedllm.models.deltanet) after its in_proj, for a step's sequences, a prompt's chunk of
// many tokens or a decode step's one each alike, in one call (gated_delta_forward): the causal convolution over
// each token and the ones before it (from the sequence's convolution state before its chunk), its SiLU, q and k
// L2-normed by key head, the gated delta rule over each value head's [K, V] state token by token, and the gated norm
// of each token's head output; each sequence's states read from its read slot and written to its write slot.
//
// In torch a step is ~30 ops, each a pass over its tokens' [T, conv_dim] rows or the batch's states (Qwen3.5-0.8B's
// 16 heads of [128, 128] a sequence, 18 layers). Here each value column of a head's state, a recurrence of its own,
// stays in float32 in L1 with its block of columns while the tokens go by, one pass over it a token: S^T q after the
// update is decay S^T q + (k . q) delta, so what a token reads of the state (S^T k and S^T q) is summed as the
// previous token's update writes it, and the state is read from its slot once and written once a step. The
// arithmetic is the torch path's (`GatedDeltaNet` without the kernels), rounded to the storage type where torch stores
// an intermediate, exp and SiLU by exp_approx: in float32 within float rounding (the rule's sums in another order
// than the chunked form's).
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

namespace pagedllm {
namespace {

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's, threshold 20

// A step's buffers of floats, left uninitialized: every element is written before it is read (zeroed vectors were
// a memset of a prompt's [T, conv_dim] inputs and [T, H V] outputs on one thread before the others started).
using Floats = std::unique_ptr<float[]>;

// A decode step reads every state from memory, a block's rows a state row apart, where the hardware prefetcher left
// the task waiting: its rows this many ahead are asked for (18 layers of 16 Qwen3-Next states: 1.15x at 32, 1.1x at 16)
constexpr int64_t kStateAhead = 32;
constexpr int64_t kBlock = 32;  // a rule task's value columns (step 3)

// A decode step's token of a (sequence, head, block of kBlock columns) task from a state: its sums taken as the
// read slot's rows are read, its update rounded and stored to the write slot as it is made; two sweeps over the rows
// (the second from cache), where a copy widened to float32 took four. The same operations in the same order as the
// rule's general path (gated_delta_forward_impl's step 3): the same bits. Not inlined: inlined, its prefetches (asm)
// left the general path's prompt tokens 1.3x slower (GCC's code for the rest of the task changed).
template <typename scalar_t>
__attribute__((noinline)) void decode_token(const scalar_t* old, scalar_t* fresh, const float* k, const float* q,
                                            const float* v, float* o, float decay, float beta, float dot,
                                            int64_t key_dim, int64_t value_dim, int64_t width) {
  float sum_k[kBlock] = {}, sum_q[kBlock] = {}, delta[kBlock];
  for (int64_t i = 0; i < key_dim; ++i) {
    const scalar_t* src = old + i * value_dim;
    if (i + kStateAhead < key_dim) prefetch_line<0>(src + kStateAhead * value_dim);
    const float nk = k[i] * decay, nq = q[i] * decay;
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) {
      const float x = to_float(src[j]);
      sum_k[j] += x * nk;
      sum_q[j] += x * nq;
    }
  }
  for (int64_t j = 0; j < width; ++j) {
    delta[j] = (v[j] - sum_k[j]) * beta;
    o[j] = sum_q[j] + dot * delta[j];
  }
  // a block's row of the write slot is whole lines (bf16's 32 values one): streamed, not read in to be written
  const bool lines = width == kBlock && reinterpret_cast<uintptr_t>(fresh) % 64 == 0 &&
                     value_dim * sizeof(scalar_t) % 64 == 0;
  for (int64_t i = 0; i < key_dim; ++i) {
    const scalar_t* src = old + i * value_dim;
    scalar_t* dst = fresh + i * value_dim;
    const float ki = k[i];
    if (lines) {
      alignas(64) scalar_t row[kBlock];
#pragma omp simd
      for (int64_t j = 0; j < kBlock; ++j) row[j] = from_float<scalar_t>(to_float(src[j]) * decay + ki * delta[j]);
      stream_lines(dst, row, sizeof(row));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) dst[j] = from_float<scalar_t>(to_float(src[j]) * decay + ki * delta[j]);
    }
  }
}

template <typename scalar_t>
void gated_delta_forward_impl(at::Tensor& out, const at::Tensor& qkv, const at::Tensor& z, const at::Tensor& b,
                              const at::Tensor& a, at::Tensor& conv_pool, at::Tensor& state_pool,
                              const int64_t* read, const int64_t* write, const int64_t* starts, int64_t seqs,
                              const at::Tensor& conv_weight, const at::Tensor& dt_bias, const at::Tensor& decay_rate,
                              const at::Tensor& norm_weight, float eps, int64_t key_heads) {
  const int64_t rows = qkv.size(0), conv_dim = qkv.size(1), taps = conv_weight.size(1), kept = taps - 1;
  const int64_t heads = state_pool.size(1), key_dim = state_pool.size(2), value_dim = state_pool.size(3);
  const int64_t key_size = key_heads * key_dim, per_key = heads / key_heads;
  const scalar_t* w = conv_weight.data_ptr<scalar_t>();
  const scalar_t* inputs = qkv.data_ptr<scalar_t>();
  const scalar_t* a_rows = a.data_ptr<scalar_t>();
  const scalar_t* b_rows = b.data_ptr<scalar_t>();
  const scalar_t* z_rows = z.data_ptr<scalar_t>();
  scalar_t* out_rows = out.data_ptr<scalar_t>();
  const int64_t stride = qkv.stride(0);
  scalar_t* conv = conv_pool.data_ptr<scalar_t>();
  scalar_t* states = state_pool.data_ptr<scalar_t>();
  const int64_t conv_slot = conv_dim * kept, state_size = key_dim * value_dim, state_slot = heads * state_size;
  const float scale = 1.f / std::sqrt(static_cast<float>(key_dim));
  std::vector<int64_t> seq_of(rows);
  for (int64_t s = 0; s < seqs; ++s) std::fill(seq_of.begin() + starts[s], seq_of.begin() + starts[s + 1], s);
  // 1. each token's convolution over it and the `kept` inputs before it (its sequence's earlier rows, else the
  // state before the chunk), its SiLU; q and k normed by head, their dot product kq [T, key heads]; each value head's
  // decay and beta [T, H]. The results go into act head by head (q's key heads, k's, then v's value heads, each
  // [T, its size]): a rule task reads its heads' rows token after token, which are then a head's row apart, not a
  // token's conv_dim (a page or more, where the hardware prefetcher does not follow)
  const float* rate = decay_rate.data_ptr<float>();
  Floats act(new float[rows * conv_dim]);
  std::vector<float> taps_w(taps * conv_dim);  // the weight tap by tap: [taps, conv_dim]
  std::vector<float> kq(rows * key_heads), decays(rows * heads), betas(rows * heads);
  for (int64_t ch = 0; ch < conv_dim; ++ch)
    for (int64_t j = 0; j < taps; ++j) taps_w[j * conv_dim + ch] = to_float(w[ch * taps + j]);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Floats token(new float[conv_dim]);
    float* row = token.get();
    for (int64_t r = begin; r < end; ++r) {
      const int64_t s = seq_of[r], position = r - starts[s];
      const scalar_t* before = read[s] < 0 ? nullptr : conv + read[s] * conv_slot;
      std::fill(row, row + conv_dim, 0.f);
      for (int64_t j = 0; j < taps; ++j) {  // torch: (window * weight) in scalar_t, summed in float, rounded
        const int64_t back = position - kept + j;  // the tap's input: this chunk's row, or the state's column
        const float* wj = taps_w.data() + j * conv_dim;
        if (back >= 0) {
          const scalar_t* x = inputs + (starts[s] + back) * stride;
#pragma omp simd
          for (int64_t ch = 0; ch < conv_dim; ++ch) row[ch] += round_to<scalar_t>(to_float(x[ch]) * wj[ch]);
        } else if (before != nullptr) {
          const scalar_t* column = before + position + j;
#pragma omp simd
          for (int64_t ch = 0; ch < conv_dim; ++ch) row[ch] += round_to<scalar_t>(to_float(column[ch * kept]) * wj[ch]);
        }
      }
#pragma omp simd
      for (int64_t ch = 0; ch < conv_dim; ++ch) {
        const float value = round_to<scalar_t>(row[ch]);
        row[ch] = round_to<scalar_t>(value / (1.f + exp_approx(-value)));
      }
      for (int64_t head = 0; head < 2 * key_heads; ++head) {  // q's heads (scaled too), then k's
        float* v = row + head * key_dim;
        const float inv = 1.f / std::sqrt(dot(v, v, key_dim) + 1e-6f) * (head < key_heads ? scale : 1.f);
#pragma omp simd
        for (int64_t i = 0; i < key_dim; ++i) v[i] *= inv;
      }
      for (int64_t head = 0; head < key_heads; ++head) {
        const float* q = row + head * key_dim;
        const float* k = row + key_size + head * key_dim;
        kq[r * key_heads + head] = dot(k, q, key_dim);
      }
      for (int64_t head = 0; head < 2 * key_heads; ++head)
        std::copy(row + head * key_dim, row + (head + 1) * key_dim, act.get() + head * key_dim * rows + r * key_dim);
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t offset = 2 * key_size + h * value_dim;
        std::copy(row + offset, row + offset + value_dim, act.get() + offset * rows + r * value_dim);
      }
      for (int64_t h = 0; h < heads; ++h) {
        const float bias = to_float(dt_bias.data_ptr<scalar_t>()[h]);
        decays[r * heads + h] = std::exp(rate[h] * softplus(to_float(a_rows[r * a.stride(0) + h]) + bias));
        betas[r * heads + h] = round_to<scalar_t>(1.f / (1.f + std::exp(-to_float(b_rows[r * b.stride(0) + h]))));
      }
    }
  });
  // 2. each sequence's next convolution state: the last `kept` of its state before the chunk and the chunk's inputs
  at::parallel_for(0, seqs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t n = starts[s + 1] - starts[s];
      const scalar_t* before = read[s] < 0 ? nullptr : conv + read[s] * conv_slot;
      scalar_t* after = conv + write[s] * conv_slot;
      for (int64_t ch = 0; ch < conv_dim; ++ch) {
        for (int64_t j = 0; j < kept; ++j) {
          const int64_t index = n + j;  // in the window of the old state's `kept` inputs then the chunk's n
          const scalar_t* x = inputs + (starts[s] + index - kept) * stride;
          after[ch * kept + j] = index >= kept ? x[ch]
                                 : before == nullptr ? from_float<scalar_t>(0.f) : before[ch * kept + index];
        }
      }
    }
  });
  // 3. the rule: a value column j of a head's state is its own recurrence (kv_j = S_j . k, delta_j = beta (v_j - kv_j),
  // S_j = decay S_j + k delta_j, o_j = S_j . q), so a (sequence, head, block of kBlock columns) task keeps its
  // [K, kBlock] columns in float32 in L1 while the chunk's tokens go by: one pass over them a token, which updates
  // them and sums what the next token reads of them (decay S^T k and decay S^T q: S^T q after the update is decay
  // S^T q + (k . q) delta); read from the read slot once and written to the write slot once
  const int64_t blocks = (value_dim + kBlock - 1) / kBlock;
  Floats outputs(new float[rows * heads * value_dim]);  // each token's heads' o, for the norm
  at::parallel_for(0, seqs * heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> columns(key_dim * kBlock);
    float sum_k[kBlock], sum_q[kBlock], delta[kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / (heads * blocks), h = task / blocks % heads, j0 = task % blocks * kBlock;
      const int64_t width = std::min(kBlock, value_dim - j0), kh = h / per_key;
      const scalar_t* old = read[s] < 0 ? nullptr : states + read[s] * state_slot + h * state_size + j0;
      scalar_t* fresh = states + write[s] * state_slot + h * state_size + j0;
      auto decay_of = [&](int64_t r) { return decays[r * heads + h]; };
      auto q_of = [&](int64_t r) { return act.get() + kh * key_dim * rows + r * key_dim; };
      auto k_of = [&](int64_t r) { return act.get() + (key_size + kh * key_dim) * rows + r * key_dim; };
      auto v_of = [&](int64_t r) { return act.get() + (2 * key_size + h * value_dim) * rows + r * value_dim + j0; };
      if (old != nullptr && starts[s + 1] - starts[s] == 1) {
        const int64_t r = starts[s];
        decode_token(old, fresh, k_of(r), q_of(r), v_of(r), outputs.get() + (r * heads + h) * value_dim + j0,
                     decay_of(r), betas[r * heads + h], kq[r * key_heads + kh], key_dim, value_dim, width);
        continue;
      }
      // zeros where the state starts at none, or past a last block's width; else every column is read from the slot
      if (old == nullptr || width < kBlock) std::fill(columns.begin(), columns.end(), 0.f);
      if (old != nullptr) {  // (a branch, not a mask: a masked load's lanes off a null pointer stall Zen 4)
        for (int64_t i = 0; i < key_dim; ++i)
          for (int64_t j = 0; j < width; ++j) columns[i * kBlock + j] = to_float(old[i * value_dim + j]);
      }
      // the columns' sums for the chunk's first token
      std::fill(sum_k, sum_k + kBlock, 0.f);
      std::fill(sum_q, sum_q + kBlock, 0.f);
      if (old != nullptr) {
        const float first_decay = decay_of(starts[s]);
        const float* k = k_of(starts[s]);
        const float* q = q_of(starts[s]);
        for (int64_t i = 0; i < key_dim; ++i) {
          const float* row = columns.data() + i * kBlock;
          const float nk = k[i] * first_decay, nq = q[i] * first_decay;
#pragma omp simd
          for (int64_t j = 0; j < kBlock; ++j) {
            sum_k[j] += row[j] * nk;
            sum_q[j] += row[j] * nq;
          }
        }
      }
      for (int64_t r = starts[s]; r < starts[s + 1]; ++r) {
        const float* q = q_of(r);
        const float* k = k_of(r);
        const float* v = v_of(r);
        const float beta = betas[r * heads + h], dot = kq[r * key_heads + kh];
        float* o = outputs.get() + (r * heads + h) * value_dim + j0;
        for (int64_t j = 0; j < kBlock; ++j) {
          delta[j] = j < width ? (v[j] - sum_k[j]) * beta : 0.f;
          if (j < width) o[j] = sum_q[j] + dot * delta[j];
        }
        const bool next = r + 1 < starts[s + 1];
        const float decay = decay_of(r), next_decay = next ? decay_of(r + 1) : 0.f;
        const float* next_k = next ? k_of(r + 1) : k;
        const float* next_q = next ? q_of(r + 1) : q;
        // (two rows at a time, into two sets of sums: twice the independent chains of FMAs)
        float odd_k[kBlock] = {}, odd_q[kBlock] = {};
        std::fill(sum_k, sum_k + kBlock, 0.f);
        std::fill(sum_q, sum_q + kBlock, 0.f);
        int64_t i = 0;
        for (; i + 1 < key_dim; i += 2) {
          float* row = columns.data() + i * kBlock;
          const float ki = k[i], nk = next_k[i] * next_decay, nq = next_q[i] * next_decay;
          const float ki1 = k[i + 1], nk1 = next_k[i + 1] * next_decay, nq1 = next_q[i + 1] * next_decay;
#pragma omp simd
          for (int64_t j = 0; j < kBlock; ++j) {
            const float x = row[j] * decay + ki * delta[j];
            const float y = row[kBlock + j] * decay + ki1 * delta[j];
            row[j] = x;
            row[kBlock + j] = y;
            sum_k[j] += x * nk;
            sum_q[j] += x * nq;
            odd_k[j] += y * nk1;
            odd_q[j] += y * nq1;
          }
        }
        for (; i < key_dim; ++i) {
          float* row = columns.data() + i * kBlock;
          const float ki = k[i], nk = next_k[i] * next_decay, nq = next_q[i] * next_decay;
#pragma omp simd
          for (int64_t j = 0; j < kBlock; ++j) {
            const float x = row[j] * decay + ki * delta[j];
            row[j] = x;
            sum_k[j] += x * nk;
            sum_q[j] += x * nq;
          }
        }
#pragma omp simd
        for (int64_t j = 0; j < kBlock; ++j) {
          sum_k[j] += odd_k[j];
          sum_q[j] += odd_q[j];
        }
      }
      for (int64_t i = 0; i < key_dim; ++i)
        for (int64_t j = 0; j < width; ++j) fresh[i * value_dim + j] = from_float<scalar_t>(columns[i * kBlock + j]);
    }
    stream_fence();  // decode_token's streamed rows, before step 4's threads and the caller read on
  });
  // 4. the gated norm of each token's head output: torch rounds o to the storage type, norms it in float and rounds,
  // times the weight (rounded), times SiLU(z) in float, rounded
  const scalar_t* nw = norm_weight.data_ptr<scalar_t>();
  at::parallel_for(0, rows * heads, 16, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / heads, h = task % heads;
      float* o = outputs.get() + task * value_dim;
#pragma omp simd
      for (int64_t j = 0; j < value_dim; ++j) o[j] = round_to<scalar_t>(o[j]);
      const float inv_rms = 1.f / std::sqrt(dot(o, o, value_dim) / static_cast<float>(value_dim) + eps);
      const scalar_t* zh = z_rows + r * z.stride(0) + h * value_dim;
      scalar_t* out_h = out_rows + r * out.stride(0) + h * value_dim;
#pragma omp simd
      for (int64_t j = 0; j < value_dim; ++j) {
        const float zj = to_float(zh[j]);
        const float normed = round_to<scalar_t>(to_float(nw[j]) * round_to<scalar_t>(o[j] * inv_rms));
        out_h[j] = from_float<scalar_t>(normed * (zj / (1.f + exp_approx(-zj))));
      }
    }
  });
}

}  // namespace

void gated_delta_forward(at::Tensor out, at::Tensor qkv, at::Tensor z, at::Tensor b, at::Tensor a,
                         at::Tensor conv_pool, at::Tensor state_pool, at::Tensor read_slots, at::Tensor write_slots,
                         at::Tensor query_start_loc, at::Tensor conv_weight, at::Tensor dt_bias, at::Tensor decay_rate,
                         at::Tensor norm_weight, double eps, int64_t key_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && z.stride(1) == 1 && b.stride(1) == 1 && a.stride(1) == 1 &&
                  out.stride(1) == 1, "qkv [T, conv_dim], z and out [T, H V], b and a [T, H], rows contiguous");
  TORCH_CHECK(conv_pool.is_contiguous() && state_pool.is_contiguous() && conv_weight.is_contiguous() &&
                  conv_pool.size(1) == qkv.size(1) && conv_pool.size(2) == conv_weight.size(1) - 1,
              "conv_pool [slots, conv_dim, kernel - 1] and conv_weight [conv_dim, kernel], contiguous");
  TORCH_CHECK(state_pool.dim() == 4 && state_pool.size(1) % key_heads == 0 &&
                  qkv.size(1) == 2 * key_heads * state_pool.size(2) + state_pool.size(1) * state_pool.size(3) &&
                  z.size(1) == state_pool.size(1) * state_pool.size(3) && norm_weight.numel() == state_pool.size(3),
              "state_pool [slots, H, K, V], qkv's width 2 key_heads K + H V, z's H V, norm_weight [V]");
  const at::Tensor starts = query_start_loc.to(at::kLong).contiguous();
  const int64_t seqs = starts.numel() - 1;
  TORCH_CHECK(read_slots.scalar_type() == at::kLong && write_slots.scalar_type() == at::kLong &&
                  read_slots.numel() == seqs && write_slots.numel() == seqs && !starts.is_cuda() &&
                  starts.data_ptr<int64_t>()[seqs] == qkv.size(0) && decay_rate.scalar_type() == at::kFloat &&
                  decay_rate.is_contiguous(),
              "read_slots and write_slots int64 [S] (a read slot of -1: zeros), query_start_loc [S + 1] ending at "
              "T, decay_rate float32 [H]");
  for (const at::Tensor& t : {qkv, z, b, a, conv_pool, state_pool, conv_weight, dt_bias, norm_weight, out})
    TORCH_CHECK(t.scalar_type() == qkv.scalar_type(), "the layer's tensors in one dtype");
  const at::Tensor reads = read_slots.contiguous(), writes = write_slots.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "gated_delta_forward", [&] {
    gated_delta_forward_impl<scalar_t>(out, qkv, z, b, a, conv_pool, state_pool, reads.data_ptr<int64_t>(),
                                       writes.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), seqs, conv_weight,
                                       dt_bias, decay_rate, norm_weight, static_cast<float>(eps), key_heads);
  });
}

}  // namespace pagedllm

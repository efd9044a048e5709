// pagedllm's CPU kernels: the declarations bindings.cpp exposes, and the scalar helpers they share.
//
// Every kernel has a plain torch reference in the Python layer that calls it (the `forward_native` of the layer,
// or pagedllm.attention.torch_ref), and a test comparing the two in float32, bfloat16 and float16.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagedllm {

// Attention (decode_attention.cpp, prefill_attention.cpp, paged_attention.cpp). `window`: 0, or a sliding window
// of that many keys: a query at position p sees the keys at positions (p - window, p] (transformers' and vLLM's
// sliding_window). `softcap`: 0, or Gemma 2's soft-capping of the scaled scores s, cap tanh(s / cap) (`soft_cap`).
// Not `causal` (an encoder's bidirectional attention, EmbeddingGemma's), a query sees the keys after it too: all of
// its context, or with a window those at (p - window, p + window); a decode, the last position, sees the same keys
// either way. `alibi_slopes`: none, or ALiBi's slope of each query head (float32 [num_heads]; BLOOM's, MPT's): the
// scaled (and capped) score of a query at p and a key at k gains slope (k - p), a causal layer's only. `sinks`: none,
// or an attention sink of each query head (float32 [num_heads]; gpt-oss's learned logits): one more term exp(sink)
// in each row's softmax denominator, a key whose value is zero (`sink_term`), so that a row may attend to nothing.
void decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                      at::Tensor seq_lens, double scale, int64_t window, double softcap,
                      const c10::optional<at::Tensor>& alibi_slopes, const c10::optional<at::Tensor>& sinks);
void prefill_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                       at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_start_loc, int64_t first_seq,
                       double scale, int64_t window, double softcap, bool causal,
                       const c10::optional<at::Tensor>& alibi_slopes, const c10::optional<at::Tensor>& sinks);
// A step's attention as pagedllm.attention.cpu.paged_attention runs it: decodes (the first num_decodes sequences)
// through decode_attention, the rest through prefill_attention; when every sequence's context starts with the same
// blocks and `cascade` allows it (never with a window or ALiBi, never without causality), as cascade attention
// (paged_attention.cpp).
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor seq_lens, at::Tensor query_start_loc, int64_t num_decodes, double scale,
                     bool cascade, int64_t window, double softcap, bool causal,
                     const c10::optional<at::Tensor>& alibi_slopes, const c10::optional<at::Tensor>& sinks);
// A per-head tensor's floats (ALiBi's slopes, the sinks), checked against q's heads (nullptr for none): the
// kernels' `alibi` and `sinks`.
const float* head_data(const c10::optional<at::Tensor>& per_head, const at::Tensor& q, const char* what);
// A row's sink in its softmax denominator, whose other terms are exp(s - max): exp(sink - max); 0 without sinks.
inline float sink_term(const float* sinks, int64_t head, float max) {
  return sinks ? std::exp(sinks[head] - max) : 0.f;
}
// The prefix paged_attention runs as cascade attention for this batch: the positions at the start of every
// sequence's context held in the same blocks of every table and seen by every query token, in whole blocks, rounded
// down to a multiple of 64; 0 where a cascade would not pay (paged_attention.cpp).
int64_t cascade_prefix_len(at::Tensor q, at::Tensor k_cache, at::Tensor block_tables, at::Tensor seq_lens,
                           at::Tensor query_start_loc);

// Keys per online-softmax update of prefill_attention (4 tiles of 16), to spread its fixed cost; a cascade's prefix
// is whole chunks of them.
constexpr int64_t kKeyChunk = 64;

// The online-softmax state of every query row (token, query head) of a flat batch over the keys at positions
// [0, prefix_len) of its context: the running max m of its scaled (and capped) scores, the sum l of their
// exp(s - m), and the output row they weigh, not yet divided by l. Cascade attention's prefix part leaves it; its
// suffix parts start from it, so that each row's softmax runs over all its keys as if in one pass.
struct SoftmaxState {
  SoftmaxState(int64_t num_tokens, int64_t num_heads, int64_t head_dim, int64_t prefix_len)
      : prefix_len(prefix_len), max(new float[num_tokens * num_heads]), sum(new float[num_tokens * num_heads]),
        acc(new float[num_tokens * num_heads * head_dim]) {}  // left uninitialised: the prefix part fills them
  int64_t prefix_len;
  std::unique_ptr<float[]> max, sum, acc;  // [num_tokens, num_heads] (acc: [..., head_dim]), rows as in q
};
// Whether prefill_attention scores and weighs in AMX tiles for this query and cache (bf16, head size 64, 128 or 256).
bool prefill_attention_in_tiles(const at::Tensor& q, const at::Tensor& k_cache);
// Cascade attention's parts (paged_attention.cpp runs them): every row of q over the first prefix_len keys of the
// first sequence's blocks (whole kKeyChunks), then the decodes' and the other sequences' rows over the rest of their
// contexts from that state (prefix = nullptr: from no keys, over the whole context, or its window). `alibi`: nullptr,
// or the slopes (`head_data`), never with a prefix; `sinks`: nullptr, or the sinks, which join each row's denominator
// as its output is made (after the prefix's keys and its own).
SoftmaxState prefix_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& query_start_loc, int64_t prefix_len, double scale, double softcap);
void decode_attention_after_prefix(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                                   const float* alibi, const float* sinks, const SoftmaxState* prefix);
void prefill_attention_after_prefix(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache, const at::Tensor& block_tables,
                                    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t first_seq,
                                    double scale, int64_t window, double softcap, const float* alibi,
                                    const float* sinks, const SoftmaxState* prefix, bool causal = true);

// The new tokens' K and V into their cache slots, copied or quantized to int8 rows (cache_write.cpp).
void write_kv(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping);

// Each row's first index of its largest value, or of its first NaN: x.argmax(-1) of x [N, V] float32, bf16 or
// float16, its rows any stride apart (sampling.cpp).
at::Tensor argmax_rows(const at::Tensor& x);
// Each row's token drawn from softmax(x / temperature), filtered by its top-k, top-p and min-p, by inverse CDF with
// its uniform u: x [N, V] float32, bf16 or float16 (rows any stride apart), temperature, uniform, top_p and min_p
// [N] float32, top_k [N] int64 (>= V: off); a filter left out is off for every row (sampling.cpp).
at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& temperature, const at::Tensor& uniform,
                       const c10::optional<at::Tensor>& top_k, const c10::optional<at::Tensor>& top_p,
                       const c10::optional<at::Tensor>& min_p);
// Each row's verdict on its draft token (draft_ids [N] int64; -1: none, a bonus row) against the distribution
// sample_rows draws from: accepted [N] bool where uniform[r, 0] < p(draft), and recovered [N] int64, the token drawn
// with uniform[r, 1] ([N, 2] float32) from p without the draft (from p on a bonus row): rejection sampling of a
// point-mass draft (sampling.cpp).
std::tuple<at::Tensor, at::Tensor> verify_rows(const at::Tensor& x, const at::Tensor& temperature,
                                               const at::Tensor& uniform, const at::Tensor& draft_ids,
                                               const c10::optional<at::Tensor>& top_k,
                                               const c10::optional<at::Tensor>& top_p,
                                               const c10::optional<at::Tensor>& min_p);
// Each row's log-softmax (normalize; else its values) at token_ids [N] int64 and at its num largest values, the
// largest first (equal ones by index), and the token's rank, 1 + the number of larger values: (ids [N, 1 + num]
// int64, the token first; values [N, 1 + num] float32; ranks [N] int64) of x [N, V] float32, bf16 or float16
// (sampling.cpp).
std::tuple<at::Tensor, at::Tensor, at::Tensor> row_logprobs(const at::Tensor& x, const at::Tensor& token_ids,
                                                            int64_t num, bool normalize);
// Each rows[i] of float32 logits [N, V] to -inf where bit t of bitmask row i (int32 [R, W], bit j of word w: token
// 32 w + j) is 0, and past its 32 W tokens (sampling.cpp).
void apply_token_bitmask(at::Tensor logits, const at::Tensor& rows, const at::Tensor& bitmask);
// The penalties in place on float32 logits [N, V], as pagedllm.sample.ops.apply_penalties: each row's tokens seen
// (prompt_ids[prompt_starts[i]:prompt_starts[i + 1]] and the output's likewise, int64; ids outside [0, V) ignored)
// divided (positive) or multiplied by its repetition, then frequency x the times generated and presence subtracted
// (sampling.cpp).
void apply_penalties(at::Tensor logits, const at::Tensor& prompt_ids, const at::Tensor& prompt_starts,
                     const at::Tensor& output_ids, const at::Tensor& output_starts, const at::Tensor& repetition,
                     const at::Tensor& frequency, const at::Tensor& presence);

// Layers (layers.cpp).
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor out, at::Tensor residual_out, at::Tensor x, at::Tensor residual,
                        at::Tensor weight, double eps);
void silu_and_mul(at::Tensor out, at::Tensor x);
// silu_and_mul's bits for `rows` rows of x [rows, 2 d] into out [rows, d], contiguous, on the calling thread (T:
// float or bf16)
template <typename T>
void silu_and_mul_rows(T* out, const T* x, int64_t rows, int64_t d);
void gelu_and_mul(at::Tensor out, at::Tensor x);  // GELU's tanh approximation (Gemma's gelu_pytorch_tanh)
// A Mamba-2 layer's decode step after in_proj (mamba.cpp): out [S, inner] = the gated norm of its recurrence's
// output; each sequence's states read from slot read_slots[s] of the pools (-1: zeros) and written to write_slots[s]
// A sequence's L tokens through a Mamba-2 layer's recurrence (mamba.cpp), float32: x [L, H, P], dt [L, H] (softplus,
// clamped), a [H], b and c [L, G, N], initial [H, P, N] or none (zeros) -> y [L, H, P] (no D term), final_state
void mamba2_scan(at::Tensor y, at::Tensor final_state, at::Tensor x, at::Tensor dt, at::Tensor a, at::Tensor b,
                 at::Tensor c, c10::optional<at::Tensor> initial);
void mamba2_decode(at::Tensor out, at::Tensor xbc, at::Tensor dt, at::Tensor gate, at::Tensor conv_pool,
                   at::Tensor ssm_pool, at::Tensor read_slots, at::Tensor write_slots, at::Tensor conv_weight,
                   c10::optional<at::Tensor> conv_bias, at::Tensor dt_bias, at::Tensor a, at::Tensor d,
                   at::Tensor norm_weight, double eps, int64_t groups, double dt_min, double dt_max);
// A Gated DeltaNet layer after in_proj for a step's sequences (deltanet.cpp), their rows query_start_loc [S + 1]
// (int64, on the CPU): out [T, H V] = the gated norm of each token's value heads' outputs; each sequence's states read
// from slot read_slots[s] of the pools (-1: zeros) and written to write_slots[s]; decay_rate [H] float32 = -exp(A_log)
void gated_delta_forward(at::Tensor out, at::Tensor qkv, at::Tensor z, at::Tensor b, at::Tensor a,
                         at::Tensor conv_pool, at::Tensor state_pool, at::Tensor read_slots, at::Tensor write_slots,
                         at::Tensor query_start_loc, at::Tensor conv_weight, at::Tensor dt_bias, at::Tensor decay_rate,
                         at::Tensor norm_weight, double eps, int64_t key_heads);
// out = LayerNorm(x + residual) (BERT's post-norm; residual may be a row broadcast, stride 0): the sum rounded to
// x's type, as torch adds, then normalised in float
void add_layer_norm(at::Tensor out, at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight,
                    at::Tensor bias, double eps);
void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos_cache, at::Tensor sin_cache);

// Linear layers on a prepacked weight (linear.cpp).
at::Tensor pack_linear_weight(at::Tensor weight);
void linear_packed(at::Tensor out, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias,
                   c10::optional<at::Tensor> scale);
// linear_packed's bits for float32 rows x [m, k] (`ld` apart) into out [m, n] (rows `out_stride` apart), no bias,
// all on the calling thread: a mixture of experts' units (moe.cpp). `scale`: an int8 weight's [N] row scales.
void linear_packed_on_thread(c10::BFloat16* out, int64_t out_stride, int64_t n, const float* x, int64_t ld,
                             int64_t m, int64_t k, const at::Tensor& packed, const float* scale);
void linear_packed_on_thread(float* out, int64_t out_stride, int64_t n, const float* x, int64_t ld, int64_t m,
                             int64_t k, const at::Tensor& packed, const float* scale);

// GGUF's Q8_0, Q4_0 and Q4_1 blocks times activations quantized to 16 (or 8) bits per 32 k's (linear_gguf.cpp),
// or (activation_bits = 0) times x in bf16, the blocks dequantised to bf16, in AMX tiles (linear_gguf_amx.cpp) where
// gguf_bf16_tiles_available(), else in AVX512-BF16 vectors (linear_gguf_bf16.cpp): where gguf_bf16_available().
void linear_gguf(at::Tensor out, at::Tensor x, at::Tensor packed, int64_t ggml_type, c10::optional<at::Tensor> bias,
                 int64_t activation_bits);
bool gguf_bf16_available();
bool gguf_bf16_tiles_available();
// A GGUF Q4_0, Q4_1 or Q8_0 weight's rows of blocks regrouped in the layout linear_gguf reads (linear_gguf.cpp).
at::Tensor pack_gguf_weight(at::Tensor rows, int64_t ggml_type);
// silu(x W_gate^T) * (x W_up^T) for a packed weight of 2 N columns (gate's N, then up's), N a multiple of 16: the
// bits of linear_gguf (activation_bits = 0) then silu_and_mul, with the product stored once (linear_gguf_bf16.cpp).
// Runs where gguf_bf16_available().
void linear_gguf_silu_and_mul(at::Tensor out, at::Tensor x, at::Tensor packed, int64_t ggml_type,
                              c10::optional<at::Tensor> bias);

// W8A8: int8 weights times int8 activations, quantized per row in the call, summed in int32 (linear_int8.cpp).
std::tuple<at::Tensor, at::Tensor> pack_w8a8_weight(at::Tensor q);
void linear_w8a8(at::Tensor out, at::Tensor x, at::Tensor packed, at::Tensor col_sums, at::Tensor w_scale,
                 c10::optional<at::Tensor> bias);
// The buffers a W8A8 call quantizes x into: one thread's own, for linear_w8a8_on_thread's calls.
struct W8A8Scratch {
  std::vector<uint8_t> quantized;
  std::vector<float> x_scale, v;
};
// linear_w8a8's bits for x [m, k] (contiguous) into out [m, n] (rows `out_stride` apart), no bias, all on the
// calling thread: a mixture of experts' units (moe.cpp). T: float or bf16.
template <typename T>
void linear_w8a8_on_thread(T* out, int64_t out_stride, int64_t n, const T* x, int64_t m, int64_t k,
                           const int8_t* packed, const int32_t* col_sums, const float* w_scale, W8A8Scratch& scratch);

// bf16 weights in torch's brgemm blocks times bf16 x (linear_brgemm.cpp), where torch's brgemm packs bf16.
bool brgemm_bf16_available();
at::Tensor pack_brgemm_weight(at::Tensor weight);
void linear_brgemm(at::Tensor out, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias);
// linear_brgemm's bits for x [m, k] (rows `x_stride` apart) into out [m, n] (rows `out_stride` apart), no bias, all
// on the calling thread, which owns `acc` (kBrgemmAccFloats floats) and calls brgemm_release once it is done with
// brgemm: a mixture of experts' units (moe.cpp), without a tensor or a fork a call.
constexpr int64_t kBrgemmAccFloats = 64 * 64;
void linear_brgemm_on_thread(c10::BFloat16* out, int64_t out_stride, int64_t n, const c10::BFloat16* x,
                             int64_t x_stride, int64_t m, int64_t k, const c10::BFloat16* packed, float* acc);
void brgemm_release();

// A linear layer's weight as pagedllm.layers.linear.linear takes it (GGUF blocks, pagedllm's packed layouts, oneDNN's
// or a plain [out, in] weight), with the bias the kernel adds and the one added after it (a row-parallel layer's).
struct LinearWeights {
  at::Tensor weight;
  int64_t out_features;
  c10::optional<at::Tensor> bias, row_bias, scale, col_sums, input_perm;
  int64_t ggml_type, activation_bits;
  bool brgemm;  // weight from pack_brgemm_weight
  // GGUF blocks: the activation bits of a call of at most kFewRows rows, where they differ (an expert's:
  // pagedllm.layers.linear.few_rows_activation_bits)
  c10::optional<int64_t> few_rows_activation_bits;

  LinearWeights(at::Tensor weight, int64_t out_features, c10::optional<at::Tensor> bias,
                c10::optional<at::Tensor> row_bias, c10::optional<at::Tensor> scale, c10::optional<at::Tensor> col_sums,
                c10::optional<at::Tensor> input_perm, int64_t ggml_type, int64_t activation_bits, bool brgemm,
                c10::optional<int64_t> few_rows_activation_bits);
  // pagedllm.layers.linear.gguf_call_bits: the activation bits of a call of `rows` rows on GGUF blocks
  int64_t call_bits(int64_t rows) const;
  at::Tensor operator()(at::Tensor x) const;  // x [T, in] -> [T, out]
  // silu_and_mul of operator()(x) for a gate_up projection: x [T, in] -> [T, out / 2], in one kernel where
  // pagedllm.layers.linear.fuses_silu_and_mul says so (GGUF blocks in AMX tiles).
  at::Tensor silu_and_mul(const at::Tensor& x) const;
};

// The gated activation of a mixture's experts: SiLU-and-mul (limit = 0), or gpt-oss's clamped SwiGLU,
// (clamp(up, -limit, limit) + 1) g sigmoid(alpha g) with g = min(gate, limit): `swiglu_oai`.
struct ExpertActivation {
  double alpha = 0.0, limit = 0.0;
};
// gpt-oss's clamped SwiGLU of x [T, 2 d] (gate, then up) -> [T, d], in pagedllm.layers.activation.SwigluOAI's ops.
at::Tensor swiglu_oai(const at::Tensor& x, double alpha, double limit);

// sum_j weights[t, j] experts[ids[t, j]](x[t]) for x [T, H], weights [T, top_k] float32, ids [T, top_k] int64, each
// expert down(act(gate_up(x))), `activation` act: pagedllm.layers.moe.run_experts, the experts split between the
// threads (moe.cpp).
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                       const std::vector<LinearWeights>& gate_up, const std::vector<LinearWeights>& down,
                       double swiglu_alpha, double swiglu_limit);

// A mixture of experts' MLP (pagedllm.models.llama.LlamaSparseMoeBlock on one rank): the router's weight [E, H] (the
// rows cast to its dtype), its top_k, whether it renormalises (by a sum of at least norm_min, plus norm_eps), the
// experts' projections, a shared expert with its gate's [1, H] weight or ungated, a bias ([E] or [1, E]) of the
// experts' choice, whether the scores are sigmoids (not a softmax), and a scale of the weights; the router's own
// bias [E] (gpt-oss's) and the experts' activation (gpt-oss's clamped SwiGLU, or SiLU-and-mul).
struct MoEWeights {
  at::Tensor router;
  int64_t top_k;
  bool renormalize;
  std::vector<LinearWeights> gate_up, down;
  c10::optional<LinearWeights> shared_gate_up, shared_down;
  c10::optional<at::Tensor> shared_gate, selection_bias;
  double norm_min;
  bool sigmoid;
  double norm_eps, scale;
  c10::optional<at::Tensor> router_bias;
  ExpertActivation activation;
  // DeepSeek's groups of experts (pagedllm.layers.moe.Routing's groups, kept_groups, group_top2)
  int64_t groups, kept_groups;
  bool group_top2;

  MoEWeights(at::Tensor router, int64_t top_k, bool renormalize, std::vector<LinearWeights> gate_up,
             std::vector<LinearWeights> down, c10::optional<LinearWeights> shared_gate_up,
             c10::optional<LinearWeights> shared_down, c10::optional<at::Tensor> shared_gate,
             c10::optional<at::Tensor> selection_bias, double norm_min, bool sigmoid, double norm_eps,
             double scale, c10::optional<at::Tensor> router_bias, double swiglu_alpha, double swiglu_limit,
             int64_t groups, int64_t kept_groups, bool group_top2);
  at::Tensor operator()(const at::Tensor& h) const;  // h [T, H] -> [T, H]
};

// A decoder layer's weights: its MLP's gate_up and down (an ungated MLP's fc1 and fc2), or a mixture of experts
// (`moe`); its attention's sliding window (0: none) and its rotary embedding's tables.
struct DecoderLayerWeights {
  // input_norm: none for a layer that norms its branches' outputs instead (OLMo's, EXAONE 4's: post_attention_norm
  // the attention's, post_feedforward_norm the MLP's). post_attention_norm: none for parallel branches under one norm
  // (Phi's); with parallel branches, the MLP's norm of the layer's input stream (GPT-NeoX's)
  c10::optional<at::Tensor> input_norm, post_attention_norm;
  LinearWeights qkv, o;
  c10::optional<LinearWeights> gate_up, down;
  // RMSNorm weights over each query and key head (Qwen3's: [head_dim]) or over all of them at once (OLMo's:
  // [heads x head_dim])
  c10::optional<at::Tensor> q_norm, k_norm;
  c10::optional<MoEWeights> moe;
  int64_t sliding_window;
  at::Tensor cos_cache, sin_cache;
  // Gemma 3's: post_attention_norm then norms the attention's output, pre_feedforward_norm the residual stream for
  // the MLP, post_feedforward_norm the MLP's output; and its MLP's GELU (tanh) in place of SiLU
  c10::optional<at::Tensor> pre_feedforward_norm, post_feedforward_norm;
  // the MLP's activation: gated ("silu_and_mul", Gemma's "gelu_and_mul") or of an ungated MLP ("gelu", "gelu_tanh",
  // "relu", "relu2")
  std::string activation;
  // LFM2's short convolution in place of the attention: its taps [H, L] (qkv then holds its in_proj, o its out_proj),
  // its tokens' inputs in `pool_layers` layers of the KV pool (an attention's K/V: one)
  c10::optional<at::Tensor> conv;
  int64_t pool_layers;
  // a LayerNorm model's (StableLM's, Phi's, GPT-NeoX's, ...): the biases of input_norm and post_attention_norm, which
  // are then LayerNorms; and whether the attention and the MLP both read the layer's input stream, their outputs
  // joining it together
  c10::optional<at::Tensor> input_norm_bias, post_attention_norm_bias;
  bool parallel;
  // the attention's sink of each query head (gpt-oss's), or none
  c10::optional<at::Tensor> sinks;
};

using KVPair = std::tuple<at::Tensor, at::Tensor>;  // one layer's (k_cache, v_cache)

// A Llama-family decoder's layers and final norm in one call (decoder.cpp): pagedllm.models.llama's modules, with
// the CPU attention backend, on one rank.
class DecoderStack {
 public:
  // softcap: 0, or the soft cap of every layer's attention scores (Gemma 2's); causal: false for an encoder's layers;
  // norm_bias: the final norm's bias, a LayerNorm model's (its final norm then a LayerNorm); clip_qkv: 0, or the bound
  // each layer's q, k and v are clamped to (OLMo's); qk_norm_after_rope: each head's q/k norms after the rotary
  // embedding (Hunyuan's), not before; alibi_slopes: ALiBi's slope of each query head, every layer's (BLOOM's, MPT's);
  // query_beta, query_original: 0, or Ministral 3's temperature of the queries, each scaled after the rotary embedding
  // by 1 + query_beta ln(1 + floor(position / query_original))
  DecoderStack(std::vector<DecoderLayerWeights> layers, at::Tensor norm, double eps, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, double scale, double softcap, bool causal,
               c10::optional<at::Tensor> norm_bias, double clip_qkv, bool qk_norm_after_rope,
               c10::optional<at::Tensor> alibi_slopes, double query_beta, int64_t query_original);
  // x: the embedded tokens [T, H]; the batch as pagedllm.attention.metadata.AttentionMetadata holds it, decodes first.
  at::Tensor forward(at::Tensor x, const at::Tensor& positions, const std::vector<KVPair>& kv_caches,
                     at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                     at::Tensor query_start_loc, int64_t num_decodes, bool cascade) const;

 private:
  struct StepBatch {
    at::Tensor slot_mapping, block_tables, seq_lens, query_start_loc;
    int64_t num_decodes;
    bool cascade;
  };
  at::Tensor attention(const DecoderLayerWeights& layer, const at::Tensor& h, const at::Tensor& positions,
                       const KVPair& kv_cache, const StepBatch& batch) const;
  // each token's block and offset `back` positions earlier, and whether that is before its sequence (LFM2's)
  using EarlierSlots = std::map<int64_t, std::tuple<at::Tensor, at::Tensor, at::Tensor>>;
  at::Tensor mixer(const DecoderLayerWeights& layer, const at::Tensor& h, const at::Tensor& positions,
                   const std::vector<KVPair>& caches, const StepBatch& batch, EarlierSlots& earlier) const;
  at::Tensor short_conv(const DecoderLayerWeights& layer, const at::Tensor& h, const at::Tensor& positions,
                        const std::vector<KVPair>& caches, const StepBatch& batch, EarlierSlots& earlier) const;
  at::Tensor head_norm(const at::Tensor& heads, const at::Tensor& weight) const;
  at::Tensor output_norm_layer(const DecoderLayerWeights& layer, const at::Tensor& x, at::Tensor& residual,
                               const at::Tensor& positions, const std::vector<KVPair>& caches,
                               const StepBatch& batch, EarlierSlots& earlier) const;
  at::Tensor mlp(const DecoderLayerWeights& layer, const at::Tensor& h) const;
  // RMSNorm, or LayerNorm where a bias is given; add_norm: of x + residual, returning (the norm, the sum)
  at::Tensor norm(const at::Tensor& x, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias = c10::nullopt) const;
  std::pair<at::Tensor, at::Tensor> add_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                             const c10::optional<at::Tensor>& bias) const;

  std::vector<DecoderLayerWeights> layers_;
  at::Tensor norm_;
  c10::optional<at::Tensor> norm_bias_, alibi_slopes_;
  double eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_, softcap_, clip_qkv_, query_beta_;
  int64_t query_original_;
  bool causal_, qk_norm_after_rope_;
};

// shm.cpp: the collectives of tensor-parallel ranks on one machine; each returns the last round number it used.
void shm_register(at::Tensor segment, int64_t rank, int64_t world, int64_t pid);
int64_t shm_all_reduce(at::Tensor segment, at::Tensor x, int64_t rank, int64_t world, int64_t seq, double timeout_s);
int64_t shm_gather(at::Tensor segment, at::Tensor x, c10::optional<at::Tensor> out, int64_t rank, int64_t world,
                   int64_t seq, double timeout_s);

// A paged KV cache as raw pointers, for the attention kernels: position `pos` of sequence `seq` lives in block
// table(seq)[pos / block_size] at offset pos % block_size. The caches are [num_blocks, block_size, num_kv_heads,
// head_dim] with any strides in the first three dims (e.g. views of one tensor holding every layer). An int8 cache
// (kv_cache_dtype="int8") is [..., head_dim + 4]: each row's head_dim values q, then the float32 scale s of that
// (token, kv head), the value being q * s (see load_row and pagedllm.attention.torch_ref.quantize_kv).
template <typename cache_t>
struct PagedCache {
  const cache_t* k;
  const cache_t* v;
  int64_t block_size, num_kv_heads;
  int64_t k_block, k_token, k_head, v_block, v_token, v_head;  // strides
  const int32_t* block_tables;
  int64_t max_blocks;
  const int32_t* seq_lens;

  PagedCache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& lens)
      : k(k_cache.data_ptr<cache_t>()), v(v_cache.data_ptr<cache_t>()), block_size(k_cache.size(1)),
        num_kv_heads(k_cache.size(2)), k_block(k_cache.stride(0)), k_token(k_cache.stride(1)),
        k_head(k_cache.stride(2)), v_block(v_cache.stride(0)), v_token(v_cache.stride(1)), v_head(v_cache.stride(2)),
        block_tables(tables.data_ptr<int32_t>()), max_blocks(tables.size(1)), seq_lens(lens.data_ptr<int32_t>()) {}

  const int32_t* table(int64_t seq) const { return block_tables + seq * max_blocks; }
  const cache_t* key(const int32_t* table, int64_t pos, int64_t head) const {
    return k + table[pos / block_size] * k_block + (pos % block_size) * k_token + head * k_head;
  }
  const cache_t* value(const int32_t* table, int64_t pos, int64_t head) const {
    return v + table[pos / block_size] * v_block + (pos % block_size) * v_token + head * v_head;
  }
};

// Units of work [0, n) in one contiguous range per thread: thread `part` takes units from the front of its own
// range, then, once that is empty, from the back of the others'. A thread that runs slower than its partner ends up
// with fewer units (a VM's two cores do not always run at one speed: on the AMX Xeon the kernels' static splits left
// one thread waiting for the other ~10% of a run in some hours, none in others), while each thread still walks
// mostly its own contiguous run (what it has in cache, or has dequantised, stays useful). parallel_units runs
// body(take) on each of `parts` threads, take() giving the thread's next unit, or -1 when none is left.
class UnitRanges {
 public:
  UnitRanges(int64_t n, int64_t parts) : parts_(parts), ranges_(new Range[parts]) {
    for (int64_t i = 0; i < parts; ++i) ranges_[i].bounds.store(pack(n * i / parts, n * (i + 1) / parts));
  }
  int64_t take(int64_t part) {
    if (const int64_t u = take_from(part, true); u >= 0) return u;
    for (int64_t i = 1; i < parts_; ++i) {
      if (const int64_t u = take_from((part + i) % parts_, false); u >= 0) return u;
    }
    return -1;
  }

 private:
  struct alignas(64) Range {
    std::atomic<uint64_t> bounds;  // front in the low 32 bits, back (one past the last unit) in the high ones
  };
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(back) << 32 | static_cast<uint64_t>(front);
  }
  int64_t take_from(int64_t r, bool front) {
    uint64_t bounds = ranges_[r].bounds.load(std::memory_order_relaxed);
    while (true) {
      const int64_t lo = static_cast<int64_t>(bounds & 0xFFFFFFFFu), hi = static_cast<int64_t>(bounds >> 32);
      if (lo >= hi) return -1;
      if (ranges_[r].bounds.compare_exchange_weak(bounds, front ? pack(lo + 1, hi) : pack(lo, hi - 1),
                                                  std::memory_order_relaxed)) {
        return front ? lo : hi - 1;
      }
    }
  }
  int64_t parts_;
  std::unique_ptr<Range[]> ranges_;
};

template <typename Body>
void parallel_units(int64_t n, int64_t parts, const Body& body) {
  parts = std::max<int64_t>(1, std::min(parts, n));  // a part with no units of its own would only steal
  UnitRanges ranges(n, parts);
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) body([&] { return ranges.take(part); });
  });
}

// Asks for the cache line holding p, towards L1 (kLevel 0) or L2 (1). In asm: GCC judged helpers made of
// `__builtin_prefetch` or `_mm_prefetch` calls free of side effects and dropped their calls (check with objdump).
template <int kLevel>
inline void prefetch_line(const void* p) {
  static_assert(kLevel == 0 || kLevel == 1);
#if defined(__x86_64__)
  if constexpr (kLevel == 0) asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  else asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 3 - kLevel);
#endif
}

// Copies `bytes` (whole 64-byte lines, both ends 64-byte aligned) from src to dst with non-temporal stores, which
// write the lines to memory without reading them first: a normal store to a line not in cache reads it in to
// modify it (the Gated DeltaNet decode's write slots, 16 MB a layer, read for nothing). Weakly ordered: the thread
// calls stream_fence() before its other threads may read dst.
inline void stream_lines(void* dst, const void* src, size_t bytes) {
  char* to = static_cast<char*>(dst);
  const char* from = static_cast<const char*>(src);
#if defined(__AVX512F__)
  for (size_t o = 0; o < bytes; o += 64)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(to + o), _mm512_load_si512(from + o));
#elif defined(__AVX__)
  for (size_t o = 0; o < bytes; o += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(to + o),
                        _mm256_load_si256(reinterpret_cast<const __m256i*>(from + o)));
#elif defined(__x86_64__)
  for (size_t o = 0; o < bytes; o += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + o), _mm_load_si128(reinterpret_cast<const __m128i*>(from + o)));
#else
  std::memcpy(to, from, bytes);
#endif
}

inline void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

#if defined(__AVX512F__)
// dst row p (64 bytes) = pair p (dword p at byte `offset`) of each of the 16 rows: a 16 x 16 transpose of dwords,
// which makes 16 rows of bf16 pairs an AMX B operand (linear_gguf_amx.cpp's x, prefill_attention.cpp's keys).
inline void transpose_pairs(const uint8_t* const (&rows)[16], int64_t offset, uint8_t* dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows[i] + offset);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4 q + s]: lane l holds dword 4 l + s' of rows 4 q .. 4 q + 3 (s' = 0, 1, 2, 3 for s = 0, 1, 2, 3).
  for (int s = 0; s < 4; ++s) {
    const __m512i a = _mm512_shuffle_i32x4(r[s], r[4 + s], 0x88), b = _mm512_shuffle_i32x4(r[s], r[4 + s], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + s], r[12 + s], 0x88);
    const __m512i e = _mm512_shuffle_i32x4(r[8 + s], r[12 + s], 0xDD);
    t[s] = _mm512_shuffle_i32x4(a, c, 0x88);       // lanes: pair s of rows 0-3, 4-7, 8-11, 12-15
    t[8 + s] = _mm512_shuffle_i32x4(a, c, 0xDD);   // pair 8 + s
    t[4 + s] = _mm512_shuffle_i32x4(b, e, 0x88);   // pair 4 + s
    t[12 + s] = _mm512_shuffle_i32x4(b, e, 0xDD);  // pair 12 + s
  }
  for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + p * 64, t[p]);
}
#endif

#if defined(__AVX512BF16__)
// Rows of n weights (n apart) rounded to bf16, each padded with zeros to `stride` (a multiple of 32): word i of a
// row holds the weights of its keys 2i and 2i + 1, the operand a pair of value rows is weighed with (the attention
// kernels' p, as vdpbf16ps or AMX tiles take it).
inline void round_rows_to_bf16(const float* p, int64_t rows, int64_t n, int64_t stride, c10::BFloat16* dst) {
  const auto mask = [](int64_t left) {
    return static_cast<__mmask16>(left >= 16 ? 0xFFFF : left <= 0 ? 0 : (1 << left) - 1);
  };
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t < stride; t += 32) {
      const float* src = p + r * n + t;
      const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(mask(n - t - 16), src + 16),
                                                _mm512_maskz_loadu_ps(mask(n - t), src));
      _mm512_storeu_si512(dst + r * stride + t, reinterpret_cast<__m512i>(both));
    }
  }
}
#endif

#if defined(__AMX_TILE__)
// AMX (Sapphire Rapids and later): tile registers, used by linear_int8.cpp (W8A8), linear_gguf_amx.cpp and
// prefill_attention.cpp.
// Whether Linux lets this process use them: it grants them on request, once (torch's oneDNN asks the same way).
inline bool amx_granted() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

constexpr int kAmxRows = 16;        // rows of a tile
constexpr int64_t kAmxRowBytes = 64;  // bytes of a tile's row

// Tiles 0 .. count - 1 as 16 rows of 64 bytes each (`ldtilecfg`'s 64-byte operand), for this thread until
// `_tile_release`.
inline void configure_tiles(int count) {
  struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < count; ++t) config.rows[t] = kAmxRows, config.colsb[t] = kAmxRowBytes;
  asm volatile("" : : "r"(&config) : "memory");  // GCC's ldtilecfg does not tell it the stores above are read
  _tile_loadconfig(&config);
}
#endif

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

// The scale of a cached K or V row of n values: an int8 row's float32 after its values, 1 for a float type's.
template <typename cache_t>
inline float row_scale(const cache_t* row, int64_t n) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    float scale;
    std::memcpy(&scale, row + n, sizeof(scale));
    return scale;
  } else {
    return 1.f;
  }
}

// Widen one cached K or V row of n values to float: a float type by conversion, an int8 row (n values, then its
// float32 scale) by q * s, the product torch's dequantization computes, so both give the same floats.
template <typename cache_t>
inline void load_row(const cache_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}
inline void load_row(const int8_t* src, float* dst, int64_t n) {
  const float scale = row_scale(src, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

// a . b over n floats, summed in 16 lanes (each over every 16th product, in order) then across them. Written out
// rather than as an `omp simd reduction`, which GCC left a scalar chain when inlined into the Gated DeltaNet
// kernel's token loop (its q and k norms and the gated norm: 1.1x slower prompts there).
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
#pragma omp simd
    for (int64_t j = 0; j < 16; ++j) lanes[j] += a[i + j] * b[i + j];
  }
  float sum = 0.f;
  for (int64_t j = 0; j < 16; ++j) sum += lanes[j];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Run body.template operator()<cache_t>() with cache_t = int8_t for an int8 cache, else the query's scalar_t; the
// caches must match the query: same float type, or int8 rows of head_dim + 4.
template <typename scalar_t, typename Body>
inline void dispatch_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, Body&& body) {
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must have one dtype");
  if (k_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(k_cache.size(3) == q.size(2) + 4 && v_cache.size(3) == q.size(2) + 4,
                "an int8 cache holds head_dim values and a float32 scale per row");
    return body.template operator()<int8_t>();
  }
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "the caches must have the query's dtype, or int8");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && v_cache.size(3) == q.size(2), "the caches' head_dim must be q's");
  body.template operator()<scalar_t>();
}

// x rounded to the nearest integer, ties to even (as std::nearbyint and torch.round), for |x| < 2^22: adding 1.5 x
// 2^23 leaves no fraction bits, and taking it away again is exact. std::nearbyint vectorises with AVX-512 but stays
// a scalar instruction in AVX2 loops, which made SiLU-and-mul 20x slower there.
constexpr float kRoundToInt = 12582912.0f;  // 1.5 x 2^23
inline float round_half_even(float x) { return (x + kRoundToInt) - kRoundToInt; }

// exp(x) in float, to within ~2 ulp, written so that `#pragma omp simd` loops over it vectorise: std::exp stays
// a scalar call there (glibc declares its vector variants only under -ffast-math). Cephes' expf: x = n ln2 + r,
// |r| <= ln2 / 2, exp(r) by a degree-7 polynomial, 2^n put into the exponent bits.
namespace expf_constants {
// Below kLowest exp gives 0: at -87 every result of the reduction is still a normal float (n = -126 needs r >= 0.34
// there: p >= 1.4), where at float's own bound (-87.34) a masked -inf lane came out denormal (0.99999 x 2^-126), and
// an instruction that makes a denormal takes a microcode assist: on partly masked softmax chunks the exps of the
// AVX2 prefill kernel ran several times slower. exp overflows past kHighest.
constexpr float kLowest = -87.f, kHighest = 88.3762626647949f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;  // ln 2 = high + low, high exact in 10 bits
constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace expf_constants

inline float exp_approx(float x) {
  using namespace expf_constants;
  const float clamped = std::min(std::max(x, kLowest), kHighest);
  const float n = round_half_even(clamped * kLog2e);
  const float r = clamped - n * kLn2High - n * kLn2Low;
  float p = kPoly[0];
  p = p * r + kPoly[1];  // written out: the `omp simd` loops around it need not rely on a loop's unrolling
  p = p * r + kPoly[2];
  p = p * r + kPoly[3];
  p = p * r + kPoly[4];
  p = p * r + kPoly[5];
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const float value = p * scale;  // computed whatever x, so that the select below is branch-free (AVX2 has no masks)
  return x < kLowest ? 0.f : value;  // below that, exp is about float's smallest normal or less (and exp(-inf) = 0)
}

// Soft-capping (Gemma 2's attention scores) in place: s = cap tanh(s / cap) over n scores, cap > 0, tanh(y) taken
// as 1 - 2 / (e^(2y) + 1) with exp_approx (whose clamp gives +-1 for a large |y|). torch's tanh differs: its bits
// within a rounding or so of the cap.
inline void soft_cap(float* s, int64_t n, float cap) {
  const float two_over_cap = 2.f / cap, two_cap = 2.f * cap;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) s[i] = cap - two_cap / (exp_approx(s[i] * two_over_cap) + 1.f);
}

#if defined(__AVX512F__)
// exp_approx of 16 values, none NaN or above kHighest, 2^n put in by vscalefps; below kLowest it gives exp(kLowest)
// where exp_approx gives 0 (the callers mask such lanes: a -inf one).
inline __m512 exp_approx16(__m512 x) {
  using namespace expf_constants;
  const __m512 clamped = _mm512_max_ps(x, _mm512_set1_ps(kLowest));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), clamped);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kPoly[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// exp_approx of 8 values, as exp_approx computes it: 0 below kLowest (-inf included), NaN kept a NaN (max and min
// return their second operand where either is NaN).
inline __m256 exp_approx8(__m256 x) {
  using namespace expf_constants;
  const __m256 clamped = _mm256_min_ps(_mm256_set1_ps(kHighest), _mm256_max_ps(_mm256_set1_ps(kLowest), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), clamped);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kPoly[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 value = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_and_ps(value, _mm256_cmp_ps(x, _mm256_set1_ps(kLowest), _CMP_NLT_UQ));
}
#endif

// The largest of n > 0 floats: a max per lane of 16, then a tree across the lanes. A plain `reduction(max : m)`
// loop over std::max stays one chain of scalar vmaxss (GCC keeps std::max's order for NaN), 4 cycles a value: it
// was a fifth of the decode kernel's time.
inline float max_of(const float* x, int64_t n) {
  constexpr int64_t kLanes = 16;
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, -std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] = std::max(lanes[l], x[i + l]);
  }
  for (int64_t l = 0; i + l < n; ++l) lanes[l] = std::max(lanes[l], x[i + l]);
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t l = 0; l < width; ++l) lanes[l] = std::max(lanes[l], lanes[l + width]);
  }
  return lanes[0];
}

// Round a float to the storage type and back: where torch would store an intermediate result.
template <typename scalar_t>
inline float round_to(float x) {
  return to_float(from_float<scalar_t>(x));
}

// SiLU-and-mul of one gate and up value as torch computes it in scalar_t: silu(g) = g / (1 + exp(-g)), rounded to
// the storage type, times up. layers.cpp's silu_and_mul and the GGUF tiles' fused store (linear_gguf_amx.cpp) share
// it, so that both give the same bits.
template <typename scalar_t>
inline float silu_times(float gate, float up) {
  return round_to<scalar_t>(gate / (1.f + exp_approx(-gate))) * up;
}

// GELU-and-mul, GELU's tanh approximation: gelu(g) = g (1 + tanh(y)) / 2 with y = sqrt(2 / pi) (g + 0.044715 g^3),
// taken as g / (1 + exp(-2 y)) (the same value: (1 + tanh(y)) / 2 is the logistic of 2 y), rounded to the storage
// type, times up. torch's tanh and its order of operations differ: its bits within a rounding or so.
template <typename scalar_t>
inline float gelu_tanh_times(float gate, float up) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  const float y = kSqrt2OverPi * (gate + 0.044715f * gate * gate * gate);
  return round_to<scalar_t>(gate / (1.f + exp_approx(-2.f * y))) * up;
}

}  // namespace pagedllm

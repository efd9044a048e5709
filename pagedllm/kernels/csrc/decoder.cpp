// A Llama-family decoder's layers in one call: what pagedllm/models/llama.py's modules do, from C++.
//
// The modules call these same kernels one at a time from Python: ~15 calls a layer, each behind a module call, a
// kernel lookup, argument conversion and a Python allocation, ~3-5 ms of a ~16 ms one-stream decode step on SmolLM2's
// 30 layers. DecoderStack::forward makes the same calls, on the same tensors, in the same order, so it gives the
// modules' bits (tested, for every weight format), and it holds no GIL while the whole stack runs.
#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <utility>

namespace pagedllm {
namespace {

// torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], ""), as pagedllm.layers.linear.linear calls it.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, weight, bias, std::string("none"),
                          c10::impl::GenericList(c10::OptionalType::create(c10::NumberType::get())),
                          std::string("")};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

}  // namespace

LinearWeights::LinearWeights(at::Tensor weight, int64_t out_features, c10::optional<at::Tensor> bias,
                             c10::optional<at::Tensor> row_bias, c10::optional<at::Tensor> scale,
                             c10::optional<at::Tensor> col_sums, c10::optional<at::Tensor> input_perm,
                             int64_t ggml_type, int64_t activation_bits, bool brgemm,
                             c10::optional<int64_t> few_rows_activation_bits)
    : weight(std::move(weight)), out_features(out_features), bias(std::move(bias)), row_bias(std::move(row_bias)),
      scale(std::move(scale)), col_sums(std::move(col_sums)), input_perm(std::move(input_perm)),
      ggml_type(ggml_type), activation_bits(activation_bits), brgemm(brgemm),
      few_rows_activation_bits(few_rows_activation_bits) {}

constexpr int64_t kFewRows = 8;  // pagedllm.layers.linear.FEW_ROWS

int64_t LinearWeights::call_bits(int64_t rows) const {
  return few_rows_activation_bits && rows <= kFewRows ? *few_rows_activation_bits : activation_bits;
}

// The branches of pagedllm.layers.linear.linear, in its order.
at::Tensor LinearWeights::operator()(at::Tensor x) const {
  at::Tensor y;
  if (weight.is_mkldnn()) {
    y = onednn_linear(x, weight, bias);
  } else if (brgemm) {
    y = at::empty({x.size(0), out_features}, x.options());
    linear_brgemm(y, x, weight, bias);
  } else if (weight.scalar_type() == at::kByte) {
    if (input_perm) x = x.index_select(1, *input_perm);
    y = at::empty({x.size(0), out_features}, x.options());
    linear_gguf(y, x, weight, ggml_type, bias, call_bits(x.size(0)));
  } else if (weight.dim() == 3) {
    y = at::empty({x.size(0), out_features}, x.options());
    if (col_sums) {
      linear_w8a8(y, x, weight, *col_sums, *scale, bias);
    } else {
      linear_packed(y, x, weight, bias, scale);
    }
  } else {
    y = at::linear(x, weight, bias);
  }
  return row_bias ? y + *row_bias : y;
}

// pagedllm.models.llama.LlamaMLP's gate_up projection and SiLU-and-mul (fuses_silu_and_mul's test, in its order).
at::Tensor LinearWeights::silu_and_mul(const at::Tensor& x) const {
  if (weight.scalar_type() == at::kByte && call_bits(x.size(0)) == 0 && !input_perm && out_features % 32 == 0 &&
      !row_bias) {
    at::Tensor out = at::empty({x.size(0), out_features / 2}, x.options());
    linear_gguf_silu_and_mul(out, x, weight, ggml_type, bias);
    return out;
  }
  const at::Tensor gate_up = (*this)(x);
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  pagedllm::silu_and_mul(out, gate_up);
  return out;
}

DecoderStack::DecoderStack(std::vector<DecoderLayerWeights> layers, at::Tensor norm, double eps, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, double scale, double softcap, bool causal,
                           c10::optional<at::Tensor> norm_bias, double clip_qkv, bool qk_norm_after_rope,
                           c10::optional<at::Tensor> alibi_slopes, double query_beta, int64_t query_original)
    : layers_(std::move(layers)), norm_(std::move(norm)), norm_bias_(std::move(norm_bias)),
      alibi_slopes_(std::move(alibi_slopes)), eps_(eps),
      num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale), softcap_(softcap),
      clip_qkv_(clip_qkv), query_beta_(query_beta), query_original_(query_original), causal_(causal),
      qk_norm_after_rope_(qk_norm_after_rope) {}

// LlamaModel.forward after the embedding: x [T, H] -> the final norm's output [T, H].
at::Tensor DecoderStack::forward(at::Tensor x, const at::Tensor& positions, const std::vector<KVPair>& kv_caches,
                                 at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                                 at::Tensor query_start_loc, int64_t num_decodes, bool cascade) const {
  int64_t num_pool_layers = 0;
  for (const DecoderLayerWeights& layer : layers_) num_pool_layers += layer.pool_layers;
  TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_pool_layers, "the layers take ", num_pool_layers,
              " layers of the KV pool, given ", kv_caches.size());
  const at::Tensor pos = positions.to(at::kLong);
  const StepBatch batch{std::move(slot_mapping), std::move(block_tables), std::move(seq_lens),
                        std::move(query_start_loc), num_decodes, cascade};
  EarlierSlots earlier;
  at::Tensor residual;
  auto pool = kv_caches.begin();
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecoderLayerWeights& layer = layers_[i];
    const std::vector<KVPair> caches(pool, pool + layer.pool_layers);
    pool += layer.pool_layers;
    if (!layer.input_norm) {
      x = output_norm_layer(layer, x, residual, pos, caches, batch, earlier);
      continue;
    }
    at::Tensor h;
    if (residual.defined()) {
      std::tie(h, residual) = add_norm(x, residual, *layer.input_norm, layer.input_norm_bias);
    } else {
      h = norm(x, *layer.input_norm, layer.input_norm_bias);
      residual = x;
    }
    if (layer.parallel) {  // both branches read the layer's input stream; their outputs join it together
      const at::Tensor mlp_in =
          layer.post_attention_norm ? norm(residual, *layer.post_attention_norm, layer.post_attention_norm_bias) : h;
      x = mixer(layer, h, pos, caches, batch, earlier) + mlp(layer, mlp_in);
      continue;
    }
    x = mixer(layer, h, pos, caches, batch, earlier);
    const bool sandwich = layer.pre_feedforward_norm && layer.post_feedforward_norm;  // Gemma 3's branch norms
    if (sandwich) x = norm(x, *layer.post_attention_norm);
    std::tie(h, residual) = add_norm(x, residual, sandwich ? *layer.pre_feedforward_norm : *layer.post_attention_norm,
                                     sandwich ? c10::nullopt : layer.post_attention_norm_bias);
    x = mlp(layer, h);
    if (sandwich) x = norm(x, *layer.post_feedforward_norm);
  }
  return add_norm(x, residual, norm_, norm_bias_).first;
}

// LlamaDecoderLayer.forward of a layer that norms its branches' outputs (OLMo's, EXAONE 4's): the stream itself into
// the attention, each branch's output normed before it joins the stream. Returns the MLP's normed output; `residual`
// becomes the stream before it is added.
at::Tensor DecoderStack::output_norm_layer(const DecoderLayerWeights& layer, const at::Tensor& x, at::Tensor& residual,
                                           const at::Tensor& positions, const std::vector<KVPair>& caches,
                                           const StepBatch& batch, EarlierSlots& earlier) const {
  residual = residual.defined() ? x + residual : x;
  residual = residual + norm(mixer(layer, residual, positions, caches, batch, earlier), *layer.post_attention_norm);
  return norm(mlp(layer, residual), *layer.post_feedforward_norm);
}

// The layer's token mixer: its attention over its one layer of the pool, or LFM2's short convolution.
at::Tensor DecoderStack::mixer(const DecoderLayerWeights& layer, const at::Tensor& h, const at::Tensor& positions,
                               const std::vector<KVPair>& caches, const StepBatch& batch, EarlierSlots& earlier) const {
  return layer.conv ? short_conv(layer, h, positions, caches, batch, earlier)
                    : attention(layer, h, positions, caches[0], batch);
}

// pagedllm.models.llama.ShortConv.forward: h [T, H] -> out_proj's output [T, H]; each token's B * x written to its
// slot in the layer's layers of the pool (K and V rows, padded), the taps over the tokens before it read there.
at::Tensor DecoderStack::short_conv(const DecoderLayerWeights& layer, const at::Tensor& h, const at::Tensor& positions,
                                    const std::vector<KVPair>& caches, const StepBatch& batch,
                                    EarlierSlots& earlier) const {
  const std::vector<at::Tensor> bcx = layer.qkv(h).chunk(3, -1);
  const at::Tensor bx = bcx[0] * bcx[2];  // [T, H]
  const int64_t tokens = bx.size(0), hidden = bx.size(1);
  const at::Tensor& k0 = std::get<0>(caches[0]);
  const int64_t kv_heads = k0.size(2), head_dim = k0.size(3), block_size = k0.size(1);
  const int64_t num_layers = static_cast<int64_t>(caches.size());
  at::Tensor padded = at::zeros({tokens, num_layers * 2 * kv_heads * head_dim}, bx.options());
  padded.narrow(1, 0, hidden).copy_(bx);
  const at::Tensor parts = padded.view({tokens, num_layers, 2, kv_heads, head_dim});
  for (int64_t i = 0; i < num_layers; ++i) {
    const auto& [k, v] = caches[i];
    write_kv(parts.select(1, i).select(1, 0), parts.select(1, i).select(1, 1), k, v, batch.slot_mapping);
  }
  const at::Tensor weight = layer.conv->squeeze(1);  // [H, L]
  const int64_t taps = weight.size(1);
  at::Tensor out;
  for (int64_t j = 0; j < taps; ++j) {
    const int64_t back = taps - 1 - j;
    at::Tensor tap = bx;
    if (back > 0) {
      if (!earlier.count(back)) {  // AttentionMetadata.earlier_slots
        const at::Tensor counts = batch.query_start_loc.slice(0, 1) - batch.query_start_loc.slice(0, 0, -1);
        const at::Tensor seqs =
            at::repeat_interleave(at::arange(counts.size(0), positions.options().dtype(at::kLong)), counts);
        const at::Tensor back_positions = positions - back;
        const at::Tensor clamped = back_positions.clamp_min(0);
        earlier[back] = {batch.block_tables.index({seqs, clamped.div(block_size, "floor")}).to(at::kLong),
                         clamped.remainder(block_size), back_positions.lt(0)};
      }
      const auto& [blocks, offsets, before_start] = earlier.at(back);
      std::vector<at::Tensor> rows;
      for (const auto& [k, v] : caches) {
        rows.push_back(at::cat({k.index({blocks, offsets}), v.index({blocks, offsets})}, 1).flatten(1));
      }
      tap = at::cat(rows, 1).narrow(1, 0, hidden).masked_fill(before_start.unsqueeze(1), 0);
    }
    const at::Tensor term = tap * weight.select(1, j);
    out = out.defined() ? out + term : term;
  }
  return layer.o(bcx[1] * out);
}

// LlamaAttention.forward with the CPU backend (pagedllm.attention.cpu): h [T, H] -> o_proj's output [T, H]; Qwen3's
// per-head norms of q and k (or OLMo's over all the heads) before the rotary embedding, where the layer has them.
at::Tensor DecoderStack::attention(const DecoderLayerWeights& layer, const at::Tensor& h, const at::Tensor& positions,
                                   const KVPair& kv_cache, const StepBatch& batch) const {
  at::Tensor qkv = layer.qkv(h);  // [T, (Hq + 2 Hkv) D]
  if (clip_qkv_ > 0) qkv = qkv.clamp(-clip_qkv_, clip_qkv_);
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  at::Tensor q = qkv.narrow(1, 0, q_size);
  at::Tensor k = qkv.narrow(1, q_size, kv_size);
  const bool all_heads = layer.q_norm && layer.q_norm->numel() == q_size;  // OLMo's norms over all the heads
  if (all_heads) {
    q = norm(q.contiguous(), *layer.q_norm);
    k = norm(k.contiguous(), *layer.k_norm);
  }
  q = q.view({-1, num_heads_, head_dim_});
  k = k.view({-1, num_kv_heads_, head_dim_});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({-1, num_kv_heads_, head_dim_});
  const bool head_norms = layer.q_norm && layer.k_norm && !all_heads;
  if (head_norms && !qk_norm_after_rope_) {
    q = head_norm(q, *layer.q_norm);
    k = head_norm(k, *layer.k_norm);
  }
  rotary_embedding(positions, q, k, layer.cos_cache, layer.sin_cache);
  if (head_norms && qk_norm_after_rope_) {  // (Hunyuan's)
    q = head_norm(q, *layer.q_norm);
    k = head_norm(k, *layer.k_norm);
  }
  if (query_beta_ > 0) {  // Ministral 3's temperature of the queries, in LlamaAttention.forward's ops
    const at::Tensor spans = at::floor(positions.to(at::kFloat) / static_cast<double>(query_original_));
    q = q * (at::log(spans + 1) * query_beta_ + 1).view({-1, 1, 1}).to(q.scalar_type());
  }
  const auto& [k_cache, v_cache] = kv_cache;
  write_kv(k, v, k_cache, v_cache, batch.slot_mapping);
  q = q.contiguous();
  at::Tensor out = at::empty_like(q);
  paged_attention(out, q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                  batch.num_decodes, scale_, batch.cascade, layer.sliding_window, softcap_, causal_, alibi_slopes_,
                  layer.sinks);
  return layer.o(out.flatten(1));
}

// LlamaMLP.forward (with Gemma's GELU, or SiLU), LlamaSparseMoeBlock's, or PlainMLP's (fc1 and fc2 in gate_up's and
// down's places, its activation as torch computes it there): h [T, H] -> [T, H].
at::Tensor DecoderStack::mlp(const DecoderLayerWeights& layer, const at::Tensor& h) const {
  if (layer.moe) return (*layer.moe)(h);
  if (layer.activation == "silu_and_mul") return (*layer.down)(layer.gate_up->silu_and_mul(h));
  const at::Tensor up = (*layer.gate_up)(h);
  at::Tensor out;
  if (layer.activation == "gelu_and_mul") {
    out = at::empty({up.size(0), up.size(1) / 2}, up.options());
    gelu_and_mul(out, up);
  } else if (layer.activation == "relu") {
    out = at::relu(up);
  } else if (layer.activation == "relu2") {
    out = at::square(at::relu(up));
  } else {
    TORCH_CHECK(layer.activation == "gelu" || layer.activation == "gelu_tanh", "unknown MLP activation ",
                layer.activation);
    out = at::gelu(up, layer.activation == "gelu" ? "none" : "tanh");
  }
  return (*layer.down)(out);
}

// RMSNorm.forward without a residual (PreLayerNorm's where `bias` is given): x [T, H] -> [T, H].
at::Tensor DecoderStack::norm(const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias) const {
  at::Tensor out = at::empty_like(x);
  if (bias) {
    add_layer_norm(out, x, c10::nullopt, weight, *bias, eps_);
  } else {
    rms_norm(out, x, weight, eps_);
  }
  return out;
}

// RMSNorm.forward with a residual (PreLayerNorm's where `bias` is given: the sum as torch adds it, then normed):
// (the norm of x + residual, x + residual).
std::pair<at::Tensor, at::Tensor> DecoderStack::add_norm(const at::Tensor& x, const at::Tensor& residual,
                                                         const at::Tensor& weight,
                                                         const c10::optional<at::Tensor>& bias) const {
  if (bias) {
    at::Tensor sum = x + residual;
    return {norm(sum, weight, bias), sum};
  }
  at::Tensor out = at::empty_like(x);
  at::Tensor sum = at::empty_like(x);
  fused_add_rms_norm(out, sum, x, residual, weight, eps_);
  return {out, sum};
}

// LlamaAttention's Qwen3 norm: heads [T, heads, D] -> each head's row RMS-normed with `weight` [D], contiguous.
at::Tensor DecoderStack::head_norm(const at::Tensor& heads, const at::Tensor& weight) const {
  return norm(heads.reshape({-1, head_dim_}), weight).view(heads.sizes());
}

}  // namespace pagedllm

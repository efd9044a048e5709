// A step's attention on the CPU: the decodes through decode_attention, the other sequences through
// prefill_attention, or, when every sequence's context starts with the same blocks, as cascade attention.
//
// Cascade attention (as FlashInfer and vLLM's FlashAttention backend do it on GPUs): when N sequences share a
// prefix of P tokens (a system prompt held by the prefix cache, the samples of one prompt), attending each on its own
// reads the prefix's keys and values N times and scores them with vector code, one sequence's few query rows at a
// time. Instead every query row of the step scores the prefix in one pass, the prefix packed once per kv head and its
// rows taken 16 tokens at a time whatever sequence they belong to (so that decodes, one token each, fill AMX tiles
// too); each row's online-softmax state after the prefix (SoftmaxState) is where its own keys' pass starts:
//
//            prefix (shared blocks)        suffix (each sequence's own)
//   seq 0:   [ b0 b1 b2 b3 b4 b5 b6 b7 ] [ b8 b9 ]
//   seq 1:   [ b0 b1 b2 b3 b4 b5 b6 b7 ] [ b12 ]
//            prefix_attention: all rows  decode_attention_after_prefix / prefill_attention_after_prefix
//
// cascade_prefix_len finds the common prefix from the block tables (the same block ids, before every sequence's
// first query token) and rounds it down to prefill_attention's 64-key chunks.
#include "ops.h"

#include <algorithm>
#include <optional>

namespace pagedllm {
namespace {

// A cascade pays for packing the prefix and for a pass of its own over the rows; it gains the reads of the prefix's
// keys and values it saves, sequences x prefix. Measured on SmolLM2's shapes (9 query heads, 3 kv heads, 64 dims;
// decodes with 48 keys of their own; docs/benchmarks.md): in AMX tiles 1.1-1.45x from 8 sequences over 256 keys, 16
// over 128 or 32 over 64, 2.8x for 32 over 528, and slower at 2-4 sequences (0.4-0.8x); in vector code (float32 with
// AVX-512, AVX2) 0.8-1.0x for 8 sequences over 256 or 528 and 16 over 128, 1.1-1.8x from 32 over 64.
struct CascadeThreshold {
  int64_t seqs, keys;
};
constexpr CascadeThreshold kInTiles{8, 2048}, kInVectors{16, 4096};

}  // namespace

int64_t cascade_prefix_len(at::Tensor q, at::Tensor k_cache, at::Tensor block_tables, at::Tensor seq_lens,
                           at::Tensor query_start_loc) {
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
              seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
              query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous(),
              "block tables, lengths and starts must be contiguous int32");
  TORCH_CHECK(query_start_loc.numel() == seq_lens.numel() + 1, "query_start_loc must have num_seqs + 1 entries");
  const CascadeThreshold least = prefill_attention_in_tiles(q, k_cache) ? kInTiles : kInVectors;
  const int64_t num_seqs = seq_lens.size(0), max_blocks = block_tables.size(1), block_size = k_cache.size(1);
  if (num_seqs < least.seqs) return 0;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  int64_t blocks = max_blocks;  // seen by every query token: before each sequence's first one
  for (int64_t i = 0; i < num_seqs; ++i) {
    blocks = std::min<int64_t>(blocks, (lens[i] - (qsl[i + 1] - qsl[i])) / block_size);
  }
  for (int64_t i = 1; i < num_seqs && blocks > 0; ++i) {  // the same block ids in every table
    blocks = std::mismatch(tables, tables + blocks, tables + i * max_blocks).first - tables;
  }
  const int64_t prefix_len = blocks * block_size / kKeyChunk * kKeyChunk;
  return prefix_len * num_seqs >= least.keys ? prefix_len : 0;
}

const float* head_data(const c10::optional<at::Tensor>& per_head, const at::Tensor& q, const char* what) {
  if (!per_head) return nullptr;
  TORCH_CHECK(per_head->scalar_type() == at::kFloat && per_head->is_contiguous() && per_head->device().is_cpu() &&
              per_head->numel() == q.size(1), what, " must be contiguous float32 on the CPU, one a query head (",
              q.size(1), "), not ", per_head->scalar_type(), " ", per_head->sizes());
  return per_head->data_ptr<float>();
}

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor seq_lens, at::Tensor query_start_loc, int64_t num_decodes, double scale,
                     bool cascade, int64_t window, double softcap, bool causal,
                     const c10::optional<at::Tensor>& alibi_slopes, const c10::optional<at::Tensor>& sinks) {
  const int64_t num_seqs = seq_lens.size(0);
  const float* alibi = head_data(alibi_slopes, q, "ALiBi's slopes");
  const float* sink = head_data(sinks, q, "sinks");
  // A window's rows see different keys of a shared prefix, as many as their positions leave them: no cascade; nor
  // for an encoder's rows (which share no blocks), nor with ALiBi (each row's biases run from its own position).
  const bool shared = cascade && window == 0 && causal && !alibi;
  const int64_t prefix_len = shared ? cascade_prefix_len(q, k_cache, block_tables, seq_lens, query_start_loc) : 0;
  std::optional<SoftmaxState> prefix;
  if (prefix_len > 0) {
    prefix.emplace(prefix_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, prefix_len, scale,
                                    softcap));
  }
  const SoftmaxState* state = prefix ? &*prefix : nullptr;
  if (num_decodes > 0) {
    decode_attention_after_prefix(out.narrow(0, 0, num_decodes), q.narrow(0, 0, num_decodes), k_cache, v_cache,
                                  block_tables.narrow(0, 0, num_decodes), seq_lens.narrow(0, 0, num_decodes), scale,
                                  window, softcap, alibi, sink, state);
  }
  if (num_decodes < num_seqs) {
    prefill_attention_after_prefix(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_decodes,
                                   scale, window, softcap, alibi, sink, state, causal);
  }
}

}  // namespace pagedllm

// The Python module: pagedllm.kernels.cpu_kernels() returns it.
#include <torch/extension.h>

#include "ops.h"

#include <chrono>
#include <thread>

// Every kernel runs without the GIL (its arguments are converted first, its result after), so that other Python
// threads go on meanwhile: the server's event loop beside the engine thread, data-parallel replicas beside each other.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("decode_attention", &pagedllm::decode_attention,
        "Paged decode attention, one query token per sequence, over a float or int8 cache: (out, q, k_cache, "
        "v_cache, block_tables, seq_lens, scale, window, softcap, alibi_slopes, sinks)", NoGil());
  m.def("prefill_attention", &pagedllm::prefill_attention,
        "Paged attention of sequences first_seq.. of a flat batch, causal or not: (out, q, k_cache, v_cache, "
        "block_tables, seq_lens, query_start_loc, first_seq, scale, window, softcap, causal, alibi_slopes, sinks)",
        NoGil());
  m.def("paged_attention", &pagedllm::paged_attention,
        "A step's paged attention, decodes first, as cascade attention where every sequence's context starts with "
        "the same blocks and `cascade` allows it (never with a sliding window or ALiBi): (out, q, k_cache, "
        "v_cache, block_tables, seq_lens, query_start_loc, num_decodes, scale, cascade, window, softcap, causal, "
        "alibi_slopes, sinks)",
        NoGil());
  m.def("cascade_prefix_len", &pagedllm::cascade_prefix_len,
        "The shared prefix paged_attention runs as cascade attention, in positions (0: none): (q, k_cache, "
        "block_tables, seq_lens, query_start_loc)", NoGil());
  m.def("write_kv", &pagedllm::write_kv,
        "Store the new tokens' K and V rows at their slots, copied into a cache of their dtype or quantized into an "
        "int8 cache's rows: (key, value, k_cache, v_cache, slot_mapping)", NoGil());
  m.def("argmax_rows", &pagedllm::argmax_rows,
        "Each row's first index of its largest value (of its first NaN), torch.argmax(x, -1): (x)", NoGil());
  m.def("sample_rows", &pagedllm::sample_rows,
        "Each row's token drawn from softmax(x / temperature) after its top-k, top-p and min-p (None: off), by "
        "inverse CDF with its uniform: (x, temperature, uniform, top_k, top_p, min_p)",
        py::arg("x"), py::arg("temperature"), py::arg("uniform"), py::arg("top_k") = py::none(),
        py::arg("top_p") = py::none(), py::arg("min_p") = py::none(), NoGil());
  m.def("verify_rows", &pagedllm::verify_rows,
        "Each row's verdict on its draft (-1: none) against the distribution sample_rows draws from: accepted where "
        "uniform[:, 0] < p(draft), and the token drawn with uniform[:, 1] from p without the draft: (x, temperature, "
        "uniform, draft_ids, top_k, top_p, min_p) -> (accepted, recovered)",
        py::arg("x"), py::arg("temperature"), py::arg("uniform"), py::arg("draft_ids"), py::arg("top_k") = py::none(),
        py::arg("top_p") = py::none(), py::arg("min_p") = py::none(), NoGil());
  m.def("row_logprobs", &pagedllm::row_logprobs,
        "Each row's log-softmax (its values where not normalize) at its token and at its num largest values, and "
        "the token's rank: (x, token_ids, num, normalize) -> (ids, values, ranks)", NoGil());
  m.def("apply_token_bitmask", &pagedllm::apply_token_bitmask,
        "Each listed row's tokens whose bit is 0 to -inf, in place on float32 logits: (logits, rows, bitmask)",
        NoGil());
  m.def("apply_penalties", &pagedllm::apply_penalties,
        "Repetition, frequency and presence penalties in place on float32 logits, from each row's prompt and output "
        "ids: (logits, prompt_ids, prompt_starts, output_ids, output_starts, repetition, frequency, presence)",
        NoGil());
  m.def("rms_norm", &pagedllm::rms_norm, "out = RMSNorm(x) * weight: (out, x, weight, eps)", NoGil());
  m.def("fused_add_rms_norm", &pagedllm::fused_add_rms_norm,
        "residual_out = x + residual; out = RMSNorm(residual_out) * weight: "
        "(out, residual_out, x, residual, weight, eps)", NoGil());
  m.def("silu_and_mul", &pagedllm::silu_and_mul, "out = silu(x[:, :d]) * x[:, d:]: (out, x)", NoGil());
  m.def("mamba2_scan", &pagedllm::mamba2_scan,
        "A sequence's tokens through a Mamba-2 layer's recurrence, token by token: (y, final_state, x, dt, a, b, c, "
        "initial)", NoGil());
  m.def("mamba2_decode", &pagedllm::mamba2_decode,
        "A Mamba-2 layer's decode step after in_proj, states read from and written to pool slots: (out, xbc, dt, "
        "gate, conv_pool, ssm_pool, read_slots, write_slots, conv_weight, conv_bias, dt_bias, a, d, norm_weight, "
        "eps, groups, dt_min, dt_max)", NoGil());
  m.def("gated_delta_forward", &pagedllm::gated_delta_forward,
        "A Gated DeltaNet layer after in_proj for a step's sequences, states read from and written to pool slots: "
        "(out, qkv, z, b, a, conv_pool, state_pool, read_slots, write_slots, query_start_loc, conv_weight, dt_bias, "
        "decay_rate, norm_weight, eps, key_heads)", NoGil());
  m.def("gelu_and_mul", &pagedllm::gelu_and_mul, "out = gelu(x[:, :d], tanh approximation) * x[:, d:]: (out, x)",
        NoGil());
  m.def("add_layer_norm", &pagedllm::add_layer_norm,
        "out = LayerNorm(x + residual) * weight + bias, residual optional: (out, x, residual, weight, bias, eps)",
        NoGil());
  m.def("rotary_embedding", &pagedllm::rotary_embedding,
        "Neox-style rotary embedding of q and k in place: (positions, q, k, cos_cache, sin_cache)", NoGil());
  m.def("pack_linear_weight", &pagedllm::pack_linear_weight,
        "A float32, bfloat16 or int8 [N, K] weight in linear_packed's blocked layout, [ceil(N/16), K, 16]: "
        "(weight)", NoGil());
  m.def("linear_packed", &pagedllm::linear_packed,
        "out = x W^T + bias in float32 arithmetic, W packed by pack_linear_weight, N = out.size(1); an int8 W is "
        "scale[n] * q[n, k]: (out, x, packed, bias, scale)",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("scale") = pybind11::none(), NoGil());
  m.def("linear_gguf", &pagedllm::linear_gguf,
        "out = x W^T + bias, W a GGUF Q4_0, Q4_1 or Q8_0 weight regrouped by "
        "pagedllm.layers.gguf.pack_gguf_weight, N = out.size(1), times x quantized per 32 k's to 16 bits (two "
        "int8 halves) or 8, or times x in bf16 with W dequantised to bf16 in AMX tiles for activation_bits=0 "
        "(pagedllm.layers.linear.gguf_reference): (out, x, packed, ggml_type, bias, activation_bits)",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("ggml_type"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("activation_bits") = 16, NoGil());
  m.def("linear_gguf_silu_and_mul", &pagedllm::linear_gguf_silu_and_mul,
        "out = silu(x W_gate^T + b_gate) * (x W_up^T + b_up) for a GGUF weight of 2 N columns, gate's then up's (a "
        "fused gate_up projection), N = out.size(1) a multiple of 16: linear_gguf with activation_bits=0 then "
        "silu_and_mul, the same bits, in one pass: (out, x, packed, ggml_type, bias)",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("ggml_type"),
        pybind11::arg("bias") = pybind11::none(), NoGil());
  m.def("pack_gguf_weight", &pagedllm::pack_gguf_weight,
        "GGUF Q4_0, Q4_1 or Q8_0 rows (uint8 [N, K/32 * block bytes], as stored) in linear_gguf's layout, the bytes "
        "of pagedllm.layers.gguf.pack_gguf_weight_reference: (rows, ggml_type)", NoGil());
  m.def("gguf_bf16_available", &pagedllm::gguf_bf16_available,
        "Whether linear_gguf runs activation_bits=0 here: built with AVX512-BF16 (vectors), or with AMX-BF16 and "
        "granted the tiles by Linux");
  m.def("gguf_bf16_tiles_available", &pagedllm::gguf_bf16_tiles_available,
        "Whether linear_gguf's activation_bits=0 runs in AMX-BF16 tiles here: built with AMX-BF16, and granted the "
        "tiles by Linux (else in AVX512-BF16 vectors, where gguf_bf16_available)");
  m.def("pack_w8a8_weight", &pagedllm::pack_w8a8_weight,
        "An int8 [N, K] weight with values in [-127, 127] in linear_w8a8's layout: (packed [ceil(N/16), ceil(K/4), "
        "64] int8, column sums per 64 k's [ceil(N/16), ceil(K/64), 16] int32): (q)", NoGil());
  m.def("linear_w8a8", &pagedllm::linear_w8a8,
        "out = x W^T + bias with W = w_scale[n] q[n, k] packed by pack_w8a8_weight and x quantized to int8 in the "
        "call, one scale per 64 k's of a row: out[m, n] = (sum over spans t of float(sum_{k in t} qx q) * "
        "x_scale[m, t]) * w_scale[n] + bias[n], N = out.size(1): "
        "(out, x, packed, col_sums, w_scale, bias)",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("col_sums"),
        pybind11::arg("w_scale"), pybind11::arg("bias") = pybind11::none(), NoGil());
  // module_local: each ISA level's build is a module of its own in one process, each with these C++ types
  py::class_<pagedllm::LinearWeights>(m, "LinearWeights", py::module_local(),
                                      "A linear layer's weight for DecoderStack, as pagedllm.layers.linear.linear "
                                      "takes it (pagedllm.layers.linear.linear_weights builds one)")
      .def(py::init<at::Tensor, int64_t, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                    c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>, int64_t,
                    int64_t, bool, c10::optional<int64_t>>(),
           py::arg("weight"), py::arg("out_features"), py::arg("bias") = py::none(), py::arg("row_bias") = py::none(),
           py::arg("scale") = py::none(), py::arg("col_sums") = py::none(), py::arg("input_perm") = py::none(),
           py::arg("ggml_type") = 0, py::arg("activation_bits") = 16, py::arg("brgemm") = false,
           py::arg("few_rows_activation_bits") = py::none());
  m.def("brgemm_bf16_available", &pagedllm::brgemm_bf16_available,
        "Whether torch's brgemm packs bf16 weights on this CPU (AMX, AVX512-BF16): pack_brgemm_weight runs");
  m.def("pack_brgemm_weight", &pagedllm::pack_brgemm_weight,
        "A bf16 [N, K] weight (K even) in brgemm's blocks of 32 columns, [ceil(N/32), K/2, 64]: (weight)", NoGil());
  m.def("linear_brgemm", &pagedllm::linear_brgemm,
        "out = x W^T + bias, bf16, for W packed by pack_brgemm_weight, N = out.size(1): (out, x, packed, bias)",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias") = pybind11::none(),
        NoGil());
  m.def("moe_experts", &pagedllm::moe_experts,
        "sum_j weights[t, j] experts[ids[t, j]](x[t]), each expert down(act(gate_up(x))) on its tokens, act "
        "SiLU-and-mul or (swiglu_limit > 0) gpt-oss's clamped SwiGLU, the experts split between the threads: (x, "
        "weights, ids, gate_up, down, swiglu_alpha, swiglu_limit)",
        py::arg("x"), py::arg("weights"), py::arg("ids"), py::arg("gate_up"), py::arg("down"),
        py::arg("swiglu_alpha") = 0.0, py::arg("swiglu_limit") = 0.0, NoGil());
  py::class_<pagedllm::MoEWeights>(m, "MoEWeights", py::module_local(),
                                   "A mixture of experts' MLP, routing included (moe.cpp)")
      .def(py::init<at::Tensor, int64_t, bool, std::vector<pagedllm::LinearWeights>,
                    std::vector<pagedllm::LinearWeights>, c10::optional<pagedllm::LinearWeights>,
                    c10::optional<pagedllm::LinearWeights>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                    double, bool, double, double, c10::optional<at::Tensor>, double, double, int64_t, int64_t,
                    bool>(),
           py::arg("router"), py::arg("top_k"), py::arg("renormalize"), py::arg("gate_up"), py::arg("down"),
           py::arg("shared_gate_up") = py::none(), py::arg("shared_down") = py::none(),
           py::arg("shared_gate") = py::none(), py::arg("selection_bias") = py::none(), py::arg("norm_min") = 0.0,
           py::arg("sigmoid") = false, py::arg("norm_eps") = 0.0, py::arg("scale") = 1.0,
           py::arg("router_bias") = py::none(), py::arg("swiglu_alpha") = 0.0, py::arg("swiglu_limit") = 0.0,
           py::arg("groups") = 1, py::arg("kept_groups") = 1, py::arg("group_top2") = false)
      .def("__call__", &pagedllm::MoEWeights::operator(), "h [T, H] -> the block's output [T, H]", NoGil());
  py::class_<pagedllm::DecoderLayerWeights>(m, "DecoderLayerWeights", py::module_local())
      .def(py::init<c10::optional<at::Tensor>, c10::optional<at::Tensor>, pagedllm::LinearWeights,
                    pagedllm::LinearWeights, c10::optional<pagedllm::LinearWeights>,
                    c10::optional<pagedllm::LinearWeights>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                    c10::optional<pagedllm::MoEWeights>, int64_t, at::Tensor, at::Tensor, c10::optional<at::Tensor>,
                    c10::optional<at::Tensor>, std::string, c10::optional<at::Tensor>, int64_t,
                    c10::optional<at::Tensor>, c10::optional<at::Tensor>, bool, c10::optional<at::Tensor>>(),
           py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("q_norm"), py::arg("k_norm"), py::arg("moe"), py::arg("sliding_window"),
           py::arg("cos_cache"), py::arg("sin_cache"), py::arg("pre_feedforward_norm") = py::none(),
           py::arg("post_feedforward_norm") = py::none(), py::arg("activation") = "silu_and_mul",
           py::arg("conv") = py::none(), py::arg("pool_layers") = 1, py::arg("input_norm_bias") = py::none(),
           py::arg("post_attention_norm_bias") = py::none(), py::arg("parallel") = false,
           py::arg("sinks") = py::none());
  py::class_<pagedllm::DecoderStack>(m, "DecoderStack", py::module_local(),
                                     "A Llama-family decoder's layers and final norm in one call (decoder.cpp)")
      .def(py::init<std::vector<pagedllm::DecoderLayerWeights>, at::Tensor, double, int64_t, int64_t, int64_t,
                    double, double, bool, c10::optional<at::Tensor>, double, bool, c10::optional<at::Tensor>, double,
                    int64_t>(),
           py::arg("layers"), py::arg("norm"), py::arg("eps"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("scale"), py::arg("softcap") = 0.0, py::arg("causal") = true,
           py::arg("norm_bias") = py::none(), py::arg("clip_qkv") = 0.0, py::arg("qk_norm_after_rope") = false,
           py::arg("alibi_slopes") = py::none(), py::arg("query_beta") = 0.0, py::arg("query_original") = 0)
      .def("forward", &pagedllm::DecoderStack::forward,
           "The embedded tokens [T, H] through every layer and the final norm, reading and writing the paged KV "
           "cache: (x, positions, kv_caches, slot_mapping, block_tables, seq_lens, query_start_loc, num_decodes, "
           "cascade)",
           NoGil());
  m.def("parallel_units_owners",
        [](int64_t n, int64_t parts, double thread0_sleep_s) {
          // Which thread took each unit: -1 none, -2 more than one.
          std::unique_ptr<std::atomic<int64_t>[]> owners(new std::atomic<int64_t>[n]);
          for (int64_t u = 0; u < n; ++u) owners[u].store(-1);
          pagedllm::parallel_units(n, parts, [&](const auto& take) {
            const int64_t thread = at::get_thread_num();
            for (int64_t u; (u = take()) >= 0;) {
              int64_t none = -1;
              if (!owners[u].compare_exchange_strong(none, thread)) owners[u].store(-2);
              if (thread == 0) std::this_thread::sleep_for(std::chrono::duration<double>(thread0_sleep_s));
            }
          });
          std::vector<int64_t> result(n);
          for (int64_t u = 0; u < n; ++u) result[u] = owners[u].load();
          return result;
        },
        "For the tests of parallel_units (ops.h): the thread that took each of n units dealt over `parts` threads "
        "(-1: none, -2: more than one), thread 0 sleeping thread0_sleep_s after each of its units: "
        "(n, parts, thread0_sleep_s)", NoGil());
  m.def("shm_register", &pagedllm::shm_register,
        "Write this rank's pid into a shared segment, for the others' liveness checks: (segment, rank, world, pid)",
        NoGil());
  m.def("shm_all_reduce", &pagedllm::shm_all_reduce,
        "Sum x over the ranks in place, through a shared segment, in rank order (the same bits on every rank); "
        "returns the last round used: (segment, x, rank, world, seq, timeout_s)", NoGil());
  m.def("shm_gather", &pagedllm::shm_gather,
        "Every rank's x, in rank order, into out ([world, *x.shape]; None on a rank that does not need them); "
        "returns the last round used: (segment, x, out, rank, world, seq, timeout_s)", NoGil());
}

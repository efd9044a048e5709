// A mixture of experts' MLP from C++: pagedllm.models.llama.LlamaSparseMoeBlock, routing and experts.
//
// From Python each expert is ~8 calls (a gather, two or three kernels, a scale, an add), and every kernel splits
// its few rows' work between the threads and joins them: at a decode step's two rows an expert, ~220 us an expert on
// a 2-core VM, a third of it beside the weights' bytes. Here the experts are what the threads split: each thread
// runs whole experts, their kernels on one thread (a kernel called inside a parallel region runs on its caller's
// thread), taken as parallel_units deals them, so the threads stream weights without meeting between experts
// (an expert with more than kUnitRows rows is split into several units).
// Experts in brgemm blocks (bf16, `small_calls`), in pagedllm's packed float32, bf16, int8 and W8A8 layouts, or in
// GGUF blocks in a call that takes their integer arithmetic (every call of a float32 model, and of a few rows in a bf16
// one: LinearWeights::call_bits) run on raw rows in each thread's own buffers, with no tensor made or op dispatched
// a unit (run_unit_raw): at a decode step's two or three rows an expert, such calls (~12 an expert: a gather,
// empties, narrows, a copy) and their allocations took ~28% of the threads' time on the AMX Xeon beside the brgemm
// kernels that stream the weights. A random Qwen3-MoE's experts at 16 tokens, 12 layers: bf16 in brgemm blocks
// 88.6 -> 66.3 ms (18.0 -> 24.0 GB/s of weights, where two threads stream at most ~26-27), int8 51.1 -> 42.0 ms,
// bf16 packed (capped to AVX2) 78.0 -> 62-65 ms, GGUF Q4_1 in 16-bit integers 32.9 -> 27.2 ms, W8A8 at 1 and 4
// tokens 8.5 -> 6.9 and 23 -> 19.3 ms (at 16 level: its weights already streamed at ~19.5 GB/s). Other units (oneDNN's
// weights, GGUF blocks in bf16 tiles or vectors: a prefill's many rows an expert) go through LinearWeights' calls
// (run_unit_tensors). Then each token's weighted rows are added in expert order, as
// pagedllm.layers.moe.run_experts adds them.
#include "linear_common.h"
#include "linear_gguf.h"
#include "ops.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace pagedllm {

namespace {

// One routed slot of a token: row `row` of the experts' outputs, times `weight`.
struct Slot {
  int64_t row;
  float weight;
};

// Rows [first, first + count) of an expert's tokens, whose outputs go to rows [output, output + count).
struct Unit {
  int64_t expert, first, count, output;
};

constexpr int64_t kUnitRows = 512;

// The rows an expert on oneDNN's weights runs: its count of rows past 16 rounded up to a multiple of 32 (zero rows
// added), so that the experts' calls come in ~30 shapes. oneDNN builds a kernel for each shape it has not seen
// (~1.3 ms on the AMX Xeon, for bf16 tiles), and every layer's experts see counts of their own: a 3,600-token
// prefill of a random Qwen3-MoE (12 layers of 64 experts, 8 a token) spent 2.0 s in its experts with the exact
// counts and whole experts, 1.05 s padded and in units of kUnitRows.
int64_t onednn_rows(int64_t count) { return count <= 16 ? count : (count + 31) / 32 * 32; }

// out[t] = sum over t's slots, in expert order, of round(outputs[slot][row] * round(weight)), each product and
// each sum rounded to T: the bits of `y * weight` (weights cast to x's dtype) then `out.index_add_` expert by
// expert, without their ~20 us of calls an expert. The products are stored before they are added (and
// `rounding_barrier` keeps GCC from fusing the two into one FMA, which would round once).
template <typename T>
void add_slots(at::Tensor& out, const at::Tensor& outputs, const std::vector<std::vector<Slot>>& slots) {
  const int64_t hidden = out.size(1);
  T* dst = out.data_ptr<T>();
  const T* rows = outputs.data_ptr<T>();
  at::parallel_for(0, out.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<T> product(hidden);
    for (int64_t t = begin; t < end; ++t) {
      T* o = dst + t * hidden;
      for (const Slot& slot : slots[t]) {
        const T* y = rows + slot.row * hidden;
        const float w = static_cast<float>(static_cast<T>(slot.weight));
        for (int64_t i = 0; i < hidden; ++i) product[i] = static_cast<T>(static_cast<float>(y[i]) * w);
        rounding_barrier(product.data());
        for (int64_t i = 0; i < hidden; ++i) {
          o[i] = static_cast<T>(static_cast<float>(o[i]) + static_cast<float>(product[i]));
        }
      }
    }
  });
}

// A projection a unit of `rows` rows of `dtype` can run on raw rows: bf16 brgemm blocks (bf16 rows), pagedllm's
// packed float32, bf16 or int8 weights (linear_packed's) or W8A8's, or GGUF blocks in a call that takes their
// integer arithmetic (LinearWeights::call_bits; not bf16's tiles or vectors), with no bias of any kind and no input
// permutation.
bool on_raw_rows(const LinearWeights& w, at::ScalarType dtype, int64_t rows) {
  const bool gguf = w.weight.scalar_type() == at::kByte && !w.brgemm && w.call_bits(rows) != 0;
  const bool packed = !w.brgemm && w.weight.dim() == 3 && !w.weight.is_mkldnn() && w.weight.scalar_type() != at::kByte;
  return (dtype == at::kBFloat16 || dtype == at::kFloat) && ((w.brgemm && dtype == at::kBFloat16) || packed || gguf) &&
         !w.bias && !w.row_bias && !w.input_perm;
}

// A thread's buffers for its units, grown as they need.
template <typename T>
struct UnitBuffers {
  std::vector<float> acc = std::vector<float>(kBrgemmAccFloats), wide;
  std::vector<T> x_rows, gated, mid;
  GgufScratch gguf;
  W8A8Scratch w8a8;
  bool brgemm = false;  // brgemm ran on this thread: its tile configuration is to release
};

// out [rows, w.out_features] (rows `out_stride` apart) = x [rows, k] (contiguous) times w, on this thread, with the
// bits of w's own call: brgemm's, linear_gguf's, linear_w8a8's, or linear_packed's on x widened to float32
// (exactly, as it widens x itself).
template <typename T>
void project_on_thread(const LinearWeights& w, T* out, int64_t out_stride, const T* x, int64_t rows, int64_t k,
                       UnitBuffers<T>& buffers) {
  if (w.weight.scalar_type() == at::kByte) {
    linear_gguf_on_thread(out, out_stride, w.out_features, x, rows, k, w.weight.data_ptr<uint8_t>(), w.ggml_type,
                          w.call_bits(rows), buffers.gguf);
    return;
  }
  if (w.col_sums) {
    linear_w8a8_on_thread(out, out_stride, w.out_features, x, rows, k, w.weight.data_ptr<int8_t>(),
                          w.col_sums->data_ptr<int32_t>(), w.scale->data_ptr<float>(), buffers.w8a8);
    return;
  }
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (w.brgemm) {
      buffers.brgemm = true;
      linear_brgemm_on_thread(out, out_stride, w.out_features, x, k, rows, k, w.weight.data_ptr<T>(),
                              buffers.acc.data());
      return;
    }
  }
  const float* x32;
  if constexpr (std::is_same_v<T, float>) {
    x32 = x;
  } else {
    buffers.wide.resize(rows * k);
    for (int64_t i = 0; i < rows * k; ++i) buffers.wide[i] = to_float(x[i]);
    x32 = buffers.wide.data();
  }
  linear_packed_on_thread(out, out_stride, w.out_features, x32, k, rows, k, w.weight,
                          w.scale ? w.scale->data_ptr<float>() : nullptr);
}

// A unit whose projections are on_raw_rows, on this thread: its tokens gathered into the thread's own buffer,
// gate_up, SiLU-and-mul and down on raw rows (project_on_thread, silu_and_mul_rows), its rows of `outputs` written
// in place.
template <typename T>
void run_unit_raw(T* outputs, const T* x, int64_t hidden, const std::vector<int64_t>& rows, const Unit& unit,
                  const LinearWeights& gate_up, const LinearWeights& down, UnitBuffers<T>& buffers) {
  const int64_t wide = gate_up.out_features, inter = wide / 2;
  buffers.x_rows.resize(unit.count * hidden);
  buffers.gated.resize(unit.count * wide);
  buffers.mid.resize(unit.count * inter);
  for (int64_t r = 0; r < unit.count; ++r) {
    std::memcpy(buffers.x_rows.data() + r * hidden, x + rows[unit.first + r] * hidden, hidden * sizeof(T));
  }
  project_on_thread(gate_up, buffers.gated.data(), wide, buffers.x_rows.data(), unit.count, hidden, buffers);
  silu_and_mul_rows(buffers.mid.data(), buffers.gated.data(), unit.count, inter);
  project_on_thread(down, outputs + unit.output * hidden, hidden, buffers.mid.data(), unit.count, inter, buffers);
}

// A unit through LinearWeights' calls, whatever its weights and activation: its tokens gathered (padded with zero
// rows for oneDNN's weights), its rows of the result copied into `outputs`.
void run_unit_tensors(at::Tensor& outputs, const at::Tensor& x, const std::vector<int64_t>& rows, const Unit& unit,
                      const LinearWeights& gate_up, const LinearWeights& down, const ExpertActivation& activation) {
  const int64_t row_bytes = x.size(1) * x.element_size();
  // index_select only reads the ids
  const at::Tensor tokens = at::from_blob(const_cast<int64_t*>(rows.data()) + unit.first, {unit.count}, at::kLong);
  const int64_t padded = gate_up.weight.is_mkldnn() ? onednn_rows(unit.count) : unit.count;
  at::Tensor x_rows = at::empty({padded, x.size(1)}, x.options());
  at::Tensor gathered = x_rows.narrow(0, 0, unit.count);
  at::index_select_out(gathered, x, 0, tokens);
  x_rows.narrow(0, unit.count, padded - unit.count).zero_();
  // copied, not copy_: a worker thread runs outside the caller's inference mode, in which `outputs` was made
  const at::Tensor mid = activation.limit > 0 ? swiglu_oai(gate_up(x_rows), activation.alpha, activation.limit)
                                              : gate_up.silu_and_mul(x_rows);
  const at::Tensor y = down(mid).narrow(0, 0, unit.count);
  std::memcpy(static_cast<char*>(outputs.data_ptr()) + unit.output * row_bytes, y.contiguous().data_ptr(),
              unit.count * row_bytes);
}

// The units split between the threads (parallel_units), each on raw rows where its projections and its activation
// (SiLU's) allow (on_raw_rows: at a decode step's two or three rows an expert, a unit's ~12 tensor calls and their
// allocations took ~28% of the threads' time beside brgemm's kernels on the AMX Xeon), else through the tensor calls.
template <typename T>
void run_units(at::Tensor& outputs, const at::Tensor& x, const std::vector<std::vector<int64_t>>& rows,
               const std::vector<Unit>& units, const std::vector<LinearWeights>& gate_up,
               const std::vector<LinearWeights>& down, const ExpertActivation& activation) {
  parallel_units(static_cast<int64_t>(units.size()), at::get_num_threads(), [&](const auto& take) {
    UnitBuffers<T> buffers;
    for (int64_t u; (u = take()) >= 0;) {
      const Unit& unit = units[u];
      const LinearWeights &g = gate_up[unit.expert], &d = down[unit.expert];
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
        if (activation.limit == 0 && on_raw_rows(g, x.scalar_type(), unit.count) &&
            on_raw_rows(d, x.scalar_type(), unit.count)) {
          run_unit_raw(outputs.data_ptr<T>(), x.data_ptr<T>(), x.size(1), rows[unit.expert], unit, g, d, buffers);
          continue;
        }
      }
      run_unit_tensors(outputs, x, rows[unit.expert], unit, g, d, activation);
    }
    if (buffers.brgemm) brgemm_release();
  });
}

}  // namespace

at::Tensor swiglu_oai(const at::Tensor& x, double alpha, double limit) {
  const int64_t d = x.size(-1) / 2;
  const at::Tensor gate = x.narrow(-1, 0, d).clamp_max(limit), up = x.narrow(-1, d, d).clamp(-limit, limit);
  return (up + 1) * (gate * at::sigmoid(gate * alpha));
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                       const std::vector<LinearWeights>& gate_up, const std::vector<LinearWeights>& down,
                       double swiglu_alpha, double swiglu_limit) {
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && weights.sizes() == ids.sizes() && ids.size(0) == x.size(0),
              "x [T, H], weights and ids [T, top_k]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat && ids.device().is_cpu() &&
                  weights.device().is_cpu(),
              "ids int64 and weights float32, on the CPU");
  TORCH_CHECK(gate_up.size() == down.size(), "one gate_up and one down projection an expert");
  const int64_t num_experts = static_cast<int64_t>(gate_up.size());
  // each expert's tokens in ascending order (a token routes to an expert once) and their weights
  std::vector<std::vector<int64_t>> rows(num_experts);
  std::vector<std::vector<float>> row_weights(num_experts);
  const auto id = ids.accessor<int64_t, 2>();
  const auto w = weights.accessor<float, 2>();
  for (int64_t t = 0; t < ids.size(0); ++t) {
    for (int64_t j = 0; j < ids.size(1); ++j) {
      const int64_t e = id[t][j];
      TORCH_CHECK(e >= 0 && e < num_experts, "expert id ", e, " out of [0, ", num_experts, ")");
      rows[e].push_back(t);
      row_weights[e].push_back(w[t][j]);
    }
  }
  // the units of work: runs of at most kUnitRows of an expert's rows, so that an expert most tokens chose does
  // not keep one thread busy while the other waits
  std::vector<Unit> units;
  std::vector<std::vector<Slot>> slots(x.size(0));  // each token's slots, in expert order
  int64_t num_rows = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = static_cast<int64_t>(rows[e].size());
    for (int64_t first = 0; first < n; first += kUnitRows) {
      const int64_t count = std::min(kUnitRows, n - first);
      for (int64_t r = 0; r < count; ++r) {
        slots[rows[e][first + r]].push_back({num_rows + r, row_weights[e][first + r]});
      }
      units.push_back({e, first, count, num_rows});
      num_rows += count;
    }
  }
  const at::Tensor rows_x = x.contiguous();
  at::Tensor outputs = at::empty({num_rows, rows_x.size(1)}, rows_x.options());
  at::Tensor out = at::zeros_like(rows_x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "moe_experts", [&] {
    run_units<scalar_t>(outputs, rows_x, rows, units, gate_up, down, {swiglu_alpha, swiglu_limit});
    add_slots<scalar_t>(out, outputs, slots);
  });
  return out;
}

MoEWeights::MoEWeights(at::Tensor router, int64_t top_k, bool renormalize, std::vector<LinearWeights> gate_up,
                       std::vector<LinearWeights> down, c10::optional<LinearWeights> shared_gate_up,
                       c10::optional<LinearWeights> shared_down, c10::optional<at::Tensor> shared_gate,
                       c10::optional<at::Tensor> selection_bias, double norm_min, bool sigmoid, double norm_eps,
                       double scale, c10::optional<at::Tensor> router_bias, double swiglu_alpha,
                       double swiglu_limit, int64_t groups, int64_t kept_groups, bool group_top2)
    : router(std::move(router)), top_k(top_k), renormalize(renormalize), gate_up(std::move(gate_up)),
      down(std::move(down)), shared_gate_up(std::move(shared_gate_up)), shared_down(std::move(shared_down)),
      shared_gate(std::move(shared_gate)), selection_bias(std::move(selection_bias)), norm_min(norm_min),
      sigmoid(sigmoid), norm_eps(norm_eps), scale(scale), router_bias(std::move(router_bias)),
      activation{swiglu_alpha, swiglu_limit}, groups(groups), kept_groups(kept_groups), group_top2(group_top2) {
  TORCH_CHECK(swiglu_limit >= 0, "swiglu_limit: 0 (SiLU-and-mul) or the clamped SwiGLU's limit, not ", swiglu_limit);
  TORCH_CHECK(this->shared_gate_up.has_value() == this->shared_down.has_value() &&
                  (this->shared_down.has_value() || !this->shared_gate.has_value()),
              "a shared expert takes its gate_up and its down (and may take a gate)");
  TORCH_CHECK(this->gate_up.size() == this->down.size() && this->router.size(0) ==
                  static_cast<int64_t>(this->gate_up.size()),
              "one router row, one gate_up and one down projection an expert");
  TORCH_CHECK(groups >= 1 && kept_groups >= 1 && kept_groups <= groups && this->router.size(0) % groups == 0,
              "the experts in 1 or more equal groups, 1 to all of them kept: ", groups, ", ", kept_groups);
}

// LlamaSparseMoeBlock.forward_native with pagedllm.layers.moe.route's ops, in their order: h [T, H] -> [T, H].
at::Tensor MoEWeights::operator()(const at::Tensor& h) const {
  const at::Tensor logits = at::linear(h.to(router.scalar_type()), router, router_bias).to(at::kFloat);
  const at::Tensor probs = sigmoid ? at::sigmoid(logits) : at::softmax(logits, -1);
  at::Tensor top, ids;
  if (selection_bias || kept_groups < groups) {  // the experts chosen with the bias, weighted without it
    at::Tensor choice = selection_bias ? probs + *selection_bias : probs;
    if (kept_groups < groups) {  // among the experts of each token's best groups only
      const at::Tensor grouped = choice.view({choice.size(0), groups, -1});
      const at::Tensor scores = group_top2 ? std::get<0>(grouped.topk(2, -1)).sum(-1) : grouped.amax(-1);
      const at::Tensor kept = at::zeros_like(scores, scores.options().dtype(at::kBool))
                                  .scatter_(1, std::get<1>(at::topk(scores, kept_groups, -1)), true);
      choice = choice.masked_fill(kept.unsqueeze(-1).expand_as(grouped).reshape_as(choice).logical_not(),
                                  -std::numeric_limits<float>::infinity());
    }
    ids = std::get<1>(at::topk(choice, top_k, -1));
    top = probs.gather(-1, ids);
  } else {
    std::tie(top, ids) = at::topk(probs, top_k, -1);
  }
  if (renormalize) top = top / (top.sum(-1, true).clamp_min(norm_min) + norm_eps);
  if (scale != 1.0) top = top * scale;
  at::Tensor out = moe_experts(h, top, ids, gate_up, down, activation.alpha, activation.limit);
  if (shared_gate_up) {
    const at::Tensor shared = (*shared_down)(shared_gate_up->silu_and_mul(h));
    out = out + (shared_gate ? at::sigmoid(at::linear(h, *shared_gate)) * shared : shared);
  }
  return out;
}

}  // namespace pagedllm

// A mixture of experts' MLP from C++: pagedllm.models.llama.LlamaSparseMoeBlock, routing and experts.
//
// From Python each expert is ~8 calls (a gather, two or three kernels, a scale, an add), and every kernel splits
// its few rows' work between the threads and joins them: at a decode step's two rows an expert, ~220 us an expert on
// a 2-core VM, a third of it beside the weights' bytes. Here the experts are what the threads split: each thread
// runs whole experts, their kernels on one thread (a kernel called inside a parallel region runs on its caller's
// thread), taken as parallel_units deals them, so the threads stream weights without meeting between experts.
// Then each token's weighted rows are added in expert order, as pagedllm.layers.moe.run_experts adds them.
#include "linear_common.h"
#include "ops.h"

#include <utility>
#include <vector>

namespace pagedllm {

namespace {

// One routed slot of a token: row `row` of expert output `output`, times `weight`.
struct Slot {
  int64_t output, row;
  float weight;
};

// out[t] = sum over t's slots, in expert order, of round(outputs[slot][row] * round(weight)), each product and
// each sum rounded to T: the bits of `y * weight` (weights cast to x's dtype) then `out.index_add_` expert by
// expert, without their ~20 us of calls an expert. The products are stored before they are added (and
// `rounding_barrier` keeps GCC from fusing the two into one FMA, which would round once).
template <typename T>
void add_slots(at::Tensor& out, const std::vector<at::Tensor>& outputs, const std::vector<std::vector<Slot>>& slots) {
  const int64_t hidden = out.size(1);
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, out.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<T> product(hidden);
    for (int64_t t = begin; t < end; ++t) {
      T* o = dst + t * hidden;
      for (const Slot& slot : slots[t]) {
        const T* y = outputs[slot.output].data_ptr<T>() + slot.row * hidden;
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

}  // namespace

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                       const std::vector<LinearWeights>& gate_up, const std::vector<LinearWeights>& down) {
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
  std::vector<int64_t> active;
  std::vector<std::vector<Slot>> slots(x.size(0));  // each token's slots, in expert order
  for (int64_t e = 0; e < num_experts; ++e) {
    if (rows[e].empty()) continue;
    for (size_t r = 0; r < rows[e].size(); ++r) {
      slots[rows[e][r]].push_back({static_cast<int64_t>(active.size()), static_cast<int64_t>(r), row_weights[e][r]});
    }
    active.push_back(e);
  }
  std::vector<at::Tensor> outputs(active.size());
  const at::Tensor rows_x = x.contiguous();
  parallel_units(static_cast<int64_t>(active.size()), at::get_num_threads(), [&](const auto& take) {
    for (int64_t u; (u = take()) >= 0;) {
      const int64_t e = active[u];
      const at::Tensor tokens = at::from_blob(rows[e].data(), {static_cast<int64_t>(rows[e].size())}, at::kLong);
      outputs[u] = down[e](gate_up[e].silu_and_mul(rows_x.index_select(0, tokens))).contiguous();
    }
  });
  at::Tensor out = at::zeros_like(rows_x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "moe_experts",
                                  [&] { add_slots<scalar_t>(out, outputs, slots); });
  return out;
}

MoEWeights::MoEWeights(at::Tensor router, int64_t top_k, bool renormalize, std::vector<LinearWeights> gate_up,
                       std::vector<LinearWeights> down, c10::optional<LinearWeights> shared_gate_up,
                       c10::optional<LinearWeights> shared_down, c10::optional<at::Tensor> shared_gate)
    : router(std::move(router)), top_k(top_k), renormalize(renormalize), gate_up(std::move(gate_up)),
      down(std::move(down)), shared_gate_up(std::move(shared_gate_up)), shared_down(std::move(shared_down)),
      shared_gate(std::move(shared_gate)) {
  TORCH_CHECK(this->shared_gate_up.has_value() == this->shared_down.has_value() &&
                  this->shared_down.has_value() == this->shared_gate.has_value(),
              "a shared expert takes its gate_up, its down and its gate");
  TORCH_CHECK(this->gate_up.size() == this->down.size() && this->router.size(0) ==
                  static_cast<int64_t>(this->gate_up.size()),
              "one router row, one gate_up and one down projection an expert");
}

// LlamaSparseMoeBlock.forward with pagedllm.layers.moe.route's ops, in its order: h [T, H] -> [T, H].
at::Tensor MoEWeights::operator()(const at::Tensor& h) const {
  const at::Tensor probs = at::softmax(at::linear(h, router).to(at::kFloat), -1);
  auto [top, ids] = at::topk(probs, top_k, -1);
  if (renormalize) top = top / top.sum(-1, true);
  at::Tensor out = moe_experts(h, top, ids, gate_up, down);
  if (shared_gate_up) {
    out = out + at::sigmoid(at::linear(h, *shared_gate)) * (*shared_down)(shared_gate_up->silu_and_mul(h));
  }
  return out;
}

}  // namespace pagedllm

// A mixture of experts' MLP from C++: pagedllm.models.llama.LlamaSparseMoeBlock, routing and experts.
//
// From Python each expert is ~8 calls (a gather, two or three kernels, a scale, an add), and every kernel splits
// its few rows' work between the threads and joins them: at a decode step's two rows an expert, ~220 us an expert on
// a 2-core VM, a third of it beside the weights' bytes. Here the experts are what the threads split: each thread
// runs whole experts, their kernels on one thread (a kernel called inside a parallel region runs on its caller's
// thread), taken as parallel_units deals them, so the threads stream weights without meeting between experts
// (an expert with more than kUnitRows rows is split into several units).
// Then each token's weighted rows are added in expert order, as pagedllm.layers.moe.run_experts adds them.
#include "linear_common.h"
#include "ops.h"

#include <utility>
#include <vector>

namespace pagedllm {

namespace {

// One routed slot of a token: row `row` of unit `output`'s output, times `weight`.
struct Slot {
  int64_t output, row;
  float weight;
};

// Rows [first, first + count) of an expert's tokens.
struct Unit {
  int64_t expert, first, count;
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
  // the units of work: runs of at most kUnitRows of an expert's rows, so that an expert most tokens chose does
  // not keep one thread busy while the other waits
  std::vector<Unit> units;
  std::vector<std::vector<Slot>> slots(x.size(0));  // each token's slots, in expert order
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = static_cast<int64_t>(rows[e].size());
    for (int64_t first = 0; first < n; first += kUnitRows) {
      const int64_t count = std::min(kUnitRows, n - first);
      for (int64_t r = 0; r < count; ++r) {
        slots[rows[e][first + r]].push_back({static_cast<int64_t>(units.size()), r, row_weights[e][first + r]});
      }
      units.push_back({e, first, count});
    }
  }
  std::vector<at::Tensor> outputs(units.size());
  const at::Tensor rows_x = x.contiguous();
  parallel_units(static_cast<int64_t>(units.size()), at::get_num_threads(), [&](const auto& take) {
    for (int64_t u; (u = take()) >= 0;) {
      const Unit& unit = units[u];
      const at::Tensor tokens = at::from_blob(rows[unit.expert].data() + unit.first, {unit.count}, at::kLong);
      const int64_t padded = gate_up[unit.expert].weight.is_mkldnn() ? onednn_rows(unit.count) : unit.count;
      at::Tensor x_rows = at::empty({padded, rows_x.size(1)}, rows_x.options());
      at::Tensor gathered = x_rows.narrow(0, 0, unit.count);
      at::index_select_out(gathered, rows_x, 0, tokens);
      x_rows.narrow(0, unit.count, padded - unit.count).zero_();
      outputs[u] = down[unit.expert](gate_up[unit.expert].silu_and_mul(x_rows)).narrow(0, 0, unit.count).contiguous();
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

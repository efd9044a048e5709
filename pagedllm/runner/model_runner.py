"""The model runner: executes one scheduler step on the device.

It moves blocks the scheduler asked to move, builds the flat inputs, runs the model over the paged KV cache and
samples. It never decides policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import CacheConfig
from pagedllm.core.request import child_seed
from pagedllm.core.sched.output import NewRequestData, RunnerOutput, SchedulerOutput
from pagedllm.loader import LoadedModel
from pagedllm.runner import kv_tensors
from pagedllm.runner.input_batch import CachedRequestState, ModelInputs, build_model_inputs
from pagedllm.sample.metadata import SamplingMetadata, SamplingRow, make_generator
from pagedllm.sample.sampler import Sampler
from pagedllm.spec_decode.rejection_sampler import verify_drafts


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


def model_shape(hf_config) -> ModelShape:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return ModelShape(hf_config.num_hidden_layers, num_kv_heads, head_dim, hf_config.vocab_size)


class ModelRunner:
    """Owns the model, the KV tensors and each request's sampling state."""

    def __init__(self, loaded: LoadedModel, cache_config: CacheConfig, eos_token_id: int | None,
                 seed: int = 0) -> None:
        self.model = loaded.model
        self.device = next(self.model.parameters()).device
        self.shape = model_shape(loaded.hf_config)
        self.layout = kv_tensors.KVLayout(self.shape.num_layers, self.shape.num_kv_heads, self.shape.head_dim,
                                          loaded.dtype)
        self.block_size = cache_config.block_size
        self.eos_token_id = eos_token_id
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.global_generator = make_generator(seed, self.device)
        self.kv: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.swap: kv_tensors.SwapSpace | None = None

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv = kv_tensors.allocate_kv(self.layout, num_blocks, self.block_size, self.device)
        self.kv_caches = kv_tensors.layer_caches(self.kv)

    def allocate_swap_space(self, num_blocks: int, path: str | None = None) -> None:
        """The swap pool: pinned host memory beside a GPU, a memory-mapped file on a CPU device."""
        self.swap = kv_tensors.SwapSpace(self.layout, num_blocks, self.block_size, self.device, path)

    def _move_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """Swap-out, then swap-in, then copy-on-write copies: the order SchedulerOutput promises."""
        assert self.kv is not None, "allocate_kv_cache() must run before execute()"
        if scheduler_output.blocks_to_swap_out or scheduler_output.blocks_to_swap_in:
            assert self.swap is not None, "the scheduler swapped without a swap pool"
            kv_tensors.swap_blocks(self.kv, self.swap.kv, scheduler_output.blocks_to_swap_out)
            kv_tensors.swap_blocks(self.swap.kv, self.kv, scheduler_output.blocks_to_swap_in)
        kv_tensors.copy_blocks(self.kv, scheduler_output.blocks_to_copy)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            self.requests.pop(request_id, None)
        # A preempted request keeps its state here (above all its seeded generator, so that its samples do not
        # depend on whether it was preempted); it comes back through new_requests and is recognised.
        for new in scheduler_output.new_requests:
            self._add_request(new)
        self._move_blocks(scheduler_output)
        if not scheduler_output.scheduled:
            return RunnerOutput()
        inputs = build_model_inputs(scheduler_output.scheduled, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not inputs.sample_request_ids:
            return RunnerOutput()
        children = {s.request_id: s.child_request_ids for s in scheduler_output.scheduled if s.child_request_ids}
        drafts = {s.request_id: s.spec_token_ids for s in scheduler_output.scheduled if s.spec_token_ids}
        if drafts:
            return self._sample_with_drafts(hidden, inputs, children, drafts)
        return self._sample(hidden[inputs.logits_indices], inputs.sample_request_ids, children)

    def _add_request(self, new: NewRequestData) -> None:
        if new.request_id in self.requests:
            return
        self.requests[new.request_id] = CachedRequestState(new.request_id, list(new.prompt_token_ids),
                                                       new.sampling_params, self._generator(new.sampling_params.seed))

    def _add_child(self, parent_id: str, child_id: str, index: int) -> None:
        """Sampling state for child `index` of a parallel-sampling request: its own seed stream."""
        parent = self.requests[parent_id]
        generator = self._generator(child_seed(parent.params.seed, index))
        self.requests[child_id] = CachedRequestState(child_id, parent.prompt_token_ids, parent.params, generator,
                                                     list(parent.output_token_ids))

    def _generator(self, seed: int | None) -> torch.Generator | None:
        """A seeded request's own random stream; None draws from the engine's global one."""
        return make_generator(seed, self.device) if seed is not None else None

    def _fork_rows(self, request_ids: list[str], children: dict[str, list[str]]) -> tuple[list[int], list[str]]:
        """Repeat each forking request's logits row once per child: (row of each sample, its request id)."""
        rows, row_request_ids = [], []
        for row, request_id in enumerate(request_ids):
            rows.append(row)
            row_request_ids.append(request_id)
            for index, child_id in enumerate(children.get(request_id, ()), start=1):
                self._add_child(request_id, child_id, index)
                rows.append(row)
                row_request_ids.append(child_id)
        return rows, row_request_ids

    def _sample(self, hidden: torch.Tensor, sample_request_ids: list[str],
                children: dict[str, list[str]]) -> RunnerOutput:
        """Sample one token per row of `hidden` ([num_sampled, H], the last row of each sampling request)."""
        logits = self.model.compute_logits(hidden)                          # [num_sampled, vocab]
        if children:
            rows, sample_request_ids = self._fork_rows(sample_request_ids, children)
            logits = logits[torch.tensor(rows, device=logits.device)]       # [num_sampled + children, vocab]
        states = [self.requests[request_id] for request_id in sample_request_ids]
        rows = [self._sampling_row(s) for s in states]
        meta = SamplingMetadata.build(rows, self.shape.vocab_size, self.device, self.global_generator)
        result = self.sampler(logits, meta)
        token_ids = result.token_ids.tolist()
        for state, token_id in zip(states, token_ids):
            state.output_token_ids.append(token_id)
        sampled = dict(zip(sample_request_ids, token_ids))
        logprobs = result.logprobs.to_lists(sample_request_ids) if result.logprobs is not None else {}
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sampling_row(self, state: CachedRequestState, draft_ids: list[int] | None = None) -> SamplingRow:
        """The sampler's view of a request, after its output tokens and then `draft_ids`."""
        output_token_ids = state.output_token_ids + draft_ids if draft_ids else state.output_token_ids
        return SamplingRow(state.params, state.prompt_token_ids, output_token_ids, state.generator, self.eos_token_id)

    def _sample_with_drafts(self, hidden: torch.Tensor, inputs: ModelInputs, children: dict[str, list[str]],
                            drafts: dict[str, list[int]]) -> RunnerOutput:
        """Sample the requests without drafts as usual; verify the others' drafts (pagedllm.spec_decode) on the
        logits of their last 1 + k rows."""
        last_rows = inputs.logits_indices.tolist()
        plain = [(row, r) for row, r in zip(last_rows, inputs.sample_request_ids) if r not in drafts]
        output = (self._sample(hidden[[row for row, _ in plain]], [r for _, r in plain], children) if plain
                  else RunnerOutput())
        spec = [(row, r) for row, r in zip(last_rows, inputs.sample_request_ids) if r in drafts]
        request_ids = [r for _, r in spec]
        rows = [row - k for row, r in spec for k in range(len(drafts[r]), -1, -1)]
        logits = self.model.compute_logits(hidden[rows])                    # [sum(k + 1), vocab]
        states = [self.requests[r] for r in request_ids]
        sampling_rows = [self._sampling_row(s, drafts[r][:j]) for s, r in zip(states, request_ids)
                         for j in range(len(drafts[r]) + 1)]
        meta = SamplingMetadata.build(sampling_rows, self.shape.vocab_size, self.device, self.global_generator)
        verified = verify_drafts(logits, meta, request_ids, [drafts[r] for r in request_ids])
        for state, request_id, num_accepted, token_id in zip(states, request_ids, verified.num_accepted,
                                                             verified.token_ids):
            state.output_token_ids += drafts[request_id][:num_accepted] + [token_id]
            output.sampled_token_ids[request_id] = token_id
            output.num_accepted_draft_tokens[request_id] = num_accepted
        output.logprobs.update(verified.logprobs)
        return output

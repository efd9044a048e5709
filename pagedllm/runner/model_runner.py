"""The model runner: executes one scheduler step on the device.

It moves blocks the scheduler asked to move, builds the flat inputs, runs the model over the paged KV cache and
samples. It never decides policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import CacheConfig
from pagedllm.core.request import child_seed
from pagedllm.core.sched.output import NewRequestData, RunnerOutput, ScheduledRequest, SchedulerOutput
from pagedllm.loader import LoadedModel
from pagedllm.runner import kv_tensors
from pagedllm.runner.input_batch import CachedRequestState, ModelInputs, build_model_inputs
from pagedllm.sample.metadata import SamplingMetadata, SamplingRow, make_generator
from pagedllm.sample.sampler import Sampler, position_logprobs


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
        prompt_logprobs = self._prompt_logprobs(hidden, inputs, scheduler_output.scheduled)
        if not inputs.sample_request_ids:
            return RunnerOutput(prompt_logprobs=prompt_logprobs)
        children = {s.request_id: s.child_request_ids for s in scheduler_output.scheduled if s.child_request_ids}
        output = self._sample(hidden, inputs, children)
        output.prompt_logprobs = prompt_logprobs
        return output

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: ModelInputs,
                         scheduled: list[ScheduledRequest]) -> dict[str, list]:
        """For each request that wants prompt logprobs: the logprobs of the prompt tokens its rows predict this
        step (row p predicts prompt token p + 1), from raw logits, skipping positions already reported."""
        result = {}
        for s in scheduled:
            state = self.requests[s.request_id]
            num = state.params.prompt_logprobs
            start = max(s.num_computed_tokens, state.num_prompt_logprob_positions)
            end = min(s.num_computed_tokens + s.num_new_tokens, len(state.prompt_token_ids) - 1)
            if num is None or start >= end:
                continue
            row = inputs.first_rows[s.request_id] + start - s.num_computed_tokens
            logits = self.model.compute_logits(hidden[row:row + end - start])             # [end - start, vocab]
            targets = torch.tensor(state.prompt_token_ids[start + 1:end + 1], device=logits.device)
            result[s.request_id] = position_logprobs(logits, targets, num)
            state.num_prompt_logprob_positions = end
        return result

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
                                                     list(parent.output_token_ids),
                                                     parent.num_prompt_logprob_positions)

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

    def _sample(self, hidden: torch.Tensor, inputs: ModelInputs, children: dict[str, list[str]]) -> RunnerOutput:
        logits = self.model.compute_logits(hidden[inputs.logits_indices])   # [num_sampled, vocab]
        sample_request_ids = inputs.sample_request_ids
        if children:
            rows, sample_request_ids = self._fork_rows(sample_request_ids, children)
            logits = logits[torch.tensor(rows, device=logits.device)]       # [num_sampled + children, vocab]
        states = [self.requests[request_id] for request_id in sample_request_ids]
        rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator, self.eos_token_id)
                for s in states]
        meta = SamplingMetadata.build(rows, self.shape.vocab_size, self.device, self.global_generator)
        result = self.sampler(logits, meta)
        token_ids = result.token_ids.tolist()
        for state, token_id in zip(states, token_ids):
            state.output_token_ids.append(token_id)
        sampled = dict(zip(sample_request_ids, token_ids))
        logprobs = result.logprobs.to_lists(sample_request_ids) if result.logprobs is not None else {}
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

"""Draft-model speculative decoding: a smaller model of the same tokenizer proposes the drafts.

The draft model keeps its K/V in a pool of its own, addressed by the target's block tables: block b of a
request's table holds the target's K/V in the target's pool and the draft's in the draft's. So the scheduler's
tables, copy-on-write copies and lookahead slots serve both, and nothing else keeps track of the draft.

After a step in which a request sampled (and the scheduler gave it `num_lookahead_tokens` k), the runner asks
for k drafts to follow its tokens:

    tokens:  ... t  d1 d2 | n          the step verified d1 d2 after t, accepted d1 d2, sampled n
    pass 1:  the tokens the draft has not seen (the step's accepted ones and n; the whole context the first
             time) -> argmax e1, written at their positions
    pass j:  e_{j-1} at the next position -> argmax e_j, for j = 2..k

Greedy drafts are a point mass, for which the target's verification (`rejection_sampler`) keeps the output
distribution exactly the target's, and greedy outputs identical. The draft's K/V decides only which tokens are
proposed, never which are output, so it is kept simply: a request that comes back after a preemption (its
blocks freed, or swapped without the draft's K/V) or that is new (a prefix-cache hit's blocks hold K/V the
draft may never have written) has its whole context run through the draft again.
"""

from __future__ import annotations

import torch

from pagedllm.core.sched.output import ScheduledRequest
from pagedllm.kernels import kernels_fixed
from pagedllm.loader import LoadedModel
from pagedllm.runner import kv_tensors
from pagedllm.runner.input_batch import CachedRequestState, build_model_inputs
from pagedllm.runner.model_runner import model_shape
from pagedllm.sample.ops import argmax_rows


class DraftModel:
    """The draft model, its K/V pool, and `propose` (see the module docstring).

    Args:
        loaded: the draft model, loaded in the target's dtype on its device.
        block_size: the target's block size (the draft's pool has the target's blocks).
        kv_cache_dtype: the target's ("auto" or "int8").
        max_model_len: the target's context length; no draft goes past it.
        vocab_size: the target's vocabulary; drafts are the draft's argmax over the ids both have.
    """

    def __init__(self, loaded: LoadedModel, block_size: int, kv_cache_dtype: str, max_model_len: int,
                 vocab_size: int) -> None:
        self.model = loaded.model
        self.name = loaded.resolved.name
        self.device = next(self.model.parameters()).device
        shape = model_shape(loaded.hf_config)
        self.layout = kv_tensors.KVLayout(shape.num_layers, shape.num_kv_heads, shape.head_dim, loaded.dtype,
                                          kv_cache_dtype)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = min(vocab_size, shape.vocab_size)
        self.kv: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv = kv_tensors.allocate_kv(self.layout, num_blocks, self.block_size, self.device)
        self.kv_caches = kv_tensors.layer_caches(self.kv)

    def release_kv_cache(self) -> None:
        self.kv, self.kv_caches = None, []

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """The scheduler's copy-on-write copies, in the draft's pool too."""
        assert self.kv is not None
        kv_tensors.copy_blocks(self.kv, pairs)

    @torch.inference_mode()
    def propose(self, requests: list[tuple[CachedRequestState, list[int], int]]) -> dict[str, list[int]]:
        """Up to `num` greedy drafts to follow each request's tokens, for (its state, its block table, num) each;
        fewer where max_model_len comes first. The table must have room for the drafts' K/V (`num - 1` slots past
        the request's tokens)."""
        drafts: dict[str, list[int]] = {}
        batch: list[tuple[ScheduledRequest, int]] = []       # (this pass's tokens of a request, its drafts wanted)
        for state, block_ids, num in requests:
            tokens = state.prompt_token_ids + state.output_token_ids
            num = min(num, self.max_model_len - len(tokens))
            if num <= 0:
                continue
            start = min(state.num_draft_computed_tokens, len(tokens) - 1)
            batch.append((ScheduledRequest(state.request_id, block_ids, start, tokens[start:], sample=True), num))
            state.num_draft_computed_tokens = len(tokens)
            drafts[state.request_id] = []
        while batch:
            next_ids = self._greedy([s for s, _ in batch])
            next_batch = []
            for s, num in batch:
                draft = drafts[s.request_id]
                draft.append(next_ids[s.request_id])
                if len(draft) < num:
                    next_batch.append((ScheduledRequest(s.request_id, s.block_ids, s.num_computed_tokens
                                                        + s.num_new_tokens, [draft[-1]], sample=True), num))
            batch = next_batch
        return drafts

    def _greedy(self, scheduled: list[ScheduledRequest]) -> dict[str, int]:
        """One forward pass of the draft over `scheduled` (writing their K/V): request id -> the argmax after its
        last token."""
        inputs = build_model_inputs(scheduled, self.block_size, self.device, cascade=False)
        with kernels_fixed():
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, None)
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return dict(zip(inputs.sample_request_ids, argmax_rows(logits[:, :self.vocab_size]).tolist()))

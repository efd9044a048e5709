"""Turns a scheduler step into the flat tensors one forward pass takes.

The batch is flat: the new tokens of every scheduled request, one after another.

    request:        A (3 new)      B (1 new)   C (2 new)
    rows:           0  1  2        3           4  5
    query_start:    0              3           4          6
    positions:      5  6  7        40          0  1        (num_computed_tokens + offset)
    slot:           block_table[pos // block_size] * block_size + pos % block_size
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.core.sched.output import ScheduledRequest
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal import ImageInput, MRopeLayout
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher


@dataclass(slots=True)
class CachedRequestState:
    """What the runner remembers about a request between steps (it survives preemption)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    grammar: LLMatcher | None = None     # structured outputs: the parse state after output_token_ids
    num_prompt_logprob_positions: int = 0    # prompt positions whose logprobs went out (a recompute skips them)
    pooling: PoolingParams | None = None     # an embedding request
    # MEAN / CLS pooling: per prompt chunk (by its first position), the sum of its rows' hidden states or (CLS,
    # the chunk at 0) the first row's; keyed so that a chunk run again (a failed step's rerun) replaces its own
    pooled_chunks: dict[int, torch.Tensor] = field(default_factory=dict)
    lora: LoRARequest | None = None          # its LoRA adapter
    token_type_ids: list[int] | None = None  # its prompt's token types (a BERT cross-encoder's pair); None: all 0
    num_draft_computed_tokens: int = 0       # tokens whose K/V the draft model wrote (pagedllm.spec_decode.draft_model)
    images: tuple[ImageInput, ...] = ()      # its prompt's images
    # image index -> the image encoder's rows for its placeholders, from the first step that reaches them until
    # the request ends (a recompute after a preemption reads them again)
    image_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    mrope: MRopeLayout | None = None         # where M-RoPE puts its tokens, when its prompt has grid images
    thinking: bool = False                   # in a thought its structured-output constraint waits out

    @property
    def seen_prompt_token_ids(self) -> list[int]:
        """The prompt's tokens the penalties count as seen: none for a prompt of embeddings, whose ids are placeholders
        (transformers' generate from inputs_embeds counts none either)."""
        return [] if any(image.embeds for image in self.images) else self.prompt_token_ids


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor          # [num_tokens]
    positions: torch.Tensor          # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor     # [num_sampled]: the row of each sampling request's last token
    sample_request_ids: list[str]        # the requests those rows belong to, in order
    first_rows: dict[str, int]       # request id -> the row of its first new token


def build_model_inputs(scheduled: list[ScheduledRequest], block_size: int, device: torch.device,
                       cascade: bool = True) -> ModelInputs:
    # Decodes first: attention runs them as one batch (see pagedllm.attention.cpu).
    scheduled = sorted(scheduled, key=lambda s: len(s.token_ids) > 1)
    num_new = np.fromiter((len(s.token_ids) for s in scheduled), dtype=np.int64, count=len(scheduled))
    num_computed = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64, count=len(scheduled))
    query_start = np.zeros(len(scheduled) + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start[1:])
    num_tokens = int(query_start[-1])

    row_req = np.repeat(np.arange(len(scheduled)), num_new)                      # [num_tokens]
    positions = num_computed[row_req] + np.arange(num_tokens) - query_start[row_req]
    block_tables = _block_table_array(scheduled)
    slots = block_tables[row_req, positions // block_size] * block_size + positions % block_size
    seq_lens = num_computed + num_new

    sample_rows = [i for i, s in enumerate(scheduled) if s.sample]
    input_ids = np.fromiter(chain.from_iterable(s.token_ids for s in scheduled), dtype=np.int64, count=num_tokens)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc=torch.from_numpy(query_start.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(block_tables).to(device),
        max_query_len=int(num_new.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        cascade=cascade,
    )
    return ModelInputs(
        input_ids=torch.from_numpy(input_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        meta=meta,
        logits_indices=torch.from_numpy(query_start[1:][sample_rows] - 1).to(device),
        sample_request_ids=[scheduled[i].request_id for i in sample_rows],
        first_rows={s.request_id: int(start) for s, start in zip(scheduled, query_start)},
    )


def _block_table_array(scheduled: list[ScheduledRequest]) -> np.ndarray:
    """[num_seqs, max_blocks] int32, padded with 0 (the null block)."""
    max_blocks = max(len(s.block_ids) for s in scheduled)
    table = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
    for row, s in enumerate(scheduled):
        table[row, : len(s.block_ids)] = s.block_ids
    return table

"""Attention metadata: what one forward pass needs to read and write the paged KV cache.

The KV cache of one layer is a tuple `(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads,
head_dim]`. The batch is flattened: the new tokens of all sequences are concatenated into `num_tokens` rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from pagedllm.models.recurrent import RecurrentStep

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and what each sequence's queries may read.

    Invariants: `query_start_loc[-1] == num_tokens`; for each seq i, `q_len_i = qsl[i+1] - qsl[i] <=
    seq_lens[i]`, and `block_tables[i]` holds at least `ceil(seq_lens[i] / block_size)` real block ids.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64; slot = block_table[pos // bs] * bs + pos % bs
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32; seq i's new tokens are rows qsl[i]:qsl[i+1]
    seq_lens: torch.Tensor  # [num_seqs] int32; context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies of query_start_loc / seq_lens, for per-sequence Python loops (filled in if omitted).
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    # Whether the CPU kernels may run the step's attention as cascade attention where it pays (a shared prefix).
    cascade: bool = True
    # Gemma 3's images: (the step's rows of an image's placeholders, up to its last; the metadata of those rows as
    # queries of their sequence up to the image's end), rows that see their whole image, not only what precedes them
    image_spans: list[tuple[slice, AttentionMetadata]] = field(default_factory=list)
    # recurrent layers' states of the step's requests (the runner's `RecurrentStates`); None: every sequence from its
    # first token, its states dropped
    recurrent: RecurrentStep | None = None
    # earlier_slots' answers, by how far back: the same for every layer of the step
    _earlier: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.query_start_loc_cpu:
            self.query_start_loc_cpu = self.query_start_loc.tolist()
        if not self.seq_lens_cpu:
            self.seq_lens_cpu = self.seq_lens.tolist()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def earlier_slots(self, positions: torch.Tensor, back: int, block_size: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where each new token's sequence holds its token `back` positions earlier: (block ids, offsets in them,
        whether it is before the sequence's start, where the first two read position 0), each [num_tokens]; for
        LFM2's convolutions (pagedllm.models.llama.ShortConv), worked out once a step."""
        if back not in self._earlier:
            counts = self.query_start_loc[1:] - self.query_start_loc[:-1]
            seqs = torch.repeat_interleave(torch.arange(len(counts), device=positions.device), counts)
            earlier = positions.long() - back
            clamped = earlier.clamp(min=0)
            self._earlier[back] = (self.block_tables[seqs, clamped // block_size].long(), clamped % block_size,
                                   earlier < 0)
        return self._earlier[back]

    @cached_property
    def num_decodes(self) -> int:
        """How many leading sequences have exactly one new token (the runner puts decodes first)."""
        qsl = self.query_start_loc_cpu
        count = 0
        while count < self.num_seqs and qsl[count + 1] - qsl[count] == 1:
            count += 1
        return count

    @classmethod
    def build(cls, block_tables: list[list[int]], num_computed: list[int], query_lens: list[int],
              block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """Metadata for sequences that have `num_computed[i]` cached tokens and `query_lens[i]` new ones.

        A convenience for tests and simple runners; `block_tables[i]` must cover the new context length.
        """
        seq_lens = [c + q for c, q in zip(num_computed, query_lens)]
        slots: list[int] = []
        for table, start, end in zip(block_tables, num_computed, seq_lens):
            slots.extend(table[pos // block_size] * block_size + pos % block_size for pos in range(start, end))
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), max_blocks),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )


class AttentionBackend(Protocol):
    """(query, k_cache, v_cache, meta, scale, window, softcap, alibi_slopes=..., sinks=...) -> out; see
    pagedllm.attention.torch_ref.paged_attention_ref."""

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, window: int = 0, softcap: float = 0.0, *,
                 alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor: ...

"""CUDA graphs for decode steps, as vLLM captures them.

A decode step on a GPU runs a dozen small kernels a layer (360 for SmolLM2's 30 layers), each a few microseconds
of work behind as many of Python and launch: the step is bound by the host, not the device. A CUDA graph records
the launches of one forward pass once and replays them all with one call.

A graph fixes what its capture saw: the addresses and shapes of every tensor, and every value the forward pass
read on the host. So, for each batch size in `capture_sizes`:

    step of B decodes  ->  the graph of the smallest captured size S >= B
    static buffers      input_ids  positions  slot_mapping  seq_lens  block_tables [S_max, max_blocks_per_seq]
    rows 0..B-1         this step's, copied in before the replay
    rows B..S-1         padding: token 0 at position 0, its K/V written to slot 0 of the null block (block 0,
                        never handed out) and its attention reading that slot alone (seq_len 1)
    output              rows 0..B-1 of the graph's hidden states

- The capture's metadata says "S sequences of one new token each": all the Triton backend reads on the host
  (`num_decodes`, `max_query_len`). Context lengths and block ids are read on the device, from the buffers.
- The block-table buffer has a column for every block of `max_model_len` tokens, so no decode outgrows it.
- The graphs read the KV pool by address: `ModelRunner.allocate_kv_cache` drops them, a new pool needs a new capture.
- Steps with prefill chunks or speculative drafts (more than one new token for a request), and batches over the
  largest size, run eagerly. `enforce_eager=True` captures nothing.

The sizes are captured largest first into one memory pool, which the smaller ones reuse (vLLM's order).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable

import torch

from pagedllm.attention.metadata import AttentionMetadata

__all__ = ["Capture", "DecodeGraphs", "capture_sizes", "cuda_capture"]

# Capture(run) -> (replay, out): record `run` (a forward pass over the static buffers) so that replay() redoes its
# work, leaving the result in `out` (the tensor run returned when captured).
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]

_LARGEST_SIZE = 256   # vLLM's: larger decode batches are bound by the device's arithmetic, not by launches


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to the first that holds max_num_seqs sequences (at most 256)."""
    sizes = []
    for size in [1, 2, 4, *range(8, _LARGEST_SIZE + 1, 8)]:
        sizes.append(size)
        if size >= max_num_seqs:
            break
    return sizes


def cuda_capture() -> Capture:
    """A Capture into CUDA graphs that share one memory pool."""
    pool = torch.cuda.graph_pool_handle()

    def capture(run: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = run()
        return graph.replay, out

    return capture


class DecodeGraphs:
    """One captured forward pass per size in `sizes`, over static input buffers (see the module docstring).

    Args:
        forward: (input_ids [T], positions [T], meta) -> hidden states [T, H], the runner's forward pass.
        sizes: the batch sizes to capture.
        max_blocks_per_seq: the block-table buffer's columns (blocks of max_model_len tokens).
        device: where the buffers live (the model's device).
        capture: how to record a pass (`cuda_capture()` on a GPU).
    """

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 sizes: list[int], max_blocks_per_seq: int, device: torch.device, capture: Capture) -> None:
        self.sizes = sorted(sizes)
        rows = self.sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(rows, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        for size in reversed(self.sizes):
            run = functools.partial(forward, self.input_ids[:size], self.positions[:size], self._meta(size))
            run()     # warm-up: the first pass compiles kernels and makes workspaces, which a capture cannot
            self._graphs[size] = capture(run)

    def _meta(self, size: int) -> AttentionMetadata:
        """`size` sequences of one new token each, over the buffers' first rows."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size], max_query_len=1,
            max_seq_len=self.block_tables.shape[1], query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size)

    def covers(self, meta: AttentionMetadata) -> bool:
        """Whether a step with this metadata can replay a graph: decodes only, and not too many of them."""
        return (meta.max_query_len == 1 and 0 < meta.num_seqs <= self.sizes[-1]
                and meta.block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The forward pass of a step that `covers` allows: hidden states [B, H], a view of the graph's output that
        the next replay overwrites."""
        num = meta.num_seqs
        size = self.sizes[bisect.bisect_left(self.sizes, num)]
        self.input_ids[:num].copy_(input_ids)
        self.positions[:num].copy_(positions)
        self.slot_mapping[:num].copy_(meta.slot_mapping)
        self.seq_lens[:num].copy_(meta.seq_lens)
        self.block_tables[:num, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if num < size:   # padding rows, which a larger step may have filled: token 0 at 0 in the null slot, 1 key
            for buffer in (self.input_ids, self.positions, self.slot_mapping):
                buffer[num:size].zero_()
            self.seq_lens[num:size].fill_(1)
        replay, out = self._graphs[size]
        replay()
        return out[:num]

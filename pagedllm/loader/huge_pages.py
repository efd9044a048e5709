"""A CPU model's weights moved into memory backed by 2 MiB pages, once loaded and packed.

A decode step streams every weight it multiplies from memory. In 4 KiB pages each page of a stream costs a TLB miss
and restarts the hardware prefetcher; a mixture of experts' experts, each a packed weight of ~1.5 MiB read whole by
one thread, suffer it most. Measured on the AMX Xeon of docs/benchmarks.md (64 experts' 768 x 1,024 bf16 weights in
torch's brgemm blocks, 4-row products): one thread 8.0-8.4 GB/s from 4 KiB pages, 11.6-12.5 from 2 MiB ones; two
threads 14.8-15.7 against 20.7-20.9.

`place_in_huge_pages` copies the weights of at least `MIN_BYTES` into one buffer whose 2 MiB-aligned interior is
advised as huge pages (`madvise(MADV_HUGEPAGE)`, which Linux's default THP setting, "madvise", honours) before it is
first written, and points each parameter at its slice (the Parameter objects, and the attributes the kernels read
on them, stay). Embedding tables stay where they are: a lookup reads a row per token, it does not stream them.

Where: on Linux, for a CPU device, except on AMD's CPUs, where a Zen 5 ran the engine's decode steps slower with
SmolLM2's packed weights on huge pages (session 32 in docs/benchmarks.md: 1.25-1.32x slower, level with each tensor
on its own 2 MiB boundary, not understood) though the kernel alone ran faster. PAGEDLLM_HUGE_PAGES=1 places them on
any CPU, =0 on none.

In an engine, on the same Xeon: SmolLM2's GGUF blocks decoding one stream 59-63 -> 73.5 tok/s, the mixed workload
424-460 -> 495-528 output tok/s, a mixture of experts' decode (qwen3-moe-1b) 137-142 -> 163-178. The cost is at
start-up, where Linux assembles the huge pages as they are first written (`_fault_in`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading

import torch
from torch import nn

from pagedllm.cpu import cpu_info

logger = logging.getLogger(__name__)

HUGE_PAGES_ENV = "PAGEDLLM_HUGE_PAGES"   # "1": on any CPU, "0": on none; unset: `wanted`
HUGE_PAGE = 2 << 20
MIN_BYTES = 64 << 10     # smaller tensors (norms, biases) stay: they stay in cache
_ALIGN = 64              # each weight's start, as the kernels' loads want
_MADV_HUGEPAGE = 14


def _advise_huge_pages(address: int, length: int) -> bool:
    """madvise(MADV_HUGEPAGE) over [address, address + length), both multiples of HUGE_PAGE; False if refused."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(address, length, _MADV_HUGEPAGE) == 0


def wanted() -> bool:
    """PAGEDLLM_HUGE_PAGES=1 or 0, else whether the CPU is not AMD's (see the module docstring)."""
    value = os.environ.get(HUGE_PAGES_ENV)
    if value not in (None, "0", "1"):
        raise ValueError(f"{HUGE_PAGES_ENV} must be 0 or 1, got {value!r}")
    return value == "1" if value is not None else not cpu_info().is_amd


def place_in_huge_pages(model: nn.Module) -> int:
    """Move the CPU parameters of at least MIN_BYTES into one huge-page buffer (see the module docstring); returns
    the bytes moved (0 where nothing was)."""
    from pagedllm.layers.embedding import ParallelLMHead, VocabEmbedding

    if not sys.platform.startswith("linux") or not wanted():
        return 0
    # an embedding table is read a row per token, not streamed: it stays (unless it is a tied LM head's too)
    lookups = {id(m.weight) for m in model.modules()
               if isinstance(m, (nn.Embedding, VocabEmbedding)) and not isinstance(m, ParallelLMHead)}
    lookups -= {id(m.weight) for m in model.modules() if isinstance(m, ParallelLMHead)}
    params = [p for p in model.parameters() if p.device.type == "cpu" and p.layout == torch.strided
              and p.is_contiguous() and id(p) not in lookups and p.numel() * p.element_size() >= MIN_BYTES]
    if not params:
        return 0
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    advised = -(-total // HUGE_PAGE) * HUGE_PAGE
    buffer = torch.empty(advised + HUGE_PAGE, dtype=torch.uint8)   # not written yet: no page is there
    start = -buffer.data_ptr() % HUGE_PAGE
    if not _advise_huge_pages(buffer.data_ptr() + start, advised):
        logger.info("huge pages refused (madvise): the weights stay in 4 KiB pages")
        return 0
    _fault_in(buffer[start:start + advised].view(-1, HUGE_PAGE))
    for p, offset in zip(params, offsets):
        nbytes = p.numel() * p.element_size()
        slot = buffer[start + offset:start + offset + nbytes].view(p.dtype).view(p.shape)
        slot.copy_(p.data)
        p.data = slot
    return total


def _fault_in(pages: torch.Tensor) -> None:
    """Write the first byte of each row of `pages` ([n, HUGE_PAGE]), so that Linux backs each with a huge page, from
    as many threads at once as torch runs, each its own pages: on the 2-vCPU VM of docs/benchmarks.md 1 GiB took
    0.9-2.5 s from one thread (the other vCPU idle) and 80-115 ms from two."""
    threads = max(1, torch.get_num_threads())
    workers = [threading.Thread(target=pages[i::threads, 0].fill_, args=(0,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()

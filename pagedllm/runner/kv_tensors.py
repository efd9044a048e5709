"""The KV cache tensors: sizing from the memory budget, allocation, and block copies.

One tensor holds every layer's keys and values, shaped in blocks:

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
          layer ─┘   └─ 0 = K, 1 = V

so that a block copy (copy-on-write) or a swap moves one block of every layer with one indexing op.

With kv_cache_dtype="int8" the tensor is int8 and each row is `head_dim + 4` bytes wide: the quantized values,
then that (token, kv head)'s float32 scale (`pagedllm.attention.torch_ref.quantize_kv`). The scales live in the
blocks, so copies, swaps and the swap pool move them with the data and need no change.

The swap pool (`SwapSpace`) has the same layout. Next to a GPU it is pinned host memory; on a CPU device it is
a memory-mapped file, so that swapped blocks can leave RAM for the page cache and the disk and the swap pool
really adds capacity. That holds only on a disk: a file on a RAM-backed filesystem (tmpfs, ramfs; /dev/shm, and
often /tmp) takes the same RAM as the KV pool. So a named swap file there is refused, and the anonymous one goes
to the temporary directory only when it is on a disk, else to pagedllm's cache directory.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from pagedllm.logger import init_logger
from pagedllm.paths import cache_dir

logger = init_logger(__name__)

GiB = 1 << 30
CPU_DEFAULT_KV_BYTES = 4 * GiB
GPU_DEFAULT_MEMORY_UTILIZATION = 0.9
RAM_BACKED_FILESYSTEMS = ("tmpfs", "ramfs")


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's K/V across the model.

    dtype is the model's; kv_cache_dtype "auto" stores K/V in it, "int8" as int8 rows with a float32 scale each.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype == "int8" and self.head_dim % 4:
            raise ValueError(f"kv_cache_dtype 'int8' needs a head_dim that is a multiple of 4 (its float32 scales "
                             f"are stored aligned beside the rows), got {self.head_dim}")

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.int8 if self.kv_cache_dtype == "int8" else self.dtype

    @property
    def row_size(self) -> int:
        """Stored elements per (token, kv head): head_dim, plus the 4 bytes of an int8 row's float32 scale."""
        return self.head_dim + 4 if self.kv_cache_dtype == "int8" else self.head_dim

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x row bytes (head_dim x dtype bytes, or head_dim + 4 for int8)."""
        element_size = torch.empty((), dtype=self.storage_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.row_size * element_size

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The pool tensor's shape: [num_layers, 2, num_blocks, block_size, num_kv_heads, row_size]."""
        return (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.row_size)


def pool_view(buffer: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU pool of `shape` ([num_layers, 2, num_blocks, block_size, num_kv_heads, row_size]) over a flat
    `buffer`, stored head-major within each block ([..., num_kv_heads, block_size, row_size]), as vLLM's CPU cache
    is: one kv head's rows of a block lie together. Attention reads a (sequence, kv head) at a time, so it reads a
    block's keys, and its values, as one run instead of block_size rows num_kv_heads rows apart: decode attention
    1.1-1.3x on SmolLM2 (docs/benchmarks.md). The kernels and the torch paths take any strides there."""
    stored = (*shape[:3], shape[4], shape[3], *shape[5:])
    return buffer.view(stored).transpose(3, 4)


@dataclass(frozen=True)
class CapacityReport:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    max_model_len: int
    window: int = 0     # the sliding window behind which a sequence's blocks are freed (KVCacheManager's), 0: none

    @property
    def max_concurrent_seqs(self) -> float:
        """How many requests at full context fit in the pool at once: each holds the blocks of max_model_len tokens,
        or, with a window, at most those its window's keys span (cdiv(window, block_size) + 1)."""
        held = self.max_model_len
        if self.window:
            held = min(held, (-(-self.window // self.block_size) + 1) * self.block_size)
        return (self.num_blocks - 1) * self.block_size / held

    def __str__(self) -> str:
        pool_gib = self.num_blocks * self.block_size * self.bytes_per_token / GiB
        window = f" (blocks behind the {self.window}-token sliding window freed)" if self.window else ""
        return (f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens ({pool_gib:.2f} GiB), "
                f"{self.bytes_per_token} bytes per token, "
                f"{self.max_concurrent_seqs:.1f}x concurrency at max_model_len={self.max_model_len}{window}")


def kv_budget_bytes(kv_cache_memory: int | None, memory_utilization: float | None, weight_bytes: int,
                    device: torch.device, activation_bytes: int = 0) -> int:
    """Bytes for the KV pool: explicit, else a fraction of device memory minus the weights, else the default.

    On a GPU, see `gpu_kv_budget_bytes` (`activation_bytes`: the peak of the start-up profile run). On a CPU the
    pool shares RAM with everything else, so the default is 4 GiB capped by half of what is available now; an
    explicit utilization takes that fraction of the machine's RAM.
    """
    if kv_cache_memory is not None:
        return kv_cache_memory
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return gpu_kv_budget_bytes(total, free, memory_utilization, weight_bytes, activation_bytes)
    if memory_utilization is not None:
        return int(psutil.virtual_memory().total * memory_utilization) - weight_bytes
    return min(CPU_DEFAULT_KV_BYTES, psutil.virtual_memory().available // 2)


def gpu_kv_budget_bytes(total_bytes: int, free_bytes: int, memory_utilization: float | None, weight_bytes: int,
                        activation_bytes: int) -> int:
    """The KV pool on a GPU, as vLLM sizes it: the engine's share of the device (`memory_utilization`, 0.9 by
    default) less the weights and the activation peak of one maximal step, and never more than is free now, with
    the weights loaded (what other processes hold is not the engine's), less the same peak.

        |<----------------------------- total ----------------------------->|
        |<---------------- memory_utilization x total ---------------->|
        | weights | activation peak |            KV pool               | rest |
    """
    utilization = memory_utilization if memory_utilization is not None else GPU_DEFAULT_MEMORY_UTILIZATION
    return min(int(total_bytes * utilization) - weight_bytes, free_bytes) - activation_bytes


def num_blocks_for(budget_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """Blocks of `block_size` tokens of `bytes_per_token` (a layout's, or several pools' of the same blocks) that
    `budget_bytes` holds; ValueError under 2."""
    num_blocks = budget_bytes // (bytes_per_token * block_size)
    if num_blocks < 2:
        raise ValueError(f"the KV cache budget of {budget_bytes} bytes holds fewer than 2 blocks of "
                         f"{block_size} tokens ({bytes_per_token} bytes per token); raise "
                         "kv_cache_memory or gpu_memory_utilization")
    return int(num_blocks)


def allocate_kv(layout: KVLayout, num_blocks: int, block_size: int, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. On a CPU it is an anonymous private mapping, zero pages that cost no RAM and no start-up
    time until first written, faulted in 4 KiB at a time.

    Not numpy.zeros: numpy asks for transparent huge pages (MADV_HUGEPAGE) on large arrays, and with the kernel's
    default `defrag=madvise` the first touch of each 2 MiB page then compacts memory synchronously: measured on a
    2-vCPU VM, 2.5-4 ms a huge page (5-8 us per 4 KiB of it) against ~1 us per 4 KiB page here, so that an engine's
    first request spent 0.45 s writing its first token's K/V (60 layer regions, a huge page each) and the mixed
    benchmark ~0.9 s of its ~21 s.
    """
    shape, dtype = layout.shape(num_blocks, block_size), layout.storage_dtype
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    element_size = torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, int(np.prod(shape)) * element_size, flags=mmap.MAP_PRIVATE)  # the tensor keeps it alive
    return pool_view(torch.frombuffer(pages, dtype=torch.uint8).view(dtype), shape)


def layer_caches(kv: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (k_cache, v_cache) views, each [num_blocks, block_size, num_kv_heads, row_size]."""
    return [(kv[layer, 0], kv[layer, 1]) for layer in range(kv.shape[0])]


def copy_blocks(kv: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks (all layers, K and V) from src to dst ids within one pool."""
    if pairs:
        kv[:, :, _column(pairs, 1, kv.device)] = kv[:, :, _column(pairs, 0, kv.device)]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks (all layers, K and V) from block src of one pool to block dst of another."""
    if pairs:
        dst[:, :, _column(pairs, 1, dst.device)] = src[:, :, _column(pairs, 0, src.device)].to(dst.device)


def _column(pairs: list[tuple[int, int]], index: int, device: torch.device | str) -> torch.Tensor:
    """The block ids at `index` of each (src, dst) pair, as a tensor on `device`."""
    return torch.tensor([pair[index] for pair in pairs], device=device)


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding `path` ("ext4", "tmpfs", ...): that of its deepest mount point in
    /proc/mounts, the last one mounted there winning. "" when the mount table cannot be read."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                mount_point = fields[1].replace("\\040", " ")
                inside = mount_point == "/" or real == mount_point or real.startswith(mount_point + "/")
                if inside and len(mount_point) >= len(best):
                    best, fstype = mount_point, fields[2]
    except OSError:
        return ""
    return fstype


def is_ram_backed(path: str) -> bool:
    return filesystem_type(path) in RAM_BACKED_FILESYSTEMS


def _anonymous_swap_dir() -> str:
    """The temporary directory if it is on a disk, else pagedllm's cache directory if that is; else (warned) the
    temporary directory."""
    tmp, cache = tempfile.gettempdir(), cache_dir()
    if not is_ram_backed(tmp):
        return tmp
    cache.mkdir(parents=True, exist_ok=True)
    if not is_ram_backed(str(cache)):
        return str(cache)
    logger.warning("the swap file goes to %s, a RAM-backed filesystem like %s: swapped blocks stay in RAM, so the "
                   "swap pool adds no capacity; give swap_path (--swap-path) a file on a disk", tmp, cache)
    return tmp


class SwapSpace:
    """The swap pool's tensor, `[num_layers, 2, num_blocks, block_size, num_kv_heads, row_size]` (`KVLayout.shape`).

    Args:
        layout, num_blocks, block_size: as for `allocate_kv`.
        device: the KV cache's device. For CUDA the pool is pinned host memory; for a CPU a memory-mapped file.
        path: the file on a CPU device; None uses an anonymous file (already unlinked, so it is gone when the pool
            is closed or the process dies) in a disk-backed directory (see the module docstring). A given path is
            created, and deleted by `close()`; one on a RAM-backed filesystem is refused (ValueError).

    `location` says where the pool lives, for the start-up log.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, device: torch.device,
                 path: str | None = None) -> None:
        shape, dtype = layout.shape(num_blocks, block_size), layout.storage_dtype
        self.path = path
        self._file = None
        self._side_stream: SideStreamSwaps | None = None
        if device.type == "cuda":
            self.kv = torch.zeros(shape, dtype=dtype, pin_memory=True)
            self.location = "pinned host memory"
            self._side_stream = SideStreamSwaps(device)
            return
        num_bytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        if path is not None and is_ram_backed(path):
            raise ValueError(f"swap_path {path!r} is on a RAM-backed filesystem ({filesystem_type(path)}): swapped "
                             "blocks would stay in RAM and the swap pool would add no capacity; give a file on a disk")
        if path is not None:
            self._file, self.location = open(path, "w+b"), f"the file {path}"
        else:
            folder = _anonymous_swap_dir()
            self._file = tempfile.TemporaryFile(prefix="pagedllm-swap-", dir=folder)
            self.location = f"an anonymous file in {folder}"
        self._file.truncate(num_bytes)  # sparse: pages cost nothing until a block is swapped out
        raw = np.memmap(self._file, dtype=np.uint8, mode="r+", shape=(num_bytes,))
        self.kv = pool_view(torch.from_numpy(raw).view(dtype), shape)   # as the pool's blocks: swaps copy runs

    @property
    def is_memory_mapped(self) -> bool:
        return self._file is not None

    def move(self, kv: torch.Tensor, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Swap blocks out of the KV pool `kv` ((kv block, swap block) pairs), then into it ((swap block, kv block)
        pairs): beside a GPU on a CUDA stream of their own (`SideStreamSwaps`), on a CPU at once."""
        if self._side_stream is not None:
            self._side_stream.move(kv, self.kv, swap_out, swap_in)
            return
        swap_blocks(kv, self.kv, swap_out)
        swap_blocks(self.kv, kv, swap_in)

    def close(self) -> None:
        """Release the memory, and close and delete the file. Closing twice does nothing more."""
        self.kv = torch.empty(0)
        self._side_stream = None
        if self._file is not None:
            self._file.close()
            self._file = None
            if self.path is not None and os.path.exists(self.path):
                os.remove(self.path)


class SideStreamSwaps:
    """A GPU's swaps on a CUDA stream of their own: the host thread never waits for PCIe, and a swap-out's copy to
    host memory runs under the step's forward pass instead of before it.

        compute stream ── step t-1 ──┬──────────────────────────────── wait(ready) ── copies, step t's forward ──
        copy stream                  └─ gather outs ── ins: H2D, scatter ── ready ── outs: D2H ── done
        host                            (the next move, once `done`: the outs' rows go into the swap pool)

    The copy stream starts once the compute stream's earlier work has (the blocks hold what it wrote), and the
    compute stream waits only for `ready`: by then the blocks going out are gathered into a buffer of their own, so
    the step may write into them as soon as they are freed, and the blocks coming in have landed. A swap-out's rows
    reach the pinned pool at the next move, before any swap-in reads it; pinned buffers are held by torch's caching
    host allocator until the copies that use them have run.
    """

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self._pending: list[tuple[torch.cuda.Event, torch.Tensor, torch.Tensor]] = []  # (done, rows, swap block ids)

    def move(self, kv: torch.Tensor, pool: torch.Tensor, swap_out: list[tuple[int, int]],
             swap_in: list[tuple[int, int]]) -> None:
        """Swap out, then in (as `SwapSpace.move`), on the copy stream; the compute stream waits for `ready`."""
        self.settle(pool)
        compute = torch.cuda.current_stream(kv.device)
        self.stream.wait_stream(compute)
        kv.record_stream(self.stream)   # a pool freed by a reallocation is not reused before these copies ran
        with torch.cuda.stream(self.stream):
            gathered = kv[:, :, _column(swap_out, 0, kv.device)] if swap_out else None   # [L, 2, n, ...]
            if swap_in:
                rows = torch.empty((*pool.shape[:2], len(swap_in), *pool.shape[3:]), dtype=pool.dtype,
                                   pin_memory=True)
                torch.index_select(pool, 2, _column(swap_in, 0, "cpu"), out=rows)
                kv[:, :, _column(swap_in, 1, kv.device)] = rows.to(kv.device, non_blocking=True)
            ready = self.stream.record_event()
            if gathered is not None:
                host = torch.empty_like(gathered, device="cpu", pin_memory=True)
                host.copy_(gathered, non_blocking=True)
                self._pending.append((self.stream.record_event(), host, _column(swap_out, 1, "cpu")))
        compute.wait_event(ready)

    def settle(self, pool: torch.Tensor) -> None:
        """Put the swapped-out rows into the pool, in the order they went out, waiting for copies still running."""
        for done, rows, swap_block_ids in self._pending:
            done.synchronize()
            pool[:, :, swap_block_ids] = rows
        self._pending.clear()

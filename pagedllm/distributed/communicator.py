"""The collectives the tensor-parallel model calls: `all_reduce` (after the row-parallel layers and the
vocab-parallel embedding) and `gather_to_first` (the LM head's vocabulary slices, to rank 0).

Two ways to run them, chosen once when the group forms (`init_communicator`):

- **Shared memory**, when every rank runs on this machine and pagedllm's CPU kernels are built: rank 0 creates a
  segment in /dev/shm, every rank maps it, and the collectives are copies into slots and flags that the ranks spin
  on (kernels/csrc/shm.cpp). A round costs microseconds; over gloo on loopback TCP it costs about a millisecond,
  which at 61 all-reduces a forward pass (SmolLM2) is more than the pass itself (docs/scale-out.md).
- **gloo** (`torch.distributed`), otherwise: ranks on several machines (Ray), no /dev/shm, no kernels.

Both give every rank the same bits (the shared-memory sum runs in rank order on every rank), and both fail a
collective whose partner died (the shared-memory wait checks the partner's pid) or never comes (120 s).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedllm.kernels import cpu_kernels
from pagedllm.logger import init_logger

logger = init_logger(__name__)

_SLOT_BYTES = 4 << 20      # per rank and round parity: larger tensors go in several rounds
_LINE_BYTES = 64           # one cache line per rank for its flag and pid (shm.cpp)
_SHM_DIR = "/dev/shm"


class Communicator:
    """gloo's collectives."""

    kind = "gloo"

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum x over the ranks, in place."""
        dist.all_reduce(x)

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x stacked in rank order ([world, *x.shape]) on rank 0; None on the others."""
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.stack(parts) if parts is not None else None

    def close(self) -> None:
        pass


class SharedMemoryCommunicator(Communicator):
    """The collectives through a shared-memory segment that every rank of the group has mapped."""

    kind = "shared memory"

    def __init__(self, rank: int, world: int, segment: torch.Tensor, timeout: timedelta) -> None:
        super().__init__(rank, world)
        self.segment, self._timeout_s = segment, timeout.total_seconds()
        self._kernels = cpu_kernels()
        self._seq = 0       # the last round this rank took part in; the same on every rank between collectives

    def all_reduce(self, x: torch.Tensor) -> None:
        """Over the segment for float32 and bfloat16 (the activations' dtypes on a CPU); over gloo for another
        dtype (float16), which every rank chooses alike since they reduce the same tensors."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            return super().all_reduce(x)
        target = x if x.is_contiguous() else x.contiguous()
        self._seq = self._kernels.shm_all_reduce(self.segment, target, self.rank, self.world, self._seq,
                                                 self._timeout_s)
        if target is not x:
            x.copy_(target)

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        x = x.contiguous()
        out = torch.empty((self.world, *x.shape), dtype=x.dtype) if self.rank == 0 else None
        self._seq = self._kernels.shm_gather(self.segment, x, out, self.rank, self.world, self._seq,
                                             self._timeout_s)
        return out


_communicator: Communicator | None = None


def communicator() -> Communicator:
    """This process's communicator (a tensor-parallel rank's, set when it joined its group)."""
    if _communicator is None:
        raise RuntimeError("no tensor-parallel group in this process")
    return _communicator


def new_segment_path() -> str | None:
    """A fresh name for a group's segment, for rank 0 to create; None where there is no /dev/shm (gloo then)."""
    return os.path.join(_SHM_DIR, f"pagedllm-tp-{uuid.uuid4().hex}") if os.path.isdir(_SHM_DIR) else None


def segment_bytes(world: int) -> int:
    return world * _LINE_BYTES + 2 * world * _SLOT_BYTES


def init_communicator(rank: int, world: int, segment_path: str | None, timeout: timedelta) -> Communicator:
    """Choose the group's communicator, once the gloo group has formed: shared memory if every rank could map
    rank 0's segment (same machine, kernels built), else gloo. Rank 0 creates the segment first and removes its
    name once every rank has it mapped (or failed to), so that nothing is left in /dev/shm."""
    global _communicator
    segment = _map_segment(rank, world, segment_path)
    mapped = torch.tensor([int(segment is not None)])
    dist.all_reduce(mapped, op=dist.ReduceOp.MIN)
    if rank == 0 and segment_path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment_path)
    if mapped.item() and segment is not None:
        cpu_kernels().shm_register(segment, rank, world, os.getpid())  # type: ignore[union-attr]
        dist.barrier()      # every pid is in the segment before the first collective
        _communicator = SharedMemoryCommunicator(rank, world, segment, timeout)
    else:
        _communicator = Communicator(rank, world)
    if rank == 0:
        logger.info("tensor parallelism: collectives over %s", _communicator.kind)
    return _communicator


def close_communicator() -> None:
    global _communicator
    _communicator = None


def create_segment(segment_path: str | None, world: int) -> None:
    """Rank 0: create the segment's file (zeros: every flag at round 0) before the other ranks start."""
    if segment_path is None:
        return
    fd = os.open(segment_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, segment_bytes(world))
    finally:
        os.close(fd)


def remove_segment(segment_path: str | None) -> None:
    """Remove the segment's name if it is still there (a group that failed to form)."""
    if segment_path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment_path)


def _map_segment(rank: int, world: int, segment_path: str | None) -> torch.Tensor | None:
    if segment_path is None or cpu_kernels() is None:
        return None
    try:
        return torch.from_file(segment_path, shared=True, size=segment_bytes(world), dtype=torch.uint8)
    except (RuntimeError, OSError) as exc:      # another machine's rank: no such file here
        logger.info("tensor-parallel rank %d cannot map %s (%s): collectives over gloo", rank, segment_path, exc)
        return None

"""The tensor-parallel collectives over shared memory (pagedllm/distributed/communicator.py, kernels/csrc/shm.cpp)
against gloo's: the same sums and gathers, the same bits on every rank, tensors larger than a slot, and a partner
that dies fails the collective at once instead of hanging it. Two spawned ranks."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pagedllm.distributed import free_port
from pagedllm.distributed.communicator import Communicator, create_segment, init_communicator, new_segment_path
from pagedllm.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None or new_segment_path() is None,
                                reason="the shared-memory collectives need pagedllm's CPU kernels and /dev/shm")

SIZES = [1, 576 * 3, (4 << 20) // 4 + 1000]     # the last one is over a 4 MiB slot in float32: two rounds


def _join(rank: int, init_method: str, segment_path: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    return init_communicator(rank, 2, segment_path, timedelta(seconds=60))


def _plain(x: torch.Tensor | None):
    """A tensor as a numpy array (float32: exact for bf16 too), which a queue pickles by value; torch's own
    pickling would share the storage with a process that is about to exit."""
    return None if x is None else x.float().numpy()


def _compare(rank: int, init_method: str, segment_path: str, results) -> None:
    shared = _join(rank, init_method, segment_path)
    gloo = Communicator(rank, 2)
    out = {"kind": shared.kind}
    for dtype in (torch.float32, torch.bfloat16):
        for size in SIZES:
            x = torch.randn(size, generator=torch.Generator().manual_seed(10 * rank + size)).to(dtype)
            a, b = x.clone(), x.clone()
            shared.all_reduce(a)
            gloo.all_reduce(b)
            out[f"reduce {dtype} {size}"] = (_plain(a), _plain(b))
    # float16 goes over gloo, a non-contiguous tensor through a contiguous copy, with the same results.
    seeded = torch.Generator().manual_seed(rank)
    for key, x in [("reduce float16", torch.randn(64, generator=seeded).half()),
                   ("reduce float32 transposed", torch.randn(8, 16, generator=seeded).t())]:
        a, b = x.clone(), x.clone()
        shared.all_reduce(a)
        gloo.all_reduce(b)
        out[key] = (_plain(a), _plain(b))
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(rank))
    out["gather"] = (_plain(shared.gather_to_first(logits)), _plain(gloo.gather_to_first(logits)))
    results.put((rank, out))
    dist.destroy_process_group()


def _wait_alone(rank: int, init_method: str, segment_path: str, results) -> None:
    shared = _join(rank, init_method, segment_path)
    if rank == 1:
        time.sleep(3600)        # never joins the collective; the test kills it
    results.put("waiting")
    start = time.monotonic()
    try:
        shared.all_reduce(torch.ones(8))
        results.put("returned")
    except RuntimeError as exc:
        results.put((str(exc), time.monotonic() - start))


def _run(target) -> tuple[list, multiprocessing.Queue, str]:
    """Both ranks of a new group in spawned processes: (the processes, their results queue, the segment's path)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    segment_path = new_segment_path()
    create_segment(segment_path, 2)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ranks = [context.Process(target=target, args=(rank, init_method, segment_path, results), daemon=True)
             for rank in range(2)]
    for process in ranks:
        process.start()
    return ranks, results, segment_path


def test_shared_memory_collectives_give_gloos_results_and_the_same_bits_on_every_rank() -> None:
    ranks, results, segment_path = _run(_compare)
    outs = dict(results.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(30)
    assert not os.path.exists(segment_path), "rank 0 removes the segment's name once every rank mapped it"
    assert outs[0]["kind"] == outs[1]["kind"] == "shared memory"
    for key in outs[0]:
        if key.startswith("reduce"):
            (shm0, gloo0), (shm1, _) = outs[0][key], outs[1][key]
            assert (shm0 == shm1).all(), key           # every rank holds the same hidden state afterwards
            if "float32" in key:                       # a + b: exact in either order
                assert (shm0 == gloo0).all(), key
            else:                                      # one rounding of the float32 sum either way
                torch.testing.assert_close(torch.from_numpy(shm0), torch.from_numpy(gloo0), rtol=2**-8, atol=0)
    shm_parts, gloo_parts = outs[0]["gather"]
    assert (shm_parts == gloo_parts).all() and shm_parts.shape == (2, 3, 1000)
    assert outs[1]["gather"] == (None, None)


def test_a_partner_that_dies_fails_the_collective_at_once() -> None:
    ranks, results, _ = _run(_wait_alone)
    assert results.get(timeout=60) == "waiting"
    time.sleep(0.2)             # rank 0 is spinning on rank 1's flag by now
    os.kill(ranks[1].pid, signal.SIGKILL)
    message, waited = results.get(timeout=30)
    ranks[0].join(30)
    assert "rank 1" in message and "died" in message
    assert waited < 20

"""Tensor parallelism on one machine: worker processes, each running one slice of the model (docs/scale-out.md).

Rank 0 is the engine's own process. Its `ModelRunner` does everything that is not per rank: it builds the step's
flat inputs, samples, and keeps the requests' state. Ranks 1..N-1 are worker processes, each with its own
`ModelRunner` over its slice of the weights (`head_shard`: whole GQA groups) and a KV pool of its KV heads, with
the same block ids. Before each rank-wide operation, rank 0's runner sends it to every worker (`Peers.run`), then
does its own part; the collectives inside the model (an all-reduce after attention and after the MLP, one for the
vocab-parallel embedding, a gather of the LM head's logits to rank 0) join them:

    rank 0                                    worker r
    runner.forward(ids, positions, meta)
      ├─ send ("forward", ids, positions, meta) ──▶ runner.forward(...)
      └─ model(...)  ◀═══ all-reduce x (2 L + 1) ═══▶ model(...)
    runner.compute_logits(hidden)
      ├─ send ("compute_logits", hidden) ─────────▶ runner.compute_logits(...)
      └─ lm_head     ◀═══ gather to rank 0 ════════ lm_head

Commands travel on one pipe per worker (pickled bytes; a worker waits on it for as long as the engine idles, and
reads end-of-file when rank 0 is gone), the collectives on a gloo process group. Workers never see a request: the
scheduler, the sampler and the structured-output grammars live on rank 0 only.

A rank-wide operation that fails on any rank leaves the ranks out of step (a collective half done), so it fails
the engine as a whole with `TensorParallelError`: every request gets an error, and the server answers 503.

`Peers.call` is vLLM's `collective_rpc` on ranks 1..N-1: a method of the rank's runner by name, or a function
given it, whose result each worker sends back on its pipe (a Ray actor: as its call's result). A failure there
is the function's, not the group's: it raises on rank 0 and the group goes on.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm.config import EngineConfig
from pagedllm.distributed.communicator import (
    close_communicator,
    create_segment,
    init_communicator,
    new_segment_path,
    remove_segment,
)
from pagedllm.logger import init_logger

if TYPE_CHECKING:
    from pagedllm.runner.model_runner import ModelRunner

logger = init_logger(__name__)

# A collective waits this long for a rank that stopped answering (one that died closes its sockets at once).
_COLLECTIVE_TIMEOUT = timedelta(seconds=120)
_JOIN_SECONDS = 10.0
_WAITED_FOR = ("allocate_kv_cache", "release_kv_cache", "allocate_swap_space")   # rank 0 calls these with wait=True


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died or an operation failed on some rank: the engine cannot go on."""


class Peers:
    """What rank 0's runner sends its rank-wide operations to. This one, for tensor_parallel_size 1, has none."""

    size = 1

    @contextlib.contextmanager
    def run(self, method: str, *args, wait: bool = False) -> Iterator[None]:
        """Start `method(*args)` on every other rank; the body is rank 0's own part. `wait`: return only once
        every rank has done it (for the allocations at start-up, so that a rank's failure shows there)."""
        yield

    @contextlib.contextmanager
    def call(self, method: str | Callable, args: tuple, kwargs: dict[str, Any], timeout: float | None
             ) -> Iterator[list]:
        """Start `invoke(runner, method, args, kwargs)` on every other rank; the body is rank 0's own part, and
        the list it is given holds the other ranks' results, in rank order, once it ends (TimeoutError after
        `timeout` seconds; RuntimeError with a rank's traceback where it raised there)."""
        yield []

    def is_alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


def invoke(runner: ModelRunner, method: str | Callable, args: tuple, kwargs: dict[str, Any]) -> Any:
    """vLLM's collective_rpc on one rank: the runner's method of that name, or a function given the runner first."""
    if isinstance(method, str):
        return getattr(runner, method)(*args, **kwargs)
    return method(runner, *args, **kwargs)


def apply_to_model(runner: ModelRunner, function: Callable) -> Any:
    """vLLM's apply_model on one rank: `function` of the rank's model (its slice under tensor parallelism)."""
    return function(runner.model)


class WorkerProcesses(Peers):
    """Ranks 1..N-1 as local processes (`_worker_context`: none is a fork of this process, whose threads and OpenMP
    state it would inherit), joined to this process (rank 0) by a gloo process group. `start` returns once every
    rank has joined the group; each worker then loads its slice of the model while rank 0 loads its own."""

    def __init__(self, config: EngineConfig) -> None:
        self.size = config.parallel.tensor_parallel_size
        self.error: BaseException | None = None
        self._closed = False
        self._calls = 0             # collective_rpc calls sent, which number their replies
        init_method = f"tcp://127.0.0.1:{free_port()}"
        segment_path = new_segment_path()
        create_segment(segment_path, self.size)
        context = _worker_context()
        self.pipes: list[Connection] = []
        self.processes: list[mp.Process] = []
        try:
            for rank in range(1, self.size):
                ours, theirs = context.Pipe()
                process = context.Process(target=_worker_main, args=(config, rank, init_method, segment_path, theirs,
                                                                     dict(os.environ)),
                                          name=f"pagedllm-tp{rank}", daemon=True)
                process.start()
                theirs.close()
                self.pipes.append(ours)
                self.processes.append(process)
            _join_group(0, self.size, init_method, segment_path)
        finally:
            remove_segment(segment_path)
        logger.info("tensor parallelism: %d ranks (this process and worker pids %s) joined over gloo, %d threads "
                    "each", self.size, [p.pid for p in self.processes], torch.get_num_threads())

    @contextlib.contextmanager
    def run(self, method: str, *args, wait: bool = False) -> Iterator[None]:
        if self.error is not None:
            raise TensorParallelError(f"the tensor-parallel group failed earlier: {self.error!r}") from self.error
        try:
            command = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
            for pipe in self.pipes:
                pipe.send_bytes(command)
            yield
            if wait:
                dist.barrier()
        except BaseException as exc:
            self.error = exc
            dead = [p.name for p in self.processes if not p.is_alive()]
            logger.error("tensor-parallel %s failed%s: %r", method, f" (dead: {', '.join(dead)})" if dead else "",
                         exc)
            raise TensorParallelError(f"tensor-parallel {method} failed: {exc!r}"
                                      + (f"; worker(s) {', '.join(dead)} died" if dead else "")) from exc

    @contextlib.contextmanager
    def call(self, method: str | Callable, args: tuple, kwargs: dict[str, Any], timeout: float | None
             ) -> Iterator[list]:
        if self.error is not None:
            raise TensorParallelError(f"the tensor-parallel group failed earlier: {self.error!r}") from self.error
        try:
            payload = pickle.dumps((method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise ValueError(f"collective_rpc sends its method and arguments to the other ranks, and they do not "
                             f"pickle ({exc!r}): name a runner method, or give a module-level function, not a "
                             "lambda or a nested one") from exc
        self._calls += 1
        with self.run("rpc", self._calls, payload):
            pass
        results: list = []
        yield results
        deadline = None if timeout is None else time.monotonic() + timeout
        for rank, pipe in enumerate(self.pipes, 1):
            results.append(self._reply(rank, pipe, self._calls, deadline, timeout))

    def _reply(self, rank: int, pipe: Connection, call: int, deadline: float | None, timeout: float | None) -> Any:
        """Rank `rank`'s result of call number `call`; the replies of earlier calls that timed out are dropped."""
        while True:
            if not pipe.poll(None if deadline is None else max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"collective_rpc: rank {rank} gave no result within {timeout} s")
            try:
                answered, ok, value = pickle.loads(pipe.recv_bytes())
            except (EOFError, OSError) as exc:
                self.error = exc
                raise TensorParallelError(f"tensor-parallel rank {rank} died during collective_rpc") from exc
            if answered == call:
                break
        if not ok:
            raise RuntimeError(f"collective_rpc failed on tensor-parallel rank {rank}:\n{value}")
        return value

    def is_alive(self) -> bool:
        return self.error is None and not self._closed and all(p.is_alive() for p in self.processes)

    def close(self) -> None:
        """Stop the workers (they close their swap files), then leave the group; no process is left behind."""
        if self._closed:
            return
        self._closed = True
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send_bytes(pickle.dumps(("shutdown", ())))
            pipe.close()
        for process in self.processes:
            process.join(_JOIN_SECONDS)
            if process.is_alive():
                process.kill()
                process.join()
        _leave_group()


class RayWorkers(Peers):
    """Ranks 1..N-1 as Ray actors, on the Ray cluster at RAY_ADDRESS (`ray start --head` on one machine,
    `ray start --address ...` on the others) or, without one, a local cluster this engine starts and stops.
    Commands are actor calls (Ray runs one actor's calls in order); the collectives use the same gloo group as
    local processes, rendezvousing at this node's address (docs/scale-out.md says which ports and interfaces)."""

    def __init__(self, config: EngineConfig) -> None:
        self.ray = ray = acquire_ray()
        self.size = config.parallel.tensor_parallel_size
        self.error: BaseException | None = None
        self._closed = False
        self._pending: list = []
        segment_path = new_segment_path()   # mapped by the actors on this node; those on others use gloo
        try:
            require_ray_cpus(ray, self.size - 1, f"tensor_parallel_size={self.size}'s workers")
            init_method = f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"
            create_segment(segment_path, self.size)
            worker = ray.remote(num_cpus=1)(_RayWorker)
            self.actors = [worker.options(name=f"pagedllm-tp{rank}-{os.getpid()}").remote(config, rank, init_method,
                                                                                         segment_path)
                           for rank in range(1, self.size)]
            _join_group(0, self.size, init_method, segment_path)
        except BaseException:
            release_ray()       # stops a local cluster this engine started, and with it any actor started here
            raise
        finally:
            remove_segment(segment_path)
        self.pids = ray.get([actor.pid.remote() for actor in self.actors])
        logger.info("tensor parallelism: %d ranks (this process and Ray actors, pids %s) joined over gloo",
                    self.size, self.pids)

    @contextlib.contextmanager
    def run(self, method: str, *args, wait: bool = False) -> Iterator[None]:
        if self.error is not None:
            raise TensorParallelError(f"the tensor-parallel group failed earlier: {self.error!r}") from self.error
        try:
            refs = [actor.execute.remote(method, args) for actor in self.actors]
            yield
            if wait:
                dist.barrier()
                self.ray.get(refs)
            else:
                self._pending = self._settled(self._pending + refs)
        except BaseException as exc:
            self.error = exc
            logger.error("tensor-parallel %s failed: %r", method, exc)
            raise TensorParallelError(f"tensor-parallel {method} failed: {exc!r}") from exc

    @contextlib.contextmanager
    def call(self, method: str | Callable, args: tuple, kwargs: dict[str, Any], timeout: float | None
             ) -> Iterator[list]:
        if self.error is not None:
            raise TensorParallelError(f"the tensor-parallel group failed earlier: {self.error!r}") from self.error
        refs = [actor.call.remote(method, args, kwargs) for actor in self.actors]
        results: list = []
        yield results
        exceptions = self.ray.exceptions
        try:
            results += self.ray.get(refs, timeout=timeout)     # GetTimeoutError: a TimeoutError
        except exceptions.RayTaskError as exc:
            raise RuntimeError(f"collective_rpc failed on a tensor-parallel rank: {exc}") from exc
        except exceptions.RayActorError as exc:
            self.error = exc
            raise TensorParallelError(f"a tensor-parallel rank died during collective_rpc: {exc!r}") from exc

    def _settled(self, refs: list) -> list:
        """The calls still running; raises the error of one that failed (an actor that died among them)."""
        done, running = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        self.ray.get(done)
        return running

    def is_alive(self) -> bool:
        """No call failed and, for the actors on this machine, their processes live (an actor on another node
        that dies is noticed at the next step, whose collective fails)."""
        return self.error is None and not self._closed and all(process_lives(pid) for pid in self.pids)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.ray.get([actor.execute.remote("close", ()) for actor in self.actors], timeout=_JOIN_SECONDS)
        for actor in self.actors:
            self.ray.kill(actor)
        _leave_group()
        release_ray()


_ray_users = 0              # the RayWorkers and RayReplicas of this process holding Ray
_ray_started_here = False   # whether this process started the local cluster it is connected to


def acquire_ray():
    """The `ray` module, connected: to the cluster at RAY_ADDRESS (`ray start --head`), to the one this process
    already joined, or else to a local cluster started here, which `release_ray` stops once its last user is done."""
    global _ray_users, _ray_started_here
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'pagedllm[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        _ray_started_here = True
    _ray_users += 1
    return ray


def require_ray_cpus(ray, num_actors: int, what: str) -> None:
    """Refuse at once, rather than wait forever for them, actors the cluster has no CPUs for (one each)."""
    num_cpus = ray.cluster_resources().get("CPU", 0)
    if num_cpus < num_actors:
        raise ValueError(f"{what} need {num_actors} Ray actors of one CPU each, and the Ray cluster has "
                         f"{num_cpus:g} CPU(s)")


def release_ray() -> None:
    """One user of `acquire_ray` is done; the last one stops the local cluster if this process started it."""
    global _ray_users, _ray_started_here
    _ray_users -= 1
    if _ray_users == 0 and _ray_started_here:
        import ray

        ray.shutdown()
        _ray_started_here = False


class _RayWorker:
    """A tensor-parallel rank inside a Ray actor: joins the group and loads its slice when created."""

    def __init__(self, config: EngineConfig, rank: int, init_method: str, segment_path: str | None) -> None:
        self.runner = _start_rank(config, rank, init_method, segment_path)

    def pid(self) -> int:
        return os.getpid()

    def execute(self, method: str, args: tuple) -> None:
        getattr(self.runner, method)(*args)
        if method in _WAITED_FOR:
            dist.barrier()

    def call(self, method: str | Callable, args: tuple, kwargs: dict[str, Any]) -> Any:
        return invoke(self.runner, method, args, kwargs)


def _rpc_reply(runner: ModelRunner, call: int, payload: bytes) -> bytes:
    """A worker's reply to collective_rpc number `call`: (call, True, result), or (call, False, the traceback)."""
    try:
        return pickle.dumps((call, True, invoke(runner, *pickle.loads(payload))), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return pickle.dumps((call, False, traceback.format_exc()))


def start_peers(config: EngineConfig) -> Peers:
    """The other ranks of `config`'s tensor-parallel group: none at size 1, else worker processes. Each of the
    N processes gets 1/N of the CPU's threads, so that the ranks do not oversubscribe the cores."""
    if config.parallel.tensor_parallel_size == 1:
        return Peers()
    if dist.is_initialized():
        raise ValueError("a tensor-parallel engine needs its own process group, and this process already has one: "
                         "run one tensor-parallel engine per process")
    torch.set_num_threads(threads_per_rank(config.parallel.tensor_parallel_size))
    if config.parallel.distributed_executor_backend == "ray":
        return RayWorkers(config)
    return WorkerProcesses(config)


def process_lives(pid: int) -> bool:
    """Whether process `pid` on this machine runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def threads_per_rank(tp_size: int) -> int:
    """Each of the tp_size processes of a group on one machine gets its share of this process's cores."""
    return max(1, len(os.sched_getaffinity(0)) // tp_size)


def free_port() -> int:
    """A TCP port free on the loopback interface now, for a group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_group(rank: int, size: int, init_method: str, segment_path: str | None) -> None:
    """Join the gloo group, then choose its collectives' transport (shared memory when all ranks share /dev/shm)."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=_COLLECTIVE_TIMEOUT)
    init_communicator(rank, size, segment_path, _COLLECTIVE_TIMEOUT)


def _leave_group() -> None:
    close_communicator()
    if dist.is_initialized():
        dist.destroy_process_group()


def _start_rank(config: EngineConfig, rank: int, init_method: str, segment_path: str | None) -> ModelRunner:
    """A worker rank's runner: its share of the threads, joined to the group, over its slice of the model."""
    from pagedllm.loader import load_model
    from pagedllm.runner.model_runner import ModelRunner

    tp_size = config.parallel.tensor_parallel_size
    torch.set_num_threads(threads_per_rank(tp_size))
    _join_group(rank, tp_size, init_method, segment_path)
    return ModelRunner(load_model(config.model, rank, tp_size), copy.deepcopy(config.cache), None,
                       config.model.seed)


# What a worker rank imports, once, in the server process the ranks are forked from (`_worker_context`):
# transformers too, whose configuration classes the loader imports as it reads a model.
_WORKER_MODULES = ["pagedllm.distributed", "pagedllm.loader", "pagedllm.runner.model_runner", "transformers"]


def _worker_context():
    """How worker ranks start: forked from multiprocessing's fork server, a clean process that imported what a
    rank runs (torch, transformers, the loader, the runner) when the first rank started, where the platform has
    one; spawned elsewhere. A forked rank skips those imports (~1.5 s) and ends at once where a spawned one tears
    torch down (~0.7 s): a two-rank engine on a tiny model started in 1.2 s instead of 2.8 s and closed in 0.02 s
    instead of 0.7 s (the AMX Xeon of docs/benchmarks.md). multiprocessing gives it this process's working
    directory and sys.path of now, but the fork server's environment, from when it started: `_worker_main` takes
    rank 0's as an argument."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_WORKER_MODULES)
    return context


def _worker_main(config: EngineConfig, rank: int, init_method: str, segment_path: str | None,
                 pipe: Connection, environ: dict[str, str]) -> None:
    """A worker: take rank 0's environment, join the group, load this rank's slice, then run rank 0's commands
    until told to stop or until rank 0 is gone. Any failure ends the process, which fails rank 0's next
    collective."""
    os.environ.clear()
    os.environ.update(environ)
    runner = _start_rank(config, rank, init_method, segment_path)
    try:
        while True:
            try:
                method, args = pickle.loads(pipe.recv_bytes())
            except EOFError:     # rank 0 is gone
                return
            if method == "shutdown":
                return
            if method == "rpc":
                pipe.send_bytes(_rpc_reply(runner, *args))
                continue
            getattr(runner, method)(*args)
            if method in _WAITED_FOR:
                dist.barrier()
    except BaseException:
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        raise
    finally:
        runner.close()

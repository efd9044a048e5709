"""Data parallelism: N whole engines (replicas), each with its own KV pool, behind a router (dp_router.py).

```
                      router.route(prompt ids, cache_salt, loads)
 LLM.generate  --->  DataParallelEngine  ---> replica 0: LLMEngine   step() in thread 0 --+
 (offline)           step(): every busy  ---> replica 1: LLMEngine   step() in thread 1 --+--> outputs, in one list
                     replica at once

 server        --->  AsyncDataParallelEngine ---> replica 0: AsyncEngine (its own engine thread)
 (serving_*.py)      generate() routes; the  ---> replica 1: AsyncEngine (its own engine thread)
                     rest fans out
```
Both fronts keep the interface of what they stand for (LLMEngine for the offline LLM, AsyncEngine for the server),
so neither the offline API nor the serving code knows about replicas. Each replica is built on the thread that
steps it, and only that thread runs its forward passes (engine_thread.py). A request runs on one replica from start
to end, so its `n` completions, beams, aborts and disconnects stay inside that replica. The model forward
releases the GIL, so the replicas' steps overlap on the cores. Each replica takes the configured KV budget (as a
vLLM data-parallel rank does); on a CPU the process's intra-op threads are shared out among the replicas.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import os
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import torch

from pagedllm.config import EngineConfig, MediaAccess
from pagedllm.core.kv_cache.block_pool import PrefixCacheStats
from pagedllm.device import resolve_engine_device
from pagedllm.distributed import apply_to_model
from pagedllm.engine.admission import Admission, admitted
from pagedllm.engine.async_engine import AsyncEngine, KVCacheSnapshot
from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams
from pagedllm.engine.dp_router import DataParallelRouter
from pagedllm.engine.engine_thread import EngineThread
from pagedllm.engine.llm_engine import LLMEngine, PromptInput, require_tokenizer
from pagedllm.inputs import ParsedPrompt, parse_prompt
from pagedllm.logger import init_logger
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.log_stats import LoggingStatLogger
from pagedllm.multimodal import ImageProcessor
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.runner import kv_tensors
from pagedllm.sampling_params import SamplingParams

logger = init_logger(__name__)
T = TypeVar("T")


def build_replicas(config: EngineConfig, thread_name: str) -> tuple[list[LLMEngine], list[EngineThread]]:
    """`config.parallel.data_parallel_size` engines, each with the configured KV budget (a `swap_path` gets the
    replica's index as a suffix), and the EngineThread of each, named `thread_name` (`thread_name`-i for replica i
    of several): in this process, each replica is built on its thread, the one that is to step it
    (engine_thread.py says why), or with the "ray" backend and more than one, each in a Ray actor (`RayReplica`,
    same interface). On a CPU the intra-op threads are divided among them. Logs the pools."""
    count = config.parallel.data_parallel_size
    threads = [EngineThread(thread_name if count == 1 else f"{thread_name}-{index}") for index in range(count)]
    try:
        return _build_replicas(config, threads), threads
    except BaseException:
        _stop(threads)
        raise


def _build_replicas(config: EngineConfig, threads: list[EngineThread]) -> list[LLMEngine]:
    config = copy.deepcopy(config)
    resolve_engine_device(config)
    num_replicas = config.parallel.data_parallel_size
    num_threads = max(1, torch.get_num_threads() // num_replicas)
    if num_replicas > 1 and config.parallel.distributed_executor_backend == "ray":
        replicas = _replicas_in_actors(config, num_threads)
    else:
        if config.model.device == "cpu" and num_replicas > 1:
            torch.set_num_threads(num_threads)
        replicas = []
        try:
            for index in range(num_replicas):
                replicas.append(threads[index].call(LLMEngine, _replica_config(config, index)))
        except BaseException:
            for replica in replicas:
                replica.close()
            raise
    if config.model.device == "cpu" and num_replicas > 1:
        logger.info("data parallel: %d intra-op thread(s) per replica", num_threads)
    if num_replicas > 1:
        capacity = replicas[0].capacity
        pool_gib = capacity.num_blocks * capacity.block_size * capacity.bytes_per_token / kv_tensors.GiB
        logger.info("data parallel: %d replicas, each with its own KV pool of %d blocks (%.2f GiB; %.2f GiB in all)",
                    num_replicas, capacity.num_blocks, pool_gib, num_replicas * pool_gib)
    return replicas


def _stop(threads: list[EngineThread]) -> None:
    for thread in threads:
        thread.stop()


def _replica_config(config: EngineConfig, index: int) -> EngineConfig:
    replica_config = copy.deepcopy(config)
    replica_config.parallel.data_parallel_size = 1
    if config.cache.swap_path is not None and config.parallel.data_parallel_size > 1:
        replica_config.cache.swap_path = f"{config.cache.swap_path}.{index}"
    return replica_config


def _replicas_in_actors(config: EngineConfig, num_threads: int) -> list[LLMEngine]:
    """Each replica in a Ray actor; all of them load their models side by side."""
    from pagedllm.distributed import acquire_ray, release_ray, require_ray_cpus
    from pagedllm.distributed.ray_replica import RayReplica

    num_replicas, tp_size = config.parallel.data_parallel_size, config.parallel.tensor_parallel_size
    ray = acquire_ray()     # held while the replicas start, so that a failure among them stops a local cluster
    replicas: list[RayReplica] = []
    try:
        # Each replica is rank 0 of its tensor-parallel group, whose other ranks are actors too.
        require_ray_cpus(ray, num_replicas * tp_size, f"data_parallel_size={num_replicas}'s replicas"
                         + (f" of tensor_parallel_size={tp_size}" if tp_size > 1 else ""))
        for index in range(num_replicas):
            replicas.append(RayReplica(_replica_config(config, index), index, num_threads))
        for replica in replicas:
            replica.wait_until_loaded()
    except BaseException:
        for replica in replicas:
            replica.close()
        raise
    finally:
        release_ray()
    return replicas  # type: ignore[return-value]  # LLMEngine's interface, duck-typed


def make_router(config: EngineConfig, num_blocks_per_replica: int) -> DataParallelRouter:
    """The config's router, remembering about as many block hashes as the replicas' pools hold together."""
    parallel = config.parallel
    return DataParallelRouter(parallel.data_parallel_size, config.cache.block_size, parallel.data_parallel_router,
                              max_blocks=parallel.data_parallel_size * num_blocks_per_replica)


_ONE_ENGINE_IMAGES = "images run on one engine: with data_parallel_size > 1, LLM takes text prompts only"


class DataParallelEngine:
    """The offline front: N LLMEngine replicas with LLMEngine's request and step methods (those `LLM` uses).

    `add_request` routes; `step()` steps every replica that has work, at once, one thread each, and returns all
    their outputs. Only one thread at a time touches a replica, as for a single engine.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.replicas, self._threads = build_replicas(config, "pagedllm-dp")
        first = self.replicas[0]
        self.config = copy.deepcopy(first.config)       # what replica 0 derived, with the parallel settings
        self.config.parallel = copy.deepcopy(config.parallel)
        self.tokenizer, self.model_name = first.tokenizer, first.model_name
        self.vocab_size, self.max_model_len = first.vocab_size, first.max_model_len
        self.default_sampling, self.class_labels = first.default_sampling, first.class_labels
        self.token_type_vocab_size = first.token_type_vocab_size
        self.router = make_router(config, first.capacity.num_blocks)
        self._owner: dict[str, int] = {}    # unfinished request id -> its replica

    def tokenize_prompt(self, prompt: PromptInput, pooling: bool = False) -> list[int]:
        return self.replicas[0].tokenize_prompt(prompt, pooling)

    def get_tokenizer(self):
        return require_tokenizer(self.tokenizer)

    @property
    def image_marker(self) -> str | None:
        raise ValueError(_ONE_ENGINE_IMAGES)

    def process_images(self, parsed: ParsedPrompt, add_special_tokens: bool = True) -> ParsedPrompt:
        """Refused: offline, images run on one engine (`LLMEngine.process_images`)."""
        raise ValueError(_ONE_ENGINE_IMAGES)

    def embeds_prompt(self, parsed: ParsedPrompt) -> ParsedPrompt:
        """Refused: offline, prompt embeddings run on one engine (`LLMEngine.embeds_prompt`)."""
        raise ValueError("offline data-parallel replicas take no prompt_embeds: they run on one engine "
                         "(data_parallel_size=1)")

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | PoolingParams,
                    priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None, lora_request: LoRARequest | None = None) -> None:
        """Route the request to a replica and queue it there (see `LLMEngine.add_request`; no LoRA adapters)."""
        _no_lora(lora_request)
        self._check_new(request_id)
        token_ids = prompt_token_ids if prompt_token_ids is not None else \
            self.tokenize_prompt(prompt, isinstance(params, PoolingParams))
        cache_salt = cache_salt if cache_salt is not None else parse_prompt(prompt).cache_salt
        index = self.router.route(token_ids, cache_salt, self._loads())
        self.replicas[index].add_request(request_id, prompt, params, priority, cache_salt, arrival_time, token_ids)
        self._owner[request_id] = index

    def add_beam_search(self, request_id: str, prompt: PromptInput, params: BeamSearchParams,
                        lora_request: LoRARequest | None = None) -> None:
        _no_lora(lora_request)
        self._check_new(request_id)
        index = self.router.route(self.tokenize_prompt(prompt), parse_prompt(prompt).cache_salt, self._loads())
        self.replicas[index].add_beam_search(request_id, prompt, params)
        self._owner[request_id] = index

    def pop_beam_search_output(self, request_id: str) -> BeamSearchOutput | None:
        index = self._owner.get(request_id)
        output = self.replicas[index].pop_beam_search_output(request_id) if index is not None else None
        if output is not None:
            del self._owner[request_id]
        return output

    def abort_request(self, request_ids: list[str], stop_reason: str | None = None) -> list[RequestOutput]:
        """Abort each request on its replica; returns the aborted requests' last outputs."""
        outputs = []
        for request_id in request_ids:
            index = self._owner.pop(request_id, None)
            if index is not None:
                outputs += self.replicas[index].abort_request([request_id], stop_reason)
        return outputs

    def step(self) -> list[RequestOutput]:
        """One step of every replica with unfinished requests, concurrently, each on its own thread."""
        steps = [thread.submit(replica.step) for replica, thread in zip(self.replicas, self._threads, strict=True)
                 if replica.has_unfinished_requests()]
        outputs = [output for step in steps for output in step.result()]
        for output in outputs:
            if output.finished:
                self._owner.pop(output.request_id, None)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return any(replica.has_unfinished_requests() for replica in self.replicas)

    def get_num_unfinished_requests(self) -> int:
        return sum(replica.get_num_unfinished_requests() for replica in self.replicas)

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list:
        """LLMEngine.collective_rpc on each replica: every replica's ranks' results, replica by replica."""
        return [result for replica in self.replicas
                for result in replica.collective_rpc(method, timeout, args, kwargs)]

    def apply_model(self, function: Callable) -> list:
        return self.collective_rpc(apply_to_model, args=(function,))

    def start_profile(self, profile_prefix: str | None = None, *, delay_iterations: int | None = None,
                      max_iterations: int | None = None) -> None:
        """Each replica's session, on the thread that steps it (the thread torch's profiler records)."""
        for index, (replica, thread) in enumerate(zip(self.replicas, self._threads, strict=True)):
            thread.call(functools.partial(replica.start_profile, _replica_profile(profile_prefix, index),
                                          delay_iterations=delay_iterations, max_iterations=max_iterations))

    def stop_profile(self) -> None:
        for replica, thread in zip(self.replicas, self._threads, strict=True):
            thread.call(replica.stop_profile)

    def sleep(self, level: int = 1) -> None:
        for replica in self.replicas:
            replica.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        return all([replica.wake_up(tags) for replica in self.replicas])

    def release_kv_cache_memory(self) -> None:
        for replica in self.replicas:
            replica.release_kv_cache_memory()

    def is_sleeping(self) -> bool:
        return any(replica.is_sleeping() for replica in self.replicas)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._owner)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every replica's cached blocks and the router's map; False if some replica is busy (those that
        are idle are reset all the same), unless `reset_running_requests` (LLMEngine.reset_prefix_cache)."""
        done = all([replica.reset_prefix_cache(reset_running_requests, reset_connector)
                    for replica in self.replicas])
        if done:
            self.router.forget()
        return done

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The replicas' prefix-cache totals, summed."""
        stats = [replica.prefix_cache_stats for replica in self.replicas]
        return PrefixCacheStats(sum(s.num_queries for s in stats), sum(s.num_query_tokens for s in stats),
                                sum(s.num_hit_tokens for s in stats))

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()
        _stop(self._threads)

    def _check_new(self, request_id: str) -> None:
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")

    def _loads(self) -> list[int]:
        counts = Counter(self._owner.values())
        return [counts[index] for index in range(len(self.replicas))]


def _replica_profile(profile_prefix: str | None, index: int) -> str:
    """The name of replica `index`'s trace in a profiling session named `profile_prefix`."""
    return f"{profile_prefix or f'pagedllm_{os.getpid()}'}_dp{index}"


class AsyncDataParallelEngine:
    """The server's front: N AsyncEngine replicas (each its own engine thread) with AsyncEngine's interface.

    `generate` routes the request to a replica and streams from it; an abort goes to the replica running the
    request; start, drain and shutdown go to every replica; the engine is running while every replica is.
    Tokenizing and the read-only facts come from replica 0 (the replicas load the same model).

    Args:
        replicas: AsyncEngines not yet started.
        router: picks a replica for each request, given the requests each one is running.
        admission: the server's queue limits over all the replicas' requests; None: none.
    """

    def __init__(self, replicas: list[AsyncEngine], router: DataParallelRouter,
                 admission: Admission | None = None) -> None:
        self.replicas, self.router, self.admission = replicas, router, admission
        self._owner: dict[str, int] = {}    # event loop thread only

    # ---- read-only facts ------------------------------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        return len(self.replicas)

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @property
    def image_processor(self) -> ImageProcessor | None:
        return self.replicas[0].image_processor

    @property
    def image_limit(self) -> int | None:
        return self.replicas[0].image_limit

    @property
    def media_access(self) -> MediaAccess:
        return self.replicas[0].media_access

    def embeds_prompt(self, parsed: ParsedPrompt) -> ParsedPrompt:
        return self.replicas[0].embeds_prompt(parsed)

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def model_name(self) -> str:
        return self.replicas[0].model_name

    @property
    def vocab_size(self) -> int:
        return self.replicas[0].vocab_size

    @property
    def class_labels(self) -> list[str] | None:
        return self.replicas[0].class_labels

    @property
    def token_type_vocab_size(self) -> int:
        return self.replicas[0].token_type_vocab_size

    @property
    def default_sampling(self) -> dict[str, Any]:
        return self.replicas[0].default_sampling

    @property
    def swap_space_bytes(self) -> int:
        """Each replica's swap pool."""
        return self.replicas[0].swap_space_bytes

    @property
    def error(self) -> BaseException | None:
        """The first replica's error that stopped its loop; None while all run."""
        return next((replica.error for replica in self.replicas if replica.error is not None), None)

    @property
    def is_running(self) -> bool:
        return all(replica.is_running for replica in self.replicas)

    @property
    def is_draining(self) -> bool:
        return any(replica.is_draining for replica in self.replicas)

    @property
    def num_active_requests(self) -> int:
        return sum(replica.num_active_requests for replica in self.replicas)

    async def tokenize_prompt(self, prompt: PromptInput, pooling: bool = False) -> list[int]:
        return await self.replicas[0].tokenize_prompt(prompt, pooling)

    async def run_on_tokenizer_thread(self, fn: Callable[..., T], *args, **kwargs) -> T:
        return await self.replicas[0].run_on_tokenizer_thread(fn, *args, **kwargs)

    def add_stat_logger(self, stat_logger: Callable[..., None]) -> None:
        """Call `stat_logger(scheduler_stats, iteration_stats, replica=index)` on each replica's engine thread after
        each of its steps."""
        for index, replica in enumerate(self.replicas):
            replica.add_stat_logger(functools.partial(stat_logger, replica=index))

    # ---- lifecycle ------------------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        loop = loop or asyncio.get_running_loop()
        for replica in self.replicas:
            replica.start(loop)

    def shutdown(self, timeout: float = 10.0) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout)

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()

    def begin_drain(self) -> None:
        for replica in self.replicas:
            replica.begin_drain()

    async def drain(self, timeout: float, poll_interval: float = 0.05) -> int:
        """Drain every replica at once (see `AsyncEngine.drain`); returns how many requests were aborted."""
        return sum(await asyncio.gather(*(replica.drain(timeout, poll_interval) for replica in self.replicas)))

    # ---- requests -------------------------------------------------------------------------------------------------
    def generate(self, request_id: str, prompt: PromptInput, params: SamplingParams, *,
                 prompt_token_ids: list[int] | None = None, priority: int = 0,
                 cache_salt: str | None = None, lora_request: LoRARequest | None = None
                 ) -> AsyncGenerator[RequestOutput, None]:
        """Route the request to a replica and yield its outputs (see `AsyncEngine.generate`; no LoRA adapters:
        they run on one engine)."""
        return admitted(self.admission, self._generate(request_id, prompt, params, prompt_token_ids, priority,
                                                       cache_salt, lora_request), params, prompt_token_ids)

    async def _generate(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                        prompt_token_ids: list[int] | None, priority: int, cache_salt: str | None,
                        lora_request: LoRARequest | None) -> AsyncGenerator[RequestOutput, None]:
        _no_lora(lora_request)
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = prompt_token_ids if prompt_token_ids is not None else \
            await self.tokenize_prompt(prompt, isinstance(params, PoolingParams))
        cache_salt = cache_salt if cache_salt is not None else parse_prompt(prompt).cache_salt
        index = self.router.route(token_ids, cache_salt, [r.num_active_requests for r in self.replicas])
        self._owner[request_id] = index
        try:
            stream = self.replicas[index].generate(request_id, prompt, params, prompt_token_ids=token_ids,
                                                   priority=priority, cache_salt=cache_salt)
            async with aclosing(stream):
                async for output in stream:
                    yield output
        finally:
            self._owner.pop(request_id, None)

    async def beam_search(self, request_id: str, prompt: PromptInput, params: BeamSearchParams,
                          lora_request: LoRARequest | None = None) -> BeamSearchOutput:
        """A beam search on the replica the router picks (see `AsyncEngine.beam_search`; no LoRA adapters)."""
        _no_lora(lora_request)
        token_ids = await self.tokenize_prompt(prompt)
        index = self.router.route(token_ids, parse_prompt(prompt).cache_salt,
                                  [r.num_active_requests for r in self.replicas])
        return await self.replicas[index].beam_search(request_id, prompt, params)

    # ---- vLLM's development controls, on every replica -------------------------------------------------------------
    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        await asyncio.gather(*(replica.sleep(level, mode) for replica in self.replicas))

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        await asyncio.gather(*(replica.pause_generation(mode, clear_cache) for replica in self.replicas))

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return all(await asyncio.gather(*(replica.wake_up(tags) for replica in self.replicas)))

    async def release_kv_cache_memory(self) -> None:
        await asyncio.gather(*(replica.release_kv_cache_memory() for replica in self.replicas))

    def is_sleeping(self) -> bool:
        return any(replica.is_sleeping() for replica in self.replicas)

    @property
    def tensor_parallel_size(self) -> int:
        return self.replicas[0].tensor_parallel_size

    @property
    def profiles(self) -> bool:
        return self.replicas[0].profiles

    async def start_profile(self, profile_prefix: str | None = None, delay_iterations: int | None = None,
                            max_iterations: int | None = None) -> None:
        await asyncio.gather(*(replica.start_profile(_replica_profile(profile_prefix, index), delay_iterations,
                                                     max_iterations) for index, replica in enumerate(self.replicas)))

    async def stop_profile(self) -> None:
        await asyncio.gather(*(replica.stop_profile() for replica in self.replicas))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Every replica's (DataParallelEngine.reset_prefix_cache's rule: the router forgets once all are reset)."""
        done = all(await asyncio.gather(*(replica.reset_prefix_cache(reset_running_requests)
                                          for replica in self.replicas)))
        if done:
            self.router.forget()
        return done

    async def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list:
        """Every replica's ranks' results, replica by replica."""
        results = await asyncio.gather(*(replica.collective_rpc(method, timeout, args, kwargs)
                                         for replica in self.replicas))
        return [result for replica_results in results for result in replica_results]

    async def kv_cache_snapshot(self) -> KVCacheSnapshot:
        """Replica 0's block map and stats (the dashboard shows one pool)."""
        return await self.replicas[0].kv_cache_snapshot()

    def abort(self, request_id: str, tell: bool = False) -> None:
        index = self._owner.get(request_id)
        if index is not None:
            self.replicas[index].abort(request_id, tell)


def build_async_engine(config: EngineConfig, log_requests: bool = False, log_stats: bool = False,
                       max_log_len: int | None = None, admission: Admission | None = None,
                       log_outputs: bool = False) -> AsyncEngine | AsyncDataParallelEngine:
    """The server's engine: one AsyncEngine, or with data_parallel_size > 1 the replicas behind the router; each
    engine built on the thread that steps it. `log_stats`: vLLM's log line of throughput and load every 10 s of
    activity (pagedllm.metrics.log_stats); `log_requests`, `max_log_len` and `log_outputs` as AsyncEngine's;
    `admission`: the queue limits, held by the front (the one engine, or the replicas' router)."""
    replicas, threads = build_replicas(config, "pagedllm-engine")
    engines = [AsyncEngine(replica, log_requests, thread, max_log_len, admission if len(replicas) == 1 else None,
                           log_outputs) for replica, thread in zip(replicas, threads, strict=True)]
    engine = engines[0] if len(engines) == 1 else AsyncDataParallelEngine(
        engines, make_router(config, replicas[0].capacity.num_blocks), admission)
    if log_stats:
        engine.add_stat_logger(LoggingStatLogger().record)
    return engine


def _no_lora(lora_request: LoRARequest | None) -> None:
    if lora_request is not None:
        raise ValueError("LoRA adapters run on one engine: data_parallel_size must be 1")

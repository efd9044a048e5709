"""A data-parallel replica as a Ray actor: `distributed_executor_backend="ray"` with `data_parallel_size` > 1.

Each replica's whole `LLMEngine` (scheduler, KV pool, runner) lives in its own actor process, on any node of the
Ray cluster; this process keeps the router and talks to each replica through a `RayReplica`, which has the part of
LLMEngine's interface that the data-parallel fronts use (`DataParallelEngine` offline, `AsyncEngine` on the
server), so neither knows where its replica runs:

    DataParallelEngine / AsyncEngine ── RayReplica.step() ── actor call ──▶ _EngineActor: LLMEngine.step()
                                     ◀── outputs, whether work is left ──

What crosses per step is the step's `RequestOutput`s (new tokens and text), never weights or KV blocks. An actor
runs one call at a time, in order, except a grammar compile, which runs beside a step as it does in one process.
A replica whose actor dies fails the calls to it: its requests get an error and the server answers 503.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache.block_pool import PrefixCacheStats
from pagedllm.distributed import _JOIN_SECONDS, acquire_ray, process_lives, release_ray
from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams
from pagedllm.engine.engine_thread import EngineThread
from pagedllm.engine.llm_engine import LLMEngine, PromptInput, tokenize_prompt
from pagedllm.logger import init_logger
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.runner import kv_tensors
from pagedllm.sampling_params import SamplingParams

logger = init_logger(__name__)


@dataclass
class _Facts:
    """What a replica's engine derived at start-up, read once."""
    pid: int
    node_id: str
    config: EngineConfig
    tokenizer: Any
    model_name: str
    vocab_size: int
    max_model_len: int
    default_sampling: dict[str, Any]
    class_labels: list[str] | None
    token_type_vocab_size: int
    swap_space_bytes: int
    capacity: kv_tensors.CapacityReport


class _EngineActor:
    """The actor: one LLMEngine on its share of the node's cores.

    Ray runs a threaded actor's calls on any of its threads; the engine is built and runs on one of its own
    (engine_thread.py says why: two threads running its forward passes would throttle each other's kernels).
    """

    def __init__(self, config: EngineConfig, num_threads: int) -> None:
        if config.model.device == "cpu":
            torch.set_num_threads(num_threads)
        self._thread = EngineThread("pagedllm-replica")
        self.engine = self._thread.call(LLMEngine, config)

    def facts(self) -> _Facts:
        import ray

        engine = self.engine
        return _Facts(os.getpid(), ray.get_runtime_context().get_node_id(), engine.config, engine.tokenizer,
                      engine.model_name, engine.vocab_size, engine.max_model_len, engine.default_sampling,
                      engine.class_labels, engine.token_type_vocab_size, engine.swap_space_bytes, engine.capacity)

    def call(self, method: str, *args, **kwargs) -> Any:
        return self._thread.call(functools.partial(getattr(self.engine, method), *args, **kwargs))

    def call_and_report(self, method: str, *args, **kwargs) -> tuple[Any, bool]:
        """`method`'s result, and whether the engine has unfinished requests after it."""
        return self.call(method, *args, **kwargs), self.engine.has_unfinished_requests()

    def compile(self, spec) -> None:
        self.engine.structured_output.compile(spec)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.engine.prefix_cache_stats


class _RemoteStructuredOutput:
    """`engine.structured_output.compile` for a replica in an actor: compiles (and caches) it there."""

    def __init__(self, replica: RayReplica) -> None:
        self._replica = replica

    def compile(self, spec) -> None:
        self._replica._get(self._replica.actor.compile.remote(spec))


class RayReplica:
    """One data-parallel replica's LLMEngine in a Ray actor, behind the LLMEngine methods the fronts call.

    Args:
        config: the replica's config (data_parallel_size 1).
        index: the replica's index, for the actor's name.
        num_threads: the actor's intra-op threads (on a CPU).
    """

    def __init__(self, config: EngineConfig, index: int, num_threads: int) -> None:
        self.ray = ray = acquire_ray()
        self.index = index
        try:
            # max_concurrency 2: a grammar compile may run beside a step (the engine's one thread-safe call).
            actor_class = ray.remote(num_cpus=1, max_concurrency=2)(_EngineActor)
            self.actor = actor_class.options(name=f"pagedllm-dp{index}-{os.getpid()}").remote(config, num_threads)
        except BaseException:
            release_ray()
            raise
        self._facts_ref = self.actor.facts.remote()
        self._unfinished = False
        self._sleeping = False
        self._closed = False

    def wait_until_loaded(self) -> None:
        """Wait for the actor's engine to start (the replicas load their models meanwhile, side by side); raises
        its start-up error."""
        facts: _Facts = self._get(self._facts_ref)
        self.pid = facts.pid
        self._on_this_node = facts.node_id == self.ray.get_runtime_context().get_node_id()
        self.config, self.tokenizer = facts.config, facts.tokenizer
        self.model_name, self.vocab_size, self.max_model_len = facts.model_name, facts.vocab_size, facts.max_model_len
        self.default_sampling, self.class_labels = facts.default_sampling, facts.class_labels
        self.token_type_vocab_size = facts.token_type_vocab_size
        self.swap_space_bytes, self.capacity = facts.swap_space_bytes, facts.capacity
        self.structured_output = _RemoteStructuredOutput(self)
        logger.info("data parallel: replica %d in Ray actor pid %d", self.index, self.pid)

    def _get(self, ref) -> Any:
        """The call's result; the engine's own exception (a ValueError for bad input, ...) re-raised as itself."""
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, Exception):
                raise exc.cause from None
            raise

    def _call(self, method: str, *args, **kwargs) -> Any:
        return self._get(self.actor.call.remote(method, *args, **kwargs))

    def _call_and_report(self, method: str, *args, **kwargs) -> Any:
        result, self._unfinished = self._get(self.actor.call_and_report.remote(method, *args, **kwargs))
        return result

    # ---- LLMEngine's interface ----------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptInput, pooling: bool = False) -> list[int]:
        return tokenize_prompt(self.tokenizer, prompt, self.vocab_size, self.max_model_len, pooling)

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | PoolingParams,
                    priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None, lora_request: LoRARequest | None = None) -> None:
        self._call_and_report("add_request", request_id, prompt, params, priority, cache_salt, arrival_time,
                              prompt_token_ids, lora_request)

    def add_beam_search(self, request_id: str, prompt: PromptInput, params: BeamSearchParams,
                        lora_request: LoRARequest | None = None) -> None:
        self._call_and_report("add_beam_search", request_id, prompt, params, lora_request)

    def pop_beam_search_outputs(self) -> dict[str, BeamSearchOutput]:
        return self._call("pop_beam_search_outputs")

    def pop_beam_search_output(self, request_id: str) -> BeamSearchOutput | None:
        return self._call("pop_beam_search_output", request_id)

    def abort_request(self, request_ids: list[str], stop_reason: str | None = None) -> list[RequestOutput]:
        return self._call_and_report("abort_request", request_ids, stop_reason)

    def step(self) -> list[RequestOutput]:
        return self._call_and_report("step")

    def has_unfinished_requests(self) -> bool:
        """As of the last call (only this process adds requests, and only a call changes the answer)."""
        return self._unfinished

    def get_num_unfinished_requests(self) -> int:
        return self._call("get_num_unfinished_requests")

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list:
        return self._call("collective_rpc", method, timeout, args, kwargs)

    def start_profile(self, profile_prefix: str | None = None, *, delay_iterations: int | None = None,
                      max_iterations: int | None = None) -> None:
        self._call("start_profile", profile_prefix, delay_iterations=delay_iterations, max_iterations=max_iterations)

    def stop_profile(self) -> None:
        self._call("stop_profile")

    def sleep(self, level: int = 1) -> None:
        self._call("sleep", level)
        self._sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self._sleeping = not self._call("wake_up", tags)
        return not self._sleeping

    def release_kv_cache_memory(self) -> None:
        self._call("release_kv_cache_memory")

    def is_sleeping(self) -> bool:
        """As of the last call (only this process puts the engine to sleep and wakes it)."""
        return self._sleeping

    def make_stats(self):
        return self._call("make_stats")

    def make_block_map(self):
        return self._call("make_block_map")

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._get(self.actor.prefix_cache_stats.remote())

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self._call("reset_prefix_cache", reset_running_requests, reset_connector)

    def is_healthy(self) -> bool:
        """Not closed and, for an actor on this machine, its process lives: asked without a call, so that /health
        never waits for a step (an actor on another node that dies is noticed at the next call, which fails)."""
        return not self._closed and (not self._on_this_node or process_lives(self.pid))

    def close(self) -> None:
        """Close the engine in the actor (its swap file is deleted there), then end the actor."""
        if self._closed:
            return
        self._closed = True
        try:
            self.ray.get(self.actor.call.remote("close"), timeout=_JOIN_SECONDS)
        except Exception:  # noqa: BLE001 - a dead or stuck actor is killed all the same
            logger.warning("data parallel: a replica's engine did not close cleanly; killing its actor")
        self.ray.kill(self.actor)
        release_ray()

"""AsyncEngine: the LLMEngine step loop on one background thread, beside the asyncio event loop.

The engine thread is an EngineThread: `build_async_engine` loads the model on it too, so that all of the
engine's torch work runs on one thread (engine_thread.py says why that doubles the speed of a served stream).

```
 event loop thread                                   engine thread (the only one that touches LLMEngine)
 -----------------                                   -------------
 generate(id) -> registers queue[id]  --inbox-->      wait on condition while idle
              -> post(_Add)                           add / abort everything in the inbox
 await queue[id].get()  <--call_soon_threadsafe--     step() -> outputs; one _dispatch callback per step
 disconnect / cancel -> post(_Abort)                  metrics: engine.make_stats() + request timings
 await kv_cache_snapshot() -> post(_Snapshot) ..>    after that step, if asked: engine.make_block_map()
```
The model forward releases the GIL, so the event loop keeps serving HTTP while a step runs. Tokenizing and chat
templating run on a third thread (`run_on_tokenizer_thread`): a multi-MB prompt takes seconds to tokenize, and on
the event loop every stream would stall for that long (the Rust tokenizer releases the GIL while it encodes).
The dashboard's block map is made only when a caller asks, at most once per step whatever the number of callers,
and is handed over as an immutable `KVCacheSnapshot`: with no dashboard open, the loop does no extra work.

Failures, from the smallest to the largest:
  - the engine refuses a request at add time (bad input): that request alone fails, with ValueError;
  - the runner raises during a step: LLMEngine finds the requests whose own run raises (see `LLMEngine._execute`)
    and fails them alone; each fails here with RequestFailedError, and the loop goes on;
  - the loop itself raises (the bookkeeping is broken): the error is kept, every waiting request fails with
    EngineDeadError, and so does every later one; `is_running` turns False at once.
Shutting down: `begin_drain()` refuses new requests (EngineDrainingError), `drain(timeout)` waits for the running
ones and then aborts the rest (finish_reason "abort", stop_reason "server_shutdown"); `shutdown()` stops the thread,
fails anything still waiting, so that no caller ever hangs, and closes the engine (the swap file goes).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from pagedllm.config import MediaAccess
from pagedllm.core.kv_cache.block_map import BlockMap
from pagedllm.distributed import TensorParallelError
from pagedllm.engine.admission import Admission, admitted
from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams
from pagedllm.engine.engine_thread import EngineThread
from pagedllm.engine.llm_engine import LLMEngine, PromptInput, check_sleep, tokenize_prompt
from pagedllm.inputs import ParsedPrompt, parse_prompt
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.stats import IterationStats, SchedulerStats, StatLogger, StepRecorder
from pagedllm.multimodal import ImageProcessor
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped on an error; no request can run."""


class EngineDrainingError(EngineDeadError):
    """The server is shutting down: it takes no new request."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request (a failed step); other requests go on."""


SHUTDOWN_STOP_REASON = "server_shutdown"
SLEEP_STOP_REASON = "engine_sleep"      # the stop_reason of requests a sleep (mode "abort") ended


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: PromptInput
    params: SamplingParams
    prompt_token_ids: list[int] | None
    priority: int
    cache_salt: str | None
    arrival: float          # time.monotonic(): the scheduler's first-come order and the latencies
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]
    stop_reason: str | None = None      # the aborted outputs' stop_reason
    tell: bool = False                  # send each request's caller its aborted output (nobody listens otherwise)


@dataclass(slots=True)
class _Snapshot:
    """Ask for a KVCacheSnapshot after the coming step."""


@dataclass(frozen=True, slots=True)
class KVCacheSnapshot:
    """The scheduler's stats and the KV block map, taken together after one step (so they agree)."""

    time: float             # time.time() when taken
    stats: SchedulerStats
    block_map: BlockMap


@dataclass(slots=True)
class _Call:
    """Run `fn(engine)` on the engine thread, between steps; its result (or exception) goes to `future`."""

    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future


_InboxItem = _Add | _Abort | _Snapshot | _Call


class AsyncEngine:
    """Serve an LLMEngine to asyncio code.

    Args:
        engine: the engine; from `start()` on, only the engine thread may touch it.
        log_requests: log each request's prompt and parameters (off by default: prompts may be private).
        thread: the thread that built the engine, to step it on (default: a new one).
        max_log_len: the most characters of a prompt's text (or of its token ids, written out), or of an output's
            text, logged; None: all.
        admission: the server's queue limits, held by its front (this engine, unless it is a data-parallel
            replica); None: none.
        log_outputs: also log each completion's text and finish reason once it ends (vLLM's --enable-log-outputs).
    """

    data_parallel_size = 1      # one engine; AsyncDataParallelEngine stands for several with this interface

    def __init__(self, engine: LLMEngine, log_requests: bool = False, thread: EngineThread | None = None,
                 max_log_len: int | None = None, admission: Admission | None = None,
                 log_outputs: bool = False) -> None:
        self.engine = engine
        self.admission = admission
        self.log_requests, self.max_log_len, self.log_outputs = log_requests, max_log_len, log_outputs
        self.error: BaseException | None = None
        self.latest_stats = SchedulerStats()
        self._cond = threading.Condition()
        self._inbox: list[_InboxItem] = []
        self._calls: set[asyncio.Future] = set()     # call_in_engine's, until answered
        self._stopped = False
        self._draining = False
        self._thread = thread or EngineThread()
        self._loop_done: Future[None] | None = None       # the step loop, once started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue] = {}        # event loop thread only
        self._beam_waiters: dict[str, asyncio.Future] = {}  # event loop thread only: beam searches unanswered
        self._snapshot_waiter: asyncio.Future[KVCacheSnapshot] | None = None     # event loop thread only
        self._stats = StepRecorder()                        # engine thread only
        self._beam_search_ids: set[str] = set()             # engine thread only: beam searches added, not done
        # One worker, as vLLM's serving layer has: tokenizer calls run one at a time and in order (a fast
        # tokenizer raises "Already borrowed" if one thread changes its settings while another encodes), and a
        # flood of huge prompts takes one core, not all of them.
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-tokenizer")

    # ---- read-only facts, safe from any thread ------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def image_processor(self) -> ImageProcessor | None:
        """The model's processor of prompts with images (`LLMEngine.image_processor`); None: it takes none."""
        return self.engine.image_processor

    @property
    def image_limit(self) -> int | None:
        return self.engine.image_limit

    @property
    def media_access(self) -> MediaAccess:
        return self.engine.config.model.media_access

    def embeds_prompt(self, parsed: ParsedPrompt) -> ParsedPrompt:
        """A prompt of embeddings checked and made the engine's (`LLMEngine.embeds_prompt`); thread-safe."""
        return self.engine.embeds_prompt(parsed)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def class_labels(self) -> list[str] | None:
        """A classifier model's class names (PoolingParams task "classify"); None for a model that cannot classify."""
        return self.engine.class_labels

    @property
    def token_type_vocab_size(self) -> int:
        """How many token types the model's embedding adds (a BERT-family encoder's); 0: it takes no token type ids."""
        return self.engine.token_type_vocab_size

    @property
    def default_sampling(self) -> dict[str, Any]:
        return self.engine.default_sampling

    @property
    def swap_space_bytes(self) -> int:
        return self.engine.swap_space_bytes

    async def tokenize_prompt(self, prompt: PromptInput, pooling: bool = False) -> list[int]:
        """The prompt's token ids, validated as the engine will (empty, vocabulary, context length, which a prompt
        to embed may fill), computed on the tokenizer thread; raises ValueError (PromptTooLongError for the
        context)."""
        return await self.run_on_tokenizer_thread(tokenize_prompt, self.tokenizer, prompt, self.vocab_size,
                                                  self.max_model_len, pooling)

    async def _prepared(self, prompt: PromptInput, params: SamplingParams | PoolingParams,
                        prompt_token_ids: list[int] | None) -> tuple[PromptInput, list[int] | None]:
        """What the step loop would do slowly, done here in worker threads, so that it only queues the request: a
        structured-output constraint compiled (or found in the cache), a prompt's images processed (resized and
        hashed; its token ids then the processor's)."""
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.structured_output.compile,
                                                             params.structured_outputs)
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:    # only a dict holds images as given
            parsed = parse_prompt(prompt)
            if parsed.images:
                return await self.run_on_tokenizer_thread(self.engine.process_images, parsed), None
        return prompt, prompt_token_ids

    async def run_on_tokenizer_thread(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` on the tokenizer thread, off the event loop; for tokenizing, templating and
        decoding, which take time in proportion to the text. Safe from any coroutine on the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, functools.partial(fn, *args, **kwargs))

    @property
    def is_running(self) -> bool:
        self._notice_dead_workers()
        return self._loop_done is not None and not self._loop_done.done() and self.error is None

    def _notice_dead_workers(self) -> None:
        """A tensor-parallel worker that died while the engine idled kills the engine now, not at the next step."""
        if self.error is None and not self.engine.is_healthy():
            self.error = TensorParallelError("a tensor-parallel worker process died")

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def num_active_requests(self) -> int:
        """Requests some caller is still waiting on (event loop thread only)."""
        return len(self._streams)

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """Call `stat_logger(scheduler_stats, iteration_stats)` on the engine thread after each step."""
        self._stats.loggers.append(stat_logger)

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the step loop on the engine thread; outputs are delivered on `loop` (default: the running loop)."""
        if self._loop_done is not None:
            raise RuntimeError("the engine thread is already started")
        self._loop = loop or asyncio.get_running_loop()
        self._loop_done = self._thread.submit(self._run)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; any request still waiting fails with EngineDeadError (none hangs). Then close
        the engine (its swap file is deleted), unless the thread is still inside a step after `timeout`."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._thread.stop()
        if self._loop_done is not None:
            try:
                self._loop_done.result(timeout)     # _run keeps its errors: it only ever returns
            except TimeoutError:
                logger.warning("the engine thread did not stop within %.1f s; the engine is left open", timeout)
                return
            finally:
                self._call_in_loop(self._fail_all, EngineDeadError("the engine has shut down"))
        self.engine.close()

    def close(self) -> None:
        """Close the engine (its swap file is deleted) without stopping the thread: for a forced exit, after which
        nothing steps it."""
        self.engine.close()

    def begin_drain(self) -> None:
        """Refuse new requests from now on; running ones go on."""
        self._draining = True

    async def drain(self, timeout: float, poll_interval: float = 0.05) -> int:
        """Refuse new requests, wait up to `timeout` seconds for the running ones to finish, then abort the rest:
        each ends with finish_reason "abort" and stop_reason "server_shutdown". Returns how many were aborted."""
        self.begin_drain()
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self.is_running:
            await asyncio.sleep(poll_interval)
        left = list(self._streams)
        if left and self.is_running:
            logger.warning("shutdown deadline (%.1f s) reached: aborting %d running request(s)", timeout, len(left))
            self._post(_Abort(left, SHUTDOWN_STOP_REASON, tell=True))
            end = time.monotonic() + 5.0
            while self._streams and time.monotonic() < end and self.is_running:
                await asyncio.sleep(poll_interval)
        return len(left)

    # ---- the asyncio side ---------------------------------------------------------------------------------------
    def generate(self, request_id: str, prompt: PromptInput, params: SamplingParams | PoolingParams, *,
                 prompt_token_ids: list[int] | None = None, priority: int = 0,
                 cache_salt: str | None = None, lora_request: LoRARequest | None = None
                 ) -> AsyncGenerator[RequestOutput, None]:
        """Run one request and yield its outputs until the last (`finished`) one. With PoolingParams, the request
        embeds the prompt: one output, whose `embedding` holds it. `lora_request` runs it with that adapter.

        Use `params.output_kind = "delta"` to get each step's new text; with `params.n > 1` each such output
        carries the completion that changed (its `index` says which), and the last is `finished` once all n are.
        Closing the iterator early (the client went away) aborts the request with all its completions, and its KV
        blocks go back to the pool.

        Raises:
            EngineDeadError: the engine loop has failed (now or while this request waited).
            ValueError: the engine refused the request (this request alone fails), e.g. a non-zero priority
                without scheduling_policy "priority", or a structured-output constraint that does not compile.
            QueueFullError: a queue limit of the engine's `admission` is reached (pagedllm.engine.admission).
        """
        return admitted(self.admission, self._generate(request_id, prompt, params, prompt_token_ids, priority,
                                                       cache_salt, lora_request), params, prompt_token_ids)

    async def _generate(self, request_id: str, prompt: PromptInput, params: SamplingParams | PoolingParams,
                        prompt_token_ids: list[int] | None, priority: int, cache_salt: str | None,
                        lora_request: LoRARequest | None) -> AsyncGenerator[RequestOutput, None]:
        self._raise_if_dead()
        if self._draining:
            raise EngineDrainingError("the server is shutting down and takes no new requests")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt, prompt_token_ids = await self._prepared(prompt, params, prompt_token_ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        if self.log_requests:
            logger.info("request %s: prompt=%s params=%s", request_id, self._clipped(repr(prompt)), params)
        self._post(_Add(request_id, prompt, params, prompt_token_ids, priority, cache_salt, time.monotonic(),
                        lora_request))
        done = False
        texts: dict[int, str] = {}      # with log_outputs: each completion's text so far
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True     # refused at add time, or the engine died: nothing to abort
                    raise item
                if item.error is not None:
                    done = True     # the engine failed this request's step and has already finished it
                    raise RequestFailedError(item.error)
                done = item.finished
                if self.log_outputs:
                    self._log_outputs(request_id, item, texts, getattr(params, "output_kind", "final") == "delta")
                yield item
                if done:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not done:
                self.abort(request_id)

    def _clipped(self, text: str) -> str:
        if self.max_log_len is None or len(text) <= self.max_log_len:
            return text
        return f"{text[:self.max_log_len]}... ({len(text) - self.max_log_len} more characters)"

    def _log_outputs(self, request_id: str, output: RequestOutput, texts: dict[int, str], delta: bool) -> None:
        """Log each of the output's completions that ended, with its whole text (a stream's deltas gathered)."""
        for completion in output.outputs:
            texts[completion.index] = texts.get(completion.index, "") + completion.text if delta else completion.text
            if completion.finish_reason is not None:
                logger.info("response %s (completion %d): output=%s finish_reason=%s", request_id, completion.index,
                            self._clipped(repr(texts.pop(completion.index))), completion.finish_reason)

    async def beam_search(self, request_id: str, prompt: PromptInput, params: BeamSearchParams,
                          lora_request: LoRARequest | None = None) -> BeamSearchOutput:
        """Run a beam search in the engine (its beams batch with the other requests and share KV blocks) and
        return its sequences, best first. Cancelling the caller aborts it.

        Raises:
            EngineDeadError: the engine loop has failed or stopped.
            ValueError: the engine refused it (a bad prompt, an id in use).
        """
        self._raise_if_dead()
        if self._draining:
            raise EngineDrainingError("the server is shutting down and takes no new requests")
        if request_id in self._beam_waiters or request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        assert self._loop is not None
        answer = self._loop.create_future()
        self._beam_waiters[request_id] = answer     # before it is added: its answer cannot come first
        try:
            await self.call_in_engine(lambda engine: self._add_beam_search(engine, request_id, prompt, params,
                                                                           lora_request))
            return await answer
        finally:
            self._beam_waiters.pop(request_id, None)
            if not answer.done() or answer.cancelled():     # the caller went away (which cancels `answer`
                # too), or the add failed: nothing may stay running
                self.abort(request_id)

    def _add_beam_search(self, engine: LLMEngine, request_id: str, prompt: PromptInput, params: BeamSearchParams,
                         lora_request: LoRARequest | None) -> None:
        """On the engine thread: add it, and look for its answer after each step from now on."""
        engine.add_beam_search(request_id, prompt, params, lora_request)
        self._beam_search_ids.add(request_id)

    def _deliver_beam_searches(self, outputs: dict[str, BeamSearchOutput]) -> None:
        """On the event loop: each finished beam search's sequences to whoever waits for them."""
        for request_id, output in outputs.items():
            _settle(self._beam_waiters.get(request_id), output, None)

    async def call_in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)`'s result, run on the engine thread between two steps (what changes the engine outside a
        request, such as loading a LoRA adapter); its exception is raised here.

        Raises:
            EngineDeadError: the engine loop has failed or stopped (now or before `fn` ran).
        """
        self._raise_if_dead()
        assert self._loop is not None
        future = self._loop.create_future()
        self._calls.add(future)
        self._post(_Call(fn, future))
        try:
            return await future
        finally:
            self._calls.discard(future)

    # ---- vLLM's development controls (the server's /sleep, /wake_up, /collective_rpc, ...) ---------------------------
    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """`LLMEngine.sleep` between two steps, once the requests are dealt with as `mode` says: "abort" ends every
        request (finish_reason "abort", stop_reason "engine_sleep"), "wait" lets those running or queued now finish
        first (later ones are kept), "keep" keeps them all, to run after wake_up (recomputed from level 1)."""
        check_sleep(level, mode)
        if mode == "abort" and self._streams:
            self._post(_Abort(list(self._streams), SLEEP_STOP_REASON, tell=True))
        elif mode == "wait":
            if self._streams and self.is_sleeping():
                raise ValueError("sleep mode 'wait' runs the requests in flight to the end, which a sleeping engine "
                                 "cannot: wake it up first, or use mode 'abort' or 'keep'")
            waited = set(self._streams)
            while waited.intersection(self._streams) and self.is_running:
                await asyncio.sleep(0.02)
        await self.call_in_engine(lambda engine: engine.sleep(level))

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's pause for a weight update: a level-0 sleep (`mode` as sleep's), then the prefix cache emptied
        unless `clear_cache` is False or the requests are kept (their blocks are in use)."""
        await self.sleep(0, mode)
        if clear_cache and mode != "keep":
            await self.reset_prefix_cache()

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """`LLMEngine.wake_up`: whether the engine is fully awake (and steps again)."""
        return await self.call_in_engine(lambda engine: engine.wake_up(tags))

    async def release_kv_cache_memory(self) -> None:
        await self.call_in_engine(lambda engine: engine.release_kv_cache_memory())

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    @property
    def tensor_parallel_size(self) -> int:
        return self.engine.config.parallel.tensor_parallel_size

    @property
    def profiles(self) -> bool:
        """Whether a profiler is configured (`start_profile`)."""
        return bool(self.engine.config.profiler.profiler)

    async def start_profile(self, profile_prefix: str | None = None, delay_iterations: int | None = None,
                            max_iterations: int | None = None) -> None:
        await self.call_in_engine(lambda engine: engine.start_profile(
            profile_prefix, delay_iterations=delay_iterations, max_iterations=max_iterations))

    async def stop_profile(self) -> None:
        await self.call_in_engine(lambda engine: engine.stop_profile())

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block; False while requests hold blocks, unless `reset_running_requests`
        (LLMEngine.reset_prefix_cache)."""
        return await self.call_in_engine(lambda engine: engine.reset_prefix_cache(reset_running_requests))

    async def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list:
        """`LLMEngine.collective_rpc` between two steps."""
        return await self.call_in_engine(lambda engine: engine.collective_rpc(method, timeout, args, kwargs))

    async def kv_cache_snapshot(self) -> KVCacheSnapshot:
        """The KV block map and the stats after the engine's next step (at once when it is idle). Callers that
        ask while one is being made share it.

        Raises:
            EngineDeadError: the engine loop has failed or stopped.
        """
        self._raise_if_dead()
        if self._snapshot_waiter is None:
            assert self._loop is not None
            self._snapshot_waiter = self._loop.create_future()
            self._post(_Snapshot())
        return await asyncio.shield(self._snapshot_waiter)

    def abort(self, request_id: str, tell: bool = False) -> None:
        """Abort a request (a no-op if it already finished). `tell`: its caller, still iterating, gets its last
        output, finish_reason "abort" (otherwise the caller has gone: the server's disconnect)."""
        self._post(_Abort([request_id], tell=tell))

    def _raise_if_dead(self) -> None:
        self._notice_dead_workers()
        if self.error is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self.error!r}") from self.error
        if self._loop_done is None or self._stopped:
            raise EngineDeadError("the engine is not running")

    def _post(self, item: _InboxItem) -> None:
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """On the event loop: hand each output to its request's queue."""
        for output in outputs:
            queue = self._streams.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    def _dispatch_error(self, request_id: str, error: BaseException) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def _deliver_snapshot(self, snapshot: KVCacheSnapshot | BaseException) -> None:
        """On the event loop: hand the snapshot (or the engine's death) to everyone waiting for one."""
        waiter, self._snapshot_waiter = self._snapshot_waiter, None
        if waiter is None or waiter.done():
            return
        if isinstance(snapshot, BaseException):
            waiter.set_exception(snapshot)
            waiter.exception()      # retrieved: no "never retrieved" warning when every caller went away
        else:
            waiter.set_result(snapshot)

    def _fail_all(self, error: BaseException) -> None:
        dead = error if isinstance(error, EngineDeadError) else \
            EngineDeadError(f"the engine loop has stopped: {error!r}")
        for queue in self._streams.values():
            queue.put_nowait(dead)
        self._deliver_snapshot(dead)
        for future in [*self._calls, *self._beam_waiters.values()]:
            _settle(future, None, dead)

    def _call_in_loop(self, callback: Callable, *args) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:    # the event loop has closed: nobody is waiting any more
            pass

    # ---- the engine thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._publish([], IterationStats())     # the gauges' starting values
            while (batch := self._wait_for_work()) is not None:
                iteration = IterationStats()
                wants_snapshot = self._handle_inbox(batch, iteration)
                stepped = self._has_work()
                iteration.started = time.monotonic()
                outputs = self.engine.step() if stepped else []
                self._publish(outputs, iteration, stepped)
                if wants_snapshot:
                    snapshot = KVCacheSnapshot(time.time(), self.latest_stats, self.engine.make_block_map())
                    self._call_in_loop(self._deliver_snapshot, snapshot)
        except BaseException as exc:  # noqa: BLE001 - any failure kills the loop; report it to everyone
            logger.exception("the engine loop failed; the server will answer 503 from now on")
            self.error = exc
            self._call_in_loop(self._fail_all, exc)

    def _wait_for_work(self) -> list[_InboxItem] | None:
        """Sleep until there is something to do; None once shut down."""
        with self._cond:
            while not self._stopped and not self._inbox and not self._has_work():
                self._cond.wait()
            if self._stopped:
                return None
            batch, self._inbox = self._inbox, []
            return batch

    def _has_work(self) -> bool:
        """Requests to step: unfinished ones, and the engine awake (asleep, they wait for wake_up)."""
        return self.engine.has_unfinished_requests() and not self.engine.is_sleeping()

    def _handle_inbox(self, batch: list[_InboxItem], iteration: IterationStats) -> bool:
        """Add and abort; True if a snapshot was asked for."""
        wants_snapshot = False
        for item in batch:
            if isinstance(item, _Add):
                self._add(item)
            elif isinstance(item, _Abort):
                self._abort(item.request_ids, iteration, item.stop_reason, item.tell)
            elif isinstance(item, _Call):
                self._call(item)
            else:
                wants_snapshot = True
        return wants_snapshot

    def _call(self, item: _Call) -> None:
        try:
            result, error = item.fn(self.engine), None
        except Exception as exc:  # the caller's failure, not the engine's
            result, error = None, exc
        self._call_in_loop(_settle, item.future, result, error)

    def _add(self, item: _Add) -> None:
        try:
            self.engine.add_request(item.request_id, item.prompt, item.params, priority=item.priority,
                                    cache_salt=item.cache_salt, arrival_time=item.arrival,
                                    prompt_token_ids=item.prompt_token_ids, lora_request=item.lora_request)
        except Exception as exc:  # bad input fails this request alone
            self._call_in_loop(self._dispatch_error, item.request_id, exc)
            return
        num_prompt_tokens = len(item.prompt_token_ids) if item.prompt_token_ids is not None else 0
        sampling = item.params if isinstance(item.params, SamplingParams) else None
        self._stats.requests.on_added(item.request_id, item.arrival, num_prompt_tokens,
                                      None if sampling is None else sampling.max_tokens,
                                      None if sampling is None else sampling.n)

    def _abort(self, request_ids: list[str], iteration: IterationStats, stop_reason: str | None = None,
               tell: bool = False) -> None:
        beams = [r for r in request_ids if r in self._beam_search_ids]
        if beams:
            self.engine.abort_request(beams)
            self._beam_search_ids.difference_update(beams)
        live = [r for r in request_ids if r in self._stats.requests]
        if not live:
            return      # finished (or refused) before the abort arrived
        ends = self.engine.abort_request(live, stop_reason)
        self._stats.requests.on_aborted(live, iteration, time.monotonic())
        if tell:     # someone is still listening: tell them how it ended
            self._call_in_loop(self._dispatch, ends)

    def _publish(self, outputs: list[RequestOutput], iteration: IterationStats, stepped: bool = False) -> None:
        self.latest_stats = self._stats.record(self.engine, outputs, iteration, stepped)
        if outputs:
            self._call_in_loop(self._dispatch, outputs)
        if self._beam_search_ids:       # (an engine without beam searches is not asked: a Ray replica's is remote)
            beams = self.engine.pop_beam_search_outputs()
            self._beam_search_ids.difference_update(beams)
            if beams:
                self._call_in_loop(self._deliver_beam_searches, beams)


def _settle(future: asyncio.Future | None, result: Any, error: BaseException | None) -> None:
    """On the event loop: give `future` its result or exception, unless it is done or gone (its caller went
    away)."""
    if future is None or future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)

"""vLLM's AsyncLLM (`AsyncLLMEngine`, its older name): the async engine as code written against vLLM's calls it, over
pagedllm's AsyncEngine (or data-parallel replicas behind one front, as the server runs them).

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=...))
    async for output in engine.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        print(output.outputs[0].text)      # the completion so far (output_kind "cumulative", vLLM's default)
    engine.shutdown()

The engine thread starts at the first request, delivering outputs on that request's event loop (one loop for the
engine's life). A consumer that stops iterating aborts its request, as on the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any

from pagedllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from pagedllm.engine.async_engine import AsyncEngine, EngineDeadError
from pagedllm.engine.data_parallel import AsyncDataParallelEngine, build_async_engine
from pagedllm.engine.llm_engine import PromptInput, apply_tokenization_kwargs
from pagedllm.inputs import PromptType, parse_prompt
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class AsyncLLM:
    """vLLM's async engine interface over `engine` (an AsyncEngine not yet started, or replicas behind one)."""

    def __init__(self, engine: AsyncEngine | AsyncDataParallelEngine) -> None:
        self.engine = engine
        self._started = False

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, start_engine_loop: bool = True) -> AsyncLLM:
        """An engine of these arguments (vLLM's); its thread starts at the first request, whatever
        `start_engine_loop` says (it needs the caller's event loop)."""
        del start_engine_loop
        log_requests = isinstance(engine_args, AsyncEngineArgs) and engine_args.enable_log_requests
        return cls(build_async_engine(engine_args.create_engine_config(), log_requests=log_requests,
                                      log_stats=not engine_args.disable_log_stats))

    def _start(self) -> None:
        if not self._started:
            self.engine.start(asyncio.get_running_loop())
            self._started = True

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, *,
                       lora_request: LoRARequest | None = None, priority: int = 0,
                       tokenization_kwargs: dict[str, Any] | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Run one request, yielding its outputs until the finished one: each the completion so far unless
        `sampling_params.output_kind` says "delta" or "final" (vLLM's default; pagedllm's LLM uses "final").
        `tokenization_kwargs`: as LLM.generate's (truncate_prompt_tokens, truncation_side, add_special_tokens).

        Raises:
            ValueError: a bad prompt or parameters (this request alone fails).
            EngineDeadError: the engine has failed or shut down.
        """
        self._start()
        if sampling_params.output_kind is None:
            sampling_params = dataclasses.replace(sampling_params, output_kind="cumulative")
        prompt = await self._tokenized(prompt, tokenization_kwargs)
        async for output in self.engine.generate(request_id, prompt, sampling_params, priority=priority,
                                                 lora_request=lora_request):
            yield output

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams, request_id: str,
                     lora_request: LoRARequest | None = None, priority: int = 0,
                     tokenization_kwargs: dict[str, Any] | None = None
                     ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Pool one prompt (an embedding, or a classifier's probabilities: `pooling_params.task`); one output."""
        self._start()
        prompt = await self._tokenized(prompt, tokenization_kwargs)
        async for output in self.engine.generate(request_id, prompt, pooling_params, priority=priority,
                                                 lora_request=lora_request):
            yield PoolingRequestOutput.of(output)

    async def _tokenized(self, prompt: PromptType, tokenization_kwargs: dict[str, Any] | None) -> PromptInput:
        """The prompt as its tokenization_kwargs leave it (tokenized off the event loop, on the tokenizer's
        thread), or as given without them."""
        if not tokenization_kwargs:
            return prompt
        (parsed,) = await self.engine.run_on_tokenizer_thread(
            apply_tokenization_kwargs, [parse_prompt(prompt)], None, tokenization_kwargs, self.engine.tokenizer,
            self.engine.max_model_len)
        return parsed

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (ids already finished are skipped): each one's `generate` yields its last output,
        finish_reason "abort", and ends."""
        for one in [request_id] if isinstance(request_id, str) else request_id:
            self.engine.abort(one, tell=True)

    def shutdown(self) -> None:
        """Stop the engine thread (a request still waiting fails with EngineDeadError) and close the engine."""
        if self._started:
            self.engine.shutdown()
        else:
            self.engine.close()

    # ---- facts and health ---------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        if self.engine.tokenizer is None:
            raise ValueError("the engine has no tokenizer (skip_tokenizer_init=True)")
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self.engine.is_running

    @property
    def errored(self) -> bool:
        return self.engine.error is not None

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError(f"the engine has failed: {self.engine.error!r}")

    async def check_health(self) -> None:
        """EngineDeadError once the engine has failed."""
        if self.errored:
            raise self.dead_error

    def get_num_unfinished_requests(self) -> int:
        return self.engine.num_active_requests

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return await self._in_engine(lambda engine: engine.get_supported_tasks())

    # ---- vLLM's controls ----------------------------------------------------------------------------------------
    async def _control(self, call: Callable[[], Any]) -> Any:
        self._start()
        return await call()

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """LLMEngine.reset_prefix_cache between two steps."""
        del reset_connector     # (no external KV connector)
        return await self._control(lambda: self.engine.reset_prefix_cache(reset_running_requests))

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """LLM.sleep's levels and modes, for the requests in flight."""
        await self._control(lambda: self.engine.sleep(level, mode))

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return await self._control(lambda: self.engine.wake_up(tags))

    async def release_kv_cache_memory(self) -> None:
        await self._control(self.engine.release_kv_cache_memory)

    async def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's pause for a weight update (AsyncEngine.pause_generation)."""
        await self._control(lambda: self.engine.pause_generation(mode, clear_cache))

    async def resume_generation(self) -> None:
        await self.wake_up(["scheduling"])

    async def is_paused(self) -> bool:
        return self.engine.is_sleeping()

    async def start_profile(self, profile_prefix: str | None = None, *, delay_iterations: int | None = None,
                            max_iterations: int | None = None) -> None:
        await self._control(lambda: self.engine.start_profile(profile_prefix, delay_iterations, max_iterations))

    async def stop_profile(self) -> None:
        await self._control(self.engine.stop_profile)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """LLMEngine.add_lora between two steps."""
        return await self._in_engine(lambda engine: engine.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._in_engine(lambda engine: engine.remove_lora(lora_id))

    async def list_loras(self) -> set[int]:
        return await self._in_engine(lambda engine: engine.list_loras())

    async def _in_engine(self, call: Callable[[Any], Any]) -> Any:
        """`call(LLMEngine)` between two steps, on the engine (the first replica's: LoRA, which they would need
        alike, runs on one engine only, and they serve one model)."""
        engine = self.engine if isinstance(self.engine, AsyncEngine) else self.engine.replicas[0]
        return await self._control(lambda: engine.call_in_engine(call))

    async def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list:
        return await self._control(lambda: self.engine.collective_rpc(method, timeout, args, kwargs))


AsyncLLMEngine = AsyncLLM   # vLLM's older name for the same engine

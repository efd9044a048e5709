"""A real pagedllm server on a free loopback port, in a background thread of the test process.

The embedded model is loaded once per process (`shared_server()`), float32 so that greedy tokens do not depend on
the batch, with a small KV pool. Before the server takes the engine, `offline_reference` runs the concurrency
prompts through the offline `LLM.generate` on that same engine, so the suite loads the weights only once.
"""

from __future__ import annotations

import itertools
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import uvicorn

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.data_parallel import AsyncDataParallelEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.entrypoints.openai.server import CorsPolicy, build_app
from pagedllm.entrypoints.openai.serving_base import FrontendOptions, ServerLimits
from pagedllm.sampling_params import SamplingParams
from tests.models.tiny import save_tiny_model

API_KEY = "test-key"
MAX_BODY_BYTES = 256 * 1024
REFERENCE_MAX_TOKENS = 12
# 64 distinct prompts for the concurrency test.
_TOPICS = ["the sea", "a city at night", "mountains", "a robot", "coffee", "the moon", "winter", "a library"]
_FORMS = ["Write one sentence about", "Tell me a fact about", "Describe", "Say something kind about",
          "Give a title for a story about", "List two words about", "Explain to a child", "Name a color for"]
REFERENCE_PROMPTS = [f"{form} {topic}." for form, topic in itertools.product(_FORMS, _TOPICS)]


@dataclass
class RunningServer:
    base_url: str
    engine: AsyncEngine | AsyncDataParallelEngine
    server: uvicorn.Server
    thread: threading.Thread
    model_name: str
    reference: dict[str, tuple[str, list[int]]] = field(default_factory=dict)   # prompt -> offline greedy output

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, api_key: str = "EMPTY", timeout: float = 60) -> openai.OpenAI:
        """The openai SDK on this server, without retries (a test sees the first answer)."""
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=timeout)


def build_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(dtype="float32", max_model_len=2048),
        cache=CacheConfig(kv_cache_memory=64 << 20),
        scheduler=SchedulerConfig(max_num_seqs=128)))


def offline_reference(engine: LLMEngine, prompts: list[str], max_tokens: int) -> dict[str, tuple[str, list[int]]]:
    """Greedy (text, token ids) of each prompt from the offline LLM API, run on `engine`."""
    llm = LLM.from_engine(engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {p: (o.outputs[0].text, o.outputs[0].token_ids) for p, o in zip(prompts, outputs)}


TOOL_CONTEXT = 1024  # the byte tokenizer spends ~450 tokens on a tool's system message


def save_tool_model(folder: Path) -> Path:
    """A tiny Llama for the tool-calling APIs' tests (Responses, Messages): weights large enough that a forced call
    ends within a few tokens, and a context of TOOL_CONTEXT."""
    folder, _ = save_tiny_model(folder, "llama-gqa", initializer_range=0.5, max_position_embeddings=TOOL_CONTEXT)
    return folder


def tool_model_engine(folder: Path) -> LLMEngine:
    """An engine on `save_tool_model`'s folder, over its whole context."""
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(folder), dtype="float32", max_model_len=TOOL_CONTEXT),
                                  cache=CacheConfig(block_size=16, num_blocks=512)))


def start_server(engine, *, api_key: str | None = API_KEY, limits: ServerLimits | None = None,
                 served_model_names: list[str] | None = None, timeout: float = 60.0,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 cors: CorsPolicy | None = None, lora_modules: list | tuple = (),
                 options: FrontendOptions | None = None) -> RunningServer:
    """Serve an (LLM or fake) engine, or data-parallel replicas (an AsyncDataParallelEngine), on a free 127.0.0.1
    port; returns once /health answers. `tool_call_parser` turns on tool_choice "auto" with that parser."""
    async_engine = engine if isinstance(engine, (AsyncEngine, AsyncDataParallelEngine)) else AsyncEngine(engine)
    limits = limits or ServerLimits(max_request_body_bytes=MAX_BODY_BYTES)
    app = build_app(async_engine, served_model_names=served_model_names, api_key=api_key, limits=limits,
                    enable_auto_tool_choice=tool_call_parser is not None, tool_call_parser=tool_call_parser,
                    reasoning_parser=reasoning_parser, cors=cors, lora_modules=lora_modules, options=options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="test-uvicorn")
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    else:
        raise RuntimeError("the test server did not come up")
    return RunningServer(base_url, async_engine, server, thread, (served_model_names or [engine.model_name])[0])


_shared: RunningServer | None = None
_lock = threading.Lock()


def shared_server() -> RunningServer:
    """One server with the embedded model for the whole test process (tests/entrypoints and tests/metrics)."""
    global _shared
    with _lock:
        if _shared is None:
            engine = build_engine()
            reference = offline_reference(engine, REFERENCE_PROMPTS, REFERENCE_MAX_TOKENS)
            _shared = start_server(engine)
            _shared.reference = reference
        return _shared


def scrape(base_url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value}, labels as the server wrote them."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """The value of one series; `labels` need only be a subset (model_name is implied)."""
    total, found = 0.0, False
    for key, value in values.items():
        match = re.fullmatch(r"([^{]+)(?:\{(.*)\})?", key)
        if match is None or match.group(1) != name:
            continue
        series = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(series.get(k) == v for k, v in labels.items()):
            total, found = total + value, True
    if not found:
        raise KeyError(f"no series {name} {labels}")
    return total


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()

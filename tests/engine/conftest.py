"""Fixtures of the engine tests."""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest
import torch

from pagedllm.engine.llm_engine import LLMEngine


@pytest.fixture
def threads_seen(monkeypatch):
    """{engine: (the thread that built it, the set of threads that stepped it)}, for every LLMEngine made."""
    built: dict[int, str] = {}
    stepped: dict[int, set[str]] = defaultdict(set)
    init, step = LLMEngine.__init__, LLMEngine.step

    def recording_init(self, config):
        built[id(self)] = threading.current_thread().name
        init(self, config)

    def recording_step(self):
        stepped[id(self)].add(threading.current_thread().name)
        return step(self)

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    before = torch.get_num_threads()     # data parallelism divides the intra-op threads among the replicas
    yield lambda engine: (built[id(engine)], stepped[id(engine)])
    torch.set_num_threads(before)

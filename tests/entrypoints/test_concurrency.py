"""64 concurrent streaming clients: every response complete, and equal to the offline LLM.generate output."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.entrypoints.server_utils import API_KEY, REFERENCE_MAX_TOKENS, REFERENCE_PROMPTS, RunningServer

pytestmark = pytest.mark.slow


async def _stream_one(client: openai.AsyncOpenAI, model: str, prompt: str) -> tuple[str, str | None, int]:
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=REFERENCE_MAX_TOKENS,
                                             temperature=0, stream=True, stream_options={"include_usage": True})
    text, finish_reason, num_tokens = "", None, -1
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish_reason = chunk.choices[0].finish_reason or finish_reason
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
    return text, finish_reason, num_tokens


async def _run_all(server: RunningServer) -> list[tuple[str, str | None, int]]:
    async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0,
                                  timeout=120) as client:
        return await asyncio.gather(*(_stream_one(client, server.model_name, p) for p in REFERENCE_PROMPTS))


def test_64_concurrent_streams_match_offline_generate(server: RunningServer):
    assert len(REFERENCE_PROMPTS) == 64
    results = asyncio.run(_run_all(server))
    for prompt, (text, finish_reason, num_tokens) in zip(REFERENCE_PROMPTS, results):
        expected_text, expected_ids = server.reference[prompt]
        assert text == expected_text, prompt
        assert num_tokens == len(expected_ids), prompt
        assert finish_reason == ("length" if len(expected_ids) == REFERENCE_MAX_TOKENS else "stop"), prompt

"""The KV-cache dashboard: /v1/kv_cache behind the API key and in agreement with /metrics, /dashboard behind
`?key=`, and the page itself in a real headless Chromium: it loads, its grid counts equal /metrics, and it updates
while a workload runs."""

from __future__ import annotations

import base64
import concurrent.futures
import os
import shutil
import time

import httpx
import pytest
import torch

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedllm.engine.llm_engine import LLMEngine
from tests.entrypoints.server_utils import API_KEY, RunningServer, metric, scrape, start_server, wait_until
from tests.models.tiny import save_tiny_model

# A long shared prefix, so that the workload's requests share prefix-cache blocks.
_PREFIX = "You are a careful assistant. Answer in plain words, one short paragraph, no lists. "
SCREENSHOT_ENV = "PAGEDLLM_DASHBOARD_SCREENSHOT"    # a path: the browser test saves the page there mid-workload


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> RunningServer:
    """A tiny random Llama (byte tokenizer) behind the server: the dashboard shows blocks, not text. 160 blocks of
    4 tokens and a small swap pool, so that the workload (12 requests of ~230 tokens, ~58 blocks each, 24 of them
    a shared prefix) cannot all fit and preempts."""
    folder, _ = save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # a tiny model on a busy two-core box: a second thread only spins
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(folder), dtype="float32", max_model_len=256),
                                    cache=CacheConfig(block_size=4, num_blocks=161, swap_space=1e-4),
                                    scheduler=SchedulerConfig(max_num_seqs=16, preemption_mode="swap")))
    running = start_server(engine)
    yield running
    running.stop()
    torch.set_num_threads(threads)


def _idle_metrics(url: str) -> dict[str, float]:
    assert wait_until(lambda: metric(scrape(url), "pagedllm:num_requests_running") == 0)
    return scrape(url)


def _complete(url: str, topic: str, max_tokens: int = 120) -> None:
    response = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                          json={"prompt": f"{_PREFIX}Tell me about {topic}.", "max_tokens": max_tokens,
                                "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text


def test_kv_cache_needs_the_key_and_agrees_with_metrics(server: RunningServer):
    url = server.base_url
    assert httpx.get(f"{url}/v1/kv_cache", timeout=10).status_code == 401
    _complete(url, "the sea", max_tokens=4)        # leaves cached blocks behind
    values = _idle_metrics(url)
    body = httpx.get(f"{url}/v1/kv_cache", headers=server.headers, timeout=10).json()
    states = base64.b64decode(body["blocks"])
    names = body["state_names"]
    counts = {name: states[1:].count(names.index(name)) for name in ("free", "cached", "used", "shared")}
    stats = body["stats"]
    assert states[0] == names.index("null") and len(states) - 1 == stats["num_blocks_total"]
    assert counts["cached"] > 0 and counts["used"] == counts["shared"] == 0 and body["requests"] == []
    assert counts["free"] + counts["cached"] == stats["num_blocks_free"] == metric(values, "pagedllm:num_blocks_free")
    assert stats["num_blocks_total"] == metric(values, "pagedllm:num_blocks_total")
    assert stats["prefix_cache_hits"] == metric(values, "pagedllm:prefix_cache_hits_total")
    assert body["block_size"] == server.engine.engine.config.cache.block_size


def test_the_page_needs_the_key(server: RunningServer):
    url = server.base_url
    assert httpx.get(f"{url}/dashboard", timeout=10).status_code == 401
    refused = httpx.get(f"{url}/dashboard", params={"key": "wrong"}, timeout=10)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    page = httpx.get(f"{url}/dashboard", params={"key": API_KEY}, timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/kv_cache" in page.text and "<canvas" in page.text and "http" not in page.text.split("<script>")[1]


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no Chromium on this machine, and none could be installed (make test installs Debian's "
                    "chromium package where apt-get is available)")
    return path


def _page_counts(page) -> dict[str, int]:
    return {name: int(page.inner_text(f"#count-{name}")) for name in ("free", "cached", "used", "shared")}


def test_the_page_in_a_headless_browser(server: RunningServer, monkeypatch):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (a dev dependency) is not installed")
    url = server.base_url
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 1100})
            page.goto(f"{url}/dashboard?key={API_KEY}")
            assert "key=" not in page.url                  # dropped from the address bar
            _check_counts_equal_metrics(page, url)
            _slow_steps(monkeypatch, server, 0.02)
            _check_updates_under_load(page, url)
            _check_counts_equal_metrics(page, url)
        finally:
            browser.close()


def _slow_steps(monkeypatch, server: RunningServer, seconds: float) -> None:
    """Make each engine step take `seconds` longer: on a fast CPU the tiny model can run the whole load between two
    of the page's polls (500 ms apart), and the page would never see a request running."""
    engine = server.engine.engine
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)


def _check_counts_equal_metrics(page, url: str) -> None:
    values = _idle_metrics(url)
    updates = int(page.evaluate("document.body.dataset.updates || 0"))
    page.wait_for_function(f"Number(document.body.dataset.updates) > {updates}", timeout=10_000)
    counts = _page_counts(page)
    free, total = metric(values, "pagedllm:num_blocks_free"), metric(values, "pagedllm:num_blocks_total")
    assert counts["free"] + counts["cached"] == free and sum(counts.values()) == total
    assert counts["used"] + counts["shared"] == total - free
    assert page.inner_text("#fig-free") == f"{int(free)} / {int(total)}"


def _check_updates_under_load(page, url: str) -> None:
    topics = ["the sea", "a city at night", "mountains", "a robot", "coffee", "the moon", "winter", "a library",
              "rain", "a garden", "the wind", "a bridge"]
    with concurrent.futures.ThreadPoolExecutor(len(topics)) as pool:
        running = [pool.submit(_complete, url, topic) for topic in topics]
        page.wait_for_function("Number(document.body.dataset.running) > 0", timeout=60_000)
        busy = _page_counts(page)
        assert busy["used"] + busy["shared"] > 0
        # A poll may list only a request whose prompt blocks are all prefix-cache hits ("the sea" ran before) or
        # one that waits or is swapped out, none of them with a computed prompt block: wait for a poll that does.
        page.wait_for_function("document.querySelectorAll('#requests .prompt').length > 0", timeout=60_000)
        if os.environ.get(SCREENSHOT_ENV):
            page.wait_for_function("document.getElementById('fig-preemptions').textContent !== '0 / 0'",
                                   timeout=60_000)
            page.screenshot(path=os.environ[SCREENSHOT_ENV], full_page=True)
        for future in running:
            future.result(timeout=120)
    page.wait_for_function("Number(document.body.dataset.running) === 0", timeout=30_000)
    # The pool was too small for all twelve: preemptions, as /metrics counts them; whatever went out came back in.
    values = _idle_metrics(url)
    preemptions = [int(metric(values, "pagedllm:num_preemptions_total", mode=mode)) for mode in ("recompute", "swap")]
    wait_until(lambda: page.inner_text("#fig-preemptions") == " / ".join(map(str, preemptions)), timeout=10)
    assert page.inner_text("#fig-preemptions") == " / ".join(map(str, preemptions)) and sum(preemptions) > 0
    swapped_out, swapped_in = map(int, page.inner_text("#fig-swap").split(" / "))
    assert swapped_in == swapped_out and (swapped_out > 0) == (preemptions[1] > 0)

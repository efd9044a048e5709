"""`pagedllm bench dashboard`: the engine's step time with the /dashboard page open in headless Chromium, against
closed, on the same workload.

A server runs in this process; after one untimed warm-up phase, each phase sends the same `--num-prompts`
completions at once, with the page open or not, and the phases alternate (`--rounds` pairs) so that drift on a
shared machine hits both alike. The step
time is the time between two consecutive steps while requests are unfinished: it includes everything the engine
thread does between steps, the dashboard's snapshot too. Needs Playwright (a dev dependency) and a Chromium.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import shutil
import socket
import statistics
import threading
import time
from typing import Any

from pagedllm.bench.args import add_engine_args, engine_kwargs
from pagedllm.metrics.stats import IterationStats, SchedulerStats

_MODES = ("closed", "open")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", type=int, default=16, help="completions sent at once in each phase")
    group.add_argument("--output-len", type=int, default=64)
    group.add_argument("--rounds", type=int, default=2, help="closed/open pairs of phases")
    group.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"),
                        help="the Chromium executable (Playwright drives it)")
    parser.set_defaults(func=main)


class _StepClock:
    """A stat logger: the gaps between consecutive steps taken while requests were unfinished."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._last: float | None = None

    def __call__(self, stats: SchedulerStats, _: IterationStats) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.gaps.append(now - self._last)
        busy = stats.num_running + stats.num_waiting + stats.num_swapped > 0
        self._last = now if busy else None


def main(args: argparse.Namespace) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    from pagedllm.engine.async_engine import AsyncEngine
    from pagedllm.engine.engine_thread import EngineThread
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.entrypoints.openai.server import build_app

    if args.chromium is None:
        raise SystemExit("no Chromium found: install Debian's chromium package or pass --chromium")
    thread = EngineThread()     # the model loads on the thread that steps it (engine_thread.py)
    engine = AsyncEngine(thread.call(lambda: LLM(**engine_kwargs(args)).engine), thread=thread)
    clock = _StepClock()
    engine.add_stat_logger(clock)
    url, stop = _serve(build_app(engine))
    gaps: dict[str, list[float]] = {mode: [] for mode in _MODES}
    phase_medians: dict[str, list[float]] = {mode: [] for mode in _MODES}
    try:
        _run_workload(url, args.num_prompts, args.output_len)      # warm-up: first-call costs, page faults
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            for _ in range(args.rounds):
                for mode in _MODES:
                    page = browser.new_page() if mode == "open" else None
                    if page is not None:
                        page.goto(f"{url}/dashboard")
                        page.wait_for_function("Number(document.body.dataset.updates) > 0")
                    clock.gaps.clear()
                    _run_workload(url, args.num_prompts, args.output_len)
                    gaps[mode] += clock.gaps
                    phase_medians[mode].append(1e3 * statistics.median(clock.gaps))
                    if page is not None:
                        page.close()
            browser.close()
    finally:
        stop()
    result = {mode: _summary(values) | {"phase_medians_ms": phase_medians[mode]} for mode, values in gaps.items()}
    result["overhead_perc"] = 100 * (result["open"]["median_ms"] / result["closed"]["median_ms"] - 1)
    print_report(result)
    return result


def _serve(app) -> tuple[str, Any]:
    """Run `app` with uvicorn on a free loopback port in a thread; returns its URL and a stop function."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(30)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


def _run_workload(url: str, num_prompts: int, output_len: int) -> None:
    import httpx  # here, not at the top: every `pagedllm` command builds this parser, and httpx takes ~0.2 s

    def one(index: int) -> None:
        body = {"prompt": f"Story number {index}: once upon a time", "max_tokens": output_len, "temperature": 0,
                "ignore_eos": True}
        httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()
    with concurrent.futures.ThreadPoolExecutor(num_prompts) as pool:
        list(pool.map(one, range(num_prompts)))


def _summary(gaps: list[float]) -> dict[str, float]:
    return {"steps": len(gaps), "mean_ms": 1e3 * statistics.fmean(gaps), "median_ms": 1e3 * statistics.median(gaps)}


def print_report(result: dict[str, Any]) -> None:
    for mode in _MODES:
        figures = result[mode]
        phases = ", ".join(f"{median:.1f}" for median in figures["phase_medians_ms"])
        print(f"page {mode:6}: {figures['steps']:5d} steps, mean {figures['mean_ms']:.2f} ms, "
              f"median {figures['median_ms']:.2f} ms (phase medians: {phases} ms)")
    print(f"median step time with the page open: {result['overhead_perc']:+.1f} %")

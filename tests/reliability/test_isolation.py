"""Tenant isolation with cache_salt: two tenants sending the same prompt never share a cached block, while
requests of one tenant (or with no salt) do. It shows in the block tables, in the cached-token counts and in the
metrics; a block-table audit before every step proves that no request reads a block it does not hold. Prompts
stay out of the server log unless request logging is turned on."""

from __future__ import annotations

import logging

import httpx
import pytest

from pagedllm.core.sched.output import ScheduledRequest, SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from tests.entrypoints.server_utils import metric, scrape, start_server
from tests.reliability.tiny_server import audit_block_tables, build_tiny_engine, install_block_audit, prompt_traces

SHARED_PROMPT = "The quarterly numbers of tenant A, confidential: 1234 5678 9012 3456 7890 and more."  # 5+ blocks
SECRET = "zq-secret-77e1"


def _run_to_end(engine) -> int:
    """Step until nothing is left; returns the number of steps."""
    num_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    return num_steps


def test_salted_tenants_never_share_blocks_unsalted_requests_do(tiny_model_dir):
    engine = build_tiny_engine(tiny_model_dir, num_blocks=64)
    audited = install_block_audit(engine)
    manager, params = engine.kv_cache_manager, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    num_full_blocks = len(engine.tokenizer.encode(SHARED_PROMPT)) // 16
    assert num_full_blocks >= 4
    engine.add_request("a1", SHARED_PROMPT, params, cache_salt="tenant-a")
    engine.add_request("u1", SHARED_PROMPT, params)
    engine.step()
    first = {r: manager.get_block_ids(r)[:num_full_blocks] for r in ("a1", "u1")}
    assert not set(first["a1"]) & set(first["u1"])           # a salt and no salt: nothing shared, even at once
    num_steps = 1 + _run_to_end(engine)
    hits = manager.prefix_cache_stats.num_hit_tokens

    # The same prompt again: tenant A, tenant B, and two unsalted requests, all running together.
    for request_id, salt in (("a2", "tenant-a"), ("b1", "tenant-b"), ("u2", None), ("u3", None)):
        engine.add_request(request_id, SHARED_PROMPT, params, cache_salt=salt)
    engine.step()
    cached = {r: engine.scheduler.requests[r].num_cached_tokens for r in ("a2", "b1", "u2", "u3")}
    assert cached == {"a2": num_full_blocks * 16, "b1": 0, "u2": num_full_blocks * 16, "u3": num_full_blocks * 16}
    blocks = {r: manager.get_block_ids(r) for r in ("a2", "b1", "u2", "u3")}
    assert blocks["a2"][:num_full_blocks] == first["a1"]                              # tenant A's own blocks
    assert blocks["u2"][:num_full_blocks] == blocks["u3"][:num_full_blocks] == first["u1"]  # shared, unsalted
    assert not set(blocks["b1"]) & (set(blocks["a2"]) | set(blocks["u2"]) | set(blocks["u3"]))
    assert not set(blocks["a2"]) & set(blocks["u2"])
    assert manager.prefix_cache_stats.num_hit_tokens == hits + 3 * num_full_blocks * 16
    num_steps += 1 + _run_to_end(engine)
    assert len(audited) == num_steps                # every step was audited
    assert max(audited) >= num_full_blocks          # the audit saw u2 and u3 share their prompt blocks


def test_the_audit_catches_a_table_naming_a_block_not_held(tiny_model_dir):
    engine = build_tiny_engine(tiny_model_dir, num_blocks=16)
    engine.add_request("r", SHARED_PROMPT, SamplingParams(max_tokens=2))
    engine.step()
    table = engine.kv_cache_manager.get_block_ids("r")
    free_block = next(b for b in range(1, 16) if b not in table)
    request = engine.scheduler.requests["r"]
    output = SchedulerOutput(scheduled=[ScheduledRequest("r", [*table, free_block], request.num_computed_tokens,
                                                         [request.all_token_ids[-1]], True)])
    with pytest.raises(AssertionError):
        audit_block_tables(engine, output)
    output.scheduled[0].block_ids = table
    assert audit_block_tables(engine, output) == 0


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    running = start_server(build_tiny_engine(tiny_model_dir, num_blocks=64), api_key=None)
    yield running
    running.stop()


def _hits(server) -> float:
    return metric(scrape(server.base_url), "pagedllm:prefix_cache_hits_total")


def _complete(server, prompt: str, salt: str | None, max_tokens: int = 8) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_the_metrics_show_no_hit_across_tenants(server):
    _complete(server, SHARED_PROMPT, "tenant-a")
    before = _hits(server)
    text_b = _complete(server, SHARED_PROMPT, "tenant-b")
    assert _hits(server) == before                      # tenant B found nothing of tenant A's
    text_a = _complete(server, SHARED_PROMPT, "tenant-a")
    assert _hits(server) > before                       # tenant A finds its own blocks
    assert text_a == text_b                             # and the salt changes nothing in the output


def test_prompts_reach_the_log_only_with_request_logging(server, caplog):
    engine_log = logging.getLogger("pagedllm")      # it does not propagate to the root logger caplog watches
    engine_log.addHandler(caplog.handler)
    try:
        _complete(server, f"{SECRET} quiet", None, 2)
        server.engine.log_requests = True           # --enable-log-requests
        _complete(server, f"{SECRET} logged", None, 2)
    finally:
        server.engine.log_requests = False
        engine_log.removeHandler(caplog.handler)
    logged, quiet = (prompt_traces(server.engine.tokenizer, f"{SECRET} {word}") for word in ("logged", "quiet"))
    assert any(trace in caplog.text for trace in logged)        # the check below can see a logged prompt...
    assert not any(trace in caplog.text for trace in quiet)     # ...and by default none is logged

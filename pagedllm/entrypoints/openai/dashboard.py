"""The live KV-cache dashboard: GET /dashboard (one static page, shipped in static/dashboard.html, no build step
and nothing from the internet) and GET /v1/kv_cache (its data, polled by the page).

The API key: /v1/kv_cache is under it as every /v1 route (RequestGate). The page itself is served only with
`?key=<api key>`; the page drops the key from the address bar and sends it as `Authorization: Bearer` to
/v1/kv_cache. With no API key configured, both are open.

/v1/kv_cache asks the engine thread for a snapshot (`AsyncEngine.kv_cache_snapshot`), so the engine does the
work only while a page (or another client) polls. Block states go as base64, one byte per block
(`BlockState`); the page draws them on a canvas and works out each block's owners from the request tables.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from pagedllm.core.kv_cache.block_map import BlockState, RequestBlocks
from pagedllm.engine.async_engine import AsyncEngine, KVCacheSnapshot
from pagedllm.entrypoints.openai.protocol import OpenAIError

DASHBOARD_HTML = Path(__file__).parent / "static" / "dashboard.html"


def dashboard_router(engine: AsyncEngine, api_keys: Sequence[str]) -> APIRouter:
    """/dashboard and /v1/kv_cache for `engine`; `api_keys` the server's (none: no key asked for)."""
    router = APIRouter()
    page = DASHBOARD_HTML.read_text(encoding="utf-8")

    @router.get("/dashboard")
    async def dashboard(key: str = "") -> HTMLResponse:
        if api_keys and not any(secrets.compare_digest(key.encode(), api_key.encode()) for api_key in api_keys):
            raise OpenAIError("Incorrect or missing API key: open /dashboard?key=<key>.", 401, code="invalid_api_key")
        # no-referrer: the key in this page's address must not leak to anything it links to.
        return HTMLResponse(page, headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})

    @router.get("/v1/kv_cache")
    async def kv_cache() -> dict[str, Any]:
        return snapshot_json(await engine.kv_cache_snapshot())

    return router


def snapshot_json(snapshot: KVCacheSnapshot) -> dict[str, Any]:
    """The /v1/kv_cache body: block states (base64, one byte each), request tables and the step's figures."""
    stats, block_map = snapshot.stats, snapshot.block_map
    return {
        "object": "kv_cache",
        "time": snapshot.time,
        "block_size": block_map.block_size,
        "state_names": [state.name.lower() for state in BlockState],
        "blocks": base64.b64encode(block_map.states).decode(),
        "swap_blocks": base64.b64encode(block_map.swap_states).decode(),
        "requests": [_request_json(table) for table in block_map.requests],
        "stats": {
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "num_requests_swapped": stats.num_swapped,
            "num_blocks_total": stats.num_blocks_total,
            "num_blocks_free": stats.num_blocks_free,
            "kv_cache_usage_perc": stats.kv_cache_usage,
            "kv_waste_perc": stats.kv_waste,
            "prefix_cache_queries": stats.prefix_cache_queries_total,
            "prefix_cache_hits": stats.prefix_cache_hits_total,
            "num_preemptions": dict(stats.num_preemptions_total),
            "num_blocks_swapped_out": block_map.num_blocks_swapped_out,
            "num_blocks_swapped_in": block_map.num_blocks_swapped_in,
        },
    }


def _request_json(table: RequestBlocks) -> dict[str, Any]:
    return {"id": table.request_id, "status": table.status.lower(), "num_prompt_tokens": table.num_prompt_tokens,
            "num_tokens": table.num_tokens, "num_computed_tokens": table.num_computed_tokens,
            "num_cached_tokens": table.num_cached_tokens, "block_ids": list(table.block_ids),
            "swap_block_ids": list(table.swap_block_ids)}

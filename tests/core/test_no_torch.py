"""The bookkeeping core must import, and work, with torch unimportable."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CORE_MODULES = ["pagedllm.core.request", "pagedllm.core.kv_cache.block", "pagedllm.core.kv_cache.hashing",
                "pagedllm.core.kv_cache.block_pool", "pagedllm.core.kv_cache.manager",
                "pagedllm.core.sched.output", "pagedllm.core.sched.scheduler"]
PACKAGE_DIR = str(Path(__file__).resolve().parents[2] / "pagedllm")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60)


def test_core_modules_need_no_torch() -> None:
    """Each core module imports with torch blocked (the top-level package __init__ is bypassed, so this test
    is about pagedllm/core itself), and a scheduler step runs."""
    result = _run(f"""
        import sys, types, importlib
        sys.modules["torch"] = None
        package = types.ModuleType("pagedllm")
        package.__path__ = [{PACKAGE_DIR!r}]
        sys.modules["pagedllm"] = package
        for name in {CORE_MODULES!r}:
            importlib.import_module(name)
        from pagedllm.config import SchedulerConfig
        from pagedllm.core.kv_cache.manager import KVCacheManager
        from pagedllm.core.request import Request
        from pagedllm.core.sched.scheduler import Scheduler
        from pagedllm.sampling_params import SamplingParams
        scheduler = Scheduler(SchedulerConfig(), KVCacheManager(8, 4))
        scheduler.add_request(Request("r", [1, 2, 3], SamplingParams()))
        assert scheduler.schedule().num_batched_tokens == 3
        assert not [m for m, mod in sys.modules.items() if m.startswith("torch") and mod is not None]
    """)
    assert result.returncode == 0, result.stderr


@pytest.mark.xfail(strict=True, reason="pagedllm/__init__.py imports LLM (and torch) eagerly; it should import "
                                      "it lazily (module __getattr__) so that `import pagedllm.core` needs no torch")
def test_import_pagedllm_core_without_torch() -> None:
    result = _run(f"""
        import sys, importlib
        sys.modules["torch"] = None
        for name in {CORE_MODULES!r}:
            importlib.import_module(name)
    """)
    assert result.returncode == 0, result.stderr

"""The bookkeeping core must import, and work, with torch unimportable."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CORE_MODULES = ["pagedllm.core.request", "pagedllm.core.kv_cache.block", "pagedllm.core.kv_cache.hashing",
                "pagedllm.core.kv_cache.block_pool", "pagedllm.core.kv_cache.manager",
                "pagedllm.core.kv_cache.residency", "pagedllm.core.sched.output", "pagedllm.core.sched.scheduler"]


def test_import_pagedllm_core_without_torch() -> None:
    code = f"""
        import sys, importlib
        sys.modules["torch"] = None
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
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr

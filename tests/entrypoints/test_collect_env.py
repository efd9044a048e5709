"""`pagedllm collect-env`: the report a bug needs, through the real command: versions, the CPU as pagedllm reads it,
the kernels, the embedded model, and the environment variables that matter, a secret's value never printed."""

from __future__ import annotations

import subprocess
import sys

from pagedllm import __version__
from pagedllm.cpu import cpu_info


def test_the_report_names_what_a_bug_needs_and_hides_secrets() -> None:
    env = {"PATH": "/usr/bin:/bin", "PAGEDLLM_API_KEY": "do-not-print-me", "OMP_NUM_THREADS": "1",
           "PAGEDLLM_MAX_CPU_ISA": "baseline", "UNRELATED": "x", "HOME": "/root"}
    done = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "collect-env"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    report = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert report["pagedllm"] == __version__ and report["python"] == sys.version.split()[0]
    assert report["torch"] and report["transformers"] != "not installed"
    capped = cpu_info("baseline")        # on x86, the baseline level's features (a cap changes nothing elsewhere)
    assert report["cpu"] == capped.describe() and report["kernel level"].startswith(capped.isa_level)
    assert report["kernels"].startswith("loaded")
    assert report["default model"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert report["OMP_NUM_THREADS"] == "1" and report["PAGEDLLM_API_KEY"] == "(set)"
    assert "do-not-print-me" not in done.stdout + done.stderr and "UNRELATED" not in report

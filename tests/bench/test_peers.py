"""A peer's child process takes the processes it started with it: when it exits, and when the benchmark that ran
it is stopped."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from pagedllm.bench.peers import run_in_own_group

# Starts a grandchild that would spin on forever (as vLLM's EngineCore can), writes its pid, then exits or sleeps.
_LEAVES_A_PROCESS = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(grandchild.pid))
if sys.argv[2] == "sleep":
    time.sleep(600)
sys.exit(int(sys.argv[2]) if sys.argv[2] != "sleep" else 0)
"""


def _is_running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie that no one has reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _gone_within(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while _is_running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _read_pid(path: Path, seconds: float = 30.0) -> int:
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"no pid written to {path}"
        time.sleep(0.05)
    return int(path.read_text())


def test_what_a_peer_leaves_running_goes_when_it_exits(tmp_path):
    script, pid_file = tmp_path / "peer.py", tmp_path / "grandchild.pid"
    script.write_text(_LEAVES_A_PROCESS)
    assert run_in_own_group([sys.executable, str(script), str(pid_file), "3"]) == 3
    assert _gone_within(_read_pid(pid_file))


def test_stopping_the_benchmark_stops_the_peer_and_what_it_started(tmp_path):
    script, pid_file = tmp_path / "peer.py", tmp_path / "grandchild.pid"
    script.write_text(_LEAVES_A_PROCESS)
    bench = subprocess.Popen([sys.executable, "-c", "import sys; from pagedllm.bench.peers import run_in_own_group; "
                              f"run_in_own_group([sys.executable, {str(script)!r}, {str(pid_file)!r}, 'sleep'])"])
    grandchild = _read_pid(pid_file)
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=30) == 128 + signal.SIGTERM
    assert _gone_within(grandchild)

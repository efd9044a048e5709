"""`pagedllm simulate` from the command line: the table, --json, --plot, and clear errors before any run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import main
from pagedllm.memory.traces import TraceRequest, save_trace


@pytest.fixture
def trace_csv(tmp_path: Path) -> str:
    path = tmp_path / "two.csv"
    save_trace([TraceRequest(0.0, 3, 2), TraceRequest(0.0, 3, 2)], path)
    return str(path)


SMALL = ["--kv-tokens", "32", "--max-model-len", "16"]


def test_simulate_prints_json_for_scripts(trace_csv: str, capsys: pytest.CaptureFixture[str]) -> None:
    main(["simulate", "--trace", trace_csv, "--policy", "oracle", "--policy", "paged-1", *SMALL, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in report[trace_csv]] == ["oracle", "paged-1"]
    assert [r["token_state_pct"] for r in report[trace_csv]] == [60.0, 100.0]


def test_simulate_prints_a_table_and_writes_a_png(trace_csv: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "waste.png"
    main(["simulate", "--trace", trace_csv, "--policy", "max", *SMALL, "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "KV budget: 32 token slots" in out and "max" in out and "18.8%" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["--policy", "oracle", "--policy", "paged-0"], "unknown policy 'paged-0'"),
    (["--kv-tokens", "8"], "at least one request of max_model_len"),
    (["--step-seconds", "0"], "step_seconds must be > 0"),
])
def test_simulate_bad_input_is_a_clear_error(trace_csv: str, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["simulate", "--trace", trace_csv, *SMALL, *argv])


def test_simulate_of_a_missing_trace_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="No such file"):
        main(["simulate", "--trace", str(tmp_path / "missing.csv")])

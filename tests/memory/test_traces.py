"""The shipped traces: regenerated bit for bit from their seed, with the paper's mean lengths; CSV validation."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from pagedllm.memory.traces import (
    TRACE_MAX_MODEL_LEN,
    TRACE_MODELS,
    TraceRequest,
    generate_trace,
    load_trace,
    save_trace,
)


@pytest.mark.parametrize("name", list(TRACE_MODELS))
def test_the_shipped_trace_is_what_the_generator_makes(name: str) -> None:
    assert load_trace(name) == generate_trace(name)
    assert generate_trace(name, 50, seed=1) == generate_trace(name, 50, seed=1) != generate_trace(name, 50, seed=2)


@pytest.mark.parametrize("name", list(TRACE_MODELS))
def test_lengths_and_arrivals_follow_the_published_means(name: str) -> None:
    model, trace = TRACE_MODELS[name], generate_trace(name, 3000)
    assert statistics.mean(r.prompt_len for r in trace) == pytest.approx(model.prompt_mean, rel=0.1)
    assert statistics.mean(r.output_len for r in trace) == pytest.approx(model.output_mean, rel=0.1)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 and r.prompt_len + r.output_len <= TRACE_MAX_MODEL_LEN
               for r in trace)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(trace, trace[1:])]
    assert trace[0].arrival_s == 0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(1 / model.rate, rel=0.1)


def test_a_saved_trace_loads_back(tmp_path: Path) -> None:
    trace = [TraceRequest(0.0, 5, 7), TraceRequest(0.25, 1, 1)]
    save_trace(trace, tmp_path / "t.csv")
    assert load_trace(str(tmp_path / "t.csv")) == trace


@pytest.mark.parametrize(("text", "message"), [
    ("arrival,prompt,output\n0,1,1\n", "the header must be"),
    ("arrival_s,prompt_len,output_len\n", "no requests"),
    ("arrival_s,prompt_len,output_len\n0,1,1\n0,x,1\n", "line 3: expected a number and two integers"),
    ("arrival_s,prompt_len,output_len\n0,0,1\n", "line 2: lengths must be >= 1"),
    ("arrival_s,prompt_len,output_len\nnan,1,1\n", "line 2: lengths must be >= 1 and the arrival"),
    ("arrival_s,prompt_len,output_len\n1,1,1\n0,1,1\n", "must not decrease"),
])
def test_a_malformed_trace_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        load_trace(str(path))

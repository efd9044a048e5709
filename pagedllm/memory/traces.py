"""Request traces for the simulator: (arrival time, prompt length, output length), generated, never downloaded.

The two shipped traces draw lengths from log-normal distributions whose means are the PagedAttention paper's
(Kwon et al., SOSP 2023, Fig. 11 and section 6.1):

    trace      prompt mean  output mean   log-normal sigma (prompt, output)   rate
    sharegpt   161.31       337.99        (1.0, 0.8)                          8 requests/s
    alpaca     19.31        58.45         (0.5, 0.9)                          400 requests/s

The means are published; the spreads (sigma) are ours, read off the shape of Fig. 11's histograms (ShareGPT's
long-tailed prompts, Alpaca's short, narrow instructions), since the paper gives no variance. A pair whose
total exceeds `max_model_len` (2048, OPT's context) is drawn again, as the paper's filtering drops such
conversations. Arrivals are a Poisson process (exponential gaps) at `rate`, chosen to keep every policy
memory-bound. Everything comes from one `random.Random(seed)`, so a trace is the same on every machine.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class LengthModel:
    """Log-normal prompt and output lengths with the given means, and the Poisson arrival rate."""

    prompt_mean: float
    prompt_sigma: float
    output_mean: float
    output_sigma: float
    rate: float


TRACE_MODELS = {
    "sharegpt": LengthModel(161.31, 1.0, 337.99, 0.8, rate=8.0),
    "alpaca": LengthModel(19.31, 0.5, 58.45, 0.9, rate=400.0),
}
TRACE_MAX_MODEL_LEN = 2048
TRACE_NUM_REQUESTS = 200
_FIELDS = ("arrival_s", "prompt_len", "output_len")


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    """A log-normal draw with the given mean (mu = ln(mean) - sigma^2 / 2), rounded, at least 1."""
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def generate_trace(name: str, num_requests: int = TRACE_NUM_REQUESTS, seed: int = 0,
                   max_model_len: int = TRACE_MAX_MODEL_LEN) -> list[TraceRequest]:
    """`num_requests` requests of the named length model (see the module docstring), arriving from time 0."""
    model = TRACE_MODELS[name]
    rng = random.Random(seed)
    trace: list[TraceRequest] = []
    arrival_s = 0.0
    while len(trace) < num_requests:
        prompt_len = _lognormal(rng, model.prompt_mean, model.prompt_sigma)
        output_len = _lognormal(rng, model.output_mean, model.output_sigma)
        if prompt_len + output_len > max_model_len:
            continue
        trace.append(TraceRequest(round(arrival_s, 4), prompt_len, output_len))
        arrival_s += rng.expovariate(model.rate)
    return trace


def shipped_trace_path(name: str) -> Path:
    return Path(str(resources.files("pagedllm.memory") / "traces" / f"{name}.csv"))


def load_trace(name_or_path: str) -> list[TraceRequest]:
    """A shipped trace by name ("sharegpt", "alpaca") or a CSV file with columns arrival_s,prompt_len,output_len.

    Raises ValueError naming the line of a malformed row: lengths must be positive integers and arrivals
    non-decreasing numbers.
    """
    path = shipped_trace_path(name_or_path) if name_or_path in TRACE_MODELS else Path(name_or_path)
    with open(path, newline="", encoding="utf-8") as file:
        reader = csv.DictReader(file)
        if reader.fieldnames is None or tuple(reader.fieldnames) != _FIELDS:
            raise ValueError(f"{path}: the header must be {','.join(_FIELDS)}")
        trace = [_parse_row(row, line) for line, row in enumerate(reader, start=2)]
    if not trace:
        raise ValueError(f"{path}: the trace has no requests")
    if any(b.arrival_s < a.arrival_s for a, b in zip(trace, trace[1:])):
        raise ValueError(f"{path}: arrival times must not decrease")
    return trace


def _parse_row(row: dict[str, str], line: int) -> TraceRequest:
    try:
        request = TraceRequest(float(row["arrival_s"]), int(row["prompt_len"]), int(row["output_len"]))
    except (TypeError, ValueError):
        raise ValueError(f"line {line}: expected a number and two integers, got {row}") from None
    if request.prompt_len < 1 or request.output_len < 1 or not math.isfinite(request.arrival_s) \
            or request.arrival_s < 0:
        raise ValueError(f"line {line}: lengths must be >= 1 and the arrival a time >= 0, got {row}")
    return request


def save_trace(trace: list[TraceRequest], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file, lineterminator="\n")
        writer.writerow(_FIELDS)
        writer.writerows((r.arrival_s, r.prompt_len, r.output_len) for r in trace)


if __name__ == "__main__":   # regenerate the shipped traces: python -m pagedllm.memory.traces
    for trace_name in TRACE_MODELS:
        save_trace(generate_trace(trace_name), shipped_trace_path(trace_name))

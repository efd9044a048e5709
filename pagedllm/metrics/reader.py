"""`LLM.get_metrics()`'s records, as vLLM's (vllm.v1.metrics.reader): a snapshot of a registry's pagedllm metrics
as plain values, without scraping text.

    for metric in llm.get_metrics():
        if isinstance(metric, Histogram):
            print(metric.name, metric.labels, metric.count, metric.sum, metric.buckets)  # buckets: {"le": count}
        elif isinstance(metric, Vector):
            print(metric.name, metric.labels, metric.values)
        else:
            print(metric.name, metric.labels, metric.value)          # Counter, Gauge

A Vector is the one family that Prometheus keeps as counters labelled by position: the draft tokens accepted at
each speculative position, `values[i]` for position i.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client import Metric as PrometheusFamily

from pagedllm.metrics.prometheus import PREFIX

PER_POSITION = PREFIX + "spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]   # upper bound ("0.5", ..., "+Inf") -> observations at or below it


def metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every pagedllm metric in `registry` now, one record per series (label set)."""
    collected: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(PREFIX):
            continue
        if family.type == "gauge":
            collected += [Gauge(family.name, s.labels, s.value) for s in _samples(family, "")]
        elif family.type == "counter" and family.name == PER_POSITION:
            collected += _vectors(family)
        elif family.type == "counter":
            collected += [Counter(family.name, s.labels, int(s.value)) for s in _samples(family, "_total")]
        elif family.type == "histogram":
            collected += _histograms(family)
        else:
            raise AssertionError(f"{family.name}: a {family.type} metric has no record here")
    return collected


def _samples(family: PrometheusFamily, suffix: str) -> list:
    return [s for s in family.samples if s.name == family.name + suffix]


def _series(labels: dict[str, str], without: str) -> tuple[tuple[str, str], ...]:
    """A series' labels as a key, less the one that splits it into samples (a histogram's "le", a position)."""
    return tuple(sorted((k, v) for k, v in labels.items() if k != without))


def _vectors(family: PrometheusFamily) -> list[Metric]:
    by_series: dict[tuple, dict[int, int]] = defaultdict(dict)
    for s in _samples(family, "_total"):
        by_series[_series(s.labels, "position")][int(s.labels["position"])] = int(s.value)
    return [Vector(family.name, dict(key), [counts.get(i, 0) for i in range(max(counts) + 1)])
            for key, counts in by_series.items()]


def _histograms(family: PrometheusFamily) -> list[Metric]:
    buckets: dict[tuple, dict[str, int]] = defaultdict(dict)
    for s in _samples(family, "_bucket"):
        buckets[_series(s.labels, "le")][s.labels["le"]] = int(s.value)
    counts = {_series(s.labels, "le"): int(s.value) for s in _samples(family, "_count")}
    sums = {_series(s.labels, "le"): s.value for s in _samples(family, "_sum")}
    return [Histogram(family.name, dict(key), counts[key], sums[key], series) for key, series in buckets.items()]

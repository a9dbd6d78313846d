"""A worker's counters and histograms are kept in its slot's file, and taken over by the
worker started again in that slot (``proxy/workers/kept.py``); gauges are not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values

from proxy.workers import kept


@pytest.fixture
def restore_value_class() -> Iterator[None]:
    before = values.ValueClass
    yield
    values.ValueClass = before


def _metrics() -> tuple[CollectorRegistry, Counter, Histogram, Gauge]:
    registry = CollectorRegistry()
    counter = Counter("t_requests", "requests", ["lane"], registry=registry)
    histogram = Histogram("t_seconds", "seconds", ["lane"], buckets=[1.0], registry=registry)
    gauge = Gauge("t_in_flight", "held now", ["lane"], registry=registry)
    return registry, counter, histogram, gauge


def test_a_new_process_in_the_slot_counts_on_and_holds_no_gauge(
    tmp_path: Path, restore_value_class: None
) -> None:
    kept.install(str(tmp_path), 1)
    registry, counter, histogram, gauge = _metrics()
    counter.labels("a").inc(3)
    histogram.labels("a").observe(0.5)
    histogram.labels("a").observe(2.0)
    gauge.labels("a").set(7)

    # The worker dies; the one started in its slot makes the same series again.
    kept.install(str(tmp_path), 1)
    registry, counter, histogram, gauge = _metrics()
    counter.labels("a").inc()
    histogram.labels("a").observe(0.25)
    got = {(s.name, s.labels.get("le")): s.value for m in registry.collect() for s in m.samples}
    assert got[("t_requests_total", None)] == 4
    assert got[("t_seconds_count", None)] == 3
    assert got[("t_seconds_sum", None)] == 2.75
    assert got[("t_seconds_bucket", "1.0")] == 2
    assert got[("t_seconds_bucket", "+Inf")] == 3
    assert ("t_in_flight", None) not in got  # made lazily: a new worker holds nothing
    assert gauge.labels("a")._value.get() == 0


def test_another_slot_and_another_series_start_at_zero(
    tmp_path: Path, restore_value_class: None
) -> None:
    kept.install(str(tmp_path), 0)
    _, counter, _, _ = _metrics()
    counter.labels("a").inc(5)
    kept.install(str(tmp_path), 1)
    _, counter, _, _ = _metrics()
    assert counter.labels("a")._value.get() == 0
    kept.install(str(tmp_path), 0)
    _, counter, _, _ = _metrics()
    assert counter.labels("a")._value.get() == 5
    assert counter.labels("b")._value.get() == 0

"""``observe.gaps.Gaps``: a stream's inter-token times added to their histogram in batches
must leave it exactly as ``Histogram.observe`` one at a time would, and never hold a gap for
longer than its bounds say."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from proxy.observe.gaps import EVERY, MAX_AGE_S, Gaps
from proxy.observe.metrics import LATENCY_BUCKETS


def series(name: str) -> tuple[CollectorRegistry, object]:
    registry = CollectorRegistry()
    family = Histogram(name, "gaps", ["lane"], buckets=LATENCY_BUCKETS, registry=registry)
    return registry, family.labels("l")


def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("le", "")): s.value
        for m in registry.collect()
        for s in m.samples
        if not s.name.endswith("_created")
    }


@pytest.mark.parametrize(
    "gaps",
    [
        [0.05],  # on a bound: counted in that bucket (le)
        [0.0, 0.005, 0.0050001, 59.9, 60.0, 61.0, 1e9],  # the first, near, last bounds and +Inf
        [0.05 + i * 0.001 for i in range(EVERY * 3 + 5)],  # several batches and a rest
    ],
)
def test_batched_gaps_leave_the_histogram_as_one_by_one_observations_do(
    gaps: list[float],
) -> None:
    one_by_one, plain = series("one")
    batched, child = series("one")
    held = Gaps(child, now=0.0)
    for gap in gaps:
        plain.observe(gap)  # type: ignore[attr-defined]
        held.observe(gap, now=0.0)
    held.flush(now=0.0)
    assert samples(batched) == pytest.approx(samples(one_by_one))


def test_gaps_are_added_every_batch_and_once_old_enough() -> None:
    registry, child = series("g")
    held = Gaps(child, now=100.0)

    def count() -> float:
        return samples(registry)[("g_count", "")]

    for _ in range(EVERY - 1):
        held.observe(0.05, now=100.0)
    assert count() == 0  # held
    held.observe(0.05, now=100.0)
    assert count() == EVERY  # a whole batch: added
    held.observe(0.05, now=100.0 + MAX_AGE_S / 2)
    assert count() == EVERY
    held.observe(0.05, now=100.0 + MAX_AGE_S)  # a second after the last batch
    assert count() == EVERY + 2
    held.flush(now=200.0)  # nothing held: nothing added
    assert count() == EVERY + 2

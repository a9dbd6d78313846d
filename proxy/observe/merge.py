"""One ``/metrics`` for several workers: their samples as plain data, and the merge.

Each worker keeps its own registry (so a replica's series can still be removed, and info
series exist, which prometheus-client's multiprocess mode offers neither of). A scrape of any
worker asks the others for their samples (``families``) and merges them (``merge``):
counters, histograms and the gauges that count what a worker holds (``ADDITIVE``) are summed
over the workers; every other gauge and info series says the same in every worker, and the
lowest-numbered worker that answered (the leader, normally) is taken. A series exists when
any worker has it, so a series every worker removed is gone from the merge.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

# Gauges whose value is a worker's share of the gateway's: the gateway's is their sum.
ADDITIVE = frozenset({"tokenlane_queue_depth", "tokenlane_replica_in_flight"})
SUMMED_TYPES = frozenset({"counter", "histogram", "summary", "gaugehistogram"})

Family = dict[str, Any]  # {"name", "type", "help", "unit", "samples": [[name, labels, value]]}


def families(registry: CollectorRegistry) -> list[Family]:
    """``registry``'s samples as JSON-ready data."""
    out = []
    for metric in registry.collect():
        out.append(
            {
                "name": metric.name,
                "type": metric.type,
                "help": metric.documentation,
                "unit": metric.unit,
                "samples": [[s.name, s.labels, s.value] for s in metric.samples],
            }
        )
    return out


def merge(workers: Sequence[Sequence[Family]]) -> list[Metric]:
    """The gateway's families from the workers' (``workers[0]`` is taken first for the
    gauges that are the same everywhere: pass the leader's first)."""
    merged: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for fams in workers:
        for fam in fams:
            name = fam["name"]
            metric = merged.get(name)
            if metric is None:
                metric = merged[name] = Metric(name, fam["help"], fam["type"], fam["unit"])
                values[name] = {}
            summed = fam["type"] in SUMMED_TYPES or name in ADDITIVE
            table = values[name]
            for sample_name, labels, value in fam["samples"]:
                key = (sample_name, tuple(sorted(labels.items())))
                if key in table:
                    if sample_name.endswith("_created"):  # a start time: the earliest
                        table[key] = min(table[key], value)
                    elif summed:
                        table[key] += value
                else:
                    table[key] = value
    for name, metric in merged.items():
        metric.samples = [
            Sample(sample_name, dict(labels), value)
            for (sample_name, labels), value in values[name].items()
        ]
    return list(merged.values())


def worker_gauges(workers: int, answered: int) -> list[Metric]:
    """How many workers the serve runs, and how many are in this scrape (a worker that did
    not answer in time is missing from every sum: compare the two)."""
    out = []
    for name, doc, value in (
        ("tokenlane_workers", "Worker processes of this serve (server.workers).", workers),
        ("tokenlane_workers_scraped", "Workers whose metrics are in this scrape.", answered),
    ):
        metric = Metric(name, doc, "gauge")
        metric.add_sample(name, {}, float(value))
        out.append(metric)
    return out


class Merged:
    """A collector over merged families, for ``generate_latest``."""

    def __init__(self, metrics: Iterable[Metric]) -> None:
        self.metrics = list(metrics)

    def collect(self) -> Iterator[Metric]:
        return iter(self.metrics)


def registry_of(metrics: Iterable[Metric]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged(metrics))
    return registry


__all__ = ["ADDITIVE", "Family", "families", "merge", "registry_of", "worker_gauges"]

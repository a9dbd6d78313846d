"""Counters that outlive their worker: a restarted worker takes over its predecessor's counts.

A scrape sums the workers' counters (``proxy/observe/merge.py``). A worker that died took its
counts with it, so the sums would drop by what it had counted, and Prometheus' ``rate()``
reads any drop as a counter reset: the whole of the new sum counted again as an increase. So
in a worker every counter and histogram keeps its value in a file of the run directory (in
``/dev/shm``), one per worker slot, written on every change; the worker started again in that
slot reads each series' value back when the series is first made, and counts on from it.
A ``SIGKILL`` loses nothing written: the writes are to shared memory, not to a buffer of the
process (a stream's inter-token gaps and the queue waits not yet added, ``observe.gaps``,
die with the worker).

Gauges stay in memory: they say what a worker holds now, and a new worker holds nothing.

prometheus-client offers the file format (``MmapedDict``) but not the choice per registry:
its multiprocess mode keys files by pid (a restart starts a new file), calls ``getpid()`` on
every change and gives up label removal and info series (``merge.py``). What it does offer
is the module-level ``values.ValueClass``, read whenever a series is made; ``install`` sets
it once, at a worker's start, before any metric exists.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from prometheus_client import values
from prometheus_client.mmap_dict import MmapedDict, mmap_key

# The series types whose values only grow (a histogram's buckets, count and sum included).
KEPT_TYPES = frozenset({"counter", "histogram", "summary"})


def counts_path(rundir: str, index: int) -> str:
    return os.path.join(rundir, f"counts-{index}.db")


class KeptValues:
    """The values of one worker slot's series, in one file."""

    def __init__(self, path: str) -> None:
        self._file = MmapedDict(path)
        self._lock = threading.Lock()  # MmapedDict is not thread safe; metrics may be

    def make(
        self,
        typ: str,
        metric_name: str,
        name: str,
        labelnames: Any,
        labelvalues: Any,
        help_text: str,
        **kwargs: Any,
    ) -> Any:
        """What ``values.ValueClass`` is called as: a kept value for the growing types."""
        if typ not in KEPT_TYPES:
            return values.MutexValue(
                typ, metric_name, name, labelnames, labelvalues, help_text, **kwargs
            )
        key = mmap_key(metric_name, name, labelnames, labelvalues, help_text)
        return KeptValue(self._file, self._lock, key)


class KeptValue:
    """``MutexValue``'s interface over one entry of the slot's file."""

    __slots__ = ("_file", "_key", "_lock", "_value")

    def __init__(self, file: MmapedDict, lock: threading.Lock, key: str) -> None:
        self._file = file
        self._lock = lock
        self._key = key
        with lock:
            self._value: float = file.read_value(key)[0]

    def inc(self, amount: float) -> None:
        with self._lock:
            self._value += amount
            self._file.write_value(self._key, self._value, 0.0)

    def set(self, value: float, timestamp: float | None = None) -> None:
        with self._lock:
            self._value = value
            self._file.write_value(self._key, value, 0.0)

    def get(self) -> float:
        return self._value

    def set_exemplar(self, exemplar: Any) -> None:
        return None  # the gateway attaches none

    def get_exemplar(self) -> None:
        return None


def install(rundir: str, index: int) -> KeptValues:
    """From now on, this process's counters and histograms are kept for worker ``index``."""
    kept = KeptValues(counts_path(rundir, index))
    values.ValueClass = kept.make
    return kept


__all__ = ["KEPT_TYPES", "KeptValue", "KeptValues", "counts_path", "install"]

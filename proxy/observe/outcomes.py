"""Recording what became of each request, off the request's path.

A finished request is queued and recorded (metrics, the estimator's learning, the access-log
line: ``record.Recorder``) within ``FLUSH_S``, together with every request that finished by
then, or as soon as ``MAX_QUEUED`` wait; ``/metrics`` flushes first, so a scrape sees every
request that ended before it. Recorded on the spot, that work (tens of microseconds, most of
it the access line) sat between a response and the next request on its connection: at
concurrency 1 it was 0.1 ms of every request's latency. As Envoy flushes its file access log on
an interval. A process killed outright loses at most the last ``FLUSH_S``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from proxy.relay.call import Call

FLUSH_S: Final = 0.01
MAX_QUEUED: Final = 256
# Read as a Final: compiled, ``time.time`` is a lookup in the module's dict per call.
_wall_clock: Final = time.time

Record = Callable[["Call", float, float], None]  # (call, duration_s, wall-clock end)


class Outcomes:
    def __init__(self, record: Record, batch_done: Callable[[], None] = lambda: None) -> None:
        self.record = record
        self.batch_done = batch_done  # after each batch (the access log's flush)
        self._queued: list[tuple[Call, float, float]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    def add(self, call: Call, duration_s: float) -> None:
        """Queue ``call``, which is done: nothing in it changes any more."""
        self._queued.append((call, duration_s, _wall_clock()))
        if self._closed or len(self._queued) >= MAX_QUEUED:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = loop.call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        queued, self._queued = self._queued, []
        record = self.record
        for call, duration_s, ts in queued:
            record(call, duration_s, ts)
        if queued:
            self.batch_done()

    def close(self) -> None:
        """Record what waits; from now on every outcome is recorded at once (no timer is left
        behind on a loop that is ending)."""
        self._closed = True
        self.flush()


__all__ = ["FLUSH_S", "MAX_QUEUED", "Outcomes"]

"""What one finished request leaves behind: its metrics, the estimator's lesson, its access line.

``Outcomes`` calls a ``Recorder`` off the request's path, in batches; ``/metrics`` flushes first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from proxy.observe.accessline import write_lines
from proxy.observe.accesslog import flush_lines
from proxy.observe.gaps import Gaps
from proxy.observe.metrics import Metrics, replica_ttft_s

if TYPE_CHECKING:
    from proxy.relay.call import Call
    from proxy.routing.profile import Profile


class Learner(Protocol):
    """Learns characters per token from what replicas report (``classify.Estimator``)."""

    def observe(self, profile: Profile, reported_prompt_tokens: int) -> None: ...


class Recorder:
    """Records a finished ``Call``: an ``outcomes.Record`` for ``Outcomes``, whose batch ends
    with ``batch_done``.

    A batch's counts and observations are added to their series once per series at its end:
    ``Counter.inc`` and ``Histogram.observe`` take a lock and walk prometheus-client's Python
    per call (seven a request), where a batch of a busy second holds a few series. They are
    kept by metric and labels, and each series is looked up (``Metrics.series``, interpreted)
    once per batch, not once per request. The access lines go out at the batch's end as well
    (``accesslog.flush_lines``)."""

    def __init__(self, metrics: Metrics, estimator: Learner) -> None:
        self.metrics = metrics
        self.estimator = estimator
        # (a counter, its labels): what this batch adds
        self._counts: dict[tuple[Any, tuple[str, ...]], float] = {}
        # (a histogram, its labels): this batch's values, held for its series
        self._observed: dict[tuple[Any, tuple[str, ...]], Gaps] = {}
        # The batch's requests, for their access lines (``accessline.write_lines``)
        self._ended: list[tuple[Call, float, float]] = []

    def _inc(self, metric: Any, labels: tuple[str, ...], amount: float = 1.0) -> None:
        key = (metric, labels)
        counts = self._counts
        counts[key] = counts.get(key, 0.0) + amount

    def _observe(self, metric: Any, labels: tuple[str, ...], value: float) -> None:
        key = (metric, labels)
        held = self._observed.get(key)
        if held is None:
            held = self._observed[key] = Gaps(self.metrics.series(metric, *labels), 0.0)
        held.observe(value, 0.0)  # one clock: added at the batch's end, or every EVERY values

    def __call__(self, call: Call, duration: float, ts: float) -> None:
        m = self.metrics
        lane = call.lane.name
        pool = call.pool or ""
        replica = call.replica.name if call.replica is not None else ""
        self._inc(m.requests, (lane, pool, replica, str(call.status)))
        self._inc(m.api_requests, (lane, call.kind))
        if call.overhead_s is not None:
            self._observe(m.overhead, (lane,), call.overhead_s)
        # A realtime session's length and first message say nothing of a request's latency:
        # counted, logged, kept out of the lanes' latency histograms.
        if call.pool and call.kind != "realtime":
            self._observe(m.duration, (lane, pool), duration)
            if call.ttft_s is not None:
                self._observe(m.ttft, (lane, pool), call.ttft_s)
            if call.replica is not None:
                seconds = replica_ttft_s(call.ttft_s, call.queue_wait_s, call.retries)
                if seconds is not None:
                    self._observe(m.replica_ttft, (pool, replica), seconds)
        usage = call.usage
        reported = usage.get("prompt_tokens") if usage else None
        profile = call.profile
        # A request continuing a stored response (``Call.pinned``) is reported with a prompt
        # its body does not hold: it would teach the estimator a wrong ratio.
        if profile is not None and call.pool and call.pinned is None:
            # Estimated and reported over the same requests: their ratio is the estimator's
            # error, not the share of requests whose usage came back.
            if isinstance(reported, int) and reported > 0:
                self._inc(m.prompt_tokens_estimated, (pool,), profile.prompt_tokens_est)
                self._inc(m.prompt_tokens_reported, (pool,), reported)
                self.estimator.observe(profile, reported)
        self._ended.append((call, duration, ts))  # its one access line, at the batch's end

    def batch_done(self) -> None:
        """The batch's counts and observations into their series, then its access lines out."""
        counts = self._counts
        if counts:
            series = self.metrics.series
            for (metric, labels), amount in counts.items():
                series(metric, *labels).inc(amount)
            counts.clear()
        observed = self._observed
        if observed:
            for held in observed.values():
                held.flush(0.0)
            observed.clear()
        ended = self._ended
        if ended:
            # Taken before it is written: a record that cannot be made (raising here) costs
            # this batch's lines, not every later batch's.
            self._ended = []
            write_lines(ended)
        flush_lines()


__all__ = ["Learner", "Recorder"]

"""What one finished request leaves behind: its metrics, the estimator's lesson, its access line.

``Outcomes`` calls a ``Recorder`` off the request's path, in batches; ``/metrics`` flushes first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from proxy.observe.accesslog import write_line
from proxy.observe.metrics import Metrics, replica_ttft_s

if TYPE_CHECKING:
    from proxy.relay.call import Call
    from proxy.routing.profile import Profile


class Learner(Protocol):
    """Learns characters per token from what replicas report (``classify.Estimator``)."""

    def observe(self, profile: Profile, reported_prompt_tokens: int) -> None: ...


class Recorder:
    """Records a finished ``Call``: an ``outcomes.Record`` for ``Outcomes``."""

    def __init__(self, metrics: Metrics, estimator: Learner) -> None:
        self.metrics = metrics
        self.estimator = estimator

    def __call__(self, call: Call, duration: float, ts: float) -> None:
        m = self.metrics
        lane = call.lane.name
        pool = call.pool or ""
        replica = call.replica.name if call.replica is not None else ""
        m.series(m.requests, lane, pool, replica, str(call.status)).inc()
        m.series(m.api_requests, lane, call.kind).inc()
        if call.overhead_s is not None:
            m.series(m.overhead, lane).observe(call.overhead_s)
        # A realtime session's length and first message say nothing of a request's latency:
        # counted, logged, kept out of the lanes' latency histograms.
        if call.pool and call.kind != "realtime":
            m.series(m.duration, lane, pool).observe(duration)
            if call.ttft_s is not None:
                m.series(m.ttft, lane, pool).observe(call.ttft_s)
            if call.replica is not None:
                m.observe_replica_ttft(
                    pool, replica, replica_ttft_s(call.ttft_s, call.queue_wait_s, call.retries)
                )
        usage = call.usage
        reported = usage.get("prompt_tokens") if usage else None
        profile = call.profile
        # A request continuing a stored response (``Call.pinned``) is reported with a prompt
        # its body does not hold: it would teach the estimator a wrong ratio.
        if profile is not None and call.pool and call.pinned is None:
            # Estimated and reported over the same requests: their ratio is the estimator's
            # error, not the share of requests whose usage came back.
            if isinstance(reported, int) and reported > 0:
                m.series(m.prompt_tokens_estimated, pool).inc(profile.prompt_tokens_est)
                m.series(m.prompt_tokens_reported, pool).inc(reported)
                self.estimator.observe(profile, reported)
        write_line(call, duration, ts)  # the one line per request


__all__ = ["Learner", "Recorder"]

"""Admission: whether a request may be dispatched now, and to which replica.

Gateway-core version: no waiting. A request is dispatched at once to a replica of its lane's pool
(or of its ``spill_to`` pool) that is healthy, serves the model and is below its
``max_in_flight``; otherwise it is refused. Bounded priority queues, lane limits and rate limits
replace this with waiting (issue 5); the seam is ``admit()``.
"""

from __future__ import annotations

from collections.abc import Callable

from .config import LaneConfig
from .errors import Rejected
from .fleet import Fleet, Replica
from .metrics import Metrics

# A function that picks a replica for the request now (None when none can take it), and tells
# whether any replica at all could serve it (healthy and serving the model, saturated or not).
TryPick = Callable[[], Replica | None]
AnyServing = Callable[[], bool]


class Admission:
    def __init__(self, fleet: Fleet, metrics: Metrics) -> None:
        self.fleet = fleet
        self.metrics = metrics

    async def admit(self, lane: LaneConfig, try_pick: TryPick, any_serving: AnyServing) -> Replica:
        """A replica for the request's first attempt, or ``Rejected``."""
        replica = try_pick()
        if replica is not None:
            return replica
        if any_serving():
            reason, status, message = "queue_full", 429, "every replica of the lane is busy"
        else:
            reason, status, message = "no_replica", 503, "no healthy replica can serve this request"
        self.metrics.rejections.labels(lane.name, reason).inc()
        raise Rejected(
            f"{message} (lane {lane.name!r})", status=status, reason=reason, retry_after_s=1.0
        )

    def released(self, replica: Replica) -> None:
        """A slot on ``replica`` is free again (the queue of issue 5 wakes a waiter here)."""

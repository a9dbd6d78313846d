"""The fleet as shared state sees it: its replicas as records, its load, and news applied.

``record_of`` turns a replica into the record other instances read; ``FleetView.apply`` turns
another instance's record back into a transition of the local fleet. Both convert between the
fleet's monotonic clock and the Unix time records carry (``until``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence

from proxy.fleet.fleet import EjectReason, Fleet, Replica, ReplicaState
from proxy.routing import cache_aware
from proxy.state.codec import ReplicaRecord
from proxy.state.protocol import SharedState

log = logging.getLogger("tokenlane.shared")


def record_of(replica: Replica, now: float) -> ReplicaRecord:
    """A replica's state as shared; ``now`` is the fleet clock (its ``ejected_until``'s)."""
    until = None
    if replica.state is ReplicaState.EJECTED and not math.isinf(replica.ejected_until):
        until = round(time.time() + (replica.ejected_until - now), 3)
    return ReplicaRecord(
        pool=replica.pool,
        url=replica.url,
        state=replica.state.value,
        reason=replica.reason.value if replica.reason else None,
        until=until,
        ejections=replica.ejections,
        level=replica.backoff_level,
        # when this instance made (or applied) the transition; never made: 0, the oldest
        changed_at=round(replica.changed_at, 3) if replica.changed_at else 0.0,
    )


class FleetView:
    """The fleet as shared state sees it (a ``LocalView``); also hooks the fleet so that every
    transition of its own is published."""

    def __init__(self, fleet: Fleet, shared: SharedState) -> None:
        self.fleet = fleet
        self.shared = shared
        fleet.on_transition = self.transition

    def transition(self, replica: Replica) -> None:
        self.shared.publish(record_of(replica, self.fleet.clock()))

    def records(self) -> list[ReplicaRecord]:
        now = self.fleet.clock()
        return [record_of(r, now) for r in self.fleet.replicas()]

    def in_flight(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.fleet.replicas():  # leaving (draining) replicas included, once
            if r.in_flight:
                counts[r.url] = counts.get(r.url, 0) + r.in_flight
        return counts

    def apply(self, record: ReplicaRecord) -> bool:
        found = self.fleet.find(record.url, record.pool)
        if not found:
            return False
        try:
            state = ReplicaState(record.state)
            reason = EjectReason(record.reason) if record.reason is not None else None
        except ValueError:
            log.warning("shared state: ignoring a record with an unknown state: %r", record)
            return True
        until = 0.0
        if state is ReplicaState.EJECTED:
            now = self.fleet.clock()
            until = math.inf if record.until is None else now + (record.until - time.time())
        self.fleet.apply_remote(
            found[0], state, reason, until, record.ejections, record.level, record.instance
        )
        return True

    def remote_load(self, in_flight: Mapping[str, int]) -> None:
        for r in self.fleet.replicas():
            r.remote_in_flight = in_flight.get(r.url, 0)

    def learn_placement(self, pool: str, url: str, hashes: Sequence[int]) -> None:
        cache_aware.learn(self.fleet, pool, url, hashes)

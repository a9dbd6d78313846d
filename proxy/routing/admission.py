"""Admission: per-lane limits and bounded priority queues (docs/operations.md).

A request is dispatched at once when its lane is below its ``max_in_flight``, nobody of its lane
waits before it, and some replica of its pool or ``spill_to`` pool is healthy, serves the model
and has room (below its ``max_in_flight``, counting hand-offs in progress). Otherwise:

- no replica of either pool is healthy and serving: 503 ``no_replica`` at once. A pool that is
  down is not queued for; only saturation is. A queued request whose pools both go down is
  answered the same way by the sweeper below, so nobody waits out a timeout for a dead pool;
- the lane's queue holds ``max_queue``: 429 ``queue_full`` at once, ``Retry-After`` from the
  lane's measured drain rate (``retry_after_s``);
- else it waits in its lane's FIFO queue until a slot frees, ``queue_timeout_s`` passes (503
  ``queue_timeout``) or its client leaves (the handler task is cancelled: the waiter is removed
  and is never dispatched).

Hand-off. A freed slot (``released``: an attempt ended on a replica; ``finished``: a request
left its lane) is given at once, on the releasing side, to the best waiter that can use it:
lanes by ``priority`` (higher first), then by their head's arrival, the head of each lane only
(FIFO inside a lane). The waiter's own ``try_pick`` chooses the replica, so overlapping pools and
spill pools need no bookkeeping here, and the replica is *reserved* until the waiter's task
resumes: ``has_room`` counts reservations, so no newcomer or retry takes that slot in between.
The waiter turns its reservation into a real in-flight count in the same step as the relay
calls ``fleet.attempt_started`` (no await between the two).

Workers (``tokenlane serve --workers N``). A ``Ledger`` shares the counts with the other
workers of the serve: a replica's and a lane's in-flight and a lane's queue depth are then the
sums over all workers, each taken with a claim that cannot overshoot (``claim``: check and
take under one lock), and a slot freed in one worker wakes the waiters of the others
(``kick_others``). Without a ledger (one process) none of this runs.

Nothing polls per request: each waiter is a future and a timer handle. One sweeper task per
gateway runs only while something waits; it re-offers slots every ``SWEEP_S`` for changes no
release announces (a replica readmitted, a reload raising a limit) and fails waiters whose
pools went down. Queue operations are O(1): one ``OrderedDict`` per lane (append, pop first,
remove any); choosing the lane is a sort of the few lanes that have waiters.

Length: one job, admission's state machine (dispatch, queue, hand-off, sweep) and the ledger under
it; the hand-off rule needs the queues and the counts in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from proxy.config import LaneConfig
from proxy.errors import Rejected
from proxy.fleet.fleet import Fleet, Replica
from proxy.observe.gaps import Gaps
from proxy.observe.metrics import Metrics

log: Final = logging.getLogger("tokenlane.admission")

# A function that picks a replica for the request now (None when none can take it), and tells
# whether any replica at all could serve it (healthy and serving the model, saturated or not).
TryPick = Callable[[], Replica | None]
AnyServing = Callable[[], bool]


class Ledger(Protocol):
    """Counts shared by the workers of one serve (``proxy.workers.link.BoardLedger``), by name."""

    def others(self, name: str) -> int:
        """What the other workers hold of ``name`` now."""
        ...

    def claim(self, name: str, limit: int, amount: int = 1) -> bool:
        """One more for this worker when all workers together hold fewer than ``limit`` (or
        ``amount`` more when it fits, or when they hold nothing)."""
        ...

    def hold(self, name: str, count: int) -> None:
        """What this worker holds of ``name`` now."""
        ...

    def kick_others(self) -> None:
        """A slot was freed here: wake the workers that have waiters."""
        ...


WAITING_ROW: Final = "waiting"  # a worker's waiters over all lanes: whom a freed slot should wake


def replica_row(replica: Replica) -> str:
    return f"r {replica.pool} {replica.url}"


SWEEP_S: Final = 0.25
DRAIN_TAU_S = 10.0  # time constant of the drain-rate average: a burst's own pace, not an hour's
RETRY_AFTER_MIN_S: Final = 1.0
RETRY_AFTER_MAX_S: Final = 60.0
NO_REPLICA_RETRY_AFTER_S: Final = 1.0


# ---------------------------------------------------------------------------- pure parts


@dataclass(slots=True)
class DrainRate:
    """Dispatches per second, exponentially weighted over ``tau_s``, continuous in time.

    ``level`` decays as ``exp(-dt / tau)`` and each dispatch adds ``1 / tau``, so a steady rate
    ``r`` settles at ``r``. Early on the average has seen less than ``tau`` of history; dividing by
    the weight it has had (``1 - exp(-age / tau)``, age floored at 1 s) removes that start-up bias.
    """

    tau_s: float = DRAIN_TAU_S
    level: float = 0.0
    at: float | None = None
    first: float | None = None

    def note(self, now: float, n: int = 1) -> None:
        if self.at is not None:
            self.level *= math.exp(-(now - self.at) / self.tau_s)
        else:
            self.first = now
        self.level += n / self.tau_s
        self.at = now

    def per_s(self, now: float) -> float:
        if self.at is None or self.first is None:
            return 0.0
        level = self.level * math.exp(-(now - self.at) / self.tau_s)
        weight = 1.0 - math.exp(-max(now - self.first, 1.0) / self.tau_s)
        return level / weight


def retry_after_s(position: int, rate_per_s: float) -> float:
    """When a client at ``position`` in the queue would be served at the measured drain rate,
    clamped to 1..60 s (no rate measured yet: the longest)."""
    if rate_per_s <= 0.0:
        return RETRY_AFTER_MAX_S
    return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, position / rate_per_s))


# ---------------------------------------------------------------------------- state


@dataclass(eq=False, slots=True)
class Waiter:
    seq: int
    lane: str
    try_pick: TryPick
    any_serving: AnyServing
    future: asyncio.Future[Replica]
    enqueued_at: float
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False, slots=True)
class LaneState:
    config: LaneConfig
    in_flight: int = 0
    queue: OrderedDict[int, Waiter] = field(default_factory=OrderedDict)
    drain: DrainRate = field(default_factory=DrainRate)
    depth: Any = None  # the lane's tokenlane_queue_depth child
    # The lane's tokenlane_queue_wait_seconds child, its observations held and added in
    # batches (``Admission.flush_metrics`` before a scrape): a histogram's ``observe`` is
    # interpreted prometheus-client, once per request.
    wait: Gaps | None = None

    def has_room(self, ledger: Ledger | None) -> bool:
        limit = self.config.max_in_flight
        if limit is None:
            return True
        if ledger is None:
            return self.in_flight < limit
        return self.in_flight + ledger.others(self.row) < limit

    @property
    def row(self) -> str:
        return f"l {self.config.name}"

    @property
    def queue_row(self) -> str:
        return f"q {self.config.name}"

    def head(self) -> Waiter:
        return next(iter(self.queue.values()))


class Admission:
    def __init__(
        self,
        fleet: Fleet | None,
        metrics: Metrics,
        lanes: Iterable[LaneConfig] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
        sweep_s: float = SWEEP_S,
    ) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.clock = clock
        self.sweep_s = sweep_s
        self.lanes: dict[str, LaneState] = {}
        self.waiting = 0
        self._reserved: dict[Replica, int] = {}
        self._seq = itertools.count()
        self._sweeper: asyncio.Task[None] | None = None
        self.ledger: Ledger | None = None  # set when this process is one of several workers
        self._unsettled: set[Replica] = set()  # claimed in this step, not yet held (below)
        self.set_lanes(lanes)

    def set_lanes(self, lanes: Iterable[LaneConfig]) -> None:
        """Take the policy's lanes (at start and on reload): limits, priorities, gauges at 0.
        A reload may raise a limit, so waiters get another look at once."""
        for lane in lanes:
            self._lane(lane)
        self.kick()

    def flush_metrics(self) -> None:
        """Every queue wait observed so far into its histogram (before a scrape)."""
        t = self.clock()
        for st in self.lanes.values():
            if st.wait is not None:
                st.wait.flush(t)

    def kick(self) -> None:
        """Something freed capacity without a release (a replica readmitted, a reload): give
        it to waiters now rather than at the sweeper's next round."""
        if self.waiting:
            self._pump()

    def _lane(self, lane: LaneConfig) -> LaneState:
        st = self.lanes.get(lane.name)
        if st is None:
            st = self.lanes[lane.name] = LaneState(lane)
            st.depth = self.metrics.queue_depth.labels(lane.name)
            st.wait = Gaps(self.metrics.queue_wait.labels(lane.name), self.clock())
            st.depth.set(0)
        elif st.config is not lane:
            st.config = lane  # a reloaded policy: same lane, new limits
        return st

    # -- what the relay asks ---------------------------------------------------------------

    def has_room(self, replica: Replica) -> bool:
        """Below ``max_in_flight``, counting slots handed to waiters that have not started yet
        (and, with workers, what the other workers hold: then also the replica's load)."""
        held = replica.in_flight + self._reserved.get(replica, 0)
        ledger = self.ledger
        if ledger is not None:
            replica.sibling_in_flight = others = ledger.others(replica_row(replica))
            held += others
        return held < replica.config.max_in_flight

    def claim(self, replica: Replica) -> bool:
        """Take the slot ``has_room`` saw, for the pick the caller is about to use. With
        workers another worker may have taken it since (False: pick another); the claim is
        settled into this worker's held count at the end of the step (``_settle``), by when
        the pick has become an attempt or a reservation, or was dropped."""
        if self.ledger is None:
            return True
        if not self._claim(replica_row(replica), replica.config.max_in_flight):
            return False
        if not self._unsettled:
            asyncio.get_running_loop().call_soon(self._settle)
        self._unsettled.add(replica)
        return True

    def _settle(self) -> None:
        for replica in self._unsettled:
            self._hold(replica)
        self._unsettled.clear()

    def _hold(self, replica: Replica) -> None:
        if self.ledger is not None:
            self.ledger.hold(
                replica_row(replica), replica.in_flight + self._reserved.get(replica, 0)
            )

    def _claim(self, name: str, limit: int | None) -> bool:
        """One of ``limit`` for this worker (always, without workers or without a limit: the
        caller has checked its own count)."""
        return self.ledger is None or limit is None or self.ledger.claim(name, limit)

    def _claim_lane(self, st: LaneState) -> bool:
        return self._claim(st.row, st.config.max_in_flight)

    def _hold_lane(self, st: LaneState) -> None:
        if self.ledger is not None and st.config.max_in_flight is not None:
            self.ledger.hold(st.row, st.in_flight)

    def _queue_depth(self, st: LaneState) -> int:
        """The lane's queue across all workers."""
        depth = len(st.queue)
        if self.ledger is not None:
            depth += self.ledger.others(st.queue_row)
        return depth

    async def admit(self, lane: LaneConfig, try_pick: TryPick, any_serving: AnyServing) -> Replica:
        """A replica for the request's first attempt, after waiting if need be; or ``Rejected``.

        The caller owes one ``finished(lane)`` for every replica returned."""
        st = self._lane(lane)
        if self.waiting:
            self._pump()  # earlier waiters first: a newcomer never takes a slot they can use
        if not self._queue_depth(st) and st.has_room(self.ledger) and self._claim_lane(st):
            replica = try_pick()
            if replica is not None:
                self._dispatched(st, 0.0)
                return replica
            self._hold_lane(st)  # the lane slot claimed is not used
        if not any_serving():
            raise self._reject(
                st, "no_replica", 503, "no healthy replica can serve this request",
                NO_REPLICA_RETRY_AFTER_S,
            )  # fmt: skip
        depth = self._queue_depth(st)
        if depth >= lane.max_queue or not self._claim(st.queue_row, lane.max_queue):
            raise self._reject(
                st, "queue_full", 429, f"the lane's queue is full ({lane.max_queue} waiting)",
                retry_after_s(depth + 1, st.drain.per_s(self.clock())),
            )  # fmt: skip
        return await self._wait(st, try_pick, any_serving)

    def released(self, replica: Replica) -> None:
        """An attempt on ``replica`` ended: its slot may go to a waiter."""
        if self.ledger is not None:
            self._hold(replica)
            self.ledger.kick_others()
        if self.waiting:
            self._pump()

    def finished(self, lane: LaneConfig) -> None:
        """A request admitted to ``lane`` is over (all its attempts): its lane slot is free."""
        st = self.lanes.get(lane.name)
        if st is not None and st.in_flight > 0:
            st.in_flight -= 1
        if st is not None and self.ledger is not None:
            self._hold_lane(st)
            self.ledger.kick_others()
        if self.waiting:
            self._pump()

    def depths(self) -> dict[str, int]:
        return {name: len(st.queue) for name, st in self.lanes.items()}

    # -- waiting ---------------------------------------------------------------------------

    async def _wait(self, st: LaneState, try_pick: TryPick, any_serving: AnyServing) -> Replica:
        loop = asyncio.get_running_loop()
        waiter = Waiter(
            seq=next(self._seq),
            lane=st.config.name,
            try_pick=try_pick,
            any_serving=any_serving,
            future=loop.create_future(),
            enqueued_at=self.clock(),
        )
        waiter.timer = loop.call_later(st.config.queue_timeout_s, self._expire, waiter)
        st.queue[waiter.seq] = waiter
        self._changed(st, +1)
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = loop.create_task(self._sweep(), name="tokenlane-admission-sweep")
        try:
            replica = await waiter.future
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        # The reservation becomes the relay's in-flight count in this same step.
        self._unreserve(replica)
        return replica

    def _abandon(self, waiter: Waiter) -> None:
        """The waiting task was cancelled (client gone, server stopping): never dispatch it."""
        st = self.lanes.get(waiter.lane)
        if st is not None and st.queue.pop(waiter.seq, None) is not None:
            self._changed(st, -1)
        if waiter.timer is not None:
            waiter.timer.cancel()
        fut = waiter.future
        if fut.done() and not fut.cancelled():
            if fut.exception() is None:
                # Granted in the instant before the cancel landed: give the slot back.
                replica = fut.result()
                self._unreserve(replica)
                self._hold(replica)
                if st is not None and st.in_flight > 0:
                    st.in_flight -= 1
                    self._hold_lane(st)
                if self.ledger is not None:
                    self.ledger.kick_others()
                if self.waiting:
                    self._pump()

    def _expire(self, waiter: Waiter) -> None:
        st = self.lanes.get(waiter.lane)
        if st is None or st.queue.pop(waiter.seq, None) is None:
            return
        self._changed(st, -1)
        if not waiter.future.done():
            waiter.future.set_exception(
                self._reject(
                    st, "queue_timeout", 503,
                    f"not dispatched within queue_timeout_s ({st.config.queue_timeout_s:g}s)",
                    retry_after_s(len(st.queue) + 1, st.drain.per_s(self.clock())),
                )
            )  # fmt: skip

    def _pump(self) -> None:
        """Give every slot that is free now to the best waiter that can use it."""
        while self.waiting:
            ledger = self.ledger
            ready = [st for st in self.lanes.values() if st.queue and st.has_room(ledger)]
            if not ready:
                return
            ready.sort(key=lambda s: (-s.config.priority, s.head().seq))
            for st in ready:
                head = st.head()
                if head.future.done():  # cancelled; its task has not run its cleanup yet
                    self._abandon(head)
                    break
                if not self._claim_lane(st):  # another worker took the lane's last slot
                    continue
                try:
                    replica = head.try_pick()
                except Exception as exc:  # fail that request, not the one releasing a slot
                    self._hold_lane(st)
                    del st.queue[head.seq]
                    self._changed(st, -1)
                    if head.timer is not None:
                        head.timer.cancel()
                    head.future.set_exception(exc)
                    break
                if replica is not None:
                    self._grant(st, head, replica)
                    break
                self._hold_lane(st)
            else:
                return

    def _grant(self, st: LaneState, waiter: Waiter, replica: Replica) -> None:
        del st.queue[waiter.seq]
        self._changed(st, -1)
        if waiter.timer is not None:
            waiter.timer.cancel()
        self._reserved[replica] = self._reserved.get(replica, 0) + 1
        self._dispatched(st, self.clock() - waiter.enqueued_at)
        waiter.future.set_result(replica)

    async def _sweep(self) -> None:
        while self.waiting:
            await asyncio.sleep(self.sweep_s)
            try:
                self._sweep_once()
            except Exception:  # the sweeper must outlive one bad round
                log.exception("admission sweep failed")

    def _sweep_once(self) -> None:
        self._pump()
        for st in list(self.lanes.values()):
            for waiter in list(st.queue.values()):
                if waiter.future.done() or waiter.any_serving():
                    continue
                del st.queue[waiter.seq]
                self._changed(st, -1)
                if waiter.timer is not None:
                    waiter.timer.cancel()
                waiter.future.set_exception(
                    self._reject(
                        st, "no_replica", 503,
                        "no healthy replica is left to serve this request",
                        NO_REPLICA_RETRY_AFTER_S,
                    )
                )  # fmt: skip

    # -- bookkeeping -----------------------------------------------------------------------

    def _dispatched(self, st: LaneState, waited_s: float) -> None:
        st.in_flight += 1
        self._hold_lane(st)
        t = self.clock()
        st.drain.note(t)
        if st.wait is not None:
            st.wait.observe(waited_s, t)

    def _changed(self, st: LaneState, delta: int) -> None:
        self.waiting += delta
        st.depth.set(len(st.queue))
        if self.ledger is not None:
            self.ledger.hold(st.queue_row, len(st.queue))
            self.ledger.hold(WAITING_ROW, self.waiting)

    def _unreserve(self, replica: Replica) -> None:
        n = self._reserved.get(replica, 0) - 1
        if n > 0:
            self._reserved[replica] = n
        else:
            self._reserved.pop(replica, None)

    def _reject(
        self, st: LaneState, reason: str, status: int, message: str, retry_after: float
    ) -> Rejected:
        self.metrics.rejections.labels(st.config.name, reason).inc()
        return Rejected(
            f"{message} (lane {st.config.name!r})",
            status=status,
            reason=reason,
            retry_after_s=retry_after,
        )

    async def close(self) -> None:
        """Stop the sweeper and add the queue waits held (gateway shutdown: a restarted
        worker counts on from its predecessor's series, ``proxy/workers/kept.py``)."""
        self.flush_metrics()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

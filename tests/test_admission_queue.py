"""The admission queue without sockets: priority between lanes, FIFO inside a lane, timeouts,
cancellation, hand-off reservations, the sweeper, and the drain rate behind Retry-After."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from proxy.config import LaneConfig, ReplicaConfig
from proxy.errors import Rejected
from proxy.fleet.fleet import Replica, ReplicaState, make_replica
from proxy.observe.metrics import Metrics
from proxy.routing.admission import Admission, DrainRate, retry_after_s


def replica(name: str, max_in_flight: int = 1, pool: str = "p") -> Replica:
    r = make_replica(
        pool, ReplicaConfig(url=f"http://{name}:8000", max_in_flight=max_in_flight), {}
    )
    r.state = ReplicaState.HEALTHY
    return r


def lane(name: str, **kw: Any) -> LaneConfig:
    return LaneConfig(name=name, pool=kw.pop("pool", "p"), **kw)


class Harness:
    """Admission plus the relay's side of the contract: pick, start, end."""

    def __init__(self, **kw: Any) -> None:
        self.metrics = Metrics()
        self.adm = Admission(None, self.metrics, **kw)

    def picker(self, *replicas: Replica) -> Callable[[], Replica | None]:
        def pick() -> Replica | None:
            for r in replicas:
                if r.state is ReplicaState.HEALTHY and self.adm.has_room(r):
                    return r
            return None

        return pick

    def serving(self, *replicas: Replica) -> Callable[[], bool]:
        return lambda: any(r.state is ReplicaState.HEALTHY for r in replicas)

    async def admit(self, ln: LaneConfig, *replicas: Replica) -> Replica:
        r = await self.adm.admit(ln, self.picker(*replicas), self.serving(*replicas))
        r.in_flight += 1  # what fleet.attempt_started does in the same step
        return r

    def end(self, ln: LaneConfig, r: Replica) -> None:
        r.in_flight -= 1
        self.adm.released(r)
        self.adm.finished(ln)

    def spawn(self, ln: LaneConfig, *replicas: Replica) -> asyncio.Task[Replica]:
        return asyncio.create_task(self.admit(ln, *replicas))

    def rejections(self, ln: str, reason: str) -> float:
        return self.metrics.rejections.labels(ln, reason)._value.get()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_waiters_are_served_by_lane_priority_then_arrival() -> None:
    h = Harness()
    r = replica("a")
    low, high = lane("low", priority=0), lane("high", priority=10)
    await h.admit(low, r)
    order: list[str] = []

    async def wait(ln: LaneConfig, tag: str) -> None:
        got = await h.admit(ln, r)
        order.append(tag)
        await asyncio.sleep(0.01)
        h.end(ln, got)

    tasks = [asyncio.create_task(wait(low, "low-1"))]
    await settle()
    tasks.append(asyncio.create_task(wait(low, "low-2")))
    await settle()
    tasks.append(asyncio.create_task(wait(high, "high-1")))
    await settle()
    assert h.adm.depths() == {"low": 2, "high": 1}
    h.end(low, r)
    await asyncio.gather(*tasks)
    assert order == ["high-1", "low-1", "low-2"]


async def test_lanes_of_equal_priority_are_served_by_arrival() -> None:
    h = Harness()
    r = replica("a")
    a, b = lane("a"), lane("b")
    await h.admit(a, r)
    order: list[str] = []

    async def wait(ln: LaneConfig) -> None:
        got = await h.admit(ln, r)
        order.append(ln.name)
        h.end(ln, got)

    tasks = []
    for ln in (b, a, b):
        tasks.append(asyncio.create_task(wait(ln)))
        await settle()
    h.end(a, r)
    await asyncio.gather(*tasks)
    assert order == ["b", "a", "b"]


async def test_lane_max_in_flight_holds_requests_even_with_free_replicas() -> None:
    h = Harness()
    r = replica("a", max_in_flight=10)
    ln = lane("bulk", max_in_flight=2, max_queue=5)
    first = [await h.admit(ln, r) for _ in range(2)]
    third = h.spawn(ln, r)
    await settle()
    assert not third.done() and h.adm.depths()["bulk"] == 1
    h.end(ln, first[0])
    assert await asyncio.wait_for(third, 1) is r
    assert h.adm.lanes["bulk"].in_flight == 2


async def test_full_queue_rejects_at_once_with_429_queue_full() -> None:
    h = Harness()
    r = replica("a")
    ln = lane("bulk", max_queue=2)
    await h.admit(ln, r)
    waiting = [h.spawn(ln, r) for _ in range(2)]
    await settle()
    with pytest.raises(Rejected) as exc:
        await h.admit(ln, r)
    assert exc.value.status == 429 and exc.value.reason == "queue_full"
    assert 1 <= int(exc.value.headers["retry-after"]) <= 60
    assert h.rejections("bulk", "queue_full") == 1
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_zero_max_queue_never_queues() -> None:
    h = Harness()
    r = replica("a")
    ln = lane("bulk", max_queue=0)
    await h.admit(ln, r)
    with pytest.raises(Rejected) as exc:
        await h.admit(ln, r)
    assert exc.value.reason == "queue_full"


async def test_no_healthy_replica_rejects_at_once_with_503_no_replica() -> None:
    h = Harness()
    r = replica("a")
    r.state = ReplicaState.EJECTED
    with pytest.raises(Rejected) as exc:
        await asyncio.wait_for(h.admit(lane("l"), r), 1)
    assert exc.value.status == 503 and exc.value.reason == "no_replica"
    assert "retry-after" in exc.value.headers
    assert h.adm.depths()["l"] == 0


async def test_queue_timeout_answers_503_and_empties_the_queue() -> None:
    h = Harness()
    r = replica("a")
    ln = lane("l", queue_timeout_s=0.05)
    await h.admit(ln, r)
    with pytest.raises(Rejected) as exc:
        await asyncio.wait_for(h.admit(ln, r), 2)
    assert exc.value.status == 503 and exc.value.reason == "queue_timeout"
    assert int(exc.value.headers["retry-after"]) >= 1
    assert h.adm.depths()["l"] == 0 and h.adm.waiting == 0
    assert h.rejections("l", "queue_timeout") == 1


async def test_cancelled_waiter_is_removed_and_never_dispatched() -> None:
    h = Harness()
    r = replica("a")
    ln = lane("l")
    first = await h.admit(ln, r)
    gone, stays = h.spawn(ln, r), None
    await settle()
    stays = h.spawn(ln, r)
    await settle()
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert h.adm.depths()["l"] == 1
    h.end(ln, first)
    assert await asyncio.wait_for(stays, 1) is r
    assert gone.cancelled()
    assert r.in_flight == 1  # only the one that stayed


async def test_cancel_landing_after_the_grant_gives_the_slot_to_the_next_waiter() -> None:
    h = Harness()
    r = replica("a")
    ln = lane("l")
    first = await h.admit(ln, r)
    a = h.spawn(ln, r)
    await settle()
    b = h.spawn(ln, r)
    await settle()
    h.end(ln, first)  # grants to a: its future is resolved, its task not yet resumed
    a.cancel()  # ... and the client leaves in that same instant
    await asyncio.gather(a, return_exceptions=True)
    assert a.cancelled()
    assert await asyncio.wait_for(b, 1) is r
    assert r.in_flight == 1 and h.adm.lanes["l"].in_flight == 1


async def test_handed_off_slot_is_reserved_from_newcomers() -> None:
    h = Harness()
    r = replica("a")
    ln = lane("l")
    first = await h.admit(ln, r)
    waiter = h.spawn(ln, r)
    await settle()
    h.end(ln, first)  # the slot goes to the waiter, which has not run yet
    assert not h.adm.has_room(r)
    late = h.spawn(ln, r)
    await settle()
    assert waiter.done() and not late.done()
    assert r.in_flight == 1
    late.cancel()
    await asyncio.gather(late, return_exceptions=True)


async def test_spill_waiter_of_higher_priority_takes_the_shared_pool_first() -> None:
    h = Harness()
    fast, bulk = replica("fast", pool="interactive"), replica("bulk", pool="bulk")
    short = lane("short", pool="interactive", spill_to="bulk", priority=5)
    long_ = lane("long", pool="bulk")
    await h.admit(short, fast, bulk)
    b = await h.admit(long_, bulk)
    long_waiter = h.spawn(long_, bulk)
    await settle()
    short_waiter = h.spawn(short, fast, bulk)
    await settle()
    h.end(long_, b)  # the bulk slot: both lanes can use it; short has the priority
    assert await asyncio.wait_for(short_waiter, 1) is bulk
    assert not long_waiter.done()
    long_waiter.cancel()
    await asyncio.gather(long_waiter, return_exceptions=True)


async def test_sweeper_dispatches_when_a_replica_comes_back_without_a_release() -> None:
    h = Harness(sweep_s=0.02)
    a, b = replica("a"), replica("b")
    b.state = ReplicaState.PROBING
    ln = lane("l")
    await h.admit(ln, a, b)
    waiter = h.spawn(ln, a, b)
    await settle()
    b.state = ReplicaState.HEALTHY  # readmitted by the health loop: nothing is released
    assert await asyncio.wait_for(waiter, 1) is b


async def test_sweeper_fails_waiters_whose_pools_went_down() -> None:
    h = Harness(sweep_s=0.02)
    r = replica("a")
    ln = lane("l", queue_timeout_s=30)
    await h.admit(ln, r)
    waiter = h.spawn(ln, r)
    await settle()
    r.state = ReplicaState.EJECTED
    with pytest.raises(Rejected) as exc:
        await asyncio.wait_for(waiter, 1)
    assert exc.value.reason == "no_replica"
    assert h.adm.waiting == 0


async def test_queue_wait_is_observed_for_every_dispatch() -> None:
    h = Harness()
    r = replica("a")
    ln = lane("l")
    first = await h.admit(ln, r)
    waiter = h.spawn(ln, r)
    await settle()
    await asyncio.sleep(0.05)
    h.end(ln, first)
    await waiter
    h.adm.flush_metrics()  # held and added in batches, as before a scrape
    hist = h.metrics.queue_wait.labels("l")
    assert hist._sum.get() >= 0.05
    samples = {s.name: s.value for s in h.metrics.queue_wait.collect()[0].samples
               if s.labels.get("le") in (None, "0.005")}  # fmt: skip
    assert samples["tokenlane_queue_wait_seconds_count"] == 2
    assert samples["tokenlane_queue_wait_seconds_bucket"] == 1  # the immediate one


# ---------------------------------------------------------------------------- drain rate


def test_drain_rate_settles_at_the_steady_dispatch_rate() -> None:
    d = DrainRate(tau_s=10.0)
    t = 0.0
    for _ in range(600):  # 5/s for 120 s
        t += 0.2
        d.note(t)
    assert d.per_s(t) == pytest.approx(5.0, rel=0.1)


def test_drain_rate_is_unbiased_early() -> None:
    d = DrainRate(tau_s=10.0)
    for i in range(20):  # 4/s for 5 s
        d.note(0.25 * (i + 1))
    assert d.per_s(5.0) == pytest.approx(4.0, rel=0.25)


def test_drain_rate_decays_when_nothing_drains() -> None:
    d = DrainRate(tau_s=10.0)
    for i in range(100):
        d.note(0.1 * i)
    assert d.per_s(40.0) < d.per_s(10.0) / 10


def test_retry_after_is_position_over_rate_clamped() -> None:
    assert retry_after_s(10, 2.0) == 5.0
    assert retry_after_s(1, 100.0) == 1.0
    assert retry_after_s(10_000, 1.0) == 60.0
    assert retry_after_s(3, 0.0) == 60.0


async def test_queue_full_retry_after_follows_the_drain_rate() -> None:
    clock = [0.0]
    h = Harness(clock=lambda: clock[0])
    r = replica("a", max_in_flight=1000)
    ln = lane("l", max_in_flight=1, max_queue=3)
    # 2 dispatches a second for 30 s: the lane drains at ~2/s.
    for _ in range(60):
        got = await h.admit(ln, r)
        clock[0] += 0.5
        h.end(ln, got)
    held = await h.admit(ln, r)
    waiting = [h.spawn(ln, r) for _ in range(3)]
    await settle()
    with pytest.raises(Rejected) as exc:
        await h.admit(ln, r)
    assert exc.value.headers["retry-after"] == "2"  # position 4 at ~2/s
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    h.end(ln, held)

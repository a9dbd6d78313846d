"""Shared state against a real redis-server: two ``RedisState`` objects in one process stand for
two gateways. The pure parts (leases, load sums, the breaker) are tested without sockets."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest

from proxy.config import RateLimitsConfig, RedisConfig
from proxy.fleet.fleet import EjectReason, Fleet, ReplicaState
from proxy.observe.metrics import Metrics
from proxy.policyfile import build_policy
from proxy.routing.ratelimit import LocalRateLimiter
from proxy.state.codec import ReplicaRecord, sum_load
from proxy.state.leases import Lease, LeasedRateLimiter, batch_size, lease_amount, may_spend, settle
from proxy.state.local import LocalState
from proxy.state.redis_state import RedisState
from proxy.state.redislink import Breaker, Unavailable
from proxy.state.shared import shared_state_for
from proxy.state.view import FleetView

from .lost_cancel import LostCancel
from .redis_server import RedisServer, running_redis
from .waiting import wait_until

pytestmark = pytest.mark.redis


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh, empty redis-server per test (it starts in milliseconds)."""
    with running_redis() as server:
        yield server


U1 = "http://10.0.0.1:8000"
U2 = "http://10.0.0.2:8000"


class View:
    """The gateway side, recorded."""

    def __init__(self, known: list[ReplicaRecord] | None = None) -> None:
        self.known = known or []
        self.counts: dict[str, int] = {}
        self.applied: list[ReplicaRecord] = []
        self.loads: list[dict[str, int]] = []
        self.placements: list[tuple[str, str, list[int]]] = []

    def records(self) -> list[ReplicaRecord]:
        return list(self.known)

    def in_flight(self) -> dict[str, int]:
        return dict(self.counts)

    def apply(self, record: ReplicaRecord) -> bool:
        self.applied.append(record)
        return True

    def remote_load(self, in_flight: Mapping[str, int]) -> None:
        self.loads.append(dict(in_flight))

    def learn_placement(self, pool: str, url: str, hashes: Sequence[int]) -> None:
        self.placements.append((pool, url, list(hashes)))

    def last(self, url: str) -> ReplicaRecord | None:
        found = [r for r in self.applied if r.url == url]
        return found[-1] if found else None


# A call's bound: short enough for outage tests to stay quick, wide enough that a loaded
# machine's scheduling hiccup is not taken for Redis being down.
TIMEOUT_MS = 2000


def cfg(url: str, **kw: float) -> RedisConfig:
    return RedisConfig(
        url=url, **{"timeout_ms": TIMEOUT_MS, "heartbeat_s": 0.2, "ttl_s": 1.0, **kw}
    )


def subscribers(server: RedisServer, channel: str = "tokenlane:replicas:changed") -> int:
    """Connections subscribed to ``channel`` (the records'), as Redis counts them."""
    reply = server.command("PUBSUB", "NUMSUB", channel)
    return int(reply.split()[-1].lstrip(b":"))


def sync_rounds(*views: View) -> Callable[[], bool]:
    """A condition that holds once each view's instance has run two more sync rounds (each
    ends by handing the load view over): proof that reconciles ran, before an absence is
    asserted."""
    marks = [len(v.loads) + 2 for v in views]
    return lambda: all(len(v.loads) >= m for v, m in zip(views, marks, strict=True))


def calls_under_way(state: RedisState) -> Callable[[], int]:
    """From now on, how many of ``state``'s Redis calls are under way (each is bounded by
    ``timeout_ms``, so with Redis paused they all end)."""
    call = state._call
    count = 0

    async def counted(*args: Any, **kw: Any) -> Any:
        nonlocal count
        count += 1
        try:
            return await call(*args, **kw)
        finally:
            count -= 1

    state._call = counted  # type: ignore[method-assign]
    return lambda: count


@contextlib.asynccontextmanager
async def instance(
    server: RedisServer,
    view: View | None = None,
    *,
    name: str,
    reconcile_s: float = 0.2,
    metrics: Metrics | None = None,
    clock: Callable[[], float] = time.monotonic,
    joined: bool = True,
    **kw: float,
) -> AsyncIterator[tuple[RedisState, View]]:
    """A started ``RedisState``; with ``joined``, once it is on Redis (a busy machine can make
    its first attempts miss ``timeout_ms``; its probe then joins)."""
    config = cfg(server.url, **kw)
    state = RedisState(
        server.url, lambda: config, instance=name, reconcile_s=reconcile_s, probe_s=0.2,
        metrics=metrics, clock=clock,
    )  # fmt: skip
    view = view or View()
    await state.start(view)
    try:
        if joined:
            await wait_until(lambda: state.up, what=f"{name} joined")
        yield state, view
    finally:
        await state.stop()


def ejected(
    url: str = U1, reason: str = "stall", until: float | None = None, **kw: object
) -> ReplicaRecord:
    if until is None and reason != "operator":
        until = time.time() + 30
    return ReplicaRecord(pool="p", url=url, state="ejected", reason=reason, until=until, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- replica records


async def test_ejection_on_one_instance_is_applied_by_the_other_by_its_message(
    redis_server: RedisServer,
) -> None:
    # Reconcile is slowed to 30 s: only the published message can deliver well before that.
    async with (
        instance(redis_server, name="a", reconcile_s=30) as (a, _),
        instance(redis_server, name="b", reconcile_s=30) as (_b, vb),
    ):
        await wait_until(lambda: subscribers(redis_server) == 2, what="a and b subscribed")
        a.publish(ejected(reason="operator", ejections=1))
        took = await wait_until(lambda: vb.last(U1), what="b applies a's ejection", timeout=15)
        got = vb.last(U1)
        assert got is not None
        assert (got.state, got.reason, got.until, got.instance) == (
            "ejected",
            "operator",
            None,
            "a",
        )
        assert got.ejections == 1 and got.updated_at > 0
        print(f"propagated in {took * 1000:.0f} ms")


async def test_record_written_without_a_message_converges_by_reconcile(
    redis_server: RedisServer,
) -> None:
    async with instance(redis_server, name="b", reconcile_s=0.3) as (_, vb):
        # As if another instance's PUBLISH was lost: the record is there, no message came.
        record = ejected(reason="health_check", ejections=2, instance="a", updated_at=time.time())
        redis_server.command("HSET", "tokenlane:replicas", record.field, record.to_json())
        await wait_until(lambda: vb.last(U1), what="reconcile applies the record")
        assert vb.last(U1) == record


async def test_subscriber_disconnected_during_a_broadcast_converges(
    redis_server: RedisServer,
) -> None:
    # T18. Reconcile at 30 s: convergence must come from the re-subscription's own reconcile.
    async with (
        instance(redis_server, name="a", reconcile_s=30) as (a, _),
        instance(redis_server, name="b", reconcile_s=30) as (_b, vb),
    ):
        await wait_until(lambda: subscribers(redis_server) == 2, what="a and b subscribed")
        assert redis_server.command("CLIENT", "KILL", "TYPE", "pubsub").startswith(b":")
        a.publish(ejected(reason="operator"))  # published while b is not subscribed
        await wait_until(lambda: vb.last(U1), what="b converges after losing the message")
        assert vb.last(U1).reason == "operator"  # type: ignore[union-attr]


async def test_two_instances_ejecting_at_once_make_one_ejection(redis_server: RedisServer) -> None:
    async with (
        instance(redis_server, name="a") as (a, va),
        instance(redis_server, name="b") as (b, vb),
    ):
        a.publish(ejected(until=time.time() + 30, ejections=1, level=1))
        await wait_until(lambda: vb.last(U1), what="b sees a's ejection")
        seen = len(vb.applied)
        b.publish(ejected(until=time.time() + 60, ejections=1, level=1))  # b saw the stall too
        await wait_until(lambda: len(vb.applied) > seen, what="b's write answered: b adopts")
        stored = ReplicaRecord.from_json(
            redis_server.value("HGET", "tokenlane:replicas", f"p {U1}") or b""
        )
        assert stored.instance == "a" and stored.ejections == 1  # the standing one won
        assert vb.last(U1) == stored  # b adopted it (its own proposal merged into it)
        assert va.last(U1) is None  # a's own record is never applied back to a


async def test_ejection_count_is_shared_across_instances(redis_server: RedisServer) -> None:
    async with (
        instance(redis_server, name="a") as (a, _),
        instance(redis_server, name="b") as (b, vb),
    ):
        a.publish(ejected(until=time.time() + 0.1, ejections=1, level=1))
        await wait_until(lambda: vb.last(U1), what="b sees ejection 1")
        a.publish(ReplicaRecord(pool="p", url=U1, state="healthy", ejections=1, level=1))
        await wait_until(lambda: vb.last(U1).state == "healthy", what="b sees readmission")  # type: ignore[union-attr]
        # b's own count lags behind: the script counts
        b.publish(ejected(reason="consecutive_failures", ejections=0, level=2))
        await wait_until(lambda: stored_by(redis_server) == "b", what="b's ejection written")
        raw = redis_server.value("HGET", "tokenlane:replicas", f"p {U1}") or b""
        assert ReplicaRecord.from_json(raw).ejections == 2


async def test_operator_ejection_overrides_a_standing_detector_ejection(
    redis_server: RedisServer,
) -> None:
    async with (
        instance(redis_server, name="a") as (a, _),
        instance(redis_server, name="b") as (_, vb),
    ):
        a.publish(ejected(reason="stall", ejections=1))
        await wait_until(lambda: vb.last(U1), what="stall ejection")
        a.publish(ejected(reason="operator", ejections=1))
        await wait_until(lambda: vb.last(U1).reason == "operator", what="operator ejection")  # type: ignore[union-attr]
        assert vb.last(U1).until is None and vb.last(U1).ejections == 2  # type: ignore[union-attr]


def stored_record(server: RedisServer, url: str = U1) -> ReplicaRecord:
    return ReplicaRecord.from_json(server.value("HGET", "tokenlane:replicas", f"p {url}") or b"")


def stored_by(server: RedisServer, url: str = U1) -> str | None:
    """The instance that wrote the stored record; None before any."""
    raw = server.value("HGET", "tokenlane:replicas", f"p {url}")
    return None if raw is None else ReplicaRecord.from_json(raw).instance


async def test_older_transition_arriving_later_is_refused_and_adopted(
    redis_server: RedisServer,
) -> None:
    # The millisecond race: a readmits (t1), b operator-ejects (t2 = t1 + 1 ms), but b's write
    # reaches Redis first.
    t1 = round(time.time() - 0.01, 3)
    t2 = round(t1 + 0.001, 3)
    async with (
        instance(redis_server, name="a") as (a, va),
        instance(redis_server, name="b") as (b, vb),
    ):
        b.publish(ejected(reason="operator", ejections=1, changed_at=t2))
        await wait_until(lambda: va.last(U1) is not None, what="a sees b's ejection")
        seen = len(va.applied)
        a.publish(ReplicaRecord(pool="p", url=U1, state="healthy", ejections=1, changed_at=t1))
        await wait_until(lambda: len(va.applied) > seen, what="a adopts the stored record")
        stored = stored_record(redis_server)
        assert (stored.state, stored.reason, stored.instance) == ("ejected", "operator", "b")
        assert stored.changed_at == t2 and stored.ejections == 1
        assert va.last(U1) == stored
        await wait_until(sync_rounds(va, vb), what="a reconcile or two: nothing else happens")
        assert stored_record(redis_server) == stored
        assert vb.last(U1) is None  # b never saw a healthy record (nor its own, echoed)
        # Not a blanket refusal: a later transition (t3 > t2) wins as it should.
        a.publish(ReplicaRecord(pool="p", url=U1, state="healthy", ejections=1))
        await wait_until(lambda: vb.last(U1) is not None, what="b gets a's newer readmission")
        assert vb.last(U1).state == "healthy" and stored_record(redis_server).instance == "a"  # type: ignore[union-attr]


async def test_operator_ejection_overrides_a_newer_detector_ejection_keeping_its_time(
    redis_server: RedisServer,
) -> None:
    t1 = round(time.time() - 0.01, 3)
    t2, t3 = round(t1 + 0.002, 3), round(t1 + 0.001, 3)
    async with (
        instance(redis_server, name="a") as (a, va),
        instance(redis_server, name="b") as (b, _),
    ):
        a.publish(ejected(reason="stall", ejections=1, changed_at=t2))
        await wait_until(lambda: stored_by(redis_server) == "a", what="a's")
        b.publish(ejected(reason="operator", ejections=1, changed_at=t1))  # older, still wins
        await wait_until(lambda: stored_by(redis_server) == "b", what="b's")
        stored = stored_record(redis_server)
        assert stored.reason == "operator" and stored.changed_at == t2 and stored.ejections == 2
        # The stored transition time did not go back: a stale write from between is refused.
        seen = len(va.applied)
        a.publish(ReplicaRecord(pool="p", url=U1, state="probing", changed_at=t3))
        # a's write is refused and answered with the stored record, which a adopts
        await wait_until(lambda: len(va.applied) > seen, what="a's stale write answered")
        assert stored_record(redis_server) == stored


async def test_record_without_transition_time_is_read_and_taken_as_oldest(
    redis_server: RedisServer,
) -> None:
    legacy = ejected(reason="operator", ejections=2, instance="old", updated_at=time.time())
    raw = legacy.to_json().replace(',"changed_at":0.0', "")
    assert "changed_at" not in raw and ReplicaRecord.from_json(raw) == legacy
    redis_server.command("HSET", "tokenlane:replicas", legacy.field, raw)
    async with instance(redis_server, name="a") as (a, va):
        assert va.last(U1) == legacy
        a.publish(ReplicaRecord(pool="p", url=U1, state="probing", reason="operator"))
        await wait_until(lambda: stored_by(redis_server) == "a", what="a's write")
        stored = stored_record(redis_server)
        assert stored.state == "probing" and stored.changed_at > 0 and stored.ejections == 2


async def test_new_instance_learns_existing_records_at_start(redis_server: RedisServer) -> None:
    async with instance(redis_server, name="a") as (a, _):
        a.publish(ejected(reason="operator"))
        await wait_until(lambda: stored_by(redis_server) == "a", what="a's ejection written")
        async with instance(redis_server, name="c", reconcile_s=30) as (_, vc):
            assert vc.last(U1) is not None and vc.last(U1).reason == "operator"  # type: ignore[union-attr]


# ---------------------------------------------------------------------------- load


async def test_remote_in_flight_is_the_sum_over_other_instances(redis_server: RedisServer) -> None:
    async with (
        instance(redis_server, name="a") as (a, va),
        instance(redis_server, name="b") as (_, vb),
        instance(redis_server, name="c") as (c, vc),
    ):
        va.counts = {U1: 3}
        vb.counts = {U1: 2, U2: 1}
        vc.counts = {}
        await wait_until(
            lambda: c.remote_in_flight(U1) == 5 and c.remote_in_flight(U2) == 1, what="c's view"
        )
        await wait_until(lambda: a.remote_in_flight(U1) == 2, what="a excludes itself")
        assert vc.loads[-1] == {U1: 5, U2: 1}
        assert c.instances == 3


CRASHER = textwrap.dedent(
    """
    import asyncio, sys
    from proxy.config import RedisConfig
    from proxy.state.redis_state import RedisState

    class View:
        def records(self): return []
        def in_flight(self): return {sys.argv[2]: 7}
        def apply(self, record): return True
        def remote_load(self, m): pass

    async def main():
        cfg = RedisConfig(url=sys.argv[1], timeout_ms=2000, heartbeat_s=0.2, ttl_s=1.0)
        state = RedisState(sys.argv[1], lambda: cfg, instance="doomed")
        await state.start(View())
        print("up" if state.up else "down", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def test_killed_instance_in_flight_counts_vanish_within_ttl_plus_heartbeat(
    redis_server: RedisServer,
) -> None:
    # T17: SIGKILL leaves no chance to clean up; the per-instance key's expiry does it.
    async with instance(redis_server, name="b") as (b, _):
        proc = subprocess.Popen(
            [sys.executable, "-c", CRASHER, redis_server.url, U1],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            # "up", or "down" on a machine too busy for its first attempts: its probe joins later
            line = await asyncio.to_thread(proc.stdout.readline)
            if line.strip() not in (b"up", b"down"):
                proc.kill()
                _, err = proc.communicate(timeout=5)
                pytest.fail(f"the crasher did not start: {err.decode(errors='replace')[-2000:]}")
            await wait_until(lambda: b.remote_in_flight(U1) == 7, what="b sees the 7 in flight")
            proc.kill()
            proc.wait(5)
            took = await wait_until(lambda: b.remote_in_flight(U1) == 0, what="counts expire")
            # ttl 1.0 + heartbeat 0.2 + one reconcile 0.2, with wide slack for a loaded machine
            assert took < 1.0 + 0.2 + 0.2 + 4.0
            print(f"view clean {took:.2f}s after SIGKILL")
            # Pruned from the registry once Redis has expired its key: the view may be clean a
            # refresh earlier (a stale heartbeat counts as dead before its key expires).
            await wait_until(
                lambda: b"doomed" not in redis_server.command("SMEMBERS", "tokenlane:instances"),
                what="the dead instance is pruned",
            )
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)


async def test_clean_stop_withdraws_load_at_once(redis_server: RedisServer) -> None:
    async with instance(redis_server, name="b", ttl_s=30) as (b, _):
        async with instance(redis_server, name="a", ttl_s=30) as (_, va):
            va.counts = {U1: 4}
            await wait_until(lambda: b.remote_in_flight(U1) == 4, what="b sees a")
        await wait_until(lambda: b.remote_in_flight(U1) == 0, what="a's stop withdrew its counts")


async def test_a_loop_whose_cancel_a_call_swallowed_still_stops(
    redis_server: RedisServer,
) -> None:
    # A fresh clone's ``make test`` once hung here: the teardown waited on a "shared sync"
    # task cancelled twice and still looping, its cancel lost inside a call. Lose one on
    # purpose: the loop must end at its next round, within ``stop``'s wait.
    async with instance(redis_server, name="a") as (a, _):
        lost = LostCancel()  # swallowed, as a library may: the cancel goes no further
        a.sync = lost.wait  # type: ignore[method-assign]
        a._reconcile_now.set()  # the sync loop's next round now, into the call above
        await asyncio.wait_for(lost.entered.wait(), timeout=30)
        sync_task = next(t for t in a._tasks if t.get_name() == "shared sync")
    # ``instance`` stopped ``a`` on its way out: the cancel swallowed, then the loop ended
    # (without its check it sleeps into its next round, and ``stop`` gives up after 2 s).
    assert lost.swallowed.is_set()
    assert sync_task.done() and sync_task.cancelled()


# ---------------------------------------------------------------------------- Redis slow or down


async def test_breaker_opens_when_redis_is_paused_and_calls_stay_bounded(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = Metrics()
    async with instance(redis_server, name="a", metrics=metrics) as (a, va):
        va.counts = {U1: 1}
        assert a.up and metrics.shared_state_up._value.get() == 1
        redis_server.pause()
        try:
            with caplog.at_level(logging.INFO, "tokenlane.shared"):
                for _ in range(2):  # the breaker opens on the second failure in a row
                    started = time.monotonic()
                    with pytest.raises(Unavailable):
                        await a.sync()
                    # bounded by timeout_ms (redis-py's own defaults may wait without end)
                    assert time.monotonic() - started < TIMEOUT_MS / 1000 + 3.0
                assert not a.up and metrics.shared_state_up._value.get() == 0
                a.publish(ejected())  # never waits, never raises
                with pytest.raises(Unavailable, match="breaker open"):
                    await a.sync()  # fails at once: no call reaches Redis
                assert a.remote_in_flight(U1) == 0
                probes = a.breaker.failures + 2
                await wait_until(
                    lambda: a.breaker.failures >= probes,
                    what="probes keep failing quietly",
                    timeout=30,  # each waits out timeout_ms
                )
            downs = [r for r in caplog.records if "unreachable" in r.getMessage()]
            assert len(downs) == 1
        finally:
            redis_server.resume()
        await wait_until(lambda: a.up, what="re-sync after resume")
        assert metrics.shared_state_up._value.get() == 1


async def test_breaker_opens_when_redis_dies_and_state_resyncs_after_restart(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    known = ejected(url=U2, reason="operator", ejections=3)
    async with (
        instance(redis_server, View([known]), name="a") as (a, va),
        instance(redis_server, name="b") as (b, vb),
    ):
        va.counts = {U1: 2}
        await wait_until(lambda: b.remote_in_flight(U1) == 2, what="b sees a's load")
        with caplog.at_level(logging.INFO, "tokenlane.shared"):
            redis_server.kill()
            await wait_until(lambda: not a.up and not b.up, what="both fall back to local")
            assert b.remote_in_flight(U1) == 0
            a.publish(ejected(reason="stall", ejections=1))  # a transition during the outage
            redis_server.start()  # empty: everything Redis held is gone
            await wait_until(lambda: a.up and b.up, what="both re-sync")
        assert any("re-synced" in r.getMessage() for r in caplog.records)
        await wait_until(lambda: vb.last(U1) is not None, what="b gets a's outage transition")
        await wait_until(lambda: vb.last(U2) is not None, what="b gets a's restored record")
        assert vb.last(U2).reason == "operator" and vb.last(U2).ejections == 3  # type: ignore[union-attr]
        await wait_until(lambda: b.remote_in_flight(U1) == 2, what="load view back")


async def test_stale_transition_made_during_an_outage_does_not_undo_a_newer_ejection(
    redis_server: RedisServer,
) -> None:
    # a loses Redis; its breaker stays open as long as its own clock says no probe is due.
    a_clock = Clock()
    async with (
        instance(redis_server, name="a", clock=a_clock) as (a, va),
        instance(redis_server, name="b") as (b, vb),
    ):
        a.publish(ejected(reason="stall", ejections=1))
        await wait_until(lambda: vb.last(U1) is not None, what="b sees a's stall ejection")
        a_calls = calls_under_way(a)
        redis_server.pause()
        try:
            with contextlib.suppress(Unavailable):
                for _ in range(2):
                    await a.sync()
            await wait_until(lambda: not a.up, what="a cut off", timeout=30)
            # A call a's loops began before the breaker opened would be answered once Redis
            # resumes, and that answer closes the breaker: let each one time out first.
            await wait_until(lambda: a_calls() == 0, what="a's calls under way timed out")
        finally:
            redis_server.resume()
        await wait_until(lambda: b.up, what="b back on Redis (the pause may have reached it)")
        # During a's outage: a's canary readmits the replica, then an operator ejects it on b.
        a.publish(ReplicaRecord(pool="p", url=U1, state="healthy", ejections=1, level=1))
        await asyncio.sleep(0.01)
        b.publish(ejected(reason="operator", ejections=1))
        await wait_until(lambda: stored_record(redis_server).reason == "operator", what="b's")
        assert not a.up
        a_clock.t += 10  # a's probe is due: it re-syncs
        await wait_until(lambda: a.up, what="a re-syncs")
        stored = stored_record(redis_server)
        assert (stored.state, stored.reason, stored.instance) == ("ejected", "operator", "b")
        assert va.last(U1) == stored  # a adopted b's ejection instead of overwriting it
        await wait_until(sync_rounds(va, vb), what="reconciles on both: it stays that way")
        assert stored_record(redis_server) == stored and va.last(U1) == stored
        assert all(r.state != "healthy" for r in vb.applied)  # b never readmitted it


async def test_start_without_redis_runs_on_local_view(redis_server: RedisServer) -> None:
    redis_server.kill()
    metrics = Metrics()
    started = time.monotonic()
    async with instance(redis_server, name="a", metrics=metrics, joined=False) as (a, _):
        assert time.monotonic() - started < 4 * TIMEOUT_MS / 1000  # bounded attempts to join
        assert not a.up and metrics.shared_state_up._value.get() == 0
        redis_server.start()
        await wait_until(lambda: a.up, what="joins once Redis is there")


async def test_client_is_configured_to_fail_fast(redis_server: RedisServer) -> None:
    state = RedisState(redis_server.url, lambda: cfg(redis_server.url, timeout_ms=80))
    kw = state._redis.connection_pool.connection_kwargs
    assert kw["socket_timeout"] == kw["socket_connect_timeout"] == 0.08
    assert kw["retry"].get_retries() == 0
    await state.stop()


# ---------------------------------------------------------------------------- rate limits


async def test_leased_limits_hold_across_two_instances_within_one_batch(
    redis_server: RedisServer,
) -> None:
    limit = 200
    limits = RateLimitsConfig(requests_per_min=limit)
    async with (
        instance(redis_server, name="a") as (a, _),
        instance(redis_server, name="b") as (b, _),
    ):
        la = a.rate_limiter(lambda: limits)
        lb = b.rate_limiter(lambda: limits)
        allowed = 0
        started = time.monotonic()
        for _ in range(40):  # 40 rounds of 10 requests per instance: 400 asked for 200
            for limiter in (la, lb):
                for _ in range(10):
                    allowed += limiter.check("k1", 10).allowed
            await asyncio.sleep(0.02)  # leases are fetched in the background meanwhile
        refill = (time.monotonic() - started) * limit / 60
        batch = batch_size(limit)
        assert allowed <= limit + refill + 2 * batch, (allowed, refill, batch)
        assert allowed >= limit - 2 * batch, (allowed, refill, batch)
        print(f"allowed {allowed} of limit {limit} (+{refill:.1f} refill, batch {batch:g})")


async def test_leased_limit_refusal_says_when_to_retry(redis_server: RedisServer) -> None:
    limits = RateLimitsConfig(requests_per_min=20)
    async with instance(redis_server, name="a") as (a, _):
        limiter = a.rate_limiter(lambda: limits)
        verdicts = []
        started = time.monotonic()
        for _ in range(60):
            verdicts.append(limiter.check("k", 1))
            await asyncio.sleep(0.01)
        # The shared bucket refills while the loop runs (a loaded machine stretches it), and
        # one batch may be spent on credit.
        refill = (time.monotonic() - started) * 20 / 60
        refused = [v for v in verdicts if not v.allowed]
        assert refused, "the limit never bit"
        allowed = sum(v.allowed for v in verdicts)
        assert allowed <= 20 + refill + batch_size(20), (allowed, refill)
        print(f"allowed {allowed} of limit 20 (+{refill:.1f} refill)")
        last = refused[-1]
        assert last.retry_after_s > 0 and last.requests is not None
        assert last.headers()["x-ratelimit-limit-requests"] == "20"


async def test_limiter_falls_back_to_local_share_when_redis_is_down(
    redis_server: RedisServer,
) -> None:
    limits = RateLimitsConfig(requests_per_min=100)
    async with instance(redis_server, name="a") as (a, _), instance(redis_server, name="b"):
        la = a.rate_limiter(lambda: limits)
        await wait_until(lambda: a.instances == 2, what="a sees b")
        redis_server.kill()
        await wait_until(lambda: not a.up, what="a falls back")
        allowed = sum(la.check("k", 1).allowed for _ in range(200))
        assert allowed == 50  # its share: 100 / 2 instances, from a full local bucket


# ---------------------------------------------------------------------------- pure parts


def test_record_json_round_trip_keeps_every_field() -> None:
    r = ReplicaRecord(
        "p", U1, "ejected", "stall", 1763800000.5, 4, 2, 1763800000.123, "a", 1763799999.987
    )
    assert ReplicaRecord.from_json(r.to_json()) == r
    assert r.field == f"p {U1}"


def test_record_from_junk_is_a_value_error() -> None:
    for junk in (b"[]", b'{"pool": "p"}', b"not json"):
        with pytest.raises(ValueError):
            ReplicaRecord.from_json(junk)


def test_sum_load_skips_self_reported_stale_and_reports_dead() -> None:
    now = 1000.0
    totals, live, dead = sum_load(
        {
            "a": {"_at": "999.5", U1: "3", U2: "1"},
            "b": {"_at": "999.9", U1: "2"},
            "old": {"_at": "900", U1: "50"},  # writer's clock far behind: treated as missing
            "gone": {},
        },
        now,
        ttl_s=10,
    )
    assert totals == {U1: 5, U2: 1} and live == 2 and dead == ["gone"]


def test_breaker_opens_on_second_failure_in_a_row_and_then_allows_only_a_probe() -> None:
    b = Breaker(probe_s=1.0, threshold=2)
    assert b.failed(9.0) is False and b.allows(False, 9.0)  # one hiccup: still closed
    b.succeeded()
    assert b.failed(9.5) is False  # the count restarted
    assert b.failed(10.0) is True
    assert not b.allows(False, 10.5) and not b.allows(True, 10.5)
    assert b.allows(True, 11.0) and not b.allows(False, 11.0)
    assert b.failed(11.0) is False  # already open: no second "down"
    b.succeeded()
    assert b.allows(False, 11.0)


def test_credit_is_one_batch_and_stops_when_the_shared_bucket_is_empty() -> None:
    lease = Lease()
    assert may_spend(lease, 1, batch=5)  # nothing leased yet: on credit
    lease.stock = -4
    assert may_spend(lease, 1, batch=5) and not may_spend(lease, 2, batch=5)
    lease.stock, lease.exhausted = 0.5, True
    assert not may_spend(lease, 1, batch=5)


def test_lease_settles_debt_and_marks_an_empty_bucket() -> None:
    lease = Lease(stock=-3)
    ask = lease_amount(lease, batch=5)
    assert ask == 8
    settle(lease, ask, granted=8, left=100, now=0.0, per_s=1.0)
    assert lease.stock == 5 and not lease.exhausted
    lease.stock = 0
    settle(lease, 5, granted=2, left=0, now=0.0, per_s=1.0)
    assert lease.exhausted and lease.stock == 2 and lease.next_at > 0


def test_local_state_is_always_up_and_shares_nothing() -> None:
    state = shared_state_for(lambda: RedisConfig())
    assert isinstance(state, LocalState)
    assert state.up and state.remote_in_flight(U1) == 0
    assert isinstance(state.rate_limiter(lambda: RateLimitsConfig()), LocalRateLimiter)


def test_redis_url_selects_the_redis_backend() -> None:
    state = shared_state_for(lambda: RedisConfig(url="redis://127.0.0.1:1/0"))
    assert isinstance(state, RedisState)
    assert isinstance(
        state.rate_limiter(lambda: RateLimitsConfig(requests_per_min=1)), LeasedRateLimiter
    )
    assert math.isclose(batch_size(1), 1.0)


# ---------------------------------------------------------------------------- the fleet glue


class Recorder:
    """A ``SharedState`` stand-in that records what the fleet publishes."""

    instance = "me"
    up = True

    def __init__(self) -> None:
        self.published: list[ReplicaRecord] = []

    def publish(self, record: ReplicaRecord) -> None:
        self.published.append(record)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fleet_view(*urls: str) -> tuple[Fleet, FleetView, Recorder, Metrics, Clock]:
    policy = build_policy({"pools": {"p": {"replicas": [{"url": u} for u in urls]}},
                           "lanes": [{"name": "all", "pool": "p"}]})  # fmt: skip
    metrics, clock = Metrics(), Clock()
    fleet = Fleet(policy, {}, metrics=metrics, clock=clock)
    recorder = Recorder()
    view = FleetView(fleet, recorder)  # type: ignore[arg-type]
    return fleet, view, recorder, metrics, clock


def test_fleet_transitions_are_published_with_wall_clock_end() -> None:
    fleet, _, rec, _, clock = fleet_view(U1)
    r = fleet.find(U1)[0]
    fleet.operator_eject(r)
    assert rec.published[-1].state == "ejected" and rec.published[-1].until is None
    fleet.operator_readmit(r, force=True)
    assert rec.published[-1].state == "healthy"
    fleet._eject(r, EjectReason.STALL, clock(), "test")
    last = rec.published[-1]
    assert last.reason == "stall" and last.ejections == 2 and last.level == 1
    assert (
        last.until is not None and abs(last.until - (time.time() + r.ejected_until - clock())) < 0.1
    )


def test_remote_record_is_applied_without_echo_or_metrics() -> None:
    fleet, view, rec, metrics, clock = fleet_view(U1, U2)
    r = fleet.find(U1)[0]
    fleet.operator_readmit(r, force=True)
    rec.published.clear()
    until = time.time() + 30
    assert view.apply(
        ReplicaRecord("p", U1, "ejected", "stall", until, ejections=4, level=2, instance="x")
    )
    assert r.state is ReplicaState.EJECTED and r.reason is EjectReason.STALL
    assert r.ejections == 4 and r.backoff_level == 2
    assert abs(r.ejected_until - (clock() + 30)) < 0.1
    assert rec.published == []  # not shared back
    labels = {"pool": "p", "replica": r.name, "reason": "stall"}
    assert metrics.registry.get_sample_value("tokenlane_ejections_total", labels) in (None, 0.0)
    fleet.tick(r, clock() + 31)  # the shared end time is honoured locally
    assert r.state is ReplicaState.PROBING
    view.apply(ReplicaRecord("p", U1, "healthy", instance="x"))  # another instance's canary
    assert r.state is ReplicaState.HEALTHY
    view.apply(ReplicaRecord("p", U1, "ejected", "operator", None, ejections=5, instance="x"))
    assert r.state is ReplicaState.EJECTED and math.isinf(r.ejected_until)
    assert not view.apply(ReplicaRecord("q", U1, "healthy"))  # no such replica here (yet)


def test_reload_transitions_are_not_shared() -> None:
    fleet, _, rec, _, _ = fleet_view(U1, U2)
    r2 = fleet.find(U2)[0]
    r2.in_flight = 1  # still busy: it drains after leaving the policy
    policy = build_policy({"pools": {"p": {"replicas": [{"url": U1}]}},
                           "lanes": [{"name": "all", "pool": "p"}]})  # fmt: skip
    fleet.apply(policy)
    assert r2.state is ReplicaState.DRAINING and rec.published == []


def test_fleet_view_reports_in_flight_and_takes_remote_load() -> None:
    fleet, view, _, _, _ = fleet_view(U1, U2)
    r1 = fleet.find(U1)[0]
    r1.in_flight = 3
    assert view.in_flight() == {U1: 3}
    view.remote_load({U1: 4})
    assert r1.remote_in_flight == 4 and fleet.find(U2)[0].remote_in_flight == 0
    assert r1.load == 7  # stats never scraped: waiting 0
    assert [x.url for x in view.records()] == [U1, U2]


def test_fleet_view_counts_a_leaving_replicas_in_flight_once() -> None:
    fleet, view, _, _, _ = fleet_view(U1, U2)
    r2 = fleet.find(U2)[0]
    r2.in_flight = 2  # still busy when a reload removes it: it drains
    policy = build_policy({"pools": {"p": {"replicas": [{"url": U1}]}},
                           "lanes": [{"name": "all", "pool": "p"}]})  # fmt: skip
    fleet.apply(policy)
    assert r2 in fleet.leaving
    assert view.in_flight() == {U2: 2}


# ---------------------------------------------------------------------------- stored responses


async def test_a_stored_responses_home_learned_by_one_instance_is_found_by_the_other(
    redis_server: RedisServer,
) -> None:
    from proxy.relay.homes import ResponseHomes

    async with (
        instance(redis_server, name="a") as (a, _),
        instance(redis_server, name="b") as (
            b,
            _,
        ),
    ):
        homes_a = ResponseHomes(shared=a, ttl_s=60)
        homes_b = ResponseHomes(shared=b, ttl_s=60)
        assert await homes_b.lookup("resp_1") is None  # nobody knows it yet
        homes_a.remember("resp_1", U1)
        # Written in the background: b finds it once a's write loop has run.
        found: list[str | None] = []

        async def b_finds_it() -> bool:
            found.append(await homes_b.lookup("resp_1"))
            return found[-1] == U1

        await wait_until(b_finds_it, what="b found a's response home")
        assert homes_b.home_of("resp_1") == U1  # kept locally from then on
        ttl = await a._redis.ttl("tokenlane:resp:resp_1")
        assert 0 < ttl <= 60
    async with instance(redis_server, name="c") as (c, _):
        redis_server.kill()
        # A lookup while Redis is gone (breaker closed or open): a miss, never an error.
        assert await ResponseHomes(shared=c).lookup("resp_1") is None


async def test_a_cache_aware_placement_reaches_the_other_instance_and_not_its_maker(
    redis_server: RedisServer,
) -> None:
    """Placements go over pub/sub, batched, with 64-bit hashes intact; the maker ignores its
    own. While Redis is down placements are dropped, not queued without bound."""
    big = [2**64 - 1, 0, 12345678901234567890]
    async with instance(redis_server, name="a") as (a, view_a):
        async with instance(redis_server, name="b") as (b, view_b):
            subscribed = lambda: subscribers(redis_server, "tokenlane:placed") >= 2  # noqa: E731
            await wait_until(subscribed, what="both subscribed")
            a.share_placement("p", U1, big)
            a.share_placement("p", U2, [7])
            await wait_until(lambda: len(view_b.placements) == 2, what="b learned both")
            assert view_b.placements == [("p", U1, big), ("p", U2, [7])]
            b.share_placement("p", U2, [8])  # a hears b's: proof a's subscription works
            await wait_until(lambda: view_a.placements, what="a learned b's placement")
            assert view_a.placements == [("p", U2, [8])]  # and never its own
        redis_server.kill()
        await wait_until(lambda: not a.up, what="a saw Redis go")
        for i in range(5000):
            a.share_placement("p", U1, [i])
        assert a._placements == []  # nothing kept while down

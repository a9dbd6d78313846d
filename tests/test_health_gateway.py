"""Health through the whole gateway, over real sockets, under streaming load on 3 simulated
replicas: a stall is ejected in time and costs the clients nothing that had not started
streaming; error bursts and silent first tokens eject with their reasons; nothing hangs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from loadtest.bench_stall import Sent, analyse, closed_loop, send_one
from loadtest.client import LoadClient
from loadtest.sim.server import Sim, run_sim
from loadtest.stats import OK
from proxy.edge.routes import GatewayApp
from proxy.fleet.fleet import EjectReason, Replica, ReplicaState

from .gateway import policy_for, running_gateway
from .waiting import wait_until

# Probe and canary timeouts, and the stall detector, far above the pauses of a loaded machine:
# a good replica must not fail a probe, or look stalled, because the test process (gateway,
# simulators and clients in one loop) stalled. The stall test sets its own stall_after_s.
HEALTH = {
    "interval_s": 0.2,
    "timeout_s": 2.0,
    "stall_after_s": 5.0,
    "eject_base_s": 30.0,
    "canary_timeout_s": 3.0,
}


@contextlib.asynccontextmanager
async def fleet_of_three(
    health: dict[str, Any] | None = None,
    lane: dict[str, Any] | None = None,
    balance: str = "least_loaded",
    retry: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[list[Sim], str, GatewayApp]]:
    async with contextlib.AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(run_sim(name=f"sim{i}")) for i in range(3)]
        data = policy_for(
            {"p": [s.url for s in sims]},
            balance=balance,
            lanes=[{"name": "all", "pool": "p", **(lane or {})}],
            health={**HEALTH, **(health or {})},
            retry=retry or {},
        )
        url, app = await stack.enter_async_context(running_gateway(data))
        yield sims, url, app


def replica_of(app: GatewayApp, sim: Sim) -> Replica:
    return app.gateway.fleet.find(sim.url)[0]


async def until_state(r: Replica, state: ReplicaState) -> float:
    """When (monotonic) ``r`` is in ``state``."""
    await wait_until(lambda: r.state is state, what=f"{r.name} {state.value}")
    return time.monotonic()


def served_since(sent: list[Sent], since: float) -> int:
    """Requests sent at or after ``since`` (monotonic) that have ended well."""
    return sum(
        1 for s in sent if s.at >= since and s.done_at is not None and s.result.outcome == OK
    )


async def until_served(sent: list[Sent], n: int, since: float = 0.0) -> None:
    """Until ``n`` requests sent since ``since`` have ended well: the load is flowing (rather
    than sleeping for a time a loaded machine may spend on something else)."""
    await wait_until(lambda: served_since(sent, since) >= n, what=f"{n} requests served")


async def burst(url: str, n: int, out: list[Sent], max_tokens: int = 24) -> None:
    """``n`` streaming requests sent at once, recorded in ``out`` like the load's."""
    async with LoadClient(url, timeout_s=30, max_connections=n) as client:
        await asyncio.gather(*(send_one(client, out, max_tokens) for _ in range(n)))


class ScrapesAtEjection(logging.Handler):
    """How many ``/metrics`` scrapes ``sim`` had answered when its replica was ejected (read
    as the fleet logs the move, not when the test next looks)."""

    def __init__(self, replica: Replica, sim: Sim) -> None:
        super().__init__(logging.INFO)
        self.replica, self.sim = replica, sim
        self.seen: int | None = None
        self.logger = logging.getLogger("tokenlane.health")

    def scrapes(self) -> int:
        return self.sim.stats()["requests_by_path"].get("/metrics", 0)

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "to_state", None) == "ejected" and self.seen is None:
            if getattr(record, "replica", None) == self.replica.name:
                self.seen = self.scrapes()

    async def __aenter__(self) -> ScrapesAtEjection:
        self.level = self.logger.level
        self.logger.addHandler(self)
        self.logger.setLevel(logging.INFO)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


@contextlib.asynccontextmanager
async def load(url: str, workers: int = 9, max_tokens: int = 24) -> AsyncIterator[list[Sent]]:
    """Closed-loop streaming clients for the duration of the block; on exit every request must
    end within 15 s (a hang fails the test)."""
    stop, sent = asyncio.Event(), []
    task = asyncio.create_task(closed_loop(url, workers, max_tokens, stop, sent, timeout_s=30))
    try:
        yield sent
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def test_stalled_replica_is_ejected_in_time_and_its_waiting_requests_finish_elsewhere() -> (
    None
):
    # First-token timeouts far away: only the stall detector and the rescue hook can act.
    lane = {"first_token_timeout_s": 30, "stream_idle_timeout_s": 30}
    # stall_after_s 2: the requests sent at the stall reach the replica well before it is out.
    health = {"stall_after_s": 2.0}
    # Round robin keeps sending the stalled replica its share until the ejection: there are
    # always requests to rescue (least_loaded would steer away from its growing in-flight).
    async with fleet_of_three(health, lane=lane, balance="round_robin") as (sims, url, app):
        stalled = replica_of(app, sims[0])
        at_ejection = ScrapesAtEjection(stalled, sims[0])
        async with load(url) as sent, at_ejection:
            # Every replica serves (round robin), the stalled one with requests in its engine.
            await until_served(sent, 9)
            await wait_until(lambda: sims[0].engine.num_running > 0, what="sim0 generating")
            stalled_at = time.monotonic()
            await sims[0].set_fault({"fault": "stall"})
            stalled_wall = time.time()  # requests arriving from now on never see a token
            scrapes_at_stall = at_ejection.scrapes()
            # Three requests at once, however slow the load runs: round robin hands one of any
            # three in a row to the stalled replica, so some arrive there while it is stalled.
            extra = asyncio.create_task(burst(url, 3, sent))
            ejected_at = await until_state(stalled, ReplicaState.EJECTED)
            assert stalled.reason is EjectReason.STALL
            # The other two carry on: requests sent after the ejection are served.
            await until_served(sent, 9, since=ejected_at)
            await asyncio.wait_for(extra, 30)
        ejected_wall = stalled.changed_at
        assert ejected_wall is not None
        waiting = [
            e
            for e in sims[0].requests("/v1/chat/completions")
            if stalled_wall < e["arrived_at"] < ejected_wall
        ]
        report = analyse(
            sent,
            stalled_replica=stalled.name,
            stalled_at=stalled_at,
            ejected_at=ejected_at,
            ejected_wall=ejected_wall,
            reason=stalled.reason.value,
            stalled_log=sims[0].requests(),
        )
        retried = app.gateway.metrics.registry.get_sample_value(
            "tokenlane_retries_total", {"lane": "all", "reason": "replica_ejected"}
        )
    # In time: stall_after_s (2 s) is measured on the scrapes' clock, so counted in scrapes
    # (interval 0.2 s) it holds however long a loaded machine takes for each: about 10, and
    # the first scrape after the stall may still see a token move.
    assert at_ejection.seen is not None
    assert at_ejection.seen - scrapes_at_stall <= 2.0 / 0.2 + 3, (report, at_ejection.seen)
    assert report.failed_not_streaming == 0, report
    assert report.failed_mid_stream_elsewhere == 0, report
    assert report.unfinished == 0
    assert report.to_stalled_after_ejection == 0, report
    # Requests that reached the stalled replica after the stall (the engine never saw them)
    # were each moved elsewhere by the ejection.
    assert waiting and (retried or 0) >= len(waiting), (len(waiting), retried)


async def test_replica_answering_503_is_ejected_for_consecutive_failures_and_readmitted() -> None:
    health = {"consecutive_failures": 3, "eject_base_s": 0.5, "eject_max_s": 1.0}
    # Every 503 is retried; at 6 workers more than the default budget's 3 retries can be in
    # flight at once on a loaded machine, and the budget rightly answers 502 then. This test
    # is about ejection and readmission, so the budget is out of its way.
    async with fleet_of_three(health, retry={"budget_ratio": 1.0}) as (sims, url, app):
        bad = replica_of(app, sims[0])
        async with load(url, workers=6) as sent:
            await until_served(sent, 6)
            # No duration_s: the test lifts the fault once it has seen what it is about.
            await sims[0].set_fault({"fault": "error_rate", "rate": 1.0, "status": 503})
            try:
                await until_state(bad, ReplicaState.EJECTED)
                assert bad.reason is EjectReason.CONSECUTIVE_FAILURES
                # Its ejection ran out and a canary met the 503: ejected again.
                await wait_until(lambda: bad.ejections >= 2, what="a canary failed")
                assert bad.state is not ReplicaState.HEALTHY
            finally:
                lifted_wall = time.time()
                await sims[0].set_fault(None)
            await until_state(bad, ReplicaState.HEALTHY)
            assert (bad.changed_at or 0) >= lifted_wall  # readmitted only once lifted
    # 503 before anything was sent is retried elsewhere, and a request that raced a good
    # replica closing an idle pooled connection (its keep-alive ran out across a pause of this
    # process) is sent again on a new one: no client saw an error.
    failed = [s.result.error or "" for s in sent if s.result.outcome != OK]
    assert failed == [], failed[:3]


async def test_silent_first_tokens_eject_for_first_token_timeout() -> None:
    # The stall detector is out of reach (60 s): the relay's first-token timeouts, backed by
    # the replica's flat counters, must eject it. The timeouts are the subject, yet above the
    # pauses of a loaded machine: a healthy replica's first token may come a second late.
    lane = {"first_token_timeout_s": 3.0, "stream_idle_timeout_s": 4.0}
    # The silent replica's waiting requests all time out together and are retried: more than
    # the default budget's 3 may be in flight, and this test is not about the budget.
    retry = {"budget_ratio": 1.0}
    async with fleet_of_three({"stall_after_s": 60}, lane, retry=retry) as (sims, url, app):
        silent = replica_of(app, sims[0])
        async with load(url) as sent:
            await until_served(sent, 9)
            await sims[0].set_fault({"fault": "stall"})
            ejected_at = await until_state(silent, ReplicaState.EJECTED)
            await until_served(sent, 9, since=ejected_at)
    assert silent.reason in (EjectReason.FIRST_TOKEN_TIMEOUT, EjectReason.SILENT_STREAM)
    failed = [s.result for s in sent if s.result.outcome != OK]
    # Only streams already flowing from the stalled replica may fail.
    assert all(r.content_chunks > 0 for r in failed), [r.error for r in failed][:3]


@pytest.mark.parametrize(
    "fault", [{"fault": "refuse"}, {"fault": "crash"}], ids=lambda f: f["fault"]
)
async def test_unreachable_replica_under_load_is_ejected_and_clients_are_served(fault) -> None:
    # A crash resets the requests it held after they were sent: retried only on opt-in
    # (docs/http.md, "Retries, as the client sees them"), which this test takes to see them all served. Every refused connect is
    # retried too, and on a loaded machine more than the default budget's 3 retries can be in
    # flight at once (the budget rightly answers 502 then): out of this test's way.
    retry: dict[str, Any] = {"budget_ratio": 1.0}
    if fault["fault"] == "crash":
        retry["on_5xx_after_send"] = True
    health = {"eject_base_s": 0.5, "eject_max_s": 1.0}
    async with fleet_of_three(health, retry=retry) as (sims, url, app):
        dead = replica_of(app, sims[0])
        async with load(url, workers=6) as sent:
            await until_served(sent, 6)
            # No duration_s: the test lifts the fault once the replica is out.
            await sims[0].set_fault(fault)
            try:
                await until_state(dead, ReplicaState.EJECTED)
                assert dead.reason in (EjectReason.HEALTH_CHECK, EjectReason.CONSECUTIVE_FAILURES)
                # Its ejection runs out and the probes find the port still dead: it stays out.
                await until_state(dead, ReplicaState.PROBING)
                fails = dead.health_fails_in_row
                await wait_until(lambda: dead.health_fails_in_row > fails, what="a failed probe")
                assert dead.state is ReplicaState.PROBING
            finally:
                lifted_wall = time.time()
                await sims[0].set_fault(None)
            await until_state(dead, ReplicaState.HEALTHY)
            assert (dead.changed_at or 0) >= lifted_wall  # readmitted only once lifted
    failed = [s.result for s in sent if s.result.outcome != OK]
    # Connects refused and (opted in) resets are retried, and a request sent on a pooled
    # connection that the refusing replica closed under it is sent again: only streams cut
    # mid-way by the crash may fail.
    assert all(r.content_chunks > 0 for r in failed), [r.error for r in failed][:3]

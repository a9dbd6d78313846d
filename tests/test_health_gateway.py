"""Health through the whole gateway, over real sockets, under streaming load on 3 simulated
replicas: a stall is ejected in time and costs the clients nothing that had not started
streaming; error bursts and silent first tokens eject with their reasons; nothing hangs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from loadtest.bench_stall import Sent, analyse, closed_loop
from loadtest.sim.server import Sim, run_sim
from loadtest.stats import OK
from proxy.edge.routes import GatewayApp
from proxy.fleet.fleet import EjectReason, Replica, ReplicaState

from .gateway import policy_for, running_gateway
from .waiting import wait_until

HEALTH = {
    "interval_s": 0.2,
    "timeout_s": 0.5,
    "stall_after_s": 1.0,
    "eject_base_s": 30.0,
    "canary_timeout_s": 1.0,
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
    # Round robin keeps sending the stalled replica its share until the ejection: there are
    # always requests to rescue (least_loaded would steer away from its growing in-flight).
    async with fleet_of_three(lane=lane, balance="round_robin") as (sims, url, app):
        stalled = replica_of(app, sims[0])
        async with load(url) as sent:
            await asyncio.sleep(1.0)
            stalled_at = time.monotonic()
            await sims[0].set_fault({"fault": "stall"})
            ejected_at = await until_state(stalled, ReplicaState.EJECTED)
            assert stalled.reason is EjectReason.STALL
            await asyncio.sleep(1.5)
        ejected_wall = stalled.changed_at
        assert ejected_wall is not None
        stalled_wall = ejected_wall - (ejected_at - stalled_at)
        waiting = [
            e
            for e in sims[0].requests("/v1/chat/completions")
            if stalled_wall + 0.05 < e["arrived_at"] < ejected_wall
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
    # Target stall_after_s + interval_s = 1.2 s; the slack is for a loaded 2-core box.
    assert report.time_to_ejection_s <= 1.2 + 1.0, report
    assert report.failed_not_streaming == 0, report
    assert report.failed_mid_stream_elsewhere == 0, report
    assert report.unfinished == 0
    assert report.to_stalled_after_ejection == 0, report
    # Requests that reached the stalled replica after the stall (the engine never saw them)
    # were each moved elsewhere by the ejection.
    assert waiting and (retried or 0) >= len(waiting), (len(waiting), retried)
    assert sum(1 for s in sent if s.result.outcome == OK) > 50


async def test_replica_answering_503_is_ejected_for_consecutive_failures_and_readmitted() -> None:
    health = {"consecutive_failures": 3, "eject_base_s": 0.5, "eject_max_s": 1.0}
    # Every 503 is retried; at 6 workers more than the default budget's 3 retries can be in
    # flight at once on a loaded machine, and the budget rightly answers 502 then. This test
    # is about ejection and readmission, so the budget is out of its way.
    async with fleet_of_three(health, retry={"budget_ratio": 1.0}) as (sims, url, app):
        bad = replica_of(app, sims[0])
        async with load(url, workers=6) as sent:
            await asyncio.sleep(0.5)
            set_at = time.monotonic()
            await sims[0].set_fault(
                {"fault": "error_rate", "rate": 1.0, "status": 503, "duration_s": 2.0}
            )
            await until_state(bad, ReplicaState.EJECTED)
            assert bad.reason is EjectReason.CONSECUTIVE_FAILURES
            back_at = await until_state(bad, ReplicaState.HEALTHY)
            await asyncio.sleep(0.3)
    assert back_at >= set_at + 2.0  # canaries failed while the fault held
    # 503 before anything was sent is retried elsewhere: no client saw an error.
    assert all(s.result.outcome == OK for s in sent), [
        s.result.error for s in sent if s.result.outcome != OK
    ][:3]


async def test_silent_first_tokens_eject_for_first_token_timeout() -> None:
    # The stall detector is out of reach (60 s): the relay's first-token timeouts, backed by
    # the replica's flat counters, must eject it.
    lane = {"first_token_timeout_s": 0.6, "stream_idle_timeout_s": 1.0}
    async with fleet_of_three({"stall_after_s": 60}, lane) as (sims, url, app):
        silent = replica_of(app, sims[0])
        async with load(url) as sent:
            await asyncio.sleep(0.8)
            await sims[0].set_fault({"fault": "stall"})
            await until_state(silent, ReplicaState.EJECTED)
            await asyncio.sleep(0.5)
    assert silent.reason in (EjectReason.FIRST_TOKEN_TIMEOUT, EjectReason.SILENT_STREAM)
    failed = [s.result for s in sent if s.result.outcome != OK]
    # Only streams already flowing from the stalled replica may fail.
    assert all(r.content_chunks > 0 for r in failed), [r.error for r in failed][:3]


@pytest.mark.parametrize(
    "fault", [{"fault": "refuse"}, {"fault": "crash"}], ids=lambda f: f["fault"]
)
async def test_unreachable_replica_under_load_is_ejected_and_clients_are_served(fault) -> None:
    # A crash resets the requests it held after they were sent: retried only on opt-in
    # (RELIABILITY 6), which this test takes to see them all served.
    retry = {"on_5xx_after_send": True} if fault["fault"] == "crash" else None
    health = {"eject_base_s": 0.5, "eject_max_s": 1.0}
    async with fleet_of_three(health, retry=retry) as (sims, url, app):
        dead = replica_of(app, sims[0])
        async with load(url, workers=6) as sent:
            await asyncio.sleep(0.5)
            set_at = time.monotonic()
            await sims[0].set_fault({**fault, "duration_s": 1.5})
            await until_state(dead, ReplicaState.EJECTED)
            assert dead.reason in (EjectReason.HEALTH_CHECK, EjectReason.CONSECUTIVE_FAILURES)
            back_at = await until_state(dead, ReplicaState.HEALTHY)
    assert back_at >= set_at + 1.5  # readmitted only once the fault lifted
    failed = [s.result for s in sent if s.result.outcome != OK]
    # Connects refused and (opted in) resets are retried; only streams cut mid-way by the crash
    # may fail.
    assert all(r.content_chunks > 0 for r in failed), [r.error for r in failed][:3]

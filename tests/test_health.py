"""The health loop against simulated vLLM replicas over real sockets: canary admission, each
fault ending in ejection with its reason, readmission only after the fault lifts, and a hung
replica delaying nobody else's probes."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from loadtest.sim.server import Sim, run_sim
from proxy.fleet.fleet import EjectReason, Fleet, Replica, ReplicaState
from proxy.fleet.health import HealthMonitor
from proxy.observe.metrics import Metrics
from proxy.policyfile import build_policy
from proxy.relay.upstream import UpstreamClient, make_client

from .lost_cancel import LostCancel, ended_in_time
from .waiting import wait_until

# Probe and canary timeouts far above the pauses a loaded machine takes (a good replica must
# not fail a probe because the test process stalled); the faults below fail them for real.
HEALTH = {
    "interval_s": 0.1,
    "timeout_s": 2.0,
    "stall_after_s": 1.0,
    "unhealthy_threshold": 2,
    "eject_base_s": 0.5,
    "eject_max_s": 2.0,
    "canary_timeout_s": 3.0,
    "max_ejected_percent": 100,
}


@dataclass
class Transition:
    at: float  # monotonic
    replica: str
    from_state: str
    to_state: str
    reason: str | None


class Recorder(logging.Handler):
    """Every state change the fleet logs, with its structured fields."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[Transition] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "to_state"):
            self.seen.append(
                Transition(
                    time.monotonic(),
                    record.replica,
                    record.from_state,
                    record.to_state,
                    record.reason,
                )
            )

    def of(self, replica: Replica) -> list[Transition]:
        return [t for t in self.seen if t.replica == replica.name]


@pytest.fixture
def transitions() -> AsyncIterator[Recorder]:
    logger = logging.getLogger("tokenlane.health")
    recorder, level = Recorder(), logger.level
    logger.addHandler(recorder)
    logger.setLevel(logging.INFO)
    yield recorder
    logger.removeHandler(recorder)
    logger.setLevel(level)


@contextlib.asynccontextmanager
async def sims(n: int) -> AsyncIterator[list[Sim]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(run_sim(name=f"sim{i}")) for i in range(n)]


@contextlib.asynccontextmanager
async def monitored(urls: list[str], **health: Any) -> AsyncIterator[Fleet]:
    fleet, client, monitor = unstarted(*urls, **health)
    await monitor.start()
    try:
        yield fleet
    finally:
        await monitor.stop()
        await client.aclose()


def unstarted(*urls: str, **health: Any) -> tuple[Fleet, UpstreamClient, HealthMonitor]:
    """A fleet of the replicas at ``urls`` (``health`` over ``HEALTH``), its client and a
    monitor not yet started; the caller starts it or calls its parts, and closes the client."""
    policy = build_policy(
        {
            "pools": {"p": {"replicas": [{"url": u} for u in urls]}},
            "lanes": [{"name": "all", "pool": "p"}],
            "health": {**HEALTH, **health},
        }
    )
    metrics = Metrics()
    fleet = Fleet(policy, {}, metrics=metrics)
    client = make_client(policy)
    return fleet, client, HealthMonitor(fleet, lambda: policy, client, metrics)


async def stream_load(sim: Sim, n: int) -> list[asyncio.Task[None]]:
    """``n`` long streams running on ``sim`` (so it has running > 0); returns once they run."""

    async def one(client: httpx.AsyncClient) -> None:
        body = {
            "model": "Qwen/Qwen2.5-0.5B-Instruct",
            "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 20000,
            "stream": True,
        }
        async with client.stream("POST", sim.url + "/v1/chat/completions", json=body) as resp:
            async for _ in resp.aiter_raw():
                pass

    client = httpx.AsyncClient(timeout=60)
    tasks = [asyncio.create_task(one(client)) for _ in range(n)]
    tasks.append(asyncio.create_task(_close_when_done(client, tasks[:])))
    await wait_until(lambda: sim.engine.num_running >= n, what="load running")
    return tasks


async def _close_when_done(client: httpx.AsyncClient, tasks: list[asyncio.Task[None]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.aclose()


def canaries(sim: Sim) -> list[dict[str, Any]]:
    return [
        r for r in sim.requests("/v1/completions") if r["headers"].get("x-tokenlane-canary") == "1"
    ]


# ---------------------------------------------------------------------------- admission


async def test_health_admits_each_replica_after_its_canary(transitions: Recorder) -> None:
    async with sims(2) as (a, b), monitored([a.url, b.url]) as fleet:
        ra, rb = fleet.replicas()
        await wait_until(lambda: ra.state is rb.state is ReplicaState.HEALTHY, what="both healthy")
        assert fleet.models().keys() == {"Qwen/Qwen2.5-0.5B-Instruct"}
        assert len(canaries(a)) == 1 and len(canaries(b)) == 1
        assert canaries(a)[0]["body"]["max_tokens"] == 1
        assert [(t.from_state, t.to_state) for t in transitions.of(ra)] == [("probing", "healthy")]
        assert not ra.stats.stale and ra.stats.at is not None


# ---------------------------------------------------------------------------- stall


async def test_health_ejects_stalled_replica_and_readmits_only_after_lift(
    transitions: Recorder,
) -> None:
    async with sims(1) as (sim,), monitored([sim.url]) as fleet:
        (r,) = fleet.replicas()
        await wait_until(lambda: r.state is ReplicaState.HEALTHY, what="healthy")
        load = await stream_load(sim, 3)
        try:
            stalled_at = time.monotonic()
            await sim.set_fault({"fault": "stall"})
            await wait_until(lambda: r.state is ReplicaState.EJECTED, what="ejected")
            ejected_at = time.monotonic()
            assert r.reason is EjectReason.STALL
            # stall_after_s 1 + interval_s 0.1 is the target; 3x absorbs a loaded CI box.
            assert ejected_at - stalled_at < 3 * 1.1
            # Stalled, its canaries time out: out it stays, through probing and back.
            await wait_until(
                lambda: any(t.reason == "canary_failed" for t in transitions.of(r)),
                what="a canary failed while stalled",
            )
            assert r.state is not ReplicaState.HEALTHY
            lifted_at = time.monotonic()
            await sim.set_fault(None)
            await wait_until(lambda: r.state is ReplicaState.HEALTHY, what="readmitted after lift")
        finally:
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
    healthy = [t.at for t in transitions.of(r) if t.to_state == "healthy"]
    assert len(healthy) == 2 and stalled_at < lifted_at < healthy[1]


async def test_idle_replica_with_frozen_counters_is_not_a_stall() -> None:
    async with sims(1) as (sim,), monitored([sim.url]) as fleet:
        (r,) = fleet.replicas()
        await wait_until(lambda: r.state is ReplicaState.HEALTHY, what="healthy")
        await sim.set_fault({"fault": "stall"})  # nothing running: nothing to stall
        frozen_at = time.monotonic()
        scrapes = sim.stats()["requests_by_path"].get("/metrics", 0)
        # The detector judged the frozen counters well past stall_after_s (1 s), over many
        # scrapes: proof it had every chance to call this a stall.
        await wait_until(
            lambda: (
                time.monotonic() - frozen_at > 2.0
                and sim.stats()["requests_by_path"].get("/metrics", 0) >= scrapes + 15
            ),
            what="15 scrapes over 2 s of frozen counters",
        )
        assert r.state is ReplicaState.HEALTHY


# ---------------------------------------------------------------------------- faults


@pytest.mark.parametrize(
    "fault",
    [
        {"fault": "health_fail", "status": 503},
        {"fault": "refuse"},
        {"fault": "hang_accept"},
        {"fault": "crash"},
    ],
    ids=lambda f: f["fault"],
)
async def test_fault_ejects_for_health_check_and_lifts_to_readmission(
    fault: dict[str, Any], transitions: Recorder
) -> None:
    async with sims(1) as (sim,), monitored([sim.url]) as fleet:
        (r,) = fleet.replicas()
        await wait_until(lambda: r.state is ReplicaState.HEALTHY, what="healthy")
        set_at = time.monotonic()
        # No duration_s: the test lifts the fault once it has seen the replica held out.
        await sim.set_fault(fault)
        try:
            await wait_until(lambda: r.state is ReplicaState.EJECTED, what="ejected")
            assert r.reason is EjectReason.HEALTH_CHECK
            # Its ejection runs out and the probes find the fault still there: it stays out.
            await wait_until(lambda: r.state is ReplicaState.PROBING, what="ejection over")
            fails = r.health_fails_in_row
            await wait_until(lambda: r.health_fails_in_row > fails, what="a failed probe")
            assert r.state is ReplicaState.PROBING
        finally:
            lifted_at = time.monotonic()
            await sim.set_fault(None)
        await wait_until(lambda: r.state is ReplicaState.HEALTHY, what="readmitted after the fault")
    # Never back in while the fault held (a canary cannot pass a dead port or a failing /health).
    back = [t.at for t in transitions.of(r) if t.to_state == "healthy" and t.at > set_at]
    assert back and min(back) >= lifted_at


async def test_hang_accept_delays_no_other_replicas_probes() -> None:
    async with sims(3) as (hung, b, c), monitored([hung.url, b.url, c.url]) as fleet:
        rh, rb, rc = fleet.replicas()
        await wait_until(
            lambda: all(r.state is ReplicaState.HEALTHY for r in (rh, rb, rc)), what="healthy"
        )

        def probes() -> list[int]:
            return [s.stats()["requests_by_path"].get("/health", 0) for s in (b, c)]

        await hung.set_fault({"fault": "hang_accept"})  # lifted below, not by a timer
        try:
            # A round of the hung replica ends only when its probes time out (timeout_s 2).
            await wait_until(lambda: rh.health_fails_in_row >= 1, what="a hung probe timed out")
            hung_rounds, before = rh.health_fails_in_row, probes()
            await wait_until(
                lambda: all(n >= m + 10 for n, m in zip(probes(), before, strict=True)),
                what="10 more probes of each other replica",
            )
            hung_rounds = rh.health_fails_in_row - hung_rounds
            assert rh.stats.stale and rh.load >= rh.max_in_flight  # stale counts as busy
            assert rb.state is rc.state is ReplicaState.HEALTHY
        finally:
            await hung.set_fault(None)
    # Counts, not times: at interval 0.1 s the others' 10 probes take ~1 s, within one hung
    # round of 2 s; probes waiting on the hung one would take a hung round each (10). The
    # slack is for pauses of a loaded machine, which end a hung round early by its timeout.
    assert hung_rounds <= 5, hung_rounds


async def test_replica_answering_garbage_instead_of_http_is_ejected() -> None:
    """A port that answers something other than HTTP (the replica died and another service took
    its port) must fail the probes like any other broken replica, not end each round in an
    unexpected exception that leaves the replica healthy and its stats fresh."""

    async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(4096)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(not_http, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    fleet, client, monitor = unstarted(url)
    (r,) = fleet.replicas()
    r.models = {"m": {"id": "m"}}
    fleet.observe_health(r, True, fleet.clock())
    fleet.canary_result(r, True, fleet.clock())  # it was a good replica until now
    fleet.observe_scrape(r, None, fleet.clock())
    r.stats.stale = False
    try:
        for rounds in range(1, HEALTH["unhealthy_threshold"] + 1):
            await monitor.probe_once(r, rounds)
        assert r.stats.stale
        assert (r.state, r.reason) == (ReplicaState.EJECTED, EjectReason.HEALTH_CHECK)
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_probes_stop_once_a_removed_replica_has_drained() -> None:
    async with sims(2) as (kept, gone):
        policy = build_policy(
            {
                "pools": {"p": {"replicas": [{"url": kept.url}, {"url": gone.url}]}},
                "lanes": [{"name": "all", "pool": "p"}],
                "health": HEALTH,
            }
        )
        current = policy
        metrics = Metrics()
        fleet = Fleet(policy, {}, metrics=metrics)
        client = make_client(policy)
        monitor = HealthMonitor(fleet, lambda: current, client, metrics)
        await monitor.start()
        try:
            _, rg = fleet.replicas()
            loop_of_gone = monitor._tasks[rg]
            fleet.attempt_started(rg)  # a request still running when the reload removes it
            current = build_policy(
                {
                    "pools": {"p": {"replicas": [{"url": kept.url}]}},
                    "lanes": [{"name": "all", "pool": "p"}],
                    "health": HEALTH,
                }
            )
            fleet.apply(current)  # it drains: still in the fleet, still probed
            monitor.replicas_changed()
            fleet.attempt_finished(rg, None)  # drained: it leaves the fleet
            assert rg not in set(fleet.replicas())
            # Its loop ends itself after the round under way (whose probes may still land).
            await wait_until(loop_of_gone.done, what="the removed replica's probe loop ended")
            probes = gone.stats()["requests_by_path"].get("/health", 0)

            def kept_probes() -> int:
                return kept.stats()["requests_by_path"].get("/health", 0)

            # Six more rounds of the kept replica: the gone one had the time for six too.
            kept_before = kept_probes()
            await wait_until(lambda: kept_probes() >= kept_before + 6, what="6 rounds")
            assert gone.stats()["requests_by_path"].get("/health", 0) == probes
        finally:
            await monitor.stop()
            await client.aclose()


async def test_probes_leave_no_reference_cycles() -> None:
    """The gateway raises the cycle collector's threshold (``edge/serve.py``), so garbage
    that only the collector frees piles up between its passes: a probe (health, metrics,
    models, canary) must leave none. ``AsyncClient.get`` left one response-stream cycle each."""
    async with sims(1) as (sim,):
        fleet, client, monitor = unstarted(sim.url)
        (replica,) = fleet.replicas()
        try:
            await monitor.probe_once(replica, 0)  # pooled connections made, caches warm
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for _ in range(5):
                    await monitor.probe_once(replica, 0)  # round 0: the models are read too
                    good, detail = await monitor._canary(replica, HEALTH["canary_timeout_s"])
                    assert good, detail
                gc.collect()
                left = [
                    f"{type(o).__module__}.{type(o).__qualname__}"
                    for o in gc.garbage
                    if type(o).__module__.startswith(("httpx", "aiohttp", "proxy"))
                ]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
        finally:
            await client.aclose()
    assert left == []


async def test_a_probe_loop_whose_cancel_a_probe_swallowed_still_stops() -> None:
    # Python 3.11's ``asyncio.timeout`` may turn a cancel that lands as it expires into
    # TimeoutError, which a probe survives: the loop must still end at once, or ``stop``
    # waits on it for ever. Lose one cancel that way on purpose.
    async with sims(1) as (sim,):
        fleet, client, monitor = unstarted(sim.url)
        lost = LostCancel(TimeoutError)
        rounds_after = 0

        async def probe(replica: Replica, rounds: int) -> None:
            nonlocal rounds_after
            if lost.swallowed.is_set():
                rounds_after += 1  # a round the loop should not have begun
            await lost.wait()

        monitor.probe_once = probe  # type: ignore[method-assign]
        try:
            monitor.replicas_changed()
            (replica,) = fleet.replicas()
            loop_task = monitor._tasks[replica]
            await asyncio.wait_for(lost.entered.wait(), timeout=30)
            stopped = await ended_in_time(asyncio.create_task(monitor.stop()))
        finally:
            await client.aclose()
    assert lost.swallowed.is_set()
    assert stopped, "stop still waited on the probe loop after 30 s"
    assert loop_task.done() and loop_task.cancelled()
    assert rounds_after == 0

"""Several gateways, one view of the fleet (issue 7): two gateway instances over the same
simulated replicas and a real redis-server. Operator actions on one reach the other within 1 s;
a lost pub/sub message converges by reconcile; a SIGKILLed instance's in-flight counts leave the
others' view within TTL + heartbeat; Redis paused, killed and restarted under load costs no
request, and the instances converge afterwards; a client key's rate limit is one budget."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.client import LoadClient
from loadtest.sim.server import Sim, run_sim
from loadtest.sim.settings import SimSettings
from loadtest.stats import OK, RequestResult
from proxy.edge.routes import GatewayApp
from proxy.fleet.fleet import EjectReason, Replica, ReplicaState

from .gateway import gateway_process, policy_for, running_gateway
from .redis_server import RedisServer, running_redis
from .waiting import wait_until

pytestmark = pytest.mark.redis

API_KEY = "sk-shared-test"
# Short intervals so that the tests take seconds: TTL 1 s, heartbeat 0.2 s. The call bound is
# wide enough that a loaded machine's scheduling hiccup is not taken for Redis being down.
REDIS = {"timeout_ms": 2000, "heartbeat_s": 0.2, "ttl_s": 1.0}


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


def shared_policy(sims: list[Sim], redis_url: str, **sections: Any) -> dict[str, Any]:
    return policy_for(
        {"p": [s.url for s in sims]},
        balance="least_loaded",
        redis={"url": redis_url, **REDIS},
        **sections,
    )


@contextlib.asynccontextmanager
async def two_gateways(
    sims: list[Sim], redis_url: str, **sections: Any
) -> AsyncIterator[tuple[tuple[str, GatewayApp], tuple[str, GatewayApp]]]:
    data = shared_policy(sims, redis_url, **sections)
    environ = {"TOKENLANE_API_KEYS": API_KEY}
    async with running_gateway(data, environ=environ) as a, running_gateway(
        data, environ=environ
    ) as b:  # fmt: skip
        yield a, b


def replica(app: GatewayApp, sim: Sim) -> Replica:
    return app.gateway.fleet.find(sim.url)[0]


async def admin(gateway: str, action: str, **body: Any) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        resp = await client.post(f"{gateway}/admin/replicas/{action}", json=body)
        assert resp.status_code == 200, resp.text
        return dict(resp.json())


def chat(i: int, max_tokens: int = 16, stream: bool = True) -> bytes:
    return json.dumps(
        {
            "model": "Qwen/Qwen2.5-0.5B-Instruct",
            "messages": [{"role": "user", "content": f"request {i}"}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    ).encode()


@contextlib.asynccontextmanager
async def load(urls: list[str], workers: int = 3) -> AsyncIterator[list[RequestResult]]:
    """Closed-loop clients on every gateway (streamed and plain requests, with a client key so
    the shared rate limiter is on the path) until the block ends; then every request must end
    within 15 s."""
    stop, results = asyncio.Event(), []

    async def worker(client: LoadClient, n: int) -> None:
        while not stop.is_set():
            i = len(results)
            stream = i % 3 != 0
            result = RequestResult(
                index=i, cls="chat", stream=stream, prompt_tokens=0, max_tokens=16,
                scheduled_s=0.0,
            )  # fmt: skip
            results.append(result)
            await client.send("/v1/chat/completions", chat(i, stream=stream), result)

    async def run(url: str) -> None:
        async with LoadClient(url, api_key=API_KEY, timeout_s=30) as client:
            await asyncio.gather(*(worker(client, n) for n in range(workers)))

    task = asyncio.gather(*(run(u) for u in urls))
    try:
        yield results
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


def chat_requests(sim: Sim) -> int:
    return len(sim.requests("/v1/chat/completions"))


# ---------------------------------------------------------------------------- operator actions


async def test_operator_ejection_on_one_gateway_is_applied_by_the_other(
    redis_server: RedisServer,
) -> None:
    async with (
        run_sim(name="sim0") as s0,
        run_sim(name="sim1") as s1,
        two_gateways([s0, s1], redis_server.url) as ((url_a, _), (url_b, app_b)),
    ):
        target = replica(app_b, s0)
        await wait_until(lambda: target.state is ReplicaState.HEALTHY, what="B sees s0 healthy")
        row = await admin(url_a, "eject", url=s0.url)
        assert row["state"] == "ejected"
        took = await wait_until(
            lambda: target.state is ReplicaState.EJECTED, what="B applies A's operator ejection"
        )
        assert target.reason is EjectReason.OPERATOR and target.ejections == 1
        print(f"operator ejection on A applied by B in {took * 1000:.0f} ms")
        # B, which saw nothing wrong with s0, no longer sends it anything.
        before = chat_requests(s0)
        async with httpx.AsyncClient(
            base_url=url_b, headers={"authorization": f"Bearer {API_KEY}"}
        ) as client:
            for i in range(6):
                resp = await client.post("/v1/chat/completions", content=chat(i, stream=False))
                assert resp.status_code == 200
        assert chat_requests(s0) == before
        # Readmission on A (forced: no canary) reaches B too.
        await admin(url_a, "readmit", url=s0.url, force=True)
        await wait_until(lambda: target.state is ReplicaState.HEALTHY, what="B readmits s0")
        await admin(url_b, "drain", url=s1.url)
        await wait_until(
            lambda: replica(app_b, s1).state is ReplicaState.DRAINING, what="drain is shared"
        )


async def test_ejection_while_subscribers_are_cut_off_converges_by_reconcile(
    redis_server: RedisServer,
) -> None:
    # T18: the PUBLISH happens while no instance is subscribed; the message is lost for good.
    async with (
        run_sim(name="sim0") as s0,
        run_sim(name="sim1") as s1,
        two_gateways([s0, s1], redis_server.url) as ((url_a, _), (_, app_b)),
    ):
        target = replica(app_b, s0)
        await wait_until(lambda: target.state is ReplicaState.HEALTHY, what="B sees s0 healthy")
        assert redis_server.command("CLIENT", "KILL", "TYPE", "pubsub").startswith(b":")
        await admin(url_a, "eject", url=s0.url)
        took = await wait_until(
            lambda: target.state is ReplicaState.EJECTED, what="B converges by reconcile"
        )
        print(f"lost message converged in {took:.2f}s (reconcile every 1 s)")


# ---------------------------------------------------------------------------- load


async def test_killed_gateway_in_flight_counts_leave_the_other_view(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    # T17. 50 ms steps: a 1000-token answer takes ~50 s, so the requests stay in flight.
    slow = SimSettings(step_fixed_s=0.05)
    async with run_sim(slow, name="slow") as sim:
        data = shared_policy([sim], redis_server.url)
        async with (
            running_gateway(data) as (_, app_b),
            gateway_process(data, tmp_path) as (url_p, pid),
        ):
            seen = replica(app_b, sim)
            async with httpx.AsyncClient(base_url=url_p, timeout=60) as client:

                async def hold(i: int) -> None:
                    with contextlib.suppress(httpx.HTTPError):
                        async with client.stream(
                            "POST", "/v1/chat/completions", content=chat(i, max_tokens=1000)
                        ) as resp:
                            async for _ in resp.aiter_raw():
                                pass

                holders = [asyncio.create_task(hold(i)) for i in range(5)]
                try:
                    await wait_until(lambda: seen.remote_in_flight == 5, what="B sees P's 5")
                    assert seen.load >= 5  # balancing counts them
                    os.kill(pid, signal.SIGKILL)
                    took = await wait_until(
                        lambda: seen.remote_in_flight == 0, what="P's counts expire"
                    )
                finally:
                    for h in holders:
                        h.cancel()
                    await asyncio.gather(*holders, return_exceptions=True)
    # TTL 1.0 + heartbeat 0.2 + one reconcile 1.0 at most; the rest is wide slack for a busy box.
    assert took <= 1.0 + 0.2 + 1.0 + 4.0, took
    print(f"B's view clean {took:.2f}s after SIGKILL (TTL 1.0 s, heartbeat 0.2 s)")


async def test_redis_paused_killed_and_restarted_under_load_fails_no_request(
    redis_server: RedisServer,
) -> None:
    limits = {"requests_per_min": 1_000_000, "tokens_per_min": 100_000_000}
    async with (
        run_sim(name="sim0") as s0,
        run_sim(name="sim1") as s1,
        # Probes and the stall span far above a loaded machine's pauses (the simulators share
        # the gateways' loop): no replica is ejected, so any failure is the outage's doing.
        two_gateways(
            [s0, s1],
            redis_server.url,
            rate_limits=limits,
            health={"timeout_s": 5, "stall_after_s": 30},
        ) as ((url_a, app_a), (url_b, app_b)),
    ):
        a, b = app_a.gateway, app_b.gateway
        both_up = lambda: a.shared.up and b.shared.up  # noqa: E731
        both_down = lambda: not a.shared.up and not b.shared.up  # noqa: E731
        await wait_until(both_up, what="both joined")
        async with load([url_a, url_b]) as results:
            await wait_until(lambda: len(results) >= 12, what="load flowing")
            redis_server.pause()  # slow: connections accepted, nothing answered
            try:
                await wait_until(both_down, what="both fall back while Redis hangs", timeout=30)
                sent = len(results)
                await wait_until(lambda: len(results) >= sent + 6, what="load while it hangs")
            finally:
                redis_server.resume()
            await wait_until(both_up, what="both back after resume")
            redis_server.kill()  # down, and everything it held is lost
            await wait_until(both_down, what="both fall back while Redis is down")
            sent = len(results)
            await wait_until(lambda: len(results) >= sent + 6, what="load while Redis is down")
            # An operator action during the outage: local on A until Redis returns.
            probes = b.shared.breaker.failures + 2  # type: ignore[attr-defined]
            await admin(url_a, "drain", url=s1.url)
            # B looked for Redis twice since (and found none): the drain had its chances
            await wait_until(
                lambda: b.shared.breaker.failures >= probes,  # type: ignore[attr-defined]
                what="B probes the dead Redis",
            )
            assert replica(app_b, s1).state is ReplicaState.HEALTHY
            redis_server.start()
            await wait_until(both_up, what="both re-sync after restart")
            await wait_until(
                lambda: replica(app_b, s1).state is ReplicaState.DRAINING,
                what="A's outage drain reaches B",
            )
            await wait_until(lambda: replica(app_b, s0).remote_in_flight > 0, what="load view back")
            sent = len(results)
            await wait_until(lambda: len(results) >= sent + 6, what="load after the re-sync")
        async with httpx.AsyncClient() as client:
            text = (await client.get(url_a + "/metrics")).text
        assert "tokenlane_shared_state_up 1.0" in text
    failed = [r for r in results if r.outcome != OK]
    # Each phase waited for its own requests (a count, not a rate: a loaded machine serves
    # fewer per second), so every one of them is among these.
    assert len(results) >= 12 + 6 + 6 + 6
    assert not failed, [(r.status, r.error) for r in failed][:5]
    print(f"{len(results)} requests across pause, kill and restart of Redis, 0 failed")


async def test_client_key_budget_is_shared_by_both_gateways(redis_server: RedisServer) -> None:
    limit, batch = 40, 2  # a batch is 5 % of the limit
    async with (
        run_sim(name="sim0") as s0,
        two_gateways([s0], redis_server.url, rate_limits={"requests_per_min": limit}) as (
            (url_a, app_a),
            (url_b, app_b),
        ),
    ):
        await wait_until(lambda: app_a.gateway.shared.up and app_b.gateway.shared.up, what="up")
        statuses: list[int] = []
        limit_headers: list[str | None] = []
        started = time.monotonic()
        headers = {"authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(headers=headers, timeout=10) as client:
            for i in range(120):  # 3 × the limit, alternating between the two gateways
                url = (url_a, url_b)[i % 2]
                resp = await client.post(
                    url + "/v1/chat/completions", content=chat(i, max_tokens=1, stream=False)
                )
                statuses.append(resp.status_code)
                limit_headers.append(resp.headers.get("x-ratelimit-limit-requests"))
                assert "x-ratelimit-remaining-requests" in resp.headers
        refill = (time.monotonic() - started) * limit / 60
    allowed = statuses.count(200)
    assert set(statuses) <= {200, 429}
    assert set(limit_headers) == {str(limit)}  # on every answer, admitted or refused
    # Each gateway alone would allow 40: together they must stay within one budget.
    assert limit - 2 * batch <= allowed <= limit + refill + 2 * batch, (allowed, refill)
    print(f"one budget of {limit}/min over two gateways: {allowed} allowed (+{refill:.1f} refill)")

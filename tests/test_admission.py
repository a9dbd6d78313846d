"""Admission over real sockets: lane and replica limits, the bounded queue (429 at once when
full, 503 on timeout, never dispatching a client that left), priority between lanes, spillover,
and a short lane keeping its TTFT while the bulk lane is saturated (against the simulator)."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from loadtest.fake_upstream import FakeUpstream
from loadtest.sim.server import run_sim

from .gateway import policy_for, running_gateway
from .servers import free_port
from .waiting import wait_until

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


# Lanes here that are not about the queue timeout get a wide one: on a loaded machine the
# streams ahead of a queued request take many times their nominal length.


def chat(tag: str, *, tokens: int = 10, interval_ms: float = 0.0, **extra: Any) -> dict[str, Any]:
    """A streamed chat request the fake answers with ``tokens`` chunks ``interval_ms`` apart;
    ``tag`` (the ``user`` field, forwarded unchanged) tells requests apart upstream."""
    return {
        "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": True,
        "max_tokens": tokens, "fake_interval_ms": interval_ms, "user": tag, **extra,
    }  # fmt: skip


class CountingUpstream(FakeUpstream):
    """The fake, also counting client requests (canaries apart) in progress at once.

    While ``gate`` is clear, client requests are counted, then held before their first byte:
    a test holds the replica busy for as long as it needs (a pause of the machine cannot end
    a hold early, as it can a stream of a given length), then opens the gate."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.now = 0
        self.peak = 0
        self.tags: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def _respond(self, method: str, path: str, headers: dict[str, str], raw: bytes,
                       w: asyncio.StreamWriter) -> None:  # fmt: skip
        counted = path == "/v1/chat/completions" and "x-tokenlane-canary" not in headers
        if counted:
            self.now += 1
            self.peak = max(self.peak, self.now)
            if b'"user":"' in raw:
                self.tags.append(raw.split(b'"user":"')[1].split(b'"')[0].decode())
        try:
            if counted:
                await self.gate.wait()
            await super()._respond(method, path, headers, raw, w)
        finally:
            if counted:
                self.now -= 1


@contextlib.asynccontextmanager
async def counting(**kw: Any) -> AsyncIterator[CountingUpstream]:
    up = CountingUpstream(**kw)
    await up.start()
    try:
        yield up
    finally:
        up.gate.set()
        await up.stop()


async def post(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[int, float, httpx.Response]:
    resp = await client.post(url + "/v1/chat/completions", json=body)
    return resp.status_code, time.monotonic(), resp


def metric(app: Any, name: str, *labels: str) -> float:
    return getattr(app.gateway.metrics, name).labels(*labels)._value.get()


# ---------------------------------------------------------------------------- the queue


async def test_twenty_bulk_requests_give_two_running_four_queued_fourteen_429s() -> None:
    async with counting() as up:
        lanes = [
            {
                "name": "bulk",
                "pool": "p",
                "max_in_flight": 2,
                "max_queue": 4,
                "queue_timeout_s": 120,
            }
        ]
        async with running_gateway(policy_for({"p": [up.url]}, lanes=lanes)) as (url, app):
            up.gate.clear()  # the two admitted requests run until the test lets them go
            limits = httpx.Limits(max_connections=50)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                tasks = [
                    asyncio.create_task(post(client, url, chat(f"r{i}", tokens=10, interval_ms=10)))
                    for i in range(20)
                ]
                await wait_until(
                    lambda: sum(t.done() for t in tasks) >= 14 and up.now == 2,
                    what="sum(t.done() for t in tasks) >= 14 and up.now == 2",
                )
                assert app.gateway.admission.depths()["bulk"] == 4
                assert len(up.tags) == 2  # the two running ones are all that reached upstream
                # Every refusal came back at once, while the admitted ones still ran.
                assert [t.result()[0] for t in tasks if t.done()] == [429] * 14
                up.gate.set()
                results = await asyncio.gather(*tasks)
    statuses = sorted(s for s, _, _ in results)
    assert statuses == [200] * 6 + [429] * 14
    refused = [r for s, _, r in results if s == 429]
    for r in refused:
        assert 1 <= int(r.headers["retry-after"]) <= 60
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == 429
    assert up.peak == 2
    assert len(up.tags) == 6
    assert metric(app, "rejections", "bulk", "queue_full") == 14
    assert app.gateway.admission.depths()["bulk"] == 0


async def test_queued_client_that_disconnects_is_never_sent_upstream() -> None:
    async with counting() as up:
        lanes = [
            {"name": "l", "pool": "p", "max_in_flight": 1, "max_queue": 4, "queue_timeout_s": 120}
        ]
        async with running_gateway(policy_for({"p": [up.url]}, lanes=lanes)) as (url, app):
            async with httpx.AsyncClient(timeout=120) as client:
                up.gate.clear()  # the holder keeps the lane's one slot until the gate opens
                holder = asyncio.create_task(post(client, url, chat("holder")))
                await wait_until(lambda: up.now == 1, what="up.now == 1")
                leaver = asyncio.create_task(post(client, url, chat("leaver")))
                await wait_until(
                    lambda: app.gateway.admission.depths()["l"] == 1,
                    what='app.gateway.admission.depths()["l"] == 1',
                )
                leaver.cancel()  # closes its connection while it waits in the queue
                await asyncio.gather(leaver, return_exceptions=True)
                await wait_until(
                    lambda: app.gateway.admission.depths()["l"] == 0,
                    what='app.gateway.admission.depths()["l"] == 0',
                )
                up.gate.set()
                status, _, _ = await holder
                after = await post(client, url, chat("after"))
    assert status == 200 and after[0] == 200
    assert up.tags == ["holder", "after"]
    assert metric(app, "requests", "l", "", "", "499") == 1


async def test_queue_timeout_answers_503_with_retry_after() -> None:
    async with counting() as up:
        lanes = [{"name": "l", "pool": "p", "max_in_flight": 1, "queue_timeout_s": 0.3}]
        async with running_gateway(policy_for({"p": [up.url]}, lanes=lanes)) as (url, app):
            async with httpx.AsyncClient(timeout=120) as client:
                # The holder keeps the slot until the gate opens: however slow the machine,
                # the late request can only leave at its timeout.
                up.gate.clear()
                holder = asyncio.create_task(post(client, url, chat("holder")))
                await wait_until(lambda: up.now == 1, what="up.now == 1")
                started = time.monotonic()
                status, ended, resp = await post(client, url, chat("late"))
                assert not holder.done() and up.now == 1  # the holder still had the slot
                up.gate.set()
                holder_status, holder_ended, _ = await holder
    assert status == 503 and holder_status == 200
    assert ended - started > 0.3  # not before its timeout (pauses only make it later)
    assert ended < holder_ended
    assert int(resp.headers["retry-after"]) >= 1
    assert resp.json()["error"]["type"] == "ServiceUnavailableError"
    assert "late" not in up.tags
    assert metric(app, "rejections", "l", "queue_timeout") == 1


async def test_pool_without_healthy_replica_answers_503_at_once() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    # A queue timeout far above the bound below: "at once" is not "at the queue timeout".
    lanes = [{"name": "all", "pool": "p", "queue_timeout_s": 120}]
    policy = policy_for({"p": [dead]}, lanes=lanes, health={"interval_s": 0.1, "timeout_s": 0.2})
    async with running_gateway(policy, ready=False) as (url, app):
        async with httpx.AsyncClient(timeout=120) as client:
            started = time.monotonic()
            status, ended, resp = await post(client, url, chat("x"))
    assert status == 503 and ended - started < 10.0
    assert "retry-after" in resp.headers
    assert metric(app, "rejections", "all", "no_replica") == 1
    assert app.gateway.admission.depths()["all"] == 0


async def test_replica_limit_holds_across_replicas_and_requests_queue_for_it() -> None:
    async with counting() as a, counting() as b:
        lanes = [{"name": "all", "pool": "p", "queue_timeout_s": 120}]
        policy = policy_for({"p": [a.url, b.url]}, lanes=lanes, balance="least_loaded")
        for r in policy["pools"]["p"]["replicas"]:
            r["max_in_flight"] = 2
        async with running_gateway(policy) as (url, app):
            a.gate.clear()
            b.gate.clear()  # the first four hold their slots until all twelve have arrived
            limits = httpx.Limits(max_connections=50)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                tasks = [
                    asyncio.create_task(post(client, url, chat(f"r{i}", tokens=10, interval_ms=30)))
                    for i in range(12)
                ]
                await wait_until(
                    lambda: app.gateway.admission.depths()["all"] == 8 and a.now + b.now == 4,
                    what='app.gateway.admission.depths()["all"] == 8 and a.now + b.now == 4',
                )
                assert (a.now, b.now) == (2, 2)
                a.gate.set()
                b.gate.set()
                results = await asyncio.gather(*tasks)
    assert [s for s, _, _ in results] == [200] * 12
    assert (a.peak, b.peak) == (2, 2)
    assert len(a.tags) + len(b.tags) == 12


async def test_retries_respect_the_replica_limit() -> None:
    async with counting() as bad, counting() as good:
        # At most 2 requests in flight (the lane), so a retry always finds room on `good`.
        lanes = [
            {"name": "l", "pool": "p", "max_in_flight": 2, "max_queue": 10, "queue_timeout_s": 120}
        ]
        policy = policy_for({"p": [bad.url, good.url]}, lanes=lanes,
                            health={"consecutive_failures": 1000})  # fmt: skip
        policy["pools"]["p"]["replicas"][0]["max_in_flight"] = 1
        policy["pools"]["p"]["replicas"][1]["max_in_flight"] = 2
        async with running_gateway(policy) as (url, app):
            bad.fail_status = 503  # after its canary: retried elsewhere before the first byte
            async with httpx.AsyncClient(timeout=120) as client:
                results = await asyncio.gather(
                    *[post(client, url, chat(f"r{i}", tokens=10, interval_ms=30)) for i in range(8)]
                )
    assert [s for s, _, _ in results] == [200] * 8
    assert metric(app, "retries", "l", "upstream_5xx") >= 1
    assert bad.peak == 1 and good.peak == 2


async def test_higher_priority_lane_is_served_first_on_a_shared_pool() -> None:
    async with counting() as up:
        lanes = [
            {"name": "short", "pool": "p", "priority": 10, "queue_timeout_s": 120,
             "when": {"stream": True, "output_tokens_max": 16}},
            {"name": "long", "pool": "p", "queue_timeout_s": 120},
        ]  # fmt: skip
        policy = policy_for({"p": [up.url]}, lanes=lanes)
        policy["pools"]["p"]["replicas"][0]["max_in_flight"] = 1
        async with running_gateway(policy) as (url, app):
            async with httpx.AsyncClient(timeout=120) as client:
                up.gate.clear()  # the holder keeps the one slot until all three wait
                holder = asyncio.create_task(post(client, url, chat("holder", tokens=30)))
                await wait_until(lambda: up.now == 1, what="up.now == 1")
                long1 = asyncio.create_task(post(client, url, chat("long1", tokens=20)))
                await wait_until(
                    lambda: app.gateway.admission.depths()["long"] == 1,
                    what='app.gateway.admission.depths()["long"] == 1',
                )
                short1 = asyncio.create_task(post(client, url, chat("short1", tokens=5)))
                await wait_until(
                    lambda: app.gateway.admission.depths()["short"] == 1,
                    what='app.gateway.admission.depths()["short"] == 1',
                )
                long2 = asyncio.create_task(post(client, url, chat("long2", tokens=20)))
                await wait_until(
                    lambda: app.gateway.admission.depths()["long"] == 2,
                    what='app.gateway.admission.depths()["long"] == 2',
                )
                up.gate.set()
                results = await asyncio.gather(holder, long1, short1, long2)
    assert [s for s, _, _ in results] == [200] * 4, [r.text for _, _, r in results]
    assert up.tags == ["holder", "short1", "long1", "long2"]
    # The priority is the gateway's: it is not added to the body sent upstream.
    assert all("priority" not in b for b in up.stats.bodies)
    assert results[2][2].headers["x-tokenlane-lane"] == "short"


async def test_client_priority_field_is_forwarded_unchanged() -> None:
    async with counting() as up:
        lanes = [{"name": "l", "pool": "p", "priority": 7}]
        async with running_gateway(policy_for({"p": [up.url]}, lanes=lanes)) as (url, _):
            async with httpx.AsyncClient(timeout=120) as client:
                status, _, _ = await post(client, url, chat("x", priority=-3))
    assert status == 200
    assert [b["priority"] for b in up.stats.bodies if b.get("user") == "x"] == [-3]


# ---------------------------------------------------------------------------- spillover


async def test_saturated_pool_spills_to_its_spill_pool_and_counts_it() -> None:
    async with counting() as fast, counting() as bulk:
        lanes = [{"name": "short", "pool": "fast", "spill_to": "bulk"}]
        policy = policy_for({"fast": [fast.url], "bulk": [bulk.url]}, lanes=lanes)
        policy["pools"]["fast"]["replicas"][0]["max_in_flight"] = 1
        async with running_gateway(policy) as (url, app):
            async with httpx.AsyncClient(timeout=120) as client:
                fast.gate.clear()  # the holder keeps fast's one slot until the spill is done
                holder = asyncio.create_task(post(client, url, chat("holder")))
                await wait_until(lambda: fast.now == 1, what="fast.now == 1")
                status, _, resp = await post(client, url, chat("spilled"))
                fast.gate.set()
                await holder
    assert status == 200
    assert bulk.tags == ["spilled"] and fast.tags == ["holder"]
    assert resp.headers["x-tokenlane-replica"] == app.gateway.fleet.pools["bulk"].replicas[0].name
    assert metric(app, "spills", "short", "fast", "bulk") == 1


async def test_pool_without_healthy_replica_spills() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with counting() as bulk:
        lanes = [{"name": "short", "pool": "fast", "spill_to": "bulk"}]
        policy = policy_for({"fast": [dead], "bulk": [bulk.url]}, lanes=lanes)
        async with running_gateway(policy) as (url, app):  # ready: the spill pool serves
            async with httpx.AsyncClient(timeout=120) as client:
                status, _, _ = await post(client, url, chat("s"))
    assert status == 200 and bulk.tags == ["s"]
    assert metric(app, "spills", "short", "fast", "bulk") == 1


# ---------------------------------------------------------------------------- TTFT isolation


async def ttft(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[float, str]:
    """Seconds to the first content of a stream, and the lane that served it."""
    started = time.monotonic()
    took = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if (
                took is None
                and line.startswith("data: {")
                and '"content":"' in line
                and ('"content":""' not in line)
            ):
                took = time.monotonic() - started
    assert took is not None, "no content"
    return took, resp.headers["x-tokenlane-lane"]


def queue_waits(app: Any, lane: str) -> tuple[float, float]:
    """(count, sum) of the lane's queue-wait observations: 0 s for a request dispatched on
    arrival, the time it waited for one that queued."""
    app.gateway.admission.flush_metrics()  # held and added in batches, as before a scrape
    samples = {
        s.name: s.value
        for m in app.gateway.metrics.queue_wait.collect()
        for s in m.samples
        if s.labels.get("lane") == lane
    }
    return samples["tokenlane_queue_wait_seconds_count"], samples[
        "tokenlane_queue_wait_seconds_sum"
    ]


async def test_short_lane_keeps_its_ttft_while_the_bulk_lane_is_saturated() -> None:
    async with run_sim(name="fast") as fast, run_sim(name="bulk") as bulk:
        lanes = [
            {"name": "short", "pool": "interactive", "priority": 10,
             "when": {"stream": True, "prompt_tokens_max": 512, "output_tokens_max": 64}},
            {"name": "long", "pool": "bulk", "max_in_flight": 2, "max_queue": 64,
             "queue_timeout_s": 120},
        ]  # fmt: skip
        # Scrapes of the in-process simulators cost this loop CPU: not every 0.1 s.
        policy = policy_for(
            {"interactive": [fast.url], "bulk": [bulk.url]}, lanes=lanes, health={"interval_s": 0.5}
        )
        short = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}],
                 "stream": True, "max_tokens": 16}  # fmt: skip
        long_text = "lorem ipsum dolor sit amet " * 1200  # ~8k tokens of prompt
        long_body = {"model": MODEL, "messages": [{"role": "user", "content": long_text}],
                     "stream": True, "max_tokens": 30}  # fmt: skip
        async with running_gateway(policy) as (url, app):
            limits = httpx.Limits(max_connections=100)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                alone = [(await ttft(client, url, short))[0] for _ in range(5)]
                # The bulk replica slowed 20x until the short requests are done: its backlog
                # then outlasts them however slow this machine is.
                await bulk.set_fault({"fault": "slow", "factor": 20})
                bulk_tasks = [asyncio.create_task(ttft(client, url, long_body)) for _ in range(12)]
                await wait_until(
                    lambda: app.gateway.admission.depths()["long"] >= 8,
                    what='app.gateway.admission.depths()["long"] >= 8',
                )
                loaded = []
                for _ in range(8):
                    took, lane = await ttft(client, url, short)
                    loaded.append(took)
                    assert lane == "short"
                    assert app.gateway.admission.depths()["long"] > 0  # still saturated
                await bulk.set_fault(None)
                bulk_results = await asyncio.gather(*bulk_tasks)
    # What isolation means, free of timing: no short request ever waited for dispatch (each
    # observed exactly 0 s), while bulk requests did.
    assert queue_waits(app, "short") == (13, 0.0)
    long_count, long_sum = queue_waits(app, "long")
    assert long_count == 12 and long_sum > 0
    assert {lane for _, lane in bulk_results} == {"long"}
    # And in time, by medians (a pause of the machine may hit any single request): the short
    # lane's TTFT under load stays near its TTFT alone, far below the bulk lane's.
    bulk_ttfts = [t for t, _ in bulk_results]
    assert statistics.median(loaded) < 3 * statistics.median(alone) + 2.0, (alone, loaded)
    assert statistics.median(bulk_ttfts) > 3 * statistics.median(loaded), (bulk_ttfts, loaded)
    assert app.gateway.admission.depths() == {"short": 0, "long": 0}

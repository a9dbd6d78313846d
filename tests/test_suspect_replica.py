"""A replica's 500 with no peer to compare it with (docs/reliability.md, "A suspect replica's
500 is replayed"): replayed once when the replica is suspect, counted against it only when the
replay was served elsewhere, never for a poison body; and a retry with no replica to go to
probes the ejected whose /health answers again instead of failing. Over real sockets against
the wire-level fake."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from loadtest.fake_upstream import FakeUpstream, running
from proxy.edge.routes import GatewayApp
from proxy.fleet.fleet import EjectReason, Replica, ReplicaState

from .gateway import policy_for, running_gateway
from .waiting import wait_until

CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}
POISON = {**CHAT, "messages": [{"role": "user", "content": "POISON"}]}


class _PoisonedUpstream(FakeUpstream):
    """A replica that answers 500 to any request whose body says POISON (as vLLM has done for
    some bodies), and serves everything else."""

    async def _respond(
        self, method: str, path: str, headers: dict[str, str], raw: bytes, w: asyncio.StreamWriter
    ) -> None:
        self.fail_status = 500 if b"POISON" in raw else None
        await super()._respond(method, path, headers, raw, w)


def chats(up: FakeUpstream) -> int:
    """Client chat requests a fake received (the health loop's canaries apart)."""
    return sum(
        "messages" in b and "x-tokenlane-canary" not in h
        for b, h in zip(up.stats.bodies, up.stats.headers, strict=True)
    )


def replica(app: GatewayApp, up: FakeUpstream) -> Replica:
    return app.gateway.fleet.find(up.url)[0]


async def ask(client: httpx.AsyncClient, url: str, app: GatewayApp, body: dict[str, Any]):
    """One request, and until the gateway is done with it (its verdicts on the replicas are
    given when its last attempt ends, which may follow the client's last byte)."""
    r = await client.post(url + "/v1/chat/completions", json=body)
    relay = app.gateway.relay
    await wait_until(lambda: relay.requests_in_flight == 0, what="the request finished")
    return r


def lone_with_spill(first: str, spill: str, **sections: Any) -> dict[str, Any]:
    return policy_for(
        {"first": [first], "spill": [spill]},
        lanes=[{"name": "all", "pool": "first", "spill_to": "spill"}],
        **sections,
    )


async def test_a_lone_replica_failing_everything_is_replayed_elsewhere_then_ejected() -> None:
    async with running(tokens=3) as bad, running(tokens=3) as good:
        policy = lone_with_spill(bad.url, good.url, health={"consecutive_failures": 5})
        async with running_gateway(policy) as (url, app):
            bad.fail_status = 500  # its /health still says 200
            r_bad = replica(app, bad)
            statuses = []
            async with httpx.AsyncClient(timeout=10) as client:
                for _ in range(12):
                    r = await ask(client, url, app, CHAT)
                    statuses.append(r.status_code)
            retries = app.gateway.metrics.retries.labels("all", "upstream_5xx")._value.get()
    # Two 500s are no evidence yet, and are relayed as the replica's answer; from the third
    # the replica is suspect, its 500 is replayed on the spill pool and served.
    assert statuses == [500, 500] + [200] * 10
    # Five of those replays served elsewhere: its own fault, although it has no peer.
    assert (r_bad.state, r_bad.reason) == (ReplicaState.EJECTED, EjectReason.CONSECUTIVE_FAILURES)
    assert (chats(bad), retries) == (7, 5)
    assert chats(good) == 10  # five replays, then five straight to the spill pool


@contextlib.asynccontextmanager
async def running_poisoned() -> AsyncIterator[_PoisonedUpstream]:
    fake = _PoisonedUpstream(tokens=3)
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


async def test_a_poison_body_is_replayed_once_and_ejects_no_replica_even_a_lone_one() -> None:
    async with running_poisoned() as a, running_poisoned() as b:
        policy = lone_with_spill(a.url, b.url, health={"consecutive_failures": 2})
        async with running_gateway(policy) as (url, app):
            r_a, r_b = replica(app, a), replica(app, b)
            async with httpx.AsyncClient(timeout=10) as client:
                statuses = [(await ask(client, url, app, POISON)).status_code for _ in range(20)]
                after = await ask(client, url, app, CHAT)
            retries = app.gateway.metrics.retries.labels("all", "upstream_5xx")._value.get()
    assert statuses == [500] * 20  # every replica answers it 500, and the client is told so
    # From the third, a is suspect and each poison body is replayed on b, once: 500 there
    # too, so the request is the common factor and neither answer counts.
    assert (chats(a), chats(b), retries) == (21, 18, 18)
    assert r_a.state is ReplicaState.HEALTHY and r_b.state is ReplicaState.HEALTHY
    assert r_a.failures_in_row == 0 and r_b.failures_in_row == 0
    assert after.status_code == 200
    assert after.headers["x-tokenlane-replica"] == a.url.removeprefix("http://")


async def test_a_retry_with_nowhere_to_go_probes_an_ejected_replica_back_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "tokenlane.health")
    async with running(tokens=3) as a, running(tokens=3) as b:
        # b's ejection would last a minute; the test is over well before that.
        health = {"consecutive_failures": 1, "eject_base_s": 60}
        async with running_gateway(policy_for({"p": [a.url, b.url]}, health=health)) as (
            url,
            app,
        ):
            r_a, r_b = replica(app, a), replica(app, b)
            b.close_after_request = "reset"
            async with httpx.AsyncClient(timeout=10) as client:
                while r_b.state is not ReplicaState.EJECTED:  # round robin reaches b at once
                    await ask(client, url, app, CHAT)
                b.close_after_request = None  # its fault lifts; its /health answered all along
                a.fail_status = 500
                statuses: list[int] = []
                while not statuses or statuses[-1] != 200:
                    # Nothing but a request with nowhere to go brings b back before a minute.
                    assert r_b.state is ReplicaState.EJECTED and len(statuses) < 3, statuses
                    last = await ask(client, url, app, CHAT)
                    statuses.append(last.status_code)
    # a's first 500 is no evidence and is relayed. Once a is suspect (two answers seen, a
    # quarter of them 500) its 500 is replayed; b, the only other replica, is ejected, so
    # b is probed at once, passes its canary, and serves the replay.
    assert statuses[0] == 500 and set(statuses[:-1]) == {500}
    assert last.headers["x-tokenlane-replica"] == b.url.removeprefix("http://")
    assert r_b.state is ReplicaState.HEALTHY
    assert any("probed early: request" in m for m in caplog.messages), caplog.messages
    assert r_a.failures_in_row >= 1  # the replay's success is held against a

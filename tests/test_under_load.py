"""RELIABILITY T11 and T14 under load, over real sockets; ``pytest -s`` prints the figures.

T11: many clients leave while queued for admission: none of them reaches the replica, and the
queue empties. T14: one replica answers every request with 503 while the gateway takes
~200 requests a second: retries stay within the budget (retried attempts not yet started ≤
``budget_ratio`` × requests in flight, at least 3), no request reaches a replica twice, and the
healthy replica gets no more than the offered load (no retry storm). T16 (Redis black-holed)
and T17 (an instance SIGKILLed) run under load in ``python -m loadtest.bench_soak --redis``;
T17 and T18 have their own tests in tests/test_shared.py and tests/test_shared_gateway.py.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx

from loadtest.fake_upstream import running

from .gateway import policy_for, running_gateway, wait_healthy
from .test_admission import chat, counting, metric, post
from .waiting import wait_until

QUEUED, LEAVING = 40, 30


async def test_t11_thirty_of_forty_queued_clients_leave_and_none_reaches_the_replica() -> None:
    lanes = [{"name": "l", "pool": "p", "max_in_flight": 2, "max_queue": 64,
              "queue_timeout_s": 120}]  # fmt: skip
    async with counting() as up:
        async with running_gateway(policy_for({"p": [up.url]}, lanes=lanes)) as (url, app):
            depth = lambda: app.gateway.admission.depths()["l"]  # noqa: E731
            limits = httpx.Limits(max_connections=QUEUED + 10)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                up.gate.clear()  # the two holders keep the lane's slots until the gate opens
                holders = [asyncio.create_task(post(client, url, chat(f"h{i}"))) for i in (0, 1)]
                await wait_until(lambda: up.now == 2, what="both holders at the replica")
                queued = [
                    asyncio.create_task(post(client, url, chat(f"q{i}"))) for i in range(QUEUED)
                ]
                await wait_until(lambda: depth() == QUEUED, what=f"{QUEUED} queued")
                leavers = queued[QUEUED - LEAVING :]
                for task in leavers:
                    task.cancel()  # closes its connection while it waits in the queue
                await asyncio.gather(*leavers, return_exceptions=True)
                await wait_until(lambda: depth() == QUEUED - LEAVING, what="the leavers gone")
                up.gate.set()
                stayed = await asyncio.gather(*holders, *queued[: QUEUED - LEAVING])
            left_499 = metric(app, "requests", "l", "", "", "499")
            final_depth = depth()
    print(f"\nT11: {QUEUED} queued, {LEAVING} left: replica saw {len(up.tags)} requests "
          f"({sorted(up.tags)}), 499s counted {left_499:g}, queue afterwards {final_depth}")  # fmt: skip
    assert [status for status, _, _ in stayed] == [200] * (2 + QUEUED - LEAVING)
    assert sorted(up.tags) == sorted(["h0", "h1"] + [f"q{i}" for i in range(QUEUED - LEAVING)])
    assert left_499 == LEAVING and final_depth == 0


RATE, SECONDS, FIRST_TOKEN_S = 200, 5.0, 0.2


async def test_t14_a_replica_failing_everything_at_200_rps_causes_no_retry_storm() -> None:
    async with running(tokens=4) as failing, running(tokens=4) as good:
        good.first_token_delay_s = FIRST_TOKEN_S  # ~40 requests in flight at 200 a second
        # Nothing is ejected (max_ejected_percent 0): the failing replica keeps its share, so
        # only the retry budget stands between its failures and a storm on the other.
        policy = policy_for(
            {"p": [failing.url, good.url]},
            health={"interval_s": 60, "max_ejected_percent": 0},
            continuation={"enabled": False},
        )
        async with running_gateway(policy, ready=False) as (url, app):
            await wait_healthy(app, 2)
            failing.fail_status = 503
            relay = app.gateway.relay
            ratio = app.gateway.policy.retry.budget_ratio
            before = (failing.stats.requests, good.stats.requests)
            samples: list[tuple[int, int]] = []  # (retries pending, requests in flight)
            done = asyncio.Event()

            async def watch() -> None:
                while not done.is_set():
                    samples.append((relay.retries_pending, relay.requests_in_flight))
                    await asyncio.sleep(0.002)

            # Idle connections dropped before the server's keep-alive timeout (5 s) closes them
            # under a request (a client-side race no gateway can answer).
            limits = httpx.Limits(max_connections=400, keepalive_expiry=2)
            statuses: Counter[int] = Counter()
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:

                async def one(i: int) -> None:
                    r = await client.post(url + "/v1/chat/completions", json=chat(f"r{i}"))
                    statuses[r.status_code] += 1

                watcher = asyncio.create_task(watch())
                started = time.monotonic()
                tasks = []
                for i in range(int(RATE * SECONDS)):  # open loop: one every 1/RATE s
                    await asyncio.sleep(max(0.0, started + i / RATE - time.monotonic()))
                    tasks.append(asyncio.create_task(one(i)))
                await asyncio.gather(*tasks)
                elapsed = time.monotonic() - started
                done.set()
                await watcher
            retries = metric(app, "retries", "all", "upstream_5xx")
    sent = len(tasks)
    to_failing = failing.stats.requests - before[0]
    to_good = good.stats.requests - before[1]
    # The budget is checked when a retry is decided; requests that end afterwards lower the
    # in-flight count under a retry already started, so a sample can exceed it for a moment.
    # Where the floor of 3 does not matter (15 or more in flight), the share on average:
    busy = [p / n for p, n in samples if n >= 15]
    mean_share = sum(busy) / len(busy) if busy else 0.0
    print(f"\nT14: {sent} requests in {elapsed:.1f}s ({sent / elapsed:.0f}/s): answers "
          f"{dict(statuses)}; failing replica got {to_failing}, healthy {to_good} "
          f"({to_good / sent:.2f}x the offered load); retries {retries:g}; retries pending / "
          f"requests in flight: mean {mean_share:.3f}, max {max(busy, default=0):.3f} over "
          f"{len(busy)} samples with 15+ in flight (budget {ratio:g})")  # fmt: skip
    assert sum(statuses.values()) == sent and set(statuses) <= {200, 503}
    assert busy and mean_share <= ratio + 0.05
    # No request reaches a replica twice; the healthy one gets at most the offered load.
    assert to_failing <= sent and to_good <= sent
    assert to_failing + to_good == sent + retries
    assert statuses[200] == to_good and statuses[503] == sent - to_good
    assert retries > 0 and statuses[503] > 0  # the failures were retried, within the budget

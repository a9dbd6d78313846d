"""The probing loop: one task per replica scrapes ``/health`` and ``/v1/models``.

Minimal first version (gateway core): a replica becomes ``healthy`` on its first ``/health`` 200
with a known model list, and goes back to ``probing`` when ``/health`` fails. Stall detection,
ejection and canaries build on this loop (issue 4).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from .config import Policy
from .fleet import Fleet, Replica, ReplicaState
from .metrics import Metrics

log = logging.getLogger("tokenlane.health")

MODELS_EVERY = 10  # /v1/models changes rarely: poll it every 10th round, and until known


class HealthMonitor:
    def __init__(
        self,
        fleet: Fleet,
        policy: Callable[[], Policy],
        client: httpx.AsyncClient,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.policy = policy
        self.client = client
        self.metrics = metrics
        self.clock = clock
        self._tasks: dict[Replica, asyncio.Task[None]] = {}

    async def start(self) -> None:
        """Probe every replica once (bounded by the scrape timeout), then keep probing."""
        first = [self.probe_once(r, rounds=0) for r in self.fleet.replicas()]
        await asyncio.gather(*first, return_exceptions=True)
        self.replicas_changed()

    def replicas_changed(self) -> None:
        """Start loops for new replicas and stop those of replicas that left the fleet."""
        current = set(self.fleet.replicas())
        for replica, task in list(self._tasks.items()):
            if replica not in current:
                task.cancel()
                del self._tasks[replica]
        for replica in current - self._tasks.keys():
            self._tasks[replica] = asyncio.create_task(self._loop(replica))

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _loop(self, replica: Replica) -> None:
        rounds = 1
        while True:
            await asyncio.sleep(self.policy().health.interval_s)
            try:
                await self.probe_once(replica, rounds)
            except Exception:  # a bug in one probe must not end the loop
                log.exception("probe of %s failed", replica.url)
            rounds += 1

    def _headers(self, replica: Replica) -> dict[str, str]:
        return {"authorization": f"Bearer {replica.api_key}"} if replica.api_key else {}

    async def probe_once(self, replica: Replica, rounds: int) -> None:
        timeout = self.policy().health.timeout_s
        ok = False
        try:
            resp = await self.client.get(
                replica.url + "/health", headers=self._headers(replica), timeout=timeout
            )
            ok = resp.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok and (not replica.models or rounds % MODELS_EVERY == 0):
            await self._refresh_models(replica, timeout)
        self._transition(replica, ok)

    async def _refresh_models(self, replica: Replica, timeout: float) -> None:
        try:
            resp = await self.client.get(
                replica.url + "/v1/models", headers=self._headers(replica), timeout=timeout
            )
            if resp.status_code == 200:
                data: Any = resp.json()
                replica.models = {m["id"]: m for m in data.get("data", []) if "id" in m}
        except (httpx.HTTPError, ValueError, TypeError, KeyError):
            pass  # keep the cached list: /v1/models must answer while replicas are down

    def _transition(self, replica: Replica, ok: bool) -> None:
        before = replica.state
        if before is ReplicaState.DRAINING:
            return
        after = ReplicaState.HEALTHY if ok and replica.models else ReplicaState.PROBING
        if after is not before:
            replica.state = after
            log.info(
                "replica %s/%s %s -> %s", replica.pool, replica.name, before.value, after.value
            )
        self.metrics.set_replica_state(replica.pool, replica.name, replica.state.value)

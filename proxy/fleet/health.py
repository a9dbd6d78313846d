"""The probing loop: one task per replica scrapes ``/health``, ``/metrics`` and ``/v1/models``,
feeds the fleet's detectors and sends canaries to probing replicas.

One task per replica, so a replica that hangs delays nobody else's probes; within a round
``/health`` and ``/metrics`` go out together, each bounded by ``health.timeout_s`` in total
(httpx's own timeout is per phase, so a server that trickles bytes could outlast it).
Rounds start at a fixed rate (every ``interval_s`` from the first, skipping rounds that a slow
probe overran) so that the stall detector sees evenly spaced scrapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from proxy.config import Policy
from proxy.errors import UpstreamError
from proxy.fleet.fleet import Fleet, Replica, ReplicaState
from proxy.fleet.vllm import (
    CANARY_PATH,
    EngineSample,
    ScrapeError,
    canary_request,
    canary_succeeded,
    model_cards,
    parse_metrics,
)
from proxy.observe.metrics import Metrics
from proxy.relay.upstream import UpstreamClient, fetch
from proxy.tasks import end_if_cancelled

log = logging.getLogger("tokenlane.health")

MODELS_EVERY = 10  # /v1/models changes rarely: poll it every 10th round, and until known
# What a probe may raise when a replica is down, slow or talks nonsense (the upstream client
# raises only UpstreamError; a body that is no JSON, ValueError); anything else is a bug.
PROBE_ERRORS = (UpstreamError, TimeoutError, OSError, ValueError)
# Marks canaries in the replica's access log, so nobody mistakes them for client traffic.
CANARY_HEADERS = {"x-tokenlane-canary": "1"}
# prometheus_client answers OpenMetrics (with escaped names) only when asked; ask for text.
METRICS_HEADERS = {"accept": "text/plain"}


class HealthMonitor:
    def __init__(
        self,
        fleet: Fleet,
        policy: Callable[[], Policy],
        client: UpstreamClient,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        on_round: Callable[[Replica], None] | None = None,
    ) -> None:
        """``client`` is the upstream seam's (``relay.upstream.make_client``): it raises only
        ``UpstreamError`` for what a replica's answer met. ``on_round`` hears of each
        replica's finished round (the workers' leader tells the other workers)."""
        self.fleet = fleet
        self.policy = policy
        self.client = client
        self.metrics = metrics
        self.clock = clock
        self.on_round = on_round
        if fleet.metrics is None:
            fleet.metrics = metrics
            fleet.publish_all()
        self._tasks: dict[Replica, asyncio.Task[None]] = {}
        self._first_round: dict[Replica, asyncio.Event] = {}

    async def start(self) -> None:
        """Start one loop per replica and wait for each one's first round (a round is bounded
        by ``timeout_s`` plus, for a canary, ``canary_timeout_s``), so a gateway that starts
        serving knows which replicas generate."""
        self.replicas_changed()
        h = self.policy().health
        waits = [e.wait() for e in self._first_round.values()]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2 * h.timeout_s + h.canary_timeout_s + 1.0):
                await asyncio.gather(*waits)

    def replicas_changed(self) -> None:
        """Start loops for new replicas and stop those of replicas that left the fleet."""
        current = set(self.fleet.replicas())
        for replica, task in list(self._tasks.items()):
            if replica not in current:
                task.cancel()
                del self._tasks[replica]
                self._first_round.pop(replica, None)
        for replica in current - self._tasks.keys():
            self._first_round[replica] = asyncio.Event()
            self._tasks[replica] = asyncio.create_task(
                self._loop(replica), name=f"health {replica.pool}/{replica.name}"
            )

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self._first_round.clear()

    async def _loop(self, replica: Replica) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        rounds = 0
        while True:
            try:
                await self.probe_once(replica, rounds)
            except Exception:  # a bug in one probe must not end the loop
                log.exception("replica=%s probe failed", replica.name)
            # A cancel lost inside the probe (``proxy/tasks.py``: its timeout's TimeoutError, a
            # client that caught it) ends the loop here; else ``stop`` would wait for ever.
            end_if_cancelled()
            event = self._first_round.get(replica)
            if event is not None:
                event.set()
            if not any(r is replica for r in self.fleet.replicas()):
                # Removed by a reload and since drained: nobody calls replicas_changed() for
                # that, so the loop ends itself (its finished task is dropped at the next call).
                return
            rounds += 1
            next_at += self.policy().health.interval_s
            now = loop.time()
            if next_at < now:
                next_at = now  # overran (a hung replica): start the next round at once
            await asyncio.sleep(next_at - now)

    def _headers(self, replica: Replica) -> dict[str, str]:
        return {"authorization": f"Bearer {replica.api_key}"} if replica.api_key else {}

    async def probe_once(self, replica: Replica, rounds: int) -> None:
        """One round: scrape, let the fleet judge, and send a canary if the replica is probing."""
        h = self.policy().health
        self.fleet.health = h  # reloaded health keys apply from the next round on
        ok, sample = await asyncio.gather(
            self._check_health(replica, h.timeout_s), self._scrape(replica, h.timeout_s)
        )
        if ok and (not replica.models or rounds % MODELS_EVERY == 0):
            await self._refresh_models(replica, h.timeout_s)
        now = self.clock()
        self.fleet.observe_health(replica, ok, now)
        self.fleet.observe_scrape(replica, sample, now)
        self.fleet.tick(replica, now)
        if replica.state is ReplicaState.PROBING and ok and replica.models:
            good, detail = await self._canary(replica, h.canary_timeout_s)
            self.fleet.canary_result(replica, good, self.clock(), detail)
        if self.on_round is not None:
            self.on_round(replica)

    async def _check_health(self, replica: Replica, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                resp = await fetch(
                    self.client,
                    "GET",
                    replica.url + "/health",
                    headers=self._headers(replica),
                    timeout_s=timeout_s,
                )
                return resp.status_code == 200
        except PROBE_ERRORS as exc:
            log.debug("replica=%s /health: %r", replica.name, exc)
            return False

    async def _scrape(self, replica: Replica, timeout_s: float) -> EngineSample | None:
        try:
            async with asyncio.timeout(timeout_s):
                resp = await fetch(
                    self.client,
                    "GET",
                    replica.url + "/metrics",
                    headers={**self._headers(replica), **METRICS_HEADERS},
                    timeout_s=timeout_s,
                )
                if resp.status_code != 200:
                    return None
                return parse_metrics(resp.text)
        except ScrapeError as exc:
            log.debug("replica=%s /metrics: %s", replica.name, exc)
            return None
        except PROBE_ERRORS as exc:
            log.debug("replica=%s /metrics: %r", replica.name, exc)
            return None

    async def _refresh_models(self, replica: Replica, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                resp = await fetch(
                    self.client,
                    "GET",
                    replica.url + "/v1/models",
                    headers=self._headers(replica),
                    timeout_s=timeout_s,
                )
                if resp.status_code == 200:
                    replica.models = model_cards(resp.json())
        except PROBE_ERRORS as exc:
            # Keep the cached list: /v1/models must answer while replicas are down.
            log.debug("replica=%s /v1/models: %r", replica.name, exc)

    async def _canary(self, replica: Replica, timeout_s: float) -> tuple[bool, str]:
        """A real one-token completion for the replica's first model; (success, why)."""
        model = min(replica.models)
        started = self.clock()
        try:
            async with asyncio.timeout(timeout_s):
                resp = await fetch(
                    self.client,
                    "POST",
                    replica.url + CANARY_PATH,
                    json=canary_request(model),
                    headers={**self._headers(replica), **CANARY_HEADERS},
                    timeout_s=timeout_s,
                )
        except TimeoutError:
            return False, f"canary: no token within {timeout_s:g}s"
        except PROBE_ERRORS as exc:
            return False, f"canary: {type(exc).__name__}: {exc}"
        took = self.clock() - started
        if canary_succeeded(resp.status_code, resp.content):
            return True, f"canary token in {took * 1000:.0f} ms"
        return False, f"canary: status {resp.status_code} {resp.content[:200]!r}"

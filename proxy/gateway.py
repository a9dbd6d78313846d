"""The composition root: one gateway process's parts, built and wired once.

``Gateway`` builds the parts (fleet, admission, shared state, the client-key guard, relay,
health, outcomes), swaps in a new policy on reload or when discovery finds other addresses, and
starts, stops and reports readiness. It handles no request itself: ``create_app`` puts the HTTP
edge (``proxy.edge.routes.GatewayApp``) over it, and the edge reads the parts it needs through
small protocols, never this class.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any, Final

from prometheus_client import generate_latest

from proxy.config import Policy, keep_restart_keys, restart_changes
from proxy.edge.auth import ClientKeys, Guard
from proxy.edge.routes import GatewayApp
from proxy.errors import PolicyError
from proxy.fleet.discovery import Discovery, dns_hosts, expand
from proxy.fleet.fleet import Fleet, Replica
from proxy.fleet.health import HealthMonitor
from proxy.fleet.kv_events import KvEventFeeds, PromptTokens
from proxy.observe.merge import Family, families, merge, registry_of, worker_gauges
from proxy.observe.metrics import Metrics
from proxy.observe.outcomes import Outcomes
from proxy.observe.record import Recorder
from proxy.observe.tracing import from_environ as tracer_from_environ
from proxy.policyfile import policy_from_text, read_policy_text
from proxy.relay import continuation
from proxy.relay.homes import ResponseHomes
from proxy.relay.relay import Relay, make_client
from proxy.routing import cache_aware
from proxy.routing.admission import Admission, replica_row
from proxy.routing.estimate import Estimator
from proxy.state.codec import ReplicaRecord
from proxy.state.protocol import SharedState, new_instance_id
from proxy.state.shared import FleetView, shared_state_for
from proxy.state.view import record_of
from proxy.workers.link import WorkerLink, apply_health, health_item

log = logging.getLogger("tokenlane")

POLICY_POLL_S = 1.0


def _cache_aware_pools(policy: Policy) -> list[str]:
    return [name for name, pool in policy.pools.items() if pool.balance == "cache_aware"]


def _continuing_lanes(policy: Policy) -> list[str]:
    return [
        lane.name
        for lane in policy.lanes
        if continuation.continues(policy.continuation, lane.continuation)
    ]


def _file_hash(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).digest()
    except OSError:
        return None


class Gateway:
    """Everything one gateway process holds; shared by the handlers, health and admin."""

    def __init__(
        self,
        policy: Policy,
        *,
        environ: Mapping[str, str] | None = None,
        policy_path: str | None = None,
        link: WorkerLink | None = None,
    ) -> None:
        self.declared = policy  # as written; `policy` is it with DNS replicas expanded
        self.policy = policy
        self.version = 1
        self.policy_path = policy_path
        self.needs_restart: list[str] = []
        # One of several workers of a serve (``--workers``): its link to the others.
        self.link = link
        self.leader = link is None or link.place.leader
        # The text this process runs (a restarted worker's is the leader's: what it loaded).
        self.policy_text: str | None = None
        if policy_path is not None:
            source = link.place.policy_source(policy_path) if link is not None else policy_path
            with contextlib.suppress(PolicyError):
                self.policy_text = read_policy_text(source)
        self.discovery = Discovery()
        self._reload_lock = asyncio.Lock()
        self._policy_hash: bytes | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.environ: Mapping[str, str] = os.environ if environ is None else environ
        self.metrics = Metrics()
        self.fleet: Final = Fleet(policy, self.environ, metrics=self.metrics)
        self.estimator: Final = Estimator.from_config(policy.estimate)
        recorder = Recorder(self.metrics, self.estimator)
        self.outcomes: Final = Outcomes(recorder, recorder.batch_done)
        self.admission = Admission(self.fleet, self.metrics, policy.lanes)
        # In-process unless redis.url is set: then ejections, load and rate limits are shared
        # with the other instances. The workers of one serve share them through their link
        # (and, with Redis, each is an instance of its own there too).
        if link is not None:
            self.admission.ledger = link.ledger
        self.shared: SharedState
        if link is not None and policy.redis.url is None:
            self.shared = link.shared_state(new_instance_id())
        else:
            self.shared = shared_state_for(lambda: self.policy.redis, self.metrics)
        self.guard = Guard(
            ClientKeys.from_env(self.environ, policy.server.api_keys_env),
            self.shared.rate_limiter(lambda: self.policy.rate_limits),
            self.metrics,
        )
        self.max_prefix_chars = max(p.prefix_chars for p in policy.pools.values())
        self.client = make_client(policy, on_stale_resend=self.metrics.stale_resends.inc)
        self.health_client = make_client(policy)
        # Precise cache_aware's render calls: a pool of their own, so a burst of requests never
        # holds up a health probe.
        self.render_client = make_client(policy)
        # Off (None) unless the OTEL_EXPORTER_OTLP_* variables name a collector.
        self.tracer: Final = tracer_from_environ(self.environ)
        # Replicas' KV cache events (precise cache_aware routing), subscribed to from start().
        self.feeds = KvEventFeeds(self.fleet, self.metrics)
        self.relay: Final = Relay(
            self.client,
            admission=self.admission,
            fleet=self.fleet,
            metrics=self.metrics,
            # The policy in force, read on every request: a C-level getter, not a lambda (an
            # interpreted frame, twice a request).
            policy=functools.partial(getattr, self, "policy"),
            tracer=self.tracer,
            homes=ResponseHomes(shared=self.shared),
            share_placement=self.shared.share_placement,
            feeds=self.feeds,
            prompt_tokens=PromptTokens(self.feeds, self.render_client),
        )
        self.health = HealthMonitor(
            self.fleet,
            lambda: self.policy,
            self.health_client,
            self.metrics,
            on_round=link.health_round if link is not None and self.leader else None,
        )
        self.view: FleetView | None = None
        self.active_requests = 0  # relayed requests being handled, queued ones included
        self.shutting_down = False
        for replica in self.fleet.replicas():
            self.metrics.set_replica_state(replica.pool, replica.name, replica.state.value)
        self.metrics.sync(
            policy.lanes,
            self.fleet.replicas(),
            _cache_aware_pools(policy),
            _continuing_lanes(policy),
        )
        for pool in policy.pools:
            self.metrics.panic.labels(pool).set(0)

    # -- policy changes: reload and discovery -----------------------------------------------

    async def reload(self) -> int:
        """Read the policy file again and swap it in whole, or keep the old one and raise
        ``PolicyError`` saying why. Requests in flight finish with the policy they started
        with; replicas that stay keep their health state and counters."""
        if not self.leader:
            return await self._reload_by_leader()
        async with self._reload_lock:
            if self.policy_path is None:
                raise PolicyError(["no policy file: this gateway was started from data"])
            try:
                text = read_policy_text(self.policy_path)
                new = policy_from_text(text, environ=self.environ, name=self.policy_path)
            except PolicyError as exc:
                self.metrics.reloads.labels("invalid").inc()
                log.warning(
                    "policy reload refused, keeping version %d: %s",
                    self.version,
                    "; ".join(exc.problems),
                )
                raise
            self.needs_restart = restart_changes(self.declared, new)
            self._swap(keep_restart_keys(self.declared, new))
            self.version += 1
            self.policy_text = text
            self._policy_hash = _file_hash(self.policy_path)
            self.metrics.reloads.labels("ok").inc()
            if self.link is not None:
                self.link.policy_swapped(text, self.version)
            log.info(
                "policy reloaded: version %d%s",
                self.version,
                f" (restart needed for {', '.join(self.needs_restart)})"
                if self.needs_restart
                else "",
            )
            return self.version

    async def _reload_by_leader(self) -> int:
        """A worker's reload is the leader's: it reads the file and sends every worker the
        text it accepted (this one adopts it from the answer too), or refuses it for all."""
        assert self.link is not None
        answer = await self.link.ask_leader_reload()
        if answer is None or "error" in answer:
            why = "did not answer" if answer is None else f"answered: {answer['error']}"
            raise PolicyError([f"the leader worker {why}; the policy is unchanged"])
        if not answer.get("ok"):
            raise PolicyError([str(p) for p in answer.get("problems", [])])
        self.adopt(str(answer["text"]), int(answer["version"]))
        return int(answer["version"])

    async def reload_answer(self) -> dict[str, Any]:
        """The leader's answer to a worker that asked for a reload."""
        try:
            version = await self.reload()
        except PolicyError as exc:
            return {"ok": False, "problems": exc.problems}
        return {"ok": True, "version": version, "text": self.policy_text}

    def adopt(self, text: str, version: int) -> None:
        """The policy the leader swapped in (a worker's side of a reload): the same text, the
        same version. An older or equal version is one this worker has."""
        if version <= self.version:
            return
        try:
            new = policy_from_text(text, environ=self.environ, name=self.policy_path or "<policy>")
        except PolicyError as exc:  # the leader accepted it: only the environment can differ
            log.error("worker policy version %d refused here: %s", version, exc.problems)
            return
        self.needs_restart = restart_changes(self.declared, new)
        self._swap(keep_restart_keys(self.declared, new))
        self.version = version
        self.policy_text = text
        self.metrics.reloads.labels("ok").inc()
        log.info("policy version %d adopted from the leader worker", version)

    def sync_state(self) -> dict[str, Any]:
        """What a starting worker takes over from this one: states, health, policy."""
        now = self.fleet.clock()
        replicas = list(self.fleet.replicas())
        return {
            "records": [asdict(record_of(r, now)) for r in replicas],
            "health": [health_item(r) for r in replicas],
            "version": self.version,
            "text": self.policy_text,
            "pid": os.getpid(),
            "placements": cache_aware.snapshot(self.fleet),
        }

    def adopt_sync(self, answer: Mapping[str, Any]) -> None:
        if answer.get("text") is not None:
            self.adopt(str(answer["text"]), int(answer["version"]))
        if self.view is not None:
            for raw in answer.get("records", []):
                self.view.apply(ReplicaRecord(**raw))
        replicas = list(self.fleet.replicas())
        for item in answer.get("health", []):  # after the records: slow start goes on as it was
            apply_health(replicas, item)
        cache_aware.adopt(self.fleet, answer.get("placements", {}))

    def in_flight(self, replica: Replica) -> int:
        if self.link is None:
            return replica.in_flight
        return replica.in_flight + self.link.ledger.others(replica_row(replica))

    def _refresh_gauges(self) -> None:
        self.outcomes.flush()  # every request that ended before the scrape is in it
        self.admission.flush_metrics()  # and every queue wait
        m = self.metrics
        for replica in self.fleet.replicas():
            m.replica_in_flight.labels(replica.pool, replica.name).set(replica.in_flight)
            m.set_replica_state(replica.pool, replica.name, replica.state.value)
        # cache_aware pools: what moves between picks, read now.
        cache_aware.export_gauges(self.fleet, m)
        self.feeds.refresh_gauges()

    def local_families(self) -> list[Family]:
        """This process's metrics, as data (one worker's share of a merged scrape)."""
        self._refresh_gauges()
        return families(self.metrics.registry)

    async def scrape(self) -> bytes:
        """The gateway's metrics; with workers, every worker's merged (``observe.merge``)."""
        if self.link is None:
            self._refresh_gauges()
            return generate_latest(self.metrics.registry)
        mine = self.local_families()
        answers = await self.link.peer_metrics()
        index = self.link.place.index
        by_worker: dict[int, list[Family]] = {index: mine}
        for peer, answer in answers.items():
            if answer is not None and "families" in answer:
                by_worker[peer] = answer["families"]
        merged = merge([by_worker[w] for w in sorted(by_worker)])
        merged.extend(worker_gauges(self.link.place.count, len(by_worker)))
        return generate_latest(registry_of(merged))

    def _swap(self, declared: Policy) -> None:
        self.declared = declared
        effective = expand(declared, self.discovery.addresses)
        self.policy = effective
        if self.fleet.apply(effective):
            self.health.replicas_changed()
        self.estimator.configure(declared.estimate)
        self.admission.set_lanes(declared.lanes)
        self.admission.kick()  # new replicas or looser limits may serve waiters now
        self.max_prefix_chars = max(p.prefix_chars for p in declared.pools.values())
        self.metrics.sync(
            declared.lanes,
            self.fleet.replicas(),
            _cache_aware_pools(declared),
            _continuing_lanes(declared),
        )
        self.feeds.sync()
        for pool in declared.pools:
            self.metrics.series(self.metrics.panic, pool)

    async def _watch_policy_file(self) -> None:
        """Reload when the file's content changes. Polling the content (not mtime or inotify)
        also catches editors that save by writing a new file and renaming it over the old."""
        assert self.policy_path is not None
        while True:
            await asyncio.sleep(POLICY_POLL_S)
            digest = _file_hash(self.policy_path)
            if digest is None or digest == self._policy_hash:
                continue
            self._policy_hash = digest
            with contextlib.suppress(PolicyError):
                await self.reload()

    async def _discover(self) -> None:
        while True:
            hosts = dns_hosts(self.declared)
            if hosts and await self.discovery.refresh(hosts):
                async with self._reload_lock:
                    self._swap(self.declared)
            await asyncio.sleep(self.policy.health.interval_s * 10)

    async def reload_logged(self) -> None:
        """A reload whose refusal is only logged (SIGHUP has no one to answer)."""
        with contextlib.suppress(PolicyError):
            await self.reload()

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        if dns_hosts(self.declared):
            await self.discovery.refresh(dns_hosts(self.declared))
            self._swap(self.declared)
        # Before the first health round, so this instance starts from the shared states
        # (bounded by redis.timeout_ms per call: a missing Redis delays nothing).
        self.view = FleetView(self.fleet, self.shared)
        await self.shared.start(self.view)
        if self.link is not None:
            # Takes over the fleet's state (and policy version) from a running worker.
            await self.link.start(self, self.policy_text)
        if self.leader:  # the workers' leader probes for all of them
            await self.health.start()
        self.feeds.start()  # every worker subscribes for itself
        self._tasks = [asyncio.create_task(self._discover())]
        if self.policy_path is not None and self.leader:
            self._policy_hash = _file_hash(self.policy_path)
            self._tasks.append(asyncio.create_task(self._watch_policy_file()))

    async def stop(self) -> None:
        try:
            for task in self._tasks:
                task.cancel()
            await self.admission.close()
            await self.health.stop()
            await self.feeds.stop()
            await self.shared.stop()
            if self.link is not None:
                await self.link.stop()
            await self.client.aclose()
            await self.health_client.aclose()
            await self.render_client.aclose()
        finally:
            self.outcomes.close()
            if self.tracer is not None:
                # Flushes the spans still batched: a blocking export, off the event loop.
                await asyncio.to_thread(self.tracer.shutdown)

    def begin_shutdown(self) -> None:
        """From now on ``/ready`` fails and new requests get 503: a drain has started."""
        self.shutting_down = True

    def ready(self) -> tuple[bool, list[str]]:
        """Every lane has a healthy replica in its pool or its ``spill_to`` pool."""
        if self.shutting_down:
            return False, ["(shutting down)"]
        missing = []
        for lane in self.policy.lanes:
            pools = [lane.pool] + ([lane.spill_to] if lane.spill_to else [])
            if not any(self.fleet.pools[p].has_healthy() for p in pools):
                missing.append(lane.name)
        return not missing, missing


def create_app(
    policy: Policy,
    *,
    environ: Mapping[str, str] | None = None,
    policy_path: str | None = None,
    link: WorkerLink | None = None,
) -> GatewayApp:
    """A gateway and the ASGI app that serves it (``app.gateway`` holds the parts)."""
    return GatewayApp(Gateway(policy, environ=environ, policy_path=policy_path, link=link))


__all__ = ["POLICY_POLL_S", "Gateway", "create_app"]

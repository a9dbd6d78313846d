"""The fleet at run time: who serves what, how loaded, in which health state. The records of
a replica and a pool are in ``replica.py``; this module is the state machine that
moves replicas between states.

The fleet is plain data mutated only on the event loop, so reading it needs no lock. The
balancer never sees it directly: it gets a list of candidate replicas (healthy, serving the
model) and reads their ``load``. The request path reports every attempt here
(``attempt_started`` / ``attempt_finished``) and the health loop reports scrapes, ``/health``
answers and canaries; both feed the state machine below. The decisions themselves (stall, cap,
backoff, decay, which streams to end) are the pure functions of ``detect.py``.

States and what moves a replica between them::

    probing  --canary token within canary_timeout_s and /health 200-->  healthy
    probing  --canary fails-->                                          ejected (canary_failed)
    healthy  --stall / health_check / consecutive_failures /
               first_token_timeout / silent_stream-->                   ejected
    ejected  --ejection over (base × n, capped)-->                      probing
    any      --operator eject-->  ejected (operator; stays until readmitted)
    any      --operator drain-->  draining (finishes what it holds, takes nothing new)
    any      --operator readmit--> probing (canary), or healthy with force

Only ``healthy`` replicas take client requests; ``probing`` ones get canaries only. A draining
replica is left to the operator: detectors do not move it.

Slow start: for ``health.slow_start_s`` after a readmission the replica's ``weight`` ramps from
0.1 to 1 and ``load`` reports ``(raw + 1) / weight - 1``. A least-loaded balancer equalises
that figure, so the newcomer holds about ``weight`` times the in-flight requests of a warm peer.

Length: one job, the state machine that moves replicas between states, kept whole so its
transitions read together.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from proxy.config import HealthConfig, Policy
from proxy.errors import AmbiguousReplica, FailureKind, UnknownReplica
from proxy.fleet import detect
from proxy.fleet.detect import Progress
from proxy.fleet.replica import (
    OUT_OF_SERVICE,
    EjectReason,
    Pool,
    Replica,
    ReplicaState,
    ScrapedStats,
    StreamWatch,
    make_replica,
)
from proxy.fleet.vllm import EngineSample

if TYPE_CHECKING:
    from proxy.observe.metrics import Metrics

log: Final = logging.getLogger("tokenlane.health")

# Failure kinds the request path reports, by the counter they feed.
HARD_FAILURES: Final = frozenset({FailureKind.CONNECT, FailureKind.RESET, FailureKind.UPSTREAM_5XX})
SILENT_FAILURES: Final = {
    FailureKind.FIRST_TOKEN_TIMEOUT: EjectReason.FIRST_TOKEN_TIMEOUT,
    FailureKind.STREAM_IDLE: EjectReason.SILENT_STREAM,
}
# Ejections that a usable answer disproves (a held-back one is dropped on success).
TRAFFIC_REASONS: Final = frozenset(
    {EjectReason.CONSECUTIVE_FAILURES, EjectReason.FIRST_TOKEN_TIMEOUT, EjectReason.SILENT_STREAM}
)


class Fleet:
    """All pools and their replicas; the one place the request path reports to."""

    def __init__(
        self,
        policy: Policy,
        environ: Mapping[str, str] | None = None,
        *,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.environ: Mapping[str, str] = os.environ if environ is None else environ
        self.health: HealthConfig = policy.health
        self.metrics = metrics
        self.clock = clock
        self.leaving: list[Replica] = []  # out of the policy, still finishing requests
        # Called after every transition of a replica's own (not a reload's, not a remote one):
        # shared state publishes it to the other gateway instances.
        self.on_transition: Callable[[Replica], None] | None = None
        self.pools: dict[str, Pool] = {
            name: Pool(name, cfg, [make_replica(name, r, self.environ) for r in cfg.replicas])
            for name, cfg in policy.pools.items()
        }
        # The cache_aware pools' routers by pool name, kept and used by
        # ``proxy.routing.cache_aware`` alone: they live as long as the fleet, across reloads,
        # so a reload keeps what their indexes learnt. (Held here, not in a weak mapping keyed
        # by the fleet: a compiled class takes no weak reference.)
        self.cache_routers: dict[str, Any] = {}
        self.publish_all()

    def publish_all(self) -> None:
        """Every replica's state gauge and every pool's panic gauge, so that dashboards see
        zeros rather than missing series."""
        if self.metrics is None:
            return
        for pool in self.pools.values():
            self.metrics.panic.labels(pool.name).set(1 if pool.panic else 0)
            for replica in pool.replicas:
                self.publish_state(replica)

    def replicas(self) -> Iterator[Replica]:
        for pool in self.pools.values():
            yield from pool.replicas
        yield from self.leaving

    def find(self, url: str, pool: str | None = None) -> list[Replica]:
        url = url.rstrip("/")
        return [r for r in self.replicas() if r.url == url and (pool is None or r.pool == pool)]

    def one(self, url: str, pool: str | None = None) -> Replica:
        """The replica an operator means; ``UnknownReplica`` or ``AmbiguousReplica`` if none or
        several match."""
        found = self.find(url, pool)
        if not found:
            where = f" in pool {pool!r}" if pool is not None else ""
            raise UnknownReplica(f"no replica with URL {url!r}{where}")
        if len(found) > 1:
            pools = ", ".join(sorted(r.pool for r in found))
            raise AmbiguousReplica(f"{url!r} is in several pools ({pools}); name the pool")
        return found[0]

    def models(self) -> dict[str, dict[str, Any]]:
        """The union of every replica's model cards, first seen wins (cached by the health loop,
        so it still answers while some replicas are down)."""
        out: dict[str, dict[str, Any]] = {}
        for replica in self.replicas():
            for model_id, card in replica.models.items():
                out.setdefault(model_id, card)
        return out

    def serves_model(self, model: str) -> bool:
        # Asked for every request: loops, not a generator over ``replicas()`` (2 % of a
        # request's CPU in a profile of the overhead benchmark).
        for pool in self.pools.values():
            for r in pool.replicas:
                if model in r.models:
                    return True
        for r in self.leaving:
            if model in r.models:
                return True
        return False

    def apply(self, policy: Policy) -> bool:
        """Take a reloaded policy: keep replicas (and their health) whose pool and URL stay,
        add new ones in ``probing``; a replica that left the policy drains: it finishes the
        requests it holds, takes no new ones, and is forgotten when it holds none. True when
        the set of replicas changed (the health monitor then needs ``replicas_changed()``)."""
        self.health = policy.health
        old = {(r.pool, r.url): r for r in self.replicas()}
        before = set(old)
        pools: dict[str, Pool] = {}
        for name, cfg in policy.pools.items():
            replicas = []
            for rcfg in cfg.replicas:
                replica = old.pop((name, rcfg.url), None)
                if replica is None:
                    replica = make_replica(name, rcfg, self.environ)
                    self.publish_state(replica)
                else:
                    replica.config = rcfg
                    if replica.name != rcfg.label:  # renamed: its series move to the new name
                        self.forget(replica)
                        replica.name = rcfg.label
                        self.publish_state(replica)
                    replica.api_key = (
                        self.environ.get(rcfg.api_key_env) if rcfg.api_key_env else None
                    )
                    if replica in self.leaving:  # back in the policy before it drained
                        self._move(
                            replica, ReplicaState.PROBING, None, self.clock(), "re-added",
                            shared=False,
                        )  # fmt: skip
                replicas.append(replica)
            previous = self.pools.get(name)
            pool = Pool(name, cfg, replicas)
            if previous is not None:
                pool.rr_counter, pool.panic = previous.rr_counter, previous.panic
            pools[name] = pool
        leaving = []
        for replica in old.values():  # no longer in the policy
            if replica.in_flight == 0:
                self.forget(replica)
                continue
            if replica.state is not ReplicaState.DRAINING:
                self._move(
                    replica, ReplicaState.DRAINING, None, self.clock(), "removed from the policy",
                    shared=False,
                )  # fmt: skip
            leaving.append(replica)
        gone_pools = set(self.pools) - set(pools)
        self.pools = pools
        self.leaving = leaving
        for name in pools:  # a held-back ejection may have left with its replica
            self._update_panic(name)
        if self.metrics is not None:
            for name in gone_pools:
                self.metrics.panic.remove(name)
        return before != {(r.pool, r.url) for r in self.replicas()}

    # -- the request path reports here (hot path: counters only) ----------------------------

    def attempt_started(self, replica: Replica) -> None:
        replica.in_flight += 1
        replica.requests_total += 1

    def attempt_finished(
        self, replica: Replica, failure: FailureKind | None, *, counted: bool = True
    ) -> None:
        """``failure`` is None for a usable answer, else what went wrong (``FailureKind``).

        ``counted=False``: the outcome says nothing about the replica (a 5xx that the same
        request also got on another replica: a poison request), only its slot is freed."""
        if replica.in_flight > 0:
            replica.in_flight -= 1
        if self.leaving and replica.in_flight == 0 and replica in self.leaving:
            self.leaving.remove(replica)  # drained after leaving the policy
            self.forget(replica)
        if not counted:
            return
        if failure is None:
            replica.failures_in_row = 0
            replica.fivexx_in_row = 0
            replica.silent_in_row = 0
            replica.recent_5xx.append(False)
            if replica.capped is not None and replica.capped in TRAFFIC_REASONS:
                self._uncap(replica)
            return
        h = self.health
        if failure == FailureKind.UPSTREAM_5XX:
            self.note_5xx(replica)
            return
        if failure in HARD_FAILURES:
            self._hard_failure(replica)
            return
        reason = SILENT_FAILURES.get(failure)
        if reason is None:
            log.warning("replica=%s unknown failure kind %r ignored", replica.name, failure)
            return
        replica.silent_in_row += 1
        if replica.state is not ReplicaState.HEALTHY:
            return
        agree = detect.not_generating(
            replica.progress, replica.stats.stale, replica.stats.at is not None, h.interval_s
        )
        if detect.silent_failure_ejects(replica.silent_in_row, agree):
            self._fail(replica, reason, self.clock())

    def note_5xx(self, replica: Replica, *, confirmed: bool = False) -> None:
        """A 5xx that is the replica's own (the relay may report one late: when a request's
        5xx was replayed elsewhere, it is counted once the replay's answer is in).

        ``confirmed``: the replay was served fine elsewhere, so the 5xx was this replica's
        fault with no need for peer evidence: it counts toward ``consecutive_failures`` like a
        reset (detect's "suspect replica" rule). A lone replica can be shed this way too."""
        replica.recent_5xx.append(True)
        replica.fivexx_in_row += 1
        if replica.state is not ReplicaState.HEALTHY:
            return
        if confirmed and self._hard_failure(replica):
            return
        peer_5xx = peer_total = 0
        pool = self.pools.get(replica.pool)
        for peer in pool.replicas if pool is not None else ():
            if peer is not replica:
                peer_total += len(peer.recent_5xx)
                peer_5xx += sum(peer.recent_5xx)
        threshold = self.health.consecutive_failures
        if detect.fivexx_outlier(replica.fivexx_in_row, threshold, peer_5xx, peer_total):
            self._fail(replica, EjectReason.CONSECUTIVE_FAILURES, self.clock())

    def _hard_failure(self, replica: Replica) -> bool:
        """One failure that is surely the replica's own (a connect error, a reset, a confirmed
        5xx): toward ``consecutive_failures``. Returns whether it was ejected (or held back)."""
        replica.failures_in_row += 1
        if (
            replica.state is ReplicaState.HEALTHY
            and replica.failures_in_row >= self.health.consecutive_failures
        ):
            self._fail(replica, EjectReason.CONSECUTIVE_FAILURES, self.clock())
            return True
        return False

    # -- the health loop reports here ------------------------------------------------------

    def observe_health(self, replica: Replica, ok: bool, now: float) -> None:
        """One ``/health`` answer (``ok`` = 200 in time)."""
        changed = replica.health_ok != ok
        replica.health_ok = ok
        if changed and replica.capped is not None:
            self._note_outage(replica.pool)
        if ok:
            replica.health_fails_in_row = 0
            if replica.capped is EjectReason.HEALTH_CHECK:
                self._uncap(replica)
            return
        replica.health_fails_in_row += 1
        if (
            replica.state is ReplicaState.HEALTHY
            and replica.health_fails_in_row >= self.health.unhealthy_threshold
        ):
            self._fail(replica, EjectReason.HEALTH_CHECK, now)

    def observe_scrape(self, replica: Replica, sample: EngineSample | None, now: float) -> None:
        """One ``/metrics`` scrape; None when it failed or hung (the stats go stale)."""
        stats = replica.stats
        if sample is None:
            stats.stale = True
            return
        stats.sample = sample
        stats.at = now
        stats.stale = False
        tokens = sample.prompt_tokens_total + sample.generation_tokens_total
        replica.progress = detect.note_scrape(replica.progress, now, sample.running, tokens)
        h = self.health
        if replica.state is not ReplicaState.HEALTHY:
            return
        p = replica.progress
        # Never capped: a stalled replica serves nobody, keeping it only hangs requests.
        if detect.stalled(p, h.stall_after_s, h.interval_s):
            detail = f"running {p.running:g}, token counters flat {detect.flat_for(p):.1f}s"
            self._eject(replica, EjectReason.STALL, now, detail)
        elif replica.streams and detect.traffic_stalled(
            replica.streams, p, now, h.stall_after_s, h.interval_s
        ):
            detail = (
                f"requests waiting, no stream moving, counters flat {detect.unchanged_for(p):.1f}s"
            )
            self._eject(replica, EjectReason.STALL, now, detail)

    def canary_result(self, replica: Replica, ok: bool, now: float, detail: str = "") -> None:
        """A canary ended: a token in time (and ``/health`` 200) readmits, anything else ejects."""
        if replica.state is not ReplicaState.PROBING:
            return  # the operator moved it while the canary ran
        if ok and replica.health_ok:
            self._readmitted(replica, now, detail or "canary answered")
        elif not ok:
            self._eject(replica, EjectReason.CANARY_FAILED, now, detail)

    def tick(self, replica: Replica, now: float) -> None:
        """Time-driven moves, once per health round: ejection over, decay, slow start, and
        ejections the cap held back once there is room again."""
        h = self.health
        if replica.state is ReplicaState.EJECTED and now >= replica.ejected_until:
            self._move(replica, ReplicaState.PROBING, replica.reason, now, "ejection over")
        elif replica.state is ReplicaState.HEALTHY:
            replica.backoff_level, replica.level_since = detect.decay(
                replica.backoff_level, replica.level_since, now, h.eject_base_s
            )
            if replica.healthy_since is not None:
                replica.weight = detect.slow_start_weight(
                    now - replica.healthy_since, h.slow_start_s
                )
            if replica.capped is not None:
                self._fail(replica, replica.capped, now)

    # -- operator actions ------------------------------------------------------------------

    def operator_eject(self, replica: Replica) -> None:
        """Out until an operator readmits it; does not raise its backoff level."""
        now = self.clock()
        if replica.state is ReplicaState.EJECTED and replica.reason is EjectReason.OPERATOR:
            return
        self._eject(replica, EjectReason.OPERATOR, now, "operator", until=math.inf)

    def operator_readmit(self, replica: Replica, force: bool = False) -> None:
        """Back through a canary, or straight to healthy with ``force``. A healthy replica stays."""
        now = self.clock()
        if replica.state is ReplicaState.HEALTHY:
            return
        if force:
            self._readmitted(replica, now, "operator readmit (force)")
        elif replica.state is not ReplicaState.PROBING:
            replica.ejected_until = 0.0
            self._move(replica, ReplicaState.PROBING, replica.reason, now, "operator readmit")

    def operator_drain(self, replica: Replica) -> None:
        now = self.clock()
        if replica.state is not ReplicaState.DRAINING:
            self._uncap(replica)
            self._move(replica, ReplicaState.DRAINING, None, now, "operator drain")

    # -- shared state (issue 7) ------------------------------------------------------------

    def apply_remote(
        self,
        replica: Replica,
        state: ReplicaState,
        reason: EjectReason | None,
        until: float,
        ejections: int,
        level: int,
        source: str,
    ) -> None:
        """A transition another gateway instance made: taken as it is, not shared back, not
        counted in this instance's ejection metrics (its maker counted it). ``until`` is on
        the fleet clock (``math.inf``: until readmitted). The same state again only updates
        the shared counters."""
        now = self.clock()
        replica.ejections = max(replica.ejections, ejections)
        detail = f"from gateway instance {source}"
        if state is replica.state and reason is replica.reason:
            if state is ReplicaState.EJECTED:
                replica.ejected_until, replica.backoff_level = until, level
            return
        if state is ReplicaState.EJECTED:
            replica.ejected_until, replica.backoff_level = until, level
            replica.healthy_since = None
            self._uncap(replica)
            self._move(replica, state, reason, now, detail, shared=False)
            self._rescue(replica, now)
        elif state is ReplicaState.HEALTHY:
            self._readmitted(replica, now, detail, shared=False)
        else:
            replica.ejected_until = 0.0
            self._uncap(replica)  # held back only while healthy: out of service, it is moot
            self._move(replica, state, reason, now, detail, shared=False)

    def probe_for_request(self, replica: Replica, why: str) -> bool:
        """A request found no replica to go to: try ``replica`` (ejected) again now rather than
        at the end of its ejection, if ``detect.probe_when_no_target`` says so. Returns whether
        it is now probing (its canary goes out at its next health round)."""
        now = self.clock()
        if replica.state is not ReplicaState.EJECTED or not detect.probe_when_no_target(
            replica.reason is not EjectReason.OPERATOR,
            replica.ejected_until,
            now,
            replica.health_ok,
            replica.probed_for_request,
        ):
            return False
        replica.probed_for_request = True
        replica.ejected_until = 0.0
        self._move(replica, ReplicaState.PROBING, replica.reason, now, f"probed early: {why}")
        return True

    # -- transitions -----------------------------------------------------------------------

    def _fail(self, replica: Replica, reason: EjectReason, now: float) -> None:
        """A failure-based ejection: subject to max_ejected_percent."""
        pool = self.pools.get(replica.pool)
        if pool is None or replica not in pool.replicas:
            return  # reloaded away while a request to it was in flight
        out = sum(1 for r in pool.replicas if r.state in OUT_OF_SERVICE)
        if detect.may_eject(len(pool.replicas), out, self.health.max_ejected_percent):
            self._eject(replica, reason, now, "")
            return
        first = replica.capped is None
        if first:
            log.warning(
                "replica=%s pool=%s ejection for %s held back: %d of %d replicas already out "
                "(max_ejected_percent %d); it keeps serving",
                replica.name, replica.pool, reason.value, out, len(pool.replicas),
                self.health.max_ejected_percent,
            )  # fmt: skip
        replica.capped = reason
        self._update_panic(pool.name)
        if first:
            for other in pool.replicas:
                if other.state is ReplicaState.EJECTED and detect.probe_early(
                    other.reason is not EjectReason.OPERATOR, other.ejected_until, now
                ):
                    other.ejected_until = 0.0
                    self._move(other, ReplicaState.PROBING, other.reason, now,
                               f"probed early: {replica.name}'s ejection is held back")  # fmt: skip

    def _eject(
        self,
        replica: Replica,
        reason: EjectReason,
        now: float,
        detail: str,
        until: float | None = None,
    ) -> None:
        h = self.health
        if until is None:
            replica.backoff_level += 1
            until = now + detect.backoff_s(replica.backoff_level, h.eject_base_s, h.eject_max_s)
        replica.ejected_until = until
        replica.ejections += 1
        replica.healthy_since = None
        had_cap = replica.capped is not None
        replica.capped = None
        if self.metrics is not None:
            self.metrics.ejections.labels(replica.pool, replica.name, reason.value).inc()
        lasts = "until_readmitted" if math.isinf(until) else f"{until - now:.1f}s"
        self._move(replica, ReplicaState.EJECTED, reason, now, detail, ejected_for=lasts)
        if had_cap:
            self._update_panic(replica.pool)
        self._rescue(replica, now)

    def _readmitted(
        self, replica: Replica, now: float, detail: str, *, shared: bool = True
    ) -> None:
        replica.failures_in_row = 0
        replica.fivexx_in_row = 0
        replica.silent_in_row = 0
        replica.health_fails_in_row = 0
        replica.ejected_until = 0.0
        replica.probed_for_request = False
        replica.progress = Progress()  # a stall before the ejection says nothing about now
        replica.healthy_since = now
        replica.level_since = now
        replica.weight = detect.slow_start_weight(0.0, self.health.slow_start_s)
        self._uncap(replica)  # it just proved itself: failures from before count no more
        self._move(replica, ReplicaState.HEALTHY, None, now, detail, shared=shared)

    def _rescue(self, replica: Replica, now: float) -> None:
        """End the silent streams of an ejected replica; progressing ones go on."""
        for watch in detect.silent_streams(list(replica.streams), now, self.health.interval_s):
            try:
                watch.interrupt("replica_ejected")
            except Exception:  # one broken watch must not keep the others hanging
                log.exception("replica=%s interrupting a stream failed", replica.name)

    def _uncap(self, replica: Replica) -> None:
        if replica.capped is not None:
            replica.capped = None
            self._update_panic(replica.pool)

    def _update_panic(self, pool_name: str) -> None:
        pool = self.pools.get(pool_name)
        if pool is None:
            return
        panic = any(r.capped is not None for r in pool.replicas)
        if panic != pool.panic:
            pool.panic = panic
            log.warning("pool=%s panic %s", pool.name, "on" if panic else "off")
            self._note_outage(pool_name)
        if self.metrics is not None:
            self.metrics.panic.labels(pool.name).set(1 if panic else 0)

    def _note_outage(self, pool_name: str) -> None:
        """Log an outage of the pool as it starts and ends (``Pool.outage`` is computed on
        demand; this only keeps the log to its edges)."""
        pool = self.pools.get(pool_name)
        if pool is None:
            return
        outage = pool.panic and pool.outage
        if outage != pool.outage_logged:
            pool.outage_logged = outage
            if outage:
                log.error(
                    "pool=%s outage: every replica is out or failing; requests get 503 "
                    "no_replica until one answers /health", pool.name,
                )  # fmt: skip
            else:
                log.warning("pool=%s outage over", pool.name)

    def _move(
        self,
        replica: Replica,
        to: ReplicaState,
        reason: EjectReason | None,
        now: float,
        detail: str,
        *,
        shared: bool = True,
        ejected_for: str | None = None,
    ) -> None:
        before = replica.state
        replica.state = to
        replica.reason = reason
        replica.since = now
        replica.changed_at = time.time()
        # One field per fact: a field that does not apply is left out (no "reason=None"), and
        # the ejection's length is its own field, not part of the evidence.
        fields = [
            f"replica={replica.name}",
            f"pool={replica.pool}",
            f"from={before.value}",
            f"to={to.value}",
        ]
        if reason is not None:
            fields.append(f"reason={reason.value}")
        if ejected_for is not None:
            fields.append(f"ejected_for={ejected_for}")
        if detail:
            fields.append(f"evidence={json.dumps(detail)}")
        log.info(
            "%s", " ".join(fields),
            extra={
                "replica": replica.name, "pool": replica.pool, "from_state": before.value,
                "to_state": to.value, "reason": reason.value if reason else None,
                "evidence": detail or None, "ejected_for": ejected_for,
            },
        )  # fmt: skip
        self.publish_state(replica)
        if shared and self.on_transition is not None:
            self.on_transition(replica)

    def publish_state(self, replica: Replica) -> None:
        if self.metrics is not None:
            self.metrics.set_replica_state(replica.pool, replica.name, replica.state.value)

    def forget(self, replica: Replica) -> None:
        """The replica left the fleet: its gauges go with it."""
        if self.metrics is not None:
            self.metrics.forget_replica(replica.pool, replica.name)


# The replica records are re-exported: the fleet's users import them from here.
__all__ = [
    "EjectReason",
    "Fleet",
    "Pool",
    "Replica",
    "ReplicaState",
    "ScrapedStats",
    "StreamWatch",
    "make_replica",
]

"""A replica and a pool as the fleet keeps them: plain data with the few figures read off it
(load, saturation, the admin row). The fleet (``proxy.fleet.fleet``) moves them between states;
the balancer reads them."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Final, Protocol

from proxy.config import PoolConfig, ReplicaConfig
from proxy.fleet import detect
from proxy.fleet.detect import Progress
from proxy.fleet.vllm import EngineSample


class ReplicaState(StrEnum):
    PROBING = "probing"  # not yet (or no longer) proven to generate; gets canaries only
    HEALTHY = "healthy"  # takes client requests
    EJECTED = "ejected"  # out until its ejection ends, then back to probing
    DRAINING = "draining"  # finishes what it holds, takes nothing new


class EjectReason(StrEnum):
    STALL = "stall"
    SILENT_STREAM = "silent_stream"
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"
    HEALTH_CHECK = "health_check"
    CONSECUTIVE_FAILURES = "consecutive_failures"
    CANARY_FAILED = "canary_failed"
    OPERATOR = "operator"


# Out of service, for the max_ejected_percent cap: not taking client requests, not by choice.
OUT_OF_SERVICE: Final = (ReplicaState.EJECTED, ReplicaState.PROBING)


class StreamWatch(Protocol):
    """What the fleet sees of one relayed attempt: enough to end it when its replica is ejected.

    ``last_progress`` is the monotonic time of the last chunk from upstream (or the attempt's
    start); ``content_sent`` tells whether any content reached the client (then it cannot be
    retried, only ended with an SSE error event).
    """

    last_progress: float

    @property
    def content_sent(self) -> bool: ...

    def interrupt(self, reason: str) -> None: ...


@dataclass(slots=True)
class ScrapedStats:
    """The last good ``/metrics`` sample, when it was taken (monotonic seconds; None = never)
    and whether the scrapes since have failed (stale)."""

    sample: EngineSample = field(default_factory=EngineSample)
    at: float | None = None
    stale: bool = True

    @property
    def waiting(self) -> float:
        return self.sample.waiting


@dataclass(eq=False, slots=True)
class Replica:
    pool: str
    config: ReplicaConfig
    name: str
    url: str
    api_key: str | None = None
    state: ReplicaState = ReplicaState.PROBING
    reason: EjectReason | None = None  # why it is (or last was) out; None once healthy again
    in_flight: int = 0
    remote_in_flight: int = 0  # other gateway instances' in-flight to it (shared state, issue 7)
    sibling_in_flight: int = 0  # the other workers' of this serve (``serve --workers``)
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> model card
    ejections: int = 0  # total, for the admin view
    ejected_until: float = 0.0
    stats: ScrapedStats = field(default_factory=ScrapedStats)
    requests_total: int = 0
    failures_in_row: int = 0  # connect errors and resets
    fivexx_in_row: int = 0  # 5xx answers (ejecting only as an outlier: detect.fivexx_outlier)
    # The last attempts' outcomes (True: a 5xx), for the peers' side of that comparison.
    recent_5xx: deque[bool] = field(default_factory=lambda: deque(maxlen=detect.FIVEXX_WINDOW))
    streams: set[StreamWatch] = field(default_factory=set)  # attempts in flight, for rescue
    # -- health bookkeeping (fleet and health loop only) --
    silent_in_row: int = 0  # first-token timeouts and idle streams
    health_fails_in_row: int = 0
    health_ok: bool = False  # the last /health answer was 200
    progress: Progress = field(default_factory=Progress)
    backoff_level: int = 0  # n of "the n-th ejection lasts base × n"; decays while healthy
    level_since: float = 0.0  # reference time for the decay
    healthy_since: float | None = None
    weight: float = 1.0  # slow start share, 0.1..1
    capped: EjectReason | None = None  # an ejection the max_ejected_percent cap holds back
    # Probed before its ejection was over because a request had no replica to go to: once until
    # it is back in service (detect.probe_when_no_target).
    probed_for_request: bool = False
    since: float = 0.0  # when the current state began (fleet clock)
    changed_at: float | None = None  # the same, as Unix time: for people and other processes

    @property
    def max_in_flight(self) -> int:
        return self.config.max_in_flight

    @property
    def load(self) -> float:
        """In-flight from this gateway (and from the others, with shared state or workers) plus
        the replica's own waiting queue.

        A replica whose scrape is stale counts as busy (its full ``max_in_flight``), never as idle:
        a hung ``/metrics`` must not attract traffic. During slow start the figure is inflated
        so that the replica holds about ``weight`` of a warm peer's share.
        """
        # With Redis each worker is an instance too: the (older) Redis figure includes the
        # siblings, so the two are not added.
        others = max(self.remote_in_flight, self.sibling_in_flight)
        if self.stats.stale and self.stats.at is not None:
            raw: float = float(self.in_flight + others + self.config.max_in_flight)
        else:
            raw = float(self.in_flight + others + self.stats.waiting)
        if self.weight < 1.0:
            return (raw + 1.0) / self.weight - 1.0
        return raw

    @property
    def saturated(self) -> bool:
        return self.in_flight >= self.config.max_in_flight

    def serves(self, model: str | None) -> bool:
        return model is None or model in self.models

    def row(self) -> dict[str, Any]:
        """The replica as the admin API shows it."""
        s = self.stats
        return {
            "pool": self.pool,
            "name": self.name,
            "url": self.url,
            "state": self.state.value,
            "reason": self.reason.value if self.reason else None,
            "in_flight": self.in_flight,
            "ejections": self.ejections,
            "models": sorted(self.models),
            "stats": {
                **asdict(s.sample),
                "stale": s.stale,
                "scraped_at": s.at,
                "requests_total": self.requests_total,
                "failures_in_row": self.failures_in_row,
                "fivexx_in_row": self.fivexx_in_row,
                "silent_in_row": self.silent_in_row,
                "health_fails_in_row": self.health_fails_in_row,
                "backoff_level": self.backoff_level,
                # the current ejection's length; None when not ejected or until readmitted
                "ejection_s": (
                    round(self.ejected_until - self.since, 3)
                    if self.state is ReplicaState.EJECTED and not math.isinf(self.ejected_until)
                    else None
                ),
                "weight": self.weight,
                "state_changed_at": self.changed_at,
                "capped": self.capped.value if self.capped else None,
            },
        }


@dataclass(eq=False, slots=True)
class Pool:
    name: str
    config: PoolConfig
    replicas: list[Replica]
    rr_counter: int = 0
    panic: bool = False  # an ejection is held back by max_ejected_percent
    outage_logged: bool = False  # the last outage edge logged (see Fleet._note_outage)

    def candidates(self, model: str | None) -> list[Replica]:
        """Replicas that may take a client request for ``model`` now (none in an outage)."""
        if self.panic and self.outage:
            return []
        return [r for r in self.replicas if r.state is ReplicaState.HEALTHY and r.serves(model)]

    def has_healthy(self) -> bool:
        return not self.outage and any(r.state is ReplicaState.HEALTHY for r in self.replicas)

    @property
    def outage(self) -> bool:
        """Every replica out of service, or kept in only by the ejection cap while its own
        ``/health`` fails too: the cap keeps no capacity then, only slow failures in the
        route. (A held-back replica whose ``/health`` answers keeps serving: its successes
        lift the hold.)"""
        return detect.in_outage(
            r.state in OUT_OF_SERVICE or (r.capped is not None and not r.health_ok)
            for r in self.replicas
        )


def make_replica(pool: str, cfg: ReplicaConfig, environ: Mapping[str, str]) -> Replica:
    api_key = environ.get(cfg.api_key_env) if cfg.api_key_env else None
    return Replica(pool=pool, config=cfg, name=cfg.label, url=cfg.url, api_key=api_key)

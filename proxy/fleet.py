"""Replicas and pools at run time: who serves what, how loaded, in which health state.

The fleet is plain data mutated only on the event loop, so reading it needs no lock. The
balancer never sees it directly: it gets a list of candidate replicas (healthy, serving the
model) and reads their ``load``. The request path reports every attempt here
(``attempt_started`` / ``attempt_finished``) and the health loop reports scrapes; both feed the
state machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from .config import Policy, PoolConfig, ReplicaConfig


class ReplicaState(str, Enum):
    PROBING = "probing"  # not yet (or no longer) proven to generate; gets canaries only
    HEALTHY = "healthy"  # takes client requests
    EJECTED = "ejected"  # out until its ejection ends, then back to probing
    DRAINING = "draining"  # finishes what it holds, takes nothing new


class EjectReason(str, Enum):
    STALL = "stall"
    SILENT_STREAM = "silent_stream"
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"
    HEALTH_CHECK = "health_check"
    CONSECUTIVE_FAILURES = "consecutive_failures"
    CANARY_FAILED = "canary_failed"
    OPERATOR = "operator"


class StreamWatch(Protocol):
    """What the fleet sees of one relayed attempt: enough to end it when its replica is ejected.

    ``last_progress`` is the monotonic time of the last chunk from upstream (or the attempt's
    start); ``content_sent`` tells whether any content reached the client (then it cannot be
    retried, only ended with an SSE error event).
    """

    last_progress: float
    content_sent: bool

    def interrupt(self, reason: str) -> None: ...


@dataclass(slots=True)
class ScrapedStats:
    """What the last ``/metrics`` scrape said. ``at`` is monotonic seconds; None = never."""

    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0
    prompt_tokens_total: float = 0.0
    generation_tokens_total: float = 0.0
    at: float | None = None
    stale: bool = True


@dataclass(eq=False, slots=True)
class Replica:
    pool: str
    config: ReplicaConfig
    name: str
    url: str
    api_key: str | None = None
    state: ReplicaState = ReplicaState.PROBING
    reason: EjectReason | None = None
    in_flight: int = 0
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> model card
    ejections: int = 0
    ejected_until: float = 0.0
    stats: ScrapedStats = field(default_factory=ScrapedStats)
    requests_total: int = 0
    failures_in_row: int = 0
    streams: set[StreamWatch] = field(default_factory=set)  # attempts in flight, for rescue

    @property
    def max_in_flight(self) -> int:
        return self.config.max_in_flight

    @property
    def load(self) -> float:
        """In-flight from this gateway plus the replica's own waiting queue.

        A replica whose scrape is stale counts as busy (its full ``max_in_flight``), never as idle:
        a hung ``/metrics`` must not attract traffic.
        """
        if self.stats.stale and self.stats.at is not None:
            return self.in_flight + self.config.max_in_flight
        return self.in_flight + self.stats.waiting

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
                "running": s.running,
                "waiting": s.waiting,
                "kv_cache_usage": s.kv_cache_usage,
                "prompt_tokens_total": s.prompt_tokens_total,
                "generation_tokens_total": s.generation_tokens_total,
                "stale": s.stale,
                "requests_total": self.requests_total,
                "failures_in_row": self.failures_in_row,
            },
        }


@dataclass(eq=False, slots=True)
class Pool:
    name: str
    config: PoolConfig
    replicas: list[Replica]
    rr_counter: int = 0

    def candidates(self, model: str | None) -> list[Replica]:
        """Replicas that may take a client request for ``model`` now."""
        return [r for r in self.replicas if r.state is ReplicaState.HEALTHY and r.serves(model)]

    def has_healthy(self) -> bool:
        return any(r.state is ReplicaState.HEALTHY for r in self.replicas)


def make_replica(pool: str, cfg: ReplicaConfig, environ: Mapping[str, str]) -> Replica:
    api_key = environ.get(cfg.api_key_env) if cfg.api_key_env else None
    return Replica(pool=pool, config=cfg, name=cfg.label, url=cfg.url, api_key=api_key)


class Fleet:
    """All pools and their replicas; the one place the request path reports to."""

    def __init__(self, policy: Policy, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.pools: dict[str, Pool] = {
            name: Pool(name, cfg, [make_replica(name, r, env) for r in cfg.replicas])
            for name, cfg in policy.pools.items()
        }

    def replicas(self) -> Iterator[Replica]:
        for pool in self.pools.values():
            yield from pool.replicas

    def find(self, url: str, pool: str | None = None) -> list[Replica]:
        url = url.rstrip("/")
        return [r for r in self.replicas() if r.url == url and (pool is None or r.pool == pool)]

    def models(self) -> dict[str, dict[str, Any]]:
        """The union of every replica's model cards, first seen wins (cached by the health loop,
        so it still answers while some replicas are down)."""
        out: dict[str, dict[str, Any]] = {}
        for replica in self.replicas():
            for model_id, card in replica.models.items():
                out.setdefault(model_id, card)
        return out

    def serves_model(self, model: str) -> bool:
        return any(model in r.models for r in self.replicas())

    # -- the request path reports here -----------------------------------------------------

    def attempt_started(self, replica: Replica) -> None:
        replica.in_flight += 1
        replica.requests_total += 1

    def attempt_finished(self, replica: Replica, failure: str | None) -> None:
        """``failure`` is None for a usable answer, else a kind: ``connect``, ``reset``,
        ``upstream_5xx``, ``first_token_timeout``, ``stream_idle``."""
        replica.in_flight -= 1
        if failure is None:
            replica.failures_in_row = 0
        else:
            replica.failures_in_row += 1

"""Rate limits shared by several gateway instances: leased from Redis.

Every instance decides each request from a local stock per key and limit, with no Redis call
on the request path. The stock comes in batches (``LEASE_FRACTION`` of a minute's limit)
leased from one token bucket per key and limit kept in Redis (``scripts.LEASE``, which
refills it by the Redis server's clock). ``RedisState``'s lease loop asks for the batches that
``LeasedRateLimiter.due`` lists and hands the answers to ``LeasedRateLimiter.settle``.

When the stock runs out before the next lease lands, a request may be spent on credit while
the shared bucket is not known to be empty (``may_spend``), so N instances overshoot a limit by
at most N batches. While Redis is unreachable each instance enforces its share of the limits
locally (``LocalRateLimiter`` over ``scaled`` limits: limit / live instances last seen).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from proxy.config import RateLimitsConfig
from proxy.routing.ratelimit import (
    REQUEST_TOO_LARGE_RETRY_AFTER_S,
    LimitState,
    LocalRateLimiter,
    Verdict,
)

LEASE_TICK_S = 0.25  # the lease loop looks at the stocks this often (and when woken)
LEASE_FRACTION = 0.05  # one lease batch: 5 % of a minute's limit (at least 1)
BUCKET_IDLE_MS = 120_000  # a shared bucket idle this long is full again: let Redis drop it


class LeaseHolder(Protocol):
    """What a ``LeasedRateLimiter`` needs from the shared state that leases for it
    (``RedisState``)."""

    clock: Callable[[], float]
    instances: int  # live instances, this one included, as last seen

    @property
    def up(self) -> bool: ...

    def wake_leases(self) -> None:
        """Run the lease loop now: a stock ran low."""
        ...


@dataclass(slots=True)
class Lease:
    """One key's stock of one limit, leased from the shared bucket.

    ``stock`` is leased and unspent; below 0 it is spent on credit, owed to the shared bucket
    and settled by the next lease. ``exhausted``: the last lease got less than it asked, so no
    more credit until one does. ``want``: the largest cost refused for lack of stock (the next
    lease asks for at least that much).
    """

    stock: float = 0.0
    left: float | None = None  # the shared bucket's level after our last lease; None: never
    exhausted: bool = False
    want: float = 0.0
    next_at: float = 0.0  # no lease before this (the shared bucket was empty)


@dataclass(frozen=True, slots=True)
class LeaseAsk:
    kind: str  # "requests" or "tokens"
    key: str
    limit: int
    amount: float


def batch_size(limit: int) -> float:
    return float(max(1, math.ceil(limit * LEASE_FRACTION)))


def may_spend(lease: Lease, cost: float, batch: float) -> bool:
    """Pay from stock; else, while the shared bucket is not known to be empty, on credit: up to
    one batch of debt, or one request when nothing is owed. So N instances overshoot a limit by
    at most N batches (or N requests larger than a batch)."""
    if cost <= lease.stock:
        return True
    if lease.exhausted:
        return False
    return lease.stock >= 0 or lease.stock - cost >= -batch


def lease_amount(lease: Lease, batch: float) -> float:
    """Enough to settle the debt and hold one batch (or the largest refused cost)."""
    return max(0.0, max(batch, lease.want) - lease.stock)


def needs_lease(lease: Lease, batch: float, now: float) -> bool:
    low = lease.stock < batch / 2 or lease.want > lease.stock
    return low and now >= lease.next_at


def settle(
    lease: Lease, asked: float, granted: float, left: float, now: float, per_s: float
) -> None:
    lease.stock += granted
    lease.left = left
    lease.exhausted = granted + 1e-9 < asked
    if lease.stock >= lease.want:
        lease.want = 0.0
    if lease.exhausted:
        # Ask again when the bucket will have refilled what was missing (within 1 s).
        lease.next_at = now + min(1.0, max(LEASE_TICK_S, (asked - granted) / per_s))
    else:
        lease.next_at = 0.0


def limit_state(lease: Lease, limit: int) -> LimitState:
    shared = lease.left if lease.left is not None else float(limit)
    remaining = int(max(0.0, min(float(limit), shared + max(lease.stock, 0.0))))
    return LimitState(limit=limit, remaining=remaining, reset_s=(limit - remaining) * 60.0 / limit)


def scaled(cfg: RateLimitsConfig, instances: int) -> RateLimitsConfig:
    """Each instance's share of the limits while Redis is unreachable."""
    n = max(1, instances)

    def share(limit: int | None) -> int | None:
        return None if limit is None else math.ceil(limit / n)

    return RateLimitsConfig(
        requests_per_min=share(cfg.requests_per_min), tokens_per_min=share(cfg.tokens_per_min)
    )


@dataclass
class LeasedRateLimiter:
    """Per-key limits shared by all instances: decided from local stock, with no Redis call
    per request; ``RedisState`` refills the stock in the background. While Redis is down each
    instance enforces its share of the limits (limit / live instances last seen) locally."""

    state: LeaseHolder
    limits: Callable[[], RateLimitsConfig]
    leases: dict[tuple[str, str], Lease] = field(default_factory=dict)
    fallback: LocalRateLimiter = field(init=False)

    def __post_init__(self) -> None:
        self.fallback = LocalRateLimiter(lambda: scaled(self.limits(), self.state.instances))

    @property
    def enabled(self) -> bool:
        cfg = self.limits()
        return cfg.requests_per_min is not None or cfg.tokens_per_min is not None

    def check(self, key: str, tokens: int) -> Verdict:
        if not self.state.up:
            return self.fallback.check(key, tokens)
        cfg = self.limits()
        parts: list[tuple[str, int, float, Lease]] = []
        for kind, limit, cost in (
            ("requests", cfg.requests_per_min, 1.0),
            ("tokens", cfg.tokens_per_min, tokens),  # an int: see LocalRateLimiter.check
        ):
            if limit is not None:
                lease = self.leases.get((kind, key))
                if lease is None:
                    lease = self.leases[(kind, key)] = Lease()
                parts.append((kind, limit, cost, lease))
        too_large = any(cost > limit for _, limit, cost, _ in parts)
        # A too-large cost is never spent: no arithmetic with it (it may be beyond any float).
        short = [p for p in parts if not too_large and not may_spend(p[3], p[2], batch_size(p[1]))]
        allowed = not too_large and not short
        wait = 0.0
        if allowed:
            for _, _, cost, lease in parts:
                lease.stock -= cost
        elif too_large:
            wait = REQUEST_TOO_LARGE_RETRY_AFTER_S
        else:
            for _, limit, cost, lease in short:
                lease.want = max(lease.want, cost)
                wait = max(wait, _retry_after(lease, cost, limit))
        now = self.state.clock()
        if any(needs_lease(lease, batch_size(limit), now) for _, limit, _, lease in parts):
            self.state.wake_leases()
        states = {kind: limit_state(lease, limit) for kind, limit, _, lease in parts}
        return Verdict(
            allowed=allowed,
            retry_after_s=wait,
            requests=states.get("requests"),
            tokens=states.get("tokens"),
            too_large=too_large,
        )

    def due(self, now: float) -> list[LeaseAsk]:
        cfg = self.limits()
        limits = {"requests": cfg.requests_per_min, "tokens": cfg.tokens_per_min}
        asks = []
        for (kind, key), lease in self.leases.items():
            limit = limits[kind]
            if limit is None:
                continue
            batch = batch_size(limit)
            if needs_lease(lease, batch, now):
                asks.append(LeaseAsk(kind, key, limit, lease_amount(lease, batch)))
        return asks

    def settle(self, asks: list[LeaseAsk], results: list[tuple[float, float]], now: float) -> None:
        for ask, (granted, left) in zip(asks, results, strict=True):
            lease = self.leases.get((ask.kind, ask.key))
            if lease is not None:
                settle(lease, ask.amount, granted, left, now, ask.limit / 60.0)


def _retry_after(lease: Lease, cost: float, limit: int) -> float:
    """Until the shared bucket should hold what this request lacks (a lease on its way when it
    is not known to be empty)."""
    if not lease.exhausted:
        return LEASE_TICK_S
    lacking = cost - lease.stock - max(lease.left or 0.0, 0.0)
    return max(LEASE_TICK_S, lacking * 60.0 / limit)

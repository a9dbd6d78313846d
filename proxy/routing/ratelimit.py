"""Per-key rate limits (docs/policy.md): requests and estimated tokens per minute.

Each key has two token buckets, one per limit, of capacity ``limit`` refilling continuously at
``limit / 60`` per second, so a key may burst a whole minute's budget and then goes on at the
steady rate. A request passes only when both buckets hold its cost, and then takes from both:
a request refused for tokens does not spend a request.

What a refusal says, as OpenAI says it: ``x-ratelimit-limit-*`` (the per-minute limit),
``x-ratelimit-remaining-*`` (whole units left), ``x-ratelimit-reset-*`` (until the bucket is full
again, as a Go duration: ``"1s"``, ``"6m0s"``, ``"120ms"``) and ``Retry-After`` (until this request
would pass). A request costing more than a whole minute's tokens can never pass; it is refused
with the longest ``Retry-After`` and a message that says so.

The seam for shared limits (issue 7): ``RateLimiter`` is what the gateway calls. The local one
(here) refills its buckets from the clock; the shared one (``proxy.state.leases``) decides from a
local stock too, without I/O per request, and refills it by leasing batches of tokens from Redis
in the background, so several gateways share one budget without a round trip per request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from proxy.config import RateLimitsConfig

REQUEST_TOO_LARGE_RETRY_AFTER_S = 60.0


@dataclass(slots=True)
class TokenBucket:
    """``level`` units, at most ``capacity``, refilled at ``per_s`` since ``at``."""

    capacity: float
    per_s: float
    level: float
    at: float

    @classmethod
    def per_minute(cls, limit: int, now: float) -> TokenBucket:
        return cls(capacity=float(limit), per_s=limit / 60.0, level=float(limit), at=now)

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.per_s)
            self.at = now

    def resize(self, limit: int) -> None:
        """A reloaded limit: keep what is left, within the new capacity."""
        self.capacity = float(limit)
        self.per_s = limit / 60.0
        self.level = min(self.level, self.capacity)

    def add(self, n: float) -> None:
        """Tokens from elsewhere (a lease from a shared budget; a refund)."""
        self.level = min(self.capacity, self.level + n)

    def wait_s(self, cost: int | float) -> float:
        """Seconds until ``cost`` fits (0 if it fits now; inf if it never can).

        ``cost`` may be any int a client can write (``max_tokens: 10**400``): Python compares
        an int with a float exactly, and only a cost within ``capacity`` is ever converted."""
        if cost <= self.level:
            return 0.0
        if cost > self.capacity:
            return math.inf
        return (cost - self.level) / self.per_s

    def full_in_s(self) -> float:
        return (self.capacity - self.level) / self.per_s


@dataclass(frozen=True, slots=True)
class LimitState:
    """One limit as the response headers show it."""

    limit: int
    remaining: int
    reset_s: float


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    retry_after_s: float = 0.0
    requests: LimitState | None = None
    tokens: LimitState | None = None
    too_large: bool = False  # the request alone exceeds a whole minute's limit

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, state in (("requests", self.requests), ("tokens", self.tokens)):
            if state is not None:
                out[f"x-ratelimit-limit-{name}"] = str(state.limit)
                out[f"x-ratelimit-remaining-{name}"] = str(state.remaining)
                out[f"x-ratelimit-reset-{name}"] = go_duration(state.reset_s)
        return out


class RateLimiter(Protocol):
    """What the gateway asks before admitting a request of ``key`` costing ``tokens``."""

    def check(self, key: str, tokens: int) -> Verdict: ...

    @property
    def enabled(self) -> bool: ...


@dataclass(slots=True)
class KeyBuckets:
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None


@dataclass
class LocalRateLimiter:
    """Buckets in this process, one pair per key. Keys are the configured client keys' ids, so
    the table is as small as the key list."""

    limits: Callable[[], RateLimitsConfig]
    clock: Callable[[], float] = time.monotonic
    buckets: dict[str, KeyBuckets] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        cfg = self.limits()
        return cfg.requests_per_min is not None or cfg.tokens_per_min is not None

    def check(self, key: str, tokens: int) -> Verdict:
        cfg = self.limits()
        now = self.clock()
        kb = self.buckets.get(key)
        if kb is None:
            kb = self.buckets[key] = KeyBuckets()
        kb.requests = _sync(kb.requests, cfg.requests_per_min, now)
        kb.tokens = _sync(kb.tokens, cfg.tokens_per_min, now)
        # The token cost stays an int: a client-chosen one may be beyond any float
        # (``float(10**400)`` raises), and a cost over a minute's budget is refused as too
        # large, whatever its size. Only a cost that fits is ever subtracted.
        costs = ((kb.requests, 1), (kb.tokens, tokens))
        wait = max((b.wait_s(c) for b, c in costs if b is not None), default=0.0)
        allowed = wait == 0.0
        if allowed:
            for bucket, cost in costs:
                if bucket is not None:
                    bucket.level -= cost
        too_large = math.isinf(wait)
        return Verdict(
            allowed=allowed,
            retry_after_s=REQUEST_TOO_LARGE_RETRY_AFTER_S if too_large else wait,
            requests=_state(kb.requests),
            tokens=_state(kb.tokens),
            too_large=too_large,
        )


def _sync(bucket: TokenBucket | None, limit: int | None, now: float) -> TokenBucket | None:
    """The bucket for ``limit`` now: made, resized, refilled, or dropped when unlimited."""
    if limit is None:
        return None
    if bucket is None:
        return TokenBucket.per_minute(limit, now)
    if bucket.capacity != limit:
        bucket.resize(limit)
    bucket.refill(now)
    return bucket


def _state(bucket: TokenBucket | None) -> LimitState | None:
    if bucket is None:
        return None
    return LimitState(
        limit=int(bucket.capacity),
        remaining=max(0, math.floor(bucket.level)),
        reset_s=bucket.full_in_s(),
    )


def go_duration(seconds: float) -> str:
    """A duration as OpenAI's headers write it (Go's ``time.Duration``): ``"0s"``, ``"120ms"``,
    ``"1.5s"``, ``"6m0s"``, ``"1h2m3s"``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    ms = round(seconds * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s = f"{ms / 1000:.3f}".rstrip("0").rstrip(".")
    if h:
        return f"{h}h{m}m{s}s"
    if m:
        return f"{m}m{s}s"
    return f"{s}s"

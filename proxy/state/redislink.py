"""The link to Redis for shared state: bounded calls, and a breaker for when Redis is down.

Shared state must never hold up a request or a shutdown, so every Redis call is bounded by
``redis.timeout_ms``: the client has socket timeouts and no retries of its own (``connect``),
and ``RedisState`` puts an ``asyncio.timeout`` around each whole call. A call that fails, times
out or meets an open breaker raises ``Unavailable``: the caller goes on with its local view.
Two failures in a row open the ``Breaker``; while open, only a probe every ``PROBE_S`` reaches
Redis, and the first one that answers closes it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.maint_notifications import MaintNotificationsConfig

from proxy.errors import SharedUnavailable

# Defined with every other exception in ``proxy.errors``; the state modules know it by this name.
Unavailable = SharedUnavailable

PROBE_S = 1.0  # while the breaker is open: one PING this often
# What a Redis call may raise when Redis is slow, down or restarting; anything else is a bug.
REDIS_ERRORS = (RedisError, OSError, TimeoutError)


def connect(url: str, timeout_s: float) -> Redis:
    """A client for ``url`` whose calls fail within ``timeout_s`` instead of retrying."""
    # redis-py's defaults wait seconds (socket timeout 5 s, 10 retries with backoff): set
    # both timeouts and no retries, so a call fails within timeout_ms and the breaker decides.
    return Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        health_check_interval=0,
        decode_responses=True,
        # Off: "auto" costs a CLIENT command on every new connection (and fails on a
        # plain Redis): one more round trip inside the timeout after each reconnect.
        maint_notifications_config=MaintNotificationsConfig(enabled=False),
    )


@dataclass(slots=True)
class Breaker:
    """Closed: calls go to Redis. Open: they fail at once, except the probe, due every
    ``probe_s``. It opens on the ``threshold``-th failure in a row: the timeout also counts the
    time the event loop was busy elsewhere, and one such hiccup must not flip the instance to
    its local view (the caller confirms a first failure with another call at once)."""

    probe_s: float = PROBE_S
    threshold: int = 2
    closed: bool = True
    failures: int = 0
    next_probe: float = 0.0

    def allows(self, probe: bool, now: float) -> bool:
        return self.closed or (probe and now >= self.next_probe)

    def succeeded(self) -> None:
        self.failures = 0
        self.closed = True

    def failed(self, now: float) -> bool:
        """True when this failure opened it."""
        self.failures += 1
        self.next_probe = now + self.probe_s
        if self.closed and self.failures >= self.threshold:
            self.closed = False
            return True
        return False


async def wait_event(event: asyncio.Event, timeout_s: float) -> None:
    """Until ``event`` is set or ``timeout_s`` passes (no TimeoutError to confuse with a
    cancel); clears it."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout_s)
    finally:
        waiter.cancel()
    event.clear()

"""What the gateway uses of shared state (``SharedState``), and what it offers it (``LocalView``).

Two backends satisfy ``SharedState``: ``LocalState`` (nothing shared, the default) and
``RedisState`` (instances share replica states, load and rate limits). ``FleetView`` is the
fleet's ``LocalView``.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from proxy.config import RateLimitsConfig
from proxy.routing.ratelimit import RateLimiter
from proxy.state.codec import ReplicaRecord


class LocalView(Protocol):
    """The gateway's side of shared state: what this instance knows, and where news goes.

    ``apply`` and ``remote_load`` are called on the event loop from background tasks; they must
    not call ``SharedState.publish`` for what they apply (that would echo it back).
    """

    def records(self) -> list[ReplicaRecord]:
        """Every replica's current local state (for re-sync after Redis lost data)."""
        ...

    def in_flight(self) -> dict[str, int]:
        """url → requests this instance has in flight to it."""
        ...

    def apply(self, record: ReplicaRecord) -> bool:
        """A transition made by another instance, newer than anything applied before. False
        when this instance has no such replica (yet: a reload may add it; asked again later)."""
        ...

    def remote_load(self, in_flight: Mapping[str, int]) -> None:
        """url → the other live instances' in-flight sum; empty while Redis is unreachable."""
        ...

    def learn_placement(self, pool: str, url: str, hashes: Sequence[int]) -> None:
        """Another instance (or worker) sent a prompt with these prefix blocks to the replica
        at ``url`` of ``pool``: its ``cache_aware`` index learns them as if sent from here."""
        ...


class SharedState(Protocol):
    """What the gateway uses, whichever backend is configured."""

    instance: str

    @property
    def up(self) -> bool: ...

    async def start(self, view: LocalView) -> None: ...

    async def stop(self) -> None: ...

    def publish(self, record: ReplicaRecord) -> None:
        """A local transition: shared in the background; never waits, never raises."""
        ...

    def remote_in_flight(self, url: str) -> int:
        """The other instances' in-flight requests to ``url``, from the last background read."""
        ...

    def rate_limiter(self, limits: Callable[[], RateLimitsConfig]) -> RateLimiter: ...

    def share_response_home(self, response_id: str, url: str, ttl_s: float) -> None:
        """A stored response's replica, for the other instances: written in the background;
        never waits, never raises."""
        ...

    async def response_home(self, response_id: str) -> str | None:
        """The replica another instance learned for ``response_id``; None when none did, or
        shared state is down (one bounded call: only for an id this instance does not know)."""
        ...

    def share_placement(self, pool: str, url: str, hashes: Sequence[int]) -> None:
        """A ``cache_aware`` pick: the prompt's prefix blocks went to the replica at ``url``.
        Sent to the other instances (or workers) in the background; never waits, never
        raises; lost while shared state is down (a placement is a hint: a lost one costs cache
        hits, not correctness)."""
        ...


def new_instance_id() -> str:
    """Unique per process start: a restarted gateway never inherits its old keys."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"

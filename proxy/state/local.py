"""Shared state when there is nothing to share: one instance, its own view (no ``redis.url``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from proxy.config import RateLimitsConfig
from proxy.routing.ratelimit import LocalRateLimiter, RateLimiter
from proxy.state.codec import ReplicaRecord
from proxy.state.protocol import LocalView, new_instance_id


class LocalState:
    """The default: nothing is shared, nothing can be down."""

    def __init__(self, instance: str | None = None) -> None:
        self.instance = instance or new_instance_id()

    @property
    def up(self) -> bool:
        return True

    async def start(self, view: LocalView) -> None:
        return None

    async def stop(self) -> None:
        return None

    def publish(self, record: ReplicaRecord) -> None:
        return None

    def remote_in_flight(self, url: str) -> int:
        return 0

    def rate_limiter(self, limits: Callable[[], RateLimitsConfig]) -> RateLimiter:
        return LocalRateLimiter(limits)

    def share_response_home(self, response_id: str, url: str, ttl_s: float) -> None:
        return None

    async def response_home(self, response_id: str) -> str | None:
        return None

    def share_placement(self, pool: str, url: str, hashes: Sequence[int]) -> None:
        return None

"""The gateway's entry to shared state: pick the backend, and hook the fleet up to it.

Without ``redis.url`` every instance keeps its own view (``LocalState``); with it instances
share replica states, load and rate limits (``RedisState``, whose docstring says how). The
package's modules, one job each: ``protocol`` (what the gateway uses and offers), ``local``
and ``redis_state`` (the two backends), ``codec`` (records and load hashes), ``scripts`` (the
Lua), ``leases`` (shared rate limits), ``redislink`` (bounded calls, the breaker), ``view``
(the fleet's side, ``FleetView``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from proxy.config import RedisConfig
from proxy.state.local import LocalState
from proxy.state.protocol import SharedState
from proxy.state.redis_state import RedisState
from proxy.state.view import FleetView

if TYPE_CHECKING:
    from proxy.observe.metrics import Metrics

__all__ = ["FleetView", "shared_state_for"]


def shared_state_for(
    config: Callable[[], RedisConfig], metrics: Metrics | None = None
) -> SharedState:
    """``RedisState`` when ``redis.url`` is set (a restart key), else ``LocalState``."""
    url = config().url
    if url is None:
        return LocalState()
    return RedisState(url, config, metrics=metrics)

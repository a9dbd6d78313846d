"""Where each stored Responses-API response lives: its replica.

vLLM keeps a created response in the memory of the process that made it, so a request that
names it (``previous_response_id``, ``GET`` and ``cancel`` by id) can only be answered there;
anywhere else vLLM says 404 for an id it never saw, or worse, nothing tells the client that a
conversation lost its history. The relay learns each response's id from the answer that
creates it (``remember``) and the edge pins requests that name one (``home_of``).

Bounded (``max_entries``, oldest dropped first) and aged (``ttl_s`` from the last use): an id
the gateway no longer knows is answered 404 the way vLLM answers an unknown id. Instances that
share Redis share the map (``SharedState.share_response_home``): an id this instance does not
know is looked up there once (``lookup``), so a conversation may go on through any instance.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from proxy.state.protocol import SharedState

DEFAULT_MAX_ENTRIES: Final = 100_000
DEFAULT_TTL_S: Final = 24 * 3600.0


class ResponseHomes:
    """response id → the URL of the replica that holds it."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedState | None = None,
    ) -> None:
        self.shared = shared
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._homes: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def remember(self, response_id: str, url: str, *, share: bool = True) -> None:
        if share and self.shared is not None:
            self.shared.share_response_home(response_id, url, self.ttl_s)
        homes = self._homes
        homes[response_id] = (url, self.clock())
        homes.move_to_end(response_id)
        while len(homes) > self.max_entries:
            homes.popitem(last=False)

    def home_of(self, response_id: str) -> str | None:
        """The replica URL holding ``response_id``; None when unknown or aged out. A use
        keeps an entry alive (a conversation in progress is not aged out under it)."""
        entry = self._homes.get(response_id)
        if entry is None:
            return None
        url, at = entry
        now = self.clock()
        if now - at > self.ttl_s:
            del self._homes[response_id]
            return None
        self._homes[response_id] = (url, now)
        self._homes.move_to_end(response_id)
        return url

    async def lookup(self, response_id: str) -> str | None:
        """``home_of``, then, for an id this instance does not know, what another instance
        sharing Redis learned (kept here from then on)."""
        url = self.home_of(response_id)
        if url is None and self.shared is not None:
            url = await self.shared.response_home(response_id)
            if url is not None:
                self.remember(response_id, url, share=False)
        return url


__all__ = ["ResponseHomes"]

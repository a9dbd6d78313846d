"""Continuations re-prefilling at once: bounded for the gateway and per target replica.

A replica that dies holding many streams would otherwise send all of them to re-prefill on the
survivors at once (``continuation.max_in_flight``, ``continuation.max_in_flight_per_replica``).
A continuation holds its slot from its start to its first token (its prefill); after that it is
one more stream on its replica, bounded like any other by the replica's ``max_in_flight``.
"""

from __future__ import annotations

import asyncio


def has_room(total: int, on_target: int, max_total: int, max_per_replica: int) -> bool:
    """May one more continuation start re-prefilling on a replica holding ``on_target``?"""
    return total < max_total and on_target < max_per_replica


class Reprefills:
    """The continuations in their prefill, counted for the gateway and per replica name."""

    def __init__(self) -> None:
        self.total = 0
        self.by_replica: dict[str, int] = {}
        self.peak_by_replica: dict[str, int] = {}  # the most at once: what the bound held to
        self.full = 0  # takes refused for want of room (each then waits for a slot)
        self._freed = asyncio.Event()

    def try_take(self, replica: str, max_total: int, max_per_replica: int) -> Slot | None:
        if not has_room(self.total, self.by_replica.get(replica, 0), max_total, max_per_replica):
            self.full += 1
            return None
        self.total += 1
        held = self.by_replica[replica] = self.by_replica.get(replica, 0) + 1
        self.peak_by_replica[replica] = max(self.peak_by_replica.get(replica, 0), held)
        return Slot(self, replica)

    async def freed(self, timeout_s: float) -> None:
        """Until a slot is given back, or ``timeout_s``."""
        if timeout_s <= 0:
            return
        event = self._freed
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            pass

    def _give(self, replica: str) -> None:
        self.total -= 1
        left = self.by_replica[replica] - 1
        if left:
            self.by_replica[replica] = left
        else:
            del self.by_replica[replica]
        # Wake every waiter once, then arm a fresh event for the next wait.
        self._freed.set()
        self._freed = asyncio.Event()


class Slot:
    """One continuation's place; given back once, however many times ``release`` is called."""

    __slots__ = ("_owner", "_replica")

    def __init__(self, owner: Reprefills, replica: str) -> None:
        self._owner: Reprefills | None = owner
        self._replica = replica

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._give(self._replica)

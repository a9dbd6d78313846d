"""Continuations re-prefilling at once: bounded for the gateway and per target replica.

A replica that dies holding many streams would otherwise send all of them to re-prefill on the
survivors at once (``continuation.max_in_flight``, ``continuation.max_in_flight_per_replica``).
A continuation holds its slot from its start to its first token (its prefill); after that it is
one more stream on its replica, bounded like any other by the replica's ``max_in_flight``.

With workers the bounds hold for the whole serve: a ``Ledger`` (the workers' board) counts
every worker's slots, a slot is taken under its lock, and a worker waiting for a slot looks
again every ``POLL_S`` (a slot freed in another worker wakes nobody here).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

POLL_S = 0.05  # with workers: how often a waiting continuation looks for a slot freed elsewhere
TOTAL_ROW = "reprefill"  # the board's row of the serve's re-prefills; per replica + ":" + name


class Ledger(Protocol):
    """Counts shared with the serve's other workers (``proxy.workers.link.BoardLedger``)."""

    def claim(self, name: str, limit: int) -> bool: ...

    def hold(self, name: str, count: int) -> None: ...


def has_room(total: int, on_target: int, max_total: int, max_per_replica: int) -> bool:
    """May one more continuation start re-prefilling on a replica holding ``on_target``?"""
    return total < max_total and on_target < max_per_replica


class Reprefills:
    """The continuations in their prefill, counted for the gateway and per replica name."""

    def __init__(self, ledger: Ledger | None = None) -> None:
        self.ledger = ledger
        self.total = 0
        self.by_replica: dict[str, int] = {}
        self.peak_by_replica: dict[str, int] = {}  # the most at once: what the bound held to
        self.full = 0  # takes refused for want of room (each then waits for a slot)
        self._freed = asyncio.Event()

    def try_take(self, replica: str, max_total: int, max_per_replica: int) -> Slot | None:
        if not has_room(self.total, self.by_replica.get(replica, 0), max_total, max_per_replica):
            self.full += 1
            return None
        ledger = self.ledger
        if ledger is not None:  # the serve's other workers count too (each claim is atomic)
            if not ledger.claim(TOTAL_ROW, max_total):
                self.full += 1
                return None
            if not ledger.claim(f"{TOTAL_ROW}:{replica}", max_per_replica):
                ledger.hold(TOTAL_ROW, self.total)  # give the first claim back
                self.full += 1
                return None
        self.total += 1
        held = self.by_replica[replica] = self.by_replica.get(replica, 0) + 1
        self.peak_by_replica[replica] = max(self.peak_by_replica.get(replica, 0), held)
        return Slot(self, replica)

    async def freed(self, timeout_s: float) -> None:
        """Until a slot is given back (here; with workers, or ``POLL_S``), or ``timeout_s``."""
        if self.ledger is not None:
            timeout_s = min(timeout_s, POLL_S)
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
        if self.ledger is not None:
            self.ledger.hold(TOTAL_ROW, self.total)
            self.ledger.hold(f"{TOTAL_ROW}:{replica}", left)
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
